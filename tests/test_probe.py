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
from safeinstall.run.parts.probe import refusal, verdict_problem
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
    linked, found none damaged, and the two trees hold the same dist-infos with byte-identical RECORDs."""
    filled = Filled(1, 10, ("sicext 2.0",), taken=("archive-v0/a",))
    same = {"lib/python3/site-packages/sicext-2.0.dist-info": b"sicext/__init__.py,sha256=x,1\n"}
    linked = frozenset({"archive-v0/a"})
    assert verdict_problem(filled, linked, same, dict(same)) is None
    other = {next(iter(same)): b"sicext/__init__.py,sha256=y,1\n"}
    assert "RECORD differs" in str(verdict_problem(filled, linked, other, same))
    more = {**same, "lib/python3/site-packages/extra-1.dist-info": b""}
    assert "the probe holds" in str(verdict_problem(filled, linked, more, same))
    assert "did not copy" in str(verdict_problem(filled, frozenset({"archive-v0/b"}), same, same))
    damaged = Filled(0, 0, (), damaged=("sicext 2.0",), taken=("archive-v0/a",))
    assert "changed copy" in str(verdict_problem(damaged, linked, same, same))
    assert "copied nothing" in str(verdict_problem(Filled(0, 0, (), "no"), linked, same, same))
    assert "copied nothing" in str(verdict_problem(None, linked, same, same))


def test_a_probe_only_where_a_root_owned_swap_linked_from_a_fill_of_roots_cache_is_checked(
    bed: Bed, tmp_path: Path
) -> None:
    """Pure, then a real run: no probe for an account's environment, uv's other link modes, a run that
    does not swap, no fill, a wheel given by its path (uv would unpack it twice), or ``--no-smoke``
    (a run by name from root's warm cache: nothing of a probe made, nothing left)."""
    env = inspect_environment(bed.python)
    assert refusal(env, "hardlink", True, True, False, False) is None
    account = dataclasses.replace(env, account=Account(1000, 1000, "/home/svc"))
    assert refusal(account, "hardlink", True, True, False, False) == "the environment is an account's"
    assert refusal(env, "copy", True, True, False, False) is not None
    assert refusal(env, "hardlink", True, False, False, False) is not None
    assert refusal(env, "hardlink", False, True, False, False) is not None
    assert refusal(env, "hardlink", True, True, False, True) == "a wheel is given by its path"
    assert refusal(env, "hardlink", True, True, True, False) == "--no-smoke"
    cache = _root_cache(tmp_path)
    _warm(bed, cache, "sicext==2.0")
    done = _by_name(bed, cache, "sicext==2.0", "--no-smoke")
    assert done.code == 0, done.stdout + done.stderr
    assert "] prefetch: probe" not in _log(done) and "on the probe tree" not in _log(done), _log(done)
    _no_probe_left(bed)
