"""Distributions proven unchanged by ``lstat`` alone (issue 36): a ``--verify-only`` after one that found a
distribution clean compares none of its files when its RECORD, its files and the directories on their way
are as they were; anything an account can do to them still shows.

Whether a check took the proof shows through a forged verified-inode store (``tests/test_verified.py``'s
way): its one entry says an unchanged file hashes to something else, so a check that asked the store
reports the file ``modified``, one that proved the distribution unchanged does not."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from safeinstall.env.hashing import FileState
from safeinstall.env.inodetrust import GRANULARITY_NS, MAX_AGE_NS, InodeStore, VerifiedInode
from safeinstall.env.unchanged import (
    FILE_IDENTITY,
    MAX_DEPTH,
    UnchangedDistribution,
    UnchangedStore,
    bounded,
    directories_of,
    file_identity,
    is_settled,
    too_deep,
    updated,
)
from safeinstall.store.inodestore import boot_id, store_file, to_bytes
from safeinstall.store.state import environment_state
from safeinstall.store.unchanged import STORE_LIMIT, STORE_NAME, from_json, to_json
from tests import wheelhouse
from tests.beds import forge_kept_hash as _forge
from tests.beds import hashed_state
from tests.beds import modified_names as _modified
from tests.beds import verify_sipure as _verify
from tests.clirun import run
from tests.wheelhouse import Wheelhouse


@pytest.fixture
def env(venv: Path, wheels: Wheelhouse) -> Path:
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    return venv


def _prefix(python: Path) -> Path:
    return Path(os.path.realpath(python.parent.parent))


def _settle(python: Path) -> None:
    """Until the granularity has passed since the newest ctime in the environment: a check from then
    on sees every file, RECORD and directory settled, and keeps them."""
    prefix = _prefix(python)
    newest = os.lstat(prefix).st_ctime_ns
    for directory, dirs, files in os.walk(prefix):
        for name in [*dirs, *files]:
            newest = max(newest, os.lstat(os.path.join(directory, name)).st_ctime_ns)
    while time.time_ns() <= newest + GRANULARITY_NS:
        time.sleep(0.1)


def _kept(state: Path, python: Path) -> set[str]:
    """The ``.dist-info`` names the store of clean distributions holds."""
    path = environment_state(state, _prefix(python)).dir / STORE_NAME
    if not path.exists():
        return set()
    return {os.path.basename(d["dist_info"]) for d in json.loads(path.read_bytes())["distributions"]}


def _proven_clean(python: Path, state: Path, target: Path) -> None:
    """A first check keeps sipure clean; with a forged hash for ``target`` in the verified-inode store, a
    second check still finds nothing: it proved sipure unchanged and asked the store nothing."""
    _settle(python)
    assert _modified(_verify(python, state)) == set()
    assert _kept(state, python) == {"sipure-1.0.dist-info"}
    _forge(state, python, target, time.time_ns())
    assert _modified(_verify(python, state)) == set()  # proven: the forged hash was not asked


def _init(python: Path) -> Path:
    return wheelhouse.site_packages(python) / "sipure" / "__init__.py"


def test_a_clean_distribution_is_proven_unchanged_and_full_takes_no_proof(env: Path, tmp_path: Path) -> None:
    state, target = tmp_path / "state", _init(env)
    _proven_clean(env, state, target)
    _forge(state, env, target, time.time_ns())
    assert _modified(_verify(env, state, "--full")) == set()  # read: the forged hash is not believed
    assert _kept(state, env) == {"sipure-1.0.dist-info"}  # what --full found clean is kept anew


@pytest.mark.parametrize("pth_import", [False, True], ids=["lstat", "the-steering-walks-lstat"])
def test_a_same_size_edit_with_the_mtime_set_back_is_modified_after_a_proven_check(
    env: Path, tmp_path: Path, pth_import: bool
) -> None:
    """The owner's edit that keeps the size and puts the mtime back to the nanosecond moves the ctime:
    the distribution is no longer proven, and the file is read. With a ``.pth`` line that imports, the
    steering walk looks at every file of site-packages, and the proof takes its ``lstat``."""
    state, target = tmp_path / "state", _init(env)
    if pth_import:
        (wheelhouse.site_packages(env) / "zz-imports.pth").write_text("import sipure\n")
    _proven_clean(env, state, target)
    info = os.lstat(target)
    content = target.read_bytes()
    target.write_bytes(bytes([content[0] ^ 1]) + content[1:])
    stamp = f"@{info.st_mtime_ns // 10**9}.{info.st_mtime_ns % 10**9:09d}"
    subprocess.run(["touch", "-d", stamp, str(target)], check=True)
    after = os.lstat(target)
    assert (after.st_ino, after.st_size, after.st_mtime_ns) == (info.st_ino, info.st_size, info.st_mtime_ns)
    assert _modified(_verify(env, state)) == {"__init__.py"}
    assert _kept(state, env) == set()  # not clean any more: not kept


def test_a_record_the_owner_edited_is_parsed_and_believed_again(env: Path, tmp_path: Path) -> None:
    """A RECORD edited (its mtime set back): its ctime moved, so the distribution is not proven by what
    the old RECORD said; the files are compared with the new one."""
    state, target = tmp_path / "state", _init(env)
    _proven_clean(env, state, target)
    record = next(wheelhouse.site_packages(env).glob("sipure-1.0.dist-info")) / "RECORD"
    info = os.lstat(record)
    lines = record.read_text().splitlines(keepends=True)
    other = "sha256=" + "C" * 43  # neither the file's hash nor the forged one
    edited = [
        line.replace(line.split(",")[1], other) if line.startswith("sipure/__init__.py,") else line
        for line in lines
    ]
    assert edited != lines
    record.write_text("".join(edited))
    os.utime(record, ns=(info.st_atime_ns, info.st_mtime_ns))
    assert os.lstat(record).st_mtime_ns == info.st_mtime_ns
    assert _modified(_verify(env, state)) == {"__init__.py"}
    assert _modified(_verify(env, state, "--full")) == {"__init__.py"}


def test_a_file_removed_or_added_in_a_package_directory_still_shows(env: Path, tmp_path: Path) -> None:
    state, target = tmp_path / "state", _init(env)
    _proven_clean(env, state, target)
    added = target.parent / "added.py"
    added.write_text("x = 1\n")
    findings = _verify(env, state)["data"]["findings"]
    assert {(f["kind"], os.path.basename(f["path"])) for f in findings} >= {("extra", "added.py")}
    added.unlink()
    target.unlink()
    findings = _verify(env, state)["data"]["findings"]
    assert ("missing", "__init__.py") in {(f["kind"], os.path.basename(f["path"])) for f in findings}


def test_a_package_directory_swapped_for_a_symlink_to_the_same_files_is_not_proven(
    env: Path, tmp_path: Path
) -> None:
    """The package directory moved out of the environment (its files keep their inodes and ctimes) and a
    symlink put in its place: an ``lstat`` of each path finds the very files as they were, but the
    directories on the way changed, so the distribution is checked as before (which refuses a
    directory that now resolves outside the prefix)."""
    state, target = tmp_path / "state", _init(env)
    _proven_clean(env, state, target)
    package = target.parent
    moved = tmp_path / "elsewhere"
    os.rename(package, moved)
    package.symlink_to(moved)
    assert os.stat(target).st_ino == os.lstat(moved / "__init__.py").st_ino  # the very files
    report = _verify(env, state)
    assert report["data"]["findings"], report


def test_a_check_of_one_package_keeps_what_the_store_says_of_the_others(
    env: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    wheelhouse.uv_install(env, wheels["sins-a"])
    state = tmp_path / "state"
    _settle(env)
    result = run(
        "--verify-only",
        "--all",
        "--python",
        str(env),
        env={**os.environ, "SAFEINSTALL_STATE_DIR": str(state)},
    )
    assert result.code == 0, result.stderr
    both = _kept(state, env)
    assert "sipure-1.0.dist-info" in both and len(both) == 2
    _init(env).touch()  # sipure is checked alone, not proven (and not kept: racy)
    assert _modified(_verify(env, state)) == set()
    assert _kept(state, env) == both - {"sipure-1.0.dist-info"}


def test_a_check_right_after_the_install_keeps_nothing_racy(env: Path, tmp_path: Path) -> None:
    """Files, RECORD and directories changed within the timestamp granularity of the check's start could
    change again unseen: the distribution is not kept (the next check compares its files)."""
    state = tmp_path / "state"
    _settle(env)  # the RECORD and the directories are settled; one file is not:
    _init(env).touch()  # its ctime now, within the granularity of the check below
    assert _modified(_verify(env, state)) == set()
    assert _kept(state, env) == set()


def test_nothing_is_kept_on_a_filesystem_whose_ctime_is_not_known_to_be_kept(
    wheels: Wheelhouse, tmp_path: Path, small_disk: Callable[[int], Path]
) -> None:
    """tmpfs (a write through a shared writable mapping moves no time at all), as NFS or FUSE: a clean
    distribution there is compared file by file at every check."""
    python = wheelhouse.make_venv(small_disk(64) / "venv")
    wheelhouse.uv_install(python, wheels["sipure-1"])
    state = tmp_path / "state"
    _settle(python)
    assert _modified(_verify(python, state)) == set()
    assert _kept(state, python) == set()


# ------------------------------------------------------------------ the decisions and the store (pure)


def _state(ctime_ns: int, **changes: object) -> FileState:
    fields: dict[str, object] = {"path": "/env/lib/site/p/f.py", "mode": 0o100644, **changes}
    hashed = fields.pop("hashed_ns", ctime_ns + 10 * GRANULARITY_NS)
    assert isinstance(hashed, int)
    state: FileState = hashed_state(ctime_ns, hashed, **fields)
    return state


def test_only_a_settled_file_read_whole_or_proven_is_kept() -> None:
    since = 10**18
    assert file_identity(_state(since - GRANULARITY_NS), since) is not None
    assert file_identity(_state(since - GRANULARITY_NS + 1), since) is None  # racy
    assert not is_settled(since - 1, since)
    assert file_identity(_state(since - GRANULARITY_NS, hashed_ns=0), since) is None  # moved while read
    assert file_identity(_state(since - GRANULARITY_NS, hashed_ns=0, by_identity=True), since) is not None
    assert file_identity(_state(since - GRANULARITY_NS, error="EIO"), since) is None
    assert file_identity(_state(since - GRANULARITY_NS, is_file=False), since) is None
    assert file_identity(_state(since - GRANULARITY_NS, mtime_ns=-1), since) is not None  # dated 1960
    for past_64_bits in ({"mtime_ns": 1 << 63}, {"inode": 1 << 63}):  # touch -d 2400, overlayfs xino
        assert file_identity(_state(since - GRANULARITY_NS, **past_64_bits), since) is None


def test_every_directory_from_the_prefix_down_is_looked_at_and_none_outside_it() -> None:
    found = directories_of(["/env/lib/site/p/q/f.py", "/env/lib/site/p/g.py", "/env/bin/x"], "/env")
    assert found == {"/env", "/env/bin", "/env/lib", "/env/lib/site", "/env/lib/site/p", "/env/lib/site/p/q"}
    assert directories_of(["/other/f.py"], "/env") == {""}  # no directory named "" is ever kept


def test_what_is_kept_is_bounded_by_depth_and_by_the_directories_count_and_bytes() -> None:
    assert not too_deep(["/env/" + "a/" * MAX_DEPTH + "f.py"], "/env")
    assert too_deep(["/env/" + "a/" * (MAX_DEPTH + 1) + "f.py"], "/env/")
    table = {f"/env/{n}": ((7, n, 5, 5), 100 + n) for n in range(10)}
    assert bounded(table, 10, 100) == table
    assert set(bounded(table, 3, 100)) == {"/env/9", "/env/8", "/env/7"}  # the newest
    assert set(bounded(table, 10, 12)) == {"/env/9", "/env/8"}


def test_the_store_is_bound_to_its_environment_and_boot_and_every_field_is_checked() -> None:
    now = 10**18
    since = now - 1000
    dist = UnchangedDistribution(
        "/env/lib/site/p-1.dist-info",
        since,
        since - 10,
        (7, 1, 10, -5, 5),  # a RECORD dated 1960: a negative mtime is kept
        1,
        FILE_IDENTITY.pack(7, 42, 10, 5, 5, 0o100644),
    )
    store = UnchangedStore("/env", "boot-a", {dist.dist_info: dist}, {"/env/lib": ((7, 2, 5, 5), since)})
    raw = to_json(store)
    assert from_json(raw, "/env", "boot-a", now) == store
    for prefix, boot in (("/other", "boot-a"), ("/env", "boot-b")):
        with pytest.raises(ValueError):
            from_json(raw, prefix, boot, now)
    document = json.loads(raw)
    damaged = [
        {**document, "directories": {"/outside": [7, 2, 5, 5, since]}},
        {**document, "directories": {"/env/../etc": [7, 2, 5, 5, since]}},
        {**document, "directories": {"/env/lib": [7, 2, 5, -5, since]}},
        {**document, "distributions": [{**document["distributions"][0], "files": 2}]},
        {**document, "distributions": [{**document["distributions"][0], "record": [7, 1, 10, 5]}]},
        {**document, "distributions": [{**document["distributions"][0], "dist_info": "p-1.dist-info"}]},
        {
            **document,
            "distributions": [
                {**document["distributions"][0], "identities": base64.b64encode(b"x" * 47).decode()}
            ],
        },
    ]
    for bad in damaged:  # each damaged entry is left out, not the whole store
        read = from_json(json.dumps(bad).encode(), "/env", "boot-a", now)
        assert not read.distributions or not read.directories
        assert read.distributions == store.distributions or read.directories == store.directories
    newer = json.loads(raw)
    newer["distributions"][0]["hashed"] = since + 1  # hashed after it was kept: not believed
    assert from_json(json.dumps(newer).encode(), "/env", "boot-a", now).distributions == {}
    old = json.loads(raw)
    old["distributions"][0]["hashed"] = now - MAX_AGE_NS - 1  # its oldest hash a day old
    assert from_json(json.dumps(old).encode(), "/env", "boot-a", now).distributions == {}
    racy = json.loads(raw)
    racy["directories"]["/env/lib"][3] = since  # its ctime within the granularity of its moment
    assert from_json(json.dumps(racy).encode(), "/env", "boot-a", now).directories == {}
    checked = [dist.dist_info]
    assert updated(store, checked, [], [], {}, now).distributions == {}  # checked, not proven: dropped
    assert updated(store, checked, checked, [], {}, now).distributions == store.distributions
    assert updated(store, [], [], [], {}, now).distributions == store.distributions  # another's check


def test_the_boot_id_is_known_here() -> None:
    assert boot_id() is not None


# The attacker review of the store of clean distributions (issue 36): what the environment's owner can
# put in it (a date past 64 bits or before 1970, a deep RECORD) and what the store rests on.


def _store(state: Path, python: Path) -> Path:
    return environment_state(state, _prefix(python)).dir / STORE_NAME


@pytest.mark.parametrize("pth_import", [False, True], ids=["lstat", "the-steering-walks-lstat"])
def test_an_edited_file_dated_past_64_bits_is_reported_modified_not_an_internal_error(
    env: Path, tmp_path: Path, pth_import: bool
) -> None:
    """The owner edits a file of a distribution kept clean and dates it 2400 (``st_mtime_ns`` past
    2**63): the proof, which packed the identity into 64-bit fields, must not crash the check (it said
    "internal error" and reported nothing, at every check); the file is compared as before: modified.
    With a ``.pth`` file that imports, the identity comes from the steering walk's ``lstat``."""
    init = _init(env)
    if pth_import:
        (init.parent.parent / "zz-imports.pth").write_text("import sipure\n")
    state = tmp_path / "state"
    _settle(env)
    assert _modified(_verify(env, state)) == set()
    assert _kept(state, env) == {"sipure-1.0.dist-info"}
    init.write_text(init.read_text() + "import os  # the owner's edit\n")
    subprocess.run(["touch", "-d", "2400-01-01", str(init)], check=True)
    assert os.lstat(init).st_mtime_ns >= 1 << 63
    for _ in range(2):  # nothing of it kept in either store: the same answer again
        result = run(
            "sipure", "--verify-only", "--python", str(env), "--json",
            env={**os.environ, "SAFEINSTALL_STATE_DIR": str(state)},
        )  # fmt: skip
        assert result.code == 1, result.stderr
        assert _modified(result.json) == {"__init__.py"}


