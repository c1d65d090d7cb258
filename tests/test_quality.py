"""The project's own checks run with the tests: ruff (lint and format) and mypy --strict must be clean."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def test_ruff_clean() -> None:
    result = subprocess.run(
        [str(BIN / "ruff"), "check", "safeinstall", "tests", "bench", "ansible_collections"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_clean() -> None:
    result = subprocess.run([str(BIN / "mypy"), "--strict"], cwd=ROOT, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_clean() -> None:
    result = subprocess.run(
        [str(BIN / "ruff"), "format", "--check", "safeinstall", "tests", "bench", "ansible_collections"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stdout + result.stderr
