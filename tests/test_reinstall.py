"""The safe reinstall, end to end: real systemd user units, real uv, real wheels, the fake NVML driver.

Order of events is checked from the outside (the installed file's inode, the fake driver's record of
when a process died), never from safeinstall's own log.
"""

from __future__ import annotations

import os
import re
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import wheelhouse
from tests.bed_nvml import GiB
from tests.bed_systemd import cgroup_pids, wait_until
from tests.beds import Bed, declined_on_a_terminal, health_server, maps_so
from tests.clirun import run


def test_happy_path(bed: Bed) -> None:
    name = bed.service("happy")
    old_main = bed.manager.main_pid(name)
    gpu = bed.nvml.add_gpu("NVIDIA H200", "GPU-00000000-0000-0000-0000-00000000000a", 141 * GiB)
    bed.nvml.hold(old_main, gpu, 20 * GiB)
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--json", "--settle", "1")
    assert result.code == 0, result.stdout + result.stderr
    doc = result.json
    assert doc["command"] == "reinstall" and doc["status"] == "done" and doc["errors"] == []
    assert set(doc["data"]) == {  # the fields docs/json.md documents
        "run_id",
        "plan",
        "steps",
        "downtime_s",
        "service_downtime_s",
        "patched",
        "deleted",
        "extras",
        "pruned",
        "backup_dir",
        "backups_removed",
        "log_file",
        "not_restarted",
        "strays_killed",
        "notes",
        "old_code",
        "patches",
        "patch_file",
        "manual_commands",
        "wall_s",
    }
    assert doc["data"]["patches"] == [] and doc["data"]["patch_file"] is None
    assert [s["name"] for s in doc["data"]["steps"]] == [
        "preflight",  # its own time, within the whole run's (issue 47 item 4)
        "backup",
        "prefetch",
        "smoke",  # the new version imported before the stop
        "gate",
        "stop",
        "gpu-release",
        "install",
        "verify",
        "restart",
        "verify-in-place",  # swapped: the files verified in place again once the units run
        "end-check",
    ]
    assert all(s["status"] == "ok" for s in doc["data"]["steps"])
    assert 0 < doc["data"]["steps"][0]["seconds"] < doc["data"]["wall_s"]
    assert doc["data"]["old_code"] == []
    assert name in doc["data"]["downtime_s"] and doc["data"]["downtime_s"][name] > 0
    new_main = bed.manager.main_pid(name)
    assert new_main != old_main and bed.manager.active_state(name) == "active"
    assert maps_so(new_main) == bed.so.stat().st_ino  # the new process runs the new extension
    assert bed.version() == "2.0"
    assert bed.verify("--wheel", str(bed.wheels["sicext-2"])).code == 0
    # No trace left in the unit, nothing left to recover.
    assert not list(bed.manager.unit_dir.glob(f"{name}.d/*safeinstall*"))
    assert not any(bed.state.glob("*/journal.json"))
    assert not any(bed.state.glob("*/gate"))


