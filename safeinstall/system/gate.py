"""The reboot gate: while a run is in progress, its units must not start on a half-installed package.

A drop-in with ``ConditionPathExists=!<state>/<env>/gate`` and the marker file; docs/crash-safety.md.
"""

from __future__ import annotations

from pathlib import Path

GATE_DROPIN = "50-safeinstall-gate"


def gate_marker(envdir: Path) -> Path:
    return envdir / "gate"


def gate_dropin_text(marker: Path, run_id: str) -> str:
    """Pure: the drop-in that keeps a unit from starting while ``marker`` exists."""
    return (
        f"# Written by safeinstall run {run_id}: while {marker} exists, a reinstall of a package this\n"
        "# unit uses is in progress, and the unit must not start on a half-installed package.\n"
        "# `safeinstall --recover` finishes the run and removes this file.\n"
        "[Unit]\n"
        f"ConditionPathExists=!{marker}\n"
    )
