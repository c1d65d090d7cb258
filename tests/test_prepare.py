"""Prepare ahead, commit in the window (issue 47, docs/prepare.md): sicext 1.0 -> 2.0 under a unit of the
private user manager, ``--prepare`` then ``--commit`` (or ``--discard``, ``--recover``)."""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest

from tests import wheelhouse
from tests.bed_systemd import wait_until
from tests.beds import Bed
from tests.clirun import run


def _prepared(bed: Bed, *extra: str) -> dict[str, object]:
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--prepare", "--json", *extra)
    assert result.code == 0, result.stdout + result.stderr
    doc = dict(result.json)
    assert doc["status"] == "prepared", doc
    return doc


def _untouched(bed: Bed, name: str, main: int) -> None:
    assert bed.manager.active_state(name) == "active"
    assert bed.manager.main_pid(name) == main
    assert bed.version() == "1.0"


def _nothing_left(bed: Bed) -> None:
    bed.no_trace()
    assert not list(bed.python.parent.parent.glob(".safeinstall-*"))
    assert not list(bed.state.glob("*/prepared.json"))
    assert not list(bed.state.glob("*/wheels/*/*.whl"))


def test_prepare_then_commit(bed: Bed) -> None:
    name = bed.service("prep-commit")
    main = bed.manager.main_pid(name)
    doc = _prepared(bed)
    # everything up to the smoke check ran; nothing stopped, nothing changed in place
    steps = [s["name"] for s in doc["data"]["steps"]]  # type: ignore[index]
    assert steps[:4] == ["preflight", "backup", "prefetch", "smoke"] and "stop" not in steps, steps
    assert doc["data"]["plan"]["units"][0]["name"] == name  # type: ignore[index]
    _untouched(bed, name, main)
    journal = bed.journal()
    assert journal is not None and journal["phase"] == "prepared"
    status = bed.cli("--status", "--json").json
    assert status["status"] == "prepared", status
    (env,) = status["data"]["environments"]
    assert env["needs_recovery"] is False
    assert env["prepared"]["changes"] == ["sicext 1.0 -> 2.0"] and env["prepared"]["units"] == [name]
    assert env["prepared"]["age_s"] >= 0
    shown = bed.cli("--status")
    assert "prepared" in shown.stdout and "--commit" in shown.stdout, shown.stdout
    # a plain run waits for it: nothing else runs there
    other = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--json")
    assert other.code == 2 and "prepared run" in other.stdout, other.stdout
    # and their dry runs say the same refusal (a new-user review: they said would-proceed, exit 0)
    dry = bed.cli("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--dry-run", "--json")
    assert dry.code == 2 and dry.json["errors"] == other.json["errors"], dry.stdout
    _untouched(bed, name, main)

    committed = bed.safeinstall("--commit", "--settle", "0.5", "--json")
    assert committed.code == 0, committed.stdout + committed.stderr
    assert committed.json["status"] == "done"
    steps = [s["name"] for s in committed.json["data"]["steps"]]
    assert "backup" not in steps and "prefetch" not in steps and "stop" in steps and "install" in steps, steps
    # the commit's preflight took the prepare's plan, wheel and hashes: nothing was read again
    assert steps[0] == "preflight" and "taken again" in committed.json["data"]["steps"][0]["detail"]
    # the commit's whole wall time (issue 47 item 4): its preflight and every step within it
    data = committed.json["data"]
    assert data["wall_s"] >= sum(s["seconds"] for s in data["steps"]) > 0
    assert bed.version() == "2.0"
    check = bed.verify("--wheel", str(bed.wheels["sicext-2"]))
    assert check.code == 0, check.stdout
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running")
    assert bed.manager.main_pid(name) != main
    # the commit ends with its checks: the old version's staging directory and the run's uv cache are
    # left to the next run (or --recover), which removes them under the lock
    assert list(bed.python.parent.parent.glob(".safeinstall-swap-*")), "left to the next run"
    assert list(bed.state.glob("*/uv-cache-*")), "left to the next run"
    assert bed.journal() is None
    assert bed.cli("--recover").code == 0
    _nothing_left(bed)
    none = bed.safeinstall("--commit", "--json")
    assert none.code == 2 and "no prepared run" in none.stdout, none.stdout