@pytest.mark.parametrize("swap", [True, False], ids=["swap", "no-swap"])
def test_the_install_hardlinks_from_the_runs_own_cache_and_nothing_shares_an_inode_after(
    bed: Bed, swap: bool
) -> None:
    """No copy of the package's bytes in the downtime: the run's own uv cache (in its state directory,
    on the prefix's filesystem) is filled before the stop and the install hardlinks from it (into the
    staging tree, before the stop, when the run swaps). The cache is deleted when the run ends, so
    every installed file, and every file of the backup (hardlinks of the old version's files), has
    exactly one link, and the backup still holds the old version."""
    import hashlib

    from safeinstall.env.distributions import find_distribution, find_distributions
    from safeinstall.env.environment import inspect_environment
    from safeinstall.store.backup import load_backup

    bed.service("links")
    extra = () if swap else ("--no-swap",)
    result = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json", *extra
    )

    assert result.code == 0, result.stdout + result.stderr
    data = result.json["data"]
    command = data["plan"]["uv_command"]
    assert command[command.index("--link-mode") + 1] == "hardlink"
    assert bed.state.is_dir() and not list(bed.state.glob("*/uv-cache-*"))
    assert not list(bed.python.parent.parent.glob(".safeinstall-swap-*"))  # the staging tree: gone
    # hashed before the stop, the linked files (every member of the wheel: what uv writes itself, the
    # RECORD, INSTALLER, the console script, is not the wheel's) are verified by their identity
    steps = {step["name"]: step["detail"] for step in data["steps"]}
    hashed = int(re.findall(r"(\d+) files hashed", steps["prefetch"])[0])
    in_place = steps["verify-in-place" if swap else "verify"]
    checked, proven = (int(n) for n in re.findall(r"(\d+) files match \((\d+) of them links", in_place)[0])
    assert 0 < proven == checked <= hashed, steps
    if swap:
        assert steps["install"].startswith("swapped: "), steps
        assert "files verified in the staging tree before the stop" in steps["verify"], steps
    else:
        assert steps["install"].startswith(f"{command[0]} pip install --offline "), (
            steps
        )  # see window_command
    log = Path(data["log_file"]).read_text()
    assert "the run's cache written to disk" in log
    assert ("the plan resolved again with the run's cache" in log) is not swap
    installed = find_distribution(
        inspect_environment(bed.python), "sicext", find_distributions(inspect_environment(bed.python))
    )
    assert installed.version == "2.0"
    assert {os.lstat(location).st_nlink for location in installed.locations} == {1}
    backup = load_backup(Path(data["backup_dir"]))
    for saved in backup.manifest.files:
        path = backup.files_dir / saved.path
        assert os.lstat(path).st_nlink == 1, saved.path
        assert hashlib.sha256(path.read_bytes()).hexdigest() == saved.sha256, saved.path
    assert any(saved.path.endswith("sicext/__init__.py") for saved in backup.manifest.files)


def test_human_output_names_every_step_and_the_downtime(bed: Bed) -> None:
    name = bed.service("human")
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5")
    assert result.code == 0, result.stderr
    for step in ("backup", "prefetch", "gate", "stop", "gpu-release", "install", "verify", "restart"):
        assert step in result.stdout
    assert f"{name} was down for" in result.stdout and "sicext 1.0 -> 2.0" in result.stdout


def test_install_waits_for_gpu_memory_release(bed: Bed) -> None:
    name = bed.service("gpu-wait")
    main = bed.manager.main_pid(name)
    gpu = bed.nvml.add_gpu("NVIDIA H200", "GPU-00000000-0000-0000-0000-00000000000b", 141 * GiB)
    linger = 2.5
    bed.nvml.hold(main, gpu, 30 * GiB, linger=linger)
    old_inode = bed.so.stat().st_ino
    installed_at: list[float] = []
    stop = threading.Event()

    def watch() -> None:  # an outside observer: when does the installed extension change?
        while not stop.is_set():
            try:
                if bed.so.stat().st_ino != old_inode:
                    installed_at.append(time.monotonic())
                    return
            except (OSError, StopIteration):
                installed_at.append(time.monotonic())
                return
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = bed.safeinstall(
            "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json"
        )
    finally:
        stop.set()
        watcher.join()
    assert result.code == 0, result.stdout + result.stderr
    dead_at = float((bed.nvml.directory / "procs" / f"{main}.dead_at").read_text().split()[0])
    assert installed_at, "the install never happened"
    assert installed_at[0] >= dead_at + linger  # the fake driver kept the memory until then
    gpu_step = next(s for s in result.json["data"]["steps"] if s["name"] == "gpu-release")
    assert gpu_step["status"] == "ok" and "released" in gpu_step["detail"]


