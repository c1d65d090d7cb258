"""GPU state through NVML (``pynvml``); the only module of safeinstall that touches NVML.

Nothing here raises because NVML is missing or failing: such a snapshot is *unavailable*, with the
reason, and never counts as released. ``SAFEINSTALL_NVML_LIBRARY`` preloads a library.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import time
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from types import TracebackType
from typing import Literal

import pynvml

NVML_LIBRARY_ENV = "SAFEINSTALL_NVML_LIBRARY"
PROC = Path("/proc")

MemoryApi = Literal["v2", "v1"]
HolderSource = Literal["nvml", "fd"]

#: NVML codes meaning "this build of the library/driver has no v2 memory info": fall back to v1.
_V2_UNSUPPORTED = frozenset(
    {
        pynvml.NVML_ERROR_NOT_SUPPORTED,
        pynvml.NVML_ERROR_FUNCTION_NOT_FOUND,
        pynvml.NVML_ERROR_ARGUMENT_VERSION_MISMATCH,
    }
)


# ---------------------------------------------------------------------------------------------- data


@dataclass(frozen=True)
class GpuProcess:
    """A compute process NVML lists on a GPU. ``used_bytes`` None = NVML says N/A (not 0)."""

    pid: int
    gpu_index: int
    used_bytes: int | None
    #: False: NVML reported a PID that has no ``<proc_root>/<pid>`` here (a host PID seen from a container).
    in_namespace: bool


@dataclass(frozen=True)
class Gpu:
    index: int
    name: str
    uuid: str
    total_bytes: int
    #: v2: excludes the driver-reserved memory; v1: includes it (so it never reaches 0).
    used_bytes: int
    memory_api: MemoryApi
    processes: tuple[GpuProcess, ...]
    #: Why the process list is unavailable (then ``processes`` is empty and means nothing); None if listed.
    processes_error: str | None = None
    #: ``nvmlDeviceGetPersistenceMode``: off, each start of a process pays the GPU's initialisation
    #: (1-3 s); None: not known (the driver does not say)
    persistence_mode: bool | None = None


@dataclass(frozen=True)
class FdHolder:
    """A process with an open fd on a ``/dev/nvidia*`` node (fallback when NVML lists nobody)."""

    pid: int
    devices: tuple[str, ...]


@dataclass(frozen=True)
class GpuSnapshot:
    available: bool
    #: Why NVML is unavailable (only when ``available`` is False).
    reason: str | None
    gpus: tuple[Gpu, ...]
    fd_holders: tuple[FdHolder, ...]
    #: Limitations of this snapshot (v1 memory fallback, no process list on this driver...).
    warnings: tuple[str, ...]
    #: NVML calls that failed during this snapshot; its data is incomplete.
    errors: tuple[str, ...]
    #: time.monotonic() when taken.
    taken_at: float
    driver_version: str | None = None

    def all_processes(self) -> tuple[GpuProcess, ...]:
        return tuple(p for g in self.gpus for p in g.processes)


@dataclass(frozen=True)
class Holder:
    """A stopped PID still holding a GPU. ``gpu_index`` None: found by the fd scan, GPU not known."""

    pid: int
    gpu_index: int | None
    used_bytes: int | None
    source: HolderSource


@dataclass(frozen=True)
class GpuRelease:
    """One GPU's memory check: released when ``used_bytes <= expected_used_bytes``."""

    index: int
    uuid: str
    baseline_used_bytes: int
    #: What the stopped PIDs held at baseline; None = unknown (N/A, or no process list at baseline).
    held_by_stopped_bytes: int | None
    #: baseline - held by stopped (+ change of the other listed processes); None = unknown.
    expected_used_bytes: int | None
    #: Now; None = the GPU is missing from the current snapshot.
    used_bytes: int | None
    #: None = unknown: only the process list decides.
    memory_released: bool | None


