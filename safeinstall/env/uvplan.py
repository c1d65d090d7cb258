"""uv at the edge: the exact ``uv pip install`` command, its dry-run plan, and the real install.

uv gets a cache of the run's own (no installed file shares an inode with a lasting cache, uv #10579)
and runs as the environment's account. Why: docs/reinstall.md and docs/privsep.md."""

from __future__ import annotations

import contextlib
import os
import re
import stat
import subprocess
import textwrap
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uv
from packaging.utils import canonicalize_name

from safeinstall.env import owner
from safeinstall.env.environment import Account
from safeinstall.errors import PlanError, UsageError
from safeinstall.system import children, worker
from safeinstall.system.safefs import Tree, private_to
from safeinstall.system.worker import WorkerError

_CHANGE = re.compile(r"^\s*(?P<sign>[-+~])\s+(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?P<rest>.*)$")
_VERSION = re.compile(r"^==(?P<version>\S+)")


@dataclass(frozen=True, slots=True)
class UvRequest:
    """What the user asked to install, before it becomes a command line."""

    python: Path
    package: str
    wheel: Path | None = None
    version_spec: str | None = None  # a specifier: "==2.0", ">=2"; None with no wheel: the installed version
    installed_version: str | None = None
    with_deps: bool = False
    extra_args: tuple[str, ...] = ()
    link_mode: str = "copy"  # "hardlink" only from a run-private cache (see private_cache_usable)


@dataclass(frozen=True, slots=True)
class UvChange:
    action: str  # "uninstall" | "install" | "reinstall"
    name: str  # canonical
    version: str | None
    source: str | None


@dataclass(frozen=True, slots=True)
class UvPlan:
    command: tuple[str, ...]  # the install command that the run will execute
    changes: tuple[UvChange, ...]
    output: str
    #: who held uv's lock of the environment when the plan's uv started (it waited for it, bounded)
    lock_note: str | None = None

    @property
    def affected(self) -> tuple[str, ...]:
        """Every distribution the install would replace or add, sorted."""
        return tuple(sorted({c.name for c in self.changes}))


def uv_binary() -> str:
    return uv.find_uv_bin()


def requirement(request: UvRequest) -> str:
    """Pure: the requirement or wheel path that uv gets."""
    if request.wheel is not None:
        return str(request.wheel)
    if request.version_spec:
        return f"{request.package}{request.version_spec}"
    if request.installed_version:
        return f"{request.package}=={request.installed_version}"
    return request.package


@dataclass(frozen=True, slots=True)
class Requirement:
    """What to install, as uv and pip take it on their command line: ``vllm``, ``'vllm==0.16.0'``."""

    name: str  # as given (canonicalized where compared)
    specifier: str | None  # ">=0.16", "==0.16.0"; None: no version asked for

    @property
    def text(self) -> str:
        return self.name + (self.specifier or "")


def parse_requirement(text: str) -> Requirement:
    """Pure: a requirement as uv/pip take it; extras, URLs and markers are refused (UsageError)."""
    from packaging.requirements import InvalidRequirement
    from packaging.requirements import Requirement as Parsed

    try:
        parsed = Parsed(text)
    except InvalidRequirement as exc:
        raise UsageError(
            f"{text!r} is not a requirement: {str(exc).splitlines()[0]}",
            hint="give a name, optionally with a version: safeinstall 'vllm==0.16.0' or 'vllm>=0.16'",
        ) from exc
    refused = (
        "a URL (name @ URL)"
        if parsed.url
        else "an environment marker (;)"
        if parsed.marker
        else "extras ([...])"
        if parsed.extras
        else None
    )
    if refused:
        raise UsageError(
            f"the requirement {text!r} has {refused}; safeinstall reinstalls one installed distribution",
            hint="give its name and, optionally, a version: safeinstall 'vllm==0.16.0'; "
            "for a wheel file use --wheel PATH; uv options go after --",
        )
    specifier = str(parsed.specifier)
    return Requirement(parsed.name, specifier or None)


