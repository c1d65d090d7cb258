"""Which running processes use the affected distributions: one pass over ``/proc``.

Every process is read once (``stat``, ``cmdline``, ``cgroup``, ``maps``, ``fd/``; its euid is the owner
of ``/proc/PID``), through its open ``/proc/PID`` directory; what it shows is matched against
pre-indexed :class:`Target` descriptions of the affected distributions, and each match is kept as
:class:`Evidence`:

* ``mapped`` - a file of the distribution is mapped (``maps``), matched by device and inode, or by path
  (overlayfs may show another device/inode). ``(deleted)`` means the process runs code that is no
  longer installed; those are matched by path only, since the inode may have been reused. A match by
  inode alone, under another path, counts when that path's directory (seen through the process's own
  root) is one of the distribution's directories: a bind mount or a container's view of this
  environment. Another directory means a hardlink twin (uv links every environment it installs a
  wheel into to the same cache inodes): a process of *another* environment, which a reinstall here
  does not touch, so it is not evidence;
* ``open`` - an open file descriptor points at one of its files or into its package directories;
* ``argv`` - the command line runs one of its console scripts, or ``-m module`` with an interpreter of
  the target environment;
* ``depends`` - any of the above for a distribution of the same environment that requires an affected
  one, directly or through others (:mod:`safeinstall.dependents`): a process that imported ``vllm``
  imported ``transformers`` too, although nothing of a pure-Python package is left in its ``/proc``;
* ``environment`` (possible, not certain) - the process runs this environment's Python: its ``argv[0]``
  (or, for a bare ``python``, its executable) is the environment's interpreter, it maps or holds open a
  file under the environment's prefix (a venv) or site directories (a system environment), or its
  ``VIRTUAL_ENV``/``PYTHONPATH`` point into it. Such a process may import the package at any time.
  ``/proc/PID/environ`` is read only for a process that looks like Python and has no other evidence
  (one more read for those). A match is kept only when the prefix, seen through the process's own
  root, is this environment's directory (a container's ``/opt/venv`` is another one).

``unit`` evidence (shares a systemd unit with an affected process) is added by the planner, from the
light record this scan keeps of every process it saw.

Nothing of a scanned process is ever executed (cf. needrestart, CVE-2024-48990): ``/proc`` is only read.
Parsing and matching are pure functions; the I/O lives in :func:`scan_processes`, :func:`load_targets`
and :func:`probe_files`.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import pwd
import re
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from stat import S_ISLNK

from safeinstall.dependents import describe_chain
from safeinstall.distributions import InstalledDistribution
from safeinstall.environment import Environment
from safeinstall.forking import can_fork, cpu_count, map_forked, split
from safeinstall.identity import PF_KTHREAD, StatInfo, parse_stat

__all__ = [
    "EnvironmentScope",
    "Evidence",
    "EvidenceKind",
    "MapsEntry",
    "ProcessRecord",
    "PythonInvocation",
    "ScanProblem",
    "ScanResult",
    "Strength",
    "Target",
    "TargetIndex",
    "argv_needs_links",
    "build_target",
    "default_workers",
    "environment_scope",
    "load_targets",
    "match_argv",
    "match_environment_argv",
    "match_environment_environ",
    "match_environment_maps",
    "match_environment_paths",
    "match_fds",
    "match_maps",
    "parse_cmdline",
    "parse_maps_line",
    "parse_python_argv",
    "probe_files",
    "scan_processes",
]

DELETED_SUFFIX = " (deleted)"
#: Directories at the top of site-packages that never belong to one distribution.
_NEVER_OWNED = frozenset({"__pycache__", "..", "."})
_EXTENSION_SUFFIXES = (".so", ".pyd")
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh"})


# --------------------------------------------------------------------------------------------- targets


@dataclass(frozen=True, slots=True)
class Target:
    """One affected distribution, as the scan recognises it."""

    distribution: str  # canonical name
    version: str
    files: frozenset[str]  # absolute installed paths of its RECORD entries
    file_ids: frozenset[tuple[int, int]]  # (st_dev, st_ino) of those files that exist
    directories: tuple[str, ...]  # its own package directories inside site-packages (absolute)
    console_scripts: frozenset[str]  # absolute paths of its scripts
    modules: frozenset[str]  # import names that ``python -m`` may run (``pkg``, ``ns.sub``, ``mod``)
    interpreters: frozenset[str]  # the environment's interpreter paths
    #: (st_dev, st_ino) of the directories holding its files: tells a bind mount of this environment
    #: (same directory) from a hardlink twin in another one (another directory)
    directory_ids: frozenset[tuple[int, int]] = frozenset()
    #: for a distribution that only *requires* affected ones (``depends`` evidence): the chains from it
    #: to each, ``(("sicext", "sipure"),)``; empty for an affected distribution
    requires: tuple[tuple[str, ...], ...] = ()


def _is_dotted_identifier(parts: Iterable[str]) -> bool:
    parts = list(parts)
    return bool(parts) and all(part.isidentifier() for part in parts)


def _module_of_file(parts: tuple[str, ...]) -> str | None:
    """``a/b.py`` -> ``a.b``; ``x.cpython-311-x86_64-linux-gnu.so`` -> ``x``; anything else -> None."""
    name = parts[-1]
    if name.endswith(".py"):
        stem = name[:-3]
    elif name.endswith(_EXTENSION_SUFFIXES):
        stem = name.split(".", 1)[0]
    else:
        return None
    dotted = (*parts[:-1], stem)
    return ".".join(dotted) if _is_dotted_identifier(dotted) and stem != "__init__" else None


def _own_directories(
    entries: list[tuple[str, ...]], prefix: tuple[str, ...], shared: frozenset[tuple[str, ...]]
) -> list[tuple[str, ...]]:
    """The directories (as path parts) that belong to this distribution alone.

    A directory is descended into instead of owned when another distribution also has files under it,
    or when, at the top, it looks like a namespace package (no ``__init__.py`` but subdirectories).
    """
    groups: dict[str, list[tuple[str, ...]]] = {}
    for parts in entries:
        if len(parts) > 1:
            groups.setdefault(parts[0], []).append(parts[1:])
    owned: list[tuple[str, ...]] = []
    for name in sorted(groups):
        if name in _NEVER_OWNED or (not prefix and name.endswith((".dist-info", ".egg-info", ".data"))):
            continue
        below = groups[name]
        here = (*prefix, name)
        has_init = ("__init__.py",) in below
        has_subdirs = any(len(parts) > 1 for parts in below)
        if here in shared or (not prefix and has_subdirs and not has_init):
            owned.extend(_own_directories(below, here, shared))
        else:
            owned.append(here)
    return owned


def _inside_site(dist: InstalledDistribution) -> list[tuple[str, ...]]:
    """RECORD paths that stay inside the site directory, normalised, as parts."""
    inside: list[tuple[str, ...]] = []
    for entry in dist.record.entries:
        relative = os.path.normpath(entry.path)
        if relative.startswith(("..", "/")) or relative == ".":
            continue
        inside.append(tuple(relative.split("/")))
    return inside


def _shared_directories(
    dist: InstalledDistribution, others: Iterable[InstalledDistribution]
) -> frozenset[tuple[str, ...]]:
    """Directories (parts, relative to ``dist.site``) under which another distribution has files."""
    shared: set[tuple[str, ...]] = set()
    for other in others:
        if other.site != dist.site or other.dist_info == dist.dist_info:
            continue
        for parts in _inside_site(other):
            for depth in range(1, len(parts)):
                shared.add(parts[:depth])
    return frozenset(shared)


def _interpreter_names(env: Environment) -> frozenset[str]:
    major, minor, _ = env.version
    names = ("python", "python3", f"python{major}", f"python{major}.{minor}")
    found = {str(env.python), str(env.executable)}
    for directory in {str(env.scripts), str(env.python.parent)}:
        found.update(f"{directory}/{name}" for name in names)
    return frozenset(found)


def build_target(
    dist: InstalledDistribution,
    env: Environment,
    *,
    file_ids: Iterable[tuple[int, int]] = (),
    others: Iterable[InstalledDistribution] = (),
    extra_interpreters: Iterable[str] = (),
    aliases: Iterable[str] = (),
    directory_ids: Iterable[tuple[int, int]] = (),
    requires: tuple[tuple[str, ...], ...] = (),
) -> Target:
    """Describe ``dist`` (installed in ``env``) for the scan. Pure: what needs I/O comes from the caller.

    ``others`` are the other distributions of the environment: a directory one of them also installs
    into (``nvidia/``, a namespace package) is not counted as this distribution's own. ``file_ids``
    and ``aliases`` come from :func:`probe_files`: ``aliases`` are where installed symlinks lead (uv's
    ``--link-mode symlink`` points into its cache, and /proc shows the resolved path).
    """
    installed = frozenset(dist.locations)
    files = installed | frozenset(aliases)
    inside = _inside_site(dist)
    owned = _own_directories(inside, (), _shared_directories(dist, others))
    site = str(dist.site)
    directories = tuple(sorted(os.path.join(site, *parts) for parts in owned))
    modules = {".".join(parts) for parts in owned if _is_dotted_identifier(parts)}
    owned_set = set(owned)
    for parts in inside:
        parents = {parts[:depth] for depth in range(1, len(parts))}
        if parents & owned_set or parts[0].endswith(".dist-info"):
            continue
        module = _module_of_file(parts)
        if module:
            modules.add(module)
    # scripts are looked for under both spellings of the scripts directory (resolved, and as given)
    script_dirs = {str(env.scripts), str(env.python.parent)}
    script_names = {os.path.basename(path) for path in installed if os.path.dirname(path) in script_dirs}
    script_names.update(dist.console_scripts)
    scripts = frozenset(f"{directory}/{name}" for directory in script_dirs for name in script_names)
    return Target(
        distribution=dist.name,
        version=dist.version,
        files=files,
        file_ids=frozenset(file_ids),
        directories=directories,
        console_scripts=scripts,
        modules=frozenset(modules),
        interpreters=_interpreter_names(env) | frozenset(extra_interpreters),
        directory_ids=frozenset(directory_ids),
        requires=requires,
    )


def probe_files(paths: Iterable[str]) -> tuple[frozenset[tuple[int, int]], frozenset[str]]:
    """The (st_dev, st_ino) of every existing path, and where the symlinks among them lead.

    Symlinks are followed, as the kernel does when it maps a file; both sets feed :func:`build_target`
    (``file_ids``, ``aliases``). One lstat per plain file.
    """
    ids: set[tuple[int, int]] = set()
    aliases: set[str] = set()
    for path in paths:
        try:
            st = os.lstat(path)
            if S_ISLNK(st.st_mode):
                aliases.add(os.path.realpath(path))
                st = os.stat(path)
        except OSError:
            continue
        ids.add((st.st_dev, st.st_ino))
    return frozenset(ids), frozenset(aliases)


def probe_directories(paths: Iterable[str]) -> frozenset[tuple[int, int]]:
    """The (st_dev, st_ino) of the directories holding ``paths`` (one stat per directory)."""
    ids: set[tuple[int, int]] = set()
    for directory in {os.path.dirname(path) for path in paths}:
        try:
            st = os.stat(directory)
        except OSError:
            continue
        ids.add((st.st_dev, st.st_ino))
    return frozenset(ids)


def load_targets(
    dists: Iterable[InstalledDistribution],
    env: Environment,
    installed: Iterable[InstalledDistribution],
    requires: Mapping[str, tuple[tuple[str, ...], ...]] | None = None,
) -> tuple[Target, ...]:
    """Targets for ``dists`` of ``env``: stats their files once; ``installed``: the environment's
    distributions, found once per run.

    ``requires`` marks distributions that only require affected ones (their chains, see
    :func:`safeinstall.dependents.dependents`): evidence against them becomes ``depends`` evidence.

    Files of a distribution installed as symlinks into a shared cache (uv ``--link-mode symlink``) are
    the same inodes for every environment linking that wheel: another environment's process using
    them is found too (the safe side).
    """
    everything = list(installed)
    # Outside a venv the interpreter is the real binary: let /proc/PID/exe recognise it too.
    extra = () if env.is_venv else (os.path.realpath(env.executable),)
    targets: list[Target] = []
    for dist in dists:
        others = [other for other in everything if other.dist_info != dist.dist_info]
        file_ids, aliases = probe_files(dist.locations)
        targets.append(
            build_target(
                dist,
                env,
                file_ids=file_ids,
                others=others,
                extra_interpreters=extra,
                aliases=aliases,
                directory_ids=probe_directories(dist.locations),
                requires=(requires or {}).get(dist.name, ()),
            )
        )
    return tuple(targets)


@dataclass(frozen=True, slots=True)
class EnvironmentScope:
    """The target environment as ``environment`` evidence recognises it."""

    prefix: str
    #: "<dir>/": a file mapped or open below one of these is the environment's (a venv: its prefix, both
    #: spellings; a system environment: its site directories, not /usr, which every process maps)
    roots: tuple[str, ...]
    interpreters: frozenset[str]  # absolute paths of its interpreter (see _interpreter_names)
    prefix_id: tuple[int, int] | None  # (st_dev, st_ino) of the prefix directory, None if unknown


def environment_scope(env: Environment) -> EnvironmentScope:
    """The scope of ``env`` (one stat of its prefix)."""
    if env.is_venv:
        directories = {str(env.prefix), os.path.normpath(str(env.python.parent.parent))}
    else:
        directories = {str(site) for site in env.site_dirs}
    extra = () if env.is_venv else (os.path.realpath(env.executable),)
    try:
        st = os.stat(env.prefix)
        prefix_id: tuple[int, int] | None = (st.st_dev, st.st_ino)
    except OSError:
        prefix_id = None
    return EnvironmentScope(
        prefix=str(env.prefix),
        roots=tuple(sorted(d.rstrip("/") + "/" for d in directories)),
        interpreters=_interpreter_names(env) | frozenset(extra),
        prefix_id=prefix_id,
    )


# --------------------------------------------------------------------------------------------- evidence


class EvidenceKind(StrEnum):
    MAPPED = "mapped"
    OPEN = "open"
    ARGV = "argv"
    UNIT = "unit"  # added by the planner, never by the scan
    DEPENDS = "depends"  # a distribution that requires the affected one is mapped, open or run
    ENVIRONMENT = "environment"  # runs the environment's Python: possible, not certain


class Strength(StrEnum):
    """How sure the evidence is that the process runs the package's code."""

    CERTAIN = "certain"
    POSSIBLE = "possible"  # a process of the environment: it may import the package at any time


