"""``ProcessId``: one process across PID reuse, and its checked constructor for untrusted values."""

from __future__ import annotations

import json
import os

import pytest

from safeinstall.run.parts.output import jsonable
from safeinstall.scan.plan import PlannedProcess
from safeinstall.store.journal import journal_from_dict, journal_to_dict, new_journal
from safeinstall.system.identity import PID_MAX, START_MAX, ProcessId, alive, own_process, process_start
from safeinstall.system.lock import LockHolder, holder_to_json, parse_holder


def test_checked_takes_a_pid_and_a_start_or_none() -> None:
    assert ProcessId.checked(1, 0) == ProcessId(1, 0)
    assert ProcessId.checked(PID_MAX, START_MAX - 1) == ProcessId(PID_MAX, START_MAX - 1)
    assert ProcessId.checked(42, None) == ProcessId(42, None)


@pytest.mark.parametrize(
    ("pid", "start"),
    [
        (0, 1),  # no process has PID 0 in /proc
        (-1, 1),  # kill(-1) signals every process
        (True, 1),  # a bool is an int to Python, not to a state file
        ("42", 1),
        (42.0, 1),
        (None, 1),
        (PID_MAX + 1, 1),  # above the kernel's PID_MAX_LIMIT
        (2**64, 1),
        (42, -1),
        (42, False),
        (42, "5"),
        (42, 1.5),
        (42, START_MAX),
        (42, [1]),
    ],
)
def test_checked_refuses_what_names_no_process(pid: object, start: object) -> None:
    with pytest.raises(ValueError, match="not a process"):
        ProcessId.checked(pid, start)


def test_own_process_is_alive_and_another_start_is_not() -> None:
    me = own_process()
    assert me.pid == os.getpid() and me.start == process_start(os.getpid()) and me.start is not None
    assert alive(me) and alive(ProcessId(me.pid, None))
    assert not alive(ProcessId(me.pid, me.start + 1))  # the same PID, another process


def test_the_lock_file_keeps_its_flat_format_and_checks_its_process() -> None:
    holder = LockHolder(ProcessId(1234, 99), "2026-11-30T03:12:01+00:00", ("a",))
    assert json.loads(holder_to_json(holder)) == {
        "version": 1,
        "pid": 1234,
        "process_start": 99,
        "started_at": "2026-11-30T03:12:01+00:00",
        "argv": ["a"],
    }
    for pid in (-5, 0, PID_MAX + 1, True, "7"):
        assert parse_holder(json.dumps({"pid": pid, "process_start": 99})) is None
    for start in (-1, True, "x", START_MAX):  # a start that is none: the PID alone decides
        read = parse_holder(json.dumps({"pid": 7, "process_start": start}))
        assert read is not None and read.process == ProcessId(7, None)


def test_the_journal_keeps_its_flat_format_and_refuses_a_process_that_is_none() -> None:
    journal = new_journal("r1", ProcessId(1234, 5678), "/p", "/v", "x", None, ["uv"])
    data = journal_to_dict(journal)
    assert (data["pid"], data["process_start"]) == (1234, 5678) and "process" not in data
    assert journal_from_dict(data) == journal
    assert journal_from_dict({**data, "process_start": None}).process == ProcessId(1234, None)
    for key, bad in (("pid", -1), ("pid", 0), ("pid", PID_MAX + 1), ("process_start", -1)):
        with pytest.raises(ValueError, match="not a process"):
            journal_from_dict({**data, key: bad})


def test_a_planned_process_shows_flat_in_json() -> None:
    planned = PlannedProcess(
        process=ProcessId(31, 4242),
        user="root",
        name="python",
        cmdline=("python",),
        unit="a.service",
        scope=None,
        evidence=("mapped",),
        details=("maps x.so",),
        distributions=("x",),
        running_old_code=False,
        gpu_bytes=None,
    )
    shown = jsonable(planned)
    assert list(shown)[:3] == ["pid", "start_time", "user"]  # as docs/json.md lists them
    assert (shown["pid"], shown["start_time"]) == (31, 4242) and "process" not in shown
