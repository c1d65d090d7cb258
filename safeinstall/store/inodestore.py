"""The verified-inode store of an environment: ``<state>/<env>/inodes.bin``, root's, 0600.

Read with the state directory's checks, every field checked; one of another environment or boot, or
damaged, is not used. The decisions: :mod:`safeinstall.env.inodetrust`; the format: docs/verify.md.
"""

from __future__ import annotations

import contextlib
import os
import struct
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

from safeinstall.env.hashing import FileState, Known
from safeinstall.env.inodetrust import (
    CTIME_FILESYSTEMS,
    GRANULARITY_NS,
    MAX_AGE_NS,
    MAX_ENTRIES,
    InodeStore,
    VerifiedInode,
    checker,
    keepable,
    updated,
)
from safeinstall.env.records import built
from safeinstall.store.state import (
    EnvironmentState,
    StateDirError,
    load_store,
    write_store,
)

STORE_NAME = "inodes.bin"
#: 2: whether the inode was root's alone when hashed; 3: sorted by device and inode (an older one is
#: read as damaged: written anew)
STORE_VERSION = 3
_NUMBERS = struct.Struct("<7q")
_DIGEST_CHARS = 43
_HEADER_MAX = 70_000  # the prefix is at most 64 KiB
#: the most bytes a store may have
STORE_LIMIT = _HEADER_MAX + MAX_ENTRIES * (_NUMBERS.size + _DIGEST_CHARS)
_BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def boot_id() -> str | None:
    """This boot's id (None: not known; then no store is used or kept)."""
    try:
        text = _BOOT_ID.read_text(encoding="ascii").strip()
    except (OSError, UnicodeDecodeError):
        return None
    return text or None


_MAGIC = b"safeinstall-inodes"


def to_bytes(store: InodeStore) -> bytes:
    """Pure: the store as it is written (its header's fields end in NUL, which no path holds; ``json``
    is not loaded by a check that finds nothing new)."""
    entries = [entry for _key, entry in sorted(store.entries.items())]  # sorted: searched as read
    texts = (str(STORE_VERSION), store.boot_id, str(len(entries)), store.prefix)
    header = b"\0".join([_MAGIC, *(text.encode("utf-8", "surrogateescape") for text in texts)])
    numbers = b"".join(
        _NUMBERS.pack(e.device, e.inode, e.size, e.mtime_ns, e.ctime_ns, e.hashed_ns, e.root_only)
        for e in entries
    )
    digests = "".join(e.digest for e in entries).encode("ascii")
    return header + b"\0\n" + numbers + digests


def from_bytes(raw: bytes, prefix: str, boot: str, now_ns: int) -> InodeStore:
    """Pure: a store read back; ValueError when damaged or another environment's or boot's. Entries' numbers
    are checked when looked up (:class:`_Packed`); one no longer believable is not there."""
    header, newline, body = raw.partition(b"\0\n")
    if not newline or len(header) > _HEADER_MAX:
        raise ValueError("no header")
    fields = header.split(b"\0")
    if len(fields) != 5 or fields[0] != _MAGIC or fields[1] != str(STORE_VERSION).encode():
        raise ValueError("not a store of this version")
    if fields[4] != prefix.encode("utf-8", "surrogateescape"):
        raise ValueError(f"it is the store of {fields[4]!r}, not of {prefix}")
    if fields[2] != boot.encode("utf-8", "surrogateescape"):
        raise ValueError("it was written before the last boot")
    if not fields[3].isdigit() or len(fields[3]) > 7:
        raise ValueError("its count is not a number")
    count = int(fields[3])
    if not 0 <= count <= MAX_ENTRIES:
        raise ValueError(f"count {count!r} is not 0 to {MAX_ENTRIES}")
    split = count * _NUMBERS.size
    if len(body) != split + count * _DIGEST_CHARS:
        raise ValueError(f"{len(body)} bytes of entries, not those of {count}")
    digests = body[split:]
    if digests.translate(None, _DIGEST_ALPHABET):
        raise ValueError("a digest is not a sha256 digest")
    return InodeStore(prefix, boot, _Packed(body[:split], digests.decode("ascii"), count, now_ns))


_DIGEST_ALPHABET = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789_-"
_KEY = struct.Struct("<2q")
#: After this many lookups, every entry is read into a dict at once (cheaper than a search each).
_SEARCHES = 2048


