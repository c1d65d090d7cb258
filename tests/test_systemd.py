from __future__ import annotations

import contextlib
import math
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import psutil
import pytest

from safeinstall.errors import SystemdError
from safeinstall.run.parts.units import start_units
from safeinstall.system.cgroups import parse_proc_cgroup, placement_of_proc_cgroup
from safeinstall.system.systemd import (
    WATCH_SHOW_S,
    DropinRoots,
    MainWatch,
    Systemd,
    UnitInfo,
    check_unit_name,
    dropin_roots,
    gone_wrong,
    parse_show,
    parse_timespan,
    read_cgroup_pids,
    seconds_said,
    start_wait_s,
    unit_info,
)

if TYPE_CHECKING:  # imported at run time by pytest_plugins, so that pytest can rewrite its asserts
    from tests.bed_systemd import Units, UserManager

pytest_plugins = ["tests.bed_systemd"]

# a service whose main process (sh) has a child (sleep)
PARENT_AND_CHILD = "/bin/sh -c 'sleep 1000 & wait'"
# ignores SIGTERM; its sleeps die of it but the loop goes on
IGNORES_TERM = "/bin/sh -c 'trap \"\" TERM; while :; do sleep 0.1; done'"


# ------------------------------------------------------------------------------------------ pure parts


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("1min 30s", 90.0),
        ("1.500000s", 1.5),
        ("500ms", 0.5),
        ("100us", 1e-4),
        ("100\u00b5s", 1e-4),
        ("2h", 7200.0),
        ("3d", 259200.0),
        ("1w", 604800.0),
        ("2month", 5259600.0),
        ("1y", 31557600.0),
        ("1h 2min 3.250000s", 3723.25),
        ("1min 1.001000s", 61.001),
        ("0", 0.0),
        ("45", 45.0),
        ("infinity", math.inf),
        (" 5s ", 5.0),
    ],
)
def test_parse_timespan(text: str, seconds: float) -> None:
    assert parse_timespan(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "soon", "5 parsecs", "1.2.3s", "-5s", "s"])
def test_parse_timespan_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_timespan(text)


SHOW_TWO = """\
Type=simple
TimeoutStopUSec=1min 30s
MainPID=4321
Result=success
NRestarts=0
ExecMainStartTimestampMonotonic=375924404
ControlGroup=/app.slice/t1.service
Id=t1.service
LoadState=loaded
ActiveState=active
SubState=running
FragmentPath=/home/u/.config/systemd/user/t1.service
UnitFileState=static
Job=

Type=
TimeoutStopUSec=infinity
MainPID=0
Result=success
NRestarts=0
ExecMainStartTimestampMonotonic=0
ControlGroup=
Id=nope.service
LoadState=not-found
ActiveState=inactive
SubState=dead
FragmentPath=
UnitFileState=
Job=17
"""


def test_parse_show_and_unit_info() -> None:
    first, second = parse_show(SHOW_TWO)
    running = unit_info("t1.service", first)
    assert running.main_pid == 4321
    assert running.control_group == "/app.slice/t1.service"
    assert running.timeout_stop_s == 90.0
    assert running.is_active and running.found
    assert running.exec_main_start_us == 375924404
    assert running.fragment_path == "/home/u/.config/systemd/user/t1.service"
    assert running.job_id is None
    missing = unit_info("nope.service", second)
    assert not missing.found and not missing.is_active
    assert missing.main_pid is None and missing.control_group is None and missing.fragment_path is None
    assert missing.timeout_stop_s == math.inf
    assert missing.job_id == 17


def test_parse_show_keeps_equals_in_values() -> None:
    assert parse_show("Environment=A=1 B=2\n\n\n") == [{"Environment": "A=1 B=2"}]


