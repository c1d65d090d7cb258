"""Backups of the distributions a run replaces, taken before any service stops, and their restore.

A backup is ``files/`` plus ``manifest.json``, written last; what it saves, why RECORD entries are
hardlinked and how a restore proceeds: docs/crash-safety.md ("The backup").
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from safeinstall.env import owner
from safeinstall.env.containment import Containment, relative_to_prefix
from safeinstall.env.distributions import (
    RECORD_LIMIT,
    InstalledDistribution,
    dist_info_dirs,
    dist_info_name,
    entry_location,
    find_distributions,
    package_roots,
)
from safeinstall.env.drift import pyc_source
from safeinstall.env.environment import Environment
from safeinstall.env.hashing import FileState, default_workers
from safeinstall.env.keep import Saved, open_kept, relink, relink_as
from safeinstall.env.records import decode_digest, parse_record
from safeinstall.errors import SafeInstallError
from safeinstall.store.runlog import human_bytes
from safeinstall.store.state import (
    PRIVATE_MODE,
    StateDirError,
    atomic_write,
    ensure_dir,
    fsync_dir,
    nearest_existing,
    read_private_file,
)
from safeinstall.system import worker
from safeinstall.system.safefs import NotRegularFile, Tree, only_caller_writes, parent_directories
from safeinstall.system.signals import held_while_threads_start, map_held

MANIFEST_NAME = "manifest.json"
#: The most bytes a manifest may have: a million files' entries (a few hundred bytes each), with room.
MANIFEST_LIMIT = 1 << 30
#: beside the manifest: what its files take, and the manifest's identity (the plan's note of the kept
#: backups reads it, not megabytes of manifest each; docs/reinstall.md, "Backups are bounded")
TOTAL_NAME = "bytes.json"
FILES_DIR = "files"
PRUNED_DIR = "pruned"  # leftovers removed by --prune after a good install
MANIFEST_VERSION = 1
_CHUNK = 1 << 20
_BLOCK = 4096
_TMP_MARK = ".safeinstall-restore-"
_FSYNC_THREADS = 16

ProgressCallback = Callable[[int, int], None]  # (bytes copied, bytes total)


class BackupError(SafeInstallError):
    """A backup could not be taken or read (before anything was changed: exit 2)."""

    code = "backup"


@dataclass(frozen=True, slots=True)
class BackupDistribution:
    name: str  # canonical
    version: str
    dist_info: str  # relative to the prefix, "/" separated


@dataclass(frozen=True, slots=True)
class BackupFile:
    path: str  # relative to the prefix, "/" separated
    distribution: str
    size: int  # bytes (of a symlink: its target's length, as lstat says)
    mode: int  # permission bits (stat.S_IMODE)
    uid: int
    gid: int
    mtime_ns: int
    sha256: str | None  # hex; None for a symlink
    link_target: str | None = None  # set for a symlink
    listed: bool = True  # False: in the distribution's own directories but in no RECORD (added by hand)
    #: its inode and change time when saved (a copy's: once its bytes were read; 0: not known), for the
    #: install anchor a restore carries over (:func:`safeinstall.store.anchors.carry_over`)
    inode: int = 0
    ctime_ns: int = 0

    @property
    def is_symlink(self) -> bool:
        return self.link_target is not None


@dataclass(frozen=True, slots=True)
class BackupDirectory:
    path: str  # relative to the prefix: every directory above a saved file, recreated on restore
    mode: int
    uid: int
    gid: int


@dataclass(frozen=True, slots=True)
class BackupManifest:
    version: int
    created_at: str
    prefix: str
    distributions: tuple[BackupDistribution, ...]
    files: tuple[BackupFile, ...]
    directories: tuple[BackupDirectory, ...]
    missing: tuple[str, ...]  # listed by a RECORD but absent (or not a file/symlink): nothing to save
    outside: tuple[str, ...]  # RECORD entries outside the prefix: not saved (reported elsewhere)
    patched: tuple[str, ...]  # locally modified/missing files, as the caller's verifier reported them
    #: the distributions' own package directories (relative): a restore leaves in them exactly the
    #: files saved, so whatever a failed install left there (uv's temp files, new files) goes
    roots: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Backup:
    dir: Path
    manifest: BackupManifest

    @property
    def files_dir(self) -> Path:
        return self.dir / FILES_DIR

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.manifest.files)


@dataclass(frozen=True, slots=True)
class RestoreResult:
    restored: int
    removed: int  # files removed (the installed version's, not in the backup)
    removed_dist_infos: tuple[str, ...]
    mismatches: tuple[str, ...]  # restored files whose content is not what was saved: must be empty
    failures: tuple[str, ...]  # "path: reason" for files that could not be removed or restored
    skipped_outside: tuple[str, ...]  # paths asked to be removed that lie outside the prefix: left alone
    kept_shared: tuple[str, ...]  # paths asked to be removed that another distribution lists: left alone
    #: the files were found exactly as saved (nothing was installed, or the install failed before it
    #: wrote anything, e.g. on a read-only site-packages): nothing was written
    unchanged: bool = False

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.failures


@dataclass(frozen=True, slots=True)
class _Item:
    source: str  # absolute
    relative: str
    distribution: str
    listed: bool = True
    #: a RECORD entry: uv's uninstall unlinks it before the install writes anything at its path, so a
    #: hardlink of it in the backup keeps the old content (files in no RECORD are copied)
    in_record: bool = False


# --- pure helpers -----------------------------------------------------------------------------------


def space_problem(
    needed: int,
    free: int,
    where: Path,
    what: str = "the backup",
    remedy: str = "free some space there or point SAFEINSTALL_STATE_DIR at a larger filesystem",
) -> str | None:
    """Pure: why ``what`` (``needed`` bytes) does not fit in ``free`` bytes at ``where``, or None."""
    if needed <= free:
        return None
    return f"{what} needs {human_bytes(needed)} but {where} has {human_bytes(free)} free; {remedy}"


def manifest_to_dict(manifest: BackupManifest) -> dict[str, Any]:
    """Pure: the manifest as ``manifest.json`` holds it: each dataclass an object, keys in field order."""
    data = {f.name: getattr(manifest, f.name) for f in fields(manifest)}
    rows = {"distributions": BackupDistribution, "files": BackupFile, "directories": BackupDirectory}
    for key, kind in rows.items():
        names = [f.name for f in fields(kind)]
        data[key] = [{name: getattr(item, name) for name in names} for item in data[key]]
    for key in ("missing", "outside", "patched", "roots"):
        data[key] = list(data[key])
    return data


def _safe_relative(text: Any) -> str:
    """Pure: ``text``, a relative path that stays below the prefix (no ``..``); by string, not
    pathlib (a manifest holds a path per file: torch's 12k cost 0.3 s of a commit)."""
    if not isinstance(text, str) or not text:
        raise ValueError(f"bad path {text!r}")
    if text.startswith("/") or ".." in text.split("/"):
        raise ValueError(f"path {text!r} escapes the prefix")
    return text


def manifest_from_dict(data: Any) -> BackupManifest:
    """Pure: raises ValueError/KeyError/TypeError on a malformed manifest."""
    if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
        raise ValueError(f"not a version {MANIFEST_VERSION} backup manifest")
    return BackupManifest(
        version=MANIFEST_VERSION,
        created_at=str(data["created_at"]),
        prefix=str(data["prefix"]),
        distributions=tuple(
            BackupDistribution(str(d["name"]), str(d["version"]), str(d["dist_info"]))
            for d in data["distributions"]
        ),
        files=tuple(
            BackupFile(
                path=_safe_relative(f["path"]),
                distribution=str(f["distribution"]),
                size=int(f["size"]),
                mode=int(f["mode"]),
                uid=int(f["uid"]),
                gid=int(f["gid"]),
                mtime_ns=int(f["mtime_ns"]),
                sha256=None if f["sha256"] is None else str(f["sha256"]),
                link_target=None if f["link_target"] is None else str(f["link_target"]),
                listed=bool(f.get("listed", True)),
                inode=int(f.get("inode", 0)),
                ctime_ns=int(f.get("ctime_ns", 0)),
            )
            for f in data["files"]
        ),
        directories=tuple(
            BackupDirectory(_safe_relative(d["path"]), int(d["mode"]), int(d["uid"]), int(d["gid"]))
            for d in data["directories"]
        ),
        missing=tuple(str(p) for p in data["missing"]),
        outside=tuple(str(p) for p in data["outside"]),
        patched=tuple(str(p) for p in data["patched"]),
        roots=tuple(_safe_relative(p) for p in data.get("roots", ())),
    )


# --- what to save -----------------------------------------------------------------------------------


def _unlisted(tree: Tree, root: str, listed: set[str]) -> Iterator[str]:
    """Files (and symlinks) below ``root`` that no RECORD lists; bytecode of a listed source is left
    out (a cache: Python writes it again)."""
    for location in _files_below(tree, root):
        if location in listed:
            continue
        source = pyc_source(PurePosixPath(location)) if location.endswith(".pyc") else None
        if source is None or str(source) not in listed:
            yield location


def _collect(
    env: Environment,
    dists: Sequence[InstalledDistribution],
    installed: Sequence[InstalledDistribution],
) -> tuple[list[_Item], list[str], list[str]]:
    """Files to save (RECORD entries inside the prefix, the .dist-info trees, and the files added to
    the distributions' own directories by hand), the entries outside, and those directories."""
    inside = Containment(env.prefix)
    items: dict[str, _Item] = {}
    outside: list[str] = []
    mine = {d.name for d in dists}
    roots = package_roots(env, [*(d for d in installed if d.name not in mine), *dists])
    listed = {location for dist in dists for location in dist.locations}
    with Tree(env.prefix) as tree:
        for dist in dists:
            for root in roots[dist.name]:
                for location in _unlisted(tree, root, listed):
                    relative = inside.relative(location)
                    if relative is not None and relative not in items:
                        items[relative] = _Item(location, relative, dist.name, listed=False)
        for dist in dists:
            for entry, location in zip(dist.record.entries, dist.locations, strict=True):
                relative = inside.relative(location)
                if relative is None:
                    outside.append(f"{dist.name}: {entry.path} ({location})")
                elif relative not in items:
                    items[relative] = _Item(location, relative, dist.name, in_record=True)
            # the .dist-info tree, symlinks as links (never followed)
            for location in _files_below(tree, os.fspath(dist.dist_info)):
                relative = inside.relative(location)
                if relative is not None and relative not in items:
                    items[relative] = _Item(location, relative, dist.name)
    relative_roots = sorted(
        {r for r in (inside.relative(root) for dist in dists for root in roots[dist.name]) if r is not None}
    )
    return sorted(items.values(), key=lambda i: i.relative), outside, relative_roots


def disk_space_needed(
    dists: Sequence[InstalledDistribution],
    env: Environment,
    installed: Sequence[InstalledDistribution],
) -> int:
    """Bytes a backup of ``dists`` takes: file sizes rounded up to blocks, plus the manifest.
    ``installed``: as for :func:`package_roots`."""
    items, _outside, _roots = _collect(env, dists, installed)
    return sum(_blocks(info) + 512 for info in _lstats(items)) + _BLOCK  # + a manifest line each


def disk_space_copied(
    dists: Sequence[InstalledDistribution],
    env: Environment,
    installed: Sequence[InstalledDistribution],
    backups: Path,
) -> int:
    """Bytes of new room a backup of ``dists`` under ``backups`` takes: the files it copies (any on
    another filesystem, files in no RECORD, inodes another user can write), each rounded up to blocks,
    plus the manifest; a RECORD entry it hardlinks takes none (it keeps the old inode, which the
    uninstall then does not free). ``installed``: as for :func:`package_roots`."""
    items, _outside, _roots = _collect(env, dists, installed)
    device = _device(backups)
    total = _BLOCK
    for item in items:
        with contextlib.suppress(OSError):
            info = os.lstat(item.source)
            linked = (
                item.in_record
                and stat.S_ISREG(info.st_mode)
                and info.st_dev == device
                and only_caller_writes(info)
            )
            total += 512 + (0 if linked else _blocks(info))
    return total


def _device(path: Path) -> int:
    """The device of ``path``, or of its nearest existing parent."""
    return nearest_existing(path).stat().st_dev


def disk_space_freed(
    dists: Sequence[InstalledDistribution],
    env: Environment,
    installed: Sequence[InstalledDistribution],
) -> int:
    """Bytes that removing ``dists``' files frees: those of files with no other link (a file that is a
    hardlink of a uv cache frees nothing). ``installed``: as for :func:`package_roots`."""
    items, _outside, _roots = _collect(env, dists, installed)
    return sum(_blocks(info) for info in _lstats(items) if info.st_nlink < 2)


def _lstats(items: Iterable[_Item]) -> Iterator[os.stat_result]:
    for item in items:
        with contextlib.suppress(OSError):
            yield os.lstat(item.source)


def _blocks(info: os.stat_result) -> int:
    """Pure: the file's size, rounded up to blocks."""
    return -(-info.st_size // _BLOCK) * _BLOCK


def free_space(path: Path) -> int:
    """Free bytes on the filesystem that holds (or will hold) ``path``."""
    return shutil.disk_usage(nearest_existing(path)).free


# --- taking a backup --------------------------------------------------------------------------------


def _link(item: _Item, tree: Tree, dest: Tree, info: os.stat_result, known: FileState | None) -> str | None:
    """Hardlink a RECORD entry into the backup, by descriptor; its sha256 from ``known`` or read now. None
    when it cannot be linked (another filesystem, changed meanwhile, or writable by its owner: see
    docs/crash-safety.md, "The backup"): the caller copies it."""
    if not stat.S_ISREG(info.st_mode) or not only_caller_writes(info):
        return None
    identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    try:
        with tree.parent(item.relative) as (src_fd, src), dest.parent(item.relative) as (dst_fd, dst):
            os.link(src, dst, src_dir_fd=src_fd, dst_dir_fd=dst_fd, follow_symlinks=False)
            linked = os.stat(dst, dir_fd=dst_fd, follow_symlinks=False)
            if (linked.st_dev, linked.st_ino, linked.st_size, linked.st_mtime_ns) != identity:
                os.unlink(dst, dir_fd=dst_fd)  # replaced or written since the lstat: copy what is there now
                return None
    except OSError:
        return None
    if (
        known is not None
        and known.algorithm == "sha256"
        and known.digest is not None
        and (known.device, known.inode, known.size, known.mtime_ns) == identity
    ):
        return decode_digest(known.digest).hex()
    digest = dest.sha256(item.relative)
    if digest is None:
        dest.unlink(item.relative)
    return digest


def _save(item: _Item, tree: Tree, dest: Tree, known: Mapping[str, FileState]) -> BackupFile | None:
    """Copy one file into the backup (read by descriptor below the prefix: a symlink on the way is never
    followed, a FIFO or a device never opened); None when it is absent or not a regular file or symlink."""
    info = tree.lstat(item.relative)
    if info is None or not (stat.S_ISLNK(info.st_mode) or stat.S_ISREG(info.st_mode)):
        return None
    if stat.S_ISLNK(info.st_mode):
        target = tree.readlink(item.relative)
        if target is None:  # replaced meanwhile
            return None
        dest.symlink(item.relative, target, atomic=False)
        return _saved(item, info, info.st_size, None, target)
    linked = _link(item, tree, dest, info, known.get(item.source)) if item.in_record else None
    if linked is not None:
        return _saved(item, info, info.st_size, linked)
    try:
        source_fd = tree.open_read(item.relative)
    except (FileNotFoundError, NotRegularFile):
        return None
    try:
        info = os.fstat(source_fd)  # what was opened, not what was listed
        copied = dest.write_from(
            item.relative, source_fd, stat.S_IMODE(info.st_mode), mtime_ns=info.st_mtime_ns, atomic=False
        )
        read = os.fstat(source_fd)  # its change time once every byte was read: an edit meanwhile shows
    finally:
        os.close(source_fd)
    return _saved(item, info, copied.size, copied.sha256, changed=read)


def _saved(
    item: _Item,
    info: os.stat_result,
    size: int,
    sha256: str | None,
    link_target: str | None = None,
    changed: os.stat_result | None = None,
) -> BackupFile:
    """Pure: the manifest entry of ``item`` as saved (``info``: what was opened or linked; ``changed``:
    its ``fstat`` once copied)."""
    return BackupFile(
        path=item.relative,
        distribution=item.distribution,
        size=size,
        mode=stat.S_IMODE(info.st_mode),
        uid=info.st_uid,
        gid=info.st_gid,
        mtime_ns=info.st_mtime_ns,
        sha256=sha256,
        link_target=link_target,
        listed=item.listed,
        inode=info.st_ino,
        ctime_ns=(changed or info).st_ctime_ns,
    )


def _directories(files: Iterable[BackupFile], prefix: Path) -> tuple[BackupDirectory, ...]:
    wanted = parent_directories(f.path for f in files)
    found: list[BackupDirectory] = []
    with Tree(prefix) as tree, tree.batch():
        for relative in sorted(wanted):  # a directory's subtree together: each opened once
            info = tree.lstat(relative)
            if info is not None and stat.S_ISDIR(info.st_mode):
                found.append(BackupDirectory(relative, stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid))
    return tuple(sorted(found, key=lambda d: (d.path.count("/"), d.path)))


def fsync_dirs(tree: Tree, directories: Sequence[str]) -> None:
    """fsync each of ``directories`` (relative to ``tree``), concurrently: fsyncs that overlap share
    one journal commit (ext4, xfs), where one after the other each waits for its own (torch's 800
    directories: 2 s one by one, 0.1 s on 16 threads). Raises the first OSError."""
    with ThreadPoolExecutor(max_workers=_FSYNC_THREADS, thread_name_prefix="fsync") as pool:
        map_held(pool, tree.fsync_dir, directories)


def create_backup(
    env: Environment,
    dists: Sequence[InstalledDistribution],
    backup_dir: Path,
    patched: Sequence[str],
    on_progress: ProgressCallback | None = None,
    workers: int | None = None,
    now: datetime | None = None,
    known: Mapping[str, FileState] | None = None,
    *,
    installed: Sequence[InstalledDistribution],
) -> Backup:
    """Save ``dists`` into ``backup_dir`` (new or empty; made 0700). Raises BackupError, leaving no backup.
    ``known``: files just hashed (a verify's observations, by location): a hardlinked file that has not
    changed since is not read again. ``installed``: as for :func:`package_roots`."""
    ensure_dir(backup_dir)
    if any(backup_dir.iterdir()):
        raise BackupError(
            f"the backup directory {backup_dir} is not empty",
            hint="use a new run id (each run backs up into its own directory)",
        )
    items, outside, roots = _collect(env, dists, installed)
    files_dir = backup_dir / FILES_DIR
    ensure_dir(files_dir)
    sizes: dict[str, int] = {}
    for item in items:
        try:
            sizes[item.relative] = os.lstat(item.source).st_size
        except OSError:
            sizes[item.relative] = 0
    total = sum(sizes.values())
    ordered = sorted(items, key=lambda i: sizes[i.relative], reverse=True)
    saved: list[BackupFile] = []
    missing: list[str] = []
    done = 0
    try:
        count = workers or default_workers()

        def record(item: _Item, result: BackupFile | None) -> None:
            nonlocal done
            if result is None:
                missing.append(item.relative)
            else:
                saved.append(result)
            done += sizes[item.relative]
            if on_progress is not None:
                on_progress(done, total)

        # On the same filesystem a RECORD entry is a hardlink and a hash already known: a thread per
        # file would cost more than the work. Copies (other files, another filesystem) go to threads.
        # (a service account's files are copied: see _link)
        linking = env.account is None and os.stat(env.prefix).st_dev == os.stat(files_dir).st_dev
        with (
            Tree(env.prefix) as tree,
            Tree(files_dir) as dest,
            tree.batch(),
            dest.batch(),
            ThreadPoolExecutor(max_workers=count, thread_name_prefix="backup") as pool,
        ):
            # parents first; a path that is an item itself (a RECORD listing "a" and "a/b") is not
            # made a directory: one of the two is not in the prefix, nothing is saved for it
            paths = {i.relative for i in items}
            directories = sorted(parent_directories(paths) - paths)
            for directory in directories:
                dest.make_dir(directory, PRIVATE_MODE)
            for item in items:  # in path order: each directory is opened once on each side
                if linking and item.in_record:
                    record(item, _save(item, tree, dest, known or {}))
            pooled = [i for i in ordered if not (linking and i.in_record)]
            with held_while_threads_start():
                futures = {pool.submit(_save, item, tree, dest, known or {}): item for item in pooled}
            try:
                for future in as_completed(futures):
                    record(futures[future], future.result())
            except BaseException:
                for pending in futures:
                    pending.cancel()
                raise
            fsync_dirs(dest, directories)
        fsync_dir(files_dir)
        saved.sort(key=lambda f: f.path)
        manifest = BackupManifest(
            version=MANIFEST_VERSION,
            created_at=(now or datetime.now(UTC)).astimezone(UTC).isoformat(timespec="seconds"),
            prefix=str(env.prefix),
            distributions=tuple(
                BackupDistribution(d.name, d.version, relative_to_prefix(d.dist_info, env.prefix) or "")
                for d in dists
            ),
            files=tuple(saved),
            directories=_directories(saved, env.prefix),
            missing=tuple(sorted(missing)),
            outside=tuple(outside),
            patched=tuple(patched),
            roots=tuple(roots),
        )
        text = json.dumps(manifest_to_dict(manifest), separators=(",", ":")) + "\n"  # the C encoder
        atomic_write(backup_dir / MANIFEST_NAME, text.encode("utf-8", "surrogateescape"))
        written = os.lstat(backup_dir / MANIFEST_NAME)
        held = {"manifest": manifest_identity(written), "bytes": sum(f.size for f in saved)}
        atomic_write(backup_dir / TOTAL_NAME, json.dumps(held).encode())
    except OSError as exc:
        shutil.rmtree(backup_dir, ignore_errors=True)  # root's 0700 tree: nobody else writes in it
        where = f" ({exc.filename})" if exc.filename else ""
        raise BackupError(
            f"could not back up {', '.join(d.name for d in dists)} into {backup_dir}: "
            f"{exc.strerror or exc}{where}; nothing was changed",
            hint="free space on that filesystem (or point SAFEINSTALL_STATE_DIR elsewhere) and run again",
        ) from exc
    return Backup(backup_dir, manifest)


def manifest_identity(info: os.stat_result) -> list[int]:
    """Pure: a manifest's identity as its total keeps it (any rewrite or replacement moves one)."""
    return [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]


def load_backup(backup_dir: Path) -> Backup:
    """Read a backup's manifest as every state file is (:func:`~safeinstall.store.state.read_private_file`:
    no symlink followed, at most :data:`MANIFEST_LIMIT`). Raises BackupError when it is missing (an
    incomplete backup), not believed, or damaged."""
    path = backup_dir / MANIFEST_NAME
    try:
        raw = read_private_file(path, MANIFEST_LIMIT)
    except FileNotFoundError as exc:
        raise BackupError(
            f"{backup_dir} holds no {MANIFEST_NAME}: the backup was never completed",
            hint="nothing was installed from an incomplete backup's run; if files were changed by hand, "
            "reinstall the package with uv",
        ) from exc
    except StateDirError as exc:
        raise BackupError(exc.message, hint=exc.hint) from exc
    except OSError as exc:
        raise BackupError(
            f"cannot read {path}: {exc.strerror or exc}", hint="run as the user that took the backup (root)"
        ) from exc
    try:
        manifest = manifest_from_dict(json.loads(raw))
    except (ValueError, KeyError, TypeError) as exc:
        raise BackupError(
            f"the backup manifest {path} is damaged ({exc})",
            hint=f"the saved files are still under {backup_dir / FILES_DIR}; copy them back by hand",
        ) from exc
    return Backup(backup_dir, manifest)


# --- restoring --------------------------------------------------------------------------------------
#
# Every change below goes through a :class:`~safeinstall.system.safefs.Tree` of the prefix: a symlink that the
# environment's owner put anywhere below it is never followed (a saved directory that became a symlink
# is replaced by the real directory again), so nothing outside the environment is written or deleted.


def _current_dist_infos(env: Environment, names: frozenset[str], tree: Tree) -> list[str]:
    """The installed ``.dist-info`` directories of ``names`` (relative; real directories only)."""
    found: list[str] = []
    for path in dist_info_dirs(env):
        relative = tree.relative(path)
        if dist_info_name(path.name) in names and relative is not None and tree.is_dir(relative):
            found.append(relative)
    return found


def _record_locations(tree: Tree, dist_info: str) -> list[str]:
    """What the RECORD in ``dist_info`` lists (relative to the prefix; outside ones as absolute paths)."""
    try:
        text = tree.read_bytes(f"{dist_info}/RECORD", RECORD_LIMIT).decode("utf-8", errors="replace")
    except (OSError, ValueError):
        return []
    base = os.path.join(os.fspath(tree.root), os.path.dirname(dist_info))
    return [entry_location(base, e) for e in parse_record(text).entries]


def stale_bytecode(sources: Iterable[Path]) -> list[Path]:
    """``__pycache__/<stem>.*.pyc`` of each ``.py`` source: a stale one is used when mtime and size match."""
    stems: dict[Path, set[str]] = {}
    for source in sources:
        if source.suffix == ".py":
            stems.setdefault(source.parent / "__pycache__", set()).add(source.stem)
    found: list[Path] = []
    for cache, wanted in stems.items():
        try:
            with Tree(cache) as listing:  # a symlinked __pycache__ is not listed
                names = os.listdir(listing.fd)
        except OSError:
            continue
        for name in names:
            if name.endswith(".pyc") and name.split(".", 1)[0] in wanted:
                found.append(cache / name)
    return sorted(found)


def _files_below(tree: Tree, root: str) -> list[str]:
    """Files and symlinks below ``root`` (absolute; symlinked directories as links, never entered)."""
    relative = tree.relative(root)
    if relative is None:
        return []
    return [os.path.join(os.fspath(tree.root), p) for p in tree.files_below(relative)]


@dataclass(frozen=True, slots=True)
class _Removal:
    """What a restore removes before it puts the saved files back (paths relative to the prefix)."""

    files: tuple[str, ...]  # the installed version's files that the backup does not hold
    debris: tuple[str, ...]  # in the saved package and .dist-info directories, not in the backup
    dist_infos: tuple[str, ...]  # installed .dist-info directories of those names that were not saved
    skipped_outside: tuple[str, ...]
    kept_shared: tuple[str, ...]


def _removal(
    backup: Backup, env: Environment, tree: Tree, remove: Iterable[Path], same: frozenset[str]
) -> _Removal:
    """What goes before anything is written: the installed version's files, what a failed install left
    in the saved directories, and the saved paths whose entry is not as saved (``same``: those that
    are): each put-back then writes into an empty place, never a copy beside the file it replaces
    (on a full disk, the room it needs is the room the removal made)."""
    manifest = backup.manifest
    names = frozenset(d.name for d in manifest.distributions)
    saved_paths = frozenset(f.path for f in manifest.files)
    saved_dist_infos = {d.dist_info for d in manifest.distributions}
    dist_infos = _current_dist_infos(env, names, tree)
    candidates: set[str] = set()
    for given in remove:
        candidates.add(os.path.normpath(given if given.is_absolute() else env.prefix / given))
    for dist_info in dist_infos:
        candidates.update(_record_locations(tree, dist_info))
    others = [d for d in find_distributions(env) if d.name not in names]
    shared = {os.path.normpath(os.path.join(d.site, e.path)) for d in others for e in d.record.entries}
    removed_whole = tuple(os.path.join(d, "") for d in dist_infos if d not in saved_dist_infos)
    skipped_outside: list[str] = []
    kept_shared: list[str] = []
    files: list[str] = []
    for path in sorted(candidates):
        relative = tree.relative(path)
        if relative is None:
            skipped_outside.append(path)
        elif relative.startswith(removed_whole) or relative in saved_paths:
            continue  # removed with its .dist-info / as a saved path, below
        elif path in shared:
            kept_shared.append(path)
        else:
            files.append(relative)
    for saved in manifest.files:  # in both versions, or changed: removed first, written back below
        info = tree.lstat(saved.path) if saved.path not in same else None
        if info is not None and not stat.S_ISDIR(info.st_mode) and not saved.path.startswith(removed_whole):
            files.append(saved.path)
    debris: list[str] = []
    # the package directories and the saved .dist-info hold exactly what was saved, nothing new;
    # bytecode of a saved source is a cache (removed below when its source is rewritten)
    for root in (*manifest.roots, *(d for d in dist_infos if d in saved_dist_infos)):
        for relative in tree.files_below(root):
            if relative in saved_paths or relative in files:
                continue
            source = pyc_source(PurePosixPath(relative)) if relative.endswith(".pyc") else None
            if source is None or str(source) not in saved_paths:
                debris.append(relative)
    return _Removal(
        tuple(files),
        tuple(debris),
        tuple(d for d in dist_infos if d not in saved_dist_infos),
        tuple(skipped_outside),
        tuple(kept_shared),
    )


def _same(saved: BackupFile, tree: Tree) -> bool:
    """The file is there exactly as saved (content or link target, mode, owner, mtime): nothing to write."""
    info = tree.lstat(saved.path)
    as_saved = (saved.mode, saved.uid, saved.gid, saved.mtime_ns)
    if info is None or (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid, info.st_mtime_ns) != as_saved:
        return False
    if saved.link_target is not None:
        return stat.S_ISLNK(info.st_mode) and tree.readlink(saved.path) == saved.link_target
    return (
        stat.S_ISREG(info.st_mode) and info.st_size == saved.size and tree.sha256(saved.path) == saved.sha256
    )


def _found_as_saved(files: Sequence[BackupFile], tree: Tree, workers: int | None) -> frozenset[str]:
    """The saved paths whose entry is there exactly as saved (:func:`_same`), hashed on threads."""
    with ThreadPoolExecutor(max_workers=workers or default_workers(), thread_name_prefix="same") as pool:
        found = map_held(pool, lambda f: _same(f, tree), files)
    return frozenset(f.path for f, same in zip(files, found, strict=True) if same)


def _make_directories(manifest: BackupManifest, tree: Tree, as_root: bool) -> list[str]:
    """Recreate missing directories with their saved mode and owner (a symlink or a file where one was is
    removed, never followed); failures as "path: reason"."""
    failures: list[str] = []
    for saved in manifest.directories:  # parents first
        try:
            tree.make_dir(saved.path, saved.mode, (saved.uid, saved.gid) if as_root else None)
        except OSError as exc:
            where = tree.root / saved.path
            failures.append(f"{where}: could not recreate the directory: {exc.strerror or exc}")
    return failures


def _remove_own_temp_files(tree: Tree, directories: Iterable[str]) -> None:
    for directory in directories:
        for name in tree.names(directory) if directory else []:
            if _TMP_MARK in name and name.startswith("."):
                with contextlib.suppress(OSError):
                    tree.unlink(f"{directory}/{name}")


def _put_back(
    saved: BackupFile, source: Tree, tree: Tree, as_root: bool, kept: int | None, same: frozenset[str]
) -> bool:
    """Put one file back atomically (temp file, rename), unless it is there as saved (False). On a full disk
    the file in its place is removed first to make room: finishing matters more than atomicity."""
    if saved.path in same or _same(saved, tree):
        return False
    if kept is not None and saved.link_target is None and saved.sha256 is not None:
        what = Saved(saved.path, saved.size, saved.mode, saved.uid, saved.gid, saved.mtime_ns, saved.sha256)
        if relink(kept, tree, what, _TMP_MARK):  # the old inode itself: no new blocks
            return True
    try:
        _put_back_atomically(saved, source, tree, as_root)
    except OSError as exc:
        info = tree.lstat(saved.path)
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or info is None or stat.S_ISDIR(info.st_mode):
            raise
        tree.unlink(saved.path)
        _put_back_atomically(saved, source, tree, as_root)
    return True


def tight(needed: int, vfs: os.statvfs_result) -> bool:
    """Pure: a restore that writes ``needed`` bytes is short of room on the filesystem ``vfs`` describes
    (less free than twice that, and 64 MiB): it writes one file at a time."""
    return vfs.f_bavail * vfs.f_frsize < 2 * needed + (64 << 20)


def _put_back_atomically(saved: BackupFile, source: Tree, tree: Tree, as_root: bool) -> None:
    owner = (saved.uid, saved.gid) if as_root else None
    if saved.link_target is not None:
        tree.symlink(saved.path, saved.link_target, owner, saved.mtime_ns, mark=_TMP_MARK)
        return
    source_fd = source.open_read(saved.path)
    try:
        tree.write_from(saved.path, source_fd, saved.mode, owner, saved.mtime_ns, mark=_TMP_MARK)
    finally:
        os.close(source_fd)


def _check(manifest: BackupManifest, tree: Tree) -> list[str]:
    mismatches: list[str] = []
    for saved in manifest.files:
        if saved.link_target is None:
            same = tree.sha256(saved.path) == saved.sha256
        else:
            same = tree.readlink(saved.path) == saved.link_target
        if not same:
            mismatches.append(str(tree.root / saved.path))
    return sorted(mismatches)


def check_restored(backup: Backup, prefix: Path) -> list[str]:
    """The saved files (absolute paths) whose content or link target in ``prefix`` is not the
    backup's: empty once a restore put them all back (an undo's verification)."""
    with Tree(prefix) as tree, tree.batch():
        return _check(backup.manifest, tree)


def restore_backup(
    backup: Backup,
    env: Environment,
    remove: Iterable[Path],
    workers: int | None = None,
    run_id: str | None = None,
) -> RestoreResult:
    """Put ``backup`` back into ``env``: remove what is installed now under its names, copy back, check.
    ``remove``: the installed version's files, removed as the environment's owner (paths outside the prefix or
    another distribution's are left, and said); ``run_id``: whose kept links go back instead of copies. Never
    raises for one file: see :attr:`RestoreResult.ok`."""
    manifest = backup.manifest
    prefix = env.prefix
    if Path(manifest.prefix) != prefix:
        raise BackupError(
            f"the backup {backup.dir} is of {manifest.prefix}, not of {prefix}",
            hint="pass the --python of the environment the backup was taken from",
        )
    try:
        with Tree(prefix) as tree, tree.batch():
            same = _found_as_saved(manifest.files, tree, workers)
            removal = _removal(backup, env, tree, remove, same)
            stop = [
                r
                for r in (tree.relative(p) for p in (*env.site_dirs, env.scripts, env.data))
                if r is not None
            ]
        removed = _remove_as_owner(env, removal, stop)
        relinked: tuple[str, ...] = ()
        if env.account is not None and run_id is not None:  # the account's kept links, by its worker
            with Tree(prefix) as made:  # the removal pruned the directories it emptied
                _make_directories(manifest, made, os.geteuid() == 0)
            regular = [f.path for f in manifest.files if f.link_target is None and f.path not in same]
            relinked = relink_as(env.account.ids, prefix, run_id, regular)  # checked below, or copied
        tree, source = Tree(prefix), Tree(backup.files_dir)  # opened anew: the worker changed directories
    except OSError as exc:
        raise BackupError(
            f"cannot open {exc.filename}: {exc.strerror or exc}",
            hint="the environment's prefix and the backup must be real directories",
        ) from exc
    kept = open_kept(tree, run_id) if run_id is not None else None
    try:
        with tree, source, tree.batch(), source.batch():
            return _restore(backup, tree, source, removal, removed, workers, kept, same, relinked)
    finally:
        if kept is not None:
            os.close(kept)


@dataclass(frozen=True, slots=True)
class _Removed:
    """What the owner's worker removed (paths relative to the prefix), and what it could not."""

    files: tuple[str, ...]
    dist_infos: tuple[str, ...]
    denied: tuple[str, ...]  # "path: reason": the owner may not remove it, so it is not the install's
    failures: tuple[str, ...]


#: How long the owner's worker may take to remove an installed version (tens of thousands of files)
REMOVAL_TIMEOUT_S = 300.0


def _remove_as_owner(env: Environment, removal: _Removal, stop: list[str]) -> _Removed:
    """Remove ``removal`` in a worker that is the environment's owner (root's own, isolated alike, for a
    root-owned environment); its answer is checked: only paths that were asked count as removed."""
    files = [*removal.files, *removal.debris]
    asked_files, asked_dirs = frozenset(files), frozenset(removal.dist_infos)
    if not files and not asked_dirs:
        return _Removed((), (), (), ())
    ids = None if env.account is None else env.account.ids
    prefix = str(env.prefix)
    try:
        answer = worker.call(
            ids,
            lambda: owner.remove_installed(prefix, files, list(removal.dist_infos), stop),
            timeout=REMOVAL_TIMEOUT_S,
            what=f"removes the installed version's files from {prefix}",
        )
    except worker.WorkerError as exc:
        return _Removed((), (), (), (exc.message,))
    return removal_answer(answer, asked_files, asked_dirs, prefix)


def removal_answer(
    answer: object, asked_files: frozenset[str], asked_dirs: frozenset[str], prefix: str
) -> _Removed:
    """Pure: the removal worker's answer, taken as the account's word: only paths root asked count as
    removed (files in ``asked_files``, ``.dist-info`` directories in ``asked_dirs``); what it denied or
    failed is a message, cut to length; anything but a dict is a failure."""

    def strings(key: str, allowed: frozenset[str] | None = None) -> tuple[str, ...]:
        value = answer.get(key) if isinstance(answer, dict) else None
        if not isinstance(value, list):
            return ()
        texts = [v[:1000] for v in value if isinstance(v, str)]
        return tuple(t for t in texts if allowed is None or t in allowed)

    if not isinstance(answer, dict):
        return _Removed((), (), (), ("the worker that removed the installed version answered nonsense",))
    return _Removed(
        strings("removed", asked_files),
        strings("removed_dist_infos", asked_dirs),
        tuple(f"{prefix}/{t}" for t in strings("denied")[:100]),
        tuple(f"{prefix}/{t}: could not remove it" for t in strings("failures")[:100]),
    )


def _restore(
    backup: Backup,
    tree: Tree,
    source: Tree,
    removal: _Removal,
    removed: _Removed,
    workers: int | None,
    kept: int | None,
    same: frozenset[str],
    relinked: tuple[str, ...] = (),
) -> RestoreResult:
    """The saved files put back (``relinked``: those the account's worker put back as kept inodes, each
    checked here like any file found in place), the bytecode of what changed removed, the result."""
    manifest = backup.manifest
    as_root = os.geteuid() == 0
    restoring = {f.path for f in manifest.files}
    failures = list(removed.failures)
    failures.extend(_make_directories(manifest, tree, as_root))
    _remove_own_temp_files(tree, {os.path.dirname(p) for p in restoring})  # left by a restore that crashed
    rewritten: list[str] = []
    writing = [f for f in manifest.files if f.path not in same]
    if not tight(sum(_BLOCK + f.size for f in writing), os.fstatvfs(tree.fd)):
        count = workers or default_workers()
    else:  # one at a time, each into the room the removal made: never several copies in flight
        count = 1
    with ThreadPoolExecutor(max_workers=count, thread_name_prefix="restore") as pool:
        with held_while_threads_start():
            futures = {pool.submit(_put_back, f, source, tree, as_root, kept, same): f for f in writing}
        for future in as_completed(futures):
            try:
                if future.result():
                    rewritten.append(futures[future].path)
            except OSError as exc:
                where = tree.root / futures[future].path
                failures.append(f"{where}: could not restore it: {exc.strerror or exc}")
    rewritten.extend(sorted(set(relinked) - set(rewritten)))  # put back too (copied where not as saved)
    # bytecode of removed or rewritten sources could be stale (saved .pyc files are back already)
    for pyc in stale_bytecode([tree.root / p for p in (*removed.files, *rewritten)]):
        stale = tree.relative(pyc)
        if stale is not None and stale not in restoring:
            with contextlib.suppress(OSError):
                tree.unlink(stale)
    with contextlib.suppress(OSError, ValueError):
        fsync_dirs(tree, sorted({os.path.dirname(p) for p in rewritten}))
    return RestoreResult(
        restored=len(manifest.files),
        removed=len(removed.files),
        removed_dist_infos=tuple(str(tree.root / d) for d in removed.dist_infos),
        mismatches=tuple(_check(manifest, tree)),
        failures=tuple(sorted(failures)),
        skipped_outside=removal.skipped_outside,
        kept_shared=removal.kept_shared,
        unchanged=not (rewritten or removed.files or removed.dist_infos or failures),
    )


def stage_backup(backup: Backup, root: Path, workers: int | None = None) -> RestoreResult:
    """``--undo`` as a swap: the backup's files written into ``root`` (an empty staging tree laid out as
    the prefix) as a restore writes them, each checked against its saved hash (``mismatches``).
    Never raises for one file: check :attr:`RestoreResult.ok`."""
    nothing = _Removal((), (), (), (), ())
    try:
        tree, source = Tree(root), Tree(backup.files_dir)
    except OSError as exc:
        raise BackupError(
            f"cannot open {exc.filename}: {exc.strerror or exc}",
            hint="the staging tree and the backup must be real directories",
        ) from exc
    with tree, source, tree.batch(), source.batch():
        return _restore(backup, tree, source, nothing, _Removed((), (), (), ()), workers, None, frozenset())


# --- --prune ----------------------------------------------------------------------------------------


def prune_into(backup: Backup, prefix: Path, paths: Iterable[str]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Move leftover files (absolute paths inside ``prefix``) into ``<backup>/pruned/``: a regular file by
    content, a symlink as the link itself (its target is never read); a FIFO, a device, or anything
    outside the prefix or below a symlink is left alone. (the paths pruned, notes on those left)."""
    pruned: list[str] = []
    notes: list[str] = []
    ensure_dir(backup.dir / PRUNED_DIR)
    with Tree(prefix) as tree, Tree(backup.dir / PRUNED_DIR) as dest:
        for path in paths:
            relative = tree.relative(path)
            if relative is None:
                notes.append(f"not pruned: {path} is outside {prefix}")
                continue
            try:
                tree.copy_out(relative, dest, relative)
            except NotRegularFile as exc:
                notes.append(f"not pruned: {path} is {exc.what}")
                continue
            except FileNotFoundError:
                continue
            tree.unlink(relative)
            pruned.append(path)
    return tuple(pruned), tuple(notes)
