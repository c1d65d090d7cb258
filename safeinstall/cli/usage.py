"""The command line's one validation: :func:`usage_problem` says why a command line does not make sense
(a :class:`UsageError`, exit 2), before anything is read.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from pathlib import Path

from safeinstall.errors import UsageError
from safeinstall.run.commands.modes import Request
from safeinstall.run.parts.options import PLAIN_NAME, Mode, flag_of

#: The modes that each choose what safeinstall does: no two of them go together (--undo is a run's).
MODES = tuple(mode for mode in Mode if mode is not Mode.UNDO)

#: The commands that take no PACKAGE.
_NO_PACKAGE = (Mode.RECOVER, Mode.STATUS, Mode.FORGET, Mode.COMMIT, Mode.DISCARD)

#: The modes that run nothing: an option of a run given with one of them would do nothing.
_NOT_A_RUN = (Mode.VERIFY_ONLY, Mode.STATUS, Mode.RECOVER, Mode.FORGET, Mode.DISCARD)

#: The options that only a run (its --dry-run, --detach, --undo) uses, by parameter name (:func:`flag_of`).
#: (--keep-patches and --accept-record-mismatch have errors of their own; --user and --yes are
#: taken by every mode, as a script's habit.)
RUN_ONLY = (
    "with_deps",
    "kill_strays",
    "only_loaded",
    "strict",
    "stop_timeout",
    "gpu_timeout",
    "settle",
    "health_url",
    "health_timeout",
    "no_restart",
    "no_swap",
    "prune",
    "keep_backups",
    "allow_broken_requirements",
    "smoke",
    "no_smoke",
    "smoke_timeout",
    "smoke_skip",
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Usage:
    """What the command line gave, as the validation needs it: the request, and what only the
    validation reads."""

    request: Request
    given: tuple[str, ...] = ()  # the parameters given on the command line, by name
    uv_args: tuple[str, ...] = ()  # the arguments after -- (the request's extra_args end with them)
    verbose: int = 0
    quiet: int = 0
    show_version: bool = False


#: The options of the window and after (docs/prepare.md): ``--commit`` takes them, ``--prepare`` not
WINDOW = ("stop_timeout", "gpu_timeout", "settle", "health_url", "health_timeout")
#: What ``--commit`` takes besides the window's options (the rest was fixed by ``--prepare``)
_COMMIT_TAKES = frozenset(
    {"commit_", "detach_", "python", "user", "yes", "as_json", "prepared_max_age", "verbose", "quiet"}
    | {"metrics_file", "environ_from"}
    | set(WINDOW)
)


def _prepare_problem(u: Usage) -> UsageError | None:
    """Pure: ``--prepare``, ``--commit`` and ``--prepared-max-age`` given with what they cannot take."""
    r, o = u.request, u.request.options
    commit = Mode.COMMIT in r.modes
    if "prepared_max_age" in u.given and not commit:
        return UsageError(
            "--prepared-max-age goes with --commit", hint="safeinstall --commit --prepared-max-age 3600"
        )
    if commit:
        extra = sorted(name for name in u.given if name not in _COMMIT_TAKES | {"package"})
        if extra:  # a PACKAGE: as for every command that takes none (below)
            flags = [flag_of(name) for name in extra]
            return UsageError(
                f"--commit takes only the window's options, not {' '.join(flags)}: "
                "the rest was fixed by --prepare",
                hint="safeinstall --commit [--python PY] [--yes] [--user] [--settle S] [--health-url URL] "
                "[--stop-timeout S] [--gpu-timeout S] [--json]; or --discard and prepare again",
            )
        return None
    if not o.prepare:
        return None
    other = next((mode for mode in Mode if mode in r.modes), None)
    if other is not None:
        return UsageError(
            f"--prepare does not go with {other}",
            hint="safeinstall PACKAGE [--wheel W] --prepare [--python PY]",
        )
    if o.keep_patches:
        return UsageError(
            "--prepare does not carry local patches (--keep-patches) yet",
            hint="run it in one go: safeinstall PACKAGE --wheel W --keep-patches",
        )
    window = [flag_of(name) for name in WINDOW if name in u.given]
    if window:
        return UsageError(
            f"{' '.join(window)} {'is' if len(window) == 1 else 'are'} for the window: give "
            f"{'it' if len(window) == 1 else 'them'} to --commit",
            hint=f"safeinstall --commit --python PY {' '.join(window)} ...",
        )
    return None


def mode_conflict(flags: Collection[Mode]) -> UsageError | None:
    """Pure: the usage error of two modes given together (None: at most one). None takes precedence
    over another in silence: ``--status --forget`` would otherwise forget, ``--verify-only --dry-run``
    only verify."""
    given = [flag for flag in MODES if flag in flags]
    if len(given) < 2 or set(given) == {Mode.COMMIT, Mode.DETACH}:  # a commit may be detached
        return None
    if set(given) == {Mode.DRY_RUN, Mode.DETACH}:
        return UsageError("--dry-run changes nothing: there is nothing to detach", hint="drop --detach")
    return UsageError(
        f"{' and '.join(given)} do not go together: each chooses what safeinstall does",
        hint=f"give one of {', '.join(given)}: each is a command of its own (see safeinstall --help)",
    )


def wheel_package(wheel: Path) -> str | None:
    """Pure: the distribution a wheel's file name names (``vllm-0.16.0-cp38-abi3-...whl`` -> ``vllm``);
    None for a name that is not a wheel's. The wheel itself is checked against it at preflight."""
    from packaging.utils import parse_wheel_filename

    try:
        return str(parse_wheel_filename(wheel.name)[0])
    except ValueError:  # InvalidWheelFilename, or a version of over 4,300 digits (int() refuses)
        return None


