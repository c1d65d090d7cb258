"""The run journal: durable atomic writes, strict reading, and the pure recovery decisions."""

from __future__ import annotations

import json
import os
import stat
from datetime import UTC, datetime
from pathlib import Path

import pytest

from safeinstall.errors import SafeInstallError
from safeinstall.store.journal import (
    PHASE_ORDER,
    HistoryEntry,
    Journal,
    JournalError,
    JournalUnit,
    Phase,
    advance,
    clear_journal,
    effective_phase,
    journal_from_dict,
    journal_to_dict,
    needs_restore,
    new_journal,
    read_journal,
    start_journal,
    units_to_start,
    update_unit,
    write_journal,
)
from safeinstall.system.identity import ProcessId

T0 = datetime(2026, 11, 30, 3, 12, 1, tzinfo=UTC)
UNITS = (
    JournalUnit("api.service", user_manager=False, was_active=True, unit_file_state="enabled"),
    JournalUnit("batch.service", user_manager=False, was_active=False, unit_file_state="disabled"),
    JournalUnit("me.service", user_manager=True, was_active=True, unit_file_state="static"),
)


def sample() -> Journal:
    return new_journal(
        run_id="20261130T031201Z-1234",
        process=ProcessId(1234, 5678),
        python="/opt/venv/bin/python",
        prefix="/opt/venv",
        package="sipure",
        wheel="/tmp/sipure-2.0-py3-none-any.whl",
        uv_command=["uv", "pip", "install", "--python", "/opt/venv/bin/python", "sipure==2.0"],
        units=UNITS,
        note="plan accepted",
        now=T0,
    )


def full_run() -> Journal:
    j = sample()
    j = advance(j, Phase.BACKED_UP, "12 files", backup_dir="/var/lib/safeinstall/x/backups/r")
    j = advance(j, Phase.GATED, gate=["/run/systemd/system/api.service.d/50-safeinstall.conf"])
    j = advance(j, Phase.STOPPING)
    j = update_unit(j, "api.service", False, stopped=True)
    j = update_unit(j, "me.service", True, stopped=True)
    j = advance(j, Phase.STOPPED, strays_killed=[4321, 4322])
    return j


def test_round_trip(tmp_path: Path) -> None:
    written = full_run()
    write_journal(tmp_path, written)
    read = read_journal(tmp_path)
    assert read == written
    assert isinstance(read.units, tuple) and isinstance(read.strays_killed, tuple)
    assert [h.phase for h in read.history] == [
        Phase.PLANNED,
        Phase.BACKED_UP,
        Phase.GATED,
        Phase.STOPPING,
        Phase.STOPPED,
    ]
    assert read.history[1].note == "12 files" and read.history[0].at.startswith("2026-11-30T03:12:01")
    data = json.loads((tmp_path / "journal.json").read_text())
    assert data["version"] == 1 and data["phase"] == "stopped" and data["strays_killed"] == [4321, 4322]
    assert stat.S_IMODE(os.stat(tmp_path / "journal.json").st_mode) == 0o600


def test_advance_is_pure_and_checked() -> None:
    j = sample()
    k = advance(j, Phase.BACKED_UP, backup_dir="/b")
    assert j.phase == Phase.PLANNED and j.backup_dir is None and len(j.history) == 1
    assert k.phase == Phase.BACKED_UP and k.backup_dir == "/b" and len(k.history) == 2
    with pytest.raises(TypeError, match="no_such_field"):
        advance(j, Phase.GATED, no_such_field=1)
    with pytest.raises(TypeError, match="history"):
        advance(j, Phase.GATED, history=())
    with pytest.raises(KeyError):
        update_unit(j, "api.service", True, stopped=True)  # the system unit, not a user one


