"""Crash safety: SIGKILL at step boundaries, a simulated reboot, two runs at once, SIGINT mid-run.

Step boundaries are found from the outside, by reading the run's journal, never by test-only hooks.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import wheelhouse
from tests.bed_nvml import FakeNvml
from tests.bed_systemd import UserManager, start_user_manager, stop_user_manager, wait_until
from tests.beds import Bed
from tests.clirun import SAFEINSTALL, run
from tests.wheelhouse import Wheelhouse


@pytest.mark.parametrize(
    ("boundary", "phases", "delay"),
    [
        ("after-stop", ("stopped",), 0.0),
        ("during-gpu-wait", ("stopped",), 0.5),
        ("during-install", ("installing",), 0.0),
        ("after-install", ("installed", "verified"), 0.0),
        ("after-verify", ("verified", "restarting"), 0.0),
    ],
)
def test_sigkill_at_step_boundary_then_recover(
    bed: Bed, big_wheel: Path, boundary: str, phases: tuple[str, ...], delay: float
) -> None:
    before = bed.hotfix()
    name = bed.unit(f"kill-{boundary}")
    bed.hold_gpu(name, 2.0 if boundary == "during-gpu-wait" else 0.0, "e1")
    # uv's install in the window (--no-swap) is what "during-install" freezes, and what "after-install"
    # kills after (a swap's install and verify last a few ms: a poll of the journal can miss both phases);
    # the swap's own kills are in test_swap.py
    no_swap = ("--no-swap",) if boundary in ("during-install", "after-install") else ()
    proc = bed.start_run("sicext", "--wheel", str(big_wheel), "--settle", "1", *no_swap)
    try:
        bed.wait_phase(proc, *phases)
        if boundary == "during-install":  # uv itself is running, not only the journal's phase
            wait_until(lambda: bool(bed.installers()), 30, "uv installing", interval=0.002)
            for pid in bed.installers():  # frozen mid-install: only its death signal can end it now
                os.kill(pid, signal.SIGSTOP)
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.communicate()
    try:
        # uv dies with safeinstall (PR_SET_PDEATHSIG): no install goes on under the recovery
        wait_until(lambda: not bed.installers(), 10, "no uv process left installing")
    finally:
        for pid in bed.installers():
            os.kill(pid, signal.SIGKILL)
    status = bed.cli("--status", "--json").json
    assert status["status"] == "needs-recovery", status
    run_id = status["data"]["environments"][0]["run_id"]
    lost = bed.cli("--status", "--wait", "--run", run_id)
    assert lost.code == 4 and "run safeinstall --recover" in lost.stderr, lost.stdout + lost.stderr
    recovered = bed.cli("--recover", "--json")
    assert recovered.code == 0, recovered.stdout + recovered.stderr
    (recovery,) = recovered.json["data"]["recoveries"]
    assert recovery["run_id"] == run_id
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running again")
    which = bed.consistent(before, big_wheel)
    if boundary in ("after-stop", "during-gpu-wait"):
        assert which == "old" and recovery["restored"] is False
    if boundary == "after-verify":
        assert which == "new" and recovery["restored"] is False
    bed.no_trace()
    # the run that died is in the history, as recovered: kept (exit 0) or put back as it was (exit 3)
    waited = bed.cli("--status", "--wait", "--run", run_id, "--json")
    assert waited.code == (0 if which == "new" else 3), waited.stdout + waited.stderr
    assert (waited.json["status"], waited.json["data"]["restored"]) == ("recovered", recovery["restored"])
    assert f"recover: the run {run_id} died in phase {recovery['phase']}" in waited.stderr  # its log
    (listed,) = bed.cli("--status", "--json").json["data"]["environments"][0]["runs"]
    assert (listed["run_id"], listed["status"], listed["exit_code"]) == (run_id, "recovered", waited.code)
    assert bed.cli("--recover").stdout.strip() == "nothing to recover"
    assert bed.cli("--status", "--json").json["status"] == "idle"


def test_a_kill_once_verified_of_a_version_that_crashes_on_start_then_recover_puts_the_old_back(
    bed: Bed,
) -> None:
    """Issue 35: the run dies once its new version is verified (phase ``verified``), before it saw the
    units settle on it, and that version (sicext 3.0) crashes on start: ``--recover`` starts the units,
    sees them fail, and puts the previous installation back, as the run would have (exit 3).

    The kill lands in ``verified`` or in ``restarting``, whichever the journal shows first (``verified``
    lasts a few instructions); a journal left in ``restarting`` is put back to ``verified``, the phase
    the recovery is asked about: everything else of it is what the run wrote."""
    name = bed.unit("kill-verified-crash")
    proc = bed.start_run("sicext", "--wheel", str(bed.wheels["sicext-3"]), "--settle", "5", "--no-smoke")
    try:
        bed.wait_phase(proc, "verified", "restarting")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.communicate()
    (path,) = [p for p in bed.state.glob("*/journal.json")]
    doc = json.loads(path.read_text())
    assert doc["phase"] in ("verified", "restarting"), doc["phase"]
    doc["phase"] = "verified"
    path.write_text(json.dumps(doc))
    assert "sicext 3.0" in bed.version()  # installed: it crashes on import
    recovered = bed.cli("--recover", "--json")
    assert recovered.code == 3, recovered.stdout + recovered.stderr
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running the old version")
    assert bed.version() == "1.0"
    assert bed.cli("--recover").stdout.strip() == "nothing to recover"


def test_recover_goes_on_past_an_environment_it_cannot_recover(
    bed: Bed,
    big_wheel: Path,
    tmp_path: Path,
    user_manager: UserManager,
    fake_nvml: FakeNvml,
    wheels: Wheelhouse,
) -> None:
    """At boot, one environment whose backup is gone must not keep the others' units down."""
    other_python = wheelhouse.make_venv(tmp_path / "other-venv")
    wheelhouse.uv_install(other_python, wheels["sicext-1"])
    other = Bed(other_python, bed.state, user_manager, fake_nvml, wheels)  # one state directory, two envs
    try:
        lost = bed.unit("lost-backup")
        fine = other.unit("fine")
        other.hold_gpu(fine, 5.0, "e7", gib=1)  # holds it at "stopped"
        for crashed, phase in ((bed, "installing"), (other, "stopped")):
            crashed.kill_in(phase, "sicext", "--wheel", str(big_wheel), "--settle", "0.5", "--no-swap")
        broken, killed_early = bed.journal(), other.journal()
        assert broken is not None and killed_early is not None
        assert (broken["phase"], killed_early["phase"]) == ("installing", "stopped")
        shutil.rmtree(broken["backup_dir"])  # lost: that run cannot be put back

        result = run("--user", "--recover", "--json", env=bed.environ(), timeout=240)

        assert result.code == 4, result.stdout + result.stderr
        doc = result.json
        assert doc["status"] == "error" and doc["exit_code"] == 4
        (failure,) = doc["errors"]
        assert failure["code"] == "rollback-failed" and broken["run_id"] in failure["message"]
        assert [r["run_id"] for r in doc["data"]["recoveries"] if r["run_id"]] == [killed_early["run_id"]]
        wait_until(lambda: other.manager.active_state(fine) == "active", 20, "the other unit running again")
        assert bed.manager.active_state(lost) != "active"  # its run could not be finished: said, not hidden
    finally:
        other.cleanup()


