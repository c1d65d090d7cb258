"""Promises of the docs that no test held (issue 45): each test here fails on a one-line mutation of
the check it holds (``bench/mutations.py`` applies them). Real parts: real wheels and uv, the private
systemd --user manager, the fake NVML driver, the console script."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import wheelhouse
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
