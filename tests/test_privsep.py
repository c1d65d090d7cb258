"""The privilege boundary: what the environment's owner (or any local user) could make root do.

Each test is an attack an unprivileged account tried on a run as root (issue 21), with real accounts
(uid 65534 owns the environment and runs its unit; uid 65533 is another local user), real uv, real
wheels and a unit of the private systemd manager. Since the fix, everything done to an account's
environment on the strength of what the account wrote runs as that account, in a session of its own
(:mod:`safeinstall.system.worker`, :mod:`safeinstall.env.owner`).
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import http.server
import os
import pty
import select
import signal
import subprocess
import termios
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import wheelhouse
from tests.beds import (
    AS_ROOT,
    NOBODY,
    OTHER,
    ServiceAccountBed,
    chown_tree,
    shared_interpreter_or_skip,
)
from tests.clirun import SAFEINSTALL, run

pytestmark = pytest.mark.skipif(not AS_ROOT, reason="the attacks are on a run as root")


def _owned_file(path: Path, text: str = "") -> Path:
    path.write_text(text)
    os.chown(path, NOBODY, NOBODY)
    return path


def _setpriv(uid: int) -> list[str]:
    """The command prefix that runs a program as ``uid`` alone (its own gid, no other group)."""
    return ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups"]


def _started_as(uid: int, ready: Path, *argv: str) -> subprocess.Popen[bytes]:
    """``python ARGV... READY`` as ``uid`` (its own gid, no other group), once it has made ``READY``
    (or 30 s have passed): the test kills it by its PID."""
    proc = subprocess.Popen(
        [
            "setpriv",
            f"--reuid={uid}",
            f"--regid={uid}",
            "--clear-groups",
            shared_interpreter_or_skip(),
            *argv,
            str(ready),
        ],
        cwd="/",
    )
    deadline = time.monotonic() + 30
    while not ready.exists() and time.monotonic() < deadline and proc.poll() is None:
        time.sleep(0.01)
    return proc


# --- 1. code run as the owner reaches root's terminal ------------------------------------------------

TTY_PROBE = (
    "import os\n"
    "def _try(marker):\n"
    "    try:\n"
    "        fd = os.open('/dev/tty', os.O_RDWR | os.O_NOCTTY)\n"
    "    except OSError as exc:\n"
    "        said = 'refused ' + str(exc.errno)\n"
    "    else:\n"
    "        os.close(fd)\n"
    "        said = 'opened'\n"
    "    with open(marker, 'a') as out:\n"
    "        out.write(said + '\\n')\n"
)


def _on_a_terminal(argv: list[str], env: dict[str, str], timeout: float = 180) -> tuple[int, str]:
    """Run ``argv`` as the session leader of a new pseudo-terminal, which is its controlling terminal
    (as root's shell over SSH is); its exit status and what it printed there."""
    master, slave = pty.openpty()

    def controlling() -> None:
        os.setsid()
        fcntl.ioctl(0, termios.TIOCSCTTY, 0)

    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave, env=env, preexec_fn=controlling)
    os.close(slave)
    output = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.5)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError as exc:  # EIO: every process of the terminal is gone
                    if exc.errno != errno.EIO:
                        raise
                    break
                if not chunk:
                    break
                output += chunk
            elif proc.poll() is not None:
                break
        return proc.wait(timeout=max(1.0, deadline - time.monotonic())), output.decode(errors="replace")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        os.close(master)


