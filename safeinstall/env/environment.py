"""The target Python environment: which interpreter, and where its files live.

The interpreter is asked in isolated mode without ``site`` and with an empty environment, as the
environment's account when it belongs to another (:class:`Account`)."""

from __future__ import annotations

import ast
import contextlib
import errno
import operator
import os
import pwd
import re
import shutil
import stat
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from safeinstall.env.containment import is_within
from safeinstall.env.hashing import cycle_collection_paused
from safeinstall.errors import InterpreterError
from safeinstall.system import children
from safeinstall.system.fields import optional_text
from safeinstall.system.safefs import (
    ACL_XATTR,
    acl_writers,
    group_may_write,
    others_may_write,
    others_who_write,
    read_small,
    read_small_unless,
)

_PROBE = r"""
import os, sys
# what site.venv() does (site is not imported: -S): a pyvenv.cfg beside or above the executable's
# directory makes that directory's parent the prefix. Before sysconfig is imported, which reads it.
exe_dir = os.path.dirname(os.path.abspath(sys.executable))
include_system = True  # a system interpreter: site adds its own site directories
for conf in (os.path.join(exe_dir, "pyvenv.cfg"), os.path.join(os.path.dirname(exe_dir), "pyvenv.cfg")):
    if os.path.isfile(conf):
        sys.prefix = sys.exec_prefix = os.path.dirname(exe_dir)
        with open(conf, encoding="utf-8", errors="replace") as handle:
            pairs = [line.split("=", 1) for line in handle.read(65536).splitlines() if "=" in line]
        settings = {k.strip().lower(): v.strip().lower() for k, v in pairs}
        include_system = settings.get("include-system-site-packages") == "true"
        break
import site, sysconfig  # site is imported, not run (-S): getsitepackages only computes paths
paths = sysconfig.get_paths()
base_sites = site.getsitepackages([sys.base_prefix]) if include_system else []
# ascii(): a Python literal in ASCII (undecodable path bytes as \udcXX escapes), read back with
# ast.literal_eval; json would cost every command 0.01 s of the probe's 0.03 s to import
print(ascii({
    "executable": sys.executable,
    "prefix": sys.prefix,
    "base_prefix": sys.base_prefix,
    "purelib": paths["purelib"],
    "platlib": paths["platlib"],
    "base_site_dirs": base_sites,
    "scripts": paths["scripts"],
    "data": paths["data"],
    "stdlib": paths["stdlib"],
    "version": [sys.version_info[0], sys.version_info[1], sys.version_info[2]],
    "implementation": sys.implementation.name,
    "soabi": sysconfig.get_config_var("SOABI"),
    "platform": sysconfig.get_platform(),
}))
"""


@dataclass(frozen=True, slots=True)
class Account:
    """The account (not root's) that owns an environment: whatever runs the environment's code (its
    interpreter, uv) runs as this uid and gid only, with no supplementary groups."""

    uid: int
    gid: int
    home: str  # from the password database; "/" for a uid it does not know

    @property
    def ids(self) -> tuple[int, int]:
        return self.uid, self.gid


@dataclass(frozen=True, slots=True)
class Environment:
    python: Path  # the interpreter as given/resolved (symlink kept: it is how the venv is named)
    executable: Path
    prefix: Path
    base_prefix: Path
    purelib: Path
    platlib: Path
    scripts: Path
    data: Path
    version: tuple[int, int, int]
    implementation: str
    soabi: str | None
    platform: str
    account: Account | None = None  # who owns the environment (not root): its probe and uv run as it
    probed_as: int | None = None  # the uid the probe was started as (never what it printed)
    #: the base installation's site directories that site adds too (a system interpreter's own, or a
    #: venv's with include-system-site-packages)
    base_site_dirs: tuple[Path, ...] = ()
    #: purelib and platlib as the interpreter spelled them (before symlinks were resolved)
    given_site_dirs: tuple[Path, ...] = ()
    #: the standard library's directory (a system interpreter's PEP 668 ``EXTERNALLY-MANAGED`` marker)
    stdlib: Path | None = None

    @property
    def owner(self) -> int | None:
        """The uid that owns the environment when that is not root (nor the caller)."""
        return None if self.account is None else self.account.uid

    @property
    def owner_note(self) -> str | None:
        """Said to the user when the environment belongs to another account."""
        if self.owner is None:
            return None
        return (
            f"the environment {self.prefix} belongs to uid {self.owner}: its interpreter was asked for its "
            f"paths as uid {self.probed_as}, never as root, and without site (no .pth file runs); "
            f"uv runs as uid {self.owner} too"
        )

    @property
    def site_dirs(self) -> tuple[Path, ...]:
        return (self.purelib,) if self.purelib == self.platlib else (self.purelib, self.platlib)

    @property
    def run_site_dirs(self) -> tuple[Path, ...]:
        """Every site directory ``site`` adds when the interpreter runs with it (as uv runs it)."""
        return tuple(dict.fromkeys((*self.site_dirs, *self.base_site_dirs)))

    @property
    def is_venv(self) -> bool:
        return self.prefix != self.base_prefix


