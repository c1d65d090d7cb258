"""A prepared run's record (``--prepare``, docs/prepare.md): what the prepare found, kept beside its
journal so that ``--commit`` can tell whether anything changed since.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from safeinstall.env.inodes import HashedInode
from safeinstall.env.uvplan import UvChange, UvPlan
from safeinstall.env.wheel import WheelMember
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
    options: Mapping[str, Any]  # the run's options, as JSON (safeinstall.run.steps.prepare)
    uv_command: tuple[str, ...]
    units: tuple[str, ...]
    processes: tuple[tuple[int, int], ...]  # (pid, start) of each process the plan found
    files: Mapping[str, Identity]  # the affected distributions' files as installed
    staged_root: str | None = None  # the staging directory's name under the prefix (a swap)
    staged: Mapping[str, Identity] = field(default_factory=dict)  # every entry of the staged tree
    #: the files the prepare verified in the staged tree (None: a record that does not say: the commit
    #: verifies the tree again)
    staged_files: int | None = None
    wheel: str | None = None  # the run's copy of the wheel
    wheel_sha256: str | None = None
    #: the copy's identity, taken before its hash (empty: a record without it, the copy is hashed again)
    wheel_identity: Identity = ()
    backup_dir: str | None = None
    # what lets the commit skip the prepare's expensive work when nothing changed (docs/prepare.md):
    #: uv's plan as the prepare had it (the commit does not ask uv again)
    uv_plan: UvPlan | None = None
    #: the wheel's members as the prepare hashed them (the commit reads the same bytes: same sha256)
    members: Mapping[str, WheelMember] = field(default_factory=dict)
    #: the run's uv cache as hashed before the staging tree was verified: the staged files' inodes
    cache_hashed: Mapping[tuple[int, int], HashedInode] = field(default_factory=dict)
    #: the root-owned files of the environment as the prepare hashed them (by inode)
    before_hashed: Mapping[tuple[int, int], HashedInode] = field(default_factory=dict)
    #: the environment's site and scripts directories by identity: an entry added or removed moves one
    dirs: Mapping[str, Identity] = field(default_factory=dict)

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
                "staged_files": self.staged_files,
                "wheel": self.wheel,
                "wheel_sha256": self.wheel_sha256,
                "wheel_identity": list(self.wheel_identity),
                "backup_dir": self.backup_dir,
                "uv_plan": None if self.uv_plan is None else _plan_json(self.uv_plan),
                "members": {
                    k: [m.size, m.sha256, *(m.listed_digest or (None, None))] for k, m in self.members.items()
                },
                "cache_hashed": _hashed_json(self.cache_hashed),
                "before_hashed": _hashed_json(self.before_hashed),
                "dirs": {k: list(v) for k, v in self.dirs.items()},
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
                staged_files=_count(doc.get("staged_files")),
                wheel=_optional(doc.get("wheel")),
                wheel_sha256=_optional(doc.get("wheel_sha256")),
                wheel_identity=_identities({"wheel": doc.get("wheel_identity", [])})["wheel"],
                backup_dir=_optional(doc.get("backup_dir")),
                uv_plan=_plan(doc.get("uv_plan")),
                members=_members(doc.get("members", {})),
                cache_hashed=_hashed(doc.get("cache_hashed", [])),
                before_hashed=_hashed(doc.get("before_hashed", [])),
                dirs=_identities(doc.get("dirs", {})),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise PreparedRunError(
                f"the prepared run's record is damaged: {exc}",
                hint="safeinstall --discard --python PY drops the prepared run; then prepare again",
            ) from exc


def _count(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise TypeError(f"{value!r} is not a count of files")
    return value


def _pair(value: Any) -> tuple[int, int]:
    pid, start = _typed(value, list)
    return int(_typed(pid, int)), int(_typed(start, int))


#: what an identity's numbers are (``bool`` is no ``int`` here), and a hashed inode's row, by ``type``
_INTS = frozenset({int})
_HASHED_TYPES = (int, int, str, int, int, int, int, str, int)


def _identities(value: Any) -> dict[str, Identity]:
    """Each path's identity (a record holds tens of thousands: checked by ``type``, not one call each)."""
    found: dict[str, Identity] = {}
    for key, numbers in _typed(value, dict).items():
        if type(key) is not str or type(numbers) is not list or not _INTS.issuperset(map(type, numbers)):
            raise TypeError(f"{key!r}: {numbers!r} is not an identity")
        found[key] = tuple(numbers)
    return found


