"""A private ``systemd --user`` manager for tests: real units in real cgroups, nothing else touched.

The manager gets its own ``XDG_RUNTIME_DIR`` (0700) and ``XDG_CONFIG_HOME`` and, where the cgroup file
systems allow, its own cgroup (``/safeinstall-test-PID-N`` in every mounted hierarchy), so its units live
at ``/safeinstall-test-PID-N/app.slice/NAME.service`` and never mix with anything on the machine. It needs
``/run/systemd/system`` to exist (systemd refuses to run without it); when it is missing the tests are
skipped, or fail when ``CI`` is set (CI creates it).

Use it with ``pytest_plugins = ["tests.bed_systemd"]`` (or import the fixtures in a conftest):

* ``user_manager`` (session): the :class:`UserManager`;
* ``units`` (function): :class:`Units`, which names units uniquely and removes everything a test made;
* ``user_manager_environ`` (function): ``os.environ`` pointed at the private manager, so in-process code
  calling ``systemctl --user`` talks to it.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shlex
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

#: systemd refuses to run (even as a user manager) unless this directory exists.
SYSTEMD_MARKER = Path("/run/systemd/system")
#: Possible cgroup hierarchies: cgroup2 (hybrid layout), v1 name=systemd, cgroup2 (unified layout).
CGROUP_ROOTS = (Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup/systemd"), Path("/sys/fs/cgroup"))
#: Variables that would point systemctl (or the manager) at another manager or bus.
_FOREIGN_VARIABLES = (
    "DBUS_SESSION_BUS_ADDRESS",
    "NOTIFY_SOCKET",
    "LISTEN_PID",
    "LISTEN_FDS",
    "LISTEN_FDNAMES",
    "INVOCATION_ID",
    "MANAGERPID",
    "SYSTEMD_EXEC_PID",
    "WATCHDOG_PID",
    "WATCHDOG_USEC",
)
_SEQUENCE = itertools.count(1)


def _unavailable(reason: str) -> None:
    """Skip (locally) or fail (in CI, where the bed must work) with ``reason``."""
    if os.environ.get("CI"):
        pytest.fail(f"systemd test bed unavailable in CI: {reason}", pytrace=False)
    pytest.skip(f"systemd test bed unavailable: {reason}")


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, interval: float = 0.05) -> None:
    """Poll ``predicate`` until true; AssertionError naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(interval)


def cgroup_pids(control_group: str) -> set[int]:
    """PIDs in ``control_group`` and below, in every hierarchy (the bed's own reader, not safeinstall's)."""
    pids: set[int] = set()
    for root in CGROUP_ROOTS:
        if not (root / "cgroup.procs").is_file():
            continue
        for directory, _dirs, files in os.walk(root / control_group.strip("/")):
            if "cgroup.procs" in files:
                with contextlib.suppress(OSError):  # removed while we walked
                    pids.update(int(pid) for pid in Path(directory, "cgroup.procs").read_text().split())
    return pids


def _make_private_cgroup(name: str) -> list[Path]:
    """Create cgroup ``/name`` in every writable hierarchy; the ``cgroup.procs`` files to join it."""
    made: list[Path] = []
    for root in CGROUP_ROOTS:
        if not (root / "cgroup.procs").is_file():
            continue
        try:
            (root / name).mkdir()
        except OSError:
            continue
        made.append(root / name / "cgroup.procs")
    return made


def _remove_cgroup_tree(name: str) -> None:
    for root in CGROUP_ROOTS:
        top = root / name
        if not (root / "cgroup.procs").is_file() or not top.is_dir():
            continue
        for directory, _dirs, _files in sorted(os.walk(top), key=lambda entry: -len(entry[0])):
            with contextlib.suppress(OSError):
                os.rmdir(directory)