@dataclass(frozen=True, slots=True)
class Evidence:
    kind: EvidenceKind
    distribution: str
    path: str  # the mapped/open file, the console script, or the module run with -m
    deleted: bool = False  # the file is gone from disk: the process runs code no longer installed
    detail: str = ""  # how it matched: "dev/inode fe:00 123", "path", "directory", "console script", ...

    @property
    def running_old_code(self) -> bool:
        return self.deleted

    @property
    def strength(self) -> Strength:
        return Strength.POSSIBLE if self.kind is EvidenceKind.ENVIRONMENT else Strength.CERTAIN

    def describe(self) -> str:
        old = " (deleted: running old code)" if self.deleted else ""
        how = f" [{self.detail}]" if self.detail else ""
        what = f"{self.distribution} {self.path}" if self.distribution else self.path  # environment: none
        return f"{self.kind}: {what}{old}{how}"


_FEW_INODES = 64
_VERBS = {EvidenceKind.MAPPED: "maps", EvidenceKind.OPEN: "holds open", EvidenceKind.ARGV: "runs"}


def _anchors(prefixes: Iterable[str]) -> tuple[str, ...]:
    """The fewest strings one of which every path starting with one of ``prefixes`` contains."""
    kept: list[str] = []
    for prefix in sorted(set(prefixes), key=len):
        if not any(anchor in prefix for anchor in kept):
            kept.append(prefix)
    return tuple(kept)


