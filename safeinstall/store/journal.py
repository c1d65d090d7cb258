"""The run journal ``<envdir>/journal.json``: what a run has done so far, durable at every step.

Written atomically; ``--recover`` decides with :func:`needs_restore` and :func:`units_to_start`.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from datetime import UTC, datetime
from enum import StrEnum
from pathlib import Path
from typing import Any

from safeinstall.errors import SafeInstallError
from safeinstall.store.state import (
    BACKUPS_DIR,
    JOURNAL_FILE,
    PREPARED_FILE,
    TMP_SUFFIX,
    atomic_write,
    environment_key,
    fsync_dir,
    is_run_id,
    read_private_file,
)
from safeinstall.system.cgroups import valid_unit_name
from safeinstall.system.fields import field as _get
from safeinstall.system.fields import list_of as _list_of
from safeinstall.system.gate import GATE_DROPIN
from safeinstall.system.identity import ProcessId

JOURNAL_VERSION = 1
#: A journal holds a plan and a history: kilobytes. Anything larger was not written by safeinstall.
JOURNAL_MAX_BYTES = 1024 * 1024
_INTERPRETER = re.compile(r"python[0-9.]*")
_TMP_PREFIX = f".{JOURNAL_FILE}."


class JournalError(SafeInstallError):
    """The journal exists but cannot be read or written."""

    code = "journal"


class Phase(StrEnum):
    """Phases of a run, in the order a run passes them."""

    PLANNED = "planned"
    BACKED_UP = "backed-up"
    STAGED = "staged"  # the new version installed and verified in the staging tree (env/renames.py)
    #: --prepare ended here: nothing stopped, the run waits for --commit (or --discard) (docs/prepare.md)
    PREPARED = "prepared"
    GATED = "gated"
    STOPPING = "stopping"
    STOPPED = "stopped"
    GPU_RELEASED = "gpu-released"
    INSTALLING = "installing"
    SWAPPING = "swapping"  # the staged version renamed into place (instead of uv's install)
    INSTALLED = "installed"
    VERIFIED = "verified"
    RESTARTING = "restarting"
    DONE = "done"
    ROLLING_BACK = "rolling-back"
    ROLLED_BACK = "rolled-back"
    FAILED = "failed"


PHASE_ORDER: tuple[Phase, ...] = tuple(Phase)
#: The package may be half-installed: recovery must restore the backup.
RESTORE_PHASES = frozenset({Phase.INSTALLING, Phase.SWAPPING, Phase.INSTALLED, Phase.ROLLING_BACK})


@dataclass(frozen=True, slots=True)
class JournalUnit:
    name: str
    user_manager: bool  # a `systemctl --user` unit
    was_active: bool
    unit_file_state: str  # enabled, disabled, static, ... as systemctl reported it before the run
    stopped: bool = False  # this run stopped it
    restarted: bool = False  # this run started it again


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    phase: Phase
    at: str  # ISO 8601, UTC
    note: str = ""


@dataclass(frozen=True, slots=True)
class Journal:
    run_id: str
    process: ProcessId  # the run; in the file, flat: ``pid`` and ``process_start``
    started_at: str  # ISO 8601, UTC
    python: str
    prefix: str
    package: str
    wheel: str | None
    uv_command: tuple[str, ...]
    phase: Phase = Phase.PLANNED
    units: tuple[JournalUnit, ...] = ()
    backup_dir: str | None = None
    gate: tuple[str, ...] = ()  # paths the run wrote to keep units from starting (drop-ins), to remove
    strays_killed: tuple[int, ...] = ()
    history: tuple[HistoryEntry, ...] = ()
    version: int = JOURNAL_VERSION
    old_version: str | None = None  # the package's version before the run (for the history of a recovery)
    new_version: str | None = None  # the version it installs

    @property
    def pid(self) -> int:
        return self.process.pid


def now_iso(now: datetime | None = None) -> str:
    return (now or datetime.now(UTC)).astimezone(UTC).isoformat(timespec="milliseconds")


def new_journal(
    run_id: str,
    process: ProcessId,
    python: str,
    prefix: str,
    package: str,
    wheel: str | None,
    uv_command: Sequence[str],
    units: Iterable[JournalUnit] = (),
    note: str = "",
    now: datetime | None = None,
    versions: tuple[str | None, str | None] = (None, None),
) -> Journal:
    """Pure: a new journal in phase ``planned``; ``versions``: the package's (old, new)."""
    at = now_iso(now)
    return Journal(
        run_id=run_id,
        process=process,
        started_at=at,
        python=python,
        prefix=prefix,
        package=package,
        wheel=wheel,
        uv_command=tuple(uv_command),
        phase=Phase.PLANNED,
        units=tuple(units),
        history=(HistoryEntry(Phase.PLANNED, at, note),),
        old_version=versions[0],
        new_version=versions[1],
    )


