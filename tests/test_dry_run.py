"""``--dry-run``: who uses the package, in which units, holding which GPU memory. Real parts only:
units of a private systemd --user manager, wheels installed by uv, the fake NVML driver."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import wheelhouse
from tests.bed_nvml import FakeNvml, GiB
from tests.bed_systemd import Units, UserManager, start_user_manager, stop_user_manager, wait_until
from tests.beds import maps_so
from tests.clirun import Result, run
from tests.wheelhouse import Wheelhouse


@pytest.fixture
def env(venv: Path, wheels: Wheelhouse) -> Path:
    wheelhouse.uv_install(venv, wheels["sicext-1"], wheels["sipure-1"])
    return venv


def so_mapped(pid: int) -> bool:
    return maps_so(pid) is not None


def safeinstall(
    user_manager: UserManager,
    nvml: FakeNvml | None,
    *args: str,
    timeout: float = 120,
    more_env: dict[str, str] | None = None,
) -> Result:
    environ = {**user_manager.env, **(more_env or {})}
    environ.update(nvml.env if nvml else {"SAFEINSTALL_NVML_LIBRARY": "/nonexistent/libnvidia-ml.so.1"})
    return run("--user", *args, env=environ, timeout=timeout)


def dry_run(user_manager: UserManager, nvml: FakeNvml | None, env: Path, wheel: Path, *extra: str) -> Result:
    """``safeinstall --user sicext --wheel WHEEL --python ENV --dry-run EXTRA...``"""
    return safeinstall(
        user_manager, nvml, "sicext", "--wheel", str(wheel), "--python", str(env), "--dry-run", *extra
    )


def by_pid(doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
    assert doc["data"] is not None, doc["errors"]
    return {p["pid"]: p for p in doc["data"]["processes"]}


@pytest.fixture
def strays() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        proc.kill()
        proc.wait()


def test_unit_processes_found_by_mapped_argv_and_unit(
    env: Path, wheels: Wheelhouse, units: Units, user_manager: UserManager, fake_nvml: FakeNvml
) -> None:
    # A service whose main process runs the console script and forks a renamed worker that loads the
    # extension (as vLLM's VLLM::EngineCore does); the main process loads nothing (--lazy).
    serve_py = wheelhouse.site_packages(env) / "sicext" / "serve.py"
    served = units.started("served", f"{env} {serve_py} --lazy --workers 1")
    # A shell service whose child imports the extension: the shell itself shares the unit only.
    shell = units.started(
        "shell", f"/bin/sh -c '{env} -c \"import sicext, time; time.sleep(600)\" & exec sleep 600'"
    )
    main = user_manager.main_pid(served)
    shell_main = user_manager.main_pid(shell)
    served_group = user_manager.show(served, "ControlGroup")["ControlGroup"]
    shell_group = user_manager.show(shell, "ControlGroup")["ControlGroup"]

    def members(group: str) -> set[int]:
        from tests.bed_systemd import cgroup_pids

        return cgroup_pids(group)

    wait_until(lambda: any(so_mapped(p) for p in members(served_group) - {main}), 15, "worker maps the .so")
    wait_until(
        lambda: any(so_mapped(p) for p in members(shell_group) - {shell_main}), 15, "child maps the .so"
    )
    worker = next(p for p in members(served_group) - {main} if so_mapped(p))
    child = next(p for p in members(shell_group) - {shell_main} if so_mapped(p))
    gpu = fake_nvml.add_gpu("NVIDIA H200", "GPU-00000000-0000-0000-0000-000000000001", 141 * GiB)
    fake_nvml.hold(worker, gpu, 40 * GiB)

    result = dry_run(user_manager, fake_nvml, env, wheels["sicext-2"], "--json")
    assert result.code == 0, result.stdout + result.stderr
    doc = result.json
    assert doc["command"] == "dry-run" and doc["status"] == "would-proceed" and doc["exit_code"] == 0
    data = doc["data"]
    assert [(d["name"], d["old_version"], d["new_version"]) for d in data["distributions"]] == [
        ("sicext", "1.0", "2.0")
    ]
    procs = by_pid(doc)
    # the API-server shape: maps nothing itself, runs the environment's python (possible), and shares
    # its unit with a worker that maps the extension: certain
    assert procs[main]["evidence"] == ["environment", "unit"] and procs[main]["strength"] == "certain"
    # the forked worker keeps its parent's command line, but only it maps the extension
    assert procs[worker]["evidence"][0] == "mapped" and procs[worker]["name"] == "SICEXT::Worker0"
    assert "mapped" not in procs[main]["evidence"]
    assert procs[worker]["unit"] == served and procs[worker]["gpu_bytes"] == 40 * GiB
    assert procs[child]["evidence"] == ["mapped"] and procs[child]["unit"] == shell
    assert procs[shell_main]["evidence"] == ["unit"]
    assert {u["name"] for u in data["units"]} == {served, shell}
    served_unit = next(u for u in data["units"] if u["name"] == served)
    assert served_unit["active_state"] == "active" and served_unit["main_pid"] == main
    assert served_unit["stop_timeout_s"] == 90
    (gpu_doc,) = data["gpus"]["gpus"]
    assert gpu_doc["uuid"].endswith("0001") and gpu_doc["used_bytes"] == 40 * GiB
    assert "--reinstall-package" in data["uv_command"] and "--dry-run" not in data["uv_command"]
    assert data["strays"] == [] and data["refusals"] == []

    human = dry_run(user_manager, fake_nvml, env, wheels["sicext-2"])
    assert human.code == 0
    for text in (
        served,
        shell,
        "SICEXT::Worker0",
        "40.0 GiB",
        "NVIDIA H200",
        "sicext 1.0 -> 2.0",
        "would proceed",
    ):
        assert text in human.stdout, text


def test_console_script_found_by_argv(
    env: Path, wheels: Wheelhouse, units: Units, user_manager: UserManager
) -> None:
    name = units.started("pure", f"{env.parent}/sipure --serve")
    main = user_manager.main_pid(name)
    wait_until(lambda: "sipure" in Path(f"/proc/{main}/cmdline").read_text(), 10, "sipure running")
    doc = safeinstall(
        user_manager,
        None,
        "sipure",
        "--python",
        str(env),
        "--dry-run",
        "--json",
        "--",
        "--offline",
        "--find-links",
        str(wheels.directory),
    ).json
    procs = by_pid(doc)
    assert procs[main]["evidence"] == ["argv"] and procs[main]["unit"] == name
    assert doc["data"]["gpus"]["available"] is False
    assert any("GPU check unavailable" in w for w in doc["data"]["warnings"])


def test_stray_is_refused_unless_kill_strays(
    env: Path,
    wheels: Wheelhouse,
    units: Units,
    user_manager: UserManager,
    strays: list[subprocess.Popen[bytes]],
) -> None:
    proc = subprocess.Popen([str(env), "-c", "import sicext, time; time.sleep(600)"])
    strays.append(proc)
    wait_until(lambda: so_mapped(proc.pid), 15, "stray maps the .so")
    args = ("sicext", "--wheel", str(wheels["sicext-2"]), "--python", str(env), "--dry-run")
    refused = safeinstall(user_manager, None, *args, "--json")
    assert refused.code == 2
    doc = refused.json
    assert doc["status"] == "would-refuse"
    assert [p["pid"] for p in doc["data"]["strays"]] == [proc.pid]
    assert "--kill-strays" in doc["data"]["refusals"][0]
    human = safeinstall(user_manager, None, *args)
    assert human.code == 2 and "stray" in human.stdout and "would refuse" in human.stdout
    allowed = safeinstall(user_manager, None, *args, "--kill-strays", "--json")
    assert allowed.code == 0
    assert any(f"stray PID {proc.pid}" in w for w in allowed.json["data"]["warnings"])
    assert proc.poll() is None  # a dry run changes nothing


def test_running_old_code_after_reinstall_under_a_running_process(
    env: Path, wheels: Wheelhouse, units: Units, user_manager: UserManager
) -> None:
    name = units.started("old", f"{env} -c 'import sicext, time; time.sleep(600)'")
    main = user_manager.main_pid(name)
    wait_until(lambda: so_mapped(main), 15, "maps the .so")
    wheelhouse.uv_install(env, wheels["sicext-2"], reinstall=True)  # behind the service's back
    result = dry_run(user_manager, None, env, wheels["sicext-2"], "--json")
    procs = by_pid(result.json)
    assert procs[main]["running_old_code"] is True
    assert any("deleted" in d or "old code" in d for d in procs[main]["details"])
    human = safeinstall(
        user_manager, None, "sicext", "--wheel", str(wheels["sicext-2"]), "--python", str(env), "--dry-run"
    )
    assert "running old code" in human.stdout


def test_unit_of_the_other_manager_is_refused(
    env: Path, wheels: Wheelhouse, units: Units, user_manager: UserManager, tmp_path: Path
) -> None:
    """A process in a unit of another manager is not this manager's to stop, even when this manager
    has a unit of the same name (a unit is its cgroup), nor when it has none: the plan refuses and says
    why; nor when this manager's unit of that name is not running (a delegated cgroup may carry any
    unit's name: that unit would be gated). (Two private user managers: the refusal is reached whether
    or not the host runs a system manager.)"""
    other = start_user_manager(tmp_path / "other-manager")
    name = user_manager.unique_name("theirs")
    try:
        other.write_unit(name, f"[Service]\nExecStart={env} -c 'import sicext, time; time.sleep(600)'\n")
        other.start(name)
        other.wait_active(name)
        theirs = other.main_pid(name)
        wait_until(lambda: so_mapped(theirs), 15, "maps the .so")
        group = other.show(name, "ControlGroup")["ControlGroup"]

        unknown = dry_run(user_manager, None, env, wheels["sicext-2"], "--json")
        assert unknown.code == 2 and unknown.json["status"] == "would-refuse", unknown.stdout + unknown.stderr
        assert unknown.json["errors"] == []
        assert unknown.json["data"]["refusals"] == [
            f"{name} is not known to the user manager: try without --user"
        ]

        units.names.append(name)  # removed by the fixture
        user_manager.write_unit(name, "[Service]\nExecStart=/bin/sleep 600\n")  # the same name here
        user_manager.start(name)
        user_manager.wait_active(name)
        ours = user_manager.show(name, "ControlGroup")["ControlGroup"]
        same_name = dry_run(user_manager, None, env, wheels["sicext-2"], "--json")
        assert same_name.code == 2 and same_name.json["errors"] == []
        assert same_name.json["data"]["refusals"] == [
            f"{name} of the user manager runs in {ours}, not in {group}: "
            "the process belongs to another manager"
        ]

        user_manager.stop(name)  # ours known but not running: it has no cgroup, nothing to compare
        user_manager.wait_state(name, ("inactive", "failed"))
        assert user_manager.show(name, "ControlGroup")["ControlGroup"] == ""
        stopped = dry_run(user_manager, None, env, wheels["sicext-2"], "--json")
        assert stopped.code == 2 and stopped.json["errors"] == []
        assert stopped.json["data"]["refusals"] == [
            f"{name} of the user manager is not running (it has no cgroup), yet a process sits in "
            f"{group}: the process belongs to another manager"
        ]
    finally:
        other.remove_unit(name)
        stop_user_manager(other)


def test_a_unit_of_the_same_name_under_another_manager_is_left_alone(
    env: Path, wheels: Wheelhouse, units: Units, user_manager: UserManager, tmp_path: Path
) -> None:
    """Two managers may each run a unit with the same name; only the affected one's processes count."""
    name = units.started("twin", f"{env} -c 'import sicext, time; time.sleep(600)'")
    main = user_manager.main_pid(name)
    wait_until(lambda: so_mapped(main), 15, "maps the .so")
    other = start_user_manager(tmp_path / "other-manager")
    try:
        other.write_unit(name, "[Service]\nExecStart=/bin/sleep 600\n")
        other.start(name)
        other.wait_active(name)
        twin = other.main_pid(name)
        result = dry_run(user_manager, None, env, wheels["sicext-2"], "--json")
        assert result.code == 0, result.stdout + result.stderr
        processes = by_pid(result.json)
        assert main in processes and twin not in processes
        (unit,) = result.json["data"]["units"]
        assert unit["name"] == name and unit["pids"] == [main]
    finally:
        other.remove_unit(name)
        stop_user_manager(other)


