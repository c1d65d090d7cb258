"""``--undo``: back to exactly what ran before a run, through the run's own safe sequence.

Real parts: a systemd --user unit running the package, real wheels installed by real uv, the fake NVML
driver. What is checked is what is on disk and what the unit maps, from the outside.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
from pathlib import Path

import pytest

from tests.bed_systemd import wait_until
from tests.beds import NOBODY, Bed, ServiceAccountBed, chown_tree, maps_so

#: an undo whose backup holds a local patch: staged no (said), put back in the window
UNDO_STEPS = [
    "preflight",
    "backup",
    "stage",
    "gate",
    "stop",
    "gpu-release",
    "restore",
    "verify",
    "restart",
    "end-check",
]
#: an undo that swaps (issue 47 item 4): the backup staged and verified before the stop, renamed in
#: during it, checked against the backup again once the units run
SWAPPED_UNDO_STEPS = [
    "preflight",
    "backup",
    "stage",
    "gate",
    "stop",
    "gpu-release",
    "restore",
    "verify",
    "restart",
    "verify-in-place",
    "end-check",
]


def _files(site: Path) -> dict[str, str]:
    """Every file of the package and its .dist-info, by content (bytecode caches aside)."""
    found: dict[str, str] = {}
    for top in (site / "sicext", *site.glob("sicext-*.dist-info")):
        for path in top.rglob("*"):
            if path.is_file() and "__pycache__" not in path.parts:
                found[str(path.relative_to(site))] = hashlib.sha256(path.read_bytes()).hexdigest()
    return found


def _restoring(package: Path) -> bool:
    """The restore is writing a file back: its temporary copy is there (the large one takes a while)."""
    try:
        return any(".safeinstall-restore-" in p.name for p in package.iterdir())
    except OSError:
        return False


def _patch(bed: Bed) -> bytes:
    patched = bed.site / "sicext" / "serve.py"
    patched.write_text(patched.read_text() + "# a local hotfix\n")
    return patched.read_bytes()


def _upgrade(bed: Bed) -> str:
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")
    assert result.code == 0, result.stdout + result.stderr
    assert bed.version() == "2.0"
    run_id: str = result.json["data"]["run_id"]
    return run_id


def test_upgrade_then_undo_puts_back_the_old_version_and_its_patch_and_restarts_on_it(bed: Bed) -> None:
    name = bed.service("undo")
    patch = _patch(bed)
    before = _files(bed.site)
    upgrade = _upgrade(bed)
    upgraded_main = bed.manager.main_pid(name)

    result = bed.safeinstall("--undo", "--settle", "0.5", "--json")

    assert result.code == 0, result.stdout + result.stderr
    doc = result.json
    assert doc["command"] == "undo" and doc["status"] == "done" and doc["errors"] == []
    assert doc["data"]["undo_of"] == upgrade
    assert [s["name"] for s in doc["data"]["steps"]] == UNDO_STEPS
    plan = doc["data"]["plan"]
    assert plan["uv_command"][0] == "restore-backup"
    assert [(d["name"], d["old_version"], d["new_version"]) for d in plan["distributions"]] == [
        ("sicext", "2.0", "1.0")
    ]
    assert bed.version() == "1.0"
    assert _files(bed.site) == before  # byte for byte, the .dist-info and the local patch included
    assert (bed.site / "sicext" / "serve.py").read_bytes() == patch
    main = bed.manager.main_pid(name)
    assert main != upgraded_main and bed.manager.active_state(name) == "active"
    assert maps_so(main) == bed.so.stat().st_ino  # the restarted unit runs the restored extension
    assert not any(bed.state.glob("*/journal.json"))
    assert not list(bed.manager.unit_dir.glob(f"{name}.d/*safeinstall*"))


def test_the_undo_of_an_undo_goes_forward_again(bed: Bed) -> None:
    name = bed.service("redo")
    _upgrade(bed)
    upgraded = _files(bed.site)
    first = bed.safeinstall("--undo", "--settle", "0.5", "--json")
    assert first.code == 0, first.stdout + first.stderr
    assert bed.version() == "1.0"
    # no local patch: a swap, as a forward run's (the window renames the staged backup in)
    steps = {s["name"]: s for s in first.json["data"]["steps"]}
    assert list(steps) == SWAPPED_UNDO_STEPS, list(steps)
    assert "staged and verified" in steps["stage"]["detail"], steps["stage"]
    assert steps["restore"]["detail"].startswith("swapped:"), steps["restore"]
    assert not list(bed.python.parent.parent.glob(".safeinstall-*"))  # the staging tree went

    again = bed.safeinstall("--undo", "--settle", "0.5", "--json")

    assert again.code == 0, again.stdout + again.stderr
    assert again.json["data"]["undo_of"] == first.json["data"]["run_id"]
    assert bed.version() == "2.0"
    assert _files(bed.site) == upgraded
    assert maps_so(bed.manager.main_pid(name)) == bed.so.stat().st_ino


def test_rolled_back_runs_never_push_out_the_backup_an_undo_needs(bed: Bed) -> None:
    """Issue 37: three failed nightlies (each rolled back) once deleted the good run's backup under the
    default --keep-backups 3, and --undo then had nothing to undo. A rolled-back run's own backup goes
    with the next run; a good run's stays."""
    bed.service("nightly")
    upgrade = _upgrade(bed)
    failed: list[str] = []
    for _ in range(3):
        result = bed.safeinstall(
            "sicext", "--wheel", str(bed.wheels["sicext-3"]), "--settle", "1", "--json", "--no-smoke"
        )
        assert result.code == 3, result.stdout + result.stderr
        removed = [Path(p).name for p in result.json["data"]["backups_removed"]]
        assert removed == failed[-1:]  # the previous rolled-back run's, never the good one's
        failed.append(result.json["data"]["run_id"])
    assert bed.version() == "2.0"

    undone = bed.safeinstall("--undo", "--settle", "0.5", "--json")

    assert undone.code == 0, undone.stdout + undone.stderr
    assert undone.json["data"]["undo_of"] == upgrade and bed.version() == "1.0"