def test_a_started_unit_is_watched_as_long_as_its_own_start_timeout() -> None:
    """A model server loading for many minutes (TimeoutStartSec=infinity) is not judged by a fixed
    bound; nor is a unit whose start systemd itself gives up on watched forever."""
    slow = unit_info(
        "vllm.service", {"TimeoutStartUSec": "infinity", "RequiredBy": "proxy.service a.service"}
    )
    assert slow.timeout_start_s == math.inf and start_wait_s(slow) == math.inf
    assert slow.dependents == ("proxy.service", "a.service")
    quick = unit_info("x.service", {"TimeoutStartUSec": "20min"})
    assert start_wait_s(quick) == 20 * 60 + 30
    assert start_wait_s(unit_info("y.service", {})) == 90 + 30 == start_wait_s(None)


def test_what_ends_the_wait_after_a_start() -> None:
    """Pure (issue 43, item 5: the health check ends at once on it): failed, inactive with no job left,
    an automatic restart (NRestarts rose), or another main process than the one seen active; not while
    it activates, a job is queued, or it runs as seen."""

    def info(state: str, pid: int = 10, start: int = 5, restarts: int = 0, job: str = "") -> UnitInfo:
        return unit_info(
            "a.service",
            {"ActiveState": state, "SubState": "x", "MainPID": str(pid), "NRestarts": str(restarts)}
            | {"ExecMainStartTimestampMonotonic": str(start), "Job": job, "Result": "exit-code"},
        )

    def verdict(
        state: UnitInfo, last: int | None = 0, seen: tuple[int | None, int] | None = None
    ) -> str | None:
        said = gone_wrong("a.service", state, last, seen)
        return None if said is None else said[0]

    assert gone_wrong("a.service", info("failed"), 0, None) == (
        "failed",
        "a.service failed (x, Result=exit-code)",
    )
    assert verdict(info("inactive")) == "inactive"
    assert verdict(info("inactive", job="7 start")) is None  # its start is queued
    assert verdict(info("activating", restarts=1)) == "restarted"  # Restart=: its main process exited
    assert verdict(info("active", pid=11, start=6), seen=(10, 5)) == "restarted"
    assert verdict(info("active"), seen=(10, 5)) is None
    assert verdict(info("activating"), last=None) is None


def test_unit_info_rejects_unreadable_timeout() -> None:
    with pytest.raises(SystemdError, match="TimeoutStopUSec"):
        unit_info("x.service", {"TimeoutStopUSec": "whenever"})


def test_dropin_roots_from_unit_path() -> None:
    system = dropin_roots(
        [
            "/etc/systemd/system.control",
            "/run/systemd/system.control",
            "/run/systemd/transient",
            "/etc/systemd/system",
            "/run/systemd/system",
            "/usr/lib/systemd/system",
        ]
    )
    assert system == DropinRoots(Path("/etc/systemd/system"), Path("/run/systemd/system"))
    assert system.directory("a.service", persistent=False) == Path("/run/systemd/system/a.service.d")
    user = dropin_roots(
        [
            "/home/u/.config/systemd/user.control",
            "/run/user/1000/systemd/user.control",
            "/home/u/.config/systemd/user",
            "/etc/systemd/user",
            "/run/user/1000/systemd/user",
        ]
    )
    assert user == DropinRoots(Path("/home/u/.config/systemd/user"), Path("/run/user/1000/systemd/user"))


@pytest.mark.parametrize(
    "unit_path",
    [[], ["/etc/systemd/system"], ["/etc/systemd/system.control", "/run/systemd/system.control"]],
)
def test_dropin_roots_refuses_odd_unit_paths(unit_path: list[str]) -> None:
    with pytest.raises(SystemdError):
        dropin_roots(unit_path)


@pytest.mark.parametrize("name", ["", "vllm", "-x.service", "a b.service", "../x.service", "a/b.service"])
def test_check_unit_name_refuses(name: str) -> None:
    with pytest.raises(SystemdError, match="not a valid unit name"):
        check_unit_name(name)


