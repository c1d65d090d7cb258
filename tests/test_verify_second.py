"""Issue 46: a second ``--verify-only --all`` does less (no RECORD digest kept again for a distribution
proven unchanged, the proof's directories by the steering walk's ``lstat``) and still catches what the
environment's owner does after a clean check; ``--acknowledge-wheel-faults --all`` acknowledges every
distribution's faults at once; the stores' readers begin with one checked preamble. Real wheels, the
real uv, the real command line."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest

from safeinstall.env.inodetrust import GRANULARITY_NS
from safeinstall.store.state import environment_state
from tests import wheelhouse
from tests.clirun import verify_all
from tests.wheelhouse import Wheelhouse


@pytest.fixture
def env(venv: Path, wheels: Wheelhouse) -> Path:
    wheelhouse.uv_install(venv, wheels["sipure-1"], wheels["sins-a"], wheels["sins-b"])
    return venv


def _site(python: Path) -> Path:
    return wheelhouse.site_packages(python)


def _check(python: Path, state: Path, *args: str) -> tuple[int, dict[str, Any]]:
    return verify_all(python, state, *args, codes=(0, 1, 5))


def _settle(python: Path) -> None:
    """Until every inode of the site directory is older than the stores' granularity: a clean check then
    keeps each distribution (a file changed within 2 s of a check is never kept)."""
    newest = max(p.lstat().st_ctime_ns for p in _site(python).rglob("*"))
    while time.time_ns() <= newest + GRANULARITY_NS:
        time.sleep(0.1)


def _kept(python: Path, state: Path, name: str) -> dict[str, Any]:
    directory = environment_state(state, Path(os.path.realpath(python.parent.parent))).dir
    return json.loads((directory / name).read_bytes())  # type: ignore[no-any-return]


def tmp_state(python: Path) -> Path:
    """A state directory of the test's own, beside the venv."""
    return python.parent.parent.parent / "state"


def _drift(doc: dict[str, Any]) -> set[tuple[str, str]]:
    return {(f["kind"], f["path"]) for f in doc["data"]["findings"] if f["drift"]}


def test_a_record_rewritten_after_a_proven_check_is_still_record_changed(env: Path, tmp_path: Path) -> None:
    """The second check proves sipure unchanged by ``lstat`` and keeps no new RECORD digest for it (its
    RECORD's identity is the one the clean check kept with it); the reference stays the first check's:
    a module then edited with its RECORD line, both mtimes set back, is ``record-changed``."""
    state, site = tmp_path / "state", _site(env)
    _settle(env)
    assert _check(env, state)[0] == 0
    dist_info = next(site.glob("sipure-*.dist-info"))
    assert str(dist_info) in {d["dist_info"] for d in _kept(env, state, "unchanged.json")["distributions"]}
    records = _kept(env, state, "records.json")["records"]
    assert _check(env, state)[0] == 0  # proven unchanged
    assert _kept(env, state, "records.json")["records"] == records
    module, record = site / "sipure" / "cli.py", dist_info / "RECORD"
    before = {path: path.lstat() for path in (module, record)}
    module.write_text("import os\n")
    digest = wheelhouse.record_digest(module.read_bytes())
    record.write_text(
        "".join(
            f"sipure/cli.py,sha256={digest},10\n" if line.startswith("sipure/cli.py,") else line + "\n"
            for line in record.read_text().splitlines()
        )
    )
    for path, info in before.items():
        os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
    code, doc = _check(env, state)
    assert code == 1 and _drift(doc) == {("record-changed", str(module))}, doc["data"]["findings"]


def test_a_package_directory_swapped_for_a_link_is_never_proven_by_the_walks_lstat(env: Path) -> None:
    """A ``.pth`` that imports makes the steering walk look at every entry of site-packages, and the proof
    takes its ``lstat`` of each directory. The owner then moves ``sipure/`` aside (its files keep their
    inodes and ctimes) and links the old name to it: the proof sees a link, not the directory it kept
    (sipure's files are compared again, through the link, as they are: the same bytes), and what was
    moved aside is code no RECORD lists at the top of site-packages: drift."""
    state, site = tmp_state(env), _site(env)
    pth = site / "zz_steer.pth"
    pth.write_text("import sipure\n")  # site imports at start-up: every directory is walked
    _settle(env)
    for _ in range(2):  # the first keeps sipure, the second proves it unchanged
        code, doc = _check(env, state)
        assert code == 1 and _drift(doc) == {("extra", str(pth))}, doc["data"]["findings"]
    aside = site / "zz_sipure_aside"
    (site / "sipure").rename(aside)
    (site / "sipure").symlink_to(aside.name, target_is_directory=True)
    code, doc = _check(env, state)
    assert code == 1 and any(path.startswith(str(aside)) for _, path in _drift(doc)), doc["data"]["findings"]


