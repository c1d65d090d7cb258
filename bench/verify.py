"""Benchmark ``safeinstall PKG --verify-only`` against parallel sha256sum and distlib, side by side.

Usage: python bench/verify.py [--package torch] [--python VENV_PYTHON | --installer uv|pip] [--rounds 5]
                              [--sha256sum] [--workers 1,2,4]
       python bench/verify.py --second-run --python VENV [--package vllm] [--rounds 3]
       python bench/verify.py --second-run --python VENV --baseline-safeinstall OLD/.venv/bin/safeinstall

Without --python it makes a torch venv: ``--installer uv`` (the default) installs the torch 2.13.0 CPU
wheel kept in ``.bench/`` (see bench/downtime.py) into ``.bench/torch-uv`` with ``uv pip install
--link-mode copy`` and a cache deleted afterwards (the files then share inodes with nothing, as after
a safeinstall run); ``--installer pip`` runs ``pip install torch==2.13.0`` into ``.bench/torch-venv``.
Each round runs safeinstall and distlib as a pair, the order flipping every round, on a warm page
cache; the per-pair ratios and the medians are printed, with each command's CPU time (user and
system, its children included: what a busier machine would make it wait for). Absolute times mean
little on these machines: read the ratios. ``--sha256sum`` adds ``xargs -0 -P<cores> sha256sum``
over the same files.

Then the same pair inside one process (no interpreter start, no argument parsing, no imports):
``verify_environment`` against distlib's ``check_installed_files()``, alternating, which shows what
the command line's fixed costs take from the ratio; ``--workers 1,2,4`` repeats it for each number of
threads (a scaling curve; the CPU time printed is all threads'). ``taskset -c 0 python bench/verify.py``
measures one CPU. ``--copy`` times reading the package's largest file from the page cache into a
``bytearray`` against into :func:`safeinstall.env.hashing.read_buffer` (page-aligned), alternating.

What the ratio against distlib depends on (printed with the result):

* the installer: pip compiles bytecode and lists every ``.pyc`` in RECORD (12k more lines for torch,
  which distlib checks one by one), uv does neither;
* hardlinks into uv's cache (uv's default link mode) add one ``hardlinked`` warning per file;
* safeinstall's own bytecode: ``PYTHONDONTWRITEBYTECODE=1`` (set on these machines) keeps an editable
  checkout from caching it, so every run compiles safeinstall again (~0.2 s); the bench compiles it
  first, as an installed tool is;
* typer 0.29 builds a pydantic adapter per option at every start (~0.2 s): pyproject keeps it below.

safeinstall runs here with ``--full`` and a state directory of the bench's own: every file is read, as
distlib reads them. ``--second-run`` measures the verified-inode store and the clean distributions'
store instead (docs/verify.md): each round ``--verify-only --all`` with both empty (the first run:
everything read and kept) then again with nothing changed (the second run: the clean distributions
proven unchanged by ``lstat``, the others' files by the kept hashes), side by side, and the ratio
(goal <= 0.1x), of the wall times and of the CPU times (which other jobs on a shared machine move less).
Then, on an overlay of the environment (the environment itself is not changed), the owner's edit that
keeps the size and sets the mtime back (``touch -d``): the second run must still say ``modified``.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
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


def ensure_torch_uv_venv() -> Path:
    venv = ROOT / ".bench" / "torch-uv"
    python = venv / "bin" / "python"
    probe = (
        subprocess.run([str(python), "-c", "import torch"], capture_output=True) if python.exists() else None
    )
    if probe is None or probe.returncode != 0:
        sys.path.insert(0, str(ROOT))
        from bench.downtime import torch_wheel
        from tests import wheelhouse

        wheelhouse.make_venv(venv)
        with tempfile.TemporaryDirectory(dir=ROOT / ".bench") as cache:
            command = [wheelhouse.UV, "pip", "install", "--quiet", "--python", str(python)]
            subprocess.run(
                [*command, "--link-mode", "copy", str(torch_wheel())],
                check=True,
                env={**wheelhouse.uv_env(), "UV_CACHE_DIR": cache},
            )
    return python


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


def timed(cmd: list[str], **kwargs: object) -> tuple[float, float]:
    """Wall-clock seconds and CPU seconds (user + system, the command and its children) of one run."""
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    subprocess.run(cmd, check=False, stdout=subprocess.DEVNULL, **kwargs)  # type: ignore[call-overload]
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime


IN_PROCESS = """
import statistics, sys, time
from pathlib import Path
from distlib.database import DistributionPath
from safeinstall.env.environment import inspect_environment
from safeinstall.env.hashing import default_workers
from safeinstall.env.verify import verify_environment
python, site, package, rounds = Path(sys.argv[1]), sys.argv[2], sys.argv[3], int(sys.argv[4])
env = inspect_environment(python)
def theirs():
    DistributionPath([site]).get_distribution(package).check_installed_files()
