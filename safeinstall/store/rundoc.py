"""A run's ``--json`` document, typed (docs/json.md): as printed, kept by the history and rendered.

:meth:`RunDocument.from_json` is the one checked reader; :meth:`RunDocument.to_json` gives the same JSON
back, byte for byte.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from safeinstall.errors import SafeInstallError
from safeinstall.system.fields import check as _check
from safeinstall.system.fields import is_number as _is_number
from safeinstall.system.fields import objects as _objects
from safeinstall.system.fields import text as _text
from safeinstall.system.fields import text_or_none as _text_or_none
from safeinstall.system.fields import texts as _texts

#: ``safeinstall_result_version``: changes only when a field is removed or changes meaning.
RESULT_VERSION = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class ErrorDoc:
    code: str
    message: str
    hint: str | None

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> ErrorDoc:
        return cls(
            code=_text(raw.get("code", "error"), "errors.code"),
            message=_text(raw.get("message", ""), "errors.message"),
            hint=_text_or_none(raw.get("hint"), "errors.hint"),
        )

    @classmethod
    def of(cls, error: SafeInstallError) -> ErrorDoc:
        return cls(code=error.code, message=error.message, hint=error.advice)

    def to_json(self) -> dict[str, Any]:
        return {"code": self.code, "message": self.message, "hint": self.hint}


@dataclass(frozen=True, slots=True, kw_only=True)
class StepDoc:
    name: str
    status: str  # ok | failed | skipped
    seconds: float
    detail: str = ""

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> StepDoc:
        return cls(
            name=_text(raw.get("name", ""), "steps.name"),
            status=_text(raw.get("status", ""), "steps.status"),
            seconds=_check(raw.get("seconds", 0.0), _is_number, "steps.seconds"),
            detail=_text(raw.get("detail", ""), "steps.detail"),
        )

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "status": self.status, "seconds": self.seconds, "detail": self.detail}


@dataclass(frozen=True, slots=True, kw_only=True)
class OldCodeDoc:
    """The end check: a process still mapping replaced files."""

    pid: int
    name: str
    cmdline: tuple[str, ...]
    unit: str | None
    scope: str | None
    distributions: tuple[str, ...]
    paths: tuple[str, ...]

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> OldCodeDoc:
        return cls(
            pid=_check(raw.get("pid", 0), lambda v: isinstance(v, int) and not isinstance(v, bool), "pid"),
            name=_text(raw.get("name", ""), "old_code.name"),
            cmdline=_texts(raw.get("cmdline", []), "old_code.cmdline"),
            unit=_text_or_none(raw.get("unit"), "old_code.unit"),
            scope=_text_or_none(raw.get("scope"), "old_code.scope"),
            distributions=_texts(raw.get("distributions", []), "old_code.distributions"),
            paths=_texts(raw.get("paths", []), "old_code.paths"),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "name": self.name,
            "cmdline": list(self.cmdline),
            "unit": self.unit,
            "scope": self.scope,
            "distributions": list(self.distributions),
            "paths": list(self.paths),
        }


@dataclass(frozen=True, slots=True, kw_only=True)
class PatchDoc:
    """--keep-patches: one local patch (``carried``, ``dropped``, ``conflict``, ``rolled-back``)."""

    path: str
    status: str
    detail: str
    diff: str

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> PatchDoc:
        return cls(
            path=_text(raw.get("path", ""), "patches.path"),
            status=_text(raw.get("status", ""), "patches.status"),
            detail=_text(raw.get("detail", ""), "patches.detail"),
            diff=_text(raw.get("diff", ""), "patches.diff"),
        )

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "status": self.status, "detail": self.detail, "diff": self.diff}


@dataclass(frozen=True, slots=True, kw_only=True)
class Change:
    """One distribution of the plan: the version it had and the one the run installs."""

    name: str
    old_version: str | None
    new_version: str | None
    requested: bool


@dataclass(frozen=True, slots=True, kw_only=True)
class PlanDoc:
    """The run's plan: as ``--dry-run --json`` prints it (``json``, kept as it is: docs/json.md), and
    its distributions' changes, read once."""

    json: Mapping[str, Any]
    changes: tuple[Change, ...] = ()

    @classmethod
    def from_json(cls, raw: object) -> PlanDoc:
        plan = _check(raw, lambda p: isinstance(p, dict), "plan")
        changes = []
        listed = _check(plan.get("distributions", []), lambda v: isinstance(v, list), "plan.distributions")
        for raw_change in listed:
            dist = _check(raw_change, lambda v: isinstance(v, dict), "plan.distributions")
            changes.append(
                Change(
                    name=_text(dist.get("name", ""), "plan.distributions.name"),
                    old_version=_text_or_none(dist.get("old_version"), "plan.distributions.old_version"),
                    new_version=_text_or_none(dist.get("new_version"), "plan.distributions.new_version"),
                    requested=bool(dist.get("requested")),
                )
            )
        return cls(json=plan, changes=tuple(changes))

    def to_json(self) -> dict[str, Any]:
        return dict(self.json)

    def slim(self) -> PlanDoc:
        """The plan without its processes and units (a history entry too large to keep whole)."""
        keep = ("package", "python", "prefix", "user_manager", "distributions", "uv_command")
        return replace(self, json={key: self.json[key] for key in keep if key in self.json})


