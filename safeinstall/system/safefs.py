"""The one way safeinstall touches an environment's files: by directory file descriptor.

Every path below a :class:`Tree`'s root is walked with ``openat`` and ``O_NOFOLLOW``, so a symlink, FIFO
or device an account puts there is never followed nor opened. Why: docs/threat-model.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import os
import re
import stat
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
#: A descriptor that only names a file: no driver's open runs (a FIFO, a terminal, a watchdog).
_PIN_FLAGS = os.O_PATH | os.O_CLOEXEC
#: The real open of a pinned regular file, through ``/proc/self/fd`` (a terminal is never taken).
_REOPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
#: ``renameat2(2)`` flags: exchange two entries atomically; never replace what is at the destination.
RENAME_EXCHANGE = 2
RENAME_NOREPLACE = 1
#: A directory to empty: never a symlink's target, and a FIFO swapped in is never waited on.
_REMOVE_DIR_FLAGS = _DIR_FLAGS | os.O_NONBLOCK
_CHUNK = 1 << 20
#: :func:`remove_at` refuses a tree deeper than this (each level holds a descriptor).
MAX_REMOVE_DEPTH = 4096
#: How often :func:`remove_at` tries an entry that keeps changing between a file and a directory, or a
#: directory that keeps being refilled, before it gives up.
_REMOVE_TRIES = 8


class NotRegularFile(OSError):
    """The path is there but is not a regular file below real directories (a symlink, a FIFO, a device,
    a directory, or a symlink on the way): it is never opened for reading."""

    def __init__(self, path: str, what: str) -> None:
        super().__init__(errno.EINVAL, f"not a regular file ({what})", path)
        self.what = what


def parts_of(relative: str) -> tuple[str, ...]:
    """Pure: the components of a "/"-separated relative path; ValueError for anything that could leave
    the root (absolute, ``..``) or is not a plain name (``.``, empty, NUL)."""
    if not relative or relative.startswith("/") or "\0" in relative:
        raise ValueError(f"{relative!r} is not a relative path")
    parts = tuple(relative.split("/"))
    if any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"{relative!r} is not a plain relative path (empty, '.' or '..' component)")
    return parts


def parent_directories(paths: Iterable[str]) -> set[str]:
    """Pure: every directory above the "/"-separated relative ``paths``."""
    wanted: set[str] = set()
    for path in paths:
        parent = path.rpartition("/")[0]
        while parent and parent not in wanted:
            wanted.add(parent)
            parent = parent.rpartition("/")[0]
    return wanted


def describe(mode: int) -> str:
    """Pure: what kind of file a ``st_mode`` is, in words."""
    kinds = (
        (stat.S_ISLNK, "a symlink"),
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
    )
    return next((word for check, word in kinds if check(mode)), "a regular file")


@dataclass(frozen=True, slots=True)
class Copied:
    sha256: str  # hex
    size: int


#: The extended attribute that holds a file's POSIX access ACL: version 2, then (tag, permissions,
#: id) entries of 2, 2 and 4 little-endian bytes (linux/posix_acl_xattr.h).
ACL_XATTR = "system.posix_acl_access"
_ACL_VERSION = 2
_ACL_USER_OBJ, _ACL_USER, _ACL_GROUP_OBJ = 0x01, 0x02, 0x04
_ACL_GROUP, _ACL_MASK, _ACL_OTHER = 0x08, 0x10, 0x20
_ACL_WRITE = 0x02
#: the id of the entries that name none (the owner, the owning group, the mask, others)
_ACL_NO_ID = 0xFFFFFFFF


def acl_writers(raw: bytes) -> tuple[set[int], set[int]]:
    """Pure: the uids and gids that a POSIX access ACL (the xattr's bytes) names with write permission,
    when its mask lets write through."""
    users: set[int] = set()
    groups: set[int] = set()
    mask_writes = True
    for offset in range(4, len(raw) - 7, 8):
        tag = int.from_bytes(raw[offset : offset + 2], "little")
        perm = int.from_bytes(raw[offset + 2 : offset + 4], "little")
        ident = int.from_bytes(raw[offset + 4 : offset + 8], "little")
        if tag == _ACL_MASK:
            mask_writes = bool(perm & _ACL_WRITE)
        elif tag == _ACL_USER and perm & _ACL_WRITE:
            users.add(ident)
        elif tag == _ACL_GROUP and perm & _ACL_WRITE:
            groups.add(ident)
    return (users, groups) if mask_writes else (set(), set())


def others_who_write(
    mode: int, gid: int, acl_groups: Iterable[int] = (), *, group_root_is_root: bool = True
) -> str | None:
    """Pure: who, besides a path's owner and root, may write it by its mode or access ACL (``"every user"``,
    ``"group N"``, ``"group(s) [...] (its ACL)"``), or None. A sticky directory is the caller's to judge.
    ``group_root_is_root`` False (root's own state): a write by gid 0 counts as another's
    (docs/threat-model.md)."""
    if everyone_may_write(mode):
        return "every user"
    if group_may_write(mode) and (gid != 0 or not group_root_is_root):
        return f"group {gid}"
    groups = sorted(set(acl_groups) - {0})
    return f"group(s) {groups} (its ACL)" if groups else None


def group_may_write(mode: int) -> bool:
    """Pure: the group write bit; with an access ACL it is the ACL's mask, which every named user's and
    group's write passes through (without it no ACL entry can write)."""
    return bool(mode & stat.S_IWGRP)


def everyone_may_write(mode: int) -> bool:
    """Pure: the others' write bit: every user may write."""
    return bool(mode & stat.S_IWOTH)


def others_may_write(mode: int) -> bool:
    """Pure: anyone but the owner (and root) may write through ``mode``: a group, an ACL entry, everyone."""
    return group_may_write(mode) or everyone_may_write(mode)


def owner_alone_writes(uid: int, mode: int, owner: int) -> bool:
    """Pure: the one owner-plus-mode rule: ``owner`` owns the inode (``uid``) and nobody else may write
    it through ``mode`` (:func:`others_may_write`, root's group included)."""
    return uid == owner and not others_may_write(mode)


def private_to(uid: int, mode: int, owner: int) -> bool:
    """Pure: ``owner`` owns the inode and nobody else may read, write or search it (no group or other bit)."""
    return uid == owner and not mode & 0o077


def only_caller_writes(info: os.stat_result) -> bool:
    """Pure: the one rule that nobody but the caller can write this inode: the caller's own, and no group
    or other write bit (root's group included). What root keeps, copies or removes on that ground (a
    backup's hardlink, a staging tree, a cache copied into a run, a detached run's directory) passes it."""
    return owner_alone_writes(info.st_uid, info.st_mode, os.geteuid())


class UntrustedFile(OSError):
    """A file safeinstall reads back that must not be believed; ``problem`` says why."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(errno.EPERM, problem, str(path))
        self.problem = problem


def trust_problem(
    info: os.stat_result, limit: int, *, root_owned_ok: bool = True, private: bool = False
) -> str | None:
    """Pure: why a file safeinstall wrote for itself must not be believed, or None: it must be a regular file,
    the caller's (or root's, ``root_owned_ok``), written by nobody else, with ``private`` read by nobody else,
    and at most ``limit`` bytes."""
    euid = os.geteuid()
    if not stat.S_ISREG(info.st_mode):
        return "it is not a regular file"
    if info.st_uid != euid and not (root_owned_ok and info.st_uid == 0):
        owners = f"root or uid {euid}" if root_owned_ok else f"uid {euid}"
        return f"it is owned by uid {info.st_uid}, not by {owners} which runs safeinstall"
    who = others_who_write(info.st_mode, info.st_gid, group_root_is_root=False)
    if who is not None:
        return f"it is mode {stat.S_IMODE(info.st_mode):04o}: {who} may write to it"
    if private and info.st_mode & 0o077:
        return f"it is mode {stat.S_IMODE(info.st_mode):04o}: others may read it"
    if info.st_size > limit:
        return f"it is {info.st_size} bytes, more than the {limit} such a file ever needs"
    return None


def read_trusted(path: Path, limit: int, *, root_owned_ok: bool = True, private: bool = False) -> bytes:
    """The one checked reader of what safeinstall wrote for itself: the bytes of ``path``, opened without
    following a symlink or blocking on a FIFO, believed only as :func:`trust_problem` says, and never
    more than ``limit`` bytes (a file that grows meanwhile included). FileNotFoundError when absent;
    :class:`UntrustedFile` saying why not; another OSError when it cannot be read."""
    try:
        pinned, info = pin(path, follow=False)
    except NotRegularFile as exc:
        raise UntrustedFile(path, "it is not a regular file") from exc
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UntrustedFile(path, "it is a symbolic link") from exc
        raise
    try:
        problem = trust_problem(info, limit, root_owned_ok=root_owned_ok, private=private)
        if problem is not None:
            raise UntrustedFile(path, problem)
        fd = reopen(pinned, path)
    finally:
        os.close(pinned)
    try:
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, limit + 1 - size):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:
                raise UntrustedFile(path, f"it grew past {limit} bytes")
        return b"".join(chunks)
    finally:
        os.close(fd)


def reader_acl(uid: int) -> bytes:
    """Pure: a POSIX access ACL (the xattr's bytes) for a file its owner may read and write, ``uid`` may
    read, and nobody else may touch: ``u::rw-,u:UID:r--,g::---,m::r--,o::---``."""
    entries = [
        (_ACL_USER_OBJ, 6, _ACL_NO_ID),
        (_ACL_USER, 4, uid),
        (_ACL_GROUP_OBJ, 0, _ACL_NO_ID),
        (_ACL_MASK, 4, _ACL_NO_ID),
        (_ACL_OTHER, 0, _ACL_NO_ID),
    ]
    return _ACL_VERSION.to_bytes(4, "little") + b"".join(
        tag.to_bytes(2, "little") + perm.to_bytes(2, "little") + ident.to_bytes(4, "little")
        for tag, perm, ident in entries
    )


def _copy_fd(source: int, dest: int) -> Copied:
    """Copy what ``source`` holds, as large as ``fstat`` says it is: one that grew meanwhile (its owner
    can watch root open it) raises OSError EFBIG, before root writes more than that."""
    hasher = hashlib.sha256()
    size = 0
    expected = os.fstat(source).st_size
    while chunk := os.read(source, min(_CHUNK, expected + 1 - size)):
        size += len(chunk)
        if size > expected:
            raise OSError(errno.EFBIG, "it grew while it was copied")
        hasher.update(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(dest, view) :]
    return Copied(hasher.hexdigest(), size)


def pin(path: str | Path, *, follow: bool, dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """An ``O_PATH`` descriptor of the regular file ``path`` and its ``fstat``: nothing is opened for
    real, so a FIFO or a device (a terminal, a watchdog) another user names is refused unopened.
    Raises :class:`NotRegularFile`; OSError ``ELOOP`` for a symlink when not ``follow``."""
    pinned = os.open(path, _PIN_FLAGS if follow else _PIN_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
    try:
        info = os.fstat(pinned)
        if stat.S_ISLNK(info.st_mode):  # O_PATH | O_NOFOLLOW names the link itself
            raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), os.fspath(path))
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(os.fspath(path), describe(info.st_mode))
    except BaseException:
        os.close(pinned)
        raise
    return pinned, info


def reopen(pinned: int, path: str | Path) -> int:
    """A non-blocking read descriptor of the regular file :func:`pin` gave (the same inode), never a
    controlling terminal. Raises OSError (named by ``path``; ``ENOSYS`` where ``/proc`` is not there)."""
    try:
        return os.open(f"/proc/self/fd/{pinned}", _REOPEN_FLAGS)
    except FileNotFoundError:
        raise OSError(errno.ENOSYS, "it cannot be reopened: /proc is not mounted", os.fspath(path)) from None
    except OSError as exc:
        raise OSError(exc.errno, exc.strerror, os.fspath(path)) from None


def open_file(path: str | Path, *, follow: bool, dir_fd: int | None = None) -> tuple[int, os.stat_result]:
    """:func:`pin` then :func:`reopen`: a non-blocking read descriptor of a regular file another user may
    name, and its ``fstat`` taken before the open. Raises OSError, :class:`NotRegularFile`."""
    pinned, info = pin(path, follow=follow, dir_fd=dir_fd)
    try:
        return reopen(pinned, path), info
    finally:
        os.close(pinned)


def open_regular(path: Path) -> int:
    """Open a file the caller named (a wheel), for reading: symlinks the caller gave are followed, but it
    must be a regular file (a FIFO or a device is refused unopened, :func:`pin`). Raises OSError."""
    fd, _info = open_file(path, follow=True)
    return _regular(fd, str(path))


def _regular(fd: int, path: str) -> int:
    """``fd``, made blocking, when it is of a regular file; else closed, and :class:`NotRegularFile`."""
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise NotRegularFile(path, describe(info.st_mode))
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small(path: Path, limit: int, reader: tuple[int, int] | None = None) -> bytes:
    """The bytes of a small file that others may control (an installed distribution's METADATA, RECORD,
    INSTALLER): a FIFO or a device is refused without blocking, a file larger than ``limit`` before it
    is read, and with ``reader`` (uid, gid) a file that account could not read itself (a symlink the
    environment's owner made to a file of root's). Raises OSError."""
    data, _info = read_small_unless(path, limit, reader, None)
    assert data is not None  # nothing is known without reading it
    return data


def read_small_unless(
    path: Path,
    limit: int,
    reader: tuple[int, int] | None,
    known: Callable[[os.stat_result], bool] | None,
) -> tuple[bytes | None, os.stat_result | None]:
    """:func:`read_small`, checked the same way; None for the bytes, unread, where ``known`` says what
    the descriptor's ``fstat`` shows is already known. With the bytes: the ``fstat`` taken before the
    read when it is unchanged after it (else None: its identity cannot stand for the bytes read)."""
    pinned, info = pin(path, follow=True)  # a FIFO or a device (a terminal) is never opened
    try:
        if reader is not None and not permitted(info.st_mode, info.st_uid, info.st_gid, reader, 4):
            raise PermissionError(errno.EACCES, f"uid {reader[0]} may not read it", str(path))
        if info.st_size > limit:
            raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
        if known is not None and known(info):
            return None, info
        fd = reopen(pinned, path)
    finally:
        os.close(pinned)
    try:
        chunks: list[bytes] = []
        size = 0
        while chunk := os.read(fd, min(1 << 20, limit + 1 - size)):
            chunks.append(chunk)
            size += len(chunk)
            if size > limit:  # it grew since the fstat
                raise OSError(errno.EFBIG, f"larger than {limit} bytes", str(path))
        after = os.fstat(fd) if known is not None else info
        unmoved = _identity(after) == _identity(info) and size == info.st_size
        return b"".join(chunks), info if unmoved else None
    finally:
        os.close(fd)


def _identity(info: os.stat_result) -> tuple[int, int, int, int, int]:
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def open_directory(path: Path) -> int:
    """Open an absolute directory path walking from ``/`` by descriptor, following no symlink in any
    component: whoever owns a directory above the prefix (a service account's home) cannot swap it for a
    symlink into another environment between the probe and a write. Raises OSError (``ELOOP`` or
    ``ENOTDIR`` for a symlink, ``EINVAL`` for a relative path or one with ``..``)."""
    text = os.fspath(path)
    parts = [part for part in text.split("/") if part not in ("", ".")]
    if not text.startswith("/") or ".." in parts:
        raise OSError(errno.EINVAL, "not an absolute, normal path", text)
    fd = os.open("/", _DIR_FLAGS)
    walked = ""
    try:
        for part in parts:
            walked += "/" + part
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OSError(exc.errno, f"{walked} is a symlink or not a directory", text) from exc
                raise OSError(exc.errno, exc.strerror, text) from exc
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


def _open_child(fd: int, name: str) -> int:
    """A new descriptor of the real directory ``name`` in the directory ``fd``; NotADirectoryError
    for a symlink or a file, FileNotFoundError when it is not there."""
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise NotADirectoryError(
                errno.ENOTDIR, "not a real directory (a symlink or a file)", name
            ) from None
        raise


def _unlink_or_open(dir_fd: int, name: str, is_dir: bool) -> int | None:
    """Unlink the entry ``name`` of ``dir_fd``, or open it when it is a directory; None when it is gone.
    ``is_dir`` is the listing's word: where the entry changed kind since, the other way is tried."""
    for _ in range(_REMOVE_TRIES):
        try:
            if is_dir:
                return os.open(name, _REMOVE_DIR_FLAGS, dir_fd=dir_fd)
            os.unlink(name, dir_fd=dir_fd)
            return None
        except FileNotFoundError:
            return None
        except OSError as exc:
            swapped = (errno.ENOTDIR, errno.ELOOP) if is_dir else (errno.EISDIR,)
            if exc.errno not in swapped:
                raise
            is_dir = not is_dir
    raise OSError(errno.EAGAIN, "it keeps changing between a file and a directory", name)


def mount_of(fd: int) -> int | None:
    """The id of the mount that holds the open file ``fd`` (``/proc/self/fdinfo``); None when unknown.
    Read as bytes: no codec is looked up (a worker that is an account may not read the interpreter's
    ``encodings`` package to import one)."""
    with contextlib.suppress(OSError, ValueError), open(f"/proc/self/fdinfo/{fd}", "rb") as info:
        for line in info:
            if line.startswith(b"mnt_id:"):
                return int(line.split()[1])
    return None


def at_or_below(path: str, top: str) -> bool:
    """Pure: ``path`` is ``top`` or lies below it, lexically (for trees named by ``/`` paths that are not
    the filesystem's, such as cgroups; a filesystem path asks ``env/containment``)."""
    top = top.rstrip("/")
    return path == top or path.startswith(top + "/")


def mounts_below(path: Path) -> list[str]:
    """Mount points strictly below ``path`` (absolute), from ``/proc/self/mountinfo``."""
    base = os.path.join(os.fspath(path), "")
    found: list[str] = []
    try:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as table:
            for line in table:
                fields = line.split(" ")
                if len(fields) > 4:
                    point = re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), fields[4])
                    if point.startswith(base):
                        found.append(point)
    except OSError:
        return found
    return found


