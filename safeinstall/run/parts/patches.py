"""``--keep-patches``: carry a package's local edits over to the new version with a three-way merge.

The core is pure (:func:`merge_file`, :func:`settle`); :func:`prepare_patches` reads before the stop,
:func:`carry` writes after the install as the owner. docs/keep-patches.md.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import TYPE_CHECKING

from merge3 import Merge3

from safeinstall.env.bytecode import pyc_name
from safeinstall.env.containment import is_within
from safeinstall.env.diffs import text_lines, unified
from safeinstall.env.distributions import InstalledDistribution
from safeinstall.env.drift import Expectation, FindingKind
from safeinstall.env.environment import Account, Environment
from safeinstall.env.owner import write_carried
from safeinstall.env.records import RecordHash, digest_bytes
from safeinstall.env.uvplan import UvRequest, prefetch_command, requirement, uv_binary
from safeinstall.env.uvplan import install as uv_install
from safeinstall.env.verify import verify_environment
from safeinstall.env.wheel import Wheel, install_location, read_member, read_wheel
from safeinstall.errors import PatchConflict, PlanError, StepFailed, WheelError
from safeinstall.store.state import EnvironmentState, atomic_write, ensure_dir, make_run_dir, remove_run_dir
from safeinstall.system import worker
from safeinstall.system.safefs import Tree

if TYPE_CHECKING:
    from safeinstall.env.vouched import Vouched
    from safeinstall.run.parts.survey import Survey

_NOTHING_STOPPED = "nothing was stopped"


class PatchStatus(StrEnum):
    CARRIED = "carried"  # merged into the new version's file, written after the install
    DROPPED = "dropped"  # could not be carried; --drop-conflicting: the new version's file stays
    CONFLICT = "conflict"  # could not be carried: the run is refused
    ROLLED_BACK = "rolled-back"  # would have been carried, but the run rolled back: the old file is back


@dataclass(frozen=True, slots=True)
class Versions:
    package: str
    old: str
    new: str


@dataclass(frozen=True, slots=True)
class LocalPatch:
    """One locally modified file with its three versions (None: there is no such version)."""

    location: str  # absolute, in the environment
    shown: str  # relative to the prefix, as the patch files name it
    base: bytes | None  # the installed version's pristine file
    ours: bytes | None  # the file on disk (None: deleted, or no longer a regular file)
    theirs: bytes | None  # the new version's file (None: the new version has none)
    problem: str = ""  # why it cannot be merged at all, found while reading


@dataclass(frozen=True, slots=True)
class PatchOutcome:
    path: str
    status: PatchStatus
    detail: str
    #: carried: the patch against the new version's file; conflict or dropped: where it conflicts (the
    #: new version's file against the merge with conflict markers), or the local change itself
    diff: str = ""
    merged: bytes | None = None  # carried: the file written after the install


def rolled_back(outcomes: Sequence[PatchOutcome]) -> tuple[PatchOutcome, ...]:
    """Pure: a run that rolled back carried nothing: each patch it would have carried is the installed
    version's again, with the old version (restored byte for byte, the patch in it)."""
    return tuple(
        replace(
            o,
            status=PatchStatus.ROLLED_BACK,
            detail="not carried: the run rolled back, and the installed file keeps the local patch",
        )
        if o.status == PatchStatus.CARRIED
        else o
        for o in outcomes
    )


