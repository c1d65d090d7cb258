"""Each distribution's install as root first saw it: ``<state>/<env>/anchors.json``, root's, 0600 (the
decisions: :func:`safeinstall.env.bytecode.anchored_window`; docs/verify.md). Read as every state file
is and every field checked; not bound to the boot; a check never replaces an anchor.
"""

from __future__ import annotations

import json
import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Any

from safeinstall.env.bytecode import Anchor
from safeinstall.env.containment import is_below
from safeinstall.env.verified import HIGHEST
from safeinstall.store.state import (
    StateDirError,
    atomic_write,
    check_trusted,
    ensure_environment_dir,
    read_private_file,
    store_part,
    trusted_environment_state,
)

STORE_NAME = "anchors.json"
STORE_VERSION = 1
STORE_LIMIT = 64 << 20


def from_json(raw: bytes, prefix: str) -> dict[str, Anchor]:
    """Pure: the anchors kept, every field checked (ValueError: damaged or another environment's)."""
    anchors: dict[Any, Any] = store_part(raw, STORE_VERSION, prefix, "anchors", dict)
    found: dict[str, Anchor] = {}
    for dist_info, value in anchors.items():
        if (
            not isinstance(dist_info, str)
            or os.path.normpath(dist_info) != dist_info
            or not is_below(dist_info, prefix)
        ):
            raise ValueError("not a .dist-info of the environment")
        if (
            not isinstance(value, list)
            or len(value) != 3
            or not all(type(n) is int and 0 <= n <= HIGHEST for n in value)
        ):
            raise ValueError("not an anchor")
        found[dist_info] = Anchor(*value)
    return found


def to_json(prefix: str, anchors: Mapping[str, Anchor]) -> bytes:
    """Pure: the store as it is written."""
    document = {
        "version": STORE_VERSION,
        "prefix": prefix,
        "anchors": {path: list(anchor) for path, anchor in sorted(anchors.items())},
    }
    return json.dumps(document, separators=(",", ":")).encode("utf-8", "surrogateescape")


def read_anchors(root: Path, prefix: Path) -> tuple[dict[str, Anchor] | None, str | None]:
    """The anchors kept ({} when none or damaged), with a note when the store was refused; None when
    the state directory is not trusted (then no window is trusted: every ``.pyc`` is compiled)."""
    state = trusted_environment_state(root, prefix)
    try:
        check_trusted(root)
        if state.problem is not None:
            return None, None
        raw = read_private_file(state.dir / STORE_NAME, STORE_LIMIT)
        return from_json(raw, os.fspath(prefix)), None
    except FileNotFoundError:
        return {}, None
    except StateDirError as exc:
        return None, f"the store of install anchors was not used: {exc.message}"
    except (ValueError, UnicodeError, RecursionError):
        return {}, "the store of install anchors was damaged: written anew"
    except OSError as exc:
        return None, f"the store of install anchors could not be read ({exc.strerror or exc})"


def keep_anchors(
    root: Path, prefix: Path, kept: Mapping[str, Anchor] | None, fresh: Mapping[str, Anchor]
) -> str | None:
    """The store with ``fresh`` anchors added, none replaced (best effort: a note when not written)."""
    if kept is None or not fresh:
        return None
    try:
        data = to_json(os.fspath(prefix), {**fresh, **kept})
        if len(data) > STORE_LIMIT:
            return f"the store of install anchors would be larger than {STORE_LIMIT} bytes: not kept"
        state = trusted_environment_state(root, prefix)
        ensure_environment_dir(state)
        atomic_write(state.dir / STORE_NAME, data)
    except StateDirError as exc:
        return f"the store of install anchors was not kept: {exc.message}"
    except (OSError, ValueError, UnicodeError) as exc:
        return f"the store of install anchors was not kept ({exc})"
    return None


def forget_anchors(root: Path, prefix: Path, names: Collection[str]) -> str | None:
    """The store without the anchors of the distributions ``names`` (canonical): a run installed them
    anew, verified, so the next check anchors their new RECORDs (best effort: a note when not written)."""
    kept, note = read_anchors(root, prefix)
    if not kept:
        return note
    left = {key: anchor for key, anchor in kept.items() if _anchored_name(key) not in names}
    if len(left) == len(kept):
        return note
    try:
        atomic_write(
            trusted_environment_state(root, prefix).dir / STORE_NAME, to_json(os.fspath(prefix), left)
        )
    except StateDirError as exc:
        return f"the store of install anchors was not kept: {exc.message}"
    except OSError as exc:
        return f"the store of install anchors was not kept ({exc.strerror or exc})"
    return note


def _anchored_name(key: str) -> str:
    """Pure: the canonical name of an anchor's key (``SITE/name-version.dist-info``)."""
    return os.path.basename(key).removesuffix(".dist-info").rsplit("-", 1)[0]
