"""Talking to systemd: the only module that runs ``systemctl``.

A stop waits until the unit is inactive and its cgroup empty; a stop that times out cannot be taken
back (docs/faults.md). Parsing is pure (:func:`parse_show`, :func:`unit_info`, ...).
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import select
import shlex
import subprocess
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from safeinstall.errors import SystemdError
from safeinstall.system import children
from safeinstall.system.cgroups import parse_proc_cgroup, valid_unit_name
from safeinstall.system.identity import ProcessId, read_stat
from safeinstall.system.safefs import at_or_below

#: Properties :meth:`Systemd.show` asks for, in one ``systemctl show -p`` call.
SHOW_PROPERTIES = (
    "Id,LoadState,ActiveState,SubState,UnitFileState,Type,MainPID,ControlGroup,TimeoutStopUSec,"
    "TimeoutStartUSec,Result,NRestarts,ExecMainStartTimestampMonotonic,ActiveExitTimestampMonotonic,"
    "ActiveEnterTimestampMonotonic,FragmentPath,Job,RequiredBy,BoundBy,ConsistsOf"
)

#: Where cgroup hierarchies may be mounted: cgroup2 in the hybrid layout, the v1 ``name=systemd``
#: hierarchy (legacy and hybrid), and cgroup2 in the unified layout. Every one that exists is read.
DEFAULT_CGROUP_ROOTS: tuple[Path, ...] = (
    Path("/sys/fs/cgroup/unified"),
    Path("/sys/fs/cgroup/systemd"),
    Path("/sys/fs/cgroup"),
)

_STOPPED_STATES = frozenset({"inactive", "failed"})

_TIMESPAN_UNITS: dict[str, float] = {
    **dict.fromkeys(("us", "usec", "\u00b5s", "\u03bcs"), 1e-6),  # systemd prints MICRO SIGN + "s"
    **dict.fromkeys(("ms", "msec"), 1e-3),
    **dict.fromkeys(("s", "sec", "second", "seconds"), 1.0),
    **dict.fromkeys(("m", "min", "minute", "minutes"), 60.0),
    **dict.fromkeys(("h", "hr", "hour", "hours"), 3600.0),
    **dict.fromkeys(("d", "day", "days"), 86400.0),
    **dict.fromkeys(("w", "week", "weeks"), 604800.0),
    **dict.fromkeys(("M", "month", "months"), 2629800.0),  # systemd's month: 30.44 days
    **dict.fromkeys(("y", "year", "years"), 31557600.0),  # systemd's year: 365.25 days
}
_TIMESPAN_TOKEN = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([^\d\s.]*)")


# --------------------------------------------------------------------------------------------- parsing


#: How many of a unit's last journal lines a failed start's error quotes
JOURNAL_LINES = 10
#: The longest journal line quoted (a traceback's line of a long path is kept, a dump is not)
JOURNAL_LINE_LIMIT = 300


def journal_lines(output: str, lines: int = JOURNAL_LINES) -> tuple[str, ...]:
    """Pure: the last ``lines`` lines of ``journalctl``'s output, its own notices left out ("-- No
    entries --", "-- Boot ... --"), each at most :data:`JOURNAL_LINE_LIMIT` characters."""
    kept = [
        line if len(line) <= JOURNAL_LINE_LIMIT else line[: JOURNAL_LINE_LIMIT - 2] + " …"
        for line in output.splitlines()
        if line.strip() and not (line.startswith("-- ") and line.endswith(" --"))
    ]
    return tuple(kept[-lines:])


def parse_timespan(text: str) -> float:
    """Seconds from a systemd time span as ``systemctl show`` prints it. ``"1min 30s"`` -> 90.0,
    ``"1.500000s"`` -> 1.5, ``"500ms"``, ``"2h"``, ``"infinity"`` -> ``math.inf``; a bare number counts as
    seconds. Raises ValueError on anything else."""
    stripped = text.strip()
    if stripped == "infinity":
        return math.inf
    if not stripped:
        raise ValueError("empty time span")
    total = 0.0
    position = 0
    while position < len(stripped):
        match = _TIMESPAN_TOKEN.match(stripped, position)
        if match is None or match.end() == position:
            raise ValueError(f"not a systemd time span: {text!r}")
        number, unit = match.groups()
        factor = _TIMESPAN_UNITS.get(unit or "s")
        if factor is None:
            raise ValueError(f"unknown time unit {unit!r} in {text!r}")
        total += float(number) * factor
        position = match.end()
    return total


def parse_show(text: str) -> list[dict[str, str]]:
    """``systemctl show`` output to one ``{property: value}`` dict per unit, in output order."""
    blocks: list[dict[str, str]] = []
    current: dict[str, str] = {}
    for line in text.splitlines():
        if not line.strip():
            if current:
                blocks.append(current)
                current = {}
            continue
        key, sep, value = line.partition("=")
        if sep:
            current[key] = value
    if current:
        blocks.append(current)
    return blocks