def interpreter_in_prefix(env: Environment) -> Path:
    """The interpreter as ``PREFIX/bin/NAME`` when that is the same file (what a journal records, so
    that --recover can tell it is the environment's own); else as it was given."""
    own = env.prefix / "bin" / env.python.name
    try:
        return own if os.path.samefile(own, env.python) else env.python
    except OSError:
        return env.python


def resolve_python(given: str | None, environ: Mapping[str, str]) -> Path:
    """Find the interpreter the way uv does: ``--python``, then ``VIRTUAL_ENV``, then ``python3``.

    ``given`` may be an interpreter or a virtual environment directory. An InterpreterError when it
    cannot be reached (a caller who is not root, below a directory closed to it: no traceback)."""
    try:
        return _resolve_python(given, environ)
    except PermissionError as exc:
        raise InterpreterError(
            f"cannot reach {exc.filename or given}: permission denied",
            hint="run as root (sudo), or as a user who can run that interpreter",
        ) from exc


def _resolve_python(given: str | None, environ: Mapping[str, str]) -> Path:
    if given:
        candidate = Path(given).expanduser()
        if candidate.is_dir():
            interpreter = candidate / "bin" / "python"
            if not interpreter.exists():
                raise InterpreterError(
                    f"{candidate} is a directory but holds no bin/python",
                    hint="pass a virtual environment directory or the path of a python executable",
                )
            return interpreter.absolute()
        if candidate.exists():
            return candidate.absolute()
        found = shutil.which(given, path=environ.get("PATH"))
        if found:
            return Path(found)
        raise InterpreterError(
            f"no such interpreter: {given}",
            hint="pass --python with a python executable or a virtual environment directory",
        )
    venv = environ.get("VIRTUAL_ENV")
    if venv:
        interpreter = Path(venv) / "bin" / "python"
        if interpreter.exists():
            return interpreter
    found = shutil.which("python3", path=environ.get("PATH"))
    if found:
        return Path(found)
    raise InterpreterError(
        "no python interpreter found (no --python, no VIRTUAL_ENV, no python3 on PATH)",
        hint="pass --python PY",
    )


def _account(uid: int, gid: int) -> Account:
    try:
        entry = pwd.getpwuid(uid)
    except KeyError:
        return Account(uid, gid, "/")
    return Account(uid, entry.pw_gid, entry.pw_dir or "/")


class Walked(dict[str, os.stat_result]):
    """What the walk of what ``site`` may import saw (:func:`steering`): the ``lstat`` of each file and
    directory it looked at, by path, and in ``listed`` each directory's entries as it listed them (name,
    whether a real directory): the verification's search for extras takes those listings."""

    def __init__(self) -> None:
        super().__init__()
        self.listed: dict[str, list[tuple[str, bool]]] = {}