@pytest.fixture
def overlay(tmp_path: Path, wheels: Wheelhouse) -> Iterator[Path]:
    """sipure installed in a tmpfs lower layer of an overlayfs mounted with ``xino=on``: its files'
    inode numbers (a lower layer's) lie at or past 2**63; skipped where mounting is not allowed."""
    lower, upper, work, merged = (tmp_path / n for n in ("lower", "upper", "work", "merged"))
    for d in (lower, upper, work, merged):
        d.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "tmpfs", str(lower)], capture_output=True, text=True)
    if done.returncode:
        pytest.skip(done.stderr)
    python = wheelhouse.make_venv(lower / "venv")
    wheelhouse.uv_install(python, wheels["sipure-1"])
    options = f"xino=on,lowerdir={lower},upperdir={upper},workdir={work}"
    done = subprocess.run(
        ["mount", "-t", "overlay", "overlay", "-o", options, str(merged)], capture_output=True, text=True
    )
    if done.returncode:
        subprocess.run(["umount", "--lazy", str(lower)], check=True)
        pytest.skip(done.stderr)
    try:
        yield merged / "venv" / "bin" / "python"
    finally:  # lazily: a process of the test's may still hold a file (the session's end check sees)
        subprocess.run(["umount", "--lazy", str(merged)], check=True)
        subprocess.run(["umount", "--lazy", str(lower)], check=True)


