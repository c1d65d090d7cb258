"""``--recover``: finish a run that died, from its journal (the backup restored where needed, the units
started, the gate removed). What ``safeinstall-recover.service`` runs at boot.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safeinstall.env import keep, renames
from safeinstall.env.environment import Environment, inspect_environment, resolve_python
from safeinstall.env.wheelcopy import discard_dead_copies, is_wheel_copy
from safeinstall.errors import ExitCode, LockHeldError, RollbackFailed, SafeInstallError, StepFailed
from safeinstall.run.back.putback import PutBack, put_back
from safeinstall.run.parts.output import envelope, jsonable
from safeinstall.run.parts.units import start_journalled, stop_journalled
from safeinstall.store.backup import Backup, load_backup
from safeinstall.store.history import find as find_entry
from safeinstall.store.history import keep_result
from safeinstall.store.journal import (
    Journal,
    JournalError,
    JournalUnit,
    Phase,
    effective_phase,
    journal_problems,
    needs_restore,
    read_journal,
    units_to_start,
)
from safeinstall.store.rundoc import RunDocument
from safeinstall.store.state import (
    PUT_BACK_CACHE_S,
    RUN_DIR_REMOVAL_S,
    EnvironmentState,
    StateDirError,
    check_trusted,
    list_environment_dirs,
    remove_dead_temps,
    remove_uv_caches,
    state_root,
    trusted_environment_state,
)
from safeinstall.system.gate import GATE_DROPIN, gate_dropin_text, gate_marker
from safeinstall.system.lock import acquire_lock
from safeinstall.system.safefs import open_file
from safeinstall.system.systemd import Systemd, default_dropin_root


@dataclass(frozen=True, slots=True)
class Recovery:
    prefix: str
    run_id: str | None  # None: there was nothing to recover
    phase: str | None
    restored: bool = False
    started: tuple[str, ...] = ()
    gates_removed: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    #: a live run holds the environment's lock (``--recover`` over all environments): its journal is
    #: that run's own, nothing to recover; said, not an error
    busy: bool = False

    @property
    def put_back_new_version(self) -> bool:
        """The run's new version, verified and started, did not come up: the backup was restored."""
        return self.restored and self.phase in KEPT_PHASES


def states_of(
    environ: Mapping[str, str], python: str | None, env: Environment | None = None
) -> list[EnvironmentState]:
    """The environments to look at (``env``: the one ``python`` names, inspected already); refuses
    (StateDirError) an untrusted state root. A listed environment directory that is not trusted comes
    with its ``problem``."""
    root = state_root(environ, os.geteuid())
    if python is None:
        return list_environment_dirs(root)
    check_trusted(root)
    env = env or inspect_environment(resolve_python(python, environ))
    return [trusted_environment_state(root, env.prefix)]


def _dropin_roots(journal: Journal, environ: Mapping[str, str]) -> dict[bool, tuple[Path, ...]]:
    """Where each of the journal's managers reads persistent drop-ins: asked of the manager, or its
    default when it cannot be asked (a user manager that is not running at boot)."""
    roots: dict[bool, tuple[Path, ...]] = {}
    for user in sorted({unit.user_manager for unit in journal.units}):
        try:
            roots[user] = (Systemd(user=user, environ=environ).dropin_roots().persistent,)
        except SafeInstallError:
            roots[user] = (default_dropin_root(user, environ),)
    return roots


def read_checked_journal(state: EnvironmentState, environ: Mapping[str, str]) -> Journal | None:
    """The environment's journal, or None; refused (exit 2) unless its directory is trusted, the file
    is one safeinstall wrote, and every field a recovery acts on is as a run of this environment
    writes it (see :func:`safeinstall.store.journal.journal_problems`)."""
    if state.problem is not None:
        raise StateDirError(
            f"refusing to use the state directory {state.dir}: {state.problem}",
            hint="another user could have planted a journal there for root to act on; look at it, then "
            "remove it or make it owned by root (or you) and writable by nobody else",
        )
    journal = read_journal(state.dir)
    if journal is None:
        return None
    problems = journal_problems(journal, state.dir, _dropin_roots(journal, environ))
    if problems:
        raise JournalError(
            f"refusing the run journal {state.journal}: " + "; ".join(problems),
            hint="safeinstall did not write this journal as it is, so nothing it names is run, started "
            "or deleted; look at it, put things back by hand if needed, then remove it",
        )
    return journal


#: A run that died in one of these had verified its new version: a recovery keeps it.
KEPT_PHASES = frozenset({Phase.VERIFIED, Phase.RESTARTING, Phase.DONE})