@dataclass(frozen=True, slots=True)
class TargetIndex:
    """Targets pre-indexed for the per-process lookups (build once with :meth:`of`)."""

    targets: tuple[Target, ...]
    by_file: Mapping[str, tuple[str, ...]]
    by_maps_id: Mapping[tuple[str, str], tuple[str, ...]]  # ("fe:00", "123") as maps spells it
    prefixes: tuple[str, ...]  # "<dir>/" of every target directory
    directory_ids: frozenset[tuple[int, int]]  # of every target
    prefix_owners: tuple[tuple[str, str], ...]  # ("<dir>/", distribution)
    by_script: Mapping[str, tuple[str, ...]]
    script_names: frozenset[str]
    interpreter_names: frozenset[str]
    # a maps text holding none of these inode numbers and none of these strings cannot match
    maps_inodes: frozenset[str]
    inode_pattern: re.Pattern[str] | None  # " (?:1234|5678) ", when there are few
    anchors: tuple[str, ...]
    #: distributions that only require affected ones, by name (see Target.requires)
    dependents: Mapping[str, Target] = dataclasses.field(default_factory=dict)

    @classmethod
    def of(cls, targets: Iterable[Target] | TargetIndex) -> TargetIndex:
        if isinstance(targets, TargetIndex):
            return targets
        targets = tuple(targets)
        by_file: dict[str, list[str]] = {}
        by_id: dict[tuple[str, str], list[str]] = {}
        by_script: dict[str, list[str]] = {}
        owners: list[tuple[str, str]] = []
        for target in targets:
            name = target.distribution
            for path in target.files:
                by_file.setdefault(path, []).append(name)
                if "\n" in path:  # as /proc/PID/maps spells it
                    by_file.setdefault(_escape(path), []).append(name)
            for dev, ino in target.file_ids:
                key = (f"{os.major(dev):02x}:{os.minor(dev):02x}", str(ino))
                by_id.setdefault(key, []).append(name)
            for script in target.console_scripts:
                by_script.setdefault(script, []).append(name)
            for directory in target.directories:
                owners.append((directory.rstrip("/") + "/", name))
                if "\n" in directory:
                    owners.append((_escape(directory.rstrip("/")) + "/", name))
        return cls(
            targets=targets,
            by_file={key: tuple(dict.fromkeys(value)) for key, value in by_file.items()},
            by_maps_id={key: tuple(dict.fromkeys(value)) for key, value in by_id.items()},
            prefixes=tuple(dict.fromkeys(prefix for prefix, _ in owners)),
            directory_ids=frozenset(i for target in targets for i in target.directory_ids),
            prefix_owners=tuple(owners),
            by_script={key: tuple(dict.fromkeys(value)) for key, value in by_script.items()},
            script_names=frozenset(os.path.basename(s) for target in targets for s in target.console_scripts),
            interpreter_names=frozenset(os.path.basename(i) for t in targets for i in t.interpreters),
            maps_inodes=frozenset(ino for _, ino in by_id),
            inode_pattern=re.compile(" (?:{}) ".format("|".join(sorted({ino for _, ino in by_id}))))
            if 0 < len(by_id) <= _FEW_INODES
            else None,
            anchors=_anchors(
                [os.path.dirname(path) + "/" for path in by_file] + [prefix for prefix, _ in owners]
            ),
            dependents={target.distribution: target for target in targets if target.requires},
        )

    def as_depends(self, found: tuple[Evidence, ...]) -> tuple[Evidence, ...]:
        """Evidence against a distribution that only requires affected ones, as ``depends`` evidence
        for each affected one it requires ("maps sicext 1.0, which requires sipure")."""
        if not self.dependents or not found:
            return found
        kept: dict[tuple[str, str], Evidence] = {}
        for evidence in found:
            target = self.dependents.get(evidence.distribution)
            if target is None:
                kept.setdefault((evidence.kind.value + evidence.distribution, evidence.path), evidence)
                continue
            verb = _VERBS.get(evidence.kind, str(evidence.kind))
            for chain in target.requires:
                detail = f"{verb} {target.distribution} {target.version}, {describe_chain(chain)}"
                # one piece per dependent and affected distribution: its first file says enough
                depends = Evidence(EvidenceKind.DEPENDS, chain[-1], evidence.path, False, detail)
                kept.setdefault((f"depends {chain[-1]}", detail), depends)
        return tuple(kept.values())

    def may_match_maps(self, text: str) -> bool:
        """False when no line of the maps text can match: the scan's fast way past most processes."""
        if any(anchor in text for anchor in self.anchors):
            return True
        if not self.maps_inodes:
            return False
        if self.inode_pattern is not None:  # one search for a few numbers beats splitting the text
            return self.inode_pattern.search(text) is not None
        return not self.maps_inodes.isdisjoint(text.split())

    def owners_of(self, path: str) -> tuple[tuple[str, str], ...]:
        """(distribution, how) for a file path: one of its files, or inside one of its directories."""
        exact = self.by_file.get(path, ())
        inside = path.startswith(self.prefixes)
        if not exact and not inside:
            return ()
        found: dict[str, str] = dict.fromkeys(exact, "path")
        if inside:
            for prefix, name in self.prefix_owners:
                if path.startswith(prefix):
                    found.setdefault(name, "directory")
        return tuple(found.items())