def _metrics_problem(u: Usage) -> UsageError | None:
    r = u.request
    if not (r.modes & {Mode.DRY_RUN, Mode.FORGET, Mode.UNDO, Mode.DETACH}) and not r.wait:
        return None
    return UsageError(
        "--metrics-file goes with --verify-only, a run (not --detach), --recover or --status (not --wait)",
        hint="e.g. safeinstall --verify-only --all --python PY --metrics-file "
        "/var/lib/node_exporter/textfile_collector/safeinstall.prom (see docs/metrics.md)",
    )


def _idle_options(u: Usage) -> UsageError | None:
    """Pure: a run's options given with a mode that runs nothing (``--verify-only --settle 30``): they
    would do nothing, in silence, as ``--all`` would without ``--verify-only``."""
    r = u.request
    mode = next((flag for flag in _NOT_A_RUN if flag in r.modes), None)
    idle = [flag_of(name) for name in RUN_ONLY if name in u.given]
    if mode is None or not idle:
        return None
    return UsageError(
        f"{', '.join(idle)} {'does' if len(idle) == 1 else 'do'} nothing with {mode}: "
        f"{'it is' if len(idle) == 1 else 'they are'} for a run (and its --dry-run, --detach, --undo)",
        hint=f"drop {' '.join(idle)}, or give {'it' if len(idle) == 1 else 'them'} to the run: "
        "safeinstall PACKAGE --wheel W [OPTIONS]",
    )


def _smoke_problem(u: Usage) -> UsageError | None:
    """Pure: ``--no-smoke`` given with an option of the check it skips (which would do nothing)."""
    idle = [flag_of(name) for name in _SMOKE_OPTIONS if name in u.given]
    if "no_smoke" not in u.given or not idle:
        return None
    return UsageError(
        f"{', '.join(idle)} {'does' if len(idle) == 1 else 'do'} nothing with --no-smoke: "
        "there is no check to shape",
        hint=f"drop --no-smoke to run the check with {' '.join(idle)}, or drop {' '.join(idle)}",
    )


def _health_problem(u: Usage) -> UsageError | None:
    """Pure: ``--health-timeout`` without a health URL (``--health-url``, ``SAFEINSTALL_HEALTH_URL``), which
    it bounds the wait for: it would do nothing. (A detached run's URL is in its ``--environ-from`` file.)"""
    r = u.request
    if "health_timeout" not in u.given or r.options.health_url is not None or r.environ_from is not None:
        return None
    return UsageError(
        "--health-timeout bounds the wait for --health-url to answer 200: without a URL it does nothing",
        hint="give the URL with it (--health-url URL, or SAFEINSTALL_HEALTH_URL to keep a token off the "
        "command line), or drop --health-timeout",
    )


#: The options of the smoke check, which ``--no-smoke`` skips whole.
_SMOKE_OPTIONS = ("smoke", "smoke_timeout", "smoke_skip")