def test_gpu_release_timeout_restarts_unit_and_installs_nothing(bed: Bed) -> None:
    name = bed.service("gpu-timeout")
    main = bed.manager.main_pid(name)
    gpu = bed.nvml.add_gpu("NVIDIA H200", "GPU-00000000-0000-0000-0000-00000000000c", 141 * GiB)
    bed.nvml.hold(main, gpu, 30 * GiB, linger=60)
    result = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--gpu-timeout", "1", "--settle", "0.5", "--json"
    )
    assert result.code == 3, result.stdout + result.stderr
    doc = result.json
    assert doc["status"] == "rolled-back"
    message = doc["errors"][0]["message"]
    assert "GPU memory was not released" in message and f"PID {main}" in message
    assert "nothing was installed" in message
    assert bed.manager.active_state(name) == "active" and bed.manager.main_pid(name) != main
    assert bed.version() == "1.0"
    assert bed.verify().code == 0


@pytest.mark.parametrize("case", ["corrupt", "other-package", "other-python", "record-mismatch"])
def test_bad_wheels_are_refused_before_anything_stops(bed: Bed, tmp_path: Path, case: str) -> None:
    """Refused before anything stops (exit 2); the dry-run, the same preflight, refuses the same."""
    name = bed.service(f"bad-{case}")
    main = bed.manager.main_pid(name)
    (tmp_path / "w").mkdir()
    if case == "corrupt":
        wheel = tmp_path / "w" / bed.wheels["sicext-2"].name
        wheel.write_bytes(bed.wheels["sicext-2"].read_bytes()[:2000])
        expected = "not a valid zip"
    elif case == "other-package":
        wheel = bed.wheels["sipure-2"]
        expected = "is for sipure, not sicext"
    elif case == "other-python":
        wheel = tmp_path / "w" / "sicext-2.0-cp39-cp39-linux_x86_64.whl"
        wheel.write_bytes(bed.wheels["sicext-2"].read_bytes())
        expected = "does not fit Python 3."
    else:
        wheel = _with_edited_member(bed.wheels["sicext-2"], tmp_path / "w", "sicext/serve.py")
        expected = "its RECORD does not match its contents"
    dry = bed.safeinstall("sicext", "--wheel", str(wheel), "--dry-run", "--json")
    assert dry.code == 2 and dry.json["exit_code"] == 2, dry.stdout + dry.stderr
    assert expected in dry.json["errors"][0]["message"]
    result = bed.safeinstall("sicext", "--wheel", str(wheel))
    assert result.code == 2, result.stdout + result.stderr
    assert expected in result.stderr and "Traceback" not in result.stderr
    assert bed.manager.main_pid(name) == main
    assert bed.version() == "1.0"


def _with_edited_member(wheel: Path, out_dir: Path, member: str) -> Path:
    """A copy of ``wheel`` with one member changed after its RECORD was written (uv #11723's shape)."""
    import zipfile

    out = out_dir / wheel.name
    with zipfile.ZipFile(wheel) as source, zipfile.ZipFile(out, "w") as copy:
        for info in source.infolist():
            data = source.read(info)
            copy.writestr(info, data + b"# edited\n" if info.filename == member else data)
    return out


def test_unit_that_ignores_sigterm_aborts_after_stop_timeout(bed: Bed) -> None:
    code = "import signal, sicext, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(600)"
    name = bed.units.started("stubborn", f"{bed.python} -c '{code}'", TimeoutStopSec="6")
    main = bed.manager.main_pid(name)
    wait_until(lambda: maps_so(main) is not None, 15, "maps the .so")
    result = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--stop-timeout", "1", "--settle", "0.5", "--json"
    )
    assert result.code == 3, result.stdout + result.stderr
    message = result.json["errors"][0]["message"]
    assert f"unit {name} did not stop in 1 s" in message
    assert result.json["errors"][0]["hint"]  # every error says what to do next
    assert "nothing was installed" in message and f"started {name} again" in message
    assert bed.manager.active_state(name) == "active"
    assert bed.version() == "1.0"


