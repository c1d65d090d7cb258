"""Verification: installed files against their RECORD (or a wheel), like ``rpm -V``.

Gathers expectations, observes every file once in parallel (:mod:`safeinstall.env.hashing`), and leaves
the judging to the pure functions of :mod:`safeinstall.env.drift`."""

from __future__ import annotations

import errno
import functools
import os
import stat
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from safeinstall.env.bytecode import Judged, KnownPyc, Source, judge_files, pyc_name
from safeinstall.env.containment import Containment, base, bases, is_below
from safeinstall.env.distributions import (
    NO_RECORD,
    InstalledDistribution,
    MetadataReader,
    ParsedRecords,
    dist_info_name,
    egg_info_paths,
    find_distribution,
    find_distributions,
    find_named,
)
from safeinstall.env.drift import (
    IN_NO_RECORD,
    Expectation,
    Finding,
    FindingKind,
    against_dpkg,
    bytecode_finding,
    compare,
    directory_owners,
    extras,
    hardlinked,
    mode_finding,
    pyc_source,
    report_order,
    roots_of,
    shared_file,
    untouched_since_install,
)
from safeinstall.env.environment import Environment, Walked, distribution_sites, identity
from safeinstall.env.hashing import FileState, Known, cycle_collection_paused, observe_files
from safeinstall.env.records import built, digest_bytes, encode_digest
from safeinstall.env.sitetop import Unlisted, look
from safeinstall.env.systemsite import SystemPackage, dpkg_md5sums, dpkg_owners, from_base, system_packages
from safeinstall.errors import ExitCode, WheelError

if TYPE_CHECKING:  # the wheel module (zipfile, packaging.tags) is loaded only when a wheel is given
    from safeinstall.env.vouched import Vouched
    from safeinstall.env.wheel import Wheel, WheelProblem

ProgressCallback = Callable[[int, int], None]  # (files done, files total)


@dataclass(frozen=True, slots=True)
class WheelSummary:
    path: str
    name: str
    version: str
    record_ok: bool
    problems: tuple[WheelProblem, ...]


@dataclass(frozen=True, slots=True)
class DistributionReport:
    name: str
    version: str
    dist_info: str
    files_checked: int
    findings: tuple[Finding, ...]
    against: str  # "record", or the wheel's file name
    site: str = ""  # the site directory that holds its .dist-info
    #: the system package that installed it (dpkg's), None when none did
    system_package: SystemPackage | None = None
    #: in a site directory of the base installation (a system interpreter's own, or a venv's base with
    #: include-system-site-packages), not where uv installs
    from_base: bool = False

    @property
    def drift(self) -> bool:
        return any(f.is_drift for f in self.findings)

    @property
    def wheel_fault(self) -> bool:
        """A ``wheel-fault`` root has not acknowledged (as its file is now)."""
        return any(f.is_wheel_fault for f in self.findings)


@dataclass(frozen=True, slots=True)
class VerifyReport:
    python: str
    prefix: str
    distributions: tuple[DistributionReport, ...]
    wheel: WheelSummary | None
    #: every file as it was observed (location -> state): a backup reuses these hashes
    observed: dict[str, FileState] = field(default_factory=dict, repr=False, compare=False)
    #: every site directory looked in, in the interpreter's order
    site_dirs: tuple[str, ...] = ()
    #: with every distribution asked for: the ``.egg-info`` ones found, not checked (they have no RECORD)
    egg_info: tuple[str, ...] = ()
    #: the ``.dist-info`` of each distribution proven unchanged by ``lstat`` alone (``unchanged``)
    proven: frozenset[str] = field(default_factory=frozenset, repr=False, compare=False)
    #: the distributions checked file by file whose every file matched its RECORD (no finding of a
    #: file nor of a RECORD line): what :mod:`safeinstall.env.unchanged` may keep
    clean: tuple[InstalledDistribution, ...] = field(default=(), repr=False, compare=False)
    #: the ``.pyc`` files read and judged the bytecode of their verified source: what
    #: :mod:`safeinstall.store.bytecode` may keep
    judged: tuple[Judged, ...] = field(default=(), repr=False, compare=False)
    #: the ``.pyc`` files judged: by compiling their source, by a judgement kept (identity), by their
    #: header alone (written by their installer, untouched since)
    bytecode: tuple[int, int, int] = (0, 0, 0)

    @property
    def findings(self) -> tuple[Finding, ...]:
        return tuple(f for d in self.distributions for f in d.findings)

    @property
    def drift(self) -> bool:
        return any(d.drift for d in self.distributions)

    @property
    def wheel_fault(self) -> bool:
        return any(d.wheel_fault for d in self.distributions)

    @property
    def exit_code(self) -> ExitCode:
        """Drift first; else a wheel's fault not acknowledged (its own status); else clean."""
        if self.drift:
            return ExitCode.DRIFT
        return ExitCode.WHEEL_FAULT if self.wheel_fault else ExitCode.OK