#: The most levels below its top a walk enters (each level holds a descriptor while its directory's
#: entries are walked), and the most entries it lists: the owner of a tree makes it as deep and as
#: wide as it likes (a chain of 6,000 directories cost 139 s and memory growing with the square of
#: the depth, when each directory was opened again from the root).
WALK_MAX_DEPTH = 256
WALK_MAX_ENTRIES = 4_000_000


class TreeTooLarge(OSError):
    """A walk reached its bound: deeper or larger than any installed tree is."""


def walk_below(
    fd: int,
    relative: str,
    files: list[str],
    directories: list[str],
    max_depth: int = WALK_MAX_DEPTH,
    max_entries: int = WALK_MAX_ENTRIES,
    deadline: float | None = None,
    budget: list[int] | None = None,
) -> None:
    """Every entry below the directory ``fd`` (closed here), by descriptor with ``O_NOFOLLOW`` and no
    recursion: directories into ``directories``, the rest into ``files``, relative to ``relative``. Raises
    :class:`TreeTooLarge` past ``max_depth``, ``max_entries``, ``budget[0]`` or ``deadline``."""
    if budget is not None:
        max_entries = min(max_entries, budget[0])
    try:
        first = _listing(fd)
    except BaseException:
        os.close(fd)
        raise
    stack: list[tuple[int, str, list[tuple[str, bool]]]] = [(fd, relative, first[::-1])]
    entries = 0
    try:
        while stack:
            parent, here, pending = stack[-1]
            if not pending:
                os.close(stack.pop()[0])
                continue
            name, is_dir = pending.pop()
            entries += 1
            if budget is not None:
                budget[0] -= 1
            if entries > max_entries:
                raise TreeTooLarge(errno.EFBIG, f"more than {max_entries} entries below it", relative or ".")
            if deadline is not None and not entries % 1024 and time.monotonic() > deadline:
                raise TreeTooLarge(errno.ETIMEDOUT, "its walk ran past its deadline", relative or ".")
            path = f"{here}/{name}" if here else name
            if not is_dir:
                files.append(path)
                continue
            directories.append(path)
            if len(stack) > max_depth:
                raise TreeTooLarge(errno.ELOOP, f"more than {max_depth} levels deep", relative or ".")
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=parent)
            except OSError:
                continue  # replaced while we walked: not a real directory any more
            try:
                listed = _listing(child)
            except BaseException:  # as a listing that fails always did: raised
                os.close(child)
                raise
            stack.append((child, path, listed[::-1]))
    finally:
        for held, _, _ in stack:
            os.close(held)


