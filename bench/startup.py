"""Benchmark: the cycle collections that loading the CLI sets off, with the console script's entry
(collector off while loading, then what was made frozen) against a plain import with it on.

    .venv/bin/python bench/startup.py

Counts, not times (a test checks the order of events: tests/test_cli.py); with the entry the young
generation runs a handful of times and the older ones never, a plain import ran them about 50 times.
Nothing here asserts: the figures are for reading.
"""

from __future__ import annotations

import subprocess
import sys

_PROBE = """
import gc, sys
sys.argv = ["safeinstall", "--version"]
before = [s["collections"] for s in gc.get_stats()]
if {entry!r}:
    from safeinstall.__main__ import main
else:
    from safeinstall.cli.app import main
try:
    main()
except SystemExit:
    pass
after = [s["collections"] for s in gc.get_stats()]
print(" ".join(str(a - b) for a, b in zip(after, before)))
"""


def collections(entry: bool) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE.format(entry=entry)], capture_output=True, text=True, check=True
    )
    return proc.stdout.strip().splitlines()[-1]


def main() -> int:
    print("collections per generation (young, middle, old) while loading and running --version:")
    print(f"  console script entry (collector off, then frozen): {collections(True)}")
    print(f"  plain import of safeinstall.cli.app (collector on):    {collections(False)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