class _Control:
    """Who besides root (and ``euid``) controls a set of paths: by uid, the first path that shows it;
    and what no single account can be held to (written by every user or by a group other than root's,
    through mode bits or an access ACL)."""

    def __init__(self, euid: int) -> None:
        self.euid = euid
        self.owners: dict[int, str] = {}
        self.gids: dict[int, int] = {}  # the group of the first path each account owns
        self.problems: list[str] = []
        #: when given: the ``lstat`` of each file the walk of what ``site`` may import looked at, and of
        #: each directory looked at, by path (:func:`steering`'s ``walked``)
        self.walked: dict[str, os.stat_result] | None = None
        #: each directory :meth:`look_up` looked at above a path, and whether it exists: looked at once
        #: (thousands of ``.pth`` lines under one site directory share theirs; the attacker review)
        self.above: dict[str, bool] = {}

    def look(self, path: Path | str, what: str, *, ancestor: bool = False) -> bool:
        """One path (not followed); False when it does not exist. ``ancestor``: a directory above what
        matters, where a sticky bit (only an entry's owner may rename it) makes others' write harmless."""
        try:
            info = os.lstat(path)
        except OSError:
            return False
        if info.st_uid not in (0, self.euid) and info.st_uid not in self.owners:
            self.owners[info.st_uid] = f"{path} ({what})"
            self.gids[info.st_uid] = info.st_gid
        mode = info.st_mode
        if stat.S_ISLNK(mode):
            return True
        if self.walked is not None and stat.S_ISDIR(mode):  # the proof's directories too
            self.walked[os.fspath(path)] = info
        sticky = ancestor and bool(mode & stat.S_ISVTX)
        raw = b""
        # with an access ACL the group bits are its mask, which every named user's and group's write
        # passes through: without them no ACL entry can write, and the xattr need not be read (a walk
        # of 68k files of vLLM's site directory looks at each)
        if group_may_write(mode):
            with contextlib.suppress(OSError):
                raw = os.getxattr(path, ACL_XATTR, follow_symlinks=False)
        users, groups = acl_writers(raw)
        for uid in sorted(users - {0, self.euid} - set(self.owners)):
            self.owners[uid] = f"{path} ({what}, by its ACL)"
            self.gids[uid] = info.st_gid
        who = None if sticky else others_who_write(mode, info.st_gid, groups)
        if who is not None:
            self.problems.append(f"{path} ({what}) may be written by {who}")
        return True

    def look_up(self, path: Path, what: str) -> None:
        """``path`` and every directory above it; a symlink is followed (its target looked at too), and
        for a path that does not exist yet, the nearest one that does must not let others create it."""
        seen: set[str] = set()
        todo = [Path(os.path.abspath(path))]
        while todo:
            current = todo.pop()
            if str(current) in seen or len(seen) > 64:
                continue
            seen.add(str(current))
            exists = self.look(current, what)
            # the nearest directory above it that exists; each is known to, and every one above it
            # looked at, once its parent is (they are looked at from / down)
            nearest = current.parent if self.above.get(str(current.parent)) else None
            for directory in () if nearest is not None else reversed(current.parents):  # from / down
                key = str(directory)
                if key not in self.above:
                    self.above[key] = self.look(directory, f"a directory above {what}", ancestor=True)
                if not self.above[key]:
                    break  # nothing below a directory that does not exist does
                nearest = directory
            if not exists and nearest is not None:
                self.look(nearest, f"where {current} ({what}) could be made")  # sticky does not help
            elif os.path.islink(current):
                todo.append(Path(os.path.realpath(current)))

    def one_account(self, refusing: str, hint: str, gid: int | None = None) -> Account | None:
        """The one account that controls what was looked at (None: root, or the caller), with ``gid``
        when given, else the group of the first path it owns; InterpreterError (``refusing ...``) when
        two accounts do, or anything may be written by every user or another group."""
        problems = list(self.problems)
        if len(self.owners) > 1:
            listed = "; ".join(f"uid {uid} owns {where}" for uid, where in sorted(self.owners.items()))
            problems.append(f"more than one account may change what it runs: {listed}")
        if problems:
            raise InterpreterError(f"refusing {refusing}: " + "; ".join(problems), hint=hint)
        if not self.owners:
            return None
        ((uid, _),) = self.owners.items()
        return _account(uid, self.gids[uid] if gid is None else gid)


#: What :func:`_walk_loaded` looks at below the modules ``site`` may load: at most this many entries in
#: all, this many directories deep; more is refused (who could change it cannot be told).
LOADED_ENTRIES = 1_000_000
LOADED_DEPTH = 64

#: What the ``.pth`` files of one site directory are read for: each file at most PTH_FILE bytes (a
#: file linked twice read once), PTH_BYTES and PTH_LINES lines (not comments, not empty) in all, each
#: path at most LOADED_DEPTH directories deep; more is refused (what they add cannot be told). Each
#: line was a path looked up with every directory above it: one 1 MiB file, 30 s; four links to it,
#: 165 s (the attacker review). A path of PATH_MAX bytes or more, or with a NUL, ``site`` never adds.
PTH_FILE = 1 << 20
PTH_BYTES = 16 << 20
PTH_LINES = 4096
_PATH_MAX = 4096

#: Names ``site`` imports itself, after the ``.pth`` files: a module or a package in a site directory.
_SITE_IMPORTS = frozenset({"sitecustomize", "usercustomize"})

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


@dataclass(frozen=True, slots=True)
class _PthLines:
    """What the ``.pth`` files of a site directory make ``site`` do: the directories they add to
    ``sys.path``, and every name their import lines could import."""

    paths: tuple[Path, ...]
    names: frozenset[str]
    problem: str | None = None  # past a bound: what they add cannot be told (refused)


