"""The state directory: where locks, journals, backups and logs of runs live.

Layout::

    <root>/                         0700; $SAFEINSTALL_STATE_DIR, /var/lib/safeinstall (root) or
                                    $XDG_STATE_HOME/safeinstall (default ~/.local/state/safeinstall)
    <root>/<basename>-<sha256[:12]>/  one per target environment, keyed by its (real) prefix
        prefix                      the prefix, as text (so --status/--recover can name it)
        lock                        held by the running run (see :mod:`safeinstall.lock`)
        journal.json                the running (or crashed) run (see :mod:`safeinstall.journal`)
        backups/<run-id>/           the files replaced by that run (see :mod:`safeinstall.backup`)
        logs/<run-id>.log
        uv-cache-<run-id>/          uv's cache for that run only (filled by the prefetch, the install
                                    hardlinks from it); deleted when the run ends

Path computation is pure (``environ`` and ``euid`` are parameters); :func:`ensure_dir` and
:func:`ensure_environment_dir` are the only functions that touch the disk, plus the listing.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from safeinstall.errors import SafeInstallError

STATE_DIR_VARIABLE = "SAFEINSTALL_STATE_DIR"
SYSTEM_STATE_ROOT = Path("/var/lib/safeinstall")
PREFIX_FILE = "prefix"
LOCK_FILE = "lock"
JOURNAL_FILE = "journal.json"
BACKUPS_DIR = "backups"
LOGS_DIR = "logs"
UV_CACHE_PREFIX = "uv-cache-"
PRIVATE_MODE = 0o700
_KEY_DIGEST_CHARS = 12
#: Temp files of :func:`atomic_write`: ``.<name>.<random>.tmp`` beside the target.
TMP_SUFFIX = ".tmp"


class StateDirError(SafeInstallError):
    """The state directory cannot be used safely (wrong owner, not a directory, not writable)."""

    code = "state-dir"


@dataclass(frozen=True, slots=True)
class EnvironmentState:
    """The state paths of one target environment."""

    root: Path  # the state root
    dir: Path  # <root>/<key>
    prefix: Path | None  # None when listed and its prefix file is missing/unreadable

    @property
    def key(self) -> str:
        return self.dir.name

    @property
    def prefix_file(self) -> Path:
        return self.dir / PREFIX_FILE

    @property
    def lock(self) -> Path:
        return self.dir / LOCK_FILE

    @property
    def journal(self) -> Path:
        return self.dir / JOURNAL_FILE

    @property
    def backups(self) -> Path:
        return self.dir / BACKUPS_DIR

    @property
    def logs(self) -> Path:
        return self.dir / LOGS_DIR

    def backup_dir(self, run_id: str) -> Path:
        return self.backups / run_id

    def log_file(self, run_id: str) -> Path:
        return self.logs / f"{run_id}.log"

    def uv_cache(self, run_id: str) -> Path:
        return self.dir / f"{UV_CACHE_PREFIX}{run_id}"


def remove_uv_caches(state: EnvironmentState, run_id: str | None = None) -> None:
    """Delete the run-private uv cache of ``run_id`` (None: every one left by runs that died). Installed
    files hardlinked from it then share their inodes with nothing. Symlinks are not followed."""
    try:
        names = os.listdir(state.dir)
    except OSError:
        return
    for name in names:
        if name.startswith(UV_CACHE_PREFIX) and (run_id is None or name == UV_CACHE_PREFIX + run_id):
            shutil.rmtree(state.dir / name, ignore_errors=True)


@dataclass(frozen=True, slots=True)
class DirStatus:
    path: Path
    created: bool
    old_mode: int | None = None  # set when the mode was looser than 0700 and was tightened

    @property
    def warning(self) -> str | None:
        if self.old_mode is None:
            return None
        return (
            f"{self.path} was mode {self.old_mode:04o} (group/other could read or write it); "
            f"tightened it to {PRIVATE_MODE:04o}"
        )


def state_root(environ: Mapping[str, str], euid: int) -> Path:
    """Pure: where the state lives, from the environment variables and the effective uid."""
    override = environ.get(STATE_DIR_VARIABLE)
    if override:
        return Path(os.path.abspath(os.path.expanduser(override)))
    if euid == 0:
        return SYSTEM_STATE_ROOT
    xdg = environ.get("XDG_STATE_HOME")
    if xdg and os.path.isabs(xdg):  # the XDG spec: relative values are invalid and ignored
        return Path(xdg) / "safeinstall"
    home = environ.get("HOME") or os.path.expanduser("~")
    return Path(home) / ".local" / "state" / "safeinstall"


def environment_key(prefix: Path) -> str:
    """Pure: ``<basename>-<first 12 hex of sha256(prefix)>``; pass the real path (Environment.prefix is)."""
    text = os.fspath(prefix)
    digest = hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()[:_KEY_DIGEST_CHARS]
    base = "".join(ch if ch.isalnum() or ch in "._-" else "_" for ch in prefix.name) or "root"
    return f"{base.lstrip('.') or 'env'}-{digest}"


def environment_state(root: Path, prefix: Path) -> EnvironmentState:
    """Pure: the state paths of the environment whose real prefix is ``prefix``."""
    return EnvironmentState(root=root, dir=root / environment_key(prefix), prefix=prefix)


def new_run_id(now: datetime, pid: int) -> str:
    """Pure: a sortable run id, e.g. ``20261130T031201Z-1234``."""
    return f"{now.astimezone(UTC).strftime('%Y%m%dT%H%M%SZ')}-{pid}"


def mode_problem(mode: int, owner: int, euid: int) -> str | None:
    """Pure: why a directory with this ``st_mode``/``st_uid`` must not be used, or None."""
    if not stat.S_ISDIR(mode):
        return "it is not a directory"
    if owner != euid:
        return f"it is owned by uid {owner}, not by uid {euid} which runs safeinstall"
    return None


def ensure_dir(path: Path, mode: int = PRIVATE_MODE) -> DirStatus:
    """Create ``path`` (and parents) with ``mode``; refuse foreign or odd ones, tighten loose modes."""
    created = False
    try:
        path.mkdir(parents=True, mode=mode)
        created = True
    except FileExistsError:
        pass
    except OSError as exc:
        raise StateDirError(
            f"cannot create the state directory {path}: {exc.strerror or exc}",
            hint=f"check its parent's permissions, or set {STATE_DIR_VARIABLE} to a writable directory",
        ) from exc
    try:
        info = os.stat(path)
    except OSError as exc:
        raise StateDirError(
            f"cannot inspect the state directory {path}: {exc.strerror or exc}",
            hint=f"check the path, or set {STATE_DIR_VARIABLE} to another directory",
        ) from exc
    problem = mode_problem(info.st_mode, info.st_uid, os.geteuid())
    if problem is not None:
        raise StateDirError(
            f"refusing to use the state directory {path}: {problem}",
            hint=f"remove or fix it (it must be a directory owned by you, mode {PRIVATE_MODE:04o}), "
            f"or set {STATE_DIR_VARIABLE} to another directory",
        )
    current = stat.S_IMODE(info.st_mode)
    if created and current != mode:  # mkdir's mode is masked by the umask
        os.chmod(path, mode)
    if not created and current & 0o077:
        try:
            os.chmod(path, mode)
        except OSError as exc:
            raise StateDirError(
                f"the state directory {path} is mode {current:04o} and could not be tightened: "
                f"{exc.strerror or exc}",
                hint=f"run chmod {mode:04o} {path}",
            ) from exc
        return DirStatus(path=path, created=False, old_mode=current)
    return DirStatus(path=path, created=created)


def ensure_environment_dir(state: EnvironmentState) -> tuple[DirStatus, ...]:
    """Create the state root and the environment's directories; record its prefix for listings."""
    statuses = tuple(ensure_dir(p) for p in (state.root, state.dir, state.backups, state.logs))
    if state.prefix is not None:
        text = os.fspath(state.prefix) + "\n"
        try:
            current: str | None = state.prefix_file.read_text(encoding="utf-8", errors="surrogateescape")
        except OSError:
            current = None
        if current != text:
            atomic_write(state.prefix_file, text.encode("utf-8", "surrogateescape"))
    return statuses


def fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes, mode: int = 0o600) -> None:
    """Write ``path`` whole or not at all: temp file beside it, fsync, rename, fsync the directory."""
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=TMP_SUFFIX)
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def _read_prefix(path: Path) -> Path | None:
    try:
        text = path.read_text(encoding="utf-8", errors="surrogateescape").strip()
    except OSError:
        return None
    return Path(text) if text and os.path.isabs(text) else None


def list_environment_dirs(root: Path) -> list[EnvironmentState]:
    """Every environment directory under the state root (for a global --status / --recover), by key."""
    try:
        entries = sorted(os.scandir(root), key=lambda e: e.name)
    except FileNotFoundError:
        return []
    except OSError as exc:
        raise StateDirError(
            f"cannot list the state directory {root}: {exc.strerror or exc}",
            hint=f"run as the user that owns it, or set {STATE_DIR_VARIABLE}",
        ) from exc
    found: list[EnvironmentState] = []
    for entry in entries:
        if entry.name.startswith(".") or not entry.is_dir(follow_symlinks=False):
            continue
        directory = Path(entry.path)
        found.append(EnvironmentState(root=root, dir=directory, prefix=_read_prefix(directory / PREFIX_FILE)))
    return found