def test_recover_over_all_environments_says_a_live_run_and_exits_for_what_it_recovered(
    bed: Bed, tmp_path: Path, user_manager: UserManager, fake_nvml: FakeNvml, wheels: Wheelhouse
) -> None:
    """Issue 44 item 6: ``--recover`` over all environments recovered a dead run's environment, then
    exited 2 because another environment's live run held its lock. The live run is said (``busy``, a
    note), not an error: the exit code is what was recovered (0: the dead run's new version, verified,
    kept), and the live run goes on to its end."""
    other_python = wheelhouse.make_venv(tmp_path / "other-venv")
    wheelhouse.uv_install(other_python, wheels["sicext-1"])
    other = Bed(other_python, bed.state, user_manager, fake_nvml, wheels)  # one state directory, two envs
    try:
        dead = bed.unit("dead")
        # killed once verified: "verified" lasts milliseconds, "restarting" the settle (3 s) too
        killed = bed.start_run("sicext", "--wheel", str(wheels["sicext-2"]), "--settle", "3", "--no-swap")
        try:
            bed.wait_phase(killed, "verified", "restarting")
            killed.send_signal(signal.SIGKILL)
        finally:
            killed.wait()
            killed.communicate()
        died = bed.journal()
        assert died is not None
        live = other.unit("live")
        holder = other.manager.main_pid(live)
        other.hold_gpu(live, 900.0, "e8", gib=1)  # its run waits for the GPU until the test lets it go
        proc = other.start_run(
            "sicext", "--wheel", str(wheels["sicext-2"]), "--settle", "0.3", "--gpu-timeout", "900"
        )
        try:
            other.wait_phase(proc, "stopped")

            result = run("--user", "--recover", "--json", env=bed.environ(), timeout=240)
            plain = run("--user", "--recover", env=bed.environ(), timeout=240)
            asked = run("--user", "--recover", "--python", str(other_python), env=bed.environ(), timeout=240)
            other.nvml.unhold(holder)  # the live run was live through them all: now it goes on

            assert result.code == 0, result.stdout + result.stderr
            recoveries = result.json["data"]["recoveries"]
            assert [r["run_id"] for r in recoveries if r["run_id"]] == [died["run_id"]], recoveries
            (busy,) = [r for r in recoveries if r["busy"]]
            assert busy["prefix"] == str(other_python.parent.parent) and "holds the lock" in busy["notes"][0]
            assert result.json["errors"] == [], result.json
            assert plain.code == 0 and "not recovered: " in plain.stdout, plain.stdout + plain.stderr
            # the one environment asked for: refused (exit 2), neither "nothing to recover" on stdout nor a
            # hint to run the very command that was run
            assert asked.code == 2 and "holds the lock" in asked.stderr, asked.stdout + asked.stderr
            assert "nothing to recover" not in asked.stdout, asked.stdout
            assert "run safeinstall --recover" not in asked.stderr and "it did not die" in asked.stderr
        finally:
            other.nvml.unhold(holder)
            out, err = proc.communicate(timeout=180)
        assert proc.returncode == 0, out + err
        wait_until(lambda: bed.manager.active_state(dead) == "active", 20, "the dead run's unit running")
        assert other.manager.active_state(live) == "active"
    finally:
        other.cleanup()


