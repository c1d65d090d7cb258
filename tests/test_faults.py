"""Faults at the worst moments (issue 22): a signal or a kill at each point of a run ends with the units
running, on the old or the new version, and nothing left that blocks the next run.

Each test reproduces one row of the issue's table against the real parts (a private ``systemd --user``
with real units, real wheels installed by the real uv); moments are found from the outside, by reading
the run's journal or ``/proc``, never by test-only hooks. The randomized soak is in ``test_soak.py``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests import wheelhouse
from tests.bed_nvml import FakeNvml
from tests.bed_systemd import UserManager, wait_until
from tests.beds import Bed
from tests.wheelhouse import Wheelhouse

#: a unit whose start takes a second before its main process runs: a window to kill the run in while
#: its restart is under way, before the crash of a broken new version can be seen
SLOW_START_UNIT = (
    "[Unit]\nDescription=safeinstall fault test\n\n[Service]\nExecStartPre=/bin/sleep 1\nExecStart={exec}\n"
)


def _finish(proc: subprocess.Popen[str]) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()


def test_recover_of_a_run_killed_while_a_broken_version_restarts_puts_the_old_one_back(bed: Bed) -> None:
    """SIGKILL in phase ``restarting`` (the broken new version verified and starting, its crash not yet
    seen), then ``--recover`` (what runs at boot after an OOM kill): the unit does not come up on the new
    version, so the previous installation is put back and started, exactly as the live run would have
    (exit 3), and nothing is left that blocks the next run."""
    before = bed.hotfix()
    name = bed.unit("broken-restart", text=SLOW_START_UNIT)
    proc = bed.start_run("sicext", "--wheel", str(bed.wheels["sicext-3"]), "--settle", "1", "--no-smoke")
    try:
        bed.wait_phase(proc, "restarting")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.communicate()
    journal = bed.journal()
    assert journal is not None and journal["phase"] == "restarting", journal
    run_id = journal["run_id"]

    recovered = bed.cli("--recover", "--json")

    assert recovered.code == 3, recovered.stdout + recovered.stderr
    assert recovered.json["status"] == "rolled-back"
    (recovery,) = recovered.json["data"]["recoveries"]
    assert (recovery["run_id"], recovery["phase"], recovery["restored"]) == (run_id, "restarting", True)
    assert any("did not come up" in note for note in recovery["notes"]), recovery
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "the unit running on the old version")
    assert bed.version() == "1.0" and bed.snapshot() == before  # old bytes, the local patch included
    bed.no_trace()
    waited = bed.cli("--status", "--wait", "--run", run_id, "--json")
    assert waited.code == 3 and waited.json["status"] == "recovered", waited.stdout + waited.stderr
    assert "did not come up" in waited.json["errors"][0]["message"]
    (listed,) = bed.cli("--status", "--json").json["data"]["environments"][0]["runs"]
    assert (listed["run_id"], listed["old_version"], listed["new_version"]) == (run_id, "1.0", "3.0"), listed
    again = bed.cli("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--yes")
    assert again.code == 0, again.stdout + again.stderr  # the next run is not refused
    assert bed.version() == "2.0"


def _catches(pid: int, signum: int) -> bool:
    """``pid`` has a handler for ``signum`` (``SigCgt`` in /proc/PID/status): Python code installed it."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(mask & (1 << (signum - 1)))


