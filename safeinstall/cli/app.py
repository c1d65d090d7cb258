"""Command line: parses arguments and renders results. No logic lives here."""

# No ``from __future__ import annotations`` in this module: typer reads the options' annotations, and
# given as strings it evaluates every one of them at each start (0.015 s of every command); the few
# names imported only for type checking are quoted.

import contextlib
import gc
import os
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
import typer.core

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
from safeinstall.cli.usage import PLAIN_NAME, Usage, usage_problem, wheel_package
from safeinstall.env.environment import Environment, inspect_environment, resolve_python
from safeinstall.errors import ExitCode, NothingToCheck, SafeInstallError, UsageError
from safeinstall.run.kept import verify_kept
from safeinstall.run.output import (
    command_for,
    dumps,
    envelope,
    jsonable,
    patches_json,
    plan_json,
    run_json,
    verify_json,
)

# What only a run, a dry run or the state commands need is imported where it is used: ``--verify-only``
# and ``--help`` start without it (a verification's time is mostly start-up on a small package).
if TYPE_CHECKING:
    from types import ModuleType

    from rich.console import Console

    from safeinstall.env.vouched import Vouched
    from safeinstall.env.wheel import Wheel
    from safeinstall.run.detach import PrivateInputs
    from safeinstall.run.metrics import Family
    from safeinstall.run.options import RunOptions
    from safeinstall.store.state import EnvironmentState

EXIT_CODES = (
    "Exit codes: 0 success (clean); 1 drift found (--verify-only); 2 could not check, refused or "
    "declined, nothing changed; 3 failed after services were stopped, everything put back (--recover: "
    "the new version did not come up, the previous one was put back); 4 failed and putting things back "
    "failed too (the message lists the commands to finish; --status --wait: the run died without a "
    "result). --status --wait exits with the run's own code."
)

app = typer.Typer(
    add_completion=True,  # --install-completion / --show-completion
    rich_markup_mode=None,  # plain help and errors, as uv and pip print them
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)


def _exit(code: int) -> NoReturn:
    # A terminal that went away (SIGHUP) or a closed pipe: Python's final flush would fail and turn
    # the exit status into 120. The status is what scripts read, so the unwritable output goes.
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except OSError:
            with contextlib.suppress(OSError):
                devnull = os.open(os.devnull, os.O_WRONLY)
                os.dup2(devnull, stream.fileno())
                os.close(devnull)
    raise typer.Exit(int(code))


def _fail(error: SafeInstallError, command: str, as_json: bool) -> NoReturn:
    if as_json:
        print(dumps(envelope(command, "error", error.exit_code, None, [error])))
    else:
        render_error(make_console(stderr=True), error)
    _exit(error.exit_code)


def _finish(
    document: dict[str, Any],
    as_json: bool,
    draw: "Callable[[Console, Console], None]",
    failures: Sequence[SafeInstallError] = (),
) -> NoReturn:
    """The one end of a command: its JSON document, or what ``draw`` renders and each failure; then
    the document's exit code. A terminal that is gone (SIGHUP) does not change the exit code."""
    with contextlib.suppress(OSError):
        if as_json:
            print(dumps(document))
        else:
            out, err = make_console(), make_console(stderr=True)
            draw(out, err)
            for failure in failures:
                render_error(err, failure)
    _exit(int(document["exit_code"]))


def _baseline_loader(env: Environment, notes: list[str]) -> "Callable[[], Mapping[str, tuple[Vouched, ...]]]":
    """The environment's baseline (:mod:`safeinstall.store.baseline`), read once and only when asked (a
    clean check reads no state); one that cannot be believed is not used, and ``notes`` say why."""
    loaded: list[Mapping[str, tuple[Vouched, ...]]] = []

    def load() -> "Mapping[str, tuple[Vouched, ...]]":
        if not loaded:
            loaded.append(_read_baseline(env, notes))
        return loaded[0]

    return load


def _read_baseline(env: Environment, notes: list[str]) -> "Mapping[str, tuple[Vouched, ...]]":
    from safeinstall.store.baseline import read_vouched
    from safeinstall.store.state import state_root

    vouched, note = read_vouched(state_root(os.environ, os.geteuid()), env.prefix)
    notes.extend([note] if note else [])
    return vouched