def _power_loss_mid_install(bed: Bed, manager: UserManager, wheel: Path, stem: str) -> str:
    """An enabled unit, a run of safeinstall, and a power loss during the install; the unit's name."""
    name = bed.unit(stem, enable=True)
    proc = bed.start_run("sicext", "--wheel", str(wheel), "--settle", "1", "--no-swap")  # uv in the window
    try:
        bed.wait_phase(proc, "installing")
    finally:
        _power_loss(proc, manager)
    return name


def _power_loss(proc: subprocess.Popen[str], manager: UserManager) -> None:
    """SIGKILL safeinstall (uv dies with it), the manager, and what is left in its cgroup (our units)."""
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    proc.communicate()
    manager.process.send_signal(signal.SIGKILL)
    manager.process.wait()
    stop_user_manager(manager)


def test_simulated_reboot_mid_install(
    venv: Path, wheels: Wheelhouse, big_wheel: Path, tmp_path: Path, fake_nvml: FakeNvml
) -> None:
    """Kill safeinstall and the whole (private) manager during the install, boot a new manager with the
    units enabled: no unit runs on a half-installed package; recovery leaves them running."""
    wheelhouse.uv_install(venv, wheels["sicext-1"])
    base = tmp_path / "machine"
    base.mkdir()
    manager = start_user_manager(base)
    bed = Bed(venv, tmp_path / "state", manager, fake_nvml, wheels)
    before = bed.hotfix()
    try:
        name = _power_loss_mid_install(bed, manager, big_wheel, "reboot")
        manager = start_user_manager(base)  # "boot": same unit files and drop-ins, fresh runtime dir
        bed.manager = manager
        assert manager.show(name, "UnitFileState")["UnitFileState"] == "enabled"
        time.sleep(1.0)
        assert manager.active_state(name) != "active"  # gated: skipped at boot
        assert manager.show(name, "ConditionResult")["ConditionResult"] == "no"
        recovered = bed.cli("--recover", "--json")
        assert recovered.code == 0, recovered.stdout + recovered.stderr
        wait_until(lambda: manager.active_state(name) == "active", 20, "unit running after recovery")
        bed.consistent(before, big_wheel)
        bed.no_trace()
    finally:
        manager.systemctl("disable", *bed.units.names, check=False)
        stop_user_manager(manager)


