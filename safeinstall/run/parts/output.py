"""The ``--json`` envelope: one versioned shape for every command (schema in docs/json.md).

``{"safeinstall_result_version": 1, "command", "status", "exit_code", "data", "errors"}``
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Collection, Sequence
from enum import Enum
from pathlib import PurePath
from typing import TYPE_CHECKING, Any

from safeinstall.env.drift import Finding, per_file
from safeinstall.errors import SafeInstallError
from safeinstall.run.parts.options import Mode
from safeinstall.store.rundoc import RESULT_VERSION, Change, OldCodeDoc, PatchDoc, PlanDoc
from safeinstall.system.identity import ProcessId

if TYPE_CHECKING:
    from safeinstall.env.verify import VerifyReport
    from safeinstall.run.parts.patches import PatchOutcome
    from safeinstall.scan.plan import OldCodeProcess, Plan


def jsonable(value: Any) -> Any:
    """Dataclasses and NamedTuples (as objects), enums, paths, tuples and sets to plain JSON values; an
    infinite or NaN float (a unit's ``TimeoutStopSec=infinity``) becomes null: JSON has no Infinity."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {
            k: jsonable(v)
            for f in dataclasses.fields(value)
            for k, v in _flat(f.name, getattr(value, f.name))
        }
    if isinstance(value, tuple) and hasattr(value, "_fields"):  # a NamedTuple: an object, as a dataclass
        return {name: jsonable(getattr(value, name)) for name in value._fields}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, PurePath):
        return str(value)
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set | frozenset):
        items = [jsonable(v) for v in value]
        return sorted(items) if isinstance(value, set | frozenset) else items
    return value


def _flat(name: str, value: Any) -> tuple[tuple[str, Any], ...]:
    """A field as JSON keys: a process held as a :class:`ProcessId` shows flat, as ``pid`` and
    ``start_time`` (docs/json.md), every other field as itself."""
    if isinstance(value, ProcessId):
        return (("pid", value.pid), ("start_time", value.start))
    return ((name, value),)


def finding_json(finding: Finding) -> dict[str, Any]:
    return {
        "distribution": finding.distribution,
        "path": finding.path,
        "kind": finding.kind.value,
        "detail": finding.detail,
        "drift": finding.is_drift,
        "baseline": finding.baseline,
        "expected": {"sha256": finding.expected_sha256, "size": finding.expected_size},
        "actual": {"sha256": finding.actual_sha256, "size": finding.actual_size},
        "wheel_member": finding.wheel_member,
        "shared_with": finding.shared_with,
        "acknowledged": finding.acknowledged,
    }


#: The flags that choose what safeinstall does, and the ``command`` of their JSON envelope.
_COMMANDS = (
    (Mode.VERIFY_ONLY, "verify"),
    (Mode.DRY_RUN, "dry-run"),
    (Mode.UNDO, "undo"),
    (Mode.RECOVER, "recover"),
    (Mode.STATUS, "status"),
    (Mode.FORGET, "forget"),
    (Mode.DISCARD, "discard"),
)


def command_for(flags: Collection[str]) -> str:
    """Pure: the command that the given modes (or flags, before they are parsed) select (``reinstall``
    by default)."""
    return next((name for flag, name in _COMMANDS if flag in flags), "reinstall")


#: Every ``status`` value of each command's ``--json`` document: docs/json.md lists each
#: (tests/test_json_contract.py reads it and fails on one it does not list).
STATUS_VALUES: dict[str, tuple[str, ...]] = {
    "verify": ("clean", "drift", "wheel-fault", "error"),
    "dry-run": ("would-proceed", "would-refuse", "error"),
    "reinstall": (
        "done",
        "declined",
        "rolled-back",
        "rollback-failed",
        "error",
        "detached",
        "recovered",
        "prepared",
        "discarded",
    ),
    "undo": ("done", "declined", "rolled-back", "rollback-failed", "error", "detached"),
    "recover": ("recovered", "nothing-to-recover", "rolled-back", "error"),
    "status": ("idle", "running", "needs-recovery", "prepared", "error"),
    "forget": ("forgotten", "error"),
    "discard": ("discarded", "error"),
}


