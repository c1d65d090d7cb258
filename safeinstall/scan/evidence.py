"""Evidence that a process uses a target, from what ``/proc`` shows of it (``maps``, ``fd/``,
``argv``, ``environ``): pure parsing and matching over a pre-built :class:`TargetIndex` (the kinds of
evidence: :mod:`safeinstall.scan.processes`)."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from enum import StrEnum

from safeinstall.env.containment import base
from safeinstall.env.dependents import describe_chain
from safeinstall.scan.targets import EnvironmentScope, Target

DELETED_SUFFIX = " (deleted)"
_SHELLS = frozenset({"sh", "bash", "dash", "zsh", "ksh"})


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
                owners.append((base(directory), name))
                if "\n" in directory:
                    owners.append((base(_escape(directory)), name))
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


def _escape(path: str) -> str:
    return path.replace("\n", "\\012")


def _unescape(path: str) -> str:
    # the kernel shows a newline in a mapped path as "\012"
    return path.replace("\\012", "\n") if "\\012" in path else path


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
    or when it cannot tell, an inode match is kept: the safe side."""
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
        path = link.removesuffix(DELETED_SUFFIX)
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
    relative argv[0] or script path; a bare ``python`` is recognised through ``exe``."""
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
                    how = f"{argv0} -m {module}"
                    _add(found, Evidence(EvidenceKind.ARGV, target.distribution, module, False, how))
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
            path = _unescape(parts[5].removesuffix(DELETED_SUFFIX))
            return _environment(path, "maps a file of the environment")
    return ()


def match_environment_paths(links: Iterable[str], scope: EnvironmentScope) -> tuple[Evidence, ...]:
    """``environment`` evidence: an open file (``/proc/PID/fd`` link) under the environment's roots."""
    for link in links:
        path = link.removesuffix(DELETED_SUFFIX)
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