def usage_problem(u: Usage) -> UsageError | None:
    """Pure: why this command line does not make sense, the first reason in the order a user reads
    it; None when it does. What needs the environment (the run ``--undo`` names, the wheel itself, uv's
    options) is checked later, by the command."""
    r, o = u.request, u.request.options
    if u.verbose and u.quiet:
        return UsageError("-v and -q do not go together", hint="give one of --verbose, --quiet")
    if u.show_version:
        if list(u.given) == ["show_version"] and not r.extra_args:
            return None
        return UsageError(
            "--version prints safeinstall's version and takes nothing else",
            hint="to install a version, give it in the requirement: safeinstall 'vllm==0.16.0'",
        )
    conflict = mode_conflict(r.modes)
    if conflict is not None:
        return conflict
    status = Mode.STATUS in r.modes
    forget = Mode.FORGET in r.modes
    if r.wait and not status:
        return UsageError("--wait goes with --status", hint="safeinstall --status --wait [--run RUN_ID]")
    if r.run and Mode.UNDO not in r.modes and not forget and not status:
        return UsageError(
            "--run goes with --status --wait, --undo or --forget",
            hint="safeinstall --status --wait --run RUN_ID; safeinstall --undo --run RUN_ID; "
            "safeinstall --forget --python PY --run RUN_ID",
        )
    if forget and r.run and "python" not in u.given:
        return UsageError(
            "--forget --run drops one kept backup of the environment --python names",
            hint="safeinstall --forget --python PY --run RUN_ID",
        )
    if r.metrics_file and (problem := _metrics_problem(u)) is not None:
        return problem
    prepared = _prepare_problem(u)
    if prepared is not None:
        return prepared
    idle = _idle_options(u) or _smoke_problem(u) or _health_problem(u)
    if idle is not None:
        return idle
    hashing = next((flag for flag in _NOT_A_RUN[1:] if flag in r.modes), None)
    if hashing is not None and "full" in u.given:
        return UsageError(
            f"--full does nothing with {hashing}: it is for what hashes files (--verify-only, a run)",
            hint="drop --full",
        )
    own = next((flag for flag in _NO_PACKAGE if flag in r.modes), None)
    if own is not None:
        if r.package or r.extra_args:
            command = own.removeprefix("--")
            return UsageError(
                f"--{command} takes no PACKAGE", hint=f"safeinstall --{command} [--python PY] [--json]"
            )
        if status and r.run and not r.wait:
            return UsageError(
                "--run goes with --status --wait", hint="safeinstall --status --wait --run RUN_ID"
            )
        return None
    verify = Mode.VERIFY_ONLY in r.modes
    if r.all_ and not verify:
        return UsageError(
            "--all goes with --verify-only", hint="safeinstall --verify-only --all [--python PY]"
        )
    if r.acknowledge and (not verify or o.wheel is not None):
        return UsageError(
            "--acknowledge-wheel-faults goes with --verify-only, without --wheel (against the wheel, "
            "its fault is wheel-record: checked every time, nothing to acknowledge)",
            hint="safeinstall --verify-only --all --acknowledge-wheel-faults [--python PY]",
        )
    if (r.diff or r.save_patch) and not verify:
        return UsageError(
            "--diff and --save-patch go with --verify-only",
            hint=f"safeinstall {r.package or 'PACKAGE'} --verify-only --wheel W --diff [--save-patch FILE]",
        )
    if Mode.UNDO in r.modes:
        return None  # its package and run come from the history; what it cannot honour, said by --undo
    if (o.base_wheel or o.drop_conflicting) and not o.keep_patches:
        return UsageError(
            "--base-wheel and --drop-conflicting go with --keep-patches",
            hint=f"safeinstall {r.package or 'PACKAGE'} --wheel W --keep-patches [--base-wheel W]",
        )
    if o.accept_record_mismatch and (o.wheel is None or verify):
        return UsageError(
            "--accept-record-mismatch goes with a run's --wheel",
            hint=f"safeinstall {r.package or 'PACKAGE'} --wheel W --accept-record-mismatch [--dry-run]",
        )
    if o.keep_patches and verify:
        return UsageError(
            "--keep-patches is for the reinstall (and its --dry-run)",
            hint="run it without --verify-only: the merge is checked before anything stops, "
            "and a patch that cannot be carried refuses the run (exit 2)",
        )
    if r.package and r.package.endswith(".whl") and "@" not in r.package:  # a wheel's path, as requirement
        named = wheel_package(Path(r.package))
        return UsageError(
            f"{r.package!r} is a wheel file, not a requirement",
            hint=f"give the wheel with --wheel: safeinstall {named or 'NAME'} --wheel {r.package}",
        )
    if verify:
        if r.all_ and r.package:
            return UsageError(
                "give either a PACKAGE or --all, not both", hint="safeinstall --verify-only --all"
            )
        if not r.all_ and not r.package and not (o.wheel is not None and wheel_package(o.wheel)):
            return UsageError(
                "no PACKAGE given", hint="safeinstall PACKAGE --verify-only, or --all for everything"
            )
        if (r.diff or r.save_patch) and o.wheel is None:
            return UsageError(
                "--diff and --save-patch compare against a wheel's contents",
                hint="add --wheel PATH (the wheel that was installed)",
            )
        if r.all_ and o.wheel is not None:
            return UsageError("--wheel checks one package", hint="name the package instead of --all")
        if r.extra_args:
            return UsageError(
                f"unexpected arguments: {' '.join(r.extra_args)}", hint="see safeinstall --help"
            )
        if r.package and not PLAIN_NAME.fullmatch(r.package):
            from safeinstall.run.parts.options import requirement_version  # more than a valid name: parsed

            if requirement_version(r.package):
                return UsageError(
                    "--verify-only checks the installed version; give the name without a version",
                    hint="safeinstall NAME --verify-only [--wheel PATH]",
                )
        return None
    if not r.package and not (o.wheel is not None and wheel_package(o.wheel)):
        return UsageError("no PACKAGE given", hint="safeinstall PACKAGE [--wheel W] (see --help)")
    stray = r.extra_args[: max(0, len(r.extra_args) - len(u.uv_args))]  # the requirement may follow --
    if stray:  # uv would take them as more requirements: `safeinstall vllm torch` installing torch
        return UsageError(
            f"unexpected arguments: {' '.join(stray)}",
            hint="one REQUIREMENT per run; uv's own arguments go after --: "
            "safeinstall PACKAGE [--wheel W] -- UV_ARGS",
        )
    return None