def recovered_result(
    journal: Journal,
    recovery: Recovery,
    log_file: str,
    ended: int | None = None,
    discarded: bool = False,
) -> dict[str, Any]:
    """Pure: the ``reinstall`` document of a run ``--recover`` finished (status ``recovered``): exit 0 when
    the verified new version was kept, 3 when the environment is as before the run. ``ended``: the exit
    code the run reported, None when it died without one; ``discarded``: a prepared run ``--discard``
    dropped (status ``discarded``, exit 0).
    """
    phase = effective_phase(journal)
    if discarded:
        note = f"the prepared run {journal.run_id} was discarded (safeinstall --discard): nothing was stopped"
        data = {
            **jsonable(recovery),
            "log_file": log_file,
            "notes": [note, *recovery.notes],
            "old_version": journal.old_version,
            "new_version": journal.new_version,
        }
        return envelope("reinstall", "discarded", ExitCode.OK, data, [])
    died = f"the run {journal.run_id} died in phase {phase} (PID {journal.pid}) without a result"
    if ended is not None:
        died = f"the run {journal.run_id} ended in phase {phase} with exit {ended}, its put-back unfinished"
    notes = [f"{died}; safeinstall --recover finished it"]
    errors: list[SafeInstallError] = []
    if phase in KEPT_PHASES and not recovery.restored:
        code = ExitCode.OK
        if phase != Phase.DONE:
            notes.append(
                "its new version was verified and is kept; the checks after its restart were not made"
            )
    else:
        code = ExitCode.ROLLED_BACK
        how = "restored the backup" if recovery.restored else "had nothing to restore"
        if phase in KEPT_PHASES:  # its new version did not come up (see restarted_new_version)
            how = "found that its new version did not come up, restored the backup"
        errors.append(
            StepFailed(
                f"{died}: safeinstall --recover {how}, and the environment is as it was before the run",
                hint="run it again",
            )
        )
    if recovery.started:
        notes.append("started again: " + ", ".join(recovery.started))
    data = {
        **jsonable(recovery),
        "log_file": log_file,
        "notes": [*notes, *recovery.notes],
        "old_version": journal.old_version,
        "new_version": journal.new_version,
    }
    return envelope("reinstall", "recovered", code, data, errors)


def _keep_recovered(
    state: EnvironmentState, journal: Journal, recovery: Recovery, discarded: bool = False
) -> tuple[str, ...]:
    """The recovered run's end, as a run's own: notes and result in its log, an entry in the history
    (so that ``--status`` lists it and ``--status --wait --run`` returns it); what went wrong, if anything."""
    log = state.log_file(journal.run_id)
    ended = _reported_exit(state, journal.run_id)
    result = RunDocument.from_json(recovered_result(journal, recovery, str(log), ended, discarded))
    # a run that ended with a result said its error; what the recovery did is then no error
    said = "error: " if ended is None else ""
    lines = (*result.details.notes, *(f"{said}{e.message}" for e in result.errors))
    return keep_result(
        state,
        journal.run_id,
        journal.package,
        journal.started_at,
        result,
        tuple(f"{'discard' if discarded else 'recover'}: {x}" for x in lines),
    )


def _reported_exit(state: EnvironmentState, run_id: str) -> int | None:
    """The exit code the run reported in its history entry (a run whose put-back failed has one), or
    None (it died without a result; or its entry is damaged)."""
    try:
        entry = find_entry(state, run_id)
    except SafeInstallError:
        return None
    return entry.result.exit_code if entry is not None else None


def _tidy(state: EnvironmentState, prefix: str, environ: Mapping[str, str]) -> None:
    """No run to recover: under the lock (unless a live run holds it: what is there is its own), what
    runs that died left without a journal goes: their copies of the wheel, uv caches and scratch
    directories, temp files of the gate marker, the gate drop-ins left in its units (docs/faults.md).
    A lock that cannot be taken (held, a full disk) leaves them for the next run."""
    try:
        with acquire_lock(state.lock, prefix):
            if not state.journal.exists():
                discard_dead_copies(state.dir)
                remove_uv_caches(state)
                remove_dead_temps(state)
                if state.prefix is not None:  # a dead run's kept links of the old files
                    keep.discard_leftovers(state.prefix)
                    _discard_stagings(state.prefix)
                _remove_stray_gates(state, environ)
    except SafeInstallError:
        return


def _discard_stagings(prefix: Path) -> None:
    """No run to recover: the staging directories left in the prefix (a commit's old version, a dead
    run's tree) go, by the prefix's owner."""
    try:
        names = renames.leftover_stagings(prefix)
        ids = renames.owner_of(prefix) if names else None
    except (OSError, SafeInstallError):
        return
    for name in names:
        renames.discard_staging(prefix, name, RUN_DIR_REMOVAL_S, ids)


#: a gate drop-in is a few hundred bytes: anything longer is not one
_GATE_LIMIT = 4096