@dataclass(frozen=True, slots=True)
class UnitInfo:
    name: str  # the name asked for (an alias resolves to a different ``id``)
    id: str
    load_state: str  # "loaded", "not-found", "masked", "bad-setting", "error"
    active_state: str  # "active", "activating", "deactivating", "inactive", "failed", "reloading"
    sub_state: str
    unit_file_state: str  # "enabled", "static", "disabled", ... ("" when unknown)
    type: str  # "simple", "exec", "notify", "forking", "oneshot", ... ("" when not a service)
    main_pid: int | None
    control_group: str | None
    timeout_stop_s: float  # math.inf for "infinity"
    result: str  # "success", "exit-code", "signal", "timeout", ...
    n_restarts: int  # automatic restarts (Restart=) since the unit was last started by hand
    exec_main_start_us: int  # CLOCK_MONOTONIC start of the main process, 0 if none
    fragment_path: str | None
    job_id: int | None  # a queued or running job (start/stop) for the unit
    #: units that a stop of this one stops too (their Requires=, BindsTo=, PartOf= name it), and that
    #: a start of this one does not start again
    dependents: tuple[str, ...] = ()
    timeout_start_s: float = 90.0  # TimeoutStartSec (math.inf for "infinity"): systemd fails a start after it
    active_exit_us: int = 0  # CLOCK_MONOTONIC when it last left active (a stop began), 0 if never
    active_enter_us: int = 0  # CLOCK_MONOTONIC when it last became active, 0 if never

    @property
    def found(self) -> bool:
        return self.load_state != "not-found"

    @property
    def is_active(self) -> bool:
        return self.active_state == "active"


def _int(value: str) -> int:
    try:
        return int(value)
    except ValueError:
        return 0


def unit_info(name: str, props: Mapping[str, str]) -> UnitInfo:
    """Build a :class:`UnitInfo` from one block of ``systemctl show -p SHOW_PROPERTIES`` output."""
    try:
        timeout_stop_s = parse_timespan(props.get("TimeoutStopUSec", "") or "infinity")
    except ValueError as exc:
        raise SystemdError(f"cannot read TimeoutStopUSec of {name}: {exc}") from exc
    main_pid = _int(props.get("MainPID", ""))
    job = props.get("Job", "").split(" ", 1)[0]
    return UnitInfo(
        name=name,
        id=props.get("Id", name),
        load_state=props.get("LoadState", ""),
        active_state=props.get("ActiveState", ""),
        sub_state=props.get("SubState", ""),
        unit_file_state=props.get("UnitFileState", ""),
        type=props.get("Type", ""),
        main_pid=main_pid or None,
        control_group=props.get("ControlGroup") or None,
        timeout_stop_s=timeout_stop_s,
        result=props.get("Result", ""),
        n_restarts=_int(props.get("NRestarts", "")),
        exec_main_start_us=_int(props.get("ExecMainStartTimestampMonotonic", "")),
        fragment_path=props.get("FragmentPath") or None,
        job_id=_int(job) or None,
        timeout_start_s=parse_timespan(props.get("TimeoutStartUSec", "") or "1min 30s"),
        active_exit_us=_int(props.get("ActiveExitTimestampMonotonic", "")),
        active_enter_us=_int(props.get("ActiveEnterTimestampMonotonic", "")),
        dependents=tuple(
            dict.fromkeys(
                name for key in ("RequiredBy", "BoundBy", "ConsistsOf") for name in props.get(key, "").split()
            )
        ),
    )


#: Beyond a unit's own TimeoutStartSec, how long to go on watching it (systemd fails the start itself).
START_MARGIN_S = 30.0


def start_wait_s(info: UnitInfo | None) -> float:
    """Pure: how long a started unit may take to become active. Its own ``TimeoutStartSec`` decides
    (a model server may load for many minutes, with ``TimeoutStartSec=infinity``): a fixed bound would
    roll back a good install of a slow-starting service."""
    timeout = 90.0 if info is None else info.timeout_start_s
    return timeout + START_MARGIN_S


#: Beyond a unit's own TimeoutStopSec, how long to go on waiting for it to stop (90 s when "infinity").
STOP_MARGIN_S = 10.0


def down_since_s(stopped: UnitInfo, asked_at: float) -> float:
    """Pure: when a unit that a stop asked for at ``asked_at`` (CLOCK_MONOTONIC seconds) took down
    went down, as systemd reports it: when it left active (its main process told to stop: it serves no
    more); a unit that is unloaded once inactive keeps no timestamps, and one from before the stop
    is another stop's: then when the stop was asked for."""
    left = stopped.active_exit_us / 1e6
    return left if left >= asked_at else asked_at


def stop_wait_s(timeout_stop_s: float) -> float:
    """Pure: how long a unit whose ``TimeoutStopSec`` is ``timeout_stop_s`` may take to stop."""
    return (timeout_stop_s if timeout_stop_s != float("inf") else 90.0) + STOP_MARGIN_S


@dataclass(frozen=True, slots=True)
class ManagerInfo:
    version: str
    system_state: str  # "running", "degraded", "starting", "stopping", ...
    control_group: str  # the manager's own cgroup ("/" for PID 1, ".../user@UID.service" for users)
    unit_path: tuple[str, ...]  # unit search path, highest priority first


@dataclass(frozen=True, slots=True)
class DropinRoots:
    persistent: Path  # /etc/systemd/system, or $XDG_CONFIG_HOME/systemd/user
    runtime: Path  # /run/systemd/system, or $XDG_RUNTIME_DIR/systemd/user

    def directory(self, unit: str, *, persistent: bool) -> Path:
        return (self.persistent if persistent else self.runtime) / f"{unit}.d"


