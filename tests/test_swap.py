"""The swap (issue 26): the new version staged and verified before the stop, renamed into place in the
window (``safeinstall/env/renames.py``, ``safeinstall/run/parts/staging.py``).

The plan is pure and tested on made-up trees; the runs use the real uv, the private ``systemd --user``
manager and sicext's wheels. Kills and failures in the middle of the swap are injected from the outside by
strace (``-e inject=renameat2:...``: the Nth ``renameat2`` call of the run, the swap's only kind of call,
is killed or fails), never by a hook in safeinstall.
"""

from __future__ import annotations

import errno
import os
import re
import shutil
import signal
import subprocess
from collections.abc import Set
from pathlib import Path

import pytest

from safeinstall.env.renames import (
    ATTIC,
    STAGED_TREE,
    How,
    Move,
    Staged,
    SwapPlan,
    execute,
    owner_of,
    plan_swap,
    staging_dir,
)
from tests import wheelhouse
from tests.bed_systemd import wait_until
from tests.beds import Bed, bind_mount
from tests.beds import tree_snapshot as _snapshot

SITE = "lib/python3.11/site-packages"


def tree_snapshot(top: Path) -> dict[str, tuple[object, ...]]:
    """The venv as :func:`tests.beds.tree_snapshot` sees it, uv's lock file aside (the gate makes it
    root's own, 0600, whatever becomes of the run: see uvplan.secure_uv_lock)."""
    return {path: what for path, what in _snapshot(top).items() if path != ".lock"}


def _plan(
    staged: dict[str, str], live: dict[str, str], old: set[str], own: set[str], held: Set[str] = frozenset()
) -> SwapPlan:
    files = frozenset(p for p, kind in staged.items() if kind == "file")
    dirs = frozenset(p for p, kind in staged.items() if kind == "dir")
    return plan_swap(files, dirs, live, frozenset(old), frozenset(own), frozenset(held))


def _tree(*paths: str) -> dict[str, str]:
    """Pure: every path given a file, every directory above one a directory."""
    found: dict[str, str] = {}
    for path in paths:
        found[path] = "file"
        parent = path.rpartition("/")[0]
        while parent:
            found[parent] = "dir"
            parent = parent.rpartition("/")[0]
    return found


def test_a_replaced_distributions_own_directories_trade_places_whole_and_its_dist_info_goes_first() -> None:
    new = _tree(
        f"{SITE}/pkg/__init__.py",
        f"{SITE}/pkg/sub/a.py",
        f"{SITE}/pkg-2.0.dist-info/RECORD",
        f"{SITE}/newpkg/__init__.py",
        "bin/pkg-cli",
    )
    live = _tree(
        f"{SITE}/pkg/__init__.py",
        f"{SITE}/pkg/gone.py",
        f"{SITE}/pkg-1.0.dist-info/RECORD",
        f"{SITE}/oldonly/__init__.py",
        f"{SITE}/other/__init__.py",
        "bin/pkg-cli",
        "bin/pkg-old-cli",
        "bin/python",
    )
    old = {
        f"{SITE}/pkg/__init__.py",
        f"{SITE}/pkg/gone.py",
        f"{SITE}/pkg-1.0.dist-info/RECORD",
        f"{SITE}/oldonly/__init__.py",
        "bin/pkg-cli",
        "bin/pkg-old-cli",
    }
    own = {f"{SITE}/pkg", f"{SITE}/oldonly", f"{SITE}/pkg-1.0.dist-info"}
    plan = _plan(new, live, old, own, {f"{SITE}/other/__init__.py"})
    assert plan.problems == ()
    assert plan.moves == (
        Move(f"{SITE}/pkg-2.0.dist-info", How.PLACE, True),  # first: the new RECORD lists what follows
        Move("bin/pkg-cli", How.EXCHANGE, False),  # bin/ holds the interpreter: entered, file by file
        Move(f"{SITE}/newpkg", How.PLACE, True),
        Move(f"{SITE}/pkg", How.EXCHANGE, True),  # pkg/gone.py leaves with the old tree
    )
    assert plan.out == (
        Move(f"{SITE}/oldonly", How.PLACE, True),
        Move("bin/pkg-old-cli", How.PLACE, False),
        Move(f"{SITE}/pkg-1.0.dist-info", How.PLACE, True),  # last: its RECORD lists the old files
    )
    assert plan.touched == ("bin", SITE)


