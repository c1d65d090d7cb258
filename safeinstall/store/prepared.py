"""A prepared run's record (``--prepare``, docs/prepare.md): what the prepare found, kept beside its
journal so that ``--commit`` can tell whether anything changed since.
"""

from __future__ import annotations

import base64
import json
import os
import sys
from array import array
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from safeinstall.env.inodes import HashedInode
from safeinstall.env.uvplan import UvChange, UvPlan
from safeinstall.env.wheel import WheelMember
from safeinstall.errors import PreparedRunError, one_line
from safeinstall.store.state import PREPARED_FILE, EnvironmentState, atomic_write, read_private_file
from safeinstall.system.fields import optional_text as _optional
from safeinstall.system.fields import typed as _typed

#: 2: the per-file tables as columns (paths below a common directory, numbers packed); 1 is refused
PREPARED_VERSION = 2
#: the formats whose own fields (not the per-file tables) are read: ``--status`` lists, and ``--discard``
#: drops, a prepared run whatever safeinstall made it
SUMMARY_VERSIONS = (1, 2)
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
        """The record in its compact form (format 2, docs/prepare.md): each per-file table as columns."""
        members = list(self.members.values())
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
                "files": _identities_table(self.files),
                "staged_root": self.staged_root,
                "staged": _identities_table(self.staged),
                "staged_files": self.staged_files,
                "wheel": self.wheel,
                "wheel_sha256": self.wheel_sha256,
                "wheel_identity": list(self.wheel_identity),
                "backup_dir": self.backup_dir,
                "uv_plan": None if self.uv_plan is None else _plan_json(self.uv_plan),
                "members": {
                    "count": len(members),
                    "names": _pack_texts([m.name for m in members]),
                    "sizes": _pack_ints([m.size for m in members]),
                    "sha256": _pack_texts([m.sha256 for m in members]),
                    "listed": [[i, *m.listed_digest] for i, m in enumerate(members) if m.listed_digest],
                },
                "cache_hashed": _hashed_table(self.cache_hashed),
                "before_hashed": _hashed_table(self.before_hashed),
                "dirs": {k: list(v) for k, v in self.dirs.items()},
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: bytes, *, summary: bool = False) -> PreparedRecord:
        """The record, every field checked; PreparedRunError saying what is wrong (a record of another
        format: made by another safeinstall, prepare again). ``summary``: its own fields only, the
        per-file tables left empty, of any format (what ``--status`` and ``--discard`` need)."""
        try:
            doc = json.loads(raw)
            if not isinstance(doc, dict):
                raise ValueError("not a prepared run's record")
        except ValueError as exc:
            raise _damaged(exc) from exc
        version = doc.get("version")
        if version != PREPARED_VERSION and not (summary and version in SUMMARY_VERSIONS):
            raise PreparedRunError(
                f"the prepared run's record is of format {one_line(repr(version))}, made by another "
                f"safeinstall; this one reads format {PREPARED_VERSION}: nothing was stopped",
                hint="safeinstall --discard --python PY drops the prepared run; then prepare it again with "
                "this safeinstall",
            )
        try:
            own = cls(
                run_id=_typed(doc["run_id"], str),
                prepared_at=float(_typed(doc["prepared_at"], (int, float))),
                prefix=_typed(doc["prefix"], str),
                package=_typed(doc["package"], str),
                changes=tuple(_typed(c, str) for c in _typed(doc["changes"], list)),
                options=_typed(doc["options"], dict),
                uv_command=tuple(_typed(c, str) for c in _typed(doc["uv_command"], list)),
                units=tuple(_typed(u, str) for u in _typed(doc["units"], list)),
                processes=tuple(_pair(p) for p in _typed(doc["processes"], list)),
                files={},
                staged_root=_optional(doc.get("staged_root")),
                staged_files=_count(doc.get("staged_files")),
                wheel=_optional(doc.get("wheel")),
                wheel_sha256=_optional(doc.get("wheel_sha256")),
                backup_dir=_optional(doc.get("backup_dir")),
            )
            if summary:
                return own
            return replace(
                own,
                files=_identities_from(doc["files"]),
                staged=_identities_from(doc["staged"]),
                wheel_identity=_identities({"wheel": doc.get("wheel_identity", [])})["wheel"],
                uv_plan=_plan(doc.get("uv_plan")),
                members=_members(doc["members"]),
                cache_hashed=_hashed(doc["cache_hashed"]),
                before_hashed=_hashed(doc["before_hashed"]),
                dirs=_identities(doc.get("dirs", {})),
            )
        except (ValueError, KeyError, TypeError) as exc:
            raise _damaged(exc) from exc


