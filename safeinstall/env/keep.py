"""The way back that needs no new blocks: hardlinks of the old files a window install replaces, kept in
``PREFIX/.safeinstall-keep-<run>/`` until the run ends, so a restore on a full disk can relink them.

Why: docs/faults.md ("Room") and docs/crash-safety.md."""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from safeinstall.env import owner
from safeinstall.system import worker
from safeinstall.system.safefs import Tree, only_caller_writes, open_file, private_to

KEEP_PREFIX = ".safeinstall-keep-"
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True, slots=True)
class Saved:
    """What the backup saved of one regular file: the inode put back must be exactly that."""

    path: str  # relative to the prefix
    size: int
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    sha256: str


def keep_name(run_id: str) -> str:
    """Pure: the name of the run's directory of kept links in the prefix."""
    return f"{KEEP_PREFIX}{run_id}"


def key(relative: str) -> str:
    """Pure: the name a kept link of ``relative`` has in the directory (flat: no directory to make)."""
    return hashlib.sha256(relative.encode("utf-8", "surrogateescape")).hexdigest()


def _roots_own(fd: int) -> bool:
    return only_caller_writes(os.fstat(fd))


def keep_links(prefix: Path, run_id: str, paths: Iterable[str], every: bool = False) -> int:
    """Link each of ``paths`` that is a file only root can write into the run's keep directory: those with
    other links, or with ``every`` all of them; leftovers of dead runs go first. Best effort: returns the
    number kept. Raises OSError when the directory cannot be made."""
    name = keep_name(run_id)
    with Tree(prefix) as tree:
        if not _roots_own(tree.fd):
            return 0
        discard_leftovers(prefix, keep=name)
        tree.make_dir(name, 0o700)
        kept = 0
        with tree.batch():
            for relative in paths:
                info = tree.lstat(relative)
                if info is None or not stat.S_ISREG(info.st_mode) or (info.st_nlink < 2 and not every):
                    continue
                if not only_caller_writes(info):
                    continue
                link = f"{name}/{key(relative)}"
                try:
                    with tree.parent(relative) as (fd, base), tree.parent(link) as (kfd, k):
                        os.link(base, k, src_dir_fd=fd, dst_dir_fd=kfd, follow_symlinks=False)
                except OSError:  # another filesystem, or gone: copied back if need be
                    continue
                kept += 1
    return kept


def open_kept(tree: Tree, run_id: str) -> int | None:
    """A descriptor of the run's keep directory in ``tree`` (the prefix), when it is root's own (0700,
    in a prefix only root writes); None otherwise. The caller closes it."""
    try:
        if not _roots_own(tree.fd):
            return None
        fd = os.open(keep_name(run_id), _DIR_FLAGS, dir_fd=tree.fd)
    except OSError:
        return None
    info = os.fstat(fd)
    if not private_to(info.st_uid, info.st_mode, os.geteuid()):
        os.close(fd)
        return None
    return fd


