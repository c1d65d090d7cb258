"""Command line: parses arguments and renders results. No logic lives here."""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer

from safeinstall.environment import inspect_environment, resolve_python
from safeinstall.errors import ExitCode, SafeInstallError, UsageError
from safeinstall.options import RunOptions
from safeinstall.output import dumps, envelope, finding_json, jsonable, plan_json, run_json
from safeinstall.render import (
    ConsoleReporter,
    make_console,
    render_error,
    render_plan,
    render_recoveries,
    render_result,
    render_status,
    render_verify,
)
from safeinstall.verify import VerifyReport, verify_environment

if TYPE_CHECKING:
    from safeinstall.wheel import Wheel

EXIT_CODES = (
    "Exit codes: 0 success (clean); 1 drift found (--verify-only); 2 could not check or refused, "
    "nothing changed; 3 failed after services were stopped, everything put back; 4 failed and putting "
    "things back failed too (the message lists the commands to finish)."
)

app = typer.Typer(add_completion=False, context_settings={"help_option_names": ["-h", "--help"]})


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


def _verify_json(report: VerifyReport, patch: str | None) -> dict[str, Any]:
    findings = [finding_json(f) for f in report.findings]
    return {
        "python": report.python,
        "prefix": report.prefix,
        "wheel": jsonable(report.wheel),
        "distributions": [
            {
                "name": d.name,
                "version": d.version,
                "dist_info": d.dist_info,
                "files_checked": d.files_checked,
                "against": d.against,
                "drift": d.drift,
            }
            for d in report.distributions
        ],
        "findings": findings,
        "summary": {
            "distributions": len(report.distributions),
            "files_checked": sum(d.files_checked for d in report.distributions),
            "drift": sum(1 for f in report.findings if f.is_drift),
            "warnings": sum(1 for f in report.findings if not f.is_drift),
        },
        "patch": patch,
    }


def _run_verify(
    package: str | None,
    all_: bool,
    python: str | None,
    wheel: Path | None,
    diff: bool,
    save_patch: Path | None,
    as_json: bool,
) -> None:
    if all_ and package:
        raise UsageError("give either a PACKAGE or --all, not both", hint="safeinstall --verify-only --all")
    if not all_ and not package:
        raise UsageError(
            "no PACKAGE given", hint="safeinstall PACKAGE --verify-only, or --all for everything"
        )
    if (diff or save_patch) and wheel is None:
        raise UsageError(
            "--diff and --save-patch compare against a wheel's contents",
            hint="add --wheel PATH (the wheel that was installed)",
        )
    if all_ and wheel is not None:
        raise UsageError("--wheel checks one package", hint="name the package instead of --all")
    env = inspect_environment(resolve_python(python, os.environ))
    err = make_console(stderr=True)
    names = None if all_ else [package or ""]
    read: Wheel | None = None
    if wheel is not None:
        from safeinstall.wheel import read_wheel

        read = read_wheel(wheel)
    if err.is_terminal:  # rich.progress is loaded only for a terminal: scripts start faster
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

            report = verify_environment(env, names, read, on_progress)
    else:
        report = verify_environment(env, names, read)
    diffs = None
    if wheel is not None and (diff or save_patch):
        from safeinstall.diffs import diffs_for, patch_text

        diffs = diffs_for(report.findings, wheel, Path(report.prefix))
    patch = None if diffs is None else patch_text(diffs)
    if save_patch is not None:
        save_patch.write_text(patch or "", encoding="utf-8")
    if as_json:
        status = "drift" if report.drift else "clean"
        print(
            dumps(envelope("verify", status, report.exit_code, _verify_json(report, patch if diff else None)))
        )
    else:
        render_verify(make_console(), err, report, diffs if diff else None)
        if save_patch is not None:
            err.print(
                f"patch of {sum(1 for d in diffs or [] if d.text)} modified files written to {save_patch}"
            )
    _exit(report.exit_code)


def _run_reinstall(options: RunOptions, as_json: bool, interactive: bool) -> None:
    from safeinstall.reinstall import run_reinstall

    out, err = make_console(), make_console(stderr=True)
    result = run_reinstall(options, ConsoleReporter(out, err, quiet=as_json), interactive)
    with contextlib.suppress(OSError):  # the terminal may be gone (SIGHUP): the exit code still tells
        if as_json:
            errors = [result.error] if result.error else []
            print(dumps(envelope("reinstall", result.status, result.exit_code, run_json(result), errors)))
        else:
            render_result(out, err, result)
    _exit(result.exit_code)


def _run_recover(python: str | None, as_json: bool) -> None:
    from safeinstall.recover import recover

    outcome = recover(os.environ, python)
    code = outcome.exit_code
    if as_json:
        data = {"recoveries": jsonable(outcome.recoveries)}
        status = "recovered" if code == ExitCode.OK else "error"
        print(dumps(envelope("recover", status, code, data, list(outcome.failures))))
    else:
        render_recoveries(make_console(), list(outcome.recoveries))
        err = make_console(stderr=True)
        for failure in outcome.failures:
            render_error(err, failure)
    _exit(code)


def _run_status(python: str | None, as_json: bool) -> None:
    from safeinstall.recover import status

    found = status(os.environ, python)
    pending = any(s.needs_recovery for s in found)
    if as_json:
        state = "needs-recovery" if pending else "running" if any(s.running for s in found) else "idle"
        print(dumps(envelope("status", state, ExitCode.OK, {"environments": jsonable(found)})))
    else:
        render_status(make_console(), found)
    _exit(ExitCode.OK)


