"""Human output with rich: tables on stdout, warnings and progress on stderr. No logic lives here."""

from __future__ import annotations

import contextlib
import os
import re
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.markup import escape

from safeinstall.errors import ExitCode, SafeInstallError
from safeinstall.run.commands.view import (
    PROGRESS_EVERY_S,
    RECORD_MAY_BE_WRONG_HINT,
    SHARED_WITH,
    UNTOUCHED,
    Finding,
    FindingKind,
    human_bytes,
    per_file,
    progress_key,
    progress_text,
    said_at_change,
)

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from safeinstall.run.back.recover import Recovery
    from safeinstall.run.commands.status import EnvironmentStatus, Forgotten
    from safeinstall.run.commands.view import (
        AffectedDistribution,
        ErrorDoc,
        FileDiff,
        HistoryEntry,
        OldCodeDoc,
        PatchDoc,
        Plan,
        PlannedProcess,
        RunDocument,
        RunSummary,
        ScanProblem,
        StepDoc,
        VerifyReport,
    )
    from safeinstall.run.parts.patches import PatchOutcome

_KIND_STYLE = {
    FindingKind.MISSING: "bold red",
    FindingKind.MODIFIED: "bold yellow",
    FindingKind.EXTRA: "cyan",
    FindingKind.OUTSIDE: "bold magenta",
    FindingKind.UNREADABLE: "red",
    FindingKind.MALFORMED: "magenta",
    FindingKind.VERSION_MISMATCH: "bold red",
    FindingKind.MODE: "bold red",
}


#: C0 and C1 control characters and DEL: an ESC/CSI/OSC sequence among them rewrites a terminal.
_CONTROLS = re.compile("[\x00-\x1f\x7f-\x9f]")
#: The same, less newline and tab (text of several lines: a message with uv's output, a diff).
_CONTROLS_BUT_LINES = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def printable(text: str, lines: bool = False) -> str:
    """Pure: ``text`` that cannot drive a terminal: each C0/C1 control character and DEL shown as
    ``\\xNN`` (other unicode unchanged). A command line, file or unit name written by another user must
    not clear, retitle or rewrite root's terminal. ``lines``: newlines and tabs are kept."""
    pattern = _CONTROLS_BUT_LINES if lines else _CONTROLS
    return pattern.sub(lambda found: f"\\x{ord(found.group()):02x}", text)


def literal(value: object, lines: bool = False) -> str:
    """Pure: a value from outside (a path, a name, a command line, a message, a detail) as rich markup
    that prints it exactly: :func:`printable`, with every ``[`` that could open a tag escaped. Every
    such value that human output shows goes through here."""
    return escape(printable(str(value), lines))


class WordWrapping(Console):
    """A console whose long lines (``soft_wrap=True``: a warning, a note, an error) are, on a terminal,
    wrapped between words at its width (a word longer than a line stands whole on its own), never
    folded by the terminal in the middle of a word; off a terminal (a pipe, a log) each stays one line,
    whole, for grep."""

    def print(self, *objects: Any, soft_wrap: bool | None = None, **kwargs: Any) -> None:
        super().print(*objects, soft_wrap=soft_wrap and not self.is_terminal, **kwargs)

    def on_broken_pipe(self) -> None:
        """The reader went away (``safeinstall ... | head``): what is left to say goes nowhere, and the
        run goes on to its end (rich's own answer, ``SystemExit``, would leave a stopped unit down)."""
        self.quiet = True
        devnull = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(devnull, self.file.fileno())
        finally:
            os.close(devnull)


#: The width of output that is not a terminal when COLUMNS does not say one (a pipe to less or cat)
PIPE_WIDTH = 80


def make_console(stderr: bool = False) -> Console:
    """No emoji codes: a file named ``:warning:`` is shown as named, not as a sign (``literal`` escapes
    markup, not ``:name:``), and no highlighting. Off a terminal, COLUMNS or :data:`PIPE_WIDTH`."""
    probe = Console(stderr=stderr)
    given = os.environ.get("COLUMNS", "").isdigit()  # on a pipe too: the width a script asks for
    wide = probe.is_terminal or given
    return WordWrapping(stderr=stderr, width=None if wide else PIPE_WIDTH, highlight=False, emoji=False)


def render_error(console: Console, error: SafeInstallError | ErrorDoc) -> None:
    """An error and its hint (a run's document's own: ``hint`` as it was said)."""
    hint = (
        error.advice if isinstance(error, SafeInstallError) else error.hint or SafeInstallError.default_hint
    )
    console.print(f"[bold red]error:[/] {literal(error.message, lines=True)}", soft_wrap=True)
    console.print(f"[dim]hint:[/] {literal(hint, lines=True)}", soft_wrap=True)


def _finding_lines(out: Console, findings: Sequence[Finding]) -> list[str]:
    """Each finding: its kind, distribution and path on one line (a path is never broken: the line is
    not wrapped), its detail indented below (wrapped between words). A hint that would be the same for
    every file is left out of the detail (``--json`` keeps it) and said once by the caller: the
    distributions whose files it is about, returned."""
    hinted: list[str] = []
    for f in findings:
        style = _KIND_STYLE.get(f.kind, "")
        kind = f"[{style}]{f.kind.value}[/]" if style else f.kind.value
        out.print(f"{kind} {literal(f.distribution)} {literal(f.path)}", soft_wrap=True)
        hint = RECORD_MAY_BE_WRONG_HINT.format(name=f.distribution)
        detail = f.detail.removesuffix(f": {hint}") if f.detail.endswith(f"{UNTOUCHED}: {hint}") else f.detail
        if detail != f.detail and f.distribution not in hinted:
            hinted.append(f.distribution)
        if detail:
            out.print(f"    {literal(detail)}", soft_wrap=True)
    return hinted


