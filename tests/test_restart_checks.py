"""Restarts that cannot work are said, not waited out (issue 34): a unit whose start limit the restart
could hit is reset first (needrestart#340), and the plan says so; a stopped process that stays in
uninterruptible sleep holding GPU memory is named at once as needing a reboot; a GPU with NVML
persistence mode off is a plan warning."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
from pathlib import Path
from typing import Any

from safeinstall.run.steps.reinstall import STUCK_AFTER_S, stuck_on_gpu
from safeinstall.system.identity import StatInfo, parse_stat
from safeinstall.system.systemd import StartLimit, start_limit_risk
from tests.bed_nvml import GiB
from tests.bed_systemd import cgroup_pids, wait_until
from tests.beds import Bed, maps_so


def test_a_unit_at_its_start_limit_is_reset_before_the_restart(bed: Bed) -> None:
    """A real unit of the private manager with ``StartLimitBurst=2`` in an hour, started and restarted
    (two starts: at its limit). Without the reset systemd would refuse the run's restart
    (start-limit-hit). Honestly: on this host's systemd (252) the gate's ``daemon-reload`` zeroes the
    counter as well, so here this case holds even without the reset; the crash-loop case below is the
    one the reset decides on this systemd."""
    name = bed.units.create(
        "limited",
        "[Unit]\nDescription=safeinstall test unit\nStartLimitBurst=2\nStartLimitIntervalSec=1h\n\n"
        f"[Service]\nExecStart={bed.python.parent}/sicext-serve\n",
    )
    bed.manager.start(name)
    bed.manager.systemctl("restart", name)
    bed.manager.wait_active(name)
    wait_until(lambda: maps_so(bed.manager.main_pid(name)) is not None, 15, "service maps the .so")
    wheel = str(bed.wheels["sicext-2"])
    plan = bed.safeinstall("sicext", "--wheel", wheel, "--dry-run", "--json").json["data"]
    (reset,) = plan["start_limit_resets"]
    assert reset["unit"] == name and "StartLimitBurst=2 within 3600 s" in reset["reason"], reset
    shown = bed.cli("sicext", "--wheel", wheel, "--dry-run")
    assert f"start limit of {name}: " in shown.stdout and "systemctl reset-failed" in shown.stdout
    done = bed.safeinstall("sicext", "--wheel", wheel, "--settle", "0.5", "--json")
    assert done.code == 0, done.stdout + done.stderr
    stop = next(s for s in done.json["data"]["steps"] if s["name"] == "stop")
    assert f"start limit reset first (systemctl reset-failed): {name}" in stop["detail"]
    assert bed.manager.active_state(name) == "active" and bed.version() == "2.0"
    assert maps_so(bed.manager.main_pid(name)) == bed.so.stat().st_ino


def test_a_crash_looping_new_version_does_not_leave_the_service_down(bed: Bed) -> None:
    """``Restart=on-failure`` and ``StartLimitBurst=1``: the new version (sicext 3) crashes at import,
    its automatic restart is refused (start-limit-hit: the unit stays failed); the rollback's start is
    reset first, so the old version runs again (without the reset it is refused too: the service left
    down, exit 4). On this systemd (252) a ``daemon-reload`` (the gate's) zeroes the counter too, so
    the starts that count here are the run's own, after it."""
    name = bed.units.create(
        "looping",
        "[Unit]\nDescription=safeinstall test unit\nStartLimitBurst=1\nStartLimitIntervalSec=1h\n\n"
        f"[Service]\nExecStart={bed.python.parent}/sicext-serve\nRestart=on-failure\nRestartSec=0.1\n",
    )
    bed.manager.start(name)
    bed.manager.wait_active(name)
    wait_until(lambda: maps_so(bed.manager.main_pid(name)) is not None, 15, "service maps the .so")
    done = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-3"]), "--settle", "2", "--json", "--no-smoke"
    )
    assert done.code == 3, done.stdout + done.stderr  # rolled back
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "the old version running again")
    assert bed.version() == "1.0"
    wait_until(lambda: maps_so(bed.manager.main_pid(name)) is not None, 15, "service maps the .so")


def test_which_start_limits_the_run_resets() -> None:
    """Pure: only a limit the run's starts could hit; systemd shows when the last start was, not how
    many starts its counter holds."""
    now = 10_000.0
    recent = StartLimit("a.service", burst=5, interval_s=10.0, last_start_s=now - 3)
    assert "last started 3 s ago" in (start_limit_risk(recent, now) or "")
    old = StartLimit("a.service", burst=5, interval_s=10.0, last_start_s=now - 3600)
    assert start_limit_risk(old, now) is None  # a new window: the run's own starts count alone
    single = StartLimit("a.service", burst=1, interval_s=10.0, last_start_s=now - 3600)
    assert "fewer than the 2 starts" in (start_limit_risk(single, now) or "")  # the rollback's start
    for none in (StartLimit("a.service", 0, 10.0, now - 1), StartLimit("a.service", 5, 0.0, now - 1)):
        assert start_limit_risk(none, now) is None  # StartLimitIntervalSec=0 or burst 0: no limit