def test_a_unit_that_never_times_out_gives_strict_json(
    env: Path, wheels: Wheelhouse, units: Units, user_manager: UserManager
) -> None:
    """TimeoutStopSec=infinity: JSON has no Infinity, so the stop timeout is null (and "infinity" for
    people)."""
    name = units.started(
        "forever", f"{env} -c 'import sicext, time; time.sleep(600)'", TimeoutStopSec="infinity"
    )
    wait_until(lambda: so_mapped(user_manager.main_pid(name)), 15, "maps the .so")
    result = dry_run(user_manager, None, env, wheels["sicext-2"], "--json")

    def refuse(constant: str) -> None:
        raise AssertionError(f"not strict JSON: {constant}")

    doc = json.loads(result.stdout, parse_constant=refuse)
    (unit,) = doc["data"]["units"]
    assert unit["name"] == name and unit["stop_timeout_s"] is None
    human = dry_run(user_manager, None, env, wheels["sicext-2"])
    assert "infinity" in human.stdout


def test_unresolvable_request_is_a_clear_error(env: Path, user_manager: UserManager) -> None:
    result = safeinstall(
        user_manager,
        None,
        "sicext==9.9",
        "--python",
        str(env),
        "--dry-run",
        "--",
        "--offline",
    )
    assert result.code == 2
    assert "error: uv cannot resolve" in result.stderr and "Traceback" not in result.stderr
    # one error line and one hint line: uv's own lines (its "error:" among them) joined into ours
    lines = result.stderr.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["error", "hint"], result.stderr


