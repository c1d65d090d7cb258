"""What the user asked for, as parsed by the command line: one typed value for every run."""

from __future__ import annotations

import math
import os
import re
import urllib.parse
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from pathlib import Path

from safeinstall.errors import UsageError, one_line

#: A valid distribution name (PEP 508) and nothing else: such a PACKAGE needs no requirement parser.
PLAIN_NAME = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]*[A-Za-z0-9])?")


class Mode(StrEnum):
    """The flags that choose what safeinstall does, each as its long flag (none: a reinstall)."""

    VERIFY_ONLY = "--verify-only"
    DRY_RUN = "--dry-run"
    DETACH = "--detach"
    RECOVER = "--recover"
    STATUS = "--status"
    FORGET = "--forget"
    COMMIT = "--commit"
    DISCARD = "--discard"
    UNDO = "--undo"


def flag_of(name: str) -> str:
    """Pure: the long flag of a parameter (``with_deps``: ``--with-deps``; ``commit_``: ``--commit``)."""
    return "--" + name.rstrip("_").replace("_", "-")


@dataclass(frozen=True, slots=True, kw_only=True)
class RunOptions:
    """Everything the user asked for, as parsed by the CLI."""

    package: str  # the distribution's name, as the requirement spelled it
    python: str | None = None
    wheel: Path | None = None
    version_spec: str | None = None  # the requirement's specifier ("==0.16.0", ">=0.16"); None: none
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
    #: install with uv in the window instead of swapping a staged version in (safeinstall.env.renames)
    no_swap: bool = False
    #: --full: read every file; take no hash the verified-inode store keeps (safeinstall.env.inodetrust)
    full: bool = False
    #: the new version imported before the stop (safeinstall.env.importcheck); ``smoke``: the operator's
    #: command too
    no_smoke: bool = False
    smoke: str | None = None
    smoke_timeout: float = 300.0  # safeinstall.env.importcheck.SMOKE_TIMEOUT_S: each child's bound
    smoke_skip: tuple[str, ...] = ()  # --smoke-skip: modules the check never imports (known bad)
    only_loaded: bool = False  # plan only processes with certain evidence (not ``environment`` alone)
    strict: bool = False  # a process left on old code after the restart fails the run (rolled back)
    keep_backups: int = 3  # safeinstall.store.retention.DEFAULT_KEEP: backups kept per environment
    run_id: str | None = None  # given by the caller (a detached run's foreground); None: a new one
    keep_patches: bool = False  # carry the package's local patches over to the new version
    base_wheel: Path | None = None  # --keep-patches: the installed version's wheel (else fetched by uv)
    drop_conflicting: bool = False  # --keep-patches: drop what cannot be carried instead of refusing
    #: --wheel: install a wheel whose own RECORD is wrong about its members' hashes or sizes (verified
    #: against its contents; the environment's baseline keeps what it is wrong about)
    accept_record_mismatch: bool = False
    #: go on with a run that breaks a requirement of the environment (safeinstall.env.requirements)
    allow_broken_requirements: bool = False
    #: --undo: the run whose backup is put back (safeinstall.run.parts.undo); None: a reinstall
    undo: str | None = None
    #: --prepare: stop after the smoke check, the run kept for --commit (safeinstall.run.steps.prepare)
    prepare: bool = False
    #: --commit: the environment's prepared run goes on from the gate, once checked unchanged
    commit: bool = False
    #: --commit: a prepared run older than this (seconds) is refused
    prepared_max_age: float = 86400.0
    proc_root: Path = Path("/proc")
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))


@dataclass(frozen=True, slots=True)
class OptionProblem:
    """A value that could not be honoured, and what to give instead."""

    message: str
    hint: str


#: The options given in seconds, and whether 0 may be: 0 s never passes a health check, a smoke check,
#: an age; a stop timeout of 0 would fail every stop at once (to systemd ``TimeoutStopSec=0`` is none)
SECONDS = {
    "--stop-timeout": False,
    "--gpu-timeout": True,
    "--settle": True,
    "--health-timeout": False,
    "--smoke-timeout": False,
    "--prepared-max-age": False,
}


def seconds_problem(flag: str, shown: str) -> OptionProblem:
    """Pure: ``flag`` (one of :data:`SECONDS`) given ``shown``, which is no number of seconds it takes: a
    ``nan``, a negative number, or what is no number at all (the command line's parser says it too)."""
    least = ", 0 or more" if SECONDS[flag] else " more than 0"
    hint = (
        "give the seconds each unit may take to stop, or leave --stop-timeout out for each unit's own "
        "TimeoutStopSec"
        if flag == "--stop-timeout"
        else f"give {flag} a number of seconds, or leave it out for its default (safeinstall --help)"
    )
    return OptionProblem(f"{flag} {one_line(shown)}: seconds must be a finite number{least}", hint)


