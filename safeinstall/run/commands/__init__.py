"""The commands the CLI calls: one function per mode, and what they return to it."""