def test_a_new_dependency_that_cannot_be_unpacked_is_found_before_anything_stops(
    bed: Bed, tmp_path: Path
) -> None:
    """The new version needs a dependency that resolves but cannot be installed (a corrupt wheel): the
    prefetch installs every new distribution of uv's plan before the stop, so nothing stops (exit 2).
    (uv failing half-way through the install itself: the disk-full tests in test_crash_safety.)"""
    patched = bed.site / "sicext" / "serve.py"
    patched.write_text(patched.read_text() + "# a local hotfix\n")
    before = {p: p.read_bytes() for p in (bed.site / "sicext").rglob("*") if p.is_file()}
    name = bed.service("uvfail")
    main = bed.manager.main_pid(name)
    v2, links = wheelhouse.with_broken_dependency(bed.wheels["sicext-2"], tmp_path)
    result = bed.safeinstall(
        "sicext",
        "--wheel",
        str(v2),
        "--settle",
        "0.5",
        "--json",
        "--",
        "--offline",
        "--find-links",
        str(links),
    )
    assert result.code == 2, result.stdout + result.stderr
    doc = result.json
    assert doc["status"] == "error"
    message = doc["errors"][0]["message"]
    assert "uv could not fetch or unpack the new version" in message and "sidep" in message, message
    assert [(s["name"], s["status"]) for s in doc["data"]["steps"]] == [
        ("preflight", "ok"),
        ("backup", "ok"),
        ("prefetch", "failed"),
    ]
    after = {p: p.read_bytes() for p in (bed.site / "sicext").rglob("*") if p.is_file()}
    assert after == before  # v1 bytes and the local patch
    assert bed.manager.active_state(name) == "active" and bed.manager.main_pid(name) == main
    assert bed.version() == "1.0"
    assert not any(bed.state.glob("*/journal.json")) and not any(bed.state.glob("*/gate"))


def test_new_version_that_crashes_is_rolled_back(bed: Bed) -> None:
    name = bed.service("crash")
    result = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-3"]), "--settle", "1", "--json", "--no-smoke"
    )
    assert result.code == 3, result.stdout + result.stderr
    (error,) = result.json["errors"]
    message = error["message"]
    assert name in message and "restored the previous installation" in message
    # what to do next: the unit's own journal, and the run's log
    assert f"journalctl --user -u {name}" in error["hint"]
    assert result.json["data"]["log_file"] in error["hint"]
    wait_until(lambda: bed.manager.active_state(name) == "active", 10, "unit active again")
    assert maps_so(bed.manager.main_pid(name)) == bed.so.stat().st_ino
    assert bed.version() == "1.0"
    assert bed.verify().code == 0
    # the rollback is a step of its own, said as it begins and when it ends (here and in the log)
    rollback = result.json["data"]["steps"][-1]
    assert (rollback["name"], rollback["status"]) == ("rollback", "ok")
    assert "restored the previous installation" in rollback["detail"]
    log = Path(result.json["data"]["log_file"]).read_text()
    assert "rolling back (" in log and "rollback: ok" in log
    human = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-3"]), "--settle", "1", "--no-smoke")
    assert human.code == 3 and "rolling back (" in human.stderr
    assert any(line.startswith("rollback ") for line in human.stdout.splitlines()), human.stdout


def test_a_rollback_that_fails_lists_the_commands_to_finish(bed: Bed, tmp_path: Path) -> None:
    """Exit 4: the unit starts neither on the new version nor, after the restore, on the old one (its
    ExecStopPost leaves a flag that makes every later start fail). The commands that finish the job
    are in the message and, one by one, in ``manual_commands`` for scripts (the Ansible module)."""
    flag = tmp_path / "stopped-once"
    serve = f"{bed.python.parent}/sicext-serve"
    name = bed.units.started(
        "no-return", f"/bin/sh -c 'test ! -e {flag} && exec {serve}'", ExecStopPost=f"/bin/touch {flag}"
    )
    main = bed.manager.main_pid(name)
    wait_until(lambda: maps_so(main) is not None, 15, "service maps the .so")

    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")

    assert result.code == 4, result.stdout + result.stderr
    doc = result.json
    assert doc["status"] == "rollback-failed" and doc["errors"][0]["code"] == "rollback-failed"
    commands = doc["data"]["manual_commands"]
    assert commands == [f"safeinstall --recover --python {bed.python}", f"systemctl --user start {name}"]
    assert " && ".join(commands) in doc["errors"][0]["message"]
    assert bed.version() == "1.0"  # the restore itself worked; the start did not