#: Each field of a run's ``data`` and how it is read (docs/json.md: ``reinstall``; a ``recovered``
#: run's: what ``--recover`` did for it), in the order a run writes them.
_READERS: dict[str, Callable[[object], Any]] = {
    "run_id": lambda v: _text_or_none(v, "run_id"),
    "undo_of": lambda v: _text_or_none(v, "undo_of"),
    "plan": lambda v: None if v is None else PlanDoc.from_json(v),
    "steps": lambda v: _objects(v, "steps", StepDoc.from_json),
    "downtime_s": lambda v: {
        _text(unit, "downtime_s"): _check(s, _is_number, "downtime_s")
        for unit, s in _check(v, lambda d: isinstance(d, dict), "downtime_s").items()
    },
    "service_downtime_s": lambda v: None if v is None else _check(v, _is_number, "service_downtime_s"),
    "patched": lambda v: _texts(v, "patched"),
    "deleted": lambda v: _texts(v, "deleted"),
    "extras": lambda v: _texts(v, "extras"),
    "pruned": lambda v: _texts(v, "pruned"),
    "backup_dir": lambda v: _text_or_none(v, "backup_dir"),
    "backups_removed": lambda v: _texts(v, "backups_removed"),
    "log_file": lambda v: _text_or_none(v, "log_file"),
    "not_restarted": lambda v: _texts(v, "not_restarted"),
    "strays_killed": lambda v: tuple(
        _check(p, lambda x: isinstance(x, int) and not isinstance(x, bool), "strays_killed")
        for p in _check(v, lambda x: isinstance(x, list), "strays_killed")
    ),
    "notes": lambda v: _texts(v, "notes"),
    "old_code": lambda v: _objects(v, "old_code", OldCodeDoc.from_json),
    "patches": lambda v: _objects(v, "patches", PatchDoc.from_json),
    "patch_file": lambda v: _text_or_none(v, "patch_file"),
    "manual_commands": lambda v: _texts(v, "manual_commands"),
    "wall_s": lambda v: None if v is None else _check(v, _is_number, "wall_s"),
    # a recovered run's
    "prefix": lambda v: _text_or_none(v, "prefix"),
    "phase": lambda v: _text_or_none(v, "phase"),
    "restored": lambda v: bool(_check(v, lambda b: isinstance(b, bool), "restored")),
    "started": lambda v: _texts(v, "started"),
    "gates_removed": lambda v: _texts(v, "gates_removed"),
    "old_version": lambda v: _text_or_none(v, "old_version"),
    "new_version": lambda v: _text_or_none(v, "new_version"),
}


#: A run's ``data``, each field in the order it is written (``undo_of``: an undo's alone).
RUN_FIELDS = tuple(_READERS)[: tuple(_READERS).index("wall_s") + 1]


