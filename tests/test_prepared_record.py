"""The prepared run's record (docs/prepare.md): its compact form (format 2) read back as written, whatever
the paths and numbers, and a record of another format refused with the hint to prepare again."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from safeinstall.env.inodes import HashedInode
from safeinstall.env.uvplan import UvChange, UvPlan
from safeinstall.env.wheel import WheelMember
from safeinstall.errors import PreparedRunError
from safeinstall.store.prepared import PreparedRecord, read_prepared, write_prepared
from safeinstall.store.state import PREPARED_FILE, environment_state

PREFIX = "/srv/app/venv"


def _record(count: int = 3, **changes: object) -> PreparedRecord:
    site = f"{PREFIX}/lib/python3.11/site-packages"
    names = [f"pkg/mod{i}.py" for i in range(count)]
    fields: dict[str, object] = {
        "run_id": "20261206T120000Z-1",
        "prepared_at": 1.5,
        "prefix": PREFIX,
        "package": "pkg",
        "changes": ("pkg 1.0 -> 2.0",),
        "options": {"yes": True},
        "uv_command": ("uv", "pip", "install"),
        "units": ("app.service",),
        "processes": ((12, 345),),
        "files": {
            f"{site}/{n}": (2049, 100 + i, 0o100644, i, 10**18 + i, 10**18 + 2 * i)
            for i, n in enumerate(names)
        },
        "staged_root": ".safeinstall-stage-r",
        "staged": {
            ".": (2049, 7, 0o40700, 4096, 1, 2),
            **{f"tree/{n}": (2049, 500 + i, 0o100644, i, 3, 4) for i, n in enumerate(names)},
        },
        "staged_files": count,
        "wheel": "/var/lib/safeinstall/k/wheels/r/pkg-2.0-py3-none-any.whl",
        "wheel_sha256": "ab" * 32,
        "wheel_identity": (2049, 9, 0o100600, 10, 11, 12),
        "backup_dir": "/var/lib/safeinstall/k/backups/r",
        "uv_plan": UvPlan(("uv", "pip", "install"), (UvChange("+", "pkg", "2.0", None),), "out", None),
        "members": {n: WheelMember(n, i, f"digest{i}", None) for i, n in enumerate(names)},
        "cache_hashed": {
            (2049, 500 + i): HashedInode(
                f"/var/lib/safeinstall/k/uv-cache-r/archive-v0/x/{n}", i, 3, 4, 0, f"digest{i}", 9
            )
            for i, n in enumerate(names)
        },
        "before_hashed": {
            (2049, 100 + i): HashedInode(f"{site}/{n}", i, 10**18 + i, 10**18 + 2 * i, 0, f"old{i}", 0)
            for i, n in enumerate(names)
        },
        "dirs": {site: (2049, 1, 0o40755, 4096, 5, 6)},
    }
    fields.update(changes)
    return PreparedRecord(**fields)  # type: ignore[arg-type]


def test_a_record_is_read_back_as_written() -> None:
    record = _record()
    assert PreparedRecord.from_json(record.to_json().encode()) == record


def test_what_the_compact_form_cannot_pack_is_read_back_too() -> None:
    """Paths with a newline, bytes that are no UTF-8, a path outside the others' directory, a relative
    one; a number beyond 64 bits (an inode), a negative time; a digest holding a NUL; empty tables."""
    odd = {
        f"{PREFIX}/lib/a\nb.py": (2**64 - 1, 2**63, 0o100644, 0, -(10**12), 0),
        f"{PREFIX}/bin/\udcff\udcfe": (1, 2, 0o100755, 3, 4, 5),
        "/elsewhere/x": (1, 3, 0o100644, 3, 4, 5),
        f"{PREFIX}/lib/./python3.11//site-packages/../../bin/y": (
            1,
            4,
            0o100644,
            3,
            4,
            5,
        ),  # as a RECORD has it
    }
    record = _record(
        files=odd,
        staged={"": (1, 2, 3, 4, 5, 6), "a\nb": (1, 2, 3, 4, 5, 6)},
        members={"a": WheelMember("a", 1, "x\0y", ("md5", "zz")), "b": WheelMember("b", 2, "d", None)},
        cache_hashed={(2**64 - 1, 1): HashedInode("relative/x", 1, 2, 3, 4, "d", 5)},
        before_hashed={},
    )
    assert PreparedRecord.from_json(record.to_json().encode()) == record
    empty = _record(files={}, staged={}, members={}, cache_hashed={}, before_hashed={}, staged_root=None)
    assert PreparedRecord.from_json(empty.to_json().encode()) == empty
    one = _record(1)
    assert PreparedRecord.from_json(one.to_json().encode()) == one
    for paths in (["/a/./b/c", "/a/./b/d"], ["/a//b/c"], ["/a/xy", "/a/xz"], ["/x"], ["/"], ["/a/b/"]):
        table = _record(files={p: (1, 2, 3, 4, 5, 6) for p in paths})
        assert list(PreparedRecord.from_json(table.to_json().encode()).files) == paths


def test_the_record_holds_each_table_as_columns() -> None:
    """The record is read before anything stops (12 MB of rows for torch in format 1): each path is
    written once below its table's directory, the numbers packed, not a JSON row per file."""
    record = _record(2000)
    raw = record.to_json()
    assert raw.count(PREFIX) < 10
    assert raw.count("site-packages") < 10
    doc = json.loads(raw)
    assert doc["version"] == 2 and isinstance(doc["files"]["ints"], str)