def test_code_run_as_the_owner_cannot_open_roots_terminal(account: ServiceAccountBed) -> None:
    """Row 1: a ``.pth`` file of the account's venv (run when uv starts the interpreter as the account)
    and the account's own ``bin/python`` (a wrapper: run by the probe) open ``/dev/tty``. Run as root
    from a terminal, every child was in root's session and kept root's controlling terminal: escape
    sequences reached it, and TIOCSTI pushed commands into root's shell. Now each child has a session
    of its own: ``/dev/tty`` cannot be opened (ENXIO)."""
    marker = _owned_file(account.base / "tty-marker")
    probe = _owned_file(account.base / "tty_probe.py", TTY_PROBE)
    _owned_file(
        account.site / "zz-tty.pth",
        f"import runpy; runpy.run_path({str(probe)!r})['_try']({str(marker)!r})\n",
    )
    real = os.path.realpath(account.python)
    wrapper = account.base / "venv" / "bin" / "python-wrapped"
    _owned_file(
        wrapper,
        "#!/bin/sh\n"
        f"if (exec 3<>/dev/tty) 2>/dev/null; then echo opened >> {marker}\n"
        f"else echo refused >> {marker}; fi\n"
        f'exec {real} "$@"\n',
    )
    wrapper.chmod(0o755)
    args = ["sicext", "--user", "--wheel", str(account.wheels["sicext-2"]), "--dry-run"]
    code, said = _on_a_terminal([SAFEINSTALL, *args, "--python", str(account.python)], account.environ())
    assert code == 0, said
    _on_a_terminal([SAFEINSTALL, *args, "--python", str(wrapper)], account.environ())  # refused or not
    lines = marker.read_text().split()
    assert lines.count("opened") == 0, f"code run as the account opened root's terminal: {lines}"
    assert "refused" in lines  # the wrapper ran, as the probe, and could not open it
    assert any(line.isdigit() and int(line) == errno.ENXIO for line in lines), lines  # the .pth ran too


# --- 2. a RECORD written by the owner names root's files ---------------------------------------------

TAMPER_THEN_CRASH = """
import glob, os

def main():
    site = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for record in glob.glob(os.path.join(site, "sicext-*.dist-info", "RECORD")):
        with open(record, "a") as out:
            out.write("../../../pyvenv.cfg,,\\n../../../include/ROOT_ONLY.txt,,\\n")
    raise SystemExit("the new version named root's files in its RECORD, then crashed")
"""


@pytest.fixture
def handed(account: ServiceAccountBed) -> ServiceAccountBed:
    """Root made the venv and handed its ``lib/`` and ``bin/`` to the account (the README's own case):
    the prefix itself, its ``pyvenv.cfg`` and ``include/`` stay root's."""
    prefix = account.base / "venv"
    os.chown(prefix, 0, 0)
    os.chown(prefix / "pyvenv.cfg", 0, 0)
    include = prefix / "include"
    include.mkdir(exist_ok=True)
    (include / "ROOT_ONLY.txt").write_text("root's own\n")
    chown_tree(include, 0)
    return account


def test_a_record_the_owner_wrote_never_makes_root_delete_what_the_owner_could_not(
    handed: ServiceAccountBed, tmp_path: Path
) -> None:
    """Row 2: while the run installs, the account appends ``../../../pyvenv.cfg`` and
    ``../../../include/ROOT_ONLY.txt`` to the new version's RECORD and makes it crash: the rollback
    removed what that RECORD lists, as root, and so deleted two root-owned files the account could not
    delete itself. Now the removal runs as the account: both files stay, and the rollback succeeds."""
    prefix = handed.base / "venv"
    wheel = wheelhouse.rebuilt(
        handed.wheels["sicext-2"], tmp_path / "tamper", {"sicext/serve.py": TAMPER_THEN_CRASH.encode()}
    )
    name = handed.unit("tamper")
    result = handed.cli("sicext", "--wheel", str(wheel), "--yes", "--settle", "2", "--json")
    assert result.code == 3, result.stdout + result.stderr
    assert (prefix / "pyvenv.cfg").is_file(), "root deleted the venv's pyvenv.cfg on the account's word"
    assert (prefix / "include" / "ROOT_ONLY.txt").read_text() == "root's own\n"
    assert "restored the previous installation" in result.json["errors"][0]["message"]
    handed.manager.wait_active(name)


# --- 3. index credentials on a command line ----------------------------------------------------------

TOKEN = "s3cr3t-T0KEN"

