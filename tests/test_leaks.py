"""The session's end check (tests/bed_leaks.py) fails a suite that leaves a process or a mount behind."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

LEAKY = """
import os
import subprocess
from pathlib import Path


def test_leaves_a_daemon(tmp_path: Path) -> None:
    subprocess.Popen(["setsid", "sleep", "600"], start_new_session=True)


def test_leaves_state_in_the_machines_directory(tmp_path: Path) -> None:
    # what a run told no SAFEINSTALL_STATE_DIR leaves for an environment of the test's
    state = Path("/var/lib/safeinstall") / f"venv-leak-{os.environ['LEAK_TAG']}"
    state.mkdir(parents=True)
    (state / "prefix").write_text(str(tmp_path / "venv"))


def test_leaves_a_mount(tmp_path: Path) -> None:
    (tmp_path / "disk").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(tmp_path / "disk")], check=True)
"""

CLEAN = """
import subprocess


def test_leaves_nothing() -> None:
    subprocess.run(["sleep", "0"], check=True)
"""


def _suite(tmp_path: Path, text: str, tag: str = "") -> subprocess.CompletedProcess[str]:
    (tmp_path / "test_inner.py").write_text(text)
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = {k: v for k, v in os.environ.items() if k != "SAFEINSTALL_TEST_SESSION"}
    env |= {"PYTHONPATH": str(ROOT), "SAFEINSTALL_TEST_LEAK_GRACE_S": "1", "LEAK_TAG": tag}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "tests.bed_leaks", "-p", "no:cacheprovider",
         "-c", str(tmp_path / "pytest.ini"), "--rootdir", str(tmp_path),
         "--basetemp", str(tmp_path / "base"), str(tmp_path / "test_inner.py")],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def test_a_suite_that_leaves_a_daemon_a_mount_or_state_fails_and_is_cleaned_up(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    tag = uuid.uuid4().hex  # another suite may run this test at the same time
    done = _suite(tmp_path, LEAKY, tag)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "3 passed" in done.stdout
    assert (
        f"leak: /var/lib/safeinstall/venv-leak-{tag} " in done.stdout
        and "(a run without SAFEINSTALL_STATE_DIR)" in done.stdout
    )
    assert not (Path("/var/lib/safeinstall") / f"venv-leak-{tag}").exists()  # removed by the check
    assert "leak: process" in done.stdout and "sleep 600" in done.stdout
    assert f"leak: mount {tmp_path / 'base'}" in done.stdout and "/disk outlived the suite" in done.stdout
    with open("/proc/self/mountinfo") as mountinfo:  # unmounted by the check
        assert str(tmp_path / "base") not in mountinfo.read()


def test_a_suite_that_leaves_nothing_passes(tmp_path: Path) -> None:
    done = _suite(tmp_path, CLEAN)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "leak:" not in done.stdout
