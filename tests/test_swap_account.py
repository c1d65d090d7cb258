"""The swap in an environment another account owns (issue 34, item 2): the staging directory, the
attic, the renames and the tidy-up are that account's worker's (``safeinstall/env/renames.py``:
``as_owner``), never root's; the journal phases, ``--recover`` and the rollback are the root swap's.

The runs use the real uv, the private ``systemd --user`` manager, sicext's wheels and uid 65534
(:class:`tests.beds.ServiceAccountBed`). Kills and failures at a rename are injected by strace into the
account's worker (``-f``: the renames run in a forked process; strace counts each process's calls on
its own, so ``when=N`` is the worker's Nth ``renameat2``), never by a hook in safeinstall.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.bed_systemd import wait_until
from tests.beds import NOBODY, ServiceAccountBed, chown_tree
from tests.beds import tree_snapshot as _snapshot


def tree_snapshot(top: Path) -> dict[str, tuple[object, ...]]:
    """The venv, uv's lock file aside (the gate replaces it: see uvplan.secure_uv_lock)."""
    return {path: what for path, what in _snapshot(top).items() if path != ".lock"}


def _venv(bed: ServiceAccountBed) -> Path:
    return bed.python.parent.parent


def _steps(result_json: dict[str, object]) -> dict[str, str]:
    data = result_json["data"]
    assert isinstance(data, dict)
    return {s["name"]: s["detail"] for s in data["steps"]}


def test_an_accounts_environment_swaps_as_that_account(account: ServiceAccountBed) -> None:
    """uid 65534's venv: the new version is staged and verified before the stop, renamed into place in
    the window (nothing hashed there), verified in place once the unit runs; every file of the venv is
    the account's, as uv's install as that account leaves it, and no staging directory is left."""
    name = account.service("acct-swap")
    result = account.safeinstall(
        "sicext", "--wheel", str(account.wheels["sicext-2"]), "--settle", "0.5", "--json"
    )
    assert result.code == 0, result.stdout + result.stderr
    steps = _steps(result.json)
    assert steps["install"].startswith("swapped: "), steps
    assert "files verified in the staging tree before the stop" in steps["verify"], steps
    assert "files match" in steps["verify-in-place"], steps
    log = Path(result.json["data"]["log_file"]).read_text()
    said = re.findall(r"swap: scan, journal .* s; renames, fsync \(the worker of uid (\d+)\) .* s", log)
    assert said == [str(NOBODY)], log
    assert account.version() == "2.0"
    owners = {(what[1], what[2]) for what in tree_snapshot(_venv(account)).values()}
    assert owners == {(NOBODY, NOBODY)}, owners
    assert not list(_venv(account).glob(".safeinstall-*"))
    assert account.manager.active_state(name) == "active"
    account.no_trace()


def test_a_rename_the_account_may_not_make_is_never_made_by_root(account: ServiceAccountBed) -> None:
    """Once the run planned and staged, the package's directory is handed to root (0755): the account
    may not move it, root could. The swap's renames are the account's: the exchange fails, the run rolls
    back (exit 3), the old version in place and the unit running."""
    package = account.site / "sicext"
    venv = _venv(account)
    before = tree_snapshot(venv)
    name = account.service("acct-denied", ExecStopPost="/bin/sleep 1")
    proc = account.start_run(
        "sicext", "--wheel", str(account.wheels["sicext-2"]), "--settle", "0.5", "--json"
    )
    try:
        account.wait_phase(proc, "staged", "gated", "stopping", timeout=120)
        os.chown(package, 0, 0)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 3, out + err
    assert "the swap failed" in out and "Permission denied" in out, out
    os.chown(package, NOBODY, NOBODY)
    assert account.version() == "1.0" and tree_snapshot(venv) == before
    account.manager.wait_active(name)
    assert not list(venv.glob(".safeinstall-*"))
    account.no_trace()


def test_a_staging_directory_a_dead_run_left_is_removed_by_the_account(account: ServiceAccountBed) -> None:
    """What a run that died left in the account's prefix (the account's staging directory) is removed by
    the next run, by the account's worker (root never deletes in the account's prefix, and would refuse
    to), and the run swaps."""
    venv = _venv(account)
    left = venv / ".safeinstall-swap-20260101T000000Z-1"
    (left / "tree" / "lib").mkdir(parents=True)
    (left / "tree" / "lib" / "staged.py").write_text("x = 1\n")
    chown_tree(left, NOBODY)
    account.service("acct-leftover")
    result = account.safeinstall(
        "sicext", "--wheel", str(account.wheels["sicext-2"]), "--settle", "0.5", "--json"
    )
    assert result.code == 0, result.stdout + result.stderr
    assert _steps(result.json)["install"].startswith("swapped: ")
    assert not list(venv.glob(".safeinstall-*"))