def test_inode_numbers_past_64_bits_are_checked_not_an_internal_error(overlay: Path, tmp_path: Path) -> None:
    """overlayfs' ``xino`` inode numbers (NFS's, FUSE's) may lie past 2**63: neither store keeps such an
    identity (packing it crashed the check), every check reads the files and finds them clean."""
    assert os.lstat(_init(overlay)).st_ino >= 1 << 63
    _settle(overlay)
    state = tmp_path / "state"
    for _ in range(2):
        result = run(
            "sipure", "--verify-only", "--python", str(overlay), "--json",
            env={**os.environ, "SAFEINSTALL_STATE_DIR": str(state)},
        )  # fmt: skip
        assert result.code == 0, result.stderr[-3000:]


def test_a_directory_dated_1960_is_kept_and_proven(env: Path, tmp_path: Path) -> None:
    """A negative modification time (``touch -d 1960-01-01`` of the package's directory) is kept as
    seen, and read back: the distribution is proven unchanged (the store was refused whole as damaged,
    nothing proven and the store rewritten at every check)."""
    subprocess.run(["touch", "-d", "1960-01-01", str(_init(env).parent)], check=True)
    assert os.lstat(_init(env).parent).st_mtime_ns < 0
    _proven_clean(env, tmp_path / "state", _init(env))