@dataclass(frozen=True, slots=True)
class _Plan:
    """What to check for one distribution: expectations plus findings known without reading."""

    dist: InstalledDistribution
    expectations: tuple[Expectation, ...]
    members: dict[str, str]  # location -> wheel member (with --wheel)
    findings: tuple[Finding, ...]
    against: str
    #: proven unchanged by ``lstat`` alone (:mod:`safeinstall.env.unchanged`): its files that share
    #: their inode; None: checked file by file
    proven: tuple[tuple[str, int], ...] | None = None
    proven_files: int = 0


def _record_plan(
    dist: InstalledDistribution, env: Environment, containment: Containment, system_owned: bool = False
) -> tuple[list[Expectation], list[Finding]]:
    expectations: list[Expectation] = []
    findings = [
        Finding(dist.name, f"{dist.dist_info}/RECORD:{p.line}", FindingKind.MALFORMED, p.reason)
        for p in dist.record.problems
    ]
    if system_owned and dist.record_problem == NO_RECORD:
        pass  # a system package's files are its package manager's to check (debsums), not drift
    elif dist.record_problem is not None:  # nothing to check its files against: never "OK"
        kind = FindingKind.MISSING if dist.record_problem == NO_RECORD else FindingKind.UNREADABLE
        detail = "no RECORD" if kind == FindingKind.MISSING else f"RECORD: {dist.record_problem}"
        why = f"{detail}: none of its files can be checked"
        findings.append(Finding(dist.name, f"{dist.dist_info}/RECORD", kind, why))
    for entry, location in zip(dist.record.entries, dist.locations, strict=True):
        if containment.outside(location):
            why = f"resolves to {location}, outside {containment.prefix}"
            findings.append(Finding(dist.name, entry.path, FindingKind.OUTSIDE, why))
            continue
        if entry.hash is None:
            if not _may_be_unhashed(dist, location):
                why = "its RECORD line has no hash: what it holds cannot be checked"
                findings.append(Finding(dist.name, location, FindingKind.MALFORMED, why))
            continue  # RECORD itself, its signatures and bytecode are unhashed as installers write them
        expectations.append(
            built(Expectation, (location, entry.hash.algorithm, entry.hash.digest, entry.size))
        )
    return expectations, findings


def _may_be_unhashed(dist: InstalledDistribution, location: str) -> bool:
    """Pure: a RECORD line an installer writes without a hash: RECORD itself, its signatures
    (``RECORD.jws``, ``RECORD.p7s``) and ``__pycache__`` bytecode (judged by what it holds instead)."""
    directory, _, name = location.rpartition("/")
    if directory == os.fspath(dist.dist_info) and name in ("RECORD", "RECORD.jws", "RECORD.p7s"):
        return True
    return name.endswith(".pyc") and pyc_name(location) is not None


_SCRIPT_MAX_BYTES = 1 << 20


def _is_launcher(launcher: bytes) -> bool:
    """An installer's launcher in place of ``#!python``: one shebang line or, for an interpreter path
    too long for a shebang (or with a space in it), the three-line ``#!/bin/sh`` + ``exec`` form;
    nothing else (a line inserted after a one-line shebang is drift)."""
    lines = launcher.split(b"\n")
    if lines[-1] != b"" or not launcher.startswith(b"#!"):
        return False
    if len(lines) == 2:
        return True
    return (
        len(lines) == 4
        and lines[0] == b"#!/bin/sh"
        and lines[1].startswith(b"'''exec' ")
        and lines[1].endswith(b' "$0" "$@"')
        and lines[2] == b"' '''"
    )


def _script_expectation(wheel: Wheel, member: str, location: Path, env: Environment) -> Expectation | None:
    """Scripts shipped as ``#!python`` get their first line rewritten on install into a launcher for
    the environment's interpreter: the launcher is the installer's, the rest must be the wheel's."""
    from safeinstall.system.safefs import NotRegularFile, Tree

    content = wheel.python_scripts.get(member)
    if content is None:
        return None
    try:  # by descriptor below the prefix: a symlink is not followed, a FIFO not opened
        with Tree(env.prefix) as tree:
            relative = tree.relative(location)
            if relative is None:
                return None
            installed = tree.read_bytes(relative, _SCRIPT_MAX_BYTES + len(content))
    except (OSError, NotRegularFile, ValueError):
        return None
    if not installed.startswith(b"#!"):
        return None
    rest = content.split(b"\n", 1)[1] if b"\n" in content else b""
    launcher = installed[: len(installed) - len(rest)] if installed.endswith(rest) else b""
    if not _is_launcher(launcher):
        launcher = installed.split(b"\n", 1)[0] + b"\n"  # changed beyond the launcher: that is drift
    expected = launcher + rest
    return Expectation(str(location), "sha256", digest_bytes(expected), len(expected))


