"""A real ``systemd --system`` as PID 1 of namespaces of its own: the default mode's bed (issue 42).

Opt-in (``SAFEINSTALL_SYSTEM_MANAGER=1``, as root): skipped with the reason otherwise. What it does,
in this order (docs/testing.md, "The system manager's bed"):

1. a marker file in the machine's real ``/tmp`` (it must survive every test: at boot the distribution's
   units, ``systemd-tmpfiles`` above all, empty ``/tmp`` for the whole machine);
2. a directory of the bed's own (``/tmp/si-sysbed-*``, 0755: the service account passes through it)
   with the unit directory (an empty target to start, empty ``sysinit``, ``basic`` and ``shutdown``
   targets), a ``system.conf``, copies of ``/etc/passwd`` and ``/etc/group`` that add the account;
3. a shell that moves itself into a cgroup of its own in every mounted hierarchy
   (``/si-sysbed-PID-N``: the system manager's root, never the machine's nor a user manager's), then
   ``unshare --pid --fork --mount --uts --ipc --net --propagation private --mount-proc``;
4. in the namespaces, before systemd: private tmpfs mounts on ``/run``, ``/tmp`` and ``/var/tmp`` (the
   bed's directory moved back in at its own path), the bed's directories on ``/etc/systemd`` and its
   files on ``/etc/passwd`` and ``/etc/group``, ``/proc/sys`` read-only, a file on ``/dev/console``;
   then checks (the marker must not be visible, ``/etc/systemd/system`` must be the bed's) and only
   then ``exec systemd --system --unit=si-bed.target`` with ``container=other`` and
   ``SYSTEMD_UNIT_PATH`` naming the bed's directories alone (no trailing colon: never the
   distribution's units);
5. ``nsenter -t PID -m -p -u -i -n`` runs systemctl and safeinstall inside.

The end: PID 1 killed by PID (the kernel kills the rest of its PID namespace), the cgroups removed, and
checks that no process and no mount of the bed outlives it and that the marker is still there.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests import wheelhouse
from tests.bed_systemd import wait_until
from tests.clirun import SAFEINSTALL, Result

#: turns the bed on
ENABLE_VARIABLE = "SAFEINSTALL_SYSTEM_MANAGER"
#: the service account the units run as (in the bed's own /etc/passwd, never the machine's)
ACCOUNT = "sibedsvc"
ACCOUNT_ID = 64321
#: the target the manager starts; the empty targets services need (their default dependencies)
TARGET = "si-bed.target"
EMPTY_TARGETS = ("sysinit.target", "basic.target", "shutdown.target", TARGET)
#: a file in the bed's unit directory: the inner script checks it is there before systemd starts
UNIT_DIR_SENTINEL = ".si-bed"
#: the manager's unit search path: the bed's /etc/systemd/system (a bind mount) and the private /run's
#: directories, with the control directories first as systemd lists them; never /lib/systemd/system
UNIT_PATH = (
    "/etc/systemd/system.control",
    "/run/systemd/system.control",
    "/run/systemd/transient",
    "/etc/systemd/system",
    "/run/systemd/system",
)
#: the environment of what runs inside (nothing of the test's: no XDG_RUNTIME_DIR, no user bus)
INSIDE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
SYSTEMD = Path("/lib/systemd/systemd")
_SEQUENCE = itertools.count(1)

#: the starting shell: a cgroup of its own in every hierarchy, then the namespaces ($1 cgroup name,
#: $2 bed directory, $3 marker, $4 unit path). unshare dies with the test process, PID 1 with unshare.
OUTER = r"""
set -eu
name=$1
for root in /sys/fs/cgroup/ /sys/fs/cgroup/*/; do
  [ -f "$root/cgroup.procs" ] || continue
  mkdir "$root$name"
  for f in cpuset.cpus cpuset.mems; do
    if [ -f "$root$f" ]; then cat "$root$f" >"$root$name/$f"; fi
  done
  echo $$ >"$root$name/cgroup.procs"
done
exec setpriv --pdeathsig KILL unshare --pid --fork --kill-child=SIGKILL --mount --uts --ipc --net \
  --propagation private --mount-proc /bin/sh -c "$INNER" inner "$2" "$3" "$4"
"""

#: in the namespaces: the private mounts, the checks, then systemd ($1 bed directory, $2 marker,
#: $3 unit path). Any failure stops here, before systemd.
INNER = r"""
set -eu
base=$1
# this namespace's copies of the machine's mounts below a directory: let go of them (another test's
# tmpfs below /tmp is then freed when that test unmounts it, whatever this bed does)
let_go() {
  awk '{print $5}' /proc/self/mountinfo | grep -E "$1" | sort -r | while read -r m; do
    umount -l "$m" 2>/dev/null || true
  done
}
let_go '^/run/'
mount -t tmpfs -o mode=0755,size=64m si-bed-run /run
mkdir /run/.si-bed-hold
mount --bind "$base" /run/.si-bed-hold
let_go '^/tmp(/|$)'
let_go '^/var/tmp(/|$)'
mount -t tmpfs -o mode=1777,size=256m si-bed-tmp /tmp
mkdir -p "$base"
mount --move /run/.si-bed-hold "$base"
rmdir /run/.si-bed-hold
mount -t tmpfs -o mode=1777,size=64m si-bed-var-tmp /var/tmp
mount --bind "$base/etc-systemd" /etc/systemd
mount --bind "$base/passwd" /etc/passwd
mount --bind "$base/group" /etc/group
mount --bind /proc/sys /proc/sys
mount -o remount,bind,ro /proc/sys
mount --bind "$base/console" /dev/console
if [ -e "$2" ]; then echo "refused: the machine's /tmp is visible ($2)"; exit 97; fi
test -e /etc/systemd/system/.si-bed || { echo "refused: the unit directory is not the bed's"; exit 97; }
if [ "$(stat -f -c %T /tmp)" != tmpfs ]; then echo "refused: /tmp is no tmpfs"; exit 97; fi
export container=other SYSTEMD_UNIT_PATH="$3"
exec /lib/systemd/systemd --system --unit=si-bed.target --log-target=console
"""


def unavailable_reason() -> str | None:
    """Why the bed cannot run here (None: it can)."""
    if os.environ.get(ENABLE_VARIABLE) != "1":
        return f"the system manager's bed is opt-in: set {ENABLE_VARIABLE}=1 (docs/testing.md)"
    if os.geteuid() != 0:
        return "the system manager's bed needs root"
    missing = [tool for tool in ("unshare", "nsenter", "setpriv", "systemctl") if shutil.which(tool) is None]
    if missing or not SYSTEMD.exists():
        return f"not installed: {', '.join(missing or [str(SYSTEMD)])}"
    if not any(Path(root, "cgroup.procs").is_file() for root in _cgroup_roots()):
        return "no cgroup hierarchy mounted under /sys/fs/cgroup"
    return None


def _cgroup_roots() -> list[Path]:
    top = Path("/sys/fs/cgroup")
    found = [top] if (top / "cgroup.procs").is_file() else []
    with contextlib.suppress(OSError):
        found += sorted(p for p in top.iterdir() if (p / "cgroup.procs").is_file())
    return found


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def _runs(pid: int, program: Path) -> bool:
    """Whether ``pid`` runs ``program`` (it may still be the shell that execs it, or be gone)."""
    try:
        return os.readlink(f"/proc/{pid}/exe") == os.path.realpath(program)
    except OSError:
        return False


def _ns_inode(pid: int, kind: str) -> int | None:
    try:
        return os.stat(f"/proc/{pid}/ns/{kind}").st_ino
    except OSError:
        return None


def processes_in_namespace(kind: str, inode: int) -> list[int]:
    """The machine's PIDs whose ``kind`` namespace (``pid``, ``mnt``) is ``inode``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _ns_inode(int(entry.name), kind) == inode:
            found.append(int(entry.name))
    return found


@dataclass
class SystemManager:
    """A running ``systemd --system`` in namespaces of its own; every helper acts inside them."""

    base: Path  # the bed's directory: the same path outside and inside
    marker: Path  # in the machine's /tmp: must survive
    marker_text: str
    cgroup_name: str
    process: subprocess.Popen[bytes]  # the shell that became unshare
    log: Path
    unit_path: tuple[str, ...]  # SYSTEMD_UNIT_PATH
    settings: dict[str, str]  # :func:`machine_settings` before the bed
    pid1: int = 0  # the machine's PID of the namespace's PID 1 (systemd)
    pid_ns: int = 0
    mnt_ns: int = 0

    @property
    def unit_dir(self) -> Path:
        """The bed's unit directory: ``/etc/systemd/system`` inside."""
        return self.base / "etc-systemd" / "system"

    def inside(self, *argv: str) -> list[str]:
        return ["nsenter", "-t", str(self.pid1), "-m", "-p", "-u", "-i", "-n", "--", *argv]

    def environ(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        return {"PATH": INSIDE_PATH, "LANG": "C.UTF-8", "COLUMNS": "200", **(extra or {})}

    def run(
        self, *argv: str, check: bool = True, timeout: float = 60, env: Mapping[str, str] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` inside the bed (its mount, PID, UTS, IPC and network namespaces)."""
        proc = subprocess.run(
            self.inside(*argv),
            env=self.environ(env),
            cwd="/",
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and proc.returncode != 0:
            raise AssertionError(f"{' '.join(argv)} failed ({proc.returncode}): {proc.stdout}{proc.stderr}")
        return proc

    def systemctl(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.run("systemctl", "--no-pager", *args, check=check)

    def show(self, unit: str, *props: str) -> dict[str, str]:
        out = self.systemctl("show", unit, "-p", ",".join(props)).stdout
        return dict(line.split("=", 1) for line in out.splitlines() if "=" in line)

    def main_pid(self, unit: str) -> int:
        """The unit's main PID, as the bed's PID namespace numbers it."""
        return int(self.show(unit, "MainPID")["MainPID"])

    def active_state(self, unit: str) -> str:
        return self.show(unit, "ActiveState")["ActiveState"]

    def wait_active(self, unit: str, timeout: float = 20) -> None:
        wait_until(lambda: self.active_state(unit) == "active", timeout, f"{unit} active")

    def write_unit(self, name: str, text: str) -> None:
        (self.unit_dir / name).write_text(text)
        self.systemctl("daemon-reload")

    def remove_unit(self, name: str) -> None:
        self.systemctl("kill", "--signal=SIGKILL", name, check=False)
        self.systemctl("stop", name, check=False)
        self.systemctl("reset-failed", name, check=False)
        (self.unit_dir / name).unlink(missing_ok=True)
        (self.unit_dir / f"{TARGET}.wants" / name).unlink(missing_ok=True)
        shutil.rmtree(self.unit_dir / f"{name}.d", ignore_errors=True)
        self.run("rm", "-rf", f"/run/systemd/system/{name}.d", check=False)
        self.systemctl("daemon-reload")

    def dropins(self) -> list[str]:
        """Every drop-in directory's file, persistent (the bed's /etc/systemd/system) and runtime."""
        listed = self.run(
            "sh", "-c", "ls -d /etc/systemd/system/*.d/* /run/systemd/system/*.d/* 2>/dev/null", check=False
        )
        return listed.stdout.split()

    def uid_of(self, pid: int) -> int:
        """The real uid of the bed's process ``pid``."""
        status = self.run("cat", f"/proc/{pid}/status").stdout
        return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Uid:")))

    def maps_so(self, pid: int) -> int | None:
        """The inode of the sicext extension the bed's process ``pid`` maps (None: not mapped)."""
        maps = self.run("cat", f"/proc/{pid}/maps", check=False).stdout
        for line in maps.splitlines():
            if "_native" in line and ".so" in line:
                return int(line.split()[4])
        return None

    # --- the machine outside ---------------------------------------------------------------------------

    def check_machine_untouched(self) -> None:
        """The marker in the machine's /tmp is there, unchanged; so are the machine's settings a system
        manager sets at boot (outside a container): its hostname, its core pattern."""
        assert self.marker.read_text() == self.marker_text, f"{self.marker} changed"
        assert machine_settings() == self.settings


def start_system_manager(unit_path: tuple[str, ...] = UNIT_PATH) -> SystemManager:
    """The marker, the bed's directory, then the manager; waits until it runs. Skips when unavailable.
    ``unit_path``: the manager's ``SYSTEMD_UNIT_PATH`` (the bed's directories, none but them)."""
    reason = unavailable_reason()
    if reason is not None:
        pytest.skip(reason)
    remove_stale_beds()
    owner = f"si-sysbed-{os.getpid()}-"  # the owner's PID in every name: see remove_stale_beds
    fd, marker_name = tempfile.mkstemp(prefix=f"{owner}marker-", dir="/tmp")  # the machine's /tmp
    marker_text = f"safeinstall system bed {os.getpid()} {time.time_ns()}\n"
    os.write(fd, marker_text.encode())
    os.close(fd)
    base = Path(tempfile.mkdtemp(prefix=owner, dir="/tmp"))
    base.chmod(0o755)
    units = base / "etc-systemd" / "system"
    units.mkdir(parents=True)
    (base / "etc-systemd" / "system.conf").write_text("[Manager]\n")
    (units / UNIT_DIR_SENTINEL).write_text("")
    for target in EMPTY_TARGETS:
        (units / target).write_text(f"[Unit]\nDescription={target} of the safeinstall bed\n")
    (base / "passwd").write_text(
        Path("/etc/passwd").read_text()
        + f"{ACCOUNT}:x:{ACCOUNT_ID}:{ACCOUNT_ID}:safeinstall bed account:/nonexistent:/usr/sbin/nologin\n"
    )
    (base / "group").write_text(Path("/etc/group").read_text() + f"{ACCOUNT}:x:{ACCOUNT_ID}:\n")
    (base / "console").write_text("")
    return _boot(base, Path(marker_name), marker_text, unit_path, machine_settings())


def machine_settings() -> dict[str, str]:
    """The machine's settings a system manager would set (outside a container)."""
    names = ("kernel/hostname", "kernel/core_pattern")
    return {name: Path("/proc/sys", name).read_text() for name in names}


def _boot(
    base: Path, marker: Path, marker_text: str, unit_path: tuple[str, ...], settings: dict[str, str]
) -> SystemManager:
    """A manager on the bed's directory ``base`` (new cgroups, new namespaces: a fresh /run)."""
    cgroup_name = f"si-sysbed-{os.getpid()}-{next(_SEQUENCE)}-{time.monotonic_ns()}"
    log = base / f"{cgroup_name}.log"  # one per boot
    with log.open("wb") as sink:
        process = subprocess.Popen(
            ["/bin/sh", "-c", OUTER, "outer", cgroup_name, str(base), str(marker), ":".join(unit_path)],
            env={"PATH": INSIDE_PATH, "INNER": INNER},
            stdin=subprocess.DEVNULL,
            stdout=sink,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            cwd="/",
        )
    manager = SystemManager(base, marker, marker_text, cgroup_name, process, log, unit_path, settings)
    try:
        _wait_running(manager)
        _check_contained(manager)
    except BaseException:
        stop_system_manager(manager)
        raise
    return manager


def _wait_running(manager: SystemManager) -> None:
    deadline = time.monotonic() + 30
    state = ""
    while time.monotonic() < deadline:
        if manager.process.poll() is not None:
            raise AssertionError(f"the bed ended ({manager.process.returncode}): {manager.log.read_text()}")
        if not manager.pid1:
            children = _children(manager.process.pid)  # unshare's one child: the namespace's PID 1
            if children and _runs(children[0], SYSTEMD):
                manager.pid1 = children[0]
                manager.pid_ns = _ns_inode(manager.pid1, "pid") or 0
                manager.mnt_ns = _ns_inode(manager.pid1, "mnt") or 0
        if manager.pid1:
            state = manager.systemctl("is-system-running", check=False).stdout.strip()
            if state in ("running", "degraded"):
                return
        time.sleep(0.05)
    raise AssertionError(f"systemd --system did not come up (state {state!r}): {manager.log.read_text()}")


def _check_contained(manager: SystemManager) -> None:
    """What the manager sees is the bed's: its own /tmp, its unit path, its cgroup."""
    assert manager.pid_ns and manager.pid_ns != _ns_inode(os.getpid(), "pid")
    assert manager.mnt_ns and manager.mnt_ns != _ns_inode(os.getpid(), "mnt")
    assert manager.run("test", "-e", str(manager.marker), check=False).returncode == 1, "machine /tmp seen"
    out = manager.systemctl("show", "-p", "UnitPath,ControlGroup").stdout
    shown = dict(line.split("=", 1) for line in out.splitlines() if "=" in line)
    assert shown["UnitPath"].split() == list(manager.unit_path), shown
    assert not any(path.startswith(("/lib/", "/usr/")) for path in shown["UnitPath"].split()), shown
    assert shown["ControlGroup"] == f"/{manager.cgroup_name}", shown


def power_off(manager: SystemManager) -> None:
    """PID 1 killed by PID (a power loss: nothing stops cleanly); then no process, mount namespace or
    cgroup of it left, and the marker in the machine's /tmp unchanged. The bed's directory stays."""
    if manager.pid1:
        with contextlib.suppress(ProcessLookupError):
            os.kill(manager.pid1, signal.SIGKILL)
    if manager.process.poll() is None:
        if not manager.pid1:  # it never got as far as PID 1: the shell (unshare) is ours
            manager.process.kill()
        manager.process.wait(timeout=30)
    if manager.pid_ns:
        wait_until(
            lambda: not processes_in_namespace("pid", manager.pid_ns), 20, "the bed's processes to end"
        )
    if manager.mnt_ns:
        wait_until(lambda: not processes_in_namespace("mnt", manager.mnt_ns), 20, "the bed's mounts to go")
    wait_until(lambda: _remove_cgroups(manager.cgroup_name), 20, "the bed's cgroups to be removed")
    manager.check_machine_untouched()


def reboot(manager: SystemManager) -> None:
    """:func:`power_off`, then a new manager on the same directory (its units, drop-ins and state;
    a fresh /run): ``manager`` is the new one from then on."""
    power_off(manager)
    booted = _boot(manager.base, manager.marker, manager.marker_text, manager.unit_path, manager.settings)
    manager.process, manager.log, manager.cgroup_name = booted.process, booted.log, booted.cgroup_name
    manager.pid1, manager.pid_ns, manager.mnt_ns = booted.pid1, booted.pid_ns, booted.mnt_ns


def stop_system_manager(manager: SystemManager) -> None:
    """:func:`power_off`, then the bed's directory and the marker removed."""
    try:
        power_off(manager)
    finally:
        shutil.rmtree(manager.base, ignore_errors=True)
    manager.marker.unlink()


def remove_stale_beds() -> None:
    """What a bed whose test process was killed left (its manager died with it: ``--pdeathsig``,
    ``--kill-child``): its empty cgroups, its directory and marker in /tmp. Only names of this bed
    (``si-sysbed-PID-...``) whose PID is gone, and cgroups that hold no process."""
    busy: set[str] = set()  # owners whose manager still runs (a cgroup that cannot be removed)
    for root in _cgroup_roots():
        for path in root.glob("si-sysbed-*"):
            owner = path.name.split("-")[2]
            dead = owner.isdigit() and not Path(f"/proc/{owner}").exists()
            if dead and not _remove_cgroups(path.name, roots=[root]):
                busy.add(owner)
    for path in Path("/tmp").glob("si-sysbed-*"):
        owner = path.name.split("-")[2]
        if not owner.isdigit() or owner in busy or Path(f"/proc/{owner}").exists():
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _remove_cgroups(name: str, roots: list[Path] | None = None) -> bool:
    """Remove the bed's cgroup tree, deepest first, in every hierarchy; True once none is left."""
    left = False
    for root in _cgroup_roots() if roots is None else roots:
        top = root / name
        if not top.is_dir():
            continue
        for directory, _dirs, _files in sorted(os.walk(top), key=lambda entry: -len(entry[0])):
            try:
                os.rmdir(directory)
            except OSError:
                left = True
    return not left


# --- what a test acts on --------------------------------------------------------------------------------


@dataclass
class SystemWheels:
    """The fixture wheels the bed uses, in its directory (pytest's own are not visible inside)."""

    directory: Path
    wheels: dict[str, Path] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Path:
        return self.wheels[key]


def copy_wheels(manager: SystemManager, wheels: SystemWheels) -> SystemWheels:
    """``wheels`` copied into another bed's directory (a bed sees no other's)."""
    directory = manager.base / "wheels"
    directory.mkdir(mode=0o755)
    copied = {key: Path(shutil.copy2(path, directory / path.name)) for key, path in wheels.wheels.items()}
    return SystemWheels(directory, copied)


def build_wheels(manager: SystemManager, keys: tuple[str, ...]) -> SystemWheels:
    directory = manager.base / "wheels"
    directory.mkdir(mode=0o755)
    built = SystemWheels(directory)
    for key in keys:
        built.wheels[key] = wheelhouse.build_wheel(wheelhouse.PACKAGES / wheelhouse.SOURCES[key], directory)
    for wheel in directory.iterdir():
        wheel.chmod(0o644)
    return built


class SystemBed:
    """sicext 1.0 in a venv of the service account's, a system unit running it as ``User=`` that
    account, a state directory: what ``safeinstall sicext --wheel ...`` as root acts on in the bed."""

    def __init__(self, manager: SystemManager, wheels: SystemWheels) -> None:
        self.manager = manager
        self.wheels = wheels
        number = next(_SEQUENCE)
        self.top = manager.base / f"bed-{number}"
        self.top.mkdir(mode=0o755)
        interpreter = wheelhouse.shared_interpreter()
        if interpreter is None:
            pytest.skip("no interpreter of this Python version that the service account may run")
        self.python = wheelhouse.make_venv(self.top / "venv", interpreter)
        wheelhouse.uv_install(self.python, wheels["sicext-1"])
        for directory, dirnames, filenames in os.walk(self.top / "venv"):
            os.lchown(directory, ACCOUNT_ID, ACCOUNT_ID)
            for name in [*dirnames, *filenames]:
                os.lchown(os.path.join(directory, name), ACCOUNT_ID, ACCOUNT_ID)
        self.site = wheelhouse.site_packages(self.python)
        self.state = self.top / "state"
        self.extra_units: list[str] = []
        self.unit = f"si-serve-{number}.service"
        manager.write_unit(
            self.unit,
            "[Unit]\nDescription=sicext-serve of the safeinstall bed\n\n"
            f"[Service]\nUser={ACCOUNT}\nExecStart={self.python.parent}/sicext-serve\n\n"
            f"[Install]\nWantedBy={TARGET}\n",
        )
        manager.systemctl("start", self.unit)
        manager.wait_active(self.unit)
        main = manager.main_pid(self.unit)
        wait_until(lambda: manager.maps_so(main) is not None, 20, "the service to map the extension")

    @property
    def so(self) -> Path:
        return next((self.site / "sicext").glob("_native*.so"))

    def version(self) -> str:
        """What ``sicext.version()`` says, asked as the account inside the bed."""
        out = self.manager.run(
            "setpriv", f"--reuid={ACCOUNT_ID}", f"--regid={ACCOUNT_ID}", "--clear-groups",
            str(self.python), "-c", "import sicext; print(sicext.version())",
            check=False,
        )  # fmt: skip
        return out.stdout.strip() or next(iter(out.stderr.strip().splitlines()[-1:]), "")

    def argv(self, *args: str) -> list[str]:
        return [SAFEINSTALL, "--python", str(self.python), *args]

    def env(self) -> dict[str, str]:
        return {"SAFEINSTALL_STATE_DIR": str(self.state)}

    def cli(self, *args: str, timeout: float = 180) -> Result:
        """``safeinstall --python VENV ARGS`` as root inside the bed: the default mode, system units."""
        proc = self.manager.run(*self.argv(*args), check=False, timeout=timeout, env=self.env())
        return Result(proc.returncode, proc.stdout, proc.stderr)

    def start_run(self, *args: str) -> subprocess.Popen[str]:
        """``safeinstall`` in the background inside the bed (nsenter's child is safeinstall)."""
        return subprocess.Popen(
            self.manager.inside(*self.argv(*args)),
            env=self.manager.environ(self.env()),
            cwd="/",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )

    def journal_phase(self) -> str | None:
        import json

        for path in self.state.glob("*/journal.json"):
            with contextlib.suppress(OSError, ValueError):
                return str(json.loads(path.read_text())["phase"])
        return None

    def wait_phase(self, proc: subprocess.Popen[str], phases: tuple[str, ...]) -> str:
        """Wait until the run's journal is at one of ``phases``; that phase."""
        deadline = time.monotonic() + 120
        while True:
            phase = self.journal_phase()
            if phase in phases:
                return str(phase)
            if proc.poll() is not None:
                raise AssertionError(
                    f"the run ended ({proc.returncode}) before {phases}: {proc.communicate()}"
                )
            if time.monotonic() > deadline:
                raise AssertionError(f"no phase {phases} within 120 s (last {phase})")
            time.sleep(0.002)

    def kill_in(self, phases: tuple[str, ...], *args: str) -> str:
        """A run killed (SIGKILL, safeinstall itself: nsenter's child) once its journal is at one of
        ``phases``; the phase seen."""
        proc = self.start_run(*args)
        try:
            seen = self.wait_phase(proc, phases)
            for child in _children(proc.pid):  # safeinstall, in the bed's PID namespace; ours
                os.kill(child, signal.SIGKILL)
        finally:
            proc.communicate(timeout=60)
        return seen

    def install_recover_unit(self) -> str:
        """The shipped ``safeinstall-recover.service``, enabled, as docs/crash-safety.md installs it:
        this safeinstall, the bed's state directory, wanted by the bed's target. Its name."""
        from importlib import resources

        text = resources.files("safeinstall").joinpath("data/safeinstall-recover.service").read_text()
        shipped = "ExecStart=/usr/local/bin/safeinstall --recover"
        assert shipped in text and "multi-user.target" in text
        text = text.replace(
            shipped, f"ExecStart={SAFEINSTALL} --recover\nEnvironment=SAFEINSTALL_STATE_DIR={self.state}"
        ).replace("multi-user.target", TARGET)
        name = "safeinstall-recover.service"
        self.manager.write_unit(name, text)
        self.manager.systemctl("enable", name)
        self.extra_units.append(name)
        return name

    def no_trace(self) -> None:
        """Nothing of the run left: no journal, gate, run cache; no drop-in; no kept links."""
        assert not list(self.state.glob("*/journal.json"))
        assert not list(self.state.glob("*/gate"))
        assert not list(self.state.glob("*/uv-cache-*"))
        assert not [d for d in self.manager.dropins() if "safeinstall" in d], self.manager.dropins()
        assert not list((self.top / "venv").glob(".safeinstall-*"))

    def cleanup(self) -> None:
        for name in [self.unit, *self.extra_units]:
            self.manager.remove_unit(name)
        shutil.rmtree(self.top, ignore_errors=True)


@pytest.fixture(scope="session")
def system_manager() -> Iterator[SystemManager]:
    """The bed's ``systemd --system`` (skipped unless ``SAFEINSTALL_SYSTEM_MANAGER=1`` and root)."""
    manager = start_system_manager()
    try:
        yield manager
    finally:
        stop_system_manager(manager)


@pytest.fixture(scope="session")
def system_wheels(system_manager: SystemManager) -> SystemWheels:
    """sicext 1, 2 and 3 (crashes on import), built into the bed's directory."""
    return build_wheels(system_manager, ("sicext-1", "sicext-2", "sicext-3"))


@pytest.fixture
def system_bed(system_manager: SystemManager, system_wheels: SystemWheels) -> Iterator[SystemBed]:
    """sicext 1.0 in the account's venv and a running system unit with ``User=`` the account; the
    marker in the machine's /tmp checked after the test."""
    made = SystemBed(system_manager, system_wheels)
    try:
        yield made
    finally:
        made.cleanup()
        system_manager.check_machine_untouched()