SNOOP = """
import os, sys
token = sys.stdin.read().encode()
found = []
for pid in os.listdir("/proc"):
    if not pid.isdigit():
        continue
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\\0")
    except OSError:
        continue
    if any(token in arg for arg in argv):
        found.append("+".join(os.path.basename(a).decode(errors="replace") for a in argv[:2]))
print(" ".join(found))
"""


class _Index(http.server.BaseHTTPRequestHandler):
    """An index that answers nothing: while uv waits for it, another local user looks at every
    command line on the host."""

    seen: list[tuple[str, str]] = []  # noqa: RUF012 - one server per test
    interpreter = ""

    def do_GET(self) -> None:
        snooped = subprocess.run(
            [
                "setpriv",
                f"--reuid={OTHER}",
                f"--regid={OTHER}",
                "--clear-groups",
                self.interpreter,
                "-c",
                SNOOP,
            ],
            input=TOKEN,
            capture_output=True,
            text=True,
            timeout=60,
            cwd="/",
        )
        self.seen.append((self.headers.get("Authorization") or "", snooped.stdout.strip() + snooped.stderr))
        self.send_response(404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def index() -> Iterator[tuple[int, type[_Index]]]:
    handler = type("Index", (_Index,), {"seen": [], "interpreter": shared_interpreter_or_skip()})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1], handler
    finally:
        server.shutdown()
        server.server_close()


def test_index_credentials_are_never_on_a_command_line_another_user_can_read(
    account: ServiceAccountBed, index: tuple[int, type[_Index]]
) -> None:
    """Row 3: credentials given after ``--`` (``--index-url http://user:TOKEN@host/simple``) were on the
    argv of every uv child, readable by every local user in ``/proc/*/cmdline``. Now they reach uv in
    its environment (``UV_INDEX_URL``), which only uv's own account can read: uv still authenticates
    with them, and another user looking at every command line while uv waits on the index sees none."""
    port, handler = index
    url = f"http://agent:{TOKEN}@127.0.0.1:{port}/simple"
    result = account.cli("sicext", "--dry-run", "--json", "--", "--index-url", url)
    assert handler.seen, result.stdout + result.stderr
    for authorization, snooped in handler.seen:
        assert authorization == "Basic " + base64.b64encode(f"agent:{TOKEN}".encode()).decode()
        # safeinstall's own command line is the caller's choice (the README says how to keep it clean)
        readers = [name for name in snooped.split() if "safeinstall" not in name.split("+")]
        assert readers == [], f"another user read the token in the command line of {readers}"
    assert result.code == 2  # the index has no sicext: refused, nothing stopped
    assert TOKEN not in result.stdout


# --- 4. the owner keeps filling the run's uv cache ---------------------------------------------------

FEEDER = """
import os, sys
cache = os.environ.get("UV_CACHE_DIR")
pidfile = {pidfile!r}
claimed = None
if cache and "uv-cache-" in cache:
    try:
        claimed = os.open(pidfile, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        pass
if claimed is not None and os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.write(claimed, str(os.getpid()).encode())
        os.close(claimed)
        null = os.open(os.devnull, os.O_RDWR)
        for fd in (0, 1, 2):  # uv's pipes: uv would wait for them to close
            os.dup2(null, fd)
        # no longer a process of the environment's interpreter: the base one, without site
        os.execv(os.path.realpath(sys.executable), ["feeder", "-I", "-S", "-c", LOOP, cache])
    os._exit(0)
if claimed is not None:
    os.close(claimed)
"""

LOOP = """
import os, sys, time
cache = sys.argv[1]
end = time.monotonic() + 300
n = 0
while time.monotonic() < end and os.path.isdir(os.path.dirname(cache)):
    try:
        os.makedirs(os.path.join(cache, "feed-%d" % n, "a", "b"))
    except OSError:
        pass
    n += 1
    time.sleep(0.002)  # gently: the cache need only never be empty
"""


