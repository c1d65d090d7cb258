"""Threat model, files and wheels: each row an attack, tried for real.

safeinstall runs as root; the environment may belong to a service account (here uid 65534, whose unit
runs its code under that uid), and the wheel comes from a directory others can write. Every attack
below uses real wheels built at test time (hostile ones written with zipfile, with a consistent
RECORD), venvs made and filled by the real uv, units of the private systemd manager, and the real
``safeinstall`` and ``safeinstall --recover``. Each asserts the exact refusal or behaviour, and that
nothing outside the environment changed (a snapshot of a directory beside it: content, type, owner).
"""

from __future__ import annotations

import errno
import json
import os
import py_compile
import shutil
import signal
import stat
import subprocess
import sys
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests import wheelhouse
from tests.bed_systemd import UserManager, wait_until
from tests.beds import (
    AS_ROOT,
    NOBODY,
    OTHER,
    UNIT_TEXT,
    Bed,
    ServiceAccountBed,
    as_nobody,
    as_user,
    chown_tree,
    shared_interpreter_or_skip,
    tree_snapshot,
)
from tests.clirun import Result, run
from tests.wheelhouse import Wheelhouse

needs_root = pytest.mark.skipif(not AS_ROOT, reason="the attacks are on a run as root")


SWAP_AND_CRASH = """
import os
_here = os.path.dirname(os.path.abspath(__file__))
if not os.path.islink(_here):
    os.rename(_here, os.path.join(os.path.dirname(_here), ".sicext-moved"))
    os.symlink({target!r}, _here)
raise SystemExit("the new code swapped its package for a symlink, then crashed")
"""


# --- 1. writes through symlinks ---------------------------------------------------------------------


def test_new_code_swaps_its_package_for_a_symlink_then_crashes_rollback(
    account: ServiceAccountBed, tmp_path: Path
) -> None:
    """Row: new code (run as the service account) replaces its package directory with a symlink to a
    directory elsewhere, then crashes. The rollback replaces the symlink with the real directory and
    restores there: nothing is written into (or deleted from) the other directory."""
    evil = wheelhouse.rebuilt(
        account.wheels["sicext-2"],
        tmp_path / "evil",
        {"sicext/__init__.py": SWAP_AND_CRASH.format(target=str(account.elsewhere)).encode()},
    )
    before = account.snapshot()
    outside = account.outside()
    name = account.unit("swap")
    # the smoke check runs the new code first (as the account, in the prefetch's tree): refused before
    # the stop, and what it did there is removed as the account, never followed
    checked = account.cli("sicext", "--wheel", str(evil), "--yes", "--settle", "1", "--json")
    assert checked.code == 2 and "swapped its package" in checked.json["errors"][0]["message"], checked.stdout
    assert account.snapshot() == before and account.outside() == outside
    assert not list(account.state.glob("*/prefetch-*"))
    result = account.cli("sicext", "--wheel", str(evil), "--yes", "--settle", "1", "--json", "--no-smoke")
    assert result.code == 3, result.stdout + result.stderr
    message = result.json["errors"][0]["message"]
    assert "restored the previous installation" in message and f"started {name} again" in message
    package = account.site / "sicext"
    assert package.is_dir() and not package.is_symlink()
    assert account.snapshot() == before and account.version() == "1.0"
    assert os.stat(package).st_uid == NOBODY  # the directory comes back as it was, the owner's
    account.manager.wait_active(name)
    outside_now = account.outside()
    assert outside_now == outside, "root wrote or deleted outside the environment"
    account.no_trace()


def test_new_code_swaps_its_package_for_a_symlink_then_recover(
    account: ServiceAccountBed, tmp_path: Path
) -> None:
    """Row: the run dies during the install (power loss, SIGKILL), and the service account swaps the
    package directory for a symlink before ``--recover`` runs: the recovery restores into the real
    directory, never into the symlink's target."""
    slow = wheelhouse.rebuilt(
        account.wheels["sicext-2"], tmp_path / "slow", {"sicext/blob.bin": os.urandom(48 << 20)}
    )
    before = account.snapshot()
    name = account.unit("swap-recover")
    # --no-swap: uv installs in the window, where the kill lands (an account's environment swaps since
    # issue 34: there ``installed`` lasts a moment, and a kill past the verification finishes forward)
    proc = account.start_run("sicext", "--wheel", str(slow), "--settle", "1", "--no-swap")
    try:
        account.wait_phase(proc, "installing", "installed")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.communicate()
    wait_until(lambda: not account.installers(), 10, "no uv process left installing")
    journal = account.journal()
    assert journal is not None and journal["phase"] in ("installing", "installed")
    copy = Path(journal["wheel"])  # the run's own copy, in its state directory: what --recover reads
    assert copy.is_relative_to(account.state) and copy.parent.parent.name == "wheels" and copy.is_file()
    assert (
        stat.S_IMODE(os.stat(copy.parent.parent).st_mode) == 0o711
    )  # entered by uv (as uid 65534), not listed
    info = os.stat(copy)  # read by uv (as uid 65534, by its ACL), never replaced; no other user reads it
    assert (stat.S_IMODE(info.st_mode), info.st_uid, info.st_gid) == (0o640, 0, 0)
    with pytest.raises(subprocess.CalledProcessError):
        as_user(OTHER, "head", "-c1", str(copy))
    package = account.site / "sicext"
    if package.is_dir():  # what the new code would do when it ran: as the service account
        as_nobody("mv", str(package), str(account.site / ".sicext-moved"))
    as_nobody("ln", "-s", str(account.elsewhere), str(package))
    outside = account.outside()

    recovered = account.cli("--recover", "--json")

    assert recovered.code == 0, recovered.stdout + recovered.stderr
    (recovery,) = recovered.json["data"]["recoveries"]
    assert recovery["restored"] is True and recovery["started"] == [name]
    assert package.is_dir() and not package.is_symlink()
    assert account.snapshot() == before and account.version() == "1.0"
    assert account.outside() == outside, "root wrote or deleted outside the environment"
    account.manager.wait_active(name)
    account.no_trace()
    assert not copy.exists()


def test_prune_saves_a_leftover_symlink_as_a_link(
    account: ServiceAccountBed, small_disk: Callable[[int, Path], Path]
) -> None:
    """Row: ``--prune`` with leftovers that are symlinks (to ``/dev/zero``, to a file outside): the links
    themselves are saved and removed; their targets are never read. (The state directory is a 16 MiB
    tmpfs: following ``/dev/zero`` could not fill the machine's disk.)"""
    account.state = small_disk(16, account.base.parent) / "state"  # a tmpfs others may enter: uv's cache
    package = account.site / "sicext"
    secret = account.elsewhere / "victim.txt"
    as_nobody("ln", "-s", "/dev/zero", str(package / "leftover_zero"))
    as_nobody("ln", "-s", str(secret), str(package / "leftover_secret"))
    outside = account.outside()
    result = account.cli("sicext", "--wheel", str(account.wheels["sicext-2"]), "--prune", "--yes", "--json")
    assert result.code == 0, result.stdout + result.stderr
    data = result.json["data"]
    assert sorted(data["pruned"]) == [str(package / "leftover_secret"), str(package / "leftover_zero")]
    relative = package.relative_to(account.python.parent.parent)
    saved = Path(data["backup_dir"]) / "pruned" / relative
    assert os.readlink(saved / "leftover_zero") == "/dev/zero"
    assert os.readlink(saved / "leftover_secret") == str(secret)
    assert not (package / "leftover_zero").is_symlink() and not (package / "leftover_secret").is_symlink()
    assert account.outside() == outside
    account.no_trace()


# --- 1b. no code of the environment runs as root: uv runs as its owner -------------------------------

RUN_ID = "20261130T031201Z-1234"


def _plant_journal(account: ServiceAccountBed, unit: str) -> Path:
    """A run of this environment that died during the install (phase installing, its unit stopped,
    its backup taken): what ``--recover`` finds after a power loss. Its environment directory."""
    from safeinstall.env.distributions import find_distribution, find_distributions
    from safeinstall.env.environment import inspect_environment
    from safeinstall.store.backup import create_backup
    from safeinstall.store.journal import JournalUnit, Phase, advance, journal_to_dict, new_journal
    from safeinstall.store.state import environment_key
    from safeinstall.system.identity import ProcessId

    env = inspect_environment(account.python)
    envdir = account.state / environment_key(env.prefix)
    backup = envdir / "backups" / RUN_ID
    create_backup(
        env,
        [find_distribution(env, "sicext", find_distributions(env))],
        backup,
        (),
        installed=find_distributions(env),
    )
    unit_entry = JournalUnit(unit, user_manager=True, was_active=True, unit_file_state="static", stopped=True)
    python = str(env.prefix / "bin" / account.python.name)
    journal = new_journal(
        RUN_ID, ProcessId(1234, None), python, str(env.prefix), "sicext", None, ["uv"], [unit_entry]
    )
    journal = advance(advance(journal, Phase.BACKED_UP, backup_dir=str(backup)), Phase.INSTALLING)
    path = envdir / "journal.json"
    path.write_text(json.dumps(journal_to_dict(journal)))
    path.chmod(0o600)
    return envdir


