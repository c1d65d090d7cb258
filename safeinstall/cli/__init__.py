"""The command line: parses, validates, calls one run, renders its result and exits in one place."""