def test_a_record_of_the_first_format_is_refused_with_the_hint_to_prepare_again() -> None:
    old = {
        "version": 1,
        "run_id": "r",
        "prepared_at": 1.0,
        "prefix": PREFIX,
        "package": "pkg",
        "changes": [],
        "options": {},
        "uv_command": [],
        "units": [],
        "processes": [],
        "files": {f"{PREFIX}/x": [1, 2, 3, 4, 5, 6]},
    }
    with pytest.raises(PreparedRunError) as caught:
        PreparedRecord.from_json(json.dumps(old).encode())
    assert "format 1" in caught.value.message and "reads format 2" in caught.value.message
    assert "--discard" in (caught.value.hint or "") and "prepare it again" in (caught.value.hint or "")


def test_a_record_of_the_first_format_is_still_listed_and_dropped(tmp_path: Path) -> None:
    """``--status`` and ``--discard`` read a record's own fields, of any format, not its tables: a run
    prepared by the safeinstall before this one is listed, and can be discarded (else nothing could drop
    it but removing its state by hand)."""
    from safeinstall.run.commands.status import prepared_summary

    old = json.loads(_record().to_json())
    old.update(version=1, files={}, staged={}, members={}, cache_hashed=[], before_hashed=[])
    raw = json.dumps(old).encode()
    summary = PreparedRecord.from_json(raw, summary=True)
    assert (summary.run_id, summary.prefix, summary.package, summary.changes) == (
        "20261206T120000Z-1",
        PREFIX,
        "pkg",
        ("pkg 1.0 -> 2.0",),
    )
    assert summary.files == {} and summary.members == {}
    state = environment_state(tmp_path / "state", Path(PREFIX))
    state.dir.mkdir(parents=True, mode=0o700)
    os.chmod(state.root, 0o700)
    (state.dir / PREPARED_FILE).write_bytes(raw)
    os.chmod(state.dir / PREPARED_FILE, 0o600)
    listed, problem = prepared_summary(state, now=11.5)
    assert problem is None and listed is not None
    assert (listed.run_id, listed.age_s, listed.changes, listed.units, listed.staged) == (
        "20261206T120000Z-1",
        10.0,
        ("pkg 1.0 -> 2.0",),
        ("app.service",),
        True,
    )
    with pytest.raises(PreparedRunError, match="format 1"):  # the commit needs its tables: refused
        read_prepared(state)
    old["version"] = 3  # a later format: not even its summary is guessed at
    with pytest.raises(PreparedRunError, match="format 3"):
        PreparedRecord.from_json(json.dumps(old).encode(), summary=True)


@pytest.mark.parametrize(
    "damage",
    [
        lambda d: d["files"].update(count=d["files"]["count"] + 1),  # a row short
        lambda d: d["files"].update(ints=d["files"]["ints"][:-4]),  # packed numbers cut
        lambda d: d["cache_hashed"].update(ints="not base64!"),
        lambda d: d["members"].update(sizes=[1, "2", 3]),
        lambda d: d["members"].update(listed=[[99, "md5", "x"]]),
        lambda d: d.pop("staged"),
    ],
)
def test_a_damaged_record_is_refused(damage: object) -> None:
    doc = json.loads(_record().to_json())
    damage(doc)  # type: ignore[operator]
    with pytest.raises(PreparedRunError, match="damaged"):
        PreparedRecord.from_json(json.dumps(doc).encode())


def test_the_record_is_read_back_from_the_state_directory(tmp_path: Path) -> None:
    root = tmp_path / "state"
    state = environment_state(root, Path(PREFIX))
    state.dir.mkdir(parents=True, mode=0o700)
    os.chmod(root, 0o700)
    record = _record(50)
    write_prepared(state, record)
    assert read_prepared(state) == record
    assert (state.dir / PREPARED_FILE).stat().st_mode & 0o777 == 0o600