def _listing(fd: int) -> list[tuple[str, bool]]:
    """The entries of the directory ``fd``: (name, whether the listing says it is a real directory)."""
    with os.scandir(fd) as entries:
        return [(entry.name, entry.is_dir(follow_symlinks=False)) for entry in entries]


@dataclass(slots=True)
class _Emptying:
    """A directory that :func:`remove_at` empties: its descriptor, its name in its parent, the entries
    left to remove, and how often it was listed."""

    fd: int
    name: str
    left: list[tuple[str, bool]]
    listed: int = 1


def _descend(stack: list[_Emptying], fd: int, name: str) -> None:
    """Push the directory ``fd`` (taken: closed with the stack) onto ``stack``, listed."""
    stack.append(_Emptying(fd, name, []))
    if len(stack) > MAX_REMOVE_DEPTH:
        raise OSError(errno.ELOOP, f"more than {MAX_REMOVE_DEPTH} directories deep", name)
    stack[-1].left = _listing(fd)


def remove_at(dir_fd: int, name: str, deadline: float | None = None) -> bool:
    """Remove the entry ``name`` of ``dir_fd`` and, for a directory, everything below it; False when absent.
    Each directory is opened by descriptor with ``O_NOFOLLOW``: a symlink is unlinked, never followed. Raises
    OSError (past :data:`MAX_REMOVE_DEPTH`, a mount point below, EXDEV) and TimeoutError past ``deadline``;
    what was removed stays removed."""
    try:
        info = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    top = _unlink_or_open(dir_fd, name, stat.S_ISDIR(info.st_mode))
    if top is None:
        return True
    stack: list[_Emptying] = []
    mount = mount_of(top)
    try:
        _descend(stack, top, name)
        while stack:
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(errno.ETIMEDOUT, "still being filled when time ran out", name)
            here = stack[-1]
            if here.left:
                child_name, is_dir = here.left.pop()
                child = _unlink_or_open(here.fd, child_name, is_dir)
                if child is not None and mount_of(child) != mount:  # another filesystem's: never emptied
                    os.close(child)
                    raise OSError(errno.EXDEV, "a mount point below: not removed", child_name)
                if child is not None:
                    _descend(stack, child, child_name)
                continue
            parent = stack[-2].fd if len(stack) > 1 else dir_fd
            try:
                os.rmdir(here.name, dir_fd=parent)
            except FileNotFoundError:
                pass  # moved away meanwhile: not in this tree any more
            except OSError as exc:
                if exc.errno == errno.ENOTEMPTY and here.listed < _REMOVE_TRIES:  # refilled meanwhile
                    here.listed += 1
                    here.left = _listing(here.fd)
                    continue
                if exc.errno != errno.ENOTDIR:
                    raise
                with contextlib.suppress(FileNotFoundError):  # swapped for a symlink or a file meanwhile
                    os.unlink(here.name, dir_fd=parent)
            os.close(stack.pop().fd)
    finally:
        for emptying in stack:
            os.close(emptying.fd)
    return True