def test_an_owner_that_keeps_filling_the_runs_cache_cannot_hold_the_units_down(
    account: ServiceAccountBed,
) -> None:
    """Row 4: the account's ``.pth`` learns the run's uv cache (``UV_CACHE_DIR``, in every uv call) and
    keeps making directories in it; the rollback deleted that cache before restoring, and went on as
    long as the account kept filling it (the unit was down 150 s). Now the cache is removed as the
    account, within a bound, and the restore goes on past it; what is left goes after the restart."""
    pidfile = account.base / "feeder.pid"
    feeder_code = f"LOOP = {LOOP!r}\n" + FEEDER.format(pidfile=str(pidfile))
    script = _owned_file(account.base / "feeder.py", feeder_code)
    _owned_file(account.site / "zz-feed.pth", f"import runpy; runpy.run_path({str(script)!r})\n")
    os.chown(account.base, NOBODY, NOBODY)  # the pid file is the account's to write
    name = account.unit("fed")
    feeder = 0
    try:
        result = account.cli(
            "sicext",
            "--wheel",
            str(account.wheels["sicext-3"]),
            "--yes",
            "--settle",
            "1",
            "--json",
            "--no-smoke",
        )
        assert pidfile.exists(), "the feeder never started (uv ran no .pth with UV_CACHE_DIR)"
        feeder = int(pidfile.read_text())
        assert result.code == 3, result.stdout + result.stderr
        log = Path(result.json["data"]["log_file"]).read_text()
        assert "still being filled" in log, log
        os.kill(feeder, 0)  # the owner's feeder was still at it when the units were back: it held nothing
        account.manager.wait_active(name)
    finally:
        if feeder:  # started by this test's .pth, ended by its PID
            with contextlib.suppress(ProcessLookupError):
                os.kill(feeder, signal.SIGKILL)


# --- 5. the owner writes a backed-up file through a descriptor ---------------------------------------

TAMPER_BACKUP = """
import os, sys, time
path = sys.argv[1]
inode = os.stat(path).st_ino
open(sys.argv[2], "w").close()
end = time.monotonic() + 120
while time.monotonic() < end:
    try:
        info = os.stat(path)
    except OSError:
        break
    if info.st_ino != inode:  # replaced by the install: too late
        break
    if info.st_nlink == 2:  # linked into the backup: write it (through a descriptor, then let it go)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        os.write(fd, b"tampered,,\\n")
        os.close(fd)
        break
    time.sleep(0.0002)
"""


def test_a_backup_is_never_an_inode_its_owner_can_write(account: ServiceAccountBed, tmp_path: Path) -> None:
    """Row 5: the backup hardlinked the installed RECORD (the account's inode); the account, watching
    it, appended to it once its link count was 2. The restore then failed its check (exit 4), the
    unit stayed down, and every ``--recover`` failed the same way. Now an inode the account can write
    is copied into the backup (root's own file): the restore succeeds (exit 3)."""
    record = next(account.site.glob("sicext-*.dist-info")) / "RECORD"
    ready = account.base / "tamper-ready"
    script = _owned_file(account.base / "tamper.py", TAMPER_BACKUP)
    os.chown(account.base, NOBODY, NOBODY)
    tamperer = _started_as(NOBODY, ready, str(script), str(record))
    try:
        name = account.unit("tampered")
        result = account.cli(
            "sicext",
            "--wheel",
            str(account.wheels["sicext-3"]),
            "--yes",
            "--settle",
            "1",
            "--json",
            "--no-smoke",
        )
        assert result.code == 3, result.stdout + result.stderr
        assert next(account.site.glob("sicext-*.dist-info")).name.startswith("sicext-1")
        assert "tampered" not in (next(account.site.glob("sicext-*.dist-info")) / "RECORD").read_text()
        account.manager.wait_active(name)
    finally:
        tamperer.kill()
        tamperer.wait()


# --- 6. another user holds uv's lock -----------------------------------------------------------------

HOLD = """
import fcntl, os, socket, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_EX)
# hide the descriptor: in flight in a socket, it is in no /proc/PID/fd, and the lock stays
hide, keep = socket.socketpair(socket.AF_UNIX)
socket.send_fds(hide, [b"x"], [fd])
os.close(fd)
open(sys.argv[2], "w").close()
time.sleep(300)
"""