def test_shipped_recover_unit_finishes_the_run_at_boot(
    venv: Path, wheels: Wheelhouse, big_wheel: Path, tmp_path: Path, fake_nvml: FakeNvml
) -> None:
    """The same power loss, with safeinstall-recover.service (as shipped, plus a drop-in that points
    it at this checkout and this state directory) enabled: at boot it recovers, and the gated unit
    comes up on a consistent package without anyone typing anything."""
    wheelhouse.uv_install(venv, wheels["sicext-1"])
    base = tmp_path / "machine"
    base.mkdir()
    manager = start_user_manager(base)
    bed = Bed(venv, tmp_path / "state", manager, fake_nvml, wheels)
    before = bed.hotfix()
    shipped = Path(__file__).resolve().parent.parent / "safeinstall" / "data" / "safeinstall-recover.service"
    recover_unit = "safeinstall-recover.service"
    (manager.unit_dir / recover_unit).write_text(shipped.read_text())
    dropin = manager.unit_dir / f"{recover_unit}.d"
    dropin.mkdir()
    environment = " ".join(
        f'"{k}={v}"' for k, v in {**fake_nvml.env, "SAFEINSTALL_STATE_DIR": str(bed.state)}.items()
    )
    (dropin / "test.conf").write_text(
        f"[Service]\nExecStart=\nExecStart={SAFEINSTALL} --recover\nEnvironment={environment}\n"
    )
    wants = manager.unit_dir / "default.target.wants"
    wants.mkdir(exist_ok=True)
    (wants / recover_unit).symlink_to(manager.unit_dir / recover_unit)
    try:
        name = _power_loss_mid_install(bed, manager, big_wheel, "boot")
        manager = start_user_manager(base)
        bed.manager = manager
        wait_until(lambda: manager.active_state(name) == "active", 60, "unit started by the recover service")
        wait_until(
            lambda: (
                manager.show(recover_unit, "Result")["Result"] == "success"
                and manager.active_state(recover_unit) == "inactive"
            ),
            60,
            "the recover service to finish",
        )
        # gated at boot, started only by the recovery: its main process began after the service did
        unit_start = int(
            manager.show(name, "ExecMainStartTimestampMonotonic")["ExecMainStartTimestampMonotonic"]
        )
        recover_start = int(
            manager.show(recover_unit, "ExecMainStartTimestampMonotonic")["ExecMainStartTimestampMonotonic"]
        )
        assert unit_start > recover_start > 0
        bed.consistent(before, big_wheel)
        bed.no_trace()
    finally:
        manager.systemctl("disable", *bed.units.names, check=False)
        stop_user_manager(manager)


@pytest.fixture
def bed_on_disk(
    small_disk: Callable[[int], Path],
    wheels: Wheelhouse,
    tmp_path: Path,
    user_manager: UserManager,
    fake_nvml: FakeNvml,
) -> Iterator[Callable[[int], Bed]]:
    """A bed whose venv (sicext 1.0) lives on a small disk of the given size in MiB."""
    beds: list[Bed] = []

    def make(mib: int) -> Bed:
        python = wheelhouse.make_venv(small_disk(mib) / "venv")
        wheelhouse.uv_install(python, wheels["sicext-1"])
        beds.append(Bed(python, tmp_path / "state", user_manager, fake_nvml, wheels))
        return beds[-1]

    yield make
    for bed in beds:
        bed.cleanup()


def test_too_little_room_for_the_install_is_refused_before_anything_stops(
    bed_on_disk: Callable[[int], Bed], big_wheel: Path
) -> None:
    bed = bed_on_disk(128)  # the wheel unpacks to 160 MiB
    name = bed.unit("noroom")
    main = bed.manager.main_pid(name)
    dry = bed.cli("sicext", "--wheel", str(big_wheel), "--dry-run", "--json")  # the same preflight
    assert dry.code == 2 and dry.json["status"] == "would-refuse", dry.stdout + dry.stderr
    # the wheel's files, and what uv writes beside them and a margin (issue 44)
    said = f"the install of {big_wheel.name} needs 16"
    assert any(said in r and "its files 160." in r for r in dry.json["data"]["refusals"]), dry.json
    result = bed.cli("sicext", "--wheel", str(big_wheel), "--yes")
    assert result.code == 2, result.stdout + result.stderr
    assert said in result.stderr and "its files 160." in result.stderr, result.stderr
    assert "nothing was stopped" in result.stderr and "SAFEINSTALL_STATE_DIR" not in result.stderr
    assert bed.manager.main_pid(name) == main and bed.version() == "1.0"


