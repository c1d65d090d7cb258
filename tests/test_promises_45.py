"""Promises of the docs that no test held (issue 45): each test here fails on a one-line mutation of
the check it holds (``bench/mutations.py`` applies them). Real parts: real wheels and uv, the private
systemd --user manager, the fake NVML driver, the console script."""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import functools
import importlib
import itertools
import json
import os
import resource
import shutil
import signal
import socketserver
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests import wheelhouse
from tests.bed_nvml import FakeNvml, GiB
from tests.bed_systemd import Units, UserManager, cgroup_pids, wait_until
from tests.beds import (
    AS_ROOT,
    NOBODY,
    OTHER,
    UNIT_TEXT,
    Bed,
    ServiceAccountBed,
    chown_tree,
    maps_so,
    shared_interpreter_or_skip,
)
from tests.clirun import run
from tests.wheelhouse import Wheelhouse

AS_NOBODY = ("setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups")

# --- verify: a #!python script's launcher ----------------------------------------------------------


@pytest.mark.parametrize(
    ("length", "inserted"),
    [
        ("short", b"import os; os.system('id')\n"),
        ("short", b"import os\nos.system('id')\n"),
        ("long", b"import os; os.system('id')\n"),
    ],
    ids=["one-line-after-shebang", "two-lines-after-shebang", "one-line-after-sh-launcher"],
)
def test_lines_inserted_between_a_scripts_launcher_and_its_body_are_drift(
    tmp_path: Path, length: str, inserted: bytes
) -> None:
    """The launcher an installer writes in place of ``#!python`` is one shebang line or the three-line
    ``#!/bin/sh`` + ``exec`` form, nothing more: a line (or two) slipped in after it, before the
    wheel's body, is ``modified`` against the wheel (issue 45: up to three lines passed as launcher)."""
    body = b"import sidata\nprint('hi', sidata.X)\n"
    wheel = wheelhouse.make_wheel(
        tmp_path,
        "sidata",
        "1.0",
        {"sidata/__init__.py": b"X = 1\n", "sidata-1.0.data/scripts/hello": b"#!python\n" + body},
    )
    base = tmp_path / ("v" if length == "short" else "v" * 150)
    python = wheelhouse.make_venv(base)
    wheelhouse.uv_install(python, wheel)
    script = base / "bin" / "hello"
    installed = script.read_bytes()
    assert installed.endswith(body)
    launcher = installed[: -len(body)]
    assert launcher.count(b"\n") == (1 if length == "short" else 3)
    assert run("sidata", "--verify-only", "--python", str(python), "--wheel", str(wheel)).code == 0
    script.write_bytes(launcher + inserted + body)
    result = run("sidata", "--verify-only", "--python", str(python), "--wheel", str(wheel), "--json")
    assert result.code == 1, result.stdout + result.stderr
    assert [(f["kind"], f["path"]) for f in result.json["data"]["findings"]] == [("modified", str(script))]


# --- a good run ends 0, whatever signal comes once its result is out ----------------------------------

# A SIGTERM to the process once the run's result is shown: when ``execute`` returns (the result printed,
# the run's handlers put back), or at the last Python code before the interpreter exits (an atexit
# callback, registered first so that it runs last). There the callback does what CPython's finalization
# does next (``_PySignal_Fini``: a signal whose handler is a Python function goes back to SIG_DFL, one
# ignored stays ignored), then sends it: the window the soak hit (seed 3686688892, exit -15).
HOOK_AFTER_RESULT = r"""
import atexit, os, signal, sys, threading
where = sys.argv.pop(1)
sent = []
def term():
    sent.append(True)
    os.kill(os.getpid(), signal.SIGTERM)
def hook(frame, event, arg):
    if not sent and event == "return" and frame.f_code.co_name == "execute" \
            and frame.f_globals.get("__name__") == "safeinstall.run.commands.modes":
        term()
def at_exit():
    if callable(signal.getsignal(signal.SIGTERM)):
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    term()
if where == "result-shown":
    sys.setprofile(hook)
else:
    atexit.register(at_exit)
from safeinstall.__main__ import main
sys.argv[0] = "safeinstall"
sys.exit(main())
"""


@pytest.mark.parametrize("where", ["result-shown", "interpreter-exit"])
def test_a_signal_once_a_good_runs_result_is_shown_does_not_change_its_exit(bed: Bed, where: str) -> None:
    """docs/faults.md: a good run ends 0. A SIGTERM after its result is printed (as the command returns,
    or as the interpreter exits) is ignored: exit 0 and the one result, not exit 2 with "nothing was
    changed" after it (the handler before the journal put back) nor a death by SIGTERM (-15)."""
    unit = bed.service("after-result")
    bed.tool = (sys.executable, "-c", HOOK_AFTER_RESULT, where)
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")
    assert result.code == 0, (result.code, result.stdout + result.stderr)
    assert result.json["status"] == "done" and result.json["exit_code"] == 0, result.stdout
    assert "error:" not in result.stderr, result.stderr
    assert bed.version() == "2.0" and bed.manager.active_state(unit) == "active"


# --- the plan's uv and uv's lock ------------------------------------------------------------------------


def test_an_operators_uv_lock_timeout_above_the_plans_bound_is_capped() -> None:
    """docs/privsep.md row 6: the plan's uv waits at most ``PLAN_LOCK_WAIT_S`` for uv's lock, whatever
    ``UV_LOCK_TIMEOUT`` the operator set (300 s is uv's default); a shorter one stays."""
    from safeinstall.env.uvplan import PLAN_LOCK_WAIT_S, plan_environ

    assert PLAN_LOCK_WAIT_S == 10
    assert plan_environ({"UV_LOCK_TIMEOUT": "300", "A": "b"}) == {"UV_LOCK_TIMEOUT": "10", "A": "b"}
    assert plan_environ({"UV_LOCK_TIMEOUT": "3"})["UV_LOCK_TIMEOUT"] == "3"
    assert plan_environ({})["UV_LOCK_TIMEOUT"] == "10"
    assert plan_environ({"UV_LOCK_TIMEOUT": "-1"})["UV_LOCK_TIMEOUT"] == "10"


