"""The default mode against a real ``systemd --system`` (issue 42): safeinstall as root, system units
with ``User=`` a service account, in the bed of :mod:`tests.bed_system_manager` (opt-in:
``SAFEINSTALL_SYSTEM_MANAGER=1``, as root; skipped with the reason otherwise).

Every test ends with the marker in the machine's ``/tmp`` checked (the ``system_bed`` fixture), and the
bed's end checks that no process, mount or cgroup of it is left.
"""

from __future__ import annotations

from tests.bed_system_manager import ACCOUNT, ACCOUNT_ID, SystemBed, SystemManager


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
    assert result.code != 0 and result.json["status"] != "ok", result.stdout
    assert "smoke" in result.stdout, result.stdout
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