_libc: ctypes.CDLL | None = None


def renameat2(src_fd: int, src: str, dst_fd: int, dst: str, flags: int) -> None:
    """``renameat2(2)`` of single names, no symlink followed: ``src`` in ``src_fd`` to ``dst`` in ``dst_fd``;
    ``flags`` 0, :data:`RENAME_NOREPLACE` or :data:`RENAME_EXCHANGE`. Raises OSError."""
    global _libc
    if _libc is None:
        _libc = ctypes.CDLL(None, use_errno=True)
    for name in (src, dst):
        if not name or "/" in name or name in (".", "..") or "\0" in name:
            raise OSError(errno.EINVAL, "not one path component", name)
    if _libc.renameat2(src_fd, os.fsencode(src), dst_fd, os.fsencode(dst), ctypes.c_uint(flags)) != 0:
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), f"{src} -> {dst}")


class _Cursor:
    """One thread's open directories in a batch: ``fds[i]`` is the directory ``names[: i + 1]``."""

    __slots__ = ("busy", "fds", "generation", "names")

    def __init__(self, generation: int) -> None:
        self.names: list[str] = []
        self.fds: list[int] = []
        self.busy = False  # a descriptor of it is in use: a nested walk opens its own
        self.generation = generation

    def truncate(self, keep: int) -> None:
        while len(self.fds) > keep:
            os.close(self.fds.pop())
            self.names.pop()

    def move(self, root: int, parts: tuple[str, ...], generation: int) -> int:
        """The descriptor of the directory ``parts`` (the root's for none), opening only the components
        that differ from the last walk; valid until the next move."""
        if generation != self.generation:  # a directory was removed meanwhile: walk again
            self.truncate(0)
            self.generation = generation
        common = 0
        for have, want in zip(self.names, parts, strict=False):
            if have != want:
                break
            common += 1
        self.truncate(common)
        for name in parts[common:]:
            self.fds.append(_open_child(self.fds[-1] if self.fds else root, name))
            self.names.append(name)
        return self.fds[-1] if self.fds else root