def dropin_roots(unit_path: Sequence[str]) -> DropinRoots:
    """The manager's admin configuration directories, from its ``UnitPath``: the siblings, without
    ``.control``, of the control directories systemd lists first."""
    controls = [entry for entry in unit_path if entry.endswith(".control")]
    if len(controls) < 2:
        raise SystemdError(
            "cannot tell where the service manager reads drop-ins from "
            f"(its UnitPath has no persistent and runtime control directories: {' '.join(unit_path)})",
            hint="the gate's drop-in goes to the manager's admin directory (/etc/systemd/system, "
            "~/.config/systemd/user), which it reads from systemd 240 on, unless it was started with "
            'SYSTEMD_UNIT_PATH (keep its defaults: end the value with ":")',
        )
    persistent, runtime = (entry.removesuffix(".control") for entry in controls[:2])
    missing = [entry for entry in (persistent, runtime) if entry not in unit_path]
    if missing:
        raise SystemdError(f"the service manager does not read units from {', '.join(missing)}")
    return DropinRoots(persistent=Path(persistent), runtime=Path(runtime))


def default_dropin_root(user: bool, environ: Mapping[str, str]) -> Path:
    """Pure: where a manager reads persistent drop-ins by default (``/etc/systemd/system``, or
    ``$XDG_CONFIG_HOME/systemd/user``), for when the manager itself cannot be asked."""
    if not user:
        return Path("/etc/systemd/system")
    config = environ.get("XDG_CONFIG_HOME", "")
    if not os.path.isabs(config):
        config = os.path.join(environ.get("HOME") or os.path.expanduser("~"), ".config")
    return Path(config) / "systemd" / "user"


def check_unit_name(name: str) -> str:
    """``name`` if it can be passed to systemctl as one unit name; SystemdError otherwise."""
    if not valid_unit_name(name):
        raise SystemdError(
            f"not a valid unit name: {name!r}",
            hint="unit names are passed to systemctl literally, never as patterns: pass full unit names "
            "such as vllm.service (escape odd characters with systemd-escape)",
        )
    return name


def _check_dropin_name(name: str) -> str:
    filename = name if name.endswith(".conf") else f"{name}.conf"
    if "/" in filename or filename.startswith(".") or filename == ".conf":
        raise SystemdError(f"not a valid drop-in name: {name!r}")
    return filename


# ------------------------------------------------------------------------------------------- cgroups


def read_cgroup_pids(control_group: str, roots: Iterable[Path] = DEFAULT_CGROUP_ROOTS) -> frozenset[int]:
    """Every PID in ``control_group`` and its sub-cgroups, across all mounted hierarchies. A cgroup that does
    not exist (any more) holds no processes."""
    relative = control_group.strip("/")
    pids: set[int] = set()
    for root in roots:
        if not (root / "cgroup.procs").is_file():
            continue  # not a cgroup hierarchy (e.g. the tmpfs at /sys/fs/cgroup in the hybrid layout)
        top = root / relative if relative else root
        for directory, _dirs, files in os.walk(top):
            if "cgroup.procs" not in files:
                continue
            try:
                text = Path(directory, "cgroup.procs").read_text()
            except OSError:
                continue  # removed while we walked
            pids.update(int(line) for line in text.split() if line.isdigit())
    return frozenset(pids)


# ------------------------------------------------------------------------------------------ outcomes


@dataclass(frozen=True, slots=True)
class StopOutcome:
    unit: str
    stopped: bool  # inactive/failed and no process left in its cgroup, within the timeout
    active_state: str
    sub_state: str
    leftover_pids: frozenset[int]  # processes still in the unit's cgroup when we gave up
    waited_s: float
    reason: str | None  # why it did not stop, for the user
    down_since: float | None = None  # stopped: when it went down (CLOCK_MONOTONIC s, see down_since_s)


SettleVerdict = Literal["settled", "failed", "inactive", "activating", "restarted", "interrupted"]


@dataclass(frozen=True, slots=True)
class SettleOutcome:
    unit: str
    verdict: SettleVerdict
    info: UnitInfo  # the last state seen
    waited_s: float
    reason: str | None  # why it did not settle, for the user

    @property
    def ok(self) -> bool:
        return self.verdict == "settled"


#: A unit's main process: (MainPID, its start, CLOCK_MONOTONIC us), as systemd shows it.
MainProcess = tuple[int | None, int]


def main_process(info: UnitInfo) -> MainProcess:
    return info.main_pid, info.exec_main_start_us


def gone_wrong(
    unit: str, info: UnitInfo, last_restarts: int | None, seen: MainProcess | None
) -> tuple[SettleVerdict, str] | None:
    """Pure: why ``unit``, started, is not coming up as started: restarted automatically (NRestarts
    rose past ``last_restarts``; systemd zeroes it on a start by hand, so only a rise counts), active
    with another main process than ``seen``, failed, or inactive with no job left; None while it is
    active as seen or still on its way (activating, or a job queued)."""
    state = info.active_state
    if last_restarts is not None and info.n_restarts > last_restarts:
        return "restarted", (
            f"{unit} was restarted automatically (NRestarts {last_restarts} -> {info.n_restarts}, "
            f"Result={info.result}): its main process exited"
        )
    if state == "active":
        if seen is not None and main_process(info) != seen:
            return "restarted", f"{unit} changed its main process (PID {seen[0]} -> {info.main_pid})"
        return None
    if state == "failed" and info.job_id is None:
        return "failed", f"{unit} failed ({info.sub_state}, Result={info.result})"
    if state in ("inactive", "deactivating") and info.job_id is None:
        return "inactive", f"{unit} is {state} ({info.sub_state}, Result={info.result})"
    return None


# ------------------------------------------------------------------------------ a started unit's watch

#: While a started unit's main process is watched by a pidfd, how often ``systemctl show`` is asked
#: all the same (a failure the main process does not show: a start timeout, an ``ExecStartPost=``).
WATCH_SHOW_S = 1.0


