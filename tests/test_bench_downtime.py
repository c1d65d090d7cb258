"""``bench/downtime.py``'s order of contenders (issue 34): with the old build as a third contender every
contender goes first as often as the others, and in a switch case switches as often each way."""

from __future__ import annotations

import importlib.util
import sys
from collections import Counter
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_downtime", ROOT / "bench" / "downtime.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_three_contenders_go_first_equally_and_switch_each_way_once_in_every_two_rounds() -> None:
    bench = _bench()
    contenders = (bench.HAND, bench.NEW, bench.OLD)
    orders = [bench.round_order(contenders, round_) for round_ in range(6)]
    assert all(sorted(order) == sorted(contenders) for order in orders)
    assert Counter(order[0] for order in orders) == dict.fromkeys(contenders, 2)
    installs = [who for order in orders for who in order]  # the n-th install switches to release n % 2
    for pair in range(3):  # rounds 2k and 2k + 1: each contender once to each release
        ways = [(who, n % 2) for n, who in enumerate(installs) if n // 6 == pair]
        assert Counter(ways) == {(who, way): 1 for who in contenders for way in (0, 1)}


def test_two_contenders_alternate_as_before() -> None:
    bench = _bench()
    contenders = (bench.HAND, bench.NEW)
    orders = [bench.round_order(contenders, round_) for round_ in range(4)]
    assert orders == [contenders, contenders[::-1], contenders, contenders[::-1]]


def test_with_prepare_commit_the_commit_gets_the_windows_options_and_the_prepare_the_rest() -> None:
    """``--commit`` refuses every option but the window's (``--keep-backups`` of the vllm case made the
    bench's vllm ``--prepare-commit`` exit 2): those go to ``--prepare``, each with its value."""
    bench = _bench()
    window, rest = bench.split_window(
        ("--keep-backups", "1", "--health-url", "http://127.0.0.1:1/", "--no-smoke", "--settle=2")
    )
    assert window == ("--health-url", "http://127.0.0.1:1/", "--settle=2")
    assert rest == ("--keep-backups", "1", "--no-smoke")