def _pth_lines(site: Path) -> _PthLines:
    """Pure-ish: the ``.pth`` files of ``site`` as ``site.addpackage`` reads them, each path once,
    within the bounds above (``problem`` past one). An import line is code: every identifier in it (an
    imported name, a string such as ``__import__('_distutils_hack')``) counts as a module it could
    load, a superset of what it imports by name."""
    paths: dict[Path, None] = {}
    names: set[str] = set()
    read: set[tuple[int, int]] = set()  # (device, inode) of each file read: a link to one is not again

    def known(info: os.stat_result) -> bool:
        key = (info.st_dev, info.st_ino)
        fresh = key not in read
        read.add(key)
        return not fresh

    try:
        found = sorted(n for n in os.listdir(site) if n.endswith(".pth"))
    except OSError:
        return _PthLines((), frozenset())
    size = lines = 0
    for name in found:
        try:  # the account may have made it a FIFO or a huge file: never waited on, bounded
            data, _info = read_small_unless(site / name, PTH_FILE, None, known)
        except OSError as exc:
            if exc.errno != errno.EFBIG:
                continue  # a FIFO, a dangling link: site reads nothing from it either
            return _PthLines((), frozenset(), f"{site / name} is larger than {PTH_FILE} bytes")
        if data is None:
            continue
        size += len(data)
        if size > PTH_BYTES:
            return _PthLines((), frozenset(), f"the .pth files in {site} hold more than {PTH_BYTES} bytes")
        for line in data.decode("utf-8", "replace").splitlines():
            line = line.rstrip()
            if not line or line.startswith("#"):
                continue
            lines += 1
            if lines > PTH_LINES:
                return _PthLines(
                    (), frozenset(), f"the .pth files in {site} hold more than {PTH_LINES} lines"
                )
            if line.startswith(("import ", "import\t")):
                names.update(_NAME.findall(line))
                continue
            added = os.path.normpath(os.path.join(site, line))
            if "\0" in added or len(os.fsencode(added)) >= _PATH_MAX:
                continue  # no such path can exist: site never adds it
            if added.count("/") > LOADED_DEPTH:
                return _PthLines(
                    (),
                    frozenset(),
                    f"{added} (in {site / name}) is more than {LOADED_DEPTH} directories deep",
                )
            paths[Path(added)] = None
    return _PthLines(tuple(paths), frozenset(names))


def _loaded_entries(directory: Path, names: frozenset[str]) -> list[Path]:
    """The entries of ``directory`` (a ``sys.path`` directory) that importing any of ``names`` may load:
    ``NAME`` (a package, a namespace directory), ``NAME.py``, ``NAME.*.so``, ``NAME.pyc``, and in its
    ``__pycache__`` ``NAME.*.pyc``."""
    loaded: list[Path] = []
    for where in (directory, directory / "__pycache__"):
        try:
            entries = sorted(os.listdir(where))
        except OSError:
            continue
        loaded.extend(where / entry for entry in entries if entry.partition(".")[0] in names)
    return loaded


def _walk_loaded(control: _Control, top: Path, what: str, budget: list[int]) -> None:
    """Look at ``top`` and every entry of its tree, never through a symlink (a link out of it is a
    problem); ``budget`` and ``LOADED_DEPTH`` bound it."""
    if budget[0] < 0:  # said once, by the walk that ran out
        return
    real_top = os.path.realpath(top)
    walked, euids = control.walked, (0, control.euid)
    todo: list[tuple[str, int]] = [(real_top, 0)]
    if os.path.islink(top):
        control.look_up(top, what)
    if not os.path.isdir(real_top):
        control.look(real_top, what)
        return
    while todo:
        directory, depth = todo.pop()
        control.look(directory, what)
        if depth > LOADED_DEPTH:
            control.problems.append(f"{directory} ({what}) is more than {LOADED_DEPTH} directories deep")
            return
        # In the listing's order, only sorting what can be found (a symlink, a file _may_say looks at)
        # and the directories below: what is found first, and said, is as in name order (68k entries
        # of vLLM's site directory, sorted and made paths each, cost this walk a third of its time).
        said: list[os.DirEntry[str]] = []
        below: list[str] = []
        names: list[tuple[str, bool]] = []  # the listing, for the search for extras (a Walked's)
        try:  # listed through a descriptor of the very directory looked at, never through a link
            fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            same = _same_directory(os.fstat(fd), walked.get(directory) if walked is not None else None)
            with os.scandir(fd) as listing:
                count = 0
                for entry in listing:
                    count += 1
                    if entry.is_symlink():
                        said.append(entry)
                        names.append((entry.name, False))
                    elif entry.is_dir(follow_symlinks=False):
                        below.append(f"{directory}/{entry.name}")
                        names.append((entry.name, True))
                    else:
                        names.append((entry.name, False))
                        if _may_say(control, entry, f"{directory}/{entry.name}", walked, euids):
                            said.append(entry)
        except OSError:
            continue
        finally:
            os.close(fd)
        if isinstance(walked, Walked) and same:
            walked.listed[directory] = names
        budget[0] -= count
        if budget[0] < 0:
            control.problems.append(
                f"more than {LOADED_ENTRIES} files below {top} ({what}): who may change them cannot be told"
            )
            return
        for entry in sorted(said, key=operator.attrgetter("name")) if len(said) > 1 else said:
            if entry.is_symlink():
                path = Path(directory, entry.name)
                control.look_up(path, what)
                target = os.path.realpath(path)
                if os.path.isdir(target) and not is_within(target, real_top):
                    control.problems.append(f"{path} ({what}) links to the directory {target}, outside it")
            else:
                control.look(f"{directory}/{entry.name}", what)
        todo.extend((path, depth + 1) for path in sorted(below))


