"""Verification with helper threads: the files are split into tasks by directory (a large file alone,
small ones in chunks of one directory); the large files go to helper threads, the small ones stay on
the calling thread (two threads trading the GIL at every system call went slower than one). The
findings are those of one thread; a FIFO, a symlink or a directory where a file is listed is reported from the
directory's listing and an ``lstat``, and never opened.

What opens what is seen through an audit hook (``os.open`` raises the ``open`` audit event with the
name it opens), on a real distribution of ~550 files installed by the real uv and drifted by hand.
"""

from __future__ import annotations

import ctypes
import gc
import hashlib
import mmap
import os
import random
import re
import shutil
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from safeinstall.env import distributions
from safeinstall.env.distributions import InstalledDistribution, MetadataReader
from safeinstall.env.drift import Expectation
from safeinstall.env.environment import inspect_environment
from safeinstall.env.hashing import (
    BIG_FILE,
    CHUNK_FILES,
    LARGEST_FILE,
    STREAM_CHUNK,
    FileState,
    _observe,
    observe_files,
    plan_tasks,
    read_buffer,
)
from safeinstall.env.records import encode_digest
from safeinstall.env.verify import VerifyReport, verify_environment
from tests import wheelhouse
from tests.wheelhouse import Wheelhouse


class _Opens:
    """The files (not directories) opened while watching: (thread, name as passed to ``os.open``).
    With ``threads`` set, a thread's first open of one of the package's own files waits (up to 30 s)
    until that many threads have each opened one: which threads take part is then certain, not a
    matter of scheduling."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, str]] = []
        self.watching = False
        self.threads = 0
        self._together = threading.Event()
        self._lock = threading.Lock()

    def __call__(self, event: str, args: tuple[object, ...]) -> None:
        if not self.watching or event != "open" or not isinstance(args[0], str):
            return
        if isinstance(args[2], int) and args[2] & os.O_DIRECTORY:
            return
        me, name = threading.get_ident(), os.path.basename(args[0])
        with self._lock:
            first = all(thread != me or not _own(seen) for thread, seen in self.seen)
            self.seen.append((me, name))
            if len({thread for thread, seen in self.seen if _own(seen)}) >= self.threads:
                self._together.set()
        if first and _own(name) and self.threads > 1:
            self._together.wait(timeout=30)

    def watch(self, threads: int = 0) -> None:
        self.seen, self.threads, self.watching = [], threads, True
        self._together.clear()

    def stop(self) -> list[tuple[int, str]]:
        self.watching = False
        return self.seen


def _states(observed: Mapping[str, FileState]) -> dict[str, FileState]:
    """Every file's state, hash, size and identity; not when it was hashed (``hashed_ns``: the clock)."""
    return {path: state._replace(hashed_ns=0) for path, state in observed.items()}


def _opened(name: str) -> bool:
    return any(seen == name for _thread, seen in _opens.seen)


def _own(name: str) -> bool:
    """One of sibulk's own files (its metadata is read before the verification starts)."""
    return re.fullmatch(r"f\d+\.py|g\d+_\d+\.txt|big\d\.bin", name) is not None


_opens = _Opens()
sys.addaudithook(_opens)  # for the whole test process: it only records while a test watches


def _content(rng: random.Random, size: int) -> bytes:
    return rng.randbytes(size)


@pytest.fixture
def bulky(venv: Path, tmp_path: Path) -> tuple[Path, Path]:
    """``sibulk``: 300 files in one directory (three chunks), 200 in 20 directories of 10, two large
    files; installed by uv (copied); returns (python, its package directory)."""
    rng = random.Random(10)
    files = {"sibulk/__init__.py": b""}
    files |= {f"sibulk/many/f{i}.py": _content(rng, rng.choice((40, 900, 3000))) for i in range(300)}
    files["sibulk/many/f6.py"] = _content(rng, 3000)
    files |= {f"sibulk/d{j}/g{j}_{k}.txt": _content(rng, 100 + 37 * k) for j in range(20) for k in range(10)}
    files["sibulk/blob/big0.bin"] = _content(rng, BIG_FILE + 4096)
    files["sibulk/blob/big1.bin"] = _content(rng, 3 * BIG_FILE)
    wheel = wheelhouse.make_wheel(tmp_path, "sibulk", "1.0", files)
    wheelhouse.uv_install(venv, wheel)
    return venv, wheelhouse.site_packages(venv) / "sibulk"