def test_a_file_changed_since_the_prepare_refuses_the_commit(bed: Bed) -> None:
    name = bed.service("prep-changed")
    main = bed.manager.main_pid(name)
    _prepared(bed)
    target = bed.site / "sicext" / "serve.py"
    target.write_text(target.read_text() + "# changed after the prepare\n")
    refused = bed.safeinstall("--commit", "--settle", "0.5", "--json")
    assert refused.code == 2, refused.stdout + refused.stderr
    (error,) = refused.json["errors"]
    assert error["code"] == "prepared-run" and "changed since the prepare" in error["message"], error
    assert "serve.py" in error["message"] and "prepare again" in error["hint"], error
    assert bed.manager.main_pid(name) == main and bed.manager.active_state(name) == "active"
    assert bed.journal() is not None  # still prepared: --discard drops it
    # the history says the commit was refused and the run stays prepared (not a run that ended in error)
    (env,) = bed.cli("--status", "--json").json["data"]["environments"]
    assert env["prepared"] is not None and env["prepared"]["run_id"] == env["runs"][0]["run_id"], env
    assert env["runs"][0]["status"] == "commit-refused" and env["runs"][0]["exit_code"] == 2, env["runs"]
    (entry,) = bed.state.glob(f"*/history/{env['runs'][0]['run_id']}.json")
    kept = json.loads(entry.read_text())["result"]
    assert "changed since the prepare" in kept["errors"][0]["message"], kept
    assert any("the run stays prepared" in note for note in kept["data"]["notes"]), kept
    assert kept["data"]["plan"]["package"] == "sicext", kept  # the prepare's document, said refused
    dropped = bed.safeinstall("--discard", "--json")
    assert dropped.code == 0, dropped.stdout + dropped.stderr
    assert dropped.json["status"] == "discarded"
    assert bed.manager.main_pid(name) == main
    _nothing_left(bed)


def test_the_wheel_copy_changed_refuses_the_commit_that_reuses_its_hashes(bed: Bed) -> None:
    """The commit takes the wheel's member hashes from the prepare only for the same bytes: a copy
    changed since (one byte more) is refused, nothing stopped."""
    name = bed.service("prep-wheel")
    main = bed.manager.main_pid(name)
    _prepared(bed)
    (copy,) = bed.state.glob("*/wheels/*/*.whl")
    with open(copy, "ab") as handle:
        handle.write(b"\0")
    refused = bed.safeinstall("--commit", "--json")
    assert refused.code == 2, refused.stdout + refused.stderr
    (error,) = refused.json["errors"]
    assert "the run's copy of the wheel" in error["message"], error
    _untouched(bed, name, main)
    assert bed.safeinstall("--discard").code == 0
    _nothing_left(bed)


