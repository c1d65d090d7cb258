"""safeinstall.scan.processes: real processes of real uv-made venvs, a fake /proc for the odd cases."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from safeinstall.env.dependents import dependents, describe_chain, marker_environment, weigh_dependents
from safeinstall.env.distributions import (
    InstalledDistribution,
    find_distribution,
    find_distributions,
    load_distribution,
)
from safeinstall.env.environment import Environment, inspect_environment
from safeinstall.scan import processes
from safeinstall.scan.evidence import (
    Evidence,
    EvidenceKind,
    Strength,
    TargetIndex,
    argv_needs_links,
    match_argv,
    match_fds,
    match_maps,
    parse_cmdline,
    parse_python_argv,
)
from safeinstall.scan.plan import left_on_old_code
from safeinstall.scan.processes import ScanProblem, ScanResult, scan_processes
from safeinstall.scan.targets import Target, build_target, directory_owners, environment_scope, load_targets
from safeinstall.system import forking
from safeinstall.system.cgroups import placement_of_proc_cgroup
from safeinstall.system.identity import PF_KTHREAD, parse_stat
from tests import wheelhouse

SO = "_native.cpython-"  # the mapped file of sicext, whatever the ABI tag

# --------------------------------------------------------------------------------- real processes

Spawn = Callable[..., subprocess.Popen[bytes]]


@pytest.fixture
def spawn() -> Iterator[Spawn]:
    """Start processes; every one is killed (by its PID) and reaped afterwards."""
    started: list[subprocess.Popen[bytes]] = []

    def start(
        argv: list[str],
        cwd: Path | None = None,
        stdin: int = subprocess.DEVNULL,
        stdout: int = subprocess.DEVNULL,
    ) -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(argv, cwd=cwd, stdin=stdin, stdout=stdout, stderr=subprocess.DEVNULL)
        started.append(proc)
        return proc

    try:
        yield start
    finally:
        for proc in started:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGKILL)
        for proc in started:
            proc.wait(timeout=30)
            for pipe in (proc.stdin, proc.stdout):
                if pipe:
                    pipe.close()


def wait_for(
    what: str, proc: subprocess.Popen[bytes], check: Callable[[], bool], timeout: float = 30.0
) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{proc.args!r} exited ({proc.returncode}) before {what}"
        try:
            if check():
                return
        except OSError:
            pass
        time.sleep(0.02)
    raise AssertionError(f"{proc.args!r}: no {what} after {timeout}s")


def read_cmdline(pid: int) -> tuple[str, ...]:
    return parse_cmdline(Path(f"/proc/{pid}/cmdline").read_bytes())


def holds_no_open(pid: int, needle: str) -> bool:
    return not [fd for fd in os.listdir(f"/proc/{pid}/fd") if needle in os.readlink(f"/proc/{pid}/fd/{fd}")]


def wait_mapped(proc: subprocess.Popen[bytes], needle: str = SO) -> None:
    """Until the extension is mapped and the import is over (dlopen holds the file open a moment)."""
    wait_for(f"{needle} in maps", proc, lambda: needle in Path(f"/proc/{proc.pid}/maps").read_text())
    wait_imported(proc)


def wait_imported(proc: subprocess.Popen[bytes]) -> None:
    wait_for("imports done", proc, functools.partial(holds_no_open, proc.pid, "/site-packages/"))


def wait_serving(proc: subprocess.Popen[bytes]) -> None:
    """Until a fixture's server (started with ``stdout=PIPE``) says it serves: its imports are over.
    (No file of the package held open at one look is not enough: between two imports it holds none.)"""
    stdout = proc.stdout
    assert stdout is not None
    wait_for("serving", proc, lambda: bool(select.select([stdout], [], [], 0.5)[0]))
    assert b"serving" in stdout.readline()


def wait_exec(proc: subprocess.Popen[bytes], needle: str) -> None:
    """Until the child has exec'd (before that its cmdline is the parent's)."""
    wait_for(f"{needle} in cmdline", proc, lambda: any(needle in arg for arg in read_cmdline(proc.pid)))


def env_and_targets(python: Path, *names: str) -> tuple[Environment, tuple[Target, ...]]:
    env = inspect_environment(python)
    installed = find_distributions(env)
    dists = [find_distribution(env, name, installed) for name in names]
    return env, load_targets(dists, env, installed)


def evidence_of(result: ScanResult, pid: int) -> tuple[Evidence, ...]:
    record = result.by_pid()[pid]
    return record.evidence


@pytest.fixture
def sicext_venv(venv: Path, wheels: wheelhouse.Wheelhouse) -> Path:
    wheelhouse.uv_install(venv, wheels["sicext-1"], wheels["sipure-1"], link_mode="copy")
    return venv


def test_mapped_extension_found_by_inode_and_by_path(sicext_venv: Path, spawn: Spawn) -> None:
    env, targets = env_and_targets(sicext_venv, "sicext")
    (target,) = targets
    so = next(path for path in target.files if SO in path)
    user = spawn([str(sicext_venv), "-c", "import sicext, time; time.sleep(60)"])
    bystander = spawn(["sleep", "60"])
    wait_mapped(user)
    wait_exec(bystander, "sleep")

    result = scan_processes(targets)

    (evidence,) = evidence_of(result, user.pid)
    assert evidence.kind is EvidenceKind.MAPPED and evidence.distribution == "sicext"
    assert evidence.path == so and not evidence.deleted
    assert "dev/inode" in evidence.detail and "path" in evidence.detail
    assert user.pid in {p.pid for p in result.affected}
    # each way of matching suffices on its own: inode alone (overlayfs may show another path) ...
    by_inode = dataclasses.replace(target, files=frozenset(), directories=())
    (only_inode,) = evidence_of(scan_processes([by_inode]), user.pid)
    assert only_inode.detail.startswith("dev/inode ") and only_inode.path == so
    # ... and path alone (overlayfs may show another device/inode)
    by_path = dataclasses.replace(target, file_ids=frozenset())
    (only_path,) = evidence_of(scan_processes([by_path]), user.pid)
    assert only_path.detail == "path"

    # the unrelated process is recorded, lightly and exactly, but not affected
    record = result.by_pid()[bystander.pid]
    assert record.evidence == () and not record.affected
    assert record.cmdline == ("sleep", "60") and record.name == "sleep"
    assert record.ppid == os.getpid() and record.uid == os.geteuid() and record.user == "root"
    assert record.cgroup_text == Path(f"/proc/{bystander.pid}/cgroup").read_text()
    assert record.process.start == parse_stat(Path(f"/proc/{bystander.pid}/stat").read_text()).start_time
    assert record.state in {"S", "R"} and not record.is_self
    # every process is there, the scanner itself marked, not skipped
    assert result.self_pid == os.getpid() and result.by_pid()[os.getpid()].is_self
    assert result.scanned_count >= len(result.processes) > 2
    assert {p.reason for p in result.problems} <= {"vanished", "permission denied"}  # a busy host
    assert env.is_venv


def test_open_file_in_package_directory(sicext_venv: Path, spawn: Spawn) -> None:
    _, targets = env_and_targets(sicext_venv, "sicext")
    (target,) = targets
    package = Path(target.directories[0])
    assert package.name == "sicext"
    (package / "cache.bin").write_bytes(b"not in RECORD")
    code = "import time; a = open({!r}); b = open({!r}); time.sleep(60)".format(
        str(package / "serve.py"), str(package / "cache.bin")
    )
    holder = spawn([str(sicext_venv), "-c", code])  # opens, never imports: nothing mapped
    wait_for("both files open", holder, lambda: not holds_no_open(holder.pid, "cache.bin"))

    evidence = evidence_of(scan_processes(targets), holder.pid)

    assert {(e.kind, e.path, e.detail) for e in evidence} == {
        (EvidenceKind.OPEN, str(package / "serve.py"), "path"),
        (EvidenceKind.OPEN, str(package / "cache.bin"), "directory"),
    }


def test_console_scripts_in_argv(sicext_venv: Path, spawn: Spawn) -> None:
    _, targets = env_and_targets(sicext_venv, "sicext", "sipure")
    bin_dir = sicext_venv.parent
    sicext_serve = spawn([str(bin_dir / "sicext-serve"), "--lazy"])
    sipure_serve = spawn([str(bin_dir / "sipure"), "--serve"], stdout=subprocess.PIPE)
    # a relative path, resolved through /proc/PID/cwd
    relative = spawn(["bin/sipure", "--serve"], cwd=bin_dir.parent, stdout=subprocess.PIPE)
    for proc in (relative, sipure_serve):
        wait_serving(proc)
    for proc in (sicext_serve, relative, sipure_serve):
        wait_exec(proc, "bin/si")
        # the kernel runs the shebang: argv becomes [venv python, script, ...]
        assert read_cmdline(proc.pid)[0].endswith("/python")
        # while starting, python holds the script open (open evidence, rightly): wait until it is done
        wait_for("the script closed", proc, functools.partial(holds_no_open, proc.pid, "/bin/si"))
        wait_imported(proc)  # and the package's sources, while it imports them

    result = scan_processes(targets)

    # (importing sicext.serve imports sicext, which maps the extension too: mapped evidence, maybe)
    assert [e for e in evidence_of(result, sicext_serve.pid) if e.kind is EvidenceKind.ARGV] == [
        Evidence(
            EvidenceKind.ARGV,
            "sicext",
            str(bin_dir / "sicext-serve"),
            False,
            f"console script run by {read_cmdline(sicext_serve.pid)[0]}",
        ),
    ]
    for proc in (sipure_serve, relative):
        (evidence,) = evidence_of(result, proc.pid)  # pure Python: nothing mapped, only argv
        assert (evidence.kind, evidence.distribution, evidence.path) == (
            EvidenceKind.ARGV,
            "sipure",
            str(bin_dir / "sipure"),
        )


def test_python_dash_m_with_the_environments_interpreter(sicext_venv: Path, spawn: Spawn) -> None:
    _, targets = env_and_targets(sicext_venv, "sicext", "sipure")
    venv_dir = sicext_venv.parent.parent
    serve = spawn([str(sicext_venv), "-m", "sicext.serve", "--lazy"])
    # sipure.cli has no __main__ guard: -i keeps the interpreter waiting on stdin after running it
    pure = spawn(
        ["bin/python", "-u", "-i", "-m", "sipure.cli", "--serve"], cwd=venv_dir, stdin=subprocess.PIPE
    )
    wait_mapped(serve)
    wait_exec(pure, "sipure.cli")
    wait_imported(pure)

    result = scan_processes(targets)

    kinds = {(e.kind, e.distribution, e.path) for e in evidence_of(result, serve.pid)}
    assert (EvidenceKind.ARGV, "sicext", "sicext.serve") in kinds
    assert EvidenceKind.MAPPED in {kind for kind, _, _ in kinds}
    assert evidence_of(result, pure.pid) == (
        Evidence(EvidenceKind.ARGV, "sipure", "sipure.cli", False, "bin/python -m sipure.cli"),
    )


def test_reinstall_under_a_running_process_shows_old_code(
    sicext_venv: Path, wheels: wheelhouse.Wheelhouse, spawn: Spawn
) -> None:
    _, before = env_and_targets(sicext_venv, "sicext")
    user = spawn([str(sicext_venv), "-c", "import sicext, time; time.sleep(60)"])
    wait_mapped(user)

    wheelhouse.uv_install(sicext_venv, wheels["sicext-2"], link_mode="copy", reinstall=True)
    wait_mapped(user, ".so (deleted)")
    _, after = env_and_targets(sicext_venv, "sicext")
    assert after[0].version == "2.0" and after[0].file_ids != before[0].file_ids

    for targets in (before, after):  # the targets of the old install and those of the new one
        (evidence,) = evidence_of(scan_processes(targets), user.pid)
        assert evidence.kind is EvidenceKind.MAPPED and evidence.deleted
        assert SO in evidence.path and not evidence.path.endswith("(deleted)")
        assert "dev/inode" not in evidence.detail  # a deleted file is matched by path only
        assert "running old code" in evidence.describe()


def test_the_end_check_reports_a_process_on_old_code_outside_any_unit(
    sicext_venv: Path, wheels: wheelhouse.Wheelhouse, spawn: Spawn
) -> None:
    """Issue 35: a process that is no unit's (started by hand, in this test's own cgroup) and still maps
    the replaced extension is one the end check reports (``left_on_old_code``), with no unit."""
    user = spawn([str(sicext_venv), "-c", "import sicext, time; time.sleep(60)"])
    wait_mapped(user)
    placement = placement_of_proc_cgroup(Path(f"/proc/{user.pid}/cgroup").read_text())
    if placement.unit is not None:
        pytest.skip(f"the test runs in the unit {placement.unit}")
    wheelhouse.uv_install(sicext_venv, wheels["sicext-2"], link_mode="copy", reinstall=True)
    wait_mapped(user, ".so (deleted)")
    _, after = env_and_targets(sicext_venv, "sicext")
    left = [p for p in left_on_old_code(scan_processes(after)) if p.pid == user.pid]
    assert [(p.unit, p.distributions) for p in left] == [(None, ("sicext",))]
    assert any(SO in path for path in left[0].paths)


def test_hardlink_twin_in_another_environment_is_not_evidence(
    tmp_path: Path, wheels: wheelhouse.Wheelhouse, spawn: Spawn
) -> None:
    """uv hardlinks every environment it installs a wheel into to the same cache inodes: a process of
    environment B maps the very inode of A's extension, yet a reinstall of A does not touch it."""
    here = wheelhouse.make_venv(tmp_path / "a")
    there = wheelhouse.make_venv(tmp_path / "b")
    for python in (here, there):
        wheelhouse.uv_install(python, wheels["sicext-1"], link_mode="hardlink")
    _, (target,) = env_and_targets(here, "sicext")
    so = next(path for path in target.files if SO in path)
    twin = so.replace(str(tmp_path / "a"), str(tmp_path / "b"))
    assert os.stat(so).st_ino == os.stat(twin).st_ino  # the premise: one inode, two environments
    ours = spawn([str(here), "-c", "import sicext, time; time.sleep(60)"])
    theirs = spawn([str(there), "-c", "import sicext, time; time.sleep(60)"])
    wait_mapped(ours)
    wait_mapped(theirs)

    result = scan_processes([target])

    assert [e.path for e in evidence_of(result, ours.pid)] == [so]
    assert evidence_of(result, theirs.pid) == ()


