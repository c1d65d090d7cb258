"""``--status`` (what each environment's state holds: a run in progress, one to recover, the last runs)
and ``--forget`` (the state of environments that are gone). Reads the same checked journal as
``--recover`` (:func:`safeinstall.run.back.recover.read_checked_journal`) and never acts on it.
"""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from safeinstall.env.environment import inspect_environment, resolve_python
from safeinstall.errors import ExitCode, SafeInstallError, UsageError
from safeinstall.run.back.recover import read_checked_journal, states_of
from safeinstall.run.parts.undo import with_undo
from safeinstall.store.history import RunSummary, read_history
from safeinstall.store.journal import Phase, read_journal
from safeinstall.store.prepared import read_prepared
from safeinstall.store.state import (
    EnvironmentState,
    StateDirError,
    check_trusted,
    environment_state,
    is_run_id,
    list_environment_dirs,
    state_root,
)
from safeinstall.system.gate import gate_marker
from safeinstall.system.lock import LockHolder, acquire_lock, read_holder
from safeinstall.system.safefs import Tree


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
    state_dir: str = ""
    prefix_exists: bool | None = None  # False: the environment is gone (--forget removes its state)
    run_id: str | None = None  # the run in progress (or that needs recovery), from its journal
    runs: tuple[RunSummary, ...] = ()  # the last finished runs, newest first
    history_problems: tuple[str, ...] = ()  # damaged history entries, skipped
    prepared: PreparedSummary | None = None  # a prepared run waiting for --commit (docs/prepare.md)


@dataclass(frozen=True, slots=True)
class PreparedSummary:
    run_id: str
    age_s: float  # since the prepare ended
    changes: tuple[str, ...]  # what the commit will change ("sicext 1.0 -> 2.0")
    units: tuple[str, ...]  # the units the commit stops and starts
    staged: bool  # the window renames a staged tree in (else uv installs in it)


def prepared_summary(state: EnvironmentState, now: float) -> tuple[PreparedSummary | None, str | None]:
    """The prepared run's summary, or why its record cannot be read."""
    try:
        record = read_prepared(state, summary=True)  # any format; not its per-file tables
    except SafeInstallError as exc:
        return None, exc.message
    if record is None:
        return None, "a prepared run without its record (safeinstall --discard drops it)"
    age = max(0.0, now - record.prepared_at)
    return PreparedSummary(record.run_id, age, record.changes, record.units, bool(record.staged_root)), None


@dataclass(frozen=True, slots=True)
class Forgotten:
    prefix: str
    state_dir: str  # what was removed: the environment's state directory, or (run_id) one backup's
    run_id: str | None = None  # --forget --run: the run whose kept backup was dropped


def prefix_exists(state: EnvironmentState) -> bool | None:
    """Whether the environment is still there (None: its prefix was never recorded)."""
    return None if state.prefix is None else os.path.isdir(state.prefix)


@dataclass(frozen=True, slots=True)
class StatusReport:
    environments: tuple[EnvironmentStatus, ...]
    failures: tuple[SafeInstallError, ...]  # environments whose state was refused (each says why)

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.REFUSED if self.failures else ExitCode.OK


def status(environ: Mapping[str, str], python: str | None) -> StatusReport:
    found: list[EnvironmentStatus] = []
    failures: list[SafeInstallError] = []
    for state in states_of(environ, python):
        try:
            journal = read_checked_journal(state, environ)
        except SafeInstallError as exc:
            failures.append(exc)
            continue
        running, holder = read_holder(state.lock) if state.lock.exists() else (False, None)
        history = read_history(state)
        waiting = journal is not None and journal.phase == Phase.PREPARED
        prepared, problem = prepared_summary(state, time.time()) if waiting else (None, None)
        found.append(
            EnvironmentStatus(
                prefix=str(state.prefix or state.dir),
                running=running,
                holder=holder if running else None,
                journal_phase=str(journal.phase) if journal else None,
                needs_recovery=journal is not None and not running and not waiting,
                gated=gate_marker(state.dir).exists(),
                package=journal.package if journal else None,
                units=tuple(u.name for u in journal.units) if journal else (),
                state_dir=str(state.dir),
                prefix_exists=prefix_exists(state),
                run_id=journal.run_id if journal else None,
                runs=with_undo(state, history.runs),
                history_problems=(*history.problems, *([problem] if problem else [])),
                prepared=prepared,
            )
        )
    return StatusReport(tuple(found), tuple(failures))


def _named(states: list[EnvironmentState], python: str, environ: Mapping[str, str]) -> list[EnvironmentState]:
    """The state of the environment ``python`` names: a live interpreter or venv, or the prefix (or
    the interpreter path) of one that is gone."""
    try:
        env = inspect_environment(resolve_python(python, environ))
    except SafeInstallError:
        given = os.path.abspath(python)
        candidates = {given, os.path.dirname(os.path.dirname(given))}
        return [s for s in states if s.prefix is not None and os.fspath(s.prefix) in candidates]
    key = environment_state(state_root(environ, os.geteuid()), env.prefix).key
    return [s for s in states if s.key == key]


