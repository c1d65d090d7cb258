"""``--undo``: put back exactly what ran before a run, through the run's own safe sequence.

An undo is a run whose new version is the run's backup; refused (exit 2) when the environment is not
what the run left or its backup is gone. docs/undo.md.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from safeinstall.env.distributions import InstalledDistribution, entry_location
from safeinstall.env.uvplan import UvChange, UvPlan
from safeinstall.env.verify import VerifyReport
from safeinstall.env.vouched import file_key
from safeinstall.errors import SafeInstallError, one_line
from safeinstall.scan.plan import Plan
from safeinstall.store.backup import Backup, BackupError, load_backup
from safeinstall.store.history import RunSummary, find, read_history
from safeinstall.store.state import (
    EnvironmentState,
    StateDirError,
    atomic_write,
    is_run_id,
    read_private_file,
)

LEFT_NAME = "left.json"
LEFT_VERSION = 1
#: the most bytes a ``left.json`` may have (a digest per file: torch's 15k files take ~2 MB)
LEFT_LIMIT = 64 << 20
#: the most changes a refusal lists (then: "and N more")
LISTED = 10
#: the swap command the plan, the journal and the log show for an undo (no uv runs)
RESTORE = "restore-backup"


class UndoError(SafeInstallError):
    """An undo that cannot be made (nothing was stopped: exit 2)."""

    code = "undo"


@dataclass(frozen=True, slots=True)
class Left:
    """What a good run left: each affected distribution's version, and each file its RECORD lists
    (absolute location) with its state (:func:`file_key`)."""

    versions: Mapping[str, str]
    files: Mapping[str, Mapping[str, str]]  # distribution -> location -> key


@dataclass(frozen=True, slots=True)
class UndoTarget:
    """The run being undone: its backup (the state before it) and what it left."""

    run_id: str
    package: str
    backup: Backup
    left: Left


@dataclass(frozen=True, slots=True)
class Undoable:
    """One finished run, and whether it can be undone (``reason``: why not)."""

    run_id: str
    package: str | None
    status: str
    reason: str | None  # None: it can be undone

    @property
    def can(self) -> bool:
        return self.reason is None


# ------------------------------------------------------------------ what a run left


def left_of(report: VerifyReport, installed: Iterable[InstalledDistribution], names: Iterable[str]) -> Left:
    """Pure: what the distributions ``names`` are after a run, from its verify ``report``."""
    wanted = frozenset(names)
    dists = [d for d in installed if d.name in wanted]
    return Left(
        {d.name: d.version for d in dists},
        {
            d.name: {
                loc: file_key(report.observed[loc])
                for loc in (entry_location(d.site, e) for e in d.record.entries)
                if loc in report.observed  # verified against the wheel: the files RECORD adds are not
            }
            for d in dists
        },
    )


def left_to_dict(left: Left) -> dict[str, Any]:
    return {
        "left_version": LEFT_VERSION,
        "versions": dict(sorted(left.versions.items())),
        "files": {name: dict(sorted(files.items())) for name, files in sorted(left.files.items())},
    }


def left_from_dict(data: Any) -> Left:
    """Pure: a ``left.json`` read back, every field checked (ValueError: damaged)."""
    if not isinstance(data, dict) or data.get("left_version") != LEFT_VERSION:
        raise ValueError("not a left.json of this version")
    versions, files = data.get("versions"), data.get("files")
    if not isinstance(versions, dict) or not isinstance(files, dict):
        raise ValueError("versions and files must be objects")
    if not all(isinstance(k, str) and isinstance(v, str) for k, v in versions.items()):
        raise ValueError("versions must map names to strings")
    for name, entries in files.items():
        if not isinstance(name, str) or not isinstance(entries, dict):
            raise ValueError("files must map names to objects")
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in entries.items()):
            raise ValueError("files must map locations to strings")
    return Left(dict(versions), {name: dict(entries) for name, entries in files.items()})


def save_left(backup_dir: Path, left: Left) -> None:
    """Beside the run's backup (root's private directory), written atomically."""
    atomic_write(backup_dir / LEFT_NAME, json.dumps(left_to_dict(left), sort_keys=True).encode())


def load_left(backup_dir: Path) -> Left:
    """Raises FileNotFoundError when the run kept none; UndoError when it cannot be believed."""
    raw = read_private_file(backup_dir / LEFT_NAME, LEFT_LIMIT)
    try:
        return left_from_dict(json.loads(raw))
    except ValueError as exc:
        raise UndoError(
            f"{backup_dir / LEFT_NAME} is damaged ({exc})",
            hint="that run cannot be undone; reinstall the version wanted with safeinstall PACKAGE --wheel W",
        ) from exc


# ------------------------------------------------------------------ which runs can be undone


def _why_not(state: EnvironmentState, run_id: str, status: str) -> str | None:
    if not is_run_id(run_id):  # never a path below the state directory made of what an entry says
        return "its history entry names no valid run id"
    if status != "done":
        return f"only a run that ended done can be undone (this one: {status})"
    backup_dir = state.backup_dir(run_id)
    if not backup_dir.is_dir():
        return "its backup was deleted (--keep-backups keeps the newest ones)"
    try:
        load_backup(backup_dir)
        load_left(backup_dir)
    except FileNotFoundError:
        return "it kept no record of what it left (a run of a safeinstall without --undo)"
    except (BackupError, UndoError, StateDirError) as exc:
        return exc.message
    return None


def _undo_of(state: EnvironmentState, run_id: str) -> str | None:
    """The run that the run ``run_id`` undid, as its history entry says (None: it undid none)."""
    try:
        entry = find(state, run_id)
    except SafeInstallError:  # damaged: --status says so (read_history skips it)
        return None
    return entry.result.details.undo_of if entry is not None else None


def _reasons(state: EnvironmentState, runs: Sequence[RunSummary]) -> list[str | None]:
    """Why each run (newest first) cannot be undone (None: it can). A run that a later undo undid
    (that undo not undone in turn) left nothing that is still there."""
    undone_by: dict[str, str] = {}
    for run in runs:
        if run.status == "done" and run.run_id not in undone_by:
            undid = _undo_of(state, run.run_id)
            if undid is not None:
                undone_by.setdefault(undid, run.run_id)
    return [
        f"undone by run {undone_by[run.run_id]} (undo that one to go forward again)"
        if run.run_id in undone_by
        else _why_not(state, run.run_id, run.status)
        for run in runs
    ]


def with_undo(state: EnvironmentState, runs: Sequence[RunSummary]) -> tuple[RunSummary, ...]:
    """The runs as ``--status`` lists them: each saying whether it can be undone, and if not why."""
    return tuple(
        replace(run, can_undo=reason is None, cannot_undo=reason)
        for run, reason in zip(runs, _reasons(state, runs), strict=True)
    )


def undoable_runs(state: EnvironmentState) -> tuple[Undoable, ...]:
    """Every run in the environment's history, newest first, and whether it can be undone."""
    runs = read_history(state).runs
    return tuple(
        Undoable(run.run_id, run.package, run.status, reason)
        for run, reason in zip(runs, _reasons(state, runs), strict=True)
    )