def test_bind_mounted_view_of_the_environment_is_found_by_inode(
    venv: Path, wheels: wheelhouse.Wheelhouse, tmp_path: Path, spawn: Spawn
) -> None:
    """A process that sees this environment at another path (a container's bind mount) maps the same
    inode under a path that is not ours; its directory, seen through the process's root, is ours."""
    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private mount namespace")
    wheelhouse.uv_install(venv, wheels["sicext-1"], link_mode="copy")
    _, (target,) = env_and_targets(venv, "sicext")
    prefix = venv.parent.parent
    view = tmp_path / "view"
    view.mkdir()
    code = "import sicext, time; time.sleep(60)"
    script = f'mount --bind {prefix} {view} && exec {view}/bin/python -c "{code}"'
    user = spawn(["unshare", "--mount", "--propagation", "private", "sh", "-c", script])
    wait_mapped(user)

    (evidence,) = evidence_of(scan_processes([target]), user.pid)

    assert evidence.path.startswith(f"{view}/") and evidence.detail.startswith("dev/inode ")
    assert not any(str(view) in path for path in target.files)  # matched by inode, not by path


def test_symlinked_install_is_found_through_the_cache(
    venv: Path, wheels: wheelhouse.Wheelhouse, spawn: Spawn
) -> None:
    wheelhouse.uv_install(venv, wheels["sicext-1"], link_mode="symlink")
    _, (target,) = env_and_targets(venv, "sicext")
    installed_so = next(path for path in target.files if SO in path and "site-packages" in path)
    assert os.path.islink(installed_so)
    cached_so = os.path.realpath(installed_so)
    cached_serve = os.path.join(os.path.dirname(cached_so), "serve.py")
    assert {cached_so, cached_serve} <= target.files  # the aliases
    code = f"import sicext, time; f = open({str(Path(target.directories[0]) / 'serve.py')!r}); time.sleep(60)"
    user = spawn([str(venv), "-c", code])
    wait_mapped(user)
    wait_for("dlopen done", user, functools.partial(holds_no_open, user.pid, cached_so))

    evidence = evidence_of(scan_processes([target]), user.pid)

    assert {(e.kind, e.path) for e in evidence} == {
        (EvidenceKind.MAPPED, cached_so),
        (EvidenceKind.OPEN, cached_serve),
    }
    mapped = next(e for e in evidence if e.kind is EvidenceKind.MAPPED)
    assert mapped.detail.startswith("dev/inode ")


