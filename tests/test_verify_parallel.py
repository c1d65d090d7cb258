"""Verification on a pool of threads: the files are split into tasks by directory (a large file alone,
small ones in chunks of one directory), costliest first, and every thread opens files. The findings
are those of one thread; a FIFO, a symlink or a directory where a file is listed is reported from the
directory's listing and an ``lstat``, and never opened.

What opens what is seen through an audit hook (``os.open`` raises the ``open`` audit event with the
name it opens), on a real distribution of ~550 files installed by the real uv and drifted by hand.
"""

from __future__ import annotations

import os
import random
import re
import sys
import threading
from pathlib import Path

import pytest

from safeinstall.drift import Expectation
from safeinstall.environment import inspect_environment
from safeinstall.hashing import BIG_FILE, CHUNK_FILES, plan_tasks
from safeinstall.verify import VerifyReport, verify_environment
from tests import wheelhouse


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
    _opens.watch(threads=4)
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
    assert together.observed == alone.observed  # every file's state, hash, size and identity
    assert together.distributions[0].files_checked == alone.distributions[0].files_checked > 503
    for opened in (opened_alone, opened_together):
        names = [name for _thread, name in opened]
        assert not {"f8.py", "g3_4.txt", "g4_0.txt", "outside-fifo", "f7.py"} & set(names)
        assert {"f5.py", "f6.py", "big1.bin", "g3_5.txt"} <= set(names)
    assert len({thread for thread, _name in opened_alone}) == 1
    # the small files themselves are spread over the threads (not only the large ones)
    small_openers = {thread for thread, name in opened_together if _own(name) and not name.startswith("big")}
    assert len(small_openers) == 4


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
    for task in tasks:
        assert len(task.files) <= CHUNK_FILES
        assert len({path.rpartition("/")[0] for path, _name, _algorithm, _size in task.files}) == 1
        assert all(size < BIG_FILE for _path, _name, _algorithm, size in task.files) or len(task.files) == 1
    assert sum(1 for task in tasks if task.files[0][0].startswith("/p/many/f")) == 3
