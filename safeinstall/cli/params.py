"""The command line's parameters, each declared once: its flag, help and default's meaning."""

# No ``from __future__ import annotations``: these are objects typer reads at each start.

from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any

import typer

from safeinstall.run.parts.options import OptionProblem, keep_backups_problem, seconds_problem

#: The sections of ``--help``, in order: each mode's options together (``cli/app.py: _PlainHelp``).
MODES = "Commands (one at most; none: reinstall)"
TARGET = "What and where"
RUN = "A run (reinstall, --undo; shown by --dry-run, --detach)"
PATCHES = "Local patches (a run)"
VERIFY = "--verify-only"
STATUS = "--status"
OUTPUT = "Output"
PANELS = (MODES, TARGET, RUN, PATCHES, VERIFY, STATUS, OUTPUT)

#: ``safeinstall`` with no arguments: the commands, not every option (``--help`` lists those).
SHORT_USAGE = """\
Usage: safeinstall REQUIREMENT [--wheel W] [--python PY] [OPTIONS] [-- UV_ARGS]

  safeinstall PACKAGE [--wheel W]      reinstall it under the services that use it
  safeinstall PACKAGE --dry-run        show the plan; change nothing
  safeinstall PACKAGE --verify-only    check its installed files; change nothing
  safeinstall --status [--wait]        the run in progress and the last runs
  safeinstall --undo --python PY       put back what ran before the last run
  safeinstall PACKAGE --prepare        everything before the stop; then --commit (or --discard)

Commands: --dry-run, --detach, --verify-only, --recover, --status, --undo, --forget, --commit, --discard
(at most one; none: reinstall). safeinstall --help lists every option, by command."""


def _flag(name: str, help_text: str, panel: str, *short: str) -> Any:
    return typer.Option(name, *short, help=help_text, rich_help_panel=panel)


def _value(
    name: str, metavar: str, help_text: str, panel: str, parser: Callable[[Any], Any] | None = None
) -> Any:
    return typer.Option(name, metavar=metavar, help=help_text, rich_help_panel=panel, parser=parser)


class NotANumber(typer.BadParameter):
    """A number's option given what is no number: said as its own usage error (``cli/app.py``), in the
    words of a value out of range (:func:`safeinstall.run.parts.options.option_problems`)."""

    def __init__(self, problem: OptionProblem) -> None:
        super().__init__(problem.message)
        self.problem = problem


def _number(kind: Callable[[Any], Any], problem: Callable[[str], OptionProblem]) -> Callable[[Any], Any]:
    def parse(value: Any) -> Any:
        try:
            return kind(value)
        except ValueError:
            raise NotANumber(problem(str(value))) from None

    return parse


def _seconds(name: str, help_text: str, panel: str) -> Any:
    """An option given in seconds (``--settle S``): one that is no number, its own usage error."""
    return _value(
        name, "SECONDS", help_text, panel, _number(float, lambda shown: seconds_problem(name, shown))
    )


Package = Annotated[
    str | None,
    typer.Argument(
        metavar="REQUIREMENT",
        help="The distribution to reinstall, optionally with a version as uv and pip take it "
        "('vllm==0.16.0', 'vllm>=0.16'); or the one to verify.",
        show_default=False,
    ),
]

Wheel = Annotated[Path | None, _value("--wheel", "PATH", "The wheel to install / compare with.", TARGET)]

Python = Annotated[
    str | None,
    _value("--python", "PY", "Target interpreter or venv (default: VIRTUAL_ENV, then python3).", TARGET),
]

User = Annotated[bool, _flag("--user", "Talk to the user's systemd manager.", TARGET)]

WithDeps = Annotated[bool, _flag("--with-deps", "Reinstall dependencies too (uv --reinstall).", RUN)]

DryRun = Annotated[
    bool, _flag("--dry-run", "Show the plan (processes, units, GPUs, uv command); change nothing.", MODES)
]

KillStrays = Annotated[
    bool, _flag("--kill-strays", "End processes outside any service (not restarted).", RUN)
]

OnlyLoaded = Annotated[
    bool,
    _flag(
        "--only-loaded",
        "Stop only processes with certain evidence of the package loaded (mapped, open, argv, "
        "depends), not every process of the environment's Python.",
        RUN,
    ),
]

Strict = Annotated[
    bool,
    _flag(
        "--strict",
        "A process still running replaced code after the restart fails the run (rolled back, exit 3).",
        RUN,
    ),
]