def test_only_good_runs_count_under_keep_backups(bed: Bed) -> None:
    """A vLLM backup is GBs: the newest --keep-backups good runs' backups stay; a rolled-back run's
    goes with the next run (it deletes no good one: issue 37), and a directory that is not a run's
    backup is never touched."""
    from safeinstall.store.state import environment_key

    bed.service("retention")
    prefix = Path(os.path.realpath(bed.python.parent.parent))
    backups = bed.state / environment_key(prefix) / "backups"
    planted = ["20240101T000000Z-11", "20240102T000000Z-12"]
    for name in [*planted, "not-a-backup"]:
        (backups / name / "files").mkdir(parents=True)
        (backups / name / "files" / "x").write_text(name)
    failed = bed.safeinstall(
        "sicext",
        "--wheel",
        str(bed.wheels["sicext-3"]),
        "--settle",
        "1",
        "--keep-backups",
        "1",
        "--json",
        "--no-smoke",
    )
    assert failed.code == 3, failed.stdout + failed.stderr
    failed_backup = Path(failed.json["data"]["backup_dir"])
    assert failed.json["data"]["backups_removed"] == []
    assert {p.name for p in backups.iterdir()} == {*planted, "not-a-backup", failed_backup.name}

    good = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--keep-backups", "2", "--json"
    )

    assert good.code == 0, good.stdout + good.stderr
    kept = Path(good.json["data"]["backup_dir"])
    assert sorted(good.json["data"]["backups_removed"]) == [str(backups / planted[0]), str(failed_backup)]
    assert {p.name for p in backups.iterdir()} == {planted[1], kept.name, "not-a-backup"}
    again = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--keep-backups", "1"
    )
    assert again.code == 0 and "deleted 2 older backups" in again.stderr, again.stderr
    (newest,) = {p.name for p in backups.iterdir()} - {"not-a-backup"}
    assert newest not in (kept.name, failed_backup.name)


def test_keep_backups_must_be_at_least_one(bed: Bed) -> None:
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--keep-backups", "0")
    assert result.code == 2 and "--keep-backups" in result.stderr and "Traceback" not in result.stderr


def test_a_file_pruned_by_a_run_that_fails_later_comes_back(bed: Bed) -> None:
    """--prune removes files the new version does not have; when the run then fails (v3 crashes at
    start), the rollback must put them back too: they are in no RECORD, but they are someone's."""
    notes = bed.site / "sicext" / "local_notes.txt"
    notes.write_text("ops notes\n")
    name = bed.service("prunefail")
    result = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-3"]), "--prune", "--settle", "1", "--json", "--no-smoke"
    )
    assert result.code == 3, result.stdout + result.stderr
    assert str(notes) in result.json["data"]["pruned"]
    assert notes.read_text() == "ops notes\n"
    wait_until(lambda: bed.manager.active_state(name) == "active", 10, "unit active again")
    assert bed.version() == "1.0"


@pytest.mark.parametrize("dependency", ["BindsTo", "Requires", "PartOf"])
def test_a_unit_that_stops_with_an_affected_one_is_started_again(bed: Bed, dependency: str) -> None:
    """A sidecar (a proxy, a metrics exporter) whose BindsTo=, Requires= or PartOf= names the service:
    stopping the service stops it too, and starting the service does not bring it back. It is planned,
    stopped, gated and started again like the service itself."""
    served = bed.service("served")
    sidecar = bed.units.create(
        "sidecar",
        f"[Unit]\n{dependency}={served}\nAfter={served}\n\n[Service]\nExecStart=/bin/sleep 600\n",
    )
    bed.manager.start(sidecar)
    bed.manager.wait_active(sidecar)
    dry = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--dry-run", "--json")
    planned = {u["name"]: u for u in dry.json["data"]["units"]}
    assert planned[sidecar]["stopped_with"] == served and planned[sidecar]["pids"] == []
    sidecar_main = bed.manager.main_pid(sidecar)

    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")

    assert result.code == 0, result.stdout + result.stderr
    assert set(result.json["data"]["downtime_s"]) == {served, sidecar}
    assert bed.manager.active_state(sidecar) == "active" and bed.manager.main_pid(sidecar) != sidecar_main
    assert bed.manager.active_state(served) == "active" and bed.version() == "2.0"
    assert not list(bed.manager.unit_dir.glob(f"{sidecar}.d/*safeinstall*"))


