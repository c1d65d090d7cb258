"""The safe reinstall: preflight, backup, gate, stop, GPU release, install, verify, restart.

Every step is journalled before it starts (:mod:`safeinstall.journal`), so that a run killed at any
point can be finished by ``safeinstall --recover``. Any failure after the stop rolls back: the backup
is restored byte for byte and the units that were running are started again (exit 3). If that fails
too, the backup and the journal are kept and the commands that finish the job are printed (exit 4).

This module orchestrates; the decisions it relies on are pure functions elsewhere (plan, drift,
journal), and each kind of I/O sits behind its own module (systemd, gpus, uvplan, backup, ...).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import psutil

from safeinstall.backup import (
    Backup,
    create_backup,
    disk_space_needed,
    free_space,
    space_problem,
)
from safeinstall.distributions import InstalledDistribution, reload_distributions
from safeinstall.drift import FindingKind
from safeinstall.environment import Environment, inspect_environment, resolve_python
from safeinstall.errors import (
    Aborted,
    ExitCode,
    PlanError,
    RollbackFailed,
    SafeInstallError,
    StepFailed,
    WheelError,
)
from safeinstall.gate import GATE_DROPIN, gate_dropin_text, gate_marker
from safeinstall.gpus import GpuSnapshot, NvmlSession, ReleaseStatus, wait_for_release
from safeinstall.journal import (
    Journal,
    JournalUnit,
    Phase,
    advance,
    clear_journal,
    new_journal,
    start_journal,
    write_journal,
)
from safeinstall.lock import HeldLock, acquire_lock, process_start
from safeinstall.options import RunOptions
from safeinstall.plan import Plan, PlannedProcess, PlannedUnit
from safeinstall.processes import scan_processes
from safeinstall.recover import restore_previous
from safeinstall.retention import prune_backups
from safeinstall.signals import interrupts_deferred, interrupts_raise
from safeinstall.state import (
    EnvironmentState,
    atomic_write,
    ensure_dir,
    ensure_environment_dir,
    environment_state,
    new_run_id,
    remove_uv_caches,
    state_root,
)
from safeinstall.survey import Survey, survey, systemd_for
from safeinstall.systemd import StopOutcome, Systemd, start_wait_s
from safeinstall.uvplan import install as uv_install
from safeinstall.uvplan import prefetch_command, uv_binary
from safeinstall.verify import VerifyReport, verify_environment
from safeinstall.wheel import Wheel, fits, installed_size, read_wheel, target_tags

#: Failing findings after the install: anything but leftovers (those are reported, --prune removes them).
_INSTALL_FAILURES = frozenset(
    {
        FindingKind.MISSING,
        FindingKind.MODIFIED,
        FindingKind.VERSION_MISMATCH,
        FindingKind.UNREADABLE,
        FindingKind.MALFORMED,
        FindingKind.OUTSIDE,
    }
)


@dataclass(frozen=True, slots=True)
class StepOutcome:
    name: str
    status: str  # "ok" | "failed" | "skipped"
    seconds: float
    detail: str = ""


@dataclass(frozen=True, slots=True)
class RunResult:
    status: str  # "done" | "declined" | "rolled-back" | "rollback-failed"
    exit_code: ExitCode
    plan: Plan | None
    steps: tuple[StepOutcome, ...]
    downtime_s: dict[str, float]
    patched: tuple[str, ...]
    extras: tuple[str, ...]
    pruned: tuple[str, ...]
    backup_dir: str | None
    log_file: str | None
    not_restarted: tuple[str, ...]
    strays_killed: tuple[int, ...]
    error: SafeInstallError | None
    notes: tuple[str, ...]
    manual_commands: tuple[str, ...] = ()
    backups_removed: tuple[str, ...] = ()  # older backups deleted after a good run (--keep-backups)


class Reporter(Protocol):
    def step(self, outcome: StepOutcome) -> None: ...

    def progress(self, what: str, done: float | None, total: float | None) -> None: ...

    def note(self, text: str) -> None: ...

    def confirm(self, plan: Plan) -> bool: ...


@dataclass(frozen=True, slots=True)
class Preflight:
    """What the preflight established, each read once; every step takes it. Nothing was changed yet
    (the lock aside, which the run holds from here on)."""

    options: RunOptions
    env: Environment
    state: EnvironmentState
    lock: HeldLock
    wheel: Wheel | None  # read and checked once (its RECORD against its contents)
    survey: Survey  # the distributions found once (installed, affected), uv's plan, the plan
    systemd: Systemd
    notes: tuple[str, ...]

    @property
    def plan(self) -> Plan:
        return self.survey.plan


def preflight(options: RunOptions) -> Preflight:
    """Everything before the first change. Raises SafeInstallError (exit 2); holds the lock on return."""
    env = inspect_environment(resolve_python(options.python, options.environ))
    state = environment_state(state_root(options.environ, os.geteuid()), env.prefix)
    notes = [status.warning for status in ensure_environment_dir(state) if status.warning]
    lock = acquire_lock(state.lock, str(env.prefix))
    try:
        if lock.takeover_note:
            notes.append(lock.takeover_note)
        wheel: Wheel | None = None
        if options.wheel is not None:
            wheel = read_wheel(options.wheel)
            _check_wheel(wheel, options.package, env)
        surveyed = survey(options, env, wheel)
        if not surveyed.plan.proceeds:
            raise PlanError(
                "the run would refuse: " + "; ".join(surveyed.plan.refusals),
                hint=f"see safeinstall {options.package} --dry-run; nothing was stopped",
            )
        _check_space(env, state, wheel, surveyed)
        return Preflight(options, env, state, lock, wheel, surveyed, systemd_for(options), tuple(notes))
    except BaseException:
        lock.release()
        raise


def _check_space(env: Environment, state: EnvironmentState, wheel: Wheel | None, surveyed: Survey) -> None:
    needed = disk_space_needed(list(surveyed.affected), env)
    problem = space_problem(needed, free_space(state.backups), state.backups)
    if problem:
        raise PlanError(problem, hint="nothing was stopped")
    if wheel is not None:
        problem = space_problem(
            installed_size(wheel),
            free_space(env.prefix),
            env.prefix,
            what=f"the install of {wheel.path.name}",
            remedy="free some space on that filesystem",
        )
        if problem:
            raise PlanError(problem, hint="nothing was stopped")


def _start_journal(pre: Preflight) -> tuple[str, Journal]:
    """The run's id and its journal, written: from here on a crash is recovered by --recover."""
    run_id = new_run_id(datetime.now(UTC), os.getpid())
    units = [
        JournalUnit(
            name=u.name,
            user_manager=pre.options.user,
            was_active=u.active_state in ("active", "activating", "reloading"),
            unit_file_state=u.unit_file_state,
        )
        for u in pre.plan.units
    ]
    journal = start_journal(
        pre.state.dir,
        new_journal(
            run_id,
            os.getpid(),
            process_start(os.getpid()),
            str(pre.env.python),
            str(pre.env.prefix),
            pre.plan.package,
            str(pre.wheel.path) if pre.wheel else None,
            pre.plan.uv_command,
            units,
        ),
    )
    return run_id, journal


