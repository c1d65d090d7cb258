"""The swap: the new version installed into a staging tree before the stop, put in place by renames.

:func:`plan_swap` (pure) decides how each staged entry takes its place; :func:`execute` renames, as the
prefix's owner (:func:`as_owner`). The order and why it is safe: docs/window.md ("The swap").
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path, PurePosixPath
from typing import Any

from safeinstall.env.containment import relative_path
from safeinstall.env.drift import pyc_source
from safeinstall.env.environment import Environment
from safeinstall.system import worker
from safeinstall.system.safefs import (
    RENAME_EXCHANGE,
    RENAME_NOREPLACE,
    Tree,
    only_caller_writes,
    others_who_write,
    parent_directories,
)
from safeinstall.system.signals import map_held

#: The staging directory's name in the prefix: this, then the run's id.
STAGING_PREFIX = ".safeinstall-swap-"
STAGED_TREE = "tree"  # the new version, laid out as the prefix
ATTIC = "attic"  # what was moved out of the environment
_FSYNC_THREADS = 16
#: How long the owner's worker may take for the window's renames and fsyncs (dozens of entries)
SWAP_TIMEOUT_S = 120.0
#: ... for the attic's directories, the tidy-up after the swap, the late files put back
_TIDY_TIMEOUT_S = 60.0

#: Who does the swap's writes in a prefix: None for root (a root-owned environment: root's own process),
#: else the account's (uid, gid), in a worker that is that account (docs/privsep.md)
Ids = tuple[int, int] | None


class How(StrEnum):
    PLACE = "place"  # nothing there: renamed in, never replacing
    EXCHANGE = "exchange"  # the live entry and the staged one trade places (the old one stays staged)


@dataclass(frozen=True, slots=True)
class Move:
    path: str  # relative to the prefix, and to the staging tree
    how: How
    directory: bool


@dataclass(frozen=True, slots=True)
class SwapPlan:
    moves: tuple[Move, ...]  # the new ``.dist-info`` directories first
    out: tuple[Move, ...]  # old entries moved into the attic (``.dist-info`` directories last)
    problems: tuple[str, ...] = ()  # why it cannot be done (then the install runs in the window)

    @property
    def touched(self) -> tuple[str, ...]:
        """The directories whose entries change (fsync'ed after the swap)."""
        return tuple(sorted({m.path.rpartition("/")[0] for m in (*self.moves, *self.out)}))


@dataclass(frozen=True, slots=True)
class Staged:
    """A verified staging tree and how it takes its place."""

    root: Path  # <prefix>/.safeinstall-swap-RUN (the prefix owner's, 0700)
    plan: SwapPlan
    identities: Mapping[str, tuple[int, int]]  # each move's (device, inode), as verified
    files: int  # files of the new version in it


def staging_dir(prefix: Path, run_id: str) -> Path:
    return prefix / f"{STAGING_PREFIX}{run_id}"


def staging_environment(env: Environment, tree: Path) -> Environment:
    """Pure: ``env`` as if its prefix were ``tree`` (uv's ``--prefix`` layout): the interpreter stays
    the environment's own (the scripts' first lines name it)."""

    def moved(path: Path) -> Path:
        return tree / relative_path(path, env.prefix)

    sites = tuple(moved(p) for p in env.site_dirs)
    return replace(
        env,
        prefix=tree,
        purelib=moved(env.purelib),
        platlib=moved(env.platlib),
        scripts=moved(env.scripts),
        data=moved(env.data),
        base_site_dirs=(),
        given_site_dirs=sites,
    )


def plan_swap(
    staged_files: frozenset[str],
    staged_dirs: frozenset[str],
    live: Mapping[str, str],
    old_files: frozenset[str],
    own_dirs: frozenset[str],
    held: frozenset[str],
    differs: frozenset[str] = frozenset(),
) -> SwapPlan:
    """Pure: how the staged entries take their place (paths relative to the prefix).

    ``live``: what the environment has at those paths; ``old_files``, ``own_dirs``: the replaced
    distributions' entries and own directories; ``held``, ``differs``: what must stay, so that no
    directory above them is moved whole.
    """
    keep = held | differs | parent_directories(held | differs)
    children: dict[str, list[str]] = {}
    for path in staged_files | staged_dirs:
        children.setdefault(path.rpartition("/")[0], []).append(path)
    moves: list[Move] = []
    problems: list[str] = []

    def visit(directory: str) -> None:
        for child in sorted(children.get(directory, ())):
            kind = live.get(child)
            is_dir = child in staged_dirs
            if kind is None:
                moves.append(Move(child, How.PLACE, is_dir))
            elif is_dir and kind != "dir":
                problems.append(f"{child} is a directory in the new version and a {kind} in the environment")
            elif not is_dir and kind not in ("file", "link"):
                problems.append(f"{child} is a file in the new version and a {kind} in the environment")
            elif is_dir and child in own_dirs and child not in keep:
                moves.append(Move(child, How.EXCHANGE, True))
            elif is_dir:
                visit(child)
            else:
                moves.append(Move(child, How.EXCHANGE, False))

    visit("")
    gone = {m.path for m in moves if m.directory}  # what leaves whole: exchanged, or moved out below
    out: list[Move] = []
    for directory in sorted(own_dirs):  # a directory before those below it
        if directory in staged_dirs or directory in keep or live.get(directory) != "dir":
            continue
        if not _below(directory, gone):
            out.append(Move(directory, How.PLACE, True))
            gone.add(directory)
    for path in sorted(old_files):
        if path in staged_files or path in keep or live.get(path) not in ("file", "link"):
            continue
        if not _below(path, gone):
            out.append(Move(path, How.PLACE, False))
    first = sorted(moves, key=lambda m: not _is_dist_info(m.path))  # stable: the rest keep their order
    last = sorted(out, key=lambda m: _is_dist_info(m.path))
    return SwapPlan(tuple(first), tuple(last), tuple(problems))


def bears_on_plan(path: str, asked: frozenset[str]) -> bool:
    """Pure: does a path that must stay (``held``) change :func:`plan_swap`'s answer? Only where it, or
    a directory above it, is one the plan asks about (``asked``: its old files and own directories):
    the rest of another distribution's files may be left out of ``held`` (vLLM's 60k)."""
    while path:
        if path in asked:
            return True
        path = path.rpartition("/")[0]
    return False


def _below(path: str, directories: set[str]) -> bool:
    """Pure: ``path`` is one of ``directories`` or lies below one."""
    while path:
        if path in directories:
            return True
        path = path.rpartition("/")[0]
    return False


def _is_dist_info(path: str) -> bool:
    return path.endswith(".dist-info") and path.count("/") >= 1


# --- I/O ------------------------------------------------------------------------------------------


def as_owner(ids: Ids, what: str, work: Callable[[], Any], timeout: float = _TIDY_TIMEOUT_S) -> Any:
    """``work()`` done by the prefix's owner: root itself (``ids`` None) or a worker that is the account
    (docs/privsep.md); its answer is the account's word. Raises OSError or
    :class:`~safeinstall.system.worker.WorkerError`.
    """
    if ids is None:
        return work()
    return worker.call(ids, work, timeout=timeout, what=what)


def owner_of(prefix: Path) -> Ids:
    """Who does the swap's writes in ``prefix`` for a recovery: root when it owns it, else its owner
    (uid, gid), opened as :class:`Tree` opens it. Raises OSError, also for a root-owned prefix others may
    write.
    """
    with Tree(prefix) as tree:
        info = os.fstat(tree.fd)
    if info.st_uid == 0 and others_who_write(info.st_mode, info.st_gid) is not None:
        raise PermissionError(errno.EPERM, "root's directory that others may write", str(prefix))
    return None if info.st_uid == 0 else (info.st_uid, info.st_gid)


def make_staging_dir(prefix: Path, name: str, mode: int, ids: Ids) -> None:
    """The staging directory ``name`` made in the prefix, by its owner. Raises OSError or WorkerError."""

    def make() -> None:
        with Tree(prefix) as tree:
            tree.make_dir(name, mode)

    as_owner(ids, f"makes {name} in {prefix}", make)


@dataclass(frozen=True, slots=True)
class Entry:
    kind: str  # "dir", "file", "link", "other"
    owner: tuple[int, int, int]  # uid, gid, permission bits


def entry_of(info: os.stat_result) -> Entry:
    """Pure: an entry's kind and owner, from its ``lstat``."""
    mode = info.st_mode
    kind = (
        "dir"
        if stat.S_ISDIR(mode)
        else "file"
        if stat.S_ISREG(mode)
        else "link"
        if stat.S_ISLNK(mode)
        else "other"
    )
    return Entry(kind, (info.st_uid, info.st_gid, stat.S_IMODE(mode)))


def entries(tree: Tree, paths: Iterable[str]) -> dict[str, Entry]:
    """What ``tree`` holds at each of ``paths`` (by descriptor, no symlink followed; absent: left out)."""
    found: dict[str, Entry] = {}
    with tree.batch():
        for path in paths:
            info = tree.lstat(path)
            if info is not None:
                found[path] = entry_of(info)
    return found


class LiveKinds(Mapping[str, str]):
    """The kind of what ``tree`` holds at a path, looked up (by descriptor) when :func:`plan_swap` asks:
    it asks of the entries it visits, the replaced distributions' own directories and the old files
    the new version drops, not of every file (torch's 12k ``lstat`` calls). Iterating gives what was
    looked up so far."""

    def __init__(self, tree: Tree, known: Mapping[str, Entry]) -> None:
        self._tree = tree
        self._seen: dict[str, str | None] = {path: entry.kind for path, entry in known.items()}

    def __getitem__(self, path: str) -> str:
        if path not in self._seen:
            info = self._tree.lstat(path)
            self._seen[path] = None if info is None else entry_of(info).kind
        kind = self._seen[path]
        if kind is None:
            raise KeyError(path)
        return kind

    def __iter__(self) -> Iterator[str]:
        return iter([path for path, kind in self._seen.items() if kind is not None])

    def __len__(self) -> int:
        return sum(1 for kind in self._seen.values() if kind is not None)


def prepare_attic(root: Path, plan: SwapPlan, ids: Ids) -> None:
    """The attic's directories, mirroring the prefix, for every entry the swap moves out (made before
    the stop, by the prefix's owner: the window only renames). Raises OSError or WorkerError."""

    def make() -> None:
        with Tree(root) as tree:
            tree.make_dir(ATTIC, 0o700)
        with Tree(root / ATTIC) as attic:
            for directory in sorted(parent_directories(m.path for m in plan.out), key=lambda p: p.count("/")):
                attic.make_dir(directory, 0o700)

    as_owner(ids, f"makes the attic of {root}", make)


def crossings(tree: Tree, plan: SwapPlan, staging_mount: int | None) -> list[str]:
    """Entries the swap renames, and their directories, that lie on another mount than the staging
    tree (a bind mount inside the environment): a rename cannot cross it."""
    paths = {m.path for m in (*plan.moves, *plan.out)}
    paths |= {p.rpartition("/")[0] for p in paths}
    return sorted(p for p in paths if tree.mount_id(p) not in (staging_mount, None))


def walk_staged(tree: Tree) -> tuple[frozenset[str], frozenset[str]]:
    """Every file and every directory of the staging tree (relative), uv's lock file aside."""
    files, directories = tree.walk("")
    return frozenset(files) - {".lock"}, frozenset(directories)


def identities(tree: Tree, moves: Sequence[Move]) -> dict[str, tuple[int, int]]:
    """(device, inode) of each move's entry in ``tree``; an entry that is not there is left out."""
    found: dict[str, tuple[int, int]] = {}
    with tree.batch():
        for move in moves:
            info = tree.lstat(move.path)
            if info is not None:
                found[move.path] = (info.st_dev, info.st_ino)
    return found


def execute(staged: Staged, prefix: Path, ids: Ids) -> None:
    """The swap itself, by the prefix's owner (``ids``: a worker that is that account; None: root's own
    process): every move, then every old entry out into the attic, then the changed directories made
    durable. Raises OSError or WorkerError at the first failure (what was done stays done: the caller
    restores the backup)."""
    as_owner(ids, f"renames the new version into {prefix}", lambda: _execute(staged, prefix), SWAP_TIMEOUT_S)


def _execute(staged: Staged, prefix: Path) -> None:
    plan = staged.plan
    with Tree(staged.root / STAGED_TREE) as new, Tree(staged.root / ATTIC) as attic, Tree(prefix) as live:
        for move in plan.moves:
            flags = RENAME_NOREPLACE if move.how == How.PLACE else RENAME_EXCHANGE
            new.move_to(move.path, live, move.path, flags, directory=move.directory)
        for move in plan.out:  # the attic mirrors the prefix (its directories made before the stop)
            live.move_to(move.path, attic, move.path, RENAME_NOREPLACE, directory=move.directory)
        with ThreadPoolExecutor(max_workers=_FSYNC_THREADS, thread_name_prefix="fsync") as pool:
            map_held(pool, live.fsync_dir, plan.touched)


def moved_as_staged(staged: Staged, prefix: Path) -> list[str]:
    """The moved entries that are not, in place, the inodes verified in the staging tree (empty: all are)."""
    with Tree(prefix) as live:
        now = identities(live, staged.plan.moves)
    return [m.path for m in staged.plan.moves if now.get(m.path) != staged.identities.get(m.path)]


KEPT_PREFIX = ".safeinstall-kept-"


def unknown_in_old(root: Path, known: frozenset[str]) -> list[tuple[str, str]]:
    """After the swap: the files in the exchanged and moved-out old entries that the backup did not save
    (``known``) and that are not bytecode of a saved source, as (below ``root``, in the prefix): what
    appeared after the backup.
    """
    found: list[tuple[str, str]] = []
    for part in (STAGED_TREE, ATTIC):
        try:
            with Tree(root / part) as old:
                files, _dirs = walk_staged(old)
        except FileNotFoundError:
            continue
        found += [
            (f"{part}/{path}", path) for path in files if path not in known and not _cached(path, known)
        ]
    return sorted(found)


def _cached(path: str, known: frozenset[str]) -> bool:
    """Pure: bytecode that Python writes again (in ``__pycache__``, or of a saved source)."""
    if not path.endswith(".pyc"):
        return False
    source = pyc_source(PurePosixPath(path))
    return "__pycache__/" in path or (source is not None and str(source) in known)


def put_back_unknown(root: Path, prefix: Path, unknown: Sequence[tuple[str, str]], ids: Ids) -> list[str]:
    """Each of ``unknown`` renamed back to where it was in the prefix, by the prefix's owner, where
    nothing took its place (as uv's install leaves such a file); its directory made again, as it was,
    where the new version dropped it (uv's uninstall leaves a directory that still holds a file); the
    ones that could not be (every one, when the owner's worker failed or said something else)."""
    if not unknown:
        return []
    asked = [path for _, path in unknown]
    try:
        answer = as_owner(ids, f"puts late files back in {prefix}", lambda: _put_back(root, prefix, unknown))
    except (OSError, worker.WorkerError):
        return asked
    if not isinstance(answer, list) or not all(isinstance(a, str) for a in answer):
        return asked
    return [path for path in asked if path in answer]  # the account's word: only paths that were asked


def _put_back(root: Path, prefix: Path, unknown: Sequence[tuple[str, str]]) -> list[str]:
    left: list[str] = []
    with Tree(root) as staged, Tree(prefix) as live:
        for where, path in unknown:
            info = staged.lstat(where)
            try:
                owner, missing = _way_back(staged, live, where, path)
                # a regular file of root's or of the directory's owner: nothing else is given a new place
                fits = info is not None and stat.S_ISREG(info.st_mode) and info.st_uid in (0, owner)
                if not fits:
                    raise OSError("not put back")
                for directory, mode in missing:
                    live.make_dir(directory, mode)
                staged.move_to(where, live, path, RENAME_NOREPLACE, directory=False)
            except OSError:
                left.append(path)
    return left


def _way_back(staged: Tree, live: Tree, where: str, path: str) -> tuple[int, list[tuple[str, int]]]:
    """The owner of the directory a late file goes back into, and the directories to make first (with
    their old modes, top down): none where it still is; where the new version dropped it, those of the
    old tree, each a real directory of this process's own user (the prefix's owner, who makes them).
    Raises OSError when there is no such way (a file at the top, a non-directory on the way)."""
    directory = path.rpartition("/")[0]
    base = where[: len(where) - len(path)]  # the old tree's mirror of the prefix in ``staged``
    missing: list[tuple[str, int]] = []
    while directory:
        here = live.lstat(directory)
        if here is not None:
            if not stat.S_ISDIR(here.st_mode):
                raise OSError(f"{directory} is no directory")
            return (here.st_uid if not missing else os.geteuid()), missing[::-1]
        old = staged.lstat(base + directory)
        if old is None or not stat.S_ISDIR(old.st_mode) or old.st_uid != os.geteuid():
            raise OSError(f"{directory} is not the owner's directory in the old tree")
        missing.append((directory, stat.S_IMODE(old.st_mode)))
        directory = directory.rpartition("/")[0]
    if not missing:
        raise OSError("nothing is put back at the top of the prefix")
    return os.geteuid(), missing[::-1]


def keep_staging(prefix: Path, name: str, ids: Ids) -> Path | None:
    """The staging directory renamed to ``.safeinstall-kept-RUN`` by the prefix's owner (never removed
    by a later run); None when it cannot be."""
    kept = KEPT_PREFIX + name.removeprefix(STAGING_PREFIX)

    def keep() -> bool:
        with Tree(prefix) as tree:
            tree.move_to(name, tree, kept, RENAME_NOREPLACE)
        return True

    try:
        done = as_owner(ids, f"keeps {name} aside in {prefix}", keep)
    except (OSError, worker.WorkerError):
        return None
    return prefix / kept if done is True else None


def tidy(plan: SwapPlan, prefix: Path, keep: frozenset[str], ids: Ids) -> None:
    """After the swap (best effort, by the prefix's owner): the bytecode of the single files moved out,
    and the directories that moving them emptied, as uv's uninstall removes them; never one of ``keep``
    (the directories uv installs into and those above them). Raises OSError or WorkerError."""
    as_owner(ids, f"tidies {prefix} after the swap", lambda: _tidy(plan, prefix, keep))


def _tidy(plan: SwapPlan, prefix: Path, keep: frozenset[str]) -> None:
    with Tree(prefix) as live:
        emptied: set[str] = set()
        for move in plan.out:
            parent, _, name = move.path.rpartition("/")
            if not move.directory and name.endswith(".py"):
                cache = f"{parent}/__pycache__" if parent else "__pycache__"
                for cached in live.names(cache):
                    if cached.startswith(name[:-3] + ".") and cached.endswith(".pyc"):
                        live.unlink(f"{cache}/{cached}")
                emptied.add(cache)
            if parent:
                emptied.add(parent)
        for directory in sorted(emptied | parent_directories(emptied), key=lambda p: -p.count("/")):
            if directory in keep:
                continue
            try:
                if not live.names(directory) and live.is_dir(directory):
                    live.rmdir(directory)
            except OSError:
                continue


def discard_staging(prefix: Path, name: str, seconds: float, ids: Ids) -> bool:
    """Remove the staging directory ``name`` of the prefix (by descriptor, never following a symlink),
    by the prefix's owner (``ids``), and only in a prefix that this owner owns and nobody else may
    write; True when it is gone."""
    if not name.startswith(STAGING_PREFIX) or "/" in name:
        return False
    try:
        done = as_owner(
            ids, f"removes {name} from {prefix}", lambda: _discard(prefix, name, seconds), seconds + 5
        )
    except (OSError, worker.WorkerError):
        return False
    return done is True and not os.path.lexists(prefix / name)


def _discard(prefix: Path, name: str, seconds: float) -> bool:
    try:
        with Tree(prefix) as tree:
            info = os.fstat(tree.fd)
            if not only_caller_writes(info):
                return False
            tree.remove_tree(name, time.monotonic() + seconds)
            return tree.lstat(name) is None
    except OSError:
        return False


def leftover_stagings(prefix: Path) -> list[str]:
    """The staging directories runs that died left in the prefix (their names)."""
    try:
        return sorted(n for n in os.listdir(prefix) if n.startswith(STAGING_PREFIX))
    except OSError:
        return []
