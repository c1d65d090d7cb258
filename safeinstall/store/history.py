"""Finished runs: each run's final result in ``<envdir>/history/<run-id>.json``, written once, last.

An entry means "finished"; the history is bounded (:data:`MAX_RUNS`), and a damaged or foreign file
is skipped with a note. docs/detach.md ("History").
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

from safeinstall.errors import SafeInstallError
from safeinstall.store.journal import now_iso
from safeinstall.store.rundoc import PlanDoc, RunDocument
from safeinstall.store.runlog import append_line
from safeinstall.store.state import EnvironmentState, atomic_write, ensure_dir, is_run_id
from safeinstall.system.safefs import UntrustedFile, read_trusted

HISTORY_VERSION = 1
#: Entries kept per environment.
MAX_RUNS = 20
#: Largest entry written or read (a plan with thousands of processes is trimmed to fit).
MAX_ENTRY_BYTES = 512 * 1024
_SUFFIX = ".json"


class HistoryError(SafeInstallError):
    code = "history"


@dataclass(frozen=True, slots=True)
class RunSummary:
    """One finished run, as ``--status`` lists it."""

    run_id: str
    status: str
    exit_code: int
    package: str | None
    old_version: str | None
    new_version: str | None
    started_at: str | None
    finished_at: str | None
    downtime_s: dict[str, float]
    log_file: str | None
    #: --status: whether ``safeinstall --undo --run RUN_ID`` can undo it, and if not why (None: not asked)
    can_undo: bool | None = None
    cannot_undo: str | None = None
    #: the first unit stopped -> the health URL answering 200 (``--health-url``), None without one
    service_downtime_s: float | None = None


@dataclass(frozen=True, slots=True)
class History:
    runs: tuple[RunSummary, ...]  # newest first
    problems: tuple[str, ...]  # files that were skipped, and why


@dataclass(frozen=True, slots=True, kw_only=True)
class HistoryEntry:
    """A finished run as its history keeps it: ``result`` is the run's ``--json`` document."""

    run_id: str
    package: str | None
    started_at: str | None
    finished_at: str | None
    log_file: str | None  # the run's log, also for a run whose result names none (refused, declined)
    result: RunDocument
    truncated: bool = False  # too large: its data left out
    version: int = HISTORY_VERSION

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> HistoryEntry:
        """The entry ``raw`` is; a ValueError says what in it is not an entry."""

        def text(name: str) -> str | None:
            value = raw.get(name)
            if value is not None and not isinstance(value, str):
                raise ValueError(f"{name}: {type(value).__name__} where the entry has a string")
            return value

        result = raw.get("result")
        if not isinstance(result, dict):
            raise ValueError("not a run's result")
        return cls(
            version=int(raw.get("history_version") or HISTORY_VERSION),
            run_id=str(raw.get("run_id")),
            package=text("package"),
            started_at=text("started_at"),
            finished_at=text("finished_at"),
            log_file=text("log_file"),
            result=RunDocument.from_json(result),
            truncated=raw.get("truncated") is True,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "history_version": self.version,
            "run_id": self.run_id,
            "package": self.package,
            "started_at": self.started_at,
            "finished_at": self.finished_at,
            "log_file": self.log_file,
            "result": self.result.to_json(),
        } | ({"truncated": True} if self.truncated else {})


def new_entry(
    run_id: str,
    package: str,
    started_at: str,
    finished_at: str,
    result: RunDocument,
    log_file: str | None = None,
) -> HistoryEntry:
    """Pure: the history entry of a finished run; ``result`` is the run's ``--json`` document;
    ``log_file`` its log, also for a run whose result names none (refused, declined)."""
    return HistoryEntry(
        run_id=run_id,
        package=package,
        started_at=started_at,
        finished_at=finished_at,
        log_file=log_file,
        result=result,
    )


def summary(entry: HistoryEntry) -> RunSummary:
    """Pure: the fields ``--status`` shows, from an entry (missing parts are None)."""
    data = entry.result.details
    old, new = data.versions(canonicalize_name(entry.package) if entry.package else None)
    return RunSummary(
        run_id=entry.run_id,
        status=entry.result.status,
        exit_code=entry.result.exit_code,
        package=entry.package,
        old_version=old,
        new_version=new,
        started_at=entry.started_at,
        finished_at=entry.finished_at,
        downtime_s={unit: float(seconds) for unit, seconds in data.downtime_s.items()},
        log_file=data.log_file or entry.log_file,
        service_downtime_s=data.service_downtime_s,
    )


