"""What the CLI shows of the layers below ``run``, named in one place (``cli/`` imports only ``run``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from safeinstall.env.drift import (
    RECORD_MAY_BE_WRONG_HINT,
    SHARED_WITH,
    UNTOUCHED,
    Finding,
    FindingKind,
    per_file,
)
from safeinstall.store.runlog import PROGRESS_EVERY_S, human_bytes, progress_key, progress_text

if TYPE_CHECKING:
    from safeinstall.env.diffs import FileDiff as FileDiff
    from safeinstall.env.verify import VerifyReport as VerifyReport
    from safeinstall.scan.plan import AffectedDistribution as AffectedDistribution
    from safeinstall.scan.plan import Plan as Plan
    from safeinstall.scan.plan import PlannedProcess as PlannedProcess
    from safeinstall.scan.processes import ScanProblem as ScanProblem
    from safeinstall.store.history import HistoryEntry as HistoryEntry
    from safeinstall.store.history import RunSummary as RunSummary
    from safeinstall.store.rundoc import ErrorDoc as ErrorDoc
    from safeinstall.store.rundoc import OldCodeDoc as OldCodeDoc
    from safeinstall.store.rundoc import PatchDoc as PatchDoc
    from safeinstall.store.rundoc import RunDocument as RunDocument
    from safeinstall.store.rundoc import StepDoc as StepDoc

__all__ = [
    "PROGRESS_EVERY_S",
    "RECORD_MAY_BE_WRONG_HINT",
    "SHARED_WITH",
    "UNTOUCHED",
    "Finding",
    "FindingKind",
    "display_time",
    "human_bytes",
    "per_file",
    "progress_key",
    "progress_text",
    "run_summary",
]


def display_time(iso: str) -> str:
    """Pure: a recorded time as the terminal shows it (:func:`safeinstall.system.lock.display_time`)."""
    from safeinstall.system.lock import display_time as shown

    return shown(iso)


def run_summary(entry: HistoryEntry) -> RunSummary:
    """Pure: a history entry's summary (:func:`safeinstall.store.history.summary`)."""
    from safeinstall.store.history import summary

    return summary(entry)