# --- crashes and failures at each rename, as the account -----------------------------------------------


def _strace() -> str:
    found = shutil.which("strace")
    if found is None:
        pytest.skip("strace is not installed: the faults in the middle of the swap are injected with it")
    return found


def _traced(
    bed: ServiceAccountBed, inject: str, out: Path | None = None, call: str = "renameat2"
) -> subprocess.Popen[str]:
    """A run 1.0 -> 2.0 under ``strace -f`` with ``inject`` on the ``call`` calls in the venv's
    ``site-packages`` and ``bin`` (renames), or in the venv itself (another ``call``) (``-P``: by the
    directory descriptor they name; uv's own renames, in the staging tree and its cache, are left
    alone); strace's output in ``out``."""
    args = bed.args("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")
    dirs = [bed.site, bed.python.parent] if call == "renameat2" else [_venv(bed)]
    where = [arg for d in dirs for arg in ("-P", str(d))]
    command = [_strace(), "-f", "-qq", "-o", str(out or "/dev/null"), *where, "-e", f"trace={call}"]
    return subprocess.Popen(
        [*command, "-e", f"inject={call}:{inject}", *args],
        env=bed.environ(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _status(pid: int) -> dict[str, str]:
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return {}
    return dict(line.split(":\t", 1) for line in text.splitlines() if ":\t" in line)


def _stopped_tracee(out: Path, timeout: float) -> int:
    """The process strace stopped (its ``SIGSTOP`` at the Nth rename, as strace's output says): its PID."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(FileNotFoundError):
            for line in out.read_text().splitlines():
                if line.endswith("--- stopped by SIGSTOP ---"):
                    return int(line.split()[0])
        time.sleep(0.01)
    raise AssertionError(f"no process stopped by strace within {timeout} s")


def _ended(pid: int) -> Callable[[], bool]:
    return lambda: not Path(f"/proc/{pid}").exists()


def _run_pid(tracer: int) -> int:
    """safeinstall itself: strace's child."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and _status(int(entry.name)).get("PPid", "").strip() == str(tracer):
            return int(entry.name)
    raise AssertionError("safeinstall is not running under strace")


def test_a_crash_at_each_rename_of_the_accounts_swap_then_recover_puts_the_old_version_back(
    account: ServiceAccountBed, tmp_path: Path
) -> None:
    """The account's worker is stopped at its first, each middle and its last rename (which is not
    made: strace answers it), and safeinstall is killed there (the worker goes with it: SIGKILL when
    safeinstall dies): the journal says
    ``swapping``; ``--recover`` restores the old version byte for byte (the staging directory removed by
    the account), and starts the unit."""
    name = account.unit("acct-kill")
    venv = _venv(account)
    before = tree_snapshot(venv)
    count = None
    when = 1
    while count is None or when <= count:
        out = tmp_path / f"strace-{when}"
        tracer = _traced(account, f"retval=0:signal=SIGSTOP:when={when}", out)
        try:
            worker = _stopped_tracee(out, 120)
            uid = _status(worker).get("Uid", "").split()[1:2]
        finally:  # safeinstall first (the worker goes with it), then strace: none is left stopped
            with contextlib.suppress(AssertionError, ProcessLookupError):
                os.kill(_run_pid(tracer.pid), signal.SIGKILL)
            tracer.communicate(timeout=60)
        assert uid == [str(NOBODY)], f"the rename was made by uid {uid}, not the account's worker"
        wait_until(_ended(worker), 20, "the worker gone with safeinstall")
        journal = account.journal()
        assert journal is not None and journal["phase"] == "swapping", (when, journal)
        if count is None:  # the plan's numbers, from the run's log: renames in and out
            log = next(account.state.glob("*/logs/*.log")).read_text()
            counts = re.findall(r"the window renames (\d+) entries in and (\d+) out", log)
            count = int(counts[-1][0]) + int(counts[-1][1])
            assert count >= 3, log
        (staging,) = venv.glob(".safeinstall-swap-*")
        assert staging.stat().st_uid == NOBODY
        recovered = account.cli("--recover", "--json")
        assert recovered.code == 0, recovered.stdout + recovered.stderr
        (recovery,) = recovered.json["data"]["recoveries"]
        assert recovery["phase"] == "swapping" and recovery["restored"] is (when > 1), recovery
        wait_until(lambda: account.manager.active_state(name) == "active", 20, "unit running again")
        assert tree_snapshot(venv) == before, when
        assert not list(venv.glob(".safeinstall-*"))
        account.no_trace()
        when += 1


def test_a_rename_of_the_accounts_swap_that_fails_rolls_back(account: ServiceAccountBed) -> None:
    name = account.unit("acct-fail")
    venv = _venv(account)
    before = tree_snapshot(venv)
    tracer = _traced(account, "error=EIO:when=2")
    out, err = tracer.communicate(timeout=240)
    assert tracer.returncode == 3, out + err
    assert "the swap failed" in out and "Input/output error" in out, out
    assert tree_snapshot(venv) == before
    assert account.manager.active_state(name) == "active"
    assert not list(venv.glob(".safeinstall-*"))
    account.no_trace()


def test_a_kill_once_the_account_made_its_staging_directory_then_recover_removes_it_as_the_account(
    account: ServiceAccountBed, tmp_path: Path
) -> None:
    """The account's worker is stopped once it made the staging directory (its ``mkdirat`` in the venv,
    by strace) and safeinstall killed (journal ``backed-up``): nothing in the environment changed;
    ``--recover`` has the account's worker remove the staging directory."""
    name = account.unit("acct-staging")
    venv = _venv(account)
    before = tree_snapshot(venv)
    out = tmp_path / "strace"
    tracer = _traced(account, "signal=SIGSTOP:when=1", out, call="mkdirat")
    try:
        worker = _stopped_tracee(out, 120)
        uid = _status(worker).get("Uid", "").split()[1:2]
    finally:
        with contextlib.suppress(AssertionError, ProcessLookupError):
            os.kill(_run_pid(tracer.pid), signal.SIGKILL)
        tracer.communicate(timeout=60)
    assert uid == [str(NOBODY)], f"the staging directory was made by uid {uid}"
    wait_until(_ended(worker), 20, "the worker gone with safeinstall")
    journal = account.journal()
    assert journal is not None and journal["phase"] == "backed-up", journal
    (staging,) = venv.glob(".safeinstall-swap-*")
    assert staging.stat().st_uid == NOBODY
    recovered = account.cli("--recover", "--json")
    assert recovered.code == 0, recovered.stdout + recovered.stderr
    wait_until(lambda: account.manager.active_state(name) == "active", 20, "unit running again")
    assert not list(venv.glob(".safeinstall-*"))
    assert account.version() == "1.0" and tree_snapshot(venv) == before
    account.no_trace()


@pytest.mark.parametrize(
    ("phase", "phases"),
    [
        ("staged", ("staged",)),
        ("installed", ("installed", "verified", "restarting")),
        ("restarting", ("restarting",)),
        ("done", ("done",)),
    ],
)
def test_a_kill_at_each_phase_around_the_accounts_swap_then_recover(
    account: ServiceAccountBed, phase: str, phases: tuple[str, ...]
) -> None:
    """As for root's swap (tests/test_swap.py): killed with the account's staging tree verified, the
    swap done, the units on the new version, or while the account's worker removes the staging tree:
    ``--recover`` leaves one whole version, no staging directory, the unit up."""
    name = account.unit(f"acct-{phase}")
    account.swap_killed_then_recovered(name, phase, phases)


@pytest.mark.parametrize("killed", [False, True], ids=["finished", "killed-then-recovered"])
def test_a_file_the_account_writes_into_the_old_package_is_put_back_by_the_account(
    account: ServiceAccountBed, killed: bool
) -> None:
    """The service (the account) writes a file into its package's directory after the backup: the
    exchange takes it away with the old tree, and once the new version runs the account's worker renames
    it back where it was (the run, or ``--recover`` after a kill), the account's file still."""
    name = account.unit("acct-late")
    late = account.site / "sicext" / "late.txt"
    proc = account.start_run("sicext", "--wheel", str(account.wheels["sicext-2"]), "--settle", "2", "--json")
    try:
        account.wait_phase(proc, "staged", "gated", "stopping", timeout=120)
        as_nobody = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
        subprocess.run([*as_nobody, "sh", "-c", f"echo late > {late}"], check=True)
        if killed:
            account.wait_phase(proc, "restarting", timeout=120)
            os.kill(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if killed:
        recovered = account.cli("--recover", "--json")
        assert recovered.code == 0, recovered.stdout + recovered.stderr
        wait_until(lambda: account.manager.active_state(name) == "active", 20, "unit running again")
    else:
        assert proc.returncode == 0, out + err
    assert late.read_text() == "late\n" and late.stat().st_uid == NOBODY
    assert not list(_venv(account).glob(".safeinstall-*"))
    assert account.version() == "2.0"