# ------------------------------------------------------------------------------------------- parsing


@dataclass(frozen=True, slots=True)
class MapsEntry:
    start: int
    end: int
    perms: str
    offset: int
    dev: int  # os.makedev(major, minor)
    inode: int
    path: str  # "" for anonymous mappings; "[heap]", "[vdso]", ... as shown
    deleted: bool


def _escape(path: str) -> str:
    return path.replace("\n", "\\012")


def _unescape(path: str) -> str:
    # the kernel shows a newline in a mapped path as "\012"
    return path.replace("\\012", "\n") if "\\012" in path else path


def parse_maps_line(line: str) -> MapsEntry | None:
    """One line of ``/proc/PID/maps``; None if it is not one."""
    parts = line.rstrip("\n").split(None, 5)
    if len(parts) < 5:
        return None
    address, perms, offset, dev, inode = parts[:5]
    path = parts[5] if len(parts) == 6 else ""
    start, sep, end = address.partition("-")
    major, colon, minor = dev.partition(":")
    try:
        if not sep or not colon:
            return None
        deleted = path.endswith(DELETED_SUFFIX)
        if deleted:
            path = path[: -len(DELETED_SUFFIX)]
        return MapsEntry(
            start=int(start, 16),
            end=int(end, 16),
            perms=perms,
            offset=int(offset, 16),
            dev=os.makedev(int(major, 16), int(minor, 16)),
            inode=int(inode),
            path=_unescape(path),
            deleted=deleted,
        )
    except ValueError:
        return None


def _add(found: dict[tuple[str, str, bool], Evidence], evidence: Evidence) -> None:
    found.setdefault((evidence.distribution, evidence.path, evidence.deleted), evidence)


#: Where a directory path leads, as (st_dev, st_ino), in the scanned process's view; None: cannot tell.
Locator = Callable[[str], tuple[int, int] | None]