@dataclass(frozen=True, slots=True)
class PatchSet:
    versions: Versions
    outcomes: tuple[PatchOutcome, ...]  # sorted by path
    base_source: str = ""  # where the pristine files came from

    def with_status(self, status: PatchStatus) -> tuple[PatchOutcome, ...]:
        return tuple(o for o in self.outcomes if o.status is status)

    def expected(self) -> dict[str, Expectation]:
        """What each carried file must hold after the install (for the verification)."""
        return {
            o.path: Expectation(o.path, "sha256", digest_bytes(o.merged), len(o.merged))
            for o in self.with_status(PatchStatus.CARRIED)
            if o.merged is not None
        }

    def patch_text(self) -> str:
        """The carried set as one patch against the new version (``patch -p1 -d PREFIX`` applies it)."""
        return "".join(o.diff for o in self.with_status(PatchStatus.CARRIED))

    def refusal(self) -> PatchConflict | None:
        conflicts = self.with_status(PatchStatus.CONFLICT)
        if not conflicts:
            return None
        v = self.versions
        listed = "; ".join(f"{o.path}: {o.detail}" for o in conflicts)
        return PatchConflict(
            f"--keep-patches: {len(conflicts)} local patch(es) of {v.package} cannot be carried from {v.old} "
            f"to {v.new}: {listed}",
            hint="nothing was stopped; resolve them by hand (the diffs show where), or pass "
            "--drop-conflicting to carry the rest (the backup keeps a copy of what is dropped)",
        )

    def summary(self) -> str:
        if not self.outcomes:
            return "no local patches"
        counts = ", ".join(
            f"{len(found)} {status.value}" for status in PatchStatus if (found := self.with_status(status))
        )
        return f"{counts} (into {self.versions.package} {self.versions.new}; base: {self.base_source})"


# ---------------------------------------------------------------------------------------------- pure


def merge_file(patch: LocalPatch, versions: Versions) -> PatchOutcome:
    """Pure: carry one local patch into the new version's file, or say why it cannot be."""

    def conflict(detail: str, diff: str = "") -> PatchOutcome:
        return PatchOutcome(patch.location, PatchStatus.CONFLICT, detail, diff)

    if patch.problem:
        return conflict(patch.problem)
    if patch.base is None or patch.ours is None:
        return conflict("deleted locally, or no longer a regular file: only edits of files are carried")
    if patch.theirs is None:
        local = unified(patch.shown, patch.base, patch.ours).text or ""
        return conflict(f"{versions.package} {versions.new} no longer has this file", local)
    if any(text_lines(data) is None for data in (patch.base, patch.ours, patch.theirs)):
        return conflict("binary file: only text files can be merged")
    merge = Merge3(
        patch.base.splitlines(keepends=True),
        patch.ours.splitlines(keepends=True),
        patch.theirs.splitlines(keepends=True),
    )
    if any(region[0] == "conflict" for region in merge.merge_regions()):
        marked = b"".join(
            merge.merge_lines(
                name_a=b"local patch",
                name_b=f"{versions.package} {versions.new}".encode(),
                name_base=f"{versions.package} {versions.old}".encode(),
                base_marker=b"|||||||",
            )
        )
        where = unified(patch.shown, patch.theirs, marked).text or ""
        return conflict(f"the local patch and {versions.package} {versions.new} change the same lines", where)
    merged = b"".join(merge.merge_lines())
    detail = "merged" if merged != patch.theirs else f"{versions.new} already has this change"
    diff = unified(patch.shown, patch.theirs, merged).text or ""
    return PatchOutcome(patch.location, PatchStatus.CARRIED, detail, diff, merged)


def settle(outcomes: Iterable[PatchOutcome], drop_conflicting: bool) -> tuple[PatchOutcome, ...]:
    """Pure: with ``--drop-conflicting`` what cannot be carried is dropped instead of refusing the run."""
    return tuple(
        replace(o, status=PatchStatus.DROPPED) if drop_conflicting and o.status is PatchStatus.CONFLICT else o
        for o in sorted(outcomes, key=lambda o: o.path)
    )


def site_relative(env: Environment, location: str) -> str | None:
    """Pure: the path of ``location`` below the site directory holding it (None: outside them)."""
    for site in env.site_dirs:
        if location != os.fspath(site) and is_within(location, os.fspath(site)):
            return os.path.relpath(location, site)
    return None


# ---------------------------------------------------------------------------------------------- I/O


#: The largest file a patch is carried for (source files; anything larger is not a local patch)
READ_LIMIT = 64 << 20


