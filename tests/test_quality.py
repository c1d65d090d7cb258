"""The project's own checks run with the tests: ruff (lint and format) and mypy --strict must be clean."""

from __future__ import annotations

import ast
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


def _imports_of_test_modules(path: Path) -> list[str]:
    """The ``tests.test_*`` modules ``path`` imports (``from tests.test_x import y``, ``import tests.test_x``,
    ``from tests import test_x``, ``from . import test_x``, ``from .test_x import y``)."""
    found: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if alias.name.startswith("tests.test_")]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if module.startswith(("tests.test_", ".test_")):
                found.append(module)
            elif module in ("tests", "."):
                found += [f"{module}.{alias.name}" for alias in node.names if alias.name.startswith("test_")]
    return found


def test_no_test_module_imports_from_another() -> None:
    """Beds, fixtures and helpers live in shared modules (tests/beds.py, tests/conftest.py, ...): a test
    module never imports from another test module."""
    found = {
        str(path.relative_to(ROOT)): imported
        for path in sorted((ROOT / "tests").rglob("*.py"))
        if (imported := _imports_of_test_modules(path))
    }
    assert found == {}, "move what they share into tests/beds.py or tests/conftest.py"


def test_every_mutation_of_the_audit_still_applies() -> None:
    """``bench/mutations.py --check`` (issue 35): each mutation's text is still in its file as many times
    as it says and each test it names is there; nothing is run. One the code moved past (the ``--forget``
    checks went from ``run/back/recover.py`` to ``run/commands/status.py``) fails here, not in an audit months
    on."""
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "mutations.py"), "--check"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
