"""SIGINT/SIGTERM/SIGHUP, one meaning at each point of a run: exit 2 before the journal, an
interruption (and rollback) during the run, held back during the rollback and tidy-up, ignored once
the result is known. docs/crash-safety.md.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from types import FrameType
from typing import TYPE_CHECKING, TypeVar

from safeinstall.errors import Aborted, StepFailed

if TYPE_CHECKING:  # an annotation: the CLI's start loads neither it nor logging
    from concurrent.futures import Executor

#: SIGHUP too: a dropped SSH session must roll back like Ctrl-C, not kill the run with the units down.
_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(StepFailed):
    """Raised in the main thread when SIGINT, SIGTERM or SIGHUP arrives during a run."""

    code = "interrupted"


class InterruptedEarly(Aborted):
    """SIGINT, SIGTERM or SIGHUP before the run's journal exists (or in a command that changes nothing):
    exit 2, nothing was changed."""

    code = "interrupted"


def raise_interrupted_early(signum: int, _frame: FrameType | None) -> None:
    raise InterruptedEarly(
        f"interrupted by {signal.Signals(signum).name}; nothing was changed",
        hint="nothing was stopped or installed; run it again when you are ready",
    )


def install_early_handlers() -> None:
    """SIGINT/SIGTERM/SIGHUP raise :class:`InterruptedEarly` (exit 2) from now on: a Ctrl-C while the CLI
    loads or the preflight runs is an ``error:`` line, not a traceback, a silent 130 or a death by
    SIGTERM. The run puts its own handlers on top once its journal exists."""
    for sig in _SIGNALS:
        signal.signal(sig, raise_interrupted_early)


T = TypeVar("T")
A = TypeVar("A")

Handler = Callable[[int, FrameType | None], object] | int | None


class Received:
    """The signals received under :func:`interrupts_raise`. A raise may land in a ``__del__`` (dropped) or a
    step's ``except Exception``, so every step is :meth:`checked`: none starts after a signal, and one that
    returns after it fails as interrupted."""

    def __init__(self) -> None:
        self.signals: list[int] = []
        self._acted_on = 0

    def check(self) -> None:
        if len(self.signals) > self._acted_on:
            self._acted_on = len(self.signals)
            raise Interrupted(f"interrupted by {signal.Signals(self.signals[-1]).name}")

    def checked(self, action: Callable[[], T]) -> Callable[[], T]:
        def run() -> T:
            self.check()  # one dropped between two steps (in what the run does between them)
            result = action()
            self.check()
            return result

        return run


@contextmanager
def interrupts_raise() -> Iterator[Received]:
    """SIGINT/SIGTERM/SIGHUP raise :class:`Interrupted` (the caller rolls back), and are recorded for
    :meth:`Received.check`."""
    received = Received()

    def handler(signum: int, _frame: FrameType | None) -> None:
        received.signals.append(signum)
        raise Interrupted(f"interrupted by {signal.Signals(signum).name}")

    with _handlers(handler):
        yield received


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


def ignored_until_exit() -> None:
    """SIGINT/SIGTERM/SIGHUP ignored from now until the process exits: a run whose result is out ends
    with that result's exit code. Ignored, not handled: as it exits, CPython puts a signal
    handled by Python back to its default action (a SIGTERM then killed a good run, exit -15) and
    leaves an ignored one ignored; and no handler of an earlier phase comes back."""
    with contextlib.suppress(ValueError):  # not the main thread: leave signals alone
        for sig in _SIGNALS:
            signal.signal(sig, signal.SIG_IGN)


def block() -> set[int | signal.Signals]:
    """Block SIGINT/SIGTERM/SIGHUP (one that comes meanwhile waits, pending); the mask before, for
    :func:`unblock`. Around a switch of handlers: a signal is then handled by the handler in place
    when it is unblocked, inside the ``try`` that is ready for it, never in between."""
    return signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)


def unblock(mask: set[int | signal.Signals]) -> None:
    """Back to ``mask`` (from :func:`block`): a pending signal is handled now."""
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def map_held(pool: Executor, fn: Callable[[A], T], items: Iterable[A]) -> list[T]:
    """``pool.map`` whose threads start with the signals held (:func:`held_while_threads_start`): the
    results in order. Raises the first item's exception; the items not yet started are cancelled."""
    with held_while_threads_start():
        futures = [pool.submit(fn, item) for item in items]
    try:
        return [future.result() for future in futures]
    finally:
        for future in futures:
            future.cancel()


@contextmanager
def held_while_threads_start() -> Iterator[None]:
    """Block SIGINT/SIGTERM/SIGHUP while threads start: a raise inside ``Thread.start`` can leave a thread
    Python no longer knows. A signal that came meanwhile is handled on leaving."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