def test_another_user_holding_uvs_lock_cannot_hold_the_window_open(account: ServiceAccountBed) -> None:
    """Row 6: uv creates ``PREFIX/.lock`` mode 0666; any local user opened it, took the lock once the
    service was down and kept it: the install waited (300 s by default). Now the run puts a new lock
    file, the owner's alone (0600), in its place before the stop: the other user holds the lock of a
    file uv no longer uses, and the run does not wait for it."""
    prefix = account.base / "venv"
    lock = prefix / ".lock"
    lock.touch()
    os.chown(lock, NOBODY, NOBODY)
    lock.chmod(0o666)  # as uv makes it
    held = os.stat(lock).st_ino
    ready = Path(f"/tmp/si-lock-ready-{os.getpid()}")
    holder = _started_as(OTHER, ready, "-c", HOLD, str(lock))
    try:
        assert ready.exists(), "the other user could not take the lock"
        name = account.unit("locked")
        environ = {**account.environ(), "UV_LOCK_TIMEOUT": "5"}
        args = (
            "--user",
            "--python",
            str(account.python),
            "sicext",
            "--wheel",
            str(account.wheels["sicext-2"]),
        )
        result = run(*args, "--yes", "--settle", "1", "--json", env=environ, timeout=240)
        assert result.code == 0, result.stdout + result.stderr
        info = os.lstat(lock)
        assert info.st_ino != held, "uv used the lock file another user holds"
        assert (info.st_uid, info.st_mode & 0o777) == (NOBODY, 0o600)
        account.manager.wait_active(name)
    finally:
        holder.kill()
        holder.wait()
        ready.unlink(missing_ok=True)


def test_another_user_holding_uvs_lock_cannot_stall_the_plan(
    open_dir: Path, wheels: wheelhouse.Wheelhouse
) -> None:
    """Row 6 (issue 35): in a root-owned venv, uid 65534 holds uv's 0666 lock file before the run: the
    plan's uv (a dry run takes the lock too) waited for uv's whole lock timeout (300 s), before the
    stop. Now it waits at most ``PLAN_LOCK_WAIT_S`` and the plan says who holds the lock."""
    python = wheelhouse.make_venv(open_dir / "venv", shared_interpreter_or_skip())
    wheelhouse.uv_install(python, wheels["sipure-1"])
    lock = open_dir / "venv" / ".lock"
    lock.touch()
    lock.chmod(0o666)  # as uv makes it
    ready = Path(f"/tmp/si-plan-lock-ready-{os.getpid()}")
    holder = _started_as(NOBODY, ready, "-c", HOLD, str(lock))
    try:
        assert ready.exists(), "uid 65534 could not take the lock"
        environ = {k: v for k, v in os.environ.items() if k != "UV_LOCK_TIMEOUT"}
        environ["SAFEINSTALL_STATE_DIR"] = str(open_dir / "state")
        args = ("sipure", "--wheel", str(wheels["sipure-2"]), "--python", str(python), "--dry-run", "--json")
        result = run(*args, env=environ, timeout=200)  # uv's own wait: 300 s
        assert result.code == 0, result.stdout + result.stderr
        said = [w for w in result.json["data"]["warnings"] if "uv's lock" in w]
        assert said and f"PID {holder.pid} (uid {NOBODY})" in said[0], result.json["data"]["warnings"]
    finally:
        holder.kill()
        holder.wait()
        ready.unlink(missing_ok=True)


def test_a_dry_run_leaves_no_lock_file_in_the_environment(account: ServiceAccountBed) -> None:
    """Row 6 too: ``--dry-run`` (and so Ansible's check mode) left uv's 0666 lock file behind."""
    lock = account.base / "venv" / ".lock"
    lock.unlink(missing_ok=True)  # made when the bed installed sicext 1.0
    result = account.cli("sicext", "--wheel", str(account.wheels["sicext-2"]), "--dry-run")
    assert result.code == 0, result.stdout + result.stderr
    assert not os.path.lexists(lock), "the dry run left uv's lock file in the environment"