def test_processes_that_do_not_use_the_targets(sicext_venv: Path, spawn: Spawn) -> None:
    _, targets = env_and_targets(sicext_venv, "sicext")
    other = spawn([sys.executable, "-c", "import time; time.sleep(60)"])  # another environment
    wait_exec(other, "time.sleep")
    result = scan_processes(targets)
    assert not result.by_pid()[other.pid].affected


def test_zombie_is_recorded_without_problems(spawn: Spawn) -> None:
    zombie = spawn(["true"])  # exits at once; not reaped until the fixture waits for it
    deadline = time.monotonic() + 30
    while parse_stat(Path(f"/proc/{zombie.pid}/stat").read_text()).state != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    result = scan_processes([])
    record = result.by_pid()[zombie.pid]
    assert record.state == "Z" and record.cmdline == () and record.evidence == ()
    assert not [p for p in result.problems if p.pid == zombie.pid]


def test_forked_workers_find_the_same(sicext_venv: Path, spawn: Spawn) -> None:
    _, targets = env_and_targets(sicext_venv, "sicext")
    user = spawn([str(sicext_venv), "-c", "import sicext, time; time.sleep(60)"])
    others = [spawn(["sleep", "60"]) for _ in range(5)]
    wait_mapped(user)
    for proc in others:
        wait_exec(proc, "sleep")
    mine = {user.pid, *(p.pid for p in others)}

    serial = scan_processes(targets, workers=1)
    forked = scan_processes(targets, workers=3)

    assert [p.pid for p in forked.processes] == sorted(p.pid for p in forked.processes)
    assert {p.pid: p for p in forked.processes if p.pid in mine} == {
        p.pid: p for p in serial.processes if p.pid in mine
    }
    assert forked.by_pid()[user.pid].affected
    # this process itself (its state may differ: a worker may see it waiting) is marked either way
    me_serial, me_forked = serial.by_pid()[os.getpid()], forked.by_pid()[os.getpid()]
    assert me_forked.is_self and me_serial.is_self and me_forked.cmdline == me_serial.cmdline
    assert processes.default_workers(10) == 1  # a small scan is not worth a fork