def test_a_directory_that_holds_what_must_stay_is_entered_never_moved_whole() -> None:
    """nvidia/ (several distributions' files), or a package directory with a file no RECORD lists (a
    hand-added config): their staged files replace the live ones one by one, the rest stays."""
    new = _tree(f"{SITE}/nvidia/cudnn/lib/a.so", f"{SITE}/pkg/__init__.py")
    live = _tree(
        f"{SITE}/nvidia/cudnn/lib/a.so",
        f"{SITE}/nvidia/nccl/lib/b.so",
        f"{SITE}/pkg/__init__.py",
        f"{SITE}/pkg/local.cfg",
    )
    old = {f"{SITE}/nvidia/cudnn/lib/a.so", f"{SITE}/pkg/__init__.py"}
    own = {f"{SITE}/nvidia/cudnn", f"{SITE}/pkg"}
    held = {f"{SITE}/nvidia/nccl/lib/b.so", f"{SITE}/pkg/local.cfg"}
    plan = _plan(new, live, old, own, held)
    assert plan.moves == (
        Move(f"{SITE}/nvidia/cudnn", How.EXCHANGE, True),  # cudnn's own: whole
        Move(f"{SITE}/pkg/__init__.py", How.EXCHANGE, False),
    )
    assert plan.out == ()


def test_a_file_in_the_way_of_a_directory_is_a_problem_not_a_guess() -> None:
    new = _tree(f"{SITE}/pkg/__init__.py", f"{SITE}/mod.py")
    live = {**_tree(f"{SITE}/mod.py"), f"{SITE}/pkg": "link", f"{SITE}/mod.py": "dir"}
    plan = _plan(new, live, set(), set())
    assert len(plan.problems) == 2, plan.problems


def test_a_placed_entry_never_replaces_what_appeared_there_since_the_plan(tmp_path: Path) -> None:
    """Issue 35: the swap places a new entry with ``RENAME_NOREPLACE``: a file that appeared at that
    path after the plan (written by the service, by its owner) is never replaced: the swap fails there
    (EEXIST, the run then rolls back), both files as they were. A planned exchange still happens."""
    prefix = tmp_path / "venv"
    staged = staging_dir(prefix, "run")
    for top in (prefix, staged / STAGED_TREE, staged / ATTIC):
        (top / "lib").mkdir(parents=True)
    (staged / STAGED_TREE / "lib" / "kept.py").write_text("new kept\n")
    (prefix / "lib" / "kept.py").write_text("old kept\n")
    (staged / STAGED_TREE / "lib" / "new.py").write_text("the new version's\n")
    (prefix / "lib" / "new.py").write_text("appeared since the plan\n")
    plan = SwapPlan(
        moves=(Move("lib/kept.py", How.EXCHANGE, False), Move("lib/new.py", How.PLACE, False)), out=()
    )
    with pytest.raises(OSError) as raised:
        execute(Staged(staged, plan, {}, 2), prefix, None)
    assert raised.value.errno == errno.EEXIST
    assert (prefix / "lib" / "kept.py").read_text() == "new kept\n"  # exchanged before the failure
    assert (prefix / "lib" / "new.py").read_text() == "appeared since the plan\n"
    assert (staged / STAGED_TREE / "lib" / "new.py").read_text() == "the new version's\n"


def test_same_version_again_exchanges_its_dist_info() -> None:
    new = _tree(f"{SITE}/pkg/__init__.py", f"{SITE}/pkg-1.0.dist-info/RECORD")
    old = {f"{SITE}/pkg/__init__.py", f"{SITE}/pkg-1.0.dist-info/RECORD"}
    plan = _plan(new, _tree(*old), old, {f"{SITE}/pkg", f"{SITE}/pkg-1.0.dist-info"})
    assert plan.moves == (
        Move(f"{SITE}/pkg-1.0.dist-info", How.EXCHANGE, True),
        Move(f"{SITE}/pkg", How.EXCHANGE, True),
    )
    assert plan.out == ()


