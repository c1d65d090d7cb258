"""Child processes never escape: killed and reaped when interrupted, and dead when safeinstall dies."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from types import FrameType

import pytest

from safeinstall.system import children
from tests.bed_systemd import wait_until
from tests.beds import NOBODY


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


def _spawn_with_pid(pid: int, attempts: int = 50) -> subprocess.Popen[bytes] | None:
    """A process of root's that leads a group of its own, given the number ``pid`` (``ns_last_pid``: the
    kernel hands out the next free number after it); None when other processes kept taking it."""
    for _ in range(attempts):
        if Path(f"/proc/{pid}").exists():
            return None  # taken by another process meanwhile: no number to reuse
        Path("/proc/sys/kernel/ns_last_pid").write_text(str(pid - 1))
        proc = subprocess.Popen(["sleep", "300"], start_new_session=True)
        if proc.pid == pid:
            return proc
        proc.kill()
        proc.wait()
    return None


def test_a_reaped_childs_number_is_never_signalled_again(open_dir: Path) -> None:
    """Once the child has exited, its group is ended and the child reaped: its number is then free for
    any new process. A process the child started in a session of its own (``setsid``: no group to end)
    still holds the output, and chooses when root ends the child anyway (it prints past the limit, or
    runs past the timeout): that must never signal the child's old group number again, which may by
    then name another's process group (the attacker review: root SIGKILLed a process of root's)."""
    mine = open_dir / "nobody"
    mine.mkdir()
    os.chown(mine, NOBODY, NOBODY)
    leader, escaped, go = mine / "leader", mine / "escaped", mine / "go"
    script = (
        f"echo $$ >{leader}; "
        f"setsid sh -c 'echo $$ >{escaped}; while [ ! -e {go} ]; do sleep 0.05; done; exec yes' </dev/null & "
        f"while [ ! -e {escaped} ]; do sleep 0.05; done; exit 0"
    )
    victims: list[subprocess.Popen[bytes] | None] = []

    def reuse_the_number() -> None:
        try:
            wait_until(lambda: leader.exists() and escaped.exists(), 30, "the child and its escapee")
            number = int(leader.read_text())
            wait_until(lambda: not Path(f"/proc/{number}").exists(), 30, "the child reaped")
            victims.append(_spawn_with_pid(number))
        finally:
            go.touch()

    helper = threading.Thread(target=reuse_the_number)
    helper.start()
    try:
        with pytest.raises(children.TooMuchOutput):
            children.run(
                ["/bin/sh", "-c", script],
                env={"PATH": os.environ["PATH"]},
                timeout=60,
                as_user=(NOBODY, NOBODY),
                limit=1 << 16,
                end_group=True,
            )
    finally:
        helper.join()
        if escaped.exists():
            _kill_if_alive(int(escaped.read_text()))
    victim = victims[0] if victims else None
    if victim is None:
        pytest.skip("the child's number was taken by another process of the machine before the test's")
    victim.terminate()  # ignored by a process being killed already: its status then says SIGKILL
    assert victim.wait() == -signal.SIGTERM, "root killed a process outside the child's group"


@pytest.mark.parametrize("as_user", [None, (NOBODY, NOBODY)], ids=["root", "account"])
def test_a_process_the_child_started_in_a_session_of_its_own_does_not_outlive_it(
    open_dir: Path, as_user: tuple[int, int] | None
) -> None:
    """The smoke check's promise (nothing it started is found using the package in the window, where it
    would be taken for a new user of the old version: a rollback) held for its process group only; a
    helper that ``setsid``\\ s (a daemonising import, or code of the unit's user's own) escaped it
    (issue 44). Now the child runs in a PID namespace of its own (``contain``): it ends with the child,
    as root and as an account."""
    if os.geteuid() != 0:
        pytest.skip("a PID namespace of its own is made for a run as root")
    mine = open_dir / "nobody"
    mine.mkdir()
    os.chown(mine, NOBODY, NOBODY)
    escaped = mine / "escaped"
    # the escapee's number as the machine sees it (this /proc is the machine's, not the namespace's)
    record = f"read -r pid rest </proc/self/stat; echo $pid >{escaped}.tmp; mv {escaped}.tmp {escaped}"
    script = (
        f"setsid sh -c '{record}; exec sleep 300' </dev/null >/dev/null 2>&1 & "
        f"while [ ! -e {escaped} ]; do sleep 0.05; done"
    )
    children.run(
        ["/bin/sh", "-c", script], env={"PATH": os.environ["PATH"]}, timeout=60, as_user=as_user,
        end_group=True, contain=True,
    )  # fmt: skip
    pid = int(escaped.read_text())
    try:
        assert not _alive(pid), "a process the check started runs on"
    finally:
        _kill_if_alive(pid)


_SEEN_SOURCE = r"""
#include <stdio.h>
#include <unistd.h>
__attribute__((constructor)) static void seen(void) {
    char comm[64] = {0};
    FILE *c = fopen("/proc/self/comm", "r");
    if (c) { if (!fgets(comm, sizeof comm, c)) comm[0] = 0; fclose(c); }
    FILE *f = fopen(SEEN_LOG, "a");
    if (f) { fprintf(f, "%d %s", (int)geteuid(), comm); fclose(f); }
}
"""


def test_the_accounts_loader_variables_are_never_loaded_by_roots_wrappers(open_dir: Path) -> None:
    """A contained child as an account ran root's ``unshare`` and ``setpriv`` with the child's whole
    environment: a unit's ``LD_PRELOAD`` (or ``LD_LIBRARY_PATH``) naming the account's own files, kept
    for the account's child, was loaded by root: code of the account run as root (the attacker review).
    Now the wrappers never see the loader's variables; the command still gets them, as the account."""
    if os.geteuid() != 0:
        pytest.skip("a PID namespace of its own is made for a run as root")
    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler")
    mine = open_dir / "nobody"
    mine.mkdir()
    mine.chmod(0o777)
    log = mine / "seen.log"
    log.touch()
    log.chmod(0o666)
    source = open_dir / "seen.c"
    source.write_text(_SEEN_SOURCE)
    library = mine / "libseen.so"
    subprocess.run(
        [gcc, "-shared", "-fPIC", f'-DSEEN_LOG="{log}"', "-o", str(library), str(source)], check=True
    )
    os.chown(library, NOBODY, NOBODY)  # the account's own file, as the unit's EnvironmentFile= names it
    done = children.run(
        ["/bin/sh", "-c", "echo $LD_PRELOAD; env | grep -c HELD || true"],
        env={"PATH": os.environ["PATH"], "LD_PRELOAD": str(library)},
        timeout=60, as_user=(NOBODY, NOBODY), contain=True,
    )  # fmt: skip
    seen = log.read_text().splitlines()
    assert not [line for line in seen if line.startswith("0 ")], f"root loaded the account's: {seen}"
    assert any(line.startswith(f"{NOBODY} ") for line in seen), (seen, done.stderr)
    assert done.stdout.split() == [str(library), "0"], done  # given back as it was, nothing else left


