"""The verified-inode store's decisions (pure): which hash of a file may be kept, and when a kept one
may stand for reading the file again (``git``'s index, for verification).

Why that is sound, and what it does not cover: docs/verify.md ("The verified-inode store")."""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from safeinstall.env.hashing import FileState, Known
from safeinstall.system.safefs import owner_alone_writes

#: The only algorithm kept (wheels and uv's RECORDs use it).
ALGORITHM = "sha256"
#: A ctime this close to the moment of the hash (or later) may hide a write after it: hashed again.
#: Two seconds: the coarsest timestamps of a filesystem kept (ext2/3's whole seconds, plus the tick).
GRANULARITY_NS = 2_000_000_000
#: An entry is kept at most this long after its hash (a day): what the cases above could hide shows
#: within a day, at the cost of one full read a day (the metrics timer's runs in between are cheap).
MAX_AGE_NS = 24 * 3600 * 1_000_000_000
#: At most this many entries (91 bytes each): the newest hashes are kept.
MAX_ENTRIES = 1_000_000
#: ``statfs`` magic numbers of the filesystems whose ctime the kernel keeps as described: ext2/3/4,
#: XFS, btrfs, F2FS, ZFS, overlayfs. On any other (NFS, FUSE, vfat, ...) nothing is kept; nor on tmpfs,
#: where a write through a shared writable mapping never moves a file's times (the attacker review).
CTIME_FILESYSTEMS = frozenset({0xEF53, 0x58465342, 0x9123683E, 0xF2F52010, 0x2FC12FC1, 0x794C7630})
#: What a kept number must lie within: a signed 64-bit field. A time the owner set with ``touch -d
#: 2400-01-01``, an inode number of overlayfs' ``xino``, of NFS or of FUSE may lie past it: such an
#: identity is neither kept nor proven by either store (its file is read and compared as before).
LOWEST, HIGHEST = -(1 << 63), (1 << 63) - 1
#: A sha256 digest in RECORD spelling (urlsafe base64, no padding).
_DIGEST = re.compile(r"[A-Za-z0-9_-]{43}")


class VerifiedInode(NamedTuple):
    """One hash kept: the inode as it was when its bytes were read and hashed. Immutable, a
    ``NamedTuple`` as :class:`~safeinstall.env.hashing.FileState` is: one is built for each of an
    environment's files (61k for vLLM's) every time the store is read, and a frozen dataclass's
    ``__init__`` would cost the cached check most of its time."""

    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    hashed_ns: int  # the clock before the fstat of the descriptor that was read
    digest: str  # sha256, RECORD spelling
    #: 1 when root owned the file and only root could write it as it was hashed (the condition of
    #: :func:`root_only_digest`: a hash taken while an account owned it never stands that way), else 0
    root_only: int = 0


@dataclass(frozen=True, slots=True)
class InodeStore:
    """An environment's kept hashes, bound to its prefix and to the boot they were taken in."""

    prefix: str
    boot_id: str
    entries: Mapping[tuple[int, int], VerifiedInode]


def is_racy(ctime_ns: int, hashed_ns: int, granularity_ns: int = GRANULARITY_NS) -> bool:
    """Pure: could a change after the hash have left this ctime? (Any change at or after ``hashed_ns``
    gets a ctime later than ``hashed_ns - granularity_ns``.)"""
    return ctime_ns + granularity_ns > hashed_ns


def entry_problem(entry: VerifiedInode, now_ns: int) -> str | None:
    """Pure: why a kept entry must not be believed (or None): every field checked, as read back."""
    if min(entry.device, entry.inode, entry.size) < 0:
        return "a negative device, inode or size"
    if not _DIGEST.fullmatch(entry.digest):
        return "not a sha256 digest"
    if entry.hashed_ns <= 0 or entry.hashed_ns > now_ns:
        return "hashed in the future (the clock went back)"
    if now_ns - entry.hashed_ns > MAX_AGE_NS:
        return "older than a day"
    if is_racy(entry.ctime_ns, entry.hashed_ns):
        return "racy: its ctime is within the timestamp granularity of its hash"
    return None


def fits(numbers: tuple[int, ...]) -> bool:
    """Pure: every one of ``numbers`` can be kept (in a signed 64-bit field, :data:`LOWEST` to
    :data:`HIGHEST`)."""
    return min(numbers) >= LOWEST and max(numbers) <= HIGHEST