def _pth_uids(account: ServiceAccountBed) -> Callable[[str], None]:
    """A ``.pth`` file in the account's venv that appends the uid it runs as to a file (beside the
    environment's files, writable by its owner); returns the check that it never ran as root."""
    uids = account.base / "venv" / "pth-uids"
    uids.touch()
    os.chown(uids, NOBODY, NOBODY)
    pth = account.site / "zz-uids.pth"
    pth.write_text(f"import os; open({str(uids)!r}, 'a').write('%d\\n' % os.getuid())\n")
    os.chown(pth, NOBODY, NOBODY)

    def never_root(after: str) -> None:
        ran = set(uids.read_text().split())
        assert "0" not in ran, f"the environment's .pth file ran as root during {after}"
        assert ran <= {str(NOBODY)}

    return never_root


def test_uv_runs_as_the_environments_owner_never_as_root(account: ServiceAccountBed) -> None:
    """Row: a ``.pth`` file in the service account's venv. uv asks the interpreter with ``-I``, which
    still runs ``site``, so the file runs in every uv call: the dry-run's plan, the prefetch, the
    install. It must never run as root: not for ``--dry-run``, a run, ``--verify-only``, a run that
    rolls back, nor ``--recover``. uv runs as uid 65534, so the files it installs are that account's,
    and the rollback and the recovery restore into its environment as before."""
    never_root = _pth_uids(account)

    def version() -> str:  # Bed.version would run the environment's python as root (the test's uid)
        versions = [
            p.name.removesuffix(".dist-info").split("-")[1] for p in account.site.glob("sicext-*.dist-info")
        ]
        assert len(versions) == 1, versions
        return versions[0]

    name = account.unit("as-owner")
    outside = account.outside()

    dry = account.cli("sicext", "--wheel", str(account.wheels["sicext-2"]), "--dry-run", "--json")
    assert dry.code == 0, dry.stdout + dry.stderr
    never_root("--dry-run")
    assert f"uv runs as uid {NOBODY} too" in dry.json["data"]["warnings"][0]

    main = account.manager.main_pid(name)
    done = account.cli(
        "sicext", "--wheel", str(account.wheels["sicext-2"]), "--yes", "--settle", "1", "--json"
    )
    assert done.code == 0, done.stdout + done.stderr
    never_root("a run")
    assert version() == "2.0" and name in done.json["data"]["downtime_s"]
    account.manager.wait_active(name)
    assert account.manager.main_pid(name) != main
    installed = [p for p in account.site.glob("sicext*/**/*") if "__pycache__" not in p.parts]
    assert installed and all(os.lstat(p).st_uid == NOBODY for p in installed), "uv installed as root"
    check = account.cli("sicext", "--verify-only", "--wheel", str(account.wheels["sicext-2"]))
    assert check.code == 0, check.stdout + check.stderr
    never_root("--verify-only")
    account.no_trace()

    before = account.snapshot()
    crash = account.cli(
        "sicext", "--wheel", str(account.wheels["sicext-3"]), "--yes", "--settle", "1", "--json", "--no-smoke"
    )
    assert crash.code == 3, crash.stdout + crash.stderr
    assert "restored the previous installation" in crash.json["errors"][0]["message"]
    never_root("a run that rolled back")
    assert account.snapshot() == before and version() == "2.0"
    restored = [p for p in (account.site / "sicext").rglob("*") if "__pycache__" not in p.parts]
    assert all(os.lstat(p).st_uid == NOBODY for p in restored)  # put back as its owner's
    account.manager.wait_active(name)
    account.no_trace()

    envdir = _plant_journal(account, name)
    account.manager.systemctl("stop", name)
    as_nobody("rm", str(account.site / "sicext" / "serve.py"))  # the dead run's half-done install
    cache = envdir / f"uv-cache-{RUN_ID}"  # the dead run's uv cache, its owner's: a link to a victim
    cache.mkdir()
    os.chown(cache, NOBODY, NOBODY)
    as_nobody("ln", "-s", str(account.elsewhere / "victim.txt"), str(cache / "victim"))
    as_nobody("ln", "-s", str(account.elsewhere), str(cache / "elsewhere"))
    recovered = account.cli("--recover", "--json")
    assert recovered.code == 0, recovered.stdout + recovered.stderr
    (recovery,) = recovered.json["data"]["recoveries"]
    assert recovery["restored"] is True and recovery["started"] == [name]
    never_root("--recover")
    assert account.snapshot() == before and os.lstat(account.site / "sicext" / "serve.py").st_uid == NOBODY
    assert not cache.exists() and account.outside() == outside, "root deleted or wrote outside"
    account.manager.wait_active(name)
    account.no_trace()


def test_keep_patches_fetches_as_the_environments_owner(account: ServiceAccountBed) -> None:
    """Row: ``--keep-patches`` without wheels: uv fetches the installed and the new version into the
    run's scratch directory, as the environment's owner (the ``.pth`` file never runs as root); root
    reads what uv wrote there by descriptor, and the carried patch is in the owner's new files."""
    never_root = _pth_uids(account)
    links = account.base / "links"  # a flat index the account can read
    links.mkdir(mode=0o755)
    for key in ("sicext-1", "sicext-2"):
        shutil.copy(account.wheels[key], links)
        (links / account.wheels[key].name).chmod(0o644)
    init = account.site / "sicext" / "__init__.py"
    init.write_text(init.read_text() + 'PATCH = " with a local fix"\n')  # shared by 1.0 and 2.0
    name = account.unit("keep-patches")
    index = ("--", "--offline", "--find-links", str(links))
    dry = account.cli("sicext==2.0", "--keep-patches", "--dry-run", "--json", *index)  # its scratch: /tmp
    assert dry.code == 0, dry.stdout + dry.stderr
    never_root("a --keep-patches dry-run")
    assert [(p["path"], p["status"]) for p in dry.json["data"]["patches"]] == [(str(init), "carried")]
    result = account.cli("sicext==2.0", "--keep-patches", "--yes", "--settle", "1", "--json", *index)
    assert result.code == 0, result.stdout + result.stderr
    never_root("a --keep-patches run")
    assert [(p["path"], p["status"]) for p in result.json["data"]["patches"]] == [(str(init), "carried")]
    assert init.read_text().endswith('PATCH = " with a local fix"\n') and os.lstat(init).st_uid == NOBODY
    account.manager.wait_active(name)
    assert not list(account.state.glob("*/keep-patches-*")) and not list(account.state.glob("*/prefetch-*"))
    account.no_trace()


# --- 2. the put-back sequence: files found unchanged -------------------------------------------------


@pytest.fixture
def read_only() -> Iterator[Callable[[Path], None]]:
    """Makes a directory read-only with a read-only bind mount of itself (undone at the end)."""
    mounted: list[Path] = []

    def make(path: Path) -> None:
        for args in (["--bind", str(path), str(path)], ["-o", "remount,bind,ro", str(path)]):
            done = subprocess.run(["mount", *args], capture_output=True, text=True)
            if done.returncode != 0:
                message = f"cannot make {path} read-only: {done.stderr.strip()}"
                if os.environ.get("CI"):
                    pytest.fail(message)
                pytest.skip(message)
            if args[0] == "--bind":
                mounted.append(path)

    try:
        yield make
    finally:
        for path in reversed(mounted):
            subprocess.run(["umount", "--lazy", str(path)], check=False, capture_output=True)


@needs_root
def test_a_read_only_site_packages_is_refused_before_anything_stops(
    bed: Bed, read_only: Callable[[Path], None]
) -> None:
    name = bed.unit("ro-preflight")
    main = bed.manager.main_pid(name)
    read_only(bed.site)
    result = bed.cli("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--yes")
    assert result.code == 2, result.stdout + result.stderr
    assert "the install could not write" in result.stderr
    assert f"{bed.site}, " in result.stderr and "nothing was stopped" in result.stderr
    assert ": it is not writable (a read-only file system)" in result.stderr
    assert bed.manager.main_pid(name) == main and bed.version() == "1.0"
    bed.no_trace()