def _held(lock: Path) -> bool:
    """Whether another process holds ``lock`` (``flock``, as uv takes it)."""
    fd = os.open(lock, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


@pytest.mark.parametrize("holder", ["account", "root"])
def test_uvs_lock_held_by_the_environments_account_refuses_the_run(
    account: ServiceAccountBed, holder: str
) -> None:
    """uv's lock held by the environment's own account, or by root, is another uv installing into the
    environment: the run refuses at its gate, before the stop (exit 2), the unit keeps running,
    nothing changes, the lock file is not taken from under it. Here a service holds it."""
    lock = account.base / "venv" / ".lock"
    lock.touch()
    os.chown(lock, NOBODY, NOBODY)
    lock.chmod(0o666)
    as_who = account.exec_prefix if holder == "account" else ""
    serve = f"{as_who}flock --no-fork {lock} {account.python.parent}/sicext-serve"
    name = account.unit("own-lock", text=UNIT_TEXT.replace("{exec}", serve))
    main = account.manager.main_pid(name)
    wait_until(lambda: _held(lock), 30, "the account's service holds uv's lock")
    held = os.stat(lock).st_ino
    result = account.safeinstall(
        "sicext", "--wheel", str(account.wheels["sicext-2"]), "--json", more_env={"UV_LOCK_TIMEOUT": "1"}
    )
    assert result.code == 2, result.stdout + result.stderr
    (error,) = result.json["errors"]
    assert f"is held by PID {main}" in error["message"], error
    assert "another uv is installing into this environment" in error["message"]
    assert account.manager.main_pid(name) == main and account.version() == "1.0"
    assert os.stat(lock).st_ino == held


# --- workers ----------------------------------------------------------------------------------------------


def test_an_import_in_a_worker_fails_at_once(tmp_path: Path) -> None:
    """A worker never imports (system/worker.py): a module not loaded before the fork fails to import
    in it, even one root can read, so no test passes only because its interpreter was readable."""
    from safeinstall.system import worker

    (tmp_path / "si_never_loaded_45.py").write_text("VALUE = 45\n")
    sys.path.insert(0, str(tmp_path))
    try:
        for ids in (None, (NOBODY, NOBODY)):
            with pytest.raises(worker.WorkerError, match="a worker imported si_never_loaded_45"):
                worker.call(
                    ids,
                    lambda: importlib.import_module("si_never_loaded_45").VALUE,
                    timeout=30,
                    what="imports",
                )
    finally:
        sys.path.remove(str(tmp_path))
    assert "si_never_loaded_45" not in sys.modules


def test_a_worker_is_never_dumpable() -> None:
    """A worker (root's own too, whose ids do not change, so the kernel's ``fs.suid_dumpable`` never
    applies) is not dumpable: no ptrace of it, no read of its memory, a copy of root's."""
    from safeinstall.system import worker

    libc = ctypes.CDLL(None, use_errno=True)
    pr_get_dumpable = 3
    assert libc.prctl(pr_get_dumpable, 0, 0, 0, 0) == 1  # this process: dumpable, as any
    for ids in (None, (NOBODY, NOBODY)):
        seen = worker.call(ids, lambda: libc.prctl(pr_get_dumpable, 0, 0, 0, 0), timeout=30, what="says")
        assert seen == 0, ids


def test_a_worker_has_umask_022_and_no_core_dumps() -> None:
    """docs/privsep.md: a worker's umask is 022 and it dumps no core (what root's memory held), whatever
    the caller's are."""
    from safeinstall.system import worker

    old_umask = os.umask(0o077)
    old_core = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (old_core[1], old_core[1]))
    try:
        for ids in (None, (NOBODY, NOBODY)):
            seen = worker.call(
                ids,
                lambda: [os.umask(0o022), *resource.getrlimit(resource.RLIMIT_CORE)],
                timeout=30,
                what="says",
            )
            assert seen == [0o022, 0, 0], ids
    finally:
        os.umask(old_umask)
        resource.setrlimit(resource.RLIMIT_CORE, old_core)


def test_a_removal_workers_removed_list_counts_only_the_paths_root_asked() -> None:
    """docs/privsep.md: the removal worker's answer is the account's word. Its "removed" lists count only
    the paths root asked it to remove (what root then deletes the bytecode of, and counts): a path it
    was not asked for, outside the prefix or of another distribution, is dropped; what it denied or
    failed is a message, cut to length; an answer that is no JSON object is a failure. (The worker runs
    safeinstall's own code, so this is the check on its answer by itself, given a lying one.)"""
    from safeinstall.store.backup import removal_answer

    asked_files = frozenset({"lib/site-packages/pkg/a.py", "lib/site-packages/pkg/b.py"})
    asked_dirs = frozenset({"lib/site-packages/pkg-1.0.dist-info"})
    lying = {
        "removed": ["lib/site-packages/pkg/a.py", "../../etc/shadow", "lib/site-packages/other/c.py", 7],
        "removed_dist_infos": ["lib/site-packages/pkg-1.0.dist-info", "lib/site-packages/other-2.dist-info"],
        "denied": ["lib/site-packages/pkg/b.py: Permission denied"],
        "failures": ["x" * 5000],
    }
    got = removal_answer(lying, asked_files, asked_dirs, "/srv/env")
    assert got.files == ("lib/site-packages/pkg/a.py",), got.files
    assert got.dist_infos == ("lib/site-packages/pkg-1.0.dist-info",), got.dist_infos
    assert got.denied == ("/srv/env/lib/site-packages/pkg/b.py: Permission denied",), got.denied
    (failure,) = got.failures
    assert len(failure) < 1100 and failure.endswith(": could not remove it"), failure[-40:]
    nonsense = removal_answer(["lib/site-packages/pkg/a.py"], asked_files, asked_dirs, "/srv/env")
    assert (nonsense.files, nonsense.dist_infos) == ((), ()) and "nonsense" in nonsense.failures[0]


# --- health ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _answering(head: bytes, location: str = "") -> Iterator[int]:
    """A real local HTTP server that answers every request with ``head`` (``{location}`` filled in);
    yields its port."""

    class Answer(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            self.rfile.readline()
            with contextlib.suppress(OSError):
                self.wfile.write(head.replace(b"{location}", location.encode()))

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Answer)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


def test_a_health_redirect_to_another_port_is_refused() -> None:
    """A redirect is followed only to the URL's own scheme, host *and port*: a service cannot send
    root's request to another service of the same host, nor have its 200 count as its own health."""
    from safeinstall.errors import StepFailed
    from safeinstall.system.health import wait_healthy

    with _answering(b"HTTP/1.1 200 OK\r\n\r\n") as other:
        target = f"http://127.0.0.1:{other}/health"
        moved = b"HTTP/1.1 302 Found\r\nLocation: {location}\r\n\r\n"
        with _answering(moved, target) as port, pytest.raises(StepFailed) as caught:
            wait_healthy(f"http://127.0.0.1:{port}/health", 1)
    assert f"(last: HTTP 302 redirect to another host ({target}), refused)" in caught.value.message


def test_only_200_is_healthy() -> None:
    """Only HTTP 200 counts (docs/reinstall.md): a 204 (or any other 2xx) is not healthy."""
    from safeinstall.errors import StepFailed
    from safeinstall.system.health import wait_healthy

    with _answering(b"HTTP/1.1 204 No Content\r\n\r\n") as port, pytest.raises(StepFailed) as caught:
        wait_healthy(f"http://127.0.0.1:{port}/health", 1)
    assert "(last: HTTP 204)" in caught.value.message


#: the pace docs/reinstall.md promises for the health URL (a literal: a mutated constant must not move it)
HEALTH_PACE_S = 0.1