def test_a_failed_worker_share_is_scanned_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = tmp_path / "proc"
    root.mkdir()
    for pid in range(100, 110):
        make_process(root, pid, maps=MAPS if pid % 3 == 0 else "")
    (root / "107" / "maps").unlink()
    expected = scan_processes([fake_target()], proc_root=root, self_pid=105, workers=1)
    assert scan_processes([fake_target()], proc_root=root, self_pid=105, workers=4) == expected

    monkeypatch.setattr(forking, "_run_child", lambda *args: os._exit(3))
    assert scan_processes([fake_target()], proc_root=root, self_pid=105, workers=4) == expected
    assert expected.problems == (ScanProblem(107, "maps", "vanished"),)
    assert [p.pid for p in expected.affected] == [102, 105, 108]


def test_no_fork_while_other_threads_run() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert processes.default_workers(10_000) == 1
    finally:
        stop.set()
        thread.join()
    assert processes.default_workers(10_000) >= 1


def test_targets_of_a_real_environment(venv: Path, wheels: wheelhouse.Wheelhouse) -> None:
    wheelhouse.uv_install(venv, wheels["sicext-1"], wheels["sins-a"], wheels["sins-b"])
    env, targets = env_and_targets(venv, "sicext", "sins-a", "sins-b")
    sicext, sins_a, sins_b = targets
    site = str(env.purelib)
    assert sicext.directories == (f"{site}/sicext",)
    assert sicext.modules == {"sicext"}
    assert sicext.console_scripts >= {f"{env.scripts}/sicext-serve"}
    assert f"{site}/sicext/__init__.py" in sicext.files
    assert all(os.path.isabs(path) and ".." not in path.split("/") for path in sicext.files)
    assert len(sicext.file_ids) == len([f for f in sicext.files if os.path.exists(f)])
    assert str(venv) in sicext.interpreters and str(env.scripts / "python3") in sicext.interpreters
    # the namespace package sins is shared: each owns only its own part
    assert sins_a.directories == (f"{site}/sins/a",) and sins_a.modules == {"sins.a"}
    assert sins_b.directories == (f"{site}/sins/b",) and sins_b.modules == {"sins.b"}
    assert not sins_a.console_scripts


def test_unreadable_processes_are_problems_not_omissions(spawn: Spawn) -> None:
    """As an unprivileged user (a forked child), root's processes deny maps and fd: reported."""
    holder = spawn(["sleep", "60"])
    wait_exec(holder, "sleep")
    fake = Path(tempfile.mkdtemp(prefix="safeinstall-fakeproc-"))
    try:
        fake.chmod(0o755)
        process = make_process(fake, 700, maps="")
        (process / "maps").chmod(0)
        (process / "fd").chmod(0o700)
        read, write = os.pipe()
        child = os.fork()
        if child == 0:  # pragma: no cover - runs in the child
            try:
                os.close(read)
                os.setgroups([])
                os.setresgid(65534, 65534, 65534)
                os.setresuid(65534, 65534, 65534)
                real = scan_processes([])
                faked = scan_processes([], proc_root=fake)
                report = {
                    "real": [[p.pid, p.reading, p.reason] for p in real.problems],
                    "real_pids": [p.pid for p in real.processes],
                    "fake": [[p.pid, p.reading, p.reason] for p in faked.problems],
                    "fake_pids": [p.pid for p in faked.processes],
                }
                os.write(write, json.dumps(report).encode())
            except BaseException:
                os.write(write, json.dumps({"error": traceback.format_exc()}).encode())
            finally:
                os._exit(0)
        os.close(write)
        with os.fdopen(read, "rb") as pipe:
            report = json.loads(pipe.read())
        os.waitpid(child, 0)
    finally:
        shutil.rmtree(fake)  # root: modes do not stop it
    assert "error" not in report, report.get("error")
    assert [holder.pid, "maps", "permission denied"] in report["real"]
    assert [holder.pid, "fd", "permission denied"] in report["real"]
    assert holder.pid in report["real_pids"]  # still recorded, from what could be read
    assert report["fake"] == [[700, "maps", "permission denied"], [700, "fd", "permission denied"]]
    assert report["fake_pids"] == [700]


# ------------------------------------------------------------------------------------- fake /proc

SITE = "/srv/app/venv/lib/python3.11/site-packages"
BIN = "/srv/app/venv/bin"
SO_PATH = f"{SITE}/fastlib/_core.cpython-311-x86_64-linux-gnu.so"
SPACED = f"{SITE}/spaced lib/odd name.so"
PAD = " "  # the kernel ends an anonymous mapping's line with a space


def fake_target(**changes: Any) -> Target:
    target = Target(
        distribution="fastlib",
        version="1.0",
        files=frozenset(
            {SO_PATH, f"{SITE}/fastlib/__init__.py", f"{BIN}/fastlib-serve", SPACED, f"{SITE}/fastlib_top.py"}
        ),
        file_ids=frozenset({(os.makedev(0xFD, 0x01), 4242)}),
        directories=(f"{SITE}/fastlib", f"{SITE}/spaced lib"),
        console_scripts=frozenset({f"{BIN}/fastlib-serve"}),
        modules=frozenset({"fastlib", "fastlib_top"}),
        interpreters=frozenset({f"{BIN}/python", f"{BIN}/python3"}),
    )
    return dataclasses.replace(target, **changes)


def stat_line(
    pid: int, name: str, *, state: str = "S", ppid: int = 1, flags: int = 0x400100, start_time: int = 5000
) -> str:
    middle = " ".join(["0"] * 12)
    return (
        f"{pid} ({name}) {state} {ppid} {pid} {pid} 0 -1 {flags} {middle} {start_time} "
        "12869632 2212 18446744073709551615 0 0 0 0 0 0 0 1 0 0 17 1 0 0 0 0 0\n"
    )


def make_process(
    root: Path,
    pid: int,
    *,
    name: str = "svc",
    uid: int = 0,
    ppid: int = 1,
    flags: int = 0x400100,
    cmdline: tuple[str, ...] = ("/usr/bin/svc",),
    cgroup: str = "0::/system.slice/svc.service\n",
    maps: str | None = "",
    fds: dict[str, str] | None = None,
    files: tuple[str, ...] | None = None,
) -> Path:
    """A /proc/PID directory; ``files`` limits which of its files exist (a process vanishing)."""
    directory = root / str(pid)
    directory.mkdir(mode=0o755)
    os.chown(directory, uid, uid)  # the owner of /proc/PID is the process's euid
    content = {
        "stat": stat_line(pid, name, ppid=ppid, flags=flags),
        "cmdline": "".join(f"{arg}\0" for arg in cmdline),
        "cgroup": cgroup,
        "maps": maps,
    }
    for filename, text in content.items():
        if text is not None and (files is None or filename in files):
            (directory / filename).write_text(text)
    if files is None or "fd" in files:
        (directory / "fd").mkdir()
        for number, target in (fds or {"0": "/dev/null", "1": "pipe:[1234]"}).items():
            (directory / "fd" / number).symlink_to(target)
    return directory