@needs_root
@pytest.mark.parametrize("swap", [True, False], ids=["swap", "no-swap"])
def test_site_packages_read_only_during_the_downtime_rollback_starts_the_units(
    bed: Bed, read_only: Callable[[Path], None], swap: bool
) -> None:
    """Row: the install fails before it writes anything (site-packages became read-only after the
    preflight): the restore finds the files unchanged, writes nothing, and the units are started."""
    before = bed.snapshot()
    name = bed.unit("ro-rollback")
    holder = bed.manager.main_pid(name)
    bed.hold_gpu(name, 900.0, "f1")  # the GPU wait lasts until it is read-only
    no_swap = () if swap else ("--no-swap",)
    proc = bed.start_run(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json", *no_swap
    )
    try:
        bed.wait_phase(proc, "stopped")
        read_only(bed.site)
        bed.nvml.unhold(holder)
        out, err = proc.communicate(timeout=120)
    finally:
        bed.nvml.unhold(holder)
        proc.kill()
        proc.communicate()
    assert proc.returncode == 3, out + err
    message = json.loads(out)["errors"][0]["message"]
    if swap:  # the read-only mount came after the plan: the first rename fails, nothing was changed
        assert "the swap failed" in message and f"the files were unchanged; started {name} again" in message
    else:  # uv removed the console script (bin/ is writable) before it failed on site-packages: only that
        # is put back; nothing is written to the read-only site-packages, and the unit is started
        assert "uv pip install failed" in message and "Read-only file system" in message, message
        assert f"restored the previous installation; started {name} again" in message
    bed.manager.wait_active(name)
    assert bed.snapshot() == before and bed.version() == "1.0"
    bed.no_trace()


@needs_root
def test_site_packages_read_only_then_killed_recover_starts_the_units(
    bed: Bed, read_only: Callable[[Path], None]
) -> None:
    """Row: the same, but the run is killed during the install: ``--recover`` finds the files unchanged
    (it could not write a thing: read-only), and starts the unit."""
    before = bed.snapshot()
    name = bed.unit("ro-recover")
    holder = bed.manager.main_pid(name)
    bed.hold_gpu(name, 900.0, "f2")  # the GPU wait lasts until it is read-only
    # uv's install in the window (the swap's failures: test_swap.py)
    proc = bed.start_run("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--no-swap")
    try:
        bed.wait_phase(proc, "stopped")
        read_only(bed.site)
        bed.nvml.unhold(holder)
        bed.wait_phase(proc, "installing", timeout=60)
        proc.send_signal(signal.SIGKILL)
    finally:
        bed.nvml.unhold(holder)
        proc.wait()
        proc.communicate()
    wait_until(lambda: not bed.installers(), 10, "no uv process left installing")
    journal = bed.journal()
    assert journal is not None and journal["phase"] in ("installing", "rolling-back"), journal
    recovered = bed.cli("--recover", "--json")
    assert recovered.code == 0, recovered.stdout + recovered.stderr
    (recovery,) = recovered.json["data"]["recoveries"]
    assert recovery["started"] == [name]
    if not recovery["restored"]:  # uv was stopped before it removed anything
        assert "the files were found as they were before the run: nothing to restore" in recovery["notes"]
    bed.manager.wait_active(name)
    assert bed.snapshot() == before and bed.version() == "1.0"
    bed.no_trace()


# --- 3. wheels checked at preflight ------------------------------------------------------------------


@needs_root
def test_a_wheel_replaced_in_its_directory_during_the_run_is_not_what_gets_installed(
    bed: Bed, tmp_path: Path
) -> None:
    """Row: whoever can write the wheel's directory replaces it after the preflight checked it (here
    during the downtime): the run installs its own copy, checked at preflight, not the new file."""
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    wheel = downloads / bed.wheels["sicext-2"].name
    shutil.copyfile(bed.wheels["sicext-2"], wheel)
    evil = wheelhouse.rebuilt(
        bed.wheels["sicext-2"], tmp_path / "evil", {"sicext/__init__.py": b"raise SystemExit('replaced')\n"}
    )
    name = bed.unit("replaced")
    holder = bed.manager.main_pid(name)
    bed.hold_gpu(name, 900.0, "f3")  # the GPU wait lasts until the wheel is replaced
    proc = bed.start_run("sicext", "--wheel", str(wheel), "--settle", "0.5", "--json")
    try:
        bed.wait_phase(proc, "stopped")
        shutil.copyfile(evil, wheel)
        bed.nvml.unhold(holder)
        out, err = proc.communicate(timeout=120)
    finally:
        bed.nvml.unhold(holder)
        proc.kill()
        proc.communicate()
    assert proc.returncode == 0, out + err
    assert bed.version() == "2.0"
    bed.manager.wait_active(name)
    bed.no_trace()
    assert not list(bed.state.glob("*/wheels/*"))  # the copy went with the run


def _non_utf8_name(wheel: Path, out: Path) -> Path:
    """A wheel with a member whose name is flagged UTF-8 but is not (bytes patched in after writing)."""
    path = wheelhouse.rebuilt(wheel, out, {"sicext/AAAA.py": b""})
    raw = bytearray(path.read_bytes().replace(b"sicext/AAAA.py", b"sicext/\xff\xfe\xfd\xfc.py", 2))
    at = 0
    while (at := raw.find(b"PK\x01\x02", at)) >= 0:  # its central directory entry: set flag bit 11
        name_len = int.from_bytes(raw[at + 28 : at + 30], "little")
        if raw[at + 46 : at + 46 + name_len] == b"sicext/\xff\xfe\xfd\xfc.py":
            flags = int.from_bytes(raw[at + 8 : at + 10], "little") | 0x800
            raw[at + 8 : at + 10] = flags.to_bytes(2, "little")
        at += 4
    path.write_bytes(bytes(raw))
    return path


def _big_metadata(wheel: Path, out: Path) -> Path:
    members, _dist_info = wheelhouse.members_of(wheel)
    name = next(n for n in members if n.endswith(".dist-info/METADATA"))
    return wheelhouse.rebuilt(wheel, out, {name: members[name] + b"\n" + b"x" * (64 << 20)})


def _digest_algorithm(wheel: Path, out: Path, algorithm: str, spoil: bool) -> Path:
    """``wheel`` with a RECORD of ``algorithm`` digests; ``spoil``: one member changed after the RECORD
    was written, at the same size (only its digest can tell)."""
    members, dist_info = wheelhouse.members_of(wheel)
    record = [
        f"{n},{algorithm}={wheelhouse.record_digest(d, algorithm)},{len(d)}" for n, d in members.items()
    ]
    record.append(f"{dist_info}/RECORD,,")
    if spoil:
        content = members["sicext/serve.py"]
        members["sicext/serve.py"] = content[:-2] + (b"#" if content[-2:-1] != b"#" else b" ") + content[-1:]
    out.mkdir(parents=True, exist_ok=True)
    path = out / wheel.name
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in members.items():
            archive.writestr(name, data)
        archive.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return path


def _console_script_python(wheel: Path, out: Path) -> Path:
    members, _dist_info = wheelhouse.members_of(wheel)
    name = next(n for n in members if n.endswith(".dist-info/entry_points.txt"))
    text = members[name].decode() + "python = sicext.serve:main\n"
    return wheelhouse.rebuilt(wheel, out, {name: text.encode()})


@pytest.fixture(scope="module")
def target(
    tmp_path_factory: pytest.TempPathFactory, wheels: Wheelhouse, user_manager: UserManager
) -> Iterator[tuple[Path, str, Path]]:
    """One venv (sipure 1.0, sicext 1.0), its unit, and a directory beside it, for the refusals: each
    changes nothing, so they can share them."""
    if not AS_ROOT:
        pytest.skip("the attacks are on a run as root")
    base = tmp_path_factory.mktemp("refusals")
    python = wheelhouse.make_venv(base / "venv")
    wheelhouse.uv_install(python, wheels["sipure-1"], wheels["sicext-1"])
    (base / "venv" / "share").mkdir()
    (base / "venv" / "share" / "notes.txt").write_text("the operator's notes, in no RECORD\n")
    (base / "outside").mkdir()
    (base / "outside" / "x").write_text("outside the environment\n")
    name = user_manager.unique_name("refusals")
    user_manager.write_unit(name, UNIT_TEXT.format(exec=f"{python.parent}/sicext-serve"))
    user_manager.start(name)
    user_manager.wait_active(name)
    try:
        yield python, name, base
    finally:
        user_manager.remove_unit(name)


def _absolute_member(wheel: Path, out: Path, absolute: str) -> Path:
    """zipfile strips a leading "/" when writing; patch the name in after."""
    placeholder = "A" * len(absolute)
    path = wheelhouse.rebuilt(wheel, out, {placeholder: b"x"})
    raw = path.read_bytes().replace(placeholder.encode(), absolute.encode())
    path.write_bytes(raw)
    return path


