"""The run's uv cache is filled from the owner's (safeinstall/env/cachefill.py): what the host already has
is copied (cloned where the filesystem can), never fetched again, and never linked (the run's cache
shares no inode with a cache that outlives the run, root's own included: issue 43); an entry whose files
differ from their RECORD is said and fetched afresh. Real uv, real wheels, a cache uv filled itself."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest

from safeinstall.env import cachefill, inodes, inodetrust
from safeinstall.env.environment import Environment
from safeinstall.env.uvplan import UvChange, UvRequest
from safeinstall.store.state import EnvironmentState
from tests import wheelhouse
from tests.wheelhouse import Wheelhouse


def _uv_fills(cache: Path, wheels: Wheelhouse, python: Path, target: Path, requirement: str) -> str:
    """uv installs ``requirement`` from the wheelhouse into ``target`` with ``cache`` (offline)."""
    proc = subprocess.run(
        [
            wheelhouse.UV,
            "pip",
            "install",
            "--offline",
            "--no-deps",
            "--python",
            str(python),
            "--target",
            str(target),
            "--link-mode",
            "hardlink",
            "--find-links",
            str(wheels.wheels["sipure-1"].parent),
            requirement,
        ],
        capture_output=True,
        text=True,
        env={**wheelhouse.uv_env(), "UV_CACHE_DIR": str(cache)},
        check=True,
    )
    return proc.stdout + proc.stderr


def _inodes(root: Path) -> set[tuple[int, int]]:
    found: set[tuple[int, int]] = set()
    for directory, _dirs, files in os.walk(root):
        for name in files:
            info = os.lstat(os.path.join(directory, name))
            if not os.path.islink(os.path.join(directory, name)):
                found.add((info.st_dev, info.st_ino))
    return found


def test_the_runs_cache_is_filled_from_the_owners_by_copy_and_uv_fetches_nothing_again(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    owners = tmp_path / "owners-cache"
    _uv_fills(owners, wheels, venv, tmp_path / "t1", "sipure==1.0")
    (owned_archive,) = os.listdir(owners / "archive-v0")
    run_cache = tmp_path / "run-cache"
    run_cache.mkdir(mode=0o700)

    filled = cachefill.fill(owners, run_cache, [UvChange("install", "sipure", "1.0", None)], None)

    assert filled.problem is None and filled.archives == 1 and filled.entries == ("sipure 1.0",)
    assert os.listdir(run_cache / "archive-v0") == [owned_archive]
    assert _inodes(run_cache) and not _inodes(run_cache) & _inodes(owners)  # copied, never linked
    # uv takes the copy: it unpacks nothing new into the run's cache (a new archive would be another id)
    _uv_fills(run_cache, wheels, venv, tmp_path / "t2", "sipure==1.0")
    assert os.listdir(run_cache / "archive-v0") == [owned_archive]
    assert (tmp_path / "t2" / "sipure" / "__init__.py").read_bytes() == (
        tmp_path / "t1" / "sipure" / "__init__.py"
    ).read_bytes()


def test_only_what_the_plan_installs_is_copied_and_a_link_that_leads_elsewhere_is_not_followed(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    owners = tmp_path / "owners-cache"
    _uv_fills(owners, wheels, venv, tmp_path / "t1", "sipure==1.0")
    run_cache = tmp_path / "run-cache"
    run_cache.mkdir(mode=0o700)
    # another version, and a name whose entry links out of the cache
    assert cachefill.fill(owners, run_cache, [UvChange("install", "sipure", "2.0", None)], None).archives == 0
    (entry_dir,) = (owners / "wheels-v8").glob("index/*/sipure")
    outside = tmp_path / "archive-v0" / "x"  # beside the cache, not in it
    outside.mkdir(parents=True)
    (outside / "key").write_text("root's")
    bad = entry_dir.parent / "evil"
    bad.mkdir()
    (bad / "1.0-py3-none-any").symlink_to("../../../../../archive-v0/x")  # one ".." too many
    (bad / "1.0-py3-none-other").symlink_to("../../../../archive-v0/../../archive-v0/x")
    (owners / "archive-v0" / "x").mkdir()  # an archive of that id in the cache too: still not linked to
    filled = cachefill.fill(owners, run_cache, [UvChange("install", "evil", "1.0", None)], None)
    assert filled.problem is None and filled.archives == 0, filled
    assert not list(run_cache.rglob("key")) and not list(run_cache.rglob("1.0-py3-none-*"))
    # a wheel given by its path, and what is uninstalled, are never looked up
    assert cachefill.wanted(
        [
            UvChange("uninstall", "sipure", "1.0", None),
            UvChange("install", "sicext", "2.0", "file:///w/sicext-2.0.whl"),
            UvChange("install", "sipure", "2.0", None),
        ]
    ) == [["sipure", "2.0"]]


def test_root_never_copies_a_cache_another_user_could_write(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """A root-owned environment's fill runs as root over the caller's cache (``sudo -E`` may keep a
    user's ``HOME``; ``UV_CACHE_DIR`` may be a shared cache): a file or directory in it that is not
    root's, or that others may write, stops the fill before its entry is made, and uv fetches it."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    owners = tmp_path / "owners-cache"
    _uv_fills(owners, wheels, venv, tmp_path / "t1", "sipure==1.0")
    (archive,) = (owners / "archive-v0").iterdir()
    planted = next(p for p in archive.rglob("*.py"))
    os.chown(planted, 65534, 65534)  # another user's file in the archive (it could write it)
    run_cache = tmp_path / "run-cache"
    run_cache.mkdir(mode=0o700)
    filled = cachefill.fill(owners, run_cache, [UvChange("install", "sipure", "1.0", None)], None)
    assert filled.problem is not None and "not this account's own" in filled.problem, filled
    assert not list(run_cache.glob("wheels-v*/index/*/sipure/1.0-*")), "no entry names the copy"
    os.chown(planted, 0, 0)
    os.chmod(planted, 0o666)  # root's, but everyone may write it
    filled = cachefill.fill(
        owners, tmp_path / "run-cache-2", [UvChange("install", "sipure", "1.0", None)], None
    )
    assert filled.problem is not None, filled


def test_an_archive_that_differs_from_its_record_is_said_and_not_taken(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """A file of the owner's cached archive edited in place (an installed file uv had linked from it,
    hotfixed): the archive is not copied, no entry names it, and the fill says which it is."""
    owners = tmp_path / "owners-cache"
    _uv_fills(owners, wheels, venv, tmp_path / "t1", "sipure==1.0")
    (module,) = (owners / "archive-v0").glob("*/sipure/__init__.py")
    with module.open("a") as edit:
        edit.write("# hotfix\n")
    run_cache = tmp_path / "run-cache"
    run_cache.mkdir(mode=0o700)
    filled = cachefill.fill(owners, run_cache, [UvChange("install", "sipure", "1.0", None)], None)
    assert filled.problem is None and filled.damaged == ("sipure 1.0",) and filled.archives == 0, filled
    assert not list(run_cache.glob("archive-v0/*")) and not list(run_cache.glob("wheels-v*/*/*/sipure/1.0-*"))


def test_a_clean_reinstall_from_roots_warm_cache_shares_no_inode_with_it(
    wheels: Wheelhouse, tmp_path: Path
) -> None:
    """Issue 43, item 3: sipure 2.0 installed by hand from root's own uv cache (uv links it: the hand's
    installed files share their inodes with the cache). safeinstall's clean reinstall by name from that
    warm cache takes it from there (not fetched), and after it no reinstalled file shares its inode with
    the cache (link count 1): an in-place edit of an installed file changes nothing in the cache. Then
    the hand's install again, hotfixed in place (which changes the cache too): the next clean reinstall
    says the changed copy (`uv cache clean sipure`), fetches a fresh one and succeeds."""
    if os.geteuid() != 0:
        pytest.skip("root's own cache: needs root")
    from tests.clirun import run as safeinstall

    cache = tmp_path / "root-cache"
    cache.mkdir(mode=0o700)
    python = wheelhouse.make_venv(tmp_path / "venv")
    links = str(wheels.wheels["sipure-1"].parent)
    env = {
        **wheelhouse.uv_env(),
        "UV_CACHE_DIR": str(cache),
        "SAFEINSTALL_STATE_DIR": str(tmp_path / "state"),
    }
    site = wheelhouse.site_packages(python)
    installed = site / "sipure" / "__init__.py"

    def by_hand() -> None:
        subprocess.run(
            [
                *(wheelhouse.UV, "pip", "install", "--quiet", "--offline", "--python", str(python)),
                *("--reinstall", "--find-links", links, "sipure==2.0"),
            ],
            check=True,
            env=env,
        )
        assert installed.stat().st_nlink > 1  # the hand's install: linked with root's cache

    def clean_reinstall() -> str:
        result = safeinstall(
            "--python", str(python), "--yes", "--json", "--settle", "0", "sipure",
            "--", "--offline", "--find-links", links,
            env=env,
        )  # fmt: skip
        assert result.code == 0, result.stdout + result.stderr
        return result.stdout + result.stderr

    def cache_files() -> dict[tuple[int, int], bytes]:
        return {
            (info.st_dev, info.st_ino): path.read_bytes()
            for path in cache.rglob("*")
            if path.is_file() and not path.is_symlink()
            for info in [path.stat()]
        }

    by_hand()
    pristine = installed.read_bytes()
    said = clean_reinstall()
    assert f"unpacked wheel(s) copied from {cache}" in said and "changed copy" not in said, said
    assert "hashed as the fill copied them, not read again" in said, said  # read once, not twice
    assert ", beside the preflight (the prefetch waited" in said, said  # filled while the old files hashed
    in_cache = cache_files()
    record = next(site.glob("sipure-2.0.dist-info")) / "RECORD"
    for line in record.read_text().splitlines():
        path = site / line.split(",", 1)[0]
        if path.is_file() and "__pycache__" not in path.parts:
            info = path.stat()
            assert info.st_nlink == 1, path  # shares its inode with nothing
            assert (info.st_dev, info.st_ino) not in in_cache, path
    with installed.open("a") as edit:
        edit.write("# hotfix\n")
    assert cache_files() == in_cache  # the cache did not change with it

    by_hand()
    with installed.open("a") as edit:
        edit.write("# hotfix\n")  # linked: the cache holds the hotfix too
    said = clean_reinstall()
    assert "uv's cache holds a changed copy of sipure 2.0: `uv cache clean sipure`" in said, said
    assert installed.read_bytes() == pristine  # from the fresh copy, not the changed one
    assert not list((tmp_path / "state").rglob("uv-cache-*"))  # the runs' caches went with them


def test_a_copy_hashed_as_the_fill_wrote_it_stands_for_that_inode_unchanged_and_nothing_else(
    tmp_path: Path,
) -> None:
    """The fill hashes each copy as it writes it (one read, not two): the run's cache hash takes that
    digest for the inode it wrote, with the size and mtime it left, without reading it; a copy changed
    since (its mtime), or another inode at that path, is read and hashed."""
    copy = tmp_path / "cache" / "archive-v0" / "id" / "m.py"
    copy.parent.mkdir(parents=True)
    copy.write_bytes(b"print(1)\n")
    info = copy.stat()
    key, claimed = (info.st_dev, info.st_ino), "A" * 43  # a digest the bytes do not have: was it read?
    actual = base64.urlsafe_b64encode(hashlib.sha256(b"print(1)\n").digest()).rstrip(b"=").decode()
    written = {str(copy): (claimed, info.st_size, info.st_ino, info.st_mtime_ns)}
    taken = inodes.hash_cache(tmp_path / "cache", written=written)[key]
    assert taken.digest == claimed and taken.hashed_ns > 0  # not read: as hashed when the fill wrote it
    os.utime(copy, ns=(info.st_atime_ns, info.st_mtime_ns + 10**9))  # changed since the fill wrote it
    assert inodes.hash_cache(tmp_path / "cache", written=written)[key].digest == actual
    other = copy.with_name("other")
    other.write_bytes(b"print(1)\n")
    os.utime(other, ns=(info.st_atime_ns, info.st_mtime_ns))
    other.rename(copy)  # another inode at that path (made while the first lived: never its number)
    again = copy.stat()
    assert (
        inodes.hash_cache(tmp_path / "cache", written=written)[(again.st_dev, again.st_ino)].digest == actual
    )


def test_a_kept_hash_stands_for_a_root_only_inode_whose_links_changed_and_for_nothing_else(
    tmp_path: Path,
) -> None:
    """The rule of :func:`verified.root_only_digest`: size and modification time unchanged, the change
    time moved by links (not back), root's and writable by root alone; anything else is read."""
    from safeinstall.env.inodetrust import VerifiedInode, root_only_digest

    path = tmp_path / "f"
    path.write_bytes(b"x" * 10)
    os.chmod(path, 0o644)
    info = os.lstat(path)
    entry = VerifiedInode(info.st_dev, info.st_ino, 10, info.st_mtime_ns, info.st_ctime_ns, 1, "d" * 43, 1)
    if os.geteuid() != 0:
        assert root_only_digest(entry, info) is None  # not root's
        return
    assert root_only_digest(entry, info) == "d" * 43
    os.link(path, tmp_path / "g")  # the change time moves: a link, as uv's and the run's make
    assert os.lstat(path).st_ctime_ns >= entry.ctime_ns
    assert root_only_digest(entry, os.lstat(path)) == "d" * 43
    assert root_only_digest(entry._replace(ctime_ns=os.lstat(path).st_ctime_ns + 1), os.lstat(path)) is None
    store = inodetrust.InodeStore(str(tmp_path), "boot", {(info.st_dev, info.st_ino): entry})
    assert inodetrust.checker(store, root_links=True)(os.lstat(path), "sha256") == "d" * 43  # a preflight's
    assert inodetrust.checker(store)(os.lstat(path), "sha256") is None  # the drift check's: all five
    os.chmod(path, 0o664)  # its group may write it
    assert root_only_digest(entry, os.lstat(path)) is None
    os.chmod(path, 0o644)
    os.chown(path, 65534, 0)  # another user's
    assert root_only_digest(entry, os.lstat(path)) is None
    os.chown(path, 0, 0)
    before = os.lstat(path).st_mtime_ns
    path.write_bytes(b"y" * 10)  # written: the mtime moves (root setting it back is root itself)
    assert os.lstat(path).st_mtime_ns != before
    assert root_only_digest(entry, os.lstat(path)) is None
    assert root_only_digest(entry._replace(size=11), info) is None
    assert root_only_digest(entry._replace(root_only=0), info) is None  # hashed while not root's alone


def _roots_cache_and_state(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> tuple[Path, Environment, EnvironmentState]:
    """A root-only uv cache holding sipure 1.0, ``venv`` inspected, and its state directory made."""
    from safeinstall.env.environment import inspect_environment
    from safeinstall.store.state import ensure_environment_dir, environment_state

    owners = tmp_path / "owners-cache"
    owners.mkdir(mode=0o700)
    _uv_fills(owners, wheels, venv, tmp_path / "t1", "sipure==1.0")
    env = inspect_environment(venv)
    state = environment_state(tmp_path / "state", env.prefix)
    ensure_environment_dir(state)
    return owners, env, state


def test_a_fill_started_beside_the_preflight_that_no_run_takes_is_waited_for_and_removed(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """The fill starts in the preflight, before the run is sure to go on (it may be declined, refused or
    interrupted before its prefetch): abandoned, it is waited for and the run's cache goes, copies and
    all; the owner's cache is untouched. Root's own cache (the fill checks it is root's alone)."""
    if os.geteuid() != 0:
        pytest.skip("root's own cache: needs root")
    from safeinstall.run.parts import prefill

    owners, env, state = _roots_cache_and_state(venv, wheels, tmp_path)
    before = _inodes(owners)
    changes = (UvChange("install", "sipure", "1.0", None),)
    environ = {"UV_CACHE_DIR": str(owners)}

    given = UvRequest(venv, "sipure", wheel=wheels.wheels["sipure-2"])
    started = prefill.start(environ, env, state, "run-1", changes, "hardlink", request=given)
    assert started is not None and started.cache == state.uv_cache("run-1")
    prefill.abandon(started)
    assert started.answer.done() and started.answer.result().archives == 1  # waited for, not cut short
    # the wheel's unpack too: over (finished, or stopped as no run wants it), its scratch gone
    assert started.unpacking is not None and started.unpacking.done()
    assert "unpacked" in started.unpacking.result()
    assert not state.uv_cache("run-1").exists()  # the copies went with it
    assert not state.unpack_dir("run-1").exists()  # and the unpack's throwaway target
    assert _inodes(owners) == before
    prefill.abandon(started)  # idempotent

    # nothing the plan fetches, or uv's own cache options: no fill, no directory
    assert (
        prefill.start(
            environ, env, state, "run-2", (UvChange("install", "sipure", "1.0", "w.whl"),), "hardlink"
        )
        is None
    )
    assert prefill.start(environ, env, state, "run-3", changes, "copy") is None
    assert not state.uv_cache("run-2").exists() and not state.uv_cache("run-3").exists()


def _a_wheel_whose_requirement_roots_cache_holds(
    venv: Path, tmp_path: Path
) -> tuple[Path, Path, Path, Path, dict[str, str]]:
    """siwants 1.0 in ``venv``; siwants 2.0's wheel, which requires siwanted 2.0, held in a find-links
    directory and in a root-only uv cache (another venv's install): ``(links, the new wheel, the cache,
    the state directory, the run's environment)``."""
    links = tmp_path / "links"
    for made in (links, tmp_path / "old", tmp_path / "new"):
        made.mkdir()
    wheelhouse.make_wheel(links, "siwanted", "2.0", {"siwanted/__init__.py": b"W = 2\n"})
    old = wheelhouse.make_wheel(tmp_path / "old", "siwants", "1.0", {"siwants/__init__.py": b"V = 1\n"})
    new = wheelhouse.make_wheel(
        tmp_path / "new", "siwants", "2.0", {"siwants/__init__.py": b"V = 2\n"}, ("siwanted==2.0",)
    )
    cache = tmp_path / "root-cache"
    cache.mkdir(mode=0o700)
    state = tmp_path / "state"
    env = {**wheelhouse.uv_env(), "UV_CACHE_DIR": str(cache), "SAFEINSTALL_STATE_DIR": str(state)}
    wheelhouse.uv_install(venv, old)
    held = wheelhouse.Wheelhouse(links, {"sipure-1": links / "siwanted-2.0-py3-none-any.whl"})
    _uv_fills(cache, held, venv, tmp_path / "elsewhere", "siwanted==2.0")  # root's cache warm with it
    return links, new, cache, state, env


def test_a_given_wheel_is_unpacked_into_the_runs_cache_beside_the_fill_and_never_again(
    venv: Path, tmp_path: Path
) -> None:
    """A wheel given by its path whose plan also installs a requirement root's cache holds: uv unpacks
    the wheel into the run's cache while the fill copies the requirement (the copy waits on the disk, the
    unpack on a CPU), so the prefetch's uv unpacks nothing; the unpack's throwaway ``--target`` goes.
    Real uv, root's own cache."""
    if os.geteuid() != 0:
        pytest.skip("root's own cache: needs root")
    from tests.clirun import run as safeinstall

    links, new, cache, state, env = _a_wheel_whose_requirement_roots_cache_holds(venv, tmp_path)

    result = safeinstall(
        "--python", str(venv), "--yes", "--settle", "0", "siwants", "--wheel", str(new),
        "--", "--offline", "--find-links", str(links),
        env=env,
    )  # fmt: skip

    assert result.code == 0, result.stdout + result.stderr
    (log,) = state.rglob("logs/*.log")
    said = log.read_text()
    assert f"copied from {cache}, beside the preflight" in said, said  # the fill ran
    assert "prefetch: the wheel unpacked into the run's cache beside the copy in" in said, said
    uv_said = said.split("uv exit 0:", 1)[1].split("\n[", 1)[0]
    assert "Installed 2 packages" in uv_said and "Prepared" not in uv_said, uv_said  # unpacked nothing
    assert (wheelhouse.site_packages(venv) / "siwants" / "__init__.py").read_bytes() == b"V = 2\n"
    assert not list(state.rglob("prefetch-*")) and not list(state.rglob("uv-cache-*"))


def test_an_unpacks_throwaway_target_goes_with_its_run_and_only_its_own(tmp_path: Path) -> None:
    """A run killed while uv unpacked its wheel leaves ``prefetch-RUN-unpack``: removed with the run's
    own directories (the rollback, ``--recover``), never another run's."""
    from safeinstall.store.state import EnvironmentState, remove_uv_caches

    state = EnvironmentState(tmp_path, tmp_path / "env", None)
    state.dir.mkdir()
    for run_id in ("20261206T000000Z-1", "20261206T000000Z-2"):
        state.unpack_dir(run_id).mkdir()
        state.uv_cache(run_id).mkdir()
    assert remove_uv_caches(state, "20261206T000000Z-1", 5.0) == ()
    left = ["prefetch-20261206T000000Z-2-unpack", "uv-cache-20261206T000000Z-2"]
    assert sorted(os.listdir(state.dir)) == left
    assert remove_uv_caches(state, seconds=5.0) == () and os.listdir(state.dir) == []


def test_a_file_whose_digest_roots_store_keeps_is_copied_in_the_kernel_under_that_digest(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """Root's own cache: a source file whose digest root's verified-inode store keeps for that very inode
    (size and mtime unchanged) is copied by the kernel and not read; the digest it stands under is the
    kept one: a wrong one is what the RECORD check then sees (the archive is said damaged, not taken),
    which shows the file was not read. An account's fill never takes such digests."""
    owners = tmp_path / "owners-cache"
    _uv_fills(owners, wheels, venv, tmp_path / "t1", "sipure==1.0")
    (archive,) = os.listdir(owners / "archive-v0")
    source = owners / "archive-v0" / archive / "sipure" / "__init__.py"
    record = next((owners / "archive-v0" / archive).glob("*.dist-info")) / "RECORD"
    listed = next(line for line in record.read_text().splitlines() if line.startswith("sipure/__init__.py,"))
    right = listed.split(",")[1].split("=", 1)[1]
    wrong = base64.urlsafe_b64encode(hashlib.sha256(b"not these bytes").digest()).rstrip(b"=").decode()
    inode = source.stat().st_ino
    changes = [UvChange("install", "sipure", "1.0", None)]

    def kept(digest: str) -> Callable[[os.stat_result], str | None]:
        return lambda info: digest if info.st_ino == inode else None

    good = cachefill.fill(owners, tmp_path / "run-1", changes, None, kept(right))
    assert good.archives == 1 and not good.damaged and good.unread == 1, good
    path = f"archive-v0/{archive}/sipure/__init__.py"
    (taken,) = [d for d in good.digests if d[0] == path]
    copy = tmp_path / "run-1" / path
    assert taken[1] == right and taken[3] == copy.stat().st_ino  # the copy's own inode, the kept digest
    assert copy.read_bytes() == source.read_bytes() and copy.stat().st_ino != inode

    bad = cachefill.fill(owners, tmp_path / "run-2", changes, None, kept(wrong))
    assert bad.archives == 0 and bad.damaged == ("sipure 1.0",) and bad.unread == 0, bad

    # none: every file read and hashed as it is copied
    plain = cachefill.fill(owners, tmp_path / "run-3", changes, None)
    assert plain.archives == 1 and plain.unread == 0 and not plain.damaged


def _xfs_with_reflink(where: Path) -> Path | None:
    """A small XFS (reflink on) loop-mounted at ``where`` (None: no mkfs.xfs, or no loop mount here)."""
    if os.geteuid() != 0 or shutil.which("mkfs.xfs") is None or shutil.which("filefrag") is None:
        return None
    image = where.parent / f"{where.name}.img"
    with image.open("wb") as sparse:
        sparse.truncate(512 * 1024 * 1024)
    where.mkdir()
    made = subprocess.run(["mkfs.xfs", "-q", "-m", "reflink=1", str(image)], capture_output=True)
    mounted = made.returncode == 0 and (
        subprocess.run(["mount", "-o", "loop", str(image), str(where)], capture_output=True).returncode == 0
    )
    return where if mounted else None


def _shares_blocks(path: Path) -> bool:
    """``path``'s first extent is shared with another file (FIEMAP's flag, as ``filefrag -v`` says)."""
    said = subprocess.run(["filefrag", "-v", str(path)], capture_output=True, text=True, check=True).stdout
    return "shared" in said


def test_on_a_filesystem_that_reflinks_the_fill_clones_roots_cache(
    wheels: Wheelhouse, tmp_path: Path
) -> None:
    """Issue 43, item 3, where the filesystem can: on XFS with reflink (a loop mount, where mkfs.xfs and
    loop mounts are at hand), the clean reinstall by name from root's warm cache clones it (``FICLONE``):
    each reinstalled file is an inode of its own (link count 1, not one of the cache's) whose blocks are
    shared with the cache's copy, so an in-place edit changes nothing in the cache."""
    mount = _xfs_with_reflink(tmp_path / "xfs")
    if mount is None:
        pytest.skip("needs root, mkfs.xfs, filefrag and a loop mount (a filesystem that reflinks)")
    from tests.clirun import run as safeinstall

    try:
        cache = mount / "root-cache"
        cache.mkdir(mode=0o700)
        python = wheelhouse.make_venv(mount / "venv")
        links = str(wheels.wheels["sipure-1"].parent)
        env = {
            **wheelhouse.uv_env(),
            "UV_CACHE_DIR": str(cache),
            "SAFEINSTALL_STATE_DIR": str(mount / "state"),
        }
        subprocess.run(
            [
                *(wheelhouse.UV, "pip", "install", "--quiet", "--offline", "--python", str(python)),
                *("--find-links", links, "sipure==2.0"),
            ],
            check=True,
            env=env,
        )
        installed = wheelhouse.site_packages(python) / "sipure" / "__init__.py"
        os.sync()  # the hand's cache on disk: its blocks are what a clone shares
        result = safeinstall(
            "--python", str(python), "--yes", "--json", "--settle", "0", "sipure",
            "--", "--offline", "--find-links", links,
            env=env,
        )  # fmt: skip
        assert result.code == 0, result.stdout + result.stderr
        assert f"unpacked wheel(s) copied from {cache}" in result.stdout, result.stdout
        cached = [p for p in cache.rglob("__init__.py") if "sipure" in p.parts and p.parent.name == "sipure"]
        assert cached, sorted(cache.rglob("*"))
        info = installed.stat()
        assert info.st_nlink == 1 and all(info.st_ino != p.stat().st_ino for p in cached)
        os.sync()
        assert _shares_blocks(installed), "cloned: the installed file shares its blocks with the cache's"
        before = {p: p.read_bytes() for p in cached}
        with installed.open("a") as edit:
            edit.write("# hotfix\n")
        assert {p: p.read_bytes() for p in cached} == before  # copy on write: the cache is unchanged
    finally:
        subprocess.run(["umount", str(mount)], check=False)


def test_a_given_wheels_unpack_beside_the_fill_runs_as_the_accounts_and_never_as_root(
    open_dir: Path, open_state: Path, wheels: Wheelhouse
) -> None:
    """An account's environment whose owner's cache holds what the plan brings: the wheel's unpack
    beside the fill runs uv, and so the environment's interpreter (its ``.pth`` files), as the account,
    never as root. Real uv; uid 65534 with a home of the test's (the password database's has none)."""
    if os.geteuid() != 0:
        pytest.skip("the attack is on a run as root")
    import dataclasses
    import shutil

    from safeinstall.env.environment import Account, inspect_environment
    from safeinstall.run.parts import prefill
    from safeinstall.store.state import ensure_environment_dir, environment_state, let_through
    from tests import beds

    shared = beds.shared_interpreter_or_skip()
    venv = open_dir / "venv"
    wheelhouse.make_venv(venv, shared)
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    home = open_dir / "home"
    _uv_fills(home / ".cache" / "uv", wheels, venv, open_dir / "elsewhere", "sipure==1.0")
    uids = open_dir / "uids"
    uids.touch(mode=0o666)
    uids.chmod(0o666)
    (site,) = (venv / "lib").glob("python*/site-packages")
    trap = f"import os; open({str(uids)!r}, 'a').write(f'{{os.getuid()}} {{os.geteuid()}}\\n')\n"
    (site / "zz_trap.pth").write_text(trap)
    given = open_dir / wheels.wheels["sipure-2"].name
    shutil.copyfile(wheels.wheels["sipure-2"], given)
    given.chmod(0o644)
    for top in (venv, home):
        beds.chown_tree(top, beds.NOBODY)
    uids.write_text("")
    env = inspect_environment(venv / "bin" / "python")
    assert env.account is not None and env.account.uid == beds.NOBODY
    env = dataclasses.replace(env, account=Account(beds.NOBODY, beds.NOBODY, str(home)))
    state = environment_state(open_state, env.prefix)
    ensure_environment_dir(state)
    let_through(state)
    changes = (UvChange("install", "sipure", "1.0", None),)
    request = UvRequest(venv / "bin" / "python", "sipure", wheel=given)

    started = prefill.start({}, env, state, "run-1", changes, "hardlink", request=request)
    assert started is not None and started.unpacking is not None
    try:
        said = started.unpacking.result()
    finally:
        prefill.abandon(started)
    assert "unpacked into the run's cache" in said, said
    ran_as = set(uids.read_text().split())
    assert ran_as == {str(beds.NOBODY)}, ran_as  # the interpreter ran, as the account alone
    assert not state.unpack_dir("run-1").exists() and not state.uv_cache("run-1").exists()


def test_a_declined_runs_fill_and_unpack_beside_the_preflight_go_with_it(venv: Path, tmp_path: Path) -> None:
    """A run declined at the prompt (a terminal) whose preflight started the fill and the given wheel's
    unpack: both are waited for and the run's cache goes with the run (copies, the unpacked wheel and
    all), never left for the next run. Real uv, root's own cache."""
    if os.geteuid() != 0:
        pytest.skip("root's own cache: needs root")
    from tests.beds import answered_no_on_a_terminal

    links, new, _cache, state, env = _a_wheel_whose_requirement_roots_cache_holds(venv, tmp_path)
    args = ["--python", str(venv), "--settle", "0", "siwants", "--wheel", str(new)]
    _code, out, err = answered_no_on_a_terminal([*args, "--", "--offline", "--find-links", str(links)], env)

    assert "not confirmed" in out + err, out + err
    assert not list(state.rglob("uv-cache-*")), list(state.rglob("uv-cache-*"))
    assert not list(state.rglob("prefetch-*"))


def test_a_given_wheels_unpack_that_no_run_waits_for_is_stopped_not_waited_out(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """The wheel's unpack beside the fill, held up (its owner stops uv, or the wheel is huge) when the
    run no longer wants it (interrupted, failed, declined): uv is killed and its scratch goes, the run
    does not wait for it to end (up to the fill's 600 s). The interpreter uv asks blocks on a FIFO that
    only the test's guard, as a last resort, would open."""
    if os.geteuid() != 0:
        pytest.skip("root's own cache: needs root")
    import threading

    from safeinstall.run.parts import prefill

    owners, env, state = _roots_cache_and_state(venv, wheels, tmp_path)
    fifo = tmp_path / "held"
    os.mkfifo(fifo)
    asked = tmp_path / "asked"
    blocking = tmp_path / "bin" / "python"
    blocking.parent.mkdir()
    blocking.write_text(f"#!/bin/sh\n: > {asked}\nread line < {fifo}\nexit 1\n")
    blocking.chmod(0o755)
    given = UvRequest(blocking, "sipure", wheel=wheels.wheels["sipure-2"])
    changes = (UvChange("install", "sipure", "1.0", None),)

    started = prefill.start(
        {"UV_CACHE_DIR": str(owners)}, env, state, "run-1", changes, "hardlink", request=given
    )
    assert started is not None and started.unpacking is not None
    started.answer.result()  # the copy is over: what is left is the unpack, blocked
    while not asked.exists():  # uv asks the interpreter: it blocks now
        assert not started.unpacking.done(), started.unpacking.result()
        threading.Event().wait(0.05)
    released: list[bool] = []

    def guard() -> None:  # the last resort, so that a run that waits it out ends the test
        if not done.wait(60):
            released.append(True)
            with open(fifo, "w") as writer:
                writer.write("\n")

    done = threading.Event()
    watcher = threading.Thread(target=guard, daemon=True)
    watcher.start()
    prefill.abandon(started)
    done.set()
    watcher.join()
    assert not released, "the run waited until the interpreter uv asked was let go"
    assert "not unpacked" in started.unpacking.result(), started.unpacking.result()
    assert not state.unpack_dir("run-1").exists() and not state.uv_cache("run-1").exists()
