"""Child processes never escape: killed and reaped when interrupted, and dead when safeinstall dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from safeinstall.system import children
from tests.bed_systemd import wait_until


def _alive(pid: int) -> bool:
    """Running (not a zombie, not gone)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rpartition(")")[2].split()[0] != "Z"


def _kill_if_alive(pid: int) -> None:
    if _alive(pid):
        os.kill(pid, signal.SIGKILL)


class Interrupted(Exception):
    pass


@pytest.fixture
def raising_sigint() -> Iterator[None]:
    """SIGINT raises, as during a safeinstall run (:mod:`safeinstall.system.signals`)."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(signal.Signals(signum).name)

    previous = signal.signal(signal.SIGINT, handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_output_and_exit_status(tmp_path: Path) -> None:
    done = children.run(
        [sys.executable, "-c", "import sys; print('out'); print('err', file=sys.stderr); sys.exit(3)"],
        env={},
        timeout=30,
    )
    assert (done.returncode, done.stdout, done.stderr) == (3, "out\n", "err\n")


def test_a_child_that_closes_its_output_and_runs_on_times_out_with_the_whole_timeout() -> None:
    with pytest.raises(subprocess.TimeoutExpired) as raised:
        children.run(["/bin/sh", "-c", "exec >&- 2>&-; exec sleep 60"], env={}, timeout=1)
    assert raised.value.timeout == 1


def test_timeout_kills_and_reaps_the_child(tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        children.run(["/bin/sh", "-c", f"echo $$ >{pid_file}; exec sleep 60"], env={}, timeout=1)
    pid = int(pid_file.read_text())
    assert not _alive(pid)


def test_timeout_kills_what_the_child_started_too(tmp_path: Path) -> None:
    """A shell's own child (``sh -c 'a; b'``, an operator's ``--smoke`` command) goes with it: the whole
    process group the child leads is killed, not the shell alone."""
    pid_file = tmp_path / "pid"
    with pytest.raises(subprocess.TimeoutExpired):
        children.run(["/bin/sh", "-c", f"sleep 60 & echo $! >{pid_file}; wait"], env={}, timeout=1)
    pid = int(pid_file.read_text())
    try:
        wait_until(lambda: not _alive(pid), 10, "the shell's own child gone")
    finally:
        _kill_if_alive(pid)


def test_a_signal_during_the_spawn_is_handled_once_the_child_is_known(
    raising_sigint: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """SIGINT right after the fork, before Popen() returns: with plain subprocess.run the handler's
    exception leaves Popen() and nobody kills the child; here it is killed and reaped first."""
    real_popen = subprocess.Popen
    started: list[int] = []

    def popen_then_signal(*args: object, **kwargs: object) -> subprocess.Popen[str]:
        proc: subprocess.Popen[str] = real_popen(*args, **kwargs)  # type: ignore[call-overload]
        started.append(proc.pid)
        os.kill(os.getpid(), signal.SIGINT)  # arrives "inside" Popen()
        time.sleep(0.1)  # a raising handler would have run by now
        return proc

    monkeypatch.setattr(subprocess, "Popen", popen_then_signal)
    try:
        with pytest.raises(Interrupted):
            children.run(["sleep", "60"], env={"PATH": os.environ["PATH"]}, timeout=30)
        (pid,) = started
        assert not _alive(pid), "the child outlived the interruption"
    finally:
        for pid in started:
            _kill_if_alive(pid)


def test_a_signal_during_the_wait_kills_and_reaps_the_child(raising_sigint: None, tmp_path: Path) -> None:
    pid_file = tmp_path / "pid"
    sender = subprocess.Popen(
        [sys.executable, "-c", f"import os, time; time.sleep(0.5); os.kill({os.getpid()}, 2)"]
    )
    try:
        with pytest.raises(Interrupted):
            children.run(["/bin/sh", "-c", f"echo $$ >{pid_file}; exec sleep 60"], env={}, timeout=30)
        pid = int(pid_file.read_text())
        assert not _alive(pid)
    finally:
        sender.wait()


def test_the_child_dies_with_a_killed_parent(tmp_path: Path) -> None:
    """SIGKILL (or the OOM killer) on safeinstall: its uv must not go on installing alone."""
    pid_file = tmp_path / "pid"
    script = (
        "import sys; import safeinstall.system.children as children; "
        f"children.run(['/bin/sh', '-c', 'echo $$ >{pid_file}; exec sleep 60'], env={{}}, timeout=120)"
    )
    parent = subprocess.Popen([sys.executable, "-c", script])
    try:
        wait_until(lambda: pid_file.is_file() and pid_file.read_text().strip() != "", 30, "the child")
        child = int(pid_file.read_text())
        assert _alive(child)
        parent.kill()
        parent.wait()
        wait_until(lambda: not _alive(child), 10, "the child to die with its parent")
    finally:
        parent.kill()
        parent.wait()
        if pid_file.is_file() and pid_file.read_text().strip():
            _kill_if_alive(int(pid_file.read_text()))


def test_a_child_that_cannot_start_is_an_os_error() -> None:
    with pytest.raises(FileNotFoundError):
        children.run(["/nonexistent/uv"], env={}, timeout=5)


def test_a_child_that_prints_without_end_is_killed_at_the_limit(tmp_path: Path) -> None:
    """The probe and uv run as the environment's owner: what they print is kept up to a limit, then
    the child is killed and reaped (unbounded, `yes` would fill root's memory before any timeout)."""
    pid_file = tmp_path / "pid"
    with pytest.raises(children.TooMuchOutput, match="printed more than 1048576 bytes on stderr"):
        children.run(
            ["/bin/sh", "-c", f"echo $$ >{pid_file}; exec yes >&2"],
            env={"PATH": os.environ["PATH"]},
            timeout=60,
            limit=1 << 20,
        )
    assert not _alive(int(pid_file.read_text()))
    assert issubclass(children.TooMuchOutput, OSError)  # callers report it as a child that failed


def test_output_up_to_the_limit_and_bytes_that_are_not_utf8() -> None:
    done = children.run(
        ["/bin/sh", "-c", "head -c 1048576 /dev/zero; printf 'a\\377b' >&2"],
        env={"PATH": os.environ["PATH"]},
        timeout=60,
        limit=1 << 20,
    )
    assert done.returncode == 0 and done.stdout == "\0" * (1 << 20) and done.stderr == "a\ufffdb"