def envelope(
    command: str,
    status: str,
    exit_code: int,
    data: Any = None,
    errors: list[SafeInstallError] | None = None,
) -> dict[str, Any]:
    return {
        "safeinstall_result_version": RESULT_VERSION,
        "command": command,
        "status": status,
        "exit_code": int(exit_code),
        "data": data,
        "errors": [e.to_json() for e in errors or []],
    }


def error_json(command: str, error: SafeInstallError) -> str:
    """The ``--json`` document of a command that failed before its result."""
    return dumps(envelope(command, "error", error.exit_code, None, [error]))


def dumps(document: dict[str, Any]) -> str:
    import json  # here: --verify-only without --json starts without it

    return json.dumps(jsonable(document), indent=2, sort_keys=False, allow_nan=False)


def plan_json(plan: Plan) -> dict[str, Any]:
    """A plan for ``--dry-run --json`` (and inside a reinstall's result)."""
    data: dict[str, Any] = jsonable(plan)
    data["proceeds"] = plan.proceeds
    return data


def plan_doc(plan: Plan) -> PlanDoc:
    """A run's plan as its document holds it: the JSON of ``--dry-run --json``, and its changes."""
    changes = tuple(
        Change(name=d.name, old_version=d.old_version, new_version=d.new_version, requested=d.requested)
        for d in plan.distributions
    )
    return PlanDoc(json=plan_json(plan), changes=changes)


def patch_docs(patches: Sequence[PatchOutcome]) -> tuple[PatchDoc, ...]:
    """--keep-patches: each local patch (a run's ``patches``, and a dry-run's)."""
    return tuple(PatchDoc(path=p.path, status=p.status.value, detail=p.detail, diff=p.diff) for p in patches)


def old_code_doc(process: OldCodeProcess) -> OldCodeDoc:
    """The end check: a process still mapping replaced files, as the run's document has it."""
    return OldCodeDoc(**dataclasses.asdict(process))


def verify_json(report: VerifyReport, patch: str | None, notes: Sequence[str] = ()) -> dict[str, Any]:
    """``--verify-only --json``: the report, each finding, a summary, the patch of ``--diff``, and
    ``notes`` (why the environment's baseline was not used)."""
    # a finding per hardlinked file, in its distribution's order (one finding of them all in the report)
    listed = [f for d in report.distributions for f in per_file(d.findings)]
    findings = [finding_json(f) for f in listed]
    return {
        "python": report.python,
        "prefix": report.prefix,
        "wheel": jsonable(report.wheel),
        "site_dirs": list(report.site_dirs),
        "egg_info": list(report.egg_info),
        "distributions": [
            {
                "name": d.name,
                "version": d.version,
                "dist_info": d.dist_info,
                "files_checked": d.files_checked,
                "against": d.against,
                "drift": d.drift,
                "wheel_fault": d.wheel_fault,
                "site": d.site,
                "from_base": d.from_base,
                "system_package": None
                if d.system_package is None
                else jsonable(d.system_package) | {"check": d.system_package.check},
            }
            for d in report.distributions
        ],
        "findings": findings,
        "summary": {
            "distributions": len(report.distributions),
            "files_checked": sum(d.files_checked for d in report.distributions),
            "drift": sum(1 for f in listed if f.is_drift),
            "wheel_faults": sum(1 for f in listed if f.is_wheel_fault),
            "bytecode": dict(zip(("compiled", "by_identity", "by_installer"), report.bytecode, strict=True)),
            "warnings": sum(1 for f in listed if not f.is_drift and not f.is_wheel_fault),
        },
        "patch": patch,
        "notes": list(notes),
    }
