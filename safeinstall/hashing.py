"""Observe installed files: stat them and hash them, streaming and in parallel.

The one place that reads file contents for verification. Each file is opened once (symlinks are not
followed, FIFOs never block). Large files stream through ``hashlib.file_digest`` on worker threads,
largest first (hashlib releases the GIL on large buffers); small ones are read whole on the calling
thread at the same time.
"""

from __future__ import annotations

import hashlib
import os
import stat
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from safeinstall.records import encode_digest


@dataclass(frozen=True, slots=True)
class FileState:
    path: str
    exists: bool
    is_file: bool = False
    size: int | None = None
    digest: str | None = None  # RECORD spelling, for `algorithm`
    algorithm: str | None = None
    nlink: int = 0
    device: int = 0
    inode: int = 0
    error: str | None = None  # set when the file exists but could not be read
    mtime_ns: int = 0


@dataclass(frozen=True, slots=True)
class HashRequest:
    path: str  # absolute; a plain string: pathlib costs more than the hashing of a small file
    algorithm: str | None  # None: stat only


def default_workers() -> int:
    return min(32, os.cpu_count() or 1)


#: Files at least this large are streamed, on worker threads (hashlib releases the GIL while it hashes
#: large buffers); smaller ones are read whole, on one thread, where no GIL hand-offs slow them down.
BIG_FILE = 1 << 20

#: The usual RECORD algorithms, called directly: ``hashlib.new`` costs more than hashing a small file.
_CONSTRUCTORS: dict[str, Callable[[bytes], hashlib._Hash]] = {
    "sha256": hashlib.sha256,
    "sha384": hashlib.sha384,
    "sha512": hashlib.sha512,
}

_OPEN_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0)
#: A directory only to open files relative to (O_PATH: searching it is enough, as for a path walk).
_DIR_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)


def _observe(request: HashRequest, dir_fd: int | None = None, name: str | None = None) -> FileState:
    """One file: opened once (never following a symlink, never blocking on a FIFO), fstat, hashed.

    ``dir_fd``: the descriptor of the directory that holds it (opened by its path, as the kernel walks
    an absolute path) and ``name`` its name there: the file is opened relative to it.
    Small files are read in one call; large ones stream through ``hashlib.file_digest``.
    """
    path = request.path
    try:
        fd = (
            os.open(path, _OPEN_FLAGS)
            if dir_fd is None
            else os.open(name or path, _OPEN_FLAGS, dir_fd=dir_fd)
        )
    except FileNotFoundError:
        return FileState(path, False)
    except OSError as exc:
        # ELOOP: a symlink (not followed); other errors: exists but unreadable
        try:
            info = os.lstat(path)
        except OSError:
            return FileState(path, True, error=exc.strerror or str(exc))
        if stat.S_ISLNK(info.st_mode):
            return FileState(
                path, True, False, info.st_size, None, None, info.st_nlink, info.st_dev, info.st_ino
            )
        return FileState(path, True, error=exc.strerror or str(exc))
    try:
        info = os.fstat(fd)
        regular = stat.S_ISREG(info.st_mode)
        if request.algorithm is None or not regular:
            return FileState(
                path,
                True,
                regular,
                info.st_size,
                None,
                None,
                info.st_nlink,
                info.st_dev,
                info.st_ino,
                mtime_ns=info.st_mtime_ns,
            )
        if info.st_size < BIG_FILE:
            # One read: asking for one byte more than the size returns the whole file and shows that
            # it ended there (a file that grew under us hashes differently, as it should).
            data = os.read(fd, info.st_size + 1)
            while len(data) < info.st_size:  # a short read (network filesystems)
                more = os.read(fd, BIG_FILE)
                if not more:
                    break
                data += more
            constructor = _CONSTRUCTORS.get(request.algorithm)
            hashed = constructor(data) if constructor else hashlib.new(request.algorithm, data)
            digest = hashed.digest()
        else:
            with os.fdopen(os.dup(fd), "rb", buffering=0) as handle:
                digest = hashlib.file_digest(handle, request.algorithm).digest()
    except OSError as exc:
        return FileState(path, True, error=exc.strerror or str(exc))
    finally:
        os.close(fd)
    return FileState(
        path,
        True,
        True,
        info.st_size,
        encode_digest(digest),
        request.algorithm,
        info.st_nlink,
        info.st_dev,
        info.st_ino,
        mtime_ns=info.st_mtime_ns,
    )


def _observe_in_directories(requests: Sequence[HashRequest], record: Callable[[FileState], None]) -> None:
    """:func:`_observe` each request, opening each directory once (by its path: what an absolute open
    would walk) and each file relative to it; a directory that cannot be opened leaves its files to
    absolute opens (the same errors, reported per file)."""
    by_directory: dict[str | None, list[HashRequest]] = {}
    for request in requests:
        directory = request.path.rpartition("/")[0] or "/"
        by_directory.setdefault(directory if request.path.startswith("/") else None, []).append(request)
    for held, listed in by_directory.items():
        try:
            dir_fd = None if held is None else os.open(held, _DIR_FLAGS)
        except OSError:
            dir_fd = None
        try:
            for request in listed:
                record(_observe(request, dir_fd, request.path.rpartition("/")[2]))
        finally:
            if dir_fd is not None:
                os.close(dir_fd)


def observe_files(
    requests: Sequence[HashRequest],
    workers: int | None = None,
    on_done: Callable[[FileState], None] | None = None,
    sizes: dict[str, int] | None = None,
) -> dict[str, FileState]:
    """Stat (and hash, where asked) every requested file; results keyed by path.

    ``sizes`` (expected sizes, e.g. from RECORD) sends large files, largest first, to worker threads
    while the calling thread works through the small ones. Python threads only help where hashlib
    runs without the GIL, that is on large buffers: measured on torch, threads over thousands of
    small files were twice as slow as one thread.
    """
    known = sizes or {}
    big = sorted((r for r in requests if known.get(r.path, 0) >= BIG_FILE), key=lambda r: -known[r.path])
    small = [r for r in requests if known.get(r.path, 0) < BIG_FILE]
    results: dict[str, FileState] = {}
    lock = threading.Lock()
    pending = iter(big)

    def record(state: FileState) -> None:
        with lock:
            results[state.path] = state
            if on_done:
                on_done(state)

    def work_big() -> None:
        while True:
            with lock:
                request = next(pending, None)
            if request is None:
                return
            record(_observe(request))

    count = min(workers or default_workers(), len(big))
    threads = [threading.Thread(target=work_big, name=f"hash-{n}", daemon=True) for n in range(count)]
    for thread in threads:
        thread.start()
    _observe_in_directories(small, record)
    work_big()  # then help with what is left of the large ones
    for thread in threads:
        thread.join()
    return results
