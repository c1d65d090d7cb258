"""The safe filesystem layer's batches: each directory opened once, and still never a symlink followed.

A backup of torch (12k files in 800 directories) went through :class:`~safeinstall.system.safefs.Tree` one
file at a time, each operation walking every directory from the prefix down again (about 620k
``open`` calls). Inside :meth:`Tree.batch` each thread keeps the directories it walked last. These
tests count the directory opens with an audit hook (``os.open`` raises the ``open`` audit event with
its flags) on real directories, and try the cases a kept descriptor could get wrong: a directory
swapped for a symlink meanwhile, one removed and made again, nested operations, threads.
"""

from __future__ import annotations

import errno
import os
import stat
import sys
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import pytest

from safeinstall.env.distributions import InstalledDistribution, find_distributions
from safeinstall.env.environment import inspect_environment
from safeinstall.store.backup import create_backup
from safeinstall.system.safefs import Tree
from tests import wheelhouse

_counting: list[list[int]] = []  # the counter of the block being counted, when one is


def _audit(event: str, args: tuple[object, ...]) -> None:
    if _counting and event == "open" and isinstance(args[2], int) and args[2] & os.O_DIRECTORY:
        _counting[0][0] += 1


sys.addaudithook(_audit)  # for the whole test process: it only counts while a block asks it to


@contextmanager
def directory_opens() -> Iterator[list[int]]:
    """Counts the ``os.open(..., O_DIRECTORY)`` calls made inside the block (any thread)."""
    counter = [0]
    _counting.append(counter)
    try:
        yield counter
    finally:
        _counting.remove(counter)


def make_files(root: Path, directories: int, files: int) -> list[str]:
    made: list[str] = []
    for d in range(directories):
        directory = root / "pkg" / "sub" / f"d{d}"
        directory.mkdir(parents=True)
        for f in range(files):
            (directory / f"f{f}.py").write_text(f"{d} {f}\n")
            made.append(f"pkg/sub/d{d}/f{f}.py")
    return made


def test_a_batch_opens_each_directory_once(tmp_path: Path) -> None:
    paths = make_files(tmp_path, directories=5, files=40)
    with Tree(tmp_path) as tree:
        with directory_opens() as unbatched:
            for path in paths:
                assert tree.lstat(path) is not None
        with tree.batch(), directory_opens() as batched:
            for path in paths:
                assert tree.lstat(path) is not None
                assert tree.sha256(path) is not None
    assert unbatched[0] == 3 * len(paths)  # pkg, sub, dN: for every file
    assert batched[0] == 2 + 5  # pkg and sub once, each dN once


def test_a_backup_opens_fewer_directories_than_it_saves_files(tmp_path: Path) -> None:
    wheels = wheelhouse.build_all(tmp_path / "wheels")
    python = wheelhouse.make_venv(tmp_path / "venv")
    wheelhouse.uv_install(python, wheels["sipure-1"])
    env = inspect_environment(python)
    installed = find_distributions(env)
    dist: InstalledDistribution = next(d for d in installed if d.name == "sipure")
    package = next(Path(p).parent for p in dist.locations if p.endswith("/sipure/__init__.py"))
    for n in range(200):  # added by hand: saved too (copied, on the backup's threads)
        (package / f"added_{n}.txt").write_text(f"{n}\n")
    with directory_opens() as opened:
        backup = create_backup(env, [dist], tmp_path / "backup", [], installed=installed)
    saved = len(backup.manifest.files)
    assert saved >= len(dist.record.entries) + 200
    # each directory a few times (both sides, the listing, each thread's first walk from its root,
    # each tree's root from "/"), not each component of each file's path on both sides (about 25
    # per file before batches)
    assert opened[0] < saved / 2


def test_a_directory_swapped_for_a_symlink_during_a_batch_is_never_followed(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (root / "a" / "b").mkdir(parents=True)
    (root / "a" / "b" / "f").write_text("inside\n")
    outside.mkdir()
    with Tree(root) as tree, tree.batch():
        assert tree.lstat("a/b/f") is not None  # the batch now holds a and a/b
        (root / "a" / "b").rename(root / "a" / "moved")
        (root / "a" / "b").symlink_to(outside)
        # the kept descriptor is the real directory (moved, still below the root), not the link
        fd = os.open(__file__, os.O_RDONLY)
        try:
            tree.write_from("a/b/g", fd, 0o644)
        finally:
            os.close(fd)
        tree.unlink("a/b/f")
    assert sorted(os.listdir(outside)) == []
    assert sorted(os.listdir(root / "a" / "moved")) == ["g"]
    with Tree(root) as tree, tree.batch():  # a new batch walks again: the link is "not there"
        assert tree.lstat("a/b/g") is None
        assert tree.sha256("a/b/g") is None


def test_a_directory_removed_and_made_again_in_a_batch_is_walked_again(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    (tmp_path / "a" / "b" / "old").write_text("old\n")
    source = tmp_path / "source"
    source.write_text("new\n")
    with Tree(tmp_path) as tree, tree.batch():
        assert tree.lstat("a/b/old") is not None
        assert tree.remove_tree("a/b")
        tree.make_dir("a/b", 0o755)
        fd = os.open(source, os.O_RDONLY)
        try:
            tree.write_from("a/b/new", fd, 0o644)
        finally:
            os.close(fd)
    assert (tmp_path / "a" / "b" / "new").read_text() == "new\n"


def test_nested_operations_and_threads_in_a_batch(tmp_path: Path) -> None:
    paths = make_files(tmp_path, directories=4, files=25)
    with Tree(tmp_path) as tree, tree.batch():
        with tree.parent(paths[0]) as (fd, name):
            before = os.fstat(fd)
            assert tree.lstat(paths[-1]) is not None  # another directory, while this one is in use
            assert os.fstat(fd).st_ino == before.st_ino
            assert os.stat(name, dir_fd=fd).st_size > 0
        with ThreadPoolExecutor(max_workers=4) as pool:
            digests = list(pool.map(tree.sha256, paths * 3))
    with Tree(tmp_path) as tree:
        assert digests == [tree.sha256(p) for p in paths * 3]


def test_a_file_that_grows_while_it_is_copied_is_refused_before_more_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A backup copies a file of the environment (across filesystems): its owner can watch root open
    it and make it terabytes long. The copy stops one byte past the size ``fstat`` gave and fails."""
    source = tmp_path / "grows.bin"
    source.write_bytes(b"x" * 5000)
    real_fstat = os.fstat

    def fstat_then_grow(fd: int) -> os.stat_result:
        info = real_fstat(fd)
        if stat.S_ISREG(info.st_mode) and info.st_size == 5000:
            with source.open("r+b") as handle:
                handle.truncate(64 << 20)
        return info

    (tmp_path / "dest").mkdir()
    fd = os.open(source, os.O_RDONLY)
    try:
        monkeypatch.setattr(os, "fstat", fstat_then_grow)
        with Tree(tmp_path / "dest") as dest, pytest.raises(OSError) as refused:
            dest.write_from("copy.bin", fd, 0o600, atomic=False)
    finally:
        monkeypatch.undo()
        os.close(fd)
    assert refused.value.errno == errno.EFBIG
    assert os.listdir(tmp_path / "dest") == []  # nothing left