def _wheel_plan(
    dist: InstalledDistribution, env: Environment, wheel: Wheel, containment: Containment
) -> tuple[list[Expectation], dict[str, str], list[Finding]]:
    from safeinstall.env.wheel import install_locations, is_installer_written

    expectations: list[Expectation] = []
    members: dict[str, str] = {}
    findings: list[Finding] = []
    if dist.version != wheel.version:
        why = f"installed {dist.version}, the wheel is {wheel.version}"
        findings.append(
            Finding(dist.name, str(dist.dist_info), FindingKind.VERSION_MISMATCH, why, baseline="wheel")
        )
    signatures = {f"{wheel.dist_info}/RECORD.jws", f"{wheel.dist_info}/RECORD.p7s"}
    other_version = dist.version != wheel.version  # then the metadata differs: the mismatch says it all
    locations = install_locations(wheel, env)
    scripts = f"{wheel.data_dir}/scripts/"
    for name, member in wheel.members.items():
        if is_installer_written(wheel, name) or name in signatures:
            continue
        if other_version and is_below(name, wheel.dist_info):
            continue
        location = locations.get(name)
        if location is None:
            continue
        members[location] = name
        expectation: Expectation | None = None
        if name.startswith(scripts):
            expectation = _script_expectation(wheel, name, Path(location), env)
        expectations.append(expectation or Expectation(location, "sha256", member.sha256, member.size))
    findings.extend(
        Finding(dist.name, p.path, FindingKind.WHEEL_RECORD, p.reason, baseline="wheel")
        for p in wheel.problems
    )
    # Installed files the wheel does not have: old leftovers recorded by the installer.
    generated_scripts = {os.path.join(env.scripts, script) for script in wheel.console_scripts}
    installed_dist_info = base(dist.dist_info.name)
    for entry, text in zip(dist.record.entries, dist.locations, strict=True):
        if text in members or text in generated_scripts:
            continue
        if entry.path.endswith(".pyc") and pyc_source(PurePosixPath(entry.path)) is not None:
            continue
        in_dist_info = entry.path.startswith(installed_dist_info)
        if in_dist_info and other_version:
            continue
        if in_dist_info and is_installer_written(wheel, f"{wheel.dist_info}/{entry.path.rpartition('/')[2]}"):
            continue
        if containment.outside(text):
            continue
        extra = "installed, but not in the wheel"
        findings.append(Finding(dist.name, text, FindingKind.EXTRA, extra, baseline="wheel"))
    return expectations, members, findings


def containment_root(env: Environment, dist: InstalledDistribution) -> Path:
    """Pure: the prefix a distribution's files must stay in: the environment's, or for a distribution
    of the base installation (a venv's, with include-system-site-packages) the base's."""
    return env.base_prefix if from_base(env, dist) else env.prefix


def _plan(
    dist: InstalledDistribution, env: Environment, wheel: Wheel | None, system_owned: bool = False
) -> _Plan:
    containment = Containment(containment_root(env, dist))
    record_expectations, findings = _record_plan(dist, env, containment, system_owned)
    if wheel is None:
        return _Plan(dist, tuple(record_expectations), {}, tuple(findings), "record")
    expectations, members, wheel_findings = _wheel_plan(dist, env, wheel, containment)
    # RECORD-only findings (outside, malformed) still stand; file content is judged against the wheel.
    return _Plan(dist, tuple(expectations), members, (*findings, *wheel_findings), wheel.path.name)


#: The entries the walks of one check may list in all, and how long they may take (the owner of the
#: environment decides how many there are): past either, what is left is reported as not checked.
WALK_ENTRIES = 8_000_000
WALK_SECONDS = 600.0


def _walk(root: str, budget: list[int] | None = None, deadline: float | None = None) -> list[str]:
    """Every non-directory below ``root`` (a symlink is listed, never entered; [] when ``root`` cannot be
    opened or is a symlink), by a stack of descriptors below it
    (:func:`safeinstall.system.safefs.walk_below`: OSError when a directory below cannot be listed,
    :class:`~safeinstall.system.safefs.TreeTooLarge` past its bounds, ``budget`` and ``deadline``)."""
    from safeinstall.system.safefs import walk_below

    try:
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:  # a symlink too: a package's directory linked elsewhere is said, never walked
        return []
    found: list[str] = []
    walk_below(fd, root, found, [], deadline=deadline, budget=budget)
    return found


def walk_listed(
    listed: Mapping[str, Sequence[tuple[str, bool]]],
    root: str,
    budget: list[int] | None = None,
    deadline: float | None = None,
    *,
    seen: Mapping[str, os.stat_result] | None = None,
) -> list[str] | None:
    """:func:`_walk` of ``root`` from listings taken moments before (``listed``: directory -> its entries,
    each with whether it is a real directory), within the same bounds (:class:`TreeTooLarge`); None
    when a directory of it was not listed, or is not now the one listed (``seen``), then it is walked."""
    from safeinstall.system.safefs import WALK_MAX_DEPTH, WALK_MAX_ENTRIES, TreeTooLarge

    if root not in listed:
        return None
    most = WALK_MAX_ENTRIES if budget is None else min(WALK_MAX_ENTRIES, budget[0])
    found: list[str] = []
    todo: list[tuple[str, int]] = [(root, 1)]
    entries = 0
    while todo:
        here, depth = todo.pop()
        names = listed.get(here)
        if names is None or not _still(here, seen):
            return None
        for name, is_dir in names:
            entries += 1
            if budget is not None:
                budget[0] -= 1
            if entries > most:
                raise TreeTooLarge(errno.EFBIG, f"more than {most} entries below it", root)
            if deadline is not None and not entries % 1024 and time.monotonic() > deadline:
                raise TreeTooLarge(errno.ETIMEDOUT, "its walk ran past its deadline", root)
            path = f"{here}/{name}"
            if not is_dir:
                found.append(path)
            elif depth > WALK_MAX_DEPTH:
                raise TreeTooLarge(errno.ELOOP, f"more than {WALK_MAX_DEPTH} levels deep", root)
            else:
                todo.append((path, depth + 1))
    return found