def test_dry_run_changes_nothing(
    env: Path, wheels: Wheelhouse, units: Units, user_manager: UserManager
) -> None:
    name = units.started("still", f"{env} -c 'import sicext, time; time.sleep(600)'")
    main = user_manager.main_pid(name)
    before = run("sicext", "--verify-only", "--python", str(env), "--json").json
    safeinstall(
        user_manager, None, "sicext", "--wheel", str(wheels["sicext-2"]), "--python", str(env), "--dry-run"
    )
    time.sleep(0.2)
    assert user_manager.main_pid(name) == main and user_manager.active_state(name) == "active"
    assert run("sicext", "--verify-only", "--python", str(env), "--json").json == before
    assert os.path.exists(f"/proc/{main}")


def test_depends_and_environment_evidence_and_only_loaded(
    venv: Path, wheels: Wheelhouse, units: Units, user_manager: UserManager, tmp_path: Path
) -> None:
    """``safeinstall sipure`` (pure Python): a unit that maps sicext, which requires sipure, has
    imported sipure (``depends``, certain); a unit that imported only sipure runs the environment's
    Python (``environment``, possible). Both are planned; --only-loaded leaves the second out, and
    says so."""
    requiring = wheelhouse.with_requirement(wheels["sicext-1"], tmp_path / "w", "sipure>=1")
    wheelhouse.uv_install(venv, requiring, wheels["sipure-1"])
    loaded = units.started("loaded", f"{venv} -c 'import sicext, time; time.sleep(600)'")
    possible = units.started("possible", f"{venv} -c 'import sipure, time; time.sleep(600)'")
    loaded_pid, possible_pid = user_manager.main_pid(loaded), user_manager.main_pid(possible)
    wait_until(lambda: so_mapped(loaded_pid), 15, "maps the .so")
    args = ("sipure", "--wheel", str(wheels["sipure-2"]), "--python", str(venv), "--dry-run")

    everything = safeinstall(user_manager, None, *args, "--json")
    assert everything.code == 0, everything.stdout + everything.stderr
    procs = by_pid(everything.json)
    assert (procs[loaded_pid]["evidence"], procs[loaded_pid]["strength"]) == (["depends"], "certain")
    assert procs[loaded_pid]["distributions"] == ["sipure"]
    assert any("maps sicext 1.0, which requires sipure" in d for d in procs[loaded_pid]["details"])
    assert (procs[possible_pid]["evidence"], procs[possible_pid]["strength"]) == (["environment"], "possible")
    assert {u["name"] for u in everything.json["data"]["units"]} == {loaded, possible}
    assert everything.json["data"]["left_out"] == [] and everything.json["data"]["only_loaded"] is False

    narrowed = safeinstall(user_manager, None, *args, "--only-loaded", "--json")
    assert narrowed.code == 0
    data = narrowed.json["data"]
    assert set(by_pid(narrowed.json)) == {loaded_pid} and [u["name"] for u in data["units"]] == [loaded]
    assert data["only_loaded"] is True and data["left_out"] == [possible_pid]
    assert any("--only-loaded leaves out 1 process(es)" in w for w in data["warnings"])

    human = safeinstall(user_manager, None, *args, "--only-loaded")
    assert "--only-loaded leaves out 1 process(es)" in human.stderr and str(possible_pid) in human.stderr
    assert "depends (certain)" in human.stdout and "maps sicext 1.0, which requires sipure" in human.stdout


