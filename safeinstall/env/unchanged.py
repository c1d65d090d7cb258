"""Distributions proven unchanged by ``lstat`` alone: no RECORD entry compared, no file read.

Pure decisions over the identities a clean check kept (:mod:`safeinstall.store.unchanged`); why an
unchanged ctime proves it: docs/verify.md ("The clean distributions")."""

from __future__ import annotations

import os
import stat
import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

from safeinstall.env.containment import base
from safeinstall.env.distributions import InstalledDistribution
from safeinstall.env.hashing import FileState
from safeinstall.env.inodetrust import GRANULARITY_NS, MAX_AGE_NS, fits

#: One file's identity, as kept: device, inode, size, mtime, ctime (ns), ``st_mode``.
FILE_IDENTITY = struct.Struct("<6q")
#: (device, inode, mtime_ns, ctime_ns) of a directory, or of a RECORD with its size:
#: (device, inode, size, mtime_ns, ctime_ns)
DirIdentity = tuple[int, int, int, int]
RecordIdentity = tuple[int, int, int, int, int]

_pack = FILE_IDENTITY.pack
#: A distribution with a directory this many levels below its prefix is not kept (nor proven): what a
#: RECORD of deep one-letter directories would make root keep grows with its depth times its paths'
#: length (the attacker review); real ones are a few levels deep.
MAX_DEPTH = 64
#: The most directories the store keeps, and the most bytes of their paths (the newest are kept; one
#: left out only means the distributions below it are compared as before).
MAX_DIRECTORIES = 1_000_000
MAX_DIRECTORY_BYTES = 64 << 20


@dataclass(frozen=True, slots=True)
class UnchangedDistribution:
    """What one clean distribution was when a check began (at ``since_ns``)."""

    dist_info: str
    since_ns: int  # the clock when the check that kept it began: everything of it was settled by then
    #: the oldest moment one of its files was read and hashed (at most ``since_ns``; a file proven by the
    #: verified-inode store's hash, by that hash's): the day it is believed counts from it
    hashed_ns: int
    record: RecordIdentity
    files: int  # how many hashed entries its RECORD has
    identities: bytes  # FILE_IDENTITY of each, in the RECORD's order


@dataclass(frozen=True, slots=True)
class UnchangedStore:
    """An environment's clean distributions (by ``.dist-info`` path) and the directories they lead
    through (path -> identity and the moment the check that saw it so began)."""

    prefix: str
    boot_id: str
    distributions: Mapping[str, UnchangedDistribution]
    directories: Mapping[str, tuple[DirIdentity, int]]


def hashed_locations(dist: InstalledDistribution) -> list[str]:
    """Pure: where the RECORD's hashed entries live, in its order (those a check compares)."""
    return [
        loc for entry, loc in zip(dist.record.entries, dist.locations, strict=True) if entry.hash is not None
    ]


def directories_of(paths: Iterable[str], root: str) -> set[str]:
    """Pure: every directory from ``root`` (included) down to each of ``paths``; a path not below ``root``
    makes the answer empty-handed: ``{""}`` (no such directory can be kept, so nothing is proven)."""
    parents = {path.rpartition("/")[0] for path in paths}
    found: set[str] = set()
    below = base(root)
    for directory in parents:
        while directory not in found:
            if directory != root and not directory.startswith(below):
                return {""}
            found.add(directory)
            if directory == root:
                break
            directory = directory.rpartition("/")[0]
    return found


def is_settled(ctime_ns: int, since_ns: int) -> bool:
    """Pure: nothing changed the inode after ``since_ns`` (a change then moves its ctime past this)."""
    return ctime_ns + GRANULARITY_NS <= since_ns


def _dir_identity(path: str, taken: os.stat_result | None = None) -> DirIdentity | None:
    """A directory's identity by its ``lstat`` (``taken``: one taken moments before, not followed)."""
    try:
        info = taken or os.lstat(path)
    except OSError:
        return None
    identity = (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_ctime_ns)
    return identity if stat.S_ISDIR(info.st_mode) and fits(identity) else None


def _record_identity(dist: InstalledDistribution) -> RecordIdentity | None:
    try:
        info = os.lstat(os.path.join(dist.dist_info, "RECORD"))
    except OSError:
        return None
    identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    return identity if stat.S_ISREG(info.st_mode) and fits(identity) else None


def prover(
    store: UnchangedStore | None,
    root_of: Callable[[InstalledDistribution], str],
    walked: Mapping[str, os.stat_result] | None = None,
) -> Callable[[InstalledDistribution], list[tuple[str, int]] | None] | None:
    """What the verification asks of a distribution: None when it cannot be proven unchanged, else its
    hardlinked files (path, link count). ``root_of``: the prefix its files stay in; ``walked``: ``lstat``
    results taken moments before. None when there is no store."""
    if store is None:
        return None
    seen: dict[str, bool] = {}  # a directory's lstat, once per check (the steering walk's, if it took one)
    lstat, taken = os.lstat, (walked or {}).get

    def directory_unchanged(path: str) -> bool:
        answer = seen.get(path)
        if answer is None:
            kept = store.directories.get(path)
            answer = seen[path] = kept is not None and _dir_identity(path, taken(path)) == kept[0]
        return answer

    def prove(dist: InstalledDistribution) -> list[tuple[str, int]] | None:
        kept = store.distributions.get(os.fspath(dist.dist_info))
        if kept is None or _record_identity(dist) != kept.record:
            return None
        locations = hashed_locations(dist)
        if len(locations) != kept.files:
            return None
        directories = directories_of([*locations, os.path.join(dist.dist_info, "RECORD")], root_of(dist))
        if not all(directory_unchanged(d) for d in directories):
            return None
        identities = bytearray()
        linked: list[tuple[str, int]] = []
        try:
            for location in locations:
                info = taken(location) or lstat(location)
                identities += _pack(
                    info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns, info.st_mode
                )
                if info.st_nlink > 1:
                    linked.append((location, info.st_nlink))
        except (OSError, struct.error):  # struct.error: a number past 64 bits, never kept
            return None
        return linked if identities == kept.identities else None

    return prove


