"""One run, once its journal exists: :class:`Run`, the value every step of a run is a function of
(:mod:`safeinstall.run.steps.reinstall` holds the steps, :mod:`safeinstall.run.back.rollback` the way back),
and the unit waits that the steps and the rollback share.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from safeinstall.env import inodes
from safeinstall.env.cachefill import Filled
from safeinstall.env.environment import Environment
from safeinstall.env.hashing import FileState
from safeinstall.env.recorded import KeptRecord
from safeinstall.env.renames import Staged
from safeinstall.env.vouched import Vouched
from safeinstall.env.wheel import Wheel
from safeinstall.errors import SafeInstallError, StepFailed
from safeinstall.run.parts.options import RunOptions
from safeinstall.run.parts.patches import PatchSet
from safeinstall.run.parts.preflight import Prepared
from safeinstall.run.parts.probe import Probe
from safeinstall.run.parts.results import Reporter
from safeinstall.run.parts.smokethread import Background
from safeinstall.run.parts.survey import Survey, systemd_for
from safeinstall.run.parts.undo import Left
from safeinstall.scan.plan import Plan
from safeinstall.store.backup import Backup
from safeinstall.store.journal import Journal, Phase, advance, write_journal
from safeinstall.store.rundoc import RunData, StepDoc
from safeinstall.store.runlog import append_line
from safeinstall.store.state import EnvironmentState
from safeinstall.system.systemd import Systemd, stop_wait_s


@dataclass
class Run:
    """One run, once its journal exists: the preflight's frozen value (``prepared``: the environment,
    the wheel read once, the distributions found once, the plan, the lock), the run's identity, and
    what the steps record as they go. Each step is a function of its own over it (``*_step`` below),
    in the order of :func:`safeinstall.run.steps.reinstall.run_reinstall`."""

    prepared: Prepared
    reporter: Reporter
    run_id: str
    journal: Journal
    notes: list[str]
    #: what the run's document says of it, filled by the steps as they go (docs/json.md); the plan, the
    #: backup and the notes join it at the end (``safeinstall.run.steps.reinstall._result``)
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
    #: set by the prefetch when the run swaps: the verified staging tree and its renames (env/renames.py)
    staged: Staged | None = None
    #: set by the verification in place: every installed file as it was observed (kept in the
    #: verified-inode store after a good run: store/inodestore.py)
    in_place: Mapping[str, FileState] = field(default_factory=dict)
    #: set by the verification in place: the RECORDs the run installed, kept after a good run as the
    #: reference a later check holds them to (store/records.py)
    records: Mapping[str, KeptRecord] = field(default_factory=dict)
    #: set by the prefetch when the run does not swap: its ``--target`` tree, kept for the smoke step
    scratch: Path | None = None
    #: set by the prefetch once the new version's tree is complete: the smoke check running beside the
    #: rest of it (safeinstall.run.steps.smoke), until the smoke step has its answer or the run ends it
    smoke_check: Background | None = None
    #: set by the prefetch where the check runs beside the fill's copy: the probe tree it checks, until the
    #: check is over (safeinstall.run.parts.probe); and what the fill answered
    probe: Probe | None = None
    fill: Filled | None = None

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
