"""The RECORDs root found clean: ``<state>/<env>/records.json``, root's, 0600.

Read with the state directory's checks; a damaged store is not used and is written anew. The
decisions: :mod:`safeinstall.env.recorded`.
"""

from __future__ import annotations

import base64
import functools
import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safeinstall.env.containment import base
from safeinstall.env.recorded import KeptRecord
from safeinstall.store.state import keep_store, load_store, store_part

STORE_NAME = "records.json"
STORE_VERSION = 1
STORE_LIMIT = 256 << 20
_DIGEST = re.compile(r"[A-Za-z0-9_-]{43}")


def from_json(raw: bytes, prefix: str) -> dict[str, KeptRecord]:
    """Pure: the RECORDs kept, every field checked (ValueError: damaged or another environment's)."""
    records: dict[Any, Any] = store_part(raw, STORE_VERSION, prefix, "records", dict)
    below = base(prefix)
    found: dict[str, KeptRecord] = {}
    for dist_info, value in records.items():
        if (
            not isinstance(dist_info, str)
            or os.path.normpath(dist_info) != dist_info
            or not dist_info.startswith(below)
        ):
            raise ValueError("not a .dist-info of the environment")
        if not isinstance(value, list) or len(value) != 2 or not all(isinstance(v, str) for v in value):
            raise ValueError("not a record")
        digest, text = value
        lines = base64.b64decode(text.encode("ascii"), validate=True)
        if not _DIGEST.fullmatch(digest) or len(lines) % 16:
            raise ValueError("not a record's digest and lines")
        found[dist_info] = KeptRecord(digest, lines)
    return found


def to_json(prefix: str, records: Mapping[str, KeptRecord]) -> bytes:
    document = {
        "version": STORE_VERSION,
        "prefix": prefix,
        "records": {
            path: [kept.digest, base64.b64encode(kept.lines).decode("ascii")]
            for path, kept in sorted(records.items())
        },
    }
    return json.dumps(document, separators=(",", ":")).encode("utf-8", "surrogateescape")


def read_records(root: Path, prefix: Path) -> tuple[dict[str, KeptRecord] | None, str | None]:
    """The RECORDs kept for the environment ({} when none, or damaged: written anew), with a note when
    the store was refused; None when the state directory is not trusted (nothing is kept then)."""
    what = "the store of RECORDs found clean"
    parse = functools.partial(from_json, prefix=os.fspath(prefix))
    damaged = f"{what} was damaged: written anew"
    return load_store(root, prefix, STORE_NAME, STORE_LIMIT, parse, {}, what, damaged=damaged)


def keep_records(
    root: Path, prefix: Path, kept: Mapping[str, KeptRecord] | None, updates: Mapping[str, KeptRecord]
) -> str | None:
    """The store with ``updates`` in (best effort; a note when it could not be written)."""
    if kept is None or not updates:
        return None
    encode = functools.partial(to_json, os.fspath(prefix), {**kept, **updates})
    return keep_store(root, prefix, STORE_NAME, STORE_LIMIT, encode, "the store of RECORDs found clean")