def match_maps(
    text: str, targets: Iterable[Target] | TargetIndex, locate: Locator | None = None
) -> tuple[Evidence, ...]:
    """``mapped`` evidence in the text of ``/proc/PID/maps`` (one per distribution, path, deleted).

    ``locate`` (the scan's I/O) tells an inode-only match under another directory (a hardlink twin in
    another environment: dropped) from a view of this environment's own directory (kept). Without it,
    or when it cannot tell, an inode match is kept: the safe side.
    """
    index = TargetIndex.of(targets)
    if not index.may_match_maps(text):
        return ()
    by_id, by_file, prefixes = index.by_maps_id, index.by_file, index.prefixes
    found: dict[tuple[str, str, bool], Evidence] = {}
    last = ""
    # the hot loop of the scan: one split per line, the rest only for the lines that may match
    for line in text.split("\n"):
        parts = line.split(None, 5)
        if len(parts) < 6:  # anonymous mapping
            continue
        path = parts[5]
        if path == last:  # a file maps as several consecutive lines
            continue
        last = path
        ids = by_id.get((parts[3], parts[4]))
        if (
            ids is None
            and path not in by_file
            and not path.startswith(prefixes)
            and not path.endswith(DELETED_SUFFIX)
        ):
            continue
        _match_mapped(found, index, path, f"dev/inode {parts[3]} {parts[4]}", ids or (), locate)
    return tuple(found.values())


def _match_mapped(
    found: dict[tuple[str, str, bool], Evidence],
    index: TargetIndex,
    path: str,
    id_detail: str,
    by_id: tuple[str, ...],
    locate: Locator | None,
) -> None:
    deleted = path.endswith(DELETED_SUFFIX)
    if deleted:  # the inode of a deleted file may since have been reused: match by path only
        path = path[: -len(DELETED_SUFFIX)]
        by_id = ()
    owners = index.owners_of(path)
    if by_id and not owners and locate is not None:
        where = locate(os.path.dirname(_unescape(path)))
        if where is not None and where not in index.directory_ids:
            by_id = ()  # a hardlink twin in another directory: another environment's file
    hows: dict[str, list[str]] = {name: [id_detail] for name in by_id}
    for name, how in owners:
        hows.setdefault(name, []).append(how)
    for name, how_list in hows.items():
        _add(found, Evidence(EvidenceKind.MAPPED, name, _unescape(path), deleted, ", ".join(how_list)))


def match_fds(links: Iterable[str], targets: Iterable[Target] | TargetIndex) -> tuple[Evidence, ...]:
    """``open`` evidence from the targets of ``/proc/PID/fd/*`` links."""
    index = TargetIndex.of(targets)
    found: dict[tuple[str, str, bool], Evidence] = {}
    for link in links:
        if not link.startswith("/"):  # socket:[..], pipe:[..], anon_inode:...
            continue
        deleted = link.endswith(DELETED_SUFFIX)
        path = link[: -len(DELETED_SUFFIX)] if deleted else link
        for name, how in index.owners_of(path):
            _add(found, Evidence(EvidenceKind.OPEN, name, path, deleted, how))
    return tuple(found.values())


@dataclass(frozen=True, slots=True)
class PythonInvocation:
    """What a python command line runs: ``-m module``, a script path, or neither (``-c``, stdin)."""

    module: str | None = None
    script: str | None = None


def parse_python_argv(args: Iterable[str]) -> PythonInvocation:
    """Read a python command line after argv[0] the way the interpreter does (``-Im mod``, ``-X opt``)."""
    it = iter(args)
    for arg in it:
        if arg == "--":
            script = next(it, None)
            return PythonInvocation(script=script)
        if arg.startswith("--"):
            if arg == "--check-hash-based-pycs":
                next(it, None)
            continue
        if arg == "-" or not arg.startswith("-"):
            return PythonInvocation(script=None if arg == "-" else arg)
        for position in range(1, len(arg)):
            flag = arg[position]
            rest = arg[position + 1 :]
            if flag == "c":
                return PythonInvocation()
            if flag == "m":
                return PythonInvocation(module=rest or next(it, None))
            if flag in "XWQ":
                if not rest:
                    next(it, None)
                break
    return PythonInvocation()


def _basename(path: str) -> str:
    return path.rpartition("/")[2]


def _looks_like_python(argv0: str, index: TargetIndex) -> bool:
    name = _basename(argv0)
    return name.startswith(("python", "pypy")) or name in index.interpreter_names


def _absolute(path: str, cwd: str | None) -> str | None:
    if path.startswith("/"):
        return os.path.normpath(path)
    if cwd is None or "/" not in path:  # a bare name was found on PATH: its directory is unknown
        return None
    return os.path.normpath(os.path.join(cwd, path))


def argv_needs_links(cmdline: tuple[str, ...], targets: Iterable[Target] | TargetIndex) -> bool:
    """Whether :func:`match_argv` could use the process's ``exe`` and ``cwd`` (relative paths only)."""
    index = TargetIndex.of(targets)
    if not cmdline:
        return False
    argv0 = cmdline[0]
    if not argv0.startswith("/") and _basename(argv0) in index.script_names:
        return True
    if len(cmdline) > 1 and _basename(cmdline[1]) in index.script_names and not cmdline[1].startswith("/"):
        return True
    if _looks_like_python(argv0, index):
        invocation = parse_python_argv(cmdline[1:])
        if invocation.module is not None and not argv0.startswith("/"):
            return True
        script = invocation.script
        return script is not None and not script.startswith("/") and _basename(script) in index.script_names
    return False