def _rewritten_in_place(path: Path) -> None:
    """The same size, one byte otherwise, its modification time set back: only its change time (which
    nobody but the clock can set) says it was written."""
    before = os.lstat(path)
    with open(path, "r+b") as handle:
        handle.seek(before.st_size // 2)
        byte = handle.read(1)
        handle.seek(before.st_size // 2)
        handle.write(bytes([byte[0] ^ 0x01]))
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    after = os.lstat(path)
    assert (after.st_size, after.st_mtime_ns) == (before.st_size, before.st_mtime_ns)


@pytest.mark.parametrize("what", ["the run's copy of the wheel", "the staged tree"])
def test_a_rewrite_with_its_times_set_back_refuses_the_commit(bed: Bed, what: str) -> None:
    """The commit takes the wheel copy by its identity (no sha256 again), and a root-only staged tree
    whose walk finds every entry as the prepare verified it without reading it again: a same-size
    rewrite of either whose mtime is set back still moves its ctime, and is refused, nothing stopped."""
    name = bed.service("prep-same-size")
    main = bed.manager.main_pid(name)
    _prepared(bed)
    if what == "the staged tree":
        (staged,) = bed.python.parent.parent.glob(".safeinstall-swap-*")
        victim = next(p for p in sorted((staged / "tree").rglob("*.py")) if p.is_file() and p.stat().st_size)
    else:
        (victim,) = bed.state.glob("*/wheels/*/*.whl")
    _rewritten_in_place(victim)
    refused = bed.safeinstall("--commit", "--json")
    assert refused.code == 2, refused.stdout + refused.stderr
    assert what in refused.json["errors"][0]["message"], refused.stdout
    _untouched(bed, name, main)
    assert bed.safeinstall("--discard").code == 0
    _nothing_left(bed)


def test_a_file_rewritten_with_its_times_set_back_refuses_the_commit(bed: Bed) -> None:
    """The commit takes each file's identity from its own check under the lock (no second ``lstat``):
    a same-size rewrite of an installed file whose mtime is set back still moves its ctime."""
    name = bed.service("prep-file-same-size")
    main = bed.manager.main_pid(name)
    _prepared(bed)
    _rewritten_in_place(bed.site / "sicext" / "serve.py")
    refused = bed.safeinstall("--commit", "--json")
    assert refused.code == 2, refused.stdout + refused.stderr
    message = refused.json["errors"][0]["message"]
    assert "file(s) of the environment changed" in message and "serve.py" in message, message
    assert bed.manager.main_pid(name) == main and bed.manager.active_state(name) == "active"
    assert bed.safeinstall("--discard").code == 0


def test_a_staged_tree_others_may_write_is_verified_again(tmp_path: Path) -> None:
    """Pure but for a small tree: the commit takes the prepare's verification only where every entry
    is the caller's alone to write (uv's lock file aside); an entry another account owns or may write
    (whose bytes a writable shared mapping changes without moving its times) has it verified again."""
    from safeinstall.run.steps.prepare import staged_entries, tree_seen, verified_as_prepared
    from safeinstall.store.prepared import PreparedRecord

    root = tmp_path / "staging"
    (root / "tree" / "pkg").mkdir(parents=True)
    (root / "attic").mkdir()
    module = root / "tree" / "pkg" / "mod.py"
    module.write_text("x = 1\n")
    lock = root / "tree" / ".lock"
    lock.write_text("")
    os.chmod(root, 0o700)
    os.chmod(lock, 0o666)  # as uv leaves it: no part of the swap

    def record(seen: dict[str, tuple[int, ...]]) -> PreparedRecord:
        return PreparedRecord(
            run_id="r",
            prepared_at=0.0,
            prefix=str(tmp_path),
            package="pkg",
            changes=(),
            options={},
            uv_command=(),
            units=(),
            processes=(),
            files={},
            staged=seen,
            staged_files=1,
        )

    seen = tree_seen(root)
    assert seen.not_alone == {"tree/.lock"}
    assert verified_as_prepared(record(seen.identities), seen, full=False)
    assert staged_entries(seen) == (frozenset({"pkg/mod.py"}), frozenset({"pkg"}))
    assert not verified_as_prepared(record(seen.identities), seen, full=True)
    assert not verified_as_prepared(replace(record(seen.identities), staged_files=None), seen, full=False)
    for mode, owner in ((0o666, 0), (0o644, 65534)):  # others may write it; another account owns it
        os.chmod(module, mode)
        os.chown(module, owner, owner)
        again = tree_seen(root)
        assert again.not_alone == {"tree/.lock", "tree/pkg/mod.py"}
        assert not verified_as_prepared(record(again.identities), again, full=False)


def test_a_distribution_added_since_the_prepare_takes_the_whole_preflight_again(bed: Bed) -> None:
    """The site directory moved (an entry added): the commit does not take the prepare's uv plan, it
    asks uv again and compares; the same plan, the same files: it commits."""
    name = bed.service("prep-dirs")
    _prepared(bed)
    added = bed.site / "added_since"
    added.mkdir()
    committed = bed.safeinstall("--commit", "--settle", "0.5", "--json")
    assert committed.code == 0, committed.stdout + committed.stderr
    first = committed.json["data"]["steps"][0]
    assert first["name"] == "preflight" and "the whole preflight again" in first["detail"], first
    assert bed.version() == "2.0"
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running")
    added.rmdir()
    assert bed.cli("--recover").code == 0
    _nothing_left(bed)


def test_the_staged_tree_changed_refuses_the_commit(bed: Bed) -> None:
    name = bed.service("prep-staged")
    main = bed.manager.main_pid(name)
    _prepared(bed)
    (staged,) = bed.python.parent.parent.glob(".safeinstall-swap-*")
    victim = next(p for p in staged.rglob("*.py") if p.is_file())
    # the same bytes, one more link to the inode the swap would put in place: a way to rewrite it later
    held = bed.python.parent.parent / "held-link"
    os.link(victim, held)
    refused = bed.safeinstall("--commit", "--json")
    assert refused.code == 2 and "the staged tree" in refused.stdout, refused.stdout
    _untouched(bed, name, main)
    held.unlink()
    assert bed.safeinstall("--discard").code == 0
    _nothing_left(bed)


def test_discard_drops_the_prepared_run(bed: Bed) -> None:
    name = bed.service("prep-discard")
    main = bed.manager.main_pid(name)
    said = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--prepare")
    assert said.code == 0, said.stdout + said.stderr
    assert "prepared: sicext 1.0 -> 2.0; backup, prefetch, smoke done, nothing stopped" in said.stdout
    assert "safeinstall --commit --python" in said.stderr, said.stderr  # the note: how to commit
    # another prepare waits for this one: the hint is a command to copy (its interpreter, not "PY")
    twice = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--prepare", "--json")
    (error,) = twice.json["errors"]
    assert twice.code == 2 and "waits in" in error["message"], twice.stdout
    assert f"safeinstall --discard --python {bed.python} --user" in error["hint"], error
    dropped = bed.safeinstall("--discard")
    assert dropped.code == 0 and "discarded the prepared run" in dropped.stdout, dropped.stdout
    _untouched(bed, name, main)
    _nothing_left(bed)
    # the history says what happened: dropped on purpose, not a run that died and was recovered
    (env,) = bed.cli("--status", "--json").json["data"]["environments"]
    latest = env["runs"][0]
    assert latest["status"] == "discarded" and latest["exit_code"] == 0, latest
    again = bed.safeinstall("--discard", "--json")
    assert again.code == 2 and again.json["errors"][0]["code"] == "prepared-run", again.stdout


def test_a_prepared_run_too_old_is_refused(bed: Bed) -> None:
    """Refused, the run stays prepared: a later detached commit goes on, and the refused commit's entry
    is not taken for its result (by it, nor by --status --wait)."""
    name = bed.service("prep-old")
    main = bed.manager.main_pid(name)
    run_id = _prepared(bed)["data"]["run_id"]  # type: ignore[index]
    time.sleep(1.1)
    refused = bed.safeinstall("--commit", "--prepared-max-age", "1", "--json")
    assert refused.code == 2, refused.stdout
    assert "more than --prepared-max-age" in refused.json["errors"][0]["message"], refused.stdout
    _untouched(bed, name, main)
    # the settle keeps the commit going while --status --wait starts (as the detached test above)
    detached = bed.safeinstall("--commit", "--settle", "4", "--detach", "--json")
    assert detached.code == 0 and detached.json["status"] == "detached", detached.stdout + detached.stderr
    waited = bed.safeinstall("--status", "--wait", "--run", run_id, "--json", timeout=240)
    assert waited.code == 0 and waited.json["status"] == "done", waited.stdout + waited.stderr
    assert bed.version() == "2.0"
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running")
    assert bed.cli("--recover").code == 0  # what the commit left to the next run
    _nothing_left(bed)


def test_commit_with_several_prepared_runs_needs_python(bed: Bed, tmp_path: Path) -> None:
    """Two environments prepared: --commit without --python names neither; with it, its own."""
    from tests import wheelhouse

    other = tmp_path / "other"
    wheelhouse.make_venv(other)
    wheelhouse.uv_install(other, bed.wheels["sicext-1"])
    _prepared(bed)
    env = bed.environ()
    from tests.clirun import run

    second = run(
        "--user",
        "--python",
        str(other / "bin" / "python"),
        "--yes",
        "sicext",
        "--wheel",
        str(bed.wheels["sicext-2"]),
        "--prepare",
        env=env,
    )
    assert second.code == 0, second.stdout + second.stderr
    refused = run("--user", "--yes", "--commit", "--json", env=env)
    assert refused.code == 2 and "2 environments have a prepared run" in refused.stdout, refused.stdout
    assert bed.version() == "1.0"
    for python in (str(bed.python), str(other / "bin" / "python")):
        assert run("--user", "--python", python, "--discard", env=env).code == 0


def test_a_kill_during_the_prepare_then_recover_leaves_nothing(bed: Bed) -> None:
    name = bed.service("prep-kill")
    main = bed.manager.main_pid(name)
    bed.kill_in("staged", "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--prepare")
    journal = bed.journal()
    assert journal is not None and journal["phase"] == "staged"
    recovered = bed.cli("--recover", "--json")
    assert recovered.code == 0, recovered.stdout + recovered.stderr
    _untouched(bed, name, main)
    _nothing_left(bed)


def test_prepare_and_commit_refuse_what_they_cannot_take(bed: Bed) -> None:
    for args, said in (
        (("sicext", "--prepare", "--settle", "1"), "give it to --commit"),
        (("sicext", "--prepare", "--dry-run"), "--prepare does not go with --dry-run"),
        (("--commit", "--with-deps"), "--commit takes only the window's options"),
        (("--commit", "sicext"), "--commit takes no PACKAGE"),
        (("sicext", "--prepared-max-age", "5"), "--prepared-max-age goes with --commit"),
    ):
        result = bed.safeinstall(*args, "--json")
        assert result.code == 2, (args, result.stdout)
        assert said in json.dumps(result.json), (args, result.stdout)


def test_recover_removes_a_prepared_run(bed: Bed) -> None:
    """A prepared run is no run in progress: --recover (after a reboot, say) drops it as --discard does."""
    name = bed.service("prep-recover")
    main = bed.manager.main_pid(name)
    run_id = _prepared(bed)["data"]["run_id"]  # type: ignore[index]
    recovered = bed.cli("--recover", "--json")
    assert recovered.code == 0, recovered.stdout + recovered.stderr
    (recovery,) = recovered.json["data"]["recoveries"]
    assert recovery["run_id"] == run_id and recovery["phase"] == "prepared"
    _untouched(bed, name, main)
    _nothing_left(bed)


def test_prepare_then_commit_without_a_swap(bed: Bed) -> None:
    """--no-swap: the prepare fills the run's uv cache; the commit installs from it in the window."""
    name = bed.service("prep-noswap")
    main = bed.manager.main_pid(name)
    doc = _prepared(bed, "--no-swap")
    assert not list(bed.python.parent.parent.glob(".safeinstall-swap-*"))
    assert list(bed.state.glob("*/uv-cache-*")), "the run's cache stays for the commit"
    assert doc["data"]["run_id"]  # type: ignore[index]
    _untouched(bed, name, main)
    committed = bed.safeinstall("--commit", "--settle", "0.5", "--json")
    assert committed.code == 0, committed.stdout + committed.stderr
    assert bed.version() == "2.0"
    assert bed.verify("--wheel", str(bed.wheels["sicext-2"])).code == 0
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running")
    assert bed.cli("--recover").code == 0  # the commit's cache, left to the next run
    _nothing_left(bed)


def test_a_detached_commit_goes_on_in_its_unit_and_wait_returns_its_result(bed: Bed) -> None:
    name = bed.service("prep-detach")
    main = bed.manager.main_pid(name)
    run_id = _prepared(bed)["data"]["run_id"]  # type: ignore[index]
    # the settle keeps the commit going while --status --wait starts: the prepare's entry is not its result
    detached = bed.safeinstall("--commit", "--settle", "4", "--detach", "--json")
    assert detached.code == 0, detached.stdout + detached.stderr
    assert detached.json["status"] == "detached" and detached.json["data"]["run_id"] == run_id
    waited = bed.safeinstall("--status", "--wait", "--run", run_id, "--json", timeout=240)
    assert waited.code == 0, waited.stdout + waited.stderr
    assert waited.json["status"] == "done", waited.json  # the commit's, not the prepare's
    assert bed.version() == "2.0" and bed.verify("--wheel", str(bed.wheels["sicext-2"])).code == 0
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running")
    assert bed.manager.main_pid(name) != main
    assert list(bed.python.parent.parent.glob(".safeinstall-swap-*")), "left to the next run"
    # the next run on the environment removes what the commit left (under the lock, no journal)
    again = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")
    assert again.code == 0, again.stdout + again.stderr
    _nothing_left(bed)


def test_a_detached_commit_refused_says_so_at_once(bed: Bed) -> None:
    name = bed.service("prep-detach-refused")
    main = bed.manager.main_pid(name)
    _prepared(bed)
    target = bed.site / "sicext" / "serve.py"
    target.write_text(target.read_text() + "# changed after the prepare\n")
    refused = bed.safeinstall("--commit", "--detach", "--json")
    assert refused.code == 2, refused.stdout + refused.stderr
    assert "changed since the prepare" in refused.json["errors"][0]["message"], refused.stdout
    _untouched_but_patched = bed.manager.main_pid(name) == main
    assert _untouched_but_patched and bed.manager.active_state(name) == "active"
    assert bed.safeinstall("--discard").code == 0


def test_the_commit_takes_the_prepares_options_and_the_windows_own() -> None:
    """Pure: every option of a run is the prepare's (kept in its record) or the window's (the commit's)."""
    import dataclasses

    from safeinstall.run.parts.options import RunOptions
    from safeinstall.run.steps.prepare import WINDOW_OPTIONS, commit_options, options_json
    from safeinstall.store.prepared import PreparedRecord

    prepared = RunOptions(
        package="vllm",
        python="/opt/vllm/bin/python",
        wheel=Path("/state/wheels/x/vllm-0.16.0-py3-none-any.whl"),
        with_deps=True,
        user=True,
        kill_strays=True,
        extra_args=("--no-build-isolation",),
        no_swap=True,
        smoke_skip=("vllm.x",),
        keep_backups=5,
        prepare=True,
        settle=9.0,
    )
    record = PreparedRecord(
        run_id="20261206T000000Z-1",
        prepared_at=0.0,
        prefix="/opt/vllm",
        package="vllm",
        changes=(),
        options=json.loads(json.dumps(options_json(prepared))),  # as the record keeps it
        uv_command=(),
        units=(),
        processes=(),
        files={},
    )
    given = RunOptions(
        package="vllm", settle=1.5, health_url="http://127.0.0.1:8000/health", stop_timeout=30.0
    )
    options = commit_options(record, given)
    assert options.commit and not options.prepare and options.run_id == record.run_id
    for name in WINDOW_OPTIONS:
        assert getattr(options, name) == getattr(given, name), name
    kept = {f.name for f in dataclasses.fields(RunOptions)} - set(WINDOW_OPTIONS)
    for name in kept - {"prepare", "commit", "run_id", "environ", "proc_root", "prepared_max_age"}:
        assert getattr(options, name) == getattr(prepared, name), name


def test_a_service_restarted_since_the_prepare_refuses_the_commit(bed: Bed) -> None:
    """The commit's new scan: another process uses the package now (the unit restarted meanwhile)."""
    name = bed.service("prep-restarted")
    _prepared(bed)
    bed.manager.systemctl("restart", name)
    bed.manager.wait_active(name)
    main = bed.manager.main_pid(name)
    refused = bed.safeinstall("--commit", "--json")
    assert refused.code == 2, refused.stdout + refused.stderr
    assert "the processes using the package: 1 new, 1 gone" in refused.json["errors"][0]["message"]
    assert bed.manager.main_pid(name) == main and bed.version() == "1.0"
    assert bed.safeinstall("--discard").code == 0
    _nothing_left(bed)


def test_the_backups_of_discarded_runs_are_pruned_by_the_next_good_run(bed: Bed) -> None:
    """docs/prepare.md: a discarded run's backup stays until the retention prunes it. It never did
    (retention counted only ``done`` runs and removed only ``rolled-back`` ones): prepared runs
    discarded left their backups (hard links of the live files) past any ``--keep-backups``."""
    name = bed.service("prep-prune")
    _prepared(bed)
    assert bed.safeinstall("--discard").code == 0
    discarded = sorted(str(p) for p in bed.state.glob("*/backups/*") if p.is_dir())
    assert len(discarded) == 1, discarded
    # meanwhile the live files share their inodes with it: the warning says it may be a kept backup
    shown = run("sicext", "--verify-only", "--python", str(bed.python), env=bed.environ())
    assert "share their inode" in shown.stderr, shown.stdout + shown.stderr
    assert "or a backup safeinstall keeps of this environment" in shown.stderr, shown.stderr
    good = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--keep-backups", "3", "--json"
    )
    assert good.code == 0, good.stdout + good.stderr
    # whatever --keep-backups says: they are no way back, and --undo never takes them
    assert sorted(good.json["data"]["backups_removed"]) == discarded, good.json["data"]
    (kept,) = bed.state.glob("*/backups/*")
    assert kept.name == good.json["data"]["run_id"]
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running")


def test_a_commit_keeps_only_the_records_it_installed(bed: Bed) -> None:
    """The check in place keeps (``records.json``) the RECORDs of what the run installed, not every
    distribution's: another distribution's module edited with its RECORD line (the same size, its
    mtime set back) since root found it clean stays ``record-changed`` after the commit."""
    wheelhouse.uv_install(bed.python, bed.wheels["sipure-1"])
    name = bed.service("prep-records")
    assert bed.cli("--verify-only", "--all", "--json").code == 0  # root finds every RECORD clean
    module = bed.site / "sipure" / "cli.py"
    record = next(bed.site.glob("sipure-*.dist-info")) / "RECORD"
    times = [os.lstat(p) for p in (module, record)]
    data = module.read_bytes()
    module.write_bytes(data[:-1] + (b"#" if data[-1:] != b"#" else b" "))
    digest = wheelhouse.record_digest(module.read_bytes())
    record.write_text(
        "".join(
            f"sipure/cli.py,sha256={digest},{len(data)}\n" if x.startswith("sipure/cli.py,") else x + "\n"
            for x in record.read_text().splitlines()
        )
    )
    for path, was in zip((module, record), times, strict=True):
        os.utime(path, ns=(was.st_atime_ns, was.st_mtime_ns))
    _prepared(bed)
    committed = bed.safeinstall("--commit", "--json", "--settle", "0")
    assert committed.code == 0, committed.stdout + committed.stderr
    assert bed.version() == "2.0" and bed.manager.active_state(name) == "active"
    checked = bed.cli("sipure", "--verify-only", "--json")
    drift = {(f["kind"], f["path"]) for f in checked.json["data"]["findings"] if f["drift"]}
    assert checked.code == 1 and ("record-changed", str(module)) in drift, checked.stdout


def test_a_prepare_needs_no_yes_and_a_commit_without_one_points_at_the_status(bed: Bed) -> None:
    """``--prepare`` stops nothing: without a terminal and without ``--yes`` it prepares (a new-user
    review: it was refused "not confirmed: the run would stop ..."). The commit stops the unit: without
    ``--yes`` it is refused, its hint naming ``--status`` (a dry run is refused while a run is prepared),
    the unit untouched."""
    name = bed.service("prep-no-yes")
    main = bed.manager.main_pid(name)
    prepared = bed.cli("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--prepare", "--json")
    assert prepared.code == 0 and prepared.json["status"] == "prepared", prepared.stdout + prepared.stderr
    _untouched(bed, name, main)
    unasked = bed.cli("--commit", "--json")
    assert unasked.code == 2, unasked.stdout + unasked.stderr
    (error,) = unasked.json["errors"]
    assert "not confirmed" in error["message"] and "--status" in error["hint"], error
    assert "--dry-run" not in error["hint"], error
    _untouched(bed, name, main)
    assert bed.cli("--discard", "--json").code == 0
    _nothing_left(bed)


@pytest.mark.parametrize("text", ["garbage", '{"version": 2, "run_id": 5}', "{}"])
def test_a_prepared_run_whose_record_is_damaged_is_still_discarded(bed: Bed, text: str) -> None:
    """A new-user review: with its record damaged (or of no format) ``--discard`` refused, its hint naming
    ``--discard`` itself, and only ``--recover`` cleared it. The journal says which run it is: the run is
    dropped, the record with it (said), and a plain run goes again."""
    name = bed.service("prep-damaged")
    main = bed.manager.main_pid(name)
    _prepared(bed)
    (record,) = bed.state.glob("*/prepared.json")
    record.write_text(text)
    shown = bed.cli("--status").stdout
    assert "its record unreadable" in shown and "idle" not in shown, shown
    dropped = bed.cli("--discard", "--json")
    assert dropped.code == 0, dropped.stdout + dropped.stderr
    assert dropped.json["data"]["discarded"]["package"] == "sicext", dropped.json
    assert any(
        "record" in note and "dropped with it" in note for note in dropped.json["data"]["discarded"]["notes"]
    )
    _untouched(bed, name, main)
    _nothing_left(bed)
    again = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0", "--json")
    assert again.code == 0, again.stdout + again.stderr
