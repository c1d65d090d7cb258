"""What root keeps of a RECORD found clean, so that a RECORD rewritten since is reported
(``record-changed``), naming the files whose lines changed. Pure.

The store is :mod:`safeinstall.store.records`; docs/verify.md."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

from safeinstall.env.distributions import InstalledDistribution
from safeinstall.env.drift import Finding, FindingKind
from safeinstall.env.records import encode_digest

_PAIR = 16


@dataclass(frozen=True, slots=True)
class KeptRecord:
    digest: str  # sha256 of the entries, RECORD spelling
    lines: bytes  # per entry: 8 bytes of its path's sha256, 8 of the entry's


def _entry_text(dist: InstalledDistribution, index: int) -> str:
    entry = dist.record.entries[index]
    hashed = "" if entry.hash is None else str(entry.hash)
    return f"{entry.path}\0{hashed}\0{'' if entry.size is None else entry.size}"


def record_digest(dist: InstalledDistribution) -> str:
    """Pure: the sha256 of what a RECORD lists (its entries as parsed, in order)."""
    texts = "\n".join(_entry_text(dist, i) for i in range(len(dist.record.entries)))
    return encode_digest(hashlib.sha256(texts.encode("utf-8", "surrogateescape")).digest())


def kept_record(dist: InstalledDistribution) -> KeptRecord:
    """Pure: what is kept of a distribution's RECORD."""
    lines = bytearray()
    for index, entry in enumerate(dist.record.entries):
        path = entry.path.encode("utf-8", "surrogateescape")
        lines += hashlib.sha256(path).digest()[:8]
        lines += hashlib.sha256(_entry_text(dist, index).encode("utf-8", "surrogateescape")).digest()[:8]
    return KeptRecord(record_digest(dist), bytes(lines))


def changed_entries(dist: InstalledDistribution, kept: KeptRecord) -> tuple[list[str], int]:
    """Pure: the locations whose RECORD entries are new or changed since ``kept``, and how many of the
    entries kept are gone."""
    before = {kept.lines[i : i + 8]: kept.lines[i + 8 : i + _PAIR] for i in range(0, len(kept.lines), _PAIR)}
    now = kept_record(dist).lines
    changed: list[str] = []
    seen: set[bytes] = set()
    for index, location in enumerate(dist.locations):
        key, line = now[index * _PAIR : index * _PAIR + 8], now[index * _PAIR + 8 : (index + 1) * _PAIR]
        seen.add(key)
        if before.get(key) != line:
            changed.append(location)
    return changed, len(set(before) - seen)


def record_findings(dist: InstalledDistribution, kept: KeptRecord | None) -> list[Finding]:
    """Pure: ``record-changed`` findings of a distribution whose RECORD lists other entries than it did
    when root last found it clean: one per file whose line is new or changed, one for lines gone."""
    if kept is None or record_digest(dist) == kept.digest:
        return []
    changed, gone = changed_entries(dist, kept)
    said = (
        "its RECORD line changed since root last found the distribution clean (a file edited with its "
        "line matches it): reinstall it, with safeinstall, to make it the reference again"
    )
    findings = [Finding(dist.name, location, FindingKind.RECORD_CHANGED, said) for location in changed]
    if gone:
        why = f"{gone} lines gone since root last found it clean"
        findings.append(
            Finding(dist.name, os.path.join(dist.dist_info, "RECORD"), FindingKind.RECORD_CHANGED, why)
        )
    return findings


class RecordCheck:
    """What the verification asks of each distribution (:func:`record_findings` against the kept
    RECORDs), remembering what it saw for the store's update."""

    def __init__(self, kept: Mapping[str, KeptRecord]) -> None:
        self.kept = kept
        self.seen: dict[str, InstalledDistribution] = {}

    def __call__(self, dist: InstalledDistribution, proven: bool) -> list[Finding]:
        key = os.fspath(dist.dist_info)
        kept = self.kept.get(key)
        if proven and kept is not None:
            return []  # its RECORD unchanged since the clean check that kept both: nothing to update
        self.seen[key] = dist
        return record_findings(dist, kept)

    def updates(self, clean: Callable[[str], bool]) -> dict[str, KeptRecord]:
        """What to keep: each distribution seen and found clean (by ``.dist-info``), its RECORD as now
        (one whose RECORD changed is never clean: it stays reported until a run installs it)."""
        return {
            key: kept_record(dist)
            for key, dist in self.seen.items()
            if clean(key) and (key not in self.kept or record_digest(dist) != self.kept[key].digest)
        }