def _wheel_copies(bed: Bed) -> list[Path]:
    return list(bed.state.glob("*/wheels/*/*.whl"))


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
@pytest.mark.parametrize("moment", ["loading", "preflight"])
def test_a_signal_before_the_journal_is_exit_2_with_an_error_line(
    bed: Bed, moment: str, signum: signal.Signals
) -> None:
    """SIGTERM or SIGINT in the first instants of a run, while the CLI loads (the handlers are installed
    before anything slow is imported) or during the preflight (the wheel copied, no journal yet):
    nothing was changed, so exit 2 with an ``error:`` and a ``hint:`` line; not a death by SIGTERM, a
    silent 130 or a traceback."""
    name = bed.unit(f"early-{moment}")
    main = bed.manager.main_pid(name)
    proc = bed.start_run("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5")
    try:
        wait_until(lambda: _catches(proc.pid, signal.SIGTERM), 30, "the handlers installed", interval=0.001)
        if moment == "preflight":
            wait_until(lambda: bool(_wheel_copies(bed)), 30, "the wheel copied", interval=0.001)
        assert bed.journal() is None  # nothing journalled, nothing changed yet
        proc.send_signal(signum)
    finally:
        out, err = _finish(proc)
    assert proc.returncode == 2, (proc.returncode, out, err)
    assert f"error: interrupted by {signum.name}" in err and "hint:" in err and "Traceback" not in err, err
    assert bed.manager.main_pid(name) == main and bed.version() == "1.0"
    bed.no_trace()


