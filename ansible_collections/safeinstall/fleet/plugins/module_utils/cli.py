"""The safeinstall command line seen from Ansible: the argv of each module's run, and the ``--json``
result envelope mapped to what a module returns. Pure functions over plain values; the modules do the
I/O (``AnsibleModule.run_command`` with an argv list: no shell, no expansion).

This runs under the interpreter Ansible uses on the host (which may be older than the Python that
safeinstall itself needs), so it keeps to Python 3.8 at run time.
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

#: a distribution name (PEP 508), as a whole and at the start of a requirement
_NAME = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?")

#: module option -> CLI option taking a value (passed as ``--flag=value``: never read as an option)
REINSTALL_VALUES = (
    ("python", "--python"),
    ("wheel", "--wheel"),
    ("stop_timeout", "--stop-timeout"),
    ("gpu_timeout", "--gpu-timeout"),
    ("settle", "--settle"),
    ("health_timeout", "--health-timeout"),
    ("keep_backups", "--keep-backups"),
)
#: module option -> CLI switch, passed only when true (a CLI without a newer switch still runs the
#: plays that do not ask for it)
REINSTALL_SWITCHES = (
    ("user", "--user"),
    ("with_deps", "--with-deps"),
    ("kill_strays", "--kill-strays"),
    ("prune", "--prune"),
    ("keep_patches", "--keep-patches"),
    ("no_swap", "--no-swap"),
    ("no_smoke", "--no-smoke"),
)


class CommandError(ValueError):
    """Options that make no safeinstall command line (the module fails before running anything)."""


def canonical_name(name: str) -> str:
    """PEP 503 normalisation: ``Foo_Bar`` and ``foo-bar`` name one distribution."""
    return re.sub(r"[-_.]+", "-", name).lower()


def _checked_name(name: str) -> str:
    if not _NAME.fullmatch(name):
        raise CommandError(f"{name!r} is not a distribution name")
    return name


def reinstall_target(name: str, requirement: str | None) -> str:
    """The CLI's positional argument: ``requirement`` (e.g. ``vllm==0.16.0``) when given, which must
    name the package ``name``; else ``name`` (the installed version, reinstalled)."""
    _checked_name(name)
    if requirement is None:
        return name
    match = _NAME.match(requirement.strip())
    if match is None or canonical_name(match.group(0)) != canonical_name(name):
        raise CommandError(f"requirement {requirement!r} does not name the package {name!r}")
    return requirement.strip()


def executable_argv(executable: str) -> list[str]:
    """``executable`` split as a shell would split it (``/opt/si/bin/python -m safeinstall``), never
    run by one."""
    argv = shlex.split(executable)
    if not argv:
        raise CommandError("executable is empty")
    return argv


def _value(value: Any) -> str:
    return format(value, "g") if isinstance(value, float) else str(value)


#: The phases of the reinstall module (its ``phase`` option): a whole run, or its two halves and the
#: discard of a prepared run (safeinstall's docs/prepare.md)
PHASES = ("run", "prepare", "commit", "discard")
#: The options of the window and after: the commit takes them, the prepare not (safeinstall refuses them)
WINDOW_KEYS = ("stop_timeout", "gpu_timeout", "settle", "health_url", "health_timeout")
#: The options a prepare fixes: a commit or a discard takes none of them
PREPARED_KEYS = (
    "requirement",
    "wheel",
    "with_deps",
    "kill_strays",
    "prune",
    "keep_patches",
    "no_swap",
    "no_smoke",
    "keep_backups",
    "undo",
    "undo_run",
)


def _given(params: Mapping[str, Any], keys: Sequence[str]) -> list[str]:
    """The options of ``keys`` set to something other than their default (None, false)."""
    return [key for key in keys if params.get(key) not in (None, False)]


def _refused(phase: str, given: Sequence[str], why: str) -> CommandError:
    return CommandError(f"phase={phase} does not take {', '.join(given)}: {why}")


def phase_argv(executable: Sequence[str], params: Mapping[str, Any], check_mode: bool) -> list[str]:
    """The command line of the reinstall module's ``phase``: ``run`` (:func:`reinstall_argv`),
    ``prepare`` (``--prepare``; in check mode the run's ``--dry-run``), ``commit`` (``--commit`` with
    the window's options only), ``discard``. A commit or a discard has no check mode of its own: the
    module reads ``--status`` for it (:func:`status_argv`)."""
    phase = params.get("phase") or "run"
    if phase not in PHASES:
        raise CommandError(f"phase must be one of {', '.join(PHASES)}, not {phase!r}")
    if params.get("prepared_max_age") is not None and phase != "commit":
        raise CommandError("prepared_max_age goes with phase=commit")
    if phase == "run":
        return reinstall_argv(executable, params, check_mode)
    if phase == "prepare":
        if _given(params, ("undo", "undo_run")):
            raise _refused(phase, _given(params, ("undo", "undo_run")), "an undo is a whole run")
        window = _given(params, WINDOW_KEYS)
        if window:
            raise _refused(phase, window, "they are the window's, give them to phase=commit")
        argv = reinstall_argv(executable, params, check_mode)
        if not check_mode:
            argv.insert(len(executable) + 3, "--prepare")  # after NAME --json --yes
        return argv
    fixed = _given(params, PREPARED_KEYS)
    if fixed:
        raise _refused(phase, fixed, "the prepare fixed them")
    if params.get("name") is not None:
        _checked_name(params["name"])
    python = [f"--python={params['python']}"] if params.get("python") else []
    if phase == "discard":
        window = _given(params, WINDOW_KEYS)
        if window:
            raise _refused(phase, window, "nothing is stopped")
        return [*executable, "--discard", "--json", *python]
    user = ["--user"] if params.get("user") else []
    values = [
        f"{flag}={_value(params[key])}"
        for key, flag in (*REINSTALL_VALUES, ("prepared_max_age", "--prepared-max-age"))
        if key in (*WINDOW_KEYS, "prepared_max_age") and params.get(key) is not None
    ]
    return [*executable, "--commit", "--json", "--yes", *python, *values, *user]


def status_argv(executable: Sequence[str], params: Mapping[str, Any]) -> list[str]:
    """``--status --json`` of the module's environment: is a run prepared there, and of what."""
    python = [f"--python={params['python']}"] if params.get("python") else []
    return [*executable, "--status", "--json", *python]


def reinstall_argv(executable: Sequence[str], params: Mapping[str, Any], check_mode: bool) -> list[str]:
    """The one command line of the reinstall module; in check mode, its ``--dry-run``. With ``undo``:
    ``--undo`` (of the last run, or of ``undo_run``), ``name`` a guard (the run must be of it)."""
    if params.get("undo"):
        if params.get("wheel") or params.get("requirement"):
            raise CommandError("undo puts back what a run replaced: it takes no wheel nor requirement")
        undo_run = params.get("undo_run")
        target = [_checked_name(params["name"]), "--undo", *([f"--run={undo_run}"] if undo_run else [])]
    elif params.get("undo_run"):
        raise CommandError("undo_run goes with undo: true")
    else:
        target = [reinstall_target(params["name"], params.get("requirement"))]
    argv = [*executable, *target, "--json", "--yes"]
    if check_mode:
        argv.append("--dry-run")
    argv += [f"{flag}={_value(params[key])}" for key, flag in REINSTALL_VALUES if params.get(key) is not None]
    argv += [flag for key, flag in REINSTALL_SWITCHES if params.get(key)]
    return argv


#: module option -> the environment variable safeinstall reads it from: a value that may hold a
#: credential (a health URL with a token) is never on a command line, which every local user can read
#: in ``/proc/PID/cmdline``
REINSTALL_ENVIRON = (("health_url", "SAFEINSTALL_HEALTH_URL"),)


def reinstall_environ(params: Mapping[str, Any]) -> dict[str, str]:
    """What the reinstall module adds to safeinstall's environment (see ``REINSTALL_ENVIRON``)."""
    return {name: str(params[key]) for key, name in REINSTALL_ENVIRON if params.get(key) is not None}


def verify_argv(executable: Sequence[str], params: Mapping[str, Any]) -> list[str]:
    """The command line of the verify module: one package (``name``) or every one (``all``)."""
    if bool(params.get("name")) == bool(params.get("all")):
        raise CommandError("give either name or all: true")
    target = ["--all"] if params.get("all") else [_checked_name(params["name"])]
    argv = [*executable, *target, "--verify-only", "--json"]
    argv += [
        f"{flag}={params[key]}"
        for key, flag in (("wheel", "--wheel"), ("python", "--python"))
        if params.get(key)
    ]
    return argv


def parse_result(stdout: str) -> dict[str, Any] | None:
    """The ``--json`` envelope on stdout; None when there is none (a CLI too old, a crash)."""
    try:
        document = json.loads(stdout)
    except ValueError:
        return None
    if not isinstance(document, dict) or "safeinstall_result_version" not in document:
        return None
    return document


@dataclass(frozen=True)
class Outcome:
    """What a module reports for one run of safeinstall."""

    failed: bool
    changed: bool
    status: str
    msg: str
    commands: tuple[str, ...] = ()


def plan_of(result: Mapping[str, Any] | None) -> Mapping[str, Any] | None:
    """The plan inside a ``dry-run`` (its data) or a ``reinstall`` (``data.plan``) result."""
    data = (result or {}).get("data") or {}
    plan = data if (result or {}).get("command") == "dry-run" else data.get("plan")
    return plan if isinstance(plan, Mapping) and "distributions" in plan else None


def _versions(plan: Mapping[str, Any]) -> str:
    return ", ".join(
        f"{d['name']} {d.get('old_version') or '(not installed)'} -> {d.get('new_version') or '(new)'}"
        for d in plan.get("distributions") or []
    )


def _units(plan: Mapping[str, Any]) -> list[str]:
    return [u["name"] for u in plan.get("units") or []]


def _errors(result: Mapping[str, Any]) -> str:
    parts = []
    for error in result.get("errors") or []:
        hint = error.get("hint")
        parts.append(error.get("message", "") + (f" (hint: {hint})" if hint else ""))
    return "; ".join(parts)


def would_change(plan: Mapping[str, Any]) -> bool:
    """A run of this plan would stop or install something."""
    strays = plan.get("kill_strays") and plan.get("strays")
    return bool(plan.get("distributions") or plan.get("units") or strays)


def _no_result(rc: int, stderr: str) -> Outcome:
    tail = " ".join(stderr.strip().splitlines()[-3:])
    return Outcome(True, False, "error", f"safeinstall exited {rc} without a --json result: {tail}".strip())


def reinstall_outcome(rc: int, result: Mapping[str, Any] | None, stderr: str, check_mode: bool) -> Outcome:
    """Exit 0: changed (check mode: changed when the run would stop or install anything); 2: failed,
    refused and nothing changed; 3: failed, rolled back; 4: failed, with the commands to finish."""
    if result is None:
        return _no_result(rc, stderr)
    status = str(result.get("status", "error"))
    plan = plan_of(result) or {}
    if rc == 0 and check_mode:
        changed = would_change(plan)
        units = ", ".join(_units(plan)) or "no unit"
        undo = "undo_of" in (result.get("data") or {})
        verb = ("would undo" if undo else "would reinstall") if changed else "nothing to do for"
        return Outcome(
            False, changed, status, f"{verb} {_versions(plan) or plan.get('package')}; restarts {units}"
        )
    if rc == 0:
        if status != "done":  # declined (an interactive run only; --yes never asks)
            return Outcome(False, False, status, f"safeinstall ended with status {status}")
        units = ", ".join(_units(plan)) or "no unit"
        undone = (result.get("data") or {}).get("undo_of")
        verb = f"undid run {undone}:" if undone else "reinstalled"
        return Outcome(False, True, status, f"{verb} {_versions(plan)}; restarted {units}")
    if rc == 2:
        reasons = _errors(result) or "; ".join(plan.get("refusals") or []) or status
        return Outcome(True, False, status, f"refused, nothing changed: {reasons}")
    if rc == 3:
        return Outcome(True, True, status, f"rolled back: {_errors(result)}")
    if rc == 4:
        commands = tuple((result.get("data") or {}).get("manual_commands") or ())
        finish = " && ".join(commands) or "see the message"
        return Outcome(
            True, True, status, f"rollback failed, finish by hand: {finish}. {_errors(result)}", commands
        )
    return Outcome(True, False, status, f"safeinstall exited {rc}: {_errors(result) or status}")


@dataclass(frozen=True)
class Prepared:
    """The prepared run of the module's environment, as ``--status --json`` lists it."""

    run_id: str
    package: str | None
    changes: tuple[str, ...]
    units: tuple[str, ...]


def prepared_of(status: Mapping[str, Any] | None) -> tuple[Prepared, ...]:
    """Every prepared run a ``--status --json`` result lists (one per environment that has one)."""
    found = []
    for env in ((status or {}).get("data") or {}).get("environments") or []:
        prepared = env.get("prepared")
        if isinstance(prepared, Mapping):
            found.append(
                Prepared(
                    str(prepared.get("run_id")),
                    env.get("package"),
                    tuple(str(c) for c in prepared.get("changes") or ()),
                    tuple(str(u) for u in prepared.get("units") or ()),
                )
            )
    return tuple(found)


def prepared_problem(name: str | None, found: Sequence[Prepared]) -> str | None:
    """Why a commit or discard must not take the prepared run: one of another package than ``name``
    (the play's guard; None: any package), or several environments without ``python``."""
    if len(found) > 1:
        return f"{len(found)} environments have a prepared run: name one with python"
    package = found[0].package if found else None
    if name is not None and package is not None and canonical_name(package) != canonical_name(name):
        return f"the prepared run {found[0].run_id} is of {found[0].package}, not {name}"
    return None


def phase_outcome(
    phase: str, rc: int, result: Mapping[str, Any] | None, stderr: str, check_mode: bool
) -> Outcome:
    """A prepare: exit 0 is changed (a prepared run is there; nothing stopped); a commit maps as a run
    (:func:`reinstall_outcome`); a discard: exit 0 is changed; 2 failed (none, or several)."""
    if phase == "prepare" and rc == 0 and not check_mode and result is not None:
        plan = plan_of(result) or {}
        units = ", ".join(_units(plan)) or "no unit"
        if result.get("status") != "prepared":
            return Outcome(True, False, str(result.get("status")), "safeinstall did not prepare")
        return Outcome(
            False,
            True,
            "prepared",
            f"prepared {_versions(plan)}; nothing stopped; the commit restarts {units}",
        )
    if phase == "discard" and result is not None:
        status = str(result.get("status", "error"))
        if rc == 0:
            dropped = (result.get("data") or {}).get("discarded") or {}
            changes = "; ".join(dropped.get("changes") or ())
            return Outcome(
                False, True, status, f"discarded the prepared run {dropped.get('run_id')} ({changes})"
            )
        return Outcome(True, False, status, f"could not discard: {_errors(result) or status}")
    return reinstall_outcome(rc, result, stderr, check_mode)


def plan_diff(plan: Mapping[str, Any]) -> dict[str, str]:
    """Ansible's diff of a plan: each distribution's old -> new version, and the units restarted."""
    before, after = [], []
    for dist in plan.get("distributions") or []:
        before.append(f"{dist['name']} {dist.get('old_version') or '(not installed)'}\n")
        after.append(f"{dist['name']} {dist.get('new_version') or '(new)'}\n")
    for unit in plan.get("units") or []:
        why = f", stops with {unit['stopped_with']}" if unit.get("stopped_with") else ""
        before.append(
            f"unit {unit['name']}: {unit.get('active_state')}, main PID {unit.get('main_pid')}{why}\n"
        )
        after.append(f"unit {unit['name']}: restarted\n")
    if plan.get("kill_strays"):
        for stray in plan.get("strays") or []:
            before.append(f"stray PID {stray['pid']} ({stray.get('name')})\n")
    python = plan.get("python", "")
    return {
        "before_header": f"{python} (installed)",
        "after_header": f"{python} (after safeinstall)",
        "before": "".join(before),
        "after": "".join(after),
    }


#: The kinds of finding (safeinstall.env.drift.FindingKind), drift apart from warnings: :func:`finding_counts`
#: lists each of them, zeros included, as ``--metrics-file`` does
DRIFT_KINDS = (
    "missing",
    "modified",
    "extra",
    "outside",
    "unreadable",
    "malformed",
    "version-mismatch",
    "mode",
    "record-changed",
)
WARNING_KINDS = ("hardlinked", "wheel-record", "shared", "dpkg-intact", "wheel-fault")


def finding_counts(result: Mapping[str, Any] | None) -> dict[str, dict[str, Any]]:
    """Per distribution, the counts that ``--metrics-file`` writes: ``files_checked``, and the findings
    per kind, ``drift`` (every drift kind) apart from ``warnings`` (every warning kind)."""
    data = (result or {}).get("data") or {}
    counts: dict[str, dict[str, Any]] = {}
    for dist in data.get("distributions") or []:
        counts[str(dist.get("name"))] = {
            "files_checked": int(dist.get("files_checked") or 0),
            "drift": dict.fromkeys(DRIFT_KINDS, 0),
            "warnings": dict.fromkeys(WARNING_KINDS, 0),
        }
    for finding in data.get("findings") or []:
        entry = counts.get(str(finding.get("distribution")))
        if entry is not None:
            group = entry["drift"] if finding.get("drift") else entry["warnings"]
            kind = str(finding.get("kind"))
            group[kind] = group.get(kind, 0) + 1
    return counts


def drift_findings(result: Mapping[str, Any] | None) -> list[Mapping[str, Any]]:
    """The findings that are drift (warnings such as ``hardlinked`` are not)."""
    findings = ((result or {}).get("data") or {}).get("findings") or []
    return [f for f in findings if f.get("drift")]


def verify_outcome(rc: int, result: Mapping[str, Any] | None, stderr: str, fail_on_drift: bool) -> Outcome:
    """Never changed. Exit 0: clean; 1: drift, failed only with ``fail_on_drift``; 5: no drift, a
    wheel's fault not acknowledged (said, not failed); else failed."""
    if result is None:
        return _no_result(rc, stderr)
    status = str(result.get("status", "error"))
    if rc in (0, 1, 5):
        drift = drift_findings(result)
        summary = (result.get("data") or {}).get("summary") or {}
        if not drift:
            faults = int(summary.get("wheel_faults") or 0)
            said = f"; {faults} wheel-fault(s) not acknowledged" if faults else ""
            return Outcome(False, False, status, f"no drift in {summary.get('files_checked', 0)} files{said}")
        listed = "; ".join(f"{f['kind']} {f['path']}" for f in drift[:5])
        more = f" and {len(drift) - 5} more" if len(drift) > 5 else ""
        return Outcome(fail_on_drift, False, status, f"{len(drift)} drifted: {listed}{more}")
    return Outcome(True, False, status, f"could not check: {_errors(result) or status}")
