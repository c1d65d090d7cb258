"""The privilege boundary, the worker's side: what runs as the environment's owner.

Each function runs in a worker (:func:`safeinstall.system.worker.call`), acts through
:mod:`safeinstall.system.safefs`, and returns plain JSON that root checks. docs/privsep.md.
"""

from __future__ import annotations

import base64
import contextlib
import csv
import errno
import fcntl
import hashlib
import os
import queue
import re
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from safeinstall.env import hashing
from safeinstall.env.containment import relative_path
from safeinstall.errors import StepFailed
from safeinstall.system.safefs import Tree, only_caller_writes, open_file, remove_at

#: Errors that mean "the account may not do this": the path is not the account's to remove.
_DENIED = (errno.EACCES, errno.EPERM, errno.EROFS)

#: uv's lock of an environment, ``PREFIX/.lock`` (uv creates it 0666: any local user may open and
#: hold it)
UV_LOCK = ".lock"

#: the run's directory of kept links of the old files (:mod:`safeinstall.env.keep`'s ``KEEP_PREFIX``)
_KEEP_PREFIX = ".safeinstall-keep-"


def remove_installed(prefix: str, files: list[str], dist_infos: list[str], stop: list[str]) -> dict[str, Any]:
    """Remove ``files`` and the ``dist_infos`` directories, then directories left empty up to ``stop``.
    What the account may not remove is ``denied``, not a failure. Returns ``{"removed",
    "removed_dist_infos", "denied", "failures"}``.
    """
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
    """Put a new, empty uv lock file at ``PREFIX/.lock``, 0600 and the owner's, so that no other user
    holds the lock uv takes while the services are down. Returns ``{"replaced": bool}``.
    """
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


def read_texts(paths: list[str], limit: int) -> list[list[str | None]]:
    """Each file's text (at most ``limit`` bytes, undecodable bytes replaced), or None and why: what the
    account may read of a unit's ``EnvironmentFile=`` files (the smoke check, safeinstall.env.importcheck).
    Opened as systemd opens them, symlinks followed: the kernel checks each as the account."""
    read: list[list[str | None]] = []
    for path in paths:
        try:  # a FIFO or a device is refused unopened (a FIFO would hold the worker until its timeout)
            fd, _info = open_file(path, follow=True)
            with os.fdopen(fd, "rb") as handle:
                data = handle.read(limit + 1)
        except OSError as exc:
            read.append([None, exc.strerror or str(exc)])
            continue
        if len(data) > limit:
            read.append([None, f"more than {limit} bytes"])
            continue
        read.append([data.decode("utf-8", "replace"), None])
    return read


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


#: uv's link from a wheel's entry to its unpacked archive: ``../../../archive-v0/ID`` (one ``..`` per
#: directory between the entry and the cache's top)
_ARCHIVE_LINK = re.compile(r"^(?:\.\./)+(?P<bucket>archive-v[0-9]+)/(?P<id>[A-Za-z0-9_-]{1,64})$")
#: what of a wheel's entry is copied besides the link: uv's HTTP cache policy, metadata and revision
_ENTRY_SUFFIXES = (".http", ".msgpack", ".rev")
_COPY_CHUNK = 64 << 20
FICLONE = 0x40049409  # linux/fs.h: _IOW(0x94, 9, int), a reflink of a whole file
#: Threads that copy an unpacked wheel's files (one per CPU, at least two: a copy also waits on the disk)
COPY_THREADS = max(2, min(8, hashing.default_workers()))


