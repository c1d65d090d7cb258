"""The one put-back sequence, for a run's rollback and for ``--recover``: the backup written back, the
gate opened, the stopped units started, the drop-ins removed, the journal cleared.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from safeinstall.env import keep
from safeinstall.env.environment import Environment
from safeinstall.env.renames import (
    STAGING_PREFIX,
    Ids,
    discard_staging,
    keep_staging,
    owner_of,
    put_back_unknown,
    unknown_in_old,
)
from safeinstall.env.wheel import environment_files, install_location, read_wheel
from safeinstall.env.wheelcopy import discard_wheel_copy, is_wheel_copy
from safeinstall.errors import SafeInstallError
from safeinstall.store.anchors import carry_over
from safeinstall.store.backup import Backup, load_backup, restore_backup
from safeinstall.store.journal import (
    Journal,
    JournalUnit,
    Phase,
    clear_journal,
    effective_phase,
    units_to_start,
)
from safeinstall.store.state import PROBE_SUFFIX, PUT_BACK_CACHE_S, RUN_DIR_REMOVAL_S
from safeinstall.system.gate import GATE_DROPIN, gate_marker
from safeinstall.system.systemd import Systemd


def restore_previous(
    env: Environment, backup: Backup, wheel_path: Path | None, state_dir: Path, run_id: str | None = None
) -> bool:
    """Put the backed-up distributions back, removing whatever (half-)install is there; False when the
    files were as saved. Adds the new wheel's files (from the run's own copy) to what is removed;
    ``run_id``: whose kept links go back instead of copies."""
    remove: list[Path] = []
    if wheel_path is not None and is_wheel_copy(wheel_path, state_dir):
        try:
            wheel = read_wheel(wheel_path)
        except SafeInstallError:
            wheel = None
        if wheel is not None:
            own = environment_files(env)  # never removed, whatever a wheel says (preflight refuses those)
            for member in wheel.members:
                location = install_location(wheel, member, env)
                if location is not None and str(location) not in own:
                    remove.append(location)
    result = restore_backup(backup, env, remove, run_id=run_id)
    if not result.ok:
        problems = [*result.mismatches, *result.failures][:5]
        raise SafeInstallError(
            f"restoring the backup {backup.dir} failed: {problems}",
            hint="the backup is kept; fix the cause (disk full? permissions?) and run safeinstall --recover",
        )
    return not result.unchanged


@dataclass(frozen=True, slots=True)
class PutBack:
    restored: bool  # the backup was written back
    unchanged: bool  # a restore was due, but the files were found exactly as saved: nothing written
    started: tuple[str, ...]
    gates_removed: tuple[str, ...]
    notes: tuple[str, ...]


def put_back(
    state_dir: Path,
    journal: Journal,
    environ: Mapping[str, str],
    restore: tuple[Environment, Backup] | None,
    start: Callable[[list[JournalUnit]], None],
    finished: Callable[[PutBack], None] = lambda done: None,
) -> PutBack:
    """The one put-back sequence: restore the backup (``restore``), open the gate, start the units the run
    stopped (``start``), remove the drop-ins, call ``finished``, clear the journal, drop the wheel copy.
    Raises SafeInstallError; the journal is then kept."""
    notes: list[str] = []
    restored = unchanged = False
    # the run's staging tree (a swap's): new files not put in place, or the old trees it exchanged
    # (the backup holds those too); bounded while the units are down, tried again once they run
    staging = Path(journal.prefix), f"{STAGING_PREFIX}{journal.run_id}"
    there = os.path.lexists(os.path.join(*staging))
    ids: Ids = None  # the prefix's owner writes in it (docs/privsep.md); None: root itself
    if there:
        try:
            ids = owner_of(staging[0])
        except OSError as exc:  # never root's writes where the prefix's owner is unknown (a link swapped in)
            there = False
            notes.append(
                f"{staging[0]}: its owner could not be read ({exc.strerror or exc}): its staging directory "
                f"{staging[1]} is left as it is"
            )
    if restore is None and _swapped(journal) and there:
        notes.extend(_keep_late_files(journal, *staging, ids))
    if there:
        discard_staging(*staging, PUT_BACK_CACHE_S, ids)
    if restore is not None:
        env, backup = restore
        wheel = Path(journal.wheel) if journal.wheel else None
        restored = restore_previous(env, backup, wheel, state_dir, journal.run_id)
        unchanged = not restored
        if unchanged:
            notes.append("the files were found as they were before the run: nothing to restore")
    # the kept links of the old files (restored now, or never needed): they hold the old version's blocks
    if not keep.discard(Path(journal.prefix), journal.run_id, RUN_DIR_REMOVAL_S):
        kept = Path(journal.prefix) / keep.keep_name(journal.run_id)
        notes.append(f"{kept} could not be removed: remove it by hand")
    gate_marker(state_dir).unlink(missing_ok=True)
    units = units_to_start(journal)
    start(units)
    gates = remove_gates(journal, environ, notes)
    notes.extend(_discard_probe(journal))
    if restore is not None:  # the restored RECORDs meet the anchors they had (the units run meanwhile)
        note = carry_over(state_dir.parent, restore[0].prefix, restore[1])
        notes.extend([note] if note else [])
    if (
        there
        and os.path.lexists(os.path.join(*staging))
        and not discard_staging(*staging, RUN_DIR_REMOVAL_S, ids)
    ):
        notes.append(f"{os.path.join(*staging)} could not be removed: remove it by hand")
    done = PutBack(restored, unchanged, tuple(u.name for u in units), gates, tuple(notes))
    finished(done)
    clear_journal(state_dir)
    if journal.wheel:
        discard_wheel_copy(Path(journal.wheel), state_dir)
    return done


def _discard_probe(journal: Journal) -> list[str]:
    """The run's probe tree (docs/window.md: never live, made before the stop), removed by the prefix's
    owner; what could not be, said."""
    prefix, name = Path(journal.prefix), f"{STAGING_PREFIX}{journal.run_id}{PROBE_SUFFIX}"
    if not os.path.lexists(prefix / name):
        return []
    try:
        ids = owner_of(prefix)
    except OSError as exc:
        return [f"{prefix}: its owner could not be read ({exc.strerror or exc}): {name} is left as it is"]
    if discard_staging(prefix, name, RUN_DIR_REMOVAL_S, ids):
        return []
    return [f"{prefix / name} could not be removed: remove it by hand"]


def _swapped(journal: Journal) -> bool:
    """Pure: the run's swap was done and verified (its staging directory holds only old entries)."""
    return effective_phase(journal) in (Phase.VERIFIED, Phase.RESTARTING, Phase.DONE)