# --- real runs --------------------------------------------------------------------------------------


def _files(python: Path) -> dict[str, str]:
    """Every file and directory of the venv's site-packages with its content, owner and mode (what uv
    records about where it found the wheel aside: the two installs read it from different places),
    and the package's console script after its first line (which names the venv's interpreter)."""
    found = {
        path: str(what)
        for path, what in tree_snapshot(wheelhouse.site_packages(python)).items()
        if not path.endswith(("direct_url.json", "uv_cache.json", "/RECORD"))
    }
    script = python.parent / "sicext-serve"
    found["bin/sicext-serve"] = script.read_text().partition("\n")[2]
    return found


@pytest.mark.parametrize(
    "added", ["", "file", "directory"], ids=["exchanged-whole", "added-file", "added-dir"]
)
def test_a_swapped_install_is_the_install_uv_makes_in_place(bed: Bed, tmp_path: Path, added: str) -> None:
    """The same files and directories, the same bytes, owners and modes, as ``uv pip install`` into
    the venv itself: whether the package's directory is exchanged whole, or entered because someone
    added a file to it (which stays, reported left over) and handed an empty directory in it to the
    service's account, an empty one (which stays too, as uv leaves it)."""

    def prepare(site: Path) -> None:
        if added == "file":
            (site / "sicext" / "local.cfg").write_text("kept\n")
        if added == "directory":
            (site / "sicext" / "state").mkdir()
            os.chown(site / "sicext" / "state", 65534, 65534)

    prepare(bed.site)
    bed.service("swap-same")
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")
    assert result.code == 0, result.stdout + result.stderr
    steps = {s["name"]: s["detail"] for s in result.json["data"]["steps"]}
    assert steps["install"].startswith("swapped: "), steps
    assert ("1 leftover file(s)" in steps["verify-in-place"]) is (added == "file"), steps
    hand = wheelhouse.make_venv(tmp_path / "hand", str(bed.python.resolve()))
    wheelhouse.uv_install(hand, bed.wheels["sicext-1"])
    prepare(wheelhouse.site_packages(hand))
    wheelhouse.uv_install(hand, bed.wheels["sicext-2"], link_mode="copy", reinstall=True)
    assert _files(bed.python) == _files(hand)
    assert not list(bed.python.parent.parent.glob(".safeinstall-swap-*"))
    assert bed.version() == "2.0"


def _strace() -> str:
    found = shutil.which("strace")
    if found is None:
        pytest.skip("strace is not installed: the faults in the middle of the swap are injected with it")
    return found


def _under_strace(bed: Bed, inject: str) -> subprocess.CompletedProcess[str]:
    """A run of safeinstall 1.0 -> 2.0 under strace, with ``inject`` on its ``renameat2`` calls (only
    the main thread is traced: the swap runs there; uv and the threads are left alone)."""
    args = bed.args("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")
    return subprocess.run(
        [
            _strace(),
            "-qq",
            "-o",
            "/dev/null",
            "-e",
            "trace=renameat2",
            "-e",
            f"inject=renameat2:{inject}",
            *args,
        ],
        env=bed.environ(),
        capture_output=True,
        text=True,
        timeout=240,
    )


