"""The wheel's faults root acknowledged: ``<state>/<env>/wheel-faults.json``, root's, 0600 (the decisions:
:func:`safeinstall.env.drift.acknowledged`; docs/verify.md). Read as every state file is and every field
checked; not bound to the boot; a damaged store is not used (every fault is said again).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from safeinstall.env.containment import is_below
from safeinstall.env.drift import FaultIdentity
from safeinstall.env.inodetrust import HIGHEST, LOWEST
from safeinstall.store.state import (
    StateDirError,
    check_trusted,
    read_private_file,
    store_part,
    trusted_environment_state,
    write_store,
)

STORE_NAME = "wheel-faults.json"
STORE_VERSION = 1
STORE_LIMIT = 16 << 20
#: The most acknowledged files kept (a wheel's RECORD is wrong about a few).
MAX_FAULTS = 10_000
_SHA256 = re.compile(r"[A-Za-z0-9_-]{43}")


def _entry(raw: object, prefix: str) -> FaultIdentity:
    if not isinstance(raw, list) or len(raw) != 7:
        raise ValueError("not an entry")
    location, *numbers, digest = raw
    if not isinstance(location, str) or os.path.normpath(location) != location:
        raise ValueError("not a normal path")
    if not is_below(location, prefix):
        raise ValueError("not a file of the environment")
    if not isinstance(digest, str) or not _SHA256.fullmatch(digest):
        raise ValueError("not a sha256")
    if not all(type(n) is int and LOWEST <= n <= HIGHEST for n in numbers):
        raise ValueError("not numbers")
    device, inode, size, mtime, ctime = numbers
    if min(device, inode, size, ctime) < 0:
        raise ValueError("negative")
    return FaultIdentity(location, device, inode, size, mtime, ctime, digest)


def from_json(raw: bytes, prefix: str) -> dict[str, FaultIdentity]:
    """Pure: the faults acknowledged, every field checked (ValueError: damaged or another's)."""
    entries: list[Any] = store_part(raw, STORE_VERSION, prefix, "faults", list)
    if len(entries) > MAX_FAULTS:
        raise ValueError("more faults than are kept")
    return {entry.location: entry for entry in (_entry(e, prefix) for e in entries)}


def to_json(prefix: str, faults: Iterable[FaultIdentity]) -> bytes:
    """Pure: the store as it is written."""
    document = {
        "version": STORE_VERSION,
        "prefix": prefix,
        "faults": [list(f) for f in sorted(faults)],
    }
    return json.dumps(document, separators=(",", ":")).encode("utf-8", "surrogateescape")


def read_faults(root: Path, prefix: Path) -> tuple[dict[str, FaultIdentity], str | None]:
    """The faults root acknowledged ({} when none, or the store is not believed), with a note when it
    was refused or damaged (every fault is then said again)."""
    state = trusted_environment_state(root, prefix)
    try:
        check_trusted(root)
        if state.problem is not None:
            return {}, None
        raw = read_private_file(state.dir / STORE_NAME, STORE_LIMIT)
        return from_json(raw, os.fspath(prefix)), None
    except FileNotFoundError:
        return {}, None
    except StateDirError as exc:
        return {}, f"the wheel's faults acknowledged were not used: {exc.message}"
    except (ValueError, UnicodeError, RecursionError):
        return {}, "the store of the wheel's faults acknowledged was damaged: each is said again"
    except OSError as exc:
        return {}, f"the wheel's faults acknowledged could not be read ({exc.strerror or exc})"


def keep_faults(root: Path, prefix: Path, faults: Mapping[str, FaultIdentity]) -> str | None:
    """The store written with ``faults`` (the acknowledging check's, replacing what was kept): a note
    when it could not be, else None. Raises nothing."""
    if len(faults) > MAX_FAULTS:
        return f"more than {MAX_FAULTS} wheel faults: none acknowledged"
    try:
        write_store(root, prefix, STORE_NAME, to_json(os.fspath(prefix), faults.values()))
    except StateDirError as exc:
        return f"the wheel's faults were not acknowledged: {exc.message}"
    except (OSError, ValueError, UnicodeError) as exc:
        return f"the wheel's faults were not acknowledged ({exc})"
    return None