def _still(here: str, seen: Mapping[str, os.stat_result] | None) -> bool:
    """Whether the directory at ``here`` is the one listed: the same inode, its entries and its place
    unchanged since (a swap of it, or of a directory above it, moves one of them)."""
    if seen is None or here not in seen:
        return False
    try:
        now = os.lstat(here)
    except OSError:
        return False
    return stat.S_ISDIR(now.st_mode) and identity(now) == identity(seen[here])


def _listed_locations(installed: Sequence[InstalledDistribution]) -> frozenset[str]:
    return frozenset(location for d in installed for location in d.locations)


def _listed_by(
    installed: Sequence[InstalledDistribution], mismatched: Collection[str]
) -> dict[str, list[tuple[str, str, Expectation]]]:
    """Every distribution whose RECORD lists one of the ``mismatched`` locations, with its entry:
    location -> (name, version, entry). One pass over the RECORDs, only when something did not match."""
    found: dict[str, list[tuple[str, str, Expectation]]] = {}
    if not mismatched:
        return found
    for dist in installed:
        for entry, location in zip(dist.record.entries, dist.locations, strict=True):
            if location not in mismatched or entry.hash is None:
                continue
            expectation = Expectation(location, entry.hash.algorithm, entry.hash.digest, entry.size)
            found.setdefault(location, []).append((dist.name, dist.version, expectation))
    return found