def test_read_cgroup_pids_walks_sub_cgroups(tmp_path: Path) -> None:
    root = tmp_path / "unified"
    (root / "a.service" / "worker").mkdir(parents=True)
    (root / "cgroup.procs").write_text("1\n")
    (root / "a.service" / "cgroup.procs").write_text("10\n11\n")
    (root / "a.service" / "worker" / "cgroup.procs").write_text("12\n")
    not_a_hierarchy = tmp_path / "tmpfs"
    (not_a_hierarchy / "a.service").mkdir(parents=True)
    (not_a_hierarchy / "a.service" / "cgroup.procs").write_text("99\n")
    roots = (not_a_hierarchy, root)
    assert read_cgroup_pids("/a.service", roots) == {10, 11, 12}
    assert read_cgroup_pids("/gone.service", roots) == frozenset()


def test_unreachable_user_manager_says_what_to_do(tmp_path: Path) -> None:
    lonely = Systemd(user=True, environ={"PATH": "/usr/bin:/bin", "XDG_RUNTIME_DIR": str(tmp_path)})
    with pytest.raises(SystemdError, match="systemctl --user not reachable") as caught:
        lonely.manager()
    assert str(tmp_path) in caught.value.message
    assert caught.value.hint is not None and "XDG_RUNTIME_DIR" in caught.value.hint


def test_missing_systemctl(tmp_path: Path) -> None:
    with pytest.raises(SystemdError, match="systemctl not found"):
        Systemd(environ={"PATH": str(tmp_path)}).manager()


# ------------------------------------------------------------------------------- with a real manager


@pytest.fixture
def svc(user_manager: UserManager) -> Systemd:
    return Systemd(user=True, environ=user_manager.env, poll_s=0.05)


def wait_until(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout:g}s waiting for {what}"
        time.sleep(0.05)


def _child_of(pid: int) -> int:
    children: list[psutil.Process] = []

    def has_child() -> bool:
        children[:] = psutil.Process(pid).children()
        return bool(children)

    wait_until(has_child, 5, f"a child of {pid}")
    return children[0].pid


@pytest.mark.systemd
def test_manager_info(svc: Systemd, user_manager: UserManager) -> None:
    info = svc.manager()
    assert info.system_state in ("running", "degraded")
    assert info.version.startswith(tuple("0123456789"))
    if user_manager.cgroup_name:
        assert info.control_group == f"/{user_manager.cgroup_name}"


@pytest.mark.systemd
def test_in_process_code_reaches_the_private_manager(user_manager_environ: UserManager) -> None:
    info = Systemd(user=True).manager()  # os.environ, as patched
    if user_manager_environ.cgroup_name:
        assert info.control_group == f"/{user_manager_environ.cgroup_name}"
    assert Systemd(user=True).dropin_roots().runtime == user_manager_environ.runtime_unit_dir


@pytest.mark.systemd
def test_show_running_unit(svc: Systemd, units: Units, user_manager: UserManager) -> None:
    name = units.started("show", PARENT_AND_CHILD, TimeoutStopSec="42")
    info = svc.show([name])[name]
    assert info.id == name
    assert (info.load_state, info.active_state, info.sub_state) == ("loaded", "active", "running")
    assert info.main_pid == user_manager.main_pid(name)
    assert info.control_group is not None and info.control_group.endswith(f"/app.slice/{name}")
    assert info.timeout_stop_s == 42.0
    assert info.type == "simple"
    assert info.fragment_path == str(user_manager.unit_dir / name)
    assert info.n_restarts == 0 and info.job_id is None and info.exec_main_start_us > 0
    assert svc.is_active(name)


@pytest.mark.systemd
@pytest.mark.parametrize(("setting", "seconds"), [("1.5", 1.5), ("2min 3s", 123.0), ("infinity", math.inf)])
def test_show_timeout_stop(svc: Systemd, units: Units, setting: str, seconds: float) -> None:
    name = units.service("timeout", "/bin/sleep 1000", TimeoutStopSec=setting)
    assert svc.info(name).timeout_stop_s == seconds


