"""Benchmark ``safeinstall PKG --verify-only`` against parallel sha256sum and distlib, side by side.

Usage: python bench/verify.py [--package torch] [--python VENV_PYTHON] [--rounds 5]

Without --python it makes ``.bench/torch-venv`` and runs ``pip install torch==2.13.0`` there (a CPU
build this machine keeps on disk). Each round runs the three contenders one after another on a warm
page cache; the medians are compared. Absolute times mean little on these machines: read the ratios.

What the ratio against distlib depends on (printed with the result):

* the installer: pip compiles bytecode and lists every ``.pyc`` in RECORD (12k more lines for torch,
  which distlib checks one by one), uv does neither;
* hardlinks into uv's cache (uv's default link mode) add one ``hardlinked`` warning per file;
* safeinstall's own bytecode: ``PYTHONDONTWRITEBYTECODE=1`` (set on these machines) keeps an editable
  checkout from caching it, so every run compiles safeinstall again (~0.2 s); the bench compiles it
  first, as an installed tool is;
* typer >= 0.2x builds a pydantic adapter per option at every start (~0.2 s).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SAFEINSTALL = Path(sys.executable).parent / "safeinstall"

DISTLIB = """
import sys
from distlib.database import DistributionPath
dist = DistributionPath([sys.argv[1]]).get_distribution(sys.argv[2])
print(len(dist.check_installed_files()))
"""

FILES = """
import csv, os, sys, sysconfig
from importlib.metadata import distribution
dist = distribution(sys.argv[1])
base = dist.locate_file("")
for row in csv.reader(dist.read_text("RECORD").splitlines()):
    if len(row) == 3 and row[1]:
        sys.stdout.write(os.path.normpath(os.path.join(base, row[0])) + "\\0")
"""


def ensure_torch_venv() -> Path:
    venv = ROOT / ".bench" / "torch-venv"
    python = venv / "bin" / "python"
    if not python.exists():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    probe = subprocess.run([str(python), "-c", "import torch"], capture_output=True)
    if probe.returncode != 0:
        subprocess.run([str(python), "-m", "pip", "install", "-q", "torch==2.13.0", "distlib"], check=True)
    return python


def describe(python: Path, package: str) -> str:
    """Which installer, whether RECORD lists bytecode, whether the files are hardlinked (a sample)."""
    probe = (
        "import os, sys; from importlib.metadata import distribution; d = distribution(sys.argv[1]); "
        "files = [f for f in d.files or () if f.hash]; rec = d.read_text('RECORD') or ''; "
        "links = sum(os.stat(d.locate_file(f)).st_nlink > 1 for f in files[:200]); "
        "print((d.read_text('INSTALLER') or '?').strip(), rec.count('.pyc,'), links)"
    )
    out = subprocess.run(
        [str(python), "-I", "-c", probe, package], check=True, capture_output=True, text=True
    ).stdout.split()
    return f"installed by {out[0]}, {out[1]} .pyc lines in RECORD, {out[2]}/200 sampled files hardlinked"


def timed(cmd: list[str], **kwargs: object) -> float:
    start = time.perf_counter()
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload]
    return time.perf_counter() - start


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--package", default="torch")
    parser.add_argument("--python", default=None)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    python = Path(args.python) if args.python else ensure_torch_venv()
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "safeinstall")], check=True)
    site = subprocess.run(
        [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    listing = subprocess.run([str(python), "-I", "-c", FILES, args.package], check=True, capture_output=True)
    with tempfile.NamedTemporaryFile(delete=False) as handle:
        handle.write(listing.stdout)
        file_list = handle.name
    count = listing.stdout.count(b"\0")
    size = sum(os.path.getsize(p) for p in listing.stdout.decode().split("\0") if p and os.path.exists(p))
    cores = str(os.cpu_count() or 1)
    contenders = {
        "safeinstall": [str(SAFEINSTALL), args.package, "--verify-only", "--python", str(python)],
        "sha256sum -P": ["sh", "-c", f"xargs -0 -P {cores} -n 64 sha256sum < {file_list}"],
        "distlib": [sys.executable, "-c", DISTLIB, site, args.package],
    }
    print(f"{args.package}: {count} hashed files, {size / 1e9:.2f} GB, {cores} cores, {args.rounds} rounds")
    print(f"  {describe(python, args.package)}; load {os.getloadavg()[0]:.1f}")
    for cmd in contenders.values():  # warm the page cache
        timed(cmd)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(args.rounds):
        for name, cmd in contenders.items():
            times[name].append(timed(cmd))
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        print(f"  {name:<14} median {value:7.3f} s")
    ours = medians["safeinstall"]
    print(f"safeinstall / parallel sha256sum = {ours / medians['sha256sum -P']:.2f}x  (goal <= 1.2x)")
    print(f"distlib / safeinstall            = {medians['distlib'] / ours:.2f}x  (goal >= 3x)")
    os.unlink(file_list)
    return 0


if __name__ == "__main__":
    sys.exit(main())
