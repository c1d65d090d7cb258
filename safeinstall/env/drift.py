"""Drift: what differs between installed files and what was installed. Pure functions only.

Inputs are typed expectations (from an installed RECORD or from a wheel) and observed
:class:`~safeinstall.env.hashing.FileState`; outputs are :class:`Finding` values."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import PurePath
from typing import NamedTuple

from safeinstall.env.bytecode import pyc_name
from safeinstall.env.containment import bases
from safeinstall.env.hashing import FileState
from safeinstall.system.safefs import everyone_may_write


class FindingKind(StrEnum):
    MISSING = "missing"  # listed, not there
    MODIFIED = "modified"  # sha256 or size differs (or no longer a regular file)
    EXTRA = "extra"  # in the distribution's own directories, listed by no RECORD (or not in the wheel)
    OUTSIDE = "outside"  # a RECORD path that resolves outside the environment: reported, never read
    UNREADABLE = "unreadable"  # exists but could not be read
    MALFORMED = "malformed"  # a RECORD line that could not be parsed
    VERSION_MISMATCH = "version-mismatch"  # installed version is not the wheel's
    HARDLINKED = "hardlinked"  # shares its inode (uv's cache, a kept backup): editing it edits that too
    WHEEL_RECORD = "wheel-record"  # the wheel's own RECORD is wrong: the wheel's fault, not drift
    SHARED = "shared"  # listed by another distribution's RECORD too, whose copy is there: not drift
    #: of a distribution dpkg installed: differs from its RECORD, but dpkg's own md5sums say it is as the
    #: package shipped it (Debian changes files after writing RECORD: strips libraries): not drift
    DPKG_INTACT = "dpkg-intact"
    MODE = "mode"  # its mode is not an installer's: a script not executable, setuid/setgid, others write
    #: its RECORD line changed since root last found the distribution clean: the reference
    #: itself was rewritten, whatever the file now matches
    RECORD_CHANGED = "record-changed"
    #: differs from its installed RECORD, but its inode never changed after the installer wrote that
    #: RECORD (change times, which no account sets): the wheel's own RECORD is wrong about it. Not
    #: drift; its own exit status until root acknowledges it (``--acknowledge-wheel-faults``), then
    #: quiet while the file keeps the identity and digest acknowledged
    WHEEL_FAULT = "wheel-fault"


#: Findings that are worth a warning but are not drift (exit code stays 0).
WARNING_KINDS = frozenset(
    {FindingKind.HARDLINKED, FindingKind.WHEEL_RECORD, FindingKind.SHARED, FindingKind.DPKG_INTACT}
)


class Expectation(NamedTuple):
    """One file that should be installed, with what it should contain (one per file verified: a
    NamedTuple, as :class:`~safeinstall.env.hashing.FileState` is)."""

    location: str  # absolute, normalised
    algorithm: str | None  # None: unhashed (like RECORD itself): existence is all that is checked
    digest: str | None
    size: int | None


@dataclass(frozen=True, slots=True)
class Finding:
    distribution: str
    path: str
    kind: FindingKind
    detail: str = ""
    baseline: str = "record"  # "record" or "wheel"
    expected_sha256: str | None = None
    actual_sha256: str | None = None
    expected_size: int | None = None
    actual_size: int | None = None
    wheel_member: str | None = None  # with --wheel: the archive member this file comes from
    shared_with: str | None = None  # kind shared: the other distribution whose copy of the file is there
    #: kind hardlinked: every such file of the distribution, with its number of links (one finding for
    #: them all, ``path`` the first; ``--json`` and ``-v`` list each: :func:`per_file`)
    linked: tuple[tuple[str, int], ...] = ()
    #: kind wheel-fault: root acknowledged it, as the file is now (quiet: exit 0 for it)
    acknowledged: bool = False

    @property
    def is_drift(self) -> bool:
        return self.kind not in WARNING_KINDS and self.kind != FindingKind.WHEEL_FAULT

    @property
    def is_wheel_fault(self) -> bool:
        """The wheel's fault, not yet acknowledged: the check's own exit status (5) when no drift."""
        return self.kind == FindingKind.WHEEL_FAULT and not self.acknowledged

    @property
    def files(self) -> int:
        """How many files it is about (a distribution's ``hardlinked`` finding: all of them)."""
        return len(self.linked) or 1


def compare(distribution: str, expected: Expectation, state: FileState, baseline: str) -> Finding | None:
    """One expected file against what is on disk (called once per file verified: it makes no closure,
    and nothing at all for a file that matches)."""
    if not state.exists:
        kind, detail = FindingKind.MISSING, "listed but not installed"
    elif state.error is not None:
        kind, detail = FindingKind.UNREADABLE, state.error
    elif not state.is_file:
        kind, detail = FindingKind.MODIFIED, "no longer a regular file"
    elif expected.size is not None and state.size != expected.size:
        kind, detail = FindingKind.MODIFIED, f"size {state.size}, expected {expected.size}"
    elif expected.digest is not None and state.digest is not None and state.digest != expected.digest:
        kind, detail = FindingKind.MODIFIED, f"{expected.algorithm} differs"
    else:
        return None
    return Finding(
        distribution=distribution,
        path=expected.location,
        kind=kind,
        detail=detail,
        baseline=baseline,
        expected_sha256=expected.digest,
        actual_sha256=state.digest,
        expected_size=expected.size,
        actual_size=state.size,
    )


def shared_file(
    finding: Finding,
    expected: Expectation,
    listed_by: Sequence[tuple[str, str, Expectation]],
    settle: bool = True,
) -> Finding:
    """Pure: a ``modified`` file other RECORDs list too (``listed_by``): what one of them lists is that
    one's (``shared``, not drift). ``settle`` False (``--wheel``): it stays ``modified``, since whoever writes
    site-packages writes RECORDs."""
    if finding.kind != FindingKind.MODIFIED or not listed_by:
        return finding
    for name, version, other in listed_by:
        if (
            other.algorithm == expected.algorithm
            and other.digest is not None
            and other.digest == finding.actual_sha256
            and other.size in (None, finding.actual_size)
        ):
            if not settle:
                return replace(
                    finding,
                    detail=f"{finding.detail}; {name} {version}'s RECORD lists this very file, but an "
                    "installed RECORD does not overrule the wheel",
                )
            return replace(
                finding,
                kind=FindingKind.SHARED,
                detail=f"{name} {version} lists it too, and the file is {name}'s (installed over "
                f"{finding.distribution}'s copy)",
                shared_with=name,
            )
    names = ", ".join(f"{name} {version}" for name, version, _ in listed_by)
    return replace(finding, detail=f"{finding.detail}; {names} lists it too, and it matches neither")


#: What a ``wheel-fault`` says (in its detail), then how to settle it.
UNTOUCHED = "not changed since it was installed (its inode no newer than its RECORD)"
RECORD_MAY_BE_WRONG_HINT = (
    "the wheel's own RECORD is wrong about it (uv installs such a wheel without a word): the wheel's "
    "fault, not drift; compare with the wheel (safeinstall {name} --verify-only --wheel W), then "
    "acknowledge it (safeinstall {name} --verify-only --acknowledge-wheel-faults [--python PY]), or every "
    "distribution's at once (safeinstall --verify-only --all --acknowledge-wheel-faults [--python PY]): "
    "quiet until the file changes"
)
RECORD_MAY_BE_WRONG = f"{UNTOUCHED}: {RECORD_MAY_BE_WRONG_HINT}"


def untouched_since_install(finding: Finding, ctime_ns: int, record_ctime_ns: int | None) -> Finding:
    """Pure: a file that differs from its RECORD but whose ctime (which no account sets) is no later than
    the RECORD's was not edited here: ``wheel-fault``, saying how to settle it. Never bytecode."""
    if (
        finding.kind != FindingKind.MODIFIED
        or finding.baseline != "record"
        or record_ctime_ns is None
        or ctime_ns == 0
        or ctime_ns > record_ctime_ns
        or pyc_name(finding.path) is not None
    ):
        return finding
    return replace(
        finding,
        kind=FindingKind.WHEEL_FAULT,
        detail=f"{finding.detail}; {RECORD_MAY_BE_WRONG.format(name=finding.distribution)}",
    )


class FaultIdentity(NamedTuple):
    """A ``wheel-fault`` file as root acknowledged it: its identity and its sha256 (RECORD spelling)."""

    location: str
    device: int
    inode: int
    size: int
    mtime_ns: int
    ctime_ns: int
    sha256: str


def fault_identity(finding: Finding, state: FileState) -> FaultIdentity | None:
    """Pure: what acknowledging a ``wheel-fault`` keeps of its file, or None when it cannot be kept (not
    a regular file read with its sha256, or not that finding's)."""
    if (
        finding.kind != FindingKind.WHEEL_FAULT
        or state.path != finding.path
        or not state.is_file
        or state.algorithm != "sha256"
        or state.digest is None
        or state.size is None
        or not state.ctime_ns
    ):
        return None
    return FaultIdentity(
        state.path, state.device, state.inode, state.size, state.mtime_ns, state.ctime_ns, state.digest
    )


def acknowledged(finding: Finding, state: FileState | None, kept: Mapping[str, FaultIdentity]) -> Finding:
    """Pure: a ``wheel-fault`` root acknowledged, the file as it was then (device, inode, size, mtime,
    ctime and sha256 all the same): quiet; any other finding, or a file changed since, as it is."""
    if finding.kind != FindingKind.WHEEL_FAULT or state is None:
        return finding
    now = fault_identity(finding, state)
    if now is None or kept.get(finding.path) != now:
        return finding
    return replace(finding, acknowledged=True)


def against_dpkg(finding: Finding, md5_matches: bool | None, package: str) -> Finding:
    """Pure: a ``modified`` file of a distribution dpkg installed, as dpkg's own md5sums see it (the
    check of ``dpkg --verify``): as the package shipped it (``md5_matches`` True: ``dpkg-intact``, a
    warning: Debian changed it after writing RECORD), changed here too (False: stays drift, and says
    that dpkg flags it too), or not in dpkg's list (None: stays drift)."""
    if finding.kind != FindingKind.MODIFIED:
        return finding
    if md5_matches:
        return replace(
            finding,
            kind=FindingKind.DPKG_INTACT,
            detail=f"{finding.detail}; dpkg's md5sums of {package} say it is as the package shipped it",
        )
    said = (
        "dpkg's md5sums of {p} differ too" if md5_matches is False else "dpkg's md5sums of {p} do not list it"
    )
    return replace(finding, detail=f"{finding.detail}; {said.format(p=package)}")


def hardlinked(distribution: str, linked: Sequence[tuple[str, int]]) -> Finding | None:
    """Pure: one warning for every file of a distribution that shares its inode (:data:`SHARED_WITH`), or
    None. One per distribution, not per file: a venv uv installed hardlinks every file (61k on vLLM's), and a
    finding each cost a check that reads nothing most of its time; :func:`per_file` lists each."""
    if not linked:
        return None
    ordered = tuple(sorted(linked))
    return Finding(
        distribution=distribution,
        path=ordered[0][0],
        kind=FindingKind.HARDLINKED,
        detail=_linked_detail(ordered[0][1]) if len(ordered) == 1 else f"{len(ordered)} files: {_SHARED}",
        linked=ordered,
    )


#: what else may hold a hardlinked file's inode: verify cannot tell which, so it names both (a backup of
#: a prepared run, or of one that stopped before its install, is hard links of the live files)
SHARED_WITH = "uv's cache, or a backup safeinstall keeps of this environment in its state directory"
_SHARED = (
    f"shared with another file ({SHARED_WITH}); editing it in place edits that one too (reinstall with "
    "--link-mode copy)"
)


def _linked_detail(links: int) -> str:
    return f"{links} links: {_SHARED}"


def report_order(finding: Finding) -> tuple[bool, str]:
    """Pure: the order of a distribution's findings in a report: a version mismatch first, then by path."""
    return finding.kind != FindingKind.VERSION_MISMATCH, finding.path


def per_file(findings: Iterable[Finding]) -> list[Finding]:
    """Pure: the findings with each ``hardlinked`` one as one finding per file (as ``--json`` has them),
    in :func:`report_order` when there was one to list."""
    listed: list[Finding] = []
    expanded = False
    for f in findings:
        if f.kind != FindingKind.HARDLINKED or not f.linked:
            listed.append(f)
            continue
        expanded = True
        listed.extend(
            Finding(f.distribution, path, FindingKind.HARDLINKED, _linked_detail(links))
            for path, links in f.linked
        )
    return sorted(listed, key=_file_order) if expanded else listed


def _file_order(finding: Finding) -> tuple[bool, str, int]:
    """Pure: :func:`report_order`, and for one file its content's finding, then its link, then its mode
    (the order of a finding per file)."""
    rank = 1 if finding.kind == FindingKind.HARDLINKED else 2 if finding.kind == FindingKind.MODE else 0
    return finding.kind != FindingKind.VERSION_MISMATCH, finding.path, rank


def mode_finding(distribution: str, state: FileState, script: bool) -> Finding | None:
    """Pure: what ``rpm -V`` checks beyond content, for a file a RECORD lists (a symlink or anything
    not a regular file there is ``modified`` already, never followed): a mode no installer gives it.
    ``script``: it is in the environment's scripts directory, where an installer makes it executable."""
    if not state.is_file or not state.mode:
        return None
    mode = state.mode
    if mode & (stat.S_ISUID | stat.S_ISGID):
        detail = "setuid or setgid"
    elif everyone_may_write(mode):
        detail = "writable by others"
    elif script and not mode & stat.S_IXUSR:
        detail = "a script its owner cannot execute"
    else:
        return None
    return Finding(distribution, state.path, FindingKind.MODE, f"mode {stat.S_IMODE(mode):04o}: {detail}")


def own_roots(
    files_by_distribution: Mapping[str, Iterable[str]], site_dirs: Iterable[str]
) -> dict[str, list[str]]:
    """Each distribution's own package directories: strictly below a site directory, with no other
    distribution's files below (so ``nvidia/`` is never one); ``.dist-info`` left out."""
    return roots_of(directory_owners(files_by_distribution, site_dirs), files_by_distribution)


def roots_of(owners: Mapping[str, set[str]], names: Iterable[str]) -> dict[str, list[str]]:
    """Pure: :func:`own_roots` from the :func:`directory_owners` already found (one check finds them
    once: the extras search and the walk of where Python looks first both take them)."""
    roots: dict[str, list[str]] = {name: [] for name in names}
    for directory, names in owners.items():
        if len(names) != 1 or directory.endswith(".dist-info"):
            continue
        parent_owners = owners.get(os.path.dirname(directory))
        if parent_owners is None or len(parent_owners) > 1:
            roots[next(iter(names))].append(directory)
    return {name: sorted(dirs) for name, dirs in roots.items()}


def directory_owners(
    files_by_distribution: Mapping[str, Iterable[str]], site_dirs: Iterable[str]
) -> dict[str, set[str]]:
    """Pure: every directory strictly below a site directory that holds a listed file (at any depth
    below it), with the distributions whose files lie below it: those of two or more are shared
    (namespace directories such as ``nvidia/``)."""
    sites = bases(site_dirs)
    owners: dict[str, set[str]] = {}
    for name, files in files_by_distribution.items():
        seen: set[str] = set()
        for file in files:
            parent = file.rpartition("/")[0]  # os.path.dirname of a normalised absolute path, faster
            if parent in seen or not file.startswith(sites):  # most files share a seen directory
                continue
            site = next(s for s in sites if file.startswith(s))[:-1]
            while parent != site and parent not in seen and len(parent) > len(site):
                seen.add(parent)
                owners.setdefault(parent, set()).add(name)
                parent = os.path.dirname(parent)
    return owners


def pyc_source(path: PurePath) -> PurePath | None:
    """``pkg/__pycache__/mod.cpython-311.pyc`` -> ``pkg/mod.py``; None for anything else."""
    if path.suffix != ".pyc" or path.parent.name != "__pycache__":
        return None
    return path.parent.parent / (path.name.split(".", 1)[0] + ".py")


def extras(
    distribution: str, candidates: Iterable[str], listed: frozenset[str]
) -> tuple[list[Finding], list[str]]:
    """Files found under a distribution's own directories that no RECORD lists, and apart from them
    the ``__pycache__`` bytecode found there (listed or not: each is judged by what it holds,
    :mod:`safeinstall.env.bytecode`)."""
    found: list[Finding] = []
    bytecode: list[str] = []
    for text in candidates:
        if text.endswith(".pyc") and pyc_name(text) is not None:
            bytecode.append(text)
            continue
        if text in listed:
            continue
        found.append(Finding(distribution, text, FindingKind.EXTRA, IN_NO_RECORD))
    return found, bytecode


#: What an ``extra`` file found in a distribution's own directories says.
IN_NO_RECORD = "in the distribution's directories but in no RECORD"


def bytecode_finding(distribution: str, location: str, why: str, listed: bool) -> Finding:
    """Pure: a ``.pyc`` that is not the bytecode of its listed, verified source: ``modified`` when a
    RECORD lists it, else ``extra``; the reason said."""
    kind = FindingKind.MODIFIED if listed else FindingKind.EXTRA
    return Finding(distribution, location, kind, f"bytecode: {why}")