def test_a_signal_while_the_cli_loads_still_prints_the_json_document(tmp_path: Path) -> None:
    """With ``--json`` every command prints one JSON document, also when a signal arrives while the
    CLI loads (the second review found nothing on stdout then)."""
    from tests.clirun import SAFEINSTALL

    proc = subprocess.Popen(
        [SAFEINSTALL, "--verify-only", "--all", "--python", sys.executable, "--json"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state")},
    )
    try:
        wait_until(lambda: _catches(proc.pid, signal.SIGTERM), 30, "the handlers installed", interval=0.0005)
        proc.send_signal(signal.SIGINT)
    finally:
        out, err = _finish(proc)
    if proc.returncode != 2:  # it finished before the signal came: nothing to see
        pytest.skip(f"the command ended first (exit {proc.returncode})")
    document = json.loads(out)
    assert document["command"] == "verify" and document["exit_code"] == 2, out
    assert "interrupted by SIGINT" in document["errors"][0]["message"] and "Traceback" not in err


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_while_a_good_run_tidies_up_lets_it_finish(bed: Bed, signum: signal.Signals) -> None:
    """SIGINT or SIGTERM in phase ``done`` (the new version verified and settled, the run removing its
    gate drop-ins and journal): the tidy-up is short and finishes, the run keeps its result (exit 0),
    and nothing is left that blocks the next run."""
    name = bed.unit("tidy")
    proc = bed.start_run("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")
    try:
        bed.wait_phase(proc, "done", timeout=120)
        proc.send_signal(signum)
    finally:
        out, err = _finish(proc)
    assert proc.returncode == 0, (proc.returncode, out, err)
    assert json.loads(out)["status"] == "done"
    assert f"{signum.name} received while the run tidies up" in err
    assert bed.manager.active_state(name) == "active" and bed.version() == "2.0"
    bed.no_trace()
    status = bed.cli("--status", "--json").json
    assert status["status"] == "idle", status
    again = bed.cli("sicext", "--wheel", str(bed.wheels["sicext-1"]), "--settle", "0.5", "--yes")
    assert again.code == 0, again.stdout + again.stderr


#: a unit that systemd refuses to stop by hand: ``systemctl stop`` fails at once and the unit runs on
REFUSED_STOP_UNIT = (
    "[Unit]\nDescription=safeinstall fault test\nRefuseManualStop=yes\n\n"
    "[Service]\nExecStart={exec}\nTimeoutStopSec=600\n"
)


def test_a_stop_that_does_not_happen_is_said_at_once_and_costs_no_downtime(bed: Bed) -> None:
    """A stop that systemd does not carry out (here refused; in the issue, ``systemctl stop`` killed by a
    terminal's Ctrl-C before it asked) is not waited out for the unit's TimeoutStopSec (600 s here: the
    test's 120 s would run out), and no downtime is reported for a unit that never went down."""
    name = bed.unit("no-stop", text=REFUSED_STOP_UNIT)
    main = bed.manager.main_pid(name)
    proc = bed.start_run("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")
    out, err = _finish(proc)
    assert proc.returncode == 3, (proc.returncode, out, err)
    doc = json.loads(out)
    message = doc["errors"][0]["message"]
    assert f"unit {name} did not stop (the stop was not carried out" in message, message
    assert "nothing was installed" in message
    assert doc["data"]["downtime_s"] == {}, doc["data"]["downtime_s"]
    assert bed.manager.main_pid(name) == main and bed.version() == "1.0"
    bed.no_trace()


def test_downtime_is_what_systemd_reports(bed: Bed) -> None:
    """The downtime of a restarted unit runs from when systemd began to stop it (it left active) to its
    return to active, as systemd's own timestamps say; not from when safeinstall asked for the stop,
    nor from when it saw the unit stopped."""
    name = bed.unit("downtime", enable=True)  # enabled: loaded while stopped, systemd keeps its timestamps
    proc = bed.start_run("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")
    out, err = _finish(proc)
    assert proc.returncode == 0, (proc.returncode, out, err)
    (seconds,) = json.loads(out)["data"]["downtime_s"].values()
    shown = bed.manager.show(
        name,
        "ActiveExitTimestampMonotonic",
        "InactiveEnterTimestampMonotonic",
        "ActiveEnterTimestampMonotonic",
    )
    stop_began, inactive, active = (
        int(shown[key])
        for key in (
            "ActiveExitTimestampMonotonic",
            "InactiveEnterTimestampMonotonic",
            "ActiveEnterTimestampMonotonic",
        )
    )
    assert 0 < stop_began <= inactive < active, shown
    assert round(seconds * 1e6) == active - stop_began, (seconds, shown)


def test_the_wheel_copy_of_a_run_killed_before_its_journal_goes_with_the_next_run(bed: Bed) -> None:
    """A run killed between copying the wheel into the state directory and writing its journal leaves
    nothing to recover; its copy is removed by the next run (it piled up, one per killed run)."""
    name = bed.unit("copy-leak")
    proc = bed.start_run("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5")
    try:
        wait_until(lambda: bool(_wheel_copies(bed)), 60, "the wheel copied", interval=0.001)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.communicate()
    assert _wheel_copies(bed) and bed.journal() is None
    done = bed.cli("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--yes")
    assert done.code == 0, done.stdout + done.stderr
    assert not list(bed.state.glob("*/wheels/*")), list(bed.state.glob("*/wheels/*"))
    assert bed.manager.active_state(name) == "active" and bed.version() == "2.0"


def test_backups_of_rolled_back_runs_fall_under_keep_backups(bed: Bed) -> None:
    """Every rolled-back run kept its backup until the next good run (3 -> 15 in the issue's soak):
    a run that put everything back counts under --keep-backups as a good one does."""
    name = bed.unit("backups")
    for _ in range(2):
        result = bed.cli(
            "sicext",
            "--wheel",
            str(bed.wheels["sicext-3"]),
            "--no-smoke",
            "--settle",
            "0.5",
            "--keep-backups",
            "1",
            "--yes",
        )
        assert result.code == 3, result.stdout + result.stderr
    backups = list(bed.state.glob("*/backups/*"))
    assert len(backups) == 1, backups
    assert bed.manager.active_state(name) == "active" and bed.version() == "1.0"
    bed.no_trace()


def _with_blob(wheel: Path, out: Path, mib: int) -> Path:
    """A copy of ``wheel`` with a random file of ``mib`` MiB (RECORD rewritten to match)."""
    return wheelhouse.rebuilt(wheel, out, {"sicext/blob.bin": os.urandom(mib << 20)}, deflate=False)


def test_room_messages_say_what_they_mean() -> None:
    """A room check that fails by less than 0.1 MiB said 'needs 0.1 MiB but has 0.1 MiB free'."""
    from safeinstall.store.backup import space_problem

    problem = space_problem(150_000, 60_000, Path("/srv"))
    assert problem is not None and "needs 146.5 KiB but /srv has 58.6 KiB free" in problem, problem


def test_the_room_check_counts_what_the_uninstall_frees(
    wheels: Wheelhouse, tmp_path: Path, user_manager: UserManager, fake_nvml: FakeNvml
) -> None:
    """The environment's disk holds the old version (96 MiB) and 60 MiB more: the new version (96 MiB)
    fits once uv's uninstall has freed the old files (the backup copies them to the state directory,
    on another disk). It was refused at preflight ("needs 96 MiB"), though the run goes through."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    disk = tmp_path / "disk"
    disk.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=176m", "tmpfs", str(disk)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs: {mounted.stderr!r}")
    bed: Bed | None = None
    try:
        old = _with_blob(wheels["sicext-1"], tmp_path / "old", 96)
        new = _with_blob(wheels["sicext-2"], tmp_path / "new", 96)
        python = wheelhouse.make_venv(disk / "venv")
        wheelhouse.uv_install(python, old)
        bed = Bed(python, tmp_path / "state", user_manager, fake_nvml, wheels)
        name = bed.unit("room")
        free = os.statvfs(disk).f_bavail * os.statvfs(disk).f_frsize
        assert 32 << 20 < free < 96 << 20, free  # the new version does not fit beside the old one
        result = bed.cli("sicext", "--wheel", str(new), "--settle", "0.5", "--yes")
        assert result.code == 0, result.stdout + result.stderr
        assert bed.version() == "2.0" and bed.manager.active_state(name) == "active"
        bed.no_trace()
    finally:
        if bed is not None:
            bed.cleanup()
        subprocess.run(["umount", "--lazy", str(disk)], check=False)


def test_recover_after_a_run_that_ended_with_exit_4_does_not_say_it_died(bed: Bed) -> None:
    """A run whose put-back failed (its backup out of reach: moved away during the downtime, back
    afterwards) ended with a result (exit 4); ``--recover`` then finishes it. Its log and history say
    so: not that the run "died without a result", under ``error:``."""
    name = bed.unit("exit4")
    bed.hold_gpu(name, 3.0, "f4")  # a downtime to move the backup away in
    proc = bed.start_run(
        "sicext", "--wheel", str(bed.wheels["sicext-3"]), "--settle", "0.5", "--json", "--no-smoke"
    )
    try:
        bed.wait_phase(proc, "stopped")
        journal = bed.journal()
        assert journal is not None and journal["backup_dir"]
        backup = Path(journal["backup_dir"])
        hidden = backup.with_name(backup.name + ".away")
        backup.rename(hidden)
    finally:
        out, err = _finish(proc)
    assert proc.returncode == 4, (proc.returncode, out, err)
    run_id = json.loads(out)["data"]["run_id"]
    hidden.rename(backup)
    recovered = bed.cli("--recover")
    assert recovered.code == 0, recovered.stdout + recovered.stderr
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "the unit running on the old version")
    assert bed.version() == "1.0"
    log = next(bed.state.glob(f"*/logs/{run_id}.log")).read_text()
    assert "without a result" not in log and "recover: error:" not in log, log
    assert f"the run {run_id} ended in phase rolling-back with exit 4" in log, log
    bed.no_trace()


def test_children_run_in_a_session_of_their_own() -> None:
    """A terminal's Ctrl-C goes to its foreground process group: a child in safeinstall's (a
    ``systemctl stop`` half-way) died of it, the stop not asked, and the run then waited it out."""
    from safeinstall.system import children

    done = children.run(["/bin/sh", "-c", "cat /proc/$$/stat"], env={"PATH": "/usr/bin:/bin"}, timeout=30)
    fields = done.stdout.rsplit(")", 1)[1].split()
    pid, pgrp, session = int(done.stdout.split()[0]), int(fields[2]), int(fields[3])
    assert pgrp == pid and session == pid, done.stdout
    assert session != os.getsid(0)