def verify_environment(
    env: Environment,
    names: Sequence[str] | None,
    wheel: Wheel | None = None,
    on_progress: ProgressCallback | None = None,
    workers: int | None = None,
    installed: Sequence[InstalledDistribution] | None = None,
    expected: Mapping[str, Expectation] | None = None,
    settle_shared: bool = True,
    vouched: Callable[[], Mapping[str, tuple[Vouched, ...]]] | None = None,
    known: Known | None = None,
    unchanged: Callable[[InstalledDistribution], Sequence[tuple[str, int]] | None] | None = None,
    known_pyc: KnownPyc | None = None,
    bytecode: bool = False,
    recorded: Callable[[InstalledDistribution, bool], Sequence[Finding]] | None = None,
    install_window: Callable[[InstalledDistribution, int | None], tuple[int, int] | None] | None = None,
    anchored_before: Callable[[InstalledDistribution], bool] | None = None,
    listings: Walked | None = None,
    parses: ParsedRecords | None = None,
) -> VerifyReport:
    """Verify the named distributions (or all, with ``names=None``) of ``env``. docs/verify.md.

    ``wheel``: the reference; ``settle_shared`` False: nothing ``shared``; ``vouched``, ``known``,
    ``unchanged``, ``recorded``, ``install_window``, ``anchored_before``: what earlier checks saw;
    ``installed``, ``expected``, ``listings``, ``parses``: found, patches, kept parses; ``bytecode``."""
    # Named ones are read first, the others (whose files only say what is "extra") while the large
    # files hash; read as every distribution is, or everything is done again in the usual order. The
    # named ones and the plans (torch: 12k RECORD entries, 12k expectations) are built with the cycle
    # collector paused: reading a distribution makes no cycles (a test checks), or the environment's
    # owner could keep root's memory growing with as many as it likes.
    reader = MetadataReader.of(env, parses)  # one scan: its limits cover the named ones and the others
    with cycle_collection_paused():
        early = find_named(env, names, reader) if installed is None and names is not None else None
    found: list[InstalledDistribution] = []
    if early is not None:
        selected = early
    else:
        with cycle_collection_paused(frozen=True):  # every RECORD entry (61k on vLLM), no cycle
            found = list(installed) if installed is not None else find_distributions(env, reader=reader)
        selected = found if names is None else [find_distribution(env, name, found) for name in names]
    if wheel is not None and (len(selected) != 1 or selected[0].name != wheel.name):
        raise WheelError(
            f"the wheel {wheel.path.name} is for {wheel.name}, not "
            f"{', '.join(d.name for d in selected) or 'nothing'}",
            hint="pass the wheel of the package being verified",
        )
    owners = system_packages(env, selected)
    prove = unchanged if wheel is None and not expected else None
    with cycle_collection_paused():
        plans = [
            _proven_plan(dist, prove) or _plan(dist, env, wheel, dist.name in owners) for dist in selected
        ]
        if expected:
            plans = [
                replace(p, expectations=tuple(expected.get(e.location, e) for e in p.expectations))
                for p in plans
            ]
    total = sum(len(p.expectations) for p in plans)

    def tick(done: int) -> None:
        if on_progress is not None:
            on_progress(done, total)

    unlisted: dict[str, list[Finding]] = {}
    sites = distribution_sites(env)
    #: each __pycache__ .pyc to judge -> the distribution it is reported under ("": a site's top)
    pycs: dict[str, str] = {}
    sources: dict[str, tuple[str, Source]] = {}  # listed .py -> (its distribution, its RECORD hash)
    listed_holder: list[frozenset[str]] = []
    top: list[Unlisted] = []

    budget, deadline = [WALK_ENTRIES], time.monotonic() + WALK_SECONDS
    stopped: dict[str, str] = {}  # a walk's top -> why it stopped short: what is below is not checked

    def walk(top: str) -> list[str]:
        try:
            found = (
                None
                if listings is None
                else walk_listed(listings.listed, top, budget, deadline, seen=listings)
            )
            return _walk(top, budget, deadline) if found is None else found
        except OSError as exc:  # a bound reached (TreeTooLarge), or a directory that cannot be listed
            stopped[top] = exc.strerror or str(exc)
            return []

    def look_for_extras() -> None:  # on this thread, while the helpers hash the large files
        if early is not None:
            found.extend(find_distributions(env, early, reader))
        listed = _listed_locations(found)
        listed_holder.append(listed)
        files = {d.name: d.locations for d in found}
        owners = directory_owners(files, map(os.fspath, sites))  # once: the roots and the tops take it
        roots = roots_of(owners, files)
        for plan in plans:
            name = plan.dist.name
            unlisted[name] = []
            for root in roots.get(name, []):
                extra, walked = extras(name, walk(root), listed)
                unlisted[name].extend(extra)
                if root in stopped:
                    unlisted[name].append(_not_checked(name, root, stopped.pop(root)))
                if bytecode:
                    pycs.update((pyc, name) for pyc in walked)
                else:  # as before: only bytecode of a source no RECORD lists is said, as extra
                    unlisted[name].extend(_orphans(name, walked, listed))
            pycs.update(
                (location, name)
                for location in plan.dist.locations
                if bytecode and location.endswith(".pyc") and pyc_name(location) is not None
            )
        if bytecode and names is None and wheel is None:  # --all: where Python looks first, too
            looked = look(map(os.fspath, sites), owners, listed, walk)
            top.extend(_not_dpkgs(env, looked.unlisted))
            top.extend(Unlisted(where, "", f"not checked below it: {why}") for where, why in stopped.items())
            for pyc, owner in looked.bytecode:
                pycs.setdefault(pyc, owner)

    states = _observe(plans, env, workers, tick, look_for_extras, known)
    if early is not None and any(find_distribution(env, d.name, found) is not d for d in early):
        # a directory named otherwise holds one of them, earlier in the scan: the usual order
        return verify_environment(
            env,
            names,
            wheel,
            on_progress,
            workers,
            found,
            expected,
            settle_shared,
            vouched,
            known,
            unchanged,
            known_pyc,
            bytecode,
            recorded,
            install_window,
            anchored_before,
            listings,
            parses,
        )
    reports: list[DistributionReport] = []
    baseline = "record" if wheel is None else "wheel"
    per_plan: list[list[Finding]] = []
    scripts = base(os.fspath(env.scripts))  # an installer makes what it puts there executable
    mismatched: dict[str, Expectation] = {}  # modified files: another RECORD may list them too
    dist_infos_of = functools.cache(_dist_infos_of)
    clean: list[InstalledDistribution] = []
    verified: set[str] = set()  # the listed sources found as their RECORD says
    #: each listed .pyc of a distribution whose install window root trusts -> that window
    windows: dict[str, tuple[int, int]] = {}
    by_window = install_window if wheel is None and not expected else None
    #: each distribution's RECORD ctime as root anchored it (None: touched since, or no anchor)
    anchored: dict[str, int | None] = {}
    own: list[list[Finding]] = []
    for plan in plans:
        findings = list(plan.findings)
        name = plan.dist.name
        for expectation in plan.expectations:
            location = expectation.location
            state = states[location]
            finding = compare(name, expectation, state, baseline)
            if finding is not None:
                member = plan.members.get(location)
                findings.append(replace(finding, wheel_member=member) if member else finding)
                if finding.kind == FindingKind.MODIFIED:
                    mismatched[location] = expectation
            elif location.endswith(".py"):
                verified.add(location)
            moded = mode_finding(name, state, location.startswith(scripts))
            if moded is not None:
                findings.append(moded)
        if plan.proven is not None:
            verified.update(loc for loc in plan.dist.locations if loc.endswith(".py"))
        if by_window is not None and bytecode:
            seen = [states[e.location].ctime_ns for e in plan.expectations if states[e.location].ctime_ns]
            window = by_window(plan.dist, min(seen) if seen and plan.proven is None else None)
            earlier = anchored_before is None or anchored_before(plan.dist)  # first sight explains nothing
            anchored[os.fspath(plan.dist.dist_info)] = None if window is None or not earlier else window[1]
            if window is not None:
                windows.update((loc, window) for loc in plan.dist.locations if pyc_name(loc) is not None)
        if recorded is not None:
            findings.extend(recorded(plan.dist, plan.proven is not None))
        own.append(findings)
    if not bytecode:  # a listed .pyc that differs from its RECORD: pip may have compiled it anew
        pycs.update(
            (f.path, f.distribution)
            for findings in own
            for f in findings
            if f.kind == FindingKind.MODIFIED and pyc_name(f.path) is not None
        )
    wanted_sources = [parsed.source for pyc in pycs if (parsed := pyc_name(pyc))]
    sources.update(_sources(found, frozenset(wanted_sources)))  # none: nothing to look up (uv's vLLM)
    sources.update(_dpkg_sources(env, wanted_sources))
    verdicts = judge_files(
        [env.prefix, env.base_prefix],
        (
            (pyc, parsed, _source_of(sources, parsed.source))
            for pyc in sorted(pycs)
            if (parsed := pyc_name(pyc))
        ),
        verified.__contains__,
        known_pyc,
        windows,
    )
    listed = listed_holder[0] if listed_holder else _listed_locations(found)
    by_dist: dict[str, list[Finding]] = {}
    for pyc, why in verdicts.problems.items():
        parsed = pyc_name(pyc)
        under = sources.get(parsed.source, (pycs[pyc],))[0] if parsed else pycs[pyc]
        by_dist.setdefault(under, []).append(bytecode_finding(under, pyc, why, pyc in listed))
    for plan, findings in zip(plans, own, strict=True):
        name = plan.dist.name
        findings = [f for f in findings if not _fine_bytecode(f, pycs, verdicts.problems)]
        if prove is not None and plan.proven is None and not findings:
            clean.append(plan.dist)  # every file as its RECORD says (its bytecode judged apart)
        findings.extend(by_dist.pop(name, ()))
        linked: list[tuple[str, int]] = list(plan.proven or ())
        for expectation in plan.expectations:
            state = states[expectation.location]
            if state.nlink > 1 and state.is_file:
                linked.append((state.path, state.nlink))
        warning = hardlinked(name, linked)
        if warning is not None:
            findings.append(warning)
        findings.extend(unlisted[plan.dist.name])
        findings.extend(_second_dist_infos(plan.dist, dist_infos_of))
        per_plan.append(findings)
    listed_by = _listed_by(found, mismatched)
    for plan, findings in zip(plans, per_plan, strict=True):
        if listed_by:
            findings = [
                shared_file(
                    f,
                    mismatched[f.path],
                    [o for o in listed_by[f.path] if o[0] != f.distribution],
                    settle_shared,
                )
                if f.kind == FindingKind.MODIFIED and f.path in listed_by
                else f
                for f in findings
            ]
        if wheel is None and vouched is not None and any(f.kind == FindingKind.MODIFIED for f in findings):
            findings = _settled(plan.dist, findings, states, vouched)
        owner = owners.get(plan.dist.name)
        if wheel is None and owner is not None and any(f.kind == FindingKind.MODIFIED for f in findings):
            findings = _against_dpkg(env, plan.dist, owner, findings)  # dpkg's: no wheel to settle it with
        elif (
            wheel is None
            and anchored_before is not None
            and any(f.kind == FindingKind.MODIFIED for f in findings)
        ):
            # only --verify-only's check says a wheel's fault, and only by the RECORD's ctime root anchored at
            # an earlier check (a chmod since moves the ctime now); --full (no window) explains nothing away
            record_ctime = (
                anchored.get(os.fspath(plan.dist.dist_info)) if by_window is not None and bytecode else None
            )
            findings = [  # a listed .pyc judged by what it holds was never observed: no state
                untouched_since_install(f, states[f.path].ctime_ns, record_ctime)
                if f.kind == FindingKind.MODIFIED and f.path in states
                else f
                for f in findings
            ]
        reports.append(
            DistributionReport(
                name=plan.dist.name,
                version=plan.dist.version,
                dist_info=str(plan.dist.dist_info),
                files_checked=len(plan.expectations) + plan.proven_files,
                findings=tuple(sorted(findings, key=report_order)),
                against=plan.against,
                site=os.fspath(plan.dist.site),
                system_package=owners.get(plan.dist.name),
                from_base=from_base(env, plan.dist),
            )
        )
    for item in top:
        by_dist.setdefault(item.owner, []).append(
            Finding(
                item.owner or UNLISTED,
                item.location,
                FindingKind.UNREADABLE if item.detail.startswith("not checked") else FindingKind.EXTRA,
                item.detail,
            )
        )
    for at, report in enumerate(reports):
        if more := by_dist.pop(report.name, None):
            reports[at] = replace(report, findings=tuple(sorted((*report.findings, *more), key=report_order)))
    for under, more in sorted(by_dist.items()):  # a site's top, or a distribution not checked
        reports.append(
            DistributionReport(
                name=under or UNLISTED,
                version="",
                dist_info="",
                files_checked=0,
                findings=tuple(
                    sorted((replace(f, distribution=under or UNLISTED) for f in more), key=report_order)
                ),
                against="record",
            )
        )
    summary = (
        None
        if wheel is None
        else WheelSummary(str(wheel.path), wheel.name, wheel.version, wheel.record_ok, wheel.problems)
    )
    eggs = tuple(os.fspath(p) for p in egg_info_paths(env)) if names is None else ()
    return VerifyReport(
        str(env.python),
        str(env.prefix),
        tuple(reports),
        summary,
        states,
        tuple(os.fspath(s) for s in sites),
        eggs,
        frozenset(os.fspath(p.dist.dist_info) for p in plans if p.proven is not None),
        tuple(clean),
        verdicts.judged,
        (verdicts.compiled, verdicts.by_identity, verdicts.by_installer),
    )


