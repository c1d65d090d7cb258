"""One run per target environment: an exclusive ``flock`` on ``<envdir>/lock``.

The file is never deleted (two runs would lock two files), only emptied on release; a lock whose
file names a dead holder is taken over and reported (:attr:`HeldLock.stale`).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from types import TracebackType

from safeinstall.errors import LockHeldError, SafeInstallError
from safeinstall.system.identity import ProcessId, alive, own_process
from safeinstall.system.safefs import open_file

_HOLDER_VERSION = 1
#: While the file names no live holder, a busy lock is retried this long (the holder may be between
#: flock() and writing its details, or a --status probe may hold it for an instant).
DEFAULT_GRACE_S = 1.0


@dataclass(frozen=True, slots=True)
class LockHolder:
    process: ProcessId  # the run; in the file, flat: ``pid`` and ``process_start``
    started_at: str  # ISO 8601, UTC: when the run took the lock
    argv: tuple[str, ...]

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def started_display(self) -> str:
        return display_time(self.started_at)


def display_time(iso: str) -> str:
    """Pure: ``2026-11-30T03:12:01+00:00`` -> ``2026-11-30 03:12:01 UTC`` (unparsable: as is)."""
    try:
        moment = datetime.fromisoformat(iso)
    except ValueError:
        return iso
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return moment.astimezone(UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def holder_to_json(holder: LockHolder) -> str:
    return json.dumps(
        {
            "version": _HOLDER_VERSION,
            "pid": holder.process.pid,
            "process_start": holder.process.start,
            "started_at": holder.started_at,
            "argv": list(holder.argv),
        },
        sort_keys=True,
    )


def parse_holder(text: str) -> LockHolder | None:
    """Pure: the holder a lock file names; None for an empty (cleanly released) or unreadable file."""
    try:
        data = json.loads(text)
    except ValueError:
        return None
    if not isinstance(data, dict):
        return None
    pid = data.get("pid")
    start = data.get("process_start")
    started_at = data.get("started_at")
    argv = data.get("argv")
    try:
        process = ProcessId.checked(pid, None)
    except ValueError:
        return None
    with contextlib.suppress(ValueError):  # a start that is no start: not known, the PID alone decides
        process = ProcessId.checked(pid, start)
    if not isinstance(started_at, str):
        started_at = "an unknown time"
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        argv = []
    return LockHolder(process=process, started_at=started_at, argv=tuple(argv))


def holder_alive(holder: LockHolder, proc: Path = Path("/proc")) -> bool:
    """Whether the process the file names still runs (same pid *and* same start time: no pid reuse)."""
    return alive(holder.process, proc)


def held_message(holder: LockHolder | None, target: str) -> str:
    """Pure: why a run is refused."""
    if holder is None:
        who = "another safeinstall run"
    else:
        who = f"another safeinstall run (PID {holder.pid}, started {holder.started_display})"
    return f"{who} holds the lock for {target}"


HELD_HINT = "wait for it or, if it died, run safeinstall --recover"


def takeover_message(holder: LockHolder, alive: bool) -> str:
    """Pure: what a run reports when the lock file named a holder that no longer holds it."""
    why = (
        "it no longer holds it"
        if alive
        else "that process is gone; it did not finish cleanly, see safeinstall --status"
    )
    return f"took over stale lock of PID {holder.pid}, started {holder.started_display} ({why})"


class HeldLock:
    """An acquired lock; release it with :meth:`release` or by leaving the ``with`` block."""

    def __init__(self, path: Path, fd: int, holder: LockHolder, stale: LockHolder | None, note: str | None):
        self.path = path
        self.holder = holder
        self.stale = stale  # the previous holder when its lock was taken over
        self.takeover_note = note  # "took over stale lock of PID X, started ..." or None
        self._fd: int | None = fd

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Empty the file (a clean end) and unlock. Idempotent."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.ftruncate(fd, 0)
        except OSError:
            pass
        finally:
            os.close(fd)  # closing the only descriptor drops the flock

    def __enter__(self) -> HeldLock:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()

    def __del__(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # unlock, but keep the details: the run did not end cleanly


def _read_fd(fd: int) -> str:
    chunks: list[bytes] = []
    offset = 0
    while chunk := os.pread(fd, 65536, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _open(path: Path) -> int:
    return os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)


def _try_flock(fd: int, kind: int = fcntl.LOCK_EX) -> bool:
    """Take the ``flock`` of ``kind`` without waiting; False when another holds it."""
    try:
        fcntl.flock(fd, kind | fcntl.LOCK_NB)
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (on_disk.st_dev, on_disk.st_ino) == (mine.st_dev, mine.st_ino)


def acquire_lock(
    path: Path,
    target: str,
    argv: Sequence[str] | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    now: datetime | None = None,
) -> HeldLock:
    """Take the lock at ``path`` for the environment ``target`` (named in messages) or refuse at once. Raises
    :class:`LockHeldError` when a live run holds it. The caller owns the returned lock."""
    deadline = time.monotonic() + grace_s
    while True:
        fd = _open(path)
        try:
            if _try_flock(fd):
                if not _same_file(fd, path):  # replaced or removed meanwhile: lock the file now there
                    os.close(fd)
                    continue
                return _take(path, fd, argv, now)
            holder = parse_holder(_read_fd(fd))
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)
        if (holder is not None and holder_alive(holder)) or time.monotonic() >= deadline:
            raise LockHeldError(held_message(holder, target), hint=HELD_HINT)
        time.sleep(0.05)


def _take(path: Path, fd: int, argv: Sequence[str] | None, now: datetime | None) -> HeldLock:
    previous = parse_holder(_read_fd(fd))
    holder = LockHolder(
        process=own_process(),
        started_at=(now or datetime.now(UTC)).astimezone(UTC).isoformat(timespec="seconds"),
        argv=tuple(sys.argv if argv is None else argv),
    )
    data = (holder_to_json(holder) + "\n").encode("utf-8", errors="surrogateescape")
    try:
        os.ftruncate(fd, 0)
        if os.pwrite(fd, data, 0) != len(data):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        os.fsync(fd)
    except OSError as exc:  # a full disk, a quota, an I/O error: the run has not begun
        where = filesystem_of(path)
        raise SafeInstallError(
            f"cannot write the lock {path}: {exc.strerror or exc} (the filesystem at {where}); "
            "nothing was changed",
            hint=f"free some space on {where}, or set SAFEINSTALL_STATE_DIR to another filesystem",
        ) from exc
    stale = previous if previous is not None and previous.pid != holder.pid else None
    note = None if stale is None else takeover_message(stale, holder_alive(stale))
    return HeldLock(path, fd, holder, stale, note)


def filesystem_of(path: Path) -> Path:
    """Where the filesystem that holds ``path`` is mounted (the highest directory above it on the
    same device; ``path`` itself when it cannot be looked at)."""
    try:
        device = os.stat(path).st_dev
    except OSError:
        return path
    mount = path
    for parent in path.parents:
        try:
            if os.stat(parent).st_dev != device:
                break
        except OSError:
            break
        mount = parent
    return mount


def read_holder(path: Path) -> tuple[bool, LockHolder | None]:
    """For --status: (whether a run holds the lock now, whom the file names). Probes with a shared lock, so
    two probes never disturb each other; a run starting during the probe's instant retries (see
    :data:`DEFAULT_GRACE_S`)."""
    try:
        fd, _info = open_file(path, follow=False)
    except FileNotFoundError:
        return False, None
    try:
        held = not _try_flock(fd, fcntl.LOCK_SH)
        return held, parse_holder(_read_fd(fd))
    finally:
        os.close(fd)


def check_lock(path: Path, target: str) -> None:
    """For a dry-run: refuse as :func:`acquire_lock` would when a live run holds the lock, without
    taking it (a shared probe) and without creating anything."""
    held, holder = read_holder(path)
    if held:
        raise LockHeldError(held_message(holder, target), hint=HELD_HINT)
