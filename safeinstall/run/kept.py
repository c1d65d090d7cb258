"""Checks that take the hashes an environment's verified-inode store keeps (docs/verify.md): a file
whose inode is as it was when a run or ``--verify-only`` hashed it is not read again, and what a check
hashed is kept (:mod:`safeinstall.store.verified`; the decisions: :mod:`safeinstall.env.verified`)."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

from safeinstall.env.environment import Environment
from safeinstall.env.verify import ProgressCallback, VerifyReport, verify_environment

if TYPE_CHECKING:
    from safeinstall.env.vouched import Vouched
    from safeinstall.env.wheel import Wheel


def verify_kept(
    env: Environment,
    names: Sequence[str] | None,
    wheel: Wheel | None,
    full: bool,
    notes: list[str],
    vouched: Callable[[], Mapping[str, tuple[Vouched, ...]]],
    on_progress: ProgressCallback | None = None,
) -> VerifyReport:
    """``--verify-only``: :func:`verify_environment`, taking the store's hashes of unchanged inodes
    (none with ``full``: every file is read) and keeping what it hashed; ``notes`` say why the store was
    not used or kept, when it was not."""
    from safeinstall.store.state import state_root
    from safeinstall.store.verified import keep, read_store, store_checker

    root = state_root(os.environ, os.geteuid())
    store, note = read_store(root, env.prefix)
    notes.extend([note] if note else [])
    known = None if full else store_checker(store)
    report = verify_environment(
        env, names, wheel, on_progress, settle_shared=wheel is None, vouched=vouched, known=known
    )
    kept = keep(root, env.prefix, store, report.observed.values())
    notes.extend([kept] if kept else [])
    return report