def test_a_change_since_the_run_refuses_the_undo_before_anything_stops(bed: Bed) -> None:
    name = bed.service("changed")
    _upgrade(bed)
    main = bed.manager.main_pid(name)
    edited = bed.site / "sicext" / "serve.py"
    edited.write_text(edited.read_text() + "# edited after the upgrade\n")
    after = _files(bed.site)

    result = bed.safeinstall("--undo", "--settle", "0.5", "--json")

    assert result.code == 2, result.stdout + result.stderr
    message = result.json["errors"][0]["message"]
    assert "changed since run" in message and f"changed: {edited}" in message
    assert bed.manager.main_pid(name) == main  # nothing stopped
    assert _files(bed.site) == after  # nothing touched


def test_a_backup_changed_since_its_run_refuses_the_undo_saying_why(bed: Bed) -> None:
    """A backup file whose bytes are no longer those saved (one hardlinked with uv's cache or another
    venv changes with it): the undo is refused before the stop, saying that the backup changed, not
    only naming a path in a staging tree that is gone already (a new-user review)."""
    name = bed.service("backup-changed")
    run_id = _upgrade(bed)
    main = bed.manager.main_pid(name)
    (saved,) = [p for p in bed.state.glob(f"*/backups/{run_id}/**/serve.py") if p.is_file()]
    saved.write_bytes(saved.read_bytes().replace(b"\n", b" \n", 1))

    result = bed.safeinstall("--undo", "--settle", "0.5", "--json")

    assert result.code == 2, result.stdout + result.stderr
    error = result.json["errors"][0]
    assert "not the bytes the backup saved" in error["message"], error
    assert "changed since its run" in error["hint"], error
    assert bed.manager.main_pid(name) == main and bed.version() == "2.0"


def test_a_pruned_backup_refuses_and_says_which_runs_can_be_undone(bed: Bed) -> None:
    bed.service("pruned")
    first = _upgrade(bed)
    second = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")
    assert second.code == 0, second.stdout + second.stderr
    kept = second.json["data"]["run_id"]
    backup = bed.state.glob(f"*/backups/{first}")
    for path in backup:  # as --keep-backups would have deleted it
        for sub in sorted(path.rglob("*"), key=lambda p: len(p.parts), reverse=True):
            sub.rmdir() if sub.is_dir() and not sub.is_symlink() else sub.unlink()
        path.rmdir()

    result = bed.safeinstall("--undo", "--run", first, "--json")

    assert result.code == 2, result.stdout + result.stderr
    error = result.json["errors"][0]
    assert "backup was deleted" in error["message"] and kept in error["hint"]
    assert first not in error["hint"]
    assert os.path.exists(bed.site / "sicext")


