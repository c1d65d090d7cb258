"""The default mode against a real ``systemd --system`` (issue 42): safeinstall as root, system units
with ``User=`` a service account, in the bed of :mod:`tests.bed_system_manager` (opt-in:
``SAFEINSTALL_SYSTEM_MANAGER=1``, as root; skipped with the reason otherwise).

Every test ends with the marker in the machine's ``/tmp`` checked (the ``system_bed`` fixture), and the
bed's end checks that no process, mount or cgroup of it is left.
"""

from __future__ import annotations

from tests.bed_system_manager import (
    ACCOUNT,
    ACCOUNT_ID,
    SystemBed,
    SystemManager,
    SystemWheels,
    copy_wheels,
    reboot,
    start_system_manager,
    stop_system_manager,
)
from tests.bed_systemd import wait_until


def test_a_user_unit_of_the_bed_runs_in_the_bed_alone(system_manager: SystemManager) -> None:
    """The bed itself: a ``User=nobody`` unit runs in ``/<bed cgroup>/system.slice/NAME.service`` as
    uid 65534; inside, the machine's /tmp is out of sight; the manager reads the bed's units alone."""
    system_manager.write_unit("si-nobody.service", "[Service]\nUser=nobody\nExecStart=/bin/sleep infinity\n")
    try:
        system_manager.systemctl("start", "si-nobody.service")
        system_manager.wait_active("si-nobody.service")
        shown = system_manager.show("si-nobody.service", "ControlGroup", "MainPID")
        assert shown["ControlGroup"] == f"/{system_manager.cgroup_name}/system.slice/si-nobody.service"
        assert system_manager.uid_of(int(shown["MainPID"])) == 65534
        listed = system_manager.run("ls", "-A", "/tmp").stdout.split()
        assert listed == [system_manager.base.name]  # the bed's own directory, nothing of the machine's
        mounts = system_manager.run("cat", "/proc/self/mountinfo").stdout.splitlines()
        below_tmp = sorted(line.split()[4] for line in mounts if line.split()[4].startswith("/tmp"))
        assert below_tmp == ["/tmp", str(system_manager.base)]  # no copy of another test's mount held
        loaded = system_manager.systemctl("list-units", "--all", "--plain", "--no-legend").stdout
        assert "tmpfiles" not in loaded and "journald.service" not in loaded
    finally:
        system_manager.remove_unit("si-nobody.service")
    system_manager.check_machine_untouched()


def test_the_plan_names_the_system_unit_and_its_account(system_bed: SystemBed) -> None:
    manager = system_bed.manager
    main = manager.main_pid(system_bed.unit)
    plan = system_bed.cli("sicext", "--wheel", str(system_bed.wheels["sicext-2"]), "--dry-run", "--json")
    assert plan.code == 0, plan.stdout + plan.stderr
    (unit,) = plan.json["data"]["units"]
    assert unit["name"] == system_bed.unit and unit["pids"] == [main]
    human = system_bed.cli("sicext", "--wheel", str(system_bed.wheels["sicext-2"]), "--dry-run")
    assert human.code == 0, human.stdout + human.stderr
    assert f"as {ACCOUNT}, environment of {system_bed.unit}" in human.stdout
    assert "the run would proceed" in human.stdout
    assert manager.main_pid(system_bed.unit) == main and system_bed.version() == "1.0"


def test_a_reinstall_restarts_the_system_unit_on_the_new_version(system_bed: SystemBed) -> None:
    manager = system_bed.manager
    old_main, old_so = manager.main_pid(system_bed.unit), system_bed.so.stat().st_ino
    wheel = str(system_bed.wheels["sicext-2"])
    result = system_bed.cli("--yes", "sicext", "--wheel", wheel, "--settle", "1", "--json")
    assert result.code == 0, result.stdout + result.stderr
    assert result.json["status"] == "done"
    main = manager.main_pid(system_bed.unit)
    assert main not in (0, old_main) and manager.active_state(system_bed.unit) == "active"
    assert manager.uid_of(main) == ACCOUNT_ID
    assert manager.maps_so(main) == system_bed.so.stat().st_ino != old_so
    assert system_bed.version() == "2.0"
    check = system_bed.cli("sicext", "--verify-only", "--wheel", wheel, "--json")
    assert check.code == 0, check.stdout
    system_bed.no_trace()


