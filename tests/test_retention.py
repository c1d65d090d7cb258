"""Which old backups a good run deletes (pure), and the deleting itself on a real directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from safeinstall.run.parts.preflight import install_overhead, shared_room
from safeinstall.store.retention import (
    KeptBackup,
    backups_to_drop,
    backups_to_remove,
    drop_said,
    kept_backups,
    kept_note,
    prune_backups,
    retention_status,
)
from safeinstall.store.state import is_run_id

OLD, MID, NEW = "20261101T000000Z-7", "20261115T120000Z-99", "20261130T041125Z-19214"


def test_run_ids_are_recognised() -> None:
    assert is_run_id(NEW) and is_run_id(OLD)
    assert not any(map(is_run_id, ["notes", "20261130T041125Z", "20261130T041125Z-", "x20261130T041125Z-1"]))


def test_a_run_id_has_one_shape_for_the_backups_too() -> None:
    """Issue 48: retention had its own run-id pattern with an unbounded pid part; the one shape
    (``store/state.is_run_id``, at most 10 digits, as the history and the baseline read it) holds here too:
    a directory named otherwise is never counted, nor deleted."""
    long = "20261130T041125Z-12345678901"
    assert not is_run_id(long) and is_run_id(long[:-1])
    assert backups_to_remove([long, NEW, OLD], keep=1, protected=()) == (OLD,)


def test_the_newest_are_kept_and_the_rest_go_oldest_first() -> None:
    assert backups_to_remove([NEW, OLD, MID], keep=1, protected=()) == (OLD, MID)
    assert backups_to_remove([NEW, OLD, MID], keep=2, protected=()) == (OLD,)
    assert backups_to_remove([NEW, OLD, MID], keep=3, protected=()) == ()
    assert backups_to_remove([], keep=1, protected=()) == ()


def test_protected_and_foreign_names_are_never_chosen() -> None:
    assert backups_to_remove([NEW, OLD, MID], keep=1, protected={MID}) == (OLD,)
    # a name that is not a run id neither counts towards keep nor goes
    assert backups_to_remove(["zzz-notes", NEW, OLD], keep=1, protected=()) == (OLD,)


def test_only_good_runs_count_and_rolled_back_ones_go() -> None:
    statuses = {OLD: "done", MID: "rolled-back", NEW: "rolled-back"}
    # the newest run was rolled back: the good run's backup stays, the earlier rolled-back one goes
    assert backups_to_remove([NEW, OLD, MID], keep=1, protected={NEW}, statuses=statuses) == (MID,)
    # after a rolled-back run no good run's backup goes, however many there are
    assert backups_to_remove([NEW, OLD, MID], 1, {NEW}, {NEW: "rolled-back"}, good_run=False) == ()
    # a failed rollback keeps its backup (its journal names it) and does not count
    assert backups_to_remove([NEW, OLD, MID], keep=1, protected=(), statuses={MID: "rollback-failed"}) == (
        OLD,
    )
    assert backups_to_remove([OLD, MID], keep=1, protected=(), statuses={OLD: "rollback-failed"}) == ()


def test_discarded_runs_go_prepared_ones_stay_and_a_recovery_counts_as_it_ended() -> None:
    """A discarded prepared run's backup is no way back (nothing was changed: hard links of the live
    files, --undo never takes it): it goes at the next pruning, and never pushes out a good run's. A
    prepared run's (or a refused commit's) is its commit's way back: never chosen. A recovered run that
    kept its verified new version counts as a good one; one that put its backup back is spent."""
    statuses = {OLD: "done", MID: "discarded", NEW: "discarded"}
    assert backups_to_remove([NEW, OLD, MID], keep=1, protected=(), statuses=statuses) == (MID, NEW)
    assert backups_to_remove([NEW, OLD, MID], 1, (), statuses, good_run=False) == (MID, NEW)
    for pending in ("prepared", "commit-refused"):
        assert backups_to_remove([NEW, OLD, MID], 1, (), {OLD: pending, MID: "done", NEW: "done"}) == (MID,)
    kept, restored = retention_status("recovered", 0), retention_status("recovered", 3)
    assert backups_to_remove([NEW, OLD, MID], 1, (), {OLD: "done", MID: "done", NEW: kept}) == (OLD, MID)
    assert backups_to_remove([NEW, OLD, MID], 1, (), {OLD: "done", MID: restored, NEW: "done"}) == (OLD, MID)
    assert retention_status("done", 0) == "done" and retention_status("error", 4) == "error"


def test_keep_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        backups_to_remove([NEW], keep=0, protected=())


def test_prune_deletes_whole_backups_and_nothing_else(tmp_path: Path) -> None:
    for name in (OLD, MID, NEW, "notes"):
        (tmp_path / name / "files" / "pkg").mkdir(parents=True)
        (tmp_path / name / "files" / "pkg" / "mod.py").write_text(name)
    (tmp_path / "20261001T000000Z-1").write_text("a file, not a backup directory")

    pruned = prune_backups(tmp_path, keep=1, protected=())

    assert pruned.removed == (tmp_path / OLD, tmp_path / MID) and pruned.problems == ()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([NEW, "notes", "20261001T000000Z-1"])


def test_prune_never_raises(tmp_path: Path) -> None:
    pruned = prune_backups(tmp_path / "missing", keep=1, protected=())
    assert pruned.removed == () and "could not list it" in pruned.problems[0]


def test_the_plan_says_what_the_kept_backups_hold(tmp_path: Path) -> None:
    """Issue 44: an account's vLLM environment kept 13 GB of backups beside a disk that ran out, and no
    plan said so. Each kept backup's size comes from its manifest; the note names the oldest."""

    assert kept_backups(tmp_path / "none") == () and kept_note((), 3) is None
    for name, size in (("20261201T000000Z-1", 3 << 30), ("20261202T000000Z-2", 1 << 30)):
        (tmp_path / name).mkdir()
        files = [{"path": "a", "size": size}]
        (tmp_path / name / "manifest.json").write_text(json.dumps({"files": files}))
    (tmp_path / "not-a-run").mkdir()
    kept = kept_backups(tmp_path)
    assert [k.path.name for k in kept] == ["20261201T000000Z-1", "20261202T000000Z-2"]
    note = kept_note(kept, 3)
    assert note is not None and "2 kept backup(s)" in note and "4.0 GiB" in note, note
    assert "the oldest, 20261201T000000Z-1, 3.0 GiB" in note, note