def test_locally_patched_file_is_kept_in_the_backup(bed: Bed) -> None:
    bed.service("patched")
    patched = bed.site / "sicext" / "serve.py"
    patched.write_text(patched.read_text() + "# a local hotfix\n")
    content = patched.read_bytes()
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")
    assert result.code == 0, result.stdout + result.stderr
    data = result.json["data"]
    assert data["patched"] == [str(patched)]
    saved = Path(data["backup_dir"]) / "files" / os.path.relpath(patched, bed.python.parent.parent)
    assert saved.read_bytes() == content
    human = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5")
    assert human.code == 0  # second run: nothing patched any more
    assert "locally patched" not in human.stdout


@pytest.fixture
def stray_procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def test_stray_refused_then_killed_with_kill_strays(
    bed: Bed, stray_procs: list[subprocess.Popen[bytes]]
) -> None:
    name = bed.service("with-stray")
    proc = subprocess.Popen([str(bed.python), "-c", "import sicext, time; time.sleep(600)"])
    stray_procs.append(proc)
    wait_until(lambda: maps_so(proc.pid) is not None, 15, "stray maps the .so")
    dry = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--dry-run", "--json")
    assert dry.code == 2 and dry.json["status"] == "would-refuse"  # the same decision as the run's
    refused = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]))
    assert refused.code == 2 and "--kill-strays" in refused.stderr
    assert proc.poll() is None and bed.version() == "1.0"
    result = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--kill-strays", "--settle", "0.5", "--json"
    )
    assert result.code == 0, result.stdout + result.stderr
    assert result.json["data"]["strays_killed"] == [proc.pid]
    assert proc.wait(timeout=10) is not None
    assert bed.manager.active_state(name) == "active"


def test_vllm_shaped_unit(bed: Bed) -> None:
    """An API process that maps nothing and forks renamed workers that map the .so, hold GPU memory,
    and take seconds to exit on SIGTERM: all found, waited for, and the whole unit comes back."""
    serve = bed.site / "sicext" / "serve.py"
    name = bed.units.started("vllm", f"{bed.python} {serve} --lazy --workers 2 --term-delay 2")
    main = bed.manager.main_pid(name)
    group = bed.manager.show(name, "ControlGroup")["ControlGroup"]
    wait_until(lambda: len([p for p in cgroup_pids(group) if maps_so(p)]) == 2, 15, "two workers map the .so")
    workers = sorted(p for p in cgroup_pids(group) if maps_so(p))
    gpu = bed.nvml.add_gpu("NVIDIA H200", "GPU-00000000-0000-0000-0000-00000000000d", 141 * GiB)
    for worker in workers:
        bed.nvml.hold(worker, gpu, 60 * GiB)
    plan = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--dry-run", "--json").json[
        "data"
    ]
    found = {p["pid"]: p for p in plan["processes"]}
    assert set(found) >= {main, *workers}
    assert all(found[w]["gpu_bytes"] == 60 * GiB for w in workers)
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "1", "--json")
    assert result.code == 0, result.stdout + result.stderr
    assert result.json["data"]["downtime_s"][name] >= 2  # the workers' slow exit was waited for
    for pid in (main, *workers):
        assert not Path(f"/proc/{pid}").exists()
    new_group = bed.manager.show(name, "ControlGroup")["ControlGroup"]
    wait_until(lambda: len([p for p in cgroup_pids(new_group) if maps_so(p)]) == 2, 15, "workers back")
    assert all(maps_so(p) == bed.so.stat().st_ino for p in cgroup_pids(new_group) if maps_so(p))