def _same_directory(opened: os.stat_result, looked: os.stat_result | None) -> bool:
    """Pure: whether a directory opened is the one looked at a moment before (its listing may stand for
    it in the search for extras: :func:`safeinstall.env.verify.walk_listed`)."""
    return looked is not None and stat.S_ISDIR(looked.st_mode) and identity(opened) == identity(looked)


def identity(info: os.stat_result) -> tuple[int, int, int, int]:
    """Pure: what moves when a directory is swapped, renamed or its entries change: device, inode,
    modification and change times."""
    return (info.st_dev, info.st_ino, info.st_mtime_ns, info.st_ctime_ns)


def _may_say(
    control: _Control,
    entry: os.DirEntry[str],
    path: str,
    walked: dict[str, os.stat_result] | None,
    euids: tuple[int, int],
) -> bool:
    """Whether :meth:`_Control.look` could find anything of a file: not when root or ``euid`` (``euids``)
    owns it and neither its group nor others may write it (no ACL entry can either: the group bits are
    the ACL's mask). The walk of a whole site directory (68k files on vLLM) looks at only those;
    ``walked``: its ``lstat`` kept, by ``path``."""
    try:
        info = entry.stat(follow_symlinks=False)
    except OSError:
        return False
    if walked is not None:
        walked[path] = info
    return info.st_uid not in euids or others_may_write(info.st_mode)


def who_else_controls(path: Path, euid: int) -> str | None:
    """Who besides root and ``euid`` could change ``path`` (it, its parents, a link's target, or who could
    create it): the first finding, or None. For what a unit names that the smoke check would run."""
    found = who_else_controls_tree(path, euid, tree=False)
    return None if found is None else found[1]


def who_else_controls_tree(path: Path, euid: int, tree: bool = True) -> tuple[int | None, str] | None:
    """Who besides root and ``euid`` could change what may be loaded from ``path``: the path, its parents
    and (``tree``) its whole tree, never through a symlink. None when nobody; else the account (None: not
    one) and the first finding. For what a unit names that the smoke check would load from."""
    control = _Control(euid)
    control.look_up(path, "it")
    if tree and os.path.isdir(path):
        _walk_loaded(control, path, "in it", [LOADED_ENTRIES])
    if control.owners:
        uid, where = next(iter(control.owners.items()))
        return uid, f"{where} belongs to uid {uid}"
    return (None, control.problems[0]) if control.problems else None


def user_site_enabled(env: Environment) -> bool:
    """Whether ``env``'s interpreter adds the user's site directory at all: not in a venv that does not
    include the system's site-packages (``site`` turns it off there)."""
    values = _pyvenv_values(env.prefix / "pyvenv.cfg", "include-system-site-packages")
    if values is None:
        return True  # no venv: a system interpreter adds it
    return bool(values) and values[0].lower() == "true"


def _pyvenv_values(config: Path, wanted: str) -> list[str] | None:
    """The values of ``wanted`` in a ``pyvenv.cfg``, in order; None when it cannot be read."""
    try:
        text = read_small(config, 1 << 16).decode("utf-8", "replace")
    except OSError:
        return None
    return [
        v.strip()
        for k, _, v in (line.partition("=") for line in text.splitlines())
        if k.strip().lower() == wanted
    ]


