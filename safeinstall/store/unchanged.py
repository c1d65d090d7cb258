"""The clean distributions of an environment: ``<state>/<env>/unchanged.json``, root's, 0600.

Read with the state directory's checks, every field checked; a damaged entry is left out, not the
whole store. The decisions: :mod:`safeinstall.env.unchanged`; the argument: docs/verify.md.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from safeinstall.env.containment import is_below
from safeinstall.env.inodetrust import HIGHEST, LOWEST
from safeinstall.env.unchanged import (
    FILE_IDENTITY,
    DirIdentity,
    UnchangedDistribution,
    UnchangedStore,
    is_settled,
    still_believed,
    updated,
)
from safeinstall.store.inodestore import boot_id
from safeinstall.store.state import (
    StateDirError,
    load_store,
    write_store,
)

STORE_NAME = "unchanged.json"
#: 2: each distribution's oldest hash (``hashed``), negative modification times
STORE_VERSION = 2
#: The most bytes it may have: a million files' identities (base64) and their directories.
STORE_LIMIT = 256 << 20


def _ints(value: object, count: int, signed: int = -1) -> tuple[int, ...]:
    """The ``count`` numbers of ``value``, each within 0 and 2**63, but the one at ``signed`` (a
    modification time) within -2**63 and 2**63."""
    if (
        not isinstance(value, list)
        or len(value) != count
        or not all(
            type(v) is int and (LOWEST if i == signed else 0) <= v <= HIGHEST for i, v in enumerate(value)
        )
    ):
        raise ValueError(f"not {count} numbers")
    return tuple(value)


def _path(value: object, prefix: str | None = None) -> str:
    if (
        not isinstance(value, str)
        or not value.startswith("/")
        or "\0" in value
        or os.path.normpath(value) != value
    ):
        raise ValueError("not an absolute, normal path")
    if prefix is not None and value != prefix and not is_below(value, prefix):
        raise ValueError(f"{value} is not within {prefix}")
    return value


_ENTRY_KEYS = frozenset({"dist_info", "since", "hashed", "record", "files", "identities"})


def _distribution(raw: object, now_ns: int) -> UnchangedDistribution | None:
    if not isinstance(raw, dict) or set(raw) != _ENTRY_KEYS:
        raise ValueError("not a distribution's entry")
    dist_info = _path(raw["dist_info"])
    since, hashed = _ints([raw["since"], raw["hashed"]], 2)
    record = _ints(raw["record"], 5, signed=3)
    (files,) = _ints([raw["files"]], 1)
    if not isinstance(raw["identities"], str):
        raise ValueError("identities are not text")
    identities = base64.b64decode(raw["identities"].encode("ascii"), validate=True)
    if len(identities) != files * FILE_IDENTITY.size:
        raise ValueError(f"{len(identities)} bytes of identities, not those of {files} files")
    if (
        hashed > since
        or not still_believed(since, now_ns)
        or not still_believed(hashed, now_ns)
        or not is_settled(record[4], since)
    ):
        return None  # too old, from the future, or its RECORD racy: not believed
    return UnchangedDistribution(dist_info, since, hashed, record, files, identities)  # type: ignore[arg-type]


def from_json(raw: bytes, prefix: str, boot: str, now_ns: int) -> UnchangedStore:
    """Pure: a store read back, every field checked (ValueError: damaged, another environment's or
    another boot's); entries no longer believable are left out."""
    document: Any = json.loads(raw)
    if not isinstance(document, dict) or document.get("version") != STORE_VERSION:
        raise ValueError("not a store of this version")
    if document.get("prefix") != prefix:
        raise ValueError(f"it is the store of {document.get('prefix')!r}, not of {prefix}")
    if document.get("boot") != boot:
        raise ValueError("it was written before the last boot")
    dists, dirs = document.get("distributions"), document.get("directories")
    if not isinstance(dists, list) or not isinstance(dirs, dict):
        raise ValueError("no distributions or directories")
    distributions: dict[str, UnchangedDistribution] = {}
    for item in dists:
        with contextlib.suppress(ValueError, UnicodeError, binascii.Error):  # damaged: left out
            entry = _distribution(item, now_ns)
            if entry is not None:
                distributions[entry.dist_info] = entry
    directories: dict[str, tuple[DirIdentity, int]] = {}
    for path, value in dirs.items():
        with contextlib.suppress(ValueError):  # damaged: left out
            numbers = _ints(value, 5, signed=2)
            identity, since = numbers[:4], numbers[4]
            if still_believed(since, now_ns) and is_settled(identity[3], since):
                directories[_path(path, prefix)] = (identity, since)  # type: ignore[assignment]
    return UnchangedStore(prefix, boot, distributions, directories)


def to_json(store: UnchangedStore) -> bytes:
    """Pure: the store as it is written."""
    document = {
        "version": STORE_VERSION,
        "boot": store.boot_id,
        "prefix": store.prefix,
        "distributions": [
            {
                "dist_info": d.dist_info,
                "since": d.since_ns,
                "hashed": d.hashed_ns,
                "record": list(d.record),
                "files": d.files,
                "identities": base64.b64encode(d.identities).decode("ascii"),
            }
            for d in store.distributions.values()
        ],
        "directories": {path: [*identity, since] for path, (identity, since) in store.directories.items()},
    }
    return json.dumps(document, separators=(",", ":")).encode("utf-8", "surrogateescape")


def read_unchanged(root: Path, prefix: Path) -> tuple[UnchangedStore | None, str | None]:
    """The environment's clean distributions under the state ``root`` (an empty store when there is
    none or it cannot be believed), and a note saying why, when one was refused; None when nothing may
    be kept: this boot's id is not known, or the state directory is not trusted (which the
    verified-inode store's note says), or the store is not root's own file (its note says so)."""
    boot = boot_id()
    if boot is None:
        return None, None
    what = "the store of clean distributions"
    oversize = f"{what} was larger than {STORE_LIMIT} bytes: written anew"  # root's own, too large

    def parse(raw: bytes) -> UnchangedStore:
        return from_json(raw, os.fspath(prefix), boot, time.time_ns())

    # damaged, or another boot's: checked as before, and written anew
    empty = UnchangedStore(os.fspath(prefix), boot, {}, {})
    return load_store(root, prefix, STORE_NAME, STORE_LIMIT, parse, empty, what, oversize=oversize)


def keep_unchanged(
    root: Path,
    prefix: Path,
    store: UnchangedStore | None,
    checked: Iterable[str],
    proven: Iterable[str],
    fresh: Sequence[UnchangedDistribution],
    directories: dict[str, tuple[DirIdentity, int]],
) -> str | None:
    """After a check of the distributions ``checked`` (their ``.dist-info``): the store with what it
    proved and found clean (best effort; a note when it could not be written). ``store`` None: not to
    be used, nor written. One that would be larger than :data:`STORE_LIMIT` is written empty."""
    if store is None:
        return None
    new = updated(store, checked, proven, fresh, directories, time.time_ns())
    if new.distributions == store.distributions and new.directories == store.directories:
        return None
    note = None
    try:
        data = to_json(new)
        if len(data) > STORE_LIMIT:
            note = f"the store of clean distributions would be larger than {STORE_LIMIT} bytes: emptied"
            data = to_json(UnchangedStore(new.prefix, new.boot_id, {}, {}))
        write_store(root, prefix, STORE_NAME, data)
    except StateDirError as exc:
        return f"the store of clean distributions was not kept: {exc.message}"
    except OSError as exc:
        return f"the store of clean distributions was not kept ({exc.strerror or exc})"
    except (ValueError, UnicodeError) as exc:  # never expected: best effort, not a crash
        return f"the store of clean distributions was not kept ({exc})"
    return note