_TUPLE_FIELDS = frozenset({"uv_command", "units", "gate", "strays_killed", "history"})


def advance(
    journal: Journal, phase: Phase, note: str = "", now: datetime | None = None, **changes: Any
) -> Journal:
    """Pure: the journal in ``phase``, with ``changes`` applied (lists of its sequence fields stored as
    tuples) and the step appended to its history."""
    allowed = {f.name for f in fields(Journal)} - {"phase", "history", "version"}
    unknown = set(changes) - allowed
    if unknown:
        raise TypeError(f"advance() cannot change {sorted(unknown)}")
    normalised: dict[str, Any] = {k: tuple(v) if k in _TUPLE_FIELDS else v for k, v in changes.items()}
    history = (*journal.history, HistoryEntry(Phase(phase), now_iso(now), note))
    return replace(journal, phase=Phase(phase), history=history, **normalised)


def update_unit(journal: Journal, name: str, user_manager: bool, **changes: Any) -> Journal:
    """Pure: the journal with one unit's flags (``stopped``, ``restarted``) changed; history unchanged."""
    found = False
    units: list[JournalUnit] = []
    for unit in journal.units:
        if unit.name == name and unit.user_manager == user_manager:
            unit = replace(unit, **changes)
            found = True
        units.append(unit)
    if not found:
        raise KeyError(f"no unit {name} (user_manager={user_manager}) in the journal")
    return replace(journal, units=tuple(units))


def effective_phase(journal: Journal) -> Phase:
    """Pure: the phase to decide on; for ``failed``, the last phase reached before the failure."""
    if journal.phase != Phase.FAILED:
        return journal.phase
    for entry in reversed(journal.history):
        if entry.phase != Phase.FAILED:
            return entry.phase
    return Phase.PLANNED


def needs_restore(journal: Journal) -> bool:
    """Pure: whether the package may be half-installed, so recovery must restore the backup. False
    before the install started (planned .. gpu-released: nothing was changed; a staging tree is not the
    environment), after the new version was verified (verified, restarting, done), and once rolled back."""
    return effective_phase(journal) in RESTORE_PHASES


def units_to_start(journal: Journal) -> list[JournalUnit]:
    """Pure: units this run stopped that were running before it (start them again when recovering)."""
    return [unit for unit in journal.units if unit.stopped and unit.was_active]


# --- serialisation (pure) ---------------------------------------------------------------------------


def journal_to_dict(journal: Journal) -> dict[str, Any]:
    return {
        "version": journal.version,
        "run_id": journal.run_id,
        "pid": journal.process.pid,
        "process_start": journal.process.start,
        "started_at": journal.started_at,
        "python": journal.python,
        "prefix": journal.prefix,
        "package": journal.package,
        "wheel": journal.wheel,
        "uv_command": list(journal.uv_command),
        "phase": journal.phase.value,
        "units": [{f.name: getattr(u, f.name) for f in fields(u)} for u in journal.units],
        "backup_dir": journal.backup_dir,
        "gate": list(journal.gate),
        "strays_killed": list(journal.strays_killed),
        "history": [{"phase": h.phase.value, "at": h.at, "note": h.note} for h in journal.history],
        "old_version": journal.old_version,
        "new_version": journal.new_version,
    }


class _Bad(ValueError):
    pass


