"""Signals during a run: the handler raises where Python happens to be; where that exception is
dropped (a ``__del__`` or a weakref callback run by the garbage collector) or caught by a step, the
step still ends as interrupted when it returns."""

from __future__ import annotations

import contextlib
import gc
import os
import signal

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
