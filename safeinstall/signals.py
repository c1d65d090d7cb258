"""SIGINT/SIGTERM/SIGHUP during a run: the first one interrupts the step in progress (and the run rolls
back); during the rollback they are held back, so the services are never abandoned half-way."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import FrameType

from safeinstall.errors import StepFailed

#: SIGHUP too: a dropped SSH session must roll back like Ctrl-C, not kill the run with the units down.
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(StepFailed):
    """Raised in the main thread when SIGINT, SIGTERM or SIGHUP arrives during a run."""

    code = "interrupted"


Handler = Callable[[int, FrameType | None], object] | int | None


@contextmanager
def interrupts_raise() -> Iterator[None]:
    """SIGINT/SIGTERM/SIGHUP raise :class:`Interrupted` (the caller rolls back)."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(f"interrupted by {signal.Signals(signum).name}")

    with _handlers(handler):
        yield


@contextmanager
def interrupts_deferred(on_signal: Callable[[int], None]) -> Iterator[list[int]]:
    """SIGINT/SIGTERM/SIGHUP are recorded (and announced through ``on_signal``) but do not interrupt."""
    received: list[int] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        received.append(signum)
        on_signal(signum)

    with _handlers(handler):
        yield received


@contextmanager
def _handlers(handler: Callable[[int, FrameType | None], None]) -> Iterator[None]:
    previous: dict[signal.Signals, Handler] = {}
    try:
        for sig in _SIGNALS:
            previous[sig] = signal.signal(sig, handler)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)
