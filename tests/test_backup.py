"""Backup and restore with real artefacts: real wheels, installed and upgraded by the real uv."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from safeinstall.env import keep
from safeinstall.env.containment import relative_to_prefix
from safeinstall.env.distributions import dist_info_name, find_distribution, find_distributions
from safeinstall.env.drift import FindingKind
from safeinstall.env.environment import Environment, inspect_environment
from safeinstall.env.verify import verify_environment
from safeinstall.env.wheel import install_location, read_wheel
from safeinstall.store.backup import (
    Backup,
    BackupError,
    check_restored,
    create_backup,
    disk_space_needed,
    free_space,
    load_backup,
    manifest_from_dict,
    manifest_to_dict,
    restore_backup,
    space_problem,
    stale_bytecode,
)
from tests import wheelhouse
from tests.beds import AS_ROOT
from tests.wheelhouse import Wheelhouse

NAMES = ("sipure", "sicext")


def tree(env: Environment) -> dict[str, tuple[object, ...]]:
    """Every file under site-packages and bin (no __pycache__): content hash or link target, mode, owner."""
    found: dict[str, tuple[object, ...]] = {}
    for root in (env.purelib, env.scripts):
        for directory, dirnames, filenames in os.walk(root):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for name in [*filenames, *(d for d in dirnames if os.path.islink(os.path.join(directory, d)))]:
                path = Path(directory) / name
                info = os.lstat(path)
                if stat.S_ISLNK(info.st_mode):
                    content: str = "link:" + os.readlink(path)
                else:
                    content = hashlib.sha256(path.read_bytes()).hexdigest()
                found[str(path.relative_to(env.prefix))] = (
                    content,
                    stat.S_IMODE(info.st_mode),
                    info.st_uid,
                    info.st_gid,
                    info.st_mtime_ns,
                )
    return found


def findings(env: Environment) -> set[tuple[str, str]]:
    report = verify_environment(env, list(NAMES))
    return {(str(f.kind), f.path) for f in report.findings}


def sicext_version(python: Path) -> str:
    return subprocess.run(
        [str(python), "-c", "import sicext; print(sicext.version())"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()


def installed_v1(python: Path, wheels: Wheelhouse) -> tuple[Environment, Path]:
    """v1 of both installed by uv, one file patched locally, one file owned by someone else; the patch."""
    wheelhouse.uv_install(python, wheels["sipure-1"], wheels["sicext-1"])
    env = inspect_environment(python)
    patched = env.purelib / "sipure" / "__init__.py"
    with patched.open("a") as handle:
        handle.write("PATCHED_LOCALLY = True\n")
    if AS_ROOT:
        os.chown(env.purelib / "sipure" / "cli.py", 4321, 4322)
    os.chmod(env.purelib / "sipure" / "data" / "notes.txt", 0o640)
    # a symlink inside a .dist-info: saved and restored as a link
    dist_info = find_distribution(env, "sipure", find_distributions(env)).dist_info
    os.symlink("METADATA", dist_info / "METADATA.link")
    assert sicext_version(python) == "1.0"  # leaves v1 bytecode in __pycache__
    return env, patched


def backup_v1(env: Environment, tmp_path: Path) -> tuple[Backup, set[tuple[str, str]]]:
    before_findings = findings(env)
    patched = sorted(p for kind, p in before_findings if kind in (FindingKind.MODIFIED, FindingKind.MISSING))
    dists = [find_distribution(env, n, find_distributions(env)) for n in NAMES]
    progress: list[tuple[int, int]] = []
    backup = create_backup(
        env,
        dists,
        tmp_path / "state" / "backups" / "run1",
        patched,
        on_progress=lambda done, total: progress.append((done, total)),
        installed=find_distributions(env),
    )
    assert progress and progress[-1][0] == progress[-1][1] == backup.total_bytes
    return backup, before_findings


def upgrade(python: Path, wheels: Wheelhouse) -> None:
    wheelhouse.uv_install(python, wheels["sipure-2"], wheels["sicext-2"], reinstall=True)
    assert sicext_version(python) == "2.0"  # v2 bytecode and .so loaded once


def current_files(env: Environment) -> list[Path]:
    return [Path(loc) for d in find_distributions(env) if d.name in NAMES for loc in d.locations]


@pytest.mark.parametrize("caller_lists", [True, False], ids=["caller-lists-files", "found-by-name"])
def test_backup_upgrade_restore_gives_back_v1_byte_for_byte(
    venv: Path, wheels: Wheelhouse, tmp_path: Path, caller_lists: bool
) -> None:
    env, patched = installed_v1(venv, wheels)
    before = tree(env)
    backup, before_findings = backup_v1(env, tmp_path)
    assert before_findings == {(str(FindingKind.MODIFIED), str(patched))}

    manifest = json.loads((backup.dir / "manifest.json").read_text())
    assert manifest["patched"] == [str(patched)]
    # the total beside it, of this manifest (what the plan's note of the kept backups reads)
    held = json.loads((backup.dir / "bytes.json").read_text())
    assert held["bytes"] == sum(f["size"] for f in manifest["files"]) > 0
    info = (backup.dir / "manifest.json").stat()
    assert held["manifest"] == [info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns]
    assert {d["name"] for d in manifest["distributions"]} == set(NAMES)
    saved = {f["path"]: f for f in manifest["files"]}
    rel = str(patched.relative_to(env.prefix))
    assert saved[rel]["sha256"] == hashlib.sha256(patched.read_bytes()).hexdigest()
    assert "bin/sipure" in saved and "bin/sicext-serve" in saved  # scripts via ../../../bin
    link = next(p for p in saved if p.endswith("METADATA.link"))
    assert saved[link]["link_target"] == "METADATA" and saved[link]["sha256"] is None
    assert any(p.endswith(".dist-info/INSTALLER") for p in saved)
    assert stat.S_IMODE(os.stat(backup.dir).st_mode) == 0o700
    assert (backup.dir / "files" / rel).read_bytes() == patched.read_bytes()

    upgrade(venv, wheels)
    assert tree(env) != before
    assert (env.purelib / "sipure" / "extra_v2.py").exists()
    assert not (env.purelib / "sipure" / "data" / "old.txt").exists()

    loaded = load_backup(backup.dir)
    assert loaded == backup
    # without a list, the installed v2 .dist-info directories are found by name and their RECORDs used
    result = restore_backup(loaded, env, current_files(env) if caller_lists else [])
    assert result.ok, result
    assert result.mismatches == () and result.failures == ()
    assert result.restored == len(loaded.manifest.files)
    assert result.removed >= 1  # extra_v2.py at least
    # uv leaves sipure-1.0.dist-info behind (it holds a file its RECORD does not list): removed too
    removed_dist_infos = {Path(p).name for p in result.removed_dist_infos}
    assert removed_dist_infos >= {"sipure-2.0.dist-info", "sicext-2.0.dist-info"}

    assert tree(env) == before
    assert findings(env) == before_findings
    assert "PATCHED_LOCALLY = True" in patched.read_text()
    assert sicext_version(venv) == "1.0"
    greeting = subprocess.run(
        [str(venv), "-c", "import sipure; print(sipure.greeting(), sipure.PATCHED_LOCALLY)"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    assert greeting == "hello from sipure 1 True"
    assert not list((env.purelib / "sipure").glob("__pycache__/extra_v2.*.pyc"))
    if AS_ROOT:
        assert os.stat(env.purelib / "sipure" / "cli.py").st_uid == 4321

    leftover = env.purelib / "sipure" / ".cli.py.safeinstall-restore-1-ab"  # as a crashed restore leaves
    leftover.write_text("partial")
    again = restore_backup(loaded, env, [])  # idempotent: a crashed restore can be run again
    assert not leftover.exists()
    assert again.ok and tree(env) == before


def test_restore_after_a_half_finished_install(venv: Path, wheels: Wheelhouse, tmp_path: Path) -> None:
    env, _patched = installed_v1(venv, wheels)
    before = tree(env)
    backup, before_findings = backup_v1(env, tmp_path)
    upgrade(venv, wheels)
    # as if uv died halfway: half of the v2 files and the v2 RECORDs are gone
    files = sorted(p for p in current_files(env) if p.name != "extra_v2.py")
    for path in files[::2]:
        path.unlink(missing_ok=True)
    assert (env.purelib / "sipure" / "extra_v2.py").exists()
    for dist in find_distributions(env):
        if dist.name in NAMES:
            (dist.dist_info / "RECORD").unlink(missing_ok=True)
    # the caller knows what the new wheels install
    remove: list[Path] = []
    for key in ("sipure-2", "sicext-2"):
        wheel = read_wheel(wheels[key])
        remove.extend(p for m in wheel.members if (p := install_location(wheel, m, env)) is not None)
    result = restore_backup(backup, env, remove)
    assert result.ok, result
    assert tree(env) == before
    assert findings(env) == before_findings
    assert sicext_version(venv) == "1.0"
    assert not (env.purelib / "sipure" / "extra_v2.py").exists()
    assert [d.version for d in find_distributions(env) if d.name in NAMES] == ["1.0", "1.0"]


def test_hand_added_files_come_back_and_a_failed_installs_debris_goes(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """The package directories are restored exactly: a file added by hand (in no RECORD; --prune may
    have removed it) comes back, and what a failed install left there (uv's temp file on a full disk,
    a new directory) goes, freeing the space the restore needs."""
    env, _patched = installed_v1(venv, wheels)
    added = env.purelib / "sicext" / "local_notes.txt"
    added.write_text("ops notes\n")
    before = tree(env)
    backup, _ = backup_v1(env, tmp_path)
    saved = {f.path: f for f in backup.manifest.files}
    assert saved[str(added.relative_to(env.prefix))].listed is False
    assert all(f.listed for p, f in saved.items() if p.endswith(".pyc"))  # runtime bytecode: a cache
    assert str((env.purelib / "sicext").relative_to(env.prefix)) in backup.manifest.roots
    assert manifest_from_dict(manifest_to_dict(backup.manifest)) == backup.manifest

    upgrade(venv, wheels)
    added.unlink()
    debris = env.purelib / "sicext" / ".tmpk8HXsd"
    debris.write_bytes(b"half a file" * 1000)
    (env.purelib / "sicext" / "newdir").mkdir()
    (env.purelib / "sicext" / "newdir" / "new.py").write_text("")

    result = restore_backup(backup, env, [])

    assert result.ok, result
    assert tree(env) == before
    assert added.read_text() == "ops notes\n" and not debris.exists()
    assert not (env.purelib / "sicext" / "newdir").exists()


def test_a_manifest_from_before_package_roots_still_loads(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    env, _patched = installed_v1(venv, wheels)
    backup, _ = backup_v1(env, tmp_path)
    data = manifest_to_dict(backup.manifest)
    del data["roots"]
    for entry in data["files"]:
        del entry["listed"]
    old = manifest_from_dict(data)
    assert old.roots == () and all(f.listed for f in old.files)


@pytest.mark.parametrize("link_mode", ["copy", "hardlink"])
def test_record_entries_are_saved_as_hardlinks_that_the_install_never_writes_into(
    venv: Path, wheels: Wheelhouse, tmp_path: Path, link_mode: str
) -> None:
    """A backup hardlinks RECORD entries (no copy of a GB package): safe only because uv unlinks them
    before it writes the new version, by copy or by hardlink. A file in no RECORD is copied: an install
    that finds a file at a path it writes (here v2's new module, made by hand in v1) writes into it."""
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    env = inspect_environment(venv)
    package = env.purelib / "sipure"
    by_hand = package / "extra_v2.py"
    by_hand.write_text("# made by hand where v2 ships a module\n")
    backup = create_backup(
        env,
        [find_distribution(env, "sipure", find_distributions(env))],
        tmp_path / "backup",
        [],
        installed=find_distributions(env),
    )

    def saved(path: Path) -> Path:
        return backup.files_dir / os.path.relpath(path, env.prefix)

    assert os.path.samefile(saved(package / "__init__.py"), package / "__init__.py")  # a hardlink
    assert not os.path.samefile(saved(by_hand), by_hand)  # a copy

    wheelhouse.uv_install(venv, wheels["sipure-2"], link_mode=link_mode, reinstall=True)

    assert "version 2" in (package / "__init__.py").read_text()
    assert "version 1" in saved(package / "__init__.py").read_text()
    assert saved(by_hand).read_text() == "# made by hand where v2 ships a module\n"
    for entry in backup.manifest.files:
        path = backup.files_dir / entry.path
        assert hashlib.sha256(path.read_bytes()).hexdigest() == entry.sha256, entry.path
        assert os.stat(path).st_nlink == 1, entry.path  # the install unlinked the old file: ours alone


def test_a_backup_reuses_a_verifys_hashes_only_for_files_unchanged_since(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """The run hashes every file once before the stop (to find local patches); the hardlinked backup
    takes those hashes, except for a file written since (same inode and size, new mtime)."""
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    env = inspect_environment(venv)
    before = verify_environment(env, ["sipure"])
    cli = env.purelib / "sipure" / "cli.py"
    content = cli.read_bytes()
    with open(cli, "r+b") as handle:  # in place: same inode, same size
        handle.write(b"#" + content[1:])
    os.utime(cli, ns=(os.stat(cli).st_atime_ns, os.stat(cli).st_mtime_ns + 1_000_000))
    backup = create_backup(
        env,
        [find_distribution(env, "sipure", find_distributions(env))],
        tmp_path / "b",
        [],
        known=before.observed,
        installed=find_distributions(env),
    )
    saved = {f.path: f.sha256 for f in backup.manifest.files}
    assert saved[os.path.relpath(cli, env.prefix)] == hashlib.sha256(b"#" + content[1:]).hexdigest()
    for entry in backup.manifest.files:
        assert hashlib.sha256((backup.files_dir / entry.path).read_bytes()).hexdigest() == entry.sha256


def test_restore_leaves_paths_outside_and_shared_alone(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    wheelhouse.uv_install(venv, wheels["sipure-1"], wheels["sins-a"])
    env = inspect_environment(venv)
    backup = create_backup(
        env,
        [find_distribution(env, "sipure", find_distributions(env))],
        tmp_path / "b",
        [],
        installed=find_distributions(env),
    )
    outside = tmp_path / "outside.txt"
    outside.write_text("keep me")
    shared = find_distribution(env, "sins-a", find_distributions(env))
    shared_file = next(Path(loc) for loc in shared.locations if loc.endswith(".py"))
    result = restore_backup(backup, env, [outside, shared_file])
    assert result.ok
    assert result.skipped_outside == (str(outside),) and outside.read_text() == "keep me"
    assert result.kept_shared == (str(shared_file),) and shared_file.exists()


def test_refusals(venv: Path, wheels: Wheelhouse, tmp_path: Path) -> None:
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    env = inspect_environment(venv)
    dist = find_distribution(env, "sipure", find_distributions(env))
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("")
    with pytest.raises(BackupError, match="not empty"):
        create_backup(env, [dist], busy, [], installed=find_distributions(env))
    (tmp_path / "incomplete").mkdir()
    with pytest.raises(BackupError, match="never completed") as caught:
        load_backup(tmp_path / "incomplete")
    assert caught.value.hint
    damaged = tmp_path / "damaged"
    damaged.mkdir()
    (damaged / "manifest.json").write_text('{"version": 1}')
    with pytest.raises(BackupError, match="damaged"):
        load_backup(damaged)
    backup = create_backup(env, [dist], tmp_path / "ok", [], installed=find_distributions(env))
    other = inspect_environment(wheelhouse.make_venv(tmp_path / "other"))
    with pytest.raises(BackupError, match="not of"):
        restore_backup(backup, other, [])


def test_space_helpers(venv: Path, wheels: Wheelhouse, tmp_path: Path) -> None:
    wheelhouse.uv_install(venv, wheels["sipure-1"], wheels["sicext-1"])
    env = inspect_environment(venv)
    dists = [find_distribution(env, n, find_distributions(env)) for n in NAMES]
    needed = disk_space_needed(dists, env, find_distributions(env))
    backup = create_backup(env, dists, tmp_path / "b", [], installed=find_distributions(env))
    assert needed >= backup.total_bytes > 0
    assert free_space(tmp_path / "not" / "yet" / "there") > 0
    assert space_problem(10, 100, tmp_path) is None
    problem = space_problem(3 * 2**20, 2**20, tmp_path)
    assert problem is not None and "3.0 MiB" in problem and "SAFEINSTALL_STATE_DIR" in problem
    assert manifest_from_dict(manifest_to_dict(backup.manifest)) == backup.manifest


def test_pure_helpers(tmp_path: Path) -> None:
    prefix = Path("/opt/venv")
    assert relative_to_prefix(Path("/opt/venv/lib/x/../y.py"), prefix) == "lib/y.py"
    assert relative_to_prefix(Path("/opt/venv/../etc/passwd"), prefix) is None
    assert relative_to_prefix(prefix, prefix) is None
    assert dist_info_name("sipure-1.0.dist-info") == "sipure"
    assert dist_info_name("Foo_Bar-2.0rc1.dist-info") == "foo-bar"
    assert dist_info_name("sipure-1.0.data") is None
    with pytest.raises(ValueError, match="escapes"):
        manifest_from_dict(
            {
                "version": 1,
                "created_at": "",
                "prefix": "/p",
                "distributions": [],
                "directories": [],
                "missing": [],
                "outside": [],
                "patched": [],
                "files": [
                    {
                        "path": "../x",
                        "distribution": "d",
                        "size": 0,
                        "mode": 0,
                        "uid": 0,
                        "gid": 0,
                        "mtime_ns": 0,
                        "sha256": None,
                        "link_target": "y",
                    }
                ],
            }
        )
    cache = tmp_path / "__pycache__"
    cache.mkdir()
    for name in ("a.cpython-311.pyc", "a.cpython-311.opt-1.pyc", "ab.cpython-311.pyc"):
        (cache / name).write_bytes(b"")
    assert [p.name for p in stale_bytecode([tmp_path / "a.py", tmp_path / "a.txt"])] == [
        "a.cpython-311.opt-1.pyc",
        "a.cpython-311.pyc",
    ]


def test_kept_links_go_back_only_as_saved(
    venv: Path, wheels: Wheelhouse, tmp_path: Path, small_disk: Callable[[int], Path]
) -> None:
    """Issue 35 item 2: old files shared with other links (a uv cache on the environment's disk: their
    uninstall frees nothing) are kept as links in the prefix before the stop, and a restore puts those
    very inodes back, no new blocks, instead of copies from the backup (here on another filesystem);
    each only when it is exactly what the backup saved: a kept inode written since (its mtime put
    back) is copied from the backup instead. Files with no other link are not kept."""
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    env = inspect_environment(venv)
    package = env.purelib / "sipure"
    shared, tampered, alone = package / "__init__.py", package / "cli.py", package / "data" / "notes.txt"
    cache = tmp_path / "cache"  # as uv's cache in hardlink mode, on the same disk
    cache.mkdir()
    for path in (shared, tampered):
        os.link(path, cache / path.name)
    backup = create_backup(
        env,
        [find_distribution(env, "sipure", find_distributions(env))],
        small_disk(16) / "backup",
        [],
        installed=find_distributions(env),
    )
    paths = [f.path for f in backup.manifest.files if f.link_target is None]
    assert keep.keep_links(env.prefix, "run1", paths) == 2
    inodes = {p: os.stat(p).st_ino for p in (shared, tampered, alone)}
    old = tampered.read_bytes()
    info = os.stat(tampered)
    tampered.write_bytes(b"#" * len(old))
    os.utime(tampered, ns=(info.st_atime_ns, info.st_mtime_ns))

    wheelhouse.uv_install(venv, wheels["sipure-2"], reinstall=True)
    result = restore_backup(backup, env, [], run_id="run1")

    assert result.ok, result
    assert os.stat(shared).st_ino == inodes[shared]  # put back by link
    assert os.stat(tampered).st_ino != inodes[tampered] and tampered.read_bytes() == old  # copied
    assert "version 1" in shared.read_text() and alone.exists()
    assert keep.discard(env.prefix, "run1", 10.0)
    assert not list(env.prefix.glob(f"{keep.KEEP_PREFIX}*"))


def test_kept_links_only_in_a_prefix_root_alone_writes_and_leftovers_go(
    venv: Path, wheels: Wheelhouse
) -> None:
    """Root makes no links in a prefix another can write (an account's environment: the restore copies,
    as before); a keep directory a dead run left goes at the next run's (and in --recover's tidy)."""
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    env = inspect_environment(venv)
    listed = [str(p.relative_to(env.prefix)) for p in (env.purelib / "sipure").glob("*.py")]
    for path in listed:
        os.link(env.prefix / path, env.prefix.parent / path.replace("/", "_"))
    mode = stat.S_IMODE(os.stat(env.prefix).st_mode)
    os.chmod(env.prefix, 0o777)
    try:
        assert keep.keep_links(env.prefix, "run1", listed) == 0
        assert not list(env.prefix.glob(f"{keep.KEEP_PREFIX}*"))
    finally:
        os.chmod(env.prefix, mode)
    dead = env.prefix / keep.keep_name("dead")
    dead.mkdir(mode=0o700)
    (dead / "x").write_text("left by a run that died\n")
    assert keep.keep_links(env.prefix, "run2", listed) == len(listed)
    assert not dead.exists() and (env.prefix / keep.keep_name("run2")).is_dir()
    assert keep.discard_leftovers(env.prefix) == []
    assert not list(env.prefix.glob(f"{keep.KEEP_PREFIX}*"))


def test_a_restore_after_an_install_that_filled_the_disk_makes_its_room_first(
    wheels: Wheelhouse, tmp_path: Path, small_disk: Callable[[int], Path]
) -> None:
    """Issue 44: uv's install of a bigger version ran out of room on the environment's disk (the new
    files in place, the old ``.dist-info`` gone, the new one half written). The restore wrote each saved
    copy beside the file it replaces (the blob, in both versions: not removed first), several at once,
    and failed for lack of room. Now what the install wrote goes first (the files of both versions
    too), then the saved files are written one at a time into the room that made: the old version back,
    whole."""
    old = wheelhouse.rebuilt(wheels["sicext-1"], tmp_path / "old", {"sicext/blob.bin": os.urandom(4 << 20)})
    bigger = {"sicext/blob.bin": os.urandom((4 << 20) + (128 << 10))}
    new = wheelhouse.rebuilt(wheels["sicext-2"], tmp_path / "new", bigger)
    disk = small_disk(48)
    python = wheelhouse.make_venv(disk / "venv")
    uv = {**wheelhouse.uv_env(), "UV_CACHE_DIR": str(tmp_path / "uv-cache")}  # another filesystem: copies
    install = [wheelhouse.UV, "pip", "install", "--quiet", "--offline", "--python", str(python)]
    subprocess.run([*install, str(old)], check=True, env=uv)
    env = inspect_environment(python)
    installed = find_distributions(env)
    backup = create_backup(
        env, [find_distribution(env, "sicext", installed)], tmp_path / "backup", [], installed=installed
    )
    subprocess.run([*install, "--dry-run", str(new)], check=True, env=uv)  # in uv's cache: no room needed
    vfs = os.statvfs(disk)
    with (disk / "filler").open("wb") as filler:
        filler.write(b"\0" * (vfs.f_bavail * vfs.f_frsize - (116 << 10)))
    failed = subprocess.run(
        [*install, "--reinstall-package", "sicext", str(new)], env=uv, capture_output=True
    )
    assert failed.returncode != 0 and b"No space left on device" in failed.stderr, failed.stderr

    wheel = read_wheel(new)
    locations = [install_location(wheel, member, env) for member in wheel.members]
    result = restore_backup(backup, env, [p for p in locations if p is not None])

    assert result.ok, result
    assert not check_restored(backup, env.prefix)
    assert [d.version for d in find_distributions(env) if d.name == "sicext"] == ["1.0"]


def test_a_manifest_is_read_as_every_state_file_is(tmp_path: Path) -> None:
    """Issue 48: the manifest was read with ``read_bytes()``, following a link and without a bound.
    Now it goes through the state directory's checked reader: a link is refused, never followed, by
    the undo's and recovery's loader and by the plan's note of what the kept backups hold."""
    from safeinstall.store.retention import kept_backups

    elsewhere = tmp_path / "elsewhere.json"
    elsewhere.write_text(json.dumps({"files": [{"path": "a", "size": 5}]}))
    backups = tmp_path / "backups"
    linked = backups / "20261201T000000Z-1"
    linked.mkdir(parents=True)
    (linked / "manifest.json").symlink_to(elsewhere)
    with pytest.raises(BackupError, match="symbolic link"):
        load_backup(linked)
    assert [(k.path.name, k.bytes) for k in kept_backups(backups)] == [("20261201T000000Z-1", 0)]