def test_the_health_url_is_asked_every_tenth_of_a_second_never_more_often() -> None:
    """docs/reinstall.md: ``--health-url`` is asked every 0.1 s (``service_downtime_s`` is that precise).
    A real server answers 503 until this test has slept 30 times 0.1 s (its reference, slowed by a
    loaded machine as much as the poller is), then 200. Never more often: each request came at least
    0.1 s after the one before (a bound that no load can break). Not slower: those 30 pauses saw at
    least 12 requests; asked every 0.5 s (the pace before issue 34) they would see at most 7 unless
    this test's own sleeps took nearly twice as long as asked. No assertion on a duration."""
    from safeinstall.system.health import wait_healthy

    arrivals: list[float] = []
    healthy = threading.Event()
    asked = threading.Event()

    class Answer(socketserver.StreamRequestHandler):
        def handle(self) -> None:
            self.rfile.readline()
            arrivals.append(time.monotonic())  # the poller's clock (CLOCK_MONOTONIC), as it came
            asked.set()
            head = b"HTTP/1.1 200 OK\r\n\r\n" if healthy.is_set() else b"HTTP/1.1 503 Busy\r\n\r\n"
            with contextlib.suppress(OSError):
                self.wfile.write(head)

    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), Answer)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    answered: list[float] = []
    url = f"http://127.0.0.1:{server.server_address[1]}/health"
    poller = threading.Thread(target=lambda: answered.append(wait_healthy(url, 300)), daemon=True)
    try:
        poller.start()
        assert asked.wait(60), "the health URL was never asked"
        before = len(arrivals)
        for _ in range(30):
            time.sleep(HEALTH_PACE_S)
        during = len(arrivals) - before
        healthy.set()
        poller.join(60)
    finally:
        healthy.set()
        server.shutdown()
        server.server_close()
    assert answered and answered[0] >= arrivals[-1], (answered, arrivals[-1:])
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert min(gaps) >= HEALTH_PACE_S, sorted(gaps)[:3]
    assert during >= 12, (during, [round(g, 3) for g in gaps])


# --- the .pth walk: what site imports at start-up -----------------------------------------------------


@pytest.mark.parametrize("how", ["import-tab-line", "sitecustomize-package"])
def test_what_site_imports_without_an_import_space_line_is_walked(
    open_dir: Path, wheels: Wheelhouse, how: str
) -> None:
    """``site`` runs a ``.pth`` line that starts with ``import`` and a tab as it runs ``import NAME``, and
    imports ``sitecustomize`` (and ``usercustomize``) with no ``.pth`` line at all: the package either
    loads is root's, one module deep in it the account's. The environment is the account's: nothing
    of it runs as root."""
    if not AS_ROOT:
        pytest.skip("the attack is on a run as root")
    uids = open_dir / "uids"
    uids.touch()
    uids.chmod(0o666)
    record = f"import os; open({str(uids)!r}, 'a').write('%d\\n' % os.getuid())\n"
    python = wheelhouse.make_venv(open_dir / "venv", shared_interpreter_or_skip())
    wheelhouse.uv_install(python, wheels["sipure-1"])
    site = wheelhouse.site_packages(python)
    package = "zzpkg" if how == "import-tab-line" else "sitecustomize"
    (site / package / "inner").mkdir(parents=True)
    (site / package / "__init__.py").write_text(f"from {package}.inner import sub\n")
    (site / package / "inner" / "__init__.py").write_text("")
    (site / package / "inner" / "sub.py").write_text(record)
    os.chown(site / package / "inner" / "sub.py", NOBODY, NOBODY)
    if how == "import-tab-line":
        (site / "zz-pkg.pth").write_text("import\tzzpkg\n")
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(open_dir / "state")}
    args = ("sipure", "--wheel", str(wheels["sipure-2"]), "--python", str(python), "--dry-run", "--json")
    result = run(*args, env=environ, timeout=120)
    assert "0" not in uids.read_text().split(), f"ran as root: {result.stdout}{result.stderr}"
    assert "belongs to uid 65534" in result.stdout + result.stderr, result.stdout + result.stderr
    if how == "import-tab-line":  # what the check guards: site does run that line (here as the account)
        probe = subprocess.run(
            [*AS_NOBODY, str(python), "-c", ""], capture_output=True, text=True, check=False
        )
        assert str(NOBODY) in uids.read_text().split(), probe.stderr
    # (a sitecustomize in site-packages runs where the interpreter has none of its own; Debian's has
    # one in its standard library, which comes first: the walk looks at it all the same)


# --- D state: 3 s without a break ------------------------------------------------------------------------

#: A process that goes in and out of ``D`` when told: ``vfork()`` holds it in ``D`` until its child,
#: which stops itself, is continued (SIGCONT) and exits; it then waits in ``S`` for SIGUSR1, and goes
#: round again, until 8 s after it first left ``D``, then exits. (It went round 20 times: at the stop
#: wait's one look a second, 40 s.)
IN_AND_OUT_OF_D = r"""
#include <signal.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec / 1e9;
}
int main(void) {
    sigset_t set;
    int sig;
    double first = -1;
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    sigprocmask(SIG_BLOCK, &set, NULL);
    for (;;) {
        pid_t child = vfork();
        if (child == 0) {
            kill(getpid(), SIGSTOP);
            _exit(0);
        }
        waitpid(child, NULL, 0);
        if (first < 0)
            first = now();
        else if (now() - first >= 8.0)
            return 0;
        sigwait(&set, &sig);
    }
}
"""

# After each poll of the stop's wait (the D-state check's call), the helper is moved on: seen in D, its
# stopped child is continued (it leaves D, and waits in S); seen in S, it is sent SIGUSR1 (back in D).
# So each poll sees it in the other state: D, S, D, S... for 8 s (about 4 s in D in all, at the stop
# wait's one look a second; more looks where they come faster).
HOOK_D_S_D = r"""
import os, signal, sys
helper = int(sys.argv.pop(1))
def state(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0]
    except OSError:
        return ""
def hook(frame, event, arg):
    if event != "return" or frame.f_code.co_name != "__call__" \
            or frame.f_globals.get("__name__") != "safeinstall.run.steps.reinstall":
        return
    now = state(helper)
    if now == "D":
        with open(f"/proc/{helper}/task/{helper}/children") as children:
            for child in children.read().split():
                os.kill(int(child), signal.SIGCONT)
    elif now == "S":
        os.kill(helper, signal.SIGUSR1)
sys.setprofile(hook)
from safeinstall.__main__ import main
sys.argv[0] = "safeinstall"
sys.exit(main())
"""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except (OSError, IndexError):
        return ""


def test_a_gpu_holder_in_and_out_of_d_state_is_not_stuck(bed: Bed, tmp_path: Path) -> None:
    """docs/reinstall.md: a stopped GPU holder is stuck only after 3 s in ``D`` *without a break*: one
    seen D, S, D, S... at each poll of the stop's wait (never twice in a row in D), for longer than 3 s
    in all, is waited for, not declared stuck; once it exits the run goes on and installs."""
    helper = tmp_path / "in_and_out_of_d"
    source = tmp_path / "in_and_out_of_d.c"
    source.write_text(IN_AND_OUT_OF_D)
    subprocess.run([shutil.which("gcc") or "cc", "-o", str(helper), str(source)], check=True)
    name = bed.units.started(
        "d-s-d", f"/bin/sh -c '{helper} & exec {bed.python.parent}/sicext-serve'", KillMode="process"
    )
    main = bed.manager.main_pid(name)
    group = bed.manager.show(name, "ControlGroup")["ControlGroup"]
    wait_until(lambda: any(_state(p) == "D" for p in cgroup_pids(group)), 15, "the helper in D state")
    (flipping,) = [p for p in cgroup_pids(group) if _state(p) == "D"]
    gpu = bed.nvml.add_gpu("NVIDIA H200", "GPU-00000000-0000-0000-0000-0000000000d5", 141 * GiB)
    bed.nvml.hold(flipping, gpu, 20 * GiB)
    bed.tool = (sys.executable, "-c", HOOK_D_S_D, str(flipping))
    try:
        done = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.3", "--json")
        assert done.code == 0, done.stdout + done.stderr
        assert bed.version() == "2.0" and bed.manager.main_pid(name) != main
    finally:
        for pid in [flipping, *(p for p in cgroup_pids(group) if _state(p) == "T")]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


