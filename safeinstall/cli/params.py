"""The command line's parameters, each declared once: its flag, help and default's meaning (typer reads
them from :func:`safeinstall.cli.app.main_command`'s annotations). A run's option is one parameter
here and in ``main_command`` by the name of its :class:`safeinstall.run.options.RunOptions` field:
:func:`safeinstall.run.commands.run_options` takes it from there by that name.
"""

# No ``from __future__ import annotations``: these are objects typer reads at each start.

from pathlib import Path
from typing import Annotated, Any

import typer


def _flag(name: str, help_text: str, *short: str) -> Any:
    return typer.Option(name, *short, help=help_text)


Package = Annotated[
    str | None,
    typer.Argument(
        metavar="REQUIREMENT",
        help="The distribution to reinstall, optionally with a version as uv and pip take it "
        "('vllm==0.16.0', 'vllm>=0.16'); or the one to verify.",
        show_default=False,
    ),
]

Wheel = Annotated[
    Path | None, typer.Option("--wheel", metavar="PATH", help="The wheel to install / compare with.")
]

Python = Annotated[
    str | None,
    typer.Option(
        "--python",
        metavar="PATH",
        help="Target interpreter or venv (default: VIRTUAL_ENV, then python3).",
    ),
]

User = Annotated[bool, _flag("--user", "Talk to the user's systemd manager.")]

WithDeps = Annotated[bool, _flag("--with-deps", "Reinstall dependencies too (uv --reinstall).")]

DryRun = Annotated[
    bool, _flag("--dry-run", "Show the plan (processes, units, GPUs, uv command); change nothing.")
]

KillStrays = Annotated[bool, _flag("--kill-strays", "End processes outside any service (not restarted).")]

OnlyLoaded = Annotated[
    bool,
    _flag(
        "--only-loaded",
        "Stop only processes with certain evidence of the package loaded (mapped, open, argv, "
        "depends), not every process of the environment's Python.",
    ),
]

Strict = Annotated[
    bool,
    _flag(
        "--strict",
        "A process still running replaced code after the restart fails the run (rolled back, exit 3).",
    ),
]

StopTimeout = Annotated[
    float | None,
    typer.Option(
        "--stop-timeout",
        metavar="SECONDS",
        help="Seconds to wait for each unit to stop (default: its TimeoutStopSec).",
    ),
]

GpuTimeout = Annotated[
    float,
    typer.Option("--gpu-timeout", metavar="SECONDS", help="Seconds to wait for GPU memory to be released."),
]

Settle = Annotated[
    float, typer.Option("--settle", metavar="SECONDS", help="Seconds a restarted unit must stay active.")
]

HealthUrl = Annotated[
    str | None,
    typer.Option(
        "--health-url",
        metavar="URL",
        envvar="SAFEINSTALL_HEALTH_URL",
        show_envvar=False,
        help="After the restart, wait until this URL answers 200 (or from SAFEINSTALL_HEALTH_URL: "
        "a URL with a token stays off the command line, which every local user can read).",
    ),
]

HealthTimeout = Annotated[
    float,
    typer.Option(
        "--health-timeout", metavar="SECONDS", help="Seconds to wait for --health-url to answer 200."
    ),
]

NoRestart = Annotated[bool, _flag("--no-restart", "Leave the units stopped after the install.")]

NoSwap = Annotated[
    bool,
    _flag(
        "--no-swap",
        "Install with uv while the units are down, instead of staging the new version before the "
        "stop and renaming it into place (docs/window.md).",
    ),
]

Prune = Annotated[bool, _flag("--prune", "Remove files the old version left behind (kept in the backup).")]

KeepBackups = Annotated[
    int,
    typer.Option(
        "--keep-backups",
        metavar="N",
        help="After a good run, keep this many newest backups of the environment; delete older ones.",
    ),
]

KeepPatches = Annotated[
    bool,
    _flag(
        "--keep-patches",
        "Carry the package's local patches over to the new version (a three-way merge, checked "
        "before anything stops).",
    ),
]

BaseWheel = Annotated[
    Path | None,
    typer.Option(
        "--base-wheel",
        metavar="WHEEL",
        help="With --keep-patches: the wheel of the installed version (default: fetched by uv).",
    ),
]

DropConflicting = Annotated[
    bool,
    _flag(
        "--drop-conflicting",
        "With --keep-patches: carry what merges; drop (and list) the rest instead of refusing.",
    ),
]

AcceptRecordMismatch = Annotated[
    bool,
    _flag(
        "--accept-record-mismatch",
        "With --wheel: install a wheel whose own RECORD is wrong about its members' hashes or sizes "
        "(its packaging's fault); verified against its contents, and kept as the environment's "
        "baseline (--verify-only: wheel-record, not drift).",
    ),
]

Yes = Annotated[bool, _flag("--yes", "Do not ask before stopping anything.", "-y")]

Detach = Annotated[
    bool,
    _flag(
        "--detach",
        "After the preflight, go on as a transient systemd unit that outlives this terminal or SSH "
        "session; prints the run id (follow it with --status --wait).",
    ),
]

VerifyOnly = Annotated[
    bool, _flag("--verify-only", "Only check installed files against RECORD; change nothing.")
]

All = Annotated[bool, _flag("--all", "With --verify-only: every distribution.")]

Diff = Annotated[bool, _flag("--diff", "With --verify-only --wheel: unified diffs of modified files.")]

SavePatch = Annotated[
    Path | None,
    typer.Option(
        "--save-patch", metavar="FILE", help="With --verify-only --wheel: write those diffs to FILE."
    ),
]

Recover = Annotated[
    bool, _flag("--recover", "Finish runs that died (restore, restart units, clear the journal).")
]

Status = Annotated[
    bool, _flag("--status", "Show the run in progress and the last finished runs of each environment.")
]

Wait = Annotated[
    bool,
    _flag(
        "--wait",
        "With --status: follow the current (or latest) run to its end, showing its log; exit with its "
        "exit code and print its result.",
    ),
]

Run = Annotated[
    str | None,
    typer.Option(
        "--run",
        metavar="RUN_ID",
        help="With --status --wait: the run to follow; with --undo: the run to undo.",
    ),
]

Undo = Annotated[
    bool,
    _flag(
        "--undo",
        "Put back what ran before the environment's last run (--run: an older one), byte for byte, "
        "through the same safe sequence (see docs/undo.md).",
    ),
]

Forget = Annotated[
    bool,
    _flag(
        "--forget",
        "Remove the state (backups, logs, history) of environments that no longer exist, or of the one "
        "--python names.",
    ),
]

AsJson = Annotated[bool, _flag("--json", "Print the versioned JSON result on stdout.")]

MetricsFile = Annotated[
    Path | None,
    typer.Option(
        "--metrics-file",
        metavar="FILE",
        help="Also write the result as Prometheus metrics to FILE, atomically, mode 0644 (for "
        "node_exporter's textfile collector): with --verify-only, a run, --recover and --status.",
    ),
]

Verbose = Annotated[
    int,
    typer.Option(
        "--verbose",
        "-v",
        count=True,
        help="Say more: every warning and finding, the plan's evidence chains, each distribution.",
    ),
]

Quiet = Annotated[
    int,
    typer.Option("--quiet", "-q", count=True, help="Say less: no notes, warnings summaries or progress."),
]

ShowVersion = Annotated[bool, _flag("--version", "Print safeinstall's version and exit.", "-V")]

RunId = Annotated[str | None, typer.Option("--run-id", hidden=True)]

EnvironFrom = Annotated[Path | None, typer.Option("--environ-from", hidden=True)]