def _run_verify(
    package: str | None,
    all_: bool,
    python: str | None,
    wheel: Path | None,
    diff: bool,
    save_patch: Path | None,
    as_json: bool,
    metrics: Path | None = None,
    verbosity: int = 0,
    full: bool = False,
) -> None:
    if save_patch is not None:  # the rule of every output file (store/state.py: output_path)
        from safeinstall.store.state import new_output_file

        save_patch = new_output_file(save_patch, "--save-patch")
    env = inspect_environment(resolve_python(python, os.environ))
    err = make_console(stderr=True)
    if env.owner_note and not as_json and verbosity >= 0:
        err.print(f"[dim]note:[/] {literal(env.owner_note, lines=True)}", soft_wrap=True)
    names = None if all_ else [package or ""]
    notes: list[str] = []
    vouched = _baseline_loader(env, notes)
    read: Wheel | None = None
    if wheel is not None:
        from safeinstall.env.wheel import read_wheel

        read = read_wheel(wheel)
    if err.is_terminal and verbosity >= 0:  # rich.progress is loaded only for a terminal: scripts start fast
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(
            TextColumn("verifying"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=err,
            transient=True,
        ) as progress:
            task = progress.add_task("verify", total=None)

            def on_progress(done: int, total: int) -> None:
                progress.update(task, completed=done, total=total)

            report = verify_kept(env, names, read, full, notes, vouched, on_progress)
    else:
        report = verify_kept(env, names, read, full, notes, vouched)
    if not as_json and verbosity >= 0:
        for note in notes:
            err.print(f"[yellow]note:[/] {literal(note)}", soft_wrap=True)
    if not report.distributions:  # --all in an environment with none: a check of nothing is no pass
        raise NothingToCheck(
            f"no distribution to check in {env.prefix}: no .dist-info directory in "
            + ", ".join(report.site_dirs or ["its site directories"]),
            hint="pass --python with the environment to check (a venv directory or its interpreter); "
            "an .egg-info distribution has no RECORD and is not checked",
        )
    diffs = None
    if wheel is not None and (diff or save_patch):
        from safeinstall.env.diffs import diffs_for, patch_text

        diffs = diffs_for(report.findings, wheel, Path(report.prefix))
    patch = None if diffs is None else patch_text(diffs)
    if save_patch is not None:
        from safeinstall.store.state import write_new_output

        write_new_output(save_patch, patch or "", "--save-patch")
    _write_metrics(metrics, lambda m, now: m.verify_families(report.prefix, report, report.exit_code, now))
    if as_json:
        status = "drift" if report.drift else "clean"
        data = verify_json(report, patch if diff else None, notes)
        print(dumps(envelope("verify", status, report.exit_code, data)))
    else:
        render_verify(make_console(), err, report, diffs if diff else None, verbosity)
        if save_patch is not None:
            err.print(
                f"patch of {counted(sum(1 for d in diffs or [] if d.text), 'modified file')} written to "
                f"{literal(save_patch)}"
            )
    _exit(report.exit_code)


def _environment_state(options: "RunOptions") -> "tuple[Environment, EnvironmentState]":
    from safeinstall.store.state import environment_state, state_root

    env = inspect_environment(resolve_python(options.python, options.environ))
    return env, environment_state(state_root(options.environ, os.geteuid()), env.prefix)


def _keep(
    state: "EnvironmentState", run_id: str, package: str, started: str, result: dict[str, Any]
) -> tuple[str, ...]:
    """The run's result, final (:func:`safeinstall.store.history.keep_result`), its errors in its log."""
    from safeinstall.store.history import keep_result

    errors = tuple(f"error: {error['message']}" for error in result["errors"])
    return keep_result(state, run_id, package, started, result, errors)


def _run_metrics(
    path: Path | None, env: Environment, package: str, run_id: str, started: str, doc: Any
) -> None:
    """A run's result (``doc``, its JSON document) into ``--metrics-file``, as its history keeps it."""
    if path is None:
        return
    from safeinstall.store.history import new_entry, summary
    from safeinstall.store.journal import now_iso

    run = summary(new_entry(run_id, package, started, now_iso(), doc))
    _write_metrics(path, lambda m, now: m.run_families(str(env.prefix), run))


def _run_reinstall(
    options: "RunOptions", as_json: bool, interactive: bool, metrics: Path | None = None, verbosity: int = 0
) -> None:
    from safeinstall.run.reinstall import run_reinstall
    from safeinstall.run.results import LoggedReporter
    from safeinstall.store.journal import now_iso
    from safeinstall.store.state import new_run_id
    from safeinstall.system.signals import interrupts_deferred

    _env, state = _environment_state(options)
    run_id = options.run_id or new_run_id(datetime.now(UTC), os.getpid())
    started = now_iso()
    out, err = make_console(), make_console(stderr=True)
    console = ConsoleReporter(out, err, quiet=as_json or verbosity < 0, verbosity=verbosity)
    reporter = LoggedReporter(console, state.log_file(run_id))
    command = "reinstall" if options.undo is None else "undo"
    try:
        result = run_reinstall(replace(options, run_id=run_id), reporter, interactive)
    except SafeInstallError as error:
        document = envelope(command, "error", error.exit_code, None, [error])
        _keep(state, run_id, options.package, started, jsonable(document))
        _run_metrics(metrics, _env, options.package, run_id, started, jsonable(document))
        _fail(error, command, as_json)
    errors = [result.error] if result.error else []
    data = {"run_id": run_id, **_undo_of(options), **run_json(result)}
    document = jsonable(envelope(command, result.status, result.exit_code, data, errors))
    # the run has its result: a signal now does not change it (held back until the exit)
    with interrupts_deferred(lambda _signum: None):
        notes = _keep(state, run_id, options.package, started, document)
        _run_metrics(metrics, _env, options.package, run_id, started, document)
        with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP): the exit code still tells
            if as_json:
                print(dumps(document))
            else:
                render_run(out, err, document, run_id)
            for note in notes:
                err.print(f"[dim]note:[/] {literal(note, lines=True)}", soft_wrap=True)
    _exit(result.exit_code)