MAPS = f"""\
55d4c3a00000-55d4c3a2c000 r--p 00000000 fd:01 1234                       /usr/bin/python3.11
55d4c5b1e000-55d4c5c6a000 rw-p 00000000 00:00 0                          [heap]
7f2e19019000-7f2e1901a000 r--p 00000000 fd:01 4242                       {SO_PATH}
7f2e1901a000-7f2e1901b000 r-xp 00001000 fd:01 4242                       {SO_PATH}
7f2e19020000-7f2e19021000 rw-p 00000000 00:00 0{PAD}
7f2e19030000-7f2e19031000 r--p 00000000 fd:01 777                        {SPACED}
7f2e19040000-7f2e19041000 r--p 00000000 fd:01 778                        {SITE}/fastlib/_old.so (deleted)
7f2e19050000-7f2e19051000 r--p 00000000 00:05 4242                       /dev/zero (deleted)
7ffc1b3fe000-7ffc1b402000 r--p 00000000 00:00 0                          [vvar]
7ffc1b402000-7ffc1b404000 r-xp 00000000 00:00 0                          [vdso]
ffffffffff600000-ffffffffff601000 --xp 00000000 00:00 0                  [vsyscall]
"""


def test_match_maps() -> None:
    evidence = match_maps(MAPS, [fake_target()])
    assert [(e.path, e.deleted, e.detail) for e in evidence] == [
        (SO_PATH, False, "dev/inode fd:01 4242, path"),  # one per file, not per mapping
        (SPACED, False, "path"),
        (f"{SITE}/fastlib/_old.so", True, "directory"),  # not in RECORD any more, but its directory
    ]
    assert all(e.kind is EvidenceKind.MAPPED and e.distribution == "fastlib" for e in evidence)
    # /dev/zero (deleted) on another device with inode 4242: a deleted path never matches by inode
    assert match_maps(MAPS.replace(SITE, "/elsewhere"), [fake_target()]) == (
        Evidence(
            EvidenceKind.MAPPED,
            "fastlib",
            "/elsewhere/fastlib/_core.cpython-311-x86_64-linux-gnu.so",
            False,
            "dev/inode fd:01 4242",
        ),
    )
    assert (
        match_maps(MAPS, [fake_target(file_ids=frozenset({(os.makedev(0xFD, 2), 4242)}))])[0].detail == "path"
    )
    assert match_maps("", [fake_target()]) == ()
    other = fake_target(
        distribution="other", files=frozenset({SO_PATH}), file_ids=frozenset(), directories=()
    )
    both = match_maps(MAPS, [fake_target(), other])
    assert {e.distribution for e in both if e.path == SO_PATH} == {"fastlib", "other"}


def test_match_maps_inode_only_needs_one_of_our_directories() -> None:
    """An inode match under another path: kept when that directory is ours (a bind mount) or when it
    cannot be told; dropped when it is another directory (a hardlink twin in another environment)."""
    elsewhere = MAPS.replace(SITE, "/other-env/site-packages")
    ours = (os.makedev(0xFD, 1), 10)
    target = fake_target(directory_ids=frozenset({ours}))
    seen: list[str] = []

    def locate(answer: tuple[int, int] | None) -> Callable[[str], tuple[int, int] | None]:
        def at(directory: str) -> tuple[int, int] | None:
            seen.append(directory)
            return answer

        return at

    assert [e.detail for e in match_maps(elsewhere, [target], locate(ours))] == ["dev/inode fd:01 4242"]
    assert seen == ["/other-env/site-packages/fastlib"]
    assert match_maps(elsewhere, [target], locate((os.makedev(0xFD, 1), 11))) == ()
    assert len(match_maps(elsewhere, [target], locate(None))) == 1  # cannot tell: the safe side
    assert len(match_maps(elsewhere, [target])) == 1
    seen.clear()  # a path match needs no look at the directory
    assert match_maps(MAPS, [target], locate((0, 0)))[0].detail == "dev/inode fd:01 4242, path"
    assert seen == []


def test_match_maps_newline_in_a_path() -> None:
    odd = f"{SITE}/fastlib/we\nird.so"
    line = rf"7f00-7f01 r-xp 00000000 fd:01 99                         {SITE}/fastlib/we\012ird.so"
    target = fake_target(files=frozenset({odd}), directories=(), file_ids=frozenset())
    assert match_maps(line, [target]) == (Evidence(EvidenceKind.MAPPED, "fastlib", odd, False, "path"),)
    in_dir = fake_target(files=frozenset(), directories=(f"{SITE}/fast\nlib",), file_ids=frozenset())
    line = rf"7f00-7f01 r-xp 00000000 fd:01 99                         {SITE}/fast\012lib/x.so (deleted)"
    assert match_maps(line, [in_dir]) == (
        Evidence(EvidenceKind.MAPPED, "fastlib", f"{SITE}/fast\nlib/x.so", True, "directory"),
    )


def test_match_fds() -> None:
    links = [
        "/dev/null",
        "socket:[99]",
        "pipe:[3]",
        "anon_inode:[eventfd]",
        f"{SITE}/fastlib/data.bin",
        f"{SITE}/fastlib/__init__.py",
        f"{SITE}/fastlib/__init__.py",
        f"{SITE}/fastlib2/x",
        f"{SITE}/fastlib/gone.txt (deleted)",
        f"{SITE}/fastlib_top.py",
    ]
    evidence = match_fds(links, [fake_target()])
    assert [(e.path, e.deleted, e.detail) for e in evidence] == [
        (f"{SITE}/fastlib/data.bin", False, "directory"),
        (f"{SITE}/fastlib/__init__.py", False, "path"),
        (f"{SITE}/fastlib/gone.txt", True, "directory"),
        (f"{SITE}/fastlib_top.py", False, "path"),
    ]
    assert all(e.kind is EvidenceKind.OPEN for e in evidence)