def forget_one(state: EnvironmentState) -> Forgotten:
    """Remove one environment's state directory (its backups, logs and history), under its lock;
    refused while a run holds it or a journal says a run did not finish."""
    prefix = str(state.prefix or state.dir)
    unfinished = SafeInstallError(
        f"not forgetting {prefix}: a run there did not finish (its journal is in {state.dir})",
        hint="run safeinstall --recover first; or, if the environment is gone for good, remove "
        f"{state.dir} by hand",
    )
    if read_journal(state.dir) is not None:
        raise unfinished
    with acquire_lock(state.lock, prefix):
        if read_journal(state.dir) is not None:
            raise unfinished
        with Tree(state.dir.parent) as tree:  # a uv cache a crashed run left there is the owner's
            tree.remove_tree(state.dir.name)
    return Forgotten(prefix, str(state.dir))


def forget_backup(state: EnvironmentState, run_id: str) -> Forgotten:
    """Remove one kept backup of an environment (``--forget --run RUN_ID``: what a refusal for room
    names), under its lock; refused while a run holds it, or where a run that did not finish (or one
    prepared) is that run."""
    prefix = str(state.prefix or state.dir)
    if not is_run_id(run_id):
        raise UsageError(
            f"--run {run_id!r} is not a run id (as 20261206T071500Z-1234)",
            hint="safeinstall --status -v lists the runs of each environment",
        )
    path = state.backup_dir(run_id)
    with acquire_lock(state.lock, prefix):
        journal = read_journal(state.dir)
        if journal is not None and journal.run_id == run_id:
            raise SafeInstallError(
                f"not forgetting the backup of run {run_id}: that run did not finish (its journal is in "
                f"{state.dir})",
                hint="run safeinstall --recover first (safeinstall --discard for a prepared run)",
            )
        if not path.is_dir() or path.is_symlink():
            raise UsageError(
                f"{prefix} keeps no backup of run {run_id} (in {state.backups})",
                hint=f"safeinstall --status -v --python {prefix} lists its runs",
            )
        with Tree(state.backups) as tree:
            tree.remove_tree(run_id)
    return Forgotten(prefix, str(path), run_id)


def forget(
    environ: Mapping[str, str], python: str | None, run_id: str | None = None, live: bool = False
) -> tuple[tuple[Forgotten, ...], tuple[SafeInstallError, ...]]:
    """``--forget``: the state of every environment whose prefix is gone, or of the one ``python``
    names (one still there only with ``live``: ``--yes``); with ``run_id`` (and ``python``), only that
    run's kept backup of it. Only directories listed under the state root are ever removed."""
    root = state_root(environ, os.geteuid())
    check_trusted(root)
    states = list_environment_dirs(root)
    named = None if python is None else _named(states, python, environ)
    if named == []:
        raise UsageError(
            f"no safeinstall state for {python}",
            hint="safeinstall --status lists the environments it keeps state for",
        )
    if run_id is not None and named:
        state = named[0]
        try:
            if state.problem is not None:
                raise StateDirError(
                    f"not forgetting a backup in {state.dir}: {state.problem}",
                    hint="make it owned by root (or you) and writable by nobody else",
                )
            return (forget_backup(state, run_id),), ()
        except SafeInstallError as exc:
            return (), (exc,)
        except OSError as exc:
            return (), (
                SafeInstallError(f"could not remove {state.backup_dir(run_id)}: {exc.strerror or exc}"),
            )
    chosen = [s for s in states if prefix_exists(s) is False] if named is None else named
    forgotten: list[Forgotten] = []
    failures: list[SafeInstallError] = []
    for state in chosen:
        if state.problem is not None:
            failures.append(
                StateDirError(
                    f"not forgetting {state.dir}: {state.problem}",
                    hint="make it owned by root (or you) and writable by nobody else, or remove it by hand",
                )
            )
            continue
        if not live and prefix_exists(state):  # its backups are the way back of --undo
            failures.append(
                SafeInstallError(
                    f"not forgetting {state.prefix}: the environment is still there, and its state holds "
                    "the backups --undo goes back with",
                    hint=f"add --yes to forget its backups, logs and history all the same; or drop one "
                    f"backup: safeinstall --forget --python {state.prefix} --run RUN_ID",
                )
            )
            continue
        try:
            forgotten.append(forget_one(state))
        except SafeInstallError as exc:
            failures.append(exc)
        except OSError as exc:
            failures.append(SafeInstallError(f"could not remove {state.dir}: {exc.strerror or exc}"))
    return tuple(forgotten), tuple(failures)
