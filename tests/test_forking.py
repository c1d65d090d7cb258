"""Work shared with forked children: the same result as doing it here, whatever the children do."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from safeinstall.system import forking
from safeinstall.system.forking import can_fork, map_forked, split


def _square_all(share: list[int]) -> list[tuple[int, int, bool]]:
    return [(n, n * n, os.getpid() == PARENT) for n in share]


PARENT = os.getpid()


def test_split_deals_round_robin() -> None:
    assert split([1, 2, 3, 4, 5], 2) == [[1, 3, 5], [2, 4]]
    assert split([1], 3) == [[1], [], []]
    assert split([1, 2], 0) == [[1, 2]]


def test_shares_after_the_first_run_in_children_and_come_back_in_order() -> None:
    shares = split(list(range(20)), 3)
    started: list[bool] = []
    results = map_forked(_square_all, shares, after_fork=lambda: started.append(True))
    assert started == [True]
    assert [[(n, sq) for n, sq, _ in result] for result in results] == [
        [(n, n * n) for n in share] for share in shares
    ]
    assert all(here for _, _, here in results[0])  # the first share: this process
    assert not any(here for result in results[1:] for _, _, here in result)  # the others: children


def test_a_failed_child_is_redone_here(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(forking, "_run_child", lambda *args: os._exit(3))
    shares = split(list(range(10)), 4)
    results = map_forked(_square_all, shares)
    assert [[n for n, _, _ in result] for result in results] == shares
    assert all(here for result in results for _, _, here in result)


def test_an_exception_here_kills_and_reaps_the_children() -> None:
    def work(share: list[int]) -> list[int]:
        if os.getpid() == PARENT:
            raise RuntimeError("interrupted")
        threading.Event().wait(60)  # a child that would run on
        return share

    before = set(os.listdir("/proc"))
    with pytest.raises(RuntimeError, match="interrupted"):
        map_forked(work, [[1], [2], [3]])
    children = {
        pid for pid in set(os.listdir("/proc")) - before if pid.isdigit() and _parent_of(pid) == PARENT
    }
    assert children == set()


def _parent_of(pid: str) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rpartition(")")[2].split()[1])


def test_no_fork_while_another_thread_runs() -> None:
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert not can_fork()
    finally:
        stop.set()
        thread.join()
    assert can_fork()
