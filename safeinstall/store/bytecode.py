"""The judged bytecode of an environment: ``<state>/<env>/bytecode.json``, root's, 0600.

Read with the state directory's checks; one of another environment, boot or version, or damaged, is
not used. The decisions: :mod:`safeinstall.env.bytecode`.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from safeinstall.env.bytecode import MAX_AGE_NS, MAX_JUDGED, Judged
from safeinstall.env.inodetrust import HIGHEST, LOWEST
from safeinstall.store.inodestore import boot_id
from safeinstall.store.state import keep_store, load_store, store_part

STORE_NAME = "bytecode.json"
STORE_VERSION = 1
STORE_LIMIT = 64 << 20
_DIGEST = re.compile(r"[A-Za-z0-9_-]{16,128}")

#: (device, inode) -> the judgement, and when it was made
Entries = Mapping[tuple[int, int], tuple[Judged, int]]


def _entry(raw: object, now_ns: int) -> tuple[Judged, int] | None:
    if not isinstance(raw, list) or len(raw) != 8:
        raise ValueError("not an entry")
    location, *numbers, digest = raw
    if not isinstance(location, str) or not location.startswith("/") or "\0" in location:
        raise ValueError("not a path")
    if not isinstance(digest, str) or not _DIGEST.fullmatch(digest):
        raise ValueError("not a digest")
    if not all(type(n) is int and LOWEST <= n <= HIGHEST for n in numbers):
        raise ValueError("not numbers")
    device, inode, size, mtime, ctime, judged_ns = numbers
    if min(device, inode, size, ctime, judged_ns) < 0:
        raise ValueError("negative")
    if not 0 < judged_ns <= now_ns or now_ns - judged_ns > MAX_AGE_NS:
        return None  # too old, or from the future
    return Judged(location, device, inode, size, mtime, ctime, digest), judged_ns


def from_json(raw: bytes, prefix: str, boot: str, now_ns: int) -> dict[tuple[int, int], tuple[Judged, int]]:
    """Pure: the entries read back, every field checked (ValueError: damaged, another's)."""
    entries: list[Any] = store_part(raw, STORE_VERSION, prefix, "entries", list, boot=boot)
    found: dict[tuple[int, int], tuple[Judged, int]] = {}
    for raw_entry in entries[:MAX_JUDGED]:
        entry = _entry(raw_entry, now_ns)
        if entry is not None:
            found[(entry[0].device, entry[0].inode)] = entry
    return found


def to_json(prefix: str, boot: str, entries: Entries) -> bytes:
    """Pure: the store as it is written."""
    document = {
        "version": STORE_VERSION,
        "boot": boot,
        "prefix": prefix,
        "entries": [
            [j.location, j.device, j.inode, j.size, j.mtime_ns, j.ctime_ns, at, j.source_digest]
            for j, at in entries.values()
        ],
    }
    return json.dumps(document, separators=(",", ":")).encode("utf-8", "surrogateescape")


def read_judged(
    root: Path, prefix: Path
) -> tuple[dict[tuple[int, int], tuple[Judged, int]] | None, str | None]:
    """The environment's judged bytecode ({} when there is none or it is not believed, and it is
    written anew), with a note when it was refused; None when nothing may be kept (no boot id, the
    state directory not trusted, the store not root's own file)."""
    boot = boot_id()
    if boot is None:
        return None, None

    def parse(raw: bytes) -> dict[tuple[int, int], tuple[Judged, int]]:
        return from_json(raw, os.fspath(prefix), boot, time.time_ns())

    return load_store(root, prefix, STORE_NAME, STORE_LIMIT, parse, {}, "the store of judged bytecode")


def keep_judged(
    root: Path,
    prefix: Path,
    entries: Mapping[tuple[int, int], tuple[Judged, int]] | None,
    fresh: Iterable[Judged],
) -> str | None:
    """The store with ``fresh`` judgements added (best effort; a note when it could not be written)."""
    boot = boot_id()
    new = list(fresh)
    if entries is None or boot is None or not new:
        return None
    now = time.time_ns()
    merged = dict(entries)
    merged.update(((j.device, j.inode), (j, now)) for j in new)
    if len(merged) > MAX_JUDGED:  # the newest kept
        merged = dict(sorted(merged.items(), key=lambda item: -item[1][1])[:MAX_JUDGED])

    def encode() -> bytes:  # one too large is written empty
        data = to_json(os.fspath(prefix), boot, merged)
        return data if len(data) <= STORE_LIMIT else to_json(os.fspath(prefix), boot, {})

    return keep_store(root, prefix, STORE_NAME, STORE_LIMIT, encode, "the store of judged bytecode")
