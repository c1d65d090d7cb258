"""Installed files stated and hashed, in parallel, each opened once by directory descriptor.

The one place that reads file contents for verification; a symlink, FIFO or device is never opened.
How the work is split over threads: docs/performance.md."""

from __future__ import annotations

import contextlib
import gc
import hashlib
import mmap
import operator
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import NamedTuple, Protocol

from safeinstall.env.containment import is_within
from safeinstall.env.records import built, encode_digest
from safeinstall.system.forking import cpu_count
from safeinstall.system.safefs import reopen
from safeinstall.system.signals import held_while_threads_start


class FileState(NamedTuple):
    """What one file was found to be. Immutable like the frozen dataclasses elsewhere, but a
    ``NamedTuple``: one is built for every file verified (12k for torch), and a frozen dataclass's
    ``__init__`` (one ``object.__setattr__`` per field) cost 0.05 s of the thread that reads the small
    files, a ``NamedTuple`` a fifth of it."""

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
    ctime_ns: int = 0
    #: the digest is a hash taken earlier of this very inode, proven unchanged (see :data:`Known`)
    by_identity: bool = False
    #: read and hashed here: the clock (``time.time_ns()``) before the ``fstat`` of the descriptor read,
    #: whose identity (device, inode, size, times) was the same after the read; 0: not so (proven by
    #: identity, not read, or changed while read). What :mod:`safeinstall.env.inodetrust` may keep.
    hashed_ns: int = 0
    #: ``st_mode`` of a regular file (its permission bits: a script's execute bits, setuid), else 0
    mode: int = 0
    #: ``st_uid`` of a regular file it looked at (-1: not known): who could write it when it was hashed
    uid: int = -1


#: Given a file's ``lstat`` and the algorithm wanted, the digest of that very inode when it was hashed
#: earlier and is proven unchanged since (:mod:`safeinstall.env.inodes`); None: read and hash it.
Known = Callable[[os.stat_result, str], str | None]


class Wanted(Protocol):
    """What :func:`observe_files` needs of each file (a :class:`~safeinstall.env.drift.Expectation` is
    one)."""

    @property
    def location(self) -> str: ...  # absolute, normalised (pathlib costs more than a small file's hash)

    @property
    def algorithm(self) -> str | None: ...  # None: stat only

    @property
    def size(self) -> int | None: ...  # expected: orders the work, costliest first


def default_workers() -> int:
    """Threads for file work: one per CPU this process may run on (at most 32)."""
    return max(1, min(32, cpu_count()))


#: No file is hashed beyond this (a wheel's members are refused beyond it too): larger is reported.
LARGEST_FILE = 16 << 30
#: Files at least this large are a task of their own, streamed in chunks; smaller ones are read whole.
BIG_FILE = 1 << 20
#: A task holds at most this many small files of one directory (torch has 7,048 in one directory).
CHUNK_FILES = 128
#: What opening, reading and closing a small file costs, counted in bytes hashed (about 15 us).
_PER_FILE_COST = 20_000

#: The usual RECORD algorithms, called directly: ``hashlib.new`` costs more than hashing a small file.
_CONSTRUCTORS: dict[str, Callable[[bytes | memoryview], hashlib._Hash]] = {
    "sha256": hashlib.sha256,
    "sha384": hashlib.sha384,
    "sha512": hashlib.sha512,
}


def _new_hash(algorithm: str, data: bytes | memoryview = b"") -> hashlib._Hash:
    constructor = _CONSTRUCTORS.get(algorithm)
    return constructor(data) if constructor else hashlib.new(algorithm, data)


#: A file is pinned (``O_PATH``, nothing opened) and its ``fstat`` seen before it is opened for real.
_PIN_FLAGS = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC
#: A directory to list and to open files relative to; where it cannot be read, one only searched.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
_DIR_SEARCH_FLAGS = getattr(os, "O_PATH", os.O_RDONLY) | os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)


def _not_regular(path: str, info: os.stat_result) -> FileState:
    """A symlink, FIFO, device, socket or directory where a file is expected: never opened or read."""
    ids = (info.st_nlink, info.st_dev, info.st_ino, None, info.st_mtime_ns, info.st_ctime_ns)
    return FileState(path, True, False, info.st_size, None, None, *ids)