def test_a_read_only_environment_is_refused_before_anything_stops(bed_on_disk: Callable[[int], Bed]) -> None:
    """uv could not write the install during the downtime: refused at the preflight (exit 2), by the
    dry-run too, rather than found after the stop (a rollback, exit 3)."""
    bed = bed_on_disk(64)
    name = bed.unit("readonly")
    main = bed.manager.main_pid(name)
    disk = bed.python.parent.parent.parent
    subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True, capture_output=True)
    try:
        dry = bed.cli("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--dry-run", "--json")
        assert dry.code == 2 and dry.json["status"] == "would-refuse", dry.stdout + dry.stderr
        assert any("is not writable" in r for r in dry.json["data"]["refusals"])
        result = bed.cli("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--yes")
        assert result.code == 2, result.stdout + result.stderr
        assert "is not writable" in result.stderr and "nothing was stopped" in result.stderr
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(disk)], check=True, capture_output=True)
    assert bed.manager.main_pid(name) == main and bed.version() == "1.0"


@pytest.mark.parametrize("state_on_the_same_disk", [False, True], ids=["state-elsewhere", "state-too"])
def test_disk_full_in_the_middle_of_the_install_rolls_back(
    bed_on_disk: Callable[[int], Bed], big_wheel: Path, state_on_the_same_disk: bool
) -> None:
    """The install dies half-way (another process filled the disk during the downtime): the previous
    installation, local patch included, and the service come back; also with the state directory (the
    journal, the backup) on that full disk, as in the default layout."""
    # room for the 160 MiB the wheel unpacks to when the run starts (and, with the state directory on
    # that disk too, for the run's own copy of the wheel and the run's own uv cache)
    bed = bed_on_disk(608 if state_on_the_same_disk else 256)
    disk = bed.python.parent.parent.parent
    if state_on_the_same_disk:
        bed.state = disk / "state"
    before = bed.hotfix()
    name = bed.unit("diskfull")
    holder = bed.manager.main_pid(name)
    bed.hold_gpu(name, 900.0, "e4")  # the GPU wait lasts until the disk is full (let go below)
    # With the state on that disk the run's uv cache is there too, and the install would hardlink from
    # it, needing no room; copying (the arguments after -- choose the link mode) needs the 160 MiB.
    copy = ("--", "--link-mode", "copy") if state_on_the_same_disk else ()
    proc = bed.start_run("sicext", "--wheel", str(big_wheel), "--settle", "0.5", "--json", *copy)
    filler = disk / "filler"
    frozen: list[int] = []
    try:
        if state_on_the_same_disk:  # fill it under uv (frozen meanwhile): the journal can't be written either
            bed.wait_phase(proc, "stopped")
            bed.nvml.unhold(holder)
            bed.wait_phase(proc, "installing")
            wait_until(lambda: bool(bed.installers()), 30, "uv installing", interval=0.002)
            frozen = bed.installers()
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
            left = 16 * 1024 * 1024  # uv fills these with part of the 160 MiB file, then fails
        else:  # fill it during the GPU wait; the state directory, elsewhere, keeps working
            bed.wait_phase(proc, "stopped")
            left = 2 * 1024 * 1024
        room = os.statvfs(disk)  # preflight found room for the 160 MiB file; now there is none
        with filler.open("wb") as sink:
            os.posix_fallocate(sink.fileno(), 0, room.f_bavail * room.f_frsize - left)
        bed.nvml.unhold(holder)
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        out, err = proc.communicate(timeout=120)
    finally:
        bed.nvml.unhold(holder)
        proc.kill()
        proc.communicate()
        filler.unlink(missing_ok=True)
    assert proc.returncode == 3, out + err
    doc = json.loads(out)
    message = doc["errors"][0]["message"]
    assert "uv pip install failed" in message and "restored the previous installation" in message, message
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running again")
    assert bed.version() == "1.0" and bed.snapshot() == before  # old bytes, the local patch included
    bed.no_trace()


def test_a_dropped_terminal_rolls_back_and_leaves_the_services_running(bed: Bed) -> None:
    """An SSH session that drops: the terminal is gone (writes fail with EIO) and SIGHUP arrives. The
    run rolls back as for Ctrl-C; its exit status still says so."""
    import pty

    name = bed.unit("hangup")
    bed.hold_gpu(name, 30.0, "e5")  # keeps the run in its GPU wait
    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            bed.args(
                "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--gpu-timeout", "60"
            ),
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env=bed.environ(),
            start_new_session=True,
        )
    finally:
        os.close(slave)
    try:
        bed.wait_phase(proc, "stopped")
        os.close(master)  # the terminal goes away ...
        master = -1
        proc.send_signal(signal.SIGHUP)  # ... and the kernel hangs up on the session
        proc.wait(timeout=120)
    finally:
        if master >= 0:
            os.close(master)
        proc.kill()
        proc.wait()
    assert proc.returncode == 3
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running again")
    assert bed.version() == "1.0"
    bed.no_trace()


