"""The commands: what each mode of the command line does, as one function that returns a typed result.

The CLI calls :func:`execute` once and renders what it is handed; nothing here prints.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from safeinstall.env.environment import Environment, Walked, inspect_environment, resolve_python
from safeinstall.errors import (
    ExitCode,
    NothingToCheck,
    SafeInstallError,
    UnknownDistributionError,
    UsageError,
    one_line,
)
from safeinstall.run.parts.options import PLAIN_NAME, Mode, RunOptions, check_options, flag_of
from safeinstall.run.parts.output import command_for, envelope, jsonable

if TYPE_CHECKING:
    from contextlib import AbstractContextManager
    from types import ModuleType

    from safeinstall.env.diffs import FileDiff
    from safeinstall.env.verify import VerifyReport
    from safeinstall.env.vouched import Vouched
    from safeinstall.run.back.recover import Recovered
    from safeinstall.run.commands.metrics import Family
    from safeinstall.run.commands.status import Forgotten, StatusReport
    from safeinstall.run.parts.detach import PrivateInputs
    from safeinstall.run.parts.results import Reporter
    from safeinstall.run.steps.prepare import Discarded
    from safeinstall.scan.plan import Plan
    from safeinstall.store.history import HistoryEntry
    from safeinstall.store.rundoc import PatchDoc, RunDocument
    from safeinstall.store.state import EnvironmentState


@dataclass(frozen=True, slots=True, kw_only=True)
class Request:
    """The command line, parsed and checked: the modes that choose the command, the options of a run
    (as given: :func:`run_options` completes them), and what the other commands take."""

    modes: frozenset[Mode] = frozenset()
    options: RunOptions = field(default_factory=lambda: RunOptions(package=""))
    run: str | None = None  # --run
    wait: bool = False
    all_: bool = False
    diff: bool = False
    save_patch: Path | None = None
    acknowledge: bool = False  # --acknowledge-wheel-faults: root keeps each wheel-fault found, as it is
    metrics_file: Path | None = None
    environ_from: Path | None = None  # a detached run's private inputs
    extra_args: tuple[str, ...] = ()  # uv's arguments
    yes: bool = False
    as_json: bool = False
    verbosity: int = 0  # -1 quiet, 0, 1 verbose
    interactive: bool = False  # ask before stopping anything
    #: why a run not given --yes cannot ask (no terminal, --json): one that would stop units is refused
    cannot_ask: str | None = None

    @property
    def command(self) -> str:
        """The ``command`` of the JSON document (``reinstall`` by default)."""
        return command_for(self.modes)

    @property
    def package(self) -> str | None:
        """The requirement as given (or the package the wheel names); None: none."""
        return self.options.package or None


# -- the results: one type per mode; each has its JSON document (docs/json.md) and exit code ---------


@dataclass(frozen=True, slots=True, kw_only=True)
class Outcome:
    exit_code: int
    failures: tuple[SafeInstallError, ...] = ()  # errors said after the result
    document: dict[str, Any] | None = None  # the --json document; None: nothing to print (or a run's)

    def to_json(self) -> dict[str, Any] | None:
        """The ``--json`` document (None: nothing to print)."""
        return self.document


@dataclass(frozen=True, slots=True, kw_only=True)
class Verified(Outcome):
    report: VerifyReport
    diffs: list[FileDiff] | None  # --diff
    saved: tuple[Path, int] | None  # --save-patch: the file, and how many modified files it holds


@dataclass(frozen=True, slots=True, kw_only=True)
class DryRun(Outcome):
    plan: Plan
    patches: tuple[PatchDoc, ...] | None  # --keep-patches: each local patch


@dataclass(frozen=True, slots=True, kw_only=True)
class Ran(Outcome):
    """A reinstall or undo: its document is final (kept in its history, but a typo's that ran nothing);
    ``notes`` follow it. One that failed before it changed anything is said as its error."""

    run: RunDocument
    run_id: str
    notes: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return self.run.to_json()


@dataclass(frozen=True, slots=True, kw_only=True)
class FromHistory(Outcome):
    """A finished run, from its history entry (``--status --wait``; a detached run refused)."""

    entry: HistoryEntry

    def to_json(self) -> dict[str, Any]:
        return self.entry.result.to_json()


@dataclass(frozen=True, slots=True, kw_only=True)
class DetachedRun(Outcome):
    run_id: str
    unit: str
    user_manager: bool
    python: str


@dataclass(frozen=True, slots=True, kw_only=True)
class Declined(Outcome):
    """Not confirmed at the prompt: nothing was done."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoppedFollowing(Outcome):
    """``--status --wait`` interrupted: only the following stopped, the run goes on."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RecoverResult(Outcome):
    outcome: Recovered


@dataclass(frozen=True, slots=True, kw_only=True)
class StatusResult(Outcome):
    report: StatusReport


@dataclass(frozen=True, slots=True, kw_only=True)
class ForgetResult(Outcome):
    forgotten: tuple[Forgotten, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class DiscardResult(Outcome):
    discarded: Discarded


Result = (
    Verified
    | DryRun
    | Ran
    | FromHistory
    | DetachedRun
    | Declined
    | StoppedFollowing
    | RecoverResult
    | StatusResult
    | ForgetResult
    | DiscardResult
)


class Ui(Protocol):
    """What the user sees of a command (the CLI's terminal, or its ``--json``)."""

    def reporter(self) -> Reporter:
        """A run's step lines, progress and notes; its confirmation."""

    def note(self, text: str, *, warning: bool = False) -> None:
        """Said at once, on stderr (not with ``--json`` or ``-q``)."""

    def verifying(self) -> AbstractContextManager[Callable[[int, int], None] | None]:
        """A verification's progress (files done, of total), where it is shown."""

    def preparing(self, what: str) -> None:
        """Said while nothing else is (the preflight's seconds), until the next thing said."""

    def settle(self) -> None:
        """What :meth:`preparing` shows, gone (before an error is said)."""

    def show(self, line: str) -> None:
        """A line of the log of the run ``--status --wait`` follows."""

    def error(self, error: SafeInstallError) -> None:
        """An error that does not change the command's result (a metrics file not written)."""

    def done(self, result: Result) -> None:
        """The command's result, shown once at its end."""


def execute(request: Request, ui: Ui) -> int:
    """The one command the request chooses; its result handed to ``ui.done``; its exit code. Raises a
    SafeInstallError for a failure before the command's result (``--metrics-file`` says so)."""
    try:
        result = _command(request, ui)
    except BaseException:
        ui.settle()  # the error is said by the caller, on a terminal left clean
        raise
    ui.done(result)
    return result.exit_code


def _command(request: Request, ui: Ui) -> Result:
    metrics = None  # --metrics-file, once accepted
    try:
        private = None
        if request.environ_from is not None:  # a detached run: the caller's environment, as it was
            from safeinstall.run.parts.detach import take_private

            private = take_private(request.environ_from)
            os.environ.clear()
            os.environ.update(private.environ)
        env, package, undone = None, request.package, None
        if Mode.UNDO in request.modes:
            env, package, undone = _undo_choice(request)
        if request.metrics_file is not None:
            from safeinstall.run.commands.metrics import check_metrics_path

            metrics = check_metrics_path(request.metrics_file)
        if Mode.RECOVER in request.modes:
            return _recover(request, ui, metrics)
        if Mode.DISCARD in request.modes:
            return _discard(request)
        if Mode.COMMIT in request.modes:
            return _commit(request, ui, metrics, private)
        if Mode.FORGET in request.modes:
            return _forget(request)
        if request.wait:
            return _wait(request, ui)
        if Mode.STATUS in request.modes:
            return _status(request, ui, metrics)
        if Mode.VERIFY_ONLY in request.modes:
            return _verify(request, ui, metrics)
        assert package is not None  # cli/usage: a run names its package, or its wheel does
        asked = replace(request.options, package=package, undo=undone or request.options.undo)
        options = run_options(asked, request.extra_args, private)
        check_options(options)
        env = env or inspect_environment(resolve_python(options.python, options.environ))
        own = own_environment(env.prefix, Path(sys.prefix))
        if own is not None:
            raise own
        if Mode.DETACH in request.modes:
            return _detach(request, options, ui, env)
        if Mode.DRY_RUN in request.modes:
            return _dry_run(options, env, ui)
        return _reinstall(request, options, ui, metrics, env)
    except SafeInstallError as error:
        if metrics is not None:
            failed_metrics(metrics, ui, request.command, request.options.python, request.package, error)
        raise


def own_environment(prefix: Path, own: Path) -> UsageError | None:
    """The error of a run (or its dry run, undo, detach) into safeinstall's own environment (``own``,
    ``sys.prefix``): it would replace the uv and the code that run it. None for another one."""
    if os.path.realpath(prefix) != os.path.realpath(own):
        return None
    return UsageError(
        f"{prefix} is safeinstall's own environment: a run there would replace the uv and the code "
        "that run it",
        hint="pass --python for the environment to reinstall into; upgrade safeinstall itself with pip "
        f"({own}/bin/pip install -U safeinstall); --verify-only checks it",
    )


def run_options(
    asked: RunOptions, extra_args: Sequence[str], private: PrivateInputs | None = None
) -> RunOptions:
    """The run the command line asks for (``asked``: its options as given, the requirement as its
    ``package``); a detached run's health URL and uv arguments come from its ``private`` file, never
    its command line."""
    from safeinstall.env.uvplan import index_settings, parse_requirement
    from safeinstall.store.state import is_run_id

    health_url = asked.health_url
    if private is not None:
        if health_url is not None or extra_args:
            raise UsageError(
                "a detached run takes --health-url and uv's arguments from its --environ-from file only",
                hint="start detached runs with safeinstall --detach",
            )
        health_url, extra_args = private.health_url, private.extra_args
    # index options (their URLs may hold credentials) reach uv in its environment, never on a command
    # line that every local user can read in /proc
    extra_args, index_environ = index_settings(extra_args)
    requirement = parse_requirement(asked.package)
    wheel, base_wheel = asked.wheel, asked.base_wheel
    if wheel is not None and requirement.specifier:
        raise UsageError(
            "give --wheel or a version in the requirement, not both",
            hint=f"safeinstall {requirement.name} --wheel PATH, or safeinstall '{requirement.text}'",
        )
    if asked.run_id is not None and not is_run_id(asked.run_id):
        raise UsageError(f"{asked.run_id!r} is not a run id", hint="run ids look like 20261130T031201Z-1234")
    return replace(
        asked,
        package=requirement.name,
        wheel=wheel.absolute() if wheel else None,
        version_spec=requirement.specifier,
        base_wheel=base_wheel.absolute() if base_wheel else None,
        extra_args=tuple(extra_args),
        health_url=health_url,
        environ={**os.environ, **index_environ},
    )


# -- the commands -------------------------------------------------------------------------------------


def _verify(request: Request, ui: Ui, metrics: Path | None) -> Verified:
    from safeinstall.run.commands.verifyonly import verify_kept

    save_patch = request.save_patch
    if save_patch is not None:  # the rule of every output file (store/state.py: output_path)
        from safeinstall.store.state import new_output_file

        save_patch = new_output_file(save_patch, "--save-patch")
    walked = Walked()  # the steering walk's lstat of each file and its listings: the check's own
    env = inspect_environment(resolve_python(request.options.python, os.environ), walked=walked)
    if env.owner_note:
        ui.note(env.owner_note)
    names = None if request.all_ else [request.package or ""]
    notes: list[str] = []
    vouched = _baseline_loader(env, notes)
    read = None
    if request.options.wheel is not None:
        from safeinstall.env.wheel import read_wheel

        read = read_wheel(request.options.wheel)
    with ui.verifying() as on_progress:
        report = verify_kept(
            env, names, read, request.options.full, notes, vouched, on_progress, walked, request.acknowledge
        )
    for note in notes:
        ui.note(note, warning=True)
    if not report.distributions:  # --all in an environment with none: a check of nothing is no pass
        raise NothingToCheck(
            f"no distribution to check in {env.prefix}: no .dist-info directory in "
            + ", ".join(report.site_dirs or ["its site directories"]),
            hint="pass --python with the environment to check (a venv directory or its interpreter); "
            "an .egg-info distribution has no RECORD and is not checked",
        )
    diffs = None
    if request.options.wheel is not None and (request.diff or save_patch):
        from safeinstall.env.diffs import diffs_for, patch_text

        diffs = diffs_for(report.findings, request.options.wheel, Path(report.prefix))
    patch = None if diffs is None else patch_text(diffs)
    if save_patch is not None:
        from safeinstall.store.state import write_new_output

        write_new_output(save_patch, patch or "", "--save-patch")
    _write_metrics(
        metrics, ui, lambda m, now: m.verify_families(report.prefix, report, report.exit_code, now)
    )
    from safeinstall.run.parts.output import verify_json

    data = verify_json(report, patch if request.diff else None, notes) if request.as_json else None
    status = "drift" if report.drift else "wheel-fault" if report.wheel_fault else "clean"
    return Verified(  # the document only for --json: one finding per hardlinked file (61k on vLLM)
        document=None if data is None else envelope("verify", status, report.exit_code, data),
        exit_code=report.exit_code,
        report=report,
        diffs=diffs if request.diff else None,
        saved=None if save_patch is None else (save_patch, sum(1 for d in diffs or [] if d.text)),
    )


def _baseline_loader(env: Environment, notes: list[str]) -> Callable[[], Mapping[str, tuple[Vouched, ...]]]:
    """The environment's baseline (:mod:`safeinstall.store.baseline`), read once and only when asked (a
    clean check reads no state); one that cannot be believed is not used, and ``notes`` say why."""
    loaded: list[Mapping[str, tuple[Vouched, ...]]] = []

    def load() -> Mapping[str, tuple[Vouched, ...]]:
        if not loaded:
            from safeinstall.store.baseline import read_vouched
            from safeinstall.store.state import state_root

            vouched, note = read_vouched(state_root(os.environ, os.geteuid()), env.prefix)
            notes.extend([note] if note else [])
            loaded.append(vouched)
        return loaded[0]

    return load


def _reinstall(request: Request, options: RunOptions, ui: Ui, metrics: Path | None, env: Environment) -> Ran:
    from safeinstall.run.parts.results import LoggedReporter
    from safeinstall.run.steps.reinstall import run_reinstall
    from safeinstall.store.journal import now_iso
    from safeinstall.store.rundoc import RunDocument
    from safeinstall.store.state import new_run_id
    from safeinstall.system.signals import ignored_until_exit

    began = time.monotonic()  # the whole run's wall time: from before its preflight to its result
    state = _state_of(env, options.environ)
    run_id = options.run_id or new_run_id(datetime.now(UTC), os.getpid())
    started = now_iso()
    reporter = LoggedReporter(ui.reporter(), state.log_file(run_id))
    command = request.command
    ui.preparing(_PREFLIGHT)
    try:
        document = run_reinstall(
            replace(options, run_id=run_id), reporter, request.interactive, env, request.cannot_ask
        )
    except SafeInstallError as error:
        failed = RunDocument.failed(command, error)
        if not isinstance(error, UnknownDistributionError | UsageError):  # a typo ran nothing: no entry
            _keep(state, run_id, options.package, started, _refused(state, run_id, failed, options.commit))
        _run_metrics(metrics, ui, env, options.package, run_id, started, failed)
        return Ran(exit_code=error.exit_code, run=failed, run_id=run_id, notes=())
    wall = round(time.monotonic() - began, 3)
    document = replace(document, data=replace(document.details, wall_s=wall))
    # the run has its result: a signal now does not change it (ignored until the process exits)
    ignored_until_exit()
    notes = _keep(state, run_id, options.package, started, document)
    _run_metrics(metrics, ui, env, options.package, run_id, started, document)
    return Ran(exit_code=document.exit_code, run=document, run_id=run_id, notes=notes)


#: What a terminal shows while the preflight works (a few seconds on numpy, more on vLLM)
_PREFLIGHT = "preflight: the wheel checked, uv's plan, the processes that use the package..."


def _state_of(env: Environment, environ: Mapping[str, str]) -> EnvironmentState:
    from safeinstall.store.state import environment_state, state_root

    return environment_state(state_root(environ, os.geteuid()), env.prefix)


def _keep(
    state: EnvironmentState, run_id: str, package: str, started: str, result: RunDocument
) -> tuple[str, ...]:
    """The run's result, final (:func:`safeinstall.store.history.keep_result`), its errors in its log."""
    from safeinstall.store.history import keep_result

    errors = tuple(f"error: {error.message}" for error in result.errors)
    return keep_result(state, run_id, package, started, result, errors)


def _refused(state: EnvironmentState, run_id: str, failed: RunDocument, commit: bool) -> RunDocument:
    """What the history keeps of a run that raised: a refused commit's run stays prepared."""
    from safeinstall.run.steps.prepare import refused_commit

    return refused_commit(state, run_id, failed) if commit else failed


def _run_metrics(
    path: Path | None, ui: Ui, env: Environment, package: str, run_id: str, started: str, doc: RunDocument
) -> None:
    """A run's result (``doc``, its JSON document) into ``--metrics-file``, as its history keeps it."""
    if path is None:
        return
    from safeinstall.store.history import new_entry, summary
    from safeinstall.store.journal import now_iso

    run = summary(new_entry(run_id, package, started, now_iso(), doc))
    _write_metrics(path, ui, lambda m, now: m.run_families(str(env.prefix), run))


def _detach(
    request: Request, options: RunOptions, ui: Ui, env: Environment
) -> DetachedRun | FromHistory | Declined:
    from safeinstall.run.parts.detach import detach
    from safeinstall.store.state import ensure_environment_dir, new_run_id

    state = _state_of(env, options.environ)
    ensure_environment_dir(state)
    if request.interactive or request.cannot_ask is not None:
        # the plan the foreground prompt shows: the preflight's, local changes included; without a
        # terminal and --yes, a run that would stop units is refused here, as in the foreground
        from safeinstall.run.parts.preflight import preflight, refusal, unconfirmed

        ui.preparing(_PREFLIGHT)
        plan = preflight(options, take_lock=False, env=env).plan
        refused = refusal(plan)
        if refused is not None:
            raise refused
        unasked = None if request.cannot_ask is None else unconfirmed(plan, request.cannot_ask)
        if unasked is not None:
            raise unasked
        if request.interactive and not ui.reporter().confirm(plan):
            return Declined(exit_code=ExitCode.REFUSED)
    run_id = options.run_id or new_run_id(datetime.now(UTC), os.getpid())
    started = detach(options, env, state, run_id)
    if started.finished is not None and started.finished.result.exit_code == ExitCode.REFUSED:
        return _from_history(started.finished)  # refused in its preflight: nothing was changed
    data = {
        "run_id": run_id,
        "unit": started.unit,
        "user_manager": started.user_manager,
        "prefix": str(env.prefix),
        "log_file": started.log_file,
    }
    return DetachedRun(
        document=envelope(request.command, "detached", ExitCode.OK, data | _undo_of(options)),
        exit_code=ExitCode.OK,
        run_id=run_id,
        unit=started.unit,
        user_manager=started.user_manager,
        python=str(env.python),
    )


def _from_history(entry: HistoryEntry) -> FromHistory:
    return FromHistory(exit_code=entry.result.exit_code, entry=entry)


def _dry_run(options: RunOptions, env: Environment, ui: Ui) -> DryRun:
    from safeinstall.run.parts.output import patch_docs, plan_json
    from safeinstall.run.parts.preflight import dry_run_patches, preflight

    ui.preparing(_PREFLIGHT)
    # the run's own checks (and, with --keep-patches, its patch merge): it refuses when the run would
    plan, patches = dry_run_patches(preflight(options, take_lock=False, env=env))
    code = ExitCode.OK if plan.proceeds else ExitCode.REFUSED
    status = "would-proceed" if plan.proceeds else "would-refuse"
    patched = patch_docs(patches.outcomes) if patches is not None else None
    listed = {"patches": [p.to_json() for p in patched]} if patched is not None else {}
    data = plan_json(plan) | listed | _undo_of(options)
    return DryRun(
        document=envelope("dry-run", status, code, data), exit_code=code, plan=plan, patches=patched
    )


def _wait(request: Request, ui: Ui) -> FromHistory | StoppedFollowing:
    from safeinstall.run.parts.detach import locate, wait_for_run
    from safeinstall.store.state import environment_state, list_environment_dirs, state_root
    from safeinstall.system.signals import InterruptedEarly

    root = state_root(os.environ, os.geteuid())
    if request.options.python is not None:
        state = environment_state(
            root, inspect_environment(resolve_python(request.options.python, os.environ)).prefix
        )
    else:
        state = locate(list_environment_dirs(root), request.run)
    quiet = request.verbosity < 0  # -q: only the result, not the run's log
    try:
        entry = wait_for_run(state, request.run, (lambda _line: None) if quiet else ui.show)
    except (KeyboardInterrupt, InterruptedEarly):  # only the following stops: the run goes on
        again = "safeinstall --status --wait" + (f" --run {request.run}" if request.run else "")
        ui.show(
            f"stopped following; the run goes on (its own process is not interrupted): {again} follows it"
        )
        return StoppedFollowing(exit_code=130)
    return _from_history(entry)


def _commit(
    request: Request, ui: Ui, metrics: Path | None, private: PrivateInputs | None
) -> Ran | DetachedRun | FromHistory | Declined:
    """--commit: the environment's prepared run, with the window's options of this command line."""
    from safeinstall.run.steps.prepare import commit_options, the_prepared_run

    python = request.options.python
    # inspected once: the environment --python names is the one its prepared run is looked for in
    named = inspect_environment(resolve_python(python, os.environ)) if python is not None else None
    found = the_prepared_run(os.environ, python, env=named)
    given = run_options(replace(request.options, package=found.record.package), request.extra_args, private)
    options = commit_options(found.record, replace(given, python=python or found.python))
    options = replace(options, python=python or found.python)
    check_options(options)
    env = named or inspect_environment(resolve_python(options.python, options.environ))
    if Mode.DETACH in request.modes:
        return _detach(request, options, ui, env)
    return _reinstall(request, options, ui, metrics, env)


def _discard(request: Request) -> DiscardResult:
    from safeinstall.run.steps.prepare import discard

    dropped = discard(os.environ, request.options.python)
    document = envelope("discard", "discarded", ExitCode.OK, {"discarded": jsonable(dropped)})
    return DiscardResult(document=document, exit_code=ExitCode.OK, discarded=dropped)


def _forget(request: Request) -> ForgetResult:
    from safeinstall.run.commands.status import forget

    # a live environment's state: only when said twice (--yes)
    forgotten, failures = forget(os.environ, request.options.python, request.run, live=request.yes)
    code = failures[0].exit_code if failures else ExitCode.OK
    status = "error" if failures else "forgotten"
    document = envelope("forget", status, code, {"forgotten": jsonable(forgotten)}, list(failures))
    return ForgetResult(document=document, exit_code=code, failures=failures, forgotten=forgotten)


def _recover(request: Request, ui: Ui, metrics: Path | None) -> RecoverResult:
    from safeinstall.run.back.recover import recover, said_errors

    outcome = recover(os.environ, request.options.python)
    _write_metrics(metrics, ui, lambda m, now: m.recover_families(outcome, now))
    code = outcome.exit_code
    data = {"recoveries": jsonable(outcome.recoveries)}
    recovered = "recovered" if any(r.run_id for r in outcome.recoveries) else "nothing-to-recover"
    status = {ExitCode.OK: recovered, ExitCode.ROLLED_BACK: "rolled-back"}.get(code, "error")
    said = said_errors(outcome)  # exit 3 too: what happened, and what a person must do
    document = envelope("recover", status, code, data, list(said))
    return RecoverResult(document=document, exit_code=code, failures=said, outcome=outcome)


def _status(request: Request, ui: Ui, metrics: Path | None) -> StatusResult:
    from safeinstall.run.commands.status import status

    report = status(os.environ, request.options.python)
    _write_metrics(metrics, ui, lambda m, now: m.status_families(report, now))
    found = list(report.environments)
    pending = any(s.needs_recovery for s in found)
    state = "needs-recovery" if pending else "running" if any(s.running for s in found) else "idle"
    state = "prepared" if state == "idle" and any(s.prepared for s in found) else state
    state = "error" if report.failures else state
    data = {"environments": jsonable(found)}
    document = envelope("status", state, report.exit_code, data, list(report.failures))
    return StatusResult(
        document=document, exit_code=report.exit_code, failures=report.failures, report=report
    )


def _undo_of(options: RunOptions) -> dict[str, str]:
    """Pure: the JSON field that names the run an undo undoes (none for a reinstall)."""
    return {} if options.undo is None else {"undo_of": options.undo}


#: What a backup put back cannot honour: said, not ignored (by parameter name).
_NOT_WITH_UNDO = (
    "with_deps",
    "keep_patches",
    "base_wheel",
    "drop_conflicting",
    "accept_record_mismatch",
    "prune",
)


def _undo_choice(request: Request) -> tuple[Environment, str, str]:
    """``--undo``: the environment, and the package and id of the run it undoes (its history names it);
    the run itself is chosen again, under the lock, by the preflight. The package, when given, is a
    guard: the run must be of it. Usage errors for what does not go with it."""

    from packaging.utils import canonicalize_name

    from safeinstall.run.parts.undo import UndoError, choose_run

    package, wheel, args = request.package, request.options.wheel, request.extra_args
    unfit = {flag_of(name) for name in _NOT_WITH_UNDO if getattr(request.options, name) not in (None, False)}
    others = sorted((set(request.modes) | unfit) - {Mode.UNDO, Mode.DRY_RUN, Mode.DETACH})
    versioned = bool(package) and not PLAIN_NAME.fullmatch(package or "")
    if versioned or wheel is not None or args or others:
        given = " ".join(
            [
                *others,
                *(["--wheel"] if wheel else []),
                *([f"version ({one_line(package)})"] if versioned else []),
                *args,
            ]
        )
        raise UsageError(
            f"--undo takes no {given}: it puts back what the run it undoes replaced",
            hint="safeinstall --undo --python PY [--run RUN_ID] [--dry-run | --detach] [--json]",
        )
    env = inspect_environment(resolve_python(request.options.python, os.environ))
    chosen = choose_run(_state_of(env, os.environ), request.run)
    if package and canonicalize_name(package) != canonicalize_name(chosen.package or ""):
        raise UndoError(
            f"run {chosen.run_id} was of {chosen.package}, not {package}: nothing was undone",
            hint="safeinstall --status --python PY lists the runs; pick one with --undo --run RUN_ID",
        )
    return env, chosen.package or "", chosen.run_id


# -- --metrics-file -----------------------------------------------------------------------------------


def _write_metrics(
    path: Path | None, ui: Ui, families: Callable[[ModuleType, float], Sequence[Family]]
) -> None:
    """``families(safeinstall.run.commands.metrics, now)`` into ``path`` (None: not asked); a file that cannot
    be written is an error said through ``ui``, the command's own result and exit code stay."""
    if path is None:
        return
    import time

    from safeinstall.run.commands import metrics

    error = metrics.write_or_fail(path, families(metrics, time.time()))
    if error is not None:
        ui.error(error)


def failed_metrics(
    path: Path, ui: Ui, command: str, python: str | None, package: str | None, error: SafeInstallError
) -> None:
    """A command that failed before its result: ``--metrics-file`` says so (the check could not run)."""
    code = int(error.exit_code)
    if command != "verify" and command != "reinstall":  # --status, --recover: of every environment
        _write_metrics(path, ui, lambda m, now: m.check_families(command, False, code, now))
        return
    prefix = os.path.abspath(python) if python else ""
    with contextlib.suppress(SafeInstallError):  # the prefix the interpreter reports, when it answers
        prefix = str(inspect_environment(resolve_python(python, os.environ)).prefix)
    if command == "verify":
        _write_metrics(path, ui, lambda m, now: m.check_families(command, False, code, now, prefix=prefix))
        return
    from safeinstall.store.history import RunSummary

    run = RunSummary("", "error", code, package, None, None, None, None, {}, None)
    _write_metrics(path, ui, lambda m, _now: m.run_families(prefix, run))