def relink(kept_fd: int, tree: Tree, saved: Saved, mark: str) -> bool:
    """Put the kept inode of ``saved.path`` back in place: linked beside it under a temp name (by
    descriptor, no symlink followed), checked against what the backup saved, renamed over the path.
    False (nothing changed) when there is none, or it is not exactly what was saved."""
    with tree.parent(saved.path) as (fd, name):
        temp = f".{name}{mark}{os.getpid()}-{os.urandom(4).hex()}"
        try:
            os.link(key(saved.path), temp, src_dir_fd=kept_fd, dst_dir_fd=fd, follow_symlinks=False)
        except OSError:
            return False
        try:
            if not _as_saved(fd, temp, saved):
                os.unlink(temp, dir_fd=fd)
                return False
            os.replace(temp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError:
            os.unlink(temp, dir_fd=fd)
            return False
    return True


def _as_saved(fd: int, name: str, saved: Saved) -> bool:
    """The entry ``name`` in ``fd``: a regular file only root can write, as ``saved`` says, byte for byte."""
    try:
        handle, info = open_file(name, follow=False, dir_fd=fd)  # a FIFO or a device: never opened
    except OSError:
        return False
    try:
        if not only_caller_writes(info):
            return False
        found = (info.st_size, stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid, info.st_mtime_ns)
        if found != (saved.size, saved.mode, saved.uid, saved.gid, saved.mtime_ns):
            return False
        with os.fdopen(os.dup(handle), "rb", buffering=0) as reader:
            return hashlib.file_digest(reader, "sha256").hexdigest() == saved.sha256
    finally:
        os.close(handle)


def discard(prefix: Path, run_id: str, seconds: float) -> bool:
    """Remove the run's keep directory (by descriptor, in a prefix root owns alone; in an account's
    prefix, by the account's worker); True when it is gone (or never was)."""
    name = keep_name(run_id)
    if not os.path.lexists(prefix / name):
        return True
    ids = account_of(prefix)
    if ids is not None:
        return not _remove_as(ids, prefix, [name], seconds)
    return _remove(prefix, name, seconds)


def discard_leftovers(prefix: Path, keep: str = "", seconds: float = 10.0) -> list[str]:
    """Remove the keep directories runs that died left in the prefix (but ``keep``); those left."""
    try:
        names = sorted(n for n in os.listdir(prefix) if n.startswith(KEEP_PREFIX) and n != keep)
    except OSError:
        return []
    ids = account_of(prefix) if names else None
    if ids is not None:
        return _remove_as(ids, prefix, names, seconds)
    return [n for n in names if not _remove(prefix, n, seconds)]


def _remove(prefix: Path, name: str, seconds: float) -> bool:
    if not name.startswith(KEEP_PREFIX) or "/" in name:
        return False
    try:
        with Tree(prefix) as tree:
            if not _roots_own(tree.fd):
                return tree.lstat(name) is None
            tree.remove_tree(name, time.monotonic() + seconds)
            return tree.lstat(name) is None
    except OSError:
        return False


# --- an account's environment: the same, done by its worker --------------------------------------

#: How long the account's worker may take to link, relink or remove a version's files (tens of thousands)
WORKER_TIMEOUT_S = 300.0


def keep_links_as(ids: tuple[int, int], prefix: Path, run_id: str, paths: Sequence[str]) -> int:
    """:func:`keep_links` (``every``) in an account's environment, done by its worker; the restore checks
    each inode against the backup (:func:`relink_as`). Returns the number kept (its word); raises OSError
    when the worker fails."""
    keys = [key(p) for p in paths]
    try:
        answer = worker.call(
            ids,
            lambda: owner.keep_links(str(prefix), keep_name(run_id), list(paths), keys),
            timeout=WORKER_TIMEOUT_S,
            what=f"keeps links of the old files in {prefix}",
        )
    except worker.WorkerError as exc:
        raise OSError(exc.message) from exc
    kept = answer.get("kept") if isinstance(answer, dict) else None
    return kept if isinstance(kept, int) and not isinstance(kept, bool) else 0


def relink_as(ids: tuple[int, int], prefix: Path, run_id: str, paths: Sequence[str]) -> tuple[str, ...]:
    """The account's worker puts the kept inodes of ``paths`` back in place (no new block): the paths it
    says it relinked, among those asked. The caller checks each against the backup (content, mode,
    owner, mtime) and writes the backup's copy where it is not that. Never raises."""
    keys = [key(p) for p in paths]
    try:
        answer = worker.call(
            ids,
            lambda: owner.relink_kept(str(prefix), keep_name(run_id), list(paths), keys),
            timeout=WORKER_TIMEOUT_S,
            what=f"puts the kept old files back in {prefix}",
        )
    except worker.WorkerError:
        return ()
    said = answer.get("relinked") if isinstance(answer, dict) else None
    asked = frozenset(paths)
    return tuple(p for p in said if isinstance(p, str) and p in asked) if isinstance(said, list) else ()


def account_of(prefix: Path) -> tuple[int, int] | None:
    """The prefix's owner (uid, gid), when it is an account (not root) and the directory is its own;
    None for root's prefix (or one that cannot be read)."""
    try:
        with Tree(prefix) as tree:
            info = os.fstat(tree.fd)
    except OSError:
        return None
    return None if info.st_uid == 0 else (info.st_uid, info.st_gid)


def _remove_as(ids: tuple[int, int], prefix: Path, names: list[str], seconds: float) -> list[str]:
    """The account's worker removes its keep directories ``names`` (all: empty); those left."""
    try:
        answer = worker.call(
            ids,
            lambda: owner.remove_kept(str(prefix), names, seconds),
            timeout=seconds + 30.0,
            what=f"removes the kept links of old files in {prefix}",
        )
    except worker.WorkerError:
        return names or ["?"]
    left = answer.get("left") if isinstance(answer, dict) else None
    return [n for n in left if isinstance(n, str)] if isinstance(left, list) else (names or ["?"])