def _record_hint(err: Console, names: Sequence[str]) -> None:
    """The hint of files not changed since their install (:data:`UNTOUCHED`), once for them all."""
    if names:
        name = names[0] if len(names) == 1 else "NAME"
        err.print(
            f"[dim]hint:[/] {UNTOUCHED} ({literal(', '.join(names))}): "
            f"{literal(RECORD_MAY_BE_WRONG_HINT.format(name=name))}",
            soft_wrap=True,
        )


def _example(findings: Sequence[Finding]) -> str:
    return literal(findings[0].path) + (f" and {len(findings) - 1} more" if len(findings) > 1 else "")


def _warning_summaries(err: Console, findings: Sequence[Finding], more: str) -> None:
    """One line per kind of warning (per pair of distributions for shared files), with a count and an
    example; ``more`` says where the whole list is."""
    hardlinked = [f for f in findings if f.kind == FindingKind.HARDLINKED]
    if hardlinked:
        names = sorted({f.distribution for f in hardlinked})
        whose, how = (
            (
                literal(names[0]),
                f"with safeinstall {literal(names[0])} (once its run's cache is gone the files "
                "share no inode), or uv's --link-mode copy",
            )
            if len(names) == 1
            else (f"{len(names)} distributions", "with uv's --link-mode copy, or each with safeinstall NAME")
        )
        err.print(
            f"[yellow]warning:[/] {counted(sum(f.files for f in hardlinked), 'installed file')} of {whose} "
            f"share their inode with another file ({SHARED_WITH}; e.g. {literal(hardlinked[0].path)}); "
            "editing one in place also edits the other, and a later offline reinstall from uv's cache brings "
            f"the edit back (uv #10579). Reinstall {how}{more}",
            soft_wrap=True,
        )
    for name, lying in _by_distribution(findings, FindingKind.WHEEL_RECORD):
        err.print(
            f"[yellow]note:[/] {counted(len(lying), 'file')} of {literal(name)} "
            f"{'differs' if len(lying) == 1 else 'differ'} from {_possessive(literal(name))} RECORD but "
            f"{'holds' if len(lying) == 1 else 'hold'} the very bytes safeinstall installed and verified "
            f"against its wheel (e.g. {_example(lying)}): the wheel's own RECORD is wrong; "
            f"{FindingKind.WHEEL_RECORD.value}, not drift{more}",
            soft_wrap=True,
        )
    for name, known in _by_distribution(findings, FindingKind.WHEEL_FAULT):
        err.print(
            f"[yellow]note:[/] {counted(len(known), 'file')} of {literal(name)} "
            f"{'differs' if len(known) == 1 else 'differ'} from {_possessive(literal(name))} RECORD as "
            f"when root acknowledged the wheel's fault (e.g. {_example(known)}): "
            f"{FindingKind.WHEEL_FAULT.value}, acknowledged{more}",
            soft_wrap=True,
        )
    intact = _by_distribution(findings, FindingKind.DPKG_INTACT)
    for name, same in intact:
        err.print(
            f"[yellow]note:[/] {counted(len(same), 'file')} of {literal(name)} "
            f"{'differs' if len(same) == 1 else 'differ'} from its RECORD but dpkg's own md5sums say "
            f"{'it is' if len(same) == 1 else 'they are'} as the system package shipped "
            f"{'it' if len(same) == 1 else 'them'} (e.g. {_example(same)})"
            f"{more}",
            soft_wrap=True,
        )
    if intact:  # the hint once, however many files and packages
        err.print(
            f"[dim]hint:[/] {FindingKind.DPKG_INTACT.value}: the distribution changed them after writing "
            "RECORD (Debian strips its libraries); not drift: debsums PACKAGE (or dpkg --verify PACKAGE) "
            "checks them against the package",
            soft_wrap=True,
        )
    pairs: dict[tuple[str, str], list[Finding]] = defaultdict(list)
    for f in findings:
        if f.kind == FindingKind.SHARED:
            pairs[(f.distribution, f.shared_with or "?")].append(f)
    for (name, other), shared in sorted(pairs.items()):
        err.print(
            f"[yellow]note:[/] {counted(len(shared), 'file')} of {literal(name)} "
            f"{'holds' if len(shared) == 1 else 'hold'} {_possessive(literal(other))} copy "
            f"(both RECORDs list them; {literal(other)} was installed over them; e.g. {_example(shared)}): "
            f"{FindingKind.SHARED.value}, not drift; reinstalling {literal(name)} alone would put its own "
            f"copies back over {_possessive(literal(other))}{more}",
            soft_wrap=True,
        )


def _by_distribution(findings: Sequence[Finding], kind: FindingKind) -> list[tuple[str, list[Finding]]]:
    """Pure: the findings of ``kind``, by distribution (sorted by name)."""
    found: dict[str, list[Finding]] = defaultdict(list)
    for f in findings:
        if f.kind == kind:
            found[f.distribution].append(f)
    return sorted(found.items())


def _possessive(name: str) -> str:
    """Pure: "sipure's", "requests'" (not "requests's")."""
    return f"{name}'" if name.endswith("s") else f"{name}'s"


def counted(number: int, what: str) -> str:
    """Pure: "1 file", "2 files"."""
    return f"{number} {what}" + ("" if number == 1 else "s")


