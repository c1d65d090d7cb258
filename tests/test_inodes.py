"""Verification by identity (safeinstall/env/inodes.py): a file that is a hardlink of a run-cache inode
hashed before the stop, unchanged since, is verified from an lstat; anything else is read and hashed.

Real files on the test's filesystem, the real hashing stage; no timing."""

from __future__ import annotations

import hashlib
import os
import time
from pathlib import Path

from safeinstall.env import inodes
from safeinstall.env.drift import Expectation
from safeinstall.env.hashing import FileState, Known, observe_files
from safeinstall.env.records import encode_digest

CONTENT = b"print('the new version')\n" * 100


def _digest(data: bytes) -> str:
    return encode_digest(hashlib.sha256(data).digest())


def _cache(tmp_path: Path) -> tuple[Path, Path]:
    """A run cache as uv fills it (an unpacked archive), 0700, and the file in it."""
    cache = tmp_path / "uv-cache"
    entry = cache / "archive-v0" / "abc123" / "pkg" / "mod.py"
    entry.parent.mkdir(parents=True)
    cache.chmod(0o700)
    entry.write_bytes(CONTENT)
    entry.chmod(0o644)
    return cache, entry


def _installed(tmp_path: Path, entry: Path, link: bool = True) -> Path:
    """The file as the install puts it in the environment: a hardlink of the cache entry (or a copy)."""
    target = tmp_path / "prefix" / "site-packages" / "pkg" / "mod.py"
    target.parent.mkdir(parents=True)
    if link:
        os.link(entry, target)
    else:
        target.write_bytes(entry.read_bytes())
    return target


def _observe(path: Path, known: Known | None) -> FileState:
    wanted = [Expectation(str(path), "sha256", _digest(CONTENT), len(CONTENT))]
    return observe_files(wanted, workers=1, within=str(path.parent.parent.parent), known=known)[str(path)]


def test_a_link_of_a_hashed_cache_file_is_verified_by_its_identity(tmp_path: Path) -> None:
    cache, entry = _cache(tmp_path)
    hashed = inodes.still_hashed(inodes.hash_cache(cache))
    installed = _installed(tmp_path, entry)
    state = _observe(installed, inodes.checker(hashed, time.time_ns()))
    assert state.by_identity and state.digest == _digest(CONTENT) and state.size == len(CONTENT)
    assert _observe(installed, None).by_identity is False  # without it: read and hashed, same digest
    assert _observe(installed, None).digest == state.digest


def test_a_file_that_is_not_the_hashed_inode_is_read_and_hashed(tmp_path: Path) -> None:
    """A copy with the same bytes, size and even modification time is another inode: it is hashed."""
    cache, entry = _cache(tmp_path)
    hashed = inodes.hash_cache(cache)
    installed = _installed(tmp_path, entry, link=False)
    info = entry.stat()
    os.utime(installed, ns=(info.st_atime_ns, info.st_mtime_ns))
    installed.write_bytes(b"X" + CONTENT[1:])  # tampered, same size
    os.utime(installed, ns=(info.st_atime_ns, info.st_mtime_ns))
    state = _observe(installed, inodes.checker(hashed, time.time_ns()))
    assert not state.by_identity and state.digest == _digest(b"X" + CONTENT[1:]) != _digest(CONTENT)


def test_a_cache_entry_written_after_its_hash_is_read_and_the_change_caught(tmp_path: Path) -> None:
    """Its owner writes the entry after the hash and puts its modification time back: the change time
    moved, so the look before the stop drops it, and its link in the environment is read and hashed."""
    cache, entry = _cache(tmp_path)
    hashed = inodes.hash_cache(cache)
    assert len(hashed) == 1
    info = entry.stat()
    time.sleep(0.02)  # past the filesystem's timestamp granularity (a later tick), not a timed assertion
    with entry.open("r+b") as handle:
        handle.write(b"X")
    os.utime(entry, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert entry.stat().st_mtime_ns == info.st_mtime_ns and entry.stat().st_size == info.st_size
    assert inodes.still_hashed(hashed) == {}
    installed = _installed(tmp_path, entry)
    state = _observe(installed, inodes.checker(inodes.still_hashed(hashed), time.time_ns()))
    assert not state.by_identity and state.digest == _digest(b"X" + CONTENT[1:])


def test_a_hashed_file_rewritten_before_the_install_ended_is_read_again(tmp_path: Path) -> None:
    """Issue 35: the linked inode is written (same size, its modification time left as the write made
    it) after the look before the stop and before the install ended: its change time is under the
    install's end, so only its modification time tells: it is read and hashed, the change caught."""
    cache, entry = _cache(tmp_path)
    hashed = inodes.still_hashed(inodes.hash_cache(cache))
    installed = _installed(tmp_path, entry)
    time.sleep(0.02)  # past the filesystem's timestamp granularity (a later tick), not a timed assertion
    with installed.open("r+b") as handle:
        handle.write(b"Z")
    installed_ns = time.time_ns()  # the install ends after the write
    info = installed.stat()
    assert info.st_ctime_ns <= installed_ns and info.st_size == len(CONTENT)
    state = _observe(installed, inodes.checker(hashed, installed_ns))
    assert not state.by_identity and state.digest == _digest(b"Z" + CONTENT[1:])


def test_an_installed_file_changed_after_the_install_ended_is_read(tmp_path: Path) -> None:
    cache, entry = _cache(tmp_path)
    hashed = inodes.still_hashed(inodes.hash_cache(cache))
    installed = _installed(tmp_path, entry)
    installed_ns = time.time_ns()
    time.sleep(0.02)  # a later timestamp tick than the install's end
    info = installed.stat()
    with installed.open("r+b") as handle:
        handle.write(b"Y")
    os.utime(installed, ns=(info.st_atime_ns, info.st_mtime_ns))
    state = _observe(installed, inodes.checker(hashed, installed_ns))
    assert not state.by_identity and state.digest == _digest(b"Y" + CONTENT[1:])


def test_an_inode_others_may_write_is_never_taken_on_its_identity(tmp_path: Path) -> None:
    cache, entry = _cache(tmp_path)
    entry.chmod(0o664)  # its group may write it
    assert inodes.hash_cache(cache) == {}
    entry.chmod(0o644)
    hashed = inodes.hash_cache(cache)
    installed = _installed(tmp_path, entry)
    installed.chmod(0o666)  # made writable by others after the hash
    state = _observe(installed, inodes.checker(hashed, time.time_ns()))
    assert not state.by_identity and state.digest == _digest(CONTENT)


def test_what_a_symlink_in_the_cache_leads_to_is_never_hashed(tmp_path: Path) -> None:
    cache, entry = _cache(tmp_path)
    outside = tmp_path / "outside.txt"
    outside.write_bytes(CONTENT)
    (entry.parent / "link.py").symlink_to(outside)
    (cache / "archive-v0" / "dirlink").symlink_to(tmp_path, target_is_directory=True)
    hashed = inodes.hash_cache(cache)
    assert [e.path for e in hashed.values()] == [str(entry)]
    assert (outside.stat().st_dev, outside.stat().st_ino) not in hashed
