"""Run the real ``safeinstall`` console script as a subprocess, as users and scripts do."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SAFEINSTALL = str(Path(sys.executable).parent / "safeinstall")


@dataclass
class Result:
    code: int
    stdout: str
    stderr: str

    @property
    def json(self) -> Any:
        return json.loads(self.stdout)


def run(
    *args: str,
    env: Mapping[str, str] | None = None,
    timeout: float = 120,
    stdin: str = "",
    cwd: Path | None = None,
    tool: Sequence[str] = (SAFEINSTALL,),
) -> Result:
    """``safeinstall ARGS`` (``tool``: the command that is safeinstall, as :func:`tests.beds.hidden_tool`)."""
    full_env = dict(os.environ if env is None else env)
    full_env.setdefault("COLUMNS", "200")
    proc = subprocess.run(
        [*tool, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=full_env,
        timeout=timeout,
        input=stdin,
        check=False,
    )
    return Result(proc.returncode, proc.stdout, proc.stderr)


#: The fields of one finished run in the history (``--status``, ``data.environments[].runs``): the
#: contract of issue 11, stated here once for the tests that check it.
RUN_FIELDS = frozenset(
    {
        "run_id",
        "status",
        "exit_code",
        "package",
        "old_version",
        "new_version",
        "started_at",
        "finished_at",
        "downtime_s",
        "log_file",
        "can_undo",
        "cannot_undo",
        "service_downtime_s",  # issue 34: null without --health-url
    }
)


def verify_all(
    python: Path, state: Path, *args: str, codes: tuple[int, ...] = (0, 1)
) -> tuple[int, dict[str, Any]]:
    """``--verify-only --all --json`` of ``python``'s environment with the state directory ``state``: its
    exit code (one of ``codes``, else the test fails with its standard error) and its document."""
    result = run(
        "--verify-only",
        "--all",
        "--python",
        str(python),
        "--json",
        *args,
        env={**os.environ, "SAFEINSTALL_STATE_DIR": str(state)},
    )
    assert result.code in codes, result.stderr
    return result.code, result.json
