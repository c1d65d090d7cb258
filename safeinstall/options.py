"""What the user asked for, as parsed by the command line: one typed value for every run."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class RunOptions:
    """Everything the user asked for, as parsed by the CLI."""

    package: str
    python: str | None = None
    wheel: Path | None = None
    version_spec: str | None = None
    with_deps: bool = False
    user: bool = False
    kill_strays: bool = False
    extra_args: tuple[str, ...] = ()
    stop_timeout: float | None = None  # None: each unit's own TimeoutStopSec
    gpu_timeout: float = 120.0
    settle: float = 5.0
    health_url: str | None = None
    health_timeout: float = 300.0
    no_restart: bool = False
    prune: bool = False
    keep_backups: int = 3  # safeinstall.retention.DEFAULT_KEEP: backups kept per environment
    keep_patches: bool = False  # carry the package's local patches over to the new version
    base_wheel: Path | None = None  # --keep-patches: the installed version's wheel (else fetched by uv)
    drop_conflicting: bool = False  # --keep-patches: drop what cannot be carried instead of refusing
    proc_root: Path = Path("/proc")
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))
