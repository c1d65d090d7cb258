"""Each distribution's install as root first saw it: ``<state>/<env>/anchors.json``, root's, 0600 (the
decisions: :func:`safeinstall.env.bytecode.anchored_window`; docs/verify.md). Read as every state file
is and every field checked; not bound to the boot; a check never replaces an anchor.
"""

from __future__ import annotations

import functools
import json
import os
import re
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safeinstall.env.bytecode import Anchor
from safeinstall.env.containment import is_below
from safeinstall.env.inodetrust import HIGHEST
from safeinstall.store.state import (
    StateDirError,
    atomic_write,
    keep_store,
    load_store,
    read_private_file,
    store_part,
    trusted_environment_state,
)

if TYPE_CHECKING:  # a check reads its anchors without loading the backup's module
    from safeinstall.store.backup import Backup, BackupDistribution
    from safeinstall.system.safefs import Tree

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
    parse = functools.partial(from_json, prefix=os.fspath(prefix))
    what = "the store of install anchors"
    damaged = f"{what} was damaged: written anew"
    return load_store(root, prefix, STORE_NAME, STORE_LIMIT, parse, {}, what, damaged=damaged)


def keep_anchors(
    root: Path, prefix: Path, kept: Mapping[str, Anchor] | None, fresh: Mapping[str, Anchor]
) -> str | None:
    """The store with ``fresh`` anchors added, none replaced (best effort: a note when not written)."""
    if kept is None or not fresh:
        return None
    encode = functools.partial(to_json, os.fspath(prefix), {**fresh, **kept})
    return keep_store(root, prefix, STORE_NAME, STORE_LIMIT, encode, "the store of install anchors")


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


#: The anchors of the distributions a run backs up, as they were then: ``<backup>/anchors.json``.
BACKUP_NAME = "anchors.json"


def anchor_key(site: str, name: str, version: str) -> str | None:
    """Pure: the key of a distribution's anchor, its ``.dist-info`` as its METADATA names it (canonical
    name and version): one renamed to another spelling of itself is no first sight (the attacker
    review). None for a name or version no directory name can hold (no anchor, no window): a
    METADATA's name is read within 16 MiB, and the store's size is bounded."""
    from packaging.utils import canonicalize_version

    try:
        stem = f"{name}-{canonicalize_version(version, strip_trailing_zero=False)}"
    except ValueError:  # a version of over 4,300 digits: int() refuses (no directory name holds it)
        return None
    if len(stem) > 200 or not re.fullmatch(r"[a-z0-9][a-z0-9._+!-]*", stem):  # a directory name's room
        return None
    return os.path.join(site, f"{stem}.dist-info")


def keep_with_backup(root: Path, prefix: Path, backup: Backup) -> str | None:
    """Into the run's backup (root's 0700 tree): the anchors of the distributions it saved, as they are
    now, for :func:`carry_over` after a rollback or an ``--undo`` (a good run forgets them). Best
    effort: a note when not kept."""
    kept, note = read_anchors(root, prefix)
    keys = {_key_of(prefix, dist) for dist in backup.manifest.distributions}
    mine = {key: anchor for key, anchor in (kept or {}).items() if key in keys}
    if not mine:
        return note
    try:
        atomic_write(backup.dir / BACKUP_NAME, to_json(os.fspath(prefix), mine))
    except OSError as exc:
        return f"the install anchors were not kept with the backup ({exc.strerror or exc})"
    return note


