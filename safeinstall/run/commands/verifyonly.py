"""Checks that take the hashes the verified-inode store keeps: an unchanged inode is not read again, and a
distribution proven unchanged by ``lstat`` is not compared file by file. docs/verify.md.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from safeinstall.env.environment import Environment, Walked
from safeinstall.env.hashing import FileState, Known
from safeinstall.env.verify import ProgressCallback, VerifyReport, containment_root, verify_environment

if TYPE_CHECKING:
    from safeinstall.env.distributions import InstalledDistribution
    from safeinstall.env.inodetrust import InodeStore
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
    walked: Mapping[str, os.stat_result] | None = None,
    acknowledge: bool = False,
) -> VerifyReport:
    """``--verify-only`` with the verified-inode store: unchanged inodes not read, what was hashed kept,
    distributions proven unchanged not compared (none of it with ``full``). ``walked``: the steering
    walk's ``lstat``; ``notes`` say why the store was not used or kept. ``acknowledge``: each
    ``wheel-fault`` found is kept as acknowledged (:mod:`safeinstall.store.wheelfaults`)."""
    from safeinstall.env.bytecode import Anchor, anchored_window, keepable, known_checker
    from safeinstall.env.distributions import ParsedRecords
    from safeinstall.env.hashing import cycle_collection_paused
    from safeinstall.env.inodetrust import GRANULARITY_NS
    from safeinstall.env.recorded import RecordCheck
    from safeinstall.env.unchanged import prover, unchanged_entry
    from safeinstall.store.anchors import keep_anchors, read_anchors
    from safeinstall.store.bytecode import keep_judged, read_judged
    from safeinstall.store.inodestore import ctime_kept, filesystems, keep, read_store, store_checker
    from safeinstall.store.parses import keep_parses, read_parses
    from safeinstall.store.records import keep_records, read_records
    from safeinstall.store.state import state_root
    from safeinstall.store.unchanged import keep_unchanged, read_unchanged

    root = state_root(os.environ, os.geteuid())
    loaded: list[tuple[InodeStore | None, Known | None]] = []

    def store() -> tuple[InodeStore | None, Known | None]:
        if not loaded:
            kept, note = read_store(root, env.prefix)
            notes.extend([note] if note else [])
            loaded.append((kept, None if full else store_checker(kept)))
        return loaded[0]

    def known(info: os.stat_result, algorithm: str) -> str | None:
        checker = store()[1]
        return None if checker is None else checker(info, algorithm)

    def root_of(dist: InstalledDistribution) -> str:
        return os.fspath(containment_root(env, dist))

    since = time.time_ns()  # before any RECORD is read: what is kept was settled by then
    clean, note = read_unchanged(root, env.prefix)
    notes.extend([note] if note else [])
    records, note = read_records(root, env.prefix)
    notes.extend([note] if note else [])
    record_check = RecordCheck(records or {})
    judged, note = read_judged(root, env.prefix)
    notes.extend([note] if note else [])
    known_pyc = None if judged is None or full else known_checker({k: j for k, (j, _) in judged.items()})
    anchors, note = read_anchors(root, env.prefix)
    notes.extend([note] if note else [])
    with cycle_collection_paused(frozen=True):  # every kept RECORD entry (61k on vLLM), no cycle
        kept_parses, note = read_parses(root, env.prefix)
    notes.extend([note] if note else [])
    parses = None if kept_parses is None else ParsedRecords(kept_parses, use=not full)
    fresh_anchors: dict[str, Anchor] = {}

    def install_window(dist: InstalledDistribution, earliest: int | None) -> tuple[int, int] | None:
        if anchors is None:
            return None
        key = anchor_key(dist)
        if key is None:
            return None
        window, fresh = anchored_window(
            anchors.get(key), _record_identity(os.fspath(dist.dist_info)), earliest
        )
        if fresh is not None:
            fresh_anchors[key] = fresh
        return window

    unchanged = prover(clean, root_of, walked)
    if full and unchanged is not None:
        unchanged = _none  # every file read; what is found clean is kept anew
    report = verify_environment(
        env,
        names,
        wheel,
        on_progress,
        settle_shared=wheel is None,
        vouched=vouched,
        known=None if full else known,
        unchanged=unchanged,
        known_pyc=known_pyc,
        bytecode=True,
        recorded=record_check,
        install_window=None if full else install_window,
        anchored_before=lambda dist: anchors is not None and anchor_key(dist) in anchors,  # --full too
        listings=walked if isinstance(walked, Walked) else None,
        parses=parses,
    )
    if parses is not None and (parses.new or set(parses.seen) != set(parses.kept)):
        fs_kept = ctime_kept({})
        seen = {path: p for path, p in parses.seen.items() if fs_kept(p.identity[0], path)}
        note = keep_parses(root, env.prefix, seen if names is None else {**parses.kept, **seen})
        notes.extend([note] if note else [])
    note = keep_anchors(root, env.prefix, anchors, fresh_anchors)
    notes.extend([note] if note else [])
    clean_now = {os.fspath(d.dist_info) for d in report.clean} | set(report.proven)
    note = keep_records(root, env.prefix, records, record_check.updates(clean_now.__contains__))
    notes.extend([note] if note else [])
    if report.judged and judged is not None:
        fs_kept = ctime_kept({})
        good = [j for j in keepable(report.judged, since, GRANULARITY_NS) if fs_kept(j.device, j.location)]
        note = keep_judged(root, env.prefix, judged, good)
        notes.extend([note] if note else [])
    hashed = [state for state in report.observed.values() if state.hashed_ns]
    if hashed:
        kept = keep(root, env.prefix, store()[0], hashed)
        notes.extend([kept] if kept else [])
    checked = {d.dist_info for d in report.distributions}
    if clean is not None and (report.clean or (checked & set(clean.distributions)) - report.proven):
        directories: dict[str, tuple[tuple[int, int, int, int], int]] = {}
        kept_fs = ctime_kept(filesystems(hashed))
        hashed_at = _hashed_at(store()[0] if loaded else None)
        # a base installation's distributions are not kept: their directories are outside the prefix
        prefix = os.fspath(env.prefix)
        fresh = [
            entry
            for dist in report.clean
            if root_of(dist) == prefix
            and (
                entry := unchanged_entry(
                    dist, report.observed, since, prefix, directories, kept_fs, hashed_at
                )
            )
            is not None
        ]
        note = keep_unchanged(root, env.prefix, clean, checked, report.proven, fresh, directories)
        notes.extend([note] if note else [])
    return _wheel_faults(report, root, env, acknowledge, notes)


def _wheel_faults(
    report: VerifyReport, root: Path, env: Environment, acknowledge: bool, notes: list[str]
) -> VerifyReport:
    """The report with each ``wheel-fault`` root acknowledged (its file's identity and sha256 as kept)
    quiet; with ``acknowledge``, each found now kept so, and quiet. The store is read only when there
    is one to settle."""
    from safeinstall.env.drift import FaultIdentity, FindingKind, acknowledged, fault_identity
    from safeinstall.store.wheelfaults import keep_faults, read_faults

    if not any(f.kind == FindingKind.WHEEL_FAULT for f in report.findings):
        return report
    kept, note = read_faults(root, env.prefix)
    notes.extend([note] if note else [])
    if acknowledge:
        fresh: dict[str, FaultIdentity] = {}
        for finding in report.findings:
            state = report.observed.get(finding.path)
            identity = None if state is None else fault_identity(finding, state)
            if identity is not None:
                fresh[identity.location] = identity
        note = keep_faults(root, env.prefix, {**kept, **fresh})
        notes.extend([note] if note else [])
        kept = kept if note else {**kept, **fresh}
    distributions = tuple(
        replace(d, findings=tuple(acknowledged(f, report.observed.get(f.path), kept) for f in d.findings))
        for d in report.distributions
    )
    return replace(report, distributions=distributions)


def _hashed_at(store: InodeStore | None) -> Callable[[FileState], int]:
    """When a file's bytes were read and hashed: by this check (its ``hashed_ns``), or, for one proven
    by the verified-inode store's hash (``by_identity``), when that hash was taken; 0 when not known."""
    entries = {} if store is None else store.entries

    def hashed_at(state: FileState) -> int:
        if state.hashed_ns:
            return state.hashed_ns
        entry = entries.get((state.device, state.inode)) if state.by_identity else None
        return 0 if entry is None else entry.hashed_ns

    return hashed_at


def anchor_key(dist: InstalledDistribution) -> str | None:
    """Pure: the key of a distribution's anchor (:func:`safeinstall.store.anchors.anchor_key`)."""
    from safeinstall.store.anchors import anchor_key as key_of

    return key_of(os.fspath(dist.site), dist.name, dist.version)


def _record_identity(dist_info: str) -> tuple[int, int] | None:
    """A RECORD's inode and change time (itself, never followed), or None: not a regular file."""
    try:
        info = os.lstat(os.path.join(dist_info, "RECORD"))
    except OSError:
        return None
    return (info.st_ino, info.st_ctime_ns) if stat.S_ISREG(info.st_mode) else None


def _none(_dist: InstalledDistribution) -> None:
    """Proves nothing (``--full``)."""
    return None