# --- the worker ---------------------------------------------------------------------------------------


def test_a_worker_is_the_account_alone_in_a_session_of_its_own() -> None:
    """What a worker is (the boundary the rows above rely on): the account's effective uid and gid, no
    supplementary group, a new session, no descriptor of root's, an environment it was given."""
    from safeinstall.system import worker

    seen = worker.call(
        (NOBODY, NOBODY),
        lambda: {
            "uids": list(os.getresuid()),
            "gids": list(os.getresgid()),
            "groups": os.getgroups(),
            "leader": os.getsid(0) == os.getpid(),
            "fds": sorted(int(fd) for fd in os.listdir("/proc/self/fd")),
            "environ": dict(os.environ),
            "cwd": os.getcwd(),
        },
        timeout=30,
        what="describes itself",
    )
    # files are checked as the account (effective ids); the real and saved uid stay root's, so that the
    # account cannot signal it (test_the_account_cannot_signal_its_worker)
    assert seen["uids"] == [0, NOBODY, 0] and seen["gids"] == [NOBODY] * 3 and seen["groups"] == []
    assert seen["leader"] and seen["cwd"] == "/"
    assert len(seen["fds"]) <= 5  # stdin/out/err (/dev/null), the answer pipe, and listdir's own
    assert seen["environ"] == {"PATH": "/usr/bin:/bin"}