@dataclass(frozen=True)
class ReleaseStatus:
    released: bool
    #: NVML unavailable: nothing was checked (``released`` is False, ``reason`` starts with "skipped:").
    skipped: bool
    #: Why not released (None when released).
    reason: str | None
    holders: tuple[Holder, ...]
    gpus: tuple[GpuRelease, ...]
    errors: tuple[str, ...]
    #: How the verdict was reached where NVML could not say everything (N/A memory, host PIDs, ...).
    notes: tuple[str, ...]
    timed_out: bool = False
    waited_s: float = 0.0


# ---------------------------------------------------------------------------------------------- pure


def describe_nvml_error(exc: BaseException) -> str:
    code = getattr(exc, "value", None)
    return f"{exc} (NVML error {code})" if isinstance(code, int) else f"{type(exc).__name__}: {exc}"


def unavailable_snapshot(reason: str, taken_at: float) -> GpuSnapshot:
    return GpuSnapshot(False, reason, (), (), (), (), taken_at)


def needs_fd_scan(gpus: Iterable[Gpu]) -> bool:
    """NVML lists nobody on a GPU whose memory is in use, or cannot list processes at all."""
    return any(g.processes_error is not None or (not g.processes and g.used_bytes > 0) for g in gpus)


def _mib(n: int | None) -> str:
    return "N/A" if n is None else f"{n / 2**20:.1f} MiB"


def _held_by(gpu: Gpu, pids: frozenset[int]) -> int | None:
    """Bytes the PIDs hold on ``gpu``; None when unknown (no process list, or N/A memory)."""
    if gpu.processes_error is not None:
        return None
    sizes = [p.used_bytes for p in gpu.processes if p.pid in pids]
    return None if None in sizes else sum(s for s in sizes if s is not None)


def _others_change(baseline: Gpu, current: Gpu, stopped: frozenset[int]) -> int | None:
    """How much the processes other than the stopped ones grew (or shrank) since the baseline."""
    before = [p.used_bytes for p in baseline.processes if p.pid not in stopped]
    after = [p.used_bytes for p in current.processes if p.pid not in stopped]
    if baseline.processes_error or current.processes_error or None in before or None in after:
        return None
    return sum(s for s in after if s is not None) - sum(s for s in before if s is not None)


def _gpu_release(baseline: Gpu, current: Gpu | None, stopped: frozenset[int]) -> tuple[GpuRelease, list[str]]:
    notes: list[str] = []
    held = _held_by(baseline, stopped)
    if held is None:
        why = baseline.processes_error or "NVML reports N/A memory for a stopped process"
        notes.append(
            f"GPU {baseline.index}: what the stopped processes held is unknown ({why}); "
            "judged by the process list alone"
        )
    outsiders = sorted(p.pid for p in baseline.processes if not p.in_namespace)
    if outsiders and not any(p.pid in stopped for p in baseline.processes):
        notes.append(
            f"GPU {baseline.index}: NVML lists PIDs outside this PID namespace {outsiders}; "
            "stopped processes cannot be matched by PID there"
        )
    expected: int | None = None
    released: bool | None = None
    if current is not None and held is not None:
        if current.memory_api != baseline.memory_api:
            notes.append(
                f"GPU {baseline.index}: memory API changed ({baseline.memory_api} -> "
                f"{current.memory_api}); memory not compared"
            )
        else:
            change = _others_change(baseline, current, stopped)
            if change is None:
                change = 0
                notes.append(
                    f"GPU {baseline.index}: other processes' memory unknown; "
                    "expecting used memory to fall by what the stopped processes held"
                )
            expected = baseline.used_bytes - held + change
            released = current.used_bytes <= expected
    used = None if current is None else current.used_bytes
    release = GpuRelease(baseline.index, baseline.uuid, baseline.used_bytes, held, expected, used, released)
    return release, notes


def _holders(current: GpuSnapshot, stopped: frozenset[int]) -> tuple[Holder, ...]:
    listed = [
        Holder(p.pid, p.gpu_index, p.used_bytes, "nvml") for p in current.all_processes() if p.pid in stopped
    ]
    blind = any(g.processes_error is not None for g in current.gpus)
    by_fd = [Holder(h.pid, None, None, "fd") for h in current.fd_holders if blind and h.pid in stopped]
    return (*listed, *by_fd)