def test_a_broken_version_is_refused_before_the_system_unit_stops(system_bed: SystemBed) -> None:
    """The smoke check runs as the unit's account: sicext 3 crashes on import, the unit never stops."""
    manager = system_bed.manager
    main = manager.main_pid(system_bed.unit)
    result = system_bed.cli("--yes", "sicext", "--wheel", str(system_bed.wheels["sicext-3"]), "--json")
    assert result.code == 2, result.stdout + result.stderr
    (error,) = result.json["errors"]
    assert "sicext: ImportError: sicext 3.0 is broken on purpose" in error["message"], error
    assert "nothing was stopped" in error["hint"]
    assert manager.main_pid(system_bed.unit) == main and system_bed.version() == "1.0"
    system_bed.no_trace()


def test_a_version_that_crashes_at_start_is_rolled_back(system_bed: SystemBed) -> None:
    manager = system_bed.manager
    old_main, old_so = manager.main_pid(system_bed.unit), system_bed.so.read_bytes()
    wheel = str(system_bed.wheels["sicext-3"])
    result = system_bed.cli("--yes", "sicext", "--wheel", wheel, "--settle", "1", "--no-smoke", "--json")
    assert result.code == 3, result.stdout + result.stderr
    (error,) = result.json["errors"]
    assert system_bed.unit in error["message"] and "restored the previous installation" in error["message"]
    assert f"journalctl -u {system_bed.unit}" in error["hint"]  # the system manager's journal
    manager.wait_active(system_bed.unit)
    main = manager.main_pid(system_bed.unit)
    assert main != old_main and manager.uid_of(main) == ACCOUNT_ID
    assert manager.maps_so(main) == system_bed.so.stat().st_ino and system_bed.so.read_bytes() == old_so
    assert system_bed.version() == "1.0"
    system_bed.no_trace()


def test_recover_after_a_kill_while_the_system_unit_is_down(system_bed: SystemBed) -> None:
    """SIGKILL once the unit is stopped (or later: the run may go on before the kill lands), then
    ``--recover`` (what the boot unit runs): one whole version, the unit up again, nothing left."""
    manager = system_bed.manager
    wheel = str(system_bed.wheels["sicext-2"])
    phases = ("stopped", "gpu-released", "swapping", "installed", "verified", "restarting")
    system_bed.kill_in(phases, "--yes", "sicext", "--wheel", wheel, "--settle", "1")
    assert system_bed.journal_phase() in phases
    recovered = system_bed.cli("--recover", "--json")
    assert recovered.code == 0, recovered.stdout + recovered.stderr
    (recovery,) = recovered.json["data"]["recoveries"]
    assert recovery["phase"] in phases, recovery
    manager.wait_active(system_bed.unit)
    main = manager.main_pid(system_bed.unit)
    assert manager.uid_of(main) == ACCOUNT_ID and manager.maps_so(main) == system_bed.so.stat().st_ino
    version = system_bed.version()
    if version == "2.0":
        check = system_bed.cli("sicext", "--verify-only", "--wheel", wheel, "--json")
        assert check.code == 0, check.stdout
    else:
        assert version == "1.0"
        assert system_bed.cli("sicext", "--verify-only", "--json").code == 0
    system_bed.no_trace()