def encode(entry: HistoryEntry) -> bytes:
    """Pure: the entry as written, at most :data:`MAX_ENTRY_BYTES` (the plan goes first when too big)."""
    data = json.dumps(entry.to_json(), allow_nan=False).encode()
    if len(data) <= MAX_ENTRY_BYTES or entry.result.data is None:
        return data
    details = entry.result.data
    present = details.present + tuple(n for n in ("plan", "notes") if n not in details.present)
    slim = replace(
        details,
        present=present,
        plan=(details.plan or PlanDoc(json={})).slim(),
        notes=(*details.notes, "the plan's details were left out of the history (too large)"),
    )
    data = json.dumps(
        replace(entry, result=replace(entry.result, data=slim)).to_json(), allow_nan=False
    ).encode()
    if len(data) <= MAX_ENTRY_BYTES:
        return data
    emptied = replace(entry, result=replace(entry.result, data=None), truncated=True)
    return json.dumps(emptied.to_json(), allow_nan=False).encode()


def _path(state: EnvironmentState, run_id: str) -> Path:
    if not is_run_id(run_id):
        raise HistoryError(f"{run_id!r} is not a run id", hint="run ids look like 20261130T031201Z-1234")
    return state.history / f"{run_id}{_SUFFIX}"


def append(state: EnvironmentState, entry: HistoryEntry) -> tuple[str, ...]:
    """Write a finished run's entry and drop the oldest beyond :data:`MAX_RUNS`; what went wrong, if
    anything (best effort: the run's own outcome stands whatever happens here)."""
    try:
        ensure_dir(state.history)
        atomic_write(_path(state, entry.run_id), encode(entry))
    except SafeInstallError as exc:
        return (f"the run's result was not kept in the history: {exc.message}",)
    except OSError as exc:
        return (f"the run's result was not kept in the history ({state.history}): {exc.strerror or exc}",)
    problems: list[str] = []
    for name in _run_files(state)[:-MAX_RUNS]:
        try:
            os.unlink(state.history / name)
        except OSError as exc:
            problems.append(f"could not remove the old history entry {name}: {exc.strerror or exc}")
    return tuple(problems)


def keep_result(
    state: EnvironmentState,
    run_id: str,
    package: str,
    started_at: str,
    result: RunDocument,
    lines: tuple[str, ...] = (),
) -> tuple[str, ...]:
    """The single place where a run's result becomes final, for a run and for its recovery: ``lines``
    and the result into the run's log, then the entry into the environment's history, naming the log
    whenever there is one (a run refused or declined has one too). What went wrong, if anything."""
    log = state.log_file(run_id)
    for line in lines:
        append_line(log, line)
    append_line(log, f"result: {result.status} (exit {result.exit_code})")
    log_file = str(log) if os.path.isfile(log) else None
    return append(state, new_entry(run_id, package, started_at, now_iso(), result, log_file=log_file))


def _run_files(state: EnvironmentState) -> list[str]:
    """The entries' file names, oldest first (run ids begin with their start time)."""
    try:
        names = os.listdir(state.history)
    except OSError:
        return []
    return sorted(n for n in names if n.endswith(_SUFFIX) and is_run_id(n[: -len(_SUFFIX)]))


def read_entry(path: Path) -> HistoryEntry:
    """One entry; HistoryError (saying why) for a file that is not ours, not a regular file, too large,
    or not an entry."""
    try:  # the one checked reader: ours alone, regular, bounded
        raw = read_trusted(path, MAX_ENTRY_BYTES, root_owned_ok=False)
    except UntrustedFile as exc:
        raise HistoryError(f"{path}: {exc.problem}") from exc
    except OSError as exc:
        raise HistoryError(f"{path}: {exc.strerror or exc}") from exc
    try:
        entry = json.loads(raw)
    except ValueError as exc:
        raise HistoryError(f"{path}: damaged ({exc})") from exc
    if not isinstance(entry, dict) or not isinstance(entry.get("result"), dict):
        raise HistoryError(f"{path}: damaged (not a run's result)")
    if entry.get("run_id") != path.name[: -len(_SUFFIX)]:
        raise HistoryError(f"{path}: damaged (it names run {entry.get('run_id')!r})")
    try:
        return HistoryEntry.from_json(entry)
    except ValueError as exc:
        raise HistoryError(f"{path}: damaged ({exc})") from exc


def find(state: EnvironmentState, run_id: str) -> HistoryEntry | None:
    """The entry of ``run_id`` (None: not finished, or not this environment's); a damaged one raises."""
    path = _path(state, run_id)
    return read_entry(path) if os.path.lexists(path) else None


def read_history(state: EnvironmentState) -> History:
    """Every readable entry, newest first; a damaged file is skipped with a note."""
    runs: list[RunSummary] = []
    problems: list[str] = []
    for name in _run_files(state):
        try:
            runs.append(summary(read_entry(state.history / name)))
        except HistoryError as exc:
            problems.append(f"history entry skipped: {exc.message}")
    runs.sort(key=lambda r: (r.finished_at or "", r.run_id), reverse=True)
    return History(tuple(runs), tuple(problems))