ATTACKS: dict[str, tuple[Callable[[Path, Path, Path], Path], str]] = {
    # row: a consistent RECORD that lists a member outside the package: never installed, never deleted
    "dotdot-bin-python": (
        lambda w, out, _b: wheelhouse.rebuilt(w, out, {"../../../bin/python": b"#!/bin/sh\necho pwned\n"}),
        "member '../../../bin/python' has an empty, '.' or '..' component",
    ),
    "absolute-member": (
        lambda w, out, b: _absolute_member(w, out, str(b / "outside" / "x")),
        "member '{base}/outside/x' is not a plain relative path",
    ),
    "data-pyvenv-cfg": (
        lambda w, out, _b: wheelhouse.rebuilt(
            w, out, {"sicext-2.0.data/data/pyvenv.cfg": b"home = /tmp/evil\n"}
        ),
        "sicext-2.0.data/data/pyvenv.cfg would replace the environment's own",
    ),
    "scripts-python3": (
        lambda w, out, _b: wheelhouse.rebuilt(w, out, {"sicext-2.0.data/scripts/python3": b"#!/bin/sh\n"}),
        "sicext-2.0.data/scripts/python3 would replace the environment's own",
    ),
    "data-unowned-file": (
        lambda w, out, _b: wheelhouse.rebuilt(w, out, {"sicext-2.0.data/data/share/notes.txt": b"gone\n"}),
        "share/notes.txt, which no distribution being replaced holds",
    ),
    "other-distribution": (
        lambda w, out, _b: wheelhouse.rebuilt(w, out, {"sipure/__init__.py": b"print('hijacked')\n"}),
        "sipure/__init__.py would replace",
    ),
    "unknown-scheme": (
        lambda w, out, _b: wheelhouse.rebuilt(w, out, {"sicext-2.0.data/elsewhere/x": b"x"}),
        "member 'sicext-2.0.data/elsewhere/x' is not inside a scheme directory",
    ),
    "console-script-python": (
        lambda w, out, _b: _console_script_python(w, out),
        "console script python would replace the environment's own",
    ),
    "metadata-64-mib": (
        lambda w, out, _b: _big_metadata(w, out),
        "dist-info/METADATA unpacks to 671",
    ),
    "non-utf8-name": (lambda w, out, _b: _non_utf8_name(w, out), "is not valid UTF-8"),
    "sha512-spoiled": (
        lambda w, out, _b: _digest_algorithm(w, out, "sha512", spoil=True),
        "sicext/serve.py: RECORD sha512 hash does not match the content",
    ),
    "md5-record": (
        lambda w, out, _b: _digest_algorithm(w, out, "md5", spoil=False),
        "hash algorithm 'md5' is not accepted",
    ),
}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_hostile_wheels_are_refused_at_preflight(
    attack: str,
    target: tuple[Path, str, Path],
    wheels: Wheelhouse,
    user_manager: UserManager,
    tmp_path: Path,
) -> None:
    python, unit, base = target
    build, expected = ATTACKS[attack]
    wheel = build(wheels["sicext-2"], tmp_path / "w", base)
    before = tree_snapshot(base)
    main = user_manager.main_pid(unit)
    env = {**user_manager.env, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state")}

    result = run("sicext", "--user", "--python", str(python), "--wheel", str(wheel), "--yes", env=env)

    assert result.code == 2, result.stdout + result.stderr
    assert expected.format(base=base) in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert user_manager.main_pid(unit) == main
    assert tree_snapshot(base) == before  # the environment and what is beside it: untouched
    assert not list((tmp_path / "state").glob("*/wheels/*"))  # the run's copy went with it


def test_a_wheel_whose_record_uses_sha512_is_accepted(
    target: tuple[Path, str, Path], wheels: Wheelhouse, user_manager: UserManager, tmp_path: Path
) -> None:
    python, _unit, _base = target
    wheel = _digest_algorithm(wheels["sicext-2"], tmp_path / "w", "sha512", spoil=False)
    env = {**user_manager.env, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state")}
    result = run(
        "sicext", "--user", "--python", str(python), "--wheel", str(wheel), "--dry-run", "--json", env=env
    )
    assert result.code == 0, result.stdout + result.stderr
    assert result.json["data"]["proceeds"] is True


def test_a_fifo_given_as_the_wheel_is_refused(
    target: tuple[Path, str, Path], wheels: Wheelhouse, tmp_path: Path
) -> None:
    python, _unit, _base = target
    fifo = tmp_path / wheels["sicext-2"].name
    os.mkfifo(fifo)
    result = run("sicext", "--verify-only", "--python", str(python), "--wheel", str(fifo), timeout=60)
    assert result.code == 2 and "not a regular file (a FIFO)" in result.stderr, result.stderr


# --- 4. reads outside the environment ----------------------------------------------------------------


@pytest.fixture
def verified(venv: Path, wheels: Wheelhouse, tmp_path: Path) -> tuple[Path, Path, Path]:
    """sicext 1.0 in a venv, and a secret file outside it: (python, site-packages, secret)."""
    wheelhouse.uv_install(venv, wheels["sicext-1"])
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP-SECRET-CONTENT\n")
    return venv, wheelhouse.site_packages(venv), secret


@pytest.mark.parametrize("how", ["relative", "absolute"])
def test_verify_never_reads_what_a_wheel_member_points_at(
    verified: tuple[Path, Path, Path], wheels: Wheelhouse, tmp_path: Path, how: str
) -> None:
    python, site, secret = verified
    if how == "relative":
        member = os.path.relpath(secret, site)
        wheel = wheelhouse.rebuilt(wheels["sicext-1"], tmp_path / "w", {member: b"other\n"})
    else:
        member = str(secret)
        wheel = _absolute_member(wheels["sicext-1"], tmp_path / "w", member)
    patch = tmp_path / "out.patch"
    result = run(
        "sicext", "--verify-only", "--python", str(python), "--wheel", str(wheel),
        "--diff", "--save-patch", str(patch),
    )  # fmt: skip
    assert result.code == 2, result.stdout + result.stderr
    assert f"member '{member}'" in result.stderr and "refusing the wheel" in result.stderr
    assert "TOP-SECRET" not in result.stdout + result.stderr and not patch.exists()


@pytest.mark.parametrize("where", ["in-the-users-directory", "the-users-link-in-a-sticky-directory"])
def test_an_output_file_is_never_written_through_another_users_link(
    verified: tuple[Path, Path, Path], wheels: Wheelhouse, open_dir: Path, where: str
) -> None:
    """Row (issue 35): `--save-patch DIR/link/FILE` (and `--metrics-file`, the same rule) where another
    user's symlink leads into a root-only directory, the link in that user's directory or in a
    root-owned sticky one (`/tmp`): refused (exit 2), nothing written there. A link of root's on the way
    is followed (the file is written where it leads)."""
    if not AS_ROOT:
        pytest.skip("the attack is on a run as root")
    python, _site, _secret = verified
    root_only = open_dir / "root-only"
    root_only.mkdir(mode=0o700)
    users = open_dir / ("evil" if where == "in-the-users-directory" else "sticky")
    users.mkdir()
    if where == "in-the-users-directory":
        os.chown(users, NOBODY, NOBODY)
    else:
        users.chmod(0o1777)
    (users / "link").symlink_to(root_only, target_is_directory=True)
    os.lchown(users / "link", NOBODY, NOBODY)
    base = ("sicext", "--verify-only", "--python", str(python), "--wheel", str(wheels["sicext-1"]))
    patch = run(*base, "--diff", "--save-patch", str(users / "link" / "p.diff"))
    assert patch.code == 2 and "refusing to write" in patch.stderr, patch.stdout + patch.stderr
    assert "owned by uid 65534" in patch.stderr and "hint:" in patch.stderr
    metrics = run(*base, "--metrics-file", str(users / "link" / "m.prom"))
    assert metrics.code == 2 and "owned by uid 65534" in metrics.stderr, metrics.stderr
    assert list(root_only.iterdir()) == []
    (open_dir / "roots-link").symlink_to(root_only, target_is_directory=True)
    ok = run(*base, "--diff", "--save-patch", str(open_dir / "roots-link" / "p.diff"))
    assert ok.code == 0 and (root_only / "p.diff").is_file(), ok.stdout + ok.stderr


def test_diff_does_not_follow_a_symlinked_installed_file(
    verified: tuple[Path, Path, Path], wheels: Wheelhouse, tmp_path: Path
) -> None:
    python, site, secret = verified
    served = site / "sicext" / "serve.py"
    served.unlink()
    served.symlink_to(secret)
    patch = tmp_path / "out.patch"
    result = run(
        "sicext", "--verify-only", "--python", str(python), "--wheel", str(wheels["sicext-1"]),
        "--diff", "--save-patch", str(patch), "--json",
    )  # fmt: skip
    assert result.code == 1, result.stdout + result.stderr
    assert "TOP-SECRET" not in result.stdout + result.stderr
    assert "TOP-SECRET" not in (patch.read_text() if patch.exists() else "")
    finding = next(f for f in result.json["data"]["findings"] if f["path"] == str(served))
    assert (finding["kind"], finding["detail"]) == ("modified", "no longer a regular file")


def test_a_fifo_in_a_package_is_reported_not_waited_on(
    verified: tuple[Path, Path, Path], wheels: Wheelhouse
) -> None:
    python, site, _secret = verified
    fifos = [site / "sicext" / "serve.py", python.parent / "sicext-serve"]
    for fifo in fifos:
        fifo.unlink()
        os.mkfifo(fifo)
    against_wheel = run(
        "sicext", "--verify-only", "--python", str(python), "--wheel", str(wheels["sicext-1"]),
        "--diff", "--json", timeout=60,
    )  # fmt: skip
    against_record = run("sicext", "--verify-only", "--python", str(python), "--json", timeout=60)
    for result, expected in ((against_wheel, fifos[:1]), (against_record, fifos)):  # scripts: generated
        assert result.code == 1, result.stdout + result.stderr
        found = {f["path"]: (f["kind"], f["detail"]) for f in result.json["data"]["findings"]}
        for fifo in expected:
            assert found[str(fifo)] == ("modified", "no longer a regular file")


def test_installed_record_digests_are_checked_with_their_own_algorithm(
    verified: tuple[Path, Path, Path],
) -> None:
    python, site, _secret = verified
    served = site / "sicext" / "serve.py"
    record = next(site.glob("sicext-1.0.dist-info")) / "RECORD"
    lines = record.read_text().splitlines()
    content = served.read_bytes()
    lines = [
        f"sicext/serve.py,sha512={wheelhouse.record_digest(content, 'sha512')},{len(content)}"
        if line.startswith("sicext/serve.py,")
        else line
        for line in lines
    ]
    record.write_text("\n".join(lines) + "\n")
    clean = run("sicext", "--verify-only", "--python", str(python))
    assert clean.code == 0, clean.stdout + clean.stderr
    changed = bytearray(content)
    changed[-2] = ord("#") if changed[-2] != ord("#") else ord(" ")  # same size: only the digest tells
    served.write_bytes(bytes(changed))
    drift = run("sicext", "--verify-only", "--python", str(python), "--json")
    assert drift.code == 1, drift.stdout + drift.stderr
    finding = next(f for f in drift.json["data"]["findings"] if f["path"] == str(served))
    assert (finding["kind"], finding["detail"]) == ("modified", "sha512 differs")


# --- the pure checks behind the rows ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("sicext/serve.py", None),
        ("sicext-2.0.data/scripts/tool", None),
        ("sicext-2.0.data/data/share/x", None),
        ("../../../bin/python", "has an empty, '.' or '..' component"),
        ("sicext/./x", "has an empty, '.' or '..' component"),
        ("sicext//x", "has an empty, '.' or '..' component"),
        ("/etc/x", "is not a plain relative path"),
        ("sicext\\..\\..\\x", "is not a plain relative path"),
        ("sicext/x\0", "is not a plain relative path"),
        ("sicext-2.0.data/scripts", "is not inside a scheme directory"),
        ("sicext-2.0.data/lib/x", "is not inside a scheme directory"),
    ],
)
def test_member_names(name: str, problem: str | None) -> None:
    from safeinstall.env.wheel import member_problem

    found = member_problem(name, "sicext-2.0.data")
    assert (found is None) if problem is None else (found is not None and found.startswith(problem))