def copy_cached_wheels(
    source: str, target: str, wanted: list[list[str]], known: Known | None = None
) -> dict[str, Any]:
    """Clone or copy into the run's cache ``target`` the unpacked wheels of ``wanted`` that the cache
    ``source`` holds, never linking, as the owner of both (``known``: :func:`_copy_file`); one that
    differs from its RECORD is ``damaged``, not taken. ``{"archives", "taken", "prints", "bytes",
    "entries", "damaged", "digests", "unread"}`` (docs/window.md).
    """
    archives: set[tuple[str, str]] = set()
    prints: dict[str, str] = {}
    written: list[tuple[int, str, Written]] = []  # (size, path in the target, as written) of each copy
    bad: set[tuple[str, str]] = set()
    copied = 0
    unread = 0
    entries: list[str] = []
    damaged: list[str] = []
    top = Path(source)
    for name, version, entry_dir, entry, (bucket_name, archive_id, text) in _cached_entries(top, wanted):
        if (bucket_name, archive_id) in bad:
            continue
        if (bucket_name, archive_id) not in archives:
            archive = Path(bucket_name) / archive_id
            try:  # its print first: any later write in place moves an mtime it holds
                prints[f"{bucket_name}/{archive_id}"] = archive_print(top / archive)
                size, hashed, kept = _copy_tree(top / archive, Path(target) / archive, known)
            except FileNotFoundError:
                continue  # a link to an archive uv has removed since
            digests = {relative: written[0] for _, relative, written in hashed}
            if not _matches_record(Path(target) / archive, digests):
                _remove_tree(Path(target) / archive)
                bad.add((bucket_name, archive_id))
                damaged.append(f"{name} {version}")
                continue
            copied += size
            unread += kept
            archives.add((bucket_name, archive_id))
            written.extend((n, f"{archive}/{relative}", d) for n, relative, d in hashed)
        destination = Path(target) / relative_path(entry_dir, top)
        destination.mkdir(parents=True, exist_ok=True)
        for suffix in _ENTRY_SUFFIXES:
            with contextlib.suppress(FileNotFoundError, FileExistsError):
                copied += _copy_file(entry_dir / (entry + suffix), destination / (entry + suffix))[0]
        with contextlib.suppress(FileExistsError):
            os.symlink(text, destination / entry)
        entries.append(f"{name} {version}")
    return {
        "archives": len(archives),
        "taken": sorted(f"{bucket}/{archive_id}" for bucket, archive_id in archives),
        "prints": {
            archive: prints[archive] for archive in sorted(prints) if tuple(archive.split("/")) in archives
        },
        "bytes": copied,
        "entries": sorted(set(entries)),
        "damaged": sorted(set(damaged)),
        "digests": _within_budget(written),
        "unread": unread,
    }


def link_cached_wheels(source: str, target: str, wanted: list[list[str]]) -> dict[str, Any]:
    """Hardlink into the probe's throwaway cache ``target`` the unpacked wheels of ``wanted`` that
    ``source`` holds, their entries and uv's index pages of their names, as root (never live: docs/window.md).
    Never follows a link; what is not root's alone is not linked. ``{"archives", "prints", "entries",
    "files"}`` (``prints``: :func:`archive_print` of each linked archive)."""
    top, there = Path(source), Path(target)
    taken: set[str] = set()
    prints: dict[str, str] = {}
    entries: list[str] = []
    files = 0
    try:
        listing = sorted(os.listdir(top))
    except OSError:
        listing = []
    names = {name for name, _ in wanted}
    for bucket in (n for n in listing if re.fullmatch(r"simple-v[0-9]+", n)):
        for index_dir in _index_dirs(top / bucket):
            for name in names:
                page = index_dir / f"{name}.rkyv"
                with contextlib.suppress(OSError):
                    files += _link_file(page, there / relative_path(page, top))
    for name, version, entry_dir, entry, (bucket_name, archive_id, text) in _cached_entries(top, wanted):
        archive = f"{bucket_name}/{archive_id}"
        if archive not in taken:
            try:
                files += _link_tree(top / archive, there / archive)
                prints[archive] = archive_print(there / archive)
            except FileNotFoundError:
                continue
            taken.add(archive)
        destination = there / relative_path(entry_dir, top)
        destination.mkdir(parents=True, exist_ok=True)
        for suffix in _ENTRY_SUFFIXES:
            with contextlib.suppress(OSError):
                files += _link_file(entry_dir / (entry + suffix), destination / (entry + suffix))
        with contextlib.suppress(FileExistsError):
            os.symlink(text, destination / entry)
        entries.append(f"{name} {version}")
    return {"archives": sorted(taken), "prints": prints, "entries": sorted(set(entries)), "files": files}


