"""The fixtures every test module may ask for by name (none imports a fixture from another module).

* ``wheels`` (session): every fixture wheel, built from ``fixtures/packages``; ``venv``: a fresh venv;
* ``big_wheel`` (session): sicext 2.0 with a 160 MiB file, an install slow enough to interrupt;
* ``bed``: sicext 1.0 in a venv, the private systemd manager's units, the fake NVML
  (:class:`tests.beds.Bed`); ``account``: the same owned by uid 65534 (:class:`tests.beds.ServiceAccountBed`);
* ``small_disk``: tmpfs disks of a given size; ``open_dir``, ``open_state``: directories others may enter;
* ``sipure_venv``: a venv with sipure 1.0; ``nobody_interpreter``: a ``bin/python`` path in a directory
  for the service account;
* from the plugins: ``user_manager``, ``units``, ``user_manager_environ`` (:mod:`tests.bed_systemd`),
  ``fake_nvml``, ``fake_nvml_build`` (:mod:`tests.bed_nvml`).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# imported here before pytest loads them as plugins: their asserts (Bed.consistent, Bed.no_trace...)
# still explain themselves (tests.bed_nvml is never rewritten: PYTEST_DONT_REWRITE)
pytest.register_assert_rewrite("tests.beds", "tests.bed_systemd", "tests.bed_system_manager")

from tests import wheelhouse  # noqa: E402
from tests.bed_nvml import FakeNvml  # noqa: E402
from tests.bed_systemd import Units, UserManager  # noqa: E402
from tests.beds import AS_ROOT, Bed, ServiceAccountBed  # noqa: E402

# The real test beds: a private systemd --user manager, and a fake NVML driver built with gcc.
pytest_plugins = ["tests.bed_systemd", "tests.bed_nvml", "tests.bed_leaks", "tests.bed_system_manager"]


@pytest.fixture(scope="session")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> wheelhouse.Wheelhouse:
    """Every fixture wheel, built once per session from fixtures/packages."""
    return wheelhouse.build_all(tmp_path_factory.mktemp("wheelhouse"))


@pytest.fixture
def venv(tmp_path: Path) -> Iterator[Path]:
    """A fresh, empty venv (made by uv); yields its python."""
    yield wheelhouse.make_venv(tmp_path / "venv")


@pytest.fixture(scope="session")
def big_wheel(wheels: wheelhouse.Wheelhouse, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """sicext 2.0 with a large file, so that the install takes long enough to be interrupted."""
    blob = {"sicext/blob.bin": os.urandom(160 * 1024 * 1024)}
    return wheelhouse.rebuilt(wheels["sicext-2"], tmp_path_factory.mktemp("big"), blob, deflate=False)


@pytest.fixture
def bed(
    venv: Path,
    wheels: wheelhouse.Wheelhouse,
    tmp_path: Path,
    units: Units,
    user_manager: UserManager,
    fake_nvml: FakeNvml,
) -> Iterator[Bed]:
    """sicext 1.0 in a venv, the private user manager (units removed at the end), the fake NVML."""
    wheelhouse.uv_install(venv, wheels["sicext-1"])
    made = Bed(venv, tmp_path / "state", user_manager, fake_nvml, wheels, units)
    yield made
    made.cleanup()


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Callable[[int], Path]]:
    """Mounts tmpfs filesystems of the test's own (size in MiB): disks that can be full."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounted: list[Path] = []

    def mount(mib: int, under: Path | None = None) -> Path:
        """A tmpfs of ``mib`` MiB in the test's directory, or in ``under`` (one others may enter)."""
        where = (
            Path(tempfile.mkdtemp(prefix="disk-", dir=under)) if under else tmp_path / f"disk-{len(mounted)}"
        )
        where.mkdir(exist_ok=True)
        options = f"size={mib}m,mode=0755"
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(where)], capture_output=True, text=True
        )
        if done.returncode != 0:
            message = f"cannot mount a tmpfs: {done.stderr.strip()}"
            if os.environ.get("CI"):
                pytest.fail(message)
            pytest.skip(message)
        mounted.append(where)
        return where

    try:
        yield mount
    finally:
        for where in mounted:
            subprocess.run(["umount", "--lazy", str(where)], check=False)


@pytest.fixture
def open_dir() -> Iterator[Path]:
    """A directory others can traverse (pytest's are 0700): the service account's venv lives here."""
    made = Path(tempfile.mkdtemp(prefix="si-hostile-"))
    made.chmod(0o755)
    try:
        yield made
    finally:
        shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def open_state() -> Iterator[Path]:
    """A state directory below directories others may enter (only root writes them)."""
    made = Path(tempfile.mkdtemp(prefix="si-state-"))
    made.chmod(0o755)
    try:
        yield made / "state"
    finally:
        shutil.rmtree(made, ignore_errors=True)


@pytest.fixture
def account(
    open_dir: Path,
    open_state: Path,
    user_manager: UserManager,
    fake_nvml: FakeNvml,
    wheels: wheelhouse.Wheelhouse,
) -> Iterator[ServiceAccountBed]:
    """uid 65534's venv (sicext 1.0) and its unit, running as that uid; skipped unless root."""
    if not AS_ROOT:
        pytest.skip("the attacks are on a run as root")
    made = ServiceAccountBed(open_dir, open_state, user_manager, fake_nvml, wheels)
    yield made
    made.cleanup()


@pytest.fixture
def sipure_venv(venv: Path, wheels: wheelhouse.Wheelhouse) -> Path:
    """A venv with sipure 1.0 (pure Python, no unit)."""
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    return venv


@pytest.fixture
def nobody_interpreter() -> Iterator[Path]:
    """``TOP/bin/python``, a shell script in a directory owned by the service account (no pyvenv.cfg): it
    runs as that account and prints whatever its owner likes (:func:`tests.beds.printing_interpreter`)."""
    top = Path(tempfile.mkdtemp(prefix="si-liar-"))
    try:
        (top / "bin").mkdir()
        yield top / "bin" / "python"
    finally:
        shutil.rmtree(top, ignore_errors=True)