def test_paths_below_a_tree_and_copies_of_wheels(tmp_path: Path) -> None:
    from safeinstall.env.wheelcopy import is_wheel_copy
    from safeinstall.system.safefs import Tree, parts_of

    assert parts_of("a/b/c") == ("a", "b", "c")
    for bad in ("", "/a", "a/../b", "a/./b", "a//b", "a\0b"):
        with pytest.raises(ValueError):
            parts_of(bad)
    (tmp_path / "real").mkdir()
    (tmp_path / "real" / "f").write_text("x")
    (tmp_path / "link").symlink_to(tmp_path / "real")
    with Tree(tmp_path) as tree:
        assert tree.relative(tmp_path / "real" / ".." / "real" / "f") == "real/f"
        assert tree.relative(tmp_path.parent / "x") is None and tree.relative(tmp_path) is None
        assert tree.files_below("real") == ["real/f"] and tree.files_below("link") == []
        assert tree.lstat("link/f") is None and not tree.unlink("link/f")  # never through the link
        assert tree.sha256("link/f") is None and tree.readlink("link") == str(tmp_path / "real")
    assert (tmp_path / "real" / "f").read_text() == "x"
    envdir = tmp_path / "env"
    assert is_wheel_copy(envdir / "wheels" / "1-ab" / "x-1.0-py3-none-any.whl", envdir)
    assert not is_wheel_copy(tmp_path / "downloads" / "x-1.0-py3-none-any.whl", envdir)
    assert not is_wheel_copy(envdir / "wheels" / ".." / "journal.json", envdir)
    assert not is_wheel_copy(envdir / "wheels" / "x-1.0-py3-none-any.whl", envdir)


def test_a_copy_of_the_wheel_is_readable_only_by_the_account_uv_runs_as(
    tmp_path: Path, open_dir: Path
) -> None:
    """The copy's path is in uv's command line (any user reads it in ``/proc``): only the account uv
    runs as may read the copy, not another member of its group (``nogroup`` is shared). Another
    account's environment: an ACL gives that uid read, the group nothing (the dry-run's temporary copy
    too); root's own: 0600 root:root. Checked as those users, not by mode."""
    from safeinstall.env.environment import Account
    from safeinstall.env.wheelcopy import copy_wheel, temporary_copy

    source = tmp_path / "downloads" / "x-1.0-py3-none-any.whl"
    source.parent.mkdir()
    source.write_bytes(b"PK wheel bytes")
    envdir = open_dir / "env"  # as a state directory of another account's environment: 0711
    envdir.mkdir(mode=0o711)
    if not _acls_supported(envdir):  # then the copy is the account's group's (the next test)
        pytest.skip("no POSIX ACLs on this filesystem")
    account = Account(NOBODY, NOBODY, "/")

    def access(copy: Path) -> tuple[int, int, int, bool, bool, bool]:
        info = os.stat(copy)
        readers = []
        # the account; another account in the account's group; another account in root's group
        for uid, gid in ((NOBODY, NOBODY), (OTHER, NOBODY), (OTHER, 0)):
            try:
                subprocess.run(
                    [
                        "setpriv",
                        f"--reuid={uid}",
                        f"--regid={gid}",
                        "--clear-groups",
                        "head",
                        "-c1",
                        str(copy),
                    ],
                    check=True,
                    capture_output=True,
                )
                readers.append(True)
            except subprocess.CalledProcessError:
                readers.append(False)
        account_reads, its_group_reads, roots_group_reads = readers
        return (
            stat.S_IMODE(info.st_mode),
            info.st_uid,
            info.st_gid,
            account_reads,
            its_group_reads,
            roots_group_reads,
        )

    assert access(copy_wheel(source, envdir, account)) == (0o640, 0, 0, True, False, False)
    assert access(copy_wheel(source, envdir, None)) == (0o600, 0, 0, False, False, False)
    with temporary_copy(source, account) as copy:
        assert copy.read_bytes() == source.read_bytes()
        assert access(copy) == (0o640, 0, 0, True, False, False)


def test_without_acls_the_copy_of_the_wheel_is_the_accounts_group_and_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A filesystem without ACLs (ramfs: EOPNOTSUPP): the copy is made again from the start of the
    wheel, 0640 with the account's group; nothing else is left."""
    from safeinstall.env.environment import Account
    from safeinstall.env.wheelcopy import copy_wheel

    source = tmp_path / "x-1.0-py3-none-any.whl"
    source.write_bytes(os.urandom(3 << 20))
    envdir = tmp_path / "env"
    envdir.mkdir()

    def no_acls(*_args: object, **_kwargs: object) -> None:
        raise OSError(errno.EOPNOTSUPP, "Operation not supported")

    monkeypatch.setattr(os, "setxattr", no_acls)
    copy = copy_wheel(source, envdir, Account(NOBODY, NOBODY, "/"))
    monkeypatch.undo()
    info = os.stat(copy)
    assert (stat.S_IMODE(info.st_mode), info.st_gid) == (0o640, NOBODY)
    assert copy.read_bytes() == source.read_bytes()
    assert os.listdir(copy.parent) == [copy.name]


def test_the_acl_of_a_copy_of_the_wheel_names_only_the_account() -> None:
    """Pure: ``u::rw-,u:UID:r--,g::---,m::r--,o::---`` as the kernel's xattr bytes (read back by
    ``acl_writers``, which finds no writer in it); without ACLs the account's group reads it."""
    from safeinstall.env.environment import Account
    from safeinstall.env.wheelcopy import copy_access
    from safeinstall.system.safefs import acl_writers, reader_acl

    raw = reader_acl(NOBODY)
    assert raw.hex() == (
        "02000000" + "01000600ffffffff" + "02000400feff0000" + "04000000ffffffff" + "10000400ffffffff"
        "20000000ffffffff"
    )
    assert acl_writers(raw) == (set(), set())
    account = Account(NOBODY, NOBODY, "/")
    assert copy_access(account, 0, 0) == (0o640, (0, 0), raw)
    assert copy_access(account, 0, 0, acls=False) == (0o640, (0, NOBODY), None)
    assert copy_access(None, 0, 0) == (0o600, (0, 0), None)