@pytest.mark.parametrize(
    ("phases", "linger"), [(("stopped",), 2.0), (("installed", "verified", "restarting"), 0.0)]
)
def test_an_undo_killed_in_the_middle_is_finished_by_recover(
    bed: Bed, phases: tuple[str, ...], linger: float
) -> None:
    before = bed.hotfix()
    name = bed.unit("undo-kill")
    wheel = str(bed.wheels["sicext-2"])
    upgrade = bed.cli("sicext", "--wheel", wheel, "--yes", "--settle", "0.5")
    assert upgrade.code == 0, upgrade.stdout + upgrade.stderr
    upgraded = bed.snapshot()
    bed.hold_gpu(name, linger, "u1")
    proc = bed.start_run("--undo", "--settle", "1")
    try:
        bed.wait_phase(proc, *phases)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.communicate()
    assert bed.cli("--status", "--json").json["status"] == "needs-recovery"

    recovered = bed.cli("--recover", "--json")

    assert recovered.code == 0, recovered.stdout + recovered.stderr
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running again")
    # exactly one of the two states, whole: the upgraded one (the undo put back) or the one before it
    assert bed.snapshot() in (upgraded, before)
    assert bed.version() == ("2.0" if bed.snapshot() == upgraded else "1.0")
    if phases == ("stopped",):
        assert bed.snapshot() == upgraded
    bed.no_trace()


def test_dry_run_json_shapes_history_and_status_of_an_undo(bed: Bed) -> None:
    name = bed.service("shapes")
    upgrade = _upgrade(bed)
    main = bed.manager.main_pid(name)
    upgraded = _files(bed.site)

    other = bed.safeinstall("sipure", "--undo", "--dry-run", "--json")  # PACKAGE: a guard
    assert (
        other.code == 2 and f"run {upgrade} was of sicext, not sipure" in other.json["errors"][0]["message"]
    )
    dry = bed.safeinstall("sicext", "--undo", "--dry-run", "--json")

    assert dry.code == 0, dry.stdout + dry.stderr
    assert (dry.json["command"], dry.json["status"], dry.json["data"]["undo_of"]) == (
        "dry-run",
        "would-proceed",
        upgrade,
    )
    assert [u["name"] for u in dry.json["data"]["units"]] == [name]
    assert dry.json["data"]["uv_command"][0] == "restore-backup"
    assert bed.manager.main_pid(name) == main and _files(bed.site) == upgraded  # nothing done
    status = bed.safeinstall("--status", "--json").json["data"]["environments"][0]["runs"]
    assert [(r["run_id"], r["can_undo"], r["cannot_undo"]) for r in status] == [(upgrade, True, None)]

    undone = bed.safeinstall("--undo", "--settle", "0.5", "--json")

    assert undone.code == 0, undone.stdout + undone.stderr
    runs = bed.safeinstall("--status", "--json").json["data"]["environments"][0]["runs"]
    assert [(r["run_id"], r["status"], r["package"]) for r in runs] == [
        (undone.json["data"]["run_id"], "done", "sicext"),
        (upgrade, "done", "sicext"),
    ]
    assert [r["can_undo"] for r in runs] == [True, False]  # the upgrade is undone: its files are gone
    assert runs[1]["cannot_undo"].startswith(f"undone by run {undone.json['data']['run_id']}")
    history = list(bed.state.glob(f"*/history/{undone.json['data']['run_id']}.json"))
    assert [json.loads(h.read_text())["result"]["command"] for h in history] == ["undo"]
    human = bed.safeinstall("--status")
    assert "UNDO" in human.stdout and human.code == 0
    again = bed.safeinstall("--undo", "--run", upgrade, "--json")  # the state it left is gone
    assert again.code == 2 and "undone by run" in again.json["errors"][0]["message"]
    assert bed.version() == "1.0"
    # a prepared run waits: the undo, and its dry run (which said would-proceed), refuse alike
    prepared = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--prepare", "--json")
    assert prepared.code == 0, prepared.stdout + prepared.stderr
    real = bed.safeinstall("--undo", "--json")
    dry = bed.cli("--undo", "--dry-run", "--json")
    assert real.code == dry.code == 2 and real.json["errors"][0]["code"] == "journal", real.stdout
    assert dry.json["errors"] == real.json["errors"], dry.stdout
    assert bed.safeinstall("--discard").code == 0 and bed.version() == "1.0"


