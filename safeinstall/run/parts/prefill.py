"""The run's uv cache filled from the owner's beside the preflight (issue 43): started once the plan is
known and refuses nothing, on a thread of its own, while the old files are hashed and backed up; the
prefetch takes its answer. Why and what it keeps: docs/window.md ("The run's cache filled from the
owner's").
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from safeinstall.env import cachefill, owner
from safeinstall.env.environment import Environment
from safeinstall.env.inodetrust import InodeStore, root_only_checker
from safeinstall.env.uvplan import UvChange
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
) -> Prefill | None:
    """Start the fill of the run's cache (``state.uv_cache(run_id)``, made here as the owner's) on a
    thread; None when there is nothing to copy from, nothing the plan fetches, or the run's cache cannot
    be made here (the prefetch then fills it itself). ``known``: see :func:`cachefill.fill`."""
    source, _ = source_of(environ, env, link_mode)
    if source is None or not cachefill.wanted(changes) or not source.is_dir():
        return None
    try:
        cache = make_run_dir(state.uv_cache(run_id), env.account)
    except OSError:  # the prefetch makes it (and says why it cannot)
        return None
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="safeinstall-fill")
    try:
        with held_while_threads_start():
            answer = pool.submit(cachefill.fill, source, cache, changes, env.account, known)
    except BaseException:
        pool.shutdown(wait=True)
        remove_run_dir(cache)
        raise
    return Prefill(cache, source, pool, answer, time.monotonic())


def kept_digests(store: InodeStore | None, full: bool) -> owner.Known | None:
    """The digests root's verified-inode store keeps of root-only inodes (:func:`root_only_checker`), for
    the fill of root's own environment; None with ``--full`` (every file read) or no usable store."""
    return None if full or store is None or not store.entries else root_only_checker(store)


def take(prefill: Prefill) -> tuple[cachefill.Filled, float]:
    """The fill's answer (waited for), and how long the prefetch waited for it (seconds)."""
    waited = time.monotonic()
    try:
        filled = prefill.answer.result()
    finally:
        prefill.pool.shutdown(wait=True)
    return filled, time.monotonic() - waited


def join(prefill: Prefill | None) -> None:
    """Wait until the fill is over (its worker ends by itself), whatever became of the run."""
    if prefill is not None:
        prefill.pool.shutdown(wait=True)


def abandon(prefill: Prefill | None) -> None:
    """A fill the run does not take: waited for (its worker ends by itself), then its cache removed.
    Idempotent."""
    if prefill is None:
        return
    join(prefill)
    remove_run_dir(prefill.cache)