def _remove_stray_gates(state: EnvironmentState, environ: Mapping[str, str]) -> tuple[str, ...]:
    """Under the lock with no journal: remove the gate drop-ins a run left in this environment's units
    (found by their text) and reload the managers. Returns the paths removed; a failure waits for the
    next.
    """
    wanted = gate_dropin_text(gate_marker(state.dir), "").splitlines()[-1]
    removed: list[str] = []
    for user in (False, True):
        try:
            systemd = Systemd(user=user, environ=environ)
            root = systemd.dropin_roots().persistent
        except SafeInstallError:
            continue  # no such manager here (no user manager at boot): none of its units can be gated
        for path in sorted(root.glob(f"*.d/{GATE_DROPIN}.conf")):
            try:
                fd, _info = open_file(path, follow=False)  # a user manager's: a device is never opened
                with os.fdopen(fd, "rb") as handle:
                    text = handle.read(_GATE_LIMIT).decode("utf-8", "replace")
            except OSError:
                continue
            if wanted not in text.splitlines():
                continue  # another environment's gate (its own run may be live)
            with contextlib.suppress(SafeInstallError):
                if systemd.remove_dropin(path.parent.name[: -len(".d")], GATE_DROPIN, persistent=True):
                    removed.append(str(path))
    return tuple(removed)


def recover_one(
    state: EnvironmentState, environ: Mapping[str, str], settle: float = 2.0, *, discarding: bool = False
) -> Recovery:
    """The run the environment's journal names finished (put back, or kept); ``discarding``: a prepared
    run dropped by ``--discard`` (its history entry says ``discarded``, not ``recovered``)."""
    prefix = str(state.prefix or state.dir)
    if read_checked_journal(state, environ) is None:
        _tidy(state, prefix, environ)
        return Recovery(prefix, None, None, notes=("nothing to recover",))
    with acquire_lock(state.lock, prefix) as lock:
        journal = read_checked_journal(state, environ)  # again, under the lock
        if journal is None:
            return Recovery(prefix, None, None, notes=("nothing to recover",))
        notes: list[str] = [lock.takeover_note] if lock.takeover_note else []
        phase = str(effective_phase(journal))

        def recovery(done: PutBack) -> Recovery:
            return Recovery(
                prefix,
                journal.run_id,
                phase,
                done.restored,
                done.started,
                done.gates_removed,
                (*notes, *done.notes),
            )

        def start_units(units: list[JournalUnit]) -> None:
            start_journalled(units, environ, settle)

        def finished(done: PutBack) -> None:  # before the journal goes: a waiter finds the entry
            dropped = discarding and journal.phase == Phase.PREPARED  # else what it is: a recovery
            notes.extend(_keep_recovered(state, journal, recovery(done), dropped))

        try:
            restore: tuple[Environment, Backup] | None = None
            if needs_restore(journal):
                if journal.wheel is not None and not is_wheel_copy(Path(journal.wheel), state.dir):
                    notes.append(
                        f"the wheel {journal.wheel} is not the run's own copy in the state directory and "
                        "was not read again: only what the installed RECORDs list was removed"
                    )
                restore = _restore_of(journal, state)
            # the dead run's own uv cache (and scratch) first: nothing may share inodes with it, and on a
            # full disk the restore needs the room it holds (bounded: its owner may keep filling it)
            left = remove_uv_caches(state, seconds=PUT_BACK_CACHE_S, probes=False)
            try:
                done = put_back(state.dir, journal, environ, restore, start_units, finished)
            except SafeInstallError as exc:
                if restore is not None or not restarted_new_version(journal):
                    raise
                # the new version was verified and started, and does not come up: as the live run would
                # have, the units are stopped, the previous installation is put back, they start again
                notes.append(f"the new version did not come up: {exc.message}; the previous one is put back")
                stop_journalled(units_to_start(journal), environ)
                restore = _restore_of(journal, state)
                done = put_back(state.dir, journal, environ, restore, start_units, finished)
            left = remove_uv_caches(state)  # what was left, and a probe's cache (kept out of the downtime)
            notes.extend(f"{path} is still being filled by its owner: left for the next run" for path in left)
            discard_dead_copies(state.dir)  # the journal is gone: no copy of a wheel is of use now
            remove_dead_temps(state)
        except JournalError:
            raise  # refused before anything was done: exit 2, as for any refusal
        except Exception as caught:  # whatever failed, the journal and the backup are kept and said
            failure = (
                caught if isinstance(caught, SafeInstallError) else SafeInstallError(_unexpected(caught))
            )
            if restarted_new_version(journal):  # the best attempt: the units run on what is there
                _start_best_effort(units_to_start(journal), environ, settle)
            commands = [
                f"systemctl {'--user ' if u.user_manager else ''}start {u.name}"
                for u in units_to_start(journal)
            ]
            raise RollbackFailed(
                f"recovering the run {journal.run_id} ({journal.package} in {journal.prefix}, died in phase "
                f"{phase}) failed: {failure.message}",
                hint="the journal and the backup are kept; fix the cause and run safeinstall --recover again"
                + (f"; units to start: {'; '.join(commands)}" if commands else ""),
            ) from caught
        return recovery(done)