class _Packed(Mapping[tuple[int, int], VerifiedInode]):
    """A store's entries as written (sorted by device and inode), each checked as it is looked up: a
    binary search over the packed numbers, then :func:`_entry`; once many are looked up, or all are
    listed, all of them are read and checked at once (an inode there twice: the first)."""

    __slots__ = ("_all", "_count", "_digests", "_now", "_rows", "_searches")

    def __init__(self, rows: bytes, digests: str, count: int, now_ns: int) -> None:
        self._rows, self._digests, self._count, self._now = rows, digests, count, now_ns
        self._all: dict[tuple[int, int], VerifiedInode] | None = None
        self._searches = 0

    def _entry(self, index: int) -> VerifiedInode | None:
        row = _NUMBERS.unpack_from(self._rows, index * _NUMBERS.size)
        if row[0] < 0 or row[1] < 0 or row[2] < 0 or row[6] not in (0, 1):
            return None
        # entry_problem's other checks, written out (the digest's spelling was checked as it was read):
        # too old, from the future, racy: not there
        hashed = row[5]
        if not (
            0 < hashed <= self._now and self._now - MAX_AGE_NS <= hashed and row[4] + GRANULARITY_NS <= hashed
        ):
            return None
        at = index * _DIGEST_CHARS
        return built(VerifiedInode, (*row[:6], self._digests[at : at + _DIGEST_CHARS], row[6]))

    def _every(self) -> dict[tuple[int, int], VerifiedInode]:
        if self._all is None:
            found: dict[tuple[int, int], VerifiedInode] = {}
            for index in range(self._count):
                entry = self._entry(index)
                if entry is not None:
                    found.setdefault((entry.device, entry.inode), entry)
            self._all = found
        return self._all

    def get(  # type: ignore[override]
        self, key: tuple[int, int], default: VerifiedInode | None = None
    ) -> VerifiedInode | None:
        if self._all is not None:
            return self._all.get(key, default)
        self._searches += 1
        if self._searches > _SEARCHES:
            return self._every().get(key, default)
        low, high, rows, unpack = 0, self._count, self._rows, _KEY.unpack_from
        while low < high:
            middle = (low + high) // 2
            if unpack(rows, middle * _NUMBERS.size) < key:
                low = middle + 1
            else:
                high = middle
        if low < self._count and unpack(rows, low * _NUMBERS.size) == key:
            entry = self._entry(low)
            if entry is not None:
                return entry
        return default

    def __getitem__(self, key: tuple[int, int]) -> VerifiedInode:
        entry = self.get(key)
        if entry is None:
            raise KeyError(key)
        return entry

    def __contains__(self, key: object) -> bool:
        return isinstance(key, tuple) and self.get(key) is not None

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self._every())

    def __len__(self) -> int:
        return len(self._every())

    def __bool__(self) -> bool:  # without reading every entry: whether any was written
        return self._count > 0 if self._all is None else bool(self._all)


def store_file(state: EnvironmentState) -> Path:
    return state.dir / STORE_NAME


def read_store(root: Path, prefix: Path) -> tuple[InodeStore | None, str | None]:
    """The environment's store under the state ``root`` (an empty one when there is none), or None and
    why it is not used (then every file is read, and none is kept)."""
    boot = boot_id()
    if boot is None:
        return None, "this boot's id is not known: every file is read"
    empty = InodeStore(os.fspath(prefix), boot, {})  # damaged, or another boot's: written anew

    def parse(raw: bytes) -> InodeStore:
        return from_bytes(raw, os.fspath(prefix), boot, time.time_ns())

    what = "the verified-inode store"
    return load_store(root, prefix, STORE_NAME, STORE_LIMIT, parse, empty, what, say_problem=True)


def _fstatfs_magic(fd: int) -> int | None:
    import ctypes  # only when something was hashed to be kept: a second check never loads it

    buffer = ctypes.create_string_buffer(256)  # struct statfs: its first field is the type (a long)
    try:
        call = ctypes.CDLL(None, use_errno=True).fstatfs
    except (OSError, AttributeError):
        return None
    if call(fd, buffer) != 0:
        return None
    return int(ctypes.c_long.from_buffer(buffer).value) & 0xFFFFFFFF


def filesystems(states: Iterable[FileState]) -> dict[int, int]:
    """device -> ``statfs`` type, for each device a hashed file is on, asked of a descriptor of one of
    its files whose ``fstat`` shows that device (a path swapped meanwhile cannot lend another's)."""
    found: dict[int, int] = {}
    for state in states:
        if not state.hashed_ns or state.device in found:
            continue
        magic = _magic_of(state.path, state.device)
        if magic is not None:
            found[state.device] = magic
    return found


def _magic_of(path: str, device: int) -> int | None:
    """The ``statfs`` type of ``path`` (not followed) when a descriptor of it shows ``device``."""
    with contextlib.suppress(OSError):
        fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            magic = _fstatfs_magic(fd)
            if os.fstat(fd).st_dev == device:
                return magic
        finally:
            os.close(fd)
    return None


def ctime_kept(known: Mapping[int, int]) -> Callable[[int, str], bool]:
    """Whether the filesystem of ``device`` keeps ctime as :data:`CTIME_FILESYSTEMS` says, asked of
    ``path`` (on that device) once per device; ``known``: device -> type already asked."""
    answers = {device: magic in CTIME_FILESYSTEMS for device, magic in known.items()}

    def kept(device: int, path: str) -> bool:
        answer = answers.get(device)
        if answer is None:
            answer = answers[device] = _magic_of(path, device) in CTIME_FILESYSTEMS
        return answer

    return kept


def keep(root: Path, prefix: Path, store: InodeStore | None, states: Iterable[FileState]) -> str | None:
    """After a check: what it hashed, into the environment's store (best effort; a note when it could not
    be written). ``store`` None: it was not to be used (then it is not written either)."""
    if store is None:
        return None
    hashed = [state for state in states if state.hashed_ns]  # read here (a second check: none)
    systems = filesystems(hashed)
    if not any(keepable(state, systems) for state in hashed):
        return None  # nothing new (the entries read were checked as they were read)
    new = updated(store, hashed, systems, time.time_ns())
    if new.entries == store.entries:
        return None
    try:
        write_store(root, prefix, STORE_NAME, to_bytes(new))
    except StateDirError as exc:
        return f"the verified-inode store was not kept: {exc.message}"
    except OSError as exc:
        return f"the verified-inode store was not kept ({exc.strerror or exc})"
    except (struct.error, UnicodeError) as exc:  # never expected (keepable checks): a note, not a crash
        return f"the verified-inode store was not kept ({exc})"
    return None


def store_checker(
    store: InodeStore | None, fallback: Known | None = None, root_links: bool = False
) -> Known | None:
    """What the verification asks of the store (and of ``fallback``); None when there is neither.
    ``root_links``: see :func:`safeinstall.env.inodetrust.checker`."""
    if store is None or not store.entries:
        return fallback
    return checker(store, fallback, root_links)
