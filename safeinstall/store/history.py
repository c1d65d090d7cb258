"""Finished runs: each run's final result kept in ``<envdir>/history/<run-id>.json``.

An entry holds the run id, when it started and finished, the package, and ``result``: the very JSON
document that ``--json`` printed. One file per run, written once and atomically (mode 0600) by the
process that ran it, as the last thing it does: an entry means "finished". Two runs never write the
same file, so no lock is needed.

The history is bounded: a run that adds its entry removes the oldest beyond :data:`MAX_RUNS`, and an
entry larger than :data:`MAX_ENTRY_BYTES` keeps its summary and loses the plan. Reading never trusts a
file: a damaged, oversized or foreign one is skipped with a note saying which and why.
"""

from __future__ import annotations

import json
import os
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name

from safeinstall.errors import SafeInstallError
from safeinstall.store.journal import now_iso
from safeinstall.store.runlog import append_line
from safeinstall.store.state import EnvironmentState, atomic_write, ensure_dir, is_run_id

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


@dataclass(frozen=True, slots=True)
class History:
    runs: tuple[RunSummary, ...]  # newest first
    problems: tuple[str, ...]  # files that were skipped, and why


def new_entry(
    run_id: str,
    package: str,
    started_at: str,
    finished_at: str,
    result: dict[str, Any],
    log_file: str | None = None,
) -> dict[str, Any]:
    """Pure: the history entry of a finished run; ``result`` is the run's ``--json`` document;
    ``log_file`` its log, also for a run whose result names none (refused, declined)."""
    return {
        "history_version": HISTORY_VERSION,
        "run_id": run_id,
        "package": package,
        "started_at": started_at,
        "finished_at": finished_at,
        "log_file": log_file,
        "result": result,
    }


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _str(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _versions(data: dict[str, Any], package: str | None) -> tuple[str | None, str | None]:
    wanted = canonicalize_name(package) if package else None
    for dist in _dict(data.get("plan")).get("distributions") or []:
        dist = _dict(dist)
        if dist.get("name") == wanted or (wanted is None and dist.get("requested")):
            return _str(dist.get("old_version")), _str(dist.get("new_version"))
    return _str(data.get("old_version")), _str(data.get("new_version"))  # a recovered run's (no plan)


def summary(entry: dict[str, Any]) -> RunSummary:
    """Pure: the fields ``--status`` shows, from an entry (missing parts are None)."""
    result = _dict(entry.get("result"))
    data = _dict(result.get("data"))
    package = _str(entry.get("package"))
    old, new = _versions(data, package)
    downtime = {
        str(unit): float(seconds)
        for unit, seconds in _dict(data.get("downtime_s")).items()
        if isinstance(seconds, int | float) and not isinstance(seconds, bool)
    }
    code = result.get("exit_code")
    return RunSummary(
        run_id=str(entry.get("run_id")),
        status=_str(result.get("status")) or "unknown",
        exit_code=code if isinstance(code, int) and not isinstance(code, bool) else -1,
        package=package,
        old_version=old,
        new_version=new,
        started_at=_str(entry.get("started_at")),
        finished_at=_str(entry.get("finished_at")),
        downtime_s=downtime,
        log_file=_str(data.get("log_file")) or _str(entry.get("log_file")),
    )


def encode(entry: dict[str, Any]) -> bytes:
    """Pure: the entry as written, at most :data:`MAX_ENTRY_BYTES` (the plan goes first when too big)."""
    data = json.dumps(entry, allow_nan=False).encode()
    if len(data) <= MAX_ENTRY_BYTES:
        return data
    result = dict(_dict(entry.get("result")))
    details = dict(_dict(result.get("data")))
    details["plan"] = _slim_plan(_dict(details.get("plan")))
    details["notes"] = [
        *details.get("notes", []),
        "the plan's details were left out of the history (too large)",
    ]
    result["data"] = details
    data = json.dumps({**entry, "result": result}, allow_nan=False).encode()
    if len(data) <= MAX_ENTRY_BYTES:
        return data
    result["data"] = None
    return json.dumps({**entry, "result": result, "truncated": True}, allow_nan=False).encode()


def _slim_plan(plan: dict[str, Any]) -> dict[str, Any]:
    keep = ("package", "python", "prefix", "user_manager", "distributions", "uv_command")
    return {key: plan[key] for key in keep if key in plan}


def _path(state: EnvironmentState, run_id: str) -> Path:
    if not is_run_id(run_id):
        raise HistoryError(f"{run_id!r} is not a run id", hint="run ids look like 20261130T031201Z-1234")
    return state.history / f"{run_id}{_SUFFIX}"


def append(state: EnvironmentState, entry: dict[str, Any]) -> tuple[str, ...]:
    """Write a finished run's entry and drop the oldest beyond :data:`MAX_RUNS`; what went wrong, if
    anything (best effort: the run's own outcome stands whatever happens here)."""
    try:
        ensure_dir(state.history)
        atomic_write(_path(state, str(entry.get("run_id"))), encode(entry))
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
    result: dict[str, Any],
    lines: tuple[str, ...] = (),
) -> tuple[str, ...]:
    """The single place where a run's result becomes final, for a run and for its recovery: ``lines``
    and the result into the run's log, then the entry into the environment's history, naming the log
    whenever there is one (a run refused or declined has one too). What went wrong, if anything."""
    log = state.log_file(run_id)
    for line in lines:
        append_line(log, line)
    append_line(log, f"result: {result['status']} (exit {result['exit_code']})")
    log_file = str(log) if os.path.isfile(log) else None
    return append(state, new_entry(run_id, package, started_at, now_iso(), result, log_file=log_file))


def _run_files(state: EnvironmentState) -> list[str]:
    """The entries' file names, oldest first (run ids begin with their start time)."""
    try:
        names = os.listdir(state.history)
    except OSError:
        return []
    return sorted(n for n in names if n.endswith(_SUFFIX) and is_run_id(n[: -len(_SUFFIX)]))


def read_entry(path: Path) -> dict[str, Any]:
    """One entry; HistoryError (saying why) for a file that is not ours, not a regular file, too large,
    or not an entry."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError as exc:
        raise HistoryError(f"{path}: {exc.strerror or exc}") from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise HistoryError(f"{path}: not a regular file")
        if info.st_uid != os.geteuid():
            raise HistoryError(f"{path}: owned by uid {info.st_uid}, not by uid {os.geteuid()}")
        if info.st_size > MAX_ENTRY_BYTES:
            raise HistoryError(f"{path}: {info.st_size} bytes, more than an entry can be")
        raw = os.read(fd, MAX_ENTRY_BYTES + 1)
    finally:
        os.close(fd)
    try:
        entry = json.loads(raw)
    except ValueError as exc:
        raise HistoryError(f"{path}: damaged ({exc})") from exc
    if not isinstance(entry, dict) or not isinstance(entry.get("result"), dict):
        raise HistoryError(f"{path}: damaged (not a run's result)")
    if entry.get("run_id") != path.name[: -len(_SUFFIX)]:
        raise HistoryError(f"{path}: damaged (it names run {entry.get('run_id')!r})")
    return entry


def find(state: EnvironmentState, run_id: str) -> dict[str, Any] | None:
    """The entry of ``run_id`` (None: not finished, or not this environment's); a damaged one raises."""
    path = _path(state, run_id)
    if not os.path.lexists(path):
        return None
    return read_entry(path)


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