def test_the_loader_variables_are_held_from_the_wrappers() -> None:
    """Pure: every variable the loader or glibc loads from is held (under another name, given back as
    the account); one no shell can name is dropped (glibc reads none such); the rest pass."""
    env = {
        "LD_LIBRARY_PATH": "/srv/a", "LD_PRELOAD": "/srv/b.so", "GCONV_PATH": "/srv/c",
        "GLIBC_TUNABLES": "x", "MALLOC_ARENA_MAX": "2", "LD_BAD-NAME": "y", "HOME": "/srv", "TZ": ":/srv/z",
    }  # fmt: skip
    kept, restore = children.held_environment(env)
    assert not [name for name in kept if name.startswith(("LD_", "GCONV", "GLIBC", "MALLOC", "TZ"))], kept
    assert kept["HOME"] == "/srv" and kept[children.HELD_PREFIX + "LD_PRELOAD"] == "/srv/b.so"
    done = subprocess.run(
        [*restore, "/bin/sh", "-c", 'echo "$LD_LIBRARY_PATH|$GLIBC_TUNABLES|$TZ|$(env | grep -c HELD)"'],
        env=kept, capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert done.stdout == "/srv/a|x|:/srv/z|0\n", done


def test_a_cancelled_child_is_killed_with_its_group_and_reaped(tmp_path: Path) -> None:
    """``cancel`` set by another thread (the run stopped while a check ran in the background): the
    child, and what it started, are gone when :class:`children.Cancelled` is raised."""
    pids = tmp_path / "pids"
    cancel = threading.Event()
    script = f"sleep 600 & echo $! >{pids}.tmp; echo $$ >>{pids}.tmp; mv {pids}.tmp {pids}; wait"
    caught: list[BaseException] = []

    def waiting() -> None:
        try:
            children.run(["/bin/sh", "-c", script], env={"PATH": "/usr/bin:/bin"}, timeout=600, cancel=cancel)
        except BaseException as exc:
            caught.append(exc)

    thread = threading.Thread(target=waiting)
    thread.start()
    wait_until(pids.exists, 30, "the child and its sleep started")
    started = [int(pid) for pid in pids.read_text().split()]
    try:
        cancel.set()
        thread.join(60)
        assert not thread.is_alive()
        assert len(caught) == 1 and isinstance(caught[0], children.Cancelled), caught
        wait_until(lambda: not any(map(_alive, started)), 10, "the child and its sleep gone")
    finally:
        for pid in started:
            _kill_if_alive(pid)


def test_a_child_started_from_a_thread_with_the_signals_blocked_gets_them_unblocked() -> None:
    """A check runs in a thread started with SIGINT/SIGTERM/SIGHUP blocked (only the main thread handles
    them): the program it runs must not inherit the mask (a ``timeout`` in an operator's ``--smoke``
    command could not end what it runs)."""
    answer: list[str] = []

    def spawn() -> None:
        done = children.run(["/bin/grep", "^SigBlk", "/proc/self/status"], env={}, timeout=30)
        answer.append(done.stdout)

    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    try:
        thread = threading.Thread(target=spawn)
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
    thread.join(60)
    assert answer and int(answer[0].split()[1], 16) == 0, answer