def _cached_entries(
    top: Path, wanted: list[list[str]]
) -> Iterator[tuple[str, str, Path, str, tuple[str, str, str]]]:
    """Each entry of uv's cache ``top`` for a ``[name, version]`` of ``wanted`` that is this worker's own
    link to an unpacked wheel: ``(name, version, its directory, its name, (bucket, archive id, link
    text))``. Never follows a link; a directory another may write is passed over."""
    try:
        buckets = sorted(n for n in os.listdir(top) if re.fullmatch(r"wheels-v[0-9]+", n))
    except OSError:
        buckets = []
    for bucket in buckets:
        for index_dir in _index_dirs(top / bucket):
            depth = len(relative_path(index_dir, top).parts) + 1  # the name's directory below the top
            for name, version in wanted:
                entry_dir = index_dir / name
                try:
                    _check_controlled(os.lstat(entry_dir), entry_dir)
                    found = sorted(os.listdir(entry_dir))
                except OSError:
                    continue
                for entry in found:
                    if not entry.startswith(f"{version}-"):
                        continue
                    try:  # a link names the archive: it must be this worker's own
                        if os.lstat(entry_dir / entry).st_uid != os.geteuid():
                            continue
                    except OSError:
                        continue
                    link = _archive_of(entry_dir / entry, depth)
                    if link is not None:
                        yield name, version, entry_dir, entry, link


def archive_print(root: Path) -> str:
    """Every regular file below ``root`` by its path, inode, size and mtime, as one sha256 (hex): the
    same print at two moments, no write in place between them (a write moves the mtime). Never follows a
    link. Raises OSError (FileNotFoundError when ``root`` is gone)."""
    lines: list[str] = []
    pending = [(root, "")]
    while pending:
        here, relative = pending.pop()
        with os.scandir(here) as listing:
            for item in listing:
                info = item.stat(follow_symlinks=False)
                if stat.S_ISDIR(info.st_mode):
                    pending.append((Path(item.path), f"{relative}{item.name}/"))
                elif stat.S_ISREG(info.st_mode):
                    lines.append(
                        f"{relative}{item.name}\0{info.st_ino}\0{info.st_size}\0{info.st_mtime_ns}\n"
                    )
    return hashlib.sha256("".join(sorted(lines)).encode("utf-8", "surrogateescape")).hexdigest()


def _link_file(source: Path, destination: Path) -> int:
    """Hardlink one regular file of root's alone (never a symlink): 1 when linked. Raises OSError."""
    info = os.lstat(source)
    if not stat.S_ISREG(info.st_mode):
        return 0
    _check_controlled(info, source)
    destination.parent.mkdir(parents=True, exist_ok=True)
    os.link(source, destination, follow_symlinks=False)
    return 1


def _link_tree(source: Path, destination: Path) -> int:
    """Hardlink a tree of regular files and directories, root's alone (PermissionError otherwise; a
    symlink is left out): the files linked. FileNotFoundError when ``source`` is gone."""
    linked = 0
    pending = [(source, destination)]
    while pending:
        here, dest = pending.pop()
        with os.scandir(here) as listing:
            os.makedirs(dest, 0o755, exist_ok=True)
            for item in listing:
                info = item.stat(follow_symlinks=False)
                _check_controlled(info, Path(item.path))
                if stat.S_ISDIR(info.st_mode):
                    pending.append((Path(item.path), dest / item.name))
                elif stat.S_ISREG(info.st_mode):
                    os.link(item.path, dest / item.name, follow_symlinks=False)
                    linked += 1
    return linked


#: What of the copies' digests the answer carries (the worker's answer is bounded): the largest files'
DIGESTS_BUDGET = 2 << 20


def _within_budget(written: list[tuple[int, str, Written]]) -> dict[str, list[Any]]:
    """Pure: ``{path: [sha256, size, inode, mtime_ns]}`` of the largest files written (``(size, path, as
    written)``), as many as fit in :data:`DIGESTS_BUDGET` bytes of the answer."""
    kept: dict[str, list[Any]] = {}
    used = 0
    for size, path, (digest, inode, mtime_ns) in sorted(written, reverse=True):
        used += len(path) + len(digest) + 48
        if used > DIGESTS_BUDGET:
            break
        kept[path] = [digest, size, inode, mtime_ns]
    return kept