def open_main_pidfd(pid: int, control_group: str | None, proc: Path = Path("/proc")) -> int | None:
    """A pidfd of ``pid`` where it is a process of ``control_group`` (or below) and was so while the
    pidfd held it; None otherwise (no such process, another cgroup, a kernel without pidfds). The
    caller closes it; it proves nothing of MainPID by itself (see :class:`MainWatch`)."""
    if control_group is None or not hasattr(os, "pidfd_open"):
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    keep = False
    try:  # the service names its own cgroups (a delegated subtree): any bytes, never a crash
        try:
            raw = (proc / str(pid) / "cgroup").read_bytes()
        except OSError:
            raw = b""
        path = parse_proc_cgroup(raw.decode("utf-8", "surrogateescape"))
        inside = path is not None and at_or_below(path, control_group)
        keep = inside and not process_exited(pidfd)  # still the process the pidfd holds: the read was of it
    finally:
        if not keep:
            os.close(pidfd)
    return pidfd if keep else None


def process_exited(pidfd: int) -> bool:
    """Whether the process of ``pidfd`` has exited (the pidfd is readable then), without waiting."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


@dataclass
class _Held:
    process: MainProcess  # as systemd showed it when the pidfd was taken
    pidfd: int
    trusted: bool = False  # a later show named the same main process: the pidfd is of it


@dataclass
class MainWatch:
    """Each started unit's main process held by a pidfd: :meth:`due` says to ask ``systemctl show`` at
    once while one is not held by a trusted pidfd or has exited, else every :data:`WATCH_SHOW_S`. A
    pidfd is trusted once a later show names the same main process (the PID was not reused in
    between); it only hastens a show, every verdict is systemd's (docs/reinstall.md, restart)."""

    held: dict[str, _Held] = field(default_factory=dict)
    shown_at: float | None = None

    def saw(self, infos: Mapping[str, UnitInfo], at: float) -> None:
        """What a show (asked at ``at``, monotonic s) said of each unit."""
        self.shown_at = at
        for unit, info in infos.items():
            process, held = main_process(info), self.held.get(unit)
            if held is not None and held.process == process:
                held.trusted = True
                continue
            self._drop(unit)
            if info.main_pid is not None and info.active_state in ("active", "activating", "reloading"):
                pidfd = open_main_pidfd(info.main_pid, info.control_group)
                if pidfd is not None:
                    self.held[unit] = _Held(process, pidfd)

    def due(self, units: Iterable[str], now: float) -> bool:
        """Whether to ask systemd about ``units`` now (``now``: monotonic s)."""
        if self.shown_at is None or now - self.shown_at >= WATCH_SHOW_S:
            return True
        for unit in units:
            held = self.held.get(unit)
            if held is None or not held.trusted or process_exited(held.pidfd):
                return True
        return False

    def _drop(self, unit: str) -> None:
        held = self.held.pop(unit, None)
        if held is not None:
            os.close(held.pidfd)

    def close(self) -> None:
        for unit in list(self.held):
            self._drop(unit)


# --------------------------------------------------------------------------------------- the manager