def _deep_distribution(python: Path, files: int, depth: int) -> int:
    """A distribution ``deep`` whose RECORD lists ``files`` empty files each ``depth`` one-letter
    directories down (as the environment's owner can make one); returns its RECORD's size."""
    site = wheelhouse.site_packages(python)
    info = site / "deep-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: deep\nVersion: 1.0\n")
    empty = wheelhouse.record_digest(b"")
    lines = []
    for index in range(files):
        relative = "/".join(["deep", f"d{index}", *(["a"] * depth), "f.py"])
        made = site
        for part in relative.split("/")[:-1]:  # one level at a time (a path this long is past PATH_MAX)
            made = made / part
            if not made.is_dir():
                made.mkdir()
        (site / relative).write_bytes(b"")
        lines.append(f"{relative},sha256={empty},0")
    lines += ["deep-1.0.dist-info/METADATA,,", "deep-1.0.dist-info/RECORD,,"]
    record = "\n".join(lines) + "\n"
    (info / "RECORD").write_text(record)
    return len(record)


def test_a_distribution_of_deep_directories_is_not_kept_and_the_store_stays_small(
    env: Path, tmp_path: Path
) -> None:
    """Each directory from the prefix down is kept by its path: 20 files 600 one-letter directories deep
    (a 24 KB RECORD) made root write an 8 MB store (a few such lines: past its limit). A distribution
    with a directory deeper than MAX_DEPTH is not kept (checked as before); the others are."""
    record_size = _deep_distribution(env, files=20, depth=600)
    state = tmp_path / "state"
    _settle(env)
    result = run(
        "--verify-only", "--all", "--python", str(env), "--json",
        env={**os.environ, "SAFEINSTALL_STATE_DIR": str(state)},
    )  # fmt: skip
    assert result.code in (0, 1), result.stderr
    assert _kept(state, env) == {"sipure-1.0.dist-info"}
    size = _store(state, env).stat().st_size
    assert size < 16 * record_size, (size, record_size)


