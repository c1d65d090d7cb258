"""Observe installed files: stat them and hash them, streaming and in parallel.

The one place that reads file contents for verification. Files are hashed in chunks by
``hashlib.file_digest`` (which releases the GIL while hashing), largest first, on a thread pool.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

from safeinstall.records import encode_digest


@dataclass(frozen=True, slots=True)
class FileState:
    path: Path
    exists: bool
    is_file: bool = False
    size: int | None = None
    digest: str | None = None  # RECORD spelling, for `algorithm`
    algorithm: str | None = None
    nlink: int = 0
    device: int = 0
    inode: int = 0
    error: str | None = None  # set when the file exists but could not be read


@dataclass(frozen=True, slots=True)
class HashRequest:
    path: Path
    algorithm: str | None  # None: stat only


def default_workers() -> int:
    return min(32, (os.cpu_count() or 1) * 2)


def _observe(request: HashRequest) -> FileState:
    path = request.path
    try:
        info = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return FileState(path=path, exists=False)
    except OSError as exc:
        return FileState(path=path, exists=True, error=exc.strerror or str(exc))
    base = FileState(
        path=path,
        exists=True,
        is_file=stat.S_ISREG(info.st_mode),
        size=info.st_size,
        nlink=info.st_nlink,
        device=info.st_dev,
        inode=info.st_ino,
    )
    if request.algorithm is None or not base.is_file:
        return base
    try:
        with open(path, "rb", buffering=0) as handle:
            digest = hashlib.file_digest(handle, request.algorithm).digest()
    except OSError as exc:
        return replace(base, error=exc.strerror or str(exc))
    return replace(base, digest=encode_digest(digest), algorithm=request.algorithm)


def observe_files(
    requests: Sequence[HashRequest],
    workers: int | None = None,
    on_done: Callable[[FileState], None] | None = None,
    sizes: dict[Path, int] | None = None,
) -> dict[Path, FileState]:
    """Stat (and hash, where asked) every requested file; results keyed by path.

    ``sizes`` (expected sizes, e.g. from RECORD) orders the work largest-first so that one huge
    file does not finish last on a single thread.
    """
    if sizes is not None:
        ordered = sorted(requests, key=lambda r: sizes.get(r.path, 0), reverse=True)
    else:
        ordered = list(requests)
    results: dict[Path, FileState] = {}
    count = min(workers or default_workers(), max(1, len(ordered)))
    pending = iter(ordered)
    lock = threading.Lock()

    def work() -> None:
        # Each thread pulls the next file itself: one future per thread, not per file.
        while True:
            with lock:
                request = next(pending, None)
            if request is None:
                return
            state = _observe(request)
            with lock:
                results[request.path] = state
                if on_done:
                    on_done(state)

    if count == 1:
        work()
        return results
    threads = [threading.Thread(target=work, name=f"hash-{n}", daemon=True) for n in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def hash_bytes_of(path: Path, algorithm: str = "sha256") -> str:
    """One file's digest in RECORD spelling (streaming)."""
    with open(path, "rb", buffering=0) as handle:
        return encode_digest(hashlib.file_digest(handle, algorithm).digest())
