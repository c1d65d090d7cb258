"""Child processes (uv, systemctl, the target interpreter), started so that none escapes the run.

The spawn is a critical section for signals, every child dies with safeinstall
(``PR_SET_PDEATHSIG``) and is isolated as a worker (:func:`isolate`). docs/crash-safety.md.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import resource
import selectors
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from types import FrameType

from safeinstall.system.identity import group_members

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4
_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

_Handler = Callable[[int, FrameType | None], object] | int | None


def _find_prctl() -> Callable[[int, int], int] | None:
    try:
        prctl: Callable[[int, int], int] = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):  # not Linux (or no libc symbol): children just cannot follow us
        return None
    return prctl


#: Resolved once, before any fork: the child only calls it.
_PRCTL = _find_prctl()


def isolate(
    parent: int, ids: tuple[int, int] | None, *, new_session: bool, keep: tuple[int, ...] | None = None
) -> None:
    """In a freshly forked child: the worker's isolation. ``ids``: become them, no supplementary groups;
    ``new_session``: ``setsid``; ``keep``: the only descriptors left. The parent-death signal is armed after
    the ids change (which clears it); an orphan exits 255."""
    if new_session:
        os.setsid()
    if keep is not None:
        _close_all_but(keep)
    if ids is not None:
        # A forked worker runs safeinstall's own code, never the account's: its files are checked as the
        # account (the effective and filesystem ids), while its real and saved uid stay root's, so the
        # account cannot signal it (kill, SIGSTOP: a rollback held or failed at the account's will).
        # Not dumpable: the account cannot ptrace it nor read its memory (a copy of root's).
        os.setgroups([])
        os.setresgid(ids[1], ids[1], ids[1])
        os.setresuid(0, ids[0], 0)
        if os.getresuid() != (0, ids[0], 0) or os.getresgid() != (ids[1],) * 3 or os.getgroups():
            os._exit(254)
    if _PRCTL is not None:
        _PRCTL(_PR_SET_DUMPABLE, 0)
        _PRCTL(_PR_SET_PDEATHSIG, int(signal.SIGKILL))
    if os.getppid() != parent:  # the parent died before prctl: no signal would come
        os._exit(255)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core file of what root's memory held
    os.umask(0o022)
    os.chdir("/")


def _close_all_but(keep: tuple[int, ...]) -> None:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # a stray print must not fail, nor reach root's terminal
        if fd not in keep:
            os.dup2(null, fd)
    low = 3
    for fd in sorted(k for k in keep if k >= 3):
        os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, os.sysconf("SC_OPEN_MAX"))


def _die_with(parent: int, program_fd: int | None = None) -> Callable[[], None]:
    """The code a program's child runs between fork and exec: :func:`isolate` (``subprocess`` made the
    new session and set the ids already). ``program_fd`` (kept open by ``subprocess`` for the exec
    through it) is made close-on-exec: the exec of an ELF program through ``/proc/self/fd`` still
    works, and the program and what it runs never hold it."""

    def in_child() -> None:
        isolate(parent, None, new_session=False)
        # a child forked by a thread started with the run's signals blocked (a check run in the
        # background, safeinstall.run.steps.smoke) must not keep them blocked: the program gets them as usual
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        if program_fd is not None:
            os.set_inheritable(program_fd, False)

    return in_child


def _hold(held: list[int]) -> dict[int, _Handler]:
    """Record SIGINT/SIGTERM in ``held`` instead of handling them; the handlers to put back. Only the main
    thread can change handlers, and only there do handlers run: elsewhere this is a no-op (a signal then
    interrupts the main thread, not this spawn)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def record(signum: int, _frame: FrameType | None) -> None:
        held.append(signum)

    previous: dict[int, _Handler] = {}
    for sig in _HELD_SIGNALS:
        if signal.getsignal(sig) is None:  # a handler installed outside Python: cannot be put back
            continue
        previous[sig] = signal.signal(sig, record)
    return previous


def _release(previous: dict[int, _Handler], held: list[int]) -> None:
    """Put the handlers back, then deliver what was held back (the handler may raise here)."""
    for sig, handler in previous.items():
        signal.signal(sig, handler)
    for signum in dict.fromkeys(held):
        signal.raise_signal(signum)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    """Kill ``proc`` and its process group (so a shell's children do not run on) and wait for it, whatever
    arrives meanwhile. A child reaped already is not signalled: its number may be another's."""
    if proc.returncode is None:
        with contextlib.suppress(OSError):  # gone already, or a group not ours to signal: the child alone
            os.killpg(proc.pid, signal.SIGKILL)
    proc.kill()
    while True:
        try:
            proc.wait()
            return
        except BaseException:
            continue


#: How long the processes a child left in its group may take to go once killed.
GROUP_END_S = 10.0