def steering(env: Environment, euid: int, walked: dict[str, os.stat_result] | None = None) -> _Control:
    """Who besides root (and ``euid``) can change what the environment runs once ``site`` runs (as uv
    runs it): the prefix and its parents, the site directories, the ``.pth`` targets and, when ``site``
    imports, every tree it may import from (see :class:`_Control`). ``walked``: filled with each ``lstat``
    taken, for :func:`safeinstall.env.unchanged.prover`."""
    control = _Control(euid)
    control.walked = walked
    control.look_up(env.prefix, "the prefix")
    for given in env.given_site_dirs:  # a symlinked site-packages: the link and the directories above it
        control.look_up(given, "a site directory as the interpreter names it")
    search: list[Path] = []
    names = set(_SITE_IMPORTS)
    for site in env.run_site_dirs:
        control.look_up(site, "a site directory")
        search.append(site)
        try:
            entries = sorted(os.listdir(site))
        except OSError:
            continue
        for name in entries:
            entry = site / name
            control.look(entry, "in a site directory")
            if os.path.islink(entry):
                control.look_up(entry, "linked from a site directory")
        lines = _pth_lines(site)
        if lines.problem is not None:
            control.problems.append(f"{lines.problem}: what site adds from them cannot be told")
        names.update(lines.names)
        for added in lines.paths:
            control.look_up(added, "added by a .pth file")
            search.append(added)
    # What a loaded module imports in turn (``import foo`` whose ``foo`` imports ``bar``), or a name a
    # line builds at run time, cannot be told from the text (the attacker review): once ``site`` imports
    # anything at start-up, every directory it may import from is walked whole.
    directories = _distinct_directories(search)
    if names - _SITE_IMPORTS or any(_loaded_entries(d, frozenset(names)) for d in directories):
        budget = [LOADED_ENTRIES]
        # the cycle collector paused: the walk makes an lstat and a path of each entry (68k on vLLM),
        # no cycle, and their collections walked every object again; the budget bounds it
        with cycle_collection_paused(frozen=True):
            for directory in directories:
                _walk_loaded(control, directory, "what site may import", budget)
    return control


def _distinct_directories(paths: list[Path]) -> list[Path]:
    """Each directory once, by what it resolves to (device, inode): ``.pth`` lines may name one through
    thousands of links, and each was listed again (4,000 links to 20k files: 60 s; the attacker review,
    session 5); a path that cannot be resolved is kept as it is."""
    seen: set[tuple[int, int]] = set()
    kept: list[Path] = []
    for path in dict.fromkeys(paths):
        try:
            info = os.stat(path)
        except (OSError, ValueError):
            kept.append(path)
            continue
        if (info.st_dev, info.st_ino) not in seen:
            seen.add((info.st_dev, info.st_ino))
            kept.append(path)
    return kept


def _root_controlled(site: Path) -> bool:
    """Is ``site`` (the directories above it, and its entries) controlled by root alone?"""
    control = _Control(0)
    control.look_up(site, "a base site directory")
    try:
        entries = sorted(os.listdir(site))
    except OSError:
        entries = []
    for name in entries:
        control.look(site / name, "in a base site directory")
    return not control.owners and not control.problems


def distribution_sites(env: Environment) -> tuple[Path, ...]:
    """Every site directory whose distributions the interpreter imports, in ``sys.path`` order: its own,
    then the base's inside the base prefix. For another account's environment a base directory counts
    only when root alone controls it (the account could write its RECORDs)."""
    base = [
        site
        for site in env.base_site_dirs
        if site not in env.site_dirs
        and is_within(os.fspath(site), os.fspath(env.base_prefix))
        and (env.account is None or _root_controlled(site))
    ]
    return (*env.site_dirs, *dict.fromkeys(base))


def before_the_probe(python: Path, euid: int) -> _Control:
    """Who controls what the interpreter runs before ``site`` (the probe runs it with ``-I -S``): each
    link on the way from ``python`` to its real binary, and the directories above each; the environment
    and the directories above it; its ``pyvenv.cfg`` and the base installation it names (``home``),
    whose standard library the interpreter loads."""
    control = _Control(euid)
    hop, hops = Path(os.path.abspath(python)), 0
    while True:
        control.look_up(hop, "the interpreter")
        if not os.path.islink(hop) or hops > 40:
            break
        hop = Path(os.path.normpath(os.path.join(hop.parent, os.readlink(hop))))
        hops += 1
    real = Path(os.path.realpath(python))
    venv = python.parent.parent
    control.look_up(venv, "the environment")
    bases = [real.parent.parent]
    config = venv / "pyvenv.cfg"
    homes = _pyvenv_values(config, "home") if control.look(config, "its pyvenv.cfg") else None
    for home in map(Path, filter(None, homes or ())):
        control.look_up(home, "its base interpreter's directory")
        bases.append(home.parent)
    for base in bases:
        for lib in sorted(base.glob("lib*/python3*")):
            control.look_up(lib, "a standard library")
    return control