def keepable(state: FileState, filesystems: Mapping[int, int]) -> VerifiedInode | None:
    """Pure: the entry a file's observation makes, or None: not read and hashed here whole and unmoved
    (``hashed_ns`` 0), not sha256, racy, on a filesystem whose ctime is not known to be kept
    (``filesystems``: device -> ``statfs`` magic), or with a number that does not fit (:func:`fits`)."""
    if (
        not state.hashed_ns
        or not state.is_file
        or state.digest is None
        or state.size is None
        or state.algorithm != ALGORITHM
        or state.error is not None
        or filesystems.get(state.device) not in CTIME_FILESYSTEMS
        or is_racy(state.ctime_ns, state.hashed_ns)
        or not fits((state.device, state.inode, state.size, state.mtime_ns, state.ctime_ns))
    ):
        return None
    root_only = int(owner_alone_writes(state.uid, state.mode, 0))
    return VerifiedInode(
        state.device,
        state.inode,
        state.size,
        state.mtime_ns,
        state.ctime_ns,
        state.hashed_ns,
        state.digest,
        root_only,
    )


def updated(
    store: InodeStore, states: Iterable[FileState], filesystems: Mapping[int, int], now_ns: int
) -> InodeStore:
    """Pure: ``store`` with what this check hashed (newer entries replace those of the same inode),
    without the entries no longer believable, at most :data:`MAX_ENTRIES` (the newest)."""
    entries = {key: entry for key, entry in store.entries.items() if entry_problem(entry, now_ns) is None}
    for state in states:
        entry = keepable(state, filesystems)
        if entry is None:
            continue
        key = (state.device, state.inode)
        kept = entries.get(key)
        if kept is None or not _same_hash(kept, entry) or now_ns - kept.hashed_ns > MAX_AGE_NS // 2:
            entries[key] = entry  # else the kept one stands: a --full check rewrites nothing
    if len(entries) > MAX_ENTRIES:
        newest = sorted(entries.items(), key=lambda item: -item[1].hashed_ns)[:MAX_ENTRIES]
        entries = dict(newest)
    return InodeStore(store.prefix, store.boot_id, entries)


def _same_hash(kept: VerifiedInode, new: VerifiedInode) -> bool:
    return kept[:5] == new[:5] and kept.digest == new.digest and kept.root_only == new.root_only


def root_only_digest(entry: VerifiedInode | None, info: os.stat_result) -> str | None:
    """Pure: the kept digest of a file only root may write, when its ``lstat`` shows the very inode, size
    and mtime it had when hashed; its ctime may have moved (a link or unlink of another name).

    Why that is as sound as the very inode's kept hash (:func:`checker`): docs/verify.md."""
    if entry is None or not entry.root_only or not stat.S_ISREG(info.st_mode):
        return None
    if not owner_alone_writes(info.st_uid, info.st_mode, 0):
        return None
    if (
        info.st_size != entry.size
        or info.st_mtime_ns != entry.mtime_ns
        or info.st_ctime_ns < entry.ctime_ns
        or info.st_dev != entry.device
        or info.st_ino != entry.inode
    ):
        return None
    return entry.digest


def root_only_checker(store: InodeStore) -> Callable[[os.stat_result], str | None]:
    """:func:`root_only_digest` over the store's entries (checked as they were read)."""
    entries = store.entries.get
    return lambda info: root_only_digest(entries((info.st_dev, info.st_ino)), info)


def checker(store: InodeStore, fallback: Known | None = None, root_links: bool = False) -> Known:
    """The verification's question (:data:`safeinstall.env.hashing.Known`) answered from the store, else
    by ``fallback``. ``root_links``: a root-only inode's ctime may have moved (:func:`root_only_digest`);
    for the search for local patches, never the drift check."""
    entries = store.entries.get

    def known(info: os.stat_result, algorithm: str) -> str | None:
        # the very inode as it was hashed (once per file of the environment, every check): the device
        # and inode are the key; then size, mtime, ctime
        entry = entries((info.st_dev, info.st_ino)) if algorithm == ALGORITHM else None
        if (
            entry is not None
            and entry[2] == info.st_size
            and entry[3] == info.st_mtime_ns
            and entry[4] == info.st_ctime_ns
        ):
            return entry[6]
        if root_links and entry is not None and info.st_uid == 0:  # root's, its links changed
            digest = root_only_digest(entry, info)
            if digest is not None:
                return digest
        return None if fallback is None else fallback(info, algorithm)

    return known