def test_local_changes_are_said_before_anything_stops(
    env: Path, wheels: Wheelhouse, user_manager: UserManager
) -> None:
    """A file of the package was patched locally and another deleted: the dry-run (and so the prompt,
    which shows the same plan) lists both as what the reinstall replaces, before anything stops."""
    site = wheelhouse.site_packages(env)
    serve, init = site / "sicext" / "serve.py", site / "sicext" / "__init__.py"
    serve.write_text(serve.read_text() + "# a local fix\n")
    init.unlink()
    result = dry_run(user_manager, None, env, wheels["sicext-2"], "--json")
    assert result.code == 0, result.stdout + result.stderr
    plan = result.json["data"]
    assert sorted(plan["locally_modified"]) == sorted([str(init), str(serve)])
    assert any("2 installed files" in w and "--keep-patches" in w for w in plan["warnings"])
    human = dry_run(user_manager, None, env, wheels["sicext-2"])
    assert "were changed locally" in human.stdout + human.stderr
    clean = run("sipure", "--wheel", str(wheels["sipure-2"]), "--python", str(env), "--dry-run", "--json")
    assert clean.json["data"]["locally_modified"] == []


def test_a_wheel_landing_on_another_distributions_files_is_a_refusal_that_names_it(
    venv: Path, tmp_path: Path
) -> None:
    """siownerb was installed over a file of siownera: the plan says so (not a local change), and a
    reinstall of siownera, whose wheel lands on that file of siownerb, would refuse, naming siownerb and
    what to do; the dry-run shows the plan with it (exit 2), not an error about a hostile wheel."""
    _shared, wheel_a, _wheel_b = wheelhouse.two_owners(venv, tmp_path / "owners")
    result = run("siownera", "--wheel", str(wheel_a), "--python", str(venv), "--dry-run", "--json")
    assert result.code == 2, result.stdout + result.stderr
    doc = result.json
    assert doc["status"] == "would-refuse", doc["errors"]
    plan = doc["data"]
    assert plan["locally_modified"] == []
    assert any("1 file(s) of siownera hold the copy of siownerb" in w for w in plan["warnings"]), plan[
        "warnings"
    ]
    (refusal,) = plan["refusals"]
    assert "1 file(s) of siownerb 1.0" in refusal and "uv pip uninstall siownerb" in refusal
    assert "--with-deps" in refusal and "source you trust" not in refusal
    human = run("siownera", "--wheel", str(wheel_a), "--python", str(venv), "--dry-run")
    assert human.code == 2 and "siownerb 1.0" in human.stdout and "the run would refuse" in human.stdout


