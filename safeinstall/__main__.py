"""The console script's entry (and ``python -m safeinstall``): the CLI is loaded with Python's cycle
collector off, and what loading it made is frozen (never walked by a collection again)."""

import gc


def main() -> None:
    # Loading typer, rich and safeinstall's modules makes about 100k objects and no garbage; the
    # collections they set off walked all of them again and again (0.02 s of every command's start).
    gc.disable()
    try:
        from safeinstall.cli import main as run_command
    finally:
        gc.enable()
    gc.freeze()
    run_command()


if __name__ == "__main__":
    main()
