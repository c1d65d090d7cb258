"""The console script's entry (and ``python -m safeinstall``): the CLI is loaded with Python's cycle
collector off, and what loading it made is frozen (never walked by a collection again)."""

import gc
import sys

from safeinstall.system.signals import InterruptedEarly, install_early_handlers


def main() -> None:
    # Everything in the try: a signal's handler runs at whichever instruction comes next, so the one
    # that lands just after a handler is installed, or just after the CLI loaded, is an error line too.
    try:
        # First: a signal from now on is an error line and exit 2 (nothing was changed), also while
        # the CLI loads; signals.py imports nothing slow.
        install_early_handlers()
        # Loading typer, rich and safeinstall's modules makes about 100k objects and no garbage; the
        # collections they set off walked all of them again and again (0.02 s of every command's start).
        gc.disable()
        try:
            from safeinstall.cli.app import main as run_command
        finally:
            gc.enable()
        gc.freeze()
        run_command()
    except InterruptedEarly as interrupted:  # rich may not be loaded (yet): plain lines
        sys.stderr.write(f"error: {interrupted.message}\nhint: {interrupted.advice}\n")
        if "--json" in sys.argv[1:]:  # --json: one document on stdout, whatever happens
            _early_envelope(interrupted)
        sys.exit(int(interrupted.exit_code))


def _early_envelope(interrupted: InterruptedEarly) -> None:
    """The ``--json`` document of a command interrupted while the CLI loaded (the envelope's module is
    small; the CLI's parsing is not loaded)."""
    import json

    from safeinstall.run.parts.output import command_for, envelope

    command = command_for({arg.split("=", 1)[0] for arg in sys.argv[1:]})
    document = envelope(command, "error", int(interrupted.exit_code), None, [interrupted])
    try:
        sys.stdout.write(json.dumps(document, indent=2) + "\n")
        sys.stdout.flush()
    except OSError:
        pass


if __name__ == "__main__":
    main()