# --- smoke check ------------------------------------------------------------------------------------------


def test_a_failed_smoke_command_shows_its_last_lines_of_standard_error(bed: Bed) -> None:
    """The refusal shows what the child said last (where a traceback ends: its error), the last 12
    non-empty lines of its standard error, not its first ones."""
    unit = bed.service("smoke-tail")
    main = bed.manager.main_pid(unit)
    command = "for i in $(seq 1 30); do echo smoke-line-$i >&2; done; exit 1"
    refused = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--json", "--smoke", command)
    assert refused.code == 2, refused.stdout + refused.stderr
    message = refused.json["errors"][0]["message"]
    assert "its last lines of standard error" in message, message
    shown = [n for n in range(1, 31) if f"smoke-line-{n}\n" in message + "\n"]
    assert shown == list(range(19, 31)), message
    assert bed.manager.main_pid(unit) == main and bed.version() == "1.0"


# --- undo -------------------------------------------------------------------------------------------------


def _good_run(bed: Bed, wheel: str, *extra: str) -> str:
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels[wheel]), "--settle", "0.5", "--json", *extra)
    assert result.code == 0, result.stdout + result.stderr
    run_id: str = result.json["data"]["run_id"]
    return run_id


def test_another_version_installed_since_the_run_refuses_its_undo(bed: Bed) -> None:
    """docs/undo.md: the undo is refused before anything stops when the environment is not what the run
    left; here another version was installed since (by hand, with uv), whose files the run never saw."""
    name = bed.service("undo-other-version")
    _good_run(bed, "sicext-2")
    wheelhouse.uv_install(bed.python, bed.wheels["sicext-1"], reinstall=True)
    assert bed.version() == "1.0"
    main = bed.manager.main_pid(name)
    result = bed.safeinstall("--undo", "--settle", "0.5", "--json")
    assert result.code == 2, result.stdout + result.stderr
    message = result.json["errors"][0]["message"]
    assert "changed since run" in message and "sicext is 1.0 now, the run left 2.0" in message, message
    assert bed.manager.main_pid(name) == main and bed.version() == "1.0"


def test_a_rolled_back_run_never_prunes_a_good_runs_backup_even_past_keep_backups(bed: Bed) -> None:
    """Issue 37's promise where ``--keep-backups`` is reached: two good runs' backups, then a run that
    is rolled back with ``--keep-backups 1``: it deletes none of the good runs' backups (only a good run
    prunes them, to its ``--keep-backups``)."""
    bed.service("keep-reached")
    first = _good_run(bed, "sicext-2")
    second = _good_run(bed, "sicext-1")
    failed = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-3"]), "--settle", "1", "--json", "--no-smoke",
        "--keep-backups", "1",
    )  # fmt: skip
    assert failed.code == 3, failed.stdout + failed.stderr
    assert failed.json["data"]["backups_removed"] == [], (first, second)
    assert bed.version() == "1.0"
    backups = {p.name for p in bed.state.glob("*/backups/*")}
    assert {first, second} <= backups, backups


# --- --recover over several environments ----------------------------------------------------------------


def test_recover_of_several_environments_exits_4_when_one_is_left_down_whatever_came_first() -> None:
    """docs/crash-safety.md: ``--recover`` (every environment, as at boot) exits 4 when one recovery
    failed with its services maybe down, even when an environment refused before it (a journal it
    could not read: exit 2) came first; otherwise the first failure's code."""
    from safeinstall.errors import ExitCode, RollbackFailed
    from safeinstall.run.back.recover import Recovered
    from safeinstall.store.journal import JournalError

    refused = JournalError("the journal of /srv/a cannot be read")
    down = RollbackFailed("the units of /srv/b did not start", commands=("systemctl start b",))
    assert Recovered((), (refused, down)).exit_code == ExitCode.ROLLBACK_FAILED
    assert Recovered((), (down, refused)).exit_code == ExitCode.ROLLBACK_FAILED
    assert Recovered((), (refused,)).exit_code == refused.exit_code == ExitCode.REFUSED
    assert Recovered((), ()).exit_code == ExitCode.OK


# --- a rollback once the restart began ------------------------------------------------------------------


def _free_port() -> int:
    with socketserver.TCPServer(("127.0.0.1", 0), socketserver.BaseRequestHandler) as server:
        return int(server.server_address[1])


def test_a_rollback_after_the_restart_began_stops_the_units_before_the_restore(bed: Bed) -> None:
    """docs/reinstall.md: a failure once the units run the new version (here its health URL never
    answers) stops them again before the old files go back, then starts them: the unit ends up running
    the old version's code, a process that maps the restored extension, never the new code with the
    old files under it."""
    name = bed.service("rollback-after-restart")
    bad = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json",
        "--health-url", f"http://127.0.0.1:{_free_port()}/health", "--health-timeout", "1",
    )  # fmt: skip
    assert bad.code == 3, bad.stdout + bad.stderr
    assert "did not answer 200" in bad.json["errors"][0]["message"]
    assert bed.version() == "1.0"
    wait_until(lambda: bed.manager.active_state(name) == "active", 30, "the unit running again")
    main = bed.manager.main_pid(name)
    wait_until(lambda: maps_so(main) is not None, 15, "the service maps the .so")
    assert maps_so(main) == os.stat(bed.so).st_ino, "the unit runs code that is not the restored version's"


# --- environment evidence and another root ---------------------------------------------------------------