#: The name findings where no distribution's files are (a site directory's top) are reported under.
UNLISTED = "(in no RECORD)"


def _fine_bytecode(finding: Finding, pycs: Mapping[str, str], problems: Mapping[str, str]) -> bool:
    """Pure: a listed ``.pyc`` that differs from its RECORD (pip compiled it anew over the wheel's) but
    was judged the bytecode of its verified source: neither drift nor a local patch."""
    return finding.kind == FindingKind.MODIFIED and finding.path in pycs and finding.path not in problems


def _not_checked(name: str, root: str, why: str) -> Finding:
    """Pure: what is below ``root`` was not looked at (its walk reached a bound): never silently clean."""
    return Finding(name, root, FindingKind.UNREADABLE, f"not checked below it: {why}")


def _orphans(name: str, walked: Sequence[str], listed: frozenset[str]) -> list[Finding]:
    """Pure: the ``.pyc`` files of ``walked`` whose source no RECORD lists, as ``extra`` findings."""
    return [
        Finding(name, pyc, FindingKind.EXTRA, IN_NO_RECORD)
        for pyc in walked
        if pyc not in listed and (parsed := pyc_name(pyc)) is not None and parsed.source not in listed
    ]


def _sources(found: Sequence[InstalledDistribution], wanted: frozenset[str]) -> dict[str, tuple[str, Source]]:
    """Each ``wanted`` source some RECORD lists with a hash: location -> (its distribution, its RECORD
    hash). Only the distributions that list one are gone through (61k entries on vLLM, a few .pyc)."""
    return {
        location: (dist.name, Source(entry.hash.algorithm, entry.hash.digest))
        for dist in found
        if not wanted.isdisjoint(dist.locations)
        for entry, location in zip(dist.record.entries, dist.locations, strict=True)
        if entry.hash is not None and location in wanted
    }