def _run_detached(options: "RunOptions", as_json: bool, interactive: bool, verbosity: int = 0) -> None:
    from safeinstall.run.detach import detach
    from safeinstall.store.state import ensure_environment_dir, new_run_id

    env, state = _environment_state(options)
    ensure_environment_dir(state)
    out, err = make_console(), make_console(stderr=True)
    if interactive:  # the plan the foreground prompt shows: the preflight's, local changes included
        from safeinstall.run.preflight import preflight, refusal

        plan = preflight(options, take_lock=False).plan
        refused = refusal(plan)
        if refused is not None:
            raise refused
        if not ConsoleReporter(out, err, verbosity=verbosity).confirm(plan):
            out.print("nothing done (not confirmed)")
            _exit(ExitCode.REFUSED)
    run_id = options.run_id or new_run_id(datetime.now(UTC), os.getpid())
    started = detach(options, env, state, run_id)
    if started.finished is not None and started.finished["result"]["exit_code"] == ExitCode.REFUSED:
        _print_entry(started.finished, as_json)  # refused in its preflight: nothing was changed
    data = {
        "run_id": run_id,
        "unit": started.unit,
        "user_manager": started.user_manager,
        "prefix": str(env.prefix),
        "log_file": started.log_file,
    }
    if as_json:
        command = "reinstall" if options.undo is None else "undo"
        print(dumps(envelope(command, "detached", ExitCode.OK, data | _undo_of(options))))
    else:
        manager = "systemd --user" if started.user_manager else "systemd"
        out.print(
            f"detached: run {literal(run_id)} goes on as {literal(started.unit)} ({manager})", soft_wrap=True
        )
        out.print(
            literal(
                f"follow it with: safeinstall --status --wait --run {run_id} --python {env.python}"
                + (" --user" if started.user_manager else "")
            ),
            soft_wrap=True,
        )
    _exit(ExitCode.OK)


def _print_entry(entry: dict[str, Any], as_json: bool) -> NoReturn:
    """A finished run's result, from its history entry; exits with the run's own exit code."""
    _finish(entry["result"], as_json, lambda out, err: render_entry(out, err, entry))


def _run_wait(python: str | None, run_id: str | None, as_json: bool) -> None:
    from safeinstall.run.detach import locate, wait_for_run
    from safeinstall.store.state import environment_state, list_environment_dirs, state_root
    from safeinstall.system.signals import InterruptedEarly

    root = state_root(os.environ, os.geteuid())
    if python is not None:
        state = environment_state(root, inspect_environment(resolve_python(python, os.environ)).prefix)
    else:
        state = locate(list_environment_dirs(root), run_id)

    def show(line: str) -> None:  # the log holds uv's output and other users' names: never raw
        with contextlib.suppress(OSError):
            sys.stderr.write(printable(line, lines=True) + "\n")
            sys.stderr.flush()

    try:
        entry = wait_for_run(state, run_id, show)
    except (KeyboardInterrupt, InterruptedEarly):  # only the following stops: the run goes on
        again = "safeinstall --status --wait" + (f" --run {run_id}" if run_id else "")
        show(f"stopped following; the run goes on (its own process is not interrupted): {again} follows it")
        _exit(130)
    _print_entry(entry, as_json)


def _run_forget(python: str | None, as_json: bool) -> None:
    from safeinstall.run.status import forget

    forgotten, failures = forget(os.environ, python)
    code = failures[0].exit_code if failures else ExitCode.OK
    status = "error" if failures else "forgotten"
    document = envelope("forget", status, code, {"forgotten": jsonable(forgotten)}, list(failures))
    _finish(document, as_json, lambda out, _err: render_forgotten(out, list(forgotten)), failures)


def _run_recover(python: str | None, as_json: bool, metrics: Path | None = None) -> None:
    from safeinstall.run.recover import recover

    outcome = recover(os.environ, python)
    _write_metrics(metrics, lambda m, now: m.recover_families(outcome, now))
    code = outcome.exit_code
    data = {"recoveries": jsonable(outcome.recoveries)}
    recovered = "recovered" if any(r.run_id for r in outcome.recoveries) else "nothing-to-recover"
    status = {ExitCode.OK: recovered, ExitCode.ROLLED_BACK: "rolled-back"}.get(code, "error")
    document = envelope("recover", status, code, data, list(outcome.failures))
    _finish(
        document,
        as_json,
        lambda out, _err: render_recoveries(out, list(outcome.recoveries)),
        outcome.failures,
    )


