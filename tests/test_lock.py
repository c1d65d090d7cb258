"""The per-environment lock, against real second processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path

import pytest

from safeinstall.errors import ExitCode, LockHeldError
from safeinstall.system.identity import ProcessId, parse_stat, process_start
from safeinstall.system.lock import (
    LockHolder,
    acquire_lock,
    display_time,
    held_message,
    holder_alive,
    holder_to_json,
    parse_holder,
    read_holder,
    takeover_message,
)

ROOT = Path(__file__).resolve().parent.parent

HOLDER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from safeinstall.system.lock import acquire_lock
lock = acquire_lock(__import__("pathlib").Path(sys.argv[1]), "/some/venv", argv=["safeinstall", "pkg"])
print("acquired", flush=True)
time.sleep(120)
"""


@pytest.fixture
def holder_process(tmp_path: Path) -> Iterator[tuple[subprocess.Popen[str], Path]]:
    """A real second process that takes the lock and sleeps; killed (by its PID) afterwards."""
    path = tmp_path / "lock"
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(path), str(ROOT)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "acquired"
        yield proc, path
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)
        if proc.stdout is not None:
            proc.stdout.close()


def test_second_run_is_refused_naming_the_holder(holder_process: tuple[subprocess.Popen[str], Path]) -> None:
    proc, path = holder_process
    with pytest.raises(LockHeldError) as caught:
        acquire_lock(path, "/some/venv", grace_s=0)
    error = caught.value
    assert error.exit_code == ExitCode.REFUSED and int(error.exit_code) == 2
    assert f"another safeinstall run (PID {proc.pid}, started " in error.message
    assert "UTC) holds the lock for /some/venv" in error.message
    assert error.hint is not None and "safeinstall --recover" in error.hint
    held, named = read_holder(path)
    assert held and named is not None and named.pid == proc.pid and named.argv == ("safeinstall", "pkg")


def test_lock_of_a_killed_run_is_taken_over_and_reported(
    holder_process: tuple[subprocess.Popen[str], Path],
) -> None:
    proc, path = holder_process
    named = parse_holder(path.read_text())
    assert named is not None and holder_alive(named)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait(timeout=10)
    assert not holder_alive(named)
    with acquire_lock(path, "/some/venv", argv=["safeinstall", "x"]) as lock:
        assert lock.stale is not None and lock.stale.pid == proc.pid
        assert lock.takeover_note is not None
        assert lock.takeover_note.startswith(f"took over stale lock of PID {proc.pid}, started ")
        assert "gone" in lock.takeover_note
        mine = parse_holder(path.read_text())
        assert mine is not None and mine.pid == os.getpid() and mine.argv == ("safeinstall", "x")
        assert mine.process.start == process_start(os.getpid())
    assert path.read_text() == ""  # a clean release empties the file
    with acquire_lock(path, "/some/venv") as again:
        assert again.stale is None and again.takeover_note is None


def test_acquire_release_and_reacquire(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    with acquire_lock(path, "/v") as lock:
        assert lock.held
        with pytest.raises(LockHeldError):  # a second open file description conflicts, even in-process
            acquire_lock(path, "/v", grace_s=0)
        assert read_holder(path)[0]
    assert not lock.held
    assert read_holder(path) == (False, None)
    assert oct(os.stat(path).st_mode & 0o777) == oct(0o600)
    lock.release()  # idempotent


def test_lock_descriptor_is_not_inherited(tmp_path: Path) -> None:
    """A child started while the lock is held (uv, a restarted service) must not keep it locked."""
    path = tmp_path / "lock"
    lock = acquire_lock(path, "/v")
    child = subprocess.Popen(
        [sys.executable, "-c", "import time; print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
        text=True,
        close_fds=False,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
        fd_dir = Path(f"/proc/{child.pid}/fd")
        targets = {os.readlink(fd_dir / fd) for fd in os.listdir(fd_dir)}
        assert str(path) not in targets
        lock.release()
        with acquire_lock(path, "/v", grace_s=0) as again:
            assert again.held
    finally:
        os.kill(child.pid, signal.SIGKILL)
        child.wait(timeout=10)
        assert child.stdout is not None
        child.stdout.close()


def test_busy_lock_with_no_details_is_refused_after_the_grace(tmp_path: Path) -> None:
    path = tmp_path / "lock"
    with acquire_lock(path, "/v"):
        path.write_text("")  # as if the holder had not written its details yet
        with pytest.raises(LockHeldError, match=r"^another safeinstall run holds the lock for /v$"):
            acquire_lock(path, "/v", grace_s=0.1)


def test_a_process_start_is_read_past_odd_command_names() -> None:
    fields = " ".join(str(n) for n in range(3, 53))
    assert parse_stat(f"42 (we) (ird) {fields}").start_time == 22
    for malformed in ("garbage", "1 (x) S 1"):
        with pytest.raises(ValueError):
            parse_stat(malformed)
    own = process_start(os.getpid())
    assert own is not None and own > 0
    assert process_start(2**22 + 1) is None


def test_holder_json_round_trip_and_junk() -> None:
    holder = LockHolder(process=ProcessId(1234, 99), started_at="2026-11-30T03:12:01+00:00", argv=("a", "b"))
    assert parse_holder(holder_to_json(holder)) == holder
    assert parse_holder("") is None
    assert parse_holder("{not json") is None
    assert parse_holder('{"pid": "x"}') is None
    assert parse_holder("[1]") is None
    assert parse_holder('{"pid": 7}') == LockHolder(ProcessId(7, None), "an unknown time", ())


def test_messages_are_pure() -> None:
    holder = LockHolder(process=ProcessId(1234, None), started_at="2026-11-30T03:12:01+00:00", argv=())
    assert held_message(holder, "/path/venv") == (
        "another safeinstall run (PID 1234, started 2026-11-30 03:12:01 UTC) holds the lock for /path/venv"
    )
    assert takeover_message(holder, alive=False).startswith(
        "took over stale lock of PID 1234, started 2026-11-30 03:12:01 UTC"
    )
    assert display_time("not a time") == "not a time"
    assert display_time(datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC).isoformat()) == "2026-01-02 03:04:05 UTC"


def test_pid_reuse_is_not_mistaken_for_the_holder() -> None:
    me = process_start(os.getpid())
    assert me is not None
    assert holder_alive(LockHolder(ProcessId(os.getpid(), me), "", ()))
    assert not holder_alive(LockHolder(ProcessId(os.getpid(), me + 1), "", ()))  # same pid, another process
