"""Human output with rich: tables on stdout, warnings and progress on stderr. No logic lives here."""

from __future__ import annotations

import contextlib
import time
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from safeinstall.drift import Finding, FindingKind
from safeinstall.errors import SafeInstallError

if TYPE_CHECKING:
    from rich.progress import Progress, TaskID

    from safeinstall.diffs import FileDiff
    from safeinstall.plan import Plan
    from safeinstall.recover import EnvironmentStatus, Recovery
    from safeinstall.reinstall import RunResult, StepOutcome
    from safeinstall.verify import VerifyReport

_KIND_STYLE = {
    FindingKind.MISSING: "bold red",
    FindingKind.MODIFIED: "bold yellow",
    FindingKind.EXTRA: "cyan",
    FindingKind.OUTSIDE: "bold magenta",
    FindingKind.UNREADABLE: "red",
    FindingKind.MALFORMED: "magenta",
    FindingKind.VERSION_MISMATCH: "bold red",
}


def make_console(stderr: bool = False) -> Console:
    probe = Console(stderr=stderr)
    return Console(stderr=stderr, width=None if probe.is_terminal else 200, highlight=False)


def render_error(console: Console, error: SafeInstallError) -> None:
    console.print(f"[bold red]error:[/] {error.message}", soft_wrap=True)
    if error.hint:
        console.print(f"[dim]hint:[/] {error.hint}", soft_wrap=True)


def _findings_table(findings: list[Finding]) -> Table:
    table = Table(box=None, pad_edge=False, show_edge=False)
    table.add_column("KIND", no_wrap=True)
    table.add_column("DISTRIBUTION", no_wrap=True)
    table.add_column("PATH", overflow="fold")
    table.add_column("DETAIL", overflow="fold")
    for f in findings:
        style = _KIND_STYLE.get(f.kind, "")
        table.add_row(
            f"[{style}]{f.kind.value}[/]" if style else f.kind.value, f.distribution, f.path, f.detail
        )
    return table


def render_verify(out: Console, err: Console, report: VerifyReport, diffs: list[FileDiff] | None) -> None:
    if report.wheel is not None and not report.wheel.record_ok:
        err.print(
            f"[yellow]warning:[/] the wheel {report.wheel.path} has a RECORD that does not match its own "
            f"contents ({len(report.wheel.problems)} problems); that is the wheel's fault, not drift: "
            "installed files were compared with the wheel's actual contents",
            soft_wrap=True,
        )
    drift = [f for f in report.findings if f.is_drift]
    if drift:
        out.print(_findings_table(drift))
    hardlinked: dict[str, list[Finding]] = defaultdict(list)
    for finding in report.findings:
        if finding.kind == FindingKind.HARDLINKED:
            hardlinked[finding.distribution].append(finding)
    for name, links in hardlinked.items():
        err.print(
            f"[yellow]warning:[/] {name}: {len(links)} installed files share their inode with another "
            f"file (uv's cache, e.g. {links[0].path}); editing them in place also edits the cache, and a "
            "later offline reinstall brings the edit back (uv #10579). Reinstall with --link-mode copy.",
            soft_wrap=True,
        )
    for d in diffs or []:
        if d.text:
            out.print(d.text, end="", markup=False, highlight=False, soft_wrap=True)
        else:
            err.print(f"[dim]no diff for {d.path}: {d.reason}[/]")
    for dist in report.distributions:
        kinds = Counter(f.kind.value for f in dist.findings if f.is_drift)
        state = (
            "[green]OK[/]"
            if not kinds
            else "[red]DRIFT[/] " + ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        )
        against = "RECORD" if dist.against == "record" else dist.against
        out.print(
            f"{dist.name} {dist.version}: {dist.files_checked} files checked against {against}: {state}"
        )


def _bytes(n: int | None) -> str:
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def _seconds(value: float) -> str:
    return "infinity" if value == float("inf") else f"{value:g} s"