for workers in [int(w) or default_workers() for w in sys.argv[5].split(",")]:
    def ours():
        verify_environment(env, [package], workers=workers)
    times = {ours: [], theirs: []}
    cpu = []
    for round_ in range(rounds):
        for contender in (ours, theirs) if round_ % 2 == 0 else (theirs, ours):
            start, start_cpu = time.perf_counter(), time.process_time()
            contender()
            times[contender].append(time.perf_counter() - start)
            if contender is ours:
                cpu.append(time.process_time() - start_cpu)
    a, b, c = statistics.median(times[ours]), statistics.median(times[theirs]), statistics.median(cpu)
    pairs = [round(t / o, 2) for o, t in zip(times[ours], times[theirs])]
    print(
        f"  in one process, {workers} worker(s): verify_environment {a:.3f} s (cpu {c:.3f} s),"
        f" distlib {b:.3f} s: {b / a:.2f}x (pairs {pairs})"
    )
"""


COPY = """
import os, statistics, sys, time
from safeinstall.env.hashing import STREAM_CHUNK, read_buffer
path, rounds = sys.argv[1], int(sys.argv[2])
def read_into(buffer):
    fd = os.open(path, os.O_RDONLY)
    start = time.perf_counter()
    while os.readv(fd, [buffer]):
        pass
    os.close(fd)
    return time.perf_counter() - start
heap, aligned = memoryview(bytearray(STREAM_CHUNK)), read_buffer()
times = {"bytearray": [], "read_buffer": []}
for round_ in range(rounds):
    for name, buffer in (("bytearray", heap), ("read_buffer", aligned))[:: 1 if round_ % 2 == 0 else -1]:
        times[name].append(read_into(buffer))
