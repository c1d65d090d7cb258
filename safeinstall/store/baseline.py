"""The environment's baseline: the files a run verified against its wheel where the wheel's own RECORD
says otherwise, kept in ``baseline.json`` (root's) so a later check says ``wheel-record``, not drift.

The pure part is :mod:`safeinstall.env.vouched`; why it can be trusted: docs/verify.md.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from safeinstall.env.vouched import BASELINE_VERSION, EMPTY, KEPT_PER_DISTRIBUTION, Baseline, Vouched, updated
from safeinstall.store.state import (
    EnvironmentState,
    StateDirError,
    atomic_write,
    check_trusted,
    is_run_id,
    read_private_file,
    trusted_environment_state,
)
from safeinstall.system.fields import nonempty_text

BASELINE_NAME = "baseline.json"
#: the most bytes a baseline may have (one line per file a wheel's RECORD is wrong about: a few)
BASELINE_LIMIT = 16 << 20


def to_dict(baseline: Baseline) -> dict[str, Any]:
    return {
        "baseline_version": BASELINE_VERSION,
        "prefix": baseline.prefix,
        "distributions": {
            name: [
                {
                    "version": v.version,
                    "dist_info": v.dist_info,
                    "record": v.record,
                    "run_id": v.run_id,
                    "wheel": v.wheel,
                    "files": dict(sorted(v.files.items())),
                }
                for v in entries
            ]
            for name, entries in sorted(baseline.distributions.items())
        },
    }


def _vouched(data: Any) -> Vouched:
    if not isinstance(data, dict):
        raise ValueError("each distribution must be an object")
    dist_info, run_id = nonempty_text(data, "dist_info"), nonempty_text(data, "run_id")
    if not os.path.isabs(dist_info) or os.path.normpath(dist_info) != dist_info:
        raise ValueError(f"dist_info {dist_info!r} is not a normalised absolute path")
    if not is_run_id(run_id):
        raise ValueError(f"run_id {run_id!r} is not a run id")
    files = data.get("files")
    if not isinstance(files, dict) or not files:
        raise ValueError("files must be a non-empty object")
    for location, key in files.items():
        if not isinstance(location, str) or not isinstance(key, str):
            raise ValueError("files must map locations to strings")
        if not os.path.isabs(location) or os.path.normpath(location) != location:
            raise ValueError(f"{location!r} is not a normalised absolute path")
        if not key.startswith(("sha256=", "sha384=", "sha512=")):
            raise ValueError(f"{location!r}: {key!r} is not the state of a regular file")
    version, record, wheel = (nonempty_text(data, key) for key in ("version", "record", "wheel"))
    return Vouched(version, dist_info, record, run_id, wheel, files)


def from_dict(data: Any, prefix: str) -> Baseline:
    """Pure: a baseline read back, every field checked (ValueError: damaged). One of another
    environment (its prefix is not ``prefix``) is refused too."""
    if not isinstance(data, dict) or data.get("baseline_version") != BASELINE_VERSION:
        raise ValueError("not a baseline of this version")
    if data.get("prefix") != prefix:
        raise ValueError(f"it is the baseline of {data.get('prefix')!r}, not of {prefix}")
    distributions = data.get("distributions")
    if not isinstance(distributions, dict):
        raise ValueError("distributions must be an object")
    if not all(isinstance(name, str) and name for name in distributions):
        raise ValueError("distributions must be keyed by name")
    for entries in distributions.values():
        if not isinstance(entries, list) or not 0 < len(entries) <= KEPT_PER_DISTRIBUTION:
            raise ValueError(f"each distribution must list 1 to {KEPT_PER_DISTRIBUTION} entries")
    return Baseline(
        prefix, {name: tuple(_vouched(v) for v in entries) for name, entries in distributions.items()}
    )


def baseline_file(state: EnvironmentState) -> Path:
    return state.dir / BASELINE_NAME


def load_baseline(state: EnvironmentState, prefix: str) -> Baseline:
    """The environment's baseline (EMPTY when there is none). Raises StateDirError when the file
    cannot be believed (not root's or the caller's, writable by others, a symlink) and ValueError when
    it is damaged or another environment's."""
    try:
        raw = read_private_file(baseline_file(state), BASELINE_LIMIT)
    except FileNotFoundError:
        return EMPTY
    try:
        return from_dict(json.loads(raw), prefix)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"not JSON ({exc})") from exc
    except RecursionError as exc:  # nested deeper than the parser goes: never a baseline safeinstall wrote
        raise ValueError("nested too deep") from exc


def save_baseline(state: EnvironmentState, baseline: Baseline) -> None:
    """Written atomically, 0600, in the environment's state directory (root's)."""
    path = baseline_file(state)
    if not baseline.distributions:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)
        return
    atomic_write(path, json.dumps(to_dict(baseline), sort_keys=True).encode())


def read_vouched(root: Path, prefix: Path) -> tuple[Mapping[str, tuple[Vouched, ...]], str | None]:
    """The environment's baseline under the state ``root`` (empty when there is none), or empty and
    why it was not used: a state directory or file others could have written, a damaged file."""
    state = trusted_environment_state(root, prefix)
    try:
        check_trusted(root)
        if state.problem is not None:
            raise StateDirError(f"its directory {state.dir}: {state.problem}")
        return load_baseline(state, os.fspath(prefix)).distributions, None
    except StateDirError as exc:
        why = exc.message
    except ValueError as exc:
        why = f"it is damaged ({exc})"
    except OSError as exc:
        why = f"it could not be read ({exc.strerror or exc})"
    return {}, f"the environment's baseline {baseline_file(state)} was not used: {why}"


def record_run(state: EnvironmentState, prefix: Path, name: str, vouched: Vouched | None) -> str | None:
    """After a good run (under its lock) that verified ``name`` against a wheel whose RECORD is wrong
    (``vouched``; None: nothing to keep): its entry into the baseline. Returns a note when the baseline
    could not be kept (best effort: the run itself is done)."""
    if vouched is None:
        return None
    note = None
    try:
        current = load_baseline(state, os.fspath(prefix))
    except (StateDirError, ValueError, OSError) as exc:  # written over: it is the run's own state
        current = EMPTY
        note = f"the environment's baseline was unusable and is written anew ({exc})"
    try:
        save_baseline(state, updated(current, os.fspath(prefix), name, vouched))
    except OSError as exc:
        return f"the environment's baseline was not kept ({exc.strerror or exc})"
    return note