def match_argv(
    cmdline: tuple[str, ...],
    targets: Iterable[Target] | TargetIndex,
    exe: str | None = None,
    cwd: str | None = None,
) -> tuple[Evidence, ...]:
    """``argv`` evidence: a console script of a target runs, or ``-m`` one of its modules.

    ``exe`` and ``cwd`` (the process's ``/proc/PID/exe`` and ``cwd`` links) only serve to resolve a
    relative argv[0] or script path; a bare ``python`` is recognised through ``exe``.
    """
    index = TargetIndex.of(targets)
    if not cmdline:
        return ()
    found: dict[tuple[str, str, bool], Evidence] = {}
    argv0 = cmdline[0]
    candidates: list[tuple[str, str]] = [(argv0, "console script")]
    invocation = PythonInvocation()
    if _looks_like_python(argv0, index):
        invocation = parse_python_argv(cmdline[1:])
        if invocation.script is not None:
            candidates.append((invocation.script, f"console script run by {argv0}"))
    elif _basename(argv0) in _SHELLS and len(cmdline) > 1:
        candidates.append((cmdline[1], f"console script run by {argv0}"))
    for candidate, how in candidates:
        path = _absolute(candidate, cwd)
        for name in index.by_script.get(path, ()) if path else ():
            _add(found, Evidence(EvidenceKind.ARGV, name, path or candidate, False, how))
    module = invocation.module
    if module:
        interpreters = {p for p in (_absolute(argv0, cwd), exe) if p}
        for target in index.targets:
            if not interpreters & target.interpreters:
                continue
            for top in target.modules:
                if module == top or module.startswith(top + "."):
                    _add(
                        found,
                        Evidence(
                            EvidenceKind.ARGV, target.distribution, module, False, f"{argv0} -m {module}"
                        ),
                    )
                    break
    return tuple(found.values())


def _environment(path: str, detail: str) -> tuple[Evidence, ...]:
    return (Evidence(EvidenceKind.ENVIRONMENT, "", path, False, detail),)


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return path.startswith(roots) or path + "/" in roots


def match_environment_argv(
    cmdline: tuple[str, ...], scope: EnvironmentScope, exe: str | None = None, cwd: str | None = None
) -> tuple[Evidence, ...]:
    """``environment`` evidence: ``argv[0]`` is the environment's interpreter (a console script's
    shebang puts it there too); for a bare ``python`` found on PATH, its executable (``exe``) is."""
    if not cmdline:
        return ()
    argv0 = cmdline[0]
    path = _absolute(argv0, cwd)
    if path is not None and path in scope.interpreters:
        return _environment(path, "runs the environment's interpreter")
    if "/" not in argv0 and exe is not None and exe in scope.interpreters:
        return _environment(exe, f"{argv0} is the environment's interpreter")
    return ()


def match_environment_maps(text: str, scope: EnvironmentScope) -> tuple[Evidence, ...]:
    """``environment`` evidence: a file under the environment's roots is mapped (its first one)."""
    if not any(root in text for root in scope.roots):
        return ()
    for line in text.split("\n"):
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith(scope.roots):
            path = parts[5]
            path = _unescape(path[: -len(DELETED_SUFFIX)] if path.endswith(DELETED_SUFFIX) else path)
            return _environment(path, "maps a file of the environment")
    return ()


def match_environment_paths(links: Iterable[str], scope: EnvironmentScope) -> tuple[Evidence, ...]:
    """``environment`` evidence: an open file (``/proc/PID/fd`` link) under the environment's roots."""
    for link in links:
        path = link[: -len(DELETED_SUFFIX)] if link.endswith(DELETED_SUFFIX) else link
        if path.startswith("/") and _under(path, scope.roots):
            return _environment(path, "holds open a file of the environment")
    return ()


def match_environment_environ(data: bytes, scope: EnvironmentScope) -> tuple[Evidence, ...]:
    """``environment`` evidence: ``VIRTUAL_ENV`` or a ``PYTHONPATH`` entry (``/proc/PID/environ``: only
    read, never used) is the environment or inside it. Relative entries are not resolved."""
    for entry in data.split(b"\0"):
        name, sep, raw = entry.partition(b"=")
        if not sep or name not in (b"VIRTUAL_ENV", b"PYTHONPATH"):
            continue
        value = os.fsdecode(raw)
        for item in value.split(":") if name == b"PYTHONPATH" else (value,):
            if item.startswith("/") and _under(os.path.normpath(item), scope.roots):
                return _environment(item, f"{os.fsdecode(name)} points into the environment")
    return ()


def parse_cmdline(data: bytes) -> tuple[str, ...]:
    """NUL-separated arguments (a process that rewrote its title may have one space-joined string)."""
    if not data:
        return ()
    if data.endswith(b"\0"):
        data = data[:-1]
    return tuple(os.fsdecode(arg) for arg in data.split(b"\0"))


# -------------------------------------------------------------------------------------------- scanning


@dataclass(frozen=True, slots=True)
class ProcessRecord:
    pid: int
    ppid: int
    uid: int  # effective
    user: str  # its name, or the number when it has none
    name: str  # comm: what the process calls itself (maybe renamed, e.g. "SICEXT::Worker0")
    state: str  # R, S, D, Z (zombie: nothing left to restart), T, ...
    cmdline: tuple[str, ...]
    cgroup_text: str  # raw /proc/PID/cgroup, parsed by safeinstall.cgroups
    start_time: int  # field 22 of stat: (pid, start_time) names one process across pid reuse
    evidence: tuple[Evidence, ...] = ()
    is_self: bool = False

    @property
    def affected(self) -> bool:
        return bool(self.evidence)

    @property
    def certain(self) -> bool:
        """Some of its evidence is certain (not only ``environment``)."""
        return any(e.strength is Strength.CERTAIN for e in self.evidence)

    @property
    def strength(self) -> Strength | None:
        if not self.evidence:
            return None
        return Strength.CERTAIN if self.certain else Strength.POSSIBLE

    @property
    def distributions(self) -> frozenset[str]:
        return frozenset(e.distribution for e in self.evidence if e.distribution)

    @property
    def running_old_code(self) -> bool:
        return any(e.deleted for e in self.evidence)


