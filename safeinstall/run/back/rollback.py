"""The way back: on any failure after the stop, the run's rollback puts the previous files and the
stopped units back through the one put-back sequence (:func:`safeinstall.run.back.putback.put_back`); exit 3,
or exit 4 with the commands that finish the job when putting back fails too.
"""

from __future__ import annotations

import shutil
import signal
import time
from collections.abc import Callable

from safeinstall.errors import (
    Aborted,
    ExitCode,
    RollbackFailed,
    SafeInstallError,
    StepFailed,
)
from safeinstall.run.back.putback import put_back
from safeinstall.run.parts.running import Run, phase_at_least
from safeinstall.run.parts.units import reset_start_limits, start_and_settle, stop_units
from safeinstall.store.journal import (
    JournalUnit,
    Phase,
)
from safeinstall.store.rundoc import StepDoc
from safeinstall.store.state import (
    PUT_BACK_CACHE_S,
    remove_uv_caches,
)
from safeinstall.system.signals import interrupts_deferred


def rollback(run: Run, error: SafeInstallError, abandon: Callable[[Run], None]) -> SafeInstallError:
    """Put everything back; returns the error to report (StepFailed, or RollbackFailed). ``abandon``
    ends first what still runs beside the steps (the smoke check:
    :func:`safeinstall.run.steps.smoke.abandon`)."""

    def announce(signum: int) -> None:
        run.reporter.note(
            f"{signal.Signals(signum).name} received during rollback: finishing it first so the "
            "services are not abandoned"
        )

    with interrupts_deferred(announce):
        abandon(run)  # first: a check still running beside the prefetch (safeinstall.run.steps.smoke)
        done: list[str] = []
        stopped_any = phase_at_least(run.journal, Phase.STOPPING)
        try:
            run.journal_phase_if_possible(Phase.ROLLING_BACK, note=error.message)
            if run.restart_started:
                stop_units(run.systemd, dict.fromkeys(run.units_to_restart(), run.stop_timeout(90.0)))
            # the install (uv's, or the swap's renames) may have begun: the backup goes back
            installed = phase_at_least(run.journal, Phase.INSTALLING) or phase_at_least(
                run.journal, Phase.SWAPPING
            )
            if installed:
                # the run's cache first: the installed files are its hardlinks, and on a full disk
                # the restore needs the room that removing them frees only once the cache is gone;
                # bounded, since its owner may keep filling it (the rest goes after the restart)
                left = remove_uv_caches(run.state, run.run_id, PUT_BACK_CACHE_S, probes=False)
                if left:
                    run.log(
                        f"the run's uv cache was still being filled after {PUT_BACK_CACHE_S:g} s: "
                        "restoring first, removing it afterwards"
                    )
            restore = None
            if installed and run.backup is not None:
                restore = (run.env, run.backup)
            outcome = put_back(
                run.state.dir,
                run.journal,
                run.options.environ,
                restore,
                lambda units: _start_again(run, units),
                lambda _done: run.journal_phase_if_possible(Phase.ROLLED_BACK),
            )
            run.notes.extend(outcome.notes)
            if outcome.restored:
                done.append("restored the previous installation")
            else:
                done.append("nothing was installed" if not installed else "the files were unchanged")
            if outcome.started:
                done.append("started " + ", ".join(outcome.started) + " again")
        except SafeInstallError as second:
            return _rollback_failed(run, error, second)
        except Exception as second:
            return _rollback_failed(run, error, SafeInstallError(str(second)))
    if not stopped_any:  # the run ended before the stop: nothing changed, exit 2 as for a refusal
        _remove_own_backup(run)
        if error.exit_code == ExitCode.REFUSED:
            return error
        return Aborted(f"{error.message}; nothing was stopped or installed", hint=error.hint)
    return StepFailed(
        f"{error.message}; {'; '.join(done)}",
        hint=f"{error.hint or StepFailed.default_hint}; the run's log: {run.log_file}",
    )


def rollback_step(run: Run, error: SafeInstallError, abandon: Callable[[Run], None]) -> SafeInstallError:
    """:func:`rollback`, as a step of its own once something was stopped: a progress line when it
    begins, then its step line (what it put back, or why it failed), as every step has."""
    started = time.monotonic()
    stopped = phase_at_least(run.journal, Phase.STOPPING)
    if stopped:
        run.reporter.progress(f"rolling back ({error.message})", None, None)
    outcome = rollback(run, error, abandon)
    if stopped:
        ok = outcome.exit_code == ExitCode.ROLLED_BACK
        detail = outcome.message.removeprefix(f"{error.message}; ") if ok else outcome.message
        seconds = time.monotonic() - started
        step = StepDoc(name="rollback", status="ok" if ok else "failed", seconds=seconds, detail=detail)
        run.add_step(step)
        run.reporter.step(step)
    return outcome


def _start_again(run: Run, units: list[JournalUnit]) -> None:
    if units:
        names = [u.name for u in units]
        reset_start_limits(run, names)  # the restart's starts counted too
        start_and_settle(run, names, min(run.options.settle, 2.0))


def _remove_own_backup(run: Run) -> None:
    """Nothing was installed: this run's backup (whole or partial) is of no use; it goes."""
    backup_dir = run.state.backup_dir(run.run_id)
    shutil.rmtree(backup_dir, ignore_errors=True)  # root's 0700 tree: nobody else writes in it
    if backup_dir.exists():
        run.notes.append(f"could not remove this run's unused backup {backup_dir}")
    run.backup = None


def _rollback_failed(run: Run, error: SafeInstallError, second: SafeInstallError) -> RollbackFailed:
    commands = [f"safeinstall --recover --python {run.env.python}"]
    flag = "--user " if run.options.user else ""
    commands += [f"systemctl {flag}start {u}" for u in run.units_to_restart()]
    return RollbackFailed(
        f"{error.message}; then putting things back failed too: {second.message}. "
        f"The backup ({run.journal.backup_dir}) and the journal are kept. To finish: "
        + " && ".join(commands),
        hint="run the commands above; safeinstall --status shows what is pending",
        commands=tuple(commands),
    )
