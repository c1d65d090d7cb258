"""The verified-inode store of an environment: ``<state>/<env>/inodes.bin``, root's, 0600, beside its
baseline (the decisions are :mod:`safeinstall.env.verified`'s; docs/verify.md has the argument).

Read as every state file is (:func:`safeinstall.store.state.read_private_file`: no symlink, no FIFO,
root's or the caller's, writable by nobody else, bounded) and every field checked: a header (its
name, the format's version, the boot it was written in, the number of entries, the environment's
prefix; each ended by a NUL, the last by NUL and newline),
then the entries' numbers (six signed 64-bit little-endian integers each: device, inode, size, mtime,
ctime, moment hashed) and their digests (43 characters each). A store of another environment or of
another boot (``/proc/sys/kernel/random/boot_id``: a filesystem restored or written offline keeps its
inode numbers and times, and device numbers are handed out anew at each boot) is not used, nor is one
that is damaged: everything is then hashed, and the store written anew.

Only what this process read and hashed itself is kept (never a worker's answer, an account's), and only
on a filesystem whose ``statfs`` type is one that keeps ctime (checked on a descriptor whose ``fstat``
shows the very device).
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
import time
from collections.abc import Iterable
from pathlib import Path

from safeinstall.env.hashing import FileState, Known
from safeinstall.env.records import built
from safeinstall.env.verified import (
    GRANULARITY_NS,
    MAX_AGE_NS,
    MAX_ENTRIES,
    InodeStore,
    VerifiedInode,
    checker,
    keepable,
    updated,
)
from safeinstall.store.state import (
    EnvironmentState,
    StateDirError,
    atomic_write,
    check_trusted,
    ensure_environment_dir,
    read_private_file,
    trusted_environment_state,
)

STORE_NAME = "inodes.bin"
STORE_VERSION = 2  # 2: whether the inode was root's alone when hashed (1 is read as damaged: written anew)
_NUMBERS = struct.Struct("<7q")
_DIGEST_CHARS = 43
_HEADER_MAX = 70_000  # the prefix is at most 64 KiB
#: the most bytes a store may have
STORE_LIMIT = _HEADER_MAX + MAX_ENTRIES * (_NUMBERS.size + _DIGEST_CHARS)
_DIGESTS = re.compile(rb"[A-Za-z0-9_-]*")
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
    entries = list(store.entries.values())
    texts = (str(STORE_VERSION), store.boot_id, str(len(entries)), store.prefix)
    header = b"\0".join([_MAGIC, *(text.encode("utf-8", "surrogateescape") for text in texts)])
    numbers = b"".join(
        _NUMBERS.pack(e.device, e.inode, e.size, e.mtime_ns, e.ctime_ns, e.hashed_ns, e.root_only)
        for e in entries
    )
    digests = "".join(e.digest for e in entries).encode("ascii")
    return header + b"\0\n" + numbers + digests


def from_bytes(raw: bytes, prefix: str, boot: str, now_ns: int) -> InodeStore:
    """Pure: a store read back, every field checked (ValueError: damaged, another environment's or
    another boot's). Entries no longer believable (too old, from the future) are left out."""
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
    if not _DIGESTS.fullmatch(digests):
        raise ValueError("a digest is not a sha256 digest")
    text = digests.decode("ascii")
    rows = list(_NUMBERS.iter_unpack(body[:split]))
    if any(row[0] < 0 or row[1] < 0 or row[2] < 0 or row[6] not in (0, 1) for row in rows):
        raise ValueError("an entry has a negative device, inode or size, or no root-only flag")
    if len({(row[0], row[1]) for row in rows}) != count:
        raise ValueError("an inode is there twice")
    # entry_problem's other checks, written out (61k entries for vLLM, at every check; the digests'
    # spelling was checked above, all at once): too old, from the future, racy: left out
    oldest, racy = now_ns - MAX_AGE_NS, GRANULARITY_NS
    entries = {
        (row[0], row[1]): built(VerifiedInode, (*row[:6], text[at : at + _DIGEST_CHARS], row[6]))
        for row, at in zip(rows, range(0, count * _DIGEST_CHARS, _DIGEST_CHARS), strict=True)
        if oldest <= row[5] <= now_ns and row[5] > 0 and row[4] + racy <= row[5]
    }
    return InodeStore(prefix, boot, entries)


def store_file(state: EnvironmentState) -> Path:
    return state.dir / STORE_NAME


def read_store(root: Path, prefix: Path) -> tuple[InodeStore | None, str | None]:
    """The environment's store under the state ``root`` (an empty one when there is none), or None and
    why it is not used (then every file is read, and none is kept)."""
    boot = boot_id()
    if boot is None:
        return None, "this boot's id is not known: every file is read"
    state = trusted_environment_state(root, prefix)
    empty = InodeStore(os.fspath(prefix), boot, {})
    try:
        check_trusted(root)
        if state.problem is not None:
            raise StateDirError(f"its directory {state.dir}: {state.problem}")
        raw = read_private_file(store_file(state), STORE_LIMIT)
        return from_bytes(raw, os.fspath(prefix), boot, time.time_ns()), None
    except FileNotFoundError:
        return empty, None
    except StateDirError as exc:
        return None, f"the verified-inode store was not used: {exc.message}"
    except (ValueError, UnicodeError):
        return empty, None  # damaged, or another boot's: everything is read, and it is written anew
    except OSError as exc:
        return None, f"the verified-inode store could not be read ({exc.strerror or exc})"


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
        with contextlib.suppress(OSError):
            fd = os.open(state.path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                magic = _fstatfs_magic(fd)
                if os.fstat(fd).st_dev == state.device and magic is not None:
                    found[state.device] = magic
            finally:
                os.close(fd)
    return found


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
        state = trusted_environment_state(root, prefix)
        ensure_environment_dir(state)
        atomic_write(store_file(state), to_bytes(new))
    except StateDirError as exc:
        return f"the verified-inode store was not kept: {exc.message}"
    except OSError as exc:
        return f"the verified-inode store was not kept ({exc.strerror or exc})"
    return None


def store_checker(
    store: InodeStore | None, fallback: Known | None = None, root_links: bool = False
) -> Known | None:
    """What the verification asks of the store (and of ``fallback``); None when there is neither.
    ``root_links``: see :func:`safeinstall.env.verified.checker`."""
    if store is None or not store.entries:
        return fallback
    return checker(store, fallback, root_links)
