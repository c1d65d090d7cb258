"""Benchmark: safeinstall's /proc scan against ``needrestart -b`` and ``lsof -n`` on the same processes.

Starts N processes (most a plain ``sleep``, some a python of a uv-made venv that imported the fixture
C extension ``sicext``), then times each tool several times, interleaved, and prints the medians'
ratios. Everything it started is killed by PID at the end.

    .venv/bin/python bench/scan.py                # N=1000
    .venv/bin/python bench/scan.py -n 300 --repeat 7

needrestart and lsof come from Debian (``apt-get install -y needrestart lsof``); a missing one is
skipped. Nothing here asserts a time: the ratios are for reading.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from safeinstall.env.distributions import find_distribution, find_distributions  # noqa: E402
from safeinstall.env.environment import inspect_environment  # noqa: E402
from safeinstall.scan.evidence import TargetIndex  # noqa: E402
from safeinstall.scan.processes import default_workers, scan_processes  # noqa: E402
from safeinstall.scan.targets import environment_scope, load_targets  # noqa: E402
from tests import wheelhouse  # noqa: E402

_IMPORTER = "import sicext, time; time.sleep(3600)"


def _start(argv: list[str]) -> subprocess.Popen[bytes]:
    return subprocess.Popen(
        argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )


def _wait_mapped(pids: list[int], needle: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    pending = set(pids)
    while pending and time.monotonic() < deadline:
        for pid in list(pending):
            try:
                if needle in Path(f"/proc/{pid}/maps").read_text():
                    pending.discard(pid)
            except OSError:
                pending.discard(pid)
        time.sleep(0.05)
    if pending:
        raise SystemExit(f"{len(pending)} python processes never mapped {needle}")


def _time(action: Callable[[], object]) -> float:
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _run_quietly(argv: list[str]) -> Callable[[], object]:
    def run() -> object:
        return subprocess.run(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=False
        )

    return run


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("-n", "--processes", type=int, default=1000, help="processes to start (1000)")
    parser.add_argument(
        "--importers", type=int, default=20, help="how many of them are pythons that import sicext (20)"
    )
    parser.add_argument(
        "--other-pythons",
        type=int,
        default=0,
        help="how many of them are pythons of another environment: the environment check reads their "
        "exe link and environ (0)",
    )
    parser.add_argument("--repeat", type=int, default=5, help="timed runs per tool; median kept (5)")
    args = parser.parse_args()

    started: list[subprocess.Popen[bytes]] = []
    with tempfile.TemporaryDirectory(prefix="safeinstall-bench-") as tmp:
        work = Path(tmp)
        wheel = wheelhouse.build_wheel(wheelhouse.PACKAGES / "sicext-1", work / "wheels")
        python = wheelhouse.make_venv(work / "venv")
        wheelhouse.uv_install(python, wheel)
        env = inspect_environment(python)
        dist = find_distribution(env, "sicext", find_distributions(env))
        try:
            importers = min(args.importers, args.processes)
            for _ in range(importers):
                started.append(_start([str(python), "-c", _IMPORTER]))
            others = min(args.other_pythons, args.processes - importers)
            for _ in range(others):
                started.append(
                    _start([os.path.realpath(sys.executable), "-S", "-c", "import time; time.sleep(3600)"])
                )
            for _ in range(args.processes - importers - others):
                started.append(_start(["sleep", "3600"]))
            _wait_mapped([p.pid for p in started[:importers]], "_native.")

            index = TargetIndex.of(load_targets([dist], env, find_distributions(env)))
            scope = environment_scope(env)
            mine = {p.pid for p in started}
            result = scan_processes(index)
            found = {p.pid for p in result.affected} & mine
            print(
                f"processes on the host: {len(result.processes)} seen ({result.scanned_count} /proc "
                f"entries), {len(mine)} started by the bench, {importers} importing sicext"
            )
            print(
                f"safeinstall found {len(found)}/{importers} importers; "
                f"{len(result.problems)} problems (e.g. {result.problems[:2]})"
            )

            workers = default_workers(result.scanned_count)
            tools: dict[str, Callable[[], object]] = {
                "safeinstall": lambda: scan_processes(index),
                "safeinstall, 1 worker": lambda: scan_processes(index, workers=1),
                # what a run scans: environment evidence too (exe and environ of python processes)
                "safeinstall + environment": lambda: scan_processes(index, scope=scope),
            }
            for name, argv in (("needrestart -b", ["needrestart", "-b"]), ("lsof -n", ["lsof", "-n"])):
                if shutil.which(argv[0]):
                    tools[name] = _run_quietly(argv)
                else:
                    print(f"{argv[0]} not installed: skipped (apt-get install -y needrestart lsof)")
            times: dict[str, list[float]] = {name: [] for name in tools}
            for _ in range(args.repeat):  # interleaved, so drift in the host hits every tool alike
                for name, action in tools.items():
                    times[name].append(_time(action))
            medians = {name: statistics.median(values) for name, values in times.items()}
            print(
                f"median of {args.repeat} runs (machine-dependent): "
                + ", ".join(f"{name} {value * 1000:.0f} ms" for name, value in medians.items())
            )
            print(f"safeinstall scans with {workers} worker(s) here (default_workers)")
            for ours in ("safeinstall", "safeinstall, 1 worker"):
                for name, value in medians.items():
                    if not name.startswith("safeinstall"):
                        print(f"ratio {name} / {ours}: {value / medians[ours]:.1f}x")
        finally:
            for proc in started:
                if proc.poll() is None:
                    os.kill(proc.pid, signal.SIGKILL)
            for proc in started:
                proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