# --- metadata files of the environment ---------------------------------------------------------------


def test_an_installed_distributions_metadata_is_never_read_through_a_fifo_a_symlink_or_whole(
    open_dir: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """Row: the environment's owner (uid 65534) makes another distribution's METADATA a FIFO (reading it
    would hang every run, and a rollback while the services are down), its RECORD a symlink to a file
    only root may read, and a third one's RECORD larger than any real one: `--verify-only --all`
    finishes, reads none of them, and reports those distributions as damaged. (A symlink to a file the
    owner may read is followed: uv's `--link-mode symlink` links metadata into its cache.)"""
    if not AS_ROOT:
        pytest.skip("the attack is on a run as root")
    shared = shared_interpreter_or_skip()
    venv = wheelhouse.make_venv(open_dir / "venv", shared)
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    site = wheelhouse.site_packages(venv)
    fifo_dist = site / "fifo_meta-1.0.dist-info"
    fifo_dist.mkdir()
    os.mkfifo(fifo_dist / "METADATA")
    (fifo_dist / "RECORD").write_text("")
    secret = tmp_path / "secret"
    secret.write_text("secretline.py,sha256=AAAA,1\n")
    secret.chmod(0o600)
    link_dist = site / "link_record-1.0.dist-info"
    link_dist.mkdir()
    (link_dist / "METADATA").write_text("Metadata-Version: 2.1\nName: link-record\nVersion: 1.0\n")
    (link_dist / "RECORD").symlink_to(secret)
    huge_dist = site / "huge_record-1.0.dist-info"
    huge_dist.mkdir()
    (huge_dist / "METADATA").write_text("Metadata-Version: 2.1\nName: huge-record\nVersion: 1.0\n")
    with open(huge_dist / "RECORD", "wb") as handle:
        handle.truncate((64 << 20) + 1)  # sparse: one byte more than the limit
    chown_tree(open_dir / "venv", NOBODY)
    state = open_dir / "state"
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(state)}
    result = run("--verify-only", "--all", "--python", str(venv), "--json", env=environ, timeout=120)
    assert result.code in (0, 1), result.stdout + result.stderr
    assert "secretline" not in result.stdout + result.stderr
    assert "sipure" in {d["name"] for d in result.json["data"]["distributions"]}


def test_a_directory_above_the_prefix_swapped_for_a_symlink_leads_nowhere(
    open_dir: Path, wheels: Wheelhouse
) -> None:
    """Row: the service account owns a directory above the prefix (its home holds the venv). After the
    backup it swaps that directory for a symlink to where another, root-owned environment of the same
    layout lives. The restore then refuses the prefix (it is walked from / without following a
    symlink): nothing is written into the other environment."""
    if not AS_ROOT:
        pytest.skip("the attack is on a run as root")
    shared = shared_interpreter_or_skip()
    home = open_dir / "home"
    (home / "envs").mkdir(parents=True)
    python = wheelhouse.make_venv(home / "envs" / "app", shared)
    wheelhouse.uv_install(python, wheels["sipure-1"])
    victim_python = wheelhouse.make_venv(open_dir / "victim" / "app")
    wheelhouse.uv_install(victim_python, wheels["sipure-2"])
    victim_site = wheelhouse.site_packages(victim_python)
    before = {p: p.read_bytes() for p in sorted((victim_site / "sipure").rglob("*.py"))}
    os.lchown(home, NOBODY, NOBODY)  # the account owns its home, not the venv itself

    from safeinstall.env.distributions import find_distribution, find_distributions
    from safeinstall.env.environment import inspect_environment
    from safeinstall.errors import SafeInstallError
    from safeinstall.store.backup import create_backup, restore_backup

    env = inspect_environment(python)
    backup = create_backup(
        env,
        [find_distribution(env, "sipure", find_distributions(env))],
        open_dir / "state" / "b1",
        (),
        installed=find_distributions(env),
    )
    as_nobody("sh", "-c", f"cd {home} && mv envs envs.real && ln -s {open_dir / 'victim'} envs")
    with pytest.raises(SafeInstallError, match=f"{home / 'envs'} is a symlink or not a directory"):
        restore_backup(backup, env, remove=[])
    assert {p: p.read_bytes() for p in sorted((victim_site / "sipure").rglob("*.py"))} == before
    assert all(p.stat().st_uid == 0 for p in before)


# --- who steers the environment ---------------------------------------------------------------------


def _root_venv_with_pth(base: Path, wheels: Wheelhouse) -> tuple[Path, Path, Path]:
    """A venv made by root (interpreter, bin/, pyvenv.cfg root's) with sipure 1.0, and a .pth file that
    appends the uid it runs as to a file anyone may write; (python, site, uids file)."""
    shared = shared_interpreter_or_skip()
    python = wheelhouse.make_venv(base / "venv", shared)
    wheelhouse.uv_install(python, wheels["sipure-1"])
    site = wheelhouse.site_packages(python)
    uids = base / "pth-uids"
    uids.touch()
    uids.chmod(0o666)
    (site / "zz-uids.pth").write_text(f"import os; open({str(uids)!r}, 'a').write('%d\\n' % os.getuid())\n")
    return python, site, uids


def _dry_run(python: Path, wheels: Wheelhouse, state: Path) -> Result:
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(state)}
    args = ("sipure", "--wheel", str(wheels["sipure-2"]), "--python", str(python), "--dry-run", "--json")
    return run(*args, env=environ, timeout=120)


@pytest.mark.parametrize("handed", ["site-packages", "site-packages-and-bin"])
def test_a_site_packages_handed_to_an_account_makes_the_environment_that_accounts(
    open_dir: Path, wheels: Wheelhouse, handed: str
) -> None:
    """Row: root made the venv, then gave its site-packages (and maybe bin/) to the service account, a
    common setup. The account's .pth files would run as root in uv: the environment is that account's,
    and uv runs as it; where the account cannot write all the install writes (bin/ still root's), the
    run refuses at preflight. Either way nothing of the environment runs as root."""
    if not AS_ROOT:
        pytest.skip("the attack is on a run as root")
    python, site, uids = _root_venv_with_pth(open_dir, wheels)
    chown_tree(site, NOBODY)
    if handed == "site-packages-and-bin":
        chown_tree(python.parent, NOBODY)
    result = _dry_run(python, wheels, open_dir / "state")
    ran = set(uids.read_text().split())
    assert ran == {str(NOBODY)}, f"the .pth ran as {ran}"
    assert any("belongs to uid 65534" in w for w in result.json["data"]["warnings"])
    if handed == "site-packages":
        assert result.code == 2 and "not writable by uid 65534" in result.stdout
    else:
        assert result.code == 0, result.stdout + result.stderr


def test_an_account_that_owns_a_directory_above_the_prefix_steers_the_environment(
    open_dir: Path, wheels: Wheelhouse
) -> None:
    """Row: root made the venv inside a directory the service account owns: the account can rename it
    away and put its own in its place between the probe and uv's start. So it is that account's: uv
    runs as the account (which cannot write root's files: the run refuses, nothing runs as root)."""
    if not AS_ROOT:
        pytest.skip("the attack is on a run as root")
    home = open_dir / "home"
    home.mkdir()
    python, _site, uids = _root_venv_with_pth(home, wheels)
    os.lchown(home, NOBODY, NOBODY)
    result = _dry_run(python, wheels, open_dir / "state")
    assert "0" not in uids.read_text().split(), "the .pth ran as root"
    assert result.code == 2, result.stdout + result.stderr
    assert "not writable" in result.stdout + result.stderr


def test_a_site_packages_others_may_write_is_refused(open_dir: Path, wheels: Wheelhouse) -> None:
    """Row: anyone may add a .pth file to a world-writable site-packages: refused before uv runs."""
    if not AS_ROOT:
        pytest.skip("the attack is on a run as root")
    python, site, uids = _root_venv_with_pth(open_dir, wheels)
    site.chmod(0o777)
    result = _dry_run(python, wheels, open_dir / "state")
    assert result.code == 2, result.stdout + result.stderr
    assert "may be written by every user" in result.stdout + result.stderr
    assert uids.read_text() == ""


def _acls_supported(directory: Path) -> bool:
    """Whether a file in ``directory`` takes a POSIX ACL (tmpfs and ext4 do; ramfs does not)."""
    probe = directory / ".acl-probe"
    probe.write_bytes(b"")
    try:  # u::rw- g::--- o::---: the file's own mode as an ACL
        os.setxattr(probe, "system.posix_acl_access", _acl([(1, 6, 0), (4, 0, 0), (32, 0, 0)]))
    except OSError as exc:  # what safeinstall falls back on (wheelcopy); anything else is a failure
        if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
            return False
        raise
    finally:
        probe.unlink()
    return True