def test_health_url_must_answer_200(bed: Bed, tmp_path: Path) -> None:
    server, port = health_server(tmp_path)
    name = bed.units.started("health", f"{bed.python} {server} {port}")
    wait_until(lambda: maps_so(bed.manager.main_pid(name)) is not None, 15, "server maps the .so")
    ok = bed.safeinstall(
        "sicext",
        "--wheel",
        str(bed.wheels["sicext-2"]),
        "--settle",
        "0.5",
        "--health-url",
        f"http://127.0.0.1:{port}/health",
        "--json",
    )
    assert ok.code == 0, ok.stdout + ok.stderr
    restart = next(s for s in ok.json["data"]["steps"] if s["name"] == "restart")
    assert f"http://127.0.0.1:{port}/health answers 200" in restart["detail"]  # shown without a token
    # A URL that never answers 200 fails the restart: rolled back to what was there (2.0 now).
    bad = bed.safeinstall(
        "sicext",
        "--wheel",
        str(bed.wheels["sicext-1"]),
        "--settle",
        "0.5",
        "--health-url",
        f"http://127.0.0.1:{port}/missing",
        "--health-timeout",
        "2",
        "--json",
    )
    assert bad.code == 3, bad.stdout + bad.stderr
    assert "did not answer 200 within 2 s (last: HTTP 404)" in bad.json["errors"][0]["message"]
    assert "raise --health-timeout" in bad.json["errors"][0]["hint"]
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running again")
    assert bed.version() == "2.0"
    # no silent wait: the stop, the settle and the health check each say what they wait for (the log,
    # which --status --wait shows; on a pipe, stderr too)
    log = Path(bad.json["data"]["log_file"]).read_text()
    assert f"waiting for {name} to be stopped" in log or "stop: ok" in log
    assert f"waiting for {name} to be 0.5 s active" in log
    # the settle's progress counts up to the settle time (issue 37: "0 s of 122 s")
    assert re.search(r"to be 0.5 s active \(1 of 1; gives up after [\d.]+ s\): [\d.]+ s of 0.5 s", log), log
    assert f"waiting for http://127.0.0.1:{port}/missing to answer 200 (last: " in log
    assert "of 2 s" in log


def test_interactive_run_shows_the_plan_and_asks_first(bed: Bed) -> None:
    """On a terminal, the plan is shown and nothing is stopped without a yes."""
    name = bed.service("ask")
    main = bed.manager.main_pid(name)
    code, out, err = declined_on_a_terminal(bed)
    assert code == 2, out + err
    assert "units that would be stopped" in out and name in out
    assert "stop these units and reinstall? [y/N]" in err
    assert "nothing done (not confirmed)" in out
    assert bed.manager.main_pid(name) == main and bed.version() == "1.0"
    # a declined run finished: the next run takes no stale lock over, nor says the last one died
    again = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")
    assert again.code == 0, again.stdout + again.stderr
    assert not any("stale lock" in note for note in again.json["data"]["notes"]), again.json["data"]["notes"]
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running again")


def test_yes_still_says_what_will_be_lost_before_the_stop(bed: Bed) -> None:
    """Without the prompt (--yes), the plan's warnings (here: a local patch the reinstall replaces) are
    printed before anything stops, and kept in the run's log."""
    name = bed.service("lost")
    serve = bed.site / "sicext" / "serve.py"
    serve.write_text(serve.read_text() + "# a local fix\n")
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5")
    assert result.code == 0, result.stdout + result.stderr
    said = result.stderr.index("was changed locally")
    assert "before the stop:" in result.stderr[:said]
    assert "stop" in result.stdout  # the step lines follow on stdout; the log keeps both, in order
    (log,) = bed.state.glob("*/logs/*.log")
    text = log.read_text()
    assert "was changed locally" in text and text.index("was changed locally") < text.index("stop: ok")
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running again")