def render_verify(
    out: Console, err: Console, report: VerifyReport, diffs: list[FileDiff] | None, verbosity: int = 0
) -> None:
    """The drift, each finding on its lines; warnings summarised (one line per kind, with ``-v`` each
    finding); a line per distribution checked (with ``--all`` and without ``-v``: those with drift and
    one line for the rest). ``verbosity``: -1 ``-q`` (no warnings), 0, 1 ``-v``."""
    if report.wheel is not None and not report.wheel.record_ok and verbosity >= 0:
        err.print(
            f"[yellow]warning:[/] the wheel {literal(str(report.wheel.path))} has a RECORD that does not "
            f"match its own contents ({len(report.wheel.problems)} problems); that is the wheel's fault, "
            "not drift: installed files were compared with the wheel's actual contents",
            soft_wrap=True,
        )
    drift = [f for f in report.findings if f.is_drift or f.is_wheel_fault]  # each said on its lines
    _record_hint(err, _finding_lines(out, drift))
    warnings = [  # the wheel's own problems are the line above; the baseline's are summarised below
        f
        for f in report.findings
        if not f.is_drift
        and not f.is_wheel_fault
        and (f.kind != FindingKind.WHEEL_RECORD or f.baseline == "run")
    ]
    if verbosity > 0:
        _finding_lines(err, per_file(warnings))
    elif verbosity == 0:
        _warning_summaries(err, warnings, " (-v lists them; --json has all)")
    for d in diffs or []:
        if d.text:
            out.print(literal(d.text, lines=True), end="", soft_wrap=True)
        else:
            err.print(f"[dim]no diff for {literal(d.path)}: {literal(d.reason)}[/]")
    if report.egg_info:
        err.print(
            f"[dim]note:[/] {len(report.egg_info)} .egg-info distribution(s) have no RECORD and were not "
            f"checked (e.g. {literal(report.egg_info[0])}); a system package's are its package manager's "
            "to check (debsums)",
            soft_wrap=True,
        )
    several = len(report.site_dirs) > 1  # a system interpreter, or a venv with its base's: say where
    many = len(report.distributions) > 1 and verbosity <= 0
    for dist in report.distributions:
        kinds = Counter(f.kind.value for f in dist.findings if f.is_drift or f.is_wheel_fault)
        if many and not kinds:
            continue
        state = (
            ("[red]DRIFT[/] " if dist.drift else "[yellow]WHEEL FAULT[/] ")
            + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
            if kinds
            else "[green]OK[/]"
            if dist.files_checked
            else "[yellow]nothing checked[/]"
        )
        against = "RECORD" if dist.against == "record" else dist.against
        where = (
            f" in {literal(dist.site)}{' (the base installation)' if dist.from_base else ''}"
            if several
            else ""
        )
        owner = dist.system_package
        system = (
            ""
            if owner is None
            else f" ({literal(owner.manager)} package {literal(owner.package)}: {literal(owner.check)} "
            "checks it)"
        )
        out.print(
            f"{literal(dist.name)} {literal(dist.version)}{where}{system}: {dist.files_checked} files "
            f"checked against {literal(against)}: {state}",
            soft_wrap=True,
        )
    if many:
        drifted = sum(1 for d in report.distributions if d.drift)
        faulty = sum(1 for d in report.distributions if not d.drift and d.wheel_fault)
        files = sum(d.files_checked for d in report.distributions)
        said = [f"[red]{drifted} with drift[/]"] if drifted else []
        said += [f"[yellow]{faulty} with the wheel's fault[/]"] if faulty else []
        state = f"{', '.join(said)}, the others OK" if said else "[green]OK[/]"
        out.print(
            f"{len(report.distributions)} distributions, {files} files checked against their RECORD: {state}"
        )


def _seconds(value: float) -> str:
    return "infinity" if value == float("inf") else f"{value:g} s"


def grouped_details(processes: Sequence[PlannedProcess]) -> list[tuple[tuple[int, ...], str]]:
    """Pure: each piece of evidence of the processes once, with every PID it is said of (in the order
    first seen): every process of a system interpreter says "runs the environment's interpreter", in
    one line, not one line each."""
    groups: dict[str, list[int]] = {}
    for process in processes:
        for detail in process.details:
            groups.setdefault(detail, []).append(process.pid)
    return [(tuple(pids), detail) for detail, pids in groups.items()]


def _pids(pids: Sequence[int], shown: int = 10) -> str:
    """Pure: "PID 12", or "PIDs 12, 13, ... (25)" (the table above lists each one)."""
    if len(pids) == 1:
        return f"PID {pids[0]}"
    more = ", …" if len(pids) > shown else ""
    return f"PIDs {', '.join(map(str, pids[:shown]))}{more} ({len(pids)})"


def _scan_problems(err: Console, problems: Sequence[ScanProblem], verbosity: int) -> None:
    """What the scan could not read, each problem, with ``-v``: the plan's warnings already say once
    which processes denied access or mapped too much (a process that vanished meanwhile is no matter)."""
    if verbosity <= 0:
        return
    for problem in problems:
        err.print(
            f"[dim]note: PID {problem.pid}: could not read {literal(problem.reading)}: "
            f"{literal(problem.reason)}[/]",
            soft_wrap=True,
        )