def _process(pid: int, start: int | None) -> ProcessId:
    try:
        return ProcessId.checked(pid, start)
    except ValueError as exc:
        raise _Bad(str(exc)) from None


def _phase(value: Any) -> Phase:
    try:
        return Phase(value)
    except ValueError:
        raise _Bad(f"unknown phase {value!r}") from None


def journal_from_dict(data: Any) -> Journal:
    """Pure: raises ValueError saying what is wrong."""
    if not isinstance(data, dict):
        raise _Bad("not a JSON object")
    version = _get(data, "version", int)
    if version != JOURNAL_VERSION:
        raise _Bad(f"version {version}, this safeinstall reads version {JOURNAL_VERSION}")
    units = [
        JournalUnit(
            name=_get(raw, "name", str),
            user_manager=_get(raw, "user_manager", bool),
            was_active=_get(raw, "was_active", bool),
            unit_file_state=_get(raw, "unit_file_state", str),
            stopped=_get(raw, "stopped", bool),
            restarted=_get(raw, "restarted", bool),
        )
        for raw in _list_of(data, "units", dict)
    ]
    history = [
        HistoryEntry(_phase(_get(raw, "phase", str)), _get(raw, "at", str), _get(raw, "note", str))
        for raw in _list_of(data, "history", dict)
    ]
    return Journal(
        version=version,
        run_id=_get(data, "run_id", str),
        process=_process(_get(data, "pid", int), _get(data, "process_start", int, optional=True)),
        started_at=_get(data, "started_at", str),
        python=_get(data, "python", str),
        prefix=_get(data, "prefix", str),
        package=_get(data, "package", str),
        wheel=_get(data, "wheel", str, optional=True),
        uv_command=tuple(_list_of(data, "uv_command", str)),
        phase=_phase(_get(data, "phase", str)),
        units=tuple(units),
        backup_dir=_get(data, "backup_dir", str, optional=True),
        gate=tuple(_list_of(data, "gate", str)),
        strays_killed=tuple(_list_of(data, "strays_killed", int)),
        history=tuple(history),
        old_version=_get(data, "old_version", str, optional=True),
        new_version=_get(data, "new_version", str, optional=True),
    )


def _normal_absolute(path: str) -> bool:
    return os.path.isabs(path) and os.path.normpath(path) == path and not path.startswith("//")


def journal_problems(
    journal: Journal, envdir: Path, dropin_roots: Mapping[bool, Collection[Path]]
) -> list[str]:
    """Pure: why ``journal`` (read from ``envdir``) is not one that safeinstall wrote there; [] when
    every field a recovery acts on is as a run of this environment writes it. ``dropin_roots`` maps
    ``user_manager`` to the directories that manager reads drop-ins from: a gate path must be
    ``ROOT/UNIT.d/50-safeinstall-gate.conf`` for one of the journal's own units."""
    problems: list[str] = []
    prefix = journal.prefix
    if not _normal_absolute(prefix):
        problems.append(f"its prefix {prefix!r} is not a normal absolute path")
    elif environment_key(Path(prefix)) != envdir.name:
        problems.append(f"its prefix {prefix} is not the environment this directory ({envdir.name}) is for")
    python = Path(journal.python)
    if not (
        _normal_absolute(journal.python)
        and python.parent == Path(prefix) / "bin"
        and _INTERPRETER.fullmatch(python.name)
    ):
        problems.append(
            f"its python {journal.python!r} is not the interpreter of {prefix} (PREFIX/bin/python*)"
        )
    if not is_run_id(journal.run_id):
        problems.append(f"its run id {journal.run_id!r} is not one safeinstall makes")
    elif journal.backup_dir is not None and journal.backup_dir != str(envdir / BACKUPS_DIR / journal.run_id):
        problems.append(
            f"its backup {journal.backup_dir!r} is not this run's backup directory "
            f"{envdir / BACKUPS_DIR / journal.run_id}"
        )
    bad_units = [u.name for u in journal.units if not valid_unit_name(u.name)]
    if bad_units:
        problems.append(
            f"unit names that are not valid systemd unit names: {', '.join(map(repr, bad_units))}"
        )
    allowed = {
        str(root / f"{unit.name}.d" / f"{GATE_DROPIN}.conf")
        for unit in journal.units
        if valid_unit_name(unit.name)
        for root in dropin_roots.get(unit.user_manager, ())
    }
    foreign = [path for path in journal.gate if path not in allowed]
    if foreign:
        problems.append(
            "gate paths that are not the boot-gate drop-ins of its units: " + ", ".join(map(repr, foreign))
        )
    return problems


