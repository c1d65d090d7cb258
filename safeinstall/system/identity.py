"""Process identity: a PID and its start time (``/proc/PID/stat`` field 22, clock ticks after boot)
name one process across PID reuse. The one place that parses ``stat``, asks whether a process seen
earlier still runs, and ends processes that were seen (by identity, never by PID alone).
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # loaded by what ends processes, not by the lock's and --status's alive()
    import psutil


#: ``PF_KTHREAD`` in the flags field of ``/proc/PID/stat``: a kernel thread (no user space to check).
PF_KTHREAD = 0x00200000
#: The kernel's ``PID_MAX_LIMIT`` on 64-bit hosts: no PID is larger.
PID_MAX = 2**22
#: A start time (clock ticks after boot) at or above this is no start time (a signed 64-bit counter).
START_MAX = 2**63


@dataclass(frozen=True, slots=True)
class ProcessId:
    """One process across PID reuse: its PID and its start time (``/proc/PID/stat`` field 22, clock
    ticks after boot). ``start`` None: not known (a record whose writer could not read it); then the
    PID alone decides, in :func:`alive` and :func:`same_process`."""

    pid: int
    start: int | None

    @classmethod
    def checked(cls, pid: object, start: object) -> ProcessId:
        """From untrusted values (a state file, a lock file): ValueError unless ``pid`` is an int
        (not a bool) in 1..PID_MAX and ``start`` None or an int (not a bool) in 0..START_MAX-1."""
        if not isinstance(pid, int) or isinstance(pid, bool) or not 0 < pid <= PID_MAX:
            raise ValueError(f"not a process ID: {pid!r:.40}")
        if start is None:
            return cls(pid, None)
        if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < START_MAX:
            raise ValueError(f"not a process start time: {start!r:.40}")
        return cls(pid, start)


@dataclass(frozen=True, slots=True)
class StatInfo:
    pid: int
    name: str  # comm, as the process may have renamed itself
    state: str
    ppid: int
    flags: int
    start_time: int  # clock ticks after boot: with the pid, it names one process (pid reuse)
    pgrp: int = 0  # its process group

    @property
    def kernel_thread(self) -> bool:
        return bool(self.flags & PF_KTHREAD)


def parse_stat(text: str) -> StatInfo:
    """``/proc/PID/stat``; the name may hold spaces and parentheses. ValueError if malformed."""
    open_paren = text.find("(")
    close_paren = text.rfind(")")
    if open_paren < 0 or close_paren < open_paren:
        raise ValueError(f"no (comm) in stat: {text[:80]!r}")
    fields = text[close_paren + 2 :].split(None, 20)
    if len(fields) < 20:
        raise ValueError(f"stat has {len(fields) + 2} fields, expected at least 22")
    return StatInfo(
        pid=int(text[:open_paren]),
        name=text[open_paren + 1 : close_paren],
        state=fields[0],
        ppid=int(fields[1]),
        flags=int(fields[6]),
        start_time=int(fields[19]),
        pgrp=int(fields[2]),
    )


def group_members(pgrp: int, proc: Path = Path("/proc")) -> list[StatInfo]:
    """The live processes of process group ``pgrp`` (zombies, which only wait for their parent, are not)."""
    found: list[StatInfo] = []
    for entry in os.scandir(proc):
        if not entry.name.isdigit():
            continue
        try:
            with open(os.path.join(entry.path, "stat"), encoding="utf-8", errors="replace") as handle:
                info = parse_stat(handle.read())
        except (OSError, ValueError):
            continue
        if info.pgrp == pgrp and info.state not in ("Z", "X"):
            found.append(info)
    return found


def uninterruptible(stat: StatInfo) -> bool:
    """Pure: in uninterruptible sleep (``D``): inside a kernel call that no signal ends before it
    returns, SIGKILL included (a driver's teardown, e.g. in ``nvidia_uvm``, may never return)."""
    return stat.state == "D"


def read_stat(seen: ProcessId, proc: Path = Path("/proc")) -> StatInfo | None:
    """``/proc/PID/stat`` of the process ``seen``; None when it is gone."""
    try:
        stat = parse_stat((proc / str(seen.pid) / "stat").read_text(encoding="utf-8", errors="replace"))
    except (OSError, ValueError):
        return None
    return stat if seen.start is None or stat.start_time == seen.start else None


def process_start(pid: int, proc: Path = Path("/proc")) -> int | None:
    """The start time of ``pid`` in clock ticks after boot; None when there is no such process."""
    stat = read_stat(ProcessId(pid, None), proc)
    return None if stat is None else stat.start_time


def own_process() -> ProcessId:
    """This process (its start None only when ``/proc`` cannot be read)."""
    pid = os.getpid()
    return ProcessId(pid, process_start(pid))


def alive(seen: ProcessId, proc: Path = Path("/proc")) -> bool:
    """Whether the process ``seen`` still runs: same PID *and* start time (a start not known: the
    PID alone decides)."""
    now = process_start(seen.pid, proc)
    return now is not None and (seen.start is None or now == seen.start)


def same_process(seen: ProcessId) -> psutil.Process | None:
    """The live process that was seen (same PID and start time), or None if it is gone."""
    import psutil

    try:
        proc = psutil.Process(seen.pid)
        start = process_start(seen.pid)
    except psutil.Error:
        return None
    if start is not None and seen.start is not None and start != seen.start:
        return None
    return proc


def end_processes(seen: Iterable[ProcessId]) -> tuple[int, ...]:
    """SIGTERM each process seen that still runs, SIGKILL after 10 s; the PIDs that were ended."""
    import psutil

    ended: list[int] = []
    procs: list[psutil.Process] = []
    for process in seen:
        proc = same_process(process)
        if proc is None:
            continue
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            continue
        procs.append(proc)
        ended.append(process.pid)
    lingering = wait_exited(procs, timeout=10)
    for proc in lingering:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    wait_exited(lingering, timeout=10)
    return tuple(ended)


def running(proc: psutil.Process) -> bool:
    """Alive and not a zombie: a zombie holds no files, no mappings, no GPU memory."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_exited(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every process has exited (zombies count as exited); those still running. Not
    ``psutil.wait_procs``: for processes that are not our children it waits on ``is_running()``, which stays
    true for a zombie whose parent has not reaped it, i.e. until the timeout."""

    deadline = time.monotonic() + timeout
    alive = [p for p in procs if running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if running(p)]
    return alive
