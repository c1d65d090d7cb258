"""Command line: parses the arguments (:mod:`safeinstall.cli.params`), checks them
(:mod:`safeinstall.cli.usage`), calls one command (:func:`safeinstall.run.commands.modes.execute`), renders
its result (:mod:`safeinstall.cli.show`) and exits, in one place. No logic lives here.
"""

# No ``from __future__ import annotations`` in this module: typer reads the options' annotations, and
# given as strings it evaluates every one of them at each start (0.015 s of every command).

import contextlib
import gc
import os
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any, NoReturn

import typer
import typer.core

from safeinstall.cli import params
from safeinstall.cli.render import make_console, render_error
from safeinstall.cli.show import Terminal
from safeinstall.cli.usage import Usage, usage_problem, wheel_package
from safeinstall.errors import ExitCode, SafeInstallError, UsageError
from safeinstall.run.commands.modes import Request, execute
from safeinstall.run.parts.options import Mode, RunOptions
from safeinstall.run.parts.output import command_for, error_json

EXIT_CODES = (
    "Exit codes: 0 success (clean); 1 drift found (--verify-only); 2 could not check, refused or "
    "declined, nothing changed; 3 failed after services were stopped, everything put back (--recover: "
    "the new version did not come up, the previous one was put back); 4 failed and putting things back "
    "failed too (the message lists the commands to finish; --status --wait: the run died without a "
    "result); 5 no drift, but a wheel's fault not acknowledged (--verify-only). --status --wait exits "
    "with the run's own code."
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
        print(error_json(command, error))
    else:
        render_error(make_console(stderr=True), error)
    _exit(error.exit_code)


class _PlainHelp(typer.core.TyperCommand):
    """Help as uv and pip print it: an argument by its name alone (``REQUIREMENT``, no ``<str>``); the
    options in sections, each mode's together (:data:`safeinstall.cli.params.PANELS`)."""

    def format_options(self, ctx: Any, formatter: Any) -> None:
        params_ = self.get_params(ctx)
        sections: dict[str, list[tuple[str, str]]] = {"Arguments": []}
        sections |= {panel: [] for panel in params.PANELS}
        for param in params_:
            if param.param_type_name == "argument" and not getattr(param, "hidden", False):
                help_text = getattr(param, "help", None) or ""
                sections["Arguments"].append((param.metavar or (param.name or "").upper(), help_text))
            elif param.param_type_name == "option" and (record := param.get_help_record(ctx)) is not None:
                panel = getattr(param, "rich_help_panel", None) or "Other options"
                sections.setdefault(panel, []).append(record)
        for title, rows in sections.items():
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
    package: params.Package = None,
    wheel: params.Wheel = None,
    python: params.Python = None,
    user: params.User = False,
    with_deps: params.WithDeps = False,
    dry_run: params.DryRun = False,
    kill_strays: params.KillStrays = False,
    only_loaded: params.OnlyLoaded = False,
    strict: params.Strict = False,
    stop_timeout: params.StopTimeout = None,
    gpu_timeout: params.GpuTimeout = 120.0,
    settle: params.Settle = 5.0,
    health_url: params.HealthUrl = None,
    health_timeout: params.HealthTimeout = 300.0,
    no_restart: params.NoRestart = False,
    no_swap: params.NoSwap = False,
    no_smoke: params.NoSmoke = False,
    smoke: params.Smoke = None,
    smoke_timeout: params.SmokeTimeout = 300.0,
    smoke_skip: params.SmokeSkip = None,
    prune: params.Prune = False,
    keep_backups: params.KeepBackups = 3,
    keep_patches: params.KeepPatches = False,
    base_wheel: params.BaseWheel = None,
    drop_conflicting: params.DropConflicting = False,
    accept_record_mismatch: params.AcceptRecordMismatch = False,
    allow_broken_requirements: params.AllowBrokenRequirements = False,
    yes: params.Yes = False,
    detach_: params.Detach = False,
    verify_only: params.VerifyOnly = False,
    all_: params.All = False,
    full: params.Full = False,
    acknowledge_wheel_faults: params.AcknowledgeWheelFaults = False,
    diff: params.Diff = False,
    save_patch: params.SavePatch = None,
    recover_: params.Recover = False,
    status_: params.Status = False,
    wait: params.Wait = False,
    run: params.Run = None,
    undo_: params.Undo = False,
    forget_: params.Forget = False,
    prepare: params.Prepare = False,
    commit_: params.Commit = False,
    discard_: params.Discard = False,
    prepared_max_age: params.PreparedMaxAge = 86400.0,
    as_json: params.AsJson = False,
    metrics_file: params.MetricsFile = None,
    verbose: params.Verbose = 0,
    quiet: params.Quiet = 0,
    show_version: params.ShowVersion = False,
    run_id: params.RunId = None,
    environ_from: params.EnvironFrom = None,
) -> Usage:
    """Reinstall a Python package safely under the services that use it; or check it (--verify-only).

    Arguments after -- go to uv unchanged (index options and the like)."""
    switches = {
        Mode.VERIFY_ONLY: verify_only,
        Mode.DRY_RUN: dry_run,
        Mode.DETACH: detach_,
        Mode.RECOVER: recover_,
        Mode.STATUS: status_,
        Mode.FORGET: forget_,
        Mode.COMMIT: commit_,
        Mode.DISCARD: discard_,
        Mode.UNDO: undo_,
    }
    modes = frozenset(mode for mode, on in switches.items() if on)
    given = tuple(
        name for name in ctx.params if getattr(ctx.get_parameter_source(name), "name", "") == "COMMANDLINE"
    )
    options = RunOptions(
        package=package or "",  # the requirement as given; the run parses it (run_options)
        python=python,
        wheel=wheel,
        with_deps=with_deps,
        user=user,
        kill_strays=kill_strays,
        stop_timeout=stop_timeout,
        gpu_timeout=gpu_timeout,
        settle=settle,
        health_url=health_url,
        health_timeout=health_timeout,
        no_restart=no_restart,
        prune=prune,
        no_swap=no_swap,
        full=full,
        no_smoke=no_smoke,
        smoke=smoke,
        smoke_timeout=smoke_timeout,
        smoke_skip=tuple(smoke_skip or ()),
        only_loaded=only_loaded,
        strict=strict,
        keep_backups=keep_backups,
        run_id=run_id,
        keep_patches=keep_patches,
        base_wheel=base_wheel,
        drop_conflicting=drop_conflicting,
        accept_record_mismatch=accept_record_mismatch,
        allow_broken_requirements=allow_broken_requirements,
        undo=run if undo_ else None,  # without --run: the last, chosen by the command
        prepare=prepare,
        prepared_max_age=prepared_max_age,
    )
    verbosity = -1 if quiet else 1 if verbose else 0
    terminal = sys.stdin.isatty()
    request = Request(
        modes=modes,
        options=options,
        run=run,
        wait=wait,
        all_=all_,
        diff=diff,
        save_patch=save_patch,
        acknowledge=acknowledge_wheel_faults,
        metrics_file=metrics_file,
        environ_from=environ_from,
        extra_args=tuple(ctx.args),
        yes=yes,
        as_json=as_json,
        verbosity=verbosity,
        interactive=not yes and not as_json and terminal,
        cannot_ask=None if yes or (terminal and not as_json) else _why_not_asked(terminal),
    )
    return Usage(  # the command line parsed, checked by _run
        request=request,
        given=given,
        uv_args=ctx.obj or (),
        verbose=verbose,
        quiet=quiet,
        show_version=show_version,
    )