def test_a_worker_that_runs_past_its_deadline_or_answers_too_much_is_ended() -> None:
    from safeinstall.system import worker

    with pytest.raises(worker.WorkerError, match=r"did not finish in 0\.5 s"):
        worker.call((NOBODY, NOBODY), lambda: time.sleep(30), timeout=0.5, what="sleeps")
    with pytest.raises(worker.WorkerError, match="more than"):
        worker.call(None, lambda: "x" * (worker.ANSWER_LIMIT + 10), timeout=30, what="talks")
    with pytest.raises(worker.WorkerError, match="ZeroDivisionError"):
        worker.call(None, lambda: 1 // 0, timeout=30, what="divides")


def test_the_carried_local_patches_are_written_as_the_owner(open_dir: Path) -> None:
    """``--keep-patches`` writes the merged files after the install, at paths the environment's RECORDs
    name: as the owner, so a path the owner may not write (root's file in root's directory, named by a
    RECORD the owner wrote) is refused, not written by root."""
    from safeinstall.env.environment import Account
    from safeinstall.errors import StepFailed
    from safeinstall.run.parts.patches import PatchOutcome, PatchSet, PatchStatus, Versions, carry

    prefix = open_dir / "venv"
    (prefix / "lib").mkdir(parents=True)
    chown_tree(prefix / "lib", NOBODY)
    mine = prefix / "lib" / "mod.py"
    mine.write_text("new version\n")
    os.chown(mine, NOBODY, NOBODY)
    roots = prefix / "root.txt"
    roots.write_text("root's own\n")

    def carried(path: Path) -> PatchSet:
        outcome = PatchOutcome(str(path), PatchStatus.CARRIED, "merged", merged=b"merged\n")
        return PatchSet(Versions("pkg", "1", "2"), (outcome,))

    nobody = Account(NOBODY, NOBODY, "/")
    assert carry(prefix, carried(mine), nobody) == 1
    assert mine.read_bytes() == b"merged\n" and os.lstat(mine).st_uid == NOBODY
    with pytest.raises(StepFailed, match="could not write the merged"):
        carry(prefix, carried(roots), nobody)
    assert roots.read_text() == "root's own\n"


def test_the_account_cannot_signal_its_worker(open_dir: Path) -> None:
    """The review's medium finding: the account could SIGKILL (or SIGSTOP) the forked workers, which ran
    as its uid, and so fail (or hold) a rollback with its units down. A worker's files are checked as
    the account, but its real and saved uid are root's: the account's signals are refused."""
    import psutil

    from safeinstall.system import worker

    flag = open_dir / "flag"
    answers: list[object] = []

    def wait_for_flag() -> str:
        deadline = time.monotonic() + 60
        while not os.path.exists(flag) and time.monotonic() < deadline:
            time.sleep(0.01)
        return "finished"

    caller = threading.Thread(
        target=lambda: answers.append(worker.call((NOBODY, NOBODY), wait_for_flag, timeout=90, what="waits"))
    )
    caller.start()
    try:
        deadline = time.monotonic() + 30
        workers: list[psutil.Process] = []
        while not workers and time.monotonic() < deadline:
            workers = [p for p in psutil.Process().children() if p.uids().effective == NOBODY]
            time.sleep(0.01)
        assert workers, "no worker started"
        for signame in ("STOP", "KILL"):
            tried = subprocess.run([*_setpriv(NOBODY), "kill", f"-{signame}", str(workers[0].pid)], cwd="/")
            assert tried.returncode != 0, f"the account could send SIG{signame} to its worker"
        assert workers[0].status() != psutil.STATUS_STOPPED
    finally:
        flag.touch()
        caller.join(timeout=120)
    assert answers == ["finished"]


def test_index_options_in_every_form_leave_the_command_line() -> None:
    """Row 3, every spelling clap accepts (the review found ``-qi URL`` left on uv's command line): the
    index options go to uv's environment, the other options of a cluster stay."""
    from safeinstall.env.uvplan import index_settings
    from safeinstall.errors import UsageError

    url = f"http://agent:{TOKEN}@127.0.0.1/simple"
    for given, kept in [
        (["--index-url", url], ()),
        ([f"--index-url={url}"], ()),
        (["-i", url], ()),
        ([f"-i{url}"], ()),
        ([f"-i={url}"], ()),
        (["-qi", url], ("-q",)),
        ([f"-vqi{url}", "-n"], ("-vq", "-n")),
    ]:
        assert index_settings(given) == (kept, {"UV_INDEX_URL": url}), given
    assert index_settings(["--extra-index-url", url, "--index", "a", "--index=b"]) == (
        (),
        {"UV_EXTRA_INDEX_URL": url, "UV_INDEX": "a b"},
    )
    assert index_settings(["-qf", "/w", "--find-links=/v", "--default-index", url]) == (
        ("-q",),
        {"UV_FIND_LINKS": "/w,/v", "UV_DEFAULT_INDEX": url},
    )
    # a short option that takes a value ends the cluster: -rfile.txt is -r file.txt, not -f
    assert index_settings(["-rfile.txt", "-qr", "req.txt"]) == (("-rfile.txt", "-qr", "req.txt"), {})
    for bad in (
        ["--index-url"],
        ["-i", "a", "--index-url", "b"],
        ["--find-links", "a,b"],
        ["--index", "a b"],
    ):
        with pytest.raises(UsageError):
            index_settings(bad)


def test_a_health_url_is_said_without_what_may_be_a_token() -> None:
    """A health URL with a token (user information, a query) is never in the log, the progress lines or
    the result: the run says the URL without them (the review's low finding)."""
    from safeinstall.system.health import shown

    assert shown(f"http://u:{TOKEN}@127.0.0.1:8000/health?key={TOKEN}#x") == "http://127.0.0.1:8000/health"
    assert shown("https://[::1]:8443/v1/health") == "https://[::1]:8443/v1/health"


def test_uv_and_what_it_runs_never_hold_the_descriptor_it_was_started_through() -> None:
    """uv is executed through a descriptor root opened (it may lie where the account cannot read); the
    descriptor is close-on-exec, so neither uv nor what it runs (a .pth, a build backend) holds it."""
    from safeinstall.system import children

    program = os.open("/bin/sh", os.O_RDONLY | os.O_CLOEXEC)
    try:
        done = children.run(
            ["sh", "-c", "ls /proc/$$/fd"], env={}, timeout=30, as_user=(NOBODY, NOBODY), program_fd=program
        )
    finally:
        os.close(program)
    assert done.returncode == 0, done.stderr
    assert set(done.stdout.split()) <= {"0", "1", "2"}, done.stdout
