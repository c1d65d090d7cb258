"""``--detach`` and ``--status --wait``: a run that outlives its caller's SSH session, followed to its
end from another command. Real parts: the private systemd --user manager runs the detached run as a
transient unit; real wheels, real uv, the fake NVML driver."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
from pathlib import Path
from typing import Any

from tests.bed_systemd import wait_until
from tests.beds import Bed, declined_on_a_terminal, maps_so
from tests.clirun import RUN_FIELDS, SAFEINSTALL


def _document(path: Path) -> dict[str, Any] | None:
    try:
        return dict(json.loads(path.read_text()))
    except (OSError, ValueError):
        return None


def _as_in_a_login_session() -> None:
    """SIGHUP and SIGINT at their default, as in an SSH session: a suite started under ``nohup`` or as a
    background job (``&``) passes them on ignored, and the session would then outlive its SIGHUP."""
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def test_a_detached_run_survives_its_callers_session_and_wait_returns_its_result(
    bed: Bed, tmp_path: Path
) -> None:
    """As over SSH: the caller's whole session gets SIGHUP once --detach has returned, while the run is
    still going (it waits --settle 3 s after the restart). The run finishes anyway, and --status --wait
    from another command shows its log and ends with its exit code and its own result."""
    name = bed.service("detached")
    old_main = bed.manager.main_pid(name)
    out = tmp_path / "detach.json"
    args = [
        SAFEINSTALL,
        "--user",
        "--python",
        str(bed.python),
        "sicext",
        "--wheel",
        str(bed.wheels["sicext-2"]),
    ]
    args += ["--settle", "3", "--detach", "--json", "--yes"]  # no terminal: --yes, as apt
    session = subprocess.Popen(
        ["/bin/sh", "-c", f"{shlex.join(args)} >{shlex.quote(str(out))}; exec sleep 600"],
        env=bed.environ(),
        stdin=subprocess.DEVNULL,
        start_new_session=True,
        preexec_fn=_as_in_a_login_session,
    )
    try:
        wait_until(
            lambda: _document(out) is not None or session.poll() is not None, 120, "--detach to return"
        )
        os.killpg(session.pid, signal.SIGHUP)  # the SSH session is gone: every process of it
        assert session.wait(timeout=60) == -signal.SIGHUP
    finally:
        if session.poll() is None:
            os.killpg(session.pid, signal.SIGKILL)
            session.wait()
    detached = _document(out)
    assert detached is not None, "--detach printed nothing"
    assert (detached["command"], detached["status"], detached["exit_code"]) == ("reinstall", "detached", 0)
    run_id, unit = detached["data"]["run_id"], detached["data"]["unit"]
    assert unit.startswith("safeinstall-") and unit.endswith(f"-{run_id}.service")

    waited = bed.safeinstall("--status", "--wait", "--run", run_id, "--json", timeout=240)

    assert waited.code == 0, waited.stdout + waited.stderr
    doc = waited.json
    assert (doc["command"], doc["status"], doc["exit_code"]) == ("reinstall", "done", 0)
    assert doc["data"]["run_id"] == run_id and name in doc["data"]["downtime_s"]
    assert "restart: ok" in waited.stderr and "result: done (exit 0)" in waited.stderr  # its log
    assert bed.version() == "2.0"
    new_main = bed.manager.main_pid(name)
    assert new_main != old_main and maps_so(new_main) == bed.so.stat().st_ino
    again = bed.safeinstall("--status", "--wait", "--run", run_id, "--json")  # finished: at once
    assert again.code == 0 and again.json == doc


def test_a_detached_run_whose_new_version_crashes_rolls_back_and_the_history_says_so(bed: Bed) -> None:
    name = bed.service("detached-crash")
    detached = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-3"]), "--settle", "1", "--detach", "--no-smoke"
    )
    assert detached.code == 0, detached.stdout + detached.stderr
    assert "detached: run " in detached.stdout and "safeinstall --status --wait --run" in detached.stdout

    waited = bed.safeinstall("--status", "--wait", "--json", timeout=240)  # the run in progress

    assert waited.code == 3, waited.stdout + waited.stderr
    assert waited.json["status"] == "rolled-back" and name in waited.json["errors"][0]["message"]
    run_id = waited.json["data"]["run_id"]
    wait_until(lambda: bed.manager.active_state(name) == "active", 10, "unit active again")
    assert bed.version() == "1.0"
    (environment,) = bed.safeinstall("--status", "--json").json["data"]["environments"]
    (run,) = environment["runs"]
    assert set(run) == RUN_FIELDS
    assert (run["run_id"], run["status"], run["exit_code"], run["package"]) == (
        run_id,
        "rolled-back",
        3,
        "sicext",
    )
    assert (run["old_version"], run["new_version"]) == ("1.0", "3.0")
    assert run["started_at"] <= run["finished_at"] and Path(run["log_file"]).is_file()
    human = bed.safeinstall("--status")
    assert run_id in human.stdout and "rolled-back" in human.stdout


def test_a_detached_run_refused_in_its_preflight_fails_at_once(bed: Bed) -> None:
    name = bed.service("detached-refused")
    main = bed.manager.main_pid(name)
    refused = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sipure-2"]), "--detach", "--json")
    assert refused.code == 2, refused.stdout + refused.stderr
    assert (
        refused.json["status"] == "error"
        and "is for sipure, not sicext" in refused.json["errors"][0]["message"]
    )
    assert bed.manager.main_pid(name) == main and bed.version() == "1.0"
    (environment,) = bed.safeinstall("--status", "--json").json["data"]["environments"]
    assert [(r["status"], r["exit_code"]) for r in environment["runs"]] == [("error", 2)]


def test_the_detach_prompt_shows_what_the_foreground_prompt_shows(bed: Bed) -> None:
    """On a terminal, --detach shows the run's own plan before asking: the local patch the reinstall
    replaces included (it showed a plan without the preflight's warnings)."""
    name = bed.service("detach-ask")
    main = bed.manager.main_pid(name)
    serve = bed.site / "sicext" / "serve.py"
    serve.write_text(serve.read_text() + "# a local fix\n")
    code, out, err = declined_on_a_terminal(bed, "--detach")
    assert code == 2, out + err
    assert "was changed locally" in out + err and "[y/N]" in err
    assert "nothing done (not confirmed)" in out
    assert bed.manager.main_pid(name) == main and bed.version() == "1.0"