def _damaged(exc: Exception) -> PreparedRunError:
    return PreparedRunError(
        f"the prepared run's record is damaged: {one_line(str(exc))}",
        hint="safeinstall --discard --python PY drops the prepared run; then prepare again",
    )


def _count(value: Any) -> int | None:
    if value is None:
        return None
    if type(value) is not int or value < 0:
        raise TypeError(f"{value!r} is not a count of files")
    return value


def _pair(value: Any) -> tuple[int, int]:
    pid, start = _typed(value, list)
    return int(_typed(pid, int)), int(_typed(start, int))


#: what an identity's numbers are (``bool`` is no ``int`` here), by ``type``
_INTS = frozenset({int})


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


#: An identity's numbers (device, inode, mode, size, mtime_ns, ctime_ns) and a hashed inode's (device,
#: inode, size, mtime_ns, ctime_ns, uid, hashed_ns), per row of a table
_IDENTITY_WIDTH = 6
_HASHED_WIDTH = 7
_INT64 = (-(2**63), 2**63 - 1)


def _pack_ints(numbers: list[int]) -> str | list[int]:
    """Pure: the numbers as base64 of little-endian int64s; a JSON list where one does not fit."""
    if numbers and not (_INT64[0] <= min(numbers) and max(numbers) <= _INT64[1]):
        return numbers
    packed = array("q", numbers)
    if sys.byteorder == "big":
        packed.byteswap()
    return base64.b64encode(packed.tobytes()).decode("ascii")


def _unpack_ints(value: Any, count: int) -> list[int]:
    """The ``count`` numbers :func:`_pack_ints` wrote. Raises ValueError (TypeError) when it is not so."""
    if type(value) is list:
        if not _INTS.issuperset(map(type, value)):
            raise TypeError("a column of numbers holds something else")
        numbers: list[int] = value
    else:
        raw = base64.b64decode(_typed(value, str), validate=True)
        packed = array("q")
        if len(raw) != count * packed.itemsize:
            raise ValueError(f"{len(raw)} bytes for {count} numbers")
        packed.frombytes(raw)
        if sys.byteorder == "big":
            packed.byteswap()
        numbers = packed.tolist()
    if len(numbers) != count:
        raise ValueError(f"{len(numbers)} numbers where the table has {count}")
    return numbers


def _pack_texts(texts: list[str]) -> str | list[str]:
    """Pure: the strings joined by NUL (no path or digest holds one); a JSON list where one does."""
    return texts if any("\0" in t for t in texts) else "\0".join(texts)


def _unpack_texts(value: Any, count: int) -> list[str]:
    """The ``count`` strings :func:`_pack_texts` wrote. Raises ValueError (TypeError)."""
    if type(value) is list:
        if not all(type(t) is str for t in value):
            raise TypeError("a column of text holds something else")
        texts: list[str] = value
    else:
        texts = _typed(value, str).split("\0") if count else []
    if len(texts) != count:
        raise ValueError(f"{len(texts)} strings where the table has {count}")
    return texts


def _pack_paths(paths: list[str]) -> dict[str, Any]:
    """Pure: the paths as their common directory (``base``, empty: none) and each one below it."""
    base = ""
    if paths and all(p.startswith("/") for p in paths):  # by string: a path is kept as written ("/./", "//")
        base = os.path.commonprefix(paths).rpartition("/")[0]  # noqa: RUF071 (by character, on purpose)
    cut = len(base) + 1 if base else 0
    return {"count": len(paths), "base": base, "paths": _pack_texts([p[cut:] for p in paths])}