def install_command(request: UvRequest, uv_bin: str, dry_run: bool = False) -> list[str]:
    """Pure: the exact ``uv pip install`` command line."""
    cmd = [uv_bin, "pip", "install", "--python", str(request.python)]
    cmd += ["--reinstall"] if request.with_deps else ["--reinstall-package", request.package]
    if not _chooses(request.extra_args, ("--link-mode",)):  # uv refuses the option twice
        cmd += ["--link-mode", request.link_mode]
    if dry_run:
        cmd.append("--dry-run")
    cmd += [*request.extra_args, requirement(request)]
    return cmd


#: uv options after which the run leaves the window's install as the plan says (no ``--offline``)
_NETWORK_OPTIONS = (
    "--offline",
    "--no-offline",
    "--refresh",
    "--refresh-package",
    *("--cache-dir", "--no-cache", "-n"),
)


def chooses_network(request: UvRequest) -> bool:
    """Pure: do the extra uv arguments choose the network or a cache (``--offline`` aside)?"""
    return _chooses(request.extra_args, _NETWORK_OPTIONS[1:])


def window_command(command: Sequence[str], request: UvRequest) -> tuple[str, ...]:
    """Pure: the window's install: the plan's command with ``--offline`` when it installs from the run's
    own cache and the extra arguments name no network nor cache. Why: docs/window.md ("The window's
    install runs offline")."""
    if request.link_mode != "hardlink" or _chooses(request.extra_args, _NETWORK_OPTIONS):
        return tuple(command)
    return (*command[:3], "--offline", *command[3:])


def prefetch_command(
    request: UvRequest, uv_bin: str, target: Path, changes: Sequence[UvChange] = (), staging: bool = False
) -> list[str]:
    """Pure: install the same artefacts, pinned, into a scratch ``--target`` directory before any stop:
    it fills uv's cache and proves they install. ``changes``: what uv's dry run installs; ``staging``:
    ``--prefix target`` instead, a swap's staging tree."""
    where = ["--prefix" if staging else "--target", str(target)]
    cmd = [uv_bin, "pip", "install", "--python", str(request.python), *where, "--no-deps"]
    # the scratch copy is thrown away: link it from the cache (uv copies where it cannot link)
    cmd += ["--link-mode", "hardlink"]
    wanted = canonicalize_name(request.package)
    others = [
        text
        for change in changes
        if change.action != "uninstall" and change.name != wanted and (text := pinned(change)) is not None
    ]
    extra = [arg for arg in _without(request.extra_args, "--link-mode") if arg != "--no-deps"]  # uv: once
    return [*cmd, *extra, requirement(request), *dict.fromkeys(others)]


def unpack_command(request: UvRequest, uv_bin: str, target: Path) -> list[str] | None:
    """Pure: uv told to unpack the given wheel alone into its cache, offline, through a throwaway
    ``--target``: the prefetch's install then finds it unpacked. None without a wheel, or where uv's
    arguments choose the network or a cache (the prefetch would not take it)."""
    if request.wheel is None or chooses_network(request):
        return None
    where = ["--python", str(request.python), "--target", str(target), "--no-deps"]
    return [uv_bin, "pip", "install", "--offline", *where, "--link-mode", "hardlink", str(request.wheel)]


def _without(extra_args: Sequence[str], option: str) -> list[str]:
    """Pure: the extra arguments less ``option`` and its value."""
    kept: list[str] = []
    skip = False
    for arg in extra_args:
        if skip:
            skip = False
        elif arg == option:
            skip = True
        elif not arg.startswith(option + "="):
            kept.append(arg)
    return kept


#: uv's options that name an index or a place to find wheels, and the variable uv reads each from
#: (with the separator uv splits it at, or None where uv takes one value). Their values may hold
#: credentials (``https://user:TOKEN@host/simple``): on a command line, every local user reads them in
#: ``/proc/PID/cmdline``; in the environment, only the process's own account can.
_INDEX_OPTIONS: dict[str, tuple[str, str | None]] = {
    "--index-url": ("UV_INDEX_URL", None),
    "-i": ("UV_INDEX_URL", None),
    "--default-index": ("UV_DEFAULT_INDEX", None),
    "--extra-index-url": ("UV_EXTRA_INDEX_URL", " "),
    "--index": ("UV_INDEX", " "),
    "--find-links": ("UV_FIND_LINKS", ","),
    "-f": ("UV_FIND_LINKS", ","),
}


