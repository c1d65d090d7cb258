"""The test beds the end-to-end tests share: what a run of safeinstall acts on, made of real parts.

Test-bed code, not safeinstall's. A bed is a venv made and filled by the real uv with the fixture package
``sicext`` (a C extension and a ``sicext-serve`` service), units of the private ``systemd --user`` manager
(:mod:`tests.bed_systemd`), the fake NVML driver (:mod:`tests.bed_nvml`) and a state directory of its
own. The fixtures that make them (``bed``, ``account``, ``big_wheel``, ``small_disk``...) are registered
in ``tests/conftest.py``, so a test module asks for them by name and imports only the classes and
helpers below; no test module imports from another test module (``tests/test_quality.py`` checks it).

* :class:`Bed`: sicext in a venv of the test's own, its units, the fake NVML, a state directory;
* :class:`ServiceAccountBed`: the same, the venv owned by uid 65534 and its unit running as that uid,
  with a victim directory beside the venv (the threat-model tests);
* helpers: :func:`maps_so` (which sicext extension a process runs), :func:`declined_on_a_terminal`,
  :func:`chown_tree`, :func:`as_user`, :func:`tree_snapshot`, :func:`printing_interpreter`;
  :func:`verify_sipure`, :func:`modified_names`, :func:`forge_kept_hash` (the kept hashes' tests).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests import wheelhouse
from tests.bed_nvml import FakeNvml, GiB
from tests.bed_systemd import Units, UserManager, wait_until
from tests.clirun import SAFEINSTALL, Result, run
from tests.wheelhouse import Wheelhouse

NOBODY = 65534  # the service account that owns an environment (or a state directory) in the attacks
OTHER = 65533  # another local account: neither the environment's owner nor root
AS_ROOT = os.geteuid() == 0
#: a unit that runs sicext-serve ({exec}), and may be enabled (``[Install]``)
UNIT_TEXT = (
    "[Unit]\nDescription=safeinstall crash test\n\n"
    "[Service]\nExecStart={exec}\n\n"
    "[Install]\nWantedBy=default.target\n"
)


def maps_so(pid: int) -> int | None:
    """The inode of the sicext extension the process has mapped (None: not mapped)."""
    try:
        for line in Path(f"/proc/{pid}/maps").read_text().splitlines():
            if "_native" in line and ".so" in line:
                return int(line.split()[4])
    except OSError:
        return None
    return None


class Bed:
    """sicext in a venv (``python``), units of the private manager, the fake NVML and a state directory.

    ``units`` removes every unit the bed started when the test ends (the ``bed`` fixture passes the
    test's own :class:`Units`; a bed made in a test gets one of its own, removed by :meth:`cleanup`).
    """

    def __init__(
        self,
        python: Path,
        state: Path,
        manager: UserManager,
        nvml: FakeNvml,
        wheels: Wheelhouse,
        units: Units | None = None,
    ) -> None:
        self.python = python
        self.site = wheelhouse.site_packages(python)
        self.state = state
        self.manager = manager
        self.nvml = nvml
        self.wheels = wheels
        self.units = units if units is not None else Units(manager)
        self.enabled: list[str] = []
        self.exec_prefix = ""  # what runs sicext-serve (a ServiceAccountBed: setpriv to its account)
        self.tool: tuple[str, ...] = (SAFEINSTALL,)  # the command that is safeinstall (see hidden_tool)

    # --- the package --------------------------------------------------------------------------------

    @property
    def so(self) -> Path:
        """The installed sicext extension."""
        return next((self.site / "sicext").glob("_native*.so"))

    def version(self) -> str:
        """What ``sicext.version()`` says in the venv (or the last line of the error when it fails)."""
        out = subprocess.run(
            [str(self.python), "-c", "import sicext; print(sicext.version())"], capture_output=True, text=True
        )
        return out.stdout.strip() or next(iter(out.stderr.strip().splitlines()[-1:]), "")

    def snapshot(self) -> dict[str, str]:
        """Every file of the package (bytecode aside) and its sha256: small enough for pytest to diff."""
        return {
            str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in (self.site / "sicext").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts
        }

    def hotfix(self) -> dict[str, str]:
        """A local patch of sicext/serve.py (a line appended); the package's :meth:`snapshot` after it."""
        target = self.site / "sicext" / "serve.py"
        target.write_text(target.read_text() + "# local hotfix\n")
        return self.snapshot()

    def consistent(self, before: dict[str, str], wheel: Path) -> str:
        """Either exactly the old bytes (local patch included), or the new version verified."""
        version = self.version()
        if version == "1.0":
            assert self.snapshot() == before
            return "old"
        assert version == "2.0"
        check = self.verify("--wheel", str(wheel))
        assert check.code == 0, check.stdout
        return "new"

    # --- units --------------------------------------------------------------------------------------

    def unit(self, stem: str, enable: bool = False, text: str = UNIT_TEXT) -> str:
        """A unit running sicext-serve (``text`` with ``{exec}``), started and active; its name."""
        name = self.units.create(
            stem, text.format(exec=f"{self.exec_prefix}{self.python.parent}/sicext-serve")
        )
        if enable:
            self.manager.systemctl("enable", name)
            self.enabled.append(name)
        self.manager.start(name)
        self.manager.wait_active(name)
        return name

    def service(self, stem: str, args: str = "", **settings: str) -> str:
        """A unit running ``sicext-serve ARGS`` (unit settings as keywords), active and its main process
        running the extension (unless ``--lazy``); its name."""
        name = self.units.started(stem, f"{self.python.parent}/sicext-serve {args}".strip(), **settings)
        main = self.manager.main_pid(name)
        wait_until(lambda: maps_so(main) is not None or args.startswith("--lazy"), 15, "service maps the .so")
        return name

    def hold_gpu(self, unit: str, linger: float, uuid: str, gib: int = 10) -> None:
        """The unit's main process holds GPU memory (fake driver), kept listed ``linger`` s after it exits."""
        gpu = self.nvml.add_gpu("NVIDIA H200", f"GPU-00000000-0000-0000-0000-0000000000{uuid}", 141 * GiB)
        self.nvml.hold(self.manager.main_pid(unit), gpu, gib * GiB, linger=linger)

    def cleanup(self) -> None:
        """Disable the units the bed enabled, then kill, stop and remove every unit it made."""
        if self.enabled:
            self.manager.systemctl("disable", *self.enabled, check=False)
            self.enabled.clear()
        self.units.cleanup()

    # --- safeinstall --------------------------------------------------------------------------------

    def environ(self) -> dict[str, str]:
        # COLUMNS: as clirun.run sets it (a pipe is otherwise laid out at 80 columns)
        return {
            **self.manager.env,
            **self.nvml.env,
            "SAFEINSTALL_STATE_DIR": str(self.state),
            "COLUMNS": "200",
        }

    def cli(self, *extra: str, timeout: float = 240, more_env: dict[str, str] | None = None) -> Result:
        """``safeinstall --user --python PYTHON EXTRA...`` against the bed (``more_env``: variables added
        to its environment)."""
        env = {**self.environ(), **(more_env or {})}
        return run("--user", "--python", str(self.python), *extra, env=env, timeout=timeout, tool=self.tool)

    def safeinstall(self, *args: str, timeout: float = 180, more_env: dict[str, str] | None = None) -> Result:
        """Like :meth:`cli` with ``--yes`` (arguments after "--" go to uv, so ours come first)."""
        return self.cli("--yes", *args, timeout=timeout, more_env=more_env)

    def args(self, *extra: str) -> list[str]:
        return [*self.tool, "--user", "--python", str(self.python), "--yes", *extra]

    def start_run(self, *extra: str) -> subprocess.Popen[str]:
        """A run of safeinstall (with ``--yes``) in the background, for a test to interrupt."""
        return subprocess.Popen(
            self.args(*extra), env=self.environ(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )

    def kill_in(self, phase: str, *extra: str) -> None:
        """A run of safeinstall (with ``--yes``) killed (SIGKILL) once its journal is in ``phase``."""
        proc = self.start_run(*extra)
        try:
            self.wait_phase(proc, phase)
            proc.send_signal(signal.SIGKILL)
        finally:
            proc.wait()
            proc.communicate()

    def swap_killed_then_recovered(self, name: str, phase: str, phases: tuple[str, ...]) -> None:
        """The swap of sicext 1.0 -> 2.0 killed once the journal is at one of ``phases`` (``phase``:
        the row's name; ``done`` lasts milliseconds and may be missed), then ``--recover``: one whole
        version (the old one before the verification, the new one after), no ``.safeinstall-*``
        directory left, the unit ``name`` up, nothing else left behind."""
        venv = self.python.parent.parent
        before = tree_snapshot(venv)
        proc = self.start_run("sicext", "--wheel", str(self.wheels["sicext-2"]), "--settle", "1")
        caught: str | None
        try:
            caught = self.wait_phase(proc, *phases, timeout=120)
            os.kill(proc.pid, signal.SIGKILL)
        except AssertionError:  # "done" lasts milliseconds: the run may finish before it is seen
            if phase != "done":
                raise
            caught = None
        finally:
            proc.wait()
            proc.communicate()
        if self.journal() is not None:
            recovered = self.cli("--recover", "--json")
            assert recovered.code == 0, recovered.stdout + recovered.stderr
            (recovery,) = recovered.json["data"]["recoveries"]
            # the run may go on between the look at its journal and the kill (installed -> verified
            # takes no time in a swap): the phase it died in is the one seen or a later one of phases
            later = phases[phases.index(caught) :] if caught in phases else (caught,)
            assert recovery["phase"] in later, (recovery, caught)
            caught = str(recovery["phase"])
        wait_until(lambda: self.manager.active_state(name) == "active", 20, "unit running again")
        assert not list(venv.glob(".safeinstall-*"))
        if caught in ("staged", "installed"):
            # uv's lock file is replaced before the stop by design (the owner's alone, not 0666)
            after = {k: v for k, v in tree_snapshot(venv).items() if k != ".lock"}
            assert self.version() == "1.0" and after == {k: v for k, v in before.items() if k != ".lock"}
        else:
            check = self.verify("--wheel", str(self.wheels["sicext-2"]))
            assert self.version() == "2.0" and check.code == 0, check.stdout
        self.no_trace()

    def verify(self, *extra: str) -> Result:
        return run("sicext", "--verify-only", "--python", str(self.python), "--json", *extra)

    # --- what a run left ----------------------------------------------------------------------------

    def journal(self) -> dict[str, Any] | None:
        """This environment's journal (the state directory may hold other environments' too)."""
        prefix = os.path.realpath(self.python.parent.parent)
        for path in self.state.glob("*/journal.json"):
            try:
                doc = dict(json.loads(path.read_text()))
            except (OSError, ValueError):
                continue
            if doc.get("prefix") == prefix:
                return doc
        return None

    def wait_phase(self, proc: subprocess.Popen[Any], *phases: str, timeout: float = 60) -> str:
        """Wait until the run's journal is at one of ``phases``; that phase."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            doc = self.journal()
            if doc is not None and doc["phase"] in phases:
                return str(doc["phase"])
            if proc.poll() is not None:
                out, err = proc.communicate()
                raise AssertionError(f"the run ended (rc {proc.returncode}) before {phases}: {out}{err}")
            time.sleep(0.002)
        raise AssertionError(f"no journal phase {phases} within {timeout} s (last: {self.journal()})")

    def installers(self) -> list[int]:
        """PIDs of uv processes installing into this venv (there must be none once the run is gone)."""
        venv = str(self.python.parent.parent).encode()
        found = []
        for entry in Path("/proc").iterdir():
            try:
                argv = (entry / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if entry.name.isdigit() and b"install" in argv and any(a.startswith(venv) for a in argv):
                found.append(int(entry.name))
        return found

    def no_trace(self) -> None:
        assert self.journal() is None
        assert not list(self.state.glob("*/gate"))
        assert not list(self.state.glob("*/uv-cache-*"))  # the run's own uv cache: gone, even after a kill
        assert not list(self.manager.unit_dir.glob("*.d/*safeinstall*"))
        assert not list(self.python.parent.parent.glob(".safeinstall-keep-*"))  # kept links of old files


# --- the service account (uid 65534) -----------------------------------------------------------------


def chown_tree(top: Path, uid: int) -> None:
    for directory, dirnames, filenames in os.walk(top):
        os.lchown(directory, uid, uid)
        for name in [*dirnames, *filenames]:
            os.lchown(os.path.join(directory, name), uid, uid)


def as_user(uid: int, *argv: str) -> None:
    """Run ``argv`` as ``uid`` alone (its own gid, no other group)."""
    subprocess.run(
        ["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", *argv],
        check=True,
        capture_output=True,
        text=True,
    )


def as_nobody(*argv: str) -> None:
    as_user(NOBODY, *argv)


def shared_interpreter_or_skip() -> str:
    """An interpreter of this Python version that uid 65534 may run; the test is skipped without one."""
    shared = wheelhouse.shared_interpreter()
    if shared is None:
        pytest.skip("no interpreter of this Python version that uid 65534 may run")
    return shared


@contextlib.contextmanager
def bind_mount(source: Path, target: Path) -> Iterator[None]:
    """``source`` bind-mounted on ``target`` for the block (skipped where mounts are not allowed, a
    failure on CI); unmounted at the end."""
    done = subprocess.run(["mount", "--bind", str(source), str(target)], capture_output=True, text=True)
    if done.returncode != 0:
        message = f"cannot bind-mount {source} on {target}: {done.stderr.strip()}"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    try:
        yield
    finally:
        subprocess.run(["umount", "--lazy", str(target)], check=False, capture_output=True)


def tree_snapshot(top: Path, skip: Path | None = None) -> dict[str, tuple[object, ...]]:
    """Every entry below ``top`` (``skip`` aside): its type, content hash or link target, owner, mode."""
    found: dict[str, tuple[object, ...]] = {}
    for directory, dirnames, filenames in os.walk(top):
        dirnames[:] = [d for d in dirnames if Path(directory, d) != skip and d != "__pycache__"]
        for name in [*filenames, *dirnames]:
            path = Path(directory, name)
            info = os.lstat(path)
            if stat.S_ISLNK(info.st_mode):
                what: object = "link:" + os.readlink(path)
            elif stat.S_ISREG(info.st_mode):
                what = hashlib.sha256(path.read_bytes()).hexdigest()
            else:
                what = stat.S_IFMT(info.st_mode)
            found[str(path.relative_to(top))] = (what, info.st_uid, info.st_gid, stat.S_IMODE(info.st_mode))
    return found


class ServiceAccountBed(Bed):
    """A venv owned by uid 65534, its unit running as that uid; a victim directory beside it. The state
    directory is below directories others may enter (pytest's are 0700): uv runs as uid 65534 and must
    reach the run's uv cache there."""

    def __init__(self, base: Path, state: Path, manager: UserManager, nvml: FakeNvml, wheels: Wheelhouse):
        python = wheelhouse.make_venv(base / "venv", shared_interpreter_or_skip())
        wheelhouse.uv_install(python, wheels["sicext-1"])
        chown_tree(base / "venv", NOBODY)
        super().__init__(python, state, manager, nvml, wheels)
        self.exec_prefix = f"setpriv --reuid={NOBODY} --regid={NOBODY} --clear-groups "
        self.base = base
        self.elsewhere = base / "elsewhere"
        self.elsewhere.mkdir()
        (self.elsewhere / "victim.txt").write_text("not the environment's\n")
        chown_tree(self.elsewhere, NOBODY)

    def outside(self) -> dict[str, tuple[object, ...]]:
        return tree_snapshot(self.base, skip=self.base / "venv")


#: what a copy of the standard library leaves out (none of it is safeinstall's)
_STDLIB_SKIP = ("site-packages", "test", "idlelib", "tkinter", "turtledemo", "ensurepip", "config-*")


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)  # its own name below a 0700 directory: what the account reaches it by
    except OSError:
        shutil.copy2(source, target)


def hidden_tool(top: Path) -> tuple[str, ...]:
    """safeinstall installed where the service account cannot read, as ``uv tool install`` under a pyenv
    in ``/root`` has it: this interpreter, its standard library, safeinstall and what it requires, below
    ``top`` (made 0700, root's). The command that runs it (``python -I -m safeinstall``)."""
    top.mkdir(mode=0o700)
    top.chmod(0o700)
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    (top / "bin").mkdir()
    python = top / "bin" / version
    shutil.copy2(os.path.realpath(sys.executable), python)
    lib = top / "lib" / version
    shutil.copytree(
        Path(sys.base_prefix, "lib", version),
        lib,
        ignore=shutil.ignore_patterns(*_STDLIB_SKIP),
        copy_function=_link_or_copy,
    )
    site = lib / "site-packages"
    import safeinstall

    shutil.copytree(Path(safeinstall.__file__).parent, site / "safeinstall")  # a copy: edits stay out
    wanted, seen = ["safeinstall"], set()
    while wanted:
        dist = metadata.distribution(wanted.pop())
        name = canonicalize_name(dist.metadata["Name"])
        if name in seen:
            continue
        seen.add(name)
        for text in dist.requires or ():
            requirement = Requirement(text)
            if requirement.marker is None or requirement.marker.evaluate({"extra": ""}):
                wanted.append(requirement.name)
        if name == "safeinstall":
            continue
        for file in dist.files or ():
            source = Path(str(dist.locate_file(file)))
            target = Path(os.path.normpath(site / file))
            if source.is_file() and "__pycache__" not in file.parts:
                target.parent.mkdir(parents=True, exist_ok=True)
                _link_or_copy(str(source), str(target))
    return (str(python), "-I", "-m", "safeinstall")


def printing_interpreter(python: Path, script: str, uid: int = NOBODY) -> None:
    """Make ``python`` a shell script that runs ``script`` (whatever the probe asks), owned with its
    directory by ``uid`` (the service account)."""
    python.write_text(f"#!/bin/sh\n{script}")
    python.chmod(0o755)
    subprocess.run(["chown", "-R", f"{uid}:{uid}", str(python.parent.parent)], check=True)


# --- a terminal ---------------------------------------------------------------------------------------


def declined_on_a_terminal(bed: Bed, *extra: str) -> tuple[int, str, str]:
    """``safeinstall sicext --wheel sicext-2 EXTRA`` with a terminal as its input, answered ``n`` at the
    prompt: its exit status, stdout and stderr."""
    args = ["--user", "--python", str(bed.python), "sicext", "--wheel", str(bed.wheels["sicext-2"]), *extra]
    return answered_no_on_a_terminal(args, bed.environ())


def answered_no_on_a_terminal(args: list[str], environ: dict[str, str]) -> tuple[int, str, str]:
    """``safeinstall ARGS`` with a terminal as its input, answered ``n`` at the prompt: its exit status,
    stdout and stderr."""
    import pty

    master, slave = pty.openpty()
    try:
        proc = subprocess.Popen(
            [SAFEINSTALL, *args],
            stdin=slave,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env={**environ, "COLUMNS": "200"},
            text=True,
        )
        os.write(master, b"n\n")
        out, err = proc.communicate(timeout=120)
    finally:
        os.close(master)
        os.close(slave)
    return proc.returncode, out, err


#: A service of sicext that serves ``/health`` (200; 404 elsewhere) on 127.0.0.1:ARGV[1], after its
#: import and ``loading`` seconds more (as a model server loads before it serves).
HEALTH_SERVER = """
import http.server, sys, time, sicext
time.sleep({loading})
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
        self.wfile.write(sicext.version().encode())
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


def health_server(directory: Path, loading: float = 0.0) -> tuple[Path, int]:
    """:data:`HEALTH_SERVER` written into ``directory``, and a free loopback port for it."""
    import socket

    server = directory / "health_server.py"
    server.write_text(HEALTH_SERVER.format(loading=loading))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return server, int(sock.getsockname()[1])


# ------------------------------------------------------------------ --verify-only of sipure, kept hashes

#: A sha256 in RECORD spelling that no fixture file has.
WRONG_DIGEST = "A" * 43


def verify_sipure(python: Path, state: Path, *extra: str) -> dict[str, Any]:
    """``safeinstall sipure --verify-only --json`` with the state directory ``state``: its document."""
    result = run(
        "sipure",
        "--verify-only",
        "--python",
        str(python),
        "--json",
        *extra,
        env={**os.environ, "SAFEINSTALL_STATE_DIR": str(state)},
    )
    assert result.code in (0, 1), result.stderr
    doc: dict[str, Any] = result.json
    return doc


def modified_names(doc: dict[str, Any]) -> set[str]:
    """The file names a ``--verify-only --json`` document reports ``modified``."""
    return {os.path.basename(f["path"]) for f in doc["data"]["findings"] if f["kind"] == "modified"}


def forge_kept_hash(state: Path, python: Path, target: Path, hashed_ns: int) -> None:
    """A verified-inode store whose one entry says ``target``, as it is now, hashed at ``hashed_ns`` to
    :data:`WRONG_DIGEST` (written through the store's own ``to_bytes``): a check that believes it
    reports the file ``modified``."""
    from safeinstall.env.inodetrust import InodeStore, VerifiedInode
    from safeinstall.store.inodestore import boot_id, store_file, to_bytes
    from safeinstall.store.state import environment_state

    boot = boot_id()
    assert boot is not None
    prefix = Path(os.path.realpath(python.parent.parent))
    info = os.lstat(target)
    entry = VerifiedInode(
        info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns, hashed_ns, WRONG_DIGEST
    )
    store = InodeStore(os.fspath(prefix), boot, {(info.st_dev, info.st_ino): entry})
    path = store_file(environment_state(state, prefix))
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    path.write_bytes(to_bytes(store))
    path.chmod(0o600)


def hashed_state(ctime_ns: int, hashed_ns: int = 0, **changes: object) -> Any:
    """A :class:`~safeinstall.env.hashing.FileState` of a regular file read and hashed at ``hashed_ns``
    (device 7, inode 42, 10 bytes, its mtime and ctime ``ctime_ns``), with ``changes``."""
    from safeinstall.env.hashing import FileState

    fields: dict[str, object] = {
        "path": "/p/f.py",
        "exists": True,
        "is_file": True,
        "size": 10,
        "digest": "B" * 43,
        "algorithm": "sha256",
        "device": 7,
        "inode": 42,
        "mtime_ns": ctime_ns,
        "ctime_ns": ctime_ns,
        "hashed_ns": hashed_ns,
    }
    fields.update(changes)
    return FileState(**fields)  # type: ignore[arg-type]


# --- a full disk (issue 44) ----------------------------------------------------------------------

#: what the disk-full tests and the disk-full soak cover (tests/test_faults.py, tests/test_soak.py):
#: the kinds of environment, the modes of the install, and the room left before the run (KiB)
FULL_DISK_KINDS = ("root", "account")
FULL_DISK_MODES = ("swap", "no-swap")
FULL_DISK_LEAVE_KIB = (0, 124, 400)
#: the old version's blob, and how much bigger the new one's is
FULL_DISK_BLOB = 4 << 20
FULL_DISK_MORE = 128 << 10


def full_disk_wheels(wheels: Wheelhouse, where: Path) -> dict[str, Path]:
    """sicext 1.0 with a random blob of :data:`FULL_DISK_BLOB` and 2.0 with one :data:`FULL_DISK_MORE`
    bigger (stored, not deflated), in ``where`` (a directory the account may read): version -> wheel."""
    old = {"sicext/blob.bin": os.urandom(FULL_DISK_BLOB)}
    new = {"sicext/blob.bin": os.urandom(FULL_DISK_BLOB + FULL_DISK_MORE)}
    return {
        "1.0": wheelhouse.rebuilt(wheels["sicext-1"], where / "old", old, deflate=False),
        "2.0": wheelhouse.rebuilt(wheels["sicext-2"], where / "new", new, deflate=False),
    }


def mode_args(mode: str) -> tuple[str, ...]:
    """The options of a :data:`FULL_DISK_MODES` mode."""
    return ("--no-swap",) if mode == "no-swap" else ()


def full_disk_bed(
    kind: str,
    old: Path,
    wheels: Wheelhouse,
    tmp_path: Path,
    user_manager: UserManager,
    fake_nvml: FakeNvml,
    small_disk: Callable[..., Path],
    open_dir: Path,
    open_state: Path,
) -> Bed:
    """sicext ``old`` in a venv at ``DISK/venv``, DISK a 48 MiB tmpfs, its files copies (no other
    link): root's venv (the state directory in the test's), or uid 65534's (a ServiceAccountBed)."""
    if kind == "root":
        python = wheelhouse.make_venv(small_disk(48) / "venv")
        wheelhouse.uv_install(python, old)  # copied from a cache on another disk
        return Bed(python, tmp_path / "state", user_manager, fake_nvml, wheels)
    bed = ServiceAccountBed(small_disk(48, open_dir), open_state, user_manager, fake_nvml, wheels)
    as_account = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    install = [wheelhouse.UV, "pip", "install", "--quiet", "--offline", "--no-cache", "--python"]
    subprocess.run([*as_account, *install, str(bed.python), str(old)], check=True, env=wheelhouse.uv_env())
    return bed


def fill_disk(disk: Path, leave: int) -> None:
    """Fill ``disk`` but ``leave`` bytes (a filler file of the rest)."""
    vfs = os.statvfs(disk)
    with (disk / "filler").open("wb") as filler:
        filler.write(b"\0" * max(0, vfs.f_bavail * vfs.f_frsize - leave))


class DiskWriter:
    """Another writer on ``disk``: it takes whatever room there is, and keeps taking what is freed,
    until stopped (a log, a checkpoint, another service)."""

    def __init__(self, disk: Path) -> None:
        self.path = disk / "writer"
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._write, daemon=True)

    def _write(self) -> None:
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT, 0o600)
        try:
            while not self.done.is_set():
                for chunk in (1 << 20, 4096):
                    with contextlib.suppress(OSError):
                        while os.write(fd, b"\0" * chunk):
                            pass
                self.done.wait(0.002)
        finally:
            os.close(fd)

    def __enter__(self) -> DiskWriter:
        self.thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self.done.set()
        self.thread.join()
        self.path.unlink()


# --- what a smoke check starts (issue 44) -----------------------------------------------------------


def smoke_escape_command(marker: str, sleeps: bool = True, imports: bool = True) -> str:
    """A ``--smoke`` command that leaves processes in sessions of their own (``setsid``), ``marker`` in
    their command lines: a ``sleep`` (``sleeps``), a Python that imports sicext first (``imports``)."""
    detached = "</dev/null >/dev/null 2>&1 &"
    started = [f"setsid sleep {marker} {detached}"] if sleeps else []
    if imports:
        started.append(f"setsid python -c 'import sicext, time; time.sleep({marker})' {detached}")
    return " ".join(started) + " sleep 1; exit 0"


def alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def running_with(marker: str) -> list[int]:
    """The processes whose command line holds ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes() and alive(int(entry.name)):
                    found.append(int(entry.name))
            except OSError:
                continue
    return found