def test_the_kept_backups_are_sized_by_the_total_beside_their_manifest(tmp_path: Path) -> None:
    """Each run's plan says what the kept backups hold: a torch backup's manifest is megabytes of JSON,
    so its total is kept beside it (``bytes.json``, naming the manifest by identity) and read instead;
    a total of another manifest (rewritten, replaced) or none at all: the manifest is summed."""
    backup = tmp_path / OLD
    backup.mkdir()
    manifest = backup / "manifest.json"
    manifest.write_text(json.dumps({"files": [{"path": "a", "size": 10}, {"path": "b", "size": 5}]}))

    def total(held: int) -> None:
        info = manifest.stat()
        identity = [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]
        (backup / "bytes.json").write_text(json.dumps({"manifest": identity, "bytes": held}))

    assert [k.bytes for k in kept_backups(tmp_path)] == [15]  # no total: summed
    total(7)  # not what the manifest sums to: shows which was read
    assert [k.bytes for k in kept_backups(tmp_path)] == [7]
    manifest.write_text(json.dumps({"files": [{"path": "a", "size": 20}]}))  # another manifest since
    assert [k.bytes for k in kept_backups(tmp_path)] == [20]
    total(7)
    (backup / "bytes.json").write_text('{"manifest": "x", "bytes": 7}')  # damaged
    assert [k.bytes for k in kept_backups(tmp_path)] == [20]


def test_a_refusal_for_room_names_the_fewest_oldest_kept_backups_and_the_command(tmp_path: Path) -> None:
    """Issue 44: a kept backup never makes a run refuse for room without saying which to drop: the
    oldest first, as few as make the room, each with its ``--forget --run`` command; the newest
    (``--undo``'s way back) only where the older ones are not enough, and said so."""
    kept = tuple(
        KeptBackup(tmp_path / name, size)
        for name, size in (
            ("20261201T000000Z-1", 3 << 20),
            ("20261202T000000Z-2", 2 << 20),
            ("20261203T000000Z-3", 4 << 20),
        )
    )
    assert backups_to_drop(kept, 0) == ()
    assert backups_to_drop(kept, 3 << 20) == kept[:1]
    assert backups_to_drop(kept, (3 << 20) + 1) == kept[:2]
    assert backups_to_drop(kept, 10 << 20) is None
    said = drop_said(kept, 4 << 20, "/opt/venv")
    assert said == (
        "the 3 kept backup(s) of this environment hold 9.0 MiB; dropping 20261201T000000Z-1 (3.0 MiB), "
        "20261202T000000Z-2 (2.0 MiB) makes the room: "
        "safeinstall --forget --python /opt/venv --run 20261201T000000Z-1 && "
        "safeinstall --forget --python /opt/venv --run 20261202T000000Z-2"
    ), said
    assert "(the newest: --undo's way back) makes the room" in drop_said(kept, 8 << 20, "/v")
    assert drop_said(kept, 10 << 20, "/v").endswith("even without them it would not fit")
    assert drop_said((), 1, "/v") == ""


def test_one_filesystem_sums_the_backup_the_run_cache_and_the_install() -> None:
    """Issue 44: where the state directory shares the environment's filesystem, the backup's copies,
    the run's cache and the install are there at once: one sum. The install hardlinks from the cache
    (no room of its own) unless uv copies (``--link-mode copy``); without a wheel, only the backup."""
    linked = shared_room(1 << 20, 12 << 20, "hardlink", True)
    assert (linked.copied, linked.cache, linked.install) == (1 << 20, 12 << 20, 0)
    assert linked.needed == (13 << 20) + install_overhead(12 << 20)
    copied = shared_room(1 << 20, 12 << 20, "copy", True)
    assert copied.needed == (25 << 20) + install_overhead(12 << 20)
    assert "the install (copied) 12.0 MiB" in copied.said("")
    assert shared_room(1 << 20, 0, "hardlink", False).needed == 1 << 20
