"""The smoke check beside the fill's copy (docs/window.md, "The smoke check beside the fill's copy"): in a
root-owned environment whose run fills its cache from root's, the check runs on a probe tree that uv
installs offline from links of root's cache, while the fill still copies; its verdict stands only where
the probe holds what the staging tree holds, and the probe never outlives the check. Real uv, real
wheels, a real unit of the private manager, root's cache filled by uv itself."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from safeinstall.env.cachefill import Filled
from safeinstall.env.environment import Account, inspect_environment
from safeinstall.env.owner import archive_print
from safeinstall.env.uvplan import UvRequest, chooses_network
from safeinstall.run.parts.probe import refusal, verdict_problem
from safeinstall.store.state import EnvironmentState, remove_uv_caches
from tests import wheelhouse
from tests.beds import Bed
from tests.clirun import Result

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="root's own cache and environment: needs root")

ON_THE_PROBE = "on the probe tree, beside the fill's copy"


def _warm(bed: Bed, cache: Path, *requirements: str) -> None:
    """Root's cache ``cache`` filled by uv itself with ``requirements`` (a throwaway target each)."""
    for number, requirement in enumerate(requirements):
        subprocess.run(
            [
                *(wheelhouse.UV, "pip", "install", "--quiet", "--offline", "--no-deps"),
                *("--python", str(bed.python), "--target", str(cache.parent / f"by-hand-{number}")),
                *("--link-mode", "hardlink", "--find-links", _links(bed), requirement),
            ],
            check=True,
            env={**wheelhouse.uv_env(), "UV_CACHE_DIR": str(cache)},
        )


def _links(bed: Bed) -> str:
    return str(bed.wheels["sicext-1"].parent)


def _root_cache(tmp_path: Path) -> Path:
    cache = tmp_path / "root-cache"
    cache.mkdir(mode=0o700)
    return cache


def _by_name(bed: Bed, cache: Path, requirement: str, *extra: str) -> Result:
    """safeinstall's switch of sicext to ``requirement`` by name, root's cache ``cache`` the owner's."""
    return bed.safeinstall(
        requirement, "--settle", "0", "--json", *extra, "--", "--offline", "--find-links", _links(bed),
        more_env={"UV_CACHE_DIR": str(cache)},
    )  # fmt: skip


def _step(result: Result, name: str) -> str:
    return str(next(s for s in result.json["data"]["steps"] if s["name"] == name)["detail"])


def _log(result: Result) -> str:
    return Path(result.json["data"]["log_file"]).read_text()


def _no_probe_left(bed: Bed) -> None:
    venv = bed.python.parent.parent
    assert not list(venv.glob(".safeinstall-*")), list(venv.glob(".safeinstall-*"))
    assert not list(bed.state.glob("*/uv-cache-*")), list(bed.state.glob("*/uv-cache-*"))


def test_the_check_runs_on_the_probe_beside_the_fill_and_the_probe_goes(bed: Bed, tmp_path: Path) -> None:
    """sicext 1.0 -> 2.0 by name from root's warm cache under a running unit: the check ran on the probe
    (the smoke step and the log say so), the staging tree went live, and neither the probe tree nor its
    cache is left."""
    cache = _root_cache(tmp_path)
    _warm(bed, cache, "sicext==2.0")
    unit = bed.service("probe")
    done = _by_name(bed, cache, "sicext==2.0")
    assert done.code == 0, done.stdout + done.stderr
    assert ON_THE_PROBE in _step(done, "smoke"), _step(done, "smoke")
    log = _log(done)
    assert "smoke: the check runs on the probe tree, beside the fill's copy" in log, log
    assert "smoke: the check on the probe tree stands for the staging tree" in log, log
    assert "--offline" in next(line for line in log.splitlines() if "] prefetch: probe (" in line), log
    assert "smoke: the probe tree and its cache removed" in log, log
    assert bed.version() == "2.0" and bed.manager.active_state(unit) == "active"
    _no_probe_left(bed)


def test_a_damaged_cache_entry_makes_the_check_run_on_the_staging_tree(bed: Bed, tmp_path: Path) -> None:
    """A file of root's cached sicext 2.0 changed in place (a hotfix through a link): the probe, linked
    from that entry, holds bytes that never go live; its check is abandoned and the check runs on the
    staging tree (the fill fetched a fresh copy), and the run succeeds from that."""
    cache = _root_cache(tmp_path)
    _warm(bed, cache, "sicext==2.0")
    (module,) = (cache / "archive-v0").glob("*/sicext/serve.py")
    with module.open("a") as edit:
        edit.write("raise SystemExit('the hotfix')\n")
    done = _by_name(bed, cache, "sicext==2.0")
    assert done.code == 0, done.stdout + done.stderr
    log = _log(done)
    assert "smoke: the check runs on the probe tree, beside the fill's copy" in log, log
    assert "smoke: the check on the probe tree was abandoned (root's cache holds a changed copy" in log, log
    assert ON_THE_PROBE not in _step(done, "smoke"), _step(done, "smoke")
    assert "the hotfix" not in (bed.site / "sicext" / "serve.py").read_text()
    _no_probe_left(bed)


