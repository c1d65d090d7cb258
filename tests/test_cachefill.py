"""The run's uv cache is filled from the owner's (safeinstall/env/cachefill.py): what the host already has
is copied, never fetched again, and never linked (the run's cache shares no inode with a cache that
outlives the run). Real uv, real wheels, a cache uv filled itself."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from safeinstall.env import cachefill
from safeinstall.env.uvplan import UvChange
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
        import pytest

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