def _matches_record(archive: Path, digests: dict[str, str] | None = None) -> bool:
    """Whether every file an unpacked wheel's RECORD lists with a digest is there with that digest (the
    copy's sha256 as it was written, from ``digests`` by relative path; else read from the copy: the
    worker's own new inodes). An archive without one RECORD is not judged."""
    digests = digests or {}
    records = [archive / d / "RECORD" for d in _listing(archive) if d.endswith(".dist-info")]
    if len(records) != 1:
        return True
    try:
        text = _read_regular(records[0]).decode("utf-8", errors="replace")
    except OSError:
        return False
    for row in csv.reader(text.splitlines()):
        if len(row) < 2 or "=" not in row[1]:
            continue
        relative, (algorithm, _, digest) = row[0], row[1].partition("=")
        if Path(relative).is_absolute() or ".." in Path(relative).parts:
            continue  # outside the archive's own tree: not in it
        if algorithm not in hashlib.algorithms_guaranteed:
            continue
        written = digests.get(os.path.normpath(relative)) if algorithm == "sha256" else None
        if written is not None:
            if written != digest:
                return False
            continue
        try:
            data = _read_regular(archive / relative)
        except OSError:
            return False
        found = base64.urlsafe_b64encode(hashlib.new(algorithm, data).digest()).rstrip(b"=").decode()
        if found != digest:
            return False
    return True


def _listing(directory: Path) -> list[str]:
    try:
        return sorted(os.listdir(directory))
    except OSError:
        return []


def _read_regular(path: Path) -> bytes:
    """A regular file's bytes, never through a symlink (OSError otherwise)."""
    fd, _info = open_file(path, follow=False)
    try:
        chunks = []
        while chunk := os.read(fd, _COPY_CHUNK):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _remove_tree(root: Path) -> None:
    """Remove a tree this worker made (its own copy of a damaged archive); never following a link."""
    for directory, dirs, files in os.walk(root, topdown=False):
        for name in files:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
        for name in dirs:
            with contextlib.suppress(OSError):
                os.rmdir(os.path.join(directory, name))
    with contextlib.suppress(OSError):
        os.rmdir(root)


def _index_dirs(bucket: Path) -> list[Path]:
    """The directories of a wheel bucket that hold one directory per distribution name."""
    found = [bucket / "pypi"] if (bucket / "pypi").is_dir() else []
    with contextlib.suppress(OSError):
        found += [bucket / "index" / h for h in sorted(os.listdir(bucket / "index"))]
    return found


def _archive_of(entry: Path, depth: int) -> tuple[str, str, str] | None:
    """(bucket, id, the link's text) when ``entry`` is uv's link to an archive at the cache's top."""
    try:
        text = os.readlink(entry)
    except OSError:
        return None
    match = _ARCHIVE_LINK.match(text)
    if match is None or text.count("../") != depth:
        return None
    return match["bucket"], match["id"], text


#: A source file's digest kept by root's verified-inode store, for its ``fstat`` (None: not known)
Known = Callable[[os.stat_result], str | None]


def _copy_file(
    source: Path, destination: Path, buffer: memoryview | None = None, known: Known | None = None
) -> tuple[int, Written | None, bool]:
    """Copy one regular file (never following a symlink; a new file, not a link): bytes copied, what
    was written (:data:`Written`) when the bytes went through ``buffer``, or when ``known`` has the
    source's digest and the source did not move while the kernel copied (cloned) it (None: otherwise),
    and whether that digest stands for it (copied without being read here)."""
    src = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        info = os.fstat(src)
        if not stat.S_ISREG(info.st_mode):
            return 0, None, False
        _check_controlled(info, source)
        digest = known(info) if known is not None else None
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        dst = os.open(destination, flags, info.st_mode & 0o755)
        try:
            cloned = False
            with contextlib.suppress(OSError):  # no reflink here (ext4, another filesystem): copied
                fcntl.ioctl(dst, FICLONE, src)
                cloned = True
            if digest is not None:  # the bytes the store hashed: copied in the kernel, never read here
                done = info.st_size if cloned else _copy_in_kernel(src, dst)
                if done == info.st_size and _unmoved(info, os.fstat(src)):
                    mine = os.fstat(dst)
                    return done, (digest, mine.st_ino, mine.st_mtime_ns), True
                os.ftruncate(dst, 0)  # it moved meanwhile (root's own uv): copied again, read and hashed
                os.lseek(src, 0, os.SEEK_SET)
                os.lseek(dst, 0, os.SEEK_SET)
                cloned = False
            if cloned:
                return info.st_size, None, False
            if buffer is not None:  # read once: hashed as it is written (no second read to check it)
                return (*_copy_hashed(src, dst, buffer), False)
            return _copy_in_kernel(src, dst), None, False
        finally:
            os.close(dst)
    finally:
        os.close(src)