def test_a_pure_package_imported_by_a_unit_is_stopped_and_restarted_on_the_new_version(
    bed: Bed, tmp_path: Path
) -> None:
    """Nothing of a pure-Python package stays in /proc once imported: the unit is found because it runs
    the environment's interpreter (``environment`` evidence), stopped, and started again on the new
    version, which it reports. A unit of another environment, whose files uv hardlinked to the same
    cache inodes, is left alone."""
    ours = wheelhouse.make_venv(tmp_path / "ours")
    theirs = wheelhouse.make_venv(tmp_path / "theirs")
    for python in (ours, theirs):
        wheelhouse.uv_install(python, bed.wheels["sipure-1"], link_mode="hardlink")
    assert (wheelhouse.site_packages(ours) / "sipure" / "cli.py").stat().st_ino == (
        wheelhouse.site_packages(theirs) / "sipure" / "cli.py"
    ).stat().st_ino

    def service(python: Path, report: Path) -> tuple[str, int]:
        code = (
            f"import pathlib, sipure, time; pathlib.Path({str(report)!r}).write_text(sipure.VERSION); "
            "time.sleep(600)"
        )
        name = bed.units.started("pure", f'{python} -c "{code}"')
        wait_until(lambda: report.exists(), 15, f"{name} reports its version")
        return name, bed.manager.main_pid(name)

    our_report, their_report = tmp_path / "ours.version", tmp_path / "theirs.version"
    our_unit, our_pid = service(ours, our_report)
    their_unit, their_pid = service(theirs, their_report)
    our_report.unlink()
    result = run(
        "--user",
        "--python",
        str(ours),
        "--yes",
        "sipure",
        "--wheel",
        str(bed.wheels["sipure-2"]),
        "--settle",
        "0.5",
        "--json",
        env=bed.environ(),
    )
    assert result.code == 0, result.stdout + result.stderr
    plan = result.json["data"]["plan"]
    (found,) = plan["processes"]
    assert (found["pid"], found["unit"], found["evidence"], found["strength"]) == (
        our_pid,
        our_unit,
        ["environment"],
        "possible",
    )
    assert [u["name"] for u in plan["units"]] == [our_unit]
    wait_until(lambda: our_report.exists(), 15, "the restarted unit reports its version")
    assert our_report.read_text() == "2.0" and bed.manager.main_pid(our_unit) != our_pid
    assert bed.manager.main_pid(their_unit) == their_pid and their_report.read_text() == "1.0"


def test_the_runs_verification_takes_a_file_two_records_list_as_the_ones_whose_copy_is_there(
    venv: Path, tmp_path: Path
) -> None:
    """siownera requires siownerb and both install ``sishared/core.py``: reinstalled together
    (--with-deps), the one uv writes last owns the file, and the other's verification finds it
    ``shared``, not modified: the run is done, not rolled back."""
    out = tmp_path / "links"
    out.mkdir()
    a = wheelhouse.make_wheel(
        out, "siownera", "1.0", {"sishared/core.py": b"A = 1\n", "siownera.py": b"x = 1\n"}, ("siownerb",)
    )
    b = wheelhouse.make_wheel(out, "siownerb", "1.0", {"sishared/core.py": b"B = 2\n"})
    wheelhouse.uv_install(venv, b)
    wheelhouse.uv_install(venv, a)  # a over b's file
    environ = {
        **os.environ,
        "SAFEINSTALL_STATE_DIR": str(tmp_path / "state"),
        "SAFEINSTALL_NVML_LIBRARY": "/nonexistent/libnvidia-ml.so.1",
    }
    args = ("siownera", "--wheel", str(a), "--python", str(venv), "--with-deps", "--yes", "--json")
    result = run(*args, "--", "--offline", "--find-links", str(out), env=environ, timeout=300)
    assert result.code == 0, result.stdout + result.stderr
    assert result.json["status"] == "done"
    doc = run("--verify-only", "--all", "--python", str(venv), "--json").json
    assert doc["exit_code"] == 0 and [f["kind"] for f in doc["data"]["findings"]] == ["shared"]