def _unpack_paths(table: Any) -> tuple[int, list[str]]:
    """The row count and the paths of a table :func:`_pack_paths` began. Raises ValueError (TypeError)."""
    count = _count(_typed(table, dict)["count"])
    if count is None:
        raise TypeError("a table without its count")
    base = _typed(table["base"], str)
    below = _unpack_texts(table["paths"], count)
    return count, [f"{base}/{p}" for p in below] if base else below


def _identities_table(identities: Mapping[str, Identity]) -> dict[str, Any]:
    if any(len(v) != _IDENTITY_WIDTH for v in identities.values()):
        return {"rows": {k: list(v) for k, v in identities.items()}}  # the plain form
    return {**_pack_paths(list(identities)), "ints": _pack_ints([n for v in identities.values() for n in v])}


def _identities_from(table: Any) -> dict[str, Identity]:
    if "rows" in _typed(table, dict):
        return _identities(table["rows"])
    count, paths = _unpack_paths(table)
    numbers = iter(_unpack_ints(table["ints"], count * _IDENTITY_WIDTH))
    return dict(zip(paths, zip(*[numbers] * _IDENTITY_WIDTH, strict=True), strict=True))


def _members(value: Any) -> dict[str, WheelMember]:
    doc = _typed(value, dict)
    count = _count(doc["count"]) or 0
    names = _unpack_texts(doc["names"], count)
    digests = _unpack_texts(doc["sha256"], count)
    listed: dict[int, tuple[str, str]] = {}
    for row in _typed(doc["listed"], list):
        index, algorithm, digest = _typed(row, list)
        if type(index) is not int or not 0 <= index < count:
            raise ValueError(f"{row!r} is not a member's listed digest")
        listed[index] = (_typed(algorithm, str), _typed(digest, str))
    sizes = _unpack_ints(doc["sizes"], count)
    return {
        name: WheelMember(name, size, sha256, listed.get(i))
        for i, (name, size, sha256) in enumerate(zip(names, sizes, digests, strict=True))
    }


def _hashed_table(hashed: Mapping[tuple[int, int], HashedInode]) -> dict[str, Any]:
    rows = list(hashed.items())
    return {
        **_pack_paths([e.path for _, e in rows]),
        "digests": _pack_texts([e.digest for _, e in rows]),
        "ints": _pack_ints(
            [n for (d, i), e in rows for n in (d, i, e.size, e.mtime_ns, e.ctime_ns, e.uid, e.hashed_ns)]
        ),
    }


def _hashed(value: Any) -> dict[tuple[int, int], HashedInode]:
    count, paths = _unpack_paths(value)
    digests = _unpack_texts(value["digests"], count)
    numbers = iter(_unpack_ints(value["ints"], count * _HASHED_WIDTH))
    return {
        (dev, ino): HashedInode(path, size, mtime, ctime, uid, digest, hashed_ns)
        for path, digest, (dev, ino, size, mtime, ctime, uid, hashed_ns) in zip(
            paths, digests, zip(*[numbers] * _HASHED_WIDTH, strict=True), strict=True
        )
    }


def write_prepared(state: EnvironmentState, record: PreparedRecord) -> None:
    """Write the record (under the lock, before the journal says ``prepared``)."""
    atomic_write(state.dir / PREPARED_FILE, record.to_json().encode("utf-8", errors="surrogateescape"))


#: the records this process read, by the file's identity: a commit finds its record, then reads it again
#: under the lock (vLLM's is megabytes of JSON); the same inode, unchanged, is the same record
_READ: dict[tuple[int, ...], PreparedRecord] = {}


def read_prepared(state: EnvironmentState, *, summary: bool = False) -> PreparedRecord | None:
    """The record beside the journal, or None; PreparedRunError (or StateDirError) when it is not one.
    ``summary``: its own fields only (:meth:`PreparedRecord.from_json`)."""
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
    record = PreparedRecord.from_json(raw, summary=summary)
    if summary:
        return record
    try:
        after = os.lstat(path)
    except OSError:
        return record
    if key == (after.st_dev, after.st_ino, after.st_size, after.st_mtime_ns, after.st_ctime_ns):
        _READ.clear()
        _READ[key] = record
    return record
