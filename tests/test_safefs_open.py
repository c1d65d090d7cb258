"""Root's reads of paths it did not make never open a FIFO or a device, and never take a terminal.

An account that links a ``.pth`` (or METADATA, or the ``--wheel`` path) to a pty slave it holds made a
root run that began its own session (``setsid``) take that pty as its controlling terminal: the account
then sent it SIGQUIT through the master. Opening a device at all can act (a watchdog arms on open). Each
reader pins the path with ``O_PATH`` (no driver's open runs), refuses anything but a regular file, and
only then opens it, through ``/proc/self/fd``, with ``O_NOCTTY``. docs/threat-model.md.

Real parts: a real pty (``os.openpty``), a child that starts its own session and asks for ``/dev/tty``
afterwards (ENXIO: it has no controlling terminal), and inotify's ``IN_OPEN`` on a real FIFO.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import signal
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from safeinstall.env.hashing import _observe, read_buffer
from safeinstall.env.owner import _read_regular, read_texts
from safeinstall.env.sitetop import _digest
from safeinstall.store.runlog import LogTail
from safeinstall.system.lock import read_holder
from safeinstall.system.safefs import (
    NotRegularFile,
    Tree,
    UntrustedFile,
    open_regular,
    read_small,
    read_trusted,
)

_IN_OPEN = 0x20
#: Ends a child that blocks (unfixed code only): never a timing the tests judge.
_HANG_GUARD_S = 60


def _hashed(path: Path) -> object:
    """The hashing of a file the directory's listing showed as regular (then swapped): never opened."""
    fd = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        state = _observe(str(path), path.name, fd, "sha256", frozenset({path.name}), read_buffer())
    finally:
        os.close(fd)
    assert not state.is_file and state.digest is None
    return state


def _none(result: object) -> object:
    assert result is None
    return result


def _refused(kind: type[BaseException], call: Callable[[Path], object]) -> Callable[[Path], object]:
    def reader(path: Path) -> object:
        with pytest.raises(kind):
            call(path)
        return None

    return reader


#: name -> (follows a symlink, the reader: refuses what is not a regular file)
READERS: dict[str, tuple[bool, Callable[[Path], object]]] = {
    "read_small": (True, _refused(NotRegularFile, lambda p: read_small(p, 4096))),
    "open_regular": (True, _refused(NotRegularFile, open_regular)),
    "read_texts": (True, lambda p: read_texts([str(p)], 4096)),
    "Tree.read_bytes": (False, _refused(NotRegularFile, lambda p: Tree(p.parent).read_bytes(p.name, 4096))),
    "read_trusted": (False, _refused(UntrustedFile, lambda p: read_trusted(p, 4096))),
    "read_holder": (False, _refused(NotRegularFile, read_holder)),
    "LogTail": (False, lambda p: LogTail(p).new_lines()),
    "hashing": (False, _hashed),
    "sitetop digest": (False, lambda p: _none(_digest(str(p)))),
    "owner's reader": (False, _refused(NotRegularFile, _read_regular)),
}


@pytest.fixture
def pty_slave() -> Iterator[str]:
    master, slave = os.openpty()
    try:
        yield os.ttyname(slave)
    finally:
        os.close(slave)
        os.close(master)


#: The readers that follow a symlink: the way to a terminal (a pty slave opens only through its devpts;
#: an account cannot make a device node, and the others follow no link: the FIFO test covers them).
FOLLOWING = sorted(name for name, (follows, _reader) in READERS.items() if follows)


@pytest.mark.parametrize("name", FOLLOWING)
def test_a_reader_given_a_link_to_a_terminal_refuses_it_and_never_takes_it_as_the_controlling_terminal(
    name: str, tmp_path: Path, pty_slave: str
) -> None:
    _follows, reader = READERS[name]
    path = tmp_path / "zz.pth"
    path.symlink_to(pty_slave)

    def child() -> int:  # a root run started with setsid: a session leader without a terminal
        os.setsid()
        reader(path)
        try:
            os.close(os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY))
        except OSError as exc:
            return 0 if exc.errno == errno.ENXIO else 4
        return 3  # it took the pty: the account can signal it

    assert _in_child(child) == 0, f"{name}: the child's exit says why (3: it took the pty)"


def _in_child(work: Callable[[], int]) -> int:
    """``work``'s answer, run in a forked child (its own session, say): the exit code; 5 when it raised,
    a signal's negative number when it died. Unfixed code blocks (a read of the terminal, a FIFO's
    open): SIGALRM ends it rather than the test session (never reached by code that does not block)."""
    pid = os.fork()
    if pid == 0:
        code = 5
        try:
            signal.alarm(_HANG_GUARD_S)
            code = work()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


class _Inotify:
    """inotify's ``IN_OPEN`` on one path: how many times it was opened for real (``O_PATH`` is not)."""

    def __init__(self, path: Path) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.fd = libc.inotify_init1(os.O_NONBLOCK | os.O_CLOEXEC)
        if self.fd < 0 or libc.inotify_add_watch(self.fd, os.fsencode(path), _IN_OPEN) < 0:
            raise OSError(ctypes.get_errno(), "inotify")

    def opens(self) -> int:
        count = 0
        with contextlib.suppress(BlockingIOError):
            while data := os.read(self.fd, 4096):
                count += len(data) // 16  # no name: a watch on the file itself
        return count

    def close(self) -> None:
        os.close(self.fd)


@pytest.fixture(params=["a FIFO", "a character device"])
def special(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[Path, str, _Inotify]]:
    """A FIFO, or a device node (/dev/null's numbers), watched for real opens."""
    kind: str = request.param
    path = tmp_path / "special"
    if kind == "a FIFO":
        os.mkfifo(path, 0o600)
    else:
        os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    watch = _Inotify(path)
    try:
        os.close(os.open(path, os.O_PATH | os.O_CLOEXEC))
        if watch.opens():
            pytest.skip("this kernel reports an O_PATH open as IN_OPEN (before Linux 6.5)")
        os.close(os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        assert watch.opens() == 1  # the watch sees a real open
        yield path, kind, watch
    finally:
        watch.close()
        path.unlink()


@pytest.mark.parametrize("name", sorted(READERS))
def test_a_reader_given_a_fifo_or_a_device_refuses_it_without_opening_it(
    name: str, tmp_path: Path, special: tuple[Path, str, _Inotify]
) -> None:
    follows, reader = READERS[name]
    target, kind, watch = special
    path = target
    if follows:
        path = tmp_path / "zz.pth"
        path.symlink_to(target)

    def child() -> int:
        result = reader(path)
        if name == "read_texts":
            assert result == [[None, f"not a regular file ({kind})"]]
        if name == "LogTail":
            assert result == []
        return 0

    assert _in_child(child) == 0, f"{name}: the child's exit says why (5: a check failed; -14: it blocked)"
    assert watch.opens() == 0, f"{name} opened {kind}"


def test_read_small_still_reads_a_regular_file_through_a_link_and_names_a_device_refused(
    tmp_path: Path, pty_slave: str
) -> None:
    (tmp_path / "real.pth").write_bytes(b"import os\n")
    (tmp_path / "link.pth").symlink_to(tmp_path / "real.pth")
    assert read_small(tmp_path / "link.pth", 4096) == b"import os\n"
    (tmp_path / "tty.pth").symlink_to(pty_slave)
    with pytest.raises(NotRegularFile) as caught:
        read_small(tmp_path / "tty.pth", 4096)
    assert caught.value.what == "a character device"
    assert caught.value.filename == str(tmp_path / "tty.pth")
