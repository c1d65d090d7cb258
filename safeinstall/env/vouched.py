"""What a run vouches for: files whose bytes are their wheel's members where the wheel's RECORD says
otherwise, and how a verification settles them (``wheel-record``). Pure."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace

from safeinstall.env.distributions import InstalledDistribution
from safeinstall.env.drift import Expectation, Finding, FindingKind, compare
from safeinstall.env.hashing import FileState

BASELINE_VERSION = 1
#: the entries kept per distribution (each for another version or RECORD), newest first
KEPT_PER_DISTRIBUTION = 5
#: how a ``wheel-record`` finding that the baseline settled names its baseline in ``--json``
RUN_BASELINE = "run"


@dataclass(frozen=True, slots=True)
class Vouched:
    """One distribution as a run left it after verifying it against its wheel: the files whose bytes
    are the wheel's members but not what its RECORD says (location -> :func:`file_key`)."""

    version: str
    dist_info: str
    record: str  # :func:`record_digest` of its installed RECORD, as the run left it
    run_id: str
    wheel: str  # the wheel's file name
    files: Mapping[str, str]


@dataclass(frozen=True, slots=True)
class Baseline:
    prefix: str
    #: name -> what runs vouched for, newest first (one per version and RECORD, at most
    #: :data:`KEPT_PER_DISTRIBUTION`): an ``--undo`` back to an older version finds that one's
    distributions: Mapping[str, tuple[Vouched, ...]]


EMPTY = Baseline("", {})


def file_key(state: FileState | None) -> str:
    """Pure: one file's state as compared between what a run left and now."""
    if state is None or not state.exists:
        return "absent"
    if state.error is not None:
        return "unreadable"
    if not state.is_file:
        return "not a file"
    return f"{state.algorithm}={state.digest}:{state.size}"


def record_digest(dist: InstalledDistribution) -> str:
    """Pure: a digest of the installed RECORD's entries (path, hash, size), as parsed."""
    digest = hashlib.sha256()
    for entry in dist.record.entries:
        digest.update(f"{entry.path}\0{entry.hash or ''}\0{entry.size}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def vouched_of(
    dist: InstalledDistribution,
    observed: Mapping[str, FileState],
    shipped: Mapping[str, str],
    run_id: str,
    wheel: str,
) -> Vouched | None:
    """Pure: after a run verified ``dist`` against its wheel, the files holding exactly the wheel's bytes
    (``shipped``) that its installed RECORD does not describe, as observed; None when it describes them
    all."""
    files: dict[str, str] = {}
    for entry, location in zip(dist.record.entries, dist.locations, strict=True):
        state = observed.get(location)
        if entry.hash is None or state is None or shipped.get(location) != file_key(state):
            continue
        expected = Expectation(location, entry.hash.algorithm, entry.hash.digest, entry.size)
        if compare(dist.name, expected, state, "record") is not None:
            files[location] = file_key(state)
    if not files:
        return None
    return Vouched(dist.version, os.fspath(dist.dist_info), record_digest(dist), run_id, wheel, files)


def applies(vouched: Vouched | None, dist: InstalledDistribution) -> bool:
    """Pure: whether an entry describes the distribution as installed now (same version, same
    ``.dist-info``, same RECORD): after another installer changed it, it does not."""
    return (
        vouched is not None
        and vouched.version == dist.version
        and vouched.dist_info == os.fspath(dist.dist_info)
        and vouched.record == record_digest(dist)
    )


def entry_for(entries: Iterable[Vouched], dist: InstalledDistribution) -> Vouched | None:
    """Pure: the entry that describes ``dist`` as installed now, if any (:func:`applies`)."""
    return next((v for v in entries if applies(v, dist)), None)


def settle(finding: Finding, state: FileState, vouched: Vouched) -> Finding:
    """Pure: a ``modified`` file (against its installed RECORD) that holds exactly the bytes a run
    installed and verified against the wheel is the wheel's RECORD's fault: ``wheel-record``, not
    drift. Anything else (a local patch of it too) stays ``modified``."""
    if (
        finding.kind != FindingKind.MODIFIED
        or finding.baseline != "record"
        or vouched.files.get(finding.path) != file_key(state)
        or not state.is_file
    ):
        return finding
    return replace(
        finding,
        kind=FindingKind.WHEEL_RECORD,
        baseline=RUN_BASELINE,
        detail=f"{finding.detail}; the very bytes safeinstall installed from {vouched.wheel} and verified "
        f"against the wheel's member (run {vouched.run_id}): the wheel's own RECORD is wrong, not drift",
    )


def updated(baseline: Baseline, prefix: str, name: str, vouched: Vouched) -> Baseline:
    """Pure: the baseline after a run verified ``name`` against a wheel whose RECORD is wrong: its
    entry first, replacing one for the same version and RECORD; the newest
    :data:`KEPT_PER_DISTRIBUTION` kept (the others describe versions that may come back with ``--undo``;
    each is bound to its version and RECORD, and vouches only for content)."""
    same = (vouched.version, vouched.dist_info, vouched.record)
    older = [v for v in baseline.distributions.get(name, ()) if (v.version, v.dist_info, v.record) != same]
    entries = (vouched, *older)[:KEPT_PER_DISTRIBUTION]
    return Baseline(prefix, dict(sorted({**baseline.distributions, name: entries}.items())))