@dataclass(frozen=True, slots=True)
class ScanProblem:
    pid: int
    reading: str  # "stat", "maps", "fd", ...
    reason: str  # "vanished", "permission denied", or the error


@dataclass(frozen=True, slots=True)
class ScanResult:
    processes: tuple[ProcessRecord, ...]  # every process seen, kernel threads aside
    problems: tuple[ScanProblem, ...]
    scanned_count: int  # /proc entries looked at, kernel threads and vanished ones included
    self_pid: int

    @property
    def affected(self) -> tuple[ProcessRecord, ...]:
        return tuple(p for p in self.processes if p.evidence)

    def by_pid(self) -> dict[int, ProcessRecord]:
        return {p.pid: p for p in self.processes}


class _Vanished(Exception):
    pass


_O_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_O_FILE = os.O_RDONLY | os.O_CLOEXEC
#: below glibc's mmap threshold: a larger buffer costs an mmap/munmap per read
_READ_SIZE = 1 << 14
#: The most of a ``maps`` that is read: a process may map 65,530 files (``vm.max_map_count``) under
#: 4 KiB names, a quarter of a GB of text for every scan; a real one (a vLLM worker) has a few MB.
MAPS_LIMIT = 64 << 20
#: The reason a scan problem gives for a ``maps`` beyond ``MAPS_LIMIT``
TOO_LARGE = f"larger than {MAPS_LIMIT >> 20} MiB: not read"


def _read_at(name: str, dir_fd: int, *, single: bool) -> bytes:
    """A /proc file, relative to the process's directory.

    ``single``: the kernel hands out the whole file in one read when the buffer is large enough
    (``stat`` and ``cgroup`` are one seq_file record, ``cmdline`` is copied until the buffer is full), so
    a short first read is all of it; ``maps`` comes at most a page of records per read: read to EOF.
    """
    fd = os.open(name, _O_FILE, dir_fd=dir_fd)
    try:
        chunk = os.read(fd, _READ_SIZE)
        if (single and len(chunk) < _READ_SIZE) or not chunk:
            return chunk
        chunks = [chunk]
        total = len(chunk)
        while chunk := os.read(fd, _READ_SIZE):
            chunks.append(chunk)
            total += len(chunk)
            if total > MAPS_LIMIT:
                raise _TooLarge(errno.EFBIG, TOO_LARGE)
        return b"".join(chunks)
    finally:
        os.close(fd)


def _fd_links_at(dir_fd: int) -> list[str]:
    fd_dir = os.open("fd", _O_DIRECTORY, dir_fd=dir_fd)
    try:
        links: list[str] = []
        for name in os.listdir(fd_dir):
            try:
                links.append(os.readlink(name, dir_fd=fd_dir))
            except FileNotFoundError:
                continue  # closed in the meantime
        return links
    finally:
        os.close(fd_dir)


class _Process:
    """Reads one process's files through its open ``/proc/PID`` directory.

    Holding the directory open pins the process: should it exit and its PID be reused meanwhile, the
    reads fail (ESRCH) instead of mixing two processes. Errors become problems; a vanished process
    raises :class:`_Vanished` and its record is dropped.
    """

    __slots__ = ("dir_fd", "pid", "problems")

    def __init__(self, pid: int, dir_fd: int, problems: list[ScanProblem]) -> None:
        self.pid = pid
        self.dir_fd = dir_fd
        self.problems = problems

    def fail(self, what: str, exc: OSError) -> None:
        if isinstance(exc, FileNotFoundError | ProcessLookupError):
            self.problems.append(ScanProblem(self.pid, what, "vanished"))
            raise _Vanished from exc
        self.problems.append(ScanProblem(self.pid, what, _reason(exc)))

    def read(self, what: str, single: bool = True) -> bytes | None:
        try:
            return _read_at(what, self.dir_fd, single=single)
        except OSError as exc:
            self.fail(what, exc)
            return None

    def text(self, what: str, single: bool = True) -> str | None:
        data = self.read(what, single)
        return None if data is None else data.decode("utf-8", "surrogateescape")

    def fd_links(self) -> list[str] | None:
        try:
            return _fd_links_at(self.dir_fd)
        except OSError as exc:
            self.fail("fd", exc)
            return None

    def locate(self, directory: str) -> tuple[int, int] | None:
        """(st_dev, st_ino) of ``directory`` in this process's view (its root); None: cannot tell."""
        try:
            st = os.stat("root" + directory, dir_fd=self.dir_fd)
        except (OSError, ValueError):
            return None
        return (st.st_dev, st.st_ino)

    def link(self, what: str) -> str | None:
        try:
            return os.readlink(what, dir_fd=self.dir_fd)
        except OSError as exc:
            self.fail(what, exc)
            return None


class _TooLarge(OSError):
    """A /proc file beyond what a scan reads of it."""


def _reason(exc: OSError) -> str:
    if isinstance(exc, _TooLarge):
        return TOO_LARGE
    if isinstance(exc, FileNotFoundError | ProcessLookupError):
        return "vanished"
    if isinstance(exc, PermissionError):
        return "permission denied"
    return f"{type(exc).__name__}: {exc.strerror or exc}"


def _user(uid: int, cache: dict[int, str]) -> str:
    name = cache.get(uid)
    if name is None:
        try:
            name = pwd.getpwuid(uid).pw_name
        except KeyError:
            name = str(uid)
        cache[uid] = name
    return name


def _looks_like_python_process(argv0: str, name: str) -> bool:
    return _basename(argv0).startswith(("python", "pypy")) or name.startswith(("python", "pypy"))