def index_settings(extra_args: Sequence[str]) -> tuple[tuple[str, ...], dict[str, str]]:
    """Pure: ``extra_args`` less uv's index options, and those as the ``UV_*`` variables uv reads. Raises
    UsageError for a value the variable cannot carry, a missing value, or a single one given twice."""
    kept: list[str] = []
    values: dict[str, str] = {}
    args = list(extra_args)
    position = 0
    while position < len(args):
        arg = args[position]
        position += 1
        found = _index_option(arg)
        if found is None:
            kept.append(arg)
            continue
        flags, option, value = found
        if flags:  # the other options of a cluster (-qi URL: -q) stay on the command line
            kept.append(flags)
        if value is None:
            if position >= len(args):
                raise UsageError(f"{option} needs a value", hint=f"give it as {option} URL after --")
            value = args[position]
            position += 1
        variable, separator = _INDEX_OPTIONS[option]
        if separator is None and variable in values:
            raise UsageError(f"{option} was given twice", hint="uv takes one; give it once")
        if not value or (separator is not None and separator in value) or "\0" in value:
            raise UsageError(
                f"the value of {option} cannot be passed to uv: {value!r}",
                hint="index URLs and find-links paths must not be empty or hold "
                + ("a space" if separator == " " else "a comma" if separator == "," else "a NUL"),
            )
        joined = values.get(variable)  # given before: then the variable takes several (a separator)
        values[variable] = value if joined is None else f"{joined}{separator}{value}"
    return tuple(kept), values


def _index_option(arg: str) -> tuple[str, str, str | None] | None:
    """Pure: (the other short options of its cluster, the option, its value if attached) when ``arg``
    is, or holds, one of uv's index options."""
    if arg in _INDEX_OPTIONS:
        return "", arg, None
    if arg.startswith("--") and "=" in arg:
        option, value = arg.split("=", 1)
        return ("", option, value) if option in _INDEX_OPTIONS else None
    if arg.startswith("-") and not arg.startswith("--") and len(arg) > 2:
        return _clustered(arg)
    return None


#: uv's short options that take a value (the rest of a cluster, or the next argument, is it)
_SHORT_WITH_VALUE = frozenset("iferctpCPb")


def _clustered(arg: str) -> tuple[str, str, str | None] | None:
    """Pure: a cluster of short options as clap reads it (``-qi URL``, ``-qiURL``, ``-i=URL``): the
    index option in it and its value (None: the next argument), or None when it holds none (the first
    option that takes a value ends the cluster: ``-rfile.txt`` is ``-r file.txt``)."""
    for position, letter in enumerate(arg[1:], start=1):
        if letter in _SHORT_WITH_VALUE:
            if f"-{letter}" not in _INDEX_OPTIONS:
                return None
            rest = arg[position + 1 :].removeprefix("=")
            return (arg[:position] if position > 1 else ""), f"-{letter}", rest or None
        if letter == "=":
            return None
    return None


def elsewhere_option(extra_args: Sequence[str]) -> str | None:
    """Pure: the first of uv's options in ``extra_args`` that install somewhere else than the environment
    (``--target``, ``-t``, ``--prefix``; ``--target=DIR``, ``-tDIR``, ``-qt DIR`` too), by its long name;
    None: none. A run's prefetch gives uv a scratch tree of its own with one of them, which uv takes once."""
    for arg in extra_args:
        if arg == "--":  # uv's own: what follows is requirements
            return None
        if arg.startswith("--"):
            option = arg.split("=", 1)[0]
            if option in ("--target", "--prefix"):
                return option
        elif arg.startswith("-"):
            for letter in arg[1:]:  # a cluster as clap reads it: an option that takes a value ends it
                if letter == "t":
                    return "--target"
                if letter in _SHORT_WITH_VALUE or letter == "=":
                    break
    return None


