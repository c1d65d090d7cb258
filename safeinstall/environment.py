"""The target Python environment: which interpreter, and where its files live.

The interpreter is asked for its paths in isolated mode (``-I``) with an empty environment, so nothing
the target environment's variables say (PYTHONPATH, PYTHONHOME, ...) is trusted.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from safeinstall import children
from safeinstall.errors import InterpreterError

_PROBE = r"""
import json, sys, sysconfig
paths = sysconfig.get_paths()
print(json.dumps({
    "executable": sys.executable,
    "prefix": sys.prefix,
    "base_prefix": sys.base_prefix,
    "purelib": paths["purelib"],
    "platlib": paths["platlib"],
    "scripts": paths["scripts"],
    "data": paths["data"],
    "version": [sys.version_info[0], sys.version_info[1], sys.version_info[2]],
    "implementation": sys.implementation.name,
    "soabi": sysconfig.get_config_var("SOABI"),
    "ext_suffix": sysconfig.get_config_var("EXT_SUFFIX"),
    "platform": sysconfig.get_platform(),
}))
"""


@dataclass(frozen=True, slots=True)
class Environment:
    python: Path  # the interpreter as given/resolved (symlink kept: it is how the venv is named)
    executable: Path
    prefix: Path
    base_prefix: Path
    purelib: Path
    platlib: Path
    scripts: Path
    data: Path
    version: tuple[int, int, int]
    implementation: str
    soabi: str | None
    platform: str

    @property
    def site_dirs(self) -> tuple[Path, ...]:
        return (self.purelib,) if self.purelib == self.platlib else (self.purelib, self.platlib)

    @property
    def is_venv(self) -> bool:
        return self.prefix != self.base_prefix


def resolve_python(given: str | None, environ: Mapping[str, str]) -> Path:
    """Find the interpreter the way uv does: ``--python``, then ``VIRTUAL_ENV``, then ``python3``.

    ``given`` may be an interpreter or a virtual environment directory.
    """
    if given:
        candidate = Path(given).expanduser()
        if candidate.is_dir():
            interpreter = candidate / "bin" / "python"
            if not interpreter.exists():
                raise InterpreterError(
                    f"{candidate} is a directory but holds no bin/python",
                    hint="pass a virtual environment directory or the path of a python executable",
                )
            return interpreter.absolute()
        if candidate.exists():
            return candidate.absolute()
        found = shutil.which(given, path=environ.get("PATH"))
        if found:
            return Path(found)
        raise InterpreterError(
            f"no such interpreter: {given}",
            hint="pass --python with a python executable or a virtual environment directory",
        )
    venv = environ.get("VIRTUAL_ENV")
    if venv:
        interpreter = Path(venv) / "bin" / "python"
        if interpreter.exists():
            return interpreter
    found = shutil.which("python3", path=environ.get("PATH"))
    if found:
        return Path(found)
    raise InterpreterError(
        "no python interpreter found (no --python, no VIRTUAL_ENV, no python3 on PATH)",
        hint="pass --python PATH",
    )


def inspect_environment(python: Path, timeout: float = 30.0) -> Environment:
    """Ask ``python`` (isolated, empty environment) for its installation paths."""
    try:
        proc = children.run(
            [str(python), "-I", "-c", _PROBE],
            env={"PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"},
            timeout=timeout,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InterpreterError(
            f"could not run {python}: {exc}",
            hint="check that --python names a working interpreter",
        ) from exc
    if proc.returncode != 0:
        raise InterpreterError(
            f"{python} failed to report its paths: {proc.stderr.strip()[-400:]}",
            hint="check that --python names a working Python 3 interpreter",
        )
    try:
        info = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise InterpreterError(f"{python} printed something unexpected: {proc.stdout[:200]!r}") from exc
    major, minor, micro = (int(part) for part in info["version"])
    return Environment(
        python=python,
        executable=Path(info["executable"]),
        prefix=Path(os.path.realpath(info["prefix"])),
        base_prefix=Path(os.path.realpath(info["base_prefix"])),
        purelib=Path(os.path.realpath(info["purelib"])),
        platlib=Path(os.path.realpath(info["platlib"])),
        scripts=Path(os.path.realpath(info["scripts"])),
        data=Path(os.path.realpath(info["data"])),
        version=(major, minor, micro),
        implementation=str(info["implementation"]),
        soabi=info.get("soabi"),
        platform=str(info["platform"]),
    )