def test_a_broken_version_checked_on_the_probe_is_refused_before_the_stop(bed: Bed, tmp_path: Path) -> None:
    """sicext 3.0 (raises at import) by name from root's warm cache: refused by the check on the probe
    (exit 2), nothing stopped, the old version untouched, no probe left."""
    cache = _root_cache(tmp_path)
    _warm(bed, cache, "sicext==3.0")
    unit = bed.service("refused")
    main = bed.manager.main_pid(unit)
    before = bed.snapshot()
    refused = _by_name(bed, cache, "sicext==3.0")
    assert refused.code == 2, refused.stdout + refused.stderr
    steps = [s["name"] for s in refused.json["data"]["steps"]]
    assert steps[-1] == "smoke" and "stop" not in steps, steps
    assert "smoke: the check runs on the probe tree, beside the fill's copy" in _log(refused)
    assert bed.manager.main_pid(unit) == main and bed.snapshot() == before
    _no_probe_left(bed)


def test_a_rolled_back_run_leaves_no_probe(bed: Bed, tmp_path: Path) -> None:
    """A run checked on the probe whose restart fails (a health URL that never answers): rolled back,
    and no probe tree or cache is left."""
    cache = _root_cache(tmp_path)
    _warm(bed, cache, "sicext==2.0")
    bed.service("back")
    failed = _by_name(
        bed, cache, "sicext==2.0", "--health-url", "http://127.0.0.1:9/health", "--health-timeout", "1"
    )
    assert failed.code == 3, failed.stdout + failed.stderr
    assert "smoke: the check runs on the probe tree, beside the fill's copy" in _log(failed)
    assert bed.version() == "1.0"
    _no_probe_left(bed)


def test_a_prepared_run_checked_on_the_probe_leaves_only_its_own_cache_for_the_commit(
    bed: Bed, tmp_path: Path
) -> None:
    """``--prepare`` by name from root's warm cache: the check ran on the probe, the probe tree and its
    cache are gone once the prepare ends (the run's own cache and staging tree stay for the commit), and
    the commit then swaps in what the probe's verdict stood for."""
    cache = _root_cache(tmp_path)
    _warm(bed, cache, "sicext==2.0")
    unit = bed.service("prepared")
    pid = bed.manager.main_pid(unit)
    prepared = bed.safeinstall(
        "sicext==2.0", "--prepare", "--json", "--", "--offline", "--find-links", _links(bed),
        more_env={"UV_CACHE_DIR": str(cache)},
    )  # fmt: skip
    assert prepared.code == 0, prepared.stdout + prepared.stderr
    assert ON_THE_PROBE in _step(prepared, "smoke"), _step(prepared, "smoke")
    assert "smoke: the probe tree and its cache removed" in _log(prepared)
    venv = bed.python.parent.parent
    assert not list(venv.glob(".safeinstall-swap-*-probe")), list(venv.glob(".safeinstall-*"))
    assert not list(bed.state.glob("*/uv-cache-*-probe")), list(bed.state.glob("*/uv-cache-*"))
    assert list(bed.state.glob("*/uv-cache-*")), "the run's own cache is kept for the commit"
    assert bed.version() == "1.0" and bed.manager.main_pid(unit) == pid  # nothing stopped
    committed = bed.safeinstall("--commit", "--settle", "0", "--json")
    assert committed.code == 0, committed.stdout + committed.stderr
    assert bed.version() == "2.0" and bed.manager.active_state(unit) == "active"
    assert not list(venv.glob(".safeinstall-swap-*-probe")), list(venv.glob(".safeinstall-*"))
    assert not list(bed.state.glob("*/uv-cache-*-probe")), list(bed.state.glob("*/uv-cache-*"))
    assert bed.cli("--recover").code == 0  # what a commit leaves to the next run (docs/prepare.md)
    _no_probe_left(bed)