def _unopened(path: str, name: str, dir_fd: int | None) -> FileState | None:
    """``lstat`` a file before it is opened: its state when it is not a regular file (or is not
    there), ``None`` when it is one and may be opened."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return FileState(path, False)
    except OSError as exc:
        return FileState(path, True, error=exc.strerror or str(exc))
    return None if stat.S_ISREG(info.st_mode) else _not_regular(path, info)


#: The most bytes one :func:`observe_files` reads (a check, a run's verification): the environment's
#: owner decides how large its files are (up to :data:`LARGEST_FILE` each, sparse: no disk needed).
#: vLLM's whole environment is 9 GB; past the budget a file is reported "not checked", never clean.
READ_BUDGET = 256 << 30


#: What moves when a file's bytes may have: device, inode, size, modification and change times.
_identity = operator.attrgetter("st_dev", "st_ino", "st_size", "st_mtime_ns", "st_ctime_ns")


class Reading:
    """What one :func:`observe_files` may read: each inode once (a file of several links is hashed by
    the first path that reaches it; the others take its digest while its identity is the same), and at
    most ``budget`` bytes in all."""

    __slots__ = ("_lock", "_reading", "_seen", "left", "total")

    def __init__(self, budget: int) -> None:
        self.total = self.left = budget
        self._lock = threading.Lock()
        self._seen: dict[tuple[int, int, int, int, int, str], str] = {}
        self._reading: dict[tuple[int, int, int, int, int, str], threading.Event] = {}

    def again(self, info: os.stat_result, algorithm: str) -> str | None:
        """The digest this check took of that very inode, as it is now, by another of its links (one
        being read by another thread is waited for); None: the caller reads it, then calls
        :meth:`remember` whatever came of it."""
        if info.st_nlink <= 1:
            return None
        key = (*_identity(info), algorithm)
        with self._lock:
            digest = self._seen.get(key)
            if digest is not None:
                return digest
            pending = self._reading.get(key)
            if pending is None:
                self._reading[key] = threading.Event()
                return None
        pending.wait()
        return self._seen.get(key)

    def remember(self, info: os.stat_result, algorithm: str, digest: str | None) -> None:
        """The digest read of a linked inode (None: it could not be), for its other links."""
        if info.st_nlink <= 1:
            return
        key = (*_identity(info), algorithm)
        with self._lock:
            if digest is not None:
                self._seen[key] = digest
            pending = self._reading.pop(key, None)
        if pending is not None:
            pending.set()

    def take(self, size: int) -> bool:
        """``size`` bytes may be read (taken from the budget), or the budget is spent."""
        with self._lock:
            if size > self.left:
                self.left = 0
                return False
            self.left -= size
            return True


def _observe(
    path: str,
    name: str,
    dir_fd: int | None,
    algorithm: str | None,
    regular: frozenset[str] | None,
    buffer: memoryview,
    started_ns: int = 0,
    reading: Reading | None = None,
) -> FileState:
    """One file, by ``name`` relative to ``dir_fd``; a name the listing does not show as ``regular`` is
    opened only when its ``lstat`` shows a regular file.

    Read into the thread's ``buffer`` (a new ``bytes`` each cost page faults, docs/performance.md);
    ``started_ns`` is kept as ``hashed_ns`` when the identity did not change during the read."""
    if regular is None or name not in regular:
        unopened = _unopened(path, name, dir_fd)
        if unopened is not None:
            return unopened
    try:  # pinned first: a FIFO or a device swapped in since the listing is never opened
        pinned = os.open(name, _PIN_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        return FileState(path, False)
    except OSError as exc:
        return FileState(path, True, error=exc.strerror or str(exc))
    try:
        info = os.fstat(pinned)
        if not stat.S_ISREG(info.st_mode):  # swapped since the listing (a symlink is not followed): not read
            return _not_regular(path, info)
        fd = reopen(pinned, path)
    except OSError as exc:
        return FileState(path, True, error=exc.strerror or str(exc))
    finally:
        os.close(pinned)
    claimed: tuple[os.stat_result, str] | None = None  # a linked inode this thread reads for the others
    kept: str | None = None
    try:
        size = info.st_size
        if algorithm is None:
            digest = None
        elif size > LARGEST_FILE:  # a sparse file of terabytes would keep root hashing zeros for hours
            return FileState(path, True, error=f"{size} bytes: larger than any wheel may install")
        elif reading is not None and (again := reading.again(info, algorithm)) is not None:
            digest = again  # another link of an inode this check hashed, unchanged since
        elif reading is not None and (claimed := (info, algorithm)) and not reading.take(size):
            spent = f"not checked: this check's budget of {reading.total} bytes read is spent"
            return FileState(path, True, error=spent)
        elif size < BIG_FILE:
            count = os.readv(fd, [buffer[: size + 1]])
            while 0 < count < size:  # a short read (network filesystems)
                more = os.readv(fd, [buffer[count : size + 1]])
                if not more:
                    break
                count += more
            digest = encode_digest(_new_hash(algorithm, buffer[:count]).digest())
        else:
            digest = encode_digest(_stream_digest(fd, algorithm, buffer, size + 1))
        hashed_ns = started_ns if digest is not None and _identity(info) == _identity(os.fstat(fd)) else 0
        kept = digest if hashed_ns else None
    except OSError as exc:
        return FileState(path, True, error=exc.strerror or str(exc))
    finally:
        os.close(fd)
        if claimed is not None and reading is not None:
            reading.remember(*claimed, kept)
    return _regular(path, info, digest, algorithm, False, hashed_ns)


def _by_identity(path: str, name: str, dir_fd: int | None, algorithm: str, known: Known) -> FileState | None:
    """The file's state from an ``lstat`` alone when ``known`` proves it to be an inode hashed earlier
    and unchanged since; None: it must be read (not there, not a regular file, not proven)."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode):
        return None
    digest = known(info, algorithm)
    if digest is None:
        return None
    return _regular(path, info, digest, algorithm, True, 0)


