"""A prepared run's record (``--prepare``, docs/prepare.md): what the prepare found, kept beside its
journal so that ``--commit`` can tell whether anything changed since.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from safeinstall.errors import PreparedRunError
from safeinstall.store.state import PREPARED_FILE, EnvironmentState, atomic_write, read_private_file
from safeinstall.system.fields import optional_text as _optional
from safeinstall.system.fields import typed as _typed

PREPARED_VERSION = 1
#: A record holds the identities of the package's files and of its staged tree: vLLM's 60k lines fit.
PREPARED_MAX_BYTES = 64 * 1024 * 1024

#: A file's identity: device, inode, size, mtime_ns, ctime_ns (any change of its bytes moves one)
Identity = tuple[int, ...]


@dataclass(frozen=True, slots=True, kw_only=True)
class PreparedRecord:
    run_id: str
    prepared_at: float  # time.time() when the prepare ended
    prefix: str
    package: str
    changes: tuple[str, ...]  # what the commit changes, as said ("sicext 1.0 -> 2.0")
    options: Mapping[str, Any]  # the run's options, as JSON (safeinstall.run.prepare)
    uv_command: tuple[str, ...]
    units: tuple[str, ...]
    processes: tuple[tuple[int, int], ...]  # (pid, start) of each process the plan found
    files: Mapping[str, Identity]  # the affected distributions' files as installed
    staged_root: str | None = None  # the staging directory's name under the prefix (a swap)
    staged: Mapping[str, Identity] = field(default_factory=dict)  # every entry of the staged tree
    wheel: str | None = None  # the run's copy of the wheel
    wheel_sha256: str | None = None
    backup_dir: str | None = None

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": PREPARED_VERSION,
                "run_id": self.run_id,
                "prepared_at": self.prepared_at,
                "prefix": self.prefix,
                "package": self.package,
                "changes": list(self.changes),
                "options": dict(self.options),
                "uv_command": list(self.uv_command),
                "units": list(self.units),
                "processes": [list(p) for p in self.processes],
                "files": {k: list(v) for k, v in self.files.items()},
                "staged_root": self.staged_root,
                "staged": {k: list(v) for k, v in self.staged.items()},
                "wheel": self.wheel,
                "wheel_sha256": self.wheel_sha256,
                "backup_dir": self.backup_dir,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: bytes) -> PreparedRecord:
        """The record, every field checked; PreparedRunError saying what is wrong."""
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict) or doc.get("version") != PREPARED_VERSION:
                raise ValueError("not a prepared run's record of this version")
            return cls(
                run_id=_typed(doc["run_id"], str),
                prepared_at=float(_typed(doc["prepared_at"], (int, float))),
                prefix=_typed(doc["prefix"], str),
                package=_typed(doc["package"], str),
                changes=tuple(_typed(c, str) for c in _typed(doc["changes"], list)),
                options=_typed(doc["options"], dict),
                uv_command=tuple(_typed(c, str) for c in _typed(doc["uv_command"], list)),
                units=tuple(_typed(u, str) for u in _typed(doc["units"], list)),
                processes=tuple(_pair(p) for p in _typed(doc["processes"], list)),
                files=_identities(doc["files"]),
                staged_root=_optional(doc.get("staged_root")),
                staged=_identities(doc.get("staged", {})),
                wheel=_optional(doc.get("wheel")),
                wheel_sha256=_optional(doc.get("wheel_sha256")),
                backup_dir=_optional(doc.get("backup_dir")),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise PreparedRunError(
                f"the prepared run's record is damaged: {exc}",
                hint="safeinstall --discard --python PY drops the prepared run; then prepare again",
            ) from exc


def _pair(value: Any) -> tuple[int, int]:
    pid, start = _typed(value, list)
    return int(_typed(pid, int)), int(_typed(start, int))


def _identities(value: Any) -> dict[str, Identity]:
    return {
        _typed(k, str): tuple(int(_typed(n, int)) for n in _typed(v, list))
        for k, v in _typed(value, dict).items()
    }


def write_prepared(state: EnvironmentState, record: PreparedRecord) -> None:
    """Write the record (under the lock, before the journal says ``prepared``)."""
    atomic_write(state.dir / PREPARED_FILE, record.to_json().encode("utf-8", errors="surrogateescape"))


def read_prepared(state: EnvironmentState) -> PreparedRecord | None:
    """The record beside the journal, or None; PreparedRunError (or StateDirError) when it is not one."""
    try:
        raw = read_private_file(state.dir / PREPARED_FILE, PREPARED_MAX_BYTES)
    except FileNotFoundError:
        return None
    return PreparedRecord.from_json(raw)