def pinned(change: UvChange) -> str | None:
    """Pure: the requirement that installs exactly what ``change`` says (None: not enough to say)."""
    if change.version is not None:
        return f"{change.name}=={change.version}"
    if change.source is not None:
        return f"{change.name} @ {change.source}"
    return None


def parse_changes(text: str) -> tuple[UvChange, ...]:
    """Pure: the ``- name==1.0`` / ``+ name==2.0`` / ``+ name @ file://...`` lines of uv's output."""
    changes: list[UvChange] = []
    for line in text.splitlines():
        match = _CHANGE.match(line)
        if not match or not line.startswith(" "):
            continue
        rest = match["rest"].strip()
        version: str | None = None
        source: str | None = None
        found = _VERSION.match(rest)
        if found:
            version = found["version"]
            source_part = rest[found.end() :].strip()
            if source_part.startswith("(from ") and source_part.endswith(")"):
                source = source_part[len("(from ") : -1]
        elif rest.startswith("@"):
            source = rest[1:].strip()
        action = {"-": "uninstall", "+": "install", "~": "reinstall"}[match["sign"]]
        changes.append(UvChange(action, canonicalize_name(match["name"]), version, source))
    return tuple(changes)


#: uv options that choose the cache or the link mode: with them the run leaves uv's cache alone and copies
_CACHE_OPTIONS = ("--cache-dir", "--no-cache", "-n", "--link-mode")


def link_mode_for(extra_args: Sequence[str], same_filesystem: bool) -> str:
    """Pure: ``hardlink`` (from the run-private cache) when that cache shares the prefix's filesystem and
    the extra arguments leave the cache and the link mode to the run; ``copy`` otherwise."""
    return "hardlink" if same_filesystem and not _chooses(extra_args, _CACHE_OPTIONS) else "copy"


def _chooses(extra_args: Sequence[str], options: Sequence[str]) -> bool:
    """Pure: do the extra uv arguments give one of ``options`` (``--opt v`` or ``--opt=v``)?"""
    return any(arg == opt or arg.startswith(opt + "=") for arg in extra_args for opt in options)


def same_filesystem(a: Path, b: Path) -> bool:
    """Do ``a`` and ``b`` (or, where they do not exist yet, their nearest existing parents) share a device?"""

    def device(path: Path) -> int:
        probe = Path(os.path.abspath(path))
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        return probe.stat().st_dev

    try:
        return device(a) == device(b)
    except OSError:
        return False


#: What of the caller's environment reaches uv when it runs as the environment's owner, who can read
#: uv's environment (``/proc/PID/environ``) while it runs: uv's own settings, what the network needs
#: (proxies, CA certificates, a netrc), the locale and ``PATH``. Nothing else of root's: no publishing
#: or GitHub tokens (``UV_PUBLISH_*``, ``UV_GITHUB_TOKEN``), no cloud keys, no ssh agent, no
#: ``PYTHONPATH`` for the interpreter uv starts, none of the variables that name root's own
#: directories (``XDG_*_HOME``, ``XDG_RUNTIME_DIR``, ``TMPDIR``). uv settings that name a file
#: (``UV_CONFIG_FILE``) pass: uv reads it as the owner, so a file only root may read makes it fail.
#: ``SSL_CLIENT_CERT``: an index that wants a client certificate (the owner must be able to read it);
#: ``XDG_CONFIG_DIRS``: the system's configuration directories (uv reads uv.toml there), not root's.
_FOR_THE_OWNER = frozenset(
    {"PATH", "LANG", "LANGUAGE", "TZ", "NO_COLOR", "SSL_CERT_FILE", "SSL_CERT_DIR", "NETRC"}
    | {"SSL_CLIENT_CERT", "XDG_CONFIG_DIRS"}
    | {
        name
        for proxy in ("HTTP_PROXY", "HTTPS_PROXY", "ALL_PROXY", "NO_PROXY")
        for name in (proxy, proxy.lower())
    }
)
_FOR_THE_OWNER_PREFIXES = ("UV_", "LC_")
#: uv's own variables that an install never reads and that hold credentials for something else
_NOT_FOR_THE_OWNER_PREFIXES = ("UV_PUBLISH_", "UV_GITHUB_TOKEN", "UV_INSTALLER_")