def _regular(
    path: str,
    info: os.stat_result,
    digest: str | None,
    algorithm: str | None,
    by_identity: bool,
    hashed_ns: int,
) -> FileState:
    """Pure: a regular file's state from its ``stat`` (built as a tuple: one per file verified)."""
    ids = (info.st_nlink, info.st_dev, info.st_ino, None, info.st_mtime_ns, info.st_ctime_ns)
    head = (path, True, True, info.st_size, digest, algorithm)
    return built(FileState, (*head, *ids, by_identity, hashed_ns, info.st_mode, info.st_uid))


#: A large file is hashed in chunks this big: each chunk takes the GIL twice (after ``readv`` and after
#: hashing it), and a thread that must wait for it behind Python work waits less often.
STREAM_CHUNK = 4 << 20


@contextmanager
def cycle_collection_paused(frozen: bool = False) -> Iterator[None]:
    """Python's cycle collector off inside the block, then as it was: only around work that builds many
    objects and no cycles, whose collections walked every object (a cycle made inside stays until the
    block ends). ``frozen``: what the block made is frozen at its end (still freed by its reference
    counts, never walked by a collection again): docs/performance.md."""
    enabled = gc.isenabled()
    try:
        gc.disable()
        yield
    finally:
        if frozen:
            gc.freeze()
        if enabled:
            gc.enable()


def read_buffer() -> memoryview:
    """A thread's read buffer: ``STREAM_CHUNK`` bytes on a page boundary, populated at once (an unaligned
    ``bytearray`` copied 4-5x slower on Zen: docs/performance.md)."""
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | getattr(mmap, "MAP_POPULATE", 0)
    return memoryview(mmap.mmap(-1, STREAM_CHUNK, flags=flags))


def _stream_digest(fd: int, algorithm: str, buffer: memoryview, limit: int) -> bytes:
    """The raw digest of at most ``limit`` bytes that ``fd`` reads from where it is, through ``buffer``.
    The caller gives one byte more than ``fstat`` said: a file that grows while it is read (its owner
    can watch root open it) hashes differently, as it should, and cannot keep root reading."""
    hasher = _new_hash(algorithm)
    left = limit
    while left > 0 and (count := os.readv(fd, [buffer[: min(left, len(buffer))]])):
        hasher.update(buffer[:count])
        left -= count
    return hasher.digest()