@dataclass(frozen=True, slots=True, kw_only=True)
class RunData:
    """A run's ``data``. ``present``: the fields the document has, in its order (a run's, a recovered
    run's and an old entry's differ); ``other``: fields this version does not know, kept as they are."""

    present: tuple[str, ...] = ()
    run_id: str | None = None
    undo_of: str | None = None
    plan: PlanDoc | None = None
    steps: tuple[StepDoc, ...] = ()
    downtime_s: Mapping[str, float] = field(default_factory=dict)
    #: --health-url: the first unit stopped -> the health URL answered 200 (None: without it, not done)
    service_downtime_s: float | None = None
    patched: tuple[str, ...] = ()  # files changed or deleted locally
    deleted: tuple[str, ...] = ()  # those of ``patched`` deleted locally: nothing of them to keep
    extras: tuple[str, ...] = ()
    pruned: tuple[str, ...] = ()
    backup_dir: str | None = None
    backups_removed: tuple[str, ...] = ()
    log_file: str | None = None
    not_restarted: tuple[str, ...] = ()
    strays_killed: tuple[int, ...] = ()
    notes: tuple[str, ...] = ()
    old_code: tuple[OldCodeDoc, ...] = ()
    patches: tuple[PatchDoc, ...] = ()
    patch_file: str | None = None
    manual_commands: tuple[str, ...] = ()
    wall_s: float | None = None  # the whole run: from before its preflight to its result
    prefix: str | None = None
    phase: str | None = None
    restored: bool = False
    started: tuple[str, ...] = ()
    gates_removed: tuple[str, ...] = ()
    old_version: str | None = None
    new_version: str | None = None
    other: Mapping[str, Any] = field(default_factory=dict)

    @property
    def changes(self) -> tuple[Change, ...]:
        """The plan's distributions (none without a plan)."""
        return () if self.plan is None else self.plan.changes

    def versions(self, package: str | None) -> tuple[str | None, str | None]:
        """The old and new version of ``package`` (a canonical name; None: the requested one); a
        recovered run's, which has no plan, from its own fields."""
        for change in self.changes:
            if change.name == package or (package is None and change.requested):
                return change.old_version, change.new_version
        return self.old_version, self.new_version

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RunData:
        known = {name: _READERS[name](value) for name, value in raw.items() if name in _READERS}
        other = {name: value for name, value in raw.items() if name not in _READERS}
        return cls(present=tuple(raw), other=other, **known)

    def to_json(self) -> dict[str, Any]:
        return {name: self._json_of(name) for name in self.present}

    def _json_of(self, name: str) -> Any:
        if name not in _READERS:
            return self.other[name]
        value = getattr(self, name)
        if isinstance(value, tuple):
            return [v.to_json() if hasattr(v, "to_json") else v for v in value]
        if name == "downtime_s":
            return dict(value)
        return value.to_json() if isinstance(value, PlanDoc) else value


@dataclass(frozen=True, slots=True, kw_only=True)
class RunDocument:
    """A reinstall's or an undo's ``--json`` document: the envelope (docs/json.md) and its ``data``
    (None: the run failed before it had any)."""

    command: str
    status: str
    exit_code: int
    data: RunData | None
    errors: tuple[ErrorDoc, ...] = ()
    version: int = RESULT_VERSION

    @classmethod
    def from_json(cls, raw: Mapping[str, Any]) -> RunDocument:
        """The document ``raw`` is; a ValueError says what in it is not a run's document."""
        data = raw.get("data")
        code = raw.get("exit_code", -1)
        return cls(
            version=_check(raw.get("safeinstall_result_version", RESULT_VERSION), _is_number, "version"),
            command=_text(raw.get("command", "reinstall"), "command"),
            status=_text(raw.get("status", "unknown"), "status"),
            exit_code=_check(code, lambda c: isinstance(c, int) and not isinstance(c, bool), "exit_code"),
            data=None
            if data is None
            else RunData.from_json(_check(data, lambda d: isinstance(d, dict), "data")),
            errors=_objects(raw.get("errors", []), "errors", ErrorDoc.from_json),
        )

    @classmethod
    def failed(cls, command: str, error: SafeInstallError) -> RunDocument:
        """The document of a run that failed before it had any data."""
        errors = (ErrorDoc.of(error),)
        return cls(command=command, status="error", exit_code=int(error.exit_code), data=None, errors=errors)

    def to_json(self) -> dict[str, Any]:
        return {
            "safeinstall_result_version": self.version,
            "command": self.command,
            "status": self.status,
            "exit_code": self.exit_code,
            "data": None if self.data is None else self.data.to_json(),
            "errors": [e.to_json() for e in self.errors],
        }

    @property
    def details(self) -> RunData:
        """Its data; an empty one for a run that failed before it had any."""
        return self.data if self.data is not None else RunData()