def _kill(pids: set[int]) -> None:
    """SIGKILL ``pids`` (processes in the bed's own cgroups: started by the bed, or by a test)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@dataclass
class UserManager:
    """A running private ``systemd --user``; every helper talks only to it."""

    process: subprocess.Popen[bytes]
    runtime_dir: Path
    config_home: Path
    cgroup_name: str | None  # the private cgroup it runs in, None when none could be made
    env: dict[str, str]  # os.environ plus XDG_RUNTIME_DIR/XDG_CONFIG_HOME, for subprocesses
    log: Path
    started: set[str] = field(default_factory=set)

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def unit_dir(self) -> Path:
        return self.config_home / "systemd" / "user"

    @property
    def runtime_unit_dir(self) -> Path:
        return self.runtime_dir / "systemd" / "user"

    def systemctl(
        self, *args: str, check: bool = True, timeout: float = 30
    ) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            ["systemctl", "--user", "--no-pager", *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                f"systemctl --user {shlex.join(args)} failed ({proc.returncode}): {proc.stderr.strip()}"
            )
        return proc

    def daemon_reload(self) -> None:
        self.systemctl("daemon-reload")

    def unique_name(self, stem: str, suffix: str = "service") -> str:
        """A unit name no other test uses: ``si-STEM-N.SUFFIX``."""
        return f"si-{stem}-{next(_SEQUENCE)}.{suffix}"

    def write_unit(self, name: str, text: str) -> Path:
        path = self.unit_dir / name
        path.write_text(text)
        self.daemon_reload()
        return path

    def remove_unit(self, name: str) -> None:
        """Kill, stop and forget unit ``name``: its file, its drop-ins, its failed state."""
        control_group = self.show(name, "ControlGroup").get("ControlGroup", "")
        self.systemctl("kill", "--signal=SIGKILL", name, check=False)
        self.systemctl("stop", name, check=False, timeout=60)
        if control_group:
            _kill(cgroup_pids(control_group))  # KillMode=process leftovers: ours, by PID
        self.systemctl("reset-failed", name, check=False)
        (self.unit_dir / name).unlink(missing_ok=True)
        for directory in (self.unit_dir / f"{name}.d", self.runtime_unit_dir / f"{name}.d"):
            shutil.rmtree(directory, ignore_errors=True)
        self.started.discard(name)
        self.daemon_reload()

    def start(self, name: str) -> None:
        self.started.add(name)
        self.systemctl("start", name)

    def stop(self, name: str) -> None:
        self.systemctl("stop", name, timeout=120)

    def show(self, name: str, *props: str) -> dict[str, str]:
        args = ["show", name] + (["-p", ",".join(props)] if props else [])
        out = self.systemctl(*args).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def main_pid(self, name: str) -> int:
        return int(self.show(name, "MainPID")["MainPID"])

    def active_state(self, name: str) -> str:
        return self.show(name, "ActiveState")["ActiveState"]

    def wait_active(self, name: str, timeout: float = 10) -> None:
        try:
            wait_until(lambda: self.active_state(name) == "active", timeout, f"{name} to be active")
        except AssertionError as exc:
            status = self.systemctl("status", name, check=False).stdout
            raise AssertionError(f"{exc}\n{status}") from None

    def wait_state(self, name: str, states: tuple[str, ...], timeout: float = 10) -> str:
        wait_until(lambda: self.active_state(name) in states, timeout, f"{name} to be one of {states}")
        return self.active_state(name)

    def patch_environ(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Point this process's os.environ at the private manager (undone by ``monkeypatch``)."""
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(self.runtime_dir))
        monkeypatch.setenv("XDG_CONFIG_HOME", str(self.config_home))
        for name in _FOREIGN_VARIABLES:
            monkeypatch.delenv(name, raising=False)