@pytest.mark.parametrize(
    ("kill_strays", "goes_away"),
    [(False, False), (True, False), (False, True)],
    ids=["refused", "kill-strays", "gone"],
)
def test_a_process_that_starts_using_the_package_during_the_downtime(
    bed: Bed, kill_strays: bool, goes_away: bool
) -> None:
    """The plan is minutes old when the install starts: a process that began using the package since
    (a cron job, someone's shell) is found by a second scan, and the install does not go on under it;
    unless it ends by itself within a grace of two seconds (a `python -c` check, another safeinstall's
    probe of the environment: seen in the suite, a `--status --wait` beside a run stopped it)."""
    name = bed.unit("late")
    bed.hold_gpu(name, 3.0, "e6")  # a downtime to start it in
    extra = ["--kill-strays"] if kill_strays else []
    proc = bed.start_run(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json", *extra
    )
    late: subprocess.Popen[bytes] | None = None
    try:
        bed.wait_phase(proc, "stopped")
        late = subprocess.Popen([str(bed.python), "-c", "import sicext, time; time.sleep(600)"])
        wait_until(
            lambda: "_native" in Path(f"/proc/{late.pid}/maps").read_text(), 15, "the late user maps the .so"
        )
        if goes_away:  # the second scan comes right after the GPU release, and takes well under 1 s
            bed.wait_phase(proc, "gpu-released")
            time.sleep(1.0)
            late.kill()
            late.wait()
        out, err = proc.communicate(timeout=120)
        doc = json.loads(out)
        if goes_away:
            assert proc.returncode == 0, out + err
            assert bed.version() == "2.0" and doc["data"]["strays_killed"] == []
        elif kill_strays:
            assert proc.returncode == 0, out + err
            assert late.pid in doc["data"]["strays_killed"]
            assert late.wait(timeout=10) is not None
            assert bed.version() == "2.0"
        else:
            assert proc.returncode == 3, out + err
            message = doc["errors"][0]["message"]
            assert f"{late.pid} (" in message and "after the plan was made" in message
            assert "nothing was installed" in message and doc["errors"][0]["hint"].find("--kill-strays") >= 0
            assert late.poll() is None and bed.version() == "1.0"
        wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running")
        bed.no_trace()
    finally:
        if late is not None and late.poll() is None:
            late.kill()
        if late is not None:
            late.wait()
        proc.kill()
        proc.communicate()


def test_two_runs_at_once(bed: Bed) -> None:
    name = bed.unit("two")
    holder = bed.manager.main_pid(name)
    bed.hold_gpu(name, 900.0, "e2")  # keeps the first run in its GPU wait until the test lets it go
    first = bed.start_run(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--gpu-timeout", "900"
    )
    try:
        bed.wait_phase(first, "stopped", "gpu-released")
        journal_before = bed.journal()
        second = bed.cli("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--yes")
        assert second.code == 2
        assert f"PID {first.pid}" in second.stderr and "started" in second.stderr
        assert bed.journal() == journal_before  # the refused run changed nothing
        dry = bed.cli("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--dry-run", "--json")
        assert dry.code == 2 and dry.json["errors"][0]["code"] == "locked"  # the run's own refusal
        assert f"PID {first.pid}" in dry.json["errors"][0]["message"]
        status = bed.cli("--status", "--json").json
        assert status["status"] == "running"
        assert status["data"]["environments"][0]["holder"]["pid"] == first.pid
    finally:  # the first run was live through them all (an 8 s hold was outrun under load): now it goes on
        bed.nvml.unhold(holder)
        out, err = first.communicate(timeout=120)
    assert first.returncode == 0, out + err
    assert bed.version() == "2.0"