def uv_environment(
    environ: Mapping[str, str], cache_dir: Path | None = None, account: Account | None = None
) -> dict[str, str]:
    """Pure: uv's environment: the caller's without ``VIRTUAL_ENV``; ``cache_dir``: uv's cache.

    With ``account``: only what ``_FOR_THE_OWNER`` lets through and the owner's ``HOME``, so uv reads what it
    would as the owner and nothing of root's; no ``cache_dir``: ``UV_NO_CACHE``."""
    env = {k: v for k, v in environ.items() if k != "VIRTUAL_ENV"}
    env["UV_NO_PROGRESS"] = "1"
    if account is not None:
        env = {
            k: v
            for k, v in env.items()
            if (k in _FOR_THE_OWNER or k.startswith(_FOR_THE_OWNER_PREFIXES))
            and not k.startswith(_NOT_FOR_THE_OWNER_PREFIXES)
        }
        env["HOME"] = account.home
        if cache_dir is None:
            env["UV_NO_CACHE"] = "1"
    if cache_dir is not None:
        env["UV_CACHE_DIR"] = str(cache_dir)
    return env


def _run_uv(
    command: Sequence[str],
    environ: Mapping[str, str] | None,
    timeout: float,
    cache_dir: Path | None,
    account: Account | None,
    cancel: threading.Event | None = None,
) -> subprocess.CompletedProcess[str]:
    """Run uv (as ``account`` when given, through a descriptor root opened: safeinstall's uv may lie
    where the account cannot reach); raises OSError, subprocess.TimeoutExpired, children.Cancelled."""
    program = os.open(command[0], os.O_RDONLY | os.O_CLOEXEC | os.O_NOCTTY) if account is not None else None
    try:
        return children.run(
            command,
            env=uv_environment(os.environ if environ is None else environ, cache_dir, account),
            timeout=timeout,
            as_user=None if account is None else account.ids,
            program_fd=program,
            cancel=cancel,
        )
    finally:
        if program is not None:
            os.close(program)


#: The most of uv's message a PlanError quotes (uv's own error and its hints; a resolver's explanation
#: can run to pages: the log holds all of it)
SAID_LIMIT = 1200


#: a part of uv's message of its own: "error:", "hint:", "cause:", "Caused by:"
_UV_LABEL = re.compile(r"[A-Za-z][A-Za-z ]{0,15}: ")