def read_regular(top: Path, location: str) -> bytes | None:
    """The bytes of the regular file ``location`` below ``top``, walked by descriptor from ``top`` with
    no symlink followed in any component (:class:`~safeinstall.system.safefs.Tree`); None: missing, not a
    regular file, outside ``top`` or larger than :data:`READ_LIMIT`."""
    try:
        with Tree(top) as tree:
            relative = tree.relative(location)
            return None if relative is None else tree.read_bytes(relative, READ_LIMIT)
    except (OSError, ValueError):
        return None


def _wheel_files(wheel: Wheel, env: Environment, wanted: frozenset[str]) -> dict[str, bytes]:
    found: dict[str, bytes] = {}
    for member in wheel.members:
        location = install_location(wheel, member, env)
        if location is not None and os.fspath(location) in wanted:
            found[os.fspath(location)] = read_member(wheel.path, member)
    return found


def _tree_files(tree: Path, env: Environment, wanted: frozenset[str]) -> dict[str, bytes]:
    """Files of a ``uv pip install --target`` tree: site-packages' contents sit at its top. Read by
    descriptor: uv wrote the tree as the environment's owner, who may have put symlinks in it."""
    found: dict[str, bytes] = {}
    for location in wanted:
        relative = site_relative(env, location)
        data = None if relative is None else read_regular(tree, os.fspath(tree / relative))
        if data is not None:
            found[location] = data
    return found


def _fetch(
    request: UvRequest, target: Path, environ: Mapping[str, str], what: str, account: Account | None
) -> Path:
    """``uv pip install --target`` the requirement into the scratch directory (uv's cache, or its
    index), as ``account`` (the environment's owner) when given."""
    result = uv_install(prefetch_command(request, uv_binary(), target), environ, account=account)
    if result.returncode != 0:
        said = " / ".join(line.strip() for line in result.output.strip().splitlines()[-4:] if line.strip())
        raise PlanError(
            f"--keep-patches cannot get {what}: uv could not fetch {requirement(request)} "
            f"(exit {result.returncode}; uv said: {said})",
            hint="pass --base-wheel W (the wheel of the installed version), or give uv an index or "
            f"--find-links after --; {_NOTHING_STOPPED}",
        )
    return target


def _base_wheel(path: Path, dist: InstalledDistribution) -> Wheel:
    wheel = read_wheel(path)
    if wheel.name != dist.name or wheel.version != dist.version:
        raise WheelError(
            f"--base-wheel {path.name} is {wheel.name} {wheel.version}; the installed version is "
            f"{dist.name} {dist.version}",
            hint=f"pass the wheel that was installed; {_NOTHING_STOPPED}",
        )
    return wheel


def _check_base(base: Mapping[str, bytes], hashes: Mapping[str, RecordHash | None], source: str) -> None:
    """Each pristine file must be what the installed RECORD says was installed: else it is another build."""
    for location, data in base.items():
        recorded = hashes.get(location)
        if recorded is not None and digest_bytes(data, recorded.algorithm) != recorded.digest:
            raise PlanError(
                f"--keep-patches: {location} from {source} is not the file that was installed (its hash "
                "differs from the installed RECORD): another build of the same version, or a copy in uv's "
                "cache that was edited through a hardlink (uv #10579)",
                hint=f"pass --base-wheel with the very wheel that was installed; {_NOTHING_STOPPED}",
            )


def _problem(env: Environment, location: str, base: Mapping[str, bytes], source: str) -> str:
    if site_relative(env, location) is None:
        return "outside site-packages (a script or a data file): only the package's modules are carried"
    if location not in base:
        return f"no pristine copy of it in {source}"
    return ""