def _holding(pid: int, path: str) -> bool:
    try:
        return any(os.readlink(f"/proc/{pid}/fd/{fd}") == path for fd in os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return False


def test_environment_evidence_is_not_given_to_a_process_in_another_root(
    sipure_venv: Path, tmp_path: Path
) -> None:
    """A process whose root (a container's mount namespace) has a directory of its own at the prefix's
    path holds open a file at ``PREFIX/...``: the path is the prefix's, the directory is not, so it
    is no ``environment`` evidence. The same path held open by a process of this root is."""
    if not AS_ROOT or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    from safeinstall.scan.evidence import EvidenceKind
    from safeinstall.scan.processes import scan_processes
    from safeinstall.scan.targets import environment_scope

    env, targets = _env_and_targets(sipure_venv, "sipure")
    prefix = str(env.prefix)
    (env.prefix / "marker").write_text("this environment's\n")
    other = tmp_path / "container-venv"
    other.mkdir()
    (other / "marker").write_text("the container's own\n")
    marker = f"{prefix}/marker"
    contained = f"mount --bind {other} {prefix} && exec 3<{marker} && exec sleep 60"
    procs = [
        subprocess.Popen(["unshare", "--mount", "--propagation", "private", "sh", "-c", contained]),
        subprocess.Popen(["sh", "-c", f"exec 3<{marker} && exec sleep 60"]),
    ]
    try:
        for pid in (p.pid for p in procs):
            wait_until(functools.partial(_holding, pid, marker), 30, "the marker held open")
        result = scan_processes(targets, scope=environment_scope(env)).by_pid()
        inside, outside = (result[p.pid].evidence for p in procs)
        assert [(e.kind, e.path) for e in outside] == [(EvidenceKind.ENVIRONMENT, marker)]
        assert inside == ()
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()


def _env_and_targets(python: Path, name: str) -> tuple[Any, Any]:
    from safeinstall.env.distributions import find_distribution, find_distributions
    from safeinstall.env.environment import inspect_environment
    from safeinstall.scan.targets import load_targets

    env = inspect_environment(python)
    installed = find_distributions(env)
    return env, load_targets([find_distribution(env, name, installed)], env, installed)


# --- verification by identity -----------------------------------------------------------------------------


def test_a_hashed_cache_inode_of_another_owner_now_is_read_and_hashed(tmp_path: Path) -> None:
    """docs/verify.md: an installed file is taken as a hashed inode of the run's cache only when its
    owner matches too: one given to another account since its hash (who could then have written it,
    putting its size and modification time back) is read and hashed, the change caught."""
    import hashlib
    import time

    from safeinstall.env import inodes
    from safeinstall.env.drift import Expectation
    from safeinstall.env.hashing import observe_files
    from safeinstall.env.records import encode_digest

    if not AS_ROOT:
        pytest.skip("chown to another account needs root")
    content = b"print('the new version')\n" * 100
    cache = tmp_path / "uv-cache"
    entry = cache / "archive-v0" / "abc123" / "pkg" / "mod.py"
    entry.parent.mkdir(parents=True)
    cache.chmod(0o700)
    entry.write_bytes(content)
    entry.chmod(0o644)
    hashed = inodes.still_hashed(inodes.hash_cache(cache))
    installed = tmp_path / "prefix" / "site-packages" / "pkg" / "mod.py"
    installed.parent.mkdir(parents=True)
    os.link(entry, installed)
    info = installed.stat()
    with installed.open("r+b") as handle:  # same size, modification time put back
        handle.write(b"W")
    os.utime(installed, ns=(info.st_atime_ns, info.st_mtime_ns))
    os.chown(installed, NOBODY, NOBODY)
    installed_ns = time.time_ns()  # the install ended after all that: the change time does not tell
    now = installed.stat()
    assert (now.st_size, now.st_mtime_ns, now.st_mode & 0o022) == (info.st_size, info.st_mtime_ns, 0)

    def digest(data: bytes) -> str:
        return encode_digest(hashlib.sha256(data).digest())

    wanted = [Expectation(str(installed), "sha256", digest(content), len(content))]
    known = inodes.checker(hashed, installed_ns)
    state = observe_files(wanted, workers=1, within=str(tmp_path / "prefix"), known=known)[str(installed)]
    assert not state.by_identity and state.digest == digest(b"W" + content[1:])


# --- --save-patch: a link planted between the check and the open ----------------------------------------

# When the check just before the write (new_output_file, called by write_new_output) returns, a symbolic
# link to the victim is planted where the patch goes: only the open itself can still refuse it.
HOOK_PLANT = r"""
import os, sys
where, victim = sys.argv.pop(1), sys.argv.pop(1)
def hook(frame, event, arg):
    if event == "return" and frame.f_code.co_name == "new_output_file" and frame.f_back is not None \
            and frame.f_back.f_code.co_name == "write_new_output" and not os.path.lexists(where):
        os.symlink(victim, where)
sys.setprofile(hook)
from safeinstall.__main__ import main
sys.argv[0] = "safeinstall"
sys.exit(main())
"""


def test_save_patch_never_writes_through_a_link_planted_after_its_check(
    sipure_venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """docs/threat-model.md: ``--save-patch`` is opened ``O_EXCL|O_NOFOLLOW``: a symbolic link that
    appears at its path after the last check (a race another user could win) is not written through;
    the victim it points at keeps its bytes and the command says the file exists (exit 2)."""
    target = wheelhouse.site_packages(sipure_venv) / "sipure" / "__init__.py"
    target.write_text(target.read_text() + "# a local patch\n")
    victim = tmp_path / "victim"
    victim.write_text("keep\n")
    patch = tmp_path / "local.patch"
    result = run(
        "sipure", "--verify-only", "--python", str(sipure_venv), "--wheel", str(wheels["sipure-1"]),
        "--diff", "--save-patch", str(patch),
        tool=(sys.executable, "-c", HOOK_PLANT, str(patch), str(victim)),
    )  # fmt: skip
    assert patch.is_symlink(), "the hook did not run: the test shows nothing"
    assert victim.read_text() == "keep\n"
    assert result.code == 2 and "does not overwrite" in result.stderr, result.stdout + result.stderr


# --- kept links --------------------------------------------------------------------------------------------


def test_kept_links_are_only_of_inodes_only_root_can_write(sipure_venv: Path, tmp_path: Path) -> None:
    """docs/privsep.md: root keeps links (the way back that needs no blocks) only of inodes only root can
    write: a file another account owns, or one others may write, is left out (the restore copies it
    from the backup), though it has other links as uv's cache gives it."""
    from safeinstall.env import keep
    from safeinstall.env.environment import inspect_environment

    if not AS_ROOT:
        pytest.skip("chown to another account needs root")
    env = inspect_environment(sipure_venv)
    files = sorted(
        p for p in (env.purelib / "sipure").rglob("*") if p.is_file() and "__pycache__" not in str(p)
    )
    assert len(files) >= 3
    elsewhere = tmp_path / "cache"
    elsewhere.mkdir()
    for path in files:
        os.link(path, elsewhere / path.name)  # as uv's cache in hardlink mode: the uninstall frees nothing
    roots, accounts, anyones = files[:3]
    os.chown(accounts, NOBODY, NOBODY)
    anyones.chmod(0o666)
    listed = [str(p.relative_to(env.prefix)) for p in (roots, accounts, anyones)]
    assert keep.keep_links(env.prefix, "run45", listed) == 1
    kept = env.prefix / keep.keep_name("run45")
    assert sorted(p.name for p in kept.iterdir()) == [keep.key(listed[0])]
    assert keep.discard(env.prefix, "run45", 10.0)


def test_the_smoke_shim_stays_ahead_of_a_units_own_pythonpath(bed: Bed, tmp_path: Path) -> None:
    """The check's shim (a ``sitecustomize`` on ``PYTHONPATH``, which puts the staged new version ahead
    of the environment's site-packages) comes before the unit's own ``PYTHONPATH`` entries: a unit's
    directory with a ``sitecustomize`` of its own would otherwise be imported instead, and the check
    would import the installed (old) version."""
    app = tmp_path / "app"
    app.mkdir()
    (app / "sitecustomize.py").write_text("# the unit's own\n")
    report = tmp_path / "report.json"
    bed.service("smoke-shim-first", Environment=f"PYTHONPATH={app}")
    script = f"import json, sicext; json.dump(sicext.__file__, open({str(report)!r}, 'w'))"
    done = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "1", "--json",
        "--smoke", f'python -c "{script}"',
    )  # fmt: skip
    assert done.code == 0, done.stdout + done.stderr
    imported = json.loads(report.read_text())
    assert not imported.startswith(str(bed.site)), f"the check imported the installed version: {imported}"


# --- the tree opened to a unit's user is closed again ----------------------------------------------------

# When the gate step begins (the smoke check done, the swap still ahead), the mode of each staging
# directory in the prefix is written down.
HOOK_MODES = r"""
import json, os, sys
prefix, report = sys.argv.pop(1), sys.argv.pop(1)
def hook(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "gate_step" \
            and frame.f_globals.get("__name__") == "safeinstall.run.steps.reinstall" and not \
            os.path.exists(report):
        modes = {n: os.lstat(os.path.join(prefix, n)).st_mode & 0o7777
                 for n in os.listdir(prefix) if n.startswith(".safeinstall-swap-")}
        with open(report, "w") as out:
            json.dump(modes, out)
sys.setprofile(hook)
from safeinstall.__main__ import main
sys.argv[0] = "safeinstall"
sys.exit(main())
"""


@pytest.fixture
def open_bed(
    open_dir: Path,
    open_state: Path,
    units: Units,
    user_manager: UserManager,
    fake_nvml: FakeNvml,
    wheels: Wheelhouse,
) -> Iterator[Bed]:
    """sicext 1.0 in a root-owned venv others may enter: its units may run as uid 65534 (``User=``)."""
    if not AS_ROOT:
        pytest.skip("a unit's User= is taken by a run as root")
    python = wheelhouse.make_venv(open_dir / "venv", shared_interpreter_or_skip())
    wheelhouse.uv_install(python, wheels["sicext-1"])
    made = Bed(python, open_state, user_manager, fake_nvml, wheels, units)
    yield made
    made.cleanup()


def test_the_staging_directory_opened_to_a_units_user_is_closed_once_the_check_is_done(
    open_bed: Bed, tmp_path: Path
) -> None:
    """docs/threat-model.md: the staging directory becomes 0711 for the check of a unit with ``User=``
    (entered by name, never listed) and is made 0700 again once the check is done, before the stop."""
    bed = open_bed
    unit = bed.service("smoke-closed-again", User=str(NOBODY))
    report = tmp_path / "modes.json"
    prefix = bed.python.parent.parent
    bed.tool = (sys.executable, "-c", HOOK_MODES, str(prefix), str(report))
    done = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "1", "--json")
    assert done.code == 0, done.stdout + done.stderr
    (step,) = [s for s in done.json["data"]["steps"] if s["name"] == "smoke"]
    assert "imported as" in step["detail"] and "not checked" not in step["detail"], step
    modes = json.loads(report.read_text())
    assert list(modes.values()) == [0o700], {name: oct(mode) for name, mode in modes.items()}
    assert bed.version() == "2.0" and bed.manager.active_state(unit) == "active"