def test_a_kill_at_each_rename_of_the_swap_then_recover_puts_the_old_version_back(bed: Bed) -> None:
    """SIGKILL at the first, each middle and the last rename of the swap (journal phase ``swapping``):
    ``--recover`` restores the old version byte for byte, removes the staging tree, starts the unit."""
    name = bed.unit("swap-kill")
    venv = bed.python.parent.parent
    before = tree_snapshot(venv)
    count = None
    when = 1
    while count is None or when <= count:
        done = _under_strace(bed, f"signal=SIGKILL:when={when}")
        assert done.returncode in (-signal.SIGKILL, 128 + signal.SIGKILL, 137), (when, done.stderr[-2000:])
        journal = bed.journal()
        assert journal is not None and journal["phase"] == "swapping", (when, journal)
        if count is None:  # the plan's numbers, from the run's log: renames in and out
            log = next((bed.state).glob("*/logs/*.log")).read_text()
            counts = re.findall(r"the window renames (\d+) entries in and (\d+) out", log)
            count = int(counts[-1][0]) + int(counts[-1][1])
            assert count >= 3, log
        assert list(venv.glob(".safeinstall-swap-*")), "the staging tree is there until the recovery"
        recovered = bed.cli("--recover", "--json")
        assert recovered.code == 0, recovered.stdout + recovered.stderr
        (recovery,) = recovered.json["data"]["recoveries"]
        # killed before its first rename, the swap changed nothing: the restore finds it so
        assert recovery["phase"] == "swapping" and recovery["restored"] is (when > 1), recovery
        wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running again")
        assert tree_snapshot(venv) == before, when
        assert not list(venv.glob(".safeinstall-swap-*"))
        bed.no_trace()
        when += 1


def test_a_rename_that_fails_in_the_middle_of_the_swap_rolls_back(bed: Bed) -> None:
    name = bed.unit("swap-fail")
    venv = bed.python.parent.parent
    before = tree_snapshot(venv)
    done = _under_strace(bed, "error=EIO:when=2")
    assert done.returncode == 3, done.stdout + done.stderr
    assert "the swap failed" in done.stdout, done.stdout
    assert tree_snapshot(venv) == before
    assert bed.manager.active_state(name) == "active"
    assert not list(venv.glob(".safeinstall-swap-*"))
    bed.no_trace()


@pytest.mark.parametrize(
    ("phase", "phases"),
    [
        ("staged", ("staged",)),
        ("installed", ("installed", "verified", "restarting")),
        ("restarting", ("restarting",)),  # the new version verified in place again, the units up
        ("done", ("done",)),  # the old files and the staging tree being removed
    ],
)
def test_a_kill_at_each_phase_around_the_swap_then_recover(
    bed: Bed, phase: str, phases: tuple[str, ...]
) -> None:
    """Killed once the staging tree is verified (nothing in the environment changed yet), once the swap
    is done, once the units run the new version, or while the staging tree is removed after a good run:
    ``--recover`` leaves one whole version, no staging tree, the unit up."""
    name = bed.unit(f"swap-{phase}")
    bed.swap_killed_then_recovered(name, phase, phases)