@pytest.mark.systemd
def test_show_many_in_one_call_with_unknown(svc: Systemd, units: Units) -> None:
    name = units.started("many", "/bin/sleep 1000")
    unknown = "si-never-written.service"
    infos = svc.show([name, unknown, name])
    assert list(infos) == [name, unknown]
    assert infos[name].is_active
    assert infos[unknown].load_state == "not-found" and not infos[unknown].found
    assert infos[unknown].main_pid is None and infos[unknown].control_group is None
    assert svc.show([]) == {}


@pytest.mark.systemd
def test_a_unit_that_cannot_be_started_keeps_no_other_down(svc: Systemd, units: Units) -> None:
    """A new-user review: the first unit that could not be started (removed since the stop) ended the
    loop, so ``--recover`` at boot left the others down. Each is started; the error names each failure."""
    name = units.service("start-each", "/bin/sleep 1000")
    gone, also_gone = "si-removed-a.service", "si-removed-b.service"
    with pytest.raises(SystemdError) as caught:
        start_units(svc, [gone, name, also_gone])
    assert gone in caught.value.message and also_gone in caught.value.message, caught.value.message
    wait_until(lambda: svc.is_active(name), 20, f"{name} started")
    with pytest.raises(SystemdError) as one:
        start_units(svc, [gone])
    assert gone in one.value.message and also_gone not in one.value.message


@pytest.mark.systemd
def test_proc_cgroup_of_unit_processes_maps_to_the_unit(svc: Systemd, units: Units) -> None:
    name = units.started("cgroup", PARENT_AND_CHILD)
    info = svc.info(name)
    assert info.main_pid is not None
    child = _child_of(info.main_pid)
    for pid in (info.main_pid, child):
        placement = placement_of_proc_cgroup(Path(f"/proc/{pid}/cgroup").read_text())
        assert placement.unit == name
        assert placement.path == info.control_group
        assert not placement.is_stray


@pytest.mark.systemd
def test_strays_and_scopes_map_to_no_unit(units: Units) -> None:
    stray = units.stray("/bin/sleep", "1000")
    placement = placement_of_proc_cgroup(Path(f"/proc/{stray.pid}/cgroup").read_text())
    assert placement.is_stray
    scope, process = units.scope("/bin/sleep", "1000")

    def in_scope() -> bool:
        text = Path(f"/proc/{process.pid}/cgroup").read_text()
        return placement_of_proc_cgroup(text).scope == scope

    wait_until(in_scope, 5, f"the process to enter {scope}")
    assert placement_of_proc_cgroup(Path(f"/proc/{process.pid}/cgroup").read_text()).is_stray


@pytest.mark.systemd
def test_pids_in_cgroup_then_stop(svc: Systemd, units: Units) -> None:
    name = units.started("stop", PARENT_AND_CHILD)
    info = svc.info(name)
    assert info.main_pid is not None and info.control_group is not None
    child = _child_of(info.main_pid)
    assert svc.pids_in_cgroup(info.control_group) == {info.main_pid, child}

    outcome = svc.stop(name, timeout_s=10)
    assert outcome.stopped, outcome.reason
    assert outcome.active_state == "inactive" and not outcome.leftover_pids and outcome.reason is None
    assert svc.pids_in_cgroup(info.control_group) == frozenset()
    assert not psutil.pid_exists(info.main_pid) and not psutil.pid_exists(child)
    assert svc.stop(name, timeout_s=5).stopped  # stopping a stopped unit is fine


@pytest.mark.systemd
def test_stop_unknown_unit_refused(svc: Systemd) -> None:
    with pytest.raises(SystemdError, match="no such unit"):
        svc.stop("si-never-written.service", timeout_s=1)