def _source_of(sources: Mapping[str, tuple[str, Source]], location: str) -> Source | None:
    found = sources.get(location)
    return None if found is None else found[1]


def _dpkg_sources(env: Environment, locations: Sequence[str]) -> dict[str, tuple[str, Source]]:
    """The sources of bytecode in a system interpreter's site directories that dpkg installed, with
    dpkg's md5 of each (what ``debsums`` checks): there dpkg, not a RECORD, says what a module holds
    (Debian changes files after writing RECORD, and most of its modules have none)."""
    owners, sums = _dpkg_md5sums(env, locations)
    return {
        os.fspath(path): (package.package, Source("md5", encode_digest(bytes.fromhex(sums[os.fspath(path)]))))
        for path, package in owners.items()
        if os.fspath(path) in sums
    }


def _dpkg_md5sums(
    env: Environment, locations: Sequence[str]
) -> tuple[dict[Path, SystemPackage], dict[str, str]]:
    """The dpkg package of each of ``locations`` outside a venv's own site directories (never dpkg's),
    and the md5sums (hex) of those packages by path."""
    own = bases(env.site_dirs) if env.is_venv else ()
    owners = dpkg_owners(Path(loc) for loc in locations if not (own and loc.startswith(own)))
    sums: dict[str, str] = {}
    for package in set(owners.values()):
        sums.update(dpkg_md5sums(package))
    return owners, sums


def _not_dpkgs(env: Environment, unlisted: Sequence[Unlisted]) -> list[Unlisted]:
    """Those of ``unlisted`` that no system package installed as they are now: a file dpkg lists whose
    md5sum matches is not reported, one that does not match is, saying so."""
    owners, sums = _dpkg_md5sums(env, [u.location for u in unlisted])
    if not owners:
        return list(unlisted)
    expected = [
        Expectation(u.location, "md5", encode_digest(bytes.fromhex(sums[u.location])), None)
        for u in unlisted
        if Path(u.location) in owners and u.location in sums
    ]
    states = observe_files(expected, within=os.fspath(env.base_prefix)) if expected else {}
    intact = {e.location for e in expected if compare("", e, states[e.location], "record") is None}
    kept: list[Unlisted] = []
    for u in unlisted:
        if u.location in intact:
            continue
        owner = owners.get(Path(u.location))
        kept.append(
            u if owner is None else replace(u, detail=f"{u.detail}; {owner.package}'s md5sums differ")
        )
    return kept


