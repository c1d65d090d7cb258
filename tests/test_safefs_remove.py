"""Recursive deletes as root in trees others may write (uv's run directories, the prefix): by descriptor.

The environment's owner owns the run's uv cache and scratch directories, which root deletes, and can
change them while root deletes them. ``shutil.rmtree`` checked an entry with ``lstat`` and then opened
it by name without ``O_NOFOLLOW``/``O_NONBLOCK``: a directory swapped for a symlink to a FIFO between
the two hung root in the FIFO's open. These tests swap entries deterministically: a wrapper around
``os.scandir`` (a listing's entries answer as they were listed, and the swap happens as the remover
first asks about an entry), and an audit hook records every ``os.open`` with its flags.
"""

from __future__ import annotations

import errno
import os
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from safeinstall.store.state import remove_run_dir
from safeinstall.system.safefs import MAX_REMOVE_DEPTH, Tree, remove_at
from tests.beds import bind_mount

_recording: list[list[tuple[str, int]]] = []  # the list of the block recording opens, when one is


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if _recording and event == "open" and isinstance(args[2], int):
        _recording[0].append((os.fsdecode(args[0]) if isinstance(args[0], str | bytes) else "", args[2]))


sys.addaudithook(_audit)  # for the whole test process: it only records while a test asks it to


class _Entry:
    """A listed entry that answers as it was when listed; the first question runs ``then`` (a swap)."""

    def __init__(self, entry: os.DirEntry[str], then: Callable[[], None] | None) -> None:
        self.name = entry.name
        self.path = entry.path
        self._dir = entry.is_dir(follow_symlinks=False)
        self._link = entry.is_symlink()
        self._stat = entry.stat(follow_symlinks=False)
        self._then = then

    def _asked(self) -> None:
        then, self._then = self._then, None
        if then is not None:
            then()

    def is_dir(self, *, follow_symlinks: bool = True) -> bool:
        self._asked()
        return self._dir

    def is_file(self, *, follow_symlinks: bool = True) -> bool:
        self._asked()
        return not self._dir and not self._link

    def is_symlink(self) -> bool:
        self._asked()
        return self._link

    def stat(self, *, follow_symlinks: bool = True) -> os.stat_result:
        self._asked()
        return self._stat

    def inode(self) -> int:
        return self._stat.st_ino


class _Listing:
    def __init__(self, entries: list[_Entry]) -> None:
        self.entries = entries

    def __enter__(self) -> _Listing:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __iter__(self) -> Iterator[_Entry]:
        return iter(self.entries)

    def close(self) -> None:
        return None


def swap_after_listing(monkeypatch: pytest.MonkeyPatch, swaps: dict[str, Callable[[], None]]) -> None:
    """Listings return what was there; an entry named in ``swaps`` is changed by its function as soon
    as the remover asks the listing about it (after the listing, before any use of the name)."""
    real = os.scandir

    def scandir(target: Any = ".") -> Any:
        with real(target) as found:
            return _Listing([_Entry(e, swaps.pop(e.name, None)) for e in found])

    monkeypatch.setattr(os, "scandir", scandir)


def in_thread(work: Callable[[], object], fifos: list[Path]) -> tuple[bool, BaseException | None]:
    """Run ``work`` in a thread; (whether it ended by itself, what it raised). A generous bound only
    catches a hang: a FIFO's reader that waits for a writer is then let go, so the test can end."""
    failure: list[BaseException] = []

    def target() -> None:
        try:
            work()
        except BaseException as exc:  # reported by the test
            failure.append(exc)

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(60)
    ended = not thread.is_alive()
    while thread.is_alive():  # blocked in a FIFO's open: give it a writer
        for fifo in fifos:
            try:
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            except OSError as exc:
                assert exc.errno == errno.ENXIO  # no reader (yet)
        thread.join(1)
    return ended, failure[0] if failure else None


@pytest.fixture
def outside(tmp_path: Path) -> tuple[Path, Path]:
    """A FIFO and a directory with a file, outside the tree being deleted."""
    where = tmp_path / "outside"
    (where / "dir").mkdir(parents=True)
    (where / "dir" / "keep.txt").write_text("keep\n")
    os.mkfifo(where / "fifo")
    return where / "fifo", where / "dir"


def test_a_run_directory_with_fifos_and_symlinks_is_deleted_without_blocking(
    tmp_path: Path, outside: tuple[Path, Path]
) -> None:
    fifo, elsewhere = outside
    cache = tmp_path / "state" / "uv-cache-20261201T000000Z-1"
    (cache / "a" / "b").mkdir(parents=True)
    (cache / "a" / "b" / "file").write_text("x\n")
    os.mkfifo(cache / "a" / "fifo")
    (cache / "a" / "to-fifo").symlink_to(fifo)
    (cache / "a" / "b" / "to-dir").symlink_to(elsewhere)
    (cache / "to-fifo-dir").symlink_to(fifo, target_is_directory=True)

    ended, failure = in_thread(lambda: remove_run_dir(cache), [fifo, cache / "a" / "fifo"])

    assert ended and failure is None, failure
    assert not cache.exists() and os.listdir(cache.parent) == []
    assert fifo.is_fifo() and (elsewhere / "keep.txt").read_text() == "keep\n"