@pytest.mark.parametrize(
    ("args", "module", "script"),
    [
        (["-m", "pkg.mod", "--x"], "pkg.mod", None),
        (["-mpkg"], "pkg", None),
        (["-Im", "pkg"], "pkg", None),
        (["-u", "-X", "dev", "-W", "ignore", "-m", "pkg"], "pkg", None),
        (["-Xdev", "-Wignore", "-Esm", "pkg"], "pkg", None),
        (["--check-hash-based-pycs", "always", "-m", "pkg"], "pkg", None),
        (["-c", "import pkg", "-m", "pkg"], None, None),
        (["-Bc", "x"], None, None),
        (["/srv/bin/tool", "-m", "pkg"], None, "/srv/bin/tool"),
        (["-u", "--", "-weird"], None, "-weird"),
        (["-"], None, None),
        ([], None, None),
    ],
)
def test_parse_python_argv(args: list[str], module: str | None, script: str | None) -> None:
    invocation = parse_python_argv(args)
    assert (invocation.module, invocation.script) == (module, script)


def test_match_argv() -> None:
    index = TargetIndex.of([fake_target()])
    script = f"{BIN}/fastlib-serve"

    def kinds(cmdline: tuple[str, ...], exe: str | None = None, cwd: str | None = None) -> list[str]:
        return [f"{e.distribution}:{e.path}" for e in match_argv(cmdline, index, exe=exe, cwd=cwd)]

    assert kinds((script, "--port", "1")) == [f"fastlib:{script}"]
    assert kinds((f"{BIN}/python", script)) == [f"fastlib:{script}"]  # a shebang, as the kernel runs it
    assert kinds(("/usr/bin/python3", "-u", script)) == [f"fastlib:{script}"]
    assert kinds(("/bin/sh", script)) == [f"fastlib:{script}"]
    assert kinds((f"{BIN}/python", "-m", "fastlib")) == ["fastlib:fastlib"]
    assert kinds((f"{BIN}/python3", "-m", "fastlib.server.main")) == ["fastlib:fastlib.server.main"]
    assert kinds((f"{BIN}/python", "-m", "fastlib_top")) == ["fastlib:fastlib_top"]
    assert kinds((f"{BIN}/python", "-m", "fastlibx")) == []  # a prefix of the name is not the module
    assert kinds(("/usr/bin/python3", "-m", "fastlib")) == []  # another environment's interpreter
    assert kinds((f"{BIN}/python", "-c", "import fastlib")) == []
    assert kinds(("/usr/bin/vim", script)) == []  # editing the script is not running it
    assert kinds(()) == []
    # relative paths are resolved against the process's cwd, a bare name through its exe
    assert kinds(("./fastlib-serve",), cwd=BIN) == [f"fastlib:{script}"]
    assert kinds(("bin/python", "-m", "fastlib"), cwd="/srv/app/venv") == ["fastlib:fastlib"]
    assert kinds(("bin/python", "-m", "fastlib")) == []
    assert kinds(("python", "-m", "fastlib"), exe=f"{BIN}/python3") == ["fastlib:fastlib"]
    # a venv's python resolves to the shared base interpreter: a bare "python" there is not recognised
    assert kinds(("python", "-m", "fastlib"), exe="/usr/bin/python3.11") == []
    assert argv_needs_links(("python", "-m", "fastlib"), index)
    assert argv_needs_links(("./fastlib-serve",), index)
    assert not argv_needs_links((f"{BIN}/python", "-m", "fastlib"), index)
    assert not argv_needs_links(("sleep", "60"), index)


def test_parse_stat_and_cmdline() -> None:
    stat = parse_stat(stat_line(42, "a) (b c", state="Z", ppid=7, start_time=123456))
    assert (stat.pid, stat.name, stat.state, stat.ppid, stat.start_time) == (42, "a) (b c", "Z", 7, 123456)
    assert not stat.kernel_thread
    assert parse_stat(stat_line(2, "kthreadd", flags=PF_KTHREAD | 0x40)).kernel_thread
    with pytest.raises(ValueError):
        parse_stat("42 no parens here")
    with pytest.raises(ValueError):
        parse_stat("42 (short) S 1 2\n")
    assert parse_cmdline(b"python\0-m\0x y\0") == ("python", "-m", "x y")
    assert parse_cmdline(b"nginx: worker process") == ("nginx: worker process",)
    assert parse_cmdline(b"") == ()
    assert parse_cmdline(b"caf\xe9\0") == ("caf\udce9",)


def test_scan_of_a_fake_proc(tmp_path: Path) -> None:
    root = tmp_path / "proc"
    root.mkdir()
    (root / "self").symlink_to("300")
    (root / "meminfo").write_text("MemTotal: 1 kB\n")
    make_process(root, 2, name="kthreadd", flags=PF_KTHREAD, cmdline=(), maps=None, ppid=0)
    make_process(
        root,
        100,
        name="fastlib-serve",
        uid=54321,
        cmdline=(f"{BIN}/python", f"{BIN}/fastlib-serve"),
        maps=MAPS,
        fds={"3": f"{SITE}/fastlib/__init__.py", "4": "socket:[1]"},
    )
    make_process(root, 200, name="gone")  # vanished between listing and reading its maps
    (root / "200" / "maps").unlink()
    (root / "250").mkdir()  # vanished before anything could be read
    make_process(root, 260, files=("stat", "cmdline", "cgroup", "maps"))  # gone at fd/
    make_process(root, 270, name="bad")
    (root / "270" / "stat").write_text("garbage\n")
    make_process(root, 300, name="safeinstall", cmdline=("safeinstall", "sipure"))

    result = scan_processes([fake_target()], proc_root=root, self_pid=300)

    assert result.scanned_count == 7  # 2, 100, 200, 250, 260, 270, 300
    assert [p.pid for p in result.processes] == [100, 300]  # kernel thread skipped, vanished dropped
    assert sorted(result.problems, key=lambda p: p.pid) == [
        ScanProblem(200, "maps", "vanished"),
        ScanProblem(250, "stat", "vanished"),
        ScanProblem(260, "fd", "vanished"),
        ScanProblem(270, "stat", "malformed: no (comm) in stat: 'garbage\\n'"),
    ]
    service, me = result.processes
    assert me.is_self and result.self_pid == 300 and not me.affected
    assert (service.uid, service.user, service.name, service.ppid) == (54321, "54321", "fastlib-serve", 1)
    assert service.cgroup_text == "0::/system.slice/svc.service\n" and service.process.start == 5000
    assert service.cmdline == (f"{BIN}/python", f"{BIN}/fastlib-serve")
    assert [(e.kind.value, e.path, e.deleted) for e in service.evidence] == [
        ("mapped", SO_PATH, False),
        ("mapped", SPACED, False),
        ("mapped", f"{SITE}/fastlib/_old.so", True),
        ("open", f"{SITE}/fastlib/__init__.py", False),
        ("argv", f"{BIN}/fastlib-serve", False),
    ]
    assert service.running_old_code and service.distributions == {"fastlib"}
    assert result.affected == (service,)
    assert me.user == "root"


