"""The terminal's side of a command (:class:`safeinstall.run.commands.modes.Ui`): what it says while it works,
and its typed result at the end, as rich output or as its ``--json`` document."""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from safeinstall.cli.render import (
    ConsoleReporter,
    counted,
    literal,
    make_console,
    printable,
    render_entry,
    render_error,
    render_forgotten,
    render_patches,
    render_plan,
    render_recoveries,
    render_run,
    render_status,
    render_verify,
)
from safeinstall.errors import SafeInstallError
from safeinstall.run.commands.modes import (
    Declined,
    DetachedRun,
    DiscardResult,
    DryRun,
    ForgetResult,
    FromHistory,
    Ran,
    RecoverResult,
    Result,
    StatusResult,
    Verified,
)
from safeinstall.run.parts.output import dumps

if TYPE_CHECKING:
    from rich.console import Console
    from rich.status import Status

    from safeinstall.run.parts.results import Reporter


class Terminal:
    """The command's output: step lines and results on stdout, notes, progress and errors on stderr;
    with ``--json``, only the result's document on stdout."""

    def __init__(self, as_json: bool, verbosity: int) -> None:
        self.as_json = as_json
        self.verbosity = verbosity
        self.out = make_console()
        self.err = make_console(stderr=True)
        self._status: Status | None = None

    def preparing(self, what: str) -> None:
        """On a terminal, ``what`` with a spinner on stderr until the next thing said (the preflight's
        seconds are not silent); nothing elsewhere."""
        if self.as_json or self.verbosity < 0 or not self.err.is_terminal or self._status is not None:
            return
        with contextlib.suppress(OSError):
            self._status = self.err.status(literal(what))
            self._status.start()

    def settle(self) -> None:
        """The spinner of :meth:`preparing` gone, before anything else is said."""
        if self._status is not None:
            status, self._status = self._status, None
            with contextlib.suppress(OSError):
                status.stop()

    def reporter(self) -> Reporter:
        quiet = self.as_json or self.verbosity < 0
        return ConsoleReporter(self.out, self.err, quiet=quiet, verbosity=self.verbosity, settle=self.settle)

    def note(self, text: str, *, warning: bool = False) -> None:
        self.settle()
        if self.as_json or self.verbosity < 0:
            return
        label = "[yellow]note:[/]" if warning else "[dim]note:[/]"  # a warning's note is one line
        with contextlib.suppress(OSError):
            self.err.print(f"{label} {literal(text, lines=not warning)}", soft_wrap=True)

    @contextlib.contextmanager
    def verifying(self) -> Iterator[Callable[[int, int], None] | None]:
        if not (self.err.is_terminal and self.verbosity >= 0):  # rich.progress only for a terminal
            yield None
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        columns = (TextColumn("verifying"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn())
        with Progress(*columns, console=self.err, transient=True) as progress:
            task = progress.add_task("verify", total=None)

            def on_progress(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total)

            yield on_progress

    def show(self, line: str) -> None:  # the log holds uv's output and other users' names: never raw
        self.settle()
        with contextlib.suppress(OSError):
            sys.stderr.write(printable(line, lines=True) + "\n")
            sys.stderr.flush()

    def error(self, error: SafeInstallError) -> None:
        self.settle()
        with contextlib.suppress(OSError):
            render_error(self.err, error)

    def done(self, result: Result) -> None:
        """The result: its JSON document, or what :func:`draw` renders and each failure. A terminal that
        is gone (SIGHUP) does not change the exit code."""
        self.settle()
        with contextlib.suppress(OSError):
            if self.as_json:
                document = result.to_json()
                if document is not None:
                    print(dumps(document))
            else:
                draw(result, self.out, self.err, self.verbosity)
                for failure in result.failures:
                    render_error(self.err, failure)
            if isinstance(result, Ran):
                for note in result.notes:
                    self.err.print(f"[dim]note:[/] {literal(note, lines=True)}", soft_wrap=True)


def draw(result: Result, out: Console, err: Console, verbosity: int) -> None:
    """Pure rendering: one typed result on the terminal."""
    if isinstance(result, Verified):
        render_verify(out, err, result.report, result.diffs, verbosity)
        if result.saved is not None:
            path, count = result.saved
            err.print(f"patch of {counted(count, 'modified file')} written to {literal(path)}")
    elif isinstance(result, DryRun):
        render_plan(out, err, result.plan, verbosity, dry_run=True)
        if result.patches is not None:
            render_patches(out, result.patches, when="plan")
    elif isinstance(result, Ran):
        render_run(out, err, result.run, result.run_id)
    elif isinstance(result, FromHistory):
        render_entry(out, err, result.entry)
    elif isinstance(result, DetachedRun):
        manager = "systemd --user" if result.user_manager else "systemd"
        out.print(
            f"detached: run {literal(result.run_id)} goes on as {literal(result.unit)} ({manager})",
            soft_wrap=True,
        )
        again = f"safeinstall --status --wait --run {result.run_id} --python {result.python}"
        out.print(
            literal(f"follow it with: {again}" + (" --user" if result.user_manager else "")), soft_wrap=True
        )
    elif isinstance(result, Declined):
        out.print("nothing done (not confirmed)")
    elif isinstance(result, RecoverResult):
        render_recoveries(out, list(result.outcome.recoveries), bool(result.outcome.failures))
    elif isinstance(result, StatusResult):
        render_status(out, list(result.report.environments), last=0 if verbosity > 0 else 5)
    elif isinstance(result, ForgetResult):
        render_forgotten(out, list(result.forgotten), bool(result.failures))
    elif isinstance(result, DiscardResult):
        dropped = result.discarded
        out.print(
            literal(
                f"discarded the prepared run {dropped.run_id} ({'; '.join(dropped.changes)}) "
                f"of {dropped.prefix}"
            ),
            soft_wrap=True,
        )