HOOK_PREFETCH_MODES = r"""
import glob, json, os, sys
state, report = sys.argv.pop(1), sys.argv.pop(1)
def hook(frame, event, arg):
    if event == "call" and frame.f_code.co_name == "gate_step" \
            and frame.f_globals.get("__name__") == "safeinstall.run.steps.reinstall" and not \
            os.path.exists(report):
        modes = {p: os.lstat(p).st_mode & 0o7777 for p in glob.glob(os.path.join(state, "*", "prefetch-*"))}
        with open(report, "w") as out:
            json.dump(modes, out)
sys.setprofile(hook)
from safeinstall.__main__ import main
sys.argv[0] = "safeinstall"
sys.exit(main())
"""


def test_the_prefetched_tree_opened_to_a_units_user_is_made_private_again_once_the_check_is_done(
    open_bed: Bed, tmp_path: Path
) -> None:
    """docs/threat-model.md: where the run does not swap (``--no-swap``), the check imports from the
    prefetch's ``--target`` tree, opened (0755) to a unit's ``User=`` while it runs; once the check is
    done, before the stop, that tree is private again (0700)."""
    bed = open_bed
    unit = bed.service("smoke-prefetch-closed", User=str(NOBODY))
    report = tmp_path / "modes.json"
    bed.tool = (sys.executable, "-c", HOOK_PREFETCH_MODES, str(bed.state), str(report))
    done = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--no-swap", "--settle", "1", "--json"
    )
    assert done.code == 0, done.stdout + done.stderr
    (step,) = [s for s in done.json["data"]["steps"] if s["name"] == "smoke"]
    assert "imported as" in step["detail"] and "not checked" not in step["detail"], step
    modes = json.loads(report.read_text())
    assert list(modes.values()) == [0o700], {name: oct(mode) for name, mode in modes.items()}
    assert bed.version() == "2.0" and bed.manager.active_state(unit) == "active"


# --- a signal while the journal is written -----------------------------------------------------------------

HOOK_JOURNAL = r"""
import signal, sys, threading
sent = []
def hook(frame, event, arg):
    if not sent and event == "call" and frame.f_code.co_name == "start_journal" \
            and frame.f_globals.get("__name__") == "safeinstall.store.journal":
        sent.append(True)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
sys.setprofile(hook)
from safeinstall.__main__ import main
sys.argv[0] = "safeinstall"
sys.exit(main())
"""


def test_a_signal_while_the_journal_is_written_stops_the_run_before_its_first_step(bed: Bed) -> None:
    """docs/faults.md: a signal while the run's journal is written is held back, and the run stops
    before its first step: exit 2, nothing stopped or installed, no journal left."""
    unit = bed.service("journal-signal")
    main = bed.manager.main_pid(unit)
    bed.tool = (sys.executable, "-c", HOOK_JOURNAL)
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--json")
    assert result.code == 2, result.stdout + result.stderr
    assert "interrupted by SIGTERM" in result.stdout, result.stdout
    assert bed.manager.main_pid(unit) == main and bed.version() == "1.0"
    assert bed.journal() is None


HOOK_EARLY = r"""
import gc, signal, sys, threading
where = sys.argv.pop(1)
sent = []
def hook(frame, event, arg):
    if where == "handlers-installed":
        due = event == "return" and frame.f_code.co_name == "install_early_handlers"
    else:
        due = event == "c_call" and arg is gc.freeze
    if due and not sent:
        sent.append(True)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
sys.setprofile(hook)
from safeinstall.__main__ import main
sys.argv[0] = "safeinstall"
sys.exit(main())
"""