def test_a_store_past_its_limit_is_said_and_written_anew(env: Path, tmp_path: Path) -> None:
    """A store larger than STORE_LIMIT (as an unbounded write could leave one) was refused at every read,
    silently, and never written again: now a note says so and it is written anew."""
    state = tmp_path / "state"
    _settle(env)
    assert _modified(_verify(env, state)) == set()
    path = _store(state, env)
    os.truncate(path, STORE_LIMIT + 1)  # sparse
    doc = _verify(env, state)
    assert any("larger than" in note and "clean distributions" in note for note in doc["data"]["notes"])
    assert path.stat().st_size <= STORE_LIMIT
    assert _kept(state, env) == {"sipure-1.0.dist-info"}


def test_a_store_someone_else_wrote_is_said_and_not_used(env: Path, tmp_path: Path) -> None:
    """A store that is a symlink is refused with a note (docs/verify.md: "a note says why")."""
    state = tmp_path / "state"
    _settle(env)
    assert _modified(_verify(env, state)) == set()
    path = _store(state, env)
    (path.parent / "elsewhere.json").write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to("elsewhere.json")
    doc = _verify(env, state)
    assert any("clean distributions was not used" in note for note in doc["data"]["notes"])
    assert path.is_symlink()


def test_an_entry_resting_on_older_hashes_is_believed_a_day_from_the_oldest(
    env: Path, tmp_path: Path
) -> None:
    """A distribution found clean by the verified-inode store's hashes (no file read) is kept with the
    moment of the oldest of them, from which its day counts (it was this check's: a file could go
    unread for two days)."""
    state = tmp_path / "state"
    _settle(env)
    boot = boot_id()
    assert boot is not None
    prefix = _prefix(env)
    site = wheelhouse.site_packages(env)
    files = [p for p in site.rglob("*") if p.is_file() and "sipure" in str(p)]
    hashes: dict[tuple[int, int], VerifiedInode] = {}
    for path in files:  # as hashed by an earlier check: as early as they were settled
        info = os.lstat(path)
        hashes[(info.st_dev, info.st_ino)] = VerifiedInode(
            info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns,
            info.st_ctime_ns + GRANULARITY_NS, wheelhouse.record_digest(path.read_bytes()),
        )  # fmt: skip
    oldest = min(entry.hashed_ns for entry in hashes.values())
    inodes = store_file(environment_state(state, prefix))
    inodes.parent.mkdir(parents=True, mode=0o700)
    inodes.write_bytes(to_bytes(InodeStore(os.fspath(prefix), boot, hashes)))
    inodes.chmod(0o600)
    time.sleep(1)
    assert _modified(_verify(env, state)) == set()
    (sipure,) = json.loads(_store(state, env).read_bytes())["distributions"]
    assert sipure["hashed"] == oldest < sipure["since"]