def prepare_patches(
    survey: Survey,
    base_wheel: Path | None,
    scratch: Path,
    environ: Mapping[str, str],
    drop_conflicting: bool,
    vouched: Mapping[str, tuple[Vouched, ...]] | None = None,
) -> PatchSet:
    """Before the stop: every local patch of the package, merged into the new version's files (the run's
    wheel, or its requirement fetched by uv into ``scratch``). Raises PlanError when the pristine files
    cannot be had; what cannot be carried is in the result (:meth:`PatchSet.refusal`)."""
    env, dist, request, new_wheel = survey.env, survey.target, survey.request, survey.wheel
    new_version = new_wheel.version if new_wheel is not None else _planned_version(survey)
    versions = Versions(dist.name, dist.version, new_version)
    report = verify_environment(env, [dist.name], vouched=None if vouched is None else lambda: vouched)
    changed = [  # bytecode is never carried: a .pyc is its source's, judged by what it holds
        f.path
        for f in report.findings
        if f.kind in (FindingKind.MODIFIED, FindingKind.MISSING) and pyc_name(f.path) is None
    ]
    if not changed:
        return PatchSet(versions, ())
    wanted = frozenset(changed)
    if base_wheel is None or new_wheel is None:  # uv fetches into it, as the environment's owner
        make_run_dir(scratch, env.account)
    try:
        if base_wheel is not None:
            source = base_wheel.name
            base = _wheel_files(_base_wheel(base_wheel, dist), env, wanted)
        else:
            source = f"{dist.name}=={dist.version} fetched by uv"
            pinned = replace(request, wheel=None, version_spec=f"=={dist.version}", with_deps=False)
            what = f"the pristine files of the installed {dist.name} {dist.version}"
            base = _tree_files(_fetch(pinned, scratch / "base", environ, what, env.account), env, wanted)
        if new_wheel is not None:
            theirs = _wheel_files(new_wheel, env, wanted)
        else:
            what = f"the files of the new {dist.name} {new_version}"
            theirs = _tree_files(_fetch(request, scratch / "new", environ, what, env.account), env, wanted)
    finally:
        remove_run_dir(scratch)
    _check_base(base, dict(zip(dist.locations, (e.hash for e in dist.record.entries), strict=True)), source)
    patches = [
        LocalPatch(
            location,
            os.path.relpath(location, env.prefix),
            base.get(location),
            read_regular(env.prefix, location),
            theirs.get(location),
            _problem(env, location, base, source),
        )
        for location in changed
    ]
    outcomes = settle((merge_file(p, versions) for p in patches), drop_conflicting)
    return PatchSet(versions, outcomes, source)


def _planned_version(survey: Survey) -> str:
    planned = (d.new_version for d in survey.plan.distributions if d.name == survey.target.name)
    return next((v for v in planned if v), survey.target.version)


def carry(prefix: Path, patches: PatchSet, account: Account | None) -> int:
    """After the install: write every carried file (how many) by a worker that is the environment's owner,
    who installed them (:func:`safeinstall.env.owner.write_carried`): nothing the owner could not write."""
    files = [(o.path, o.merged) for o in patches.with_status(PatchStatus.CARRIED) if o.merged is not None]
    if not files:
        return 0

    def write_all() -> int:
        for location, data in files:
            write_carried(prefix, location, data)
        return len(files)

    try:
        written = worker.call(
            None if account is None else account.ids,
            write_all,
            timeout=CARRY_TIMEOUT_S,
            what=f"writes the carried local patches into {prefix}",
        )
    except worker.WorkerError as exc:
        raise StepFailed(exc.message.replace("StepFailed: ", ""), hint=StepFailed.default_hint) from exc
    if written != len(files):
        raise StepFailed(f"the worker that carried the local patches into {prefix} answered {written!r}")
    return len(files)


#: How long writing the carried files may take (a few merged source files)
CARRY_TIMEOUT_S = 300.0


def save_patch_set(state: EnvironmentState, run_id: str, patches: PatchSet) -> Path | None:
    """Keep the carried set as one patch against the new version: ``<state>/<env>/patches/<run>.patch``."""
    text = patches.patch_text()
    if not text:
        return None
    ensure_dir(state.patches)
    path = state.patch_file(run_id)
    atomic_write(path, text.encode("utf-8"))
    return path