StopTimeout = Annotated[
    float | None,
    _seconds("--stop-timeout", "Seconds to wait for each unit to stop (default: its TimeoutStopSec).", RUN),
]

GpuTimeout = Annotated[
    float, _seconds("--gpu-timeout", "Seconds to wait for GPU memory to be released.", RUN)
]

Settle = Annotated[float, _seconds("--settle", "Seconds a restarted unit must stay active.", RUN)]

HealthUrl = Annotated[
    str | None,
    typer.Option(
        "--health-url",
        metavar="URL",
        envvar="SAFEINSTALL_HEALTH_URL",
        show_envvar=False,
        help="After the restart, wait until this URL answers 200 (or from SAFEINSTALL_HEALTH_URL: "
        "a URL with a token stays off the command line, which every local user can read).",
        rich_help_panel=RUN,
    ),
]

HealthTimeout = Annotated[
    float, _seconds("--health-timeout", "Seconds to wait for --health-url to answer 200.", RUN)
]

NoRestart = Annotated[bool, _flag("--no-restart", "Leave the units stopped after the install.", RUN)]

NoSwap = Annotated[
    bool,
    _flag(
        "--no-swap",
        "Install with uv while the units are down, instead of staging the new version before the "
        "stop and renaming it into place (docs/window.md).",
        RUN,
    ),
]

NoSmoke = Annotated[
    bool,
    _flag(
        "--no-smoke",
        "Do not import the new version before the stop (as the environment's account, with the "
        "unit's environment; docs/reinstall.md).",
        RUN,
    ),
]

Smoke = Annotated[
    str | None,
    _value(
        "--smoke",
        "CMD",
        "Also run CMD (through /bin/sh -c) that way before the stop; a failure refuses the run, "
        "e.g. --smoke \"python -c 'import vllm._C'\".",
        RUN,
    ),
]

SmokeSkip = Annotated[
    list[str] | None,
    _value(
        "--smoke-skip",
        "MODULE",
        "Do not import MODULE (and its submodules) in the check: one known bad; repeatable.",
        RUN,
    ),
]

SmokeTimeout = Annotated[
    float, _seconds("--smoke-timeout", "Seconds each import check or --smoke may take.", RUN)
]

Prune = Annotated[
    bool, _flag("--prune", "Remove files the old version left behind (kept in the backup).", RUN)
]

KeepBackups = Annotated[
    int,
    _value(
        "--keep-backups",
        "N",
        "After a good run, keep this many newest backups of the environment; delete older ones.",
        RUN,
        _number(int, keep_backups_problem),
    ),
]

KeepPatches = Annotated[
    bool,
    _flag(
        "--keep-patches",
        "Carry the package's local patches over to the new version (a three-way merge, checked "
        "before anything stops).",
        PATCHES,
    ),
]

BaseWheel = Annotated[
    Path | None,
    _value(
        "--base-wheel",
        "WHEEL",
        "With --keep-patches: the wheel of the installed version (default: fetched by uv).",
        PATCHES,
    ),
]

DropConflicting = Annotated[
    bool,
    _flag(
        "--drop-conflicting",
        "With --keep-patches: carry what merges; drop (and list) the rest instead of refusing.",
        PATCHES,
    ),
]

AllowBrokenRequirements = Annotated[
    bool,
    _flag(
        "--allow-broken-requirements",
        "Go on with a run that leaves a requirement of the environment unmet (as `uv pip check` would "
        "say it); without it such a run is refused before anything stops.",
        RUN,
    ),
]

AcceptRecordMismatch = Annotated[
    bool,
    _flag(
        "--accept-record-mismatch",
        "With --wheel: install a wheel whose own RECORD is wrong about its members' hashes or sizes "
        "(its packaging's fault); verified against its contents, and kept as the environment's "
        "baseline (--verify-only: wheel-record, not drift).",
        RUN,
    ),
]

Yes = Annotated[bool, _flag("--yes", "Do not ask before stopping anything.", RUN, "-y")]

Detach = Annotated[
    bool,
    _flag(
        "--detach",
        "After the preflight, go on as a transient systemd unit that outlives this terminal or SSH "
        "session; prints the run id (follow it with --status --wait).",
        MODES,
    ),
]

VerifyOnly = Annotated[
    bool, _flag("--verify-only", "Only check installed files against RECORD; change nothing.", MODES)
]

