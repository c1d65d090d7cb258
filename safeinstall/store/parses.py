"""The RECORDs earlier checks parsed: ``<state>/<env>/parses.json``, root's, 0600.

Read with the state directory's checks (:func:`~safeinstall.store.state.load_store`, ``store_part``),
every field checked, a column at a time; a damaged store is not used and is written anew. What is
believed of it: :class:`safeinstall.env.distributions.ParsedRecords`; docs/verify.md.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Mapping
from itertools import repeat
from pathlib import Path
from typing import Any

from safeinstall.env.containment import base
from safeinstall.env.distributions import KeptParse, plain_locations
from safeinstall.env.inodetrust import HIGHEST, LOWEST
from safeinstall.env.records import ACCEPTED_ALGORITHMS, Record, RecordEntry, RecordHash, RecordProblem
from safeinstall.store.state import keep_store, load_store, store_part

STORE_NAME = "parses.json"
STORE_VERSION = 1
#: The most bytes it may have (a million RECORD lines, as a scan parses at most, about 250 MB).
STORE_LIMIT = 384 << 20
_ALGORITHMS = ACCEPTED_ALGORITHMS | {""}
_new = tuple.__new__


def _numbers(values: object, count: int) -> list[int]:
    if (
        not isinstance(values, list)
        or len(values) != count
        or not all(type(v) is int and LOWEST <= v <= HIGHEST for v in values)
    ):
        raise ValueError(f"not {count} numbers")
    return values


def _strings(value: object, count: int) -> list[str]:
    if not isinstance(value, list) or len(value) != count or set(map(type, value)) - {str}:
        raise ValueError("not a column of text")
    return value


def _problems(raw: object) -> tuple[RecordProblem, ...]:
    if not isinstance(raw, list):
        raise ValueError("no problems")
    found: list[RecordProblem] = []
    for item in raw:
        if (
            not isinstance(item, list)
            or len(item) != 3
            or type(item[0]) is not int
            or not all(isinstance(v, str) for v in item[1:])
        ):
            raise ValueError("not a problem")
        found.append(RecordProblem(item[0], item[1], item[2]))
    return tuple(found)


def kept_parse(raw: object, path: str) -> KeptParse:
    """Pure: the parse kept of the RECORD at ``path``, every column checked (ValueError: damaged); its
    entries and where they live built a column at a time, not a Python call per line."""
    if not isinstance(raw, list) or len(raw) != 7:
        raise ValueError("not a parse")
    identity, lines, paths, algorithms, digests, sizes, problems = raw
    dev, ino, size, mtime, ctime = _numbers(identity, 5)
    count = len(paths) if isinstance(paths, list) else -1
    if type(lines) is not int or not count <= lines <= HIGHEST or min(dev, ino, size, ctime) < 0:
        raise ValueError("not a RECORD's numbers")
    paths, algorithms, digests = (_strings(v, count) for v in (paths, algorithms, digests))
    joined = "\0".join(paths)
    if (
        "" in paths
        or joined.count("\0") != max(count - 1, 0)
        or not set(algorithms) <= _ALGORITHMS
        or list(map(bool, algorithms)) != list(map(bool, digests))
    ):
        raise ValueError("not RECORD entries")
    if not isinstance(sizes, list) or len(sizes) != count or set(map(type, sizes)) - {int, type(None)}:
        raise ValueError("not a column of sizes")
    known = [s for s in sizes if s is not None]
    if known and (min(known) < 0 or max(known) >= 10**20):
        raise ValueError("a size out of range")
    hashes: list[RecordHash | None] = list(
        map(_new, repeat(RecordHash), zip(algorithms, digests, strict=True))
    )
    for index in [i for i, algorithm in enumerate(algorithms) if not algorithm]:
        hashes[index] = None
    entries = tuple(map(_new, repeat(RecordEntry), zip(paths, hashes, sizes, strict=True)))
    record = Record(entries, _problems(problems))
    located = plain_locations(os.path.dirname(os.path.dirname(path)), entries, paths)
    return KeptParse((dev, ino, size, mtime, ctime), lines, record, located)


def from_json(raw: bytes, prefix: str) -> dict[str, KeptParse]:
    """Pure: the parses kept, by RECORD path (ValueError: damaged or another environment's)."""
    records: dict[Any, Any] = store_part(raw, STORE_VERSION, prefix, "records", dict)
    below = base(prefix)
    found: dict[str, KeptParse] = {}
    for path, value in records.items():
        if not isinstance(path, str) or os.path.normpath(path) != path or not path.startswith(below):
            raise ValueError("not a RECORD of the environment")
        found[path] = kept_parse(value, path)
    return found


def _column(kept: KeptParse) -> list[object]:
    entries = kept.record.entries
    return [
        list(kept.identity),
        kept.lines,
        [e.path for e in entries],
        ["" if e.hash is None else e.hash.algorithm for e in entries],
        ["" if e.hash is None else e.hash.digest for e in entries],
        [e.size for e in entries],
        [[p.line, p.text, p.reason] for p in kept.record.problems],
    ]


def to_json(prefix: str, parses: Mapping[str, KeptParse]) -> bytes:
    import json

    document = {
        "version": STORE_VERSION,
        "prefix": prefix,
        "records": {path: _column(kept) for path, kept in sorted(parses.items())},
    }
    return json.dumps(document, separators=(",", ":")).encode("utf-8", "surrogateescape")


def read_parses(root: Path, prefix: Path) -> tuple[dict[str, KeptParse] | None, str | None]:
    """The RECORDs' parses kept for the environment ({} when none, or damaged: written anew), with a
    note when the store was refused; None when the state directory is not trusted (nothing kept)."""
    what = "the store of parsed RECORDs"
    parse = functools.partial(from_json, prefix=os.fspath(prefix))
    damaged = f"{what} was damaged: written anew"
    return load_store(root, prefix, STORE_NAME, STORE_LIMIT, parse, {}, what, damaged=damaged)


def keep_parses(root: Path, prefix: Path, seen: Mapping[str, KeptParse]) -> str | None:
    """The store written anew with this check's parses ``seen`` (best effort; a note when it could not
    be written). Only the RECORDs this check read are kept: one gone from the environment is dropped."""
    encode = functools.partial(to_json, os.fspath(prefix), seen)
    return keep_store(root, prefix, STORE_NAME, STORE_LIMIT, encode, "the store of parsed RECORDs")