def test_build_target_is_pure_and_knows_shared_directories(tmp_path: Path) -> None:
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    env = Environment(
        python=tmp_path / "bin" / "python",
        executable=tmp_path / "bin" / "python",
        prefix=tmp_path,
        base_prefix=Path("/usr"),
        purelib=site,
        platlib=site,
        scripts=tmp_path / "bin",
        data=tmp_path,
        version=(3, 11, 7),
        implementation="cpython",
        soabi="cpython-311-x86_64-linux-gnu",
        platform="linux-x86_64",
    )

    def dist(name: str, *paths: str, scripts: str = "") -> InstalledDistribution:
        info = site / f"{name}-1.0.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        (info / "RECORD").write_text("".join(f"{p},,\n" for p in (*paths, f"{info.name}/RECORD")))
        if scripts:
            (info / "entry_points.txt").write_text(f"[console_scripts]\n{scripts} = x:y\n")
        loaded = load_distribution(info)
        assert loaded is not None
        return loaded

    cublas = dist(
        "nvidia-cublas",
        "nvidia/__init__.py",
        "nvidia/cublas/__init__.py",
        "nvidia/cublas/lib/libcublas.so.12",
        "../../../bin/cublas-tool",
        scripts="cublas-tool",
    )
    cudnn = dist("nvidia-cudnn", "nvidia/__init__.py", "nvidia/cudnn/lib/libcudnn.so.9")
    wheelish = dist(
        "wheelish",
        "wheelish.libs/libgfortran-abc.so",
        "wheelish/__init__.py",
        "wheelish/sub/x.py",
        "top_mod.py",
        "_speedups.cpython-311-x86_64-linux-gnu.so",
        "__pycache__/top_mod.cpython-311.pyc",
        "weird-name/data.txt",
    )
    everything = [cublas, cudnn, wheelish]

    target = build_target(cublas, env, owners=directory_owners(everything), file_ids=[(1, 2)])
    assert target.directories == (f"{site}/nvidia/cublas",)  # nvidia/ is shared with cudnn
    assert target.modules == {"nvidia.cublas"}
    assert target.console_scripts == {f"{tmp_path}/bin/cublas-tool"}
    assert f"{tmp_path}/bin/cublas-tool" in target.files and target.file_ids == {(1, 2)}
    assert f"{tmp_path}/bin/python3.11" in target.interpreters
    alone = build_target(cublas, env)
    assert alone.directories == (f"{site}/nvidia",)  # without the others it cannot know
    cudnn_target = build_target(cudnn, env, owners=directory_owners(everything))
    assert cudnn_target.directories == (f"{site}/nvidia/cudnn",)
    assert cudnn_target.modules == {"nvidia.cudnn"}  # a namespace portion without __init__.py
    wheel_target = build_target(wheelish, env, owners=directory_owners(everything))
    assert wheel_target.directories == tuple(
        f"{site}/{d}" for d in ("weird-name", "wheelish", "wheelish.libs")
    )
    assert wheel_target.modules == {"wheelish", "top_mod", "_speedups"}
    assert build_target(wheelish, env, owners=directory_owners(everything)) == wheel_target


# ------------------------------------------------------------------ depends and environment evidence


def test_a_pure_package_leaves_no_trace_but_the_environment_is_seen(
    tmp_path: Path, wheels: wheelhouse.Wheelhouse, spawn: Spawn
) -> None:
    """A process that imported a pure-Python package has read and closed its files: no mapped, open
    or argv evidence. It runs the environment's interpreter (argv[0]), or a bare python with
    VIRTUAL_ENV or PYTHONPATH pointing into the environment: ``environment`` evidence, possible. A
    process of another environment uv hardlinked to the same cache inodes is not evidence."""
    here = wheelhouse.make_venv(tmp_path / "a")
    there = wheelhouse.make_venv(tmp_path / "b")
    for python in (here, there):
        wheelhouse.uv_install(python, wheels["sipure-1"], link_mode="hardlink")
    env, targets = env_and_targets(here, "sipure")
    scope = environment_scope(env)
    site = wheelhouse.site_packages(here)
    code = "import sipure, time; time.sleep(60)"
    ours = spawn([str(here), "-c", code])
    theirs = spawn([str(there), "-c", code])
    bare = os.path.realpath(sys.executable)  # another interpreter, found on PATH by its bare name
    by_venv = subprocess.Popen(
        [os.path.basename(bare), "-S", "-c", "import time; time.sleep(60)"],
        env={"PATH": os.path.dirname(bare), "VIRTUAL_ENV": str(tmp_path / "a")},
        stdin=subprocess.DEVNULL,
    )
    by_path = subprocess.Popen(
        [os.path.basename(bare), "-c", code],
        env={"PATH": os.path.dirname(bare), "PYTHONPATH": f"/nowhere:{site}"},
        stdin=subprocess.DEVNULL,
    )
    try:
        for proc in (ours, theirs, by_venv, by_path):
            wait_exec(proc, "time.sleep")
            wait_imported(proc)

        result = scan_processes(targets, scope=scope)

        (evidence,) = evidence_of(result, ours.pid)
        assert (evidence.kind, evidence.path) == (EvidenceKind.ENVIRONMENT, str(here))
        assert evidence.strength is Strength.POSSIBLE and "interpreter" in evidence.detail
        record = result.by_pid()[ours.pid]
        assert record.strength is Strength.POSSIBLE and not record.certain
        assert record.distributions == frozenset()
        assert evidence_of(result, theirs.pid) == ()  # the other environment's twin
        (venv_evidence,) = evidence_of(result, by_venv.pid)
        assert venv_evidence.detail == "VIRTUAL_ENV points into the environment"
        (path_evidence,) = evidence_of(result, by_path.pid)
        assert (path_evidence.path, path_evidence.detail) == (
            str(site),
            "PYTHONPATH points into the environment",
        )
        # without the scope (what the scan did before): nothing at all
        assert evidence_of(scan_processes(targets), ours.pid) == ()
    finally:
        for proc in (by_venv, by_path):
            proc.kill()
            proc.wait()