def _run(usage: Usage) -> NoReturn:
    """Check the command line, call its command, exit with its code."""
    request = usage.request
    try:
        if not usage.given and not request.extra_args:  # as uv: a usage, and its status; on stderr
            typer.echo(params.SHORT_USAGE + "\n", err=True)
            raise UsageError(
                "no REQUIREMENT and no command given",
                hint="safeinstall PACKAGE [--wheel W], safeinstall PACKAGE --verify-only or "
                "safeinstall --status (see safeinstall --help)",
            )
        problem = usage_problem(usage)
        if problem is not None:
            raise problem
        if usage.show_version:
            print(f"safeinstall {_tool_version()}")
            _exit(ExitCode.OK)
        wheel = request.options.wheel
        if not request.options.package and not request.all_ and wheel is not None:  # the wheel names it
            named = replace(request.options, package=wheel_package(wheel) or "")
            request = replace(request, options=named)
        code = execute(request, Terminal(request.as_json, request.verbosity))
    except SafeInstallError as error:
        _fail(error, request.command, request.as_json)
    _exit(code)


def _why_not_asked(terminal: bool) -> str:
    """Pure: why a run without --yes cannot ask before it stops units (it is then refused, as apt): on a
    terminal, only --json keeps it from asking."""
    if terminal:
        return "--json does not ask (it does not imply --yes)"
    return "standard input is not a terminal to ask on"


def _split_at_dashes(argv: Sequence[str]) -> tuple[list[str], tuple[str, ...]]:
    """The arguments before ``--`` (safeinstall's) and after it (uv's)."""
    at = argv.index("--") if "--" in argv else len(argv)
    return list(argv[:at]), tuple(argv[at + 1 :])


def _usage_error(exc: typer.TyperException) -> UsageError:
    """A parsing error of Typer/click, as every other error: one line and a hint (a number's option given
    what is none: that option's own words and hint)."""
    if isinstance(exc, params.NotANumber):
        return UsageError(exc.problem.message, hint=exc.problem.hint)
    message = " ".join(exc.format_message().split()).rstrip(".")
    return UsageError(message[:1].lower() + message[1:], hint="see safeinstall --help")


def _main(argv: list[str]) -> int:
    words, uv_args = _split_at_dashes(argv)
    try:
        parsed = app(args=argv, prog_name="safeinstall", standalone_mode=False, obj=uv_args)
    except typer.TyperException as exc:  # unknown option, missing value, bad value
        _fail(_usage_error(exc), command_for(set(words)), "--json" in words)
    if isinstance(parsed, Usage):
        _run(parsed)
    return int(parsed or 0)  # --help, --show-completion


def main() -> None:
    try:
        code = _main(sys.argv[1:])
    except typer.Exit as done:
        code = done.exit_code
    except SafeInstallError as error:  # a signal while the command line was parsed (signals.py)
        if "--json" in sys.argv[1:]:
            print(error_json(command_for(set(sys.argv[1:])), error))
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
