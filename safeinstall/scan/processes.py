"""Which running processes use the affected distributions: one pass over ``/proc``, only read.

Each process is read once and matched against the :class:`Target` descriptions; each kind of
:class:`Evidence` is explained in docs/dry-run.md. Parsing and matching are pure; the I/O lives in
:func:`scan_processes`."""

from __future__ import annotations

import errno
import os
import pwd
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from safeinstall.scan.evidence import (
    Evidence,
    Strength,
    TargetIndex,
    _basename,
    argv_needs_links,
    match_argv,
    match_environment_argv,
    match_environment_environ,
    match_environment_maps,
    match_environment_paths,
    match_fds,
    match_maps,
    parse_cmdline,
)
from safeinstall.scan.targets import EnvironmentScope, Target
from safeinstall.system.forking import can_fork, cpu_count, map_forked, split
from safeinstall.system.identity import PF_KTHREAD, ProcessId, StatInfo, parse_stat


@dataclass(frozen=True, slots=True)
class ProcessRecord:
    process: ProcessId  # stat's PID and field 22: one process across pid reuse
    ppid: int
    uid: int  # effective
    user: str  # its name, or the number when it has none
    name: str  # comm: what the process calls itself (maybe renamed, e.g. "SICEXT::Worker0")
    state: str  # R, S, D, Z (zombie: nothing left to restart), T, ...
    cmdline: tuple[str, ...]
    cgroup_text: str  # raw /proc/PID/cgroup, parsed by safeinstall.system.cgroups
    evidence: tuple[Evidence, ...] = ()
    is_self: bool = False

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def affected(self) -> bool:
        return bool(self.evidence)

    @property
    def certain(self) -> bool:
        """Some of its evidence is certain (not only ``environment``)."""
        return any(e.strength is Strength.CERTAIN for e in self.evidence)

    @property
    def strength(self) -> Strength | None:
        if not self.evidence:
            return None
        return Strength.CERTAIN if self.certain else Strength.POSSIBLE

    @property
    def distributions(self) -> frozenset[str]:
        return frozenset(e.distribution for e in self.evidence if e.distribution)

    @property
    def running_old_code(self) -> bool:
        return any(e.deleted for e in self.evidence)


@dataclass(frozen=True, slots=True)
class ScanProblem:
    pid: int
    reading: str  # "stat", "maps", "fd", ...
    reason: str  # "vanished", "permission denied", or the error


@dataclass(frozen=True, slots=True)
class ScanResult:
    processes: tuple[ProcessRecord, ...]  # every process seen, kernel threads aside
    problems: tuple[ScanProblem, ...]
    scanned_count: int  # /proc entries looked at, kernel threads and vanished ones included
    self_pid: int

    @property
    def affected(self) -> tuple[ProcessRecord, ...]:
        return tuple(p for p in self.processes if p.evidence)

    def by_pid(self) -> dict[int, ProcessRecord]:
        return {p.pid: p for p in self.processes}


class _Vanished(Exception):
    pass


_O_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_O_FILE = os.O_RDONLY | os.O_CLOEXEC
#: below glibc's mmap threshold: a larger buffer costs an mmap/munmap per read
_READ_SIZE = 1 << 14
#: The most of a ``maps`` that is read: a process may map 65,530 files (``vm.max_map_count``) under
#: 4 KiB names, a quarter of a GB of text for every scan; a real one (a vLLM worker) has a few MB.
MAPS_LIMIT = 64 << 20
#: The reason a scan problem gives for a ``maps`` beyond ``MAPS_LIMIT``
TOO_LARGE = f"larger than {MAPS_LIMIT >> 20} MiB: not read"


def _read_at(name: str, dir_fd: int, *, single: bool) -> bytes:
    """A /proc file, relative to the process's directory.

    ``single``: the kernel hands out the whole file in one read when the buffer is large enough
    (``stat`` and ``cgroup`` are one seq_file record, ``cmdline`` is copied until the buffer is full), so
    a short first read is all of it; ``maps`` comes at most a page of records per read: read to EOF."""
    fd = os.open(name, _O_FILE, dir_fd=dir_fd)
    try:
        chunk = os.read(fd, _READ_SIZE)
        if (single and len(chunk) < _READ_SIZE) or not chunk:
            return chunk
        chunks = [chunk]
        total = len(chunk)
        while chunk := os.read(fd, _READ_SIZE):
            chunks.append(chunk)
            total += len(chunk)
            if total > MAPS_LIMIT:
                raise _TooLarge(errno.EFBIG, TOO_LARGE)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _fd_links_at(dir_fd: int) -> list[str]:
    fd_dir = os.open("fd", _O_DIRECTORY, dir_fd=dir_fd)
    try:
        links: list[str] = []
        for name in os.listdir(fd_dir):
            try:
                links.append(os.readlink(name, dir_fd=fd_dir))
            except FileNotFoundError:
                continue  # closed in the meantime
        return links
    finally:
        os.close(fd_dir)