def test_the_plan_reads_at_a_glance(
    env: Path, wheels: Wheelhouse, units: Units, user_manager: UserManager
) -> None:
    """One row per process with its strongest evidence as one reason; every piece of evidence with -v;
    no padding on a pipe; at 60 columns the reason and command stack below their row, a path never
    broken across lines."""
    shell = units.started(
        "glance", f"/bin/sh -c '{env} -c \"import sicext, time; time.sleep(600)\" & exec sleep 600'"
    )
    group = user_manager.show(shell, "ControlGroup")["ControlGroup"]
    main = user_manager.main_pid(shell)

    def child() -> int | None:
        from tests.bed_systemd import cgroup_pids

        return next((p for p in cgroup_pids(group) - {main} if so_mapped(p)), None)

    wait_until(lambda: child() is not None, 15, "the child maps the .so")
    pid = child()
    args = ("--user", "sicext", "--wheel", str(wheels["sicext-2"]), "--python", str(env), "--dry-run")
    environ = {**user_manager.env, "SAFEINSTALL_NVML_LIBRARY": "/nonexistent/libnvidia-ml.so.1"}
    wide = run(*args, env={**environ, "COLUMNS": "160"})
    assert wide.code == 0, wide.stdout + wide.stderr
    lines = wide.stdout.splitlines()
    (row,) = [line for line in lines if line.startswith(f"{pid} ")] or [wide.stdout]
    assert "mapped (certain)" in row and "maps sicext/_native." in row, row
    (shell_row,) = [line for line in lines if line.startswith(f"{main} ")]
    assert "unit (certain)" in shell_row and f"shares {shell} with an affected process" in shell_row
    assert not any(line != line.rstrip() for line in lines), "padded lines on a pipe"
    assert f"PID {pid}: mapped:" not in wide.stdout and "-v: every piece of evidence" in wide.stdout
    reasons = {p["pid"]: p["reason"] for p in run(*args, "--json", env=environ).json["data"]["processes"]}
    assert reasons[pid].startswith("maps sicext/_native.") and reasons[main].startswith(f"shares {shell}")
    verbose = run(*args, "-v", env={**environ, "COLUMNS": "160"})
    assert f"PID {pid}: mapped: sicext" in verbose.stdout and f"PID {main}: shares {shell}" in verbose.stdout
    narrow = run(*args, env={**environ, "COLUMNS": "60"})
    assert narrow.code == 0
    start = narrow.stdout.index("processes using them")
    table = narrow.stdout[start : narrow.stdout.index("units that would be stopped")].splitlines()
    assert all(len(line) <= 60 or len(line.split()) == 1 for line in table), table  # a long path: whole
    for token in " ".join(table).split():  # a broken path leaves its tail as a word of its own
        assert "native" not in token or token.startswith(("sicext/", "/")), table
        assert not token.startswith(("gnu.so", "x86_64", "linux-gnu")), table


