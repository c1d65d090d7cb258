"""Signals during a run: the handler raises where Python happens to be; where that exception is
dropped (a ``__del__`` or a weakref callback run by the garbage collector) or caught by a step, the
step still ends as interrupted when it returns."""

from __future__ import annotations

import contextlib
import gc
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from safeinstall.system.signals import Interrupted, interrupts_raise


class _SignalsWhenCollected:
    def __del__(self) -> None:  # the handler's exception raised here is printed and dropped
        os.kill(os.getpid(), signal.SIGINT)


def _a_step_during_which_the_raise_is_lost() -> str:
    gc.collect()
    _SignalsWhenCollected()
    gc.collect()
    return "done"


def _a_step_that_catches_everything() -> str:
    with contextlib.suppress(Exception):  # a step's own broad except, as a library's may have
        os.kill(os.getpid(), signal.SIGTERM)
    return "done"


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped raise
@pytest.mark.parametrize("action", [_a_step_during_which_the_raise_is_lost, _a_step_that_catches_everything])
def test_a_signal_whose_exception_never_reached_the_run_still_interrupts_the_step(action: object) -> None:
    assert callable(action)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN where the suite was started as a job (``&``)
    with interrupts_raise() as received:
        step = received.checked(action)
        with pytest.raises(Interrupted, match="interrupted by SIG"):
            step()
        assert received.checked(lambda: "next")() == "next"  # one signal interrupts once
    assert signal.getsignal(signal.SIGINT) is before  # the handler in place before is back


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")  # the dropped raise
def test_a_signal_dropped_between_two_steps_keeps_the_next_one_from_starting() -> None:
    ran: list[str] = []
    with interrupts_raise() as received:
        received.checked(lambda: ran.append("gate"))()
        gc.collect()
        _SignalsWhenCollected()  # between the steps: in what the run does between them
        gc.collect()
        with pytest.raises(Interrupted):
            received.checked(lambda: ran.append("stop"))()
    assert ran == ["gate"]


def test_without_a_signal_a_step_returns_what_it_returns() -> None:
    with interrupts_raise() as received:
        assert received.checked(lambda: "ok")() == "ok"


@pytest.mark.parametrize("where", ["fsync", "health"])
def test_a_signal_as_a_thread_starts_is_raised_once_it_started_never_inside_thread_start(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: str
) -> None:
    """A run killed as its fsync threads started printed a traceback ("Exception ignored in thread
    started by ... KeyError", the soak): the raise landed inside ``Thread.start``, after the thread
    began and before Python knew it. Each start now holds the signals: the interruption comes after."""
    import threading

    from safeinstall.store import backup
    from safeinstall.system import health, signals
    from safeinstall.system.safefs import Tree

    escaped: list[BaseException] = []
    ended = threading.Semaphore(0)
    started: list[int] = []
    real = threading._start_new_thread  # type: ignore[attr-defined]

    def start_then_signal(function: Any, args: Any, *rest: Any) -> Any:
        def tracked(*given: Any) -> None:
            try:
                function(*given)
            except BaseException as exc:  # what would be "Exception ignored in thread started by"
                escaped.append(exc)
            finally:
                ended.release()

        ident = real(tracked, args, *rest)
        started.append(ident)
        os.kill(os.getpid(), signal.SIGINT)  # delivered here, where the raise used to land
        return ident

    for n in range(3):
        (tmp_path / f"d{n}").mkdir()
    monkeypatch.setattr(threading, "_start_new_thread", start_then_signal)
    with pytest.raises(signals.Interrupted), signals.interrupts_raise():
        if where == "health":
            health.wait_healthy("http://127.0.0.1:9/", 5)
        with Tree(tmp_path) as tree:
            backup.fsync_dirs(tree, ["d0", "d1", "d2"])
    monkeypatch.undo()
    assert started, "no thread started"
    for _ in started:
        assert ended.acquire(timeout=60), "a thread never ended"
    assert escaped == [], escaped