def _acl(entries: list[tuple[int, int, int]]) -> bytes:
    """A ``system.posix_acl_access`` value: version 2, then (tag, permissions, id) entries."""
    import struct

    return struct.pack("<I", 2) + b"".join(struct.pack("<HHI", t, p, i) for t, p, i in entries)


@pytest.mark.parametrize(
    "how",
    [
        "pth-path-line",
        "imported-package",
        "imported-module",
        "imported-pycache",
        "imported-in-turn",
        "acl",
        "interpreter-link",
    ],
)
def test_whoever_controls_what_site_or_the_interpreter_runs_is_the_environments_account(
    open_dir: Path, wheels: Wheelhouse, how: str
) -> None:
    """Rows: code that runs when uv starts the interpreter (with `site`) or when the probe does, which
    the service account controls although every file of the venv itself is root's: a directory a
    root-owned `.pth` file adds (an editable install's source tree) holding `sitecustomize.py`; a
    package that a `.pth` import line loads, or only a module deep in it (`zzpkg/sub.py`) or a
    compiled file in its `__pycache__` (issue 35); another root-owned package that the imported one
    imports in turn, one of whose modules the account owns (the attacker review: no reading of the
    `.pth` lines can tell it); write access granted by an access ACL; a link on the way to the
    interpreter. The account is the environment's: nothing of it runs as root."""
    if not AS_ROOT:
        pytest.skip("the attack is on a run as root")
    shared = shared_interpreter_or_skip()
    uids = open_dir / "uids"
    uids.touch()
    uids.chmod(0o666)
    record = f"import os; open({str(uids)!r}, 'a').write('%d\\n' % os.getuid())\n"
    base = shared
    if how == "interpreter-link":
        own = open_dir / "alice-bin"
        own.mkdir()
        (own / "python3").symlink_to(shared)
        chown_tree(own, NOBODY)
        base = str(own / "python3")
    python = wheelhouse.make_venv(open_dir / "venv", base)
    wheelhouse.uv_install(python, wheels["sipure-1"])
    site = wheelhouse.site_packages(python)
    if how == "pth-path-line":
        source = open_dir / "src"
        source.mkdir()
        (source / "sitecustomize.py").write_text(record)
        chown_tree(source, NOBODY)
        (site / "__editable__.app-0.1.pth").write_text(f"{source}\n")
    elif how == "imported-package":
        (site / "hack").mkdir()
        (site / "hack" / "__init__.py").write_text(record)
        chown_tree(site / "hack", NOBODY)
        (site / "zz-hack.pth").write_text("import hack\n")
    elif how == "imported-module":  # root's package and .pth; one module deep in it the account's
        (site / "zzpkg" / "inner").mkdir(parents=True)
        (site / "zzpkg" / "__init__.py").write_text("from zzpkg.inner import sub\n")
        (site / "zzpkg" / "inner" / "__init__.py").write_text("")
        (site / "zzpkg" / "inner" / "sub.py").write_text(record)
        os.chown(site / "zzpkg" / "inner" / "sub.py", NOBODY, NOBODY)
        (site / "zz-pkg.pth").write_text("import zzpkg\n")
    elif how == "imported-pycache":  # root's source; its compiled file (what runs) the account's
        (site / "zzpkg").mkdir()
        (site / "zzpkg" / "__init__.py").write_text(record)
        compiled = py_compile.compile(str(site / "zzpkg" / "__init__.py"), doraise=True)
        assert compiled is not None
        os.chown(compiled, NOBODY, NOBODY)
        (site / "zz-pkg.pth").write_text("import zzpkg\n")
    elif (
        how == "imported-in-turn"
    ):  # root's .pth imports root's foo, which imports bar: bar's module the account's
        (site / "zzfoo").mkdir()
        (site / "zzfoo" / "__init__.py").write_text("import zzbar\n")
        (site / "zzbar").mkdir()
        (site / "zzbar" / "__init__.py").write_text(record)
        os.chown(site / "zzbar" / "__init__.py", NOBODY, NOBODY)
        (site / "zz-foo.pth").write_text("import zzfoo\n")
    elif how == "acl":
        (site / "zz-uids.pth").write_text(record)
        try:  # u::rwx u:65534:rwx g::r-x m::rwx o::r-x
            os.setxattr(
                site,
                "system.posix_acl_access",
                _acl([(1, 7, 0), (2, 7, NOBODY), (4, 5, 0), (16, 7, 0), (32, 5, 0)]),
            )
        except OSError:
            pytest.skip("no POSIX ACLs on this filesystem")
    else:
        (site / "zz-uids.pth").write_text(record)
    result = _dry_run(python, wheels, open_dir / "state")
    ran = set(uids.read_text().split())
    assert "0" not in ran, f"ran as root: {result.stdout}{result.stderr}"
    assert "belongs to uid 65534" in result.stdout + result.stderr, result.stdout + result.stderr


@pytest.mark.parametrize("how", ["link-out", "too-deep"])
def test_a_package_a_pth_line_imports_is_walked_within_bounds_never_out_of_it(
    open_dir: Path, wheels: Wheelhouse, how: str
) -> None:
    """Row (issue 35): a `.pth` import line loads a root-owned package whose tree holds a link to a
    directory elsewhere (where the account's files could be), or is nested past the walk's bound: the
    walk of what `site` may import never follows a link out of the tree nor goes on without end; the
    environment is refused rather than judged root's."""
    if not AS_ROOT:
        pytest.skip("the attack is on a run as root")
    python, site, _uids = _root_venv_with_pth(open_dir, wheels)
    (site / "zzpkg").mkdir()
    (site / "zzpkg" / "__init__.py").write_text("")
    if how == "link-out":
        elsewhere = open_dir / "elsewhere"
        elsewhere.mkdir()
        (elsewhere / "sub.py").write_text("")
        os.chown(elsewhere / "sub.py", NOBODY, NOBODY)
        (site / "zzpkg" / "inner").symlink_to(elsewhere, target_is_directory=True)
    else:
        (site / "zzpkg" / "/".join(["d"] * 70)).mkdir(parents=True)
    (site / "zz-pkg.pth").write_text("import zzpkg\n")
    from safeinstall.env.environment import inspect_environment
    from safeinstall.errors import InterpreterError

    said = "links to the directory" if how == "link-out" else "directories deep"
    with pytest.raises(InterpreterError, match=said):
        inspect_environment(python)


def test_the_walk_of_what_site_may_import_names_the_first_file_by_name(
    open_dir: Path, wheels: Wheelhouse
) -> None:
    """Issue 36: the walk of a package a `.pth` line imports sorts only what it finds (vLLM's 68k
    entries); what it says is as a walk in name order would say: the first of an account's files by
    name, whatever the order the directory lists them in."""
    if not AS_ROOT:
        pytest.skip("the attack is on a run as root")
    python, site, _uids = _root_venv_with_pth(open_dir, wheels)
    package = site / "zzpkg"
    package.mkdir()
    for number in reversed(range(40)):  # the listing's order is the filesystem's, not this one
        made = package / f"f{number:02d}.py"
        made.write_text("")
        os.chown(made, NOBODY, NOBODY)
    (package / "g.py").write_text("")
    os.chown(package / "g.py", NOBODY - 1, NOBODY - 1)
    (site / "zz-pkg.pth").write_text("import zzpkg\n")
    from safeinstall.env.environment import inspect_environment
    from safeinstall.errors import InterpreterError

    with pytest.raises(InterpreterError) as refused:
        inspect_environment(python)
    said = refused.value.message
    assert (
        f"uid {NOBODY} owns {package / 'f00.py'}" in said
        and f"uid {NOBODY - 1} owns {package / 'g.py'}" in said
    )


def test_a_symlinked_site_packages_in_a_directory_the_account_owns_is_the_accounts(
    open_dir: Path, wheels: Wheelhouse
) -> None:
    """Row: the venv's `lib/python3.X/` belongs to the account and its `site-packages` is a symlink to a
    root-owned directory elsewhere in the venv: the account can swap the link for its own directory
    (with a `.pth`) after the probe. The link's directory counts: the environment is the account's.
    (A site-packages that resolves outside the prefix is refused outright.)"""
    if not AS_ROOT:
        pytest.skip("the attack is on a run as root")
    python, site, uids = _root_venv_with_pth(open_dir, wheels)
    moved = open_dir / "venv" / "sp-real"
    site.rename(moved)
    site.symlink_to(moved, target_is_directory=True)
    os.lchown(site.parent, NOBODY, NOBODY)
    from safeinstall.env.environment import inspect_environment

    account = inspect_environment(python).account
    assert account is not None and account.uid == NOBODY
    result = _dry_run(python, wheels, open_dir / "state")
    assert "0" not in set(uids.read_text().split()), result.stdout + result.stderr