def test_undo_takes_no_package_nor_wheel_and_nothing_to_undo_says_so(bed: Bed) -> None:
    nothing = bed.safeinstall("--undo", "--json")
    assert nothing.code == 2 and "nothing to undo" in nothing.json["errors"][0]["message"]
    assert nothing.json["command"] == "undo"
    mixed = bed.safeinstall("sicext", "--undo", "--wheel", str(bed.wheels["sicext-2"]))
    assert mixed.code == 2 and "--undo takes no --wheel" in mixed.stderr
    patches = bed.safeinstall("--undo", "--keep-patches", "--prune")
    assert patches.code == 2 and "--undo takes no --keep-patches --prune" in patches.stderr
    unknown = bed.safeinstall("--undo", "--run", "20991231T000000Z-1")
    assert unknown.code == 2 and "no run 20991231T000000Z-1" in unknown.stderr


def test_a_detached_undo_goes_on_as_a_unit_and_wait_returns_its_result(bed: Bed) -> None:
    name = bed.service("detached-undo")
    patch = _patch(bed)
    upgrade = _upgrade(bed)

    detached = bed.safeinstall("--undo", "--settle", "0.5", "--detach", "--json")

    assert detached.code == 0, detached.stdout + detached.stderr
    assert (detached.json["command"], detached.json["status"]) == ("undo", "detached")
    assert detached.json["data"]["undo_of"] == upgrade
    run_id = detached.json["data"]["run_id"]
    waited = bed.safeinstall("--status", "--wait", "--run", run_id, "--json", timeout=240)
    assert waited.code == 0, waited.stdout + waited.stderr
    assert (waited.json["command"], waited.json["status"], waited.json["data"]["undo_of"]) == (
        "undo",
        "done",
        upgrade,
    )
    assert bed.version() == "1.0"
    assert (bed.site / "sicext" / "serve.py").read_bytes() == patch
    assert maps_so(bed.manager.main_pid(name)) == bed.so.stat().st_ino


def test_the_ansible_reinstall_module_undoes_with_the_package_as_a_guard() -> None:
    from ansible_collections.safeinstall.fleet.plugins.module_utils.cli import (
        CommandError,
        reinstall_argv,
        reinstall_outcome,
    )

    params = {
        "name": "vllm",
        "undo": True,
        "undo_run": "20261202T040000Z-7",
        "python": "/opt/v",
        "settle": 2.0,
    }
    assert reinstall_argv(["safeinstall"], params, check_mode=True) == [
        "safeinstall",
        "vllm",
        "--undo",
        "--run=20261202T040000Z-7",
        "--json",
        "--yes",
        "--dry-run",
        "--python=/opt/v",
        "--settle=2",
    ]
    last = reinstall_argv(["safeinstall"], {"name": "vllm", "undo": True}, check_mode=False)
    assert last == ["safeinstall", "vllm", "--undo", "--json", "--yes"]
    for wrong in ({"wheel": "/w.whl"}, {"requirement": "vllm==1"}):
        with pytest.raises(CommandError, match="takes no wheel nor requirement"):
            reinstall_argv(["safeinstall"], {**params, **wrong}, check_mode=False)
    with pytest.raises(CommandError, match="undo_run goes with undo"):
        reinstall_argv(["safeinstall"], {"name": "vllm", "undo_run": "x"}, check_mode=False)
    plan = {"distributions": [{"name": "vllm", "old_version": "2", "new_version": "1"}], "units": []}
    done = {"command": "undo", "status": "done", "data": {"undo_of": "R1", "plan": plan}, "errors": []}
    outcome = reinstall_outcome(0, done, "", check_mode=False)
    assert (outcome.changed, outcome.msg) == (True, "undid run R1: vllm 2 -> 1; restarted no unit")


@pytest.mark.parametrize(
    "text",
    [
        "[]",
        '{"left_version": 2, "versions": {}, "files": {}}',
        '{"left_version": 1, "versions": {"a": 1}, "files": {}}',
        '{"left_version": 1, "versions": {}, "files": {"a": ["x"]}}',
        '{"left_version": 1, "versions": {}, "files": {"a": {"/x": null}}}',
        "NaN",
    ],
)
def test_a_damaged_record_of_what_a_run_left_is_not_believed(tmp_path: Path, text: str) -> None:
    from safeinstall.run.parts.undo import UndoError, load_left

    (tmp_path / "left.json").write_text(text)
    os.chmod(tmp_path / "left.json", 0o600)
    with pytest.raises(UndoError, match="is damaged"):
        load_left(tmp_path)