def render_plan(out: Console, err: Console, plan: Plan, verbosity: int = 0, dry_run: bool = False) -> None:
    """The plan at a glance: one row per process (its strongest evidence, as one reason) and per unit;
    every piece of evidence with ``-v`` (and in ``--json``). Tables take the terminal's width and are not
    padded on a pipe; a path or command too long for its column ends in an ellipsis, never broken."""
    out.print(
        f"[bold]plan[/] for {literal(plan.package)} in {literal(plan.prefix)} "
        f"(python {literal(plan.python)})",
        soft_wrap=True,
    )
    out.print("distributions:" + ("  (--with-deps: dependencies reinstalled too)" if plan.with_deps else ""))
    shown, folded = folded_distributions(plan.distributions, verbosity)
    for dist in shown:
        mark = "".join(f" ({m})" for m in ("named" if dist.requested else "", dist.change) if m)
        versions = f"{dist.old_version or '(not installed)'} -> {dist.new_version or '?'}"
        out.print(f"  {literal(dist.name)} {literal(versions)}{mark}", soft_wrap=True)
    for line in folded:
        for wrapped in wrap_words(line, out.width, 2):
            out.print(literal(wrapped), soft_wrap=True)
    if plan.processes:
        more = "" if verbosity > 0 else " (-v: every piece of evidence)"
        rows: list[tuple[str, ...]] = []
        listed, helpers = folded_helpers(plan.processes, verbosity)
        for p in listed:
            kind = p.evidence[0] if len(p.evidence) == 1 else _strongest_kind(p.evidence)
            old = " running old code" if p.running_old_code else ""
            command = " ".join(w for w in " ".join(p.cmdline).split(" ") if w) or p.name  # setproctitle pads
            command += "".join(f" (+ PID {pid}: {what})" for pid, what in helpers.get(p.pid, ()))
            rows.append(
                (
                    str(p.pid),
                    p.unit or f"stray ({p.scope or 'no unit'})",
                    f"{kind} ({p.strength}){old}",
                    human_bytes(p.gpu_bytes),
                    p.reason or "; ".join(p.details[:1]),
                    command if command.startswith(p.name) else f"{p.name}: {command}",
                )
            )
        header: tuple[str, ...] = ("PID", "UNIT", "EVIDENCE", "GPU MEM", "WHY", "COMMAND")
        if all(p.gpu_bytes is None for p in plan.processes):  # no GPU memory listed: no column for it
            header, rows = header[:3] + header[4:], [row[:3] + row[4:] for row in rows]
        out.print(f"processes using them{more}")
        for line in stacked_table(header, rows, out.width):  # a stray's whole command is in its row
            out.print(literal(line), soft_wrap=True)
        if verbosity > 0:  # each piece of evidence once, with every PID it is said of
            for pids, detail in grouped_details(plan.processes):
                out.print(f"  {_pids(pids)}: {literal(detail)}", soft_wrap=True)
    else:
        out.print("processes using them: none")
    if plan.units:
        out.print("units that would be stopped")
        unit_rows = [
            (
                u.name,
                u.active_state,
                u.unit_file_state or "-",
                _seconds(u.stop_timeout_s),
                str(u.main_pid or "-"),
                " ".join(map(str, u.pids)) or (f"(stops with {u.stopped_with})" if u.stopped_with else ""),
            )
            for u in plan.units
        ]
        header = ("UNIT", "STATE", "ENABLED", "STOP TIMEOUT", "MAIN PID", "PIDS")
        for line in stacked_table(header, unit_rows, out.width):
            out.print(literal(line), soft_wrap=True)
    for reset in plan.start_limit_resets:
        out.print(
            f"start limit of {literal(reset.unit)}: {literal(reset.reason)}; the run resets it before "
            "the stop (systemctl reset-failed)",
            soft_wrap=True,
        )
    if plan.gpus.available:
        out.print("GPUs")
        gpu_rows = [
            (
                str(gpu.index),
                gpu.name,
                human_bytes(gpu.used_bytes),
                human_bytes(gpu.total_bytes),
                gpu.uuid,
                " ".join(f"{p.pid}:{human_bytes(p.used_bytes)}" for p in gpu.processes)
                or gpu.processes_error
                or "-",
            )
            for gpu in plan.gpus.gpus
        ]
        for line in stacked_table(("GPU", "NAME", "USED", "TOTAL", "UUID", "PROCESSES"), gpu_rows, out.width):
            out.print(literal(line), soft_wrap=True)
    else:  # why: in the warning below (said once), unless -q leaves that out
        why = "" if verbosity >= 0 and plan.gpus.reason else f" ({literal(plan.gpus.reason or '')})"
        out.print(f"GPUs: check unavailable{why}", soft_wrap=True)
    if plan.install:  # what will run: the staging install and the swap, the install in the stop, a restore
        lines = plan.install if verbosity > 0 else tuple(compact_install(line, plan) for line in plan.install)
        out.print("uv command:" + ("" if lines == plan.install else " (-v: in full)"))
        for wrapped in (part for line in lines for part in wrap_words(line, out.width, 2)):
            out.print(literal(wrapped), soft_wrap=True)
    else:
        out.print("uv command: " + literal(" ".join(plan.uv_command)), soft_wrap=True)
    if plan.smoke:
        said = plan.smoke if verbosity > 0 else compact_smoke(plan.smoke, plan.package)
        label = "smoke check (a run's; --dry-run imports nothing): " if dry_run else "smoke check: "
        for wrapped in wrap_words(label + said, out.width):
            out.print(literal(wrapped), soft_wrap=True)
    _scan_problems(err, plan.scan_problems, verbosity)
    for warning in plan.warnings:
        if verbosity < 0 and warning in plan.host_notes:  # the same on every command of this host
            continue
        err.print(f"[yellow]warning:[/] {literal(warning)}", soft_wrap=True)
    if plan.proceeds:
        out.print("[green]the run would proceed[/]")
    else:
        out.print("[red]the run would refuse:[/]")
        for refusal in plan.refusals:
            out.print(f"  - {literal(refusal)}", soft_wrap=True)


#: More distributions than this and the plan (without -v) names the others on a few lines, not one each
DISTRIBUTIONS_SHOWN = 5