def _which_can(runs: Sequence[Undoable]) -> str:
    can = [f"{r.run_id} ({r.package})" for r in runs if r.can]
    if not can:
        return "no run of this environment can be undone"
    return "runs that can be undone: " + ", ".join(can) + "; pick one with --undo --run RUN_ID"


def choose_run(state: EnvironmentState, run_id: str | None) -> Undoable:
    """The run to undo: ``run_id``, or the last run that changed the environment. UndoError (exit 2)
    when there is none, or it cannot be undone (saying which can)."""
    runs = undoable_runs(state)
    if run_id is None:
        chosen = next((r for r in runs if r.status == "done"), None)
        if chosen is None:
            raise UndoError(
                "no run of this environment changed it: there is nothing to undo",
                hint="safeinstall --status --python PY lists its runs",
            )
    else:
        chosen = next((r for r in runs if r.run_id == run_id), None)
        if chosen is None:
            raise UndoError(f"the environment's history has no run {one_line(run_id)}", hint=_which_can(runs))
    if chosen.reason is not None:
        raise UndoError(f"run {chosen.run_id} cannot be undone: {chosen.reason}", hint=_which_can(runs))
    return chosen


def undo_target(state: EnvironmentState, run_id: str) -> UndoTarget:
    """The run's backup and what it left, read again (under the run's lock)."""
    chosen = choose_run(state, run_id)
    backup_dir = state.backup_dir(chosen.run_id)
    return UndoTarget(chosen.run_id, chosen.package or "", load_backup(backup_dir), load_left(backup_dir))