def render_plan(out: Console, err: Console, plan: Plan) -> None:
    out.print(f"[bold]plan[/] for {plan.package} in {plan.prefix} (python {plan.python})")
    out.print("distributions:" + ("  (--with-deps: dependencies reinstalled too)" if plan.with_deps else ""))
    for dist in plan.distributions:
        mark = " (named)" if dist.requested else ""
        out.print(f"  {dist.name} {dist.old_version or '(not installed)'} -> {dist.new_version or '?'}{mark}")
    if plan.processes:
        table = Table(title="processes using them", title_justify="left", box=None, pad_edge=False)
        for column in ("PID", "UNIT", "USER", "EVIDENCE", "GPU MEM", "COMMAND"):
            table.add_column(column, overflow="fold")
        for p in plan.processes:
            evidence = ",".join(p.evidence) + (" [red](running old code)[/]" if p.running_old_code else "")
            unit = p.unit or f"[yellow]stray[/] ({p.scope or 'no unit'})"
            command = " ".join(p.cmdline) or p.name
            table.add_row(str(p.pid), unit, p.user, evidence, _bytes(p.gpu_bytes), f"{p.name}: {command}")
        out.print(table)
    else:
        out.print("processes using them: none")
    if plan.units:
        table = Table(title="units that would be stopped", title_justify="left", box=None, pad_edge=False)
        for column in ("UNIT", "STATE", "ENABLED", "STOP TIMEOUT", "MAIN PID", "PIDS"):
            table.add_column(column)
        for u in plan.units:
            table.add_row(
                u.name,
                u.active_state,
                u.unit_file_state or "-",
                _seconds(u.stop_timeout_s),
                str(u.main_pid or "-"),
                " ".join(map(str, u.pids)) or (f"(stops with {u.stopped_with})" if u.stopped_with else ""),
            )
        out.print(table)
    if plan.gpus.available:
        table = Table(title="GPUs", title_justify="left", box=None, pad_edge=False)
        for column in ("GPU", "NAME", "UUID", "USED", "TOTAL", "PROCESSES"):
            table.add_column(column)
        for gpu in plan.gpus.gpus:
            procs = " ".join(f"{p.pid}:{_bytes(p.used_bytes)}" for p in gpu.processes)
            table.add_row(
                str(gpu.index),
                gpu.name,
                gpu.uuid,
                _bytes(gpu.used_bytes),
                _bytes(gpu.total_bytes),
                procs or gpu.processes_error or "-",
            )
        out.print(table)
    else:
        out.print(f"GPUs: check unavailable ({plan.gpus.reason})")
    out.print("uv command: " + " ".join(plan.uv_command), soft_wrap=True)
    for problem in plan.scan_problems:
        err.print(f"[dim]note: PID {problem.pid}: could not read {problem.reading}: {problem.reason}[/]")
    for warning in plan.warnings:
        err.print(f"[yellow]warning:[/] {warning}", soft_wrap=True)
    if plan.proceeds:
        out.print("[green]the run would proceed[/]")
    else:
        out.print("[red]the run would refuse:[/]")
        for refusal in plan.refusals:
            out.print(f"  - {refusal}", soft_wrap=True)


_STEP_MARK = {"ok": "[green]ok[/]", "failed": "[bold red]FAILED[/]", "skipped": "[yellow]skipped[/]"}


@contextlib.contextmanager
def _output_best_effort() -> Iterator[None]:
    """Drop an OSError of the output (a terminal that went away: EIO; a closed pipe), but never what it
    hid: a SIGINT/SIGTERM/SIGHUP handler that raised while rich was writing is followed, as rich
    flushes on the way out, by the dead terminal's OSError, and the interruption must not be lost."""
    try:
        yield
    except OSError as exc:
        hidden = exc.__context__
        while hidden is not None and not isinstance(hidden, SafeInstallError | KeyboardInterrupt):
            hidden = hidden.__context__
        if hidden is not None:
            raise hidden from None


class ConsoleReporter:
    """Step lines on stdout; a rich progress display for slow steps and notes on stderr; asks before
    stopping anything."""

    def __init__(self, out: Console, err: Console, quiet: bool = False) -> None:
        self.out = out
        self.err = err
        self.quiet = quiet
        self._progress: Progress | None = None
        self._tasks: dict[str, TaskID] = {}
        self._last_line = time.monotonic()

    # Output is best effort: a terminal that went away (a dropped SSH session: EIO) or a closed pipe
    # must never interrupt a run, least of all its rollback. The run's log keeps everything.

    def step(self, outcome: StepOutcome) -> None:
        with _output_best_effort():
            self._step(outcome)

    def _step(self, outcome: StepOutcome) -> None:
        self._end_progress()
        if self.quiet:
            return
        mark = _STEP_MARK.get(outcome.status, outcome.status)
        self.out.print(
            f"{outcome.name:<12} {mark:<8} {outcome.seconds:6.1f} s  {outcome.detail}", soft_wrap=True
        )

    def progress(self, what: str, done: float | None, total: float | None) -> None:
        with _output_best_effort():
            self._show_progress(what, done, total)

    def _show_progress(self, what: str, done: float | None, total: float | None) -> None:
        """Slow work (the backup's bytes, the GPU wait's seconds): a transient bar on a terminal."""
        if self.quiet:
            return
        if not self.err.is_terminal:  # logs and scripts: a plain line every few seconds
            now = time.monotonic()
            if now - self._last_line >= 5.0:
                self._last_line = now
                amount = "" if done is None else f" {done:.0f}" + (f"/{total:.0f}" if total else "")
                self.err.print(f"{what}{amount}", soft_wrap=True, highlight=False)
            return
        if self._progress is None:
            from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

            self._progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                TaskProgressColumn(),
                TimeElapsedColumn(),
                console=self.err,
                transient=True,
            )
            self._progress.start()
        key = what.split(" (", 1)[0]
        if key not in self._tasks:
            self._tasks[key] = self._progress.add_task(what, total=total)
        self._progress.update(self._tasks[key], description=what, completed=done or 0, total=total)

    def _end_progress(self) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None
            self._tasks.clear()

    def note(self, text: str) -> None:
        with _output_best_effort():
            self.err.print(f"[yellow]note:[/] {text}", soft_wrap=True)

    def confirm(self, plan: Plan) -> bool:
        render_plan(self.out, self.err, plan)
        answer = self.err.input("stop these units and reinstall? \\[y/N] ")
        return answer.strip().lower() in ("y", "yes")


