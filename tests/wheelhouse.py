"""Real wheels built from ``fixtures/packages`` and real venvs made and filled by the real uv.

Test-bed code, not safeinstall's: it builds with setuptools (no build isolation, so no network) and
installs with ``uv pip install --offline``.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import uv

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "fixtures" / "packages"
UV = uv.find_uv_bin()

#: fixture key -> source directory name under fixtures/packages
SOURCES = {
    "sipure-1": "sipure-1",
    "sipure-2": "sipure-2",
    "sicext-1": "sicext-1",
    "sicext-2": "sicext-2",
    "sins-a": "sins-a",
    "sins-b": "sins-b",
}


def build_wheel(source: Path, out_dir: Path) -> Path:
    """Build one wheel from a copy of ``source`` (the fixture tree stays clean)."""
    work = out_dir / f".src-{source.name}"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(source, work)
    before = set(out_dir.glob("*.whl"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(out_dir),
            str(work),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    shutil.rmtree(work, ignore_errors=True)
    built = set(out_dir.glob("*.whl")) - before
    assert len(built) == 1, built
    return built.pop()


@dataclass(frozen=True)
class Wheelhouse:
    directory: Path
    wheels: dict[str, Path]

    def __getitem__(self, key: str) -> Path:
        return self.wheels[key]


def build_all(out_dir: Path) -> Wheelhouse:
    out_dir.mkdir(parents=True, exist_ok=True)
    wheels = {key: build_wheel(PACKAGES / name, out_dir) for key, name in SOURCES.items()}
    return Wheelhouse(out_dir, wheels)


def uv_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env["UV_NO_PROGRESS"] = "1"
    return env


def make_venv(path: Path) -> Path:
    """A fresh venv made by uv; returns its python."""
    subprocess.run(
        [UV, "venv", "--quiet", "--python", sys.executable, str(path)],
        check=True,
        capture_output=True,
        text=True,
        env=uv_env(),
    )
    return path / "bin" / "python"


def uv_install(python: Path, *wheels: Path, link_mode: str = "copy", reinstall: bool = False) -> None:
    cmd = [UV, "pip", "install", "--quiet", "--offline", "--python", str(python), "--link-mode", link_mode]
    if reinstall:
        cmd.append("--reinstall")
    subprocess.run([*cmd, *map(str, wheels)], check=True, capture_output=True, text=True, env=uv_env())


def site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())