def carry_over(root: Path, prefix: Path, backup: Backup) -> str | None:
    """After a restore of ``backup`` (a rollback's, ``--recover``'s, an ``--undo``'s; checked): each
    distribution whose RECORD was saved as root had anchored it is anchored at the restored RECORD with
    the window it had; what was outside it gets a change time past the RECORD's (docs/verify.md, "The
    window after a restore"). Best effort: a note when not done (then no window, nothing explained)."""
    try:
        before = from_json(read_private_file(backup.dir / BACKUP_NAME, STORE_LIMIT), os.fspath(prefix))
    except FileNotFoundError:
        return None
    except (StateDirError, OSError, ValueError, RecursionError) as exc:
        return f"the install anchors kept with the backup were not used ({exc})"
    from safeinstall.system.safefs import Tree

    saved = {f.path: f for f in backup.manifest.files}
    fresh: dict[str, Anchor] = {}
    with Tree(prefix) as tree:
        records: dict[str, tuple[str, Anchor, os.stat_result]] = {}
        for dist in backup.manifest.distributions:
            record = saved.get(f"{dist.dist_info}/RECORD")
            key = _key_of(prefix, dist)
            anchor = None if key is None else before.get(key)
            if record is None or anchor is None or (record.inode, record.ctime_ns) != anchor[:2]:
                continue  # no window before the run: none after
            now = tree.mark_changed(record.path)
            if now is not None and key is not None:
                records[dist.name] = key, anchor, now
        if not records:
            return None
        time.sleep(_CLOCK_TICK_S)  # a change from now on has a change time past each RECORD's
        for name, (key, anchor, now) in records.items():
            if _carried(tree, prefix, backup, name, (anchor, now)):
                fresh[key] = Anchor(now.st_ino, now.st_ctime_ns, anchor.earliest_ns)
    kept, note = read_anchors(root, prefix)
    if kept is None or not fresh:
        return note
    try:
        atomic_write(
            trusted_environment_state(root, prefix).dir / STORE_NAME,
            to_json(os.fspath(prefix), {**kept, **fresh}),
        )
    except (StateDirError, OSError) as exc:
        return f"the install anchors of the restored distributions were not kept ({exc})"
    return note


def _key_of(prefix: Path, dist: BackupDistribution) -> str | None:
    site = os.path.dirname(os.path.join(os.fspath(prefix), dist.dist_info))
    return anchor_key(site, dist.name, dist.version)


#: Longer than a tick of the clock change times are taken from (the kernel's coarse clock).
_CLOCK_TICK_S = 0.03


def _carried(
    tree: Tree, prefix: Path, backup: Backup, name: str, window: tuple[Anchor, os.stat_result]
) -> bool:
    """One distribution's files and directories as :func:`carry_over` says (``window``: its anchor before
    the run, its RECORD's ``fstat`` now); False when one could not be given a change time past it."""
    anchor, record = window
    own = next(f"{d.dist_info}/RECORD" for d in backup.manifest.distributions if d.name == name)
    from safeinstall.env.drift import Expectation
    from safeinstall.env.hashing import observe_files
    from safeinstall.env.records import encode_digest

    files = [f for f in backup.manifest.files if f.distribution == name and f.link_target is None]
    inside = {
        f.path: f for f in files if f.sha256 and 0 < f.ctime_ns <= anchor.record_ctime_ns and f.path != own
    }
    wanted = [
        Expectation(
            os.path.join(prefix, f.path), "sha256", encode_digest(bytes.fromhex(f.sha256 or "")), f.size
        )
        for f in inside.values()
    ]
    states = observe_files(wanted, within=os.fspath(prefix)) if wanted else {}
    same = {
        path
        for path, f in inside.items()
        if (state := states.get(os.path.join(prefix, path))) is not None
        and state.is_file
        and state.hashed_ns
        and state.digest == encode_digest(bytes.fromhex(f.sha256 or ""))
        and state.ctime_ns <= record.st_ctime_ns
    }
    later = [f.path for f in files if f.path not in same and f.path != own]
    directories = sorted({d for f in files for d in _parents(f.path)}, reverse=True)
    for path in [*later, *directories]:
        moved = tree.mark_changed(path)
        if moved is not None and moved.st_ctime_ns <= record.st_ctime_ns:
            return False
    return True


def _parents(path: str) -> list[str]:
    """Pure: the directories above ``path`` (relative to the prefix), up to its site directory's
    children (``lib/python3.X/site-packages/pkg/sub/mod.py``: ``.../pkg/sub``, ``.../pkg``)."""
    parts = path.split("/")
    site = next((i for i, part in enumerate(parts) if part in ("site-packages", "dist-packages")), None)
    if site is None:
        return []
    return ["/".join(parts[:end]) for end in range(len(parts) - 1, site + 1, -1)]