@pytest.mark.parametrize("killed", [False, True], ids=["finished", "killed-then-recovered"])
def test_a_file_that_appears_in_the_old_package_after_the_backup_is_put_back_not_deleted(
    bed: Bed, killed: bool
) -> None:
    """The service (or anyone) writes a file into the package's directory after the backup, before the
    stop: the exchange takes it away with the old tree, and once the new version runs it is renamed back
    where it was, as uv's install would have left it, by the run or, when the run was killed after its
    verification, by ``--recover``; nothing is kept aside."""
    name = bed.unit("swap-late")
    late = bed.site / "sicext" / "late.txt"
    proc = bed.start_run("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "2", "--json")
    try:
        bed.wait_phase(proc, "staged", "gated", "stopping", timeout=120)
        late.write_text("written after the backup\n")
        if killed:
            bed.wait_phase(proc, "restarting", timeout=120)
            os.kill(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    if killed:
        recovered = bed.cli("--recover", "--json")
        assert recovered.code == 0, recovered.stdout + recovered.stderr
        wait_until(lambda: bed.manager.active_state(name) == "active", 20, "unit running again")
    else:
        assert proc.returncode == 0, out + err
    assert late.read_text() == "written after the backup\n"
    venv = bed.python.parent.parent
    assert not list(venv.glob(".safeinstall-swap-*")) and not list(venv.glob(".safeinstall-kept-*"))
    assert bed.version() == "2.0"


def test_a_directory_whose_owner_or_mode_changed_is_entered_not_replaced() -> None:
    """uv keeps the directories it installs into: one handed to another account (a cache the service
    writes) keeps its owner, so it, and every directory above it, is never exchanged whole."""
    new = _tree(f"{SITE}/pkg/__init__.py", f"{SITE}/pkg/cache/x.py")
    old = {f"{SITE}/pkg/__init__.py", f"{SITE}/pkg/cache/x.py"}
    files = frozenset(p for p, kind in new.items() if kind == "file")
    dirs = frozenset(p for p, kind in new.items() if kind == "dir")
    plan = plan_swap(
        files,
        dirs,
        _tree(*old),
        frozenset(old),
        frozenset({f"{SITE}/pkg"}),
        frozenset(),
        frozenset({f"{SITE}/pkg/cache"}),
    )
    assert plan.moves == (
        Move(f"{SITE}/pkg/__init__.py", How.EXCHANGE, False),
        Move(f"{SITE}/pkg/cache/x.py", How.EXCHANGE, False),
    )


def test_a_mount_inside_the_environment_is_never_swapped(bed: Bed) -> None:
    """A rename cannot cross a mount, and an exchange would carry a mount point off with the old tree
    (whose removal would then empty another filesystem): with a mount point below the prefix (here the
    package's own directory, bind-mounted) the run does not swap. uv's install in the window then fails
    too (it cannot remove a mount point), and the run rolls back: the old version, the unit up, the
    mounted directory's files all there."""
    target = bed.site / "sicext"
    before = {p.name for p in target.iterdir()}
    with bind_mount(target, target):
        name = bed.service("swap-mount")
        result = bed.safeinstall(
            "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json"
        )
        assert result.code in (0, 3), result.stdout + result.stderr
        log = Path(result.json["data"]["log_file"]).read_text()
        assert f"no swap: {target} is a mount point inside the environment" in log
        steps = {s["name"]: s["detail"] for s in result.json["data"]["steps"]}
        assert "verify-in-place" not in steps and not steps.get("install", "").startswith("swapped"), steps
        assert not list(bed.python.parent.parent.glob(".safeinstall-swap-*"))
        assert bed.manager.active_state(name) == "active"
        if result.code == 3:
            assert bed.version() == "1.0" and {p.name for p in target.iterdir()} >= before


def test_a_file_changed_once_the_units_run_again_fails_the_verification_in_place_and_rolls_back(
    bed: Bed, tmp_path: Path
) -> None:
    """The new version was verified in the staging tree; once the units run, every file is verified
    where it lies again. Here the unit's ExecStartPre changes the new version's ``__init__.py`` (only the
    new one's): the run says so and rolls back, the old version and the unit as before."""
    tamper = tmp_path / "tamper.sh"
    tamper.write_text(
        f"[ -d {bed.site}/sicext-2.0.dist-info ] && "
        f"echo '# changed at start' >> {bed.site}/sicext/__init__.py\nexit 0\n"
    )
    venv = bed.python.parent.parent
    before = tree_snapshot(venv)
    name = bed.service("swap-tampered", ExecStartPre=f"/bin/sh {tamper}")
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")
    assert result.code == 3, result.stdout + result.stderr
    message = result.json["errors"][0]["message"]
    assert "once the units ran again" in message and "sicext/__init__.py" in message, message
    bed.manager.wait_active(name)
    assert bed.version() == "1.0" and tree_snapshot(venv) == before
    bed.no_trace()


def test_an_entry_of_the_staging_tree_replaced_before_the_swap_is_caught_in_the_window(bed: Bed) -> None:
    """What the window renames must be the very inodes verified in the staging tree: here the package's
    staged directory is replaced by a copy (another inode) while the unit stops; the window's check
    says so and the run rolls back before any unit starts on it."""
    name = bed.service("swap-identity", ExecStopPost="/bin/sleep 2")  # time to replace it
    venv = bed.python.parent.parent
    before = tree_snapshot(venv)
    proc = bed.start_run("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json")
    try:
        bed.wait_phase(proc, "stopping", timeout=120)
        (staged,) = venv.glob(f".safeinstall-swap-*/tree/{SITE}/sicext")
        shutil.copytree(staged, staged.with_name("sicext.copy"))
        staged.rename(staged.with_name("sicext.verified"))
        staged.with_name("sicext.copy").rename(staged)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 3, out + err
    assert "not the verified files in place after the swap" in out, out
    bed.manager.wait_active(name)
    assert bed.version() == "1.0" and tree_snapshot(venv) == before
    bed.no_trace()


def test_bytecode_uv_compiles_by_its_environment_drops_the_swap_not_the_run(bed: Bed) -> None:
    """``UV_COMPILE_BYTECODE=1`` in the caller's environment: uv writes bytecode into the staging tree
    that no RECORD lists; the run does not swap (its log says why) and installs with uv in the window."""
    bed.service("swap-bytecode")
    result = bed.safeinstall(
        "sicext",
        "--wheel",
        str(bed.wheels["sicext-2"]),
        "--settle",
        "0.5",
        "--json",
        more_env={"UV_COMPILE_BYTECODE": "1"},
    )
    assert result.code == 0, result.stdout + result.stderr
    steps = {s["name"]: s["detail"] for s in result.json["data"]["steps"]}
    assert "pip install" in steps["install"] and "verify-in-place" not in steps, steps
    log = Path(result.json["data"]["log_file"]).read_text()
    assert "no swap: the staging tree's files are not its RECORDs'" in log
    assert not list(bed.python.parent.parent.glob(".safeinstall-swap-*"))
    assert bed.version() == "2.0"


def test_the_owner_of_a_prefix_is_never_root_where_others_may_write_or_a_link_stands(tmp_path: Path) -> None:
    """The attacker review (issue 35): a recovery acts in a prefix as its owner, and as root only in a
    directory root owns that no one else may write; a prefix swapped for a link, or a root-owned one
    another group or everyone may write, has no owner to act as (OSError: the put-back then leaves its
    staging directory as it is rather than act as root)."""
    if os.geteuid() != 0:
        pytest.skip("needs root: the prefixes are root's")
    prefix = tmp_path / "venv"
    prefix.mkdir(mode=0o755)
    os.chmod(prefix, 0o755)
    assert owner_of(prefix) is None  # root's, only root writes: root's own process
    for mode, gid in ((0o757, 0), (0o775, 65534)):
        os.chown(prefix, 0, gid)
        os.chmod(prefix, mode)
        with pytest.raises(OSError):
            owner_of(prefix)
    os.chown(prefix, 0, 0)
    os.chmod(prefix, 0o775)  # root's group may write: still root's
    assert owner_of(prefix) is None
    os.chown(prefix, 65534, 65534)
    assert owner_of(prefix) == (65534, 65534)
    link = tmp_path / "link"
    link.symlink_to(prefix)
    with pytest.raises(OSError):
        owner_of(link)


def test_the_plan_looks_up_live_entries_when_it_asks_and_plans_as_with_all_of_them(tmp_path: Path) -> None:
    """The live environment's kinds are looked up as the plan asks (a few entries, not every file):
    the same plan as with every entry looked up first, and only the entries it visits are read."""
    from safeinstall.env.renames import LiveKinds, entries
    from safeinstall.system.safefs import Tree

    live = tmp_path / "prefix"
    for path in ("pkg/a.py", "pkg/gone.py", "pkg/sub/b.py", "pkg-1.0.dist-info/RECORD", "other/x.py"):
        (live / path).parent.mkdir(parents=True, exist_ok=True)
        (live / path).write_text(path)
    (live / "pkg" / "now_a_dir").write_text("a file in the environment, a directory in the new version")
    staged = _tree("pkg/a.py", "pkg/sub/b.py", "pkg/now_a_dir/c.py", "pkg-2.0.dist-info/RECORD")
    files = frozenset(p for p, kind in staged.items() if kind == "file")
    dirs = frozenset(p for p, kind in staged.items() if kind == "dir")
    old = frozenset({"pkg/a.py", "pkg/gone.py", "pkg/sub/b.py", "pkg-1.0.dist-info/RECORD"})
    own = frozenset({"pkg", "pkg-1.0.dist-info"})
    with Tree(live) as tree:
        every = {p: e.kind for p, e in entries(tree, sorted(files | dirs | old | own)).items()}
        lazy = LiveKinds(tree, entries(tree, sorted(dirs | own)))
        for held in (frozenset(), frozenset({"pkg/sub/b.py"})):
            assert plan_swap(files, dirs, lazy, old, own, held) == plan_swap(
                files, dirs, every, old, own, held
            )
        assert "pkg/now_a_dir" in lazy and lazy["pkg/now_a_dir"] == "file"
        assert "other/x.py" not in set(lazy) and "pkg/nothing" not in lazy


def test_only_what_bears_on_the_plan_is_held() -> None:
    """plan_staged leaves out of ``held`` the other distributions' files that no old file or own
    directory of the plan lies at or above (vLLM's 60k): the plan is the same as with every one held."""
    from safeinstall.env.renames import bears_on_plan

    new = _tree(f"{SITE}/nvidia/cudnn/lib/a.so", f"{SITE}/pkg/__init__.py", f"{SITE}/pkg/sub/c.py")
    live = _tree(
        f"{SITE}/nvidia/cudnn/lib/a.so",
        f"{SITE}/nvidia/cudnn/lib/shared.so",
        f"{SITE}/nvidia/nccl/lib/b.so",
        f"{SITE}/pkg/__init__.py",
        f"{SITE}/pkg/old.py",
        f"{SITE}/pkg/sub/c.py",
        f"{SITE}/pkg/sub/local.cfg",
        f"{SITE}/other/x.py",
    )
    old = {
        f"{SITE}/nvidia/cudnn/lib/a.so",
        f"{SITE}/pkg/__init__.py",
        f"{SITE}/pkg/old.py",
        f"{SITE}/pkg/sub/c.py",
    }
    own = {f"{SITE}/nvidia/cudnn", f"{SITE}/pkg", f"{SITE}/pkg/sub"}
    every = {
        f"{SITE}/nvidia/cudnn/lib/shared.so",  # below an own directory: it stays whole
        f"{SITE}/nvidia/nccl/lib/b.so",
        f"{SITE}/pkg/sub/local.cfg",
        f"{SITE}/pkg/old.py",  # an old file another distribution lists too: it stays
        f"{SITE}/other/x.py",
        "bin/other",
    }
    asked = frozenset(old | own)
    bearing = {h for h in every if bears_on_plan(h, asked)}
    assert bearing == {
        f"{SITE}/nvidia/cudnn/lib/shared.so",
        f"{SITE}/pkg/sub/local.cfg",
        f"{SITE}/pkg/old.py",
    }
    assert _plan(new, live, old, own, bearing) == _plan(new, live, old, own, every)
    for one in every:  # each held file alone, too
        assert _plan(new, live, old, own, {one} & bearing) == _plan(new, live, old, own, {one})


@pytest.mark.parametrize("prefix", ["/srv/venv", "/work/.bench/venv", "/srv/venv/"])
def test_bearing_cuts_plain_paths_as_normalising_them_would(prefix: str) -> None:
    """The lexical pass before the containment check: a plain location is cut, any other (".", "..",
    "//", a trailing "/", outside the prefix) normalised, with the same answer either way."""
    from safeinstall.env.containment import relative_to_prefix
    from safeinstall.env.renames import bears_on_plan
    from safeinstall.run.parts.staging import bearing

    top = prefix.rstrip("/")
    asked = frozenset({f"{SITE}/pkg", f"{SITE}/.hidden/own", f"{SITE}/old.py"})
    locations = [
        f"{top}/{SITE}/pkg/a.py",
        f"{top}/{SITE}/pkg/../other/b.py",
        f"{top}/{SITE}/other/../pkg/c.py",
        f"{top}/{SITE}/./pkg/d.py",
        f"{top}/{SITE}//pkg/e.py",
        f"{top}/{SITE}/pkg/",
        f"{top}/{SITE}/.hidden/own/f.so",
        f"{top}/{SITE}/.hidden/g.so",
        f"{top}/{SITE}/old.py",
        f"{top}/{SITE}/other/h.py",
        f"{top}/../elsewhere/{SITE}/pkg/i.py",
        f"/elsewhere/{SITE}/pkg/j.py",
        f"{top}",
    ]
    expected = [x for x in locations if bears_on_plan(relative_to_prefix(x, prefix) or "", asked)]
    assert bearing(prefix, locations, asked) == expected
    assert len(expected) == 7, expected