a, b = statistics.median(times["bytearray"]), statistics.median(times["read_buffer"])
size, chunk = os.path.getsize(path), STREAM_CHUNK >> 20
print(f"  reading {os.path.basename(path)} ({size / 1e6:.0f} MB, page cache) in {chunk} MiB reads:")
print(f"    into a bytearray {a:.3f} s, into read_buffer() {b:.3f} s: {a / b:.2f}x")
"""


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--package", default="torch")
    parser.add_argument("--python", default=None)
    parser.add_argument("--installer", choices=("uv", "pip"), default="uv")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--sha256sum", action="store_true")
    parser.add_argument(
        "--copy",
        action="store_true",
        help="also: the package's largest file read into a bytearray against hashing.read_buffer()",
    )
    parser.add_argument(
        "--workers",
        default="0",
        help="in-process only: comma-separated thread counts to measure one after the other "
        "(0: the default, one per CPU this process may use), e.g. 1,2,4,8 for a scaling curve",
    )
    parser.add_argument(
        "--second-run",
        action="store_true",
        help="only: --verify-only --all, first run against second run with nothing changed (the "
        "verified-inode store), then a same-size edit with the mtime set back on an overlay",
    )
    parser.add_argument(
        "--baseline-safeinstall",
        default=None,
        metavar="PATH",
        help="with --second-run: another build's safeinstall as a second contender, side by side (each "
        "round both, the order flipping; each its own state directory, emptied): the first runs' and "
        "the second runs' CPU time, new / old",
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-verify-state-") as state:
        os.environ["SAFEINSTALL_STATE_DIR"] = state  # the bench's own: its store, never /var/lib's
        if args.second_run and args.baseline_safeinstall:
            python = Path(args.python or ensure_torch_uv_venv())
            return side_by_side(python, args.rounds, Path(args.baseline_safeinstall))
        if args.second_run:
            return second_run(Path(args.python or ensure_torch_uv_venv()), args.package, args.rounds, state)
        return compare(args)


def compare(args: argparse.Namespace) -> int:
    if args.python:
        python = Path(args.python)
    else:
        python = ensure_torch_uv_venv() if args.installer == "uv" else ensure_torch_venv()
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
    cores = str(len(os.sched_getaffinity(0)))
    contenders = {
        "safeinstall": [str(SAFEINSTALL), args.package, "--verify-only", "--full", "--python", str(python)],
        "distlib": [sys.executable, "-c", DISTLIB, site, args.package],
    }
    if args.sha256sum:
        contenders["sha256sum -P"] = ["sh", "-c", f"xargs -0 -P {cores} -n 64 sha256sum < {file_list}"]
    print(f"{args.package}: {count} hashed files, {size / 1e9:.2f} GB, {cores} cores, {args.rounds} rounds")
    print(f"  {describe(python, args.package)}; load {os.getloadavg()[0]:.1f}")
    for cmd in contenders.values():  # warm the page cache
        timed(cmd)
    times: dict[str, list[float]] = {name: [] for name in contenders}
    cpu: dict[str, list[float]] = {name: [] for name in contenders}
    names = list(contenders)
    for round_ in range(args.rounds):
        for name in names if round_ % 2 == 0 else reversed(names):
            wall, used = timed(contenders[name])
            times[name].append(wall)
            cpu[name].append(used)
    medians = {name: statistics.median(values) for name, values in times.items()}
    for name, value in medians.items():
        spent = statistics.median(cpu[name])
        print(f"  {name:<14} median {value:7.3f} s (cpu {spent:.3f} s)  {[round(t, 2) for t in times[name]]}")
    ours = medians["safeinstall"]
    pairs = [round(d / o, 2) for o, d in zip(times["safeinstall"], times["distlib"], strict=True)]
    if args.sha256sum:
        print(f"safeinstall / parallel sha256sum = {ours / medians['sha256sum -P']:.2f}x  (goal <= 1.2x)")
    middle = statistics.median(pairs)
    print(
        f"distlib / safeinstall            = {medians['distlib'] / ours:.2f}x  "
        f"(pairs {pairs}, median pair {middle:.2f}x; goal >= 2x)"
    )
    os.unlink(file_list)
    if args.copy:
        largest = max((p for p in listing.stdout.decode().split("\0") if p), key=os.path.getsize)
        subprocess.run([sys.executable, "-c", COPY, largest, str(args.rounds)], check=True)
    subprocess.run(
        [sys.executable, "-c", IN_PROCESS, str(python), site, args.package, str(args.rounds), args.workers],
        check=True,
    )
    print(f"  load {os.getloadavg()[0]:.1f}")
    return 0


#: What a check keeps (each emptied before a first run): hashes by identity, the clean distributions,
#: bytecode judged by identity, the RECORDs found clean (the bench's own state directory, never root's).
KEPT = ("inodes.bin", "unchanged.json", "bytecode.json", "records.json", "parses.json")


def second_run(python: Path, package: str, rounds: int, state: str) -> int:
    """``--verify-only --all``: the first run (empty store) against the second (nothing changed)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "safeinstall")], check=True)
    command = [str(SAFEINSTALL), "--verify-only", "--all", "--python", str(python)]
    stores = Path(state)
    timed([*command, "--full"])  # warm the page cache (as far as it holds the environment)
    first: list[tuple[float, float]] = []
    second: list[tuple[float, float]] = []
    for _ in range(rounds):
        for kept in [stores.glob(f"*/{name}") for name in KEPT]:
            for path in kept:
                path.unlink()  # every store empty: the first run reads and judges every file
        first.append(timed(command))
        second.append(timed(command))
    pairs = [round(b[0] / a[0], 3) for a, b in zip(first, second, strict=True)]
    cpu_pairs = [round(b[1] / a[1], 3) for a, b in zip(first, second, strict=True)]
    print(f"--verify-only --all --python {python}: {rounds} rounds, load {os.getloadavg()[0]:.1f}")
    for name, runs in (("first run (empty store)", first), ("second run (nothing new)", second)):
        walls, cpus = [wall for wall, _ in runs], [cpu for _, cpu in runs]
        print(
            f"  {name:<26} median {statistics.median(walls):7.3f} s  {[round(t, 2) for t in walls]}"
            f"  (cpu {statistics.median(cpus):.3f} s)"
        )
    print(f"  second / first = {statistics.median(pairs):.3f}x  (pairs {pairs}; goal <= 0.1x)")
    print(
        f"  the same in CPU time (user + system) = {statistics.median(cpu_pairs):.3f}x  (pairs {cpu_pairs})"
    )
    edited = same_size_edit(python, package, command)
    print(f"  same-size edit, mtime set back: second run reports it modified: {edited}")
    return 0 if edited != "no" else 1