@pytest.mark.parametrize("where", ["gpu-wait", "install"])
def test_sigint_rolls_back_and_a_second_one_does_not_abandon_services(
    bed: Bed, big_wheel: Path, where: str
) -> None:
    before = bed.hotfix()
    name = bed.unit(f"sigint-{where}")
    bed.hold_gpu(name, 30.0 if where == "gpu-wait" else 0.0, "e3")
    no_swap = ("--no-swap",) if where == "install" else ()  # uv's install in the window, to interrupt
    proc = bed.start_run(
        "sicext", "--wheel", str(big_wheel), "--settle", "0.5", "--gpu-timeout", "60", "--json", *no_swap
    )
    try:
        bed.wait_phase(proc, "stopped" if where == "gpu-wait" else "installing")
        proc.send_signal(signal.SIGINT)
        bed.wait_phase(proc, "rolling-back")  # lasts at least the restart's settle time
        proc.send_signal(signal.SIGINT)  # a second Ctrl-C during the rollback
    finally:
        out, err = proc.communicate(timeout=120)
    assert proc.returncode == 3, out + err
    doc = json.loads(out)
    assert doc["status"] == "rolled-back" and "interrupted by SIGINT" in doc["errors"][0]["message"]
    assert "SIGINT received during rollback" in err
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running again")
    assert bed.version() == "1.0" and bed.snapshot() == before
    bed.no_trace()


def test_sigint_while_the_restarted_units_settle_rolls_back_without_waiting_them_out(bed: Bed) -> None:
    """Ctrl-C while the restarted unit settles (--settle 600): the settle wait ends at its next poll and
    the rollback starts; it does not wait out the ten minutes (the test would time out)."""
    before = bed.hotfix()
    name = bed.unit("settling")
    proc = bed.start_run("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "600", "--json")
    try:
        bed.wait_phase(proc, "restarting")
        wait_until(lambda: bed.manager.active_state(name) == "active", 30, "the new version started")
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 3, out + err
    doc = json.loads(out)
    assert doc["status"] == "rolled-back" and "interrupted by SIGINT" in doc["errors"][0]["message"]
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running again")
    assert bed.version() == "1.0" and bed.snapshot() == before
    bed.no_trace()


@pytest.mark.parametrize("strict", [False, True], ids=["warning", "strict"])
def test_the_end_check_reports_a_process_left_on_old_code(bed: Bed, strict: bool) -> None:
    """A unit outside the plan starts using the package after the last scan before the install (uv is
    held meanwhile): after the restart, one more scan finds it still mapping the replaced extension,
    by PID and unit. A warning; with --strict a failure, rolled back (exit 3)."""
    name = bed.unit("planned")
    old_inode = next((bed.site / "sicext").glob("_native*.so")).stat().st_ino
    proc = bed.start_run(
        "sicext",
        "--wheel",
        str(bed.wheels["sicext-2"]),
        "--settle",
        "0.5",
        "--json",
        "--no-swap",  # uv's install in the window is held while the late user starts
        *(["--strict"] * strict),
    )
    frozen: list[int] = []
    try:
        bed.wait_phase(proc, "installing")  # the second scan is over
        wait_until(lambda: bool(bed.installers()), 30, "uv installing", interval=0.002)
        frozen = bed.installers()
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        assert next((bed.site / "sicext").glob("_native*.so")).stat().st_ino == old_inode
        late = bed.unit("left-on-old")  # maps the old extension
        late_pid = bed.manager.main_pid(late)
        wait_until(lambda: "_native" in Path(f"/proc/{late_pid}/maps").read_text(), 15, "the .so mapped")
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        frozen = []
        out, err = proc.communicate(timeout=180)
    finally:
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)
        proc.kill()
        proc.communicate()
    doc = json.loads(out)
    (left,) = doc["data"]["old_code"]
    assert (left["pid"], left["unit"], left["distributions"]) == (late_pid, late, ["sicext"])
    assert any("_native" in path for path in left["paths"])
    end = next(s for s in doc["data"]["steps"] if s["name"] == "end-check")
    if strict:
        assert proc.returncode == 3, out + err
        assert end["status"] == "failed" and doc["status"] == "rolled-back"
        message = doc["errors"][0]["message"]
        assert f"PID {late_pid}" in message and f"unit {late}" in message and "--strict" in message
        assert "restored the previous installation" in message
        assert bed.version() == "1.0"
    else:
        assert proc.returncode == 0, out + err
        assert end["status"] == "ok" and f"PID {late_pid}" in end["detail"] and "warning" in end["detail"]
        assert bed.version() == "2.0"
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running")
    assert bed.manager.main_pid(late) == late_pid  # not in the plan: left alone
    bed.no_trace()
