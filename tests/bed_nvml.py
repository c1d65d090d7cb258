"""Test bed for NVML: the fake ``libnvidia-ml.so.1`` of ``fixtures/fake_nvml``, driven by the real pynvml.

Test-bed code, not safeinstall's. The library is compiled with gcc once per session (a full build and a
``-DFAKE_NVML_NO_V3`` build); each test gets a fresh config directory (:class:`FakeNvml`) that the library
re-reads on every call (see ``fixtures/fake_nvml/README.md`` for the format).

pynvml loads its library once per process, so in-process tests all share the full build (the
``fake_nvml`` fixture sets ``SAFEINSTALL_NVML_LIBRARY`` and ``FAKE_NVML_DIR``); a test that needs another
build, or no library at all, runs its NVML part in a subprocess (:func:`snapshot_in_subprocess`).

Holders are real processes (:func:`holder_process`), killed by their own PID.

Used as a plugin (``pytest_plugins = ("tests.bed_nvml",)``) after the test module imported it, so it is
not assert-rewritten: PYTEST_DONT_REWRITE (and it raises AssertionError itself where it checks).
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pynvml
import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCE = ROOT / "fixtures" / "fake_nvml" / "fake_nvml.c"
SONAME = "libnvidia-ml.so.1"
LIBRARY_ENV = "SAFEINSTALL_NVML_LIBRARY"
DIR_ENV = "FAKE_NVML_DIR"

MiB = 2**20
GiB = 2**30
#: A PID far above any pid_max default: never a process of this namespace.
HOST_PID_BASE = 3_900_000


@dataclass(frozen=True)
class FakeNvmlBuild:
    library: Path
    library_no_v3: Path


def build_library(out_dir: Path, *defines: str) -> Path:
    """Compile ``fake_nvml.c`` into ``out_dir/libnvidia-ml.so.1`` (soname libnvidia-ml.so.1)."""
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        raise FileNotFoundError("no C compiler (gcc/cc) on PATH to build the fake NVML library")
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / SONAME
    subprocess.run(
        [
            gcc,
            "-shared",
            "-fPIC",
            "-O1",
            "-Wall",
            *(f"-D{d}" for d in defines),
            f"-Wl,-soname,{SONAME}",
            "-o",
            str(out),
            str(SOURCE),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    return out


def build_all(out_dir: Path) -> FakeNvmlBuild:
    return FakeNvmlBuild(build_library(out_dir / "full"), build_library(out_dir / "no_v3", "FAKE_NVML_NO_V3"))


def process_start_time(pid: int) -> int:
    """Field 22 of /proc/<pid>/stat (clock ticks since boot), as the fake library compares it."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat[stat.rindex(")") + 2 :].split()[19])


def _write(path: Path, text: str) -> None:
    """Atomic: the library may read the file at any moment (from this or another process)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


@dataclass
class _FakeGpu:
    name: str
    uuid: str
    total: int
    reserved: int
    used: int


class FakeNvml:
    """One fake NVML configuration directory."""

    def __init__(self, directory: Path, library: Path) -> None:
        self.directory = directory
        self.library = library
        self._gpus: list[_FakeGpu] = []
        self._errors: dict[str, int] = {}
        (directory / "procs").mkdir(parents=True, exist_ok=True)
        self._write_gpus()

    # -- environment
    @property
    def env(self) -> dict[str, str]:
        return {LIBRARY_ENV: str(self.library), DIR_ENV: str(self.directory)}

    def env_with(self, library: Path) -> dict[str, str]:
        """This configuration served by another build (e.g. ``FakeNvmlBuild.library_no_v3``)."""
        return {**self.env, LIBRARY_ENV: str(library)}

    # -- GPUs
    def add_gpu(self, name: str, uuid: str, total: int, reserved: int = 512 * MiB, used: int = 0) -> int:
        """A GPU; ``used`` is its baseline (v2) used memory besides holders. Returns its index."""
        self._gpus.append(_FakeGpu(name, uuid, total, reserved, used))
        self._write_gpus()
        return len(self._gpus) - 1

    def set_used(self, index: int, used: int) -> None:
        """Change a GPU's baseline used memory (e.g. memory the driver has not freed yet)."""
        self._gpus[index].used = used
        self._write_gpus()

    def _write_gpus(self) -> None:
        lines = [f"{g.uuid} {g.total} {g.reserved} {g.used} {g.name}\n" for g in self._gpus]
        _write(self.directory / "gpus", "# uuid total reserved used name\n" + "".join(lines))

    # -- holders
    def hold(
        self,
        pid: int,
        gpu_index: int = 0,
        nbytes: int | None = None,
        linger: float = 0.0,
        start: int | None = None,
    ) -> None:
        """``pid`` holds ``nbytes`` (None = N/A) on a GPU while alive, then ``linger`` seconds more.

        ``start`` defaults to the process's start time (so a reused PID does not count); 0 = no check.
        """
        if start is None:
            start = process_start_time(pid)
        mem = "NA" if nbytes is None else str(nbytes)
        self._add_holding(pid, f"gpu={gpu_index} mem={mem} linger={linger} start={start}\n")

    def host_pid(self, gpu_index: int = 0, nbytes: int | None = None, pid: int | None = None) -> int:
        """A holder whose PID does not exist in this PID namespace (as NVML reports from a container)."""
        if pid is None:
            taken = {int(f.name) for f in (self.directory / "procs").iterdir() if f.name.isdigit()}
            pid = next(
                p
                for p in range(HOST_PID_BASE, HOST_PID_BASE + 10_000)
                if p not in taken and not Path(f"/proc/{p}").exists()
            )
        mem = "NA" if nbytes is None else str(nbytes)
        self._add_holding(pid, f"gpu={gpu_index} mem={mem} host=1\n")
        return pid

    def unhold(self, pid: int) -> None:
        for path in (self.directory / "procs" / str(pid), self.directory / "procs" / f"{pid}.dead_at"):
            path.unlink(missing_ok=True)

    def _add_holding(self, pid: int, line: str) -> None:
        path = self.directory / "procs" / str(pid)
        _write(path, (path.read_text() if path.exists() else "") + line)

    # -- errors
    def inject_error(self, function: str, code: int) -> None:
        """``function`` (an NVML symbol, e.g. nvmlDeviceGetComputeRunningProcesses_v3) returns ``code``."""
        self._errors[function] = code
        self._write_errors()

    def clear_error(self, function: str) -> None:
        self._errors.pop(function, None)
        self._write_errors()

    def set_init_error(self, code: int = pynvml.NVML_ERROR_DRIVER_NOT_LOADED) -> None:
        self.inject_error("nvmlInitWithFlags", code)
        self.inject_error("nvmlInit_v2", code)

    def _write_errors(self) -> None:
        _write(self.directory / "errors", "".join(f"{fn} {code}\n" for fn, code in self._errors.items()))

    def set_driver_version(self, version: str) -> None:
        _write(self.directory / "driver_version", version + "\n")

    def set_persistence_mode(self, index: int, enabled: bool) -> None:
        """A GPU's persistence mode (``nvmlDeviceGetPersistenceMode``); every GPU has it on until set."""
        path = self.directory / "persistence_mode"
        uuid = self._gpus[index].uuid
        text = path.read_text() if path.exists() else ""
        lines = [line for line in text.splitlines() if line.split()[:1] != [uuid]]
        _write(path, "".join(f"{ln}\n" for ln in [*lines, f"{uuid} {int(enabled)}"]))