All = Annotated[bool, _flag("--all", "With --verify-only: every distribution.", VERIFY)]

#: A run's option too: the parameter's name is the RunOptions field's (``full``).
Full = Annotated[
    bool,
    _flag(
        "--full",
        "Read and hash every file again: take no hash kept from an earlier check of an unchanged "
        "inode (docs/verify.md). With --verify-only or a run.",
        VERIFY,
        "--no-cache",
    ),
]

AcknowledgeWheelFaults = Annotated[
    bool,
    _flag(
        "--acknowledge-wheel-faults",
        "With --verify-only: root keeps each wheel-fault found (a file never changed since its install "
        "that its wheel's own RECORD is wrong about) as the file is now; it is quiet (exit 0) until the "
        "file changes (docs/verify.md).",
        VERIFY,
    ),
]

Diff = Annotated[
    bool, _flag("--diff", "With --verify-only --wheel: unified diffs of modified files.", VERIFY)
]

SavePatch = Annotated[
    Path | None,
    _value("--save-patch", "FILE", "With --verify-only --wheel: write those diffs to FILE.", VERIFY),
]

Recover = Annotated[
    bool, _flag("--recover", "Finish runs that died (restore, restart units, clear the journal).", MODES)
]

Status = Annotated[
    bool, _flag("--status", "Show the run in progress and the last finished runs of each environment.", MODES)
]

Wait = Annotated[
    bool,
    _flag(
        "--wait",
        "With --status: follow the current (or latest) run to its end, showing its log; exit with its "
        "exit code and print its result.",
        STATUS,
    ),
]

Run = Annotated[
    str | None,
    _value(
        "--run",
        "RUN_ID",
        "With --status --wait: the run to follow; with --undo: the run to undo; with --forget: the "
        "run whose kept backup to drop.",
        STATUS,
    ),
]

Undo = Annotated[
    bool,
    _flag(
        "--undo",
        "Put back what ran before the environment's last run (--run: an older one), byte for byte, "
        "through the same safe sequence (see docs/undo.md).",
        MODES,
    ),
]

Prepare = Annotated[
    bool,
    _flag(
        "--prepare",
        "Do everything before the stop (preflight, backup, prefetch and staging, smoke check), stop nothing, "
        "and keep the run for --commit (see docs/prepare.md).",
        RUN,
    ),
]

Commit = Annotated[
    bool,
    _flag(
        "--commit",
        "Go on with the environment's prepared run: checked unchanged since --prepare, then the stop, the "
        "swap, the restart and the checks after. Takes only the window's options.",
        MODES,
    ),
]

Discard = Annotated[
    bool,
    _flag(
        "--discard",
        "Drop the environment's prepared run: its staging tree, uv cache, wheel copy and journal (its "
        "backup is kept with the others).",
        MODES,
    ),
]

PreparedMaxAge = Annotated[
    float,
    _seconds("--prepared-max-age", "With --commit: refuse a prepared run older than this.", RUN),
]

Forget = Annotated[
    bool,
    _flag(
        "--forget",
        "Remove the state (backups, logs, history) of environments that no longer exist, or of the one "
        "--python names; with --run RUN_ID, only that run's kept backup.",
        MODES,
    ),
]

AsJson = Annotated[bool, _flag("--json", "Print the versioned JSON result on stdout.", OUTPUT)]

MetricsFile = Annotated[
    Path | None,
    _value(
        "--metrics-file",
        "FILE",
        "Also write the result as Prometheus metrics to FILE, atomically, mode 0644 (for "
        "node_exporter's textfile collector): with --verify-only, a run, --recover and --status.",
        OUTPUT,
    ),
]

Verbose = Annotated[
    int,
    typer.Option(
        "--verbose",
        "-v",
        count=True,
        help="Say more: every warning and finding, the plan's evidence chains, each distribution.",
        rich_help_panel=OUTPUT,
    ),
]

Quiet = Annotated[
    int,
    typer.Option(
        "--quiet",
        "-q",
        count=True,
        help="Say less: no notes, warnings summaries or progress.",
        rich_help_panel=OUTPUT,
    ),
]

ShowVersion = Annotated[bool, _flag("--version", "Print safeinstall's version and exit.", OUTPUT, "-V")]

RunId = Annotated[str | None, typer.Option("--run-id", hidden=True)]

EnvironFrom = Annotated[Path | None, typer.Option("--environ-from", hidden=True)]
