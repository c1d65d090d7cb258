"""Verification by identity: an installed file that is a hardlink of an inode of the run's cache, hashed
before the stop and unchanged since, needs an ``lstat``, not a read.

Why that proves as much as a hash: docs/window.md ("Verification by identity")."""

from __future__ import annotations

import ctypes
import os
import stat
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from safeinstall.env.drift import Expectation
from safeinstall.env.hashing import FileState, Known, observe_files
from safeinstall.system.safefs import owner_alone_writes

#: The only algorithm kept (wheels and uv's RECORDs use it); a RECORD that names another is hashed.
ALGORITHM = "sha256"
#: The cache's directories that uv links installed files from: its unpacked archives.
_ARCHIVES = "archive-v"


@dataclass(frozen=True, slots=True)
class HashedInode:
    """One inode of the run's cache as it was when its bytes were hashed."""

    path: str  # the cache entry it was found as
    size: int
    mtime_ns: int
    ctime_ns: int
    uid: int
    digest: str  # sha256, RECORD spelling
    #: read and hashed here (:attr:`safeinstall.env.hashing.FileState.hashed_ns`); 0: taken from the
    #: environment's verified-inode store, not read
    hashed_ns: int = 0


#: (device, inode) -> what it was when hashed
Hashed = Mapping[tuple[int, int], HashedInode]


def _entries(cache: Path) -> list[Expectation]:
    """Every regular-looking file below the cache's archive directories (a symlink to a directory is
    not entered; what replaced a directory since is refused by ``observe_files``'s ``within``)."""
    found: list[Expectation] = []
    try:
        tops = [
            e.path
            for e in os.scandir(cache)
            if e.name.startswith(_ARCHIVES) and e.is_dir(follow_symlinks=False)
        ]
    except OSError:
        return found
    for top in tops:
        for directory, _dirs, files in os.walk(top, followlinks=False):
            found.extend(Expectation(os.path.join(directory, name), ALGORITHM, None, None) for name in files)
    return found


def hash_cache(
    cache: Path,
    workers: int | None = None,
    known: Callable[[os.stat_result], str | None] | None = None,
    written: Mapping[str, tuple[str, int, int, int]] | None = None,
) -> dict[tuple[int, int], HashedInode]:
    """Before the stop: hash every file of uv's unpacked archives in the run's cache, as root, by
    descriptor; an entry that moved while read or that others may write is left out (read in the window).
    ``known``: digests of inodes hashed already; ``written``: this run's fill's own copies, by path
    (sha256, size, inode, mtime), taken for that inode unchanged only."""
    try:
        owner = os.lstat(cache).st_uid
    except OSError:
        return {}
    hashed: dict[tuple[int, int], HashedInode] = {}
    entries = _entries(cache)
    if known is not None or written is not None:
        unread: list[Expectation] = []
        for item in entries:
            now = time.time_ns()
            try:
                info = os.lstat(item.location)
            except OSError:
                continue
            digest, at = (known(info) if known is not None and stat.S_ISREG(info.st_mode) else None), 0
            copy = written.get(item.location) if written is not None else None
            if digest is None and copy is not None and stat.S_ISREG(info.st_mode):
                same = copy[1:] == (info.st_size, info.st_ino, info.st_mtime_ns)
                digest, at = (copy[0] if same else None), now
            if digest is None or not owner_alone_writes(info.st_uid, info.st_mode, owner):
                unread.append(item)
                continue
            size, mtime, ctime = info.st_size, info.st_mtime_ns, info.st_ctime_ns
            key = (info.st_dev, info.st_ino)
            hashed[key] = HashedInode(item.location, size, mtime, ctime, owner, digest, at)
        entries = unread
    real = os.path.realpath(cache)
    states = observe_files(entries, workers=workers, within=real)
    for path, state in states.items():
        if not state.is_file or state.digest is None or state.size is None or state.error is not None:
            continue
        entry = HashedInode(
            path, state.size, state.mtime_ns, state.ctime_ns, owner, state.digest, state.hashed_ns
        )
        if _unchanged(entry, state.device, state.inode):  # as it was before its bytes were read
            hashed[(state.device, state.inode)] = entry
    return hashed


def read_states(hashed: Hashed) -> list[FileState]:
    """Pure: the entries read and hashed here, as the observations the verified-inode store keeps
    (:func:`safeinstall.store.inodestore.keep`)."""
    return [
        FileState(
            entry.path,
            True,
            True,
            entry.size,
            entry.digest,
            ALGORITHM,
            device=device,
            inode=inode,
            mtime_ns=entry.mtime_ns,
            ctime_ns=entry.ctime_ns,
            hashed_ns=entry.hashed_ns,
            mode=stat.S_IFREG,  # writable by its owner alone when hashed: _unchanged checked it
            uid=entry.uid,
        )
        for (device, inode), entry in hashed.items()
        if entry.hashed_ns
    ]


def _unchanged(entry: HashedInode, device: int, inode: int) -> bool:
    """Is the cache entry still that inode, as it was hashed, with the owner and mode it must have?"""
    try:
        info = os.lstat(entry.path)
    except OSError:
        return False
    return (
        stat.S_ISREG(info.st_mode)
        and (info.st_dev, info.st_ino) == (device, inode)
        and info.st_size == entry.size
        and info.st_mtime_ns == entry.mtime_ns
        and info.st_ctime_ns == entry.ctime_ns
        and owner_alone_writes(info.st_uid, info.st_mode, entry.uid)
    )


def still_hashed(hashed: Hashed) -> dict[tuple[int, int], HashedInode]:
    """Just before the stop: the entries that are still as they were hashed (change time included:
    any write, ``chmod``, ``utimensat`` or link since is a change); the others are left out."""
    return {key: entry for key, entry in hashed.items() if _unchanged(entry, *key)}


def checker(hashed: Hashed, installed_ns: int) -> Known:
    """The verification's question (see the module): the digest of an installed file proven to be a
    hashed inode of the run's cache, unchanged, and untouched since the install ended at
    ``installed_ns`` (``time.time_ns()``, taken after uv exited); None: read and hash it."""

    def known(info: os.stat_result, algorithm: str) -> str | None:
        entry = hashed.get((info.st_dev, info.st_ino))
        if entry is None or algorithm != ALGORITHM:
            return None
        if (
            info.st_size != entry.size
            or info.st_mtime_ns != entry.mtime_ns
            or not owner_alone_writes(info.st_uid, info.st_mode, entry.uid)
            or info.st_ctime_ns > installed_ns
            or info.st_ctime_ns < entry.ctime_ns
        ):
            return None
        return entry.digest

    return known


def flush(directory: Path) -> float:
    """``syncfs`` the run's cache before the stop; the seconds it took. Else the kernel writes the
    prefetch's gigabytes back about 30 s later, in the window, where the install's links wait on it."""
    started = time.monotonic()
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return 0.0
    try:
        if _syncfs(fd) != 0:
            os.sync()
    finally:
        os.close(fd)
    return time.monotonic() - started


def _syncfs(fd: int) -> int:
    try:
        call = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):
        return -1
    return int(call(fd))
