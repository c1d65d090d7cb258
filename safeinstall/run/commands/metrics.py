"""``--metrics-file``: a result as Prometheus text for node_exporter's textfile collector.

The rendering is pure; :func:`write_metrics_file` writes atomically into a directory the caller chose,
refusing one others could redirect. docs/metrics.md.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from safeinstall.env.drift import WARNING_KINDS, FindingKind
from safeinstall.errors import SafeInstallError

if TYPE_CHECKING:  # the run's and the state's modules are not loaded by --verify-only
    from safeinstall.env.verify import VerifyReport
    from safeinstall.run.back.recover import Recovered
    from safeinstall.run.commands.status import StatusReport
    from safeinstall.store.history import RunSummary

#: Mode of the written file: node_exporter runs as an account of its own and must read it
METRICS_MODE = 0o644
#: Every status a run's result may have (the list in docs/json.md); each is a state of
#: ``safeinstall_run_status``, 1 for the run's own, 0 for the others
RUN_STATUSES = (
    "done",
    "declined",
    "rolled-back",
    "rollback-failed",
    "error",
    "recovered",
    "prepared",
    "commit-refused",
    "discarded",
)
DRIFT_KINDS = tuple(k.value for k in FindingKind if k not in WARNING_KINDS and k != FindingKind.WHEEL_FAULT)
#: wheel-fault last: not drift (its own exit status until root acknowledges it)
WARNING_KIND_NAMES = (*(k.value for k in FindingKind if k in WARNING_KINDS), FindingKind.WHEEL_FAULT.value)


class MetricsFileError(SafeInstallError):
    code = "metrics-file"


@dataclass(frozen=True, slots=True)
class Sample:
    labels: tuple[tuple[str, str], ...]
    value: float


@dataclass(frozen=True, slots=True)
class Family:
    name: str
    help: str
    samples: tuple[Sample, ...]
    type: str = "gauge"


def escape_label_value(value: str) -> str:
    """Pure: a label value as the text format writes it between quotes (backslash, double quote and
    line feed escaped); bytes that are not UTF-8 (a path's, kept by ``surrogateescape``) as ``\\xNN``."""
    text = value.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """Pure: HELP text as the format writes it (backslash and line feed escaped)."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """Pure: a sample value (``NaN``, ``+Inf`` and ``-Inf`` spelled as the format spells them)."""
    value = float(value)  # an int (a count, an exit code) too
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() and abs(value) < 2**53 else repr(value)


def render(families: Iterable[Family]) -> str:
    """Pure: the exposition text of ``families`` (one HELP and TYPE line each, then its samples; a
    family given twice is merged, the format allows each name once)."""
    merged: dict[str, Family] = {}
    for family in families:
        known = merged.get(family.name)
        merged[family.name] = (
            family if known is None else Family(known.name, known.help, known.samples + family.samples)
        )
    lines: list[str] = []
    for family in merged.values():
        if not family.samples:  # nothing to say (no environment): no HELP and TYPE lines either
            continue
        lines.append(f"# HELP {family.name} {escape_help(family.help)}")
        lines.append(f"# TYPE {family.name} {family.type}")
        for sample in family.samples:
            labels = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in sample.labels)
            lines.append(
                f"{family.name}{{{labels}}} {format_value(sample.value)}"
                if labels
                else f"{family.name} {format_value(sample.value)}"
            )
    return "\n".join(lines) + "\n"


def _one(name: str, help_text: str, value: float, **labels: str) -> Family:
    return Family(name, help_text, (Sample(tuple(labels.items()), value),))


def check_families(command: str, ok: bool, exit_code: int, now: float, **labels: str) -> list[Family]:
    """Pure: whether ``command`` could do its work, its exit code and when it ran."""
    flag = "--verify-only" if command == "verify" else f"--{command}"
    said = (
        ("success", f"1 when safeinstall {flag} could run, 0 when it failed (see its exit code)", float(ok)),
        ("exit_code", f"Exit code of the last safeinstall {flag}", exit_code),
        ("timestamp_seconds", f"When the last safeinstall {flag} ran (Unix time)", now),
    )
    return [
        _one(f"safeinstall_{command}_{name}", help_text, value, **labels) for name, help_text, value in said
    ]


def verify_families(prefix: str, report: VerifyReport | None, exit_code: int, now: float) -> list[Family]:
    """Pure: a ``--verify-only`` (``report`` None: it could not run) of the environment ``prefix``."""
    families = check_families("verify", report is not None, exit_code, now, prefix=prefix)
    if report is None:
        return families
    checked, drift, warnings = [], [], []
    for dist in report.distributions:
        base = (("prefix", prefix), ("distribution", dist.name))
        checked.append(Sample(base, dist.files_checked))
        counts: dict[str, int] = {}
        for finding in dist.findings:
            counts[finding.kind.value] = counts.get(finding.kind.value, 0) + finding.files
        drift += [Sample((*base, ("kind", kind)), counts.get(kind, 0)) for kind in DRIFT_KINDS]
        warnings += [Sample((*base, ("kind", kind)), counts.get(kind, 0)) for kind in WARNING_KIND_NAMES]
    return [
        *families,
        Family(
            "safeinstall_verify_files_checked",
            "Installed files checked against RECORD (or the wheel)",
            tuple(checked),
        ),
        Family(
            "safeinstall_verify_drift_findings",
            "Drift findings of the last check, by kind (missing, modified, extra, ...): local changes",
            tuple(drift),
        ),
        Family(
            "safeinstall_verify_warning_findings",
            "Findings that are warnings, not drift (hardlinked, wheel-record), by kind",
            tuple(warnings),
        ),
    ]


def _timestamp(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        return datetime.fromisoformat(text).timestamp()
    except ValueError:
        return None


def run_id_values(run_id: str) -> tuple[float, int] | None:
    """Pure: the Unix time and the PID a run id (``20261130T031201Z-1234``) is made of; None for none."""
    stamp, _, pid = run_id.partition("-")
    try:
        when = datetime.strptime(stamp, "%Y%m%dT%H%M%SZ").replace(tzinfo=UTC)
    except ValueError:
        return None
    return (when.timestamp(), int(pid)) if pid.isdigit() else None


def run_families(prefix: str, run: RunSummary) -> list[Family]:
    """Pure: a finished run of the environment ``prefix`` (its history summary)."""
    info = (  # no run id: a label new at every run would make a new series every run
        ("prefix", prefix),
        ("package", run.package or ""),
        ("old_version", run.old_version or ""),
        ("new_version", run.new_version or ""),
    )
    states = RUN_STATUSES if run.status in RUN_STATUSES else (*RUN_STATUSES, run.status)
    families = [
        _one(
            "safeinstall_run_info",
            "The last run: its package and versions (old and new), value 1",
            1,
            **dict(info),
        ),
        Family(
            "safeinstall_run_status",
            "The last run's status: 1 for its own, 0 for the others",
            tuple(Sample((("prefix", prefix), ("status", s)), float(s == run.status)) for s in states),
        ),
        _one("safeinstall_run_exit_code", "The last run's exit code", run.exit_code, prefix=prefix),
        Family(
            "safeinstall_run_unit_downtime_seconds",
            "How long each unit was not active in the last run",
            tuple(Sample((("prefix", prefix), ("unit", u)), s) for u, s in sorted(run.downtime_s.items())),
        ),
    ]
    if run.service_downtime_s is not None:
        families.append(
            _one(
                "safeinstall_run_service_downtime_seconds",
                "The last run: the first unit stopped -> its health URL answering 200 (--health-url)",
                run.service_downtime_s,
                prefix=prefix,
            )
        )
    named = run_id_values(run.run_id)
    if named is not None:  # the run id as values: YYYYMMDDTHHMMSSZ-PID, rebuilt from the two
        families += [
            _one(
                "safeinstall_run_id_timestamp_seconds",
                "The time in the last run's id",
                named[0],
                prefix=prefix,
            ),
            _one("safeinstall_run_id_pid", "The PID in the last run's id", named[1], prefix=prefix),
        ]
    for edge, when in (("start", run.started_at), ("end", run.finished_at)):
        seconds = _timestamp(when)
        if seconds is not None:
            families.append(
                _one(
                    f"safeinstall_run_{edge}_timestamp_seconds",
                    f"When the last run {'started' if edge == 'start' else 'ended'} (Unix time)",
                    seconds,
                    prefix=prefix,
                )
            )
    return families


def _per_prefix(name: str, help_text: str, values: Iterable[tuple[str, float]]) -> Family:
    return Family(name, help_text, tuple(Sample((("prefix", prefix),), float(v)) for prefix, v in values))


def status_families(report: StatusReport, now: float) -> list[Family]:
    """Pure: ``--status``: each environment's state and its last finished run."""
    envs = report.environments
    families = check_families("status", not report.failures, int(report.exit_code), now)
    families.append(
        _per_prefix(
            "safeinstall_status_running",
            "1 while a run holds the environment's lock",
            [(e.prefix, e.running) for e in envs],
        )
    )
    families.append(
        _per_prefix(
            "safeinstall_status_needs_recovery",
            "1 when a run died and safeinstall --recover must finish it",
            [(e.prefix, e.needs_recovery) for e in envs],
        )
    )
    for env in envs:
        if env.runs:
            families += run_families(env.prefix, env.runs[0])
    return families


def recover_families(recovered: Recovered, now: float) -> list[Family]:
    """Pure: ``--recover``: what it did for each environment."""
    done = recovered.recoveries
    return [
        *check_families("recover", not recovered.failures, int(recovered.exit_code), now),
        _per_prefix(
            "safeinstall_recover_recovered",
            "1 when a run had died here and was finished",
            [(r.prefix, r.run_id is not None) for r in done],
        ),
        _per_prefix(
            "safeinstall_recover_restored",
            "1 when the recovery restored the backup",
            [(r.prefix, r.restored) for r in done],
        ),
        _per_prefix(
            "safeinstall_recover_units_started",
            "Units the recovery started again",
            [(r.prefix, len(r.started)) for r in done],
        ),
    ]


def _untrusted(path: Path, problem: str) -> MetricsFileError:
    return MetricsFileError(
        f"refusing to write the metrics file {path}: {problem}",
        hint="another user could redirect what root writes there; give --metrics-file a path in a "
        "directory owned by root (or you) and writable by nobody else, e.g. node_exporter's textfile "
        "directory made with: install -d -m 0755 /var/lib/node_exporter/textfile_collector",
    )


def check_metrics_path(path: Path) -> Path:
    """The path to write, by the rule of every output file (:func:`safeinstall.store.state.output_path`),
    checked before the command works. Raises MetricsFileError (exit 2) when it must not be written."""
    from safeinstall.store.state import output_path

    absolute = Path(os.path.abspath(path))
    checked = output_path(Path(path), os.geteuid())
    if checked.target is None:
        raise _untrusted(absolute, checked.problem or "")
    return checked.target


def write_metrics_file(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` whole or not at all, mode 0644, in a directory :func:`check_metrics_path`
    checked first (docs/metrics.md). Raises MetricsFileError."""
    from safeinstall.store.state import atomic_write

    target = check_metrics_path(path)
    try:
        atomic_write(target, text.encode("utf-8"), METRICS_MODE)
    except OSError as exc:
        raise MetricsFileError(
            f"could not write the metrics file {target}: {exc.strerror or exc}",
            hint="nothing was left there; check that the directory exists and has room (the command's "
            "own result and exit code are unchanged)",
        ) from exc


def write_or_fail(path: Path | None, families: Sequence[Family]) -> SafeInstallError | None:
    """Write ``families`` to ``path`` (None: no ``--metrics-file``); the error, if it could not be."""
    if path is None:
        return None
    try:
        write_metrics_file(path, render(families))
    except SafeInstallError as error:
        return error
    return None