def test_a_dependent_that_is_mapped_gives_depends_evidence(
    venv: Path, wheels: wheelhouse.Wheelhouse, tmp_path: Path, spawn: Spawn
) -> None:
    """The vLLM -> transformers shape: a C extension that requires a pure package. The process maps the
    extension (a file of sicext), so it has imported sipure: ``depends`` evidence, certain."""
    requiring = wheelhouse.with_requirement(wheels["sicext-1"], tmp_path / "w", "sipure>=1")
    wheelhouse.uv_install(venv, requiring, wheels["sipure-1"])
    env = inspect_environment(venv)
    installed = find_distributions(env)
    sipure = find_distribution(env, "sipure", installed)
    chains = dependents(installed, ["sipure"], marker_environment(env))
    assert chains == {"sicext": (("sicext", "sipure"),)}
    targets = load_targets([sipure], env, installed) + load_targets(
        [find_distribution(env, "sicext", installed)], env, installed, requires=chains
    )
    user = spawn([str(venv), "-c", "import sicext, time; time.sleep(60)"])
    wait_mapped(user)

    evidence = evidence_of(scan_processes(targets, scope=environment_scope(env)), user.pid)

    (depends,) = evidence
    assert depends.kind is EvidenceKind.DEPENDS and depends.distribution == "sipure"
    assert depends.detail == "maps sicext 1.0, which requires sipure" and SO in depends.path
    assert depends.strength is Strength.CERTAIN and not depends.deleted


def _dist(name: str, *requires: str) -> InstalledDistribution:
    from safeinstall.env.records import parse_record

    return InstalledDistribution(
        name=name,
        display_name=name,
        version="1.0",
        site=Path("/site"),
        dist_info=Path(f"/site/{name}-1.0.dist-info"),
        record=parse_record(""),
        console_scripts=(),
        installer=None,
        locations=(),
        requires=requires,
    )


_ENV_39 = Environment(
    python=Path("/v/bin/python"),
    executable=Path("/v/bin/python"),
    prefix=Path("/v"),
    base_prefix=Path("/usr"),
    purelib=Path("/site"),
    platlib=Path("/site"),
    scripts=Path("/v/bin"),
    data=Path("/v"),
    version=(3, 9, 2),  # not the interpreter running these tests
    implementation="cpython",
    soabi=None,
    platform="linux-aarch64",
)


def test_dependents_follow_markers_of_the_target_environment_and_installed_extras() -> None:
    markers = marker_environment(_ENV_39)
    assert markers["python_version"] == "3.9" and markers["platform_machine"] == "aarch64"
    installed = [
        _dist(
            "vllm", "transformers>=4", "fastapi; python_version >= '3.10'", "torch; sys_platform == 'win32'"
        ),
        _dist("transformers", "tokenizers", "torch; extra == 'torch'", "absent; extra == 'tf'"),
        _dist("app", "vllm[audio]"),
        _dist("tokenizers"),
        _dist("fastapi", "pydantic"),
        _dist("pydantic"),
        _dist("torch"),
        _dist("broken", "tokenizers (((", "!!!"),
    ]
    assert dependents(installed, ["tokenizers"], markers) == {
        "app": (("app", "vllm", "transformers", "tokenizers"),),
        "broken": (("broken", "tokenizers"),),  # unparsable: its name still counts (the safe side)
        "transformers": (("transformers", "tokenizers"),),
        "vllm": (("vllm", "transformers", "tokenizers"),),
    }
    # fastapi only for Python >= 3.10: not in this 3.9 environment
    assert dependents(installed, ["pydantic"], markers) == {"fastapi": (("fastapi", "pydantic"),)}
    # torch through transformers' installed extra "torch" (every distribution it adds is installed),
    # not through vllm's win32-only requirement
    assert dependents(installed, ["torch"], markers)["transformers"] == (("transformers", "torch"),)
    assert dependents(installed, ["torch"], markers)["vllm"] == (("vllm", "transformers", "torch"),)
    assert describe_chain(("app", "vllm", "transformers", "tokenizers")) == (
        "which requires tokenizers (through vllm, transformers)"
    )


def test_an_owners_metadata_whose_extras_reweigh_every_line_is_weighed_within_a_bound() -> None:
    """The attacker review (session 5): each extra a METADATA's markers name had every line weighed again,
    unbounded: 3,200 lines ``zzI; extra == "eI"`` (125 kB), 40 s of root's survey on every run and dry
    run. Now the survey weighs within MAX_WEIGHED in all; a distribution past it is taken to require
    every installed distribution it names (the safe side), said; the others are weighed as before."""
    markers = marker_environment(_ENV_39)
    evil = (*(f'zz{i}; extra == "e{i}"' for i in range(3200)), 'zzwin; sys_platform == "win32"')
    installed = [
        _dist("evil", *evil),
        _dist("good", 'zzwin; sys_platform == "win32"', 'zz1; extra == "x"'),
        _dist("zzwin"),
        _dist("zz1"),
    ]
    found = weigh_dependents(installed, ["zzwin"], markers)
    assert found.chains == {"evil": (("evil", "zzwin"),)} and found.unweighed == ("evil",)
    assert "dependents not all weighed: the requirements of evil" in (found.note() or "")
    assert weigh_dependents(installed, ["zz1"], markers).chains["good"] == (("good", "zz1"),)


def test_a_maps_larger_than_the_limit_is_a_problem_not_read_whole(tmp_path: Path) -> None:
    """A process can map 65,530 files under 4 KiB names: a quarter of a GB of ``maps`` text for every
    scan. Beyond ``MAPS_LIMIT`` the reading stops (a problem, as for a process that denies it), and the
    plan says what is not known about that process."""
    from safeinstall.scan.plan import oversized_warning

    directory = tmp_path / "proc" / "4242"
    directory.mkdir(parents=True)
    (directory / "maps").write_bytes(
        b"7f00-7f01 r--p 00000000 fe:00 1 /x\n" * (processes.MAPS_LIMIT // 35 + 100)
    )
    (directory / "stat").write_bytes(b"4242 (x) S 1")
    problems: list[processes.ScanProblem] = []
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        proc = processes._Process(4242, fd, problems)
        assert proc.read("maps", single=False) is None
        assert proc.read("stat") == b"4242 (x) S 1"
    finally:
        os.close(fd)
    assert problems == [processes.ScanProblem(4242, "maps", processes.TOO_LARGE)]
    warning = oversized_warning(problems)
    assert warning is not None and "PID 4242" in warning and "64 MiB" in warning
    assert oversized_warning([processes.ScanProblem(1, "maps", "permission denied")]) is None