def end_process_group(leader: int, timeout: float = GROUP_END_S) -> bool:
    """Kill what is left of the process group ``leader`` led (the child, exited but not reaped yet: its
    zombie holds the number, so no other process can have it) and wait until the group has no live
    member; False if members were still there after ``timeout`` (a process in D state)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            os.killpg(leader, signal.SIGKILL)
        except ProcessLookupError:
            return True
        except PermissionError:  # not ours to signal (never for a group our child led)
            return False
        if not group_members(leader):  # only zombies left: an init that reaps late holds them
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)


#: What a child may print on each of stdout and stderr: beyond it the child is ended. The probe and uv
#: run as the environment's owner (and uv runs the owner's build backends): unbounded, what they print
#: could fill root's memory.
OUTPUT_LIMIT = 16 << 20


class TooMuchOutput(OSError):
    """A child printed more than :data:`OUTPUT_LIMIT` on one stream (it was killed and reaped)."""


class Cancelled(Exception):
    """The caller's ``cancel`` event was set while the child ran (it was killed and reaped, and its
    process group sent SIGKILL)."""


#: The programs that put a child in a PID namespace of its own (util-linux), looked for only here.
_SYSTEM_DIRS = ("/usr/bin", "/bin", "/usr/sbin", "/sbin")


def _system_program(name: str) -> str | None:
    for directory in _SYSTEM_DIRS:
        path = os.path.join(directory, name)
        if os.access(path, os.X_OK):
            return path
    return None


#: What glibc's loader and libc load code or settings from: never given to the wrappers of
#: :func:`contained`, which run as root (a unit's ``LD_PRELOAD`` or ``LD_LIBRARY_PATH`` may name the
#: account's own files: loaded by root's ``unshare``, they would run as root; the attacker review).
_LOADER_PREFIXES = ("LD_", "MALLOC_")
_LOADER_NAMES = frozenset(
    {
        "GCONV_PATH", "GETCONF_DIR", "GLIBC_TUNABLES", "HOSTALIASES", "LOCALDOMAIN", "LOCPATH",
        "NIS_PATH", "NLSPATH", "RESOLV_HOST_CONF", "RES_OPTIONS", "TZ", "TZDIR",
    }
)  # fmt: skip
#: Where a held variable waits while the wrappers run (its value never on a command line).
HELD_PREFIX = "SAFEINSTALL_HELD_"


def held_environment(env: Mapping[str, str]) -> tuple[dict[str, str], list[str]]:
    """Pure: ``env`` for root's wrappers (the loader's variables held under :data:`HELD_PREFIX`; one
    whose name no shell can set is dropped: glibc reads none such) and the ``/bin/sh`` words that, run
    as the account, give them back and run the command (``exec "$@"``)."""
    kept: dict[str, str] = {}
    restore: list[str] = []
    for name, value in env.items():
        if not (name.startswith(_LOADER_PREFIXES) or name in _LOADER_NAMES):
            kept[name] = value
        elif re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", name):
            kept[HELD_PREFIX + name] = value
            restore.append(f"{name}=${HELD_PREFIX}{name}; export {name}; unset {HELD_PREFIX}{name}; ")
    return kept, ["/bin/sh", "-c", "".join(restore) + 'exec "$@"', "sh"]


def contained(
    argv: Sequence[str], as_user: tuple[int, int] | None, groups: Sequence[int]
) -> tuple[list[str], bool] | None:
    """``argv`` run in a PID namespace of its own (``unshare --pid --fork --kill-child``) as ``as_user`` with
    ``groups`` (``setpriv``, which arms the parent-death signal again), and True; None where the caller is not
    root or util-linux is not there. Everything left in the namespace dies with it."""
    unshare, setpriv = _system_program("unshare"), _system_program("setpriv")
    if os.geteuid() != 0 or unshare is None or (as_user is not None and setpriv is None):
        return None
    wrapped = [unshare, "--pid", "--fork", "--kill-child", "--"]
    if as_user is not None:
        assert setpriv is not None
        ids = [f"--reuid={as_user[0]}", f"--regid={as_user[1]}"]
        listed = ",".join(str(g) for g in dict.fromkeys(groups))
        ids.append(f"--groups={listed}" if listed else "--clear-groups")
        wrapped += [setpriv, *ids, "--pdeathsig=KILL", "--"]
    return [*wrapped, *argv], as_user is not None


def run(
    argv: Sequence[str],
    *,
    env: Mapping[str, str],
    timeout: float | None,
    as_user: tuple[int, int] | None = None,
    limit: int = OUTPUT_LIMIT,
    program_fd: int | None = None,
    end_group: bool = False,
    groups: Sequence[int] = (),
    cancel: threading.Event | None = None,
    contain: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``subprocess.run(argv, capture_output=True, text=True)`` with no child left behind. ``as_user``,
    ``groups``: its ids; ``program_fd``: the program's descriptor; ``end_group``, ``contain``: what it started
    ends with it; ``cancel``: kill it when set. Raises ``subprocess.TimeoutExpired``, :class:`TooMuchOutput`,
    :class:`Cancelled`, ``OSError``."""
    command = list(argv)
    environment = dict(env)
    wrapped = contained(command, as_user, groups) if contain and program_fd is None else None
    if wrapped is not None:
        spawned, ids_set = wrapped
        if ids_set:  # root's unshare and setpriv never load what the account's variables name
            as_user = None
            environment, restore = held_environment(env)
            spawned = [*spawned[: -len(command)], *restore, *command]
    else:
        spawned = command
    held: list[int] = []
    previous = _hold(held)
    try:
        proc = subprocess.Popen(
            spawned,
            executable=None if program_fd is None else f"/proc/self/fd/{program_fd}",
            pass_fds=() if program_fd is None else (program_fd,),
            env=environment,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            preexec_fn=_die_with(os.getpid(), program_fd),
            user=None if as_user is None else as_user[0],
            group=None if as_user is None else as_user[1],
            extra_groups=None if as_user is None else list(groups),
            cwd="/",  # never the caller's: a uv.toml there (or above, e.g. in /tmp) would steer uv
            start_new_session=True,  # no controlling terminal (root's /dev/tty), its own process group
        )
    except BaseException:
        _release(previous, held)
        raise
    try:
        _release(previous, held)  # a signal held back during the spawn is handled now: the child is known
        stdout, stderr = _collect(proc, timeout, limit, end_group, cancel)
    except BaseException:
        _reap(proc)
        raise
    finally:
        for stream in (proc.stdout, proc.stderr):
            if stream is not None:
                stream.close()
    # what a child prints is text to show or parse, never to fail on
    text = [data.decode("utf-8", "replace") for data in (stdout, stderr)]
    return subprocess.CompletedProcess(command, proc.returncode, text[0], text[1])


