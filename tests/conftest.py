from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import wheelhouse

# The real test beds: a private systemd --user manager, and a fake NVML driver built with gcc.
pytest_plugins = ["tests.bed_systemd", "tests.bed_nvml"]


@pytest.fixture(scope="session")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> wheelhouse.Wheelhouse:
    """Every fixture wheel, built once per session from fixtures/packages."""
    return wheelhouse.build_all(tmp_path_factory.mktemp("wheelhouse"))


@pytest.fixture
def venv(tmp_path: Path) -> Iterator[Path]:
    """A fresh, empty venv (made by uv); yields its python."""
    yield wheelhouse.make_venv(tmp_path / "venv")
