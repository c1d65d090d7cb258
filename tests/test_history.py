"""The history of finished runs: bounded, private, tolerant of damage; --status lists it, --forget
removes the state of environments that are gone (and nothing else)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from safeinstall.run.parts.output import envelope, jsonable
from safeinstall.store import history
from safeinstall.store.rundoc import RunDocument
from safeinstall.store.state import EnvironmentState, ensure_environment_dir, environment_state
from tests.clirun import RUN_FIELDS, run


def env_state(root: Path, prefix: Path) -> EnvironmentState:
    state = environment_state(root, prefix)
    ensure_environment_dir(state)
    return state


def entry(run_id: str, status: str = "done", code: int = 0, processes: int = 0) -> history.HistoryEntry:
    plan = {
        "package": "sicext",
        "distributions": [{"name": "sicext", "old_version": "1.0", "new_version": "2.0", "requested": True}],
        "processes": [{"pid": pid, "cmdline": ["x" * 100]} for pid in range(processes)],
    }
    data = {
        "run_id": run_id,
        "plan": plan,
        "downtime_s": {"app.service": 2.5},
        "log_file": f"/l/{run_id}.log",
    }
    result = envelope("reinstall", status, code, data)
    finished = f"2026-12-01T0{run_id[10]}:{run_id[11:13]}:00+00:00"
    return history.new_entry(run_id, "sicext", finished, finished, RunDocument.from_json(jsonable(result)))


def run_ids(count: int) -> list[str]:
    return [f"20261201T0{n // 60}{n % 60:02d}00Z-{100 + n}" for n in range(count)]


def test_the_history_is_bounded_private_and_newest_first(tmp_path: Path) -> None:
    state = env_state(tmp_path / "state", tmp_path / "venv")
    ids = run_ids(history.MAX_RUNS + 3)
    for run_id in ids:
        assert history.append(state, entry(run_id)) == ()
    files = sorted(p.name for p in state.history.iterdir())
    assert files == [f"{run_id}.json" for run_id in ids[3:]]  # the oldest three are gone
    assert {stat.S_IMODE(os.stat(state.history / f).st_mode) for f in files} == {0o600}
    runs = history.read_history(state).runs
    assert [r.run_id for r in runs] == list(reversed(ids[3:]))
    newest = runs[0]
    assert (newest.status, newest.exit_code, newest.package) == ("done", 0, "sicext")
    assert (newest.old_version, newest.new_version) == ("1.0", "2.0")
    assert newest.downtime_s == {"app.service": 2.5} and newest.log_file == f"/l/{ids[-1]}.log"


def test_an_oversized_result_keeps_its_summary(tmp_path: Path) -> None:
    state = env_state(tmp_path / "state", tmp_path / "venv")
    (run_id,) = run_ids(1)
    big = entry(run_id, processes=20_000)
    assert len(str(big.to_json())) > history.MAX_ENTRY_BYTES
    history.append(state, big)
    path = state.history / f"{run_id}.json"
    assert path.stat().st_size <= history.MAX_ENTRY_BYTES
    kept = history.find(state, run_id)
    assert kept is not None and kept.result.exit_code == 0
    assert "left out of the history" in kept.result.details.notes[-1]
    (summary,) = history.read_history(state).runs
    assert (summary.old_version, summary.new_version, summary.status) == ("1.0", "2.0", "done")


def test_a_damaged_or_foreign_entry_is_skipped_with_a_note(tmp_path: Path) -> None:
    state = env_state(tmp_path / "state", tmp_path / "venv")
    good, damaged, linked, other = run_ids(4)
    history.append(state, entry(good))
    (state.history / f"{damaged}.json").write_text('{"run_id": "')
    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text("{}")
    (state.history / f"{linked}.json").symlink_to(elsewhere)
    history.append(state, entry(other))
    (state.history / f"{other}.json").write_bytes((state.history / f"{good}.json").read_bytes())
    read = history.read_history(state)
    assert [r.run_id for r in read.runs] == [good]
    assert len(read.problems) == 3
    assert any(damaged in p and "damaged" in p for p in read.problems)
    assert any(linked in p for p in read.problems)
    assert any(other in p and f"names run '{good}'" in p for p in read.problems)
    status = run("--status", env={**os.environ, "SAFEINSTALL_STATE_DIR": str(state.root)})
    assert status.code == 0 and "history entry skipped" in status.stdout and good in status.stdout


def test_status_lists_finished_runs_and_gone_environments_and_forget_removes_only_those(
    tmp_path: Path,
) -> None:
    root = tmp_path / "state"
    live_prefix, gone_prefix = tmp_path / "live", tmp_path / "gone"
    live_prefix.mkdir()
    gone_prefix.mkdir()
    live, gone = env_state(root, live_prefix), env_state(root, gone_prefix)
    older, newer = run_ids(2)
    history.append(live, entry(older))
    history.append(live, entry(newer, "rolled-back", 3))
    history.append(gone, entry(older))
    gone_prefix.rmdir()
    outside = tmp_path / "not-state"
    outside.mkdir()
    (root / "planted-link").symlink_to(outside)
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(root)}

    doc = run("--status", "--json", env=environ).json
    by_prefix = {e["prefix"]: e for e in doc["data"]["environments"]}
    assert by_prefix[str(live_prefix)]["prefix_exists"] is True
    assert by_prefix[str(gone_prefix)]["prefix_exists"] is False
    runs = by_prefix[str(live_prefix)]["runs"]
    assert [r["run_id"] for r in runs] == [newer, older]  # newest first
    assert all(set(r) == RUN_FIELDS for r in runs)
    assert (runs[0]["status"], runs[0]["exit_code"], runs[0]["new_version"]) == ("rolled-back", 3, "2.0")
    human = run("--status", env=environ)
    assert "environment gone" in human.stdout and newer in human.stdout and "rolled-back" in human.stdout
    (live.log_file(newer)).write_text("[t] backup: ok in 0.1 s: saved\n")
    waited = run("--status", "--wait", "--run", newer, env=environ)  # finished: its log, its result, its code
    assert waited.code == 3 and "backup: ok" in waited.stderr
    assert f"run {newer}: rolled-back (exit 3); sicext 1.0 -> 2.0" in waited.stdout
    latest = run("--status", "--wait", "--python", str(tmp_path / "gone" / "bin" / "python"), env=environ)
    assert latest.code == 2 and "error:" in latest.stderr  # no interpreter there any more
    unknown = run("--status", "--wait", "--run", "20991231T000000Z-1", "--json", env=environ)
    assert unknown.code == 2 and "no run 20991231T000000Z-1" in unknown.json["errors"][0]["message"]

    forgotten = run("--forget", "--json", env=environ)
    assert forgotten.code == 0, forgotten.stdout + forgotten.stderr
    assert forgotten.json["data"]["forgotten"] == [
        {"prefix": str(gone_prefix), "state_dir": str(gone.dir), "run_id": None}
    ]
    assert not gone.dir.exists() and live.dir.is_dir() and outside.is_dir()
    # --forget --run drops one kept backup: only a run id, only one that is there (issue 44)
    bad = run("--forget", "--python", str(live_prefix), "--run", "../..", env=environ)
    assert bad.code == 2 and "is not a run id" in bad.stderr, bad.stderr
    missing = run("--forget", "--python", str(live_prefix), "--run", older, env=environ)
    assert missing.code == 2 and f"keeps no backup of run {older}" in missing.stderr, missing.stderr
    assert "nothing to forget" not in bad.stdout + missing.stdout  # the error says why, nothing else
    assert live.dir.is_dir() and outside.is_dir()
    assert run("--forget", env=environ).stdout.startswith("nothing to forget")
    unknown = run("--forget", "--python", str(tmp_path / "never"), env=environ)
    assert unknown.code == 2 and "error: no safeinstall state for" in unknown.stderr
    # explicitly named, still there: its backups are the way back of --undo, forgotten only with --yes
    kept = run("--forget", "--python", str(live_prefix), env=environ)
    assert kept.code == 2 and "the environment is still there" in kept.stderr and live.dir.is_dir(), (
        kept.stderr
    )
    assert "add --yes" in kept.stderr and f"--forget --python {live_prefix} --run RUN_ID" in kept.stderr
    named = run("--forget", "--python", str(live_prefix), "--yes", "--json", env=environ)
    assert named.code == 0 and not live.dir.exists() and outside.is_dir()


def test_status_says_how_many_runs_it_leaves_out_and_recover_says_when_there_was_nothing(
    tmp_path: Path,
) -> None:
    root = tmp_path / "state"
    prefix = tmp_path / "venv"
    prefix.mkdir()
    state = env_state(root, prefix)
    ids = run_ids(8)
    for run_id in ids:
        history.append(state, entry(run_id))
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(root)}
    human = run("--status", env=environ)
    assert "last runs (5 of 8; -v lists all" in human.stdout and ids[0] not in human.stdout
    assert all(line == line.rstrip() for line in human.stdout.splitlines())  # no padding on a pipe
    verbose = run("--status", "-v", env=environ)
    assert all(run_id in verbose.stdout for run_id in ids) and "of 8" not in verbose.stdout
    nothing = run("--recover", "--json", env=environ)
    assert nothing.code == 0 and nothing.json["status"] == "nothing-to-recover", nothing.stdout


def test_ctrl_c_while_following_a_run_says_the_run_goes_on(tmp_path: Path) -> None:
    import signal
    import subprocess

    from safeinstall.system.lock import acquire_lock
    from tests.clirun import SAFEINSTALL

    prefix = tmp_path / "venv"
    prefix.mkdir()
    state = env_state(tmp_path / "state", prefix)
    (run_id,) = run_ids(1)
    state.log_file(run_id).parent.mkdir(parents=True, exist_ok=True)
    state.log_file(run_id).write_text("[t] backup: ok in 0.1 s: saved\n")
    lock = acquire_lock(state.lock, str(prefix))  # a run in progress: this test process
    try:
        proc = subprocess.Popen(
            [SAFEINSTALL, "--status", "--wait", "--run", run_id],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**os.environ, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state")},
            text=True,
        )
        assert proc.stderr is not None
        assert "backup: ok" in proc.stderr.readline()  # it follows the run: in its loop now
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        lock.release()
    assert proc.returncode == 130, out + err
    assert "the run goes on" in err and f"--status --wait --run {run_id}" in err and "Traceback" not in err


def test_a_run_document_is_typed_and_written_back_byte_for_byte() -> None:
    """The one typed run document (issue 37): a run's, a recovered run's and a failed run's ``--json``
    documents read into :class:`RunDocument` and written back are the very same JSON; a field of the
    wrong type is no run's document (a history entry with one is skipped as damaged)."""
    import json

    from safeinstall.errors import ExitCode, StepFailed
    from safeinstall.run.parts.options import RunOptions
    from safeinstall.run.steps.reinstall import run_document
    from safeinstall.store.rundoc import RunData, StepDoc

    steps = (
        StepDoc(name="backup", status="ok", seconds=1.5, detail="12 files"),
        StepDoc(name="stop", status="ok", seconds=2),
    )
    data = RunData(
        steps=steps,
        downtime_s={"app.service": 2},
        patched=("a.py",),
        backup_dir="/b",
        log_file="/l",
        strays_killed=(42,),
        notes=("a note",),
        backups_removed=("/old",),
        deleted=("a.py",),
        service_downtime_s=3.5,
    )
    ran = run_document(RunOptions(package="x", run_id="r", undo="q"), "done", ExitCode.OK, data).to_json()
    recovered = jsonable(
        envelope(
            "reinstall",
            "recovered",
            3,
            {
                "prefix": "/v",
                "run_id": "r",
                "phase": "stopped",
                "restored": True,
                "started": ["a.service"],
                "gates_removed": [],
                "notes": ["n"],
                "log_file": "/l",
                "old_version": "1",
                "new_version": "2",
                "added_later": {"x": 1},
            },
            [StepFailed("died", hint="run it again")],
        )
    )
    failed = jsonable(envelope("reinstall", "error", 2, None, [StepFailed("refused", hint="h")]))
    for raw in (ran, recovered, failed, entry("20261201T000000Z-1").result.to_json()):
        document = RunDocument.from_json(raw)
        assert json.dumps(document.to_json()) == json.dumps(raw)
    typed = RunDocument.from_json(ran)
    assert (
        typed.details.steps[0].seconds == 1.5
        and typed.details.undo_of == "q"
        and typed.details.strays_killed == (42,)
    )
    # the fields the other branches added (docs/json.md): typed, and back in the run's order
    assert typed.details.deleted == ("a.py",) and typed.details.service_downtime_s == 3.5
    assert list(typed.to_json()["data"]).index("deleted") == list(ran["data"]).index("deleted")
    without = jsonable(envelope("reinstall", "done", 0, {"run_id": "r", "service_downtime_s": None}))
    assert RunDocument.from_json(without).details.service_downtime_s is None
    assert RunDocument.from_json(recovered).details.versions(None) == ("1", "2")
    with pytest.raises(ValueError, match="downtime_s"):
        RunDocument.from_json({**ran, "data": {"downtime_s": {"app.service": "soon"}}})
    with pytest.raises(ValueError, match="service_downtime_s"):
        RunDocument.from_json({**ran, "data": {"service_downtime_s": "soon"}})
    with pytest.raises(ValueError, match="deleted"):
        RunDocument.from_json({**ran, "data": {"deleted": [1]}})