def test_a_fifo_pth_file_or_pyvenv_cfg_is_never_waited_on(open_dir: Path, wheels: Wheelhouse) -> None:
    """Row: the account that owns site-packages (or the venv) makes a `.pth` file, or `pyvenv.cfg`, a
    FIFO: root reads neither while it decides who controls the environment (it would wait forever)."""
    if not AS_ROOT:
        pytest.skip("the attack is on a run as root")
    python, site, _uids = _root_venv_with_pth(open_dir, wheels)
    os.mkfifo(site / "zz-fifo.pth")
    chown_tree(site, NOBODY)
    code = (
        "import sys; from pathlib import Path; from safeinstall.env.environment import before_the_probe, "
        "inspect_environment; e = inspect_environment(Path(sys.argv[1])); "
        "print(e.account.uid if e.account else None); "
        "cfg = Path(sys.argv[1]).parent.parent / 'pyvenv.cfg'; cfg.rename(cfg.with_suffix('.was')); "
        "import os; os.mkfifo(cfg); before_the_probe(Path(sys.argv[1]), 0)"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(python)], capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == [str(NOBODY)]


@pytest.mark.parametrize("how", ["many-lines", "inert-lines"])
def test_the_pth_files_are_read_within_bounds_each_file_and_path_once(
    open_dir: Path, wheels: Wheelhouse, how: str
) -> None:
    """Row (the attacker review, session 5): each `.pth` line was a path looked up with every directory
    above it, with no bound in all: one 1 MiB file of 524k lines, 30 s of root's survey; four links to
    it (free to their owner), 165 s. Now a file linked many times is read once, and past 4096 lines
    the environment is refused (what they add cannot be told); a line no path can be (a NUL, over
    PATH_MAX: `site` never adds it) is passed over, never an internal error."""
    if not AS_ROOT:
        pytest.skip("the attack is on a run as root")
    python, site, _uids = _root_venv_with_pth(open_dir, wheels)
    from safeinstall.env.environment import inspect_environment
    from safeinstall.errors import InterpreterError

    first = site / "zz-a0.pth"
    if how == "many-lines":
        first.write_bytes(b"x\n" * (1 << 19))
        for number in range(1, 4):
            os.link(first, site / f"zz-a{number}.pth")
        with pytest.raises(InterpreterError, match="hold more than 4096 lines: what site adds from them"):
            inspect_environment(python)
        return
    first.write_bytes(b"".join(b"zz-added-%d\n" % n for n in range(4000)) + b"a\0b\n" + b"y/" * 2500 + b"\n")
    for number in range(1, 2000):  # 2000 files of 4000 lines: read once
        os.link(first, site / f"zz-a{number}.pth")
    assert inspect_environment(python).account is None  # root's, judged


def test_the_pth_bounds_and_the_directories_above_each_path_looked_at_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `.pth` over 1 MiB (`site` reads it whole; it was passed over unseen) or naming a path more than
    64 directories deep is refused; the directories above thousands of added paths are each looked at
    once (every line looked at all of them again)."""
    from safeinstall.env.environment import _Control, _pth_lines

    site = tmp_path / "site"
    site.mkdir()
    big = site / "big.pth"
    big.write_bytes(b"#" * ((1 << 20) + 1))
    assert "is larger than 1048576 bytes" in (_pth_lines(site).problem or "")
    big.unlink()
    (site / "deep.pth").write_text("/".join(["d"] * 70) + "\n")
    assert "is more than 64 directories deep" in (_pth_lines(site).problem or "")
    (site / "deep.pth").write_text("".join(f"here/p{n}\n" for n in range(3000)))
    (site / "here").mkdir()
    lines = _pth_lines(site)
    assert lines.problem is None and len(lines.paths) == 3000
    looked: list[str] = []
    lstat = os.lstat

    def counted(path: str | os.PathLike[str]) -> os.stat_result:
        looked.append(os.fspath(path))
        return lstat(path)

    monkeypatch.setattr(os, "lstat", counted)  # the standard library's, to count the looks
    control = _Control(os.geteuid())
    for added in lines.paths:
        control.look_up(added, "added by a .pth file")
    assert looked.count(str(site)) == 1 and looked.count("/") == 1
    assert len(looked) < 2 * 3000 + 64


def test_a_directory_pth_lines_name_through_many_links_is_listed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The attacker review (session 5): 4,000 `.pth` lines, each a link to one directory of 20k files,
    had it listed 4,000 times for what `site` may import (60 s of every command). Each directory is
    now listed once, by what it resolves to."""
    from safeinstall.env.environment import Environment, steering

    site, target = tmp_path / "site", tmp_path / "target"
    site.mkdir()
    target.mkdir()
    for number in range(10):
        (target / f"f{number}.py").touch()
    for number in range(1000):
        (site / f"l{number}").symlink_to(target, target_is_directory=True)
    (site / "links.pth").write_text("".join(f"l{number}\n" for number in range(1000)))
    env = Environment(
        python=tmp_path / "bin" / "python",
        executable=tmp_path / "bin" / "python",
        prefix=tmp_path,
        base_prefix=Path("/usr"),
        purelib=site,
        platlib=site,
        scripts=tmp_path / "bin",
        data=tmp_path,
        version=(3, 11, 2),
        implementation="cpython",
        soabi=None,
        platform="linux-x86_64",
    )
    listed: list[str] = []
    listdir = os.listdir

    def counted(path: str | os.PathLike[str] = ".") -> list[str]:
        listed.append(os.path.realpath(path))
        return listdir(path)

    monkeypatch.setattr(os, "listdir", counted)  # the standard library's, to count the listings
    assert steering(env, os.geteuid()).problems == []
    assert listed.count(str(target)) == 1


@pytest.mark.parametrize(
    ("code", "advice"),
    [
        (errno.ENOSPC, "free some space"),
        (errno.EFBIG, "nobody else is writing"),
        (errno.EINVAL, "POSIX ACLs"),
    ],
)
def test_a_failed_copy_of_the_wheel_says_what_to_do_for_its_cause(code: int, advice: str) -> None:
    """A full disk, a wheel that grew while copied, an ACL the filesystem refused (EINVAL on an idmapped
    mount): each hint names its own remedy, not "free some space" for all."""
    from safeinstall.env.wheelcopy import _copy_hint

    assert advice in _copy_hint(OSError(code, os.strerror(code)), Path("/var/lib/safeinstall/env"))


@pytest.mark.parametrize(
    ("text", "names"),
    [
        (
            "[console_scripts]\ntorchrun = torch.distributed.run:main\n[torchrun.logs_specs]\nx = a:b\n",
            ["torchrun"],
        ),
        ("; c\n# d\n[console_scripts] # c\nfoo = a:b\n  continued = no\nbar=c:d\n", ["bar", "foo"]),
        ("[gui_scripts]\ng = a:b\n[console_scripts]\r\nc = a:b\r\n", ["c", "g"]),
        (
            "[console_scripts]\nfoo = a:b\x1cevil = c:d\nname with space = q\n = nameless\nnovalue\n",
            ["foo", "name with space"],
        ),
        ("[console_scripts]\na = x:y\na = z:w\n", ["a"]),
    ],
)
def test_console_scripts_are_read_as_configparser_reads_them(text: str, names: list[str]) -> None:
    """The names of ``[console_scripts]`` and ``[gui_scripts]``: lines split at "\\n" only (not at the
    other characters str.splitlines splits at), comment lines, indented continuation lines skipped."""
    from safeinstall.env.distributions import parse_console_scripts

    assert list(parse_console_scripts(text)) == names


def test_a_huge_or_hostile_entry_points_file_costs_little(venv: Path, wheels: Wheelhouse) -> None:
    """The owner's entry_points.txt: beyond 1 MiB it is not read (no scripts, as for a missing one);
    within it, lines of one "=" each (importlib.metadata built an object for each: 16 MiB took 60 s and
    2.2 GB) leave nothing behind but the scripts' names."""
    from safeinstall.env.distributions import ENTRY_POINTS_LIMIT, find_distribution, find_distributions
    from safeinstall.env.environment import inspect_environment

    wheelhouse.uv_install(venv, wheels["sipure-1"])
    info = next(wheelhouse.site_packages(venv).glob("sipure-*.dist-info"))
    entry_points = info / "entry_points.txt"
    real = entry_points.read_text()
    env = inspect_environment(venv)
    assert find_distribution(env, "sipure", find_distributions(env)).console_scripts == ("sipure",)
    filler = "[x]\n" + "=\n" * ((ENTRY_POINTS_LIMIT - len(real) - 8) // 2)
    entry_points.write_text(filler + real)
    assert len(entry_points.read_bytes()) <= ENTRY_POINTS_LIMIT
    assert find_distribution(env, "sipure", find_distributions(env)).console_scripts == ("sipure",)
    entry_points.write_text(filler + "=" * 64 + "\n" + real)
    assert len(entry_points.read_bytes()) > ENTRY_POINTS_LIMIT
    assert find_distribution(env, "sipure", find_distributions(env)).console_scripts == ()