def _run_status(python: str | None, as_json: bool, metrics: Path | None = None, verbosity: int = 0) -> None:
    from safeinstall.run.status import status

    report = status(os.environ, python)
    _write_metrics(metrics, lambda m, now: m.status_families(report, now))
    found = list(report.environments)
    pending = any(s.needs_recovery for s in found)
    state = "needs-recovery" if pending else "running" if any(s.running for s in found) else "idle"
    state = "error" if report.failures else state
    document = envelope(
        "status", state, report.exit_code, {"environments": jsonable(found)}, list(report.failures)
    )
    _finish(
        document,
        as_json,
        lambda out, _err: render_status(out, found, last=0 if verbosity > 0 else 5),
        report.failures,
    )


def _undo_of(options: "RunOptions") -> dict[str, str]:
    """Pure: the JSON field that names the run an undo undoes (none for a reinstall)."""
    return {} if options.undo is None else {"undo_of": options.undo}


def _undo_choice(
    python: str | None,
    run: str | None,
    package: str | None,
    wheel: Path | None,
    args: Sequence[str],
    modes: Collection[str],
) -> tuple[str, str]:
    """``--undo``: the package and id of the run it undoes (its history names it); the run itself is chosen
    again, under the lock, by the preflight. ``package``, when given, is a guard: the run must be of it.
    Usage errors for what does not go with it."""
    from packaging.utils import canonicalize_name

    from safeinstall.run.undo import UndoError, choose_run

    others = sorted(set(modes) - {"--undo", "--dry-run", "--detach"})
    if (package and not PLAIN_NAME.fullmatch(package)) or wheel is not None or args or others:
        given = " ".join(
            [
                *others,
                *(["--wheel"] if wheel else []),
                *(["a version"] if package and not PLAIN_NAME.fullmatch(package) else []),
                *args,
            ]
        )
        raise UsageError(
            f"--undo takes no {given}: it puts back what the run it undoes replaced",
            hint="safeinstall --undo --python ENV [--run RUN_ID] [--dry-run | --detach] [--json]",
        )
    from safeinstall.run.options import RunOptions

    _env, state = _environment_state(RunOptions(package="", python=python))
    chosen = choose_run(state, run)
    if package and canonicalize_name(package) != canonicalize_name(chosen.package or ""):
        raise UndoError(
            f"run {chosen.run_id} was of {chosen.package}, not {package}: nothing was undone",
            hint="safeinstall --status --python ENV lists the runs; pick one with --undo --run RUN_ID",
        )
    return chosen.package or "", chosen.run_id


def _run_dry_run(options: "RunOptions", as_json: bool, verbosity: int = 0) -> None:
    from safeinstall.run.preflight import dry_run_patches, preflight

    # the run's own checks (and, with --keep-patches, its patch merge): it refuses when the run would
    plan, patches = dry_run_patches(preflight(options, take_lock=False))
    code = ExitCode.OK if plan.proceeds else ExitCode.REFUSED
    status = "would-proceed" if plan.proceeds else "would-refuse"
    patched = patches_json(patches.outcomes) if patches is not None else None
    data = plan_json(plan) | ({"patches": patched} if patched is not None else {}) | _undo_of(options)

    def draw(out: "Console", err: "Console") -> None:
        render_plan(out, err, plan, verbosity)
        if patched is not None:
            render_patches(out, patched)

    _finish(envelope("dry-run", status, code, data), as_json, draw)


#: A valid distribution name (PEP 508) and nothing else: such a PACKAGE needs no requirement parser


