"""Work split over forked children: parallelism for CPU-bound Python that threads cannot give.

A child that fails is redone here, so the result never depends on forking; fork only while no other
thread runs (:func:`can_fork`).
"""

from __future__ import annotations

import os
import pickle
import signal
import threading
from collections.abc import Callable, Sequence
from typing import TypeVar

Share = TypeVar("Share")
Result = TypeVar("Result")

#: The parent's handlers (journal, rollback, lock release) must never run in a child.
_CHILD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def can_fork() -> bool:
    """Whether forking is safe here: a POSIX system, and no other thread in this process."""
    return hasattr(os, "fork") and threading.active_count() == 1


def cpu_count() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def split(items: Sequence[Share], count: int) -> list[list[Share]]:
    """Pure: ``items`` dealt round-robin into ``count`` shares (the slow ones spread evenly)."""
    count = max(1, count)
    return [list(items[i::count]) for i in range(count)]


def map_forked(
    work: Callable[[Share], Result],
    shares: Sequence[Share],
    after_fork: Callable[[], None] | None = None,
) -> list[Result]:
    """``[work(share) for share in shares]``, with ``shares[1:]`` done in forked children. ``after_fork`` runs
    here once the children exist (e.g. to start threads, which must not exist at the fork). If this process is
    interrupted meanwhile, the children are killed and reaped."""
    results: dict[int, Result] = {}
    children: list[tuple[int, int, int]] = []  # (share index, child pid, read end)
    here = [0]
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _CHILD_SIGNALS)  # none while forking
    masked = True
    try:
        for index in range(1, len(shares)):
            read_fd, write_fd = os.pipe()
            try:
                child = os.fork()
            except OSError:
                os.close(read_fd)
                os.close(write_fd)
                here.append(index)
                continue
            if child == 0:
                os.close(read_fd)
                _run_child(write_fd, work, shares[index])
            os.close(write_fd)
            children.append((index, child, read_fd))
        masked = False  # a signal held back meanwhile is handled here, with every child known
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        if after_fork is not None:
            after_fork()
        for index in here:
            results[index] = work(shares[index])
        while children:
            index, child, read_fd = children[0]
            try:
                data = _read_all(read_fd)
            finally:
                os.close(read_fd)
                _, status = os.waitpid(child, 0)
                children.pop(0)
            results[index] = pickle.loads(data) if status == 0 and data else work(shares[index])
    except BaseException:
        for _index, child, read_fd in children:
            os.close(read_fd)
            os.kill(child, signal.SIGKILL)
            os.waitpid(child, 0)
        if masked:
            signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        raise
    return [results[index] for index in range(len(shares))]


def _run_child(write_fd: int, work: Callable[[Share], Result], share: Share) -> None:
    """In a forked child: do the share, send the pickled result, exit without the parent's cleanups."""
    status = 1
    try:
        for signum in _CHILD_SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _CHILD_SIGNALS)
        data = memoryview(pickle.dumps(work(share), pickle.HIGHEST_PROTOCOL))
        while data:
            data = data[os.write(write_fd, data) :]
        status = 0
    finally:
        os._exit(status)


def _read_all(read_fd: int) -> bytes:
    chunks = []
    while chunk := os.read(read_fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)