def _not_released_reason(
    holders: tuple[Holder, ...], gpus: tuple[GpuRelease, ...], errors: tuple[str, ...]
) -> str:
    parts: list[str] = []
    if errors:
        parts.append("NVML error: " + "; ".join(errors))
    for h in holders:
        where = "a /dev/nvidia* fd" if h.gpu_index is None else f"GPU {h.gpu_index} ({_mib(h.used_bytes)})"
        parts.append(f"PID {h.pid} still holds {where}")
    for g in gpus:
        if g.memory_released is False:
            parts.append(f"GPU {g.index} used {_mib(g.used_bytes)} > expected {_mib(g.expected_used_bytes)}")
    return "; ".join(parts)


def skipped_release(reason: str | None) -> ReleaseStatus:
    return ReleaseStatus(False, True, f"skipped: {reason}", (), (), (), ())


def release_status(
    baseline: GpuSnapshot, stopped_pids: Collection[int], current: GpuSnapshot
) -> ReleaseStatus:
    """Pure: are the stopped PIDs' GPUs released? No error, none of those PIDs on a GPU (or holding a
    ``/dev/nvidia*`` fd), and each GPU's used memory fallen by what they held; where that is N/A, the process
    list alone decides."""
    if not baseline.available:
        return skipped_release(baseline.reason)
    stopped = frozenset(stopped_pids)
    if not current.available:
        errors: tuple[str, ...] = (f"NVML became unavailable: {current.reason}",)
        return ReleaseStatus(False, False, _not_released_reason((), (), errors), (), (), errors, ())
    by_uuid = {g.uuid: g for g in current.gpus}
    gpus: list[GpuRelease] = []
    notes: list[str] = []
    missing: list[str] = []
    for b in baseline.gpus:
        c = by_uuid.get(b.uuid)
        if c is None:
            missing.append(f"GPU {b.index} ({b.uuid}) missing from the current snapshot")
        gpu, gpu_notes = _gpu_release(b, c, stopped)
        gpus.append(gpu)
        notes.extend(gpu_notes)
    notes.extend(
        f"GPU {g.index}: {g.processes_error}; stopped PIDs checked by the /dev/nvidia* fd scan only"
        for g in current.gpus
        if g.processes_error is not None
    )
    holders = _holders(current, stopped)
    errors = (*current.errors, *missing)
    released = not errors and not holders and all(g.memory_released is not False for g in gpus)
    reason = None if released else _not_released_reason(holders, tuple(gpus), errors)
    return ReleaseStatus(released, False, reason, holders, tuple(gpus), errors, tuple(notes))


# ---------------------------------------------------------------------------------------------- I/O


def in_namespace(pid: int, proc_root: Path = PROC) -> bool:
    return (proc_root / str(pid)).exists()


def scan_fd_holders(
    proc_root: Path = PROC, exclude: Collection[int] = ()
) -> tuple[tuple[FdHolder, ...], int]:
    """Processes with a ``/dev/nvidia*`` fd open (by readlink of ``<proc_root>/*/fd/*``), and how many
    processes' fd tables could not be read (permissions); processes that exit meanwhile are skipped."""
    holders: list[FdHolder] = []
    unreadable = 0
    try:
        entries = sorted((e for e in os.scandir(proc_root) if e.name.isdigit()), key=lambda e: int(e.name))
    except OSError:
        return (), 0
    for entry in entries:
        pid = int(entry.name)
        if pid in exclude:
            continue
        fd_dir = Path(entry.path) / "fd"
        try:
            fds = os.listdir(fd_dir)
        except (FileNotFoundError, ProcessLookupError):
            continue  # exited since the scandir
        except OSError:
            unreadable += 1
            continue
        devices: set[str] = set()
        for fd in fds:
            try:
                target = os.readlink(fd_dir / fd)
            except OSError:
                continue
            if target.startswith("/dev/nvidia"):
                devices.add(target)
        if devices:
            holders.append(FdHolder(pid, tuple(sorted(devices))))
    return tuple(holders), unreadable