def _run_dry_run(options: RunOptions, as_json: bool) -> None:
    from safeinstall.survey import survey

    result = survey(options)
    plan = result.plan
    code = ExitCode.OK if plan.proceeds else ExitCode.REFUSED
    if as_json:
        status = "would-proceed" if plan.proceeds else "would-refuse"
        print(dumps(envelope("dry-run", status, code, plan_json(plan))))
    else:
        render_plan(make_console(), make_console(stderr=True), plan)
    _exit(code)


@app.command(
    context_settings={"allow_extra_args": True, "ignore_unknown_options": False},
    epilog=EXIT_CODES,
    no_args_is_help=True,
)
def main_command(
    ctx: typer.Context,
    package: Annotated[str | None, typer.Argument(help="The distribution to reinstall or verify.")] = None,
    wheel: Annotated[
        Path | None, typer.Option("--wheel", help="The wheel to install / compare with.")
    ] = None,
    version_spec: Annotated[
        str | None,
        typer.Option("--version", help="Install this version (e.g. 2.0 or '>=2') from the configured index."),
    ] = None,
    python: Annotated[
        str | None,
        typer.Option("--python", help="Target interpreter or venv (default: VIRTUAL_ENV, then python3)."),
    ] = None,
    user: Annotated[bool, typer.Option("--user", help="Talk to the user's systemd manager.")] = False,
    with_deps: Annotated[
        bool, typer.Option("--with-deps", help="Reinstall dependencies too (uv --reinstall).")
    ] = False,
    dry_run: Annotated[
        bool,
        typer.Option("--dry-run", help="Show the plan (processes, units, GPUs, uv command); change nothing."),
    ] = False,
    kill_strays: Annotated[
        bool, typer.Option("--kill-strays", help="End processes outside any service (not restarted).")
    ] = False,
    stop_timeout: Annotated[
        float | None,
        typer.Option(
            "--stop-timeout", help="Seconds to wait for each unit to stop (default: its TimeoutStopSec)."
        ),
    ] = None,
    gpu_timeout: Annotated[
        float, typer.Option("--gpu-timeout", help="Seconds to wait for GPU memory to be released.")
    ] = 120.0,
    settle: Annotated[
        float, typer.Option("--settle", help="Seconds a restarted unit must stay active.")
    ] = 5.0,
    health_url: Annotated[
        str | None, typer.Option("--health-url", help="After the restart, wait until this URL answers 200.")
    ] = None,
    health_timeout: Annotated[
        float, typer.Option("--health-timeout", help="Seconds to wait for --health-url to answer 200.")
    ] = 300.0,
    no_restart: Annotated[
        bool, typer.Option("--no-restart", help="Leave the units stopped after the install.")
    ] = False,
    prune: Annotated[
        bool, typer.Option("--prune", help="Remove files the old version left behind (kept in the backup).")
    ] = False,
    keep_backups: Annotated[
        int,
        typer.Option(
            "--keep-backups",
            min=1,
            help="After a good run, keep this many newest backups of the environment; delete older ones.",
        ),
    ] = 3,
    yes: Annotated[bool, typer.Option("--yes", "-y", help="Do not ask before stopping anything.")] = False,
    verify_only: Annotated[
        bool, typer.Option("--verify-only", help="Only check installed files against RECORD; change nothing.")
    ] = False,
    all_: Annotated[bool, typer.Option("--all", help="With --verify-only: every distribution.")] = False,
    diff: Annotated[
        bool, typer.Option("--diff", help="With --wheel: unified diffs of modified files.")
    ] = False,
    save_patch: Annotated[
        Path | None, typer.Option("--save-patch", help="With --wheel: write those diffs to FILE.")
    ] = None,
    recover_: Annotated[
        bool,
        typer.Option("--recover", help="Finish runs that died (restore, restart units, clear the journal)."),
    ] = False,
    status_: Annotated[
        bool, typer.Option("--status", help="Show whether a run is in progress or needs recovery.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the versioned JSON result on stdout.")
    ] = False,
) -> None:
    """Reinstall a Python package safely under the services that use it; or check it (--verify-only).

    Arguments after -- go to uv unchanged (index options and the like).
    """
    command = (
        "verify"
        if verify_only
        else "dry-run"
        if dry_run
        else "recover"
        if recover_
        else "status"
        if status_
        else "reinstall"
    )
    try:
        if recover_ or status_:
            if package or ctx.args:
                raise UsageError(
                    f"--{command} takes no PACKAGE", hint=f"safeinstall --{command} [--python PATH] [--json]"
                )
            if recover_:
                _run_recover(python, as_json)
            _run_status(python, as_json)
        if verify_only:
            if ctx.args:
                raise UsageError(f"unexpected arguments: {' '.join(ctx.args)}", hint="see safeinstall --help")
            _run_verify(package, all_, python, wheel, diff, save_patch, as_json)
        if not package:
            raise UsageError("no PACKAGE given", hint="safeinstall PACKAGE [--wheel W] (see --help)")
        if wheel is not None and version_spec is not None:
            raise UsageError("give --wheel or --version, not both", hint="see safeinstall --help")
        options = RunOptions(
            package=package,
            python=python,
            wheel=wheel.absolute() if wheel else None,
            version_spec=version_spec,
            with_deps=with_deps,
            user=user,
            kill_strays=kill_strays,
            extra_args=tuple(ctx.args),
            stop_timeout=stop_timeout,
            gpu_timeout=gpu_timeout,
            settle=settle,
            health_url=health_url,
            health_timeout=health_timeout,
            no_restart=no_restart,
            prune=prune,
            keep_backups=keep_backups,
        )
        if dry_run:
            _run_dry_run(options, as_json)
        _run_reinstall(options, as_json, interactive=not yes and not as_json and sys.stdin.isatty())
    except SafeInstallError as error:
        _fail(error, command, as_json)


def main() -> None:
    try:
        app()
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        sys.exit(130)
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
        sys.exit(int(ExitCode.REFUSED))