@dataclass(frozen=True, slots=True)
class Systemd:
    """One service manager: the system one, or (``user=True``) the calling user's."""

    user: bool = False
    environ: Mapping[str, str] | None = None  # for systemctl; None: os.environ at call time
    call_timeout_s: float = 30.0  # for one systemctl call
    poll_s: float = 0.02
    cgroup_roots: tuple[Path, ...] = DEFAULT_CGROUP_ROOTS

    # ---- running systemctl

    @property
    def _scope_flag(self) -> str:
        return "--user" if self.user else "--system"

    def _env(self) -> dict[str, str]:
        return dict(os.environ if self.environ is None else self.environ)

    def _unreachable(self, env: Mapping[str, str], detail: str) -> SystemdError:
        if self.user:
            runtime_dir = env.get("XDG_RUNTIME_DIR") or "unset"
            return SystemdError(
                f"systemctl --user not reachable: is a user manager running? "
                f"(XDG_RUNTIME_DIR={runtime_dir}; {detail})",
                hint="run as the user that owns the services with XDG_RUNTIME_DIR=/run/user/$UID set "
                "(`loginctl enable-linger USER` keeps their manager running without a login)",
            )
        return SystemdError(
            f"systemctl cannot reach the system manager: is systemd running as PID 1 here? ({detail})",
            hint="for services of a user manager pass --user; without systemd there are no units to stop",
        )

    def systemctl(self, *args: str, timeout_s: float | None = None) -> str:
        """Run ``systemctl [--user] ARGS``; its stdout, or SystemdError with an actionable message."""
        argv = ["systemctl", self._scope_flag, "--no-pager", "--no-ask-password", *args]
        command = " ".join(argv)
        env = self._env()
        try:
            proc = children.run(
                argv, env=env, timeout=self.call_timeout_s if timeout_s is None else timeout_s
            )
        except FileNotFoundError as exc:
            raise SystemdError(
                "systemctl not found on PATH",
                hint="safeinstall stops and starts services through systemd; install it or fix PATH",
            ) from exc
        except subprocess.TimeoutExpired as exc:
            raise SystemdError(
                f"`{command}` did not answer within {exc.timeout:g}s",
                hint=f"the service manager may be busy or hung; check `systemctl {self._scope_flag} status`",
            ) from exc
        except OSError as exc:  # it could not start, or printed without end
            raise SystemdError(
                f"`{command}` failed: {exc}",
                hint=f"check that `systemctl {self._scope_flag} status` works here",
            ) from exc
        if proc.returncode != 0:
            detail = proc.stderr.strip() or proc.stdout.strip() or f"exit status {proc.returncode}"
            if "Failed to connect to bus" in detail or "Failed to get D-Bus connection" in detail:
                raise self._unreachable(env, detail)
            if "Access denied" in detail or "authentication required" in detail.lower():
                raise SystemdError(
                    f"`{command}` was refused: {detail}",
                    hint="run as root (sudo), or pass --user for services of your own user manager",
                )
            raise SystemdError(f"`{command}` failed: {detail}")
        return proc.stdout

    def journal_tail(self, unit: str, lines: int = JOURNAL_LINES) -> tuple[str, ...]:
        """The unit's last ``lines`` lines in the journal (as ``journalctl -u`` prints them); none when
        journalctl is missing, fails or has no journal (what a failed start's error adds, never raises)."""
        argv = [
            "journalctl",
            self._scope_flag,
            "-u",
            unit,
            "-n",
            str(lines),
            "--no-pager",
            "-q",
            "-o",
            "short",
        ]
        try:
            proc = children.run(argv, env=self._env(), timeout=self.call_timeout_s)
        except (OSError, subprocess.TimeoutExpired):
            return ()
        return journal_lines(proc.stdout, lines) if proc.returncode == 0 else ()

    # ---- reading state

    def manager(self) -> ManagerInfo:
        """The manager's own properties; also the cheapest check that it can be reached."""
        props = parse_show(self.systemctl("show", "-p", "Version,SystemState,ControlGroup,UnitPath"))
        first = props[0] if props else {}
        return ManagerInfo(
            version=first.get("Version", ""),
            system_state=first.get("SystemState", ""),
            control_group=first.get("ControlGroup", ""),
            unit_path=tuple(first.get("UnitPath", "").split()),
        )

    def show(self, units: Iterable[str]) -> dict[str, UnitInfo]:
        """State of ``units`` in one ``systemctl show`` call; unknown units have load_state "not-found"."""
        blocks = self._show_blocks(units, SHOW_PROPERTIES, quote=True)
        return {name: unit_info(name, block) for name, block in blocks.items()}

    def _show_blocks(
        self, units: Iterable[str], properties: str, *, quote: bool
    ) -> dict[str, dict[str, str]]:
        """Each unit's ``properties`` in one ``systemctl show`` call (``quote``: a miscount quotes it)."""
        names = list(dict.fromkeys(check_unit_name(unit) for unit in units))
        if not names:
            return {}
        output = self.systemctl("show", "-p", properties, "--", *names)
        blocks = parse_show(output)
        if len(blocks) != len(names):
            said = f": {output[:300]!r}" if quote else ""
            raise SystemdError(f"systemctl show answered {len(blocks)} blocks for {len(names)} units{said}")
        return dict(zip(names, blocks, strict=True))

    def info(self, unit: str) -> UnitInfo:
        return self.show([unit])[unit]

    def is_active(self, unit: str) -> bool:
        return self.info(unit).is_active

    def pids_in_cgroup(self, control_group: str) -> frozenset[int]:
        """Every PID in ``control_group`` (as ``ControlGroup`` shows it) and below."""
        return read_cgroup_pids(control_group, self.cgroup_roots)

    # ---- changing state

    def daemon_reload(self) -> None:
        self.systemctl("daemon-reload", timeout_s=max(self.call_timeout_s, 90.0))

    def start(self, unit: str, *, wait: bool = False, timeout_s: float | None = None) -> None:
        """Start ``unit``. Without ``wait`` the start job is only enqueued (watch it with
        :meth:`wait_settled`); with ``wait`` systemctl waits for the job and a failed start raises."""
        check_unit_name(unit)
        if wait:
            self.systemctl("start", "--", unit, timeout_s=timeout_s)
        else:
            self.systemctl("start", "--no-block", "--", unit)

    def stop(self, unit: str, timeout_s: float, *, cancel: threading.Event | None = None) -> StopOutcome:
        """Stop ``unit`` and wait until it is down and its cgroup empty, for at most ``timeout_s``. A stop
        systemd did not carry out is said at once, not waited out; ``cancel`` ends the wait
        (``interrupted``)."""
        started = time.monotonic()
        before = self.info(unit)
        if not before.found:
            raise SystemdError(f"cannot stop {unit}: no such unit ({self._scope_flag} manager)")
        control_group = before.control_group
        # Blocks until systemd's stop job is done: no polling latency on the common path. A timeout
        # (the job goes on) or a failure is judged below from the unit's state.
        refused: SystemdError | None = None
        try:  # beyond STOP_LOOK_S the unit's processes are looked at too (one stopped, one in D)
            self.systemctl("stop", "--", unit, timeout_s=min(timeout_s, STOP_LOOK_S))
        except SystemdError as exc:
            refused = exc
            if isinstance(exc.__cause__, subprocess.TimeoutExpired) and timeout_s > STOP_LOOK_S:
                refused = self._stop_again(unit, started + timeout_s)
        deadline = started + timeout_s
        blocked = BlockedStop()
        while True:
            info = self.info(unit)
            control_group = control_group or info.control_group
            pids = self.pids_in_cgroup(control_group) if control_group else frozenset()
            now = time.monotonic()
            if info.active_state in _STOPPED_STATES and not pids:
                down = down_since_s(info, started)
                return StopOutcome(
                    unit, True, info.active_state, info.sub_state, pids, now - started, None, down
                )
            # only while systemd's stop is under way: once the unit is down, what is left in its cgroup
            # (KillMode=process) is the caller's to wait for and judge (a GPU holder in D: a reboot)
            stopping = info.active_state not in _STOPPED_STATES
            why = blocked.look(unit, self._scope_flag, pids, info.timeout_stop_s, now) if stopping else None
            interrupted = cancel is not None and cancel.is_set()
            not_done = refused is not None and info.active_state == "active" and info.job_id is None
            if why is None and (not_done or interrupted):
                why = "interrupted" if interrupted else f"the stop was not carried out: {refused}"
            if why is None and now >= deadline:
                why = _stop_failure_reason(info, control_group, pids, timeout_s)
            if why is not None:
                return StopOutcome(unit, False, info.active_state, info.sub_state, pids, now - started, why)
            time.sleep(self.poll_s)

    def _stop_again(self, unit: str, deadline: float) -> SystemdError | None:
        """After ``systemctl stop`` was ended at :data:`STOP_LOOK_S`: None when systemd has the stop job
        (or is done with it: watched by the caller); else (a busy manager had not taken the call) the
        stop asked again and waited for, as at first, until ``deadline``; what that says."""
        now = self.info(unit)
        if now.active_state != "active" or now.job_id is not None:
            return None
        try:
            self.systemctl("stop", "--", unit, timeout_s=max(0.1, deadline - time.monotonic()))
        except SystemdError as exc:
            return exc
        return None

    def wait_settled(
        self,
        unit: str,
        settle_s: float,
        timeout_s: float,
        *,
        before: UnitInfo | None = None,
        cancel: threading.Event | None = None,
        seen: MainProcess | None = None,
    ) -> SettleOutcome:
        """Wait until ``unit`` is active and stays so (same main process, no restart) for ``settle_s``.
        ``timeout_s`` bounds the wait to become active; ``before`` and ``seen``: what it was, so that an early
        restart counts (only a rise of ``NRestarts`` does); ``cancel`` ends the wait (``interrupted``)."""
        started = time.monotonic()
        deadline = started + timeout_s
        last_restarts = before.n_restarts if before is not None else None
        active_since: float | None = None
        blocked = BlockedStop()
        watch = MainWatch()  # while active: systemd asked once a second, at once when the main process exits
        try:
            while True:
                asked = time.monotonic()
                info = self.info(unit)
                watch.saw({unit: info}, asked)
                now = time.monotonic()
                if not info.found:
                    raise SystemdError(f"cannot watch {unit}: no such unit ({self._scope_flag} manager)")
                verdict: SettleVerdict | None = None
                reason: str | None = None
                state = info.active_state
                wrong = gone_wrong(unit, info, last_restarts, seen)
                if wrong is not None:
                    verdict, reason = wrong
                elif state == "active":
                    seen = main_process(info)
                    active_since = now if active_since is None else active_since
                    verdict = "settled" if now - active_since >= settle_s else None
                else:  # activating, reloading, or a job still queued (a start behind a stop that is running)
                    active_since = None
                    if state == "deactivating" and info.control_group:  # the start waits on that stop
                        pids = self.pids_in_cgroup(info.control_group)
                        reason = blocked.look(unit, self._scope_flag, pids, info.timeout_stop_s, now)
                        verdict = "failed" if reason is not None else None
                if verdict is None and active_since is None and now >= deadline:
                    verdict = "activating"
                    reason = f"{unit} is still {state} ({info.sub_state}) after {timeout_s:g}s"
                last_restarts = info.n_restarts
                if verdict is not None:
                    return SettleOutcome(unit, verdict, info, time.monotonic() - started, reason)
                until = active_since + settle_s if active_since is not None else now
                if self._pause(watch, unit, until, cancel):
                    return SettleOutcome(unit, "interrupted", info, time.monotonic() - started, "interrupted")
        finally:
            watch.close()

    def _pause(self, watch: MainWatch, unit: str, until: float, cancel: threading.Event | None) -> bool:
        """Between two looks at a started unit: ``poll_s`` at least, then until ``until`` (the settle's
        end) or until ``watch`` says to ask systemd again; True when ``cancel`` was set."""
        while True:
            if cancel is None:
                time.sleep(self.poll_s)
            elif cancel.wait(self.poll_s):
                return True
            now = time.monotonic()
            if now >= until or watch.due([unit], now):
                return False

    # ---- drop-ins

    def dropin_roots(self) -> DropinRoots:
        return dropin_roots(self.manager().unit_path)

    def dropin_path(self, unit: str, name: str, *, persistent: bool) -> Path:
        """Where drop-in ``name`` (``.conf`` added) of ``unit`` lives."""
        check_unit_name(unit)
        return self.dropin_roots().directory(unit, persistent=persistent) / _check_dropin_name(name)

    def add_dropin(self, unit: str, name: str, text: str, *, persistent: bool) -> Path:
        """Write drop-in ``name`` for ``unit`` and reload the manager. ``persistent`` drop-ins survive a
        reboot (``/etc/systemd/system/UNIT.d``, or ``$XDG_CONFIG_HOME/systemd/user/UNIT.d``); runtime ones
        live under ``/run`` (or ``$XDG_RUNTIME_DIR``) and vanish with it."""
        path = self.dropin_path(unit, name, persistent=persistent)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_name(f".{path.name}.partial")
            partial.write_text(text if text.endswith("\n") else f"{text}\n")
            partial.chmod(0o644)
            partial.replace(path)
        except OSError as exc:
            raise SystemdError(
                f"cannot write drop-in {path}: {exc}",
                hint="run as root for system services, or as their user with --user",
            ) from exc
        self.daemon_reload()
        return path

    # ---- start limits (StartLimitBurst= within StartLimitIntervalSec=)

    def start_limits(self, units: Iterable[str]) -> dict[str, StartLimit]:
        """Each unit's start limit and its last start, in one ``systemctl show`` call."""
        blocks = self._show_blocks(units, START_LIMIT_PROPERTIES, quote=False)
        return {name: start_limit(name, block) for name, block in blocks.items()}

    def reset_failed(self, unit: str) -> None:
        """``systemctl reset-failed UNIT``: its start-limit counter, failed state and restart count to 0."""
        self.systemctl("reset-failed", "--", check_unit_name(unit))

    def remove_dropin(self, unit: str, name: str, *, persistent: bool) -> bool:
        """Remove drop-in ``name`` of ``unit`` (and its directory if now empty) and reload. False (and no
        reload) when it was not there."""
        path = self.dropin_path(unit, name, persistent=persistent)
        try:
            path.unlink()
        except FileNotFoundError:
            return False
        except OSError as exc:
            raise SystemdError(f"cannot remove drop-in {path}: {exc}") from exc
        with contextlib.suppress(OSError):  # other drop-ins remain
            path.parent.rmdir()
        self.daemon_reload()
        return True