def _preload(environ: Mapping[str, str]) -> str | None:
    """Load ``$SAFEINSTALL_NVML_LIBRARY`` globally; the reason NVML is unavailable if that fails."""
    path = environ.get(NVML_LIBRARY_ENV)
    if not path:
        return None
    if not os.path.isabs(path):
        return f"{NVML_LIBRARY_ENV}={path!r} must be an absolute path"
    try:
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
    except OSError as exc:
        return f"cannot load the NVML library named by {NVML_LIBRARY_ENV} ({path}): {exc}"
    return None


def _init(environ: Mapping[str, str]) -> str | None:
    """nvmlInit; None on success, else why NVML is unavailable."""
    reason = _preload(environ)
    if reason is not None:
        return reason
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError_LibraryNotFound:
        return "NVML library libnvidia-ml.so.1 not found (no NVIDIA driver installed?)"
    except pynvml.NVMLError_DriverNotLoaded:
        return "NVIDIA driver not loaded (nvmlInit: Driver Not Loaded)"
    except (pynvml.NVMLError, pynvml.NVMLLibraryMismatchError, OSError) as exc:
        return f"nvmlInit failed: {describe_nvml_error(exc)}"
    return None


def _memory(handle: object) -> tuple[int, int, MemoryApi, str | None]:
    """(total, used, api, warning): v2 (used excludes reserved), v1 only where v2 is not supported."""
    v2 = getattr(pynvml, "nvmlMemory_v2", None)
    warning = "pynvml has no nvmlMemory_v2"
    if v2 is not None:
        try:
            info = pynvml.nvmlDeviceGetMemoryInfo(handle, version=v2)
            return int(info.total), int(info.used), "v2", None
        except pynvml.NVMLError as exc:
            if exc.value not in _V2_UNSUPPORTED:
                raise
            warning = f"nvmlDeviceGetMemoryInfo_v2: {describe_nvml_error(exc)}"
    info = pynvml.nvmlDeviceGetMemoryInfo(handle)
    return int(info.total), int(info.used), "v1", f"{warning}; v1 used memory includes driver-reserved memory"


def _processes(
    handle: object, index: int, proc_root: Path
) -> tuple[tuple[GpuProcess, ...], str | None, bool]:
    """(processes, why unavailable, whether that is an error rather than a limitation of the driver)."""
    try:
        infos = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except (pynvml.NVMLLibraryMismatchError, pynvml.NVMLError_FunctionNotFound) as exc:
        lacks = "process list unavailable: NVML library mismatch, the driver's libnvidia-ml lacks"
        return (), f"{lacks} nvmlDeviceGetComputeRunningProcesses_v3 ({type(exc).__name__})", False
    except pynvml.NVMLError as exc:
        return (), f"nvmlDeviceGetComputeRunningProcesses: {describe_nvml_error(exc)}", True
    procs = tuple(
        GpuProcess(
            pid=int(p.pid),
            gpu_index=index,
            used_bytes=None if p.usedGpuMemory is None else int(p.usedGpuMemory),
            in_namespace=in_namespace(int(p.pid), proc_root),
        )
        for p in infos
    )
    return procs, None, False


def _query_gpu(index: int, proc_root: Path) -> tuple[Gpu, list[str], list[str]]:
    """One GPU; raises pynvml.NVMLError when its name, UUID or memory cannot be read."""
    warnings: list[str] = []
    errors: list[str] = []
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    name = str(pynvml.nvmlDeviceGetName(handle))
    uuid = str(pynvml.nvmlDeviceGetUUID(handle))
    total, used, api, memory_warning = _memory(handle)
    if memory_warning is not None:
        warnings.append(f"GPU {index}: {memory_warning}")
    procs, procs_error, is_error = _processes(handle, index, proc_root)
    if procs_error is not None:
        (errors if is_error else warnings).append(f"GPU {index}: {procs_error}")
    persistence = _persistence_mode(handle)
    return Gpu(index, name, uuid, total, used, api, procs, procs_error, persistence), warnings, errors


def _persistence_mode(handle: object) -> bool | None:
    """Whether the GPU keeps its driver state while no process uses it; None where NVML does not say."""
    try:
        return bool(pynvml.nvmlDeviceGetPersistenceMode(handle) == pynvml.NVML_FEATURE_ENABLED)
    except pynvml.NVMLError:
        return None