class _Process:
    """Reads one process's files through its open ``/proc/PID`` directory.

    Holding the directory open pins the process: should it exit and its PID be reused meanwhile, the
    reads fail (ESRCH) instead of mixing two processes. Errors become problems; a vanished process
    raises :class:`_Vanished` and its record is dropped."""

    __slots__ = ("dir_fd", "pid", "problems")

    def __init__(self, pid: int, dir_fd: int, problems: list[ScanProblem]) -> None:
        self.pid = pid
        self.dir_fd = dir_fd
        self.problems = problems

    def fail(self, what: str, exc: OSError) -> None:
        if isinstance(exc, FileNotFoundError | ProcessLookupError):
            self.problems.append(ScanProblem(self.pid, what, "vanished"))
            raise _Vanished from exc
        self.problems.append(ScanProblem(self.pid, what, _reason(exc)))

    def read(self, what: str, single: bool = True) -> bytes | None:
        try:
            return _read_at(what, self.dir_fd, single=single)
        except OSError as exc:
            self.fail(what, exc)
            return None

    def text(self, what: str, single: bool = True) -> str | None:
        data = self.read(what, single)
        return None if data is None else data.decode("utf-8", "surrogateescape")

    def fd_links(self) -> list[str] | None:
        try:
            return _fd_links_at(self.dir_fd)
        except OSError as exc:
            self.fail("fd", exc)
            return None

    def locate(self, directory: str) -> tuple[int, int] | None:
        """(st_dev, st_ino) of ``directory`` in this process's view (its root); None: cannot tell."""
        try:
            st = os.stat("root" + directory, dir_fd=self.dir_fd)
        except (OSError, ValueError):
            return None
        return (st.st_dev, st.st_ino)

    def link(self, what: str) -> str | None:
        try:
            return os.readlink(what, dir_fd=self.dir_fd)
        except OSError as exc:
            self.fail(what, exc)
            return None


class _TooLarge(OSError):
    """A /proc file beyond what a scan reads of it."""


def _reason(exc: OSError) -> str:
    if isinstance(exc, _TooLarge):
        return TOO_LARGE
    if isinstance(exc, FileNotFoundError | ProcessLookupError):
        return "vanished"
    if isinstance(exc, PermissionError):
        return "permission denied"
    return f"{type(exc).__name__}: {exc.strerror or exc}"


def _user(uid: int, cache: dict[int, str]) -> str:
    name = cache.get(uid)
    if name is None:
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = str(uid)
        cache[uid] = name
    return name


def _looks_like_python_process(argv0: str, name: str) -> bool:
    return _basename(argv0).startswith(("python", "pypy")) or name.startswith(("python", "pypy"))


def _environment_evidence(
    proc: _Process,
    scope: EnvironmentScope,
    stat: StatInfo,
    cmdline: tuple[str, ...],
    maps_text: str | None,
    links: list[str] | None,
) -> tuple[Evidence, ...]:
    """``environment`` evidence, cheapest reads first; ``exe`` and ``environ`` only for a process that
    looks like Python. Dropped when the prefix, seen through the process's root, is another directory."""
    argv0 = cmdline[0] if cmdline else ""
    cwd = proc.link("cwd") if argv0 and "/" in argv0 and not argv0.startswith("/") else None
    found = match_environment_argv(cmdline, scope, cwd=cwd)
    if not found and maps_text:
        found = match_environment_maps(maps_text, scope)
    if not found and links:
        found = match_environment_paths(links, scope)
    if not found and _looks_like_python_process(argv0, stat.name):
        if argv0 and "/" not in argv0:
            found = match_environment_argv(cmdline, scope, exe=proc.link("exe"))
        if not found:
            environ = proc.read("environ")
            found = match_environment_environ(environ, scope) if environ else ()
    if found and scope.prefix_id is not None:
        seen = proc.locate(scope.prefix)
        if seen is not None and seen != scope.prefix_id:
            return ()  # another root (a container) with its own directory at this path
    return found