#: How long a stop waits for systemctl alone before it also looks at the unit's processes
STOP_LOOK_S = 2.0
#: How long a process of a stopping unit may stay in uninterruptible sleep (D) before it is named
STUCK_D_S = 3.0


def seconds_said(seconds: float) -> str:
    """Pure: a unit's timeout as systemd's own settings say it: ``90s``, or ``infinity``."""
    return "infinity" if math.isinf(seconds) else f"{seconds:g}s"


def blocked_reason(
    unit: str, scope: str, pid: int, name: str, state: str, timeout_stop_s: float, d_for: float = 0.0
) -> str | None:
    """Pure: why ``unit``'s stop cannot finish while its process ``pid`` is in ``state`` (as
    ``/proc/PID/stat`` says it), and the command that lets it; None for a state that does not block.
    ``T``/``t`` (stopped, traced): it does not act on the stop's SIGTERM until it runs again; ``D``
    (uninterruptible): no signal ends it before its kernel call returns."""
    kill = f"systemctl {scope + ' ' if scope == '--user' else ''}kill --signal=SIGKILL {unit}"
    bound = f"systemd kills it only after TimeoutStopSec={seconds_said(timeout_stop_s)}"
    if state in ("T", "t"):
        what = "stopped (state T: SIGSTOP, a debugger)" if state == "T" else "stopped by a tracer (state t)"
        return (
            f"{unit} cannot stop: PID {pid} ({name}) is {what} and does not act on the stop's SIGTERM "
            f"until it runs again ({bound}); `kill -CONT {pid}` lets it end, `{kill}` ends it now"
        )
    if state == "D":
        return (
            f"{unit} cannot stop: PID {pid} ({name}) is in uninterruptible sleep (state D, "
            f"{d_for:.0f} s): no signal ends it before its kernel call returns ({bound}); "
            f"`cat /proc/{pid}/stack` shows where it waits; once it returns, `{kill}` ends it, "
            "else the host needs a reboot"
        )
    return None