def folded_distributions(
    dists: Sequence[AffectedDistribution], verbosity: int
) -> tuple[list[AffectedDistribution], list[str]]:
    """Pure: the distributions shown one per line (all of them with ``-v`` or when few; else the named
    ones), and a line per kind of change for the others: "9 more, each a downgrade: torch, triton, …"."""
    if verbosity > 0 or len(dists) <= DISTRIBUTIONS_SHOWN:
        return list(dists), []
    shown = [d for d in dists if d.requested]
    kinds: dict[str, list[str]] = {}
    for dist in dists:
        if not dist.requested:
            kinds.setdefault(dist.change, []).append(dist.name)
    folded = [
        f"{len(names)} more, {'each a ' + kind if kind else 'their versions'} (-v: each): {', '.join(names)}"
        for kind, names in kinds.items()
    ]
    return shown, folded


#: multiprocessing's helper processes, named in their unit's row rather than a row of their own
_HELPERS = (
    ("multiprocessing.resource_tracker", "multiprocessing's resource_tracker"),
    ("multiprocessing.forkserver", "multiprocessing's forkserver"),
)


def folded_helpers(
    processes: Sequence[PlannedProcess], verbosity: int
) -> tuple[list[PlannedProcess], dict[int, list[tuple[int, str]]]]:
    """Pure: the processes that get a row, and for the first row of each unit the helpers of that unit
    folded into it (a multiprocessing resource_tracker: a row of its own says nothing more). With
    ``-v``, every process has its row."""
    first: dict[str, int] = {}
    for p in processes:
        if p.unit and not _helper(p):
            first.setdefault(p.unit, p.pid)
    listed: list[PlannedProcess] = []
    helpers: dict[int, list[tuple[int, str]]] = {}
    for p in processes:
        what = _helper(p)
        if verbosity <= 0 and what and p.unit in first:
            helpers.setdefault(first[p.unit], []).append((p.pid, what))
        else:
            listed.append(p)
    return listed, helpers


def _helper(process: PlannedProcess) -> str:
    command = " ".join(process.cmdline)
    return next((what for mark, what in _HELPERS if mark in command), "")


def compact_install(line: str, plan: Plan) -> str:
    """Pure: one line of the plan's uv command without ``-v``: the versions pinned for the distributions
    listed above said as their count (``--json`` and ``-v`` have each)."""
    pins = {f"{d.name}=={d.new_version}" for d in plan.distributions if d.new_version}
    words = line.split(" ")
    kept = [w for w in words if w not in pins]
    dropped = len(words) - len(kept)
    return " ".join(kept) + (f" and the {dropped} other versions above" if dropped > 1 else "")


def compact_smoke(said: str, package: str) -> str:
    """Pure: the smoke check said in fewer words without ``-v`` (whom it runs as, for which units)."""
    return said.replace("root (the unit has no User=: it runs as root too)", "root (no User=)").replace(
        f"import {package}'s top-level modules and the changed distributions' extension modules from the "
        "new version",
        f"import the new {package} and its changed extension modules",
    )


def wrap_words(text: str, width: int, indent: int = 0, hang: int = 2) -> list[str]:
    """Pure: ``text`` in lines of at most ``width`` characters, broken only between words: the first
    line indented by ``indent``, the others by ``indent + hang``. A word longer than a line is never
    cut: it stands whole on a line of its own (the terminal folds it, the text keeps it)."""
    lines: list[str] = []
    line = ""
    for word in text.split():
        if line and len(line) + 1 + len(word) <= width:
            line += " " + word
            continue
        if line:
            lines.append(line)
        line = " " * (indent + (hang if lines else 0)) + word
    return [*lines, line] if line else lines


def stacked_table(
    header: Sequence[str], rows: Sequence[Sequence[str]], width: int, indent: int = 0
) -> list[str]:
    """Pure: a table as lines of at most ``width`` characters, no cell cut: the leading columns that fit
    side by side, each later one below its row as "name: value", wrapped between words. Cells are
    :func:`printable`; no trailing spaces."""
    table = [[printable(" ".join(cell.split("\n"))) for cell in row] for row in (header, *rows)]
    shown = len(header)
    while shown > 1:
        widths = [max(len(row[i]) for row in table) for i in range(shown)]
        if indent + sum(widths) + 2 * (shown - 1) <= width:
            break
        shown -= 1
    widths = [max(len(row[i]) for row in table) for i in range(shown)]
    lines: list[str] = []
    for number, row in enumerate(table):
        cells = "  ".join(cell.ljust(w) for cell, w in zip(row[:shown], widths, strict=True))
        lines.append((" " * indent + cells).rstrip())
        for name, cell in zip(table[0][shown:], row[shown:], strict=True):
            if number and cell:
                lines.extend(wrap_words(f"{name.lower()}: {cell}", width, indent + 4))
    return lines


#: The evidence kinds of the plan, strongest first (``unit`` and ``environment`` last).
_KIND_ORDER = ("mapped", "open", "argv", "depends", "unit", "environment")


def _strongest_kind(kinds: Sequence[str]) -> str:
    return min(kinds, key=lambda k: _KIND_ORDER.index(k) if k in _KIND_ORDER else len(_KIND_ORDER))


_STEP_MARK = {"ok": ("ok", "green"), "failed": ("FAILED", "bold red"), "skipped": ("skipped", "yellow")}
#: the step table's columns: the longest step name (verify-in-place) and status (skipped)
_STEP_NAME, _STEP_STATUS = 15, 7


def step_lines(name: str, status: str, seconds: float, detail: str, width: int) -> list[str]:
    """Pure: one row of the run's step table as markup lines, aligned whatever the status's colour (the
    padding is counted on the text, not on its markup); the detail wrapped between words in its column
    (a word longer than the column stands whole on a line of its own)."""
    label, style = _STEP_MARK.get(status, (status, ""))
    mark = f"[{style}]{literal(label)}[/]" if style else literal(label)
    pad = " " * max(_STEP_STATUS - len(label), 0)
    step = printable(name).ljust(_STEP_NAME)
    head = f"{step} {label}{pad} {seconds:6.1f} s  "
    column = max(width - len(head), 20)
    # a detail of several lines (uv's error, a failed import's stderr): each line wrapped in the column
    paragraphs = printable(detail, lines=True).expandtabs(2).split("\n")
    first, *rest = [line for text in paragraphs for line in wrap_words(text, column)] or [""]
    return [
        f"{literal(step)} {mark}{pad} {seconds:6.1f} s  {literal(first)}".rstrip(),
        *(" " * len(head) + literal(line) for line in rest),
    ]


