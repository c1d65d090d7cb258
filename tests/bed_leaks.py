"""The session's end check: no mount and no process of the suite outlives it.

Every process the suite starts carries ``SAFEINSTALL_TEST_SESSION`` (set at the session's start, a value
of this session's alone, so that two suites at once on one machine never see each other's), and every
mount a test makes lies under pytest's base temporary directory. Once every fixture has been torn down,
a process still carrying the value or a mount still under that directory fails the session (exit 1),
named; it is then ended (by PID, ours) or lazily unmounted, so that the machine is left clean. Runs
that name no state directory get the session's own, and an entry new in the machine's
``/var/lib/safeinstall`` fails the session too.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
import time
import uuid
from pathlib import Path

import pytest

VARIABLE = "SAFEINSTALL_TEST_SESSION"
#: what a unit of the stopped manager, or a killed child, may take to go (tests/test_leaks.py: less)
_MACHINE_STATE_BEFORE = pytest.StashKey[set[str]]()
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


#: where safeinstall keeps its state as root when told nothing (store/state.py's SYSTEM_STATE_ROOT)
MACHINE_STATE = Path("/var/lib/safeinstall")


def _entries(directory: Path) -> set[str]:
    try:
        return set(os.listdir(directory))
    except OSError:
        return set()


def _prefix_of(state: Path) -> str:
    """The environment an environment's state directory is of (its ``prefix`` file); "" if unread."""
    try:
        return (state / "prefix").read_text(errors="replace").strip()
    except OSError:
        return ""


def pytest_sessionstart(session: pytest.Session) -> None:
    """The session's marker, and a state directory of its own for every run that names none (the
    machine's /var/lib/safeinstall is left alone: a user's ``--status`` never lists the suite's)."""
    os.environ[VARIABLE] = f"{os.getpid()}-{uuid.uuid4().hex}"
    os.environ.setdefault("SAFEINSTALL_STATE_DIR", tempfile.mkdtemp(prefix="safeinstall-suite-state-"))
    session.config.stash[_MACHINE_STATE_BEFORE] = _entries(MACHINE_STATE)


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
    base = factory.getbasetemp() if factory is not None else None
    before = session.config.stash.get(_MACHINE_STATE_BEFORE, set())
    for name in sorted(_entries(MACHINE_STATE) - before):
        # of an environment below this session's temporary directory: ours (not another suite's)
        if base is not None and _prefix_of(MACHINE_STATE / name).startswith(f"{base}/"):
            problems.append(f"{MACHINE_STATE / name} was written (a run without SAFEINSTALL_STATE_DIR)")
            shutil.rmtree(MACHINE_STATE / name, ignore_errors=True)
    own = os.environ.get("SAFEINSTALL_STATE_DIR", "")
    if Path(own).name.startswith("safeinstall-suite-state-"):
        shutil.rmtree(own, ignore_errors=True)
    for point in mounts_under(base) if base is not None else []:
        problems.append(f"mount {point} outlived the suite")
        subprocess.run(["umount", "--lazy", str(point)], check=False, capture_output=True)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if problems and reporter is not None:
        reporter.write("\n")
        for problem in problems:
            reporter.write_line(f"leak: {problem}", red=True)
    if problems:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