@dataclass
class _Run:
    """One run from its journal on: the preflight's frozen facts, and what the steps record as they go.
    The steps are its methods, in order."""

    pre: Preflight
    reporter: Reporter
    run_id: str
    journal: Journal
    backup: Backup | None = None  # set by the backup step
    steps: list[StepOutcome] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    patched: tuple[str, ...] = ()
    extras: tuple[str, ...] = ()
    pruned: tuple[str, ...] = ()
    stop_issued: dict[str, float] = field(default_factory=dict)
    downtime: dict[str, float] = field(default_factory=dict)
    strays_killed: tuple[int, ...] = ()
    restart_started: bool = False

    @property
    def options(self) -> RunOptions:
        return self.pre.options

    @property
    def env(self) -> Environment:
        return self.pre.env

    @property
    def state(self) -> EnvironmentState:
        return self.pre.state

    @property
    def wheel(self) -> Wheel | None:
        return self.pre.wheel

    @property
    def survey(self) -> Survey:
        return self.pre.survey

    @property
    def systemd(self) -> Systemd:
        return self.pre.systemd

    @property
    def log_file(self) -> Path:
        return self.state.log_file(self.run_id)

    @property
    def saved(self) -> Backup:
        """The backup, for the steps after the backup step (install, verify, rollback of an install)."""
        if self.backup is None:
            raise StepFailed("no backup was taken before this step")
        return self.backup

    # ------------------------------------------------------------------ helpers

    @property
    def plan(self) -> Plan:
        return self.pre.plan

    def _timed(self, name: str, action: Callable[[], str]) -> None:
        started = time.monotonic()
        try:
            detail = action()
        except BaseException as exc:
            message = exc.message if isinstance(exc, SafeInstallError) else str(exc) or type(exc).__name__
            outcome = StepOutcome(name, "failed", time.monotonic() - started, message)
            self.steps.append(outcome)
            self.reporter.step(outcome)
            raise
        outcome = StepOutcome(name, "ok", time.monotonic() - started, detail)
        self.steps.append(outcome)
        self.reporter.step(outcome)

    def _journal(self, phase: Phase, note: str = "", **changes: Any) -> None:
        self.journal = advance(self.journal, phase, note, **changes)
        write_journal(self.state.dir, self.journal)

    def _journal_if_possible(self, phase: Phase, note: str = "") -> None:
        """During the rollback the journal is best effort: a full disk must not stop the restore (which
        frees the space) nor the restart."""
        try:
            self._journal(phase, note)
        except SafeInstallError as exc:
            self.notes.append(f"the rollback went on without its journal: {exc.message}")

    def _log(self, text: str) -> None:
        """Append to the run's log; best effort (a full disk must not turn into the run's failure)."""
        with contextlib.suppress(OSError), open(self.log_file, "a", encoding="utf-8") as log:
            log.write(f"[{datetime.now(UTC).isoformat(timespec='seconds')}] {text}\n")

    def _units_to_restart(self) -> list[str]:
        return [u.name for u in self.journal.units if u.stopped and u.was_active]

    # ------------------------------------------------------------------ 2. backup

    def do_backup(self) -> str:
        names = [d.name for d in self.survey.affected]
        before = verify_environment(self.env, names, installed=self.survey.installed)
        self.patched = tuple(
            f.path for f in before.findings if f.kind in (FindingKind.MODIFIED, FindingKind.MISSING)
        )
        for path in self.patched:
            self.notes.append(f"locally patched: {path} (kept in the backup)")

        def on_progress(done: int, total: int) -> None:
            self.reporter.progress("backup", done, total)

        self.backup = create_backup(
            self.env,
            list(self.survey.affected),
            self.state.backup_dir(self.run_id),
            self.patched,
            on_progress,
            known=before.observed,
        )
        self._journal(Phase.BACKED_UP, backup_dir=str(self.backup.dir))
        size = self.backup.manifest.files
        return f"{len(size)} files saved in {self.backup.dir}" + (
            f"; {len(self.patched)} locally patched" if self.patched else ""
        )

    def do_prefetch(self) -> str:
        """Fill the run's own uv cache with the new artefacts, so that the install in the downtime only
        links (or copies) files from it."""
        scratch = self.state.dir / f"prefetch-{self.run_id}"
        request = self.survey.request
        cache = self.state.uv_cache(self.run_id)
        ensure_dir(cache)
        command = prefetch_command(request, uv_binary(), scratch, self.survey.uv_plan.changes)
        self._log(f"prefetch (UV_CACHE_DIR={cache}): " + " ".join(command))
        try:
            result = uv_install(command, self.options.environ, cache_dir=cache)
        finally:
            shutil.rmtree(scratch, ignore_errors=True)
        self._log(f"uv exit {result.returncode}:\n{result.output}")
        if result.returncode != 0:
            tail = "\n".join(result.output.strip().splitlines()[-6:])
            raise PlanError(
                f"uv could not fetch or unpack the new version (exit {result.returncode}): {tail}",
                hint="nothing was stopped; check the wheel, the index options or the network",
            )
        return f"the run's uv cache holds the new version ({request.link_mode} from it)"

    # ------------------------------------------------------------------ 3. gate

    def do_gate(self) -> str:
        """Keep the units from starting on a half-installed package (a crash, a reboot)."""
        units = [u.name for u in self.journal.units]
        if not units:
            return "no units"
        marker = gate_marker(self.state.dir)
        paths = [str(self.systemd.dropin_path(u, GATE_DROPIN, persistent=True)) for u in units]
        atomic_write(marker, f"{self.run_id}\n".encode())
        self._journal(Phase.GATED, gate=paths)  # journalled before written: recovery removes them
        text = gate_dropin_text(marker, self.run_id)
        for unit in units:
            self.systemd.add_dropin(unit, GATE_DROPIN, text, persistent=True)
        return f"{len(units)} unit(s) gated on {marker}"

    def remove_gate(self) -> None:
        gate_marker(self.state.dir).unlink(missing_ok=True)

    def remove_dropins(self) -> None:
        for unit in self.journal.units:
            self.systemd.remove_dropin(unit.name, GATE_DROPIN, persistent=True)

    # ------------------------------------------------------------------ 4. stop

    def do_stop(self) -> str:
        systemd = self.systemd
        units = list(self.plan.units)
        for unit in units:
            self.journal = _mark(self.journal, unit.name, stopped=True)
        self._journal(Phase.STOPPING)

        def stop(unit: PlannedUnit) -> StopOutcome:
            self.stop_issued[unit.name] = time.monotonic()
            return systemd.stop(unit.name, self._stop_timeout(unit.stop_timeout_s))

        outcomes: list[StopOutcome] = []
        if units:
            with ThreadPoolExecutor(max_workers=len(units)) as pool:
                outcomes = list(pool.map(stop, units))
        failed = [o for o in outcomes if not o.stopped]
        if failed:
            first = failed[0]
            timeout = self._stop_timeout(next(u.stop_timeout_s for u in units if u.name == first.unit))
            raise StepFailed(f"unit {first.unit} did not stop in {timeout:g} s ({first.reason})")
        killed = self._kill_strays()
        leftover = _wait_gone(self.plan.processes, self._stop_timeout(90.0))
        if leftover:
            raise StepFailed(f"processes {', '.join(map(str, leftover))} still run after their units stopped")
        self._journal(Phase.STOPPED, strays_killed=list(killed))
        detail = f"{len(units)} unit(s) stopped, {len(self.plan.processes)} process(es) gone"
        if killed:
            detail += f"; stray PIDs {', '.join(map(str, killed))} ended (not restarted)"
        return detail

    def _stop_timeout(self, unit_timeout: float) -> float:
        if self.options.stop_timeout is not None:
            return self.options.stop_timeout
        return (unit_timeout if unit_timeout != float("inf") else 90.0) + 10.0

    def _kill_strays(self) -> tuple[int, ...]:
        self.strays_killed = _end_processes([(p.pid, p.start_time) for p in self.plan.strays])
        return self.strays_killed

    def _check_no_late_users(self) -> str:
        """Scan again just before the install: a process that started using the package after the plan
        was made (a cron job, a tmux session) would have its files replaced under it."""
        scan = scan_processes(self.survey.targets, self.options.proc_root)
        late = [p for p in scan.affected if not p.is_self and p.state != "Z"]
        if not late:
            return ""
        listed = ", ".join(f"{p.pid} ({' '.join(p.cmdline)[:60] or p.name})" for p in late)
        if not self.options.kill_strays:
            raise StepFailed(
                f"process(es) {listed} started using {self.plan.package} after the plan was made",
                hint="stop them, or pass --kill-strays to end them (they are not restarted)",
            )
        ended = _end_processes([(p.pid, p.start_time) for p in late])
        self.strays_killed = (*self.strays_killed, *ended)
        return f"; late user(s) {listed} ended (not restarted)"

    # ------------------------------------------------------------------ 5. GPU release

    def do_gpu_wait(self, session: NvmlSession, baseline: GpuSnapshot) -> str:
        if not session.available:
            self._journal(Phase.GPU_RELEASED, note=f"GPU check skipped: {session.reason}")
            return f"skipped: {session.reason}"

        def on_poll(status: ReleaseStatus) -> None:
            holders = ", ".join(f"PID {h.pid}" for h in status.holders) or "memory not yet freed"
            self.reporter.progress(
                f"waiting for GPU memory ({holders})", status.waited_s, self.options.gpu_timeout
            )

        stopped = frozenset(p.pid for p in self.plan.processes)
        status = wait_for_release(session, baseline, stopped, self.options.gpu_timeout, on_poll)
        if status.skipped:
            self._journal(Phase.GPU_RELEASED, note=f"GPU check skipped: {status.reason}")
            return f"skipped: {status.reason}"
        if not status.released:
            holders = ", ".join(
                f"PID {h.pid} on GPU {h.gpu_index}" + (f" ({h.used_bytes} bytes)" if h.used_bytes else "")
                for h in status.holders
            )
            raise StepFailed(
                f"GPU memory was not released within {self.options.gpu_timeout:g} s"
                + (f": still held by {holders}" if holders else f": {status.reason}")
            )
        self._journal(Phase.GPU_RELEASED)
        return f"released after {status.waited_s:.1f} s"

    # ------------------------------------------------------------------ 6. install

    def do_install(self) -> str:
        late = self._check_no_late_users()
        self._journal(Phase.INSTALLING)
        command = self.plan.uv_command
        cache = self.state.uv_cache(self.run_id)
        self._log(f"install (UV_CACHE_DIR={cache}): " + " ".join(command))
        result = uv_install(command, self.options.environ, cache_dir=cache)
        self._log(f"uv exit {result.returncode}:\n{result.output}")
        if result.returncode != 0:
            tail = "\n".join(result.output.strip().splitlines()[-6:])
            raise StepFailed(f"uv pip install failed (exit {result.returncode}): {tail}")
        self._journal(Phase.INSTALLED)
        return " ".join(command) + late

    # ------------------------------------------------------------------ 7. verify

    def do_verify(self) -> str:
        report = _verify_installed(
            self.env,
            self.plan.package,
            self.wheel,
            [d.name for d in self.survey.affected],
            self.survey.installed,
        )
        failures = [f for f in report.findings if f.kind in _INSTALL_FAILURES]
        if failures:
            listed = "; ".join(f"{f.kind.value} {f.path}" for f in failures[:5])
            raise StepFailed(f"the installed files do not match the wheel: {listed}")
        self.extras = tuple(f.path for f in report.findings if f.kind == FindingKind.EXTRA)
        if self.extras and self.options.prune:
            self.pruned = self._prune(self.extras)
        self._journal(Phase.VERIFIED)
        self.remove_gate()
        checked = sum(d.files_checked for d in report.distributions)
        detail = f"{checked} files match"
        if self.extras and not self.pruned:
            detail += f"; {len(self.extras)} leftover file(s) not in the new version (--prune removes them)"
        elif self.pruned:
            detail += f"; {len(self.pruned)} leftover file(s) pruned (saved in the backup)"
        return detail

    def _prune(self, extras: tuple[str, ...]) -> tuple[str, ...]:
        pruned: list[str] = []
        for path in extras:
            relative = os.path.relpath(path, self.env.prefix)
            saved = self.saved.dir / "pruned" / relative
            saved.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, saved)
            os.unlink(path)
            pruned.append(path)
        return tuple(pruned)

    # ------------------------------------------------------------------ 8. restart

    def do_restart(self) -> str:
        units = self._units_to_restart()
        if self.options.no_restart:
            self._journal(Phase.RESTARTING, note="--no-restart: units left stopped")
            return "left stopped (--no-restart): " + (", ".join(units) or "none")
        if not units:
            self._journal(Phase.RESTARTING)
            return "no unit was running"
        self._journal(Phase.RESTARTING)
        self.restart_started = True
        detail = self._start_and_settle(units, self.options.settle)
        for unit in units:
            self.journal = _mark(self.journal, unit, restarted=True)
        if self.options.health_url:
            _wait_healthy(self.options.health_url, self.options.health_timeout)
            detail += f"; {self.options.health_url} answers 200"
        return detail

    def _start_and_settle(self, units: list[str], settle: float) -> str:
        systemd = self.systemd
        befores = systemd.show(units)
        issued = time.monotonic()
        for unit in units:
            systemd.start(unit)
        with ThreadPoolExecutor(max_workers=len(units)) as pool:
            futures = {
                u: pool.submit(
                    systemd.wait_settled, u, settle, start_wait_s(befores.get(u)), before=befores.get(u)
                )
                for u in units
            }
            outcomes = {u: f.result() for u, f in futures.items()}
        bad = [o for o in outcomes.values() if not o.ok]
        if bad:
            raise StepFailed("; ".join(o.reason or f"{o.unit} did not settle" for o in bad))
        for unit, outcome in outcomes.items():
            active_at = issued + max(0.0, outcome.waited_s - settle)
            if unit in self.stop_issued:
                self.downtime[unit] = active_at - self.stop_issued[unit]
        return ", ".join(f"{u} active for {settle:g} s" for u in units)

    # ------------------------------------------------------------------ rollback

    def rollback(self, error: SafeInstallError) -> SafeInstallError:
        """Put everything back; returns the error to report (StepFailed, or RollbackFailed)."""

        def announce(signum: int) -> None:
            self.reporter.note(
                f"{signal.Signals(signum).name} received during rollback: finishing it first so the "
                "services are not abandoned"
            )

        with interrupts_deferred(announce):
            done: list[str] = []
            stopped_any = _phase_at_least(self.journal, Phase.STOPPING)
            try:
                self._journal_if_possible(Phase.ROLLING_BACK, note=error.message)
                if self.restart_started:
                    for unit in self._units_to_restart():
                        self.systemd.stop(unit, self._stop_timeout(90.0))
                installed = _phase_at_least(self.journal, Phase.INSTALLING)
                if installed:
                    # the run's cache first: the installed files are its hardlinks, and on a full disk
                    # the restore needs the room that removing them frees only once the cache is gone
                    remove_uv_caches(self.state, self.run_id)
                    self._restore()
                    done.append("restored the previous installation")
                else:
                    done.append("nothing was installed")
                self.remove_gate()
                units = self._units_to_restart()
                if units:
                    self._start_and_settle(units, min(self.options.settle, 2.0))
                    done.append("started " + ", ".join(units) + " again")
                self.remove_dropins()
                self._journal_if_possible(Phase.ROLLED_BACK)
                clear_journal(self.state.dir)
            except SafeInstallError as second:
                return self._rollback_failed(error, second)
            except Exception as second:
                return self._rollback_failed(error, SafeInstallError(str(second)))
        if not stopped_any:  # the run ended before the stop: nothing changed, exit 2 as for a refusal
            if error.exit_code == ExitCode.REFUSED:
                return error
            return Aborted(f"{error.message}; nothing was stopped or installed", hint=error.hint)
        return StepFailed(f"{error.message}; {'; '.join(done)}", hint=error.hint)

    def _restore(self) -> None:
        restore_previous(self.env, self.saved, self.wheel)

    def _rollback_failed(self, error: SafeInstallError, second: SafeInstallError) -> RollbackFailed:
        commands = [f"safeinstall --recover --python {self.env.python}"]
        flag = "--user " if self.options.user else ""
        commands += [f"systemctl {flag}start {u}" for u in self._units_to_restart()]
        return RollbackFailed(
            f"{error.message}; then putting things back failed too: {second.message}. "
            f"The backup ({self.journal.backup_dir}) and the journal are kept. To finish: "
            + " && ".join(commands),
            hint="run the commands above; safeinstall --status shows what is pending",
        )


