"""What a new user meets first (issue 42's review): a caller that cannot reach what it names gets an
``error:`` and a ``hint:`` it can act on, never "internal error"."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import wheelhouse
from tests.beds import NOBODY

SAFEINSTALL = Path(sys.executable).parent / "safeinstall"


@pytest.fixture
def open_dirs() -> Iterator[tuple[Path, Path]]:
    """A directory anyone may enter and one only root may (outside pytest's 0700 temporary tree)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the tool as another user")
    shared, private = Path(tempfile.mkdtemp()), Path(tempfile.mkdtemp())
    shared.chmod(0o755)
    try:
        yield shared, private
    finally:
        shutil.rmtree(shared)
        shutil.rmtree(private)


def test_an_interpreter_the_caller_may_not_reach_is_an_error_with_a_hint(
    open_dirs: tuple[Path, Path],
) -> None:
    """A venv whose bin/python links into a directory the caller may not enter (uv's and pyenv's
    interpreters live in their owner's home): said, not an internal error (PermissionError)."""
    shared, private = open_dirs
    (shared / "venv" / "bin").mkdir(parents=True)
    (private / "python").symlink_to(sys.executable)
    (shared / "venv" / "bin" / "python").symlink_to(private / "python")
    state = shared / "state"
    state.mkdir()
    os.chown(state, NOBODY, NOBODY)
    done = subprocess.run(
        ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups",
         str(SAFEINSTALL), "--verify-only", "--all", "--python", str(shared / "venv")],
        env={"PATH": os.defpath, "HOME": str(state), "SAFEINSTALL_STATE_DIR": str(state), "COLUMNS": "200"},
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode == 2, done.stdout + done.stderr
    assert "internal error" not in done.stderr, done.stderr
    assert f"error: cannot reach {shared / 'venv' / 'bin' / 'python'}: permission denied" in done.stderr
    assert "hint: run as root" in done.stderr


def test_a_user_in_its_own_venv_gets_the_swap_its_plan_promised(
    open_dirs: tuple[Path, Path], wheels: wheelhouse.Wheelhouse
) -> None:
    """Not root, in a venv of its own: the staging directory is the caller's (not uid 0's), so the run
    swaps as its plan said, instead of installing in the window."""
    shared, _ = open_dirs
    interpreter = wheelhouse.shared_interpreter()
    if interpreter is None:
        pytest.skip("no interpreter every user may run")
    for name in ("sipure-1", "sipure-2"):
        shutil.copy(wheels[name], shared)
    home = shared / "home"
    home.mkdir()
    os.chown(shared, NOBODY, NOBODY)
    os.chown(home, NOBODY, NOBODY)
    env = {"PATH": f"{Path(wheelhouse.UV).parent}:{os.defpath}", "HOME": str(home), "COLUMNS": "200"}
    env |= {"UV_CACHE_DIR": str(home / "uv-cache"), "UV_NO_PROGRESS": "1"}

    def as_nobody(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", *argv],
            env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    made = as_nobody(wheelhouse.UV, "venv", "-q", "--python", interpreter, str(shared / "v"))
    assert made.returncode == 0, made.stderr
    first = as_nobody(wheelhouse.UV, "pip", "install", "-q", "--python", str(shared / "v"),
                      str(shared / wheels["sipure-1"].name))  # fmt: skip
    assert first.returncode == 0, first.stderr
    args = ("sipure", "--python", str(shared / "v"), "--wheel", str(shared / wheels["sipure-2"].name))
    plan = as_nobody(str(SAFEINSTALL), *args, "--dry-run", "--json")
    assert plan.returncode == 0, plan.stdout + plan.stderr
    done = as_nobody(str(SAFEINSTALL), *args, "--yes", "--json")
    assert done.returncode == 0, done.stdout + done.stderr
    data = json.loads(done.stdout)["data"]
    log = Path(data["log_file"]).read_text()
    assert "no swap" not in log, log
    assert "verify-in-place" in [step["name"] for step in data["steps"]], log  # only after a swap