def _held_to_one_account(env: Environment, walked: dict[str, os.stat_result] | None = None) -> Environment:
    """As root: the environment as one account may steer it (uv then runs as that account), or refused
    when others may write what site runs or may swap the environment away (see :func:`steering`)."""
    control = steering(env, os.geteuid(), walked)
    if env.account is not None:
        control.owners.setdefault(env.account.uid, "its interpreter")
    account = control.one_account(
        f"the environment {env.prefix}",
        hint="as root, safeinstall acts only on an environment that root or one account controls "
        "(the environment, its site-packages, what site runs and the directories above it); "
        "chmod go-w, or chown to that account",
        gid=os.lstat(env.prefix).st_gid,
    )
    return env if env.account is not None else replace(env, account=account)


def environment_owner(python: Path) -> Account | None:
    """The account that controls what ``python`` runs before ``site`` when that is neither root nor the
    caller (:func:`before_the_probe`): the probe then runs as it. Refused (InterpreterError) when two
    accounts do, or when every user or another group may write any of it."""
    return before_the_probe(python, os.geteuid()).one_account(
        f"the interpreter {python}",
        hint="as root, safeinstall runs an interpreter only when root or one account controls it "
        "(the links to it, its installation, the environment and the directories above them); "
        "chmod go-w, or chown to that account",
    )


def _own_prefix(python: Path) -> tuple[Path, str]:
    """The prefix ``python`` belongs to, and why: a venv's directory (its ``pyvenv.cfg`` beside or above the
    interpreter, as site finds it), else the directory above the real binary's ``bin/`` (``/usr/bin/python3``
    -> ``/usr/bin/python3.11`` -> ``/usr``; conda, pyenv and uv's ``PREFIX/bin/python3.11``)."""
    venv = python.parent.parent
    if (python.parent / "pyvenv.cfg").is_file() or (venv / "pyvenv.cfg").is_file():
        return Path(os.path.realpath(venv)), f"its pyvenv.cfg is in {venv}"
    real = Path(os.path.realpath(python))
    return real.parent.parent, f"its interpreter {real} is in {real.parent.parent}"


def _foreign_owner(paths: tuple[Path, ...], owner: int) -> tuple[Path, int] | None:
    """The first of ``paths`` owned by neither ``owner`` nor root, with its uid (a missing one is skipped)."""
    for path in paths:
        try:
            uid = os.stat(path).st_uid
        except OSError:
            continue
        if uid not in (0, owner):
            return path, uid
    return None


def _answer_problem(python: Path, env: Environment) -> str | None:
    """Why an interpreter's answer cannot be its own, or None: its prefix is not the one its location makes
    it (a venv's directory, or the directory above its real binary's ``bin/``), its site-packages, scripts
    or data directory lie outside that prefix, or (asked as the environment's owner) one of them belongs
    to an account that is neither that owner nor root."""
    expected, why = _own_prefix(python)
    if env.prefix != expected:
        return f"it reports the prefix {env.prefix}, but {why}"
    paths = (env.purelib, env.platlib, env.scripts, env.data)
    outside = [str(path) for path in paths if not is_within(os.fspath(path), os.fspath(env.prefix))]
    if outside:
        return f"it reports directories outside its prefix {env.prefix}: {', '.join(outside)}"
    if env.owner is None:
        return None
    foreign = _foreign_owner((env.prefix, *paths), env.owner)
    if foreign is None:
        return None
    path, uid = foreign
    return f"it reports {path}, owned by uid {uid}: neither its owner (uid {env.owner}) nor root"


#: The probe's answer is a few hundred bytes; beyond this the interpreter is stopped (what its owner
#: makes it print is parsed by root: 1 MiB of nested literals would cost about 500 MB).
ANSWER_LIMIT = 64 << 10


def _version(value: object) -> tuple[int, int, int]:
    """Pure: ``[major, minor, micro]`` as the probe reports it; ValueError for anything else (a float
    such as ``1e999`` is not a version part)."""
    if not isinstance(value, list | tuple) or len(value) != 3:
        raise ValueError(f"version {value!r}")
    parts = tuple(part for part in value if type(part) is int and 0 <= part < 10_000)
    if len(parts) != 3:
        raise ValueError(f"version {value!r}")
    return parts[0], parts[1], parts[2]