def _mark(
    journal: Journal, unit: str, *, stopped: bool | None = None, restarted: bool | None = None
) -> Journal:
    def changed(u: JournalUnit) -> JournalUnit:
        return replace(
            u,
            stopped=u.stopped if stopped is None else stopped,
            restarted=u.restarted if restarted is None else restarted,
        )

    units = tuple(changed(u) if u.name == unit else u for u in journal.units)
    return replace(journal, units=units)


def _phase_at_least(journal: Journal, phase: Phase) -> bool:
    return any(entry.phase == phase for entry in journal.history)


def _same_process(pid: int, start_time: int) -> psutil.Process | None:
    """The live process that was seen (same PID and start time), or None if it is gone."""
    try:
        proc = psutil.Process(pid)
        start = process_start(pid)
    except psutil.Error:
        return None
    if start is not None and start != start_time:
        return None
    return proc


def _end_processes(seen: list[tuple[int, int]]) -> tuple[int, ...]:
    """SIGTERM each (PID, start time) still running, SIGKILL after 10 s; the PIDs that were ended."""
    ended: list[int] = []
    procs: list[psutil.Process] = []
    for pid, start_time in seen:
        proc = _same_process(pid, start_time)
        if proc is None:
            continue
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            continue
        procs.append(proc)
        ended.append(pid)
    alive = _wait_exited(procs, timeout=10)
    for proc in alive:
        with contextlib.suppress(psutil.Error):
            proc.kill()
    _wait_exited(alive, timeout=10)
    return tuple(ended)