def _plan_json(plan: UvPlan) -> dict[str, Any]:
    return {
        "command": list(plan.command),
        "changes": [[c.action, c.name, c.version, c.source] for c in plan.changes],
        "output": plan.output,
        "lock_note": plan.lock_note,
    }


def _plan(value: Any) -> UvPlan | None:
    if value is None:
        return None
    doc = _typed(value, dict)
    changes = []
    for change in _typed(doc["changes"], list):
        action, name, version, source = _typed(change, list)
        changes.append(
            UvChange(_typed(action, str), _typed(name, str), _optional(version), _optional(source))
        )
    return UvPlan(
        command=tuple(_typed(c, str) for c in _typed(doc["command"], list)),
        changes=tuple(changes),
        output=_typed(doc["output"], str),
        lock_note=_optional(doc.get("lock_note")),
    )


def _members(value: Any) -> dict[str, WheelMember]:
    members: dict[str, WheelMember] = {}
    for name, row in _typed(value, dict).items():
        if type(row) is not list or len(row) != 4:
            raise TypeError(f"{name!r}: {row!r} is not a wheel member")
        size, sha256, algorithm, digest = row
        if type(name) is not str or type(size) is not int or type(sha256) is not str:
            raise TypeError(f"{name!r}: {row!r} is not a wheel member")
        listed = None if algorithm is None else (_typed(algorithm, str), _typed(digest, str))
        members[name] = WheelMember(name, size, sha256, listed)
    return members


def _hashed_json(hashed: Mapping[tuple[int, int], HashedInode]) -> list[list[Any]]:
    return [
        [dev, ino, e.path, e.size, e.mtime_ns, e.ctime_ns, e.uid, e.digest, e.hashed_ns]
        for (dev, ino), e in hashed.items()
    ]


def _hashed(value: Any) -> dict[tuple[int, int], HashedInode]:
    hashed: dict[tuple[int, int], HashedInode] = {}
    for row in _typed(value, list):
        if type(row) is not list or len(row) != 9:
            raise TypeError(f"{row!r} is not a hashed inode")
        dev, ino, path, size, mtime, ctime, uid, digest, hashed_ns = row
        if tuple(map(type, row)) != _HASHED_TYPES:
            raise TypeError(f"{row!r} is not a hashed inode")
        hashed[(dev, ino)] = HashedInode(path, size, mtime, ctime, uid, digest, hashed_ns)
    return hashed


def write_prepared(state: EnvironmentState, record: PreparedRecord) -> None:
    """Write the record (under the lock, before the journal says ``prepared``)."""
    atomic_write(state.dir / PREPARED_FILE, record.to_json().encode("utf-8", errors="surrogateescape"))


#: the records this process read, by the file's identity: a commit finds its record, then reads it again
#: under the lock (vLLM's is megabytes of JSON); the same inode, unchanged, is the same record
_READ: dict[tuple[int, ...], PreparedRecord] = {}


def read_prepared(state: EnvironmentState) -> PreparedRecord | None:
    """The record beside the journal, or None; PreparedRunError (or StateDirError) when it is not one."""
    path = state.dir / PREPARED_FILE
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    key = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)
    if key in _READ:
        return _READ[key]
    try:
        raw = read_private_file(path, PREPARED_MAX_BYTES)
    except FileNotFoundError:
        return None
    record = PreparedRecord.from_json(raw)
    try:
        after = os.lstat(path)
    except OSError:
        return record
    if key == (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns):
        _READ.clear()
        _READ[key] = record
    return record