def journal_to_json(journal: Journal) -> str:
    return json.dumps(journal_to_dict(journal), indent=2, ensure_ascii=False) + "\n"


# --- disk (the edges) -------------------------------------------------------------------------------


def journal_path(envdir: Path) -> Path:
    return envdir / JOURNAL_FILE


def write_journal(envdir: Path, journal: Journal) -> None:
    path = journal_path(envdir)
    try:
        atomic_write(path, journal_to_json(journal).encode("utf-8", errors="surrogateescape"))
    except OSError as exc:
        raise JournalError(
            f"cannot write the run journal {path}: {exc.strerror or exc}",
            hint="free space on that filesystem or fix its permissions, then run again",
        ) from exc


def prepared_waits(previous: Journal | None) -> JournalError | None:
    """Pure: the refusal of any other run (or its dry run) while ``previous`` is a prepared run that
    waits for --commit or --discard; None when none waits."""
    if previous is None or previous.phase != Phase.PREPARED:
        return None
    which = f"--python {previous.python}" + (" --user" if any(u.user_manager for u in previous.units) else "")
    return JournalError(
        f"a prepared run ({previous.run_id}, {previous.package}) waits in {previous.prefix}: "
        "nothing else runs there until it is committed or discarded",
        hint=f"safeinstall --commit {which} to go on with it, or safeinstall --discard {which}",
    )


def start_journal(envdir: Path, journal: Journal) -> Journal:
    """Write a new run's journal (see :func:`new_journal`) and return it; refuse while a previous
    run's is there. Call it holding the environment's lock."""
    previous = read_journal(envdir)
    waits = prepared_waits(previous)
    if waits is not None:
        raise waits
    if previous is not None:
        raise JournalError(
            f"a previous run ({previous.run_id}, PID {previous.pid}, {previous.package}) did not finish: "
            f"its journal {journal_path(envdir)} is in phase {previous.phase}",
            hint="run safeinstall --recover to put that run's changes back (or finish them) first",
        )
    write_journal(envdir, journal)
    return journal


def read_journal(envdir: Path) -> Journal | None:
    """The journal left in ``envdir``, or None. Raises :class:`JournalError` for a damaged one and
    :class:`~safeinstall.store.state.StateDirError` for one safeinstall cannot have written (a symlink,
    another owner's, writable by others, over :data:`JOURNAL_MAX_BYTES`). Its fields are checked against
    the directory by :func:`journal_problems`."""
    path = journal_path(envdir)
    try:
        raw = read_private_file(path, JOURNAL_MAX_BYTES)
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise JournalError(
            f"cannot read the run journal {path}: {exc.strerror or exc}",
            hint="run safeinstall as the user that owns the state directory (root for system runs)",
        ) from exc
    try:
        return journal_from_dict(json.loads(raw.decode("utf-8", errors="surrogateescape")))
    except ValueError as exc:  # json.JSONDecodeError, _Bad, UnicodeError are ValueErrors
        raise JournalError(
            f"the run journal {path} is damaged ({exc})",
            hint=f"read it to see what the crashed run did, put things back by hand if needed, then "
            f"remove it (rm {path}) and run again",
        ) from exc


def clear_journal(envdir: Path) -> None:
    """Remove the journal (a clean end) and any temp file a crashed write left; fsync the directory."""
    removed = False
    # a prepared run's record (store/prepared.py) goes with its journal
    for candidate in [
        journal_path(envdir),
        envdir / PREPARED_FILE,
        *envdir.glob(f"{_TMP_PREFIX}*{TMP_SUFFIX}"),
    ]:
        try:
            candidate.unlink()
            removed = True
        except FileNotFoundError:
            pass
    if removed:
        fsync_dir(envdir)