def _exited(proc: subprocess.Popen[bytes]) -> bool:
    """Has the child exited? Asked without reaping it (``WNOWAIT``): its zombie keeps its number, and so
    its group's, from any new process until :func:`_end_group` has signalled that group."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped by another: Popen says so, and the group is never signalled
        proc.poll()
        return True


def _end_group(proc: subprocess.Popen[bytes]) -> None:
    """End the exited child's process group while its zombie still holds the number, then reap it (a
    group signalled after the reap could be another's: the attacker review)."""
    if proc.returncode is None:
        end_process_group(proc.pid)
    proc.poll()


#: How often a child that may be cancelled is looked at (seconds).
POLL_S = 0.05


def _collect(
    proc: subprocess.Popen[bytes],
    timeout: float | None,
    limit: int,
    end_group: bool = False,
    cancel: threading.Event | None = None,
) -> tuple[bytes, bytes]:
    """``proc.communicate(timeout=timeout)`` keeping at most ``limit`` bytes of each stream;
    ``end_group``: once the child has exited, its group is ended (what it left running may hold the
    pipes open) and its output read to the end; ``cancel``: :class:`Cancelled` once it is set."""
    deadline = None if timeout is None else time.monotonic() + timeout
    names = {pipe.fileno(): name for name, pipe in (("stdout", proc.stdout), ("stderr", proc.stderr)) if pipe}
    kept = {name: bytearray() for name in ("stdout", "stderr")}
    ended = not end_group
    with selectors.DefaultSelector() as selector:
        for fd in names:
            selector.register(fd, selectors.EVENT_READ)
        while selector.get_map():
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(proc.args, timeout or 0)
            if cancel is not None and cancel.is_set():
                raise Cancelled("the run that waited for it stopped")
            if not ended and _exited(proc):
                ended = True
                _end_group(proc)
            polled = not ended or cancel is not None
            wait = min(POLL_S, left if left is not None else POLL_S) if polled else left
            for key, _events in selector.select(wait):
                data = os.read(key.fd, 1 << 16)
                if not data:
                    selector.unregister(key.fd)
                    continue
                stream = kept[names[key.fd]]
                stream += data
                if len(stream) > limit:
                    raise TooMuchOutput(f"it printed more than {limit} bytes on {names[key.fd]}")
    while not ended and not _exited(proc):  # its output closed first: its group ended once it exits
        if deadline is not None and time.monotonic() >= deadline:
            raise subprocess.TimeoutExpired(proc.args, timeout or 0)
        if cancel is not None and cancel.is_set():
            raise Cancelled("the run that waited for it stopped")
        time.sleep(0.02)
    if not ended:
        _end_group(proc)
    try:
        proc.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:  # it closed its output but runs on: said with the whole timeout
        raise subprocess.TimeoutExpired(proc.args, timeout or 0) from None
    return bytes(kept["stdout"]), bytes(kept["stderr"])