@dataclass
class BlockedStop:
    """At each poll of a stop: a process of the unit that keeps it from stopping (stopped, ``T``; or in
    ``D`` for :data:`STUCK_D_S`) named at once, not waited out to the unit's TimeoutStopSec."""

    d_since: dict[tuple[int, int], float] = field(default_factory=dict)

    def look(
        self, unit: str, scope: str, pids: Iterable[int], timeout_stop_s: float, now: float
    ) -> str | None:
        seen: set[tuple[int, int]] = set()
        for pid in sorted(pids):
            stat = read_stat(ProcessId(pid, None))
            if stat is None:
                continue
            if stat.state in ("T", "t"):
                return blocked_reason(unit, scope, pid, stat.name, stat.state, timeout_stop_s)
            if stat.state == "D":
                key = (pid, stat.start_time)
                seen.add(key)
                since = self.d_since.setdefault(key, now)
                if now - since >= STUCK_D_S:
                    return blocked_reason(unit, scope, pid, stat.name, "D", timeout_stop_s, now - since)
        for gone in set(self.d_since) - seen:
            del self.d_since[gone]
        return None


def _stop_failure_reason(
    info: UnitInfo, control_group: str | None, pids: frozenset[int], timeout_s: float
) -> str:
    shown = ", ".join(str(pid) for pid in sorted(pids)[:10]) + (" ..." if len(pids) > 10 else "")
    if info.active_state not in _STOPPED_STATES:
        return (
            f"{info.name} is still {info.active_state} ({info.sub_state}) after {timeout_s:g}s; "
            "systemd goes on stopping it and kills it after "
            f"TimeoutStopSec={seconds_said(info.timeout_stop_s)}"
        )
    return (
        f"{info.name} is {info.active_state} but {len(pids)} process(es) remain in "
        f"{control_group or 'its cgroup'}: {shown} (KillMode=process or none?)"
    )


# ------------------------------------------------------------------------------------- start limits

START_LIMIT_PROPERTIES = (
    "StartLimitBurst,StartLimitIntervalUSec,InactiveExitTimestampMonotonic,ExecMainStartTimestampMonotonic"
)