def test_a_record_that_is_a_symlink_or_a_fifo_is_not_read(tmp_path: Path) -> None:
    from safeinstall.run.parts.undo import load_left
    from safeinstall.store.state import StateDirError

    (tmp_path / "elsewhere").write_text('{"left_version": 1, "versions": {}, "files": {}}')
    (tmp_path / "left.json").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(StateDirError):
        load_left(tmp_path)
    (tmp_path / "left.json").unlink()
    os.mkfifo(tmp_path / "left.json")
    with pytest.raises(StateDirError):
        load_left(tmp_path)  # returns at once: a FIFO is never opened for a blocking read


def test_an_undo_killed_while_it_puts_the_backup_back_is_put_back_by_recover(
    bed: Bed, big_wheel: Path
) -> None:
    """The run undone replaced a large version (its backup holds 160 MiB): the kill lands in the restore
    itself. --recover puts back the state before the undo, whole, from the undo's own backup."""
    name = bed.unit("undo-kill-restore")
    for wheel in (big_wheel, bed.wheels["sicext-2"]):
        done = bed.cli("sicext", "--wheel", str(wheel), "--yes", "--settle", "0.5")
        assert done.code == 0, done.stdout + done.stderr
    upgraded = bed.snapshot()
    assert not (bed.site / "sicext" / "blob.bin").exists()
    proc = bed.start_run("--undo", "--settle", "1", "--no-swap")  # the restore in the window
    try:
        wait_until(lambda: _restoring(bed.site / "sicext"), 30, "the restore under way", interval=0.002)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.communicate()
    assert bed.journal() is not None and bed.journal()["phase"] == "installing"  # type: ignore[index]

    recovered = bed.cli("--recover", "--json")

    assert recovered.code == 0, recovered.stdout + recovered.stderr
    assert recovered.json["data"]["recoveries"][0]["restored"] is True
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running again")
    assert bed.snapshot() == upgraded and bed.version() == "2.0"
    bed.no_trace()


def test_a_backup_of_files_of_another_owner_than_the_environments_now_is_refused(tmp_path: Path) -> None:
    from safeinstall.run.parts.undo import Left, UndoTarget, owner_refusal
    from safeinstall.store.backup import Backup, BackupDistribution, BackupFile, BackupManifest

    def saved(uid: int) -> BackupFile:
        return BackupFile(f"lib/f{uid}.py", "sicext", 1, 0o644, uid, uid, 0, "0" * 64)

    manifest = BackupManifest(
        1, "t", "/venv", (BackupDistribution("sicext", "1.0", "x.dist-info"),), (saved(1000),), (), (), (), ()
    )
    target = UndoTarget("20261202T040000Z-1", "sicext", Backup(tmp_path, manifest), Left({}, {}))
    assert owner_refusal(target, 1000) is None
    refused = owner_refusal(target, 1001)
    assert refused is not None and "uid 1000" in refused and "uid 1001's now" in refused


def test_an_undo_in_another_accounts_environment_gives_it_back_its_own_files(
    account: ServiceAccountBed,
) -> None:
    """uid 65534's venv: the undo puts back its files as its own (the restore's removal runs as that
    account); once the environment changed hands, the undo is refused before anything stops."""
    name = account.unit("undo-owned")
    before = account.snapshot()
    owners = {p.stat().st_uid for p in (account.site / "sicext").rglob("*")}
    upgrade = account.cli("sicext", "--wheel", str(account.wheels["sicext-2"]), "--yes", "--settle", "0.5")
    assert upgrade.code == 0, upgrade.stdout + upgrade.stderr

    undone = account.cli("--undo", "--yes", "--settle", "0.5", "--json")

    assert undone.code == 0, undone.stdout + undone.stderr
    assert account.version() == "1.0" and account.snapshot() == before
    assert {p.stat().st_uid for p in (account.site / "sicext").rglob("*")} == owners == {NOBODY}
    account.manager.wait_active(name)
    again = account.cli("--undo", "--yes", "--settle", "0.5", "--json")  # forward: 2.0 again
    assert again.code == 0, again.stdout + again.stderr
    chown_tree(account.base / "venv", NOBODY - 1)  # the environment changes hands
    main = account.manager.main_pid(name)

    refused = account.cli("--undo", "--yes", "--json")

    assert refused.code == 2, refused.stdout + refused.stderr
    assert (
        f"uid {NOBODY}, and the environment is uid {NOBODY - 1}'s now" in refused.json["errors"][0]["message"]
    )
    assert account.manager.main_pid(name) == main and account.version() == "2.0"