def _drift(package: Path, outside: Path) -> None:
    many = package / "many"
    data = bytearray((many / "f5.py").read_bytes())
    data[0] ^= 1
    (many / "f5.py").write_bytes(bytes(data))  # same size, other content
    with (many / "f6.py").open("ab") as handle:
        handle.write(b"# patched\n")
    (many / "f7.py").unlink()
    (many / "f8.py").unlink()
    os.mkfifo(many / "f8.py")  # opening it for reading would wake a writer; reading would block
    os.mkfifo(outside)
    (package / "d3" / "g3_4.txt").unlink()
    (package / "d3" / "g3_4.txt").symlink_to(outside)  # followed, it would open the FIFO outside
    (package / "d4" / "g4_0.txt").unlink()
    (package / "d4" / "g4_0.txt").mkdir()
    (many / "added.py").write_text("")
    big = bytearray((package / "blob" / "big1.bin").read_bytes())
    big[len(big) // 2] ^= 1
    (package / "blob" / "big1.bin").write_bytes(bytes(big))


def _summary(report: VerifyReport) -> list[tuple[str, str, str]]:
    return [(f.kind.value, f.path.rpartition("sibulk/")[2], f.detail) for f in report.findings]


def test_parallel_verification_finds_what_one_thread_finds_and_opens_no_fifo_or_symlink(
    bulky: tuple[Path, Path], tmp_path: Path
) -> None:
    python, package = bulky
    _drift(package, tmp_path / "outside-fifo")
    env = inspect_environment(python)

    _opens.watch()
    alone = verify_environment(env, ["sibulk"], workers=1)
    opened_alone = _opens.stop()
    _opens.watch(threads=3)  # the calling thread and one helper for each of the two large files
    together = verify_environment(env, ["sibulk"], workers=4)
    opened_together = _opens.stop()

    assert (
        _summary(together)
        == _summary(alone)
        == [
            ("modified", "blob/big1.bin", "sha256 differs"),
            ("modified", "d3/g3_4.txt", "no longer a regular file"),
            ("modified", "d4/g4_0.txt", "no longer a regular file"),
            ("extra", "many/added.py", "in the distribution's directories but in no RECORD"),
            ("modified", "many/f5.py", "sha256 differs"),
            ("modified", "many/f6.py", "size 3010, expected 3000"),
            ("missing", "many/f7.py", "listed but not installed"),
            ("modified", "many/f8.py", "no longer a regular file"),
        ]
    )
    assert together.findings == alone.findings
    assert _states(together.observed) == _states(alone.observed)
    assert all(v.hashed_ns for v in together.observed.values() if v.digest is not None)
    assert together.distributions[0].files_checked == alone.distributions[0].files_checked > 503
    for opened in (opened_alone, opened_together):
        names = [name for _thread, name in opened]
        assert not {"f8.py", "g3_4.txt", "g4_0.txt", "outside-fifo", "f7.py"} & set(names)
        assert {"f5.py", "f6.py", "big1.bin", "g3_5.txt"} <= set(names)
    assert len({thread for thread, _name in opened_alone}) == 1
    # the large files are hashed by two helpers, the small ones by the calling thread alone
    me = threading.get_ident()
    small_openers = {thread for thread, name in opened_together if _own(name) and not name.startswith("big")}
    large_openers = [thread for thread, name in opened_together if name.startswith("big")]
    assert small_openers == {me}
    assert len(set(large_openers)) == 2 and me not in large_openers


def test_tasks_are_costliest_first_one_directory_each_and_cover_every_file_once() -> None:
    wanted = [Expectation(f"/p/many/f{i}.py", "sha256", None, 1000) for i in range(CHUNK_FILES * 2 + 5)]
    wanted += [Expectation(f"/p/d{j}/g{k}", "sha256", None, 10) for j in range(3) for k in range(3)]
    wanted += [Expectation("/p/many/big.so", "sha256", None, 50 * BIG_FILE)]
    wanted += [Expectation("/p/d1/mid.so", "sha256", None, 4 * BIG_FILE)]
    wanted += [Expectation("relative/x.py", None, None, None)]
    tasks = plan_tasks(wanted)
    files = [file for task in tasks for file in task.files]
    assert sorted(f[0] for f in files) == sorted(w.location for w in wanted)
    assert [task.cost for task in tasks] == sorted((task.cost for task in tasks), reverse=True)
    assert [f[0] for f in tasks[0].files] == ["/p/many/big.so"]
    assert [f[0] for f in tasks[1].files] == ["/p/d1/mid.so"]
    assert [task.large for task in tasks] == [True, True] + [False] * (len(tasks) - 2)
    for task in tasks:
        assert len(task.files) <= CHUNK_FILES
        assert len({path.rpartition("/")[0] for path, _name, _algorithm, _size in task.files}) == 1
        assert all(size < BIG_FILE for _path, _name, _algorithm, size in task.files) or len(task.files) == 1
    assert sum(1 for task in tasks if task.files[0][0].startswith("/p/many/f")) == 3


def test_the_named_distribution_is_read_first_and_the_others_while_large_files_hash(
    bulky: tuple[Path, Path], wheels: Wheelhouse, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``--verify-only PKG`` reads PKG's RECORD, starts its large files on helper threads, and reads
    the other RECORDs (which only say what is extra) on this thread meanwhile: the same report as a
    verification of distributions read beforehand, every RECORD read once."""
    python, _package = bulky
    wheelhouse.uv_install(python, wheels["sipure-1"], wheels["sicext-1"])
    env = inspect_environment(python)
    read: list[str] = []
    hashing_meanwhile: list[bool] = []
    real = distributions.load_distribution

    def counting(dist_info: Path, reader: MetadataReader | None = None) -> InstalledDistribution | None:
        read.append(dist_info.name)
        if not dist_info.name.startswith("sibulk"):  # waits (up to 30 s) for a helper to open big1.bin
            deadline = time.monotonic() + 30
            while (
                not any(name == "big1.bin" for _thread, name in _opens.seen) and time.monotonic() < deadline
            ):
                time.sleep(0.01)
            hashing_meanwhile.append(any(name == "big1.bin" for _thread, name in _opens.seen))
        return real(dist_info, reader)

    beforehand = verify_environment(env, ["sibulk"], installed=distributions.find_distributions(env))
    monkeypatch.setattr(distributions, "load_distribution", counting)
    _opens.watch()
    try:
        named_first = verify_environment(env, ["sibulk"], workers=2)
    finally:
        _opens.stop()
    assert named_first.findings == beforehand.findings
    assert _states(named_first.observed) == _states(beforehand.observed)
    assert read[0].startswith("sibulk-") and len(read) == len(set(read)) > 1
    assert hashing_meanwhile == [True, True]  # sicext and sipure read while big1.bin hashes


def test_a_directory_swapped_for_a_symlink_after_the_check_is_not_read(
    bulky: tuple[Path, Path], wheels: Wheelhouse, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The owner swaps a package directory for a symlink to a root-only directory between the
    containment check (when the plan is made) and the reading of its small files (after the other
    RECORDs are read, which the owner can make slow): its files are reported, never read there."""
    python, package = bulky
    wheelhouse.uv_install(python, wheels["sipure-1"])
    env = inspect_environment(python)
    secret_dir = tmp_path / "root-only" / "d3"
    secret_dir.mkdir(parents=True)
    secret = b"root's secret\n"
    for name in os.listdir(package / "d3"):
        (secret_dir / name).write_bytes(secret)
    real = distributions.load_distribution

    def swapping(dist_info: Path, reader: MetadataReader | None = None) -> InstalledDistribution | None:
        # while the others are read: after sibulk's plan, before d3's files are read
        if not dist_info.name.startswith("sibulk") and not (package / "d3").is_symlink():
            shutil.rmtree(package / "d3")
            (package / "d3").symlink_to(secret_dir, target_is_directory=True)
        return real(dist_info, reader)

    monkeypatch.setattr(distributions, "load_distribution", swapping)
    report = verify_environment(env, ["sibulk"], workers=1)
    secret_digest = encode_digest(hashlib.sha256(secret).digest())
    assert (package / "d3").is_symlink()
    assert not [s for s in report.observed.values() if s.digest == secret_digest]
    d3 = [f for f in report.findings if "/d3/" in f.path]
    assert len(d3) == 10 and {f.kind.value for f in d3} == {"unreadable"}
    assert all(f"resolves to {secret_dir}" in f.detail for f in d3)


def test_a_distribution_found_under_another_directory_name_is_verified_as_a_full_scan_finds_it(
    bulky: tuple[Path, Path],
) -> None:
    """A ``.dist-info`` directory named otherwise but whose METADATA names the package, earlier in the
    scan: a full scan takes it, so the verification does too (not the one found by its name first)."""
    python, package = bulky
    decoy = package.parent / "aaa_other-1.0.dist-info"
    decoy.mkdir()
    (decoy / "METADATA").write_text("Metadata-Version: 2.1\nName: sibulk\nVersion: 9.0\n")
    (decoy / "RECORD").write_text("sibulk/__init__.py,sha256=AAAA,3\n")
    env = inspect_environment(python)
    usual = verify_environment(env, ["sibulk"], installed=distributions.find_distributions(env))
    named_first = verify_environment(env, ["sibulk"], workers=2)
    assert usual.distributions[0].version == named_first.distributions[0].version == "9.0"
    assert named_first.findings == usual.findings and _states(named_first.observed) == _states(usual.observed)


@pytest.mark.parametrize("size", [3000, BIG_FILE + 4096])  # read whole; streamed
@pytest.mark.parametrize("change", ["shrinks", "grows"])
def test_a_file_that_changes_between_its_stat_and_its_read_is_hashed_as_it_was_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str, size: int
) -> None:
    """Every file is read into the thread's buffer: what a file that shrank after its ``fstat`` leaves
    there of an earlier file is never hashed, and one that grew hashes as changed: one byte past the
    size ``fstat`` said is read, never only that size, and never more (its owner can watch root open it
    and make it terabytes long: root would hash zeros for hours)."""
    original = (b"0123456789" * (size // 10 + 1))[:size]
    path = tmp_path / "f.py"
    path.write_bytes(original)
    real_fstat = os.fstat

    def fstat_then_change(fd: int) -> os.stat_result:
        info = real_fstat(fd)
        with path.open("r+b") as handle:
            if change == "shrinks":
                handle.truncate(1000)
            else:
                handle.truncate(size + (64 << 20))  # sparse (an attacker's: a terabyte)
        return info

    buffer = read_buffer()
    buffer[:] = b"B" * STREAM_CHUNK  # what an earlier file left in it
    monkeypatch.setattr(os, "fstat", fstat_then_change)
    state = _observe(str(path), str(path), None, "sha256", None, buffer)
    monkeypatch.undo()
    assert state.size == len(original)  # as fstat said
    with path.open("rb") as handle:
        read = handle.read(len(original) + 1)  # one byte past fstat's size (all of a shrunk one)
    assert state.digest == encode_digest(hashlib.sha256(read).digest())
    assert state.digest != encode_digest(hashlib.sha256(original).digest())


@pytest.mark.parametrize("enabled_before", [True, False])
def test_the_cycle_collector_is_paused_while_verifying_and_left_as_it_was(
    bulky: tuple[Path, Path], enabled_before: bool
) -> None:
    """A collection after every allocation (threshold 1) would run at every step of this verification;
    none runs while this thread observes files, and the collector is left as the caller had it, after an
    error (here: in the progress callback) too. (A helper may finish a large file while this thread
    still reads the other distributions, collector on: those steps are not counted.)"""
    python, _package = bulky
    env = inspect_environment(python)
    collections: list[int] = []
    seen: list[tuple[bool, int]] = []  # at each progress step: (collector enabled, collections so far)

    def count(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collections.append(info["generation"])

    def fail(done: int, total: int) -> None:
        if threading.current_thread() is threading.main_thread():  # where a signal's exception comes
            raise KeyboardInterrupt

    threshold = gc.get_threshold()
    (gc.enable if enabled_before else gc.disable)()
    gc.set_threshold(1)
    gc.callbacks.append(count)
    try:
        report = verify_environment(
            env,
            ["sibulk"],
            workers=2,
            on_progress=lambda done, total: (
                seen.append((gc.isenabled(), len(collections)))
                if threading.current_thread() is threading.main_thread()
                else None
            ),
        )
        enabled_after = gc.isenabled()
        with pytest.raises(KeyboardInterrupt):
            verify_environment(env, ["sibulk"], workers=2, on_progress=fail)
        enabled_after_error = gc.isenabled()
    finally:
        gc.callbacks.remove(count)
        gc.set_threshold(*threshold)
        gc.enable()
    assert report.distributions[0].files_checked > 500 and not report.drift and len(seen) > 5
    assert {enabled for enabled, _ in seen} == {False} and len({n for _, n in seen}) == 1
    assert enabled_after == enabled_after_error == enabled_before


def test_reading_many_distributions_leaves_no_cycles(bulky: tuple[Path, Path]) -> None:
    """Parts of a verification run with the cycle collector paused, so reading distributions must make
    no cycles: configparser's objects for each entry_points.txt did, and 30 distributions whose
    entry_points.txt were hardlinks to one 4 MiB file kept root's memory at 479 MB (82 MB before)."""
    python, package = bulky
    entry_points = "[console_scripts]\n" + "".join(f"tool{i} = sibulk:main\n" for i in range(200))
    for n in range(30):
        info = package.parent / f"decoy{n}-1.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: decoy{n}\nVersion: 1.0\n")
        (info / "RECORD").write_text(f"decoy{n}/x.py,,\n")
        (info / "entry_points.txt").write_text(entry_points)
    env = inspect_environment(python)
    assert distributions.find_distributions(env)[0].console_scripts  # read as scripts
    gc.collect()
    gc.disable()
    try:
        verify_environment(env, ["sibulk"], workers=2)
        distributions.find_distributions(env)
        left = gc.collect()
    finally:
        gc.enable()
    assert left == 0


def _present_pages(start: int, size: int) -> int:
    """How many of the pages from ``start`` for ``size`` bytes are in memory: their "present" bit
    (63) in ``/proc/self/pagemap``, which any process may read of its own pages (smaps would count
    a neighbouring mapping the kernel merged with this one)."""
    first, count = start // mmap.PAGESIZE, size // mmap.PAGESIZE
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        data = pagemap.read(count * 8)
    entries = [int.from_bytes(data[i : i + 8], "little") for i in range(0, len(data), 8)]
    return sum(entry >> 63 for entry in entries)


def test_files_are_read_into_a_private_buffer_that_starts_on_a_page() -> None:
    """The kernel copies every read from the page cache into this buffer: into one 16 bytes past a page
    boundary (where malloc puts a large bytearray's data) that copy ran 4-5x slower on AMD EPYC. A
    private mapping: what a forked child writes into it stays the child's. Its pages are there before
    the first read (made in one call, not at a page fault each)."""
    buffer = read_buffer()
    assert len(buffer) == STREAM_CHUNK and not buffer.readonly
    start = ctypes.addressof(ctypes.c_char.from_buffer(buffer))
    assert start % mmap.PAGESIZE == 0
    assert _present_pages(start, STREAM_CHUNK) == STREAM_CHUNK // mmap.PAGESIZE
    buffer[:4] = b"AAAA"
    child = os.fork()
    if child == 0:
        buffer[:4] = b"BBBB"
        os._exit(0)
    os.waitpid(child, 0)
    assert bytes(buffer[:4]) == b"AAAA"


def test_a_file_larger_than_any_wheel_may_install_is_reported_not_hashed(tmp_path: Path) -> None:
    """The owner makes an installed file a sparse file of more than 16 GiB (listed so in RECORD): root
    would hash zeros for minutes; it is reported unreadable instead, at once."""
    path = tmp_path / "huge.so"
    with path.open("wb") as handle:
        handle.truncate(LARGEST_FILE + 1)
    state = observe_files([Expectation(str(path), "sha256", "x", LARGEST_FILE + 1)])[str(path)]
    assert state.exists and state.digest is None
    assert state.error == f"{LARGEST_FILE + 1} bytes: larger than any wheel may install"


def _big_files(directory: Path, count: int) -> list[Expectation]:
    """``count`` files of ``BIG_FILE`` random bytes (each a task of its own), to be hashed."""
    content = os.urandom(BIG_FILE)
    wanted = []
    for n in range(count):
        path = directory / f"big{n}.bin"
        path.write_bytes(content)
        wanted.append(Expectation(str(path), "sha256", None, BIG_FILE))
    return wanted


class _Stop(Exception):
    """What a test's progress callback raises."""


def test_an_exception_on_the_calling_thread_stops_the_helpers(tmp_path: Path) -> None:
    """A Ctrl-C (here: an error in the progress callback) on the calling thread, outside a task: the
    helpers take no more files; they do not hash every large file left before the error is raised."""
    wanted = _big_files(tmp_path, 200)

    def on_progress(_done: int) -> None:
        if threading.current_thread() is threading.main_thread():
            raise _Stop

    _opens.watch()
    try:
        with pytest.raises(_Stop):
            observe_files(wanted, workers=2, on_progress=on_progress)
    finally:
        opened = _opens.stop()
    assert len([name for _thread, name in opened if name.startswith("big")]) < len(wanted)


def test_an_exception_of_the_progress_callback_on_a_helper_is_raised_on_the_calling_thread(
    tmp_path: Path,
) -> None:
    """What the progress callback raises on a helper thread is the caller's to see, as on its own
    thread: raised by observe_files once the helpers have stopped, not printed by the thread as a
    traceback and lost (the verification then reported as if nothing had happened)."""
    wanted = _big_files(tmp_path, 8)
    helper_reported = threading.Event()
    calling = threading.current_thread()

    def on_progress(_done: int) -> None:
        if threading.current_thread() is not calling:
            helper_reported.set()
            raise _Stop

    seen: list[threading.ExceptHookArgs] = []
    previous, threading.excepthook = threading.excepthook, seen.append
    try:
        with pytest.raises(_Stop):  # this thread waits (meanwhile) until a helper has done a file
            observe_files(
                wanted, workers=2, on_progress=on_progress, meanwhile=lambda: helper_reported.wait(30)
            )
    finally:
        threading.excepthook = previous
    assert seen == []


def test_a_file_state_has_each_field_where_its_name_says(tmp_path: Path) -> None:
    """A file's state is built from a plain tuple (records.built, for speed): every field by name is
    what stat and sha256 say, none swapped."""
    path = tmp_path / "f.py"
    path.write_bytes(b"print('x')\n")
    os.link(path, tmp_path / "twin.py")
    info = os.stat(path)
    started = time.time_ns()
    state = observe_files([Expectation(str(path), "sha256", None, info.st_size)])[str(path)]
    assert started <= state.hashed_ns <= time.time_ns()  # the clock before its fstat, read and unmoved
    assert type(state) is FileState and state._replace(hashed_ns=0)._asdict() == {
        "path": str(path),
        "exists": True,
        "is_file": True,
        "size": info.st_size,
        "digest": encode_digest(hashlib.sha256(b"print('x')\n").digest()),
        "algorithm": "sha256",
        "nlink": 2,
        "device": info.st_dev,
        "inode": info.st_ino,
        "error": None,
        "mtime_ns": info.st_mtime_ns,
        "ctime_ns": info.st_ctime_ns,
        "by_identity": False,
        "hashed_ns": 0,
        "mode": info.st_mode,
        "uid": info.st_uid,
    }
    # taken on its identity (safeinstall.env.inodes): the same fields from the lstat, the digest given
    proven = observe_files(
        [Expectation(str(path), "sha256", None, info.st_size)], known=lambda _info, _algorithm: "D"
    )[str(path)]
    assert proven._asdict() == {**state._asdict(), "digest": "D", "by_identity": True, "hashed_ns": 0}


def test_a_ctrl_c_while_waiting_for_the_helpers_is_raised_once_they_have_ended(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C while the calling thread waits for a helper still hashing a large file: the helper
    takes no further file and its directory's descriptor stays open until it has ended (closed under
    it, the number could be reused by the next open and the helper would open a name relative to
    another directory); then the Ctrl-C is raised, and no helper is left running."""
    huge = tmp_path / "huge.bin"
    with huge.open("wb") as handle:
        handle.truncate(512 << 20)  # sparse: 512 MiB of zeros to hash, a third of a second
    wanted = [Expectation(str(huge), "sha256", None, 512 << 20), *_big_files(tmp_path, 4)]
    real_join = threading.Thread.join
    interrupted: list[bool] = []

    def join(thread: threading.Thread, timeout: float | None = None) -> None:
        if not interrupted:  # the first wait for a helper is interrupted, as by a Ctrl-C
            interrupted.append(thread.is_alive())
            raise KeyboardInterrupt
        real_join(thread, timeout)

    before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(threading.Thread, "join", join)
    with pytest.raises(KeyboardInterrupt):  # the helper starts on the costliest file meanwhile
        observe_files(wanted, workers=2, meanwhile=lambda: time.sleep(0.05))
    monkeypatch.undo()
    assert interrupted == [True]  # the helper was still hashing when the Ctrl-C came
    assert not [t for t in threading.enumerate() if t.name.startswith("hash-")]
    assert set(os.listdir("/proc/self/fd")) <= before


def test_a_second_ctrl_c_while_waiting_for_the_helpers_is_raised_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A helper stuck on a file (a hung network filesystem) must not hold the process: a second Ctrl-C
    while waiting for it is raised at once, and no directory is closed under the helper."""
    huge = tmp_path / "huge.bin"
    with huge.open("wb") as handle:
        handle.truncate(512 << 20)
    wanted = [Expectation(str(huge), "sha256", None, 512 << 20), *_big_files(tmp_path, 4)]
    real_join = threading.Thread.join
    alive: list[bool] = []

    def join(thread: threading.Thread, timeout: float | None = None) -> None:
        if len(alive) < 2:  # two Ctrl-C while waiting
            alive.append(thread.is_alive())
            raise KeyboardInterrupt
        real_join(thread, timeout)

    monkeypatch.setattr(threading.Thread, "join", join)
    with pytest.raises(KeyboardInterrupt):
        observe_files(wanted, workers=2, meanwhile=lambda: time.sleep(0.05))
    still = [t for t in threading.enumerate() if t.name.startswith("hash-")]
    monkeypatch.undo()
    assert alive == [True, True] and still  # raised while the helper still hashed
    for thread in still:
        thread.join()  # it ends after its file, and closes its directory itself
