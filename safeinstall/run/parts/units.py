"""Units stopped, and started and settled: the one way for a run's stop and restart, its rollback and
``--recover``. Each unit waits in a thread of its own; a reporter, where there is one, hears progress."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field, replace
from typing import Any

from safeinstall.errors import SafeInstallError, StepFailed, SystemdError
from safeinstall.run.parts.running import Run
from safeinstall.store.journal import JournalUnit
from safeinstall.system.signals import held_while_threads_start
from safeinstall.system.systemd import (
    MainProcess,
    MainWatch,
    SettleOutcome,
    StopOutcome,
    Systemd,
    UnitInfo,
    gone_wrong,
    main_process,
    start_wait_s,
    stop_wait_s,
)

#: What hears a wait's progress: ``Reporter.progress`` (what, done, total, unit).
Progress = Callable[[str, float | None, float | None, str], None]

#: How often a wait on units (stop, start and settle) says what it still waits for.
WAIT_POLL_S = 1.0


def report_waits(
    progress: Progress | None,
    waits: Mapping[str, Future[Any]],
    state: str,
    limit: float,
    total: float | None = None,
    check: Callable[[], None] | None = None,
) -> None:
    """Until every unit's wait is done: a progress line of the units not yet ``state`` and the time left
    of ``limit`` (``total``: what it counts up to otherwise). ``check`` may end the wait by raising."""
    started = time.monotonic()
    bound = limit if math.isfinite(limit) else None
    upto = f"; gives up after {limit:g} s" if total is not None and bound is not None else ""
    while True:
        pending = [unit for unit, future in waits.items() if not future.done()]
        if not pending:
            return
        if check is not None:
            check()
        waited = time.monotonic() - started
        if progress is not None:
            progress(
                f"waiting for {', '.join(pending)} to be {state} ({len(pending)} of {len(waits)}{upto})",
                waited if total is None else min(waited, total),
                bound if total is None else total,
                "s",
            )
        futures_wait([waits[unit] for unit in pending], timeout=WAIT_POLL_S, return_when=FIRST_COMPLETED)


def stop_units(
    systemd: Systemd,
    timeouts: Mapping[str, float],
    progress: Progress | None = None,
    check: Callable[[], None] | None = None,
) -> list[StopOutcome]:
    """Stop each unit of ``timeouts`` (its wait, in seconds), all at once; each one's outcome. ``check``
    may end the wait by raising; so may a signal (the stops' waits end at their next poll)."""
    if not timeouts:
        return []
    cancel = threading.Event()
    with ThreadPoolExecutor(max_workers=len(timeouts)) as pool:
        with held_while_threads_start():
            stops = {u: pool.submit(systemd.stop, u, t, cancel=cancel) for u, t in timeouts.items()}
        try:
            report_waits(progress, stops, "stopped", max(timeouts.values()), check=check)
            return [f.result() for f in stops.values()]
        except BaseException:  # Ctrl-C, SIGTERM: the waits end at their next poll, the rollback starts
            cancel.set()
            raise


def start_units(systemd: Systemd, units: Sequence[str]) -> dict[str, UnitInfo]:
    """Start ``units``: their state before the start (what :func:`wait_settled` compares with). Each
    is started even when one before could not be (a removed unit keeps no other down); then the error
    of the one that failed, or one naming each (the first's class and hint)."""
    befores = systemd.show(units)
    failed: list[SafeInstallError] = []
    for unit in units:
        try:
            systemd.start(unit)
        except SafeInstallError as exc:
            failed.append(exc)
    if len(failed) > 1:
        raise type(failed[0])("; ".join(e.message for e in failed), hint=failed[0].hint) from failed[0]
    if failed:
        raise failed[0]
    return befores


def wait_settled(
    systemd: Systemd,
    units: Sequence[str],
    settle: float,
    befores: Mapping[str, UnitInfo],
    seen: Mapping[str, MainProcess] | None = None,
    progress: Progress | None = None,
) -> dict[str, SettleOutcome]:
    """Wait, each unit in a thread, until each of ``units`` (started, ``befores`` their state before)
    is active and stays so with the same main process (``seen``: as an earlier watch saw it) for
    ``settle`` s, or gives up; each one's outcome."""
    seen = seen or {}
    cancel = threading.Event()
    # started together, each may wait on another's start (After=): each is allowed the longest start
    allowance = max((start_wait_s(befores.get(u)) for u in units), default=0.0)
    with ThreadPoolExecutor(max_workers=len(units)) as pool:
        with held_while_threads_start():
            futures = {
                u: pool.submit(
                    systemd.wait_settled,
                    u,
                    settle,
                    allowance,
                    before=befores.get(u),
                    cancel=cancel,
                    seen=seen.get(u),
                )
                for u in units
            }
        try:
            report_waits(
                progress,
                futures,
                f"{settle:g} s active",
                settle + allowance,
                total=settle,  # the settle time, not the start's allowance (issue 37: "0 s of 122 s")
            )
            return {u: f.result() for u, f in futures.items()}
        except BaseException:  # Ctrl-C, SIGTERM: the waits end at their next poll, the rollback starts
            cancel.set()
            raise


# ------------------------------------------------------------------ a run's units


def reset_start_limits(run: Run, units: list[str]) -> tuple[str, ...]:
    """``systemctl reset-failed`` for each of ``units`` that the plan says could hit its start limit
    (:func:`safeinstall.system.systemd.start_limit_risk`): the run's start must not be refused for
    starts made before it. The units reset."""
    planned = {reset.unit for reset in run.plan.start_limit_resets}
    reset: list[str] = []
    for unit in (unit for unit in units if unit in planned):
        try:
            run.systemd.reset_failed(unit)
        except SystemdError as exc:  # not loaded (an inactive unit systemd let go): no counter to reset
            run.log(f"start limit of {unit} not reset: {exc.message}")
            continue
        reset.append(unit)
    if reset:
        run.log(f"start limit reset (systemctl reset-failed): {', '.join(reset)}")
    return tuple(reset)


@dataclass
class StartWatch:
    """Called at each poll of a wait after the start (the health check): raises StepFailed at once when
    a started unit failed, went inactive, or its main process exited or changed
    (:func:`safeinstall.system.systemd.gone_wrong`): nothing it runs will answer, the rollback starts
    now rather than after ``--health-timeout``. ``seen``: each unit's main process once seen active."""

    run: Run
    befores: Mapping[str, UnitInfo]
    restarts: dict[str, int | None] = field(default_factory=dict)
    seen: dict[str, MainProcess] = field(default_factory=dict)
    #: each unit's main process by its pidfd: systemd asked at every call only while one is not held
    #: or has exited, else once a second (a ``systemctl show`` beside the service's own start)
    mains: MainWatch = field(default_factory=MainWatch)

    def __call__(self) -> None:
        if not self.mains.due(self.befores, time.monotonic()):
            return
        asked_at = time.monotonic()
        infos = self.run.systemd.show(list(self.befores))
        self.mains.saw(infos, asked_at)
        wrong: list[str] = []
        for unit, info in infos.items():
            before = self.befores.get(unit)
            last = self.restarts.get(unit, before.n_restarts if before is not None else None)
            said = gone_wrong(unit, info, last, self.seen.get(unit))
            self.restarts[unit] = info.n_restarts
            if said is not None:
                wrong.append(said[1])
            elif info.is_active:
                self.seen[unit] = main_process(info)
        if wrong:
            raise _start_failed(self.run, wrong, list(self.befores))

    def close(self) -> None:
        """Let go of the pidfds."""
        self.mains.close()


def _start_failed(run: Run, reasons: list[str], units: list[str]) -> StepFailed:
    """Why the units did not come up, with each one's last lines in its journal (as the service said
    it, where there is a journal), beside the journalctl command."""
    flag = "--user " if run.options.user else ""
    said = "; ".join(reasons)
    for unit in units:
        tail = run.systemd.journal_tail(unit)
        if tail:
            said += f"\nthe last lines of {unit} in its journal:\n" + "\n".join(f"  {line}" for line in tail)
    return StepFailed(
        said, hint=f"see why in its journal: journalctl {flag}" + " ".join(f"-u {unit}" for unit in units)
    )


def settle_units(
    run: Run,
    units: list[str],
    settle: float,
    befores: Mapping[str, UnitInfo],
    seen: Mapping[str, MainProcess] | None = None,
) -> str:
    """:func:`wait_settled` for a run: raise StepFailed naming each unit that does not settle; records
    each unit's own downtime (``downtime_s``)."""
    outcomes = wait_settled(run.systemd, units, settle, befores, seen, run.reporter.progress)
    bad = [o for o in outcomes.values() if not o.ok]
    if bad:
        raise _start_failed(run, [o.reason or f"{o.unit} did not settle" for o in bad], [o.unit for o in bad])
    for unit, outcome in outcomes.items():  # what systemd reports; none for a unit that never went down
        before, down_since = befores.get(unit), run.down_since.get(unit)
        up = outcome.info.active_enter_us / 1e6
        if before is not None and not before.is_active and down_since is not None and up > down_since:
            run.record = replace(run.record, downtime_s={**run.record.downtime_s, unit: up - down_since})
    return ", ".join(f"{u} active for {settle:g} s" for u in units)


def start_and_settle(run: Run, units: list[str], settle: float) -> str:
    return settle_units(run, units, settle, start_units(run.systemd, units))


# ------------------------------------------------------------------ a journal's units (--recover)


def _by_manager(units: Iterable[JournalUnit]) -> dict[bool, list[str]]:
    """Pure: the units' names by manager (user or system), in the journal's order."""
    managers: dict[bool, list[str]] = {}
    for unit in units:
        managers.setdefault(unit.user_manager, []).append(unit.name)
    return managers


def start_journalled(units: Iterable[JournalUnit], environ: Mapping[str, str], settle: float) -> None:
    """Start ``units``, each on its manager, and wait until each settled; SafeInstallError naming each
    that did not come up."""
    failures: list[str] = []
    for user, names in _by_manager(units).items():
        systemd = Systemd(user=user, environ=environ)
        outcomes = wait_settled(systemd, names, settle, start_units(systemd, names))
        failures += [o.reason or f"{o.unit} did not come up" for o in outcomes.values() if not o.ok]
    if failures:
        raise SafeInstallError("; ".join(failures))


def stop_journalled(units: Iterable[JournalUnit], environ: Mapping[str, str]) -> None:
    """Stop ``units`` again, each on its manager within its own ``TimeoutStopSec``; SafeInstallError
    naming the first that did not stop."""
    for user, names in _by_manager(units).items():
        systemd = Systemd(user=user, environ=environ)
        infos = systemd.show(names)
        timeouts = {name: stop_wait_s(infos[name].timeout_stop_s) for name in names}
        for outcome in stop_units(systemd, timeouts):
            if not outcome.stopped:
                raise SafeInstallError(outcome.reason or f"{outcome.unit} did not stop")