def _scan_one(
    proc: _Process,
    index: TargetIndex,
    self_pid: int,
    users: dict[int, str],
    scope: EnvironmentScope | None = None,
) -> ProcessRecord | None:
    pid = proc.pid
    stat_text = proc.text("stat")
    if stat_text is None:
        return None
    try:
        stat = parse_stat(stat_text)
    except ValueError as exc:
        proc.problems.append(ScanProblem(pid, "stat", f"malformed: {exc}"))
        return None
    if stat.flags & PF_KTHREAD:
        return None
    # The owner of /proc/PID is the effective uid, non-dumpable processes included (unlike the files
    # inside it): what ps uses, and cheaper than reading status.
    uid = os.fstat(proc.dir_fd).st_uid
    cmdline = parse_cmdline(proc.read("cmdline") or b"")
    cgroup_text = proc.text("cgroup") or ""
    maps_text = proc.text("maps", single=False)
    evidence = match_maps(maps_text, index, proc.locate) if maps_text else ()
    links = proc.fd_links()
    if links:
        evidence += match_fds(links, index)
    if cmdline:
        exe = cwd = None
        if argv_needs_links(cmdline, index):
            exe = proc.link("exe")
            cwd = proc.link("cwd")
        evidence += match_argv(cmdline, index, exe=exe, cwd=cwd)
    evidence = index.as_depends(evidence)
    if scope is not None and not evidence and pid != self_pid:
        evidence = _environment_evidence(proc, scope, stat, cmdline, maps_text, links)
    return ProcessRecord(
        process=ProcessId(pid, stat.start_time),
        ppid=stat.ppid,
        uid=uid,
        user=_user(uid, users),
        name=stat.name,
        state=stat.state,
        cmdline=cmdline,
        cgroup_text=cgroup_text,
        evidence=evidence,
        is_self=pid == self_pid,
    )


def _pids(proc_root: Path) -> list[int]:
    with os.scandir(proc_root) as entries:
        return sorted(int(entry.name) for entry in entries if entry.name.isdigit())


_Share = tuple[list[ProcessRecord], list[ScanProblem]]


def _scan_pids(
    pids: Sequence[int], root: str, index: TargetIndex, self_pid: int, scope: EnvironmentScope | None
) -> _Share:
    problems: list[ScanProblem] = []
    records: list[ProcessRecord] = []
    users: dict[int, str] = {}
    for pid in pids:
        try:
            dir_fd = os.open(f"{root}/{pid}", _O_DIRECTORY)
        except OSError as exc:
            problems.append(ScanProblem(pid, "directory", _reason(exc)))
            continue
        try:
            record = _scan_one(_Process(pid, dir_fd, problems), index, self_pid, users, scope)
        except _Vanished:
            continue
        finally:
            os.close(dir_fd)
        if record is not None:
            records.append(record)
    return records, problems


#: fewer processes than this are scanned in one process: a fork would cost more than it saves
PARALLEL_THRESHOLD = 256
MAX_WORKERS = 4


def default_workers(count: int) -> int:
    """How many processes share a scan of ``count`` PIDs: one unless it is big and CPUs are free.

    Never more than one while this process runs other threads: forking then is unsafe."""
    if count < PARALLEL_THRESHOLD or not can_fork():
        return 1
    return max(1, min(MAX_WORKERS, cpu_count()))


def scan_processes(
    targets: Iterable[Target] | TargetIndex,
    proc_root: Path = Path("/proc"),
    self_pid: int | None = None,
    workers: int | None = None,
    scope: EnvironmentScope | None = None,
) -> ScanResult:
    """Read every process under ``proc_root`` once and match it against ``targets`` (with ``scope``:
    ``environment`` evidence too). Unreadable ones go to ``problems``; ``self_pid`` is marked, not skipped;
    ``workers``: forked processes sharing the PIDs, the same result either way."""
    index = TargetIndex.of(targets)
    me = os.getpid() if self_pid is None else self_pid
    root = str(proc_root)
    pids = _pids(proc_root)
    count = min(len(pids), default_workers(len(pids)) if workers is None else max(1, workers))
    if not can_fork():  # forking a multi-threaded process may deadlock the child
        count = 1
    if count <= 1:
        records, problems = _scan_pids(pids, root, index, me, scope)
    else:
        records, problems = [], []
        for share_records, share_problems in map_forked(
            lambda share: _scan_pids(share, root, index, me, scope), split(pids, count)
        ):
            records.extend(share_records)
            problems.extend(share_problems)
        records.sort(key=lambda record: record.pid)
        problems.sort(key=lambda problem: problem.pid)
    return ScanResult(
        processes=tuple(records), problems=tuple(problems), scanned_count=len(pids), self_pid=me
    )