def start_user_manager(base: Path, unit_path: str | None = None) -> UserManager:
    """Start a private ``systemd --user`` and wait until it runs; skip/fail when it cannot.
    ``unit_path``: its ``SYSTEMD_UNIT_PATH`` (the units it reads; none of the defaults unless it ends
    with ":")."""
    if not SYSTEMD_MARKER.is_dir():
        _unavailable(f"{SYSTEMD_MARKER} does not exist (run `mkdir -p {SYSTEMD_MARKER}` as root)")
    systemd = shutil.which("systemd") or "/lib/systemd/systemd"
    if not Path(systemd).exists() or shutil.which("systemctl") is None:
        _unavailable("systemd / systemctl are not installed")
    # a short path: the manager's sockets live here and AF_UNIX paths are limited to 108 bytes
    runtime_dir = Path(tempfile.mkdtemp(prefix="si-run-"))
    runtime_dir.chmod(0o700)
    config_home = base / "config"
    (config_home / "systemd" / "user").mkdir(parents=True, exist_ok=True)  # a "reboot" keeps it
    env = {key: value for key, value in os.environ.items() if key not in _FOREIGN_VARIABLES}
    env |= {"XDG_RUNTIME_DIR": str(runtime_dir), "XDG_CONFIG_HOME": str(config_home)}
    if unit_path is not None:
        env["SYSTEMD_UNIT_PATH"] = unit_path
    cgroup_name = f"safeinstall-test-{os.getpid()}-{time.monotonic_ns()}"
    procs_files = _make_private_cgroup(cgroup_name)
    # the shell moves itself into the private cgroup, then becomes the manager (same PID)
    script = 'for f do echo $$ >"$f" || exit 97; done; exec "$0" --user'
    log = base / "manager.log"
    with log.open("wb") as sink:
        process = subprocess.Popen(
            ["/bin/sh", "-c", script, systemd, *(str(path) for path in procs_files)],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    manager = UserManager(
        process=process,
        runtime_dir=runtime_dir,
        config_home=config_home,
        cgroup_name=cgroup_name if procs_files else None,
        env=env,
        log=log,
    )
    deadline = time.monotonic() + 30
    while True:
        if process.poll() is not None:
            stop_user_manager(manager)
            pytest.fail(f"systemd --user exited ({process.returncode}):\n{log.read_text()[-2000:]}")
        state = manager.systemctl("is-system-running", check=False, timeout=10).stdout.strip()
        if state in ("running", "degraded"):
            return manager
        if time.monotonic() >= deadline:
            stop_user_manager(manager)
            pytest.fail(f"systemd --user did not come up (state {state!r}):\n{log.read_text()[-2000:]}")
        time.sleep(0.1)


def stop_user_manager(manager: UserManager) -> None:
    """Stop the units it started, SIGTERM the manager (by PID) and wait; clean its cgroup and dirs."""
    if manager.process.poll() is None:
        for name in sorted(manager.started):
            manager.systemctl("kill", "--signal=SIGKILL", name, check=False)
            manager.systemctl("stop", name, check=False, timeout=60)
        manager.process.send_signal(signal.SIGTERM)
        try:
            manager.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            manager.process.kill()
            manager.process.wait(timeout=10)
    if manager.cgroup_name is not None:
        # anything still in the private cgroup was started by this bed
        wait_until(
            lambda: _kill_all(cgroup_pids(f"/{manager.cgroup_name}")),
            10,
            "the private cgroup to empty",
        )
        _remove_cgroup_tree(manager.cgroup_name)
    shutil.rmtree(manager.runtime_dir, ignore_errors=True)


def _kill_all(pids: set[int]) -> bool:
    _kill(pids)
    return not pids


@dataclass
class Units:
    """Per-test units and processes, all removed when the test ends."""

    manager: UserManager
    names: list[str] = field(default_factory=list)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def create(self, stem: str, text: str) -> str:
        """Write a uniquely named unit from ``text``; its name."""
        name = self.manager.unique_name(stem)
        self.names.append(name)
        self.manager.write_unit(name, text)
        return name

    def service(self, stem: str, exec_start: str, **settings: str) -> str:
        """A ``[Service]`` unit running ``exec_start``; extra settings as keyword arguments."""
        lines = [f"ExecStart={exec_start}", *(f"{key}={value}" for key, value in settings.items())]
        return self.create(
            stem, "[Unit]\nDescription=safeinstall test unit\n\n[Service]\n" + "\n".join(lines) + "\n"
        )

    def started(self, stem: str, exec_start: str, **settings: str) -> str:
        """Like :meth:`service`, then started and active."""
        name = self.service(stem, exec_start, **settings)
        self.manager.start(name)
        self.manager.wait_active(name)
        return name

    def stray(self, *argv: str) -> subprocess.Popen[bytes]:
        """A process in no service: a direct child of the test, in the test's own cgroup."""
        process = subprocess.Popen(argv, stdin=subprocess.DEVNULL)
        self.processes.append(process)
        return process

    def scope(self, *argv: str) -> tuple[str, subprocess.Popen[bytes]]:
        """A process in a transient scope of the private manager (like a login session's processes)."""
        name = self.manager.unique_name("scope", "scope")
        process = subprocess.Popen(
            ["systemd-run", "--user", "--scope", "--quiet", f"--unit={name}", "--", *argv],
            env=self.manager.env,
            stdin=subprocess.DEVNULL,
        )
        self.processes.append(process)
        return name, process

    def cleanup(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)
        for name in reversed(self.names):
            self.manager.remove_unit(name)


@pytest.fixture(scope="session")
def user_manager(tmp_path_factory: pytest.TempPathFactory) -> Iterator[UserManager]:
    manager = start_user_manager(tmp_path_factory.mktemp("user-manager"))
    try:
        yield manager
    finally:
        stop_user_manager(manager)


@pytest.fixture
def units(user_manager: UserManager) -> Iterator[Units]:
    created = Units(user_manager)
    try:
        yield created
    finally:
        created.cleanup()


@pytest.fixture
def user_manager_environ(user_manager: UserManager, monkeypatch: pytest.MonkeyPatch) -> UserManager:
    """os.environ pointed at the private manager for this test."""
    user_manager.patch_environ(monkeypatch)
    return user_manager