def test_acknowledge_wheel_faults_with_all_acknowledges_every_distributions_at_once(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """Two distributions whose wheels lie in their RECORDs: one ``--verify-only --all
    --acknowledge-wheel-faults`` quiets both (exit 0), and the hint says so."""
    (tmp_path / "w").mkdir()
    broken = [
        wheelhouse.rewrite_record_hash(
            wheels["sipure-1"], tmp_path / "w" / wheels["sipure-1"].name, "sipure/cli.py"
        ),
        wheelhouse.rewrite_record_hash(
            wheels["sins-a"], tmp_path / "w" / wheels["sins-a"].name, "sins/a/__init__.py"
        ),
    ]
    wheelhouse.uv_install(venv, *broken)
    state = tmp_path / "state"
    assert _check(venv, state)[0] == 1  # root's first sight explains nothing away
    code, doc = _check(venv, state)
    faults = {f["distribution"] for f in doc["data"]["findings"] if f["kind"] == "wheel-fault"}
    assert code == 5 and faults == {"sipure", "sins-a"}, doc["data"]["findings"]
    every = "(safeinstall --verify-only --all --acknowledge-wheel-faults [--python PY])"
    assert all(every in f["detail"] for f in doc["data"]["findings"])
    code, doc = _check(venv, state, "--acknowledge-wheel-faults")
    assert code == 0 and all(f["acknowledged"] for f in doc["data"]["findings"]), doc["data"]["findings"]
    code, doc = _check(venv, state)
    assert code == 0 and {f["distribution"] for f in doc["data"]["findings"] if f["acknowledged"]} == faults


@pytest.mark.parametrize("store", ["anchors", "wheelfaults", "records", "bytecode", "parses"])
def test_every_store_begins_with_its_version_its_environment_and_its_part_checked(store: str) -> None:
    """One preamble (``store_part``) for the stores root keeps of an environment: another version's,
    another environment's (or boot's) store, or one without its part, is damaged (ValueError)."""
    from safeinstall.store import anchors, bytecode, parses, records, wheelfaults

    module = {
        "anchors": anchors,
        "wheelfaults": wheelfaults,
        "records": records,
        "bytecode": bytecode,
        "parses": parses,
    }[store]
    part = {
        "anchors": "anchors",
        "wheelfaults": "faults",
        "records": "records",
        "bytecode": "entries",
        "parses": "records",
    }[store]
    empty: Any = [] if store in ("wheelfaults", "bytecode") else {}
    good = {"version": module.STORE_VERSION, "prefix": "/p", "boot": "b", part: empty}

    def parsed(document: dict[str, Any], prefix: str = "/p") -> object:
        raw = json.dumps(document).encode()
        if store == "bytecode":
            return bytecode.from_json(raw, prefix, "b", time.time_ns())
        return module.from_json(raw, prefix)

    assert parsed(good) == {}
    for bad in (
        {**good, "version": module.STORE_VERSION + 1},
        {**good, part: "x"},
        {key: value for key, value in good.items() if key != part},
    ):
        with pytest.raises(ValueError):
            parsed(bad)
    with pytest.raises(ValueError):
        parsed(good, "/q")
    if store == "bytecode":
        with pytest.raises(ValueError):
            parsed({**good, "boot": "c"})


def test_a_restored_record_meets_the_anchor_it_had_before_the_run(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """A run backs sipure up (its anchors kept with the backup), installs over it and puts the backup
    back (a rollback's, ``--recover``'s or an ``--undo``'s restore): the restored RECORD is a new inode
    with a new ctime, and the file its wheel lied about stays the wheel's fault once the anchor is
    carried over; a file the owner had edited before the run is never explained so (``modified``)."""
    from safeinstall.env.distributions import find_distributions
    from safeinstall.env.environment import inspect_environment
    from safeinstall.store.anchors import carry_over, keep_with_backup
    from safeinstall.store.backup import create_backup, restore_backup

    (tmp_path / "w").mkdir()
    wheel = wheelhouse.rewrite_record_hash(
        wheels["sipure-1"], tmp_path / "w" / wheels["sipure-1"].name, "sipure/cli.py"
    )
    wheelhouse.uv_install(venv, wheel)
    state, site = tmp_path / "state", _site(venv)
    assert _check(venv, state)[0] == 1  # root's first sight: anchored
    assert _check(venv, state)[0] == 5
    edited = site / "sipure" / "__init__.py"
    edited.write_text(edited.read_text() + "# the owner's\n")
    env = inspect_environment(venv)
    installed = find_distributions(env)
    backup = create_backup(
        env, [d for d in installed if d.name == "sipure"], tmp_path / "backup", [], installed=installed
    )
    assert keep_with_backup(state, env.prefix, backup) is None
    record = next(site.glob("sipure-*.dist-info")) / "RECORD"
    record.unlink()  # the install: a new RECORD, new bytes
    record.write_text("sipure/__init__.py,,\n")
    (site / "sipure" / "cli.py").unlink()  # (the backup may hold this very inode: never written in place)
    (site / "sipure" / "cli.py").write_text("NEW = 2\n")
    restored = restore_backup(backup, env, [])
    assert restored.ok, restored
    assert carry_over(state, env.prefix, backup) is None
    code, doc = _check(venv, state)
    kinds = {
        os.path.basename(f["path"]): f["kind"] for f in doc["data"]["findings"] if f["kind"] != "hardlinked"
    }
    assert code == 1 and kinds == {"cli.py": "wheel-fault", "__init__.py": "modified"}, kinds


def test_the_search_for_extras_takes_the_steering_walks_listings_and_still_finds_each_plant(
    env: Path, tmp_path: Path
) -> None:
    """With a ``.pth`` that imports, the steering walk lists every directory of site-packages and the
    search for extras takes those listings (no directory listed twice): a module, a package directory
    and a ``.pyc`` planted after a clean check are each reported."""
    state, site = tmp_path / "state", _site(env)
    pth = site / "zz_steer.pth"
    pth.write_text("import sipure\n")
    _settle(env)
    assert _drift(_check(env, state)[1]) == {("extra", str(pth))}
    module, package = site / "sipure" / "evil.py", site / "sipure" / "sub"
    module.write_text("import os\n")
    package.mkdir()
    (package / "mod.py").write_text("import os\n")
    cache = site / "sipure" / "__pycache__"
    cache.mkdir(exist_ok=True)
    planted = cache / f"cli.{__import__('sys').implementation.cache_tag}.pyc"
    planted.write_bytes(b"\0" * 16)
    code, doc = _check(env, state)
    found = {path for _, path in _drift(doc)}
    assert code == 1 and {str(module), str(package / "mod.py"), str(planted)} <= found, doc["data"][
        "findings"
    ]


def test_a_walk_from_listings_is_the_walk_of_the_tree_within_the_same_bounds(tmp_path: Path) -> None:
    """:func:`walk_listed` gives what the descriptor walk gives for the same tree (a symlink listed, never
    entered), None when a directory below was not listed, and stops at the walk's bounds."""
    from safeinstall.env.verify import _walk, walk_listed
    from safeinstall.system.safefs import WALK_MAX_DEPTH, TreeTooLarge

    top = tmp_path / "pkg"
    (top / "a" / "b").mkdir(parents=True)
    for name in ("x.py", "a/y.py", "a/b/z.so"):
        (top / name).write_text("")
    (top / "link").symlink_to(top / "a", target_is_directory=True)
    listings: dict[str, list[tuple[str, bool]]] = {}
    for directory in (top, top / "a", top / "a" / "b"):
        with os.scandir(directory) as entries:
            listings[str(directory)] = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
    seen = {str(d): os.lstat(d) for d in (top, top / "a", top / "a" / "b")}
    assert sorted(walk_listed(listings, str(top), seen=seen) or []) == sorted(_walk(str(top)))
    assert walk_listed({str(top): listings[str(top)]}, str(top), seen=seen) is None  # a/ not listed
    with pytest.raises(TreeTooLarge):
        walk_listed(listings, str(top), [2], seen=seen)
    deep = tmp_path / "deep"
    os.makedirs(os.path.join(deep, *["d"] * (WALK_MAX_DEPTH + 2)))
    chain = {str(deep) + "/d" * level: [("d", True)] for level in range(WALK_MAX_DEPTH + 2)}
    with pytest.raises(TreeTooLarge):
        walk_listed(chain, str(deep), seen={path: os.lstat(path) for path in chain})


def test_an_extra_behind_a_directory_swapped_for_a_link_while_the_steering_walk_lists_is_reported(
    env: Path, tmp_path: Path
) -> None:
    """The owner swaps a package directory for a link to an empty directory outside the environment
    just as the steering walk lists it, and puts it back just after: the search for extras never takes
    the decoy's listing for the package's (the walk lists through a descriptor of what it looked at,
    and a listing stands only for a directory still the one listed), so the planted module is found.
    Found by the attacker review of issue 46's change (it listed by path, following the link)."""
    import subprocess
    import sys

    state, site = tmp_path / "state", _site(env)
    (site / "zz_steer.pth").write_text("import sipure\n")  # the steering walk lists every directory
    package = site / "sipure"
    for n in range(300):
        (package / f"zz{n:03d}").mkdir()
        (package / f"zz{n:03d}" / "x.txt").write_text("")
    target = package / "zz150b"  # listed after zz151 and before zz150 (the walk pops the last)
    target.mkdir()
    evil = target / "evil.py"
    evil.write_text("import os\n")
    decoy = tmp_path / "decoy"
    decoy.mkdir()
    _settle(env)
    swap = [str(package / "zz151"), str(target), str(decoy), str(tmp_path / "aside"), str(package / "zz150")]
    watcher = subprocess.Popen(
        [sys.executable, "-m", "tests.bed_swapper", *swap],
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).parent.parent,
    )
    try:
        assert watcher.stdout is not None and watcher.stdout.readline().strip() == "ready"
        _, doc = _check(env, state)
    finally:
        try:
            said = watcher.communicate(timeout=30)[0]
        except subprocess.TimeoutExpired:
            watcher.kill()
            said = watcher.communicate()[0]
    assert "swapped" in said and "restored" in said, said  # the owner's swap took place, and was undone
    assert target.is_dir() and not target.is_symlink() and evil.exists()
    assert str(evil) in {path for _, path in _drift(doc)}


def test_a_listing_stands_only_for_the_directory_still_there_unchanged(tmp_path: Path) -> None:
    """:func:`walk_listed` takes a listing only while the directory at its path is the one listed: a
    directory renamed away and back (its change time moves), or one whose entries changed, is walked."""
    from safeinstall.env.verify import walk_listed

    top = tmp_path / "pkg"
    (top / "a").mkdir(parents=True)
    (top / "a" / "y.py").write_text("")

    def listed() -> tuple[dict[str, list[tuple[str, bool]]], dict[str, os.stat_result]]:
        listings = {}
        for directory in (top, top / "a"):
            with os.scandir(directory) as entries:
                listings[str(directory)] = [(e.name, e.is_dir(follow_symlinks=False)) for e in entries]
        return listings, {str(d): os.lstat(d) for d in (top, top / "a")}

    listings, seen = listed()
    assert walk_listed(listings, str(top), seen=seen) == [str(top / "a" / "y.py")]
    assert walk_listed(listings, str(top)) is None  # nothing seen: nothing stands
    time.sleep(0.01)
    os.rename(top / "a", tmp_path / "away")
    os.rename(tmp_path / "away", top / "a")
    assert walk_listed(listings, str(top), seen=seen) is None
    listings, seen = listed()
    time.sleep(0.01)
    (top / "a" / "z.py").write_text("")
    assert walk_listed(listings, str(top), seen=seen) is None


def test_a_record_rewritten_to_its_size_with_its_mtime_set_back_after_its_parse_was_kept_is_read_anew(
    env: Path, tmp_path: Path
) -> None:
    """The checks keep each RECORD's parse by its identity (``parses.json``). The owner then edits a
    module to the same size and rewrites its RECORD line to match (the RECORD's size unchanged too),
    both mtimes set back: the RECORD's ctime moved, so it is parsed anew, and the file is reported
    ``record-changed`` (a kept parse taken by size and mtime would say ``modified`` against the old
    line)."""
    state, site = tmp_path / "state", _site(env)
    _settle(env)
    dist_info = next(site.glob("sipure-*.dist-info"))
    module, record = site / "sipure" / "cli.py", dist_info / "RECORD"
    for _ in range(2):  # the first keeps the parse, the second takes it
        assert _check(env, state)[0] == 0
        kept = _kept(env, state, "parses.json")["records"][str(record)]
        assert kept[0][1] == record.lstat().st_ino and "sipure/cli.py" in kept[2]
    before = {path: path.lstat() for path in (module, record)}
    old = module.read_bytes()
    module.write_bytes(b"#" * len(old))
    digest = wheelhouse.record_digest(module.read_bytes())
    lines = record.read_text().splitlines()
    record.write_text(
        "".join(
            f"sipure/cli.py,sha256={digest},{len(old)}\n"
            if line.startswith("sipure/cli.py,")
            else line + "\n"
            for line in lines
        )
    )
    for path, info in before.items():
        os.utime(path, ns=(info.st_atime_ns, info.st_mtime_ns))
        assert path.lstat().st_size == info.st_size
    code, doc = _check(env, state)
    assert code == 1 and _drift(doc) == {("record-changed", str(module))}, doc["data"]["findings"]


def test_a_kept_parse_is_taken_only_for_the_record_it_was_made_of(tmp_path: Path) -> None:
    """A RECORD read and parsed, its ctime settled (not while racy): kept, and a second scan takes it
    without parsing (the very parse, where each entry lives worked out the same); kept and read back
    through the store, the same. Once the RECORD is rewritten to its size with its mtime set back, it is
    parsed anew."""
    from safeinstall.env.distributions import MetadataReader, ParsedRecords, entry_location
    from safeinstall.env.records import parse_record
    from safeinstall.store import parses

    site = tmp_path / "site"
    record = site / "demo-1.dist-info" / "RECORD"
    record.parent.mkdir(parents=True)
    text = "demo/__init__.py,sha256=" + "A" * 43 + ",5\n../../bin/demo,,\ndemo-1.dist-info/RECORD,,\n"
    record.write_text(text)
    racy = ParsedRecords({})
    MetadataReader(parses=racy).record(record)
    assert racy.new == 0 and not racy.seen  # its ctime within 2 s of the read: not kept
    while time.time_ns() <= record.lstat().st_ctime_ns + GRANULARITY_NS:
        time.sleep(0.1)
    first = ParsedRecords({})
    parsed, problem = MetadataReader(parses=first).record(record)
    assert problem is None and parsed == parse_record(text) and first.new == 1
    for kept in (first.seen, parses.from_json(parses.to_json(str(tmp_path), first.seen), str(tmp_path))):
        again = ParsedRecords(kept)
        reader = MetadataReader(parses=again)
        taken, _ = reader.record(record)
        assert again.new == 0 and taken is kept[str(record)].record and taken == parsed
        located = reader.locations(record, taken, str(site))
        assert located == tuple(entry_location(site, entry) for entry in parsed.entries)
    info = record.lstat()
    record.write_text(text.replace("A" * 43, "B" * 43))
    os.utime(record, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert record.lstat().st_size == info.st_size and record.lstat().st_mtime_ns == info.st_mtime_ns
    anew = ParsedRecords(first.seen)
    reparsed, _ = MetadataReader(parses=anew).record(record)
    assert reparsed.entries[0].hash is not None and reparsed.entries[0].hash.digest == "B" * 43


def test_where_kept_entries_live_is_worked_out_as_entry_location_does() -> None:
    """Pure: :func:`plain_locations` joins ``site/path`` in bulk and normalises only the paths a mark
    shows (a leading "/" or ".", "//", "/.", a trailing "/"): the same as :func:`entry_location` for
    every path made of those pieces."""
    import itertools

    from safeinstall.env.distributions import entry_location, plain_locations
    from safeinstall.env.records import RecordEntry

    pieces = ["a", "/", ".", ""]
    words = sorted({"".join(p) for p in itertools.product(pieces, repeat=4)})
    for paths in (words, [*words[::-1], "../../../bin/x"], ["a/b", "c"], ["./a"], ["a/"]):
        entries = [RecordEntry(path, None, None) for path in paths]
        expected = tuple(entry_location("/s/site", entry) for entry in entries)
        assert plain_locations("/s/site", entries, paths) == expected