@pytest.mark.systemd
def test_stop_times_out_and_a_start_brings_it_back_after_the_kill(svc: Systemd, units: Units) -> None:
    name = units.started("ignores-term", IGNORES_TERM, TimeoutStopSec="3")
    first_pid = svc.info(name).main_pid

    outcome = svc.stop(name, timeout_s=0.5)
    assert not outcome.stopped
    assert outcome.active_state == "deactivating"
    assert first_pid in outcome.leftover_pids
    assert outcome.reason is not None and "TimeoutStopSec=3" in outcome.reason

    # the stop cannot be taken back: the start queues behind it, and the unit returns once it was killed
    svc.start(name)
    settled = svc.wait_settled(name, settle_s=0.5, timeout_s=15)
    assert settled.ok, settled.reason
    assert settled.info.main_pid not in (None, first_pid)
    assert not psutil.pid_exists(first_pid or 0)


@pytest.mark.systemd
def test_stop_reports_processes_left_in_the_cgroup(svc: Systemd, units: Units) -> None:
    name = units.started("killmode", PARENT_AND_CHILD, KillMode="process")
    info = svc.info(name)
    assert info.main_pid is not None
    child = _child_of(info.main_pid)

    outcome = svc.stop(name, timeout_s=1)
    assert not outcome.stopped
    assert outcome.active_state in ("inactive", "failed")
    assert outcome.leftover_pids == {child}
    assert outcome.reason is not None and "remain" in outcome.reason and str(child) in outcome.reason


@pytest.mark.systemd
def test_wait_settled_ok(svc: Systemd, units: Units) -> None:
    name = units.service("settle", "/bin/sleep 1000")
    svc.start(name)
    outcome = svc.wait_settled(name, settle_s=1, timeout_s=10)
    assert outcome.ok and outcome.verdict == "settled" and outcome.reason is None
    assert outcome.waited_s >= 1
    assert outcome.info.is_active


@pytest.mark.systemd
def test_a_settle_asks_systemd_about_once_a_second(
    user_manager: UserManager, units: Units, tmp_path: Path
) -> None:
    """The settle of an active unit (``--settle``, 5 s by default, beside the service's own start) asks
    ``systemctl show`` about once a second while its main process is held by a pidfd, not every
    ``poll_s`` (0.02 s: 100 to 150 calls in these 3 s before); counted by a ``systemctl`` on ``PATH``."""
    calls = tmp_path / "calls"
    shim = tmp_path / "bin"
    shim.mkdir()
    real = shutil.which("systemctl")
    assert real is not None
    (shim / "systemctl").write_text(f'#!/bin/sh\necho "$*" >> {calls}\nexec {real} "$@"\n')
    (shim / "systemctl").chmod(0o755)
    name = units.started("settle", "/bin/sleep 1000")
    path = f"{shim}{os.pathsep}{user_manager.env.get('PATH', '/usr/bin:/bin')}"
    watched = Systemd(user=True, environ={**user_manager.env, "PATH": path})
    outcome = watched.wait_settled(name, settle_s=3, timeout_s=10)
    assert outcome.ok, outcome
    shows = [line for line in calls.read_text().splitlines() if "show" in line.split()]
    assert len(shows) <= 3 + 4, len(shows)  # once a second, and the first looks that trust the pidfd


@contextlib.contextmanager
def _watchdog(seconds: float) -> Iterator[threading.Event]:
    """A ``cancel`` event for wait_settled that is set after ``seconds``: a wait that would sit out its
    hour of settle time ends ``interrupted`` instead of hanging the suite (the verdict fails the test)."""
    cancel = threading.Event()
    timer = threading.Timer(seconds, cancel.set)
    timer.start()
    try:
        yield cancel
    finally:
        timer.cancel()


@pytest.mark.systemd
def test_wait_settled_detects_failure(svc: Systemd, units: Units) -> None:
    """The unit's failure ends the wait, not the clock: with an hour of settle time to wait out, the
    verdict is the failure."""
    name = units.service("fails", "/bin/sh -c 'sleep 0.5; exit 1'", Restart="no")
    svc.start(name)
    with _watchdog(60) as cancel:
        outcome = svc.wait_settled(name, settle_s=3600, timeout_s=10, cancel=cancel)
    assert outcome.verdict == "failed" and not outcome.ok
    assert outcome.info.result == "exit-code"
    assert outcome.reason is not None and "exit-code" in outcome.reason