def _unmoved(before: os.stat_result, after: os.stat_result) -> bool:
    """Pure: the same inode, size and mtime (what the store's kept digest stands for)."""
    return (before.st_ino, before.st_size, before.st_mtime_ns) == (
        after.st_ino,
        after.st_size,
        after.st_mtime_ns,
    )


def _copy_in_kernel(src: int, dst: int) -> int:
    """Copy from the offset of ``src`` to that of ``dst`` in the kernel (``copy_file_range``; read and
    written where the filesystems cannot): the bytes copied."""
    done = 0
    while True:
        try:
            count = os.copy_file_range(src, dst, _COPY_CHUNK)
        except OSError as exc:  # another filesystem (EXDEV), or none that copies in the kernel
            if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            chunk = os.read(src, _COPY_CHUNK)
            count = os.write(dst, chunk) if chunk else 0
        if count == 0:
            return done
        done += count


#: A copy as it was written: its sha256 (urlsafe base64, as a RECORD has it), inode and mtime (ns)
Written = tuple[str, int, int]


def _copy_hashed(src: int, dst: int, buffer: memoryview) -> tuple[int, Written]:
    """Copy what ``src`` reads into ``dst`` through ``buffer``, hashing it on the way: bytes, and the
    copy as written."""
    hasher = hashlib.sha256()
    done = 0
    while count := os.readv(src, [buffer]):
        chunk = buffer[:count]
        hasher.update(chunk)
        written = 0
        while written < count:
            written += os.write(dst, chunk[written:])
        done += count
    info = os.fstat(dst)
    return done, (
        base64.urlsafe_b64encode(hasher.digest()).rstrip(b"=").decode(),
        info.st_ino,
        info.st_mtime_ns,
    )


def _check_controlled(info: os.stat_result, path: Path) -> None:
    """What is copied must be this worker's own and writable by nobody else: else PermissionError, and
    the fill stops (uv fetches what is missing). As the account, its own cache passes; as root (a
    root-owned environment), a cache another user could write (a ``HOME`` or ``UV_CACHE_DIR`` that
    ``sudo -E`` kept, a shared cache) is never copied into root's run."""
    if not only_caller_writes(info):
        raise PermissionError(f"{path} is not this account's own (uid {info.st_uid}, mode {info.st_mode:o})")


def _copy_tree(
    source: Path, destination: Path, known: Known | None = None
) -> tuple[int, list[tuple[int, str, Written]], int]:
    """Copy (cloned where the filesystem can) a tree of regular files and directories: bytes copied,
    ``(size, relative path, as written)`` of each file copied through a buffer or under a ``known``
    digest, and how many were copied in the kernel under one. Files are copied on a few threads,
    largest first: without reflink torch's 0.7 GB was slower than the install."""
    files: list[tuple[int, Path, Path, str]] = []
    pending = [(source, destination, "")]
    while pending:
        here, there, relative = pending.pop()
        with os.scandir(here) as listing:  # FileNotFoundError for a missing archive: the caller's
            os.makedirs(there, 0o755, exist_ok=True)
            for item in listing:
                below = f"{relative}{item.name}"
                if item.is_dir(follow_symlinks=False):
                    _check_controlled(item.stat(follow_symlinks=False), Path(item.path))
                    pending.append((Path(item.path), there / item.name, below + "/"))
                elif item.is_file(follow_symlinks=False):
                    size = item.stat(follow_symlinks=False).st_size
                    files.append((size, Path(item.path), there / item.name, below))
    files.sort(key=lambda f: f[0], reverse=True)
    work: queue.SimpleQueue[tuple[int, Path, Path, str]] = queue.SimpleQueue()
    for file in files:
        work.put(file)
    copied: list[int] = []
    digests: list[tuple[int, str, Written]] = []
    unread: list[int] = []
    failed: list[BaseException] = []

    def copy_some() -> None:
        buffer = hashing.read_buffer()
        total = 0
        try:
            while not failed:
                try:
                    _, here, there, relative = work.get_nowait()
                except queue.Empty:
                    break
                try:
                    size, digest, unseen = _copy_file(here, there, buffer, known)
                except FileExistsError:
                    continue
                total += size
                if digest is not None:
                    digests.append((size, relative, digest))
                    if unseen:
                        unread.append(1)
        except BaseException as exc:  # the first failure is the caller's; the other threads stop
            failed.append(exc)
        finally:
            copied.append(total)

    threads = [
        threading.Thread(target=copy_some, daemon=True) for _ in range(min(COPY_THREADS, len(files)) - 1)
    ]
    for thread in threads:
        thread.start()
    copy_some()
    for thread in threads:
        thread.join()
    if failed:
        raise failed[0]
    return sum(copied), digests, len(unread)


