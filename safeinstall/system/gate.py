"""The reboot gate: while a run is in progress, its units must not start on a half-installed package.

Before the stop, each unit gets a persistent drop-in ``50-safeinstall-gate.conf`` with
``ConditionPathExists=!<state>/<env>/gate``, and the marker file ``gate`` is written. If the machine
reboots (or the manager restarts) mid-run, enabled units are skipped at boot instead of starting on
whatever is installed. The marker goes once the package is consistent (verified, or restored), and
the drop-ins go when the run ends; ``safeinstall --recover`` (run at boot by the shipped
``safeinstall-recover.service``) finishes an interrupted run and removes both.
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
