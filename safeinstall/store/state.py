"""The state directory: where locks, journals, backups and logs of runs live.

Paths are computed purely; :func:`ensure_dir` and :func:`ensure_environment_dir` touch the disk, and
:func:`trust_problem` refuses a directory anyone else could have written. Layout and trust:
docs/crash-safety.md.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import stat
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from safeinstall.env.environment import Account
from safeinstall.errors import SafeInstallError, UsageError
from safeinstall.system.safefs import (
    Tree,
    UntrustedFile,
    describe,
    only_caller_writes,
    others_who_write,
    permitted,
    read_trusted,
)

STATE_DIR_VARIABLE = "SAFEINSTALL_STATE_DIR"
SYSTEM_STATE_ROOT = Path("/var/lib/safeinstall")
PREFIX_FILE = "prefix"
LOCK_FILE = "lock"
JOURNAL_FILE = "journal.json"
#: A prepared run's record (store/prepared.py): beside its journal, removed with it
PREPARED_FILE = "prepared.json"
BACKUPS_DIR = "backups"
LOGS_DIR = "logs"
UV_CACHE_PREFIX = "uv-cache-"
PREFETCH_PREFIX = "prefetch-"
KEEP_PATCHES_PREFIX = "keep-patches-"
#: A run's probe (its tree in the prefix, its cache here): the run's id and this (docs/window.md)
PROBE_SUFFIX = "-probe"
#: A run's scratch ``--target`` where uv unpacks a given wheel into the run's cache beside the fill
UNPACK_SUFFIX = "-unpack"
#: A run's own directories by name: its id after a prefix, then one of these
_RUN_SUFFIXES = ("", PROBE_SUFFIX, UNPACK_SUFFIX)
SMOKE_PREFIX = "smoke-"  # root's: the shim the smoke check's children import (safeinstall.env.importcheck)
#: The run's own directories: uv's cache, its scratch ``--target`` directories, the smoke check's shim
RUN_DIR_PREFIXES = (UV_CACHE_PREFIX, PREFETCH_PREFIX, KEEP_PATCHES_PREFIX, SMOKE_PREFIX)
HISTORY_DIR = "history"
PATCHES_DIR = "patches"
PRIVATE_MODE = 0o700
#: The state root and an environment's directory when uv runs as the environment's owner: it may enter
#: them (to reach its own directories by name), not list or write them
PASSABLE_MODE = 0o711
_KEY_DIGEST_CHARS = 12
#: Temp files of :func:`atomic_write`: ``.<name>.<random>.tmp`` beside the target.
TMP_SUFFIX = ".tmp"
#: Files of an environment's directory that only a run holding its lock writes (the gate marker, the
#: journal, the baseline): a temp file of one of them found under the lock is a dead run's
LOCKED_FILES = ("gate", JOURNAL_FILE, PREPARED_FILE, "baseline.json", "old-imports.json")
_PREFIX_MAX = 64 * 1024


class StateDirError(SafeInstallError):
    """The state directory cannot be used safely (wrong owner, not a directory, not writable)."""

    code = "state-dir"


@dataclass(frozen=True, slots=True)
class EnvironmentState:
    """The state paths of one target environment."""

    root: Path  # the state root
    dir: Path  # <root>/<key>
    prefix: Path | None  # None when listed and its prefix file is missing/unreadable
    #: why this (listed) directory must not be used: not owned by root or the caller, writable by others
    problem: str | None = None

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

    @property
    def history(self) -> Path:
        return self.dir / HISTORY_DIR

    @property
    def patches(self) -> Path:
        return self.dir / PATCHES_DIR

    def patch_file(self, run_id: str) -> Path:
        return self.patches / f"{run_id}.patch"

    def backup_dir(self, run_id: str) -> Path:
        return self.backups / run_id

    def log_file(self, run_id: str) -> Path:
        return self.logs / f"{run_id}.log"

    def uv_cache(self, run_id: str) -> Path:
        return self.dir / f"{UV_CACHE_PREFIX}{run_id}"

    def probe_cache(self, run_id: str) -> Path:
        """The throwaway cache of the run's probe tree (links of root's cache; docs/window.md)."""
        return self.dir / f"{UV_CACHE_PREFIX}{run_id}{PROBE_SUFFIX}"

    def prefetch_dir(self, run_id: str) -> Path:
        return self.dir / f"{PREFETCH_PREFIX}{run_id}"

    def unpack_dir(self, run_id: str) -> Path:
        """The throwaway ``--target`` of uv's unpack of a given wheel beside the fill (docs/window.md)."""
        return self.dir / f"{PREFETCH_PREFIX}{run_id}{UNPACK_SUFFIX}"

    def keep_patches_dir(self, run_id: str) -> Path:
        return self.dir / f"{KEEP_PATCHES_PREFIX}{run_id}"


