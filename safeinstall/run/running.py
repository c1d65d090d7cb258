"""One run, once its journal exists: :class:`Run`, the value every step of a run is a function of
(:mod:`safeinstall.run.reinstall` holds the steps, :mod:`safeinstall.run.rollback` the way back), and the unit
waits that the steps and the rollback share.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Callable, Mapping
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from safeinstall.env import inodes
from safeinstall.env.environment import Environment
from safeinstall.env.hashing import FileState
from safeinstall.env.recorded import KeptRecord
from safeinstall.env.swap import Staged
from safeinstall.env.vouched import Vouched
from safeinstall.env.wheel import Wheel
from safeinstall.errors import (
    SafeInstallError,
    StepFailed,
    SystemdError,
)
from safeinstall.run.options import RunOptions
from safeinstall.run.patches import (
    PatchSet,
)
from safeinstall.run.preflight import Prepared
from safeinstall.run.results import Reporter
from safeinstall.run.smokecheck import Background
from safeinstall.run.survey import Survey, systemd_for
from safeinstall.run.undo import Left
from safeinstall.scan.plan import Plan
from safeinstall.store.backup import Backup
from safeinstall.store.journal import (
    Journal,
    Phase,
    advance,
    write_journal,
)
from safeinstall.store.rundoc import RunData, StepDoc
from safeinstall.store.runlog import append_line
from safeinstall.store.state import (
    EnvironmentState,
)
from safeinstall.system.signals import held_while_threads_start
from safeinstall.system.systemd import (
    MainProcess,
    Systemd,
    UnitInfo,
    gone_wrong,
    main_process,
    start_wait_s,
    stop_wait_s,
)


@dataclass
class Run:
    """One run, once its journal exists: the preflight's frozen value (``prepared``: the environment,
    the wheel read once, the distributions found once, the plan, the lock), the run's identity, and
    what the steps record as they go. Each step is a function of its own over it (``*_step`` below),
    in the order of :func:`safeinstall.run.reinstall.run_reinstall`."""

    prepared: Prepared
    reporter: Reporter
    run_id: str
    journal: Journal
    notes: list[str]
    #: what the run's document says of it, filled by the steps as they go (docs/json.md); the plan, the
    #: backup and the notes join it at the end (``safeinstall.run.reinstall._result``)
    record: RunData = field(default_factory=RunData)
    backup: Backup | None = None  # None until the backup step has saved it
    patches: PatchSet | None = None  # --keep-patches: set by the patches step
    down_since: dict[str, float] = field(default_factory=dict)  # units the stop took down: since when
    restart_started: bool = False
    left: Left | None = None  # set by the verify step: what the run leaves (kept for --undo)
    #: the run's cache, hashed after the prefetch and looked at again before the stop (inodes.py)
    hashed: inodes.Hashed = field(default_factory=dict)
    #: the run's cache fill's copies (root's own environment): path below the cache, sha256, size, inode,
    #: mtime (ns) as written
    filled: tuple[tuple[str, str, int, int, int], ...] = ()
    installed_ns: int | None = None  # time.time_ns() once uv's install in the window has exited
    #: set by the verify step: the files verified against the wheel that its RECORD does not describe
    vouched: Vouched | None = None
    #: set by the prefetch when the run swaps: the verified staging tree and its renames (env/swap.py)
    staged: Staged | None = None
    #: set by the verification in place: every installed file as it was observed (kept in the
    #: verified-inode store after a good run: store/verified.py)
    in_place: Mapping[str, FileState] = field(default_factory=dict)
    #: set by the verification in place: the RECORDs the run installed, kept after a good run as the
    #: reference a later check holds them to (store/records.py)
    records: Mapping[str, KeptRecord] = field(default_factory=dict)
    #: set by the prefetch when the run does not swap: its ``--target`` tree, kept for the smoke step
    scratch: Path | None = None
    #: set by the prefetch once the new version's tree is complete: the smoke check running beside the
    #: rest of it (safeinstall.run.smoke), until the smoke step has its answer or the run ends it
    smoke_check: Background | None = None

    @cached_property
    def systemd(self) -> Systemd:
        return systemd_for(self.options)

    @property
    def log_file(self) -> Path:
        return self.state.log_file(self.run_id)

    def add_step(self, step: StepDoc) -> None:
        """A step's outcome, into the run's record."""
        self.record = replace(self.record, steps=(*self.record.steps, step))

    @property
    def options(self) -> RunOptions:
        return self.prepared.options  # the wheel: the run's own copy in the state directory

    @property
    def env(self) -> Environment:
        return self.prepared.env

    @property
    def state(self) -> EnvironmentState:
        return self.prepared.state

    @property
    def wheel(self) -> Wheel | None:
        return self.prepared.wheel

    @property
    def survey(self) -> Survey:
        return self.prepared.survey

    @property
    def plan(self) -> Plan:
        return self.prepared.survey.plan

    def timed(self, name: str, action: Callable[[], str]) -> None:
        started = time.monotonic()
        try:
            detail = action()
        except BaseException as exc:
            message = exc.message if isinstance(exc, SafeInstallError) else str(exc) or type(exc).__name__
            outcome = StepDoc(name=name, status="failed", seconds=time.monotonic() - started, detail=message)
            self.add_step(outcome)
            self.reporter.step(outcome)
            raise
        outcome = StepDoc(name=name, status="ok", seconds=time.monotonic() - started, detail=detail)
        self.add_step(outcome)
        self.reporter.step(outcome)

    def journal_phase(self, phase: Phase, note: str = "", **changes: Any) -> None:
        self.journal = advance(self.journal, phase, note, **changes)
        write_journal(self.state.dir, self.journal)

    def journal_phase_if_possible(self, phase: Phase, note: str = "") -> None:
        """During the rollback the journal is best effort: a full disk must not stop the restore (which
        frees the space) nor the restart."""
        try:
            self.journal_phase(phase, note)
        except SafeInstallError as exc:
            self.notes.append(f"the rollback went on without its journal: {exc.message}")

    def log(self, text: str) -> None:
        """Append to the run's log; best effort (a full disk must not turn into the run's failure)."""
        append_line(self.log_file, text)

    def units_to_restart(self) -> list[str]:
        return [u.name for u in self.journal.units if u.stopped and u.was_active]

    def stop_timeout(self, unit_timeout: float) -> float:
        if self.options.stop_timeout is not None:
            return self.options.stop_timeout
        return stop_wait_s(unit_timeout)

    def saved(self) -> Backup:
        """The backup, once the backup step has made it (every step after it may rely on that)."""
        if self.backup is None:
            raise StepFailed("internal error: no backup was made before this step")
        return self.backup


def phase_at_least(journal: Journal, phase: Phase) -> bool:
    return any(entry.phase == phase for entry in journal.history)


WAIT_POLL_S = 1.0


def report_waits(
    run: Run,
    waits: Mapping[str, Future[Any]],
    state: str,
    limit: float,
    total: float | None = None,
    check: Callable[[], None] | None = None,
) -> None:
    """Until every unit's wait is done: a progress line of the units not yet ``state`` and the time left
    of ``limit`` (``total``: what it counts up to otherwise). ``check`` may end the wait by raising.
    """
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
        run.reporter.progress(
            f"waiting for {', '.join(pending)} to be {state} ({len(pending)} of {len(waits)}{upto})",
            waited if total is None else min(waited, total),
            bound if total is None else total,
            "s",
        )
        futures_wait([waits[unit] for unit in pending], timeout=WAIT_POLL_S, return_when=FIRST_COMPLETED)


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


def start_units(run: Run, units: list[str]) -> dict[str, UnitInfo]:
    """Start ``units``: their state before the start (what :func:`settle_units` compares with)."""
    befores = run.systemd.show(units)
    for unit in units:
        run.systemd.start(unit)
    return befores


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

    def __call__(self) -> None:
        infos = self.run.systemd.show(list(self.befores))
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
        said,
        hint=f"see why in its journal: journalctl {flag}" + " ".join(f"-u {unit}" for unit in units),
    )


def settle_units(
    run: Run,
    units: list[str],
    settle: float,
    befores: Mapping[str, UnitInfo],
    seen: Mapping[str, MainProcess] | None = None,
) -> str:
    """Wait until each of ``units`` (started, with ``befores`` their state before it) is active and
    stays so, with the same main process (``seen``: as an earlier watch saw it), for ``settle`` s; raise
    StepFailed naming each that does not. Records each unit's own downtime (``downtime_s``)."""
    systemd = run.systemd
    seen = seen or {}
    cancel = threading.Event()
    with ThreadPoolExecutor(max_workers=len(units)) as pool:
        with held_while_threads_start():
            futures = {
                u: pool.submit(
                    systemd.wait_settled,
                    u,
                    settle,
                    start_wait_s(befores.get(u)),
                    before=befores.get(u),
                    cancel=cancel,
                    seen=seen.get(u),
                )
                for u in units
            }
        try:
            report_waits(
                run,
                futures,
                f"{settle:g} s active",
                settle + max(start_wait_s(befores.get(u)) for u in units),
                total=settle,  # the settle time, not the start's allowance (issue 37: "0 s of 122 s")
            )
            outcomes = {u: f.result() for u, f in futures.items()}
        except BaseException:  # Ctrl-C, SIGTERM: the waits end at their next poll, the rollback starts
            cancel.set()
            raise
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
    return settle_units(run, units, settle, start_units(run, units))