@pytest.mark.systemd
def test_wait_settled_detects_automatic_restart(svc: Systemd, units: Units) -> None:
    name = units.service("restarts", "/bin/sh -c 'sleep 0.5; exit 1'", Restart="on-failure", RestartSec="0.2")
    before = svc.info(name)
    svc.start(name)
    with _watchdog(60) as cancel:  # an hour of settle time: the restart ends the wait
        outcome = svc.wait_settled(name, settle_s=3600, timeout_s=10, before=before, cancel=cancel)
    assert outcome.verdict == "restarted"
    assert outcome.info.n_restarts > before.n_restarts


@pytest.mark.systemd
def test_wait_settled_gives_up_on_a_unit_that_stays_activating(svc: Systemd, units: Units) -> None:
    name = units.service("slow", "/bin/sleep 1000", ExecStartPre="/bin/sleep 1000")
    svc.start(name)
    outcome = svc.wait_settled(name, settle_s=0.5, timeout_s=1)
    assert outcome.verdict == "activating"
    assert outcome.info.active_state == "activating"
    assert outcome.reason is not None and "still activating" in outcome.reason


@pytest.mark.systemd
def test_wait_settled_reports_a_unit_that_exits(svc: Systemd, units: Units) -> None:
    name = units.service("exits", "/bin/true")
    svc.start(name)
    outcome = svc.wait_settled(name, settle_s=2, timeout_s=10)
    assert outcome.verdict == "inactive"
    assert outcome.info.result == "success"


@pytest.mark.systemd
def test_runtime_dropin_sets_environment(svc: Systemd, units: Units, user_manager: UserManager) -> None:
    name = units.service("env", "/bin/sleep 1000")
    path = svc.add_dropin(name, "50-safeinstall-test", "[Service]\nEnvironment=SI_MARK=1", persistent=False)
    assert path == user_manager.runtime_unit_dir / f"{name}.d" / "50-safeinstall-test.conf"
    assert path.read_text() == "[Service]\nEnvironment=SI_MARK=1\n"
    props = user_manager.show(name, "Environment", "DropInPaths")
    assert "SI_MARK=1" in props["Environment"].split()
    assert str(path) in props["DropInPaths"].split()

    assert svc.remove_dropin(name, "50-safeinstall-test", persistent=False)
    assert not path.exists() and not path.parent.exists()
    assert "SI_MARK=1" not in user_manager.show(name, "Environment")["Environment"]
    assert not svc.remove_dropin(name, "50-safeinstall-test", persistent=False)


@pytest.mark.systemd
def test_persistent_gate_dropin_blocks_start(svc: Systemd, units: Units, user_manager: UserManager) -> None:
    name = units.service("gate", "/bin/sleep 1000")
    path = svc.add_dropin(
        name, "safeinstall-gate.conf", "[Service]\nExecStartPre=/bin/false\n", persistent=True
    )
    assert path == user_manager.unit_dir / f"{name}.d" / "safeinstall-gate.conf"

    with pytest.raises(SystemdError, match=name):
        svc.start(name, wait=True)
    info = svc.info(name)
    assert info.active_state == "failed" and info.result == "exit-code"

    # the same gate seen through a non-blocking start
    user_manager.systemctl("reset-failed", name)
    svc.start(name)
    assert svc.wait_settled(name, settle_s=1, timeout_s=10).verdict == "failed"

    assert svc.remove_dropin(name, "safeinstall-gate", persistent=True)
    svc.start(name, wait=True)
    assert svc.wait_settled(name, settle_s=0.3, timeout_s=10).ok


@pytest.mark.systemd
def test_dropin_names_are_checked(svc: Systemd, units: Units) -> None:
    name = units.service("names", "/bin/sleep 1000")
    for bad in ("../escape", ".hidden", "a/b"):
        with pytest.raises(SystemdError, match="drop-in name"):
            svc.add_dropin(name, bad, "[Service]\n", persistent=False)