@pytest.mark.parametrize("where", ["handlers-installed", "cli-loaded"])
def test_a_signal_just_after_the_handlers_or_the_cli_load_is_exit_2_with_an_error_line(
    tmp_path: Path, where: str
) -> None:
    """docs/faults.md: a signal before the journal is exit 2 with an ``error:`` line, also while the CLI
    loads. A SIGTERM delivered as the early handlers are installed, or as the CLI has just loaded (before
    its command starts), is that too, with its one ``--json`` document: not a traceback, exit 1 (the
    ``loading`` case of tests/test_faults.py hit the first window once, with two suites at once)."""
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            HOOK_EARLY,
            where,
            "--verify-only",
            "--all",
            "--python",
            sys.executable,
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state")},
        check=False,
    )
    assert proc.returncode == 2, (proc.returncode, proc.stdout, proc.stderr)
    assert "error: interrupted by SIGTERM" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    document = json.loads(proc.stdout)
    assert document["exit_code"] == 2 and "interrupted by SIGTERM" in document["errors"][0]["message"], (
        document
    )


# --- --only-loaded in a real run -------------------------------------------------------------------------


def test_only_loaded_in_a_real_run_leaves_the_possible_users_running(bed: Bed) -> None:
    """docs/dry-run.md: ``--only-loaded`` plans only processes with certain evidence. In a real run a
    unit whose process only runs the environment's Python (``environment`` evidence) keeps running,
    untouched, and the second scan before the install agrees (it is no late user): exit 0."""
    loaded = bed.service("only-loaded-maps")
    possible = bed.units.started("only-loaded-python", f"{bed.python} -c 'import time; time.sleep(600)'")
    loaded_main, possible_main = bed.manager.main_pid(loaded), bed.manager.main_pid(possible)
    done = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--only-loaded", "--settle", "1", "--json"
    )
    assert done.code == 0, done.stdout + done.stderr
    assert done.json["data"]["plan"]["left_out"] == [possible_main], done.json["data"]["plan"]["left_out"]
    assert bed.manager.main_pid(possible) == possible_main
    assert bed.manager.main_pid(loaded) != loaded_main and bed.version() == "2.0"


# --- the swap's late files ----------------------------------------------------------------------------------


@pytest.mark.parametrize("who", ["root", "account"])
def test_only_a_late_regular_file_of_root_or_the_directorys_owner_is_put_back(
    open_dir: Path, who: str
) -> None:
    """docs/threat-model.md: a file written into an old package directory after the backup is put back
    after the swap only when it is a regular file of root's or of the directory's owner; a third
    account's file, or a FIFO, is not given a new place (the staging directory is kept aside). By root
    in a root-owned prefix, by the account's worker in the account's."""
    from safeinstall.env import renames

    if not AS_ROOT:
        pytest.skip("files of other accounts need root")
    prefix, root = open_dir / "prefix", open_dir / "prefix" / ".safeinstall-swap-run45"
    (prefix / "pkg").mkdir(parents=True)
    os.chown(prefix / "pkg", NOBODY, NOBODY)  # the directory's owner: the environment's account
    old = root / renames.STAGED_TREE / "pkg"
    old.mkdir(parents=True)
    for name, uid in (("roots.txt", 0), ("owners.txt", NOBODY), ("thirds.txt", OTHER)):
        (old / name).write_text(f"{name}\n")
        os.chown(old / name, uid, uid)
    os.mkfifo(old / "fifo")
    os.chown(old / "fifo", NOBODY, NOBODY)
    unknown = [
        (f"{renames.STAGED_TREE}/pkg/{n}", f"pkg/{n}")
        for n in ("fifo", "owners.txt", "roots.txt", "thirds.txt")
    ]
    if who == "account":
        for path in (prefix, root, *root.rglob("*")):
            if path.is_dir():
                os.chown(path, NOBODY, NOBODY)
    left = renames.put_back_unknown(root, prefix, unknown, None if who == "root" else (NOBODY, NOBODY))
    assert sorted(left) == ["pkg/fifo", "pkg/thirds.txt"]
    assert sorted(p.name for p in (prefix / "pkg").iterdir()) == ["owners.txt", "roots.txt"]


@pytest.mark.parametrize("who", ["root", "account"])
def test_a_late_file_in_a_directory_the_new_version_drops_is_put_back(open_dir: Path, who: str) -> None:
    """docs/window.md: a file written after the backup into an old directory the new version does not
    have (a subdirectory of an exchanged package, or a package moved out whole into the attic) is put
    back where it was, its directories made again as they were, by the prefix's owner (the account's
    worker in an account's environment), as uv's uninstall leaves a directory that still holds a file;
    a directory on its way that was not the owner's keeps it aside."""
    from safeinstall.env import renames

    if not AS_ROOT:
        pytest.skip("an account's worker needs root")
    uid = NOBODY if who == "account" else 0
    prefix = open_dir / "prefix"
    root = prefix / ".safeinstall-swap-run45b"
    (prefix / "pkg").mkdir(parents=True)  # the new version's package: no ``sub`` in it
    late = {
        f"{renames.STAGED_TREE}/pkg/sub/deeper/late.txt": "pkg/sub/deeper/late.txt",  # exchanged with pkg
        f"{renames.ATTIC}/gone/late.txt": "gone/late.txt",  # a package the new version dropped
        f"{renames.ATTIC}/theirs/late.txt": "theirs/late.txt",  # its directory another account's
    }
    for where in late:
        (root / where).parent.mkdir(parents=True, exist_ok=True)
        (root / where).write_text(f"{where}\n")
    (root / renames.STAGED_TREE / "pkg" / "sub").chmod(0o750)
    for path in [prefix, *sorted(prefix.rglob("*"))]:
        os.chown(path, uid, uid)
    os.chown(root / renames.ATTIC / "theirs", OTHER, OTHER)
    left = renames.put_back_unknown(root, prefix, list(late.items()), None if uid == 0 else (uid, uid))
    assert left == ["theirs/late.txt"], left
    assert (
        prefix / "pkg/sub/deeper/late.txt"
    ).read_text() == f"{renames.STAGED_TREE}/pkg/sub/deeper/late.txt\n"
    assert (prefix / "gone/late.txt").read_text() == f"{renames.ATTIC}/gone/late.txt\n"
    made = [prefix / "pkg/sub", prefix / "pkg/sub/deeper", prefix / "gone"]
    assert [(d.stat().st_uid, d.stat().st_mode & 0o7777) for d in made] == [
        (uid, 0o750),
        (uid, 0o755),
        (uid, 0o755),
    ]
    assert not (prefix / "theirs").exists()


def test_an_accounts_run_puts_back_a_late_file_in_a_directory_the_new_version_drops(
    account: ServiceAccountBed, tmp_path: Path
) -> None:
    """End to end, in an account's environment: sicext 1.0 with a subpackage ``sicext/extra`` that 2.0
    does not have; the service (the account) writes a file into it after the backup. The swap takes the
    old ``sicext`` away whole; once 2.0 runs, the account's worker makes ``sicext/extra`` again and puts
    the file back, the account's still (uv's uninstall would have left it there); nothing kept aside."""
    extra = wheelhouse.rebuilt(
        account.wheels["sicext-1"], tmp_path / "extra", {"sicext/extra/__init__.py": b"OLD = True\n"}
    )
    wheelhouse.uv_install(account.python, extra, reinstall=True)
    chown_tree(account.python.parent.parent, NOBODY)
    name = account.unit("acct-late-dropped")
    late = account.site / "sicext" / "extra" / "late.txt"
    proc = account.start_run("sicext", "--wheel", str(account.wheels["sicext-2"]), "--settle", "1", "--json")
    try:
        account.wait_phase(proc, "staged", "gated", "stopping", timeout=120)
        subprocess.run([*AS_NOBODY, "sh", "-c", f"echo late > {late}"], check=True)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, out + err
    assert json.loads(out)["status"] == "done" and ".safeinstall-kept-" not in out + err, out + err
    assert late.read_text() == "late\n" and late.stat().st_uid == NOBODY
    assert sorted(p.name for p in late.parent.iterdir()) == ["late.txt"]  # the old module went
    assert late.parent.stat().st_uid == NOBODY
    assert not list(account.python.parent.parent.glob(".safeinstall-*"))
    assert account.version() == "2.0" and account.manager.active_state(name) == "active"