class _Directory:
    """One directory of requested files, shared by the tasks of its chunks: opened and listed once, by
    the first task that needs it, and closed by the last one done with it."""

    __slots__ = (
        "_fd",
        "_list",
        "_listed",
        "_lock",
        "_opened",
        "_problem",
        "_regular",
        "_users",
        "path",
        "within",
    )

    def __init__(self, path: str, users: int, list_it: bool, within: str | None) -> None:
        self.path = path
        self.within = within
        self._list = list_it  # a listing costs about 1 us an entry: worth it for several files
        self._lock = threading.Lock()
        self._users = users
        self._fd: int | None = None
        self._regular: frozenset[str] | None = None
        self._problem: str | None = None
        self._opened = False
        self._listed = False

    def enter(self) -> tuple[int | None, frozenset[str] | None, str | None]:
        """The directory's descriptor (``None``: it could not be opened, its files are opened by their
        paths, after an ``lstat`` each), the names of its regular files (``None``: not listed), and
        why none of its files may be opened at all (``MISSING``, or what was wrong), or ``None``."""
        with self._lock:
            if not self._opened:
                self._opened = True
                self._fd, self._problem = _open_directory(self.path, self._list, self.within)
            if self._list and not self._listed:
                self._listed = True
                self._regular = None if self._fd is None else _regular_names(self._fd)
            return self._fd, self._regular, self._problem

    def leave(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users == 0:
                self._close()

    def close(self) -> None:
        """Closes it once the pool has stopped, whatever tasks of it never ran (after a failure)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


#: A directory's problem: it is not there (nor are its files).
MISSING = "missing"


def _open_directory(path: str, list_it: bool, within: str | None) -> tuple[int | None, str | None]:
    """Open ``path`` as the caller's containment check resolved it. With ``within``, what was opened must
    be below that real directory (a symlink swapped in since must not lead root out); a directory that
    cannot be opened gets no file opened by its path."""
    fd: int | None = None
    failure: OSError | None = None
    if list_it:
        with contextlib.suppress(OSError):  # e.g. searchable but not readable: opened below, not listed
            fd = os.open(path, _DIR_FLAGS)
    if fd is None:
        try:
            fd = os.open(path, _DIR_SEARCH_FLAGS)
        except OSError as exc:
            failure = exc
    if within is None:
        return fd, None
    if fd is None:
        return None, MISSING if isinstance(failure, FileNotFoundError) else _reason(failure)
    real = _opened_path(fd)
    if real is None or not is_within(real, within):
        os.close(fd)
        return None, f"its directory now resolves to {real or 'an unknown place'}, outside {within}"
    return fd, None


def _regular_names(fd: int) -> frozenset[str] | None:
    """The names of the regular files the directory open as ``fd`` lists (None: it cannot be listed:
    opened only to be searched, or the listing failed)."""
    try:
        with os.scandir(fd) as entries:
            return frozenset(e.name for e in entries if e.is_file(follow_symlinks=False))
    except OSError:
        return None


def _reason(failure: OSError | None) -> str:
    return "unknown" if failure is None else failure.strerror or str(failure)


def _opened_path(fd: int) -> str | None:
    """Where the directory open as ``fd`` is, as the kernel knows it (None: not known)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


#: (path, name in its directory, algorithm, expected size)
_File = tuple[str, str, str | None, int]


@dataclass(frozen=True, slots=True)
class _Task:
    directory: _Directory | None  # None: paths that are not absolute, opened as given
    files: tuple[_File, ...]
    cost: int
    large: bool  # one file of BIG_FILE bytes or more

    def run(self, buffer: memoryview, reading: Reading | None = None) -> list[FileState]:
        directory = self.directory
        dir_fd, regular, problem = (None, None, None) if directory is None else directory.enter()
        started_ns = time.time_ns()  # before any of its files is opened: see FileState.hashed_ns
        try:
            if problem is not None:  # none of its files is opened
                return [
                    FileState(path, False) if problem == MISSING else FileState(path, True, error=problem)
                    for path, _name, _algorithm, _size in self.files
                ]
            return [
                _observe(
                    path,
                    path if dir_fd is None else name,
                    dir_fd,
                    algorithm,
                    regular,
                    buffer,
                    started_ns,
                    reading,
                )
                for path, name, algorithm, _size in self.files
            ]
        finally:
            if directory is not None:
                directory.leave()


#: A directory with at least this many requested files is listed (one ``getdents`` pass) instead of
#: an ``lstat`` for each file.
_LIST_FROM = 4


def plan_tasks(wanted: Sequence[Wanted], within: str | None = None) -> list[_Task]:
    """The work, costliest first (by expected size): each file of ``BIG_FILE`` bytes or more a task of
    its own, the others in chunks of at most ``CHUNK_FILES`` files of one directory."""
    by_directory: dict[str | None, tuple[list[_File], list[_File]]] = {}
    for want in wanted:
        path = want.location
        directory, _, name = path.rpartition("/")
        key = (directory or "/") if path[:1] == "/" else None
        groups = by_directory.setdefault(key, ([], []))
        size = want.size or 0
        groups[size >= BIG_FILE].append((path, name, want.algorithm, size))
    tasks: list[_Task] = []
    for key, (small, big) in by_directory.items():
        chunks = [small[i : i + CHUNK_FILES] for i in range(0, len(small), CHUNK_FILES)]
        users = len(big) + len(chunks)
        shared = None if key is None else _Directory(key, users, len(small) >= _LIST_FROM, within)
        for file in big:
            tasks.append(_Task(shared, (file,), file[3] + _PER_FILE_COST, True))
        for chunk in chunks:
            cost = sum(f[3] for f in chunk) + _PER_FILE_COST * len(chunk)
            tasks.append(_Task(shared, tuple(chunk), cost, False))
    tasks.sort(key=lambda task: -task.cost)
    return tasks


def _proven(
    wanted: Sequence[Wanted], within: str | None, known: Known, results: dict[str, FileState]
) -> list[Wanted]:
    """The wanted files that ``known`` proves by identity (an ``lstat`` each, within ``within``), into
    ``results``; returns the others, to be read. Proven first, so an unchanged check plans no task."""
    by_directory: dict[str, list[Wanted]] = {}
    rest: list[Wanted] = []
    for want in wanted:
        path = want.location
        if want.algorithm is None or path[:1] != "/":
            rest.append(want)
            continue
        by_directory.setdefault(path.rpartition("/")[0] or "/", []).append(want)
    for directory, group in by_directory.items():
        fd, _problem = _open_directory(directory, False, within)
        if fd is None:  # missing, or not within: its tasks say so
            rest.extend(group)
            continue
        try:
            for want in group:
                path, algorithm = want.location, want.algorithm
                proven = (
                    None
                    if algorithm is None
                    else _by_identity(path, path.rpartition("/")[2], fd, algorithm, known)
                )
                if proven is None:
                    rest.append(want)
                else:
                    results[path] = proven
        finally:
            os.close(fd)
    return rest


def observe_files(
    wanted: Sequence[Wanted],
    workers: int | None = None,
    on_progress: Callable[[int], None] | None = None,
    meanwhile: Callable[[], object] | None = None,
    within: str | None = None,
    known: Known | None = None,
    budget: int = READ_BUDGET,
) -> dict[str, FileState]:
    """Stat (and hash, with ``algorithm``) every wanted file, each inode read once; results by location.

    At most ``budget`` bytes; ``workers`` threads; ``on_progress``: the count done (what it raises is
    raised here); ``meanwhile``: other work; ``within``: a directory every file must be in;
    ``known``: digests of unchanged inodes."""
    results: dict[str, FileState] = {}
    reading = Reading(budget)
    if known is not None:  # first what the kept hashes prove: only the rest is planned and read
        wanted = _proven(wanted, within, known, results)
        if on_progress is not None and results:
            on_progress(len(results))
    tasks = plan_tasks(wanted, within)
    large: Iterator[_Task] = iter([task for task in tasks if task.large])
    small: Iterator[_Task] = iter([task for task in tasks if not task.large])
    failures: list[BaseException] = []
    stop = threading.Event()  # set: no thread starts another task
    lock = threading.Lock()
    done = len(results)

    def work(*queues: Iterator[_Task]) -> None:
        nonlocal done
        buffer = read_buffer()  # this thread's: every file is read into it
        for queue in queues:
            while True:
                with lock:
                    task = None if stop.is_set() else next(queue, None)
                if task is None:
                    break
                states = task.run(buffer, reading)
                with lock:
                    for state in states:
                        results[state.path] = state
                    done += len(states)
                    if on_progress is not None:
                        on_progress(done)

    def helper(queue: Iterator[_Task]) -> None:
        try:
            work(queue)
        except BaseException as exc:  # a bug or on_progress's, not a file's problem: raised on the
            with lock:  # calling thread (here it would end this thread with a traceback, and be lost)
                failures.append(exc)
            stop.set()

    helpers = min((workers or default_workers()) - 1, sum(task.large for task in tasks))
    threads = [
        threading.Thread(target=helper, args=(large,), name=f"hash-{n}", daemon=True)
        for n in range(1, helpers + 1)
    ]
    with held_while_threads_start():
        for thread in threads:
            thread.start()
    try:
        if meanwhile is not None:
            meanwhile()
        with cycle_collection_paused():
            work(small, large)
    finally:  # done, or stopped by an exception (a bug, on_progress's, meanwhile's, a signal)
        stop.set()  # the helpers end after their current file (none is left unless this thread failed)
        interrupted = _join(threads)
        for directory in {task.directory for task in tasks if task.directory is not None}:
            directory.close()  # already closed unless a failure stopped its other tasks
        if interrupted is not None:
            raise interrupted
    if failures:
        raise failures[0]
    return results


def _join(threads: Sequence[threading.Thread]) -> BaseException | None:
    """Wait for every thread to end and return the signal that came meanwhile, raised by the caller once
    the directories are closed (a helper must not have its descriptor closed under it). A second signal
    is raised at once; the descriptors then stay open until the process ends."""
    pending: BaseException | None = None
    for thread in threads:
        while True:
            try:
                thread.join()
                break
            except BaseException as exc:
                if pending is not None:
                    raise
                pending = exc
    return pending