#: a service that stops itself (SIGSTOP) when asked to stop: after systemd's SIGCONT, so it stays so
STOPS_ITSELF = "#!/bin/sh\ntrap 'kill -STOP $$' TERM\nwhile :; do sleep 0.1; done\n"


@pytest.mark.systemd
def test_a_stop_held_up_by_a_stopped_process_is_named_at_once(
    svc: Systemd, units: Units, tmp_path: Path
) -> None:
    """Issue 44 item 5: a unit with ``TimeoutStopSec=infinity`` whose process is stopped (state T)
    never stops; the run waited out its bound and said "kills it after TimeoutStopSec=infs", never the
    PID or the fix. The stop now ends at once, naming the PID, its state, ``kill -CONT`` and
    ``systemctl kill``, and the unit's timeout said as ``infinity``; so does a start queued behind it."""
    script = tmp_path / "stops-itself"
    script.write_text(STOPS_ITSELF)
    script.chmod(0o755)
    name = units.started("stops-itself", str(script), TimeoutStopSec="infinity")
    pid = svc.info(name).main_pid
    assert pid is not None
    try:
        outcome = svc.stop(name, timeout_s=120)
        assert not outcome.stopped
        reason = outcome.reason or ""
        assert f"PID {pid} " in reason and "state T" in reason, reason
        assert f"kill -CONT {pid}" in reason and "kill --signal=SIGKILL" in reason, reason
        assert "TimeoutStopSec=infinity" in reason and "infs" not in reason, reason
        svc.start(name)
        settled = svc.wait_settled(name, settle_s=0.5, timeout_s=120)
        assert settled.verdict == "failed" and f"kill -CONT {pid}" in (settled.reason or ""), settled
    finally:
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)


def test_timeouts_are_said_as_systemd_says_them() -> None:
    assert seconds_said(math.inf) == "infinity" and seconds_said(90.0) == "90s"


# ------------------------------------------------------------------ a started unit's main process by pidfd


def _main_info(unit: str, pid: int, control_group: str, start_us: int = 5) -> UnitInfo:
    """Pure: what ``systemctl show`` says of ``unit`` active with main process ``pid``."""
    props = {
        "Id": unit,
        "LoadState": "loaded",
        "ActiveState": "active",
        "SubState": "running",
        "MainPID": str(pid),
        "ControlGroup": control_group,
        "ExecMainStartTimestampMonotonic": str(start_us),
    }
    return unit_info(unit, props)


@contextlib.contextmanager
def _sleeper() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A real process (``sleep``) and its cgroup, as a unit's main process stands for one."""
    child = subprocess.Popen(["sleep", "60"])
    try:
        group = parse_proc_cgroup(Path(f"/proc/{child.pid}/cgroup").read_text())
        assert group is not None
        yield child, group
    finally:
        child.kill()
        child.wait()


def test_a_main_process_held_by_its_pidfd_is_asked_about_once_a_second() -> None:
    """Issue 43, item 5 at little cost: a started unit's main process held by a pidfd, systemd is asked
    again only every WATCH_SHOW_S, and at once when that process exits; the pidfd is trusted only once
    a later show names the same main process (a PID read once may be reused before the pidfd is taken)."""
    with _sleeper() as (child, group):
        watch = MainWatch()
        info = _main_info("app.service", child.pid, group)
        try:
            watch.saw({"app.service": info}, at=100.0)
            assert watch.due(["app.service"], 100.1)  # held, but not yet named again after the pidfd
            watch.saw({"app.service": info}, at=100.2)
            assert not watch.due(["app.service"], 100.3)  # trusted: no show needed
            assert watch.due(["app.service"], 100.2 + WATCH_SHOW_S)  # but once a second all the same
            assert watch.due(["app.service", "other.service"], 100.3)  # a unit not held: every poll
            child.kill()
            child.wait()
            assert watch.due(["app.service"], 100.3)  # it exited: ask systemd now
        finally:
            watch.close()
        assert not watch.held