def render_result(out: Console, err: Console, result: RunResult) -> None:
    for note in result.notes:
        err.print(f"[dim]note:[/] {note}", soft_wrap=True)
    if result.status == "declined":
        out.print("nothing done (not confirmed)")
        return
    plan = result.plan
    if result.status == "done" and plan is not None:
        changes = ", ".join(f"{d.name} {d.old_version} -> {d.new_version or '?'}" for d in plan.distributions)
        out.print(f"[green]done:[/] {changes}; installed and verified", soft_wrap=True)
    for unit, seconds in sorted(result.downtime_s.items()):
        out.print(f"  {unit} was down for {seconds:.1f} s")
    for unit in result.not_restarted:
        out.print(f"  [yellow]{unit} left stopped (--no-restart)[/]")
    for pid in result.strays_killed:
        out.print(f"  stray PID {pid} was ended and not restarted")
    _render_patches(out, result)
    if result.patched:
        out.print(f"locally patched files (copies kept in {result.backup_dir}):")
        for path in result.patched:
            out.print(f"  {path}")
    for path in result.extras:
        state = (
            "pruned (copy kept in the backup)" if path in result.pruned else "left in place (--prune removes)"
        )
        out.print(f"  leftover {path}: {state}", soft_wrap=True)
    if result.backup_dir:
        err.print(f"[dim]backup: {result.backup_dir}; log: {result.log_file}[/]")
    if result.backups_removed:
        err.print(f"[dim]deleted {len(result.backups_removed)} older backup(s) (--keep-backups)[/]")
    if result.error is not None:
        render_error(err, result.error)


def _render_patches(out: Console, result: RunResult) -> None:
    """--keep-patches: what was carried, what was dropped, and where each conflict is (as a diff)."""
    heading = {
        "carried": "local patches carried to the new version:",
        "dropped": "local patches dropped (--drop-conflicting; the backup keeps them):",
        "conflict": "local patches that cannot be carried:",
    }
    for status, title in heading.items():
        found = [p for p in result.patches if p.status.value == status]
        if not found:
            continue
        out.print(title)
        for patch in found:
            out.print(f"  {status} {patch.path}: {patch.detail}", soft_wrap=True)
            if status != "carried" and patch.diff:
                out.print(patch.diff, end="", markup=False, highlight=False, soft_wrap=True)
    if result.patch_file:
        out.print(f"carried patch set saved as {result.patch_file}", soft_wrap=True)


def render_recoveries(out: Console, recoveries: list[Recovery]) -> None:
    if not any(r.run_id for r in recoveries):
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
        out.print(f"recovered run {r.run_id} in {r.prefix} (died in phase {r.phase}): " + "; ".join(did))
        for note in r.notes:
            out.print(f"  note: {note}")


def render_status(out: Console, found: list[EnvironmentStatus]) -> None:
    if not found:
        out.print("no safeinstall state: no run in progress, nothing to recover")
        return
    table = Table(box=None, pad_edge=False)
    for column in ("ENVIRONMENT", "STATE", "PACKAGE", "PHASE", "UNITS"):
        table.add_column(column, overflow="fold")
    for s in found:
        if s.running and s.holder is not None:
            state = f"[yellow]running[/] (PID {s.holder.pid}, since {s.holder.started_display})"
        elif s.needs_recovery:
            state = "[red]needs recovery[/]: run safeinstall --recover"
        else:
            state = "[green]idle[/]"
        table.add_row(s.prefix, state, s.package or "-", s.journal_phase or "-", " ".join(s.units) or "-")
    out.print(table)