#: Starts a run may make of one unit: its restart, and a rollback's.
RUN_STARTS = 2


@dataclass(frozen=True, slots=True)
class StartLimit:
    """A unit's start limit (``StartLimitBurst=`` starts within ``StartLimitIntervalSec=``) and when it
    was last started (CLOCK_MONOTONIC seconds; 0: never). systemd does not show how many starts its
    counter holds: only when the last one was."""

    unit: str
    burst: int  # 0: no limit
    interval_s: float  # 0: no limit
    last_start_s: float


def start_limit(name: str, props: Mapping[str, str]) -> StartLimit:
    """Pure: a :class:`StartLimit` from one block of ``systemctl show -p START_LIMIT_PROPERTIES``."""
    try:
        interval = parse_timespan(props.get("StartLimitIntervalUSec", "") or "0")
    except ValueError:
        interval = 0.0
    last = max(_int(props.get(key, "")) for key in START_LIMIT_PROPERTIES.split(",")[2:]) / 1e6
    return StartLimit(name, _int(props.get("StartLimitBurst", "")), interval, last)


def start_limit_risk(limit: StartLimit, now_s: float, run_starts: int = RUN_STARTS) -> str | None:
    """Pure: why the run's starts of a unit could hit its start limit, or None: a unit started within
    ``StartLimitIntervalSec`` may have used up its window (docs/reinstall.md)."""
    if limit.burst <= 0 or limit.interval_s <= 0:
        return None
    said = f"StartLimitBurst={limit.burst} within {limit.interval_s:g} s"
    if limit.burst < run_starts:
        return f"{said}: fewer than the {run_starts} starts a run may make (its restart, a rollback's)"
    if limit.last_start_s > 0 and now_s - limit.last_start_s < limit.interval_s:
        ago = now_s - limit.last_start_s
        return f"{said}, last started {ago:.0f} s ago: how many starts it has left systemd does not say"
    return None


# ------------------------------------------------------------------- how a unit runs its processes


@dataclass(frozen=True, slots=True)
class ExecContext:
    """What systemd gives a unit's processes besides its command (``systemctl show``): ``Environment=``,
    ``EnvironmentFile=``, ``WorkingDirectory=``, and ``User=``, ``Group=``, ``SupplementaryGroups=``,
    ``DynamicUser=`` as written (resolved by :func:`safeinstall.env.importcheck.unit_account`)."""

    unit: str
    environment: tuple[tuple[str, str], ...]
    environment_files: tuple[tuple[str, bool], ...]
    working_directory: str
    user: str = ""
    group: str = ""
    supplementary_groups: tuple[str, ...] = ()
    dynamic_user: bool = False
    #: the argv of its (first) ``ExecStart=``, as the manager has it; () when it cannot be told
    command: tuple[str, ...] = ()


#: What :func:`exec_context` asks ``systemctl show`` for.
EXEC_PROPERTIES = (
    "ExecStart,Environment,EnvironmentFiles,WorkingDirectory,User,Group,SupplementaryGroups,DynamicUser"
)


def parse_exec_context(unit: str, text: str) -> ExecContext:
    """Pure: an :class:`ExecContext` from ``systemctl show -p EXEC_PROPERTIES`` (one ``EnvironmentFiles=``
    line per file; ``Environment=`` quoted as systemd quotes a list; ``SupplementaryGroups=`` a list of
    words)."""
    environment: dict[str, str] = {}
    files: list[tuple[str, bool]] = []
    directory = ""
    said: dict[str, str] = {}
    for line in text.splitlines():
        key, sep, value = line.partition("=")
        if not sep:
            continue
        if key == "Environment" and value:
            try:
                words = shlex.split(value)
            except ValueError:
                words = value.split()
            for word in words:
                name, has, setting = word.partition("=")
                if has and name:
                    environment[name] = setting
        elif key == "EnvironmentFiles" and value:
            path, _, flags = value.rpartition(" (")
            if not path:
                path, flags = value, ""
            files.append((path, "ignore_errors=yes" in flags))
        elif key == "WorkingDirectory":
            directory = value.lstrip("-!")
        elif key in ("User", "Group", "SupplementaryGroups", "DynamicUser"):
            said[key] = value.strip()
        elif key == "ExecStart" and "ExecStart" not in said:
            said["ExecStart"] = value
    return ExecContext(
        unit,
        tuple(environment.items()),
        tuple(files),
        directory,
        user=said.get("User", ""),
        group=said.get("Group", ""),
        supplementary_groups=tuple(said.get("SupplementaryGroups", "").split()),
        dynamic_user=said.get("DynamicUser", "") == "yes",
        command=exec_argv(said.get("ExecStart", "")),
    )


def exec_argv(value: str) -> tuple[str, ...]:
    """Pure: the argv of ``systemctl show``'s ``ExecStart={ path=... ; argv[]=A B C ; ... }`` (the first
    command; systemd quotes a word with spaces); () when there is none."""
    _, found, rest = value.partition("argv[]=")
    if not found:
        return ()
    text = rest.split(" ; ", 1)[0].strip()
    try:
        return tuple(shlex.split(text))
    except ValueError:
        return tuple(text.split())


def exec_context(systemd: Systemd, unit: str) -> ExecContext:
    """How ``unit`` runs its processes, as its manager has it loaded (SystemdError when it cannot say)."""
    name = check_unit_name(unit)
    text = systemd.systemctl("show", "-p", EXEC_PROPERTIES, "--", name)
    return parse_exec_context(name, text)
