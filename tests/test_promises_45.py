"""Promises of the docs that no test held (issue 45): each test here fails on a one-line mutation of
the check it holds (``bench/mutations.py`` applies them). Real parts: real wheels and uv, the private
systemd --user manager, the fake NVML driver, the console script."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests import wheelhouse
from tests.beds import Bed
from tests.clirun import run

# --- verify: a #!python script's launcher ----------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "inserted"),
    [
        ("short", b"import os; os.system('id')\n"),
        ("short", b"import os\nos.system('id')\n"),
        ("long", b"import os; os.system('id')\n"),
    ],
    ids=["one-line-after-shebang", "two-lines-after-shebang", "one-line-after-sh-launcher"],
)
def test_lines_inserted_between_a_scripts_launcher_and_its_body_are_drift(
    tmp_path: Path, length: str, inserted: bytes
) -> None:
    """The launcher an installer writes in place of ``#!python`` is one shebang line or the three-line
    ``#!/bin/sh`` + ``exec`` form, nothing more: a line (or two) slipped in after it, before the
    wheel's body, is ``modified`` against the wheel (issue 45: up to three lines passed as launcher)."""
    body = b"import sidata\nprint('hi', sidata.X)\n"
    wheel = wheelhouse.make_wheel(
        tmp_path,
        "sidata",
        "1.0",
        {"sidata/__init__.py": b"X = 1\n", "sidata-1.0.data/scripts/hello": b"#!python\n" + body},
    )
    base = tmp_path / ("v" if length == "short" else "v" * 150)
    python = wheelhouse.make_venv(base)
    wheelhouse.uv_install(python, wheel)
    script = base / "bin" / "hello"
    installed = script.read_bytes()
    assert installed.endswith(body)
    launcher = installed[: -len(body)]
    assert launcher.count(b"\n") == (1 if length == "short" else 3)
    assert run("sidata", "--verify-only", "--python", str(python), "--wheel", str(wheel)).code == 0
    script.write_bytes(launcher + inserted + body)
    result = run("sidata", "--verify-only", "--python", str(python), "--wheel", str(wheel), "--json")
    assert result.code == 1, result.stdout + result.stderr
    assert [(f["kind"], f["path"]) for f in result.json["data"]["findings"]] == [("modified", str(script))]


# --- a good run ends 0, whatever signal comes once its result is out ----------------------------------

# A SIGTERM to the process once the run's result is shown: when ``execute`` returns (the result printed,
# the run's handlers put back), or at the last Python code before the interpreter exits (an atexit
# callback, registered first so that it runs last). There the callback does what CPython's finalization
# does next (``_PySignal_Fini``: a signal whose handler is a Python function goes back to SIG_DFL, one
# ignored stays ignored), then sends it: the window the soak hit (seed 3686688892, exit -15).
HOOK_AFTER_RESULT = r"""
import atexit, os, signal, sys, threading
where = sys.argv.pop(1)
sent = []
def term():
    sent.append(True)
    os.kill(os.getpid(), signal.SIGTERM)
def hook(frame, event, arg):
    if not sent and event == "return" and frame.f_code.co_name == "execute" \
            and frame.f_globals.get("__name__") == "safeinstall.run.commands":
        term()
def at_exit():
    if callable(signal.getsignal(signal.SIGTERM)):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    term()
if where == "result-shown":
    sys.setprofile(hook)
else:
    atexit.register(at_exit)
from safeinstall.__main__ import main
sys.argv[0] = "safeinstall"
sys.exit(main())
"""


@pytest.mark.parametrize("where", ["result-shown", "interpreter-exit"])
def test_a_signal_once_a_good_runs_result_is_shown_does_not_change_its_exit(bed: Bed, where: str) -> None:
    """docs/faults.md: a good run ends 0. A SIGTERM after its result is printed (as the command returns,
    or as the interpreter exits) is ignored: exit 0 and the one result, not exit 2 with "nothing was
    changed" after it (the handler before the journal put back) nor a death by SIGTERM (-15)."""
    unit = bed.service("after-result")
    bed.tool = (sys.executable, "-c", HOOK_AFTER_RESULT, where)
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--json")
    assert result.code == 0, (result.code, result.stdout + result.stderr)
    assert result.json["status"] == "done" and result.json["exit_code"] == 0, result.stdout
    assert "error:" not in result.stderr, result.stderr
    assert bed.version() == "2.0" and bed.manager.active_state(unit) == "active"