def side_by_side(python: Path, rounds: int, old: Path) -> int:
    """``--verify-only --all``, this build against ``old``: each round each contender's first run (its
    own state directory, emptied) then its second, the order flipping every round; the medians, and new
    / old of the first runs' and of the second runs' CPU times (what a busy machine moves least)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ROOT / "safeinstall")], check=True)
    contenders = {"new": SAFEINSTALL, "old": old}
    runs: dict[str, dict[str, list[tuple[float, float]]]] = {
        n: {"first": [], "second": []} for n in contenders
    }
    for turn in range(rounds):
        for name in sorted(contenders, reverse=turn % 2 == 1):
            with tempfile.TemporaryDirectory(prefix=f"bench-verify-{name}-") as state:
                command = [str(contenders[name]), "--verify-only", "--all", "--python", str(python)]
                environ = {**os.environ, "SAFEINSTALL_STATE_DIR": state}
                runs[name]["first"].append(timed(command, env=environ))
                time.sleep(2.5)  # a judgement is kept once its file's ctime is older than 2 s
                runs[name]["second"].append(timed(command, env=environ))
    print(f"--verify-only --all --python {python}: {rounds} rounds, load {os.getloadavg()[0]:.1f}")
    medians: dict[tuple[str, str], float] = {}
    for name, which in runs.items():
        for run, times in which.items():
            medians[(name, run)] = statistics.median(cpu for _, cpu in times)
            walls = [round(wall, 2) for wall, _ in times]
            cpus = [round(cpu, 2) for _, cpu in times]
            print(f"  {name} {run:<6} cpu median {medians[(name, run)]:.3f} s {cpus}  wall {walls}")
    for run in ("first", "second"):
        print(f"  {run} run, new / old CPU time: {medians[('new', run)] / medians[('old', run)]:.2f}x")
    print(f"  new second / first CPU time: {medians[('new', 'second')] / medians[('new', 'first')]:.3f}x")
    return 0


def same_size_edit(python: Path, package: str, command: list[str]) -> str:
    """On an overlay of the environment (root only): one file of ``package`` copied up (so that the
    edit keeps its inode), hashed by a first run once its ctime is older than the store's granularity,
    then one byte changed in place by its owner and its mtime set back to the nanosecond with ``touch
    -d``; "yes" when the second run reports it ``modified``, "no" when not, else why it was not tried."""
    venv = python.parent.parent if python.name.startswith("python") else python
    top = Path(tempfile.mkdtemp(prefix="bench-verify-overlay-"))
    merged, upper, work = top / "merged", top / "upper", top / "work"
    for made in (merged, upper, work):
        made.mkdir()
    options = f"lowerdir={venv},upperdir={upper},workdir={work}"
    mounting = subprocess.run(["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], check=False)
    if mounting.returncode != 0:
        return "not tried (no overlay mount: run as root)"
    try:
        listed = subprocess.run(
            [str(merged / "bin" / "python"), "-I", "-c", FILES, package], check=True, capture_output=True
        ).stdout.decode()
        target = next(Path(p) for p in listed.split("\0") if p.endswith(".py") and os.path.getsize(p) > 0)
        os.chmod(target, os.lstat(target).st_mode)  # copied up: the edit below keeps this inode
        settled = os.lstat(target).st_ctime_ns + 2_000_000_000  # safeinstall.env.inodetrust.GRANULARITY_NS
        while time.time_ns() <= settled:
            time.sleep(0.1)
        on_overlay = [*command[:-1], str(merged)]
        subprocess.run(on_overlay, check=False, stdout=subprocess.DEVNULL)
        info = os.lstat(target)
        with open(target, "r+b") as handle:
            first = handle.read(1)
            handle.seek(0)
            handle.write(bytes([first[0] ^ 1]))
        stamp = f"@{info.st_mtime_ns // 10**9}.{info.st_mtime_ns % 10**9:09d}"
        subprocess.run(["touch", "-d", stamp, str(target)], check=True)
        after = os.lstat(target)
        assert (after.st_ino, after.st_size, after.st_mtime_ns) == (
            info.st_ino,
            info.st_size,
            info.st_mtime_ns,
        )
        report = subprocess.run([*on_overlay, "--json"], check=False, capture_output=True, text=True)
        findings = json.loads(report.stdout)["data"]["findings"]
        hit = any(f["kind"] == "modified" and f["path"] == str(target) for f in findings)
        print(f"  edited {target.relative_to(merged)} ({info.st_size} bytes)")
        return "yes" if hit else "no"
    finally:
        subprocess.run(["umount", str(merged)], check=False)
        shutil.rmtree(top, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