def test_keep_patches_takes_a_file_another_record_holds_for_no_local_patch(
    venv: Path, tmp_path: Path
) -> None:
    """siownerb was installed over a file of siownera: --keep-patches carries siownera's real local
    patch and does not take that file for one (as a patch of a file the new version no longer ships,
    it would refuse the run)."""
    _shared, wheel_a, _wheel_b = wheelhouse.two_owners(venv, tmp_path / "owners")
    new = wheelhouse.make_wheel(
        tmp_path, "siownera", "2.0", {"siownera.py": b"y = 0\n\n\n\nx = 1\n"}
    )  # no longer ships sishared/core.py
    patched = wheelhouse.site_packages(venv) / "siownera.py"
    patched.write_text("x = 1\n# a local fix\n")
    args = ("siownera", "--wheel", str(new), "--python", str(venv), "--keep-patches", "--base-wheel")
    result = run(*args, str(wheel_a), "--dry-run", "--json")
    assert result.code == 0, result.stdout + result.stderr
    data = result.json["data"]
    assert [(os.path.basename(p["path"]), p["status"]) for p in data["patches"]] == [
        ("siownera.py", "carried")
    ]
    assert data["locally_modified"] == [str(patched)]


def test_the_plan_says_what_will_run_the_staging_install_and_the_swap_or_the_install_in_the_stop(
    env: Path, wheels: Wheelhouse, user_manager: UserManager
) -> None:
    """Issue 37: the plan showed uv's dry-run command, which no step runs. A venv swaps: uv installs into
    the staging tree before the stop and the renames happen during it; --no-swap installs in the stop."""
    swapped = dry_run(user_manager, None, env, wheels["sicext-2"], "--json").json["data"]["install"]
    before, during = swapped
    assert (
        before.startswith("before the stop: ") and " --prefix " in before and "/.safeinstall-swap-" in before
    )
    prefix = os.path.realpath(env.parent.parent)
    assert during == f"during the stop: the staged files are renamed into {prefix} (the swap)"
    before, during = dry_run(user_manager, None, env, wheels["sicext-2"], "--no-swap", "--json").json["data"][
        "install"
    ]
    assert before.startswith("before the stop (fills the run's uv cache): ") and " --target " in before
    assert during.startswith("during the stop (no swap: --no-swap is given): ") and "--offline" in during
    human = dry_run(user_manager, None, env, wheels["sicext-2"])
    assert "uv command:\n  before the stop: " in human.stdout and "(the swap)" in human.stdout