def _environment_evidence(
    proc: _Process,
    scope: EnvironmentScope,
    stat: StatInfo,
    cmdline: tuple[str, ...],
    maps_text: str | None,
    links: list[str] | None,
) -> tuple[Evidence, ...]:
    """``environment`` evidence, cheapest reads first; ``exe`` and ``environ`` only for a process that
    looks like Python. Dropped when the prefix, seen through the process's root, is another directory."""
    argv0 = cmdline[0] if cmdline else ""
    cwd = proc.link("cwd") if argv0 and "/" in argv0 and not argv0.startswith("/") else None
    found = match_environment_argv(cmdline, scope, cwd=cwd)
    if not found and maps_text:
        found = match_environment_maps(maps_text, scope)
    if not found and links:
        found = match_environment_paths(links, scope)
    if not found and _looks_like_python_process(argv0, stat.name):
        if argv0 and "/" not in argv0:
            found = match_environment_argv(cmdline, scope, exe=proc.link("exe"))
        if not found:
            environ = proc.read("environ")
            found = match_environment_environ(environ, scope) if environ else ()
    if found and scope.prefix_id is not None:
        seen = proc.locate(scope.prefix)
        if seen is not None and seen != scope.prefix_id:
            return ()  # another root (a container) with its own directory at this path
    return found


def _scan_one(
    proc: _Process,
    index: TargetIndex,
    self_pid: int,
    users: dict[int, str],
    scope: EnvironmentScope | None = None,
) -> ProcessRecord | None:
    pid = proc.pid
    stat_text = proc.text("stat")
    if stat_text is None:
        return None
    try:
        stat = parse_stat(stat_text)
    except ValueError as exc:
        proc.problems.append(ScanProblem(pid, "stat", f"malformed: {exc}"))
        return None
    if stat.flags & PF_KTHREAD:
        return None
    # The owner of /proc/PID is the effective uid, non-dumpable processes included (unlike the files
    # inside it): what ps uses, and cheaper than reading status.
    uid = os.fstat(proc.dir_fd).st_uid
    cmdline = parse_cmdline(proc.read("cmdline") or b"")
    cgroup_text = proc.text("cgroup") or ""
    maps_text = proc.text("maps", single=False)
    evidence = match_maps(maps_text, index, proc.locate) if maps_text else ()
    links = proc.fd_links()
    if links:
        evidence += match_fds(links, index)
    if cmdline:
        exe = cwd = None
        if argv_needs_links(cmdline, index):
            exe = proc.link("exe")
            cwd = proc.link("cwd")
        evidence += match_argv(cmdline, index, exe=exe, cwd=cwd)
    evidence = index.as_depends(evidence)
    if scope is not None and not evidence and pid != self_pid:
        evidence = _environment_evidence(proc, scope, stat, cmdline, maps_text, links)
    return ProcessRecord(
        pid=pid,
        ppid=stat.ppid,
        uid=uid,
        user=_user(uid, users),
        name=stat.name,
        state=stat.state,
        cmdline=cmdline,
        cgroup_text=cgroup_text,
        start_time=stat.start_time,
        evidence=evidence,
        is_self=pid == self_pid,
    )


def _pids(proc_root: Path) -> list[int]:
    with os.scandir(proc_root) as entries:
        return sorted(int(entry.name) for entry in entries if entry.name.isdigit())


_Share = tuple[list[ProcessRecord], list[ScanProblem]]


def _scan_pids(
    pids: Sequence[int], root: str, index: TargetIndex, self_pid: int, scope: EnvironmentScope | None
) -> _Share:
    problems: list[ScanProblem] = []
    records: list[ProcessRecord] = []
    users: dict[int, str] = {}
    for pid in pids:
        try:
            dir_fd = os.open(f"{root}/{pid}", _O_DIRECTORY)
        except OSError as exc:
            problems.append(ScanProblem(pid, "directory", _reason(exc)))
            continue
        try:
            record = _scan_one(_Process(pid, dir_fd, problems), index, self_pid, users, scope)
        except _Vanished:
            continue
        finally:
            os.close(dir_fd)
        if record is not None:
            records.append(record)
    return records, problems


#: fewer processes than this are scanned in one process: a fork would cost more than it saves
PARALLEL_THRESHOLD = 256
MAX_WORKERS = 4


def default_workers(count: int) -> int:
    """How many processes share a scan of ``count`` PIDs: one unless it is big and CPUs are free.

    Never more than one while this process runs other threads: forking then is unsafe.
    """
    if count < PARALLEL_THRESHOLD or not can_fork():
        return 1
    return max(1, min(MAX_WORKERS, cpu_count()))


def scan_processes(
    targets: Iterable[Target] | TargetIndex,
    proc_root: Path = Path("/proc"),
    self_pid: int | None = None,
    workers: int | None = None,
    scope: EnvironmentScope | None = None,
) -> ScanResult:
    """Read every process under ``proc_root`` once; match it against ``targets``, and, with ``scope``,
    give ``environment`` evidence to a process without other evidence that runs that environment.

    Processes that vanish or cannot be read are listed in ``problems``; kernel threads are skipped.
    ``self_pid`` (default: this process) is only marked, never skipped. ``workers`` > 1 splits the PIDs
    among that many processes (this one and forked children; default: :func:`default_workers`; always
    one while other threads run); the result is the same either way.
    """
    index = TargetIndex.of(targets)
    me = os.getpid() if self_pid is None else self_pid
    root = str(proc_root)
    pids = _pids(proc_root)
    count = min(len(pids), default_workers(len(pids)) if workers is None else max(1, workers))
    if not can_fork():  # forking a multi-threaded process may deadlock the child
        count = 1
    if count <= 1:
        records, problems = _scan_pids(pids, root, index, me, scope)
    else:
        records, problems = [], []
        for share_records, share_problems in map_forked(
            lambda share: _scan_pids(share, root, index, me, scope), split(pids, count)
        ):
            records.extend(share_records)
            problems.extend(share_problems)
        records.sort(key=lambda record: record.pid)
        problems.sort(key=lambda problem: problem.pid)
    return ScanResult(
        processes=tuple(records), problems=tuple(problems), scanned_count=len(pids), self_pid=me
    )