def uv_said(output: str, limit: int = SAID_LIMIT) -> str:
    """Pure: uv's message on one line from its first ``error:`` line, its parts joined with " / ",
    shortened to ``limit`` characters at a word boundary."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    first = next((i for i, line in enumerate(lines) if line.startswith("error:")), 0)
    parts: list[str] = []
    for line in lines[first:]:
        goes_on = line[:1].islower() and not _UV_LABEL.match(line)  # "hint: ..." is a part of its own
        if parts and goes_on and not parts[-1].endswith((".", ":", ";", "!", "?")):
            parts[-1] += " " + line
        else:
            parts.append(line)
    said = " / ".join(parts)
    return said if len(said) <= limit else textwrap.shorten(said, limit, placeholder=" …")


def dry_run(
    request: UvRequest,
    environ: Mapping[str, str] | None = None,
    timeout: float = 300,
    account: Account | None = None,
    prefix: Path | None = None,
    cache_dir: Path | None = None,
) -> UvPlan:
    """Ask uv (as ``account``, when given) what it would uninstall and install; PlanError when it cannot
    resolve. A lock file uv made in ``prefix`` is removed; ``cache_dir``: uv's cache, which then holds the
    metadata the window's offline install needs."""
    uv_bin = uv_binary()
    cmd = install_command(request, uv_bin, dry_run=True)
    had_lock = prefix is None or _lock_info(prefix) is not None
    note = None if prefix is None else _held_note(prefix)
    try:
        proc = _run_uv(
            cmd, plan_environ(os.environ if environ is None else environ), timeout, cache_dir, account
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise PlanError(f"uv did not answer: {exc}", hint="check that uv runs: " + uv_bin) from exc
    finally:
        if prefix is not None and not had_lock:
            with contextlib.suppress(WorkerError):
                _as_prefix_owner(
                    prefix, account, lambda p: owner.remove_new_uv_lock(p), "removes uv's new lock file"
                )
    output = proc.stdout + proc.stderr
    if proc.returncode != 0:
        raise PlanError(
            "uv cannot resolve the install: " + uv_said(output),  # one line: uv's own "error:" is not ours
            hint="fix the requirement, the wheel or the index options (arguments after -- go to uv); "
            "nothing was stopped",
        )
    return UvPlan(tuple(install_command(request, uv_bin)), parse_changes(output), output, note)


@dataclass(frozen=True, slots=True)
class UvResult:
    command: tuple[str, ...]
    returncode: int
    output: str


def install(
    command: Sequence[str],
    environ: Mapping[str, str] | None = None,
    timeout: float = 3600,
    cache_dir: Path | None = None,
    account: Account | None = None,
    cancel: threading.Event | None = None,
) -> UvResult:
    """Run the install (as ``account``, the environment's owner, when given); the caller logs the
    command and the output. ``cancel``: uv is killed once it is set (uv run on another thread).

    uv never outlives the run (:mod:`safeinstall.system.children`): interrupted, it is killed and
    reaped before the rollback starts; if safeinstall is killed, uv dies with it."""
    try:
        proc = _run_uv(command, environ, timeout, cache_dir, account, cancel)
    except children.Cancelled as exc:
        return UvResult(tuple(command), -1, f"uv was stopped: {exc}")
    except subprocess.TimeoutExpired as exc:
        return UvResult(tuple(command), -1, f"uv did not finish in {timeout:.0f} s: {exc}")
    except children.TooMuchOutput as exc:
        return UvResult(tuple(command), -1, f"uv was stopped: {exc}")
    except OSError as exc:
        return UvResult(tuple(command), -1, f"uv could not run: {exc}")
    return UvResult(tuple(command), proc.returncode, proc.stdout + proc.stderr)


# --- uv's lock of the environment ------------------------------------------------------------------
#
# uv takes ``PREFIX/.lock`` (flock) for every install and creates it mode 0666: any local user may open
# it and hold the lock, and uv then waits (300 s by default) while the services are down. Before the
# stop, the run makes sure that only the environment's owner (and root) can open that file.


def _lock_info(prefix: Path) -> os.stat_result | None:
    """``PREFIX/.lock`` as it is (never followed); None when there is none (or no prefix)."""
    try:
        with Tree(prefix) as tree:
            return tree.lstat(owner.UV_LOCK)
    except OSError:
        return None


def _as_prefix_owner(prefix: Path, account: Account | None, work: Callable[[str], Any], what: str) -> Any:
    """``work(prefix)`` in a worker that is the prefix directory's owner: the environment's account, or
    root (a root-owned prefix, which the account cannot write either)."""
    try:
        owned = account is not None and os.lstat(prefix).st_uid == account.uid
    except OSError as exc:
        raise WorkerError(f"cannot look at {prefix}: {exc.strerror or exc}") from exc
    ids = account.ids if account is not None and owned else None
    text = str(prefix)
    return worker.call(ids, lambda: work(text), timeout=60, what=f"{what} in {prefix}")


def lock_holders(inode: tuple[int, int], locks: str) -> list[int]:
    """Pure: the PIDs that hold a lock on ``inode`` (device, inode number) in ``/proc/locks``'s text."""
    device, number = inode
    wanted = f"{os.major(device):02x}:{os.minor(device):02x}:{number}"
    holders: list[int] = []
    for line in locks.splitlines():
        fields = line.split()
        if "->" in fields:  # a waiter, not a holder
            continue
        if len(fields) >= 6 and fields[5] == wanted and fields[4].isdigit():
            holders.append(int(fields[4]))
    return holders


def _uid_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status", encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("Uid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return None


def _holders(info: os.stat_result) -> list[tuple[int, int | None]]:
    """Who holds the lock of the file ``info`` describes: (PID, its uid) from ``/proc/locks``."""
    try:
        with open("/proc/locks", encoding="ascii", errors="replace") as handle:
            locks = handle.read(1 << 22)
    except OSError:
        locks = ""
    return [(pid, _uid_of(pid)) for pid in lock_holders((info.st_dev, info.st_ino), locks)]


#: The most the plan's uv waits for uv's lock of the environment (``UV_LOCK_TIMEOUT``; uv then goes on
#: without it): a dry run takes the lock too, and the lock file (0666 as uv makes it, until the run
#: replaces it before the stop) may be held by any local user, for uv's default 300 s.
PLAN_LOCK_WAIT_S = 10


def plan_environ(environ: Mapping[str, str]) -> dict[str, str]:
    """Pure: the environment of the plan's uv: ``UV_LOCK_TIMEOUT`` at most ``PLAN_LOCK_WAIT_S``."""
    given = environ.get("UV_LOCK_TIMEOUT", "")
    wait = min(int(given), PLAN_LOCK_WAIT_S) if given.isdigit() else PLAN_LOCK_WAIT_S
    return {**environ, "UV_LOCK_TIMEOUT": str(wait)}


def _held_note(prefix: Path) -> str | None:
    """What the plan says when uv's lock of ``prefix`` is held as its uv starts: by whom (PID and uid),
    and that uv waits at most ``PLAN_LOCK_WAIT_S`` for it."""
    info = _lock_info(prefix)
    if info is None or not stat.S_ISREG(info.st_mode):
        return None
    holders = _holders(info)
    if not holders:
        return None
    who = ", ".join(f"PID {pid} (uid {'?' if uid is None else uid})" for pid, uid in holders)
    return (
        f"uv's lock {prefix / owner.UV_LOCK} is held by {who}: the plan's uv waited for it at most "
        f"{PLAN_LOCK_WAIT_S} s, then went on without it; before the stop the run puts a new lock file, "
        "the owner's alone, in its place"
    )


def secure_uv_lock(prefix: Path, account: Account | None) -> str:
    """Before the stop: make uv's lock file the environment owner's alone (a new empty file, 0600, put
    in place of the old one, which whoever holds it may keep). Refuses (PlanError) while the owner or
    root holds the lock: another uv is installing into the environment. Returns what was done."""
    info = _lock_info(prefix)
    own_uid = 0 if account is None else account.uid
    if info is not None and stat.S_ISREG(info.st_mode):
        holders = _holders(info)
        ours = [pid for pid, uid in holders if uid in (0, own_uid)]
        if ours:
            raise PlanError(
                f"uv's lock of {prefix} ({prefix / owner.UV_LOCK}) is held by PID "
                + ", ".join(map(str, ours))
                + ": another uv is installing into this environment",
                hint="wait until it is done, then run again; nothing was stopped",
            )
        safe = private_to(info.st_uid, info.st_mode, own_uid) and not holders
        if safe:
            return f"uv's lock {prefix / owner.UV_LOCK} is the owner's alone"
    give = None if account is None else [account.uid, account.gid]
    try:
        _as_prefix_owner(prefix, account, lambda p: owner.replace_uv_lock(p, give), "replaces uv's lock file")
    except WorkerError as exc:
        raise PlanError(
            f"could not make uv's lock of {prefix} the owner's alone: {exc.message}",
            hint="look at PREFIX/.lock; nothing was stopped",
        ) from exc
    return f"uv's lock {prefix / owner.UV_LOCK} is new, 0600: no other user can hold the install up"