class Tree:
    """A directory opened once; every operation below it walks by descriptor, never through a symlink. The
    root is opened from ``/`` a component at a time. A context manager; shared between threads safely (inside
    :meth:`batch`, each thread has its own cursor)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.fd = open_directory(root)
        self._cursors: list[_Cursor] | None = None  # inside a batch: every thread's cursor
        self._local = threading.local()
        self._lock = threading.Lock()
        self._generation = 0  # bumped when a directory is removed: cursors walk again

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @contextlib.contextmanager
    def batch(self) -> Iterator[Tree]:
        """Keep each thread's directory descriptors until the end of the block (see the module's
        docstring). Every thread that works in the tree must be done before the block ends."""
        if self._cursors is not None:  # nested: the outer batch keeps them
            yield self
            return
        cursors: list[_Cursor] = []
        self._cursors = cursors
        try:
            yield self
        finally:
            self._cursors = None
            self._local = threading.local()
            for cursor in cursors:
                cursor.truncate(0)

    def _cursor(self) -> _Cursor | None:
        cursors = self._cursors
        if cursors is None:
            return None
        cursor: _Cursor | None = getattr(self._local, "cursor", None)
        if cursor is None:
            cursor = _Cursor(self._generation)
            with self._lock:
                cursors.append(cursor)
            self._local.cursor = cursor
        return cursor

    def _removed_directory(self) -> None:
        with self._lock:
            self._generation += 1

    def __enter__(self) -> Tree:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def relative(self, location: Path | str) -> str | None:
        """Pure: ``location`` (absolute, normalised lexically) relative to the root; None when it is
        outside (or is no plain path: a NUL in it)."""
        normal = os.path.normpath(location)
        base = os.path.join(os.fspath(self.root), "")
        if not normal.startswith(base) or len(normal) == len(base) or "\0" in normal:
            return None
        return normal[len(base) :]

    # --- walking ---------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _directory(self, parts: tuple[str, ...]) -> Iterator[int]:
        """A descriptor of the directory ``parts`` (relative to the root), valid inside the block.
        FileNotFoundError when a component is missing; NotADirectoryError when one is not a real
        directory (a symlink too)."""
        cursor = self._cursor()
        if cursor is None or cursor.busy:
            fd = self._walk_from_root(parts)
            try:
                yield fd
            finally:
                os.close(fd)
            return
        cursor.busy = True
        try:
            yield cursor.move(self.fd, parts, self._generation)
        finally:
            cursor.busy = False

    def _walk_from_root(self, parts: tuple[str, ...]) -> int:
        fd = os.dup(self.fd)
        try:
            for name in parts:
                child = _open_child(fd, name)
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_dir(self, parts: tuple[str, ...]) -> int:
        """A new descriptor of the directory ``parts`` (the caller closes it); errors as
        :meth:`_directory`."""
        if not parts:
            return os.dup(self.fd)
        with self._directory(parts[:-1]) as fd:
            return _open_child(fd, parts[-1])

    @contextlib.contextmanager
    def parent(self, relative: str) -> Iterator[tuple[int, str]]:
        """(descriptor of the directory holding ``relative``, its last name), valid inside the block."""
        parts = parts_of(relative)
        with self._directory(parts[:-1]) as fd:
            yield fd, parts[-1]

    def lstat(self, relative: str) -> os.stat_result | None:
        """The entry itself (a symlink is not followed), or None when it, or a real directory on its
        way, is not there (a symlink on the way counts as not there)."""
        try:
            with self.parent(relative) as (fd, name):
                return os.stat(name, dir_fd=fd, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None

    def mount_id(self, relative: str) -> int | None:
        """The id of the mount that holds the entry ``relative`` itself ("": the root), as the kernel
        says in ``/proc/self/fdinfo`` (a rename cannot cross mounts, even on one device); None when it
        is not there."""
        try:
            if relative:
                with self.parent(relative) as (fd, name):
                    opened = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            else:
                opened = os.dup(self.fd)
        except (FileNotFoundError, NotADirectoryError):
            return None
        try:
            return mount_of(opened)
        finally:
            os.close(opened)

    def mark_changed(self, relative: str) -> os.stat_result | None:
        """Move the change time of the regular file or real directory ``relative`` to now and change
        nothing else (its access and modification times written back as they were): its ``fstat``
        after, or None when it is not there, is anything else, or lies below a symlink (never followed;
        a device is never opened)."""
        info = self.lstat(relative)
        if info is None or not (stat.S_ISREG(info.st_mode) or stat.S_ISDIR(info.st_mode)):
            return None
        try:
            with self.parent(relative) as (fd, name):
                if stat.S_ISDIR(info.st_mode):
                    opened = os.open(name, _DIR_FLAGS, dir_fd=fd)
                else:
                    opened, _now = open_file(name, follow=False, dir_fd=fd)
        except OSError:  # replaced meanwhile: a symlink (ELOOP), a FIFO, gone, below one
            return None
        try:
            now = os.fstat(opened)
            if stat.S_IFMT(now.st_mode) != stat.S_IFMT(info.st_mode):
                return None
            os.utime(opened, ns=(now.st_atime_ns, now.st_mtime_ns))
            return os.fstat(opened)
        finally:
            os.close(opened)

    def is_dir(self, relative: str) -> bool:
        info = self.lstat(relative)
        return info is not None and stat.S_ISDIR(info.st_mode)

    def files_below(self, relative: str) -> list[str]:
        """What :meth:`walk` finds below ``relative`` that is not a real directory (files, symlinks...)."""
        return self.walk(relative)[0]

    def walk(self, relative: str) -> tuple[list[str], list[str]]:
        """Everything below the directory ``relative`` ("": the root), found by listing each directory
        by its descriptor, without a ``stat`` of the files: (what is not a real directory, the real
        directories), relative to the root, sorted. A symlink is listed, never entered.
        :class:`TreeTooLarge` beyond :data:`WALK_MAX_DEPTH` levels or :data:`WALK_MAX_ENTRIES` entries."""
        files: list[str] = []
        directories: list[str] = []
        try:
            fd = self._open_dir(parts_of(relative)) if relative else os.dup(self.fd)
        except (FileNotFoundError, NotADirectoryError):
            return [], []
        walk_below(fd, relative, files, directories)
        return sorted(files), sorted(directories)

    def names(self, relative: str) -> list[str]:
        """Names in the directory ``relative`` ("": the root; [] when it is not a real directory)."""
        try:
            fd = self._open_dir(parts_of(relative)) if relative else os.dup(self.fd)
        except (FileNotFoundError, NotADirectoryError):
            return []
        try:
            return sorted(os.listdir(fd))
        finally:
            os.close(fd)

    # --- reading ---------------------------------------------------------------------------------

    def open_read(self, relative: str) -> int:
        """A descriptor of the regular file ``relative``, for reading. FileNotFoundError when it is not
        there; :class:`NotRegularFile` for anything else (it is never read, and never blocks)."""
        try:
            with self.parent(relative) as (fd, name):
                try:
                    found, _info = open_file(name, follow=False, dir_fd=fd)
                except NotRegularFile as exc:
                    raise NotRegularFile(relative, exc.what) from None
                except OSError as exc:
                    if exc.errno != errno.ELOOP:
                        raise
                    raise NotRegularFile(relative, "a symlink") from None
        except NotADirectoryError:
            raise NotRegularFile(relative, "below a symlink or a file") from None
        return _regular(found, relative)

    def read_bytes(self, relative: str, limit: int) -> bytes:
        """The content of the regular file ``relative``; ValueError when it is larger than ``limit``."""
        fd = self.open_read(relative)
        try:
            if os.fstat(fd).st_size > limit:
                raise ValueError(f"{relative} is larger than {limit} bytes")
            data = b""
            while len(data) <= limit and (chunk := os.read(fd, _CHUNK)):
                data += chunk
            if len(data) > limit:
                raise ValueError(f"{relative} is larger than {limit} bytes")
            return data
        finally:
            os.close(fd)

    def sha256(self, relative: str) -> str | None:
        """Hex sha256 of the regular file ``relative``; None when it is not there or not regular."""
        try:
            fd = self.open_read(relative)
        except (FileNotFoundError, NotRegularFile):
            return None
        try:
            with os.fdopen(os.dup(fd), "rb", buffering=0) as handle:
                return hashlib.file_digest(handle, "sha256").hexdigest()
        finally:
            os.close(fd)

    def readlink(self, relative: str) -> str | None:
        """The target of the symlink ``relative`` (never followed); None when it is not a symlink."""
        try:
            with self.parent(relative) as (fd, name):
                return os.readlink(name, dir_fd=fd)
        except (FileNotFoundError, NotADirectoryError):
            return None
        except OSError as exc:
            if exc.errno == errno.EINVAL:  # not a symlink
                return None
            raise

    # --- changing --------------------------------------------------------------------------------

    def unlink(self, relative: str) -> bool:
        """Remove the entry ``relative`` (a symlink itself, never its target); False when it is not there
        (or lies below a symlink: then it is not in this tree). A real directory is left alone."""
        try:
            with self.parent(relative) as (fd, name):
                os.unlink(name, dir_fd=fd)
        except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
            return False
        except PermissionError:  # Linux says EPERM for unlink() of a directory
            info = self.lstat(relative)
            if info is not None and stat.S_ISDIR(info.st_mode):
                return False
            raise
        return True

    def remove_tree(self, relative: str, deadline: float | None = None) -> bool:
        """Remove ``relative`` and everything below it, by descriptor (a symlink is removed, not
        followed); False when it is not there. ``deadline``: as for :func:`remove_at`."""
        try:
            with self.parent(relative) as (fd, name):
                info = os.stat(name, dir_fd=fd, follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode):
                    self._removed_directory()
                return remove_at(fd, name, deadline)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def move_to(
        self, relative: str, dest: Tree, dest_relative: str, flags: int, directory: bool = True
    ) -> None:
        """Move the entry ``relative`` (a file, a symlink, a whole directory) to ``dest_relative`` in ``dest``
        (the same filesystem) with :func:`renameat2` ``flags``; both parents are walked by descriptor, no
        symlink followed. Raises OSError (FileNotFoundError: not there, or below a symlink)."""
        with self.parent(relative) as (src_fd, src), dest.parent(dest_relative) as (dst_fd, dst):
            renameat2(src_fd, src, dst_fd, dst, flags)
        self._removed_directory()
        if dest is not self:
            dest._removed_directory()

    def rmdir(self, relative: str) -> None:
        with self.parent(relative) as (fd, name):
            self._removed_directory()
            os.rmdir(name, dir_fd=fd)

    def make_dir(self, relative: str, mode: int, owner: tuple[int, int] | None = None) -> None:
        """Make ``relative`` a real directory (its parent must be one): whatever else is there, a
        symlink above all, is removed first and never followed. ``owner``: (uid, gid) to set."""
        with self.parent(relative) as (fd, name):
            try:
                info: os.stat_result | None = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                info = None
            if info is not None and stat.S_ISDIR(info.st_mode):
                return
            if info is not None:
                os.unlink(name, dir_fd=fd)
            try:
                os.mkdir(name, mode, dir_fd=fd)
            except FileExistsError:  # made meanwhile (another thread of this backup): a directory?
                if not stat.S_ISDIR(os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode):
                    raise
                return
            child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            try:
                if owner is not None:
                    os.fchown(child, *owner)
                os.fchmod(child, mode)
            finally:
                os.close(child)

    def set_mode(self, relative: str, mode: int) -> None:
        """Set the mode of the real directory ``relative`` (by descriptor: a symlink is not followed)."""
        fd = self._open_dir(parts_of(relative))
        try:
            os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def make_dirs(self, relative: str, mode: int) -> None:
        """Every missing directory of ``relative`` (in a tree of safeinstall's own: the backup)."""
        parts = parts_of(relative)
        if self.is_dir(relative):  # the usual case in a backup: made for an earlier file
            return
        for end in range(1, len(parts) + 1):
            self.make_dir("/".join(parts[:end]), mode)

    def _temp_name(self, name: str, mark: str) -> str:
        return f".{name}{mark}{os.getpid()}-{os.urandom(4).hex()}"

    def _replace(self, fd: int, tmp: str, name: str) -> None:
        """Rename ``tmp`` over ``name`` in the directory ``fd``; a real directory in the way is removed."""
        try:
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)
        except OSError as exc:
            if exc.errno not in (errno.EISDIR, errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR):
                raise
            info = os.stat(name, dir_fd=fd, follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode):
                raise
            self._removed_directory()
            remove_at(fd, name)
            os.replace(tmp, name, src_dir_fd=fd, dst_dir_fd=fd)

    def write_from(
        self,
        relative: str,
        source_fd: int,
        mode: int,
        owner: tuple[int, int] | None = None,
        mtime_ns: int | None = None,
        mark: str = ".safeinstall-",
        atomic: bool = True,
        acl: bytes | None = None,
    ) -> Copied:
        """Write ``relative`` with the content of ``source_fd``, never through a symlink. ``atomic``: via a
        temp file renamed over it, else created new; ``acl``: an access ACL set before it is visible (OSError
        ENOTSUP where there is none)."""
        with self.parent(relative) as (fd, name):
            target = self._temp_name(name, mark) if atomic else name
            dest = os.open(target, _CREATE_FLAGS, 0o600, dir_fd=fd)
            try:
                try:
                    copied = _copy_fd(source_fd, dest)
                    if owner is not None:
                        os.fchown(dest, *owner)  # before chmod: chown clears set-id bits
                    # with an ACL, the group and other bits come from it (its mask), never before it
                    os.fchmod(dest, mode if acl is None else mode & 0o700)
                    if acl is not None:
                        os.setxattr(dest, ACL_XATTR, acl)
                    os.fsync(dest)
                    if mtime_ns is not None:
                        os.utime(dest, ns=(mtime_ns, mtime_ns))
                finally:
                    os.close(dest)
                if atomic:
                    self._replace(fd, target, name)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(target, dir_fd=fd)
                raise
        return copied

    def symlink(
        self,
        relative: str,
        link_target: str,
        owner: tuple[int, int] | None = None,
        mtime_ns: int | None = None,
        mark: str = ".safeinstall-",
        atomic: bool = True,
    ) -> None:
        """Make ``relative`` a symlink to ``link_target`` (the link is written, nothing is followed)."""
        with self.parent(relative) as (fd, name):
            target = self._temp_name(name, mark) if atomic else name
            os.symlink(link_target, target, dir_fd=fd)
            try:
                if owner is not None:
                    os.chown(target, *owner, dir_fd=fd, follow_symlinks=False)
                if mtime_ns is not None:
                    os.utime(target, ns=(mtime_ns, mtime_ns), dir_fd=fd, follow_symlinks=False)
                if atomic:
                    self._replace(fd, target, name)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.unlink(target, dir_fd=fd)
                raise

    def fsync_dir(self, relative: str) -> None:
        fd = self._open_dir(parts_of(relative)) if relative else os.dup(self.fd)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def copy_out(self, relative: str, dest: Tree, dest_relative: str) -> str:
        """Save ``relative`` into ``dest`` (a tree of safeinstall's own): a regular file by content, a
        symlink as a symlink (its target is never read); what it was ("file", "symlink"). Raises
        :class:`NotRegularFile` for a FIFO, a device or a directory (nothing is read)."""
        link = self.readlink(relative)
        parent = "/".join(parts_of(dest_relative)[:-1])
        if parent:
            dest.make_dirs(parent, 0o700)
        if link is not None:
            dest.symlink(dest_relative, link, atomic=False)
            return "symlink"
        fd = self.open_read(relative)
        try:
            info = os.fstat(fd)
            dest.write_from(
                dest_relative, fd, stat.S_IMODE(info.st_mode), mtime_ns=info.st_mtime_ns, atomic=False
            )
        finally:
            os.close(fd)
        return "file"