def _proven_plan(
    dist: InstalledDistribution,
    prove: Callable[[InstalledDistribution], Sequence[tuple[str, int]] | None] | None,
) -> _Plan | None:
    """The plan of a distribution proven unchanged since a check found it clean: nothing to read."""
    linked = None if prove is None else prove(dist)
    if linked is None:
        return None
    files = sum(1 for entry in dist.record.entries if entry.hash is not None)
    return _Plan(dist, (), {}, (), "record", tuple(linked), files)


def _dist_infos_of(site: str) -> Mapping[str, tuple[str, ...]]:
    """The ``.dist-info`` directory names of a site directory by canonical distribution name (one
    verification lists each site directory once through a cache of its own, not once per distribution:
    198 listings of 600 entries on vLLM)."""
    try:
        names = sorted(os.listdir(site))
    except OSError:
        return {}
    by_name: dict[str, list[str]] = {}
    for name in names:
        if (canonical := dist_info_name(name)) is not None:
            by_name.setdefault(canonical, []).append(name)
    return {canonical: tuple(found) for canonical, found in by_name.items()}


def _second_dist_infos(
    dist: InstalledDistribution, dist_infos_of: Callable[[str], Mapping[str, tuple[str, ...]]]
) -> list[Finding]:
    """Another ``.dist-info`` of the distribution in its own site directory (a run killed while uv wrote
    the new version): two installations in one place, which the first one's RECORD cannot show. Drift
    (``extra``), each with its path; one of the base installation's that this one shadows is not."""
    return [
        Finding(
            dist.name,
            os.path.join(dist.site, name),
            FindingKind.EXTRA,
            f"a second .dist-info of {dist.display_name} beside {dist.dist_info.name}: two installations",
        )
        for name in dist_infos_of(str(dist.site)).get(dist.name, ())
        if name != dist.dist_info.name
    ]


def _settled(
    dist: InstalledDistribution,
    findings: list[Finding],
    states: Mapping[str, FileState],
    vouched: Callable[[], Mapping[str, tuple[Vouched, ...]]],
) -> list[Finding]:
    """The ``modified`` findings of ``dist`` that hold the very bytes a run verified against its wheel
    (the environment's baseline, when it describes ``dist`` as installed now) become ``wheel-record``."""
    from safeinstall.env.vouched import entry_for, settle  # only when something differs

    entry = entry_for(vouched().get(dist.name, ()), dist)
    if entry is None:
        return findings
    return [settle(f, states[f.path], entry) if f.kind == FindingKind.MODIFIED else f for f in findings]


def _against_dpkg(
    env: Environment, dist: InstalledDistribution, owner: SystemPackage, findings: list[Finding]
) -> list[Finding]:
    """The ``modified`` findings of a distribution a system package installed, against dpkg's own md5sums
    (what ``dpkg --verify`` checks): those it says are intact become ``dpkg-intact`` (Debian
    strips its libraries after writing RECORD, and every such file alerted on every check)."""
    sums = dpkg_md5sums(owner)
    listed = [f.path for f in findings if f.kind == FindingKind.MODIFIED and f.path in sums]
    wanted = [Expectation(path, "md5", encode_digest(bytes.fromhex(sums[path])), None) for path in listed]
    states = observe_files(wanted, within=os.fspath(containment_root(env, dist))) if wanted else {}
    matches = {e.location: compare(dist.name, e, states[e.location], "record") is None for e in wanted}
    return [against_dpkg(f, matches.get(f.path), owner.package) for f in findings]


def _ticked(tick: Callable[[int], None], before: int, done: int) -> None:
    tick(before + done)


def _observe(
    plans: Sequence[_Plan],
    env: Environment,
    workers: int | None,
    tick: Callable[[int], None],
    meanwhile: Callable[[], object],
    known: Known | None = None,
) -> dict[str, FileState]:
    """Every expected file observed, each within the prefix its distribution belongs to (the base's, for
    a venv's distributions of the base installation): one pass for each such prefix."""
    by_root: dict[str, list[Expectation]] = {os.fspath(env.prefix): []}
    for plan in plans:
        by_root.setdefault(os.fspath(containment_root(env, plan.dist)), []).extend(plan.expectations)
    states: dict[str, FileState] = {}
    for root, wanted in by_root.items():
        states.update(
            observe_files(
                wanted,
                workers=workers,
                on_progress=functools.partial(_ticked, tick, len(states)),
                meanwhile=meanwhile if root == os.fspath(env.prefix) else None,
                within=root,
                known=known,
            )
        )
    return states