def test_a_main_process_is_held_only_in_its_units_cgroup_and_as_shown() -> None:
    """A MainPID that is a process of another cgroup (a reused PID, a PID of another namespace) is not
    held; another main process (another PID, or the same PID started again) is held afresh, untrusted."""
    with _sleeper() as (child, group):
        watch = MainWatch()
        try:
            watch.saw({"app.service": _main_info("app.service", child.pid, "/elsewhere/app.service")}, at=1.0)
            assert not watch.held and watch.due(["app.service"], 1.1)
            info = _main_info("app.service", child.pid, group)
            watch.saw({"app.service": info}, at=2.0)
            watch.saw({"app.service": info}, at=2.1)
            assert not watch.due(["app.service"], 2.2)
            again = _main_info("app.service", child.pid, group, start_us=6)  # started again, same PID
            watch.saw({"app.service": again}, at=2.3)
            assert watch.due(["app.service"], 2.4)
            assert watch.held["app.service"].process == (child.pid, 6)
        finally:
            watch.close()


def _unified() -> Path:
    hybrid = Path("/sys/fs/cgroup/unified")
    return hybrid if (hybrid / "cgroup.procs").exists() else Path("/sys/fs/cgroup")


def test_a_main_process_in_a_cgroup_named_by_any_bytes_is_watched_without_a_crash_or_a_leak(
    user_manager: UserManager, units: Units, tmp_path: Path
) -> None:
    """A service names its own cgroups (every --user unit, Delegate=yes): its main process moved into a
    sub-cgroup named b'x\\xff' settles as any other, and no pidfd is left open (the cgroup file was
    read as UTF-8 and raised out of the run's, the rollback's and --recover's waits; attacker review)."""
    script = tmp_path / "main.sh"
    script.write_text(
        'p=$(sed -n "s/^0:://p" /proc/self/cgroup)\n'
        f'd=$(printf "{_unified()}%s/x\\377" "$p")\n'
        'mkdir "$d" && echo $$ > "$d/cgroup.procs"\nexec sleep 1000\n'
    )
    name = units.service("nonutf8", f"/bin/sh {script}")
    systemd = Systemd(user=True, environ=user_manager.env)
    before = systemd.info(name)

    def pidfds() -> int:
        links = []
        for fd in os.listdir("/proc/self/fd"):
            with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
                links.append(os.readlink(f"/proc/self/fd/{fd}"))
        return sum("pidfd" in link for link in links)

    held = pidfds()
    systemd.start(name)
    try:
        assert systemd.wait_settled(name, settle_s=1, timeout_s=20, before=before).ok
        assert pidfds() == held
    finally:
        systemd.systemctl("stop", "--", name)


def test_units_started_together_each_wait_as_long_as_the_longest_start(
    user_manager: UserManager, units: Units
) -> None:
    """B is ordered After=A; A starts slowly within its own TimeoutStartSec, B's own is short. Started
    together (a run's restart, its rollback, --recover), B's wait is counted from the enqueue while its
    job waits behind A: each unit is allowed the longest start of them (B gave up while A still loaded,
    and --recover put back a good version; attacker review)."""
    from safeinstall.run.parts.units import start_journalled
    from safeinstall.store.journal import JournalUnit

    slow = units.service("slow", "/bin/sleep 33", Type="oneshot", RemainAfterExit="yes", TimeoutStartSec="60")
    after = units.create(
        "after", f"[Unit]\nAfter={slow}\n[Service]\nExecStart=/bin/sleep 1000\nTimeoutStartSec=1\n"
    )
    journal = [
        JournalUnit(slow, True, True, "static", stopped=True),
        JournalUnit(after, True, True, "static", stopped=True),
    ]
    systemd = Systemd(user=True, environ=user_manager.env)
    assert start_wait_s(systemd.info(after)) == 31.0
    try:
        start_journalled(journal, user_manager.env, settle=0)
        assert systemd.info(after).active_state == "active"
    finally:
        for name in (after, slow):
            systemd.systemctl("stop", "--", name)