def keep_backups_problem(shown: str) -> OptionProblem:
    """Pure: ``--keep-backups`` given ``shown``: under 1, or no whole number at all."""
    return OptionProblem(
        f"--keep-backups {one_line(shown)}: keep a whole number of backups, at least 1 (the run's own)",
        "--keep-backups 1 keeps only the newest backup",
    )


def option_problems(options: RunOptions) -> list[OptionProblem]:
    """Pure: every value that could not be honoured, found before anything is stopped. (A ``nan``
    deadline never passes: the run, and its rollback, would wait forever.)"""
    problems: list[OptionProblem] = []
    seconds = (
        ("--stop-timeout", options.stop_timeout),  # None: each unit's own TimeoutStopSec
        ("--gpu-timeout", options.gpu_timeout),
        ("--settle", options.settle),
        ("--health-timeout", options.health_timeout),
        ("--smoke-timeout", options.smoke_timeout),
        ("--prepared-max-age", options.prepared_max_age),
    )
    for flag, value in seconds:
        if value is not None and not (math.isfinite(value) and (value >= 0 if SECONDS[flag] else value > 0)):
            problems.append(seconds_problem(flag, f"{value:g}"))
    if options.smoke is not None and options.undo is not None:
        problems.append(
            OptionProblem(
                "--smoke goes with a reinstall: --undo puts back a version that ran before",
                "leave --smoke out of --undo",
            )
        )
    if options.smoke is not None and (options.no_smoke or not options.smoke.strip()):
        problems.append(
            OptionProblem(
                "--smoke needs a command, and cannot go with --no-smoke",
                "e.g. --smoke \"python -c 'import vllm._C'\"; or --no-smoke alone to skip the check",
            )
        )
    for module in options.smoke_skip:
        if not module or not all(part.isidentifier() for part in module.split(".")):
            problems.append(
                OptionProblem(
                    f"--smoke-skip {module!r}: not a module's dotted name",
                    "e.g. --smoke-skip numpy.core._umath_tests (each module, and its submodules, left out)",
                )
            )
    if options.keep_backups < 1:
        problems.append(keep_backups_problem(str(options.keep_backups)))
    if options.health_url is not None and (wrong := health_url_problem(options.health_url)):
        problems.append(
            OptionProblem(
                f"--health-url {health_url_shown(options.health_url)}: {wrong}",
                "e.g. --health-url http://127.0.0.1:8000/health",
            )
        )
    from safeinstall.env.uvplan import elsewhere_option  # uv's own words, loaded only for a run

    elsewhere = elsewhere_option(options.extra_args)
    if elsewhere is not None:
        problems.append(
            OptionProblem(
                f"uv's {elsewhere} (after --) installs somewhere else: safeinstall reinstalls into the "
                "environment --python names, and gives uv's prefetch a scratch tree of its own that way",
                f"leave {elsewhere} out of uv's arguments; name the environment with --python PY",
            )
        )
    return problems


def health_url_shown(url: str) -> str:
    """Pure: ``url`` as a usage error says it: without user information, query and fragment, where a
    token may be (``SAFEINSTALL_HEALTH_URL`` keeps one off the command line), its port as typed."""
    plain = url.isascii() and url.isprintable() and " " not in url  # urlsplit drops what is not
    try:
        parts = urllib.parse.urlsplit(url) if plain else None
    except ValueError:
        parts = None
    if parts is None:
        return "(not shown: it may hold a token)" if any(c in url for c in "@?#") else one_line(url)
    netloc = parts.netloc.rpartition("@")[2]
    return one_line(urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", "")))


def health_url_problem(url: str) -> str | None:
    """Pure: why ``url`` cannot be asked (None: it can). ``urlsplit`` drops tabs and newlines and
    raises ValueError on a bad ``[...]`` host; a port is only checked when read."""
    if not url.isascii() or not url.isprintable() or " " in url:
        return "a URL has no spaces, control or non-ASCII characters (percent-encode them)"
    try:
        parts = urllib.parse.urlsplit(url)
    except ValueError as exc:
        return f"not a URL ({exc})"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "only http:// and https:// URLs with a host are asked"
    try:
        port = parts.port
    except ValueError:
        port = 0
    return "its port must be a number 1-65535" if port == 0 else None


def check_options(options: RunOptions) -> None:
    """Refuse (UsageError, exit 2) options that :func:`option_problems` finds wrong; nothing was done."""
    problems = option_problems(options)
    if problems:
        raise UsageError("; ".join(p.message for p in problems), hint="; ".join(p.hint for p in problems))


def requirement_version(text: str) -> str | None:
    """Pure: the version a requirement asks for (``vllm>=0.16``: ``>=0.16``; None: any); one that uv
    and pip would not take is a UsageError (:func:`safeinstall.env.uvplan.parse_requirement`)."""
    from safeinstall.env.uvplan import parse_requirement

    return parse_requirement(text).specifier