class _PlainHelp(typer.core.TyperCommand):
    """Help as uv and pip print it: an argument by its name alone (``REQUIREMENT``, no ``<str>``)."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        params = self.get_params(ctx)
        arguments = [
            (param.metavar or (param.name or "").upper(), getattr(param, "help", None) or "")
            for param in params
            if param.param_type_name == "argument" and not getattr(param, "hidden", False)
        ]
        options = [
            record
            for param in params
            if param.param_type_name == "option" and (record := param.get_help_record(ctx)) is not None
        ]
        for title, rows in (("Arguments", arguments), ("Options", options)):
            if rows:
                with formatter.section(title):
                    formatter.write_dl(rows)


def _tool_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("safeinstall")
    except PackageNotFoundError:  # a source tree on sys.path
        from safeinstall import __version__

        return __version__


def run_options(
    params: Mapping[str, Any], extra_args: Sequence[str], private: "PrivateInputs | None" = None
) -> "RunOptions":
    """The run the parsed command line asks for (``params``: the command's parameters by name); a
    detached run's health URL and uv arguments come from its ``private`` file, never its command line."""
    from safeinstall.env.uvplan import index_settings, parse_requirement
    from safeinstall.run.options import RunOptions
    from safeinstall.store.state import is_run_id

    if private is not None:
        if params["health_url"] is not None or extra_args:
            raise UsageError(
                "a detached run takes --health-url and uv's arguments from its --environ-from file only",
                hint="start detached runs with safeinstall --detach",
            )
        params = {**params, "health_url": private.health_url}
        extra_args = private.extra_args
    # index options (their URLs may hold credentials) reach uv in its environment, never on a command
    # line that every local user can read in /proc
    extra_args, index_environ = index_settings(extra_args)
    requirement = parse_requirement(params["package"])
    # typer hands the command's function a Path, but leaves ``ctx.params`` as click parsed it (a str)
    wheel = Path(params["wheel"]) if params["wheel"] is not None else None
    base_wheel = Path(params["base_wheel"]) if params["base_wheel"] is not None else None
    if wheel is not None and requirement.specifier:
        raise UsageError(
            "give --wheel or a version in the requirement, not both",
            hint=f"safeinstall {requirement.name} --wheel PATH, or safeinstall '{requirement.text}'",
        )
    run_id: str | None = params["run_id"]
    if run_id is not None and not is_run_id(run_id):
        raise UsageError(f"{run_id!r} is not a run id", hint="run ids look like 20261130T031201Z-1234")
    return RunOptions(
        package=requirement.name,
        python=params["python"],
        wheel=wheel.absolute() if wheel else None,
        version_spec=requirement.specifier,
        with_deps=params["with_deps"],
        user=params["user"],
        kill_strays=params["kill_strays"],
        only_loaded=params["only_loaded"],
        strict=params["strict"],
        keep_patches=params["keep_patches"],
        base_wheel=base_wheel.absolute() if base_wheel else None,
        drop_conflicting=params["drop_conflicting"],
        accept_record_mismatch=params["accept_record_mismatch"],
        extra_args=tuple(extra_args),
        stop_timeout=params["stop_timeout"],
        gpu_timeout=params["gpu_timeout"],
        settle=params["settle"],
        health_url=params["health_url"],
        health_timeout=params["health_timeout"],
        no_restart=params["no_restart"],
        prune=params["prune"],
        no_swap=params["no_swap"],
        full=params["full"],
        no_smoke=params["no_smoke"],
        smoke=params["smoke"],
        smoke_timeout=params["smoke_timeout"],
        keep_backups=params["keep_backups"],
        run_id=run_id,
        undo=params["run"] if params.get("undo_") else None,  # without --run: the last, set by the caller
        environ={**os.environ, **index_environ},
    )


def _flag(name: str, help_text: str, *short: str) -> Any:
    return typer.Option(name, *short, help=help_text)


@app.command(
    cls=_PlainHelp,
    context_settings={
        "allow_extra_args": True,
        "ignore_unknown_options": False,
        "help_option_names": ["-h", "--help"],
    },
    epilog=EXIT_CODES,
)
def main_command(
    ctx: typer.Context,
    package: Annotated[
        str | None,
        typer.Argument(
            metavar="REQUIREMENT",
            help="The distribution to reinstall, optionally with a version as uv and pip take it "
            "('vllm==0.16.0', 'vllm>=0.16'); or the one to verify.",
            show_default=False,
        ),
    ] = None,
    wheel: Annotated[
        Path | None, typer.Option("--wheel", metavar="PATH", help="The wheel to install / compare with.")
    ] = None,
    python: Annotated[
        str | None,
        typer.Option(
            "--python",
            metavar="PATH",
            help="Target interpreter or venv (default: VIRTUAL_ENV, then python3).",
        ),
    ] = None,
    user: Annotated[bool, _flag("--user", "Talk to the user's systemd manager.")] = False,
    with_deps: Annotated[bool, _flag("--with-deps", "Reinstall dependencies too (uv --reinstall).")] = False,
    dry_run: Annotated[
        bool, _flag("--dry-run", "Show the plan (processes, units, GPUs, uv command); change nothing.")
    ] = False,
    kill_strays: Annotated[
        bool, _flag("--kill-strays", "End processes outside any service (not restarted).")
    ] = False,
    only_loaded: Annotated[
        bool,
        _flag(
            "--only-loaded",
            "Stop only processes with certain evidence of the package loaded (mapped, open, argv, "
            "depends), not every process of the environment's Python.",
        ),
    ] = False,
    strict: Annotated[
        bool,
        _flag(
            "--strict",
            "A process still running replaced code after the restart fails the run (rolled back, exit 3).",
        ),
    ] = False,
    stop_timeout: Annotated[
        float | None,
        typer.Option(
            "--stop-timeout",
            metavar="SECONDS",
            help="Seconds to wait for each unit to stop (default: its TimeoutStopSec).",
        ),
    ] = None,
    gpu_timeout: Annotated[
        float,
        typer.Option(
            "--gpu-timeout", metavar="SECONDS", help="Seconds to wait for GPU memory to be released."
        ),
    ] = 120.0,
    settle: Annotated[
        float, typer.Option("--settle", metavar="SECONDS", help="Seconds a restarted unit must stay active.")
    ] = 5.0,
    health_url: Annotated[
        str | None,
        typer.Option(
            "--health-url",
            metavar="URL",
            envvar="SAFEINSTALL_HEALTH_URL",
            show_envvar=False,
            help="After the restart, wait until this URL answers 200 (or from SAFEINSTALL_HEALTH_URL: "
            "a URL with a token stays off the command line, which every local user can read).",
        ),
    ] = None,
    health_timeout: Annotated[
        float,
        typer.Option(
            "--health-timeout", metavar="SECONDS", help="Seconds to wait for --health-url to answer 200."
        ),
    ] = 300.0,
    no_restart: Annotated[bool, _flag("--no-restart", "Leave the units stopped after the install.")] = False,
    no_swap: Annotated[
        bool,
        _flag(
            "--no-swap",
            "Install with uv while the units are down, instead of staging the new version before the "
            "stop and renaming it into place (docs/window.md).",
        ),
    ] = False,
    no_smoke: Annotated[
        bool,
        _flag(
            "--no-smoke",
            "Do not import the new version before the stop (as the environment's account, with the "
            "unit's environment; docs/reinstall.md).",
        ),
    ] = False,
    smoke: Annotated[
        str | None,
        typer.Option(
            "--smoke",
            metavar="CMD",
            help="Also run CMD (through /bin/sh -c) that way before the stop; a failure refuses the run, "
            "e.g. --smoke \"python -c 'import vllm._C'\".",
        ),
    ] = None,
    smoke_timeout: Annotated[
        float,
        typer.Option(
            "--smoke-timeout", metavar="SECONDS", help="Seconds each import check or --smoke may take."
        ),
    ] = 300.0,
    prune: Annotated[
        bool, _flag("--prune", "Remove files the old version left behind (kept in the backup).")
    ] = False,
    keep_backups: Annotated[
        int,
        typer.Option(
            "--keep-backups",
            metavar="N",
            help="After a good run, keep this many newest backups of the environment; delete older ones.",
        ),
    ] = 3,
    keep_patches: Annotated[
        bool,
        _flag(
            "--keep-patches",
            "Carry the package's local patches over to the new version (a three-way merge, checked "
            "before anything stops).",
        ),
    ] = False,
    base_wheel: Annotated[
        Path | None,
        typer.Option(
            "--base-wheel",
            metavar="WHEEL",
            help="With --keep-patches: the wheel of the installed version (default: fetched by uv).",
        ),
    ] = None,
    drop_conflicting: Annotated[
        bool,
        _flag(
            "--drop-conflicting",
            "With --keep-patches: carry what merges; drop (and list) the rest instead of refusing.",
        ),
    ] = False,
    accept_record_mismatch: Annotated[
        bool,
        _flag(
            "--accept-record-mismatch",
            "With --wheel: install a wheel whose own RECORD is wrong about its members' hashes or sizes "
            "(its packaging's fault); verified against its contents, and kept as the environment's "
            "baseline (--verify-only: wheel-record, not drift).",
        ),
    ] = False,
    yes: Annotated[bool, _flag("--yes", "Do not ask before stopping anything.", "-y")] = False,
    detach_: Annotated[
        bool,
        _flag(
            "--detach",
            "After the preflight, go on as a transient systemd unit that outlives this terminal or SSH "
            "session; prints the run id (follow it with --status --wait).",
        ),
    ] = False,
    verify_only: Annotated[
        bool, _flag("--verify-only", "Only check installed files against RECORD; change nothing.")
    ] = False,
    all_: Annotated[bool, _flag("--all", "With --verify-only: every distribution.")] = False,
    full: Annotated[
        bool,
        _flag(
            "--full",
            "Read and hash every file again: take no hash kept from an earlier check of an unchanged "
            "inode (docs/verify.md).",
            "--no-cache",
        ),
    ] = False,
    diff: Annotated[
        bool, _flag("--diff", "With --verify-only --wheel: unified diffs of modified files.")
    ] = False,
    save_patch: Annotated[
        Path | None,
        typer.Option(
            "--save-patch", metavar="FILE", help="With --verify-only --wheel: write those diffs to FILE."
        ),
    ] = None,
    recover_: Annotated[
        bool, _flag("--recover", "Finish runs that died (restore, restart units, clear the journal).")
    ] = False,
    status_: Annotated[
        bool, _flag("--status", "Show the run in progress and the last finished runs of each environment.")
    ] = False,
    wait: Annotated[
        bool,
        _flag(
            "--wait",
            "With --status: follow the current (or latest) run to its end, showing its log; exit with its "
            "exit code and print its result.",
        ),
    ] = False,
    run: Annotated[
        str | None,
        typer.Option(
            "--run",
            metavar="RUN_ID",
            help="With --status --wait: the run to follow; with --undo: the run to undo.",
        ),
    ] = None,
    undo_: Annotated[
        bool,
        _flag(
            "--undo",
            "Put back what ran before the environment's last run (--run: an older one), byte for byte, "
            "through the same safe sequence (see docs/undo.md).",
        ),
    ] = False,
    forget_: Annotated[
        bool,
        _flag(
            "--forget",
            "Remove the state (backups, logs, history) of environments that no longer exist, or of the one "
            "--python names.",
        ),
    ] = False,
    as_json: Annotated[bool, _flag("--json", "Print the versioned JSON result on stdout.")] = False,
    metrics_file: Annotated[
        Path | None,
        typer.Option(
            "--metrics-file",
            metavar="FILE",
            help="Also write the result as Prometheus metrics to FILE, atomically, mode 0644 (for "
            "node_exporter's textfile collector): with --verify-only, a run, --recover and --status.",
        ),
    ] = None,
    verbose: Annotated[
        int,
        typer.Option(
            "--verbose",
            "-v",
            count=True,
            help="Say more: every warning and finding, the plan's evidence chains, each distribution.",
        ),
    ] = 0,
    quiet: Annotated[
        int,
        typer.Option("--quiet", "-q", count=True, help="Say less: no notes, warnings summaries or progress."),
    ] = 0,
    show_version: Annotated[bool, _flag("--version", "Print safeinstall's version and exit.", "-V")] = False,
    run_id: Annotated[str | None, typer.Option("--run-id", hidden=True)] = None,
    environ_from: Annotated[Path | None, typer.Option("--environ-from", hidden=True)] = None,
) -> None:
    """Reinstall a Python package safely under the services that use it; or check it (--verify-only).

    Arguments after -- go to uv unchanged (index options and the like).
    """
    modes = {
        flag
        for flag, on in (
            ("--verify-only", verify_only),
            ("--dry-run", dry_run),
            ("--detach", detach_),
            ("--recover", recover_),
            ("--status", status_),
            ("--forget", forget_),
            ("--undo", undo_),
        )
        if on
    }
    command = command_for(modes)
    metrics = None  # --metrics-file, once accepted
    try:
        given = tuple(
            name
            for name in ctx.params
            if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"
        )
        if not given and not ctx.args:  # as uv: the help, and the status of a usage error; on stderr
            typer.echo(ctx.get_help(), err=True)
            raise UsageError(
                "no REQUIREMENT and no command given",
                hint="safeinstall PACKAGE [--wheel W], safeinstall PACKAGE --verify-only or "
                "safeinstall --status (see safeinstall --help)",
            )
        uv_args: tuple[str, ...] = ctx.obj or ()
        problem = usage_problem(
            Usage(
                frozenset(modes),
                package,
                wheel,
                given,
                tuple(ctx.args),
                uv_args,
                verbose,
                quiet,
                show_version,
                wait,
                run,
                metrics_file is not None,
                all_,
                diff,
                save_patch is not None,
                keep_patches,
                base_wheel is not None,
                drop_conflicting,
                accept_record_mismatch,
            )
        )
        if problem is not None:
            raise problem
        verbosity = -1 if quiet else 1 if verbose else 0
        if show_version:
            print(f"safeinstall {_tool_version()}")
            _exit(ExitCode.OK)
        private = None
        if environ_from is not None:  # a detached run: the caller's environment, as it was
            from safeinstall.run.detach import take_private

            private = take_private(environ_from)
            os.environ.clear()
            os.environ.update(private.environ)
        if undo_:
            unfit = {  # what a backup put back cannot honour: said, not ignored
                flag
                for flag, on in (
                    ("--with-deps", with_deps),
                    ("--keep-patches", keep_patches),
                    ("--base-wheel", base_wheel is not None),
                    ("--drop-conflicting", drop_conflicting),
                    ("--accept-record-mismatch", accept_record_mismatch),
                    ("--prune", prune),
                )
                if on
            }
            package, undone = _undo_choice(python, run, package, wheel, ctx.args, modes | unfit)
            run = None
        if metrics_file is not None:
            metrics = _metrics_target(metrics_file)
        if recover_:
            _run_recover(python, as_json, metrics)
        if forget_:
            _run_forget(python, as_json)
        if wait:
            _run_wait(python, run, as_json)
        if status_:
            _run_status(python, as_json, metrics, verbosity)
        if not package and not all_ and wheel is not None:  # the wheel names its package
            package = wheel_package(wheel)
        if verify_only:
            _run_verify(package, all_, python, wheel, diff, save_patch, as_json, metrics, verbosity, full)
        assert package is not None  # usage_problem: a run names its package, or its wheel does
        from safeinstall.run.options import check_options

        options = run_options({**ctx.params, "package": package}, ctx.args, private)
        if undo_:
            options = replace(options, undo=undone)
        check_options(options)
        interactive = not yes and not as_json and sys.stdin.isatty()
        if detach_:
            _run_detached(options, as_json, interactive, verbosity)
        if dry_run:
            _run_dry_run(options, as_json, verbosity)
        _run_reinstall(options, as_json, interactive, metrics, verbosity)
    except SafeInstallError as error:
        if metrics is not None:
            _failed_metrics(metrics, command, python, package, error)
        _fail(error, command, as_json)


def _metrics_target(path: Path) -> Path:
    """``--metrics-file`` (its command checked by :func:`safeinstall.cli.usage.usage_problem`): whether
    root may write there, before any work."""
    from safeinstall.run.metrics import check_metrics_path

    return check_metrics_path(path)


def _write_metrics(path: Path | None, families: "Callable[[ModuleType, float], Sequence[Family]]") -> None:
    """``families(safeinstall.run.metrics, now)`` into ``path`` (None: not asked); a file that cannot be
    written is an error on stderr, the command's own result and exit code stay."""
    if path is None:
        return
    import time

    from safeinstall.run import metrics

    error = metrics.write_or_fail(path, families(metrics, time.time()))
    if error is not None:
        with contextlib.suppress(OSError):
            render_error(make_console(stderr=True), error)


def _failed_metrics(
    path: Path, command: str, python: str | None, package: str | None, error: SafeInstallError
) -> None:
    """A command that failed before its result: ``--metrics-file`` says so (the check could not run)."""
    code = int(error.exit_code)
    if command != "verify" and command != "reinstall":  # --status, --recover: of every environment
        _write_metrics(path, lambda m, now: m.check_families(command, False, code, now))
        return
    prefix = os.path.abspath(python) if python else ""
    with contextlib.suppress(SafeInstallError):  # the prefix the interpreter reports, when it answers
        prefix = str(inspect_environment(resolve_python(python, os.environ)).prefix)
    if command == "verify":
        _write_metrics(path, lambda m, now: m.check_families(command, False, code, now, prefix=prefix))
        return
    from safeinstall.store.history import RunSummary

    run = RunSummary("", "error", code, package, None, None, None, None, {}, None)
    _write_metrics(path, lambda m, _now: m.run_families(prefix, run))


def _split_at_dashes(argv: Sequence[str]) -> tuple[list[str], tuple[str, ...]]:
    """The arguments before ``--`` (safeinstall's) and after it (uv's)."""
    at = argv.index("--") if "--" in argv else len(argv)
    return list(argv[:at]), tuple(argv[at + 1 :])


def _usage_error(exc: typer.TyperException) -> UsageError:
    """A parsing error of Typer/click, as every other error: one line and a hint."""
    message = " ".join(exc.format_message().split()).rstrip(".")
    return UsageError(message[:1].lower() + message[1:], hint="see safeinstall --help")


def _main(argv: list[str]) -> int:
    words, uv_args = _split_at_dashes(argv)
    try:
        code = app(args=argv, prog_name="safeinstall", standalone_mode=False, obj=uv_args)
    except typer.TyperException as exc:  # unknown option, missing value, bad value
        _fail(_usage_error(exc), command_for(set(words)), "--json" in words)
    return int(code or 0)


def main() -> None:
    try:
        code = _main(sys.argv[1:])
    except typer.Exit as done:
        code = done.exit_code
    except SafeInstallError as error:  # a signal while the command line was parsed (signals.py)
        if "--json" in sys.argv[1:]:
            print(dumps(envelope(command_for(set(sys.argv[1:])), "error", error.exit_code, None, [error])))
        else:
            render_error(make_console(stderr=True), error)
        code = int(error.exit_code)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        code = 130
    except Exception as exc:  # a bug: still one error line, not a traceback (SAFEINSTALL_DEBUG=1 shows it)
        if os.environ.get("SAFEINSTALL_DEBUG"):
            raise
        render_error(
            make_console(stderr=True),
            SafeInstallError(
                f"internal error: {type(exc).__name__}: {exc}",
                hint="nothing more was changed; safeinstall --status shows whether a run needs recovery. "
                "Rerun with SAFEINSTALL_DEBUG=1 for the traceback and report it",
            ),
        )
        code = int(ExitCode.REFUSED)
    # Done: the collection Python runs at shutdown would walk every object still alive (a verification
    # of torch leaves 12k results: 0.03 s); frozen, they are freed without it. So nothing may rely on
    # a finalizer (__del__, weakref.finalize) of an object in a cycle to run at exit.
    gc.freeze()
    sys.exit(code)