#: A process /proc shows in ``D`` until it is SIGKILLed, which a stop's SIGTERM does not end: SIGTERM
#: ignored (its vfork child inherits that), the parent waits in the kernel (TASK_KILLABLE, shown as
#: ``D``) for its child, which pauses (``S``: nothing stopped, so only the ``D`` can be named).
IGNORES_TERM_IN_D = r"""
#include <signal.h>
#include <unistd.h>
int main(void) {
    signal(SIGTERM, SIG_IGN);
    if (vfork() == 0) {
        for (;;) pause();
    }
    return 0;
}
"""


def test_a_stop_held_up_by_a_process_in_d_state_is_named_after_3_s_not_its_timeout(
    bed: Bed, tmp_path: Path
) -> None:
    """docs/faults.md (issue 44): a stop that cannot finish because a process of the unit stays in
    uninterruptible sleep (``D``) for 3 s is named then (the PID, its name, state D, ``cat
    /proc/PID/stack``, a reboot), not waited out to the unit's ``TimeoutStopSec`` (a minute here,
    after which systemd's SIGKILL would end it and the run would go on: exit 0)."""
    helper = tmp_path / "term_in_d"
    source = tmp_path / "term_in_d.c"
    source.write_text(IGNORES_TERM_IN_D)
    subprocess.run([shutil.which("gcc") or "cc", "-o", str(helper), str(source)], check=True)
    text = (
        "[Unit]\nDescription=safeinstall D-state stop test\n\n[Service]\nTimeoutStopSec=60\n"
        f"ExecStart=/bin/sh -c '{helper} & exec {{exec}}'\n"
    )
    name = bed.unit("stop-in-d", text=text)
    group = bed.manager.show(name, "ControlGroup")["ControlGroup"]

    def states() -> dict[int, str]:
        found = {}
        for pid in cgroup_pids(group):
            with contextlib.suppress(OSError):
                found[pid] = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
        return found

    wait_until(lambda: "D" in states().values(), 15, "the helper in D state")
    (stuck,) = [pid for pid, state in states().items() if state == "D"]
    mine = [pid for pid in cgroup_pids(group) if pid != bed.manager.main_pid(name)]
    try:
        result = bed.cli("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.3", "--yes")
        assert result.code == 4, result.stdout + result.stderr
        said = " ".join(result.stderr.split())
        assert f"PID {stuck} (term_in_d) is in uninterruptible sleep (state D," in said, said
        assert f"cat /proc/{stuck}/stack" in said and "reboot" in said, said
    finally:
        for pid in mine:  # the test's own processes, by PID (SIGKILL ends the vfork wait)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    recovered = bed.cli("--recover")
    assert recovered.code in (0, 3), recovered.stdout + recovered.stderr
    wait_until(lambda: bed.manager.active_state(name) == "active", 30, "the unit running again")
    assert bed.version() == "1.0"


#: In and out of ``D`` at the hook's word, SIGTERM ignored: each ``vfork`` parks the parent in ``D`` (its
#: child pauses); the child killed, the parent waits for SIGUSR1 in ``S``; 40 times, then it exits.
TERM_IN_AND_OUT_OF_D = r"""
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>
int main(void) {
    sigset_t set;
    int sig;
    signal(SIGTERM, SIG_IGN);
    sigemptyset(&set);
    sigaddset(&set, SIGUSR1);
    sigprocmask(SIG_BLOCK, &set, NULL);
    for (int i = 0; i < 40; i++) {
        pid_t child = vfork();
        if (child == 0) {
            for (;;) pause();
        }
        waitpid(child, NULL, 0);
        sigwait(&set, &sig);
    }
    return 0;
}
"""

# After each look of the stop at the unit's processes, the helper is moved on: seen in D, its paused
# child is killed (it leaves D, and waits in S); seen in S, it is sent SIGUSR1 (back in D).
HOOK_STOP_D_S_D = r"""
import os, signal, sys, threading
helper = int(sys.argv.pop(1))
def state(pid):
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0]
    except OSError:
        return ""
def hook(frame, event, arg):
    if event != "return" or frame.f_code.co_name != "look" \
            or frame.f_globals.get("__name__") != "safeinstall.system.systemd":
        return
    now = state(helper)
    if now == "D":
        with open(f"/proc/{helper}/task/{helper}/children") as children:
            for child in children.read().split():
                os.kill(int(child), signal.SIGKILL)
    elif now == "S":
        os.kill(helper, signal.SIGUSR1)
threading.setprofile(hook)
sys.setprofile(hook)
from safeinstall.__main__ import main
sys.argv[0] = "safeinstall"
sys.exit(main())
"""


def test_a_stopping_process_in_and_out_of_d_state_is_waited_for(bed: Bed, tmp_path: Path) -> None:
    """docs/faults.md: a process of a stopping unit is named only after 3 s in ``D`` *without a break*:
    one seen D, S, D, S... at each look of the stop (never twice in a row in D), for longer than 3 s
    in all, is waited for; once it exits the stop ends and the run installs (exit 0)."""
    helper = tmp_path / "term_in_and_out_of_d"
    source = tmp_path / "term_in_and_out_of_d.c"
    source.write_text(TERM_IN_AND_OUT_OF_D)
    subprocess.run([shutil.which("gcc") or "cc", "-o", str(helper), str(source)], check=True)
    text = (
        "[Unit]\nDescription=safeinstall D-state stop test\n\n[Service]\nTimeoutStopSec=60\n"
        f"ExecStart=/bin/sh -c '{helper} & exec {{exec}}'\n"
    )
    name = bed.unit("stop-d-s-d", text=text)
    group = bed.manager.show(name, "ControlGroup")["ControlGroup"]
    wait_until(lambda: any(_state(p) == "D" for p in cgroup_pids(group)), 15, "the helper in D state")
    (flipping,) = [p for p in cgroup_pids(group) if _state(p) == "D"]
    mine = [pid for pid in cgroup_pids(group) if pid != bed.manager.main_pid(name)]
    bed.tool = (sys.executable, "-c", HOOK_STOP_D_S_D, str(flipping))
    try:
        done = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.3", "--json")
        assert done.code == 0, done.stdout + done.stderr
        assert "uninterruptible" not in done.stdout + done.stderr, done.stdout + done.stderr
    finally:
        for pid in mine:  # the test's own processes, by PID
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    assert bed.version() == "2.0" and bed.manager.active_state(name) == "active"
