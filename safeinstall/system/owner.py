"""The privilege boundary, the worker's side: what runs as the environment's owner.

Each function here runs inside a worker (:func:`safeinstall.system.worker.call`): a forked process that is the
environment's account (or an isolated root, for a root-owned environment), in a session of its own,
with no descriptor of root's and no environment of root's. Each acts on paths that the account could
have written itself (a RECORD, the run's uv cache, uv's lock file), so the kernel decides what it may
touch: what it does is what the account could do anyway. Each returns plain JSON data (counts, paths
relative to the prefix, short messages); root validates that answer and never takes it for more than
the account's word.

Every file operation goes through :mod:`safeinstall.system.safefs` (by directory descriptor, never following
a symlink), as root's own would.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
import time
from pathlib import Path
from typing import Any

from safeinstall.errors import StepFailed
from safeinstall.system.safefs import Tree, remove_at

#: Errors that mean "the account may not do this": the path is not the account's to remove.
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)

#: uv's lock of an environment, ``PREFIX/.lock`` (uv creates it 0666: any local user may open and
#: hold it)
UV_LOCK = ".lock"


def remove_installed(prefix: str, files: list[str], dist_infos: list[str], stop: list[str]) -> dict[str, Any]:
    """Remove ``files`` and the directories ``dist_infos`` (relative to ``prefix``), then the
    directories left empty up to (not including) those in ``stop``. What the account may not remove
    (EACCES, EPERM, EROFS) is ``denied``, not a failure: it is not the installed version's (uv ran as
    the account, so it could not have written it). ``{"removed": [...], "removed_dist_infos": [...],
    "denied": ["path: reason"], "failures": ["path: reason"]}``."""
    removed: list[str] = []
    removed_dirs: list[str] = []
    denied: list[str] = []
    failures: list[str] = []

    def failed(relative: str, exc: OSError) -> None:
        text = f"{relative}: {exc.strerror or exc}"
        (denied if exc.errno in _DENIED else failures).append(text)

    with Tree(Path(prefix)) as tree, tree.batch():
        for relative in files:
            try:
                if tree.unlink(relative):
                    removed.append(relative)
            except OSError as exc:
                failed(relative, exc)
        for relative in dist_infos:
            try:
                tree.remove_tree(relative)
                removed_dirs.append(relative)
            except OSError as exc:
                failed(relative, exc)
    with Tree(Path(prefix)) as tree:
        _prune_empty(tree, {os.path.dirname(p) for p in removed}, frozenset(stop))
    return {"removed": removed, "removed_dist_infos": removed_dirs, "denied": denied, "failures": failures}


def _prune_empty(tree: Tree, directories: set[str], stop: frozenset[str]) -> None:
    for start in sorted(directories, key=lambda p: p.count("/"), reverse=True):
        directory = start
        while directory and directory not in stop:
            try:
                tree.rmdir(directory)
            except (OSError, ValueError):
                break
            directory = os.path.dirname(directory)


def empty_directory(path: str, seconds: float) -> dict[str, Any]:
    """Remove everything below the directory ``path`` (the run's uv cache or scratch directory: the
    account's), by descriptor, for at most ``seconds``; the directory itself stays (its parent is
    root's). ``{"emptied": bool}``: False when time ran out (something kept filling it)."""
    deadline = time.monotonic() + seconds
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return {"emptied": True}
    try:
        for name in os.listdir(fd):
            remove_at(fd, name, deadline)
    except TimeoutError:
        return {"emptied": False}
    finally:
        os.close(fd)
    return {"emptied": True}


def uv_lock_holders(prefix: str) -> dict[str, Any]:
    """Whether uv's lock of the environment can be taken now: ``{"state": "absent" | "free" | "held" |
    "not-a-file"}`` (opened without following a symlink, never blocking)."""
    with Tree(Path(prefix)) as tree:
        info = tree.lstat(UV_LOCK)
        if info is None:
            return {"state": "absent"}
        if not stat.S_ISREG(info.st_mode):
            return {"state": "not-a-file"}
        try:
            fd = tree.open_read(UV_LOCK)
        except OSError:
            return {"state": "not-a-file"}
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return {"state": "held"}
        fcntl.flock(fd, fcntl.LOCK_UN)
        return {"state": "free"}
    finally:
        os.close(fd)


def replace_uv_lock(prefix: str, owner: list[int] | None) -> dict[str, Any]:
    """Put a new, empty uv lock file in place of ``PREFIX/.lock`` (or where there was none): mode 0600,
    the environment's owner's (``owner`` uid, gid: given to it when this worker is root), so that no
    other local user can open, and so hold, the lock uv takes while the services are down. Whoever
    held the old file holds the lock of a file that is no longer there. ``{"replaced": bool}``."""
    temp = f"{UV_LOCK}.safeinstall-{os.getpid()}"
    with Tree(Path(prefix)) as tree, tree.parent(UV_LOCK) as (dir_fd, _name):
        fd = os.open(
            temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd
        )
        try:
            if owner is not None:
                os.fchown(fd, owner[0], owner[1])
            os.fchmod(fd, 0o600)
        except OSError:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
            raise
        os.close(fd)
        try:
            os.rename(temp, UV_LOCK, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except OSError:
            with contextlib.suppress(OSError):
                os.unlink(temp, dir_fd=dir_fd)
            raise
    return {"replaced": True}


def remove_new_uv_lock(prefix: str) -> dict[str, Any]:
    """After a dry run: remove the empty uv lock file that uv created (the caller saw none before),
    unless something holds it. ``{"removed": bool}``."""
    with Tree(Path(prefix)) as tree:
        info = tree.lstat(UV_LOCK)
        if info is None or not stat.S_ISREG(info.st_mode) or info.st_size != 0:
            return {"removed": False}
    if uv_lock_holders(prefix)["state"] != "free":
        return {"removed": False}
    with Tree(Path(prefix)) as tree:
        return {"removed": tree.unlink(UV_LOCK)}


def write_carried(prefix: Path, location: str, data: bytes) -> None:
    """Put one merged file in place of the new version's, through the one safe filesystem layer
    (:class:`safeinstall.system.safefs.Tree`): walked by descriptor from the prefix, no symlink followed, the
    file replaced atomically (temp file, fsync, rename); it keeps the installed file's mode and owner."""
    try:
        with Tree(prefix) as tree:
            relative = tree.relative(location)
            if relative is None:
                raise StepFailed(f"refusing to write {location}: it is not inside {prefix}")
            info = tree.lstat(relative)
            if info is None or not stat.S_ISREG(info.st_mode):
                raise StepFailed(
                    f"could not write the merged {location}: it is not a regular file (a symlink, a "
                    "special file or nothing) below the prefix"
                )
            source = os.memfd_create("safeinstall-merge", os.MFD_CLOEXEC)
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(source, view) :]
                os.lseek(source, 0, os.SEEK_SET)
                owner = (info.st_uid, info.st_gid) if os.geteuid() == 0 else None
                tree.write_from(relative, source, stat.S_IMODE(info.st_mode), owner)
            finally:
                os.close(source)
            tree.fsync_dir(os.path.dirname(relative))
    except OSError as exc:
        raise StepFailed(f"could not write the merged {location}: {exc.strerror or exc}") from exc