def test_a_directory_swapped_for_a_symlink_to_a_fifo_after_the_listing_is_never_opened(
    tmp_path: Path, outside: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The race of the review, made deterministic: ``sub`` is a directory when listed and a symlink
    to a FIFO when the remover acts on it. It is unlinked; the FIFO is never opened (every open of
    ``sub`` refuses symlinks and never blocks)."""
    fifo, _ = outside
    tree_dir = tmp_path / "tree"
    (tree_dir / "d" / "sub").mkdir(parents=True)
    (tree_dir / "d" / "sub" / "f").write_text("x\n")
    moved = tmp_path / "moved"

    def swap() -> None:
        (tree_dir / "d" / "sub").rename(moved)
        (tree_dir / "d" / "sub").symlink_to(fifo)

    opens: list[tuple[str, int]] = []
    with Tree(tree_dir) as tree:
        swap_after_listing(monkeypatch, {"sub": swap})
        _recording.append(opens)
        try:
            ended, failure = in_thread(lambda: tree.remove_tree("d"), [fifo])
        finally:
            _recording.remove(opens)

    assert ended, "root blocked opening the FIFO behind the swapped-in symlink"
    assert failure is None, failure
    assert not (tree_dir / "d").exists() and os.listdir(tree_dir) == []
    assert fifo.is_fifo() and (moved / "f").read_text() == "x\n"  # the moved directory is not in the tree
    sub_opens = [flags for name, flags in opens if name == "sub"]
    assert sub_opens and all(flags & os.O_NOFOLLOW and flags & os.O_NONBLOCK for flags in sub_opens)


def test_entries_that_change_kind_or_appear_after_the_listing_are_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file that became a directory (``EISDIR``), a directory that became a file, and a file that
    appeared after its directory was listed (``ENOTEMPTY``): each is tried the other way, or listed
    again, instead of aborting the delete."""
    top = tmp_path / "top"
    (top / "was-dir").mkdir(parents=True)
    (top / "was-file").write_text("x\n")
    (top / "grows").mkdir()
    (top / "grows" / "first").write_text("x\n")

    def to_dir() -> None:
        (top / "was-file").unlink()
        (top / "was-file" / "inner").mkdir(parents=True)
        (top / "was-file" / "inner" / "f").write_text("y\n")

    def to_file() -> None:
        (top / "was-dir").rmdir()
        (top / "was-dir").write_text("z\n")

    def late() -> None:
        (top / "grows" / "late").write_text("late\n")

    swap_after_listing(monkeypatch, {"was-file": to_dir, "was-dir": to_file, "first": late})
    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert remove_at(fd, "top") is True
        assert remove_at(fd, "top") is False  # not there any more
    finally:
        os.close(fd)
    assert not top.exists()


def _chain(parent: Path, name: str, depth: int) -> None:
    """``parent/name/name/...``, ``depth`` directories deep (made by descriptor: no path is that long)."""
    fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir(name, dir_fd=fd)
            child = os.open(name, os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = child
        os.close(os.open("leaf", os.O_WRONLY | os.O_CREAT, 0o600, dir_fd=fd))
    finally:
        os.close(fd)


def test_a_tree_too_deep_is_refused_with_an_oserror_and_a_deep_one_is_removed(tmp_path: Path) -> None:
    """No recursion: deeper than Python's recursion limit is removed; deeper than MAX_REMOVE_DEPTH is
    refused with an OSError (never a RecursionError), the rest of the tree left as it was."""
    _chain(tmp_path, "d", MAX_REMOVE_DEPTH + 1)
    root = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        with pytest.raises(OSError) as refused:
            remove_at(root, "d")
        assert refused.value.errno == errno.ELOOP
        assert (tmp_path / "d").is_dir()
        # cut the chain in two, each within the limit and deeper than the recursion limit: both go
        half = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        for _ in range(MAX_REMOVE_DEPTH // 2):
            child = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=half)
            os.close(half)
            half = child
        try:
            os.rename("d", "lower", src_dir_fd=half, dst_dir_fd=root)
        finally:
            os.close(half)
        assert remove_at(root, "d") and remove_at(root, "lower")
    finally:
        os.close(root)
        if os.listdir(tmp_path):  # a failure above: pytest's own cleanup recurses, rm does not
            leftover = [str(tmp_path / name) for name in os.listdir(tmp_path)]
            subprocess.run(["rm", "-rf", "--", *leftover], check=False)
            raise AssertionError(f"left in {tmp_path}: {leftover}")


def test_a_file_written_over_a_directory_removes_it_by_descriptor(
    tmp_path: Path, outside: tuple[Path, Path]
) -> None:
    """A restore that writes a file where a directory now is (the owner made one) removes that
    directory as above: a symlink to a FIFO in it is unlinked, never opened."""
    fifo, _ = outside
    (tmp_path / "tree" / "name" / "sub").mkdir(parents=True)
    (tmp_path / "tree" / "name" / "sub" / "to-fifo").symlink_to(fifo)
    source = tmp_path / "source"
    source.write_text("content\n")
    fd = os.open(source, os.O_RDONLY)
    try:
        with Tree(tmp_path / "tree") as tree:
            ended, failure = in_thread(lambda: tree.write_from("name", fd, 0o644), [fifo])
    finally:
        os.close(fd)
    assert ended and failure is None, failure
    assert (tmp_path / "tree" / "name").read_text() == "content\n" and fifo.is_fifo()


def test_a_mount_point_below_is_never_emptied(tmp_path: Path) -> None:
    """``rm -r`` by descriptor stops at a mount point (a bind mount of another directory, on the same
    device): EXDEV, and what the mounted filesystem holds is left whole."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "precious").write_text("not the tree's\n")
    tree = tmp_path / "tree"
    (tree / "sub" / "mounted").mkdir(parents=True)
    (tree / "sub" / "file").write_text("x")
    with bind_mount(elsewhere, tree / "sub" / "mounted"):
        fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            with pytest.raises(OSError) as raised:
                remove_at(fd, "tree")
        finally:
            os.close(fd)
        assert raised.value.errno == errno.EXDEV
        assert (elsewhere / "precious").read_text() == "not the tree's\n"
