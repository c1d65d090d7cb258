"""The run's uv cache filled from the owner's beside the preflight (issue 43): started once the plan is
known and refuses nothing, on a thread of its own, while the old files are hashed and backed up; the
prefetch takes its answer. Why and what it keeps: docs/window.md ("The run's cache filled from the
owner's").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from safeinstall.env import cachefill, owner
from safeinstall.env.environment import Environment
from safeinstall.env.inodetrust import InodeStore, root_only_checker
from safeinstall.env.uvplan import UvChange, UvRequest, unpack_command, uv_binary
from safeinstall.env.uvplan import install as uv_install
from safeinstall.errors import SafeInstallError
from safeinstall.store.state import EnvironmentState, check_trusted, make_run_dir, remove_run_dir
from safeinstall.system.signals import held_while_threads_start


@dataclass(frozen=True, slots=True)
class Prefill:
    """The fill running (or done) beside the preflight: the run's cache it fills, from where, its
    thread's answer and when it started."""

    cache: Path
    source: Path
    pool: ThreadPoolExecutor
    answer: Future[cachefill.Filled]
    started: float
    #: uv's unpack of a given wheel into the same cache, beside the copy: what to log of it
    unpacking: Future[str] | None = None
    #: set when the run no longer waits for the unpack (interrupted, failed, declined): uv is killed
    stop: threading.Event = field(default_factory=threading.Event)


def source_of(environ: Mapping[str, str], env: Environment, link_mode: str) -> tuple[Path | None, str]:
    """The owner's cache the run's is filled from, or None and why not ("" when there is nothing to say):
    none for uv's own cache options; root's only where nobody else can write it."""
    source = cachefill.source_cache(environ, env.account)
    if source is None or link_mode != "hardlink":  # uv's cache options: left to uv
        return None, ""
    if env.account is None:  # root's environment: the caller's cache, only if nobody else can write it
        try:
            check_trusted(source)
        except SafeInstallError as exc:
            return None, f"nothing copied from {source}: {exc.message}"
    return source, ""


def start(
    environ: Mapping[str, str],
    env: Environment,
    state: EnvironmentState,
    run_id: str,
    changes: tuple[UvChange, ...],
    link_mode: str,
    known: owner.Known | None = None,
    request: UvRequest | None = None,
) -> Prefill | None:
    """Start the fill of the run's cache (``state.uv_cache(run_id)``, made here as the owner's) on a
    thread; None when there is nothing to copy from, nothing the plan fetches, or the run's cache cannot
    be made here. ``known``: see :func:`cachefill.fill`; ``request``: the run's, whose given wheel uv
    unpacks beside the copy (:func:`safeinstall.env.uvplan.unpack_command`; docs/window.md)."""
    source, _ = source_of(environ, env, link_mode)
    if source is None or not cachefill.wanted(changes) or not source.is_dir():
        return None
    try:
        cache = make_run_dir(state.uv_cache(run_id), env.account)
    except OSError:  # the prefetch makes it (and says why it cannot)
        return None
    scratch = state.unpack_dir(run_id)
    unpack = unpack_command(request, uv_binary(), scratch) if request is not None else None
    pool = ThreadPoolExecutor(max_workers=2 if unpack else 1, thread_name_prefix="safeinstall-fill")
    unpacking: Future[str] | None = None
    stop = threading.Event()
    try:
        with held_while_threads_start():
            answer = pool.submit(cachefill.fill, source, cache, changes, env.account, known)
            if unpack:
                unpacking = pool.submit(_unpack, unpack, environ, cache, scratch, env, stop)
    except BaseException:
        pool.shutdown(wait=True)
        remove_run_dir(cache)
        raise
    return Prefill(cache, source, pool, answer, time.monotonic(), unpacking, stop)


def _unpack(
    command: Sequence[str],
    environ: Mapping[str, str],
    cache: Path,
    scratch: Path,
    env: Environment,
    stop: threading.Event,
) -> str:
    """uv's unpack of the given wheel into the run's cache through the throwaway ``scratch`` (removed
    here), as the environment's owner: what to log. Best effort: a failure is said, and the prefetch's
    install unpacks it."""
    started = time.monotonic()
    try:
        make_run_dir(scratch, env.account)
        result = uv_install(
            command,
            environ,
            timeout=cachefill.FILL_TIMEOUT_S,
            cache_dir=cache,
            account=env.account,
            cancel=stop,
        )
    except OSError as exc:
        return f"the wheel was not unpacked beside the copy ({exc}): the prefetch unpacks it"
    finally:
        remove_run_dir(scratch)
    if result.returncode != 0:
        tail = " ".join(result.output.strip().splitlines()[-2:])[:300]
        return f"the wheel was not unpacked beside the copy (uv exit {result.returncode}: {tail})"
    return f"the wheel unpacked into the run's cache beside the copy in {time.monotonic() - started:.1f} s"


def kept_digests(store: InodeStore | None, full: bool) -> owner.Known | None:
    """The digests root's verified-inode store keeps of root-only inodes (:func:`root_only_checker`), for
    the fill of root's own environment; None with ``--full`` (every file read) or no usable store."""
    return None if full or store is None or not store.entries else root_only_checker(store)


def take(prefill: Prefill) -> tuple[cachefill.Filled, float, str | None]:
    """The fill's answer (waited for), how long the prefetch waited for it (seconds, the unpack beside
    it included), and what to log of the unpack (None: none ran)."""
    waited = time.monotonic()
    try:
        filled = prefill.answer.result()
        unpacked = prefill.unpacking.result() if prefill.unpacking is not None else None
    except BaseException:  # interrupted while it waited: the unpack is not waited for (uv is killed)
        prefill.stop.set()
        raise
    finally:
        prefill.pool.shutdown(wait=True)
    return filled, time.monotonic() - waited, unpacked


def join(prefill: Prefill | None) -> None:
    """Wait until the fill is over (its worker ends by itself), whatever became of the run; the wheel's
    unpack, no longer wanted (a run that took it has its answer), is stopped: uv is killed."""
    if prefill is not None:
        prefill.stop.set()
        prefill.pool.shutdown(wait=True)


def abandon(prefill: Prefill | None) -> None:
    """A fill the run does not take: waited for (its worker ends by itself), then its cache removed.
    Idempotent."""
    if prefill is None:
        return
    join(prefill)
    remove_run_dir(prefill.cache)
