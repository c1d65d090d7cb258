"""The session's end check: no mount and no process of the suite outlives it.

Every process the suite starts carries ``SAFEINSTALL_TEST_SESSION`` (set at the session's start, a value
of this session's alone, so that two suites at once on one machine never see each other's), and every
mount a test makes lies under pytest's base temporary directory. Once every fixture has been torn down,
a process still carrying the value or a mount still under that directory fails the session (exit 1),
named; it is then ended (by PID, ours) or lazily unmounted, so that the machine is left clean.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

VARIABLE = "SAFEINSTALL_TEST_SESSION"
#: what a unit of the stopped manager, or a killed child, may take to go (tests/test_leaks.py: less)
_GRACE_S = float(os.environ.get("SAFEINSTALL_TEST_LEAK_GRACE_S", "15"))


def session_processes(value: str) -> dict[int, str]:
    """The live processes (not zombies) whose environment carries ``VARIABLE=value``: PID -> command."""
    marker = f"{VARIABLE}={value}".encode()
    found: dict[int, str] = {}
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry.name}/environ", "rb") as environ:
                if marker not in environ.read().split(b"\0"):
                    continue
            with open(f"/proc/{entry.name}/stat", "rb") as stat:
                if stat.read().rpartition(b")")[2].split()[0] == b"Z":
                    continue
            with open(f"/proc/{entry.name}/cmdline", "rb") as cmdline:
                found[int(entry.name)] = cmdline.read().replace(b"\0", b" ").decode(errors="replace")[:200]
        except OSError:  # gone meanwhile, or not ours to read
            continue
    return found


def mounts_under(base: Path) -> list[Path]:
    """The mount points of this mount namespace at or below ``base``, deepest first."""
    points: list[Path] = []
    with open("/proc/self/mountinfo", encoding="utf-8", errors="replace") as mountinfo:
        for line in mountinfo:
            point = Path(line.split()[4].encode().decode("unicode_escape"))
            if point == base or base in point.parents:
                points.append(point)
    return sorted(points, key=lambda p: len(p.parts), reverse=True)


def pytest_sessionstart(session: pytest.Session) -> None:
    os.environ[VARIABLE] = f"{os.getpid()}-{uuid.uuid4().hex}"


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """Fails the session on a process or a mount that outlived every fixture, then clears it away."""
    value = os.environ.get(VARIABLE)
    if value is None:
        return
    problems: list[str] = []
    deadline = time.monotonic() + _GRACE_S
    left = session_processes(value)
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = session_processes(value)
    for pid, command in sorted(left.items()):
        problems.append(f"process {pid} outlived the suite: {command}")
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
    factory = getattr(session.config, "_tmp_path_factory", None)  # pytest's tmp_path_factory
    for point in mounts_under(factory.getbasetemp()) if factory is not None else []:
        problems.append(f"mount {point} outlived the suite")
        subprocess.run(["umount", "--lazy", str(point)], check=False, capture_output=True)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if problems and reporter is not None:
        reporter.write("\n")
        for problem in problems:
            reporter.write_line(f"leak: {problem}", red=True)
    if problems:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