def _answer(text: str) -> dict[str, Any]:
    """Pure: the probe's answer (a dict literal), or ValueError. Only literals are read (nothing is
    run); the interpreter (maybe the environment owner's) was stopped past ``ANSWER_LIMIT`` bytes."""
    try:
        info = ast.literal_eval(text.strip())
    except (SyntaxError, MemoryError, RecursionError) as exc:  # nested beyond the parser's limits
        raise ValueError(str(exc)) from exc
    if not isinstance(info, dict):
        raise ValueError("not a dict")
    return info


#: lines of the probe long enough that a program echoing its arguments is recognised by them
_PROBE_LINES = tuple(line.strip() for line in _PROBE.splitlines() if len(line.strip()) >= 16)


def probe_failure(python: Path, returncode: int, stderr: str) -> str:
    """Pure: what a probe that exited ``returncode`` says. A program that is not Python (``/bin/ls``)
    complains about its arguments, the probe's source among them: that is said as "not a Python
    interpreter", never with the probe's source; a Python that failed shows the end of its error."""
    text = stderr.strip()
    if not text or any(line in text for line in _PROBE_LINES):
        why = f"it did not run the probe given with -c; exit {returncode}"
        return f"{python} is not a Python interpreter ({why})"
    return f"{python} failed to report its paths: {text[-400:]}"


def inspect_environment(
    python: Path, timeout: float = 30.0, walked: dict[str, os.stat_result] | None = None
) -> Environment:
    """Ask ``python`` (isolated, no site, empty environment) for its installation paths; as root, an
    environment that another account owns is asked as that account. ``walked``: see :func:`steering`."""
    python = Path(os.path.abspath(python))  # children run in /
    owner = environment_owner(python) if os.geteuid() == 0 else None
    try:
        proc = children.run(
            [str(python), "-I", "-S", "-c", _PROBE],
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
            timeout=timeout,
            as_user=None if owner is None else owner.ids,
            limit=ANSWER_LIMIT,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InterpreterError(
            f"could not run {python}" + (f" as uid {owner.uid} (its owner)" if owner else "") + f": {exc}",
            hint="check that --python names a working interpreter",
        ) from exc
    if proc.returncode != 0:
        raise InterpreterError(
            probe_failure(python, proc.returncode, proc.stderr)
            + (f" (run as uid {owner.uid}, its owner)" if owner else ""),
            hint="check that --python names a working Python 3 interpreter",
        )
    try:
        info = _answer(proc.stdout)
        major, minor, micro = _version(info["version"])
        env = Environment(
            python=python,
            executable=Path(info["executable"]),
            prefix=Path(os.path.realpath(info["prefix"])),
            base_prefix=Path(os.path.realpath(info["base_prefix"])),
            purelib=Path(os.path.realpath(info["purelib"])),
            platlib=Path(os.path.realpath(info["platlib"])),
            scripts=Path(os.path.realpath(info["scripts"])),
            data=Path(os.path.realpath(info["data"])),
            version=(major, minor, micro),
            implementation=str(info["implementation"]),
            soabi=optional_text(info.get("soabi")),
            platform=str(info["platform"]),
            account=owner,
            probed_as=os.geteuid() if owner is None else owner.uid,  # as started, never as it says
            base_site_dirs=tuple(Path(os.path.realpath(p)) for p in info.get("base_site_dirs", [])),
            given_site_dirs=tuple(Path(os.path.abspath(info[key])) for key in ("purelib", "platlib")),
            stdlib=Path(os.path.realpath(info["stdlib"])) if isinstance(info.get("stdlib"), str) else None,
        )
    except (ValueError, KeyError, TypeError) as exc:
        raise InterpreterError(
            probe_failure(python, proc.returncode, "")
            if not proc.stdout.strip()
            else f"{python} printed something unexpected: {proc.stdout[:200]!r}",
            hint="check that --python names a working Python 3 interpreter",
        ) from exc
    problem = _answer_problem(python, env)
    if problem is not None:
        raise InterpreterError(
            f"refusing the environment of {python}: {problem}",
            hint="safeinstall acts only inside the environment the interpreter belongs to; if "
            f"{python} is a wrapper (a pyenv shim) name the interpreter it runs (it said "
            f"{env.executable}) with --python; else check the venv",
        )
    return _held_to_one_account(env, walked) if os.geteuid() == 0 else env
