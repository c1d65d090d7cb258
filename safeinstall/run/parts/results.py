"""How a run reports as it goes (``--status --wait`` reads what :class:`LoggedReporter` wrote); what
it returns is its document (:mod:`safeinstall.store.rundoc`)."""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from safeinstall.run.parts.patches import PatchOutcome
from safeinstall.scan.plan import Plan
from safeinstall.store.rundoc import StepDoc
from safeinstall.store.runlog import (
    PROGRESS_EVERY_S,
    append_line,
    progress_key,
    progress_text,
    said_at_change,
)


def service_downtime_s(down_since: Mapping[str, float], healthy_at: float | None) -> float | None:
    """Pure: the downtime users see: from the first unit the stop took down (CLOCK_MONOTONIC seconds,
    as systemd says) until the health URL answered 200 (``healthy_at``); None when either is unknown."""
    if healthy_at is None or not down_since:
        return None
    return max(0.0, healthy_at - min(down_since.values()))


class Reporter(Protocol):
    def step(self, outcome: StepDoc) -> None: ...

    def progress(self, what: str, done: float | None, total: float | None, unit: str = "") -> None:
        """``unit``: "bytes", "s" (seconds) or "" (a count); see
        :func:`safeinstall.store.runlog.progress_text`."""

    def note(self, text: str, host: bool = False) -> None:
        """``host``: a note about the host, not this run (the same on every command: ``-q`` drops it)."""

    def confirm(self, plan: Plan, patches: Sequence[PatchOutcome] | None = None) -> bool:
        """Asked before the first stop; ``patches``: with --keep-patches, the merge made for the question."""
        ...


@dataclass
class LoggedReporter:
    """A run's reporter that also writes its step lines, notes and (every few seconds) its progress
    to the run's log, so that ``--status --wait`` can show them from anywhere."""

    inner: Reporter
    log: Path
    _last_progress: float = field(default_factory=time.monotonic)
    _last_key: str = ""

    def step(self, outcome: StepDoc) -> None:
        self._last_key = ""
        append_line(
            self.log, f"{outcome.name}: {outcome.status} in {outcome.seconds:.1f} s: {outcome.detail}"
        )
        self.inner.step(outcome)

    def progress(self, what: str, done: float | None, total: float | None, unit: str = "") -> None:
        now = time.monotonic()
        key = progress_key(what)
        if key != self._last_key:  # as off a terminal (cli/render.py): a size's line once it lasts
            self._last_progress, self._last_key = said_at_change(unit, now), key
        if now - self._last_progress >= PROGRESS_EVERY_S:
            self._last_progress = now
            append_line(self.log, progress_text(what, done, total, unit))
        self.inner.progress(what, done, total, unit)

    def note(self, text: str, host: bool = False) -> None:
        append_line(self.log, f"note: {text}")
        self.inner.note(text, host)

    def confirm(self, plan: Plan, patches: Sequence[PatchOutcome] | None = None) -> bool:
        return self.inner.confirm(plan, patches)