def _keep_late_files(journal: Journal, prefix: Path, name: str, ids: Ids) -> list[str]:
    """A swap that died after its verification left the old entries in its staging directory: files in
    them that its backup does not hold (they appeared after the backup) are put back where they were,
    as the run would have; if one cannot be, the directory is kept aside (never deleted unseen)."""
    root = prefix / name
    try:
        if journal.backup_dir is None:
            raise OSError("the journal names no backup")
        known = frozenset(f.path for f in load_backup(Path(journal.backup_dir)).manifest.files)
        left = put_back_unknown(root, prefix, unknown_in_old(root, known), ids)
    except (OSError, SafeInstallError) as exc:
        left = [f"(the old files could not be compared with the backup: {exc})"]
    if not left:
        return []
    kept = keep_staging(prefix, name, ids) or root
    return [
        f"{len(left)} file(s) that appeared in the old version's directories after the backup could not be "
        f"put back (first: {left[0]}): kept in {kept}"
    ]


def remove_gates(journal: Journal, environ: Mapping[str, str], notes: list[str]) -> tuple[str, ...]:
    removed: list[str] = []
    managers: dict[bool, Systemd] = {}
    for unit in journal.units:
        systemd = managers.setdefault(unit.user_manager, Systemd(user=unit.user_manager, environ=environ))
        try:
            if systemd.remove_dropin(unit.name, GATE_DROPIN, persistent=True):
                removed.append(unit.name)
        except SafeInstallError as exc:
            notes.append(f"could not ask the manager to remove the gate of {unit.name}: {exc.message}")
    for path in journal.gate:  # checked: only these units' own gate drop-ins (read_checked_journal)
        if os.path.lexists(path):
            os.unlink(path)
            removed.append(path)
    return tuple(removed)