def permitted(mode: int, owner: int, group: int, ids: tuple[int, int], want: int) -> bool:
    """Pure: does a file of this ``st_mode``, ``st_uid`` and ``st_gid`` grant ``want`` (the bits as for
    others: 4 read, 2 write, 1 execute/enter, or'ed) to ``ids`` (uid, gid), a process with no supplementary
    groups (as safeinstall runs another account's code)? Access control lists are not read."""
    shift = 6 if owner == ids[0] else 3 if group == ids[1] else 0
    return (mode >> shift) & want == want


def unwritable(directories: Iterable[Path], as_user: tuple[int, int] | None = None) -> list[str]:
    """Which of ``directories`` (each, or its nearest existing parent) cannot be written, and why: a
    read-only mount, or no write permission (as root, only the mount and immutable files say no).
    ``as_user`` (uid, gid): whether that account, rather than the caller, may write them."""
    problems: list[str] = []
    for directory in sorted(set(directories)):
        probe = directory
        while not os.path.lexists(probe) and probe != probe.parent:
            probe = probe.parent
        try:
            read_only = bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
            info = os.stat(probe)
        except OSError as exc:
            problems.append(f"{directory}: {exc.strerror or exc}")
            continue
        if read_only:
            problems.append(f"{probe}: a read-only file system")
        elif as_user is not None:
            if not permitted(info.st_mode, info.st_uid, info.st_gid, as_user, 0o3):
                problems.append(f"{probe}: not writable by uid {as_user[0]}")
        elif not os.access(probe, os.W_OK, effective_ids=os.access in os.supports_effective_ids):
            problems.append(f"{probe}: not writable")
    return problems