def test_a_run_killed_while_the_probe_is_checked_leaves_nothing_after_recover(
    bed: Bed, tmp_path: Path
) -> None:
    """SIGKILL once the probe tree is there, then ``--recover``: no probe tree, no probe cache."""
    cache = _root_cache(tmp_path)
    _warm(bed, cache, "sicext==2.0")
    venv = bed.python.parent.parent
    proc: subprocess.Popen[Any] = subprocess.Popen(
        [*bed.args("sicext==2.0", "--settle", "0", "--", "--offline", "--find-links", _links(bed))],
        env={**bed.environ(), "UV_CACHE_DIR": str(cache)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        while not list(venv.glob(".safeinstall-swap-*-probe/tree/lib")) and time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.005)
        assert list(venv.glob(".safeinstall-swap-*-probe")), "no probe tree seen"
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.communicate()
    recovered = bed.cli("--recover", "--json")
    assert recovered.code == 0, recovered.stdout + recovered.stderr
    assert bed.version() == "1.0"
    _no_probe_left(bed)


def test_the_probe_stands_only_for_the_same_records_from_what_the_fill_copied() -> None:
    """Pure: the verdict on the probe stands only where the fill copied every unpacked wheel the probe
    linked, with the print the probe linked, found none damaged, and the two trees hold the same
    dist-infos (some) with byte-identical RECORDs."""
    prints = (("archive-v0/a", "1" * 64),)
    filled = Filled(1, 10, ("sicext 2.0",), taken=("archive-v0/a",), prints=prints)
    same = {"lib/python3/site-packages/sicext-2.0.dist-info": b"sicext/__init__.py,sha256=x,1\n"}
    linked = frozenset({"archive-v0/a"})
    assert verdict_problem(filled, linked, prints, same, dict(same)) is None
    other = {next(iter(same)): b"sicext/__init__.py,sha256=y,1\n"}
    assert "RECORD differs" in str(verdict_problem(filled, linked, prints, other, same))
    more = {**same, "lib/python3/site-packages/extra-1.dist-info": b""}
    assert "the probe holds" in str(verdict_problem(filled, linked, prints, more, same))
    assert "the probe holds" in str(verdict_problem(filled, linked, prints, {}, {}))  # nothing compared
    assert "did not copy" in str(verdict_problem(filled, frozenset({"archive-v0/b"}), prints, same, same))
    moved = (("archive-v0/a", "2" * 64),)  # written in place between the fill's walk and the probe's links
    assert "between the fill's copy" in str(verdict_problem(filled, linked, moved, same, same))
    unprinted = dataclasses.replace(filled, prints=())
    assert "between the fill's copy" in str(verdict_problem(unprinted, linked, prints, same, same))
    damaged = Filled(0, 0, (), damaged=("sicext 2.0",), taken=("archive-v0/a",), prints=prints)
    assert "changed copy" in str(verdict_problem(damaged, linked, prints, same, same))
    assert "copied nothing" in str(verdict_problem(Filled(0, 0, (), "no"), linked, prints, same, same))
    assert "copied nothing" in str(verdict_problem(None, linked, prints, same, same))


def test_an_archive_print_moves_with_a_write_in_place_and_nothing_else(tmp_path: Path) -> None:
    """Pure over a real tree: the print is the same for a hardlinked copy of a tree (what the probe links
    of what the fill walked) and moves with a write in place, a file added, or a file replaced."""
    tree = tmp_path / "archive"
    (tree / "pkg").mkdir(parents=True)
    (tree / "pkg" / "__init__.py").write_text("VERSION = 1\n")
    (tree / "pkg" / "data.bin").write_bytes(b"x" * 10)
    linked = tmp_path / "linked"
    (linked / "pkg").mkdir(parents=True)
    for name in ("__init__.py", "data.bin"):
        os.link(tree / "pkg" / name, linked / "pkg" / name)
    first = archive_print(tree)
    assert archive_print(linked) == first
    with (linked / "pkg" / "__init__.py").open("r+") as handle:  # in place: the inode both name
        handle.write("VERSION = 2\n")
    assert archive_print(tree) != first
    os.utime(tree / "pkg" / "__init__.py", ns=(0, 0))
    assert archive_print(tree) != first
    assert archive_print(linked) == archive_print(tree)
    (tree / "pkg" / "new.py").write_text("")
    assert archive_print(tree) != archive_print(linked)


def test_a_check_that_writes_its_own_files_through_the_probe_is_set_aside(bed: Bed, tmp_path: Path) -> None:
    """A check run as root on the probe imports through links of root's cache: a version whose import
    writes a file it ships in place writes root's cache (here its own bytes again). The run sees it (the
    linked archive's print moved while the check ran), sets the probe's verdict aside and checks the
    staging tree, and says so."""
    writer = (  # the same bytes written back in place: nothing a RECORD sees, but the inode is written
        "import os\n"
        "with open(os.path.join(os.path.dirname(__file__), 'state.txt'), 'r+') as _f:\n"
        "    _kept = _f.read()\n"
        "    _f.seek(0)\n"
        "    _f.write(_kept)\n"
    )
    original = bed.wheels["sicext-2"]
    init = wheelhouse.members_of(original)[0]["sicext/__init__.py"]
    out = tmp_path / "wheels"
    wheelhouse.rebuilt(
        original,
        out,
        {"sicext/__init__.py": init + b"\n" + writer.encode(), "sicext/state.txt": b"pristine\n"},
    )
    cache = _root_cache(tmp_path)
    env = {**wheelhouse.uv_env(), "UV_CACHE_DIR": str(cache)}
    subprocess.run(
        [
            *(
                wheelhouse.UV,
                "pip",
                "install",
                "--quiet",
                "--offline",
                "--no-deps",
                "--python",
                str(bed.python),
            ),
            *("--target", str(tmp_path / "by-hand"), "--link-mode", "hardlink", "--find-links", str(out)),
            "sicext==2.0",
        ],
        check=True,
        env=env,
    )
    done = bed.safeinstall(
        "sicext==2.0", "--settle", "0", "--json", "--", "--offline", "--find-links", str(out),
        more_env={"UV_CACHE_DIR": str(cache)},
    )  # fmt: skip
    assert done.code == 0, done.stdout + done.stderr
    assert ON_THE_PROBE not in _step(done, "smoke"), _step(done, "smoke")
    assert "was written in place while the check ran on the probe" in _log(done), _log(done)
    assert any("set aside" in note for note in done.json["data"]["notes"]), done.json["data"]["notes"]
    _no_probe_left(bed)


def test_a_probe_cache_is_left_out_of_the_downtimes_removal(tmp_path: Path) -> None:
    """Rollback and --recover remove the run's uv cache while the units are down (a restore on a full
    disk needs its room); a probe's cache frees none and waits until they run again."""
    state = EnvironmentState(tmp_path, tmp_path / "env", None)
    state.dir.mkdir()
    run_id = "20261206T000000Z-1"
    for name in (f"uv-cache-{run_id}", f"uv-cache-{run_id}-probe"):
        (state.dir / name).mkdir()
    assert remove_uv_caches(state, run_id, 5.0, probes=False) == ()
    assert sorted(os.listdir(state.dir)) == [f"uv-cache-{run_id}-probe"]
    assert remove_uv_caches(state, seconds=5.0) == () and os.listdir(state.dir) == []


def test_a_probe_only_where_a_root_owned_swap_linked_from_a_fill_of_roots_cache_is_checked(
    bed: Bed, tmp_path: Path
) -> None:
    """Pure, then a real run: no probe for an account's environment, uv's other link modes, a run that
    does not swap, no fill, a wheel given by its path (uv would unpack it twice), uv arguments that
    choose the network or a cache (``--no-offline`` undoes the probe's ``--offline``), or ``--no-smoke``
    (a run by name from root's warm cache: nothing of a probe made, nothing left)."""
    env = inspect_environment(bed.python)
    assert refusal(env, "hardlink", True, True, False, False, False) is None
    account = dataclasses.replace(env, account=Account(1000, 1000, "/home/svc"))
    assert refusal(account, "hardlink", True, True, False, False, False) == "the environment is an account's"
    assert refusal(env, "copy", True, True, False, False, False) is not None
    assert refusal(env, "hardlink", True, False, False, False, False) is not None
    assert refusal(env, "hardlink", False, True, False, False, False) is not None
    assert refusal(env, "hardlink", True, True, False, True, False) == "a wheel is given by its path"
    assert refusal(env, "hardlink", True, True, True, False, False) == "--no-smoke"
    assert (
        refusal(env, "hardlink", True, True, False, False, True)
        == "uv's arguments choose the network or a cache"
    )
    request = UvRequest(env.python, "sicext", extra_args=("--offline", "--no-offline"))
    assert chooses_network(request) and not chooses_network(
        dataclasses.replace(request, extra_args=("--offline",))
    )
    cache = _root_cache(tmp_path)
    _warm(bed, cache, "sicext==2.0")
    done = _by_name(bed, cache, "sicext==2.0", "--no-smoke")
    assert done.code == 0, done.stdout + done.stderr
    assert "] prefetch: probe" not in _log(done) and "on the probe tree" not in _log(done), _log(done)
    _no_probe_left(bed)