def _driver_version() -> str | None:
    try:
        return str(pynvml.nvmlSystemGetDriverVersion())
    except pynvml.NVMLError:
        return None


def _query(proc_root: Path) -> GpuSnapshot:
    """Snapshot of an initialized NVML."""
    taken_at = time.monotonic()
    gpus: list[Gpu] = []
    warnings: list[str] = []
    errors: list[str] = []
    try:
        count = int(pynvml.nvmlDeviceGetCount())
    except pynvml.NVMLError as exc:
        count = 0
        errors.append(f"nvmlDeviceGetCount: {describe_nvml_error(exc)}")
    for index in range(count):
        try:
            gpu, gpu_warnings, gpu_errors = _query_gpu(index, proc_root)
        except pynvml.NVMLError as exc:
            errors.append(f"GPU {index}: {describe_nvml_error(exc)}")
            continue
        gpus.append(gpu)
        warnings.extend(gpu_warnings)
        errors.extend(gpu_errors)
    fd_holders: tuple[FdHolder, ...] = ()
    if needs_fd_scan(gpus):
        fd_holders, unreadable = scan_fd_holders(proc_root, exclude={os.getpid()})
        if unreadable:
            warnings.append(f"fd scan: could not read the fds of {unreadable} processes (permissions?)")
    return GpuSnapshot(
        True, None, tuple(gpus), fd_holders, tuple(warnings), tuple(errors), taken_at, _driver_version()
    )


class NvmlSession:
    """``with NvmlSession() as nvml: nvml.snapshot()`` - nvmlInit once, nvmlShutdown at the end. Never raises
    for a missing library/driver: ``available`` is False, ``reason`` says why, and :meth:`snapshot` returns
    unavailable snapshots."""

    def __init__(self, environ: Mapping[str, str] = os.environ, proc_root: Path = PROC) -> None:
        self._environ = environ
        self.proc_root = proc_root
        self._initialized = False
        self.reason: str | None = "NVML session not entered"

    @property
    def available(self) -> bool:
        return self._initialized

    def __enter__(self) -> NvmlSession:
        self.reason = _init(self._environ)
        self._initialized = self.reason is None
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._initialized:
            self._initialized = False
            self.reason = "NVML session closed"
            with contextlib.suppress(pynvml.NVMLError):
                pynvml.nvmlShutdown()

    def snapshot(self) -> GpuSnapshot:
        if not self._initialized:
            return unavailable_snapshot(self.reason or "NVML unavailable", time.monotonic())
        return _query(self.proc_root)


def snapshot_gpus(environ: Mapping[str, str] = os.environ, proc_root: Path = PROC) -> GpuSnapshot:
    """One snapshot in its own NVML session."""
    with NvmlSession(environ, proc_root) as nvml:
        return nvml.snapshot()


def wait_for_release(
    session: NvmlSession,
    baseline: GpuSnapshot,
    stopped_pids: Collection[int],
    timeout: float,
    on_poll: Callable[[ReleaseStatus], None] | None = None,
    poll_interval: float = 0.1,
) -> ReleaseStatus:
    """Poll :func:`release_status` until released or ``timeout`` seconds have passed. ``on_poll`` gets every
    status (e.g. for progress output). On timeout the last status comes back with ``timed_out`` set and the
    remaining holders named in ``reason``. NVML unavailable: a "skipped" status."""
    if not baseline.available:
        return skipped_release(baseline.reason)
    if not session.available:
        return skipped_release(session.reason)
    start = time.monotonic()
    while True:
        status = release_status(baseline, stopped_pids, session.snapshot())
        status = replace(status, waited_s=time.monotonic() - start)
        if on_poll is not None:
            on_poll(status)
        if status.released:
            return status
        remaining = start + timeout - time.monotonic()
        if remaining <= 0:
            return replace(status, timed_out=True, reason=f"timed out after {timeout:g}s: {status.reason}")
        time.sleep(min(poll_interval, remaining))