# ------------------------------------------------------------------ the plan


def undo_uv_plan(backup: Backup) -> UvPlan:
    """Pure: what the swap does, in the shape of uv's plan (each saved distribution installed at the
    backup's version), so that the run's plan names the versions before and after."""
    changes = tuple(
        UvChange("install", d.name, d.version, str(backup.dir)) for d in backup.manifest.distributions
    )
    return UvPlan((RESTORE, str(backup.dir)), changes, "")


def listed(items: Sequence[str]) -> str:
    more = f" and {len(items) - LISTED} more" if len(items) > LISTED else ""
    return "; ".join(items[:LISTED]) + more


def changes_since(
    left: Left, now: VerifyReport, installed: Sequence[InstalledDistribution]
) -> tuple[str, ...]:
    """Pure: how the environment differs from what the run left (empty: it is as the run left it):
    each distribution's version, and each file the run's verification saw. ``now``: the affected
    distributions verified just now; ``installed``: the environment's distributions now."""
    by_name = {d.name: d for d in installed}
    changed: list[str] = []
    for name, version in sorted(left.versions.items()):
        current = by_name.get(name)
        if current is None:
            changed.append(f"{name} {version} was uninstalled")
        elif current.version != version:
            changed.append(f"{name} is {current.version} now, the run left {version}")
    for name, files in sorted(left.files.items()):
        current = by_name.get(name)
        if current is None or current.version != left.versions.get(name):
            continue  # said above
        for loc, was in sorted(files.items()):
            key = file_key(now.observed.get(loc))
            if was != key:
                what = "added" if was == "absent" else "removed" if key == "absent" else "changed"
                changed.append(f"{what}: {loc}")
    return tuple(changed)


def change_refusal(target: UndoTarget, changed: Sequence[str]) -> str:
    """Pure: the plan's refusal when the environment changed since the run."""
    return (
        f"the environment changed since run {target.run_id}, so undoing it would not put back "
        f"exactly what ran before: {listed(changed)}; reinstall what you want instead "
        "(safeinstall PACKAGE --wheel W), or put these files back first"
    )


def added_warnings(target: UndoTarget) -> tuple[str, ...]:
    """Pure: distributions the run installed that its backup has no earlier state of: they stay."""
    saved = {d.name for d in target.backup.manifest.distributions}
    return tuple(
        f"{name} {version} was installed by run {target.run_id} and stays (its backup holds no earlier "
        f"{name})"
        for name, version in sorted(target.left.versions.items())
        if name not in saved
    )


def owner_refusal(target: UndoTarget, owner_uid: int) -> str | None:
    """Pure: the refusal when the backup holds files of another account than the environment's owner
    now (the environment changed hands since the run: root would give its files to the old owner)."""
    others = sorted({f.uid for f in target.backup.manifest.files} - {owner_uid})
    if not others:
        return None
    return (
        f"the backup of run {target.run_id} holds files of uid {', '.join(map(str, others))}, and the "
        f"environment is uid {owner_uid}'s now: it changed hands since that run, and putting the backup "
        "back would give its files to the old owner"
    )


def undo_plan(
    plan: Plan,
    target: UndoTarget,
    now: VerifyReport,
    installed: Sequence[InstalledDistribution],
    owner_uid: int,
) -> Plan:
    """Pure: the run's plan, refused when the environment changed since the undone run (its files, or
    its owner: ``owner_uid`` now), and saying which distributions that run added stay."""
    changed = changes_since(target.left, now, installed)
    owner = owner_refusal(target, owner_uid)
    refusals = (
        *((change_refusal(target, changed),) if changed else ()),
        *((owner,) if owner is not None else ()),
    )
    return replace(
        plan, refusals=(*plan.refusals, *refusals), warnings=(*plan.warnings, *added_warnings(target))
    )