#: How a user manager exits on SIGTERM (it starts exit.target): systemd's own exit.target and
#: systemd-exit.service; with an empty exit.target it would run on until the bed kills it
BARE_EXIT = {
    "exit.target": "[Unit]\nDefaultDependencies=no\n"
    "Requires=systemd-exit.service\nAfter=systemd-exit.service\n",
    "systemd-exit.service": "[Unit]\nDefaultDependencies=no\nRequires=shutdown.target\n"
    "After=shutdown.target\nSuccessAction=exit-force\n[Service]\nSlice=-.slice\n",
}


def test_a_manager_without_admin_directories_is_refused_by_the_plan(
    env: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """A manager started with ``SYSTEMD_UNIT_PATH`` naming its own directory alone (no trailing ":", as
    the system manager's bed of issue 42 first did) reads no admin directory, where the gate's drop-in
    goes: the plan says the run would refuse (it said "proceed" and the run failed at the gate, after
    the backup and the prefetch), and a run is refused before anything, the unit never stopped."""
    base = tmp_path / "bare"
    (base / "config" / "systemd" / "user").mkdir(parents=True)
    for target in ("default.target", "basic.target", "shutdown.target"):
        (base / "config" / "systemd" / "user" / target).write_text("[Unit]\n")
    for unit, text in BARE_EXIT.items():  # its SIGTERM exits it at once, not after the bed's 30 s
        (base / "config" / "systemd" / "user" / unit).write_text(text)
    manager = start_user_manager(base, unit_path=str(base / "config" / "systemd" / "user"))
    name = "si-bare.service"
    try:
        manager.write_unit(name, f"[Service]\nExecStart={env} -c 'import sicext, time; time.sleep(600)'\n")
        manager.start(name)
        manager.wait_active(name)
        main = manager.main_pid(name)
        wait_until(lambda: so_mapped(main), 15, "maps the .so")
        plan = dry_run(manager, None, env, wheels["sicext-2"], "--json")
        assert plan.code == 2, plan.stdout + plan.stderr
        (refusal,) = plan.json["data"]["refusals"]
        assert "cannot tell where the service manager reads drop-ins from" in refusal
        assert "SYSTEMD_UNIT_PATH" in refusal  # what to change, not "this systemd may be too old"
        state = tmp_path / "state"
        wheel = str(wheels["sicext-2"])
        more_env = {"SAFEINSTALL_STATE_DIR": str(state)}
        ran = safeinstall(
            manager,
            None,
            "sicext",
            "--wheel",
            wheel,
            "--python",
            str(env),
            "--yes",
            "--json",
            more_env=more_env,
        )
        assert ran.code == 2, ran.stdout + ran.stderr
        (error,) = ran.json["errors"]
        assert error["message"].startswith("the run would refuse: cannot tell where"), error
        assert not list(state.glob("*/backups/*"))  # refused before the backup
        assert manager.main_pid(name) == main
    finally:
        manager.remove_unit(name)
        stop_user_manager(manager)
    assert manager.process.returncode == 0, "the manager did not exit on SIGTERM: the bed killed it"