def test_writes_are_atomic_and_leave_no_temp_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = sample()
    write_journal(tmp_path, first)
    for phase in PHASE_ORDER[1:6]:
        write_journal(tmp_path, advance(first, phase))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal.json"]

    def crash(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(JournalError, match="No space left") as caught:
        write_journal(tmp_path, advance(first, Phase.INSTALLING))
    assert caught.value.hint
    monkeypatch.undo()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal.json"]  # temp removed
    reread = read_journal(tmp_path)
    assert reread is not None and reread.phase == PHASE_ORDER[5]  # the last whole state


def test_read_missing_and_damaged(tmp_path: Path) -> None:
    assert read_journal(tmp_path) is None
    path = tmp_path / "journal.json"
    text = json.dumps(journal_to_dict(full_run()))
    for damaged in (text[: len(text) // 2], "", "[]", text.replace('"stopped"', '"exploded"', 1)):
        path.write_text(damaged)
        with pytest.raises(JournalError, match="is damaged") as caught:
            read_journal(tmp_path)
        assert caught.value.hint and "rm " in caught.value.hint
    path.write_text(text.replace('"version": 1', '"version": 9'))
    with pytest.raises(JournalError, match="version 9"):
        read_journal(tmp_path)
    path.write_bytes(b"\xff\xfe\x00")
    with pytest.raises(JournalError):
        read_journal(tmp_path)


def test_from_dict_rejects_wrong_types() -> None:
    data = journal_to_dict(full_run())
    for key, bad in (("pid", "1234"), ("pid", True), ("units", {}), ("strays_killed", ["x"]), ("phase", 3)):
        with pytest.raises(ValueError):
            journal_from_dict({**data, key: bad})
    assert journal_from_dict({**data, "wheel": None}).wheel is None


def test_start_refuses_while_a_previous_journal_is_there_and_clear(tmp_path: Path) -> None:
    def start() -> Journal:
        return start_journal(tmp_path, new_journal("r1", ProcessId(1, None), "/p", "/v", "x", None, ["uv"]))

    started = start()
    assert read_journal(tmp_path) == started and started.phase == Phase.PLANNED
    with pytest.raises(JournalError, match="did not finish") as caught:
        start()
    assert caught.value.hint and "--recover" in caught.value.hint
    (tmp_path / ".journal.json.abc.tmp").write_text("{")  # what a crash between write and rename leaves
    clear_journal(tmp_path)
    assert list(tmp_path.iterdir()) == []
    clear_journal(tmp_path)  # nothing there: fine
    start()


@pytest.mark.parametrize(
    ("phase", "restore"),
    [
        (Phase.PLANNED, False),
        (Phase.BACKED_UP, False),
        (Phase.GATED, False),
        (Phase.STOPPING, False),
        (Phase.STOPPED, False),
        (Phase.GPU_RELEASED, False),
        (Phase.INSTALLING, True),
        (Phase.INSTALLED, True),
        (Phase.VERIFIED, False),
        (Phase.RESTARTING, False),
        (Phase.DONE, False),
        (Phase.ROLLING_BACK, True),
        (Phase.ROLLED_BACK, False),
        (Phase.STAGED, False),
        (Phase.PREPARED, False),  # --prepare: nothing stopped, nothing changed in place
        (Phase.SWAPPING, True),
    ],
)
def test_needs_restore_per_phase(phase: Phase, restore: bool) -> None:
    assert needs_restore(advance(full_run(), phase)) is restore


def test_phases_are_in_order() -> None:
    assert [p.value for p in PHASE_ORDER] == [
        "planned",
        "backed-up",
        "staged",
        "prepared",
        "gated",
        "stopping",
        "stopped",
        "gpu-released",
        "installing",
        "swapping",
        "installed",
        "verified",
        "restarting",
        "done",
        "rolling-back",
        "rolled-back",
        "failed",
    ]


def test_failed_is_judged_by_the_phase_it_failed_in() -> None:
    during_install = advance(advance(full_run(), Phase.INSTALLING), Phase.FAILED, "uv exited 1")
    assert effective_phase(during_install) == Phase.INSTALLING and needs_restore(during_install)
    before_install = advance(full_run(), Phase.FAILED, "stop timed out")
    assert effective_phase(before_install) == Phase.STOPPED and not needs_restore(before_install)
    after_verify = advance(advance(full_run(), Phase.VERIFIED), Phase.FAILED)
    assert not needs_restore(after_verify)
    bare = Journal(
        "r",
        ProcessId(1, None),
        "t",
        "/p",
        "/v",
        "x",
        None,
        (),
        Phase.FAILED,
        history=(HistoryEntry(Phase.FAILED, "t"),),
    )
    assert effective_phase(bare) == Phase.PLANNED


def test_units_to_start_are_the_stopped_ones_that_ran() -> None:
    j = full_run()
    assert [u.name for u in units_to_start(j)] == ["api.service", "me.service"]
    j = update_unit(j, "batch.service", False, stopped=True)  # stopped, but was not running: stays down
    assert [u.name for u in units_to_start(j)] == ["api.service", "me.service"]
    assert units_to_start(sample()) == []


def test_journal_error_is_a_safeinstall_error() -> None:
    assert issubclass(JournalError, SafeInstallError)
    assert JournalError("x").code == "journal" and JournalError("x").exit_code == 2