def _unexpected(exc: Exception) -> str:
    """Pure: what an unexpected failure of a put-back says (its type and message)."""
    return f"{type(exc).__name__}: {exc}"


def _restore_of(journal: Journal, state: EnvironmentState) -> tuple[Environment, Backup]:
    """The environment and the backup to put back, as the journal names them (checked)."""
    if journal.backup_dir is None:
        raise SafeInstallError("the journal names no backup")
    env = inspect_environment(Path(journal.python))
    if env.prefix != Path(journal.prefix):
        raise JournalError(
            f"{journal.python} reports the prefix {env.prefix}, not {journal.prefix}: "
            "refusing to restore into another environment",
            hint="look at the journal and the environment, then put things back by hand",
        )
    return env, load_backup(Path(journal.backup_dir))


def restarted_new_version(journal: Journal) -> bool:
    """Pure: the run died once its new version was verified, before it saw the units settle on it: if
    one does not come up, the recovery puts the previous installation back, as the run would have."""
    return effective_phase(journal) in (Phase.VERIFIED, Phase.RESTARTING) and journal.backup_dir is not None


def _start_best_effort(units: list[JournalUnit], environ: Mapping[str, str], settle: float) -> None:
    """The put-back failed: the units still get a start on what is installed (what failed is said)."""
    with contextlib.suppress(SafeInstallError):
        start_journalled(units, environ, settle)


@dataclass(frozen=True, slots=True)
class Recovered:
    recoveries: tuple[Recovery, ...]
    failures: tuple[SafeInstallError, ...]  # environments that could not be recovered (each says why)

    @property
    def exit_code(self) -> ExitCode:
        """0; 4 when a recovery failed (its services may be down); else the first failure's code; 3 when
        every environment was recovered but a new version that did not come up was put back."""
        if not self.failures:
            put_back = any(r.put_back_new_version for r in self.recoveries)
            return ExitCode.ROLLED_BACK if put_back else ExitCode.OK
        if any(f.exit_code == ExitCode.ROLLBACK_FAILED for f in self.failures):
            return ExitCode.ROLLBACK_FAILED
        return self.failures[0].exit_code


def said_errors(recovered: Recovered) -> tuple[SafeInstallError, ...]:
    """Pure: what ``--recover`` says as ``error:`` and ``hint:`` lines (and its ``--json`` errors): the
    environments it could not recover, and each run whose new version did not come up, put back (exit
    3: a person must look at the new version before the next run)."""
    put_back = tuple(
        StepFailed(
            f"the run {r.run_id} in {r.prefix} had verified its new version, which did not come up once "
            f"started: the previous one was put back and started ({', '.join(r.started) or 'no unit'})",
            hint="see why the new version did not come up (journalctl -u UNIT, the run's log under "
            "safeinstall --status); fix it, then run the reinstall again",
        )
        for r in recovered.recoveries
        if r.put_back_new_version
    )
    return (*recovered.failures, *put_back)


#: ``--recover``'s hint when a live run holds the environment's lock (it did not die: nothing to recover)
LIVE_RUN_HINT = (
    "a live run holds it, it did not die: nothing to recover; wait for it (safeinstall --status --wait)"
)


def recover(environ: Mapping[str, str], python: str | None, settle: float = 2.0) -> Recovered:
    """Recover every environment with a journal left (or the one ``python`` names). One that fails
    does not stop the others: at boot, every environment's units matter. Over all environments, one
    whose lock a live run holds is said (``busy``), not a failure: the exit code is what was recovered."""
    recoveries: list[Recovery] = []
    failures: list[SafeInstallError] = []
    for state in states_of(environ, python):
        try:
            recoveries.append(recover_one(state, environ, settle))
        except LockHeldError as exc:
            if python is not None:  # the one environment asked for: refused (exit 2), as a run is
                failures.append(LockHeldError(exc.message, hint=LIVE_RUN_HINT))  # not lock's "run --recover"
                continue
            prefix = str(state.prefix or state.dir)
            said = f"{exc.message}: a live run, nothing to recover (safeinstall --status --wait follows it)"
            recoveries.append(Recovery(prefix, None, None, notes=(said,), busy=True))
        except SafeInstallError as exc:
            failures.append(exc)
    return Recovered(tuple(recoveries), tuple(failures))