def make_run_dir(path: Path, account: Account | None) -> Path:
    """Make the run's directory ``path`` (its uv cache, a scratch directory: a child of an environment's
    state directory), 0700; with ``account``, the directory is that account's (uv runs as it). What
    is in the way (a leftover) is removed first, by descriptor. Returns ``path``."""
    if not remove_run_dir(path):
        raise OSError(errno.ENOTEMPTY, "a leftover could not be removed", str(path))
    with Tree(path.parent) as tree:
        tree.make_dir(path.name, PRIVATE_MODE, None if account is None else account.ids)
    return path


#: How long the run's uv cache (or a scratch directory) may take to delete: its owner may keep filling
#: it (a ``.pth`` file learns ``UV_CACHE_DIR`` in every uv call). Past it, what is left stays for the
#: next run or ``--recover``, which try again.
RUN_DIR_REMOVAL_S = 30.0
#: The same bound while the services are down (a rollback, ``--recover``): the restore goes on
#: after it, and the rest is removed once the units run again.
PUT_BACK_CACHE_S = 10.0


def remove_run_dir(path: Path, seconds: float = RUN_DIR_REMOVAL_S) -> bool:
    """Delete the run's directory ``path``, best effort within ``seconds``; True when it is gone. Its contents
    are removed by a worker that is their owner, by descriptor; root then removes the emptied directory."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    if stat.S_ISDIR(info.st_mode):
        from safeinstall.env import owner  # here: every check reads the state (not json)
        from safeinstall.system import worker

        ids = None if info.st_uid == 0 else (info.st_uid, info.st_gid)
        with contextlib.suppress(worker.WorkerError):
            worker.call(
                ids,
                lambda: owner.empty_directory(str(path), seconds),
                timeout=seconds + 5,
                what=f"empties {path}",
            )
    with contextlib.suppress(OSError), Tree(path.parent) as tree, tree.parent(path.name) as (fd, name):
        try:
            os.rmdir(name, dir_fd=fd)
        except NotADirectoryError:  # a file or a symlink in its place: the entry itself goes
            os.unlink(name, dir_fd=fd)
    return not os.path.lexists(path)


def remove_uv_caches(
    state: EnvironmentState,
    run_id: str | None = None,
    seconds: float = RUN_DIR_REMOVAL_S,
    probes: bool = True,
) -> tuple[str, ...]:
    """Delete the run-private uv cache and scratch directories of ``run_id`` (None: every one left by
    runs that died), as :func:`remove_run_dir` does, within ``seconds`` in all. Installed files
    hardlinked from the cache then share their inodes with nothing. ``probes=False``: a probe's cache
    stays (in the downtime: it frees no room). Returns the ones left."""
    try:
        names = os.listdir(state.dir)
    except OSError:
        return ()
    left: list[str] = []
    deadline = time.monotonic() + seconds
    for name in names:
        for prefix in RUN_DIR_PREFIXES:
            ours = tuple(prefix + run_id + s for s in _RUN_SUFFIXES) if run_id is not None else ()
            mine = name.startswith(prefix) and (run_id is None or name in ours)
            mine = mine and (probes or not name.endswith(PROBE_SUFFIX))
            if mine and not remove_run_dir(state.dir / name, max(0.0, deadline - time.monotonic())):
                left.append(str(state.dir / name))
    return tuple(left)


def is_dead_temp(name: str) -> bool:
    """Pure: ``name`` is a temp file of :func:`atomic_write` for one of :data:`LOCKED_FILES`."""
    return name.endswith(TMP_SUFFIX) and any(name.startswith(f".{locked}.") for locked in LOCKED_FILES)


def remove_dead_temps(state: EnvironmentState) -> None:
    """Holding the environment's lock: remove what :func:`atomic_write` left of a run killed between
    writing one of :data:`LOCKED_FILES` and renaming it (best effort). Root's own regular files only,
    by descriptor (a symlink or another's file there is left alone)."""
    with contextlib.suppress(OSError), Tree(state.dir) as tree:
        for name in tree.names(""):
            info = tree.lstat(name) if is_dead_temp(name) else None
            if info is not None and stat.S_ISREG(info.st_mode) and info.st_uid == os.geteuid():
                tree.unlink(name)


@dataclass(frozen=True, slots=True)
class DirStatus:
    path: Path
    created: bool
    old_mode: int | None = None  # set when group/other could read it and it was tightened to 0700

    @property
    def warning(self) -> str | None:
        if self.old_mode is None:
            return None
        return (
            f"{self.path} was mode {self.old_mode:04o} (group/other could read it); "
            f"tightened it to {PRIVATE_MODE:04o}"
        )


def state_root(environ: Mapping[str, str], euid: int) -> Path:
    """Where the state lives, from the environment variables and the effective uid; a real path (the
    trust check and the safe filesystem layer then see no symlink in it)."""
    return Path(os.path.realpath(_state_root(environ, euid)))


def _state_root(environ: Mapping[str, str], euid: int) -> Path:
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


_RUN_ID = re.compile(r"\d{8}T\d{6}Z-\d{1,10}")


def is_run_id(text: str) -> bool:
    """Pure: whether ``text`` has the shape :func:`new_run_id` gives (and so is safe in a file name)."""
    return _RUN_ID.fullmatch(text) is not None


def mode_problem(mode: int, owner: int, euid: int) -> str | None:
    """Pure: why a directory with this ``st_mode``/``st_uid`` must not be used, or None."""
    if not stat.S_ISDIR(mode):
        return "it is not a directory"
    if owner != euid:
        return f"it is owned by uid {owner}, not by uid {euid} which runs safeinstall"
    return None


def trust_problem(mode: int, owner: int, euid: int, *, parent: bool, gid: int = -1) -> str | None:
    """Pure: why another user could change what a directory (or a ``parent``) holds, or None: it must be owned
    by root or the caller and writable by nobody else, gid 0 included; a parent may be a root-owned sticky
    directory (``/tmp``)."""
    if not stat.S_ISDIR(mode):
        return "it is not a directory"
    if owner not in (0, euid):
        return f"it is owned by uid {owner}, not by root or uid {euid} which runs safeinstall"
    who = others_who_write(mode, gid, group_root_is_root=False)
    if who is not None and not (parent and owner == 0 and mode & stat.S_ISVTX):
        return f"it is mode {stat.S_IMODE(mode):04o}: {who} may write to it"
    return None


def _untrusted(path: Path, problem: str) -> StateDirError:
    return StateDirError(
        f"refusing to use the state directory {path}: {problem}",
        hint="another user could have planted what safeinstall would act on as root there; make it "
        f"(and its parents) owned by root or you and writable by nobody else (chmod go-w), "
        f"or set {STATE_DIR_VARIABLE} to another directory",
    )


def check_trusted(path: Path, euid: int | None = None) -> None:
    """Refuse (StateDirError) unless ``path`` and every directory above it is trusted (see
    :func:`trust_problem`). The chain checked is that of the real path: a symlink on the way counts
    as the directories it leads to. A ``path`` that does not exist yet is fine if its parents are."""
    uid = os.geteuid() if euid is None else euid
    real = Path(os.path.realpath(path))
    for directory in (*reversed(real.parents), real):
        try:
            info = os.lstat(directory)
        except FileNotFoundError:
            return  # created later, by us, below directories already checked
        except OSError as exc:
            raise StateDirError(
                f"cannot inspect {directory} (above the state directory {path}): {exc.strerror or exc}",
                hint=f"check the path, or set {STATE_DIR_VARIABLE} to another directory",
            ) from exc
        problem = trust_problem(info.st_mode, info.st_uid, uid, parent=directory != real, gid=info.st_gid)
        if problem is not None:
            raise _untrusted(path, problem if directory == real else f"its parent {directory}: {problem}")


def check_passable(root: Path, account: Account) -> None:
    """Refuse (StateDirError) a state root that ``account`` (the environment's owner, as whom uv runs)
    could not reach: one of the directories above it is closed to it (its uid and primary group only, as
    uv runs; access control lists are not read). The root and the environment's directory themselves
    are made passable by the run (:func:`let_through`)."""
    real = Path(os.path.realpath(root))
    for directory in reversed(real.parents):
        try:
            info = os.stat(directory)
        except FileNotFoundError:
            return  # created by the run, with the default mode
        except OSError as exc:
            raise StateDirError(
                f"cannot inspect {directory} (above the state directory {root}): {exc.strerror or exc}",
                hint=f"check the path, or set {STATE_DIR_VARIABLE} to another directory",
            ) from exc
        if not permitted(info.st_mode, info.st_uid, info.st_gid, account.ids, 0o1):
            raise StateDirError(
                f"uv runs as uid {account.uid}, the environment's owner, and could not reach the run's uv "
                f"cache in the state directory {root}: {directory} is mode {stat.S_IMODE(info.st_mode):04o}, "
                f"closed to uid {account.uid}",
                hint=f"set {STATE_DIR_VARIABLE} to a directory whose parents others may enter (the default "
                f"{SYSTEM_STATE_ROOT} is one), or let them in (chmod o+x {directory}); nothing was stopped",
            )


def let_through(state: EnvironmentState) -> None:
    """Make the state root and the environment's directory :data:`PASSABLE_MODE` (0711), so that the
    environment's owner reaches the run's own directories in it by name (see the module)."""
    for directory in (Path(os.path.realpath(state.root)), state.dir):
        try:
            if stat.S_IMODE(os.lstat(directory).st_mode) != PASSABLE_MODE:
                os.chmod(directory, PASSABLE_MODE)  # root's own directories (ensure_dir checked them)
        except OSError as exc:
            raise StateDirError(
                f"cannot let the environment's owner through {directory}: {exc.strerror or exc}",
                hint=f"run chmod {PASSABLE_MODE:04o} {directory}; nothing was stopped",
            ) from exc


def _usable(path: Path, *, missing_ok: bool) -> os.stat_result | None:
    """The stat of the state directory ``path``; None when it is missing and that is ok. Refuses one
    that cannot be inspected, is not a directory or is not ours."""
    try:
        info = os.lstat(path)  # a symlink is not a directory: it could lead anywhere
    except OSError as exc:
        if missing_ok and isinstance(exc, FileNotFoundError):
            return None
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
    return info


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
    info = _usable(path, missing_ok=False)
    assert info is not None
    current = stat.S_IMODE(info.st_mode)
    if not created and others_who_write(info.st_mode, info.st_gid, group_root_is_root=False) is not None:
        raise _untrusted(
            path, trust_problem(info.st_mode, info.st_uid, os.geteuid(), parent=False, gid=info.st_gid) or ""
        )
    if created and current != mode:  # mkdir's mode is masked by the umask
        os.chmod(path, mode)
    if not created and current & 0o066:  # 0711 (PASSABLE_MODE) stays: nobody else may list it
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
    """Create the state root and the environment's directories; record its prefix for listings.
    Refuses (StateDirError) a state root that is not trusted, parents included (:func:`check_trusted`)."""
    check_trusted(state.root)
    root = Path(os.path.realpath(state.root))  # a symlinked root is checked (and used) where it leads
    statuses = tuple(ensure_dir(p) for p in (root, state.dir, state.backups, state.logs))
    if state.prefix is not None:
        text = os.fspath(state.prefix) + "\n"
        try:
            current: str | None = read_private_file(state.prefix_file, _PREFIX_MAX).decode(
                "utf-8", errors="surrogateescape"
            )
        except (OSError, StateDirError):
            current = None
        if current != text:
            try:
                atomic_write(state.prefix_file, text.encode("utf-8", "surrogateescape"))
            except OSError as exc:  # a full disk: the run has not begun
                from safeinstall.system.lock import filesystem_of  # here: --verify-only needs no lock

                where = filesystem_of(state.dir)
                raise StateDirError(
                    f"cannot write {state.prefix_file}: {exc.strerror or exc} (the filesystem at {where}); "
                    "nothing was changed",
                    hint=f"free some space on {where}, or set {STATE_DIR_VARIABLE} to another filesystem",
                ) from exc
    return statuses


def check_environment_dir(state: EnvironmentState) -> None:
    """For a dry-run: refuse as :func:`ensure_environment_dir` would, creating nothing (a directory that
    is there must be usable; one that is not must be creatable in its nearest existing parent)."""
    check_trusted(state.root)
    for path in (state.root, state.dir, state.backups, state.logs):
        if _usable(path, missing_ok=True) is None:
            parent = nearest_existing(path.parent)
            if not os.access(parent, os.W_OK | os.X_OK):
                raise StateDirError(
                    f"cannot create the state directory {path}: {parent} is not writable",
                    hint=f"check its permissions, or set {STATE_DIR_VARIABLE} to a writable directory",
                )
            return  # the ones below it are made with it


def nearest_existing(path: Path) -> Path:
    """``path`` (made absolute), or its nearest existing parent."""
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


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


def read_private_file(path: Path, max_bytes: int) -> bytes:
    """The bytes of a file safeinstall wrote in its state directory, checked before it is believed
    (:func:`safeinstall.system.safefs.read_trusted`: not a symlink, not a FIFO or device, owned by root
    or the caller, writable by nobody else, at most ``max_bytes``). FileNotFoundError when absent;
    StateDirError saying what is wrong otherwise."""
    try:
        return read_trusted(path, max_bytes)
    except UntrustedFile as exc:
        hint = (
            "safeinstall never writes one there; remove it"
            if exc.problem == "it is a symbolic link"
            else "safeinstall writes its state files itself, mode 0600; someone else put this one "
            "there: look at it, then remove it"
        )
        raise StateDirError(f"refusing to read {path}: {exc.problem}", hint=hint) from exc


def _read_prefix(path: Path) -> Path | None:
    try:
        text = read_private_file(path, _PREFIX_MAX).decode("utf-8", errors="surrogateescape").strip()
    except (OSError, StateDirError):
        return None
    return Path(text) if text and os.path.isabs(text) else None


def directory_problem(directory: Path) -> str | None:
    """Why an existing environment directory must not be used (see :func:`trust_problem`); None when it
    is fine or does not exist."""
    try:
        info = os.lstat(directory)
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"cannot inspect it: {exc.strerror or exc}"
    return trust_problem(info.st_mode, info.st_uid, os.geteuid(), parent=False, gid=info.st_gid)


def trusted_environment_state(root: Path, prefix: Path) -> EnvironmentState:
    """:func:`environment_state`, with the ``problem`` of its directory if it is not trusted."""
    state = environment_state(root, prefix)
    return replace(state, problem=directory_problem(state.dir))


def write_store(root: Path, prefix: Path, name: str, data: bytes) -> None:
    """Write ``data`` as the environment's store ``name`` in a trusted state directory made first (the
    writer of :func:`load_store`'s files). Raises StateDirError, OSError."""
    state = trusted_environment_state(root, prefix)
    ensure_environment_dir(state)
    atomic_write(state.dir / name, data)


def keep_store(
    root: Path, prefix: Path, name: str, limit: int, encode: Callable[[], bytes], what: str
) -> str | None:
    """Write the store ``name`` as :func:`write_store` does, best effort: a note (naming ``what``) when
    ``encode`` gives more than ``limit`` bytes or it could not be written, else None."""
    try:
        data = encode()
        if len(data) > limit:
            return f"{what} would be larger than {limit} bytes: not kept"
        write_store(root, prefix, name, data)
    except StateDirError as exc:
        return f"{what} was not kept: {exc.message}"
    except (OSError, ValueError, UnicodeError) as exc:
        return f"{what} was not kept ({exc})"
    return None


T = TypeVar("T")


def load_store(
    root: Path,
    prefix: Path,
    name: str,
    limit: int,
    parse: Callable[[bytes], T],
    empty: T,
    what: str,
    *,
    damaged: str | None = None,
    oversize: str | None = None,
    say_problem: bool = False,
) -> tuple[T | None, str | None]:
    """A kept store of ``prefix``'s state directory, read by :func:`read_private_file`, parsed by ``parse``:
    ``empty`` when absent, damaged (note ``damaged``) or only over ``limit`` (note ``oversize``); None and
    a note when not believed or unreadable; (None, None) for an untrusted directory unless ``say_problem``."""
    state = trusted_environment_state(root, prefix)
    path = state.dir / name
    try:
        check_trusted(root)
        if state.problem is not None:
            if not say_problem:
                return None, None
            raise StateDirError(f"its directory {state.dir}: {state.problem}")
        return parse(read_private_file(path, limit)), None
    except FileNotFoundError:
        return empty, None
    except StateDirError as exc:
        if oversize is not None and _only_too_large(path, limit):
            return empty, oversize
        return None, f"{what} was not used: {exc.message}"
    except (ValueError, RecursionError):
        return empty, damaged
    except OSError as exc:
        return None, f"{what} could not be read ({exc.strerror or exc})"


def store_part(raw: bytes, version: int, prefix: str, part: str, kind: type[T], **fields: str) -> T:
    """Pure: the ``part`` of a kept store's JSON document, of ``kind``, once the document is checked to
    be of ``version``, of the environment ``prefix`` and of each of ``fields`` (the boot). ValueError:
    damaged, another version's or another environment's (every store's reader begins so)."""
    import json  # only where a store is read: a check of nothing kept never loads it

    document = json.loads(raw)
    if not isinstance(document, dict) or document.get("version") != version:
        raise ValueError("not a store of this version")
    if document.get("prefix") != prefix or any(document.get(k) != v for k, v in fields.items()):
        raise ValueError("another environment's or another boot's")
    found = document.get(part)
    if not isinstance(found, kind):
        raise ValueError(f"no {part}")
    return found


def _only_too_large(path: Path, limit: int) -> bool:
    """``path`` is a regular file of this process's account, written by nobody else, only too large."""
    try:
        info = os.lstat(path)
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and only_caller_writes(info) and info.st_size > limit


def list_environment_dirs(root: Path) -> list[EnvironmentState]:
    """Every environment directory under the state root (for a global --status / --recover), by key. Refuses
    (StateDirError) an untrusted root; an environment directory that is not trusted is listed with its
    ``problem`` (and its prefix file is not read)."""
    check_trusted(root)
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
        problem = directory_problem(directory)
        prefix = _read_prefix(directory / PREFIX_FILE) if problem is None else None
        found.append(EnvironmentState(root, directory, prefix, problem))
    return found


#: Symbolic links followed on the way to an output file's directory (the kernel's own limit).
_OUTPUT_LINK_HOPS = 40


@dataclass(frozen=True, slots=True)
class OutputPath:
    """Where an output file the CLI writes as root (``--metrics-file``, ``--save-patch``) goes:
    ``target`` (its directory's real path, then its name) or why it must not be written."""

    target: Path | None
    problem: str | None


def output_path(path: Path, euid: int, *, new: bool = False) -> OutputPath:
    """The one rule for every file the CLI writes where its user says: each directory from ``/`` owned by root
    or ``euid`` and writable by nobody else, each symlink on the way root's or ``euid``'s, the file a regular
    one (``new``: absent). Looks at the disk, writes nothing."""
    if not path.name or path.name in (".", ".."):
        return OutputPath(None, "it names no file")
    given = os.path.join(os.getcwd(), str(path.parent))
    pending = [part for part in reversed(given.split("/")) if part not in ("", ".")]
    current, hops = Path("/"), 0
    info = os.lstat(current)
    problem = trust_problem(info.st_mode, info.st_uid, euid, parent=True, gid=info.st_gid)
    if problem is not None:
        return OutputPath(None, f"/: {problem}")
    while pending:
        part = pending.pop()
        if part == "..":
            current = current.parent  # current is real: no link in it
            continue
        candidate = current / part
        try:
            info = os.lstat(candidate)
        except OSError as exc:
            return OutputPath(None, f"cannot inspect {candidate}: {exc.strerror or exc}")
        if stat.S_ISLNK(info.st_mode):
            hops += 1
            if info.st_uid not in (0, euid):
                return OutputPath(None, f"{candidate} is a symbolic link owned by uid {info.st_uid}")
            if hops > _OUTPUT_LINK_HOPS:
                return OutputPath(None, f"more than {_OUTPUT_LINK_HOPS} symbolic links on the way")
            link = os.readlink(candidate)
            pending.extend(part for part in reversed(link.split("/")) if part not in ("", "."))
            current = Path("/") if link.startswith("/") else current
            continue
        problem = trust_problem(info.st_mode, info.st_uid, euid, parent=True, gid=info.st_gid)
        if problem is not None:
            return OutputPath(None, f"{candidate}: {problem}")
        current = candidate
    target = current / path.name
    try:
        info = os.lstat(target)
    except FileNotFoundError:
        return OutputPath(target, None)
    except OSError as exc:
        return OutputPath(None, f"cannot inspect it: {exc.strerror or exc}")
    if new:
        return OutputPath(None, "it exists")
    if stat.S_ISLNK(info.st_mode):
        return OutputPath(None, "it is a symbolic link")
    if not stat.S_ISREG(info.st_mode):
        return OutputPath(None, f"it is {describe(info.st_mode)}, not a regular file")
    return OutputPath(target, None)


def new_output_file(path: Path, option: str) -> Path:
    """Where ``option`` (``--save-patch``) writes a new file (:func:`output_path` with ``new``); UsageError
    (exit 2) if it exists or must not be written. Called before the command does its work."""
    checked = output_path(path, os.geteuid(), new=True)
    if checked.target is not None:
        return checked.target
    if checked.problem == "it exists":
        raise UsageError(f"{path} exists: {option} does not overwrite a file", hint=_ANOTHER_NAME)
    raise UsageError(
        f"refusing to write {path} ({option}): {checked.problem}",
        hint="another user could redirect what root writes there; give a path in a directory owned by "
        "root (or you) and writable by nobody else, reached through no other user's symbolic link",
    )


_ANOTHER_NAME = "remove it first, or give another file name"


def write_new_output(path: Path, text: str, option: str) -> None:
    """Create ``path`` (checked again, :func:`new_output_file`) with ``text``: ``O_EXCL|O_NOFOLLOW``,
    never an existing file nor a link written over. UsageError (exit 2) if it cannot be."""
    target = new_output_file(path, option)
    try:
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
    except FileExistsError:
        raise UsageError(f"{path} exists: {option} does not overwrite a file", hint=_ANOTHER_NAME) from None
    except OSError as exc:
        raise UsageError(f"could not write {path} ({option}): {exc.strerror or exc}") from exc
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(text)
