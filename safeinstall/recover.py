"""Recovery and status: finish a run that died (SIGKILL, OOM, power loss), or say what is pending.

``safeinstall --recover`` reads each environment's journal: if the install was not verified complete
it restores the backup; it starts every unit the run stopped that was active before; it removes the
reboot gate (marker and drop-ins) and clears the journal. It is what the shipped
``safeinstall-recover.service`` runs early at boot.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from safeinstall.backup import Backup, load_backup, restore_backup
from safeinstall.environment import Environment, inspect_environment, resolve_python
from safeinstall.errors import ExitCode, RollbackFailed, SafeInstallError
from safeinstall.gate import GATE_DROPIN, gate_marker
from safeinstall.journal import (
    Journal,
    JournalUnit,
    clear_journal,
    effective_phase,
    needs_restore,
    read_journal,
    units_to_start,
)
from safeinstall.lock import LockHolder, acquire_lock, read_holder
from safeinstall.state import (
    EnvironmentState,
    environment_state,
    list_environment_dirs,
    remove_uv_caches,
    state_root,
)
from safeinstall.systemd import Systemd, start_wait_s
from safeinstall.wheel import Wheel, install_location, read_wheel


@dataclass(frozen=True, slots=True)
class Recovery:
    prefix: str
    run_id: str | None  # None: there was nothing to recover
    phase: str | None
    restored: bool = False
    started: tuple[str, ...] = ()
    gates_removed: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class EnvironmentStatus:
    prefix: str
    running: bool  # a live run holds the lock
    holder: LockHolder | None
    journal_phase: str | None
    needs_recovery: bool  # a journal is left and no run holds the lock
    gated: bool
    package: str | None
    units: tuple[str, ...] = field(default_factory=tuple)


def read_wheel_if_possible(wheel_path: Path | None) -> Wheel | None:
    if wheel_path is None or not wheel_path.exists():
        return None
    try:
        return read_wheel(wheel_path)
    except SafeInstallError:
        return None


def restore_previous(env: Environment, backup: Backup, wheel: Wheel | None) -> None:
    """Put the backed-up distributions back, removing whatever (half-)install is there now.

    :func:`restore_backup` removes what the installed ``.dist-info`` of those names list; the new
    wheel's files are added here, for an install that died before it wrote its RECORD.
    """
    remove: list[Path] = []
    if wheel is not None:
        for member in wheel.members:
            location = install_location(wheel, member, env)
            if location is not None:
                remove.append(location)
    result = restore_backup(backup, env, remove)
    if not result.ok:
        problems = [*result.mismatches, *result.failures][:5]
        raise SafeInstallError(
            f"restoring the backup {backup.dir} failed: {problems}",
            hint="the backup is kept; fix the cause (disk full? permissions?) and run safeinstall --recover",
        )


def _states(environ: Mapping[str, str], python: str | None) -> list[EnvironmentState]:
    root = state_root(environ, os.geteuid())
    if python is None:
        return list_environment_dirs(root)
    env = inspect_environment(resolve_python(python, environ))
    return [environment_state(root, env.prefix)]


def _remove_gates(journal: Journal, environ: Mapping[str, str], notes: list[str]) -> tuple[str, ...]:
    removed: list[str] = []
    managers: dict[bool, Systemd] = {}
    for unit in journal.units:
        systemd = managers.setdefault(unit.user_manager, Systemd(user=unit.user_manager, environ=environ))
        try:
            if systemd.remove_dropin(unit.name, GATE_DROPIN, persistent=True):
                removed.append(unit.name)
        except SafeInstallError as exc:
            notes.append(f"could not ask the manager to remove the gate of {unit.name}: {exc.message}")
    for path in journal.gate:  # whatever the manager could not be asked about: by path
        if os.path.exists(path):
            os.unlink(path)
            removed.append(path)
    return tuple(removed)


def _start(units: list[JournalUnit], environ: Mapping[str, str], settle: float) -> tuple[str, ...]:
    started: list[str] = []
    failures: list[str] = []
    for unit in units:
        systemd = Systemd(user=unit.user_manager, environ=environ)
        before = systemd.info(unit.name)
        systemd.start(unit.name)
        outcome = systemd.wait_settled(unit.name, settle, start_wait_s(before), before=before)
        if outcome.ok:
            started.append(unit.name)
        else:
            failures.append(outcome.reason or f"{unit.name} did not come up")
    if failures:
        raise SafeInstallError("; ".join(failures))
    return tuple(started)


def recover_one(state: EnvironmentState, environ: Mapping[str, str], settle: float = 2.0) -> Recovery:
    prefix = str(state.prefix or state.dir)
    if read_journal(state.dir) is None:
        return Recovery(prefix, None, None, notes=("nothing to recover",))
    with acquire_lock(state.lock, prefix) as lock:
        journal = read_journal(state.dir)  # again, under the lock
        if journal is None:
            return Recovery(prefix, None, None, notes=("nothing to recover",))
        notes: list[str] = [lock.takeover_note] if lock.takeover_note else []
        phase = str(effective_phase(journal))
        restored = False
        try:
            if needs_restore(journal):
                if journal.backup_dir is None:
                    raise SafeInstallError("the journal names no backup")
                env = inspect_environment(Path(journal.python))
                wheel = read_wheel_if_possible(Path(journal.wheel) if journal.wheel else None)
                restore_previous(env, load_backup(Path(journal.backup_dir)), wheel)
                restored = True
            gate_marker(state.dir).unlink(missing_ok=True)
            started = _start(units_to_start(journal), environ, settle)
            gates = _remove_gates(journal, environ, notes)
        except SafeInstallError as exc:
            commands = [
                f"systemctl {'--user ' if u.user_manager else ''}start {u.name}"
                for u in units_to_start(journal)
            ]
            raise RollbackFailed(
                f"recovering the run {journal.run_id} ({journal.package} in {journal.prefix}, died in phase "
                f"{phase}) failed: {exc.message}",
                hint="the journal and the backup are kept; fix the cause and run safeinstall --recover again"
                + (f"; units to start: {'; '.join(commands)}" if commands else ""),
            ) from exc
        clear_journal(state.dir)
        remove_uv_caches(state)  # the dead run's own uv cache: nothing may share inodes with it
        return Recovery(prefix, journal.run_id, phase, restored, started, gates, tuple(notes))


@dataclass(frozen=True, slots=True)
class Recovered:
    recoveries: tuple[Recovery, ...]
    failures: tuple[SafeInstallError, ...]  # environments that could not be recovered (each says why)

    @property
    def exit_code(self) -> ExitCode:
        """0; 4 when a recovery failed (its services may be down); else the first failure's code."""
        if not self.failures:
            return ExitCode.OK
        if any(f.exit_code == ExitCode.ROLLBACK_FAILED for f in self.failures):
            return ExitCode.ROLLBACK_FAILED
        return self.failures[0].exit_code


def recover(environ: Mapping[str, str], python: str | None, settle: float = 2.0) -> Recovered:
    """Recover every environment with a journal left (or the one ``python`` names). One that fails
    does not stop the others: at boot, every environment's units matter."""
    recoveries: list[Recovery] = []
    failures: list[SafeInstallError] = []
    for state in _states(environ, python):
        try:
            recoveries.append(recover_one(state, environ, settle))
        except SafeInstallError as exc:
            failures.append(exc)
    return Recovered(tuple(recoveries), tuple(failures))


def status(environ: Mapping[str, str], python: str | None) -> list[EnvironmentStatus]:
    found: list[EnvironmentStatus] = []
    for state in _states(environ, python):
        running, holder = read_holder(state.lock) if state.lock.exists() else (False, None)
        journal = read_journal(state.dir)
        found.append(
            EnvironmentStatus(
                prefix=str(state.prefix or state.dir),
                running=running,
                holder=holder if running else None,
                journal_phase=str(journal.phase) if journal else None,
                needs_recovery=journal is not None and not running,
                gated=gate_marker(state.dir).exists(),
                package=journal.package if journal else None,
                units=tuple(u.name for u in journal.units) if journal else (),
            )
        )
    return found