@contextlib.contextmanager
def _output_best_effort() -> Iterator[None]:
    """Drop an OSError of the output (a terminal that went away: EIO; a closed pipe), but never what it
    hid: a SIGINT/SIGTERM/SIGHUP handler that raised while rich was writing is followed, as rich
    flushes on the way out, by the dead terminal's OSError, and the interruption must not be lost."""
    handling = sys.exc_info()[1]  # an error being handled already (a rollback's) was not hidden here
    try:
        yield
    except OSError as exc:
        hidden = exc.__context__
        while (
            hidden is not None
            and hidden is not handling
            and not isinstance(hidden, SafeInstallError | KeyboardInterrupt)
        ):
            hidden = hidden.__context__
        if hidden is not None and hidden is not handling:
            raise hidden from None


class ConsoleReporter:
    """Step lines on stdout; a rich progress display for slow steps and notes on stderr; asks before
    stopping anything."""

    def __init__(
        self,
        out: Console,
        err: Console,
        quiet: bool = False,
        verbosity: int = 0,
        settle: Callable[[], None] | None = None,
    ) -> None:
        self.out = out
        self.err = err
        self.settle = settle or (lambda: None)  # ends what was shown while nothing else was (a spinner)
        self.quiet = quiet
        self.verbosity = verbosity
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._last_line = time.monotonic()
        self._last_key = ""

    # Output is best effort: a terminal that went away (a dropped SSH session: EIO) or a closed pipe
    # must never interrupt a run, least of all its rollback. The run's log keeps everything.

    def step(self, outcome: StepDoc) -> None:
        self.settle()
        with _output_best_effort():
            self._end_progress()
            self._last_key = ""  # the next step's first progress line is a change
            if self.quiet:
                return
            for line in step_lines(
                outcome.name, outcome.status, outcome.seconds, outcome.detail, self.out.width
            ):
                self.out.print(line, soft_wrap=True)

    def progress(self, what: str, done: float | None, total: float | None, unit: str = "") -> None:
        """Slow work (the backup's bytes, the GPU wait's seconds): a transient bar on a terminal; off a
        terminal (logs, scripts) a plain line every few seconds, in human units."""
        self.settle()
        with _output_best_effort():
            self._show_progress(what, done, total, unit)

    def _show_progress(self, what: str, done: float | None, total: float | None, unit: str) -> None:
        if self.quiet:
            return
        key = progress_key(what)
        if not self.err.is_terminal:  # a line per change (a size's once it lasts), then a heartbeat
            now = time.monotonic()
            if key != self._last_key:
                self._last_line, self._last_key = said_at_change(unit, now), key
            if now - self._last_line >= PROGRESS_EVERY_S:
                self._last_line = now
                self.err.print(literal(progress_text(what, done, total, unit)), soft_wrap=True)
            return
        # the whole line, amounts included ("... (1 of 2): 12 s of 90 s (13%)"), wrapped between words in
        # a column of its own: never cut at the terminal's width, the bar beside it
        said = literal(progress_text(what, done, total, unit))
        if self._progress is None:
            from rich.progress import BarColumn, Progress, TextColumn
            from rich.table import Column

            self._progress = Progress(
                TextColumn("{task.description}", table_column=Column(ratio=1, no_wrap=False)),
                BarColumn(bar_width=16),
                console=self.err,
                transient=True,
                expand=True,
            )
            self._progress.start()
        if key not in self._tasks:
            self._tasks[key] = self._progress.add_task(said, total=total)
        self._progress.update(self._tasks[key], description=said, completed=done or 0, total=total)

    def _end_progress(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
            self._tasks.clear()

    def note(self, text: str, host: bool = False) -> None:
        """``host``: about the host, not this run (no NVML, a process even root cannot read): the same on
        every command of that machine, so ``-q`` leaves it out (the log and ``--json`` keep it)."""
        self.settle()
        if host and self.verbosity < 0:
            return
        with _output_best_effort():
            self.err.print(f"[yellow]note:[/] {literal(text, lines=True)}", soft_wrap=True)

    def confirm(self, plan: Plan, patches: Sequence[PatchOutcome] | None = None) -> bool:
        self.settle()
        render_plan(self.out, self.err, plan, self.verbosity)
        question = "stop these units and reinstall" if plan.units else "reinstall (no unit to stop)"
        if patches is not None:  # the merge was made before the question: it holds, as listed
            from safeinstall.run.parts.output import patch_docs

            render_patches(self.out, patch_docs(patches), when="plan")
            carried = sum(1 for p in patches if p.status.value == "carried")
            dropped = len(patches) - carried
            merge = " (it merges)" if carried == 1 else " (they merge)" if carried else ""
            question += f", carrying {carried} local patch{'' if carried == 1 else 'es'}{merge}"
            if dropped:
                question += f" and dropping {dropped} (--drop-conflicting)"
        answer = self.err.input(f"{question}? \\[y/N] ")
        return answer.strip().lower() in ("y", "yes")


def _old_code_line(process: OldCodeDoc) -> str:
    """One process left on old code, as the run's document has it (``OldCodeProcess``)."""
    where = f"unit {process.unit}" if process.unit else f"no unit ({process.scope or 'no scope'})"
    names = ", ".join(process.distributions)
    paths = ", ".join(process.paths[:3])
    who = f"PID {process.pid} ({process.name}, {where})"
    return f"{who} still maps replaced files of {names} ({paths})"


def render_run(out: Console, err: Console, document: RunDocument, run_id: str) -> None:
    """A run's result from its ``--json`` document: the one renderer of the foreground run and of
    ``--status --wait`` (which reads the document from the run's history entry)."""
    data = document.details
    for note in data.notes:
        err.print(f"[dim]note:[/] {literal(note, lines=True)}", soft_wrap=True)
    status = document.status
    if status == "declined":
        out.print("nothing done (not confirmed)")
        return
    changes = ", ".join(f"{d.name} {d.old_version} -> {d.new_version or '?'}" for d in data.changes)
    if status == "done" and data.plan is not None:
        service = data.service_downtime_s
        users = f"; service down {service:.1f} s until healthy" if service is not None else ""
        out.print(f"[green]done:[/] {literal(changes)}; installed and verified{users}", soft_wrap=True)
    if status == "prepared" and data.plan is not None:  # docs/prepare.md
        checked = ", ".join(s.name for s in data.steps if s.status == "ok" and s.name != "preflight")
        out.print(
            f"[cyan]prepared:[/] {literal(changes)}; {literal(checked)} done, nothing stopped; "
            "safeinstall --commit goes on from the stop (see the note)",
            soft_wrap=True,
        )
    for unit, seconds in sorted(data.downtime_s.items()):
        out.print(f"  {literal(unit)} was down for {seconds:.1f} s")
    for unit in data.not_restarted:
        out.print(f"  [yellow]{literal(unit)} left stopped (--no-restart)[/]")
    for pid in data.strays_killed:
        out.print(f"  stray PID {literal(pid)} was ended and not restarted")
    for process in data.old_code:
        err.print(
            f"[yellow]warning:[/] {literal(_old_code_line(process))}: it runs old code; restart it",
            soft_wrap=True,
        )
    unchanged = document.exit_code == ExitCode.REFUSED  # stopped before anything was replaced
    render_patches(out, data.patches, data.patch_file, "unchanged" if unchanged else "done")
    backup_dir, log_file = data.backup_dir, data.log_file
    deleted = set(data.deleted)
    patched = [path for path in data.patched if path not in deleted]
    listed = {p.path for p in data.patches}  # said once: those --keep-patches listed above
    kept = f"copies kept in {literal(backup_dir)}" if backup_dir else "left as they are: nothing was replaced"
    if patched and set(patched) <= listed:
        out.print(f"the locally patched files above: {kept}", soft_wrap=True)
    elif patched:
        out.print(f"locally patched files ({kept}):", soft_wrap=True)
        for path in patched:
            out.print(f"  {literal(path)}", soft_wrap=True)
    if deleted:
        out.print("files deleted locally (nothing of them to keep):")
        for path in sorted(deleted):
            out.print(f"  {literal(path)}", soft_wrap=True)
    pruned = set(data.pruned)
    for path in data.extras:
        state = "pruned (copy kept in the backup)" if path in pruned else "left in place (--prune removes)"
        out.print(f"  leftover {literal(path)}: {state}", soft_wrap=True)
    if backup_dir:
        err.print(
            f"[dim]run {literal(run_id)}; backup: {literal(backup_dir)}; log: {literal(str(log_file))}[/]",
            soft_wrap=True,
        )
    removed = data.backups_removed
    if removed:
        err.print(f"[dim]deleted {counted(len(removed), 'older backup')} (--keep-backups)[/]")
    for error in document.errors:
        render_error(err, error)


def render_patches(
    out: Console, patches: Sequence[PatchDoc], patch_file: str | None = None, when: str = "done"
) -> None:
    """--keep-patches: what was carried, what was dropped, and where each conflict is (as a diff).
    ``when``: ``plan`` (the merge made before the run: a dry run, the question), ``done`` (a run),
    ``unchanged`` (a run that stopped before anything was replaced)."""
    carried = {
        "plan": "local patches that merge into the new version (the run carries them):",
        "done": "local patches carried to the new version:",
        "unchanged": "local patches merged but not carried (the run stopped before the install; the "
        "installed files keep them):",
    }[when]
    dropped = "they are left as they are" if when == "unchanged" else "the backup keeps them"
    heading = {
        "carried": carried,
        "dropped": f"local patches dropped (--drop-conflicting; {dropped}):",
        "conflict": "local patches that cannot be carried:",
        "rolled-back": "local patches not carried (the run rolled back; the installed files keep them):",
    }
    for status, title in heading.items():
        found = [p for p in patches if p.status == status]
        if not found:
            continue
        out.print(title)
        for patch in found:
            out.print(
                f"  {status} {literal(patch.path)}: {literal(patch.detail, lines=True)}", soft_wrap=True
            )
            if status in ("dropped", "conflict") and patch.diff:
                out.print(literal(patch.diff, lines=True), end="", soft_wrap=True)
    if patch_file:
        out.print(f"carried patch set saved as {literal(patch_file)}", soft_wrap=True)


def render_recoveries(out: Console, recoveries: list[Recovery], failed: bool = False) -> None:
    """What ``--recover`` did, on stdout; ``failed``: it could not recover an environment (said on
    stderr), so "nothing to recover" is not said."""
    for r in recoveries:  # a live run's environment: said, not recovered
        if r.busy:
            out.print(literal(f"not recovered: {r.prefix}: " + "; ".join(r.notes)))
    if not any(r.run_id for r in recoveries):
        if not failed:
            out.print("nothing to recover")
        return
    for r in recoveries:
        if r.run_id is None:
            continue
        did = ["restored the previous installation" if r.restored else "the installed package was consistent"]
        if r.started:
            did.append("started " + ", ".join(r.started))
        if r.gates_removed:
            did.append(f"removed {len(r.gates_removed)} boot gate(s)")
        out.print(
            literal(f"recovered run {r.run_id} in {r.prefix} (died in phase {r.phase}): " + "; ".join(did))
        )
        for note in r.notes:
            out.print(f"  note: {literal(note)}")


def _when(iso: str | None) -> str:
    from safeinstall.run.commands.view import display_time

    return display_time(iso) if iso else "-"


def _runs_rows(runs: tuple[RunSummary, ...]) -> list[tuple[str, ...]]:
    """The finished runs as rows, without their log files (each printed whole, on a line of its own, by
    :func:`render_status`)."""
    rows: list[tuple[str, ...]] = []
    for r in runs:
        versions = (
            f"{r.old_version or '?'} -> {r.new_version or '?'}" if r.old_version or r.new_version else "-"
        )
        downtime = ", ".join(f"{u} {s:.1f} s" for u, s in sorted(r.downtime_s.items())) or "-"
        if r.service_downtime_s is not None:  # what users saw: the stop -> the health URL's 200
            downtime += f"; service {r.service_downtime_s:.1f} s"
        rows.append(
            (
                r.run_id,
                r.status,
                str(r.exit_code),
                r.package or "-",
                versions,
                _when(r.started_at),
                _when(r.finished_at),
                downtime,
                "yes" if r.can_undo else "-",  # why not: --status --json (cannot_undo)
            )
        )
    return rows


_RUNS_HEADER = ("RUN", "STATUS", "EXIT", "PACKAGE", "VERSION", "STARTED", "FINISHED", "DOWNTIME", "UNDO")


def render_status(out: Console, found: list[EnvironmentStatus], last: int = 5) -> None:
    """Each environment: its prefix and state on one line, then its last runs (``last``; 0: all, and
    how many are left out is said); paths (the prefix, the logs) are printed whole on lines of their
    own, never folded in the middle."""
    if not found:
        out.print("no safeinstall state: no run in progress, nothing to recover")
        return
    for number, s in enumerate(found):
        if s.running and s.holder is not None:
            state = f"[yellow]running[/] (PID {s.holder.pid}, since {literal(s.holder.started_display)})"
            if s.run_id:
                state += f" run {literal(s.run_id)}"
        elif s.needs_recovery:
            state = "[red]needs recovery[/]: run safeinstall --recover"
        elif s.prepared is not None:
            p = s.prepared
            state = (
                f"[cyan]prepared[/] run {literal(p.run_id)}, {p.age_s:.0f} s ago: "
                + literal(f"will change {'; '.join(p.changes) or 'nothing'}")
                + literal(f", restart {' '.join(p.units) or 'no unit'}")
                + f" ({'a swap' if p.staged else 'uv in the window'}); safeinstall --commit or --discard"
            )
        elif s.journal_phase == "prepared":  # its record could not be read (the journal says it waits)
            state = "[cyan]prepared[/], its record unreadable: safeinstall --discard drops it"
        else:
            state = "[green]idle[/]"
        if s.prefix_exists is False:
            state += " [dim](environment gone: safeinstall --forget removes its state)[/]"
        out.print(("\n" if number else "") + f"environment {literal(s.prefix)}: {state}", soft_wrap=True)
        if s.package or s.journal_phase or s.units:
            out.print(
                f"  package {literal(s.package or '-')}; phase {literal(s.journal_phase or '-')}; "
                f"units {literal(' '.join(s.units) or '-')}",
                soft_wrap=True,
            )
        shown = s.runs if last <= 0 else s.runs[:last]
        if shown:
            more = (
                f" ({len(shown)} of {len(s.runs)}; -v lists all, --json too)"
                if len(shown) < len(s.runs)
                else ""
            )
            out.print(f"  last runs{more}:")
            for line in stacked_table(_RUNS_HEADER, _runs_rows(shown), out.width, indent=2):
                out.print(literal(line), soft_wrap=True)
            for r in shown:
                out.print(f"  log of {literal(r.run_id)}: {literal(r.log_file or '-')}", soft_wrap=True)
        for problem in s.history_problems:
            out.print(f"[yellow]note:[/] {literal(problem)}", soft_wrap=True)


def render_entry(out: Console, err: Console, entry: HistoryEntry) -> None:
    """A finished run's result as its history keeps it (``--status --wait``, a refused ``--detach``): a
    headline naming the run, then what the foreground run showed (:func:`render_run`)."""
    from safeinstall.run.commands.view import run_summary

    run = run_summary(entry)
    style = "green" if run.exit_code == 0 else "red"
    versions = f" {run.old_version} -> {run.new_version}" if run.old_version or run.new_version else ""
    out.print(
        f"run {literal(run.run_id)}: [{style}]{literal(run.status)}[/] (exit {run.exit_code}); "
        + literal(f"{run.package or '?'}{versions}"),
        soft_wrap=True,
    )
    render_run(out, err, entry.result, run.run_id)
    if run.log_file and not entry.result.details.backup_dir:
        err.print(f"[dim]log: {literal(run.log_file)}[/]", soft_wrap=True)


def render_forgotten(out: Console, forgotten: list[Forgotten], failed: bool) -> None:
    """What ``--forget`` removed; "nothing to forget" only when nothing failed (an error says why)."""
    if not forgotten and not failed:
        out.print("nothing to forget: every environment with state still exists")
    for item in forgotten:
        what = item.prefix if item.run_id is None else f"the backup of run {item.run_id} of {item.prefix}"
        out.print(literal(f"forgot {what} (removed {item.state_dir})"), soft_wrap=True)