def _running(proc: psutil.Process) -> bool:
    """Alive and not a zombie: a zombie holds no files, no mappings, no GPU memory."""
    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_exited(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """Wait until every process has exited (zombies count as exited); those still running.

    Not ``psutil.wait_procs``: for processes that are not our children it waits on ``is_running()``,
    which stays true for a zombie whose parent has not reaped it, i.e. until the timeout.
    """
    deadline = time.monotonic() + timeout
    alive = [p for p in procs if _running(p)]
    while alive and time.monotonic() < deadline:
        time.sleep(0.02)
        alive = [p for p in alive if _running(p)]
    return alive


def _wait_gone(processes: tuple[PlannedProcess, ...], timeout: float) -> list[int]:
    procs = [
        p for p in (_same_process(planned.pid, planned.start_time) for planned in processes) if p is not None
    ]
    return [p.pid for p in _wait_exited(procs, timeout)]


def _check_wheel(wheel: Wheel, package: str, env: Environment) -> None:
    from packaging.utils import canonicalize_name

    if wheel.name != canonicalize_name(package):
        raise WheelError(
            f"the wheel {wheel.path.name} is for {wheel.name}, not {package}",
            hint="pass the wheel of the package being reinstalled; nothing was stopped",
        )
    if not wheel.record_ok:
        listed = "; ".join(f"{p.path}: {p.reason}" for p in wheel.problems[:3])
        raise WheelError(
            f"the wheel {wheel.path.name} is damaged: its RECORD does not match its contents ({listed})",
            hint="download or build the wheel again; nothing was stopped",
        )
    if not fits(wheel, target_tags(env)):
        tags = ", ".join(sorted(str(t) for t in wheel.tags))
        raise WheelError(
            f"the wheel {wheel.path.name} ({tags}) does not fit Python "
            f"{env.version[0]}.{env.version[1]} ({env.implementation}) at {env.python}",
            hint="use a wheel built for that interpreter, or pass --python for the right environment; "
            "nothing was stopped",
        )


def _verify_installed(
    env: Environment,
    package: str,
    wheel: Wheel | None,
    affected: list[str],
    before: Sequence[InstalledDistribution],
) -> VerifyReport:
    """The new installation: the package against the wheel (or its RECORD), the others their RECORD.

    Only the affected distributions are read again (the install changed nothing else), and the wheel is
    the one read and checked at preflight."""
    installed = reload_distributions(env, before, affected)
    main = verify_environment(env, [package], wheel, installed=installed)
    present = {d.name for d in installed}
    others = [n for n in affected if n != package and n in present]
    if not others:
        return main
    rest = verify_environment(env, others, installed=installed)
    return replace(main, distributions=(*main.distributions, *rest.distributions))


def _wait_healthy(url: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=5) as response:
                if response.status == 200:
                    return
                last = f"HTTP {response.status}"
        except urllib.error.HTTPError as exc:
            last = f"HTTP {exc.code}"
        except (urllib.error.URLError, OSError) as exc:
            last = str(exc)
        time.sleep(0.5)
    raise StepFailed(f"{url} did not answer 200 within {timeout:g} s (last: {last})")


def run_reinstall(options: RunOptions, reporter: Reporter, interactive: bool) -> RunResult:
    """The whole run. Raises SafeInstallError only before anything changed (exit 2)."""
    pre = preflight(options)  # holds the environment's lock from here on
    try:
        if interactive and not reporter.confirm(pre.plan):
            return _result(pre, None, "declined", ExitCode.REFUSED, None)
        run_id, journal = _start_journal(pre)
    except BaseException:
        pre.lock.release()
        raise
    run = _Run(pre, reporter, run_id, journal, notes=list(pre.notes))
    run._log("plan: " + " ".join(pre.plan.uv_command))
    try:
        with interrupts_raise():
            try:
                run._timed("backup", run.do_backup)
                run._timed("prefetch", run.do_prefetch)
                run._timed("gate", run.do_gate)
                with NvmlSession(options.environ, options.proc_root) as session:
                    baseline = session.snapshot()  # before the stop: what the processes held
                    run._timed("stop", run.do_stop)
                    run._timed("gpu-release", lambda: run.do_gpu_wait(session, baseline))
                run._timed("install", run.do_install)
                run._timed("verify", run.do_verify)
                run._timed("restart", run.do_restart)
            except Exception as exc:  # any failure once the run started rolls back, bugs included
                error = (
                    exc if isinstance(exc, SafeInstallError) else StepFailed(f"{type(exc).__name__}: {exc}")
                )
                outcome = run.rollback(error)
                status = {
                    ExitCode.ROLLED_BACK: "rolled-back",
                    ExitCode.ROLLBACK_FAILED: "rollback-failed",
                }.get(outcome.exit_code, "error")
                return _result(pre, run, status, outcome.exit_code, outcome)
        # The run succeeded: the services run the new, verified version. What is left is tidying up; a
        # failure there is said, and must not turn a good run into an error (nor leave a journal that
        # blocks the next run): the gate marker is gone already, so a leftover drop-in is inert.
        run._journal_if_possible(Phase.DONE)
        try:
            run.remove_dropins()
        except SafeInstallError as exc:
            run.notes.append(
                f"could not remove the boot gate drop-ins ({GATE_DROPIN}.conf; inert, the gate is open): "
                f"{exc.message}"
            )
        with contextlib.suppress(OSError):
            clear_journal(pre.state.dir)
        old = prune_backups(pre.state.backups, options.keep_backups, protected={run_id})
        run.notes.extend(f"old backup not deleted: {problem}" for problem in old.problems)
        not_restarted = tuple(run._units_to_restart()) if options.no_restart else ()
        return _result(pre, run, "done", ExitCode.OK, None, not_restarted, tuple(map(str, old.removed)))
    finally:
        remove_uv_caches(pre.state, run_id)  # installed files then share inodes with nothing
        pre.lock.release()


def _result(
    pre: Preflight,
    run: _Run | None,  # None: declined before the run started
    status: str,
    code: ExitCode,
    error: SafeInstallError | None,
    not_restarted: tuple[str, ...] = (),
    backups_removed: tuple[str, ...] = (),
) -> RunResult:
    return RunResult(
        status=status,
        exit_code=code,
        plan=pre.plan,
        steps=tuple(run.steps) if run else (),
        downtime_s=dict(run.downtime) if run else {},
        patched=run.patched if run else (),
        extras=run.extras if run else (),
        pruned=run.pruned if run else (),
        backup_dir=str(run.backup.dir) if run and run.backup else None,
        log_file=str(run.log_file) if run else None,
        not_restarted=not_restarted,
        strays_killed=run.strays_killed if run else (),
        error=error,
        notes=tuple(run.notes) if run else pre.notes,
        backups_removed=backups_removed,
    )
