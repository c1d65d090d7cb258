"""The privilege boundary, root's side: the one way to start work on an environment's files.

A worker is a forked, isolated process with the account's file access; its answer comes back as JSON,
checked as the account's word. Why and how: docs/privsep.md.
"""

from __future__ import annotations

import codecs
import contextlib
import importlib.abc
import importlib.machinery
import json
import os
import selectors
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

from safeinstall.errors import SafeInstallError
from safeinstall.system.children import isolate

#: The most a worker's answer may hold (counts and short lists of paths).
ANSWER_LIMIT = 4 << 20

_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGPIPE)

#: The text codecs a worker's work may name (``open(..., encoding=...)``, ``bytes.decode``): each is
#: an ``encodings`` module the first lookup imports, so root looks them up once, before any fork.
CODECS = ("ascii", "utf-8", "latin-1")
for _codec in CODECS:
    codecs.lookup(_codec)


class _NoImports(importlib.abc.MetaPathFinder):
    """In a worker, first on ``sys.meta_path``: an import of a module not loaded yet (a built-in or
    frozen one aside, which needs no file) fails, as it would where the account cannot read the
    interpreter's files (``LookupError: unknown encoding``). Load it in root before the fork (a
    top-level import of the module whose function the worker runs; a codec in :data:`CODECS`)."""

    def find_spec(self, fullname: str, path: object = None, target: object = None) -> None:
        if fullname in sys.builtin_module_names or importlib.machinery.FrozenImporter.find_spec(fullname):
            return None
        raise ImportError(f"a worker imported {fullname}: load it before the fork (system/worker.py)")


class WorkerError(SafeInstallError):
    """A worker did not answer as it must (died, ran past its deadline, answered nonsense)."""

    default_hint = "the environment's owner may be interfering; see the run's log and run again"


def call(
    ids: tuple[int, int] | None,
    work: Callable[[], Any],
    *,
    timeout: float,
    what: str,
    environ: dict[str, str] | None = None,
) -> Any:
    """Run ``work()`` in a forked worker as ``ids`` (None: an isolated root) and return its JSON answer, the
    account's word to validate. ``environ``: its whole environment. Raises :class:`WorkerError` when it fails,
    dies, answers over :data:`ANSWER_LIMIT` or passes ``timeout``."""
    read_fd, write_fd = os.pipe()
    parent = os.getpid()
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS[:3])
    try:
        child = os.fork()
    except OSError as exc:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        os.close(read_fd)
        os.close(write_fd)
        raise WorkerError(f"could not start the worker that {what}: {exc.strerror or exc}") from exc
    if child == 0:  # pragma: no cover - the worker (its coverage is its answer)
        _worker_main(parent, ids, work, read_fd, write_fd, environ)
    os.close(write_fd)
    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
    try:
        data, status = _collect(child, read_fd, timeout, what)
    finally:
        os.close(read_fd)
    return _answer(data, status, what)


def _worker_main(
    parent: int,
    ids: tuple[int, int] | None,
    work: Callable[[], Any],
    read_fd: int,
    write_fd: int,
    environ: dict[str, str] | None,
) -> None:
    status = 1
    try:
        for signum in _SIGNALS:
            signal.signal(signum, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
        os.close(read_fd)
        isolate(parent, ids, new_session=True, keep=(write_fd,))
        os.environ.clear()
        os.environ.update(environ if environ is not None else {"PATH": "/usr/bin:/bin"})
        sys.meta_path.insert(0, _NoImports())
        try:
            answer: dict[str, Any] = {"ok": work()}
        except Exception as exc:  # said to root, which decides
            answer = {"error": f"{type(exc).__name__}: {exc}"}
        data = memoryview(json.dumps(answer, ensure_ascii=True).encode("ascii"))
        while data:
            data = data[os.write(write_fd, data) :]
        status = 0
    finally:
        os._exit(status)


def _collect(child: int, read_fd: int, timeout: float, what: str) -> tuple[bytes, int]:
    """The worker's output (bounded) and its wait status; kills and reaps it past the deadline, past
    the limit, or when this process is interrupted."""
    deadline = time.monotonic() + timeout
    kept = bytearray()
    reaped = False
    try:
        with selectors.DefaultSelector() as selector:
            selector.register(read_fd, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise WorkerError(f"the worker that {what} did not finish in {timeout:g} s; it was ended")
                if not selector.select(left):
                    continue
                chunk = os.read(read_fd, 1 << 16)
                if not chunk:
                    break
                kept += chunk
                if len(kept) > ANSWER_LIMIT:
                    raise WorkerError(f"the worker that {what} answered more than {ANSWER_LIMIT} bytes")
        while True:  # it closed its pipe: it exits now (os._exit right after the write)
            pid, status = os.waitpid(child, os.WNOHANG)
            if pid:
                reaped = True
                return bytes(kept), status
            if time.monotonic() > deadline:
                raise WorkerError(f"the worker that {what} did not exit in {timeout:g} s; it was ended")
            time.sleep(0.001)
    finally:
        if not reaped:
            _reap(child)


def _reap(child: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(child, signal.SIGKILL)
    while True:
        try:
            os.waitpid(child, 0)
            return
        except ChildProcessError:
            return
        except BaseException:  # a signal handler raised: the child must still be reaped first
            continue


def _answer(data: bytes, status: int, what: str) -> Any:
    """Pure: the worker's JSON answer, or WorkerError."""
    if not os.WIFEXITED(status) or os.WEXITSTATUS(status) != 0:
        code = os.WEXITSTATUS(status) if os.WIFEXITED(status) else -os.WTERMSIG(status)
        raise WorkerError(f"the worker that {what} failed (status {code})")
    try:
        document = json.loads(data)
    except ValueError as exc:
        raise WorkerError(f"the worker that {what} answered something that is not JSON") from exc
    if not isinstance(document, dict) or len(document) != 1:
        raise WorkerError(f"the worker that {what} answered an unexpected document")
    if "error" in document:
        raise WorkerError(f"the worker that {what} failed: {str(document['error'])[:500]}")
    if "ok" not in document:
        raise WorkerError(f"the worker that {what} answered an unexpected document")
    return document["ok"]