# ---------------------------------------------------------------------------------------------- processes


@contextmanager
def holder_process(seconds: int = 60) -> Iterator[subprocess.Popen[bytes]]:
    """A real, idle process; killed (by its PID) and reaped on exit unless already gone."""
    proc = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])
    try:
        yield proc
    finally:
        kill(proc)


def kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the process we started (by PID) and reap it."""
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)


# ---------------------------------------------------------------------------------------------- subprocess

_SNAPSHOT_SCRIPT = (
    "import json; from safeinstall.system.gpus import snapshot_gpus; "
    "from safeinstall.run.parts.output import jsonable; print(json.dumps(jsonable(snapshot_gpus())))"
)


def snapshot_in_subprocess(env: Mapping[str, str | None]) -> dict[str, Any]:
    """``snapshot_gpus().to_dict()`` in a fresh interpreter (its own pynvml state).

    ``env`` is applied over this process's environment with the NVML variables removed; a None value
    removes a variable.
    """
    full = {k: v for k, v in os.environ.items() if k not in (LIBRARY_ENV, DIR_ENV)}
    for key, value in env.items():
        if value is None:
            full.pop(key, None)
        else:
            full[key] = value
    done = subprocess.run(
        [sys.executable, "-c", _SNAPSHOT_SCRIPT],
        env=full,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    if done.returncode != 0:
        raise AssertionError(f"snapshot subprocess failed ({done.returncode}):\n{done.stderr}")
    result: dict[str, Any] = json.loads(done.stdout)
    return result


def pynvml_loaded_other_library(library: Path) -> bool:
    """True if pynvml in this process already loaded an NVML library that is not ``library``."""
    loaded = pynvml.nvmlLib
    if loaded is None:
        return False
    return bool(loaded._handle != ctypes.CDLL(str(library))._handle)


# ---------------------------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="session")
def fake_nvml_build(tmp_path_factory: pytest.TempPathFactory) -> FakeNvmlBuild:
    """Both builds of the fake library, compiled once per session."""
    if shutil.which("gcc") is None and shutil.which("cc") is None:
        pytest.skip("no C compiler to build the fake NVML library")
    return build_all(tmp_path_factory.mktemp("fake_nvml_lib"))


@pytest.fixture
def fake_nvml(fake_nvml_build: FakeNvmlBuild, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FakeNvml:
    """A fresh, empty fake NVML (no GPU yet) for in-process use: both env vars set via monkeypatch."""
    if pynvml_loaded_other_library(fake_nvml_build.library):
        pytest.skip("pynvml already loaded another NVML library in this process")
    fake = FakeNvml(tmp_path / "fake_nvml", fake_nvml_build.library)
    for key, value in fake.env.items():
        monkeypatch.setenv(key, value)
    return fake