def test_persistence_mode_off_is_a_plan_warning(bed: Bed) -> None:
    """The real pynvml call (``nvmlDeviceGetPersistenceMode``) over the fake driver: a GPU the service
    uses with persistence mode off is a warning of the plan (each start pays its initialisation); the
    same GPU with it on, or one the service does not use, is none."""
    name = bed.service("gpu")
    used = bed.nvml.add_gpu("NVIDIA H200", "GPU-00000000-0000-0000-0000-0000000000b1", 141 * GiB)
    idle = bed.nvml.add_gpu("NVIDIA H200", "GPU-00000000-0000-0000-0000-0000000000b2", 141 * GiB)
    bed.nvml.hold(bed.manager.main_pid(name), used, 20 * GiB)
    bed.nvml.set_persistence_mode(idle, False)  # no planned process on it: no warning
    wheel = str(bed.wheels["sicext-2"])

    def plan() -> dict[str, Any]:
        data: dict[str, Any] = bed.safeinstall("sicext", "--wheel", wheel, "--dry-run", "--json").json["data"]
        return data

    on = plan()
    assert [g["persistence_mode"] for g in on["gpus"]["gpus"]] == [True, False]
    assert not any("persistence mode" in w for w in on["warnings"]), on["warnings"]
    bed.nvml.set_persistence_mode(used, False)
    off = plan()
    (warning,) = [w for w in off["warnings"] if "persistence mode" in w]
    assert warning.startswith("GPU 0 (NVIDIA H200) has NVML persistence mode off"), warning
    assert "1-3 s per GPU" in warning


#: A process that /proc shows in ``D`` for as long as the test wants: after ``vfork()`` the parent
#: waits in the kernel (TASK_KILLABLE, shown as ``D``) until its child execs or exits, and the child
#: stops itself (SIGSTOP). A real stuck process (in nvidia_uvm) ignores SIGKILL too; this one only
#: escapes the unit's stop by ``KillMode=process`` (only the main process is signalled), and the test
#: ends it with SIGKILL. What the run sees of it is the same: ``D`` in /proc/PID/stat, GPU memory held
#: (the fake NVML), never exiting by itself.
IN_D_STATE = r"""
#include <signal.h>
#include <unistd.h>
int main(void) {
    if (vfork() == 0) {
        kill(getpid(), SIGSTOP);
        _exit(0);
    }
    return 0;
}
"""


def _state(pid: int) -> str:
    try:
        return parse_stat(Path(f"/proc/{pid}/stat").read_text()).state
    except (OSError, ValueError):
        return ""


def test_a_stopped_gpu_holder_stuck_in_d_state_needs_a_reboot(bed: Bed, tmp_path: Path) -> None:
    helper = tmp_path / "in_d_state"
    source = tmp_path / "in_d_state.c"
    source.write_text(IN_D_STATE)
    subprocess.run([shutil.which("gcc") or "cc", "-o", str(helper), str(source)], check=True)
    name = bed.units.started(
        "stuck", f"/bin/sh -c '{helper} & exec {bed.python.parent}/sicext-serve'", KillMode="process"
    )
    main = bed.manager.main_pid(name)
    wait_until(lambda: maps_so(main) is not None, 15, "service maps the .so")
    group = bed.manager.show(name, "ControlGroup")["ControlGroup"]
    wait_until(lambda: any(_state(p) == "D" for p in cgroup_pids(group)), 15, "the helper in D state")
    (stuck,) = [p for p in cgroup_pids(group) if _state(p) == "D"]
    stopped_child = [p for p in cgroup_pids(group) if _state(p) == "T"]
    gpu = bed.nvml.add_gpu("NVIDIA H200", "GPU-00000000-0000-0000-0000-0000000000d1", 141 * GiB)
    bed.nvml.hold(stuck, gpu, 20 * GiB)
    try:
        # a stop timeout of an hour: without the check the run would wait it out
        done = bed.safeinstall(
            "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--stop-timeout", "3600", "--json"
        )
        assert done.code == 3, done.stdout + done.stderr  # rolled back: nothing installed
        (error,) = done.json["errors"]
        assert f"PID {stuck} (in_d_state) stays in uninterruptible sleep (D state" in error["message"]
        assert "holding 20.0 GiB of GPU memory" in error["message"]
        assert "the host needs a reboot" in error["message"] and "reboot the host" in error["hint"]
        assert bed.version() == "1.0"
    finally:
        for pid in (stuck, *stopped_child):  # the test's own processes, by PID (SIGKILL ends a vfork wait)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_which_d_state_is_stuck_on_the_gpu() -> None:
    """Pure, over /proc/PID/stat as parsed: only ``D``, only with GPU memory held, only once it has
    lasted (a process freeing its GPU memory as it exits passes through ``D``)."""

    def stat(state: str) -> StatInfo:
        return parse_stat(f"4242 (python3 x) {state} 1 4242 4242 0 -1 4194560 " + "0 " * 12 + "777 0 0")

    assert stat("D").state == "D" and stat("D").start_time == 777
    said = stuck_on_gpu(stat("D"), 2 * 2**30, d_since=100.0, now=100.0 + STUCK_AFTER_S)
    assert said is not None and said.startswith("PID 4242 (python3 x) stays in uninterruptible sleep")
    assert "holding 2.0 GiB" in said and "needs a reboot" in said
    assert stuck_on_gpu(stat("D"), 2 * 2**30, d_since=100.0, now=100.0 + STUCK_AFTER_S / 2) is None
    assert stuck_on_gpu(stat("D"), None, d_since=100.0, now=1000.0) is None  # no GPU memory held
    for state in ("S", "R", "T", "Z"):
        assert stuck_on_gpu(stat(state), 2 * 2**30, d_since=100.0, now=1000.0) is None