def test_a_power_loss_mid_run_gates_the_unit_and_the_boot_unit_recovers(system_bed: SystemBed) -> None:
    """The machine dies while the enabled unit is down (journal at stopped..verified): at the next boot
    its persistent gate drop-in keeps it from starting on a half-installed package; at the boot after,
    with the shipped ``safeinstall-recover.service`` enabled, one whole version is back, the unit runs
    and the gate is gone."""
    manager = system_bed.manager
    manager.systemctl("enable", system_bed.unit)
    wheel = str(system_bed.wheels["sicext-2"])
    proc = system_bed.start_run("--yes", "sicext", "--wheel", wheel, "--settle", "1")
    try:
        system_bed.wait_phase(proc, ("stopped", "gpu-released", "swapping", "installed", "verified"))
        gate = manager.unit_dir / f"{system_bed.unit}.d" / "50-safeinstall-gate.conf"
        assert "ConditionPathExists=!" in gate.read_text()  # persistent: /etc/systemd/system/UNIT.d
        reboot(manager)  # the run dies with the machine
    finally:
        proc.communicate(timeout=60)
    skipped = manager.show(system_bed.unit, "ActiveState", "ConditionResult")
    assert skipped == {"ActiveState": "inactive", "ConditionResult": "no"}, skipped

    boot_unit = system_bed.install_recover_unit()
    reboot(manager)
    wait_until(lambda: manager.active_state(boot_unit) == "inactive", 60, f"{boot_unit} to finish")
    assert manager.show(boot_unit, "Result")["Result"] == "success", manager.show(boot_unit, "Result")
    manager.wait_active(system_bed.unit)
    main = manager.main_pid(system_bed.unit)
    assert manager.uid_of(main) == ACCOUNT_ID and manager.maps_so(main) == system_bed.so.stat().st_ino
    version = system_bed.version()
    assert version in ("1.0", "2.0")
    extra = ("--wheel", wheel) if version == "2.0" else ()
    assert system_bed.cli("sicext", "--verify-only", *extra, "--json").code == 0
    system_bed.no_trace()
    assert not gate.exists()


def test_a_detached_run_is_a_transient_unit_of_the_system_manager(system_bed: SystemBed) -> None:
    """``--detach`` hands the run to ``systemd-run`` on the system manager; ``--status --wait`` follows
    it to its end; ``--undo`` puts the old version back under the same unit."""
    manager = system_bed.manager
    wheel = str(system_bed.wheels["sicext-2"])
    detached = system_bed.cli("--yes", "sicext", "--wheel", wheel, "--settle", "1", "--detach", "--json")
    assert detached.code == 0, detached.stdout + detached.stderr
    data = detached.json["data"]
    assert detached.json["status"] == "detached" and data["user_manager"] is False, data
    waited = system_bed.cli("--status", "--wait", "--run", data["run_id"], "--json")
    assert waited.code == 0 and waited.json["status"] == "done", waited.stdout + waited.stderr
    wait_until(lambda: manager.active_state(data["unit"]) == "inactive", 30, "the run's unit to end")
    assert system_bed.version() == "2.0"
    manager.wait_active(system_bed.unit)
    undone = system_bed.cli("--undo", "--yes", "--settle", "1", "--json")
    assert undone.code == 0, undone.stdout + undone.stderr
    manager.wait_active(system_bed.unit)
    assert system_bed.version() == "1.0"
    main = manager.main_pid(system_bed.unit)
    assert manager.maps_so(main) == system_bed.so.stat().st_ino
    system_bed.no_trace()


def test_a_manager_that_reads_only_the_bed_s_directory_is_refused_by_the_plan(
    system_manager: SystemManager, system_wheels: SystemWheels
) -> None:
    """The issue's own recipe, ``SYSTEMD_UNIT_PATH`` naming the bed's unit directory alone: the manager
    reads no admin directory, where the gate's drop-in goes. The plan refuses, the run is refused before
    the backup and the unit never stops (before: "proceed", then a failure at the gate)."""
    bare = start_system_manager(unit_path=("/etc/systemd/system",))
    try:
        bed = SystemBed(bare, copy_wheels(bare, system_wheels))
        main = bare.main_pid(bed.unit)
        wheel = str(bed.wheels["sicext-2"])
        plan = bed.cli("sicext", "--wheel", wheel, "--dry-run", "--json")
        assert plan.code == 2, plan.stdout + plan.stderr
        (refusal,) = plan.json["data"]["refusals"]
        assert "cannot tell where the service manager reads drop-ins from" in refusal
        ran = bed.cli("--yes", "sicext", "--wheel", wheel, "--json")
        assert ran.code == 2 and ran.json["errors"][0]["message"].startswith("the run would refuse: ")
        assert not list(bed.state.glob("*/backups/*"))
        assert bare.main_pid(bed.unit) == main and bed.version() == "1.0"
        bed.cleanup()
    finally:
        stop_system_manager(bare)
    system_manager.check_machine_untouched()
