"""Promises of the README that no test held (issue 29): each test here fails on a one-line mutation of
the check it holds (``bench/mutations.py`` applies them). Real parts: the private systemd --user
manager, real wheels and uv, the fake NVML driver, the console script."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from itertools import pairwise
from pathlib import Path
from typing import Any

import pytest

from safeinstall.store.journal import new_journal, start_journal
from safeinstall.store.state import ensure_environment_dir, environment_state
from safeinstall.system.identity import ProcessId
from safeinstall.system.lock import acquire_lock
from tests.bed_nvml import GiB
from tests.bed_systemd import wait_until
from tests.beds import Bed
from tests.clirun import run


def _journal_doc(bed: Bed) -> dict[str, Any] | None:
    for path in bed.state.glob("*/journal.json"):
        try:
            return dict(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return None


# --- --forget ----------------------------------------------------------------------------------------


def test_forget_refuses_an_environment_whose_run_did_not_finish_or_is_running(tmp_path: Path) -> None:
    """The backup of a run that did not finish is what --recover needs: --forget refuses its
    environment (gone or named), and one whose lock a live run holds, and removes nothing of them."""
    root = tmp_path / "state"
    gone_prefix, live_prefix = tmp_path / "gone", tmp_path / "live"
    gone_prefix.mkdir()
    live_prefix.mkdir()
    crashed, running = environment_state(root, gone_prefix), environment_state(root, live_prefix)
    ensure_environment_dir(crashed)
    ensure_environment_dir(running)
    run_id = "20261201T031500Z-4242"
    saved = crashed.backup_dir(run_id) / "files" / "lib" / "x.py"
    saved.parent.mkdir(parents=True)
    saved.write_text("the old version, only here now\n")
    journal = new_journal(
        run_id=run_id,
        process=ProcessId(4242, None),
        python=str(gone_prefix / "bin" / "python"),
        prefix=str(gone_prefix),
        package="sicext",
        wheel=None,
        uv_command=["uv", "pip", "install"],
    )
    start_journal(crashed.dir, journal)
    gone_prefix.rmdir()  # the environment is gone too: the very case --forget is for
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(root)}

    for named in ((), ("--python", str(gone_prefix))):
        refused = run("--forget", *named, "--json", env=environ)
        assert refused.code == 2, refused.stdout + refused.stderr
        assert refused.json["data"]["forgotten"] == []
        (error,) = refused.json["errors"]
        assert "did not finish" in error["message"] and "--recover" in error["hint"]
        assert crashed.journal.is_file() and saved.read_text() == "the old version, only here now\n"
    human = run("--forget", env=environ)
    assert human.code == 2 and "error: not forgetting" in human.stderr and "hint:" in human.stderr
    # --forget --run (issue 44): not the backup of the run that did not finish either
    one = run("--forget", "--python", str(gone_prefix), "--run", run_id, "--json", env=environ)
    assert one.code == 2 and one.json["data"]["forgotten"] == [], one.stdout
    assert (
        "did not finish" in one.json["errors"][0]["message"] and "--recover" in one.json["errors"][0]["hint"]
    )
    assert saved.read_text() == "the old version, only here now\n"

    held = acquire_lock(running.lock, str(live_prefix))  # a run in progress (this process)
    try:
        busy = run("--forget", "--python", str(live_prefix), "--yes", "--json", env=environ)
        kept = running.backup_dir(run_id)
        kept.mkdir(parents=True)
        busy_one = run("--forget", "--python", str(live_prefix), "--run", run_id, "--json", env=environ)
    finally:
        held.release()
    assert busy.code == 2 and busy.json["data"]["forgotten"] == [], busy.stdout
    assert busy_one.code == 2 and busy_one.json["data"]["forgotten"] == [] and kept.is_dir(), busy_one.stdout
    assert running.dir.is_dir() and crashed.dir.is_dir()


# --- the rollback's own check: a restored file that differs from its backup -------------------------


def test_a_restored_file_that_differs_from_its_backup_fails_the_rollback_with_the_commands(
    bed: Bed, tmp_path: Path
) -> None:
    """The backup is hardlinked: its files are the old version's own inodes, which something with the
    old file open could still write. Here the unit's ExecStartPre appends to the backed-up
    ``__init__.py`` when the new (crashing) version starts; the rollback restores it, finds that it is
    not what was saved, and must not claim success: exit 4, the backup and the journal kept, and the
    commands that finish the job printed."""
    tamper = tmp_path / "tamper.sh"
    tamper.write_text(
        f"for f in {shlex.quote(str(bed.state))}/*/backups/*/files/lib/*/site-packages/sicext/__init__.py\n"
        'do [ -f "$f" ] && echo "# changed in the backup" >> "$f"\ndone\nexit 0\n'
    )
    name = bed.service("tampered", ExecStartPre=f"/bin/sh {tamper}")
    result = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-3"]), "--settle", "1", "--json", "--no-smoke"
    )

    assert result.code == 4, result.stdout + result.stderr
    doc = result.json
    assert doc["status"] == "rollback-failed"
    message = doc["errors"][0]["message"]
    assert "restoring the backup" in message and str(bed.site / "sicext" / "__init__.py") in message
    commands = doc["data"]["manual_commands"]
    assert commands[0] == f"safeinstall --recover --python {bed.python}"
    assert f"systemctl --user start {name}" in commands
    assert Path(doc["data"]["backup_dir"]).is_dir() and _journal_doc(bed) is not None
    human = bed.safeinstall("--status")
    assert "recover" in human.stdout + human.stderr


# --- the plan: only active units stop with a planned one --------------------------------------------


@pytest.mark.parametrize("state", ["failed", "inactive"])
def test_a_failed_or_inactive_sidecar_bound_to_the_service_is_not_planned(bed: Bed, state: str) -> None:
    """A stop of the service stops only *active* units that are bound to it: a failed BindsTo= sidecar,
    or one that ran and ended (inactive, not failed, still loaded: the service names it in BoundBy=;
    issue 35), is not planned, gated, stopped nor started (starting a failed one would fail the run)."""
    served = bed.service(f"bound-{state}")
    service = "ExecStart=/bin/false" if state == "failed" else "Type=oneshot\nExecStart=/bin/true"
    sidecar = bed.units.create(
        f"{state}-sidecar", f"[Unit]\nBindsTo={served}\nAfter={served}\n\n[Service]\n{service}\n"
    )
    if state == "failed":
        bed.manager.start(sidecar)
    else:  # an active unit that wants it keeps it loaded once it has ended
        holder = bed.units.create(
            "sidecar-holder", f"[Unit]\nWants={sidecar}\n\n[Service]\nExecStart=/bin/sleep infinity\n"
        )
        bed.manager.start(holder)
    bed.manager.wait_state(sidecar, (state,))
    assert sidecar in bed.manager.show(served, "BoundBy")["BoundBy"].split()
    dry = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--dry-run", "--json")
    assert dry.code == 0, dry.stdout + dry.stderr
    assert [u["name"] for u in dry.json["data"]["units"]] == [served]

    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")

    assert result.code == 0, result.stdout + result.stderr
    assert set(result.json["data"]["downtime_s"]) == {served}
    assert bed.manager.active_state(sidecar) == state and bed.version() == "2.0"


# --- --no-restart -----------------------------------------------------------------------------------


def test_no_restart_leaves_the_units_stopped_and_says_so(bed: Bed) -> None:
    name = bed.service("no-restart")
    main = bed.manager.main_pid(name)

    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--no-restart")

    assert result.code == 0, result.stdout + result.stderr
    assert f"{name} left stopped (--no-restart)" in result.stdout
    assert bed.manager.active_state(name) == "inactive" and not Path(f"/proc/{main}").exists()
    assert bed.version() == "2.0" and bed.verify("--wheel", str(bed.wheels["sicext-2"])).code == 0
    assert _journal_doc(bed) is None and not list(bed.state.glob("*/gate"))
    assert not list(bed.manager.unit_dir.glob(f"{name}.d/*safeinstall*"))
    doc = bed.safeinstall("--status", "--wait", "--json").json  # the run's own document
    assert (doc["status"], doc["exit_code"]) == ("done", 0)
    assert doc["data"]["not_restarted"] == [name]
    restart = next(s for s in doc["data"]["steps"] if s["name"] == "restart")
    assert restart["detail"] == f"left stopped (--no-restart): {name}"


# --- progress on a pipe: a plain line at most every 5 s ---------------------------------------------

_WAITED = re.compile(r"waiting for GPU memory \(.*\): (\d+(?:\.\d)?) s of 11 s")


def _waited(text: str) -> list[float]:
    return [float(m.group(1)) for m in _WAITED.finditer(text)]


def test_progress_on_a_pipe_is_a_plain_line_at_most_every_5_s(bed: Bed) -> None:
    """Off a terminal (stderr a pipe, and the run's log) the GPU wait's progress is a plain line, and
    the seconds waited that consecutive lines report are 5 apart (at least 4 once rounded), not one per
    poll (the wait polls NVML every 0.1 s): the order of the lines, not the test's own clock."""
    name = bed.service("progress")
    main = bed.manager.main_pid(name)
    gpu = bed.nvml.add_gpu("NVIDIA H200", "GPU-00000000-0000-0000-0000-00000000001d", 141 * GiB)
    bed.nvml.hold(main, gpu, 30 * GiB, linger=60)

    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--gpu-timeout", "11")

    assert result.code == 3, result.stdout + result.stderr
    (log,) = bed.state.glob("*/logs/*.log")
    for where, text in (("stderr", result.stderr), ("log", log.read_text())):
        waited = _waited(text)
        assert len(waited) >= 2, f"{where}: {text}"
        gaps = [later - earlier for earlier, later in pairwise(waited)]
        assert min(gaps) >= 4, f"{where}: {waited}"
        assert "\x1b[" not in text  # plain lines, no terminal codes
    wait_until(lambda: bed.manager.active_state(name) == "active", 10, "unit active again")


def test_a_reader_of_the_output_that_goes_away_leaves_the_run_to_finish(bed: Bed) -> None:
    """``safeinstall ... | head -1``: the reader of standard output (and of standard error) closes its end
    at once. The run is not cut short with its unit stopped: it goes on to its end, the unit runs the
    new version and nothing waits for a --recover."""
    name = bed.service("closed-pipe")
    main = bed.manager.main_pid(name)
    read_out, write_out = os.pipe()
    read_err, write_err = os.pipe()
    os.close(read_out)  # gone before the first line
    os.close(read_err)
    try:
        proc = subprocess.Popen(
            bed.args("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0"),
            env=bed.environ(),
            stdout=write_out,
            stderr=write_err,
        )
    finally:
        os.close(write_out)
        os.close(write_err)
    assert proc.wait(timeout=180) == 0
    assert bed.version() == "2.0" and bed.manager.main_pid(name) not in (0, main)
    assert bed.manager.active_state(name) == "active"
    assert bed.journal() is None  # nothing waits for --recover


# --- a detached run's unit, stopped -----------------------------------------------------------------


def test_systemctl_stop_of_a_detached_runs_unit_rolls_it_back(bed: Bed) -> None:
    """``systemctl stop`` of the transient unit of a real detached run, while the new version settles
    (--settle 600): the run rolls back and finishes its rollback before the unit is gone (the old
    version back, the service started again, the journal cleared); --status --wait says so, exit 3."""
    name = bed.service("detached-stop")
    old_main = bed.manager.main_pid(name)
    detached = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "600", "--detach", "--json"
    )
    assert detached.code == 0, detached.stdout + detached.stderr
    run_id, unit = detached.json["data"]["run_id"], detached.json["data"]["unit"]

    def settling() -> bool:  # the new version was started: the run waits out --settle
        doc = _journal_doc(bed)
        main = bed.manager.main_pid(name)
        return doc is not None and doc["phase"] == "restarting" and main not in (0, old_main)

    wait_until(settling, 180, "the detached run to restart the service")
    assert bed.manager.active_state(unit) == "active"
    bed.manager.systemctl("stop", unit, timeout=300)  # returns once the unit is gone

    waited = bed.safeinstall("--status", "--wait", "--run", run_id, "--json")
    assert waited.code == 3, waited.stdout + waited.stderr
    assert waited.json["status"] == "rolled-back" and "SIGTERM" in waited.json["errors"][0]["message"]
    assert _journal_doc(bed) is None and bed.version() == "1.0"
    assert bed.manager.active_state(name) == "active" and bed.manager.main_pid(name) != old_main