def file_identity(state: FileState, since_ns: int) -> bytes | None:
    """Pure: a clean file's identity as observed, or None when it cannot be kept: not a regular file read
    whole (or proven by an earlier hash), or changed too near the moment the check began."""
    if (
        not state.is_file
        or state.error is not None
        or state.digest is None
        or not (state.hashed_ns or state.by_identity)
        or not state.mode
        or not is_settled(state.ctime_ns, since_ns)
    ):
        return None
    numbers = (state.device, state.inode, state.size or 0, state.mtime_ns, state.ctime_ns, state.mode)
    return _pack(*numbers) if fits(numbers) else None


def unchanged_entry(
    dist: InstalledDistribution,
    states: Mapping[str, FileState],
    since_ns: int,
    root: str,
    directories: dict[str, tuple[DirIdentity, int]],
    ctime_kept: Callable[[int, str], bool],
    hashed_at: Callable[[FileState], int],
) -> UnchangedDistribution | None:
    """After a clean check of ``dist``: what to keep of it (its directories into ``directories``), or None
    when something was not settled before the check, lies where ctime is not kept, or too deep.
    ``hashed_at``: when each file was hashed; the entry lasts a day from the oldest."""
    record_path = os.path.join(dist.dist_info, "RECORD")
    record = _record_identity(dist)
    if record is None or not is_settled(record[4], since_ns) or not ctime_kept(record[0], record_path):
        return None
    locations = hashed_locations(dist)
    if too_deep([*locations, record_path], root):
        return None
    identities = bytearray()
    oldest = since_ns
    for location in locations:
        state = states.get(location)
        identity = None if state is None else file_identity(state, since_ns)
        if identity is None or state is None or not ctime_kept(state.device, location):
            return None
        at = hashed_at(state)
        if at <= 0:
            return None
        oldest = min(oldest, at)
        identities += identity
    found: dict[str, tuple[DirIdentity, int]] = {}
    for directory in directories_of([*locations, record_path], root):
        kept = directories.get(directory)
        if kept is not None and kept[1] == since_ns:
            continue  # seen by this check already
        seen = _dir_identity(directory)
        if seen is None or not is_settled(seen[3], since_ns) or not ctime_kept(seen[0], directory):
            return None
        found[directory] = (seen, since_ns)
    directories.update(found)
    return UnchangedDistribution(
        os.fspath(dist.dist_info), since_ns, oldest, record, len(locations), bytes(identities)
    )


def too_deep(paths: Iterable[str], root: str) -> bool:
    """Pure: a path lies more than :data:`MAX_DEPTH` directories below ``root``."""
    levels = root.rstrip("/").count("/") + MAX_DEPTH + 1  # the file's own name is one more
    return any(path.count("/") > levels for path in paths)


def still_believed(since_ns: int, now_ns: int) -> bool:
    """Pure: an entry kept at ``since_ns`` may still be used (not older than a day, not from the future)."""
    return 0 < since_ns <= now_ns and now_ns - since_ns <= MAX_AGE_NS


def updated(
    store: UnchangedStore,
    checked: Iterable[str],
    proven: Iterable[str],
    fresh: Sequence[UnchangedDistribution],
    directories: Mapping[str, tuple[DirIdentity, int]],
    now_ns: int,
) -> UnchangedStore:
    """Pure: the store after a check of the distributions whose ``.dist-info`` is in ``checked``: those
    it proved (``proven``) kept as they were, those it found clean (``fresh``) added, the other checked
    ones dropped (one not checked, by a check of one package, stays); the directories, the newest
    identity of each; nothing no longer believable."""
    dropped = set(checked) - set(proven)
    kept = {path: d for path, d in store.distributions.items() if path not in dropped}
    kept = {p: d for p, d in kept.items() if still_believed(d.hashed_ns, now_ns)}
    kept.update((d.dist_info, d) for d in fresh)
    table = {**store.directories, **directories}
    table = {p: v for p, v in table.items() if still_believed(v[1], now_ns)}
    return UnchangedStore(store.prefix, store.boot_id, kept, bounded(table))


def bounded(
    table: Mapping[str, tuple[DirIdentity, int]],
    count: int = MAX_DIRECTORIES,
    size: int = MAX_DIRECTORY_BYTES,
) -> Mapping[str, tuple[DirIdentity, int]]:
    """Pure: at most ``count`` directories of at most ``size`` bytes of paths, the newest (a directory
    left out: what lies below it is compared as before, and kept anew)."""
    if len(table) <= count and sum(map(len, table)) <= size:
        return table
    kept: dict[str, tuple[DirIdentity, int]] = {}
    total = 0
    for path, value in sorted(table.items(), key=lambda item: -item[1][1]):
        total += len(path)
        if len(kept) == count or total > size:
            break
        kept[path] = value
    return kept
