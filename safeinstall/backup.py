"""Backups of the distributions a run replaces, taken before any service stops, and their restore.

A backup is ``<backup_dir>/files/<path relative to the prefix>`` (each file byte for byte, with its
mode, owner and mtime; symlinks as symlinks) plus ``<backup_dir>/manifest.json``, written last: a
backup without a manifest is incomplete. What is saved: every RECORD entry of each distribution that
lies inside the environment's prefix (entries outside are listed, never read), the whole
``.dist-info`` directory, and the files someone added to the distribution's own package directories
(in no RECORD; bytecode of listed sources aside). Locally patched files are saved as they are now, and
the manifest lists the ones the caller says are patched.

A RECORD entry on the backup's filesystem is saved as a hardlink (no copy of a GB package before the
stop; the old version's bytes stay alive in it, as in a copy): uv's uninstall unlinks every RECORD
entry before the install creates the new files, so the old inode, and the backup, keep the old
content. Everything else (files added by
hand, ``.dist-info`` files no RECORD lists), and every file on another filesystem, is copied. Restores
always copy, so a restored file shares its inode with nothing.

A restore first removes what is installed now under those distribution names (the paths the caller
passes, the files the current ``.dist-info`` RECORDs of those names list, and those ``.dist-info``
directories, found by name so a half-finished install is cleaned too) and every file in the saved
package directories that the backup does not hold (a failed install's temp files: on a full disk,
their space is what the restore needs), then puts every saved file back atomically (temp file beside
it, ``os.replace``), then hashes every restored file again.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import os
import shutil
import stat
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any

from safeinstall.distributions import (
    InstalledDistribution,
    dist_info_dirs,
    dist_info_name,
    find_distributions,
)
from safeinstall.drift import own_roots, pyc_source
from safeinstall.environment import Environment
from safeinstall.errors import SafeInstallError
from safeinstall.hashing import FileState, HashRequest, default_workers, observe_files
from safeinstall.records import decode_digest, encode_digest, parse_record
from safeinstall.state import PRIVATE_MODE, atomic_write, ensure_dir, fsync_dir

MANIFEST_NAME = "manifest.json"
FILES_DIR = "files"
MANIFEST_VERSION = 1
_CHUNK = 1 << 20
_BLOCK = 4096
_TMP_MARK = ".safeinstall-restore-"

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

    @property
    def ok(self) -> bool:
        return not self.mismatches and not self.failures


@dataclass(frozen=True, slots=True)
class _Item:
    source: Path
    relative: str
    distribution: str
    listed: bool = True
    #: a RECORD entry: uv's uninstall unlinks it before the install writes anything at its path, so a
    #: hardlink of it in the backup keeps the old content (files in no RECORD are copied)
    in_record: bool = False


# --- pure helpers -----------------------------------------------------------------------------------


def is_within(path: Path, root: Path) -> bool:
    """Pure: ``path`` is ``root`` or below it (lexically)."""
    return path == root or root in path.parents


def relative_to_prefix(location: Path | str, prefix: Path | str) -> str | None:
    """Pure: ``location`` (normalised lexically) relative to ``prefix``, or None when outside it."""
    normal = os.path.normpath(location)
    root = os.fspath(prefix)
    base = root if root.endswith(os.sep) else root + os.sep
    if not normal.startswith(base) or len(normal) == len(base):
        return None
    return normal[len(base) :]


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
    return f"{what} needs {needed / 2**20:.1f} MiB but {where} has {free / 2**20:.1f} MiB free; {remedy}"


def manifest_to_dict(manifest: BackupManifest) -> dict[str, Any]:
    return {
        "version": manifest.version,
        "created_at": manifest.created_at,
        "prefix": manifest.prefix,
        "distributions": [
            {"name": d.name, "version": d.version, "dist_info": d.dist_info} for d in manifest.distributions
        ],
        "files": [
            {
                "path": f.path,
                "distribution": f.distribution,
                "size": f.size,
                "mode": f.mode,
                "uid": f.uid,
                "gid": f.gid,
                "mtime_ns": f.mtime_ns,
                "sha256": f.sha256,
                "link_target": f.link_target,
                "listed": f.listed,
            }
            for f in manifest.files
        ],
        "directories": [
            {"path": d.path, "mode": d.mode, "uid": d.uid, "gid": d.gid} for d in manifest.directories
        ],
        "missing": list(manifest.missing),
        "outside": list(manifest.outside),
        "patched": list(manifest.patched),
        "roots": list(manifest.roots),
    }


def _safe_relative(text: Any) -> str:
    if not isinstance(text, str) or not text:
        raise ValueError(f"bad path {text!r}")
    parts = PurePosixPath(text).parts
    if PurePosixPath(text).is_absolute() or any(p in ("..", ".") for p in parts):
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


class _Inside:
    """Where a location lies relative to the prefix: lexically, and with its directory's symlinks
    resolved (the file itself may be a symlink). Directories are resolved once each."""

    def __init__(self, prefix: Path) -> None:
        self._prefix = os.fspath(prefix)
        self._dirs: dict[str, bool] = {}

    def relative(self, location: Path | str) -> str | None:
        relative = relative_to_prefix(location, self._prefix)
        if relative is None:
            return None
        parent = os.path.dirname(os.path.normpath(location))
        inside = self._dirs.get(parent)
        if inside is None:
            real = os.path.realpath(parent)
            inside = real == self._prefix or relative_to_prefix(real, self._prefix) is not None
            self._dirs[parent] = inside
        return relative if inside else None


def package_roots(env: Environment, dists: Sequence[InstalledDistribution]) -> dict[str, list[str]]:
    """Each of ``dists``' own package directories (absolute; see :func:`safeinstall.drift.own_roots`):
    no other installed distribution has files below them."""
    installed = {d.name: d.locations for d in find_distributions(env)}
    installed.update({d.name: d.locations for d in dists})
    roots = own_roots(installed, [os.fspath(s) for s in env.site_dirs])
    return {d.name: roots.get(d.name, []) for d in dists}


def _unlisted(root: str, listed: set[str]) -> Iterator[str]:
    """Files (and symlinks) below ``root`` that no RECORD lists; bytecode of a listed source is left
    out (a cache: Python writes it again)."""
    for location in _files_below(Path(root)):
        if location in listed:
            continue
        source = pyc_source(PurePosixPath(location)) if location.endswith(".pyc") else None
        if source is None or str(source) not in listed:
            yield location


def _collect(
    env: Environment, dists: Sequence[InstalledDistribution]
) -> tuple[list[_Item], list[str], list[str]]:
    """Files to save (RECORD entries inside the prefix, the .dist-info trees, and the files added to
    the distributions' own directories by hand), the entries outside, and those directories."""
    inside = _Inside(env.prefix)
    items: dict[str, _Item] = {}
    outside: list[str] = []
    roots = package_roots(env, dists)
    listed = {location for dist in dists for location in dist.locations}
    for dist in dists:
        for root in roots[dist.name]:
            for location in _unlisted(root, listed):
                relative = inside.relative(location)
                if relative is not None and relative not in items:
                    items[relative] = _Item(Path(location), relative, dist.name, listed=False)
    for dist in dists:
        for entry in dist.record.entries:
            location = os.path.normpath(os.path.join(dist.site, entry.path))
            relative = inside.relative(location)
            if relative is None:
                outside.append(f"{dist.name}: {entry.path} ({location})")
            elif relative not in items:
                items[relative] = _Item(Path(location), relative, dist.name, in_record=True)
        for directory, dirnames, filenames in os.walk(dist.dist_info):
            dirnames.sort()
            # symlinks to directories show up in dirnames; save them as links too
            links = [d for d in dirnames if os.path.islink(os.path.join(directory, d))]
            for name in sorted(filenames) + links:
                location = os.path.join(directory, name)
                relative = inside.relative(location)
                if relative is not None and relative not in items:
                    items[relative] = _Item(Path(location), relative, dist.name)
    relative_roots = sorted(
        {r for r in (inside.relative(root) for dist in dists for root in roots[dist.name]) if r is not None}
    )
    return sorted(items.values(), key=lambda i: i.relative), outside, relative_roots


def disk_space_needed(dists: Sequence[InstalledDistribution], env: Environment) -> int:
    """Bytes a backup of ``dists`` takes: file sizes rounded up to blocks, plus the manifest."""
    items, _outside, _roots = _collect(env, dists)
    total = 0
    for item in items:
        try:
            size = os.lstat(item.source).st_size
        except OSError:
            size = 0
        total += -(-size // _BLOCK) * _BLOCK + 512  # content + a manifest line / inode
    return total + _BLOCK


def free_space(path: Path) -> int:
    """Free bytes on the filesystem that holds (or will hold) ``path``."""
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return shutil.disk_usage(probe).free


# --- taking a backup --------------------------------------------------------------------------------


def _copy_stream(source_fd: int, dest_fd: int) -> tuple[str, int]:
    """Copy all of ``source_fd`` to ``dest_fd``, hashing on the way; (sha256 hex, bytes)."""
    hasher = hashlib.sha256()
    size = 0
    while chunk := os.read(source_fd, _CHUNK):
        hasher.update(chunk)
        view = memoryview(chunk)
        while view:
            view = view[os.write(dest_fd, view) :]
        size += len(chunk)
    return hasher.hexdigest(), size


def _link(item: _Item, info: os.stat_result, dest: Path, known: FileState | None) -> tuple[str, int] | None:
    """Hardlink a RECORD entry into the backup; its sha256 (taken from ``known``, a hash of this very
    inode, unchanged since: same device, inode, size and mtime; else read now). None when it cannot
    be linked (another filesystem, or it changed under us): the caller copies it instead.

    The backup then holds the installed inode itself. That is safe because the install never writes
    into it: uv's uninstall unlinks every RECORD entry first, and the install creates new files (a
    hardlink from the run's cache, or a copy) at those paths. Nothing is chmod-ed or touched here: it
    is the installed file."""
    try:
        os.link(item.source, dest, follow_symlinks=False)
    except OSError:
        return None
    identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
    try:
        fd = os.open(dest, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        os.unlink(dest)
        return None
    try:
        now = os.fstat(fd)
        if (now.st_dev, now.st_ino, now.st_size, now.st_mtime_ns) != identity:
            os.unlink(dest)  # replaced or written since the lstat: copy what is there now
            return None
        if (
            known is not None
            and known.algorithm == "sha256"
            and known.digest is not None
            and (known.device, known.inode, known.size, known.mtime_ns) == identity
        ):
            return decode_digest(known.digest).hex(), info.st_size
        hasher = hashlib.sha256()
        while chunk := os.read(fd, _CHUNK):
            hasher.update(chunk)
        return hasher.hexdigest(), info.st_size
    finally:
        os.close(fd)


def _save(item: _Item, files_dir: Path, known: Mapping[str, FileState]) -> BackupFile | None:
    """Save one file into the backup (a hardlink of a RECORD entry where the filesystem allows, else a
    copy); None when it is absent (or not a regular file or symlink)."""
    try:
        info = os.lstat(item.source)
    except FileNotFoundError:
        return None
    dest = files_dir / item.relative  # its directory was made by create_backup
    mode = stat.S_IMODE(info.st_mode)
    if stat.S_ISLNK(info.st_mode):
        target = os.readlink(item.source)
        os.symlink(target, dest)
        return BackupFile(
            path=item.relative,
            distribution=item.distribution,
            size=info.st_size,
            mode=mode,
            uid=info.st_uid,
            gid=info.st_gid,
            mtime_ns=info.st_mtime_ns,
            sha256=None,
            link_target=target,
            listed=item.listed,
        )
    if not stat.S_ISREG(info.st_mode):
        return None
    linked = _link(item, info, dest, known.get(str(item.source))) if item.in_record else None
    if linked is not None:
        return BackupFile(
            path=item.relative,
            distribution=item.distribution,
            size=linked[1],
            mode=mode,
            uid=info.st_uid,
            gid=info.st_gid,
            mtime_ns=info.st_mtime_ns,
            sha256=linked[0],
            listed=item.listed,
        )
    source_fd = os.open(item.source, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    try:
        dest_fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            digest, size = _copy_stream(source_fd, dest_fd)
            os.fsync(dest_fd)
            os.fchmod(dest_fd, mode)
        finally:
            os.close(dest_fd)
    finally:
        os.close(source_fd)
    os.utime(dest, ns=(info.st_mtime_ns, info.st_mtime_ns))
    return BackupFile(
        path=item.relative,
        distribution=item.distribution,
        size=size,
        mode=mode,
        uid=info.st_uid,
        gid=info.st_gid,
        mtime_ns=info.st_mtime_ns,
        sha256=digest,
        listed=item.listed,
    )


def _device(path: Path) -> int:
    return os.stat(path).st_dev


def _directories(files: Iterable[BackupFile], prefix: Path) -> tuple[BackupDirectory, ...]:
    wanted: set[str] = set()
    for saved in files:
        parent = saved.path.rpartition("/")[0]  # "/" separated, relative: no pathlib per file
        while parent and parent not in wanted:
            wanted.add(parent)
            parent = parent.rpartition("/")[0]
    found: list[BackupDirectory] = []
    for relative in sorted(wanted, key=lambda p: (p.count("/"), p)):
        info = os.stat(prefix / relative)
        found.append(BackupDirectory(relative, stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid))
    return tuple(found)


def create_backup(
    env: Environment,
    dists: Sequence[InstalledDistribution],
    backup_dir: Path,
    patched: Sequence[str],
    on_progress: ProgressCallback | None = None,
    workers: int | None = None,
    now: datetime | None = None,
    known: Mapping[str, FileState] | None = None,
) -> Backup:
    """Save ``dists`` into ``backup_dir`` (new or empty; made 0700). Raises BackupError, leaving no backup.

    ``known``: files just hashed (a verify's observations, by location): a hardlinked file that has not
    changed since is not read again."""
    ensure_dir(backup_dir)
    if any(backup_dir.iterdir()):
        raise BackupError(
            f"the backup directory {backup_dir} is not empty",
            hint="use a new run id (each run backs up into its own directory)",
        )
    items, outside, roots = _collect(env, dists)
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
        parents = {item.relative.rpartition("/")[0] for item in items} - {""}
        for parent in sorted(parents):
            (files_dir / parent).mkdir(parents=True, exist_ok=True, mode=PRIVATE_MODE)

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
        linking = _device(env.prefix) == _device(files_dir)
        inline = [i for i in ordered if linking and i.in_record]
        pooled = [i for i in ordered if not (linking and i.in_record)]
        for item in inline:
            record(item, _save(item, files_dir, known or {}))
        count = workers or default_workers()
        with ThreadPoolExecutor(max_workers=count, thread_name_prefix="backup") as pool:
            futures = {pool.submit(_save, item, files_dir, known or {}): item for item in pooled}
            try:
                for future in as_completed(futures):
                    record(futures[future], future.result())
            except BaseException:
                for pending in futures:
                    pending.cancel()
                raise
        saved.sort(key=lambda f: f.path)
        for parent in {f.path.rpartition("/")[0] for f in saved}:
            fsync_dir(files_dir / parent if parent else files_dir)
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
        text = json.dumps(manifest_to_dict(manifest), separators=(",", ":")) + "\n"  # C encoder
        atomic_write(backup_dir / MANIFEST_NAME, text.encode("utf-8", "surrogateescape"))
    except OSError as exc:
        shutil.rmtree(backup_dir, ignore_errors=True)
        where = f" ({exc.filename})" if exc.filename else ""
        raise BackupError(
            f"could not back up {', '.join(d.name for d in dists)} into {backup_dir}: "
            f"{exc.strerror or exc}{where}; nothing was changed",
            hint="free space on that filesystem (or point SAFEINSTALL_STATE_DIR elsewhere) and run again",
        ) from exc
    return Backup(backup_dir, manifest)


def load_backup(backup_dir: Path) -> Backup:
    """Read a backup's manifest. Raises BackupError when it is missing (incomplete backup) or damaged."""
    path = backup_dir / MANIFEST_NAME
    try:
        raw = path.read_bytes()
    except FileNotFoundError as exc:
        raise BackupError(
            f"{backup_dir} holds no {MANIFEST_NAME}: the backup was never completed",
            hint="nothing was installed from an incomplete backup's run; if files were changed by hand, "
            "reinstall the package with uv",
        ) from exc
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


def _current_dist_infos(env: Environment, names: frozenset[str]) -> list[Path]:
    return [d for d in dist_info_dirs(env) if dist_info_name(d.name) in names]


def _record_locations(dist_info: Path) -> list[Path]:
    try:
        text = (dist_info / "RECORD").read_text(encoding="utf-8", errors="replace")
    except OSError:
        return []
    return [Path(os.path.normpath(dist_info.parent / e.path)) for e in parse_record(text).entries]


def stale_bytecode(sources: Iterable[Path]) -> list[Path]:
    """``__pycache__/<stem>.*.pyc`` of each ``.py`` source: a stale one is used when mtime and size match."""
    stems: dict[Path, set[str]] = {}
    for source in sources:
        if source.suffix == ".py":
            stems.setdefault(source.parent / "__pycache__", set()).add(source.stem)
    found: list[Path] = []
    for cache, wanted in stems.items():
        try:
            names = os.listdir(cache)
        except OSError:
            continue
        for name in names:
            if name.endswith(".pyc") and name.split(".", 1)[0] in wanted:
                found.append(cache / name)
    return sorted(found)


def _files_below(root: Path) -> list[str]:
    """Files and symlinks below ``root`` (symlinked directories as links, not followed)."""
    found: list[str] = []
    for directory, dirnames, filenames in os.walk(root):
        for name in dirnames:
            if os.path.islink(os.path.join(directory, name)):
                found.append(os.path.join(directory, name))
        found.extend(os.path.join(directory, name) for name in filenames)
    return found


def _unlink(path: Path) -> bool:
    try:
        os.unlink(path)
    except FileNotFoundError:
        return False
    return True


def _prune_empty(directories: Iterable[Path], stop: frozenset[Path], prefix: Path) -> None:
    for start in sorted(set(directories), key=lambda p: len(p.parts), reverse=True):
        directory = start
        while directory not in stop and is_within(directory, prefix) and directory != prefix:
            try:
                os.rmdir(directory)
            except OSError:
                break
            directory = directory.parent


def _make_directories(manifest: BackupManifest, prefix: Path, as_root: bool) -> list[str]:
    """Recreate missing directories with their saved mode and owner; failures as "path: reason"."""
    failures: list[str] = []
    for saved in manifest.directories:  # parents first
        path = prefix / saved.path
        try:
            if os.path.isdir(path):
                continue
            if os.path.lexists(path):  # a file (or dangling link) where a directory was
                os.unlink(path)
            os.mkdir(path, saved.mode)
            if as_root:
                os.chown(path, saved.uid, saved.gid)
            os.chmod(path, saved.mode)
        except OSError as exc:
            failures.append(f"{path}: could not recreate the directory: {exc.strerror or exc}")
    return failures


def _remove_own_temp_files(directories: Iterable[Path]) -> None:
    for directory in directories:
        try:
            names = os.listdir(directory)
        except OSError:
            continue
        for name in names:
            if _TMP_MARK in name and name.startswith("."):
                with contextlib.suppress(OSError):
                    os.unlink(directory / name)


def _replace(tmp: Path, dest: Path) -> None:
    try:
        os.replace(tmp, dest)
    except OSError:
        if not os.path.isdir(dest) or os.path.islink(dest):
            raise
        shutil.rmtree(dest)  # the installed version has a directory where the saved one has a file
        os.replace(tmp, dest)


def _put_back(saved: BackupFile, files_dir: Path, prefix: Path, as_root: bool) -> None:
    """Put one file back atomically (temp file beside it, rename). On a full disk the file it replaces
    is removed first, to make the room that the copy needs: the services are stopped during a restore,
    so atomicity matters less than finishing it."""
    try:
        _put_back_atomically(saved, files_dir, prefix, as_root)
    except OSError as exc:
        dest = prefix / saved.path
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not os.path.lexists(dest) or os.path.isdir(dest):
            raise
        os.unlink(dest)
        _put_back_atomically(saved, files_dir, prefix, as_root)


def _put_back_atomically(saved: BackupFile, files_dir: Path, prefix: Path, as_root: bool) -> None:
    dest = prefix / saved.path
    tmp = dest.with_name(f".{dest.name}{_TMP_MARK}{os.getpid()}-{os.urandom(4).hex()}")
    try:
        if saved.link_target is not None:
            os.symlink(saved.link_target, tmp)
            if as_root:
                os.lchown(tmp, saved.uid, saved.gid)
            os.utime(tmp, ns=(saved.mtime_ns, saved.mtime_ns), follow_symlinks=False)
        else:
            source_fd = os.open(files_dir / saved.path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                dest_fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                try:
                    _copy_stream(source_fd, dest_fd)
                    if as_root:
                        os.fchown(dest_fd, saved.uid, saved.gid)  # before chmod: chown clears set-id bits
                    os.fchmod(dest_fd, saved.mode)
                    os.fsync(dest_fd)
                finally:
                    os.close(dest_fd)
            finally:
                os.close(source_fd)
            os.utime(tmp, ns=(saved.mtime_ns, saved.mtime_ns))
        _replace(tmp, dest)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _check(manifest: BackupManifest, prefix: Path, workers: int | None) -> list[str]:
    regular = [f for f in manifest.files if f.link_target is None]
    states = observe_files(
        [HashRequest(str(prefix / f.path), "sha256") for f in regular],
        workers=workers,
        sizes={str(prefix / f.path): f.size for f in regular},
    )
    mismatches: list[str] = []
    for saved in regular:
        state = states[str(prefix / saved.path)]
        expected = encode_digest(bytes.fromhex(saved.sha256 or ""))
        if not state.is_file or state.digest != expected:
            mismatches.append(str(prefix / saved.path))
    for saved in manifest.files:
        if saved.link_target is None:
            continue
        try:
            target = os.readlink(prefix / saved.path)
        except OSError:
            target = None
        if target != saved.link_target:
            mismatches.append(str(prefix / saved.path))
    return sorted(mismatches)


def restore_backup(
    backup: Backup, env: Environment, remove: Iterable[Path], workers: int | None = None
) -> RestoreResult:
    """Put ``backup`` back into ``env``: remove what is installed now under its names, copy back, check.

    ``remove``: the files the installed (or half-installed) version has, e.g. its RECORD locations
    and the locations of the new wheel's members. Paths outside the prefix, and paths another
    installed distribution lists, are left alone (and reported). Never raises for one file: failures
    are collected; check :attr:`RestoreResult.ok`.
    """
    manifest = backup.manifest
    prefix = env.prefix
    if Path(manifest.prefix) != prefix:
        raise BackupError(
            f"the backup {backup.dir} is of {manifest.prefix}, not of {prefix}",
            hint="pass the --python of the environment the backup was taken from",
        )
    as_root = os.geteuid() == 0
    names = frozenset(d.name for d in manifest.distributions)
    restoring = {prefix / f.path for f in manifest.files}
    saved_paths = frozenset(f.path for f in manifest.files)
    failures: list[str] = []

    dist_infos = _current_dist_infos(env, names)
    candidates: set[Path] = set()
    for given in remove:
        candidates.add(Path(os.path.normpath(given if given.is_absolute() else prefix / given)))
    for dist_info in dist_infos:
        candidates.update(_record_locations(dist_info))
    others = [d for d in find_distributions(env) if d.name not in names]
    shared = {os.path.normpath(os.path.join(d.site, e.path)) for d in others for e in d.record.entries}
    inside = _Inside(prefix)
    in_dist_infos = tuple(os.path.join(d, "") for d in dist_infos)

    skipped_outside: list[str] = []
    kept_shared: list[str] = []
    to_remove: list[Path] = []
    for path in sorted(candidates):
        if inside.relative(path) is None:
            skipped_outside.append(str(path))
        elif str(path).startswith(in_dist_infos) or path in restoring:
            continue  # removed with its .dist-info / replaced atomically below
        elif str(path) in shared:
            kept_shared.append(str(path))
        else:
            to_remove.append(path)

    removed = 0
    touched_dirs: set[Path] = set()
    for path in to_remove:
        try:
            if os.path.isdir(path) and not os.path.islink(path):
                continue  # a directory is never removed whole; its files are listed themselves
            if _unlink(path):
                removed += 1
                touched_dirs.add(path.parent)
        except OSError as exc:
            failures.append(f"{path}: could not remove it: {exc.strerror or exc}")
    # bytecode of removed or replaced sources could be stale; saved .pyc files come back below
    for pyc in stale_bytecode([*to_remove, *restoring]):
        if pyc not in restoring:
            with contextlib.suppress(OSError):
                if _unlink(pyc):
                    touched_dirs.add(pyc.parent)
    for root in manifest.roots:  # the package directories hold exactly what was saved, nothing new
        for location in _files_below(prefix / root):
            relative = inside.relative(location)
            if relative is None or relative in saved_paths:
                continue
            try:
                if _unlink(Path(location)):
                    removed += 1
                    touched_dirs.add(Path(location).parent)
            except OSError as exc:
                failures.append(f"{location}: could not remove it: {exc.strerror or exc}")
    removed_dist_infos: list[str] = []
    for dist_info in dist_infos:
        try:
            shutil.rmtree(dist_info)
            removed_dist_infos.append(str(dist_info))
        except OSError as exc:
            failures.append(f"{dist_info}: could not remove it: {exc.strerror or exc}")
    stop = frozenset({prefix, *env.site_dirs, env.scripts, env.data})
    _prune_empty(touched_dirs, stop, prefix)

    failures.extend(_make_directories(manifest, prefix, as_root))
    _remove_own_temp_files({path.parent for path in restoring})  # left by a restore that crashed
    restored = 0
    with ThreadPoolExecutor(max_workers=workers or default_workers(), thread_name_prefix="restore") as pool:
        futures = {pool.submit(_put_back, f, backup.files_dir, prefix, as_root): f for f in manifest.files}
        for future in as_completed(futures):
            try:
                future.result()
                restored += 1
            except OSError as exc:
                where = prefix / futures[future].path
                failures.append(f"{where}: could not restore it: {exc.strerror or exc}")
    for directory in sorted({(prefix / f.path).parent for f in manifest.files}):
        with contextlib.suppress(OSError):
            fsync_dir(directory)
    return RestoreResult(
        restored=restored,
        removed=removed,
        removed_dist_infos=tuple(removed_dist_infos),
        mismatches=tuple(_check(manifest, prefix, workers)),
        failures=tuple(sorted(failures)),
        skipped_outside=tuple(skipped_outside),
        kept_shared=tuple(kept_shared),
    )