def test_an_entry_another_user_may_write_is_not_believed(tmp_path: Path) -> None:
    """The history is read by the one checked reader of what safeinstall wrote for itself
    (``safefs.read_trusted``, issue 37): an entry that others may write is skipped as the journal and
    the baseline would be refused, not listed as a finished run."""
    state = env_state(tmp_path / "state", tmp_path / "venv")
    good, writable = run_ids(2)
    history.append(state, entry(good))
    history.append(state, entry(writable))
    (state.history / f"{writable}.json").chmod(0o666)
    read = history.read_history(state)
    assert [r.run_id for r in read.runs] == [good]
    (problem,) = read.problems
    assert writable in problem and "it is mode 0666: every user may write to it" in problem


def test_commit_or_discard_with_nothing_prepared_says_which_and_what_to_do(tmp_path: Path) -> None:
    """No prepared run: ``--commit`` says to prepare one, ``--discard`` that there is nothing to drop
    (not "to take", not "prepare one first": discarding wants none)."""
    root = tmp_path / "state"
    env_state(root, tmp_path / "venv")
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(root)}
    discard = run("--discard", "--json", env=environ)
    (error,) = discard.json["errors"]
    assert discard.code == 2 and error["code"] == "prepared-run", discard.stdout
    assert error["message"] == "no prepared run to discard" and "nothing to drop" in error["hint"], error
    commit = run("--commit", "--json", env=environ)
    (error,) = commit.json["errors"]
    assert commit.code == 2 and error["message"] == "no prepared run to commit", commit.stdout
    assert "prepare one first" in error["hint"], error