def keep_links(prefix: str, name: str, paths: list[str], keys: list[str]) -> dict[str, Any]:
    """In an account's environment, as the account: link each regular file of ``paths`` (relative to the
    prefix) into ``PREFIX/name/<key>`` (made 0700; other ``.safeinstall-keep-*`` directories, dead
    runs', removed first), so that the uninstall frees no block and a restore puts the inodes back
    (:func:`relink_kept`). ``{"kept": N}``."""
    kept = 0
    with Tree(Path(prefix)) as tree:
        for other in sorted(os.listdir(tree.fd)):
            if other.startswith(_KEEP_PREFIX) and other != name:
                with contextlib.suppress(OSError):
                    tree.remove_tree(other, time.monotonic() + 10.0)
        tree.make_dir(name, 0o700)
        with tree.batch():
            for relative, key in zip(paths, keys, strict=True):
                info = tree.lstat(relative)
                if info is None or not stat.S_ISREG(info.st_mode):
                    continue
                try:
                    with tree.parent(relative) as (fd, base), tree.parent(f"{name}/{key}") as (kfd, k):
                        os.link(base, k, src_dir_fd=fd, dst_dir_fd=kfd, follow_symlinks=False)
                except OSError:
                    continue
                kept += 1
    return {"kept": kept}


def relink_kept(prefix: str, name: str, paths: list[str], keys: list[str]) -> dict[str, Any]:
    """As the account: put each kept inode back at its path (linked beside it under a temp name, renamed
    over it); root then checks each against its backup (its word is not taken). ``{"relinked": [...]}``."""
    relinked: list[str] = []
    with Tree(Path(prefix)) as tree:
        try:
            kept_fd = os.open(
                name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=tree.fd
            )
        except OSError:
            return {"relinked": []}
        try:
            with tree.batch():
                for relative, key in zip(paths, keys, strict=True):
                    try:
                        with tree.parent(relative) as (fd, base):
                            temp = f".{base}.safeinstall-relink-{os.getpid()}"
                            os.link(key, temp, src_dir_fd=kept_fd, dst_dir_fd=fd, follow_symlinks=False)
                            try:
                                os.replace(temp, base, src_dir_fd=fd, dst_dir_fd=fd)
                            except OSError:
                                os.unlink(temp, dir_fd=fd)
                                raise
                    except OSError:
                        continue
                    relinked.append(relative)
        finally:
            os.close(kept_fd)
    return {"relinked": relinked}


def remove_kept(prefix: str, names: list[str], seconds: float) -> dict[str, Any]:
    """As the account: remove the keep directories ``names`` (``.safeinstall-keep-*`` only; all of them
    when ``names`` is empty). ``{"left": [...]}``."""
    left: list[str] = []
    with Tree(Path(prefix)) as tree:
        found = [n for n in os.listdir(tree.fd) if n.startswith(_KEEP_PREFIX)]
        for name in sorted(n for n in found if not names or n in names):
            with contextlib.suppress(OSError):
                tree.remove_tree(name, time.monotonic() + seconds)
            if tree.lstat(name) is not None:
                left.append(name)
    return {"left": left}
