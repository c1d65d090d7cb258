"""What the CLI shows of the layers below ``run``, named in one place (``cli/`` imports only ``run``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from safeinstall.env.drift import RECORD_MAY_BE_WRONG_HINT as RECORD_MAY_BE_WRONG_HINT
from safeinstall.env.drift import SHARED_WITH as SHARED_WITH
from safeinstall.env.drift import UNTOUCHED as UNTOUCHED
from safeinstall.env.drift import Finding as Finding
from safeinstall.env.drift import FindingKind as FindingKind
from safeinstall.env.drift import per_file as per_file
from safeinstall.store.runlog import PROGRESS_EVERY_S as PROGRESS_EVERY_S
from safeinstall.store.runlog import human_bytes as human_bytes
from safeinstall.store.runlog import progress_key as progress_key
from safeinstall.store.runlog import progress_text as progress_text
from safeinstall.store.runlog import said_at_change as said_at_change

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


def display_time(iso: str) -> str:
    """Pure: a recorded time as the terminal shows it (:func:`safeinstall.system.lock.display_time`)."""
    from safeinstall.system.lock import display_time as shown

    return shown(iso)


def run_summary(entry: HistoryEntry) -> RunSummary:
    """Pure: a history entry's summary (:func:`safeinstall.store.history.summary`)."""
    from safeinstall.store.history import summary

    return summary(entry)
