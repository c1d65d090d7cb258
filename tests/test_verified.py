"""The verified-inode store (issue 36): a later ``--verify-only`` takes the hash kept for an inode whose
device, number, size, mtime and ctime are unchanged, never a racy one, and ``--full`` reads everything.

The store is written by the tests through the module's own pure ``to_bytes`` (a forged entry, whose
digest is wrong, shows whether the check believed it: a file nobody changed is then ``modified``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from safeinstall.env.hashing import FileState
from safeinstall.env.inodetrust import (
    GRANULARITY_NS,
    MAX_AGE_NS,
    InodeStore,
    VerifiedInode,
    checker,
    entry_problem,
    is_racy,
    keepable,
    updated,
)
from safeinstall.store.inodestore import boot_id, from_bytes, store_file, to_bytes
from safeinstall.store.state import environment_state
from tests import wheelhouse
from tests.beds import NOBODY, WRONG_DIGEST, as_nobody, hashed_state
from tests.beds import forge_kept_hash as _forge
from tests.beds import modified_names as _modified
from tests.beds import verify_sipure as _verify
from tests.clirun import run
from tests.wheelhouse import Wheelhouse

EXT4 = 0xEF53
WRONG = WRONG_DIGEST


def _state(ctime_ns: int, hashed_ns: int, **changes: object) -> FileState:
    state: FileState = hashed_state(ctime_ns, hashed_ns, **changes)
    return state


# ------------------------------------------------------------------ the decisions (pure)


def test_a_hash_taken_within_the_timestamp_granularity_of_the_ctime_is_racy_and_never_kept() -> None:
    now = 10**18
    assert is_racy(now - GRANULARITY_NS + 1, now)  # a write just after the fstat could leave this ctime
    assert is_racy(now + 5, now)  # changed while (or after) it was read
    assert not is_racy(now - GRANULARITY_NS, now)
    assert keepable(_state(now - 1, now), {7: EXT4}) is None
    kept = keepable(_state(now - GRANULARITY_NS, now), {7: EXT4})
    assert kept is not None and kept.digest == "B" * 43
    racy = VerifiedInode(7, 42, 10, now - 1, now - 1, now, "B" * 43)
    assert entry_problem(racy, now + 1) is not None  # read back: not believed either


def test_only_what_was_read_whole_here_on_a_filesystem_with_ctime_is_kept() -> None:
    now = 10**18
    old = now - 10 * GRANULARITY_NS
    assert keepable(_state(old, 0), {7: EXT4}) is None  # proven by identity, or changed while read
    assert keepable(_state(old, now), {7: 0x6969}) is None  # NFS: its ctime is the server's
    # tmpfs: a write through a shared mapping never moves its times (the attacker review, issue 36)
    assert keepable(_state(old, now), {7: 0x01021994}) is None
    assert keepable(_state(old, now), {}) is None  # the filesystem is not known
    assert keepable(_state(old, now, algorithm="sha512"), {7: EXT4}) is None
    assert keepable(_state(old, now, error="EIO"), {7: EXT4}) is None
    # a number past a signed 64-bit field (touch -d 2400, overlayfs xino): not kept, nothing to pack
    assert keepable(_state(old, now, mtime_ns=1 << 63), {7: EXT4}) is None
    assert keepable(_state(old, now, inode=1 << 63), {7: EXT4}) is None
    assert keepable(_state(old, now, mtime_ns=-1), {7: EXT4}) is not None  # dated 1960: kept


def test_a_kept_hash_stands_only_for_the_same_inode_size_mtime_and_ctime() -> None:
    entry = VerifiedInode(7, 42, 10, 111, 222, 10**18, "B" * 43)
    same = _stat(42, 7, 10, 111, 222)
    known = checker(InodeStore("/env", "boot", {(7, 42): entry}))  # what the verification asks
    assert known(same, "sha256") == "B" * 43 and known(same, "sha512") is None
    for other in (_stat(43, 7, 10, 111, 222), _stat(42, 8, 10, 111, 222), _stat(42, 7, 11, 111, 222)):
        assert known(other, "sha256") is None  # another inode, device or size
    assert known(_stat(42, 7, 10, 110, 222), "sha256") is None  # mtime
    assert known(_stat(42, 7, 10, 111, 223), "sha256") is None  # ctime: no account can set it
    # a run's search for local patches: a file root owns and only root may write may have a later
    # ctime (links), not another mtime or size; the drift check holds to all five
    assert known(_stat(42, 7, 10, 111, 223, uid=0), "sha256") is None
    links = checker(InodeStore("/env", "boot", {(7, 42): entry._replace(root_only=1)}), root_links=True)
    assert links(_stat(42, 7, 10, 111, 223, uid=0), "sha256") == "B" * 43
    hashed_as_an_accounts = checker(InodeStore("/env", "boot", {(7, 42): entry}), root_links=True)
    assert hashed_as_an_accounts(_stat(42, 7, 10, 111, 223, uid=0), "sha256") is None
    assert links(_stat(42, 7, 10, 111, 221, uid=0), "sha256") is None  # older than kept: the clock
    assert links(_stat(42, 7, 10, 110, 223, uid=0), "sha256") is None
    assert links(_stat(42, 7, 10, 111, 223, uid=0, mode=0o100664), "sha256") is None  # its group writes
    assert links(_stat(42, 7, 10, 111, 223), "sha256") is None  # not root's


def _stat(
    inode: int, device: int, size: int, mtime_ns: int, ctime_ns: int, uid: int = 1000, mode: int = 0o100644
) -> os.stat_result:
    # mode, ino, dev, nlink, uid, gid, size, atime, mtime, ctime (s); then atime, mtime, ctime (ns)
    return os.stat_result(
        (mode, inode, device, 1, uid, 0, size, 0, 0, 0, 0.0, 0.0, 0.0, 0, mtime_ns, ctime_ns)
    )


def test_entries_age_out_and_the_store_is_bound_to_its_environment_and_boot() -> None:
    now = 10**18
    fresh = VerifiedInode(7, 42, 10, 1, 1, now - 1000, "B" * 43)
    stale = VerifiedInode(7, 43, 10, 1, 1, now - MAX_AGE_NS - 1, "B" * 43)
    store = InodeStore("/env", "boot-a", {(7, 42): fresh, (7, 43): stale})
    assert entry_problem(stale, now) is not None
    assert set(updated(store, [], {}, now).entries) == {(7, 42)}
    raw = to_bytes(store)
    assert set(from_bytes(raw, "/env", "boot-a", now).entries) == {(7, 42)}
    for prefix, boot in (("/other", "boot-a"), ("/env", "boot-b")):
        with pytest.raises(ValueError):
            from_bytes(raw, prefix, boot, now)
    damaged = [raw[:-1], raw.replace(b"B" * 43, b"B" * 42 + b"=", 1), raw + b"x"]
    for bad in damaged:
        with pytest.raises(ValueError):
            from_bytes(bad, "/env", "boot-a", now)


# ------------------------------------------------------------------ --verify-only with the store


@pytest.fixture
def env(venv: Path, wheels: Wheelhouse) -> Path:
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    return venv


def _settled(path: Path) -> int:
    """Once the granularity has passed since ``path``'s ctime: that moment (a hash taken or forged from
    then on is later than the ctime and not racy)."""
    settled = os.lstat(path).st_ctime_ns + GRANULARITY_NS
    while time.time_ns() <= settled:
        time.sleep(0.1)
    return settled


def test_a_kept_hash_is_taken_for_an_unchanged_inode_and_full_reads_it_again(
    env: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    target = wheelhouse.site_packages(env) / "sipure" / "__init__.py"
    hashed = _settled(target)  # the forged hash must be later than its ctime, and not racy
    _forge(state, env, target, hashed)
    assert _modified(_verify(env, state)) == {"__init__.py"}  # believed: the file was not read
    assert _modified(_verify(env, state, "--full")) == set()  # read again: it is the wheel's
    assert _modified(_verify(env, state, "--no-cache")) == set()
    _forge(state, env, target, hashed)  # the full reads kept the right hash: forged again
    os.chmod(target, os.lstat(target).st_mode)  # the same mode: only its ctime moves
    assert _modified(_verify(env, state)) == set()


def test_a_racy_kept_hash_is_not_believed(env: Path, tmp_path: Path) -> None:
    """An entry whose ctime is within the granularity of its hash (a write just after the fstat could
    have left that ctime): the file is read again."""
    state = tmp_path / "state"
    target = wheelhouse.site_packages(env) / "sipure" / "__init__.py"
    _forge(state, env, target, os.lstat(target).st_ctime_ns + 1)
    assert _modified(_verify(env, state)) == set()


def test_a_same_size_edit_with_the_mtime_set_back_is_modified_on_the_second_run(
    env: Path, tmp_path: Path
) -> None:
    state = tmp_path / "state"
    target = wheelhouse.site_packages(env) / "sipure" / "__init__.py"
    _settled(target)  # else the first run's hash is racy and not kept
    assert _modified(_verify(env, state)) == set()
    boot = boot_id()
    assert boot is not None
    prefix = os.path.realpath(env.parent.parent)
    kept = from_bytes(
        store_file(environment_state(state, Path(prefix))).read_bytes(), prefix, boot, time.time_ns()
    )
    info = os.lstat(target)
    assert (info.st_dev, info.st_ino) in kept.entries  # the first run kept its hash
    before = f"@{info.st_mtime_ns // 10**9}.{info.st_mtime_ns % 10**9:09d}"  # to the nanosecond
    content = target.read_bytes()
    target.write_bytes(bytes([content[0] ^ 1]) + content[1:])  # the same size, as the owner would
    subprocess.run(["touch", "-d", before, str(target)], check=True)
    after = os.lstat(target)
    assert (after.st_size, after.st_mtime_ns, after.st_ino) == (info.st_size, info.st_mtime_ns, info.st_ino)
    assert _modified(_verify(env, state)) == {"__init__.py"}


# ------------------------------------------------------------------ beyond content: what rpm -V checks


def test_a_mode_no_installer_gives_is_reported_and_a_symlink_is_never_followed(
    env: Path, tmp_path: Path
) -> None:
    """A listed script its owner cannot execute, a setuid file, a file others may write: ``mode``
    findings (drift); a listed file replaced by a symlink is ``modified``, whatever it points to."""
    state = tmp_path / "state"
    sp = wheelhouse.site_packages(env)
    script = env.parent / "sipure"  # RECORD: ../../../bin/sipure
    assert _kinds(_verify(env, state)) == set()
    script.chmod(0o644)
    (sp / "sipure" / "__init__.py").chmod(0o4755)
    (sp / "sipure" / "data" / "notes.txt").chmod(0o646)
    core = sp / "sipure" / "cli.py"
    target = tmp_path / "cli-copy.py"
    target.write_bytes(core.read_bytes())  # the very bytes: only the symlink differs
    core.unlink()
    core.symlink_to(target)
    doc = _verify(env, state)
    assert doc["exit_code"] == 1
    assert _kinds(doc) == {
        ("mode", "sipure", "mode 0644: a script its owner cannot execute"),
        ("mode", "__init__.py", "mode 4755: setuid or setgid"),
        ("mode", "notes.txt", "mode 0646: writable by others"),
        ("modified", "cli.py", "no longer a regular file"),
    }


def _kinds(doc: dict[str, object]) -> set[tuple[str, str, str]]:
    findings = doc["data"]["findings"]  # type: ignore[index]
    return {(f["kind"], os.path.basename(f["path"]), f["detail"]) for f in findings if f["drift"]}


def test_a_runs_preflight_takes_the_kept_hashes_and_full_reads_everything(
    env: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """The plan's local changes come from the preflight's check, which takes the store's hashes (and the
    backup reuses them): a forged entry shows that it was believed; ``--full`` reads the file."""
    state = tmp_path / "state"
    target = wheelhouse.site_packages(env) / "sipure" / "__init__.py"
    hashed = _settled(target)
    _forge(state, env, target, hashed)
    dry = ["sipure", "--wheel", str(wheels["sipure-2"]), "--python", str(env), "--dry-run", "--json"]
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(state)}
    kept = run(*dry, env=environ)
    assert kept.code == 0, kept.stderr
    assert kept.json["data"]["locally_modified"] == [str(target)]
    full = run(*dry, "--full", env=environ)
    assert full.code == 0, full.stderr
    assert full.json["data"]["locally_modified"] == []


def test_a_store_someone_else_could_have_written_is_not_used_nor_written_over(
    env: Path, tmp_path: Path
) -> None:
    """The store is read as every state file is: one owned by another uid (its forged entry would hide
    an edit) is not used, a note says why, and it is left as it is."""
    state = tmp_path / "state"
    target = wheelhouse.site_packages(env) / "sipure" / "__init__.py"
    hashed = _settled(target)  # else the forged entry would be dropped as from the future
    _forge(state, env, target, hashed)
    planted = next(state.glob("*/inodes.bin"))
    os.chown(planted, 65534, 65534)
    before = planted.read_bytes()
    doc = _verify(env, state)
    assert _modified(doc) == set()
    assert any("verified-inode store was not used" in note for note in doc["data"]["notes"])
    assert planted.read_bytes() == before and os.lstat(planted).st_uid == 65534


def test_a_hash_kept_while_an_account_owned_the_file_is_not_taken_once_root_owns_it(
    open_dir: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """The root-only rule's argument (docs/verify.md) is that only the owner may set a chosen mtime, and
    the owner is root: true only if root owned the inode since the hash. An account's file, hashed by
    ``--verify-only``, edited by that account (same size, mtime set back to the nanosecond), then
    taken over by root (``chown -R root:`` of an environment made root's): the run's preflight must
    read it again, as the drift check does."""
    env = wheelhouse.make_venv(open_dir / "venv")  # below directories the account may enter
    wheelhouse.uv_install(env, wheels["sipure-1"])
    state = tmp_path / "state"
    target = wheelhouse.site_packages(env) / "sipure" / "__init__.py"
    os.chown(target, NOBODY, NOBODY)  # the account's file
    _settled(target)  # else the hash is racy and not kept
    _verify(env, state)
    info = os.lstat(target)
    prefix = os.path.realpath(env.parent.parent)
    boot = boot_id()
    assert boot is not None
    kept = from_bytes(
        store_file(environment_state(state, Path(prefix))).read_bytes(), prefix, boot, time.time_ns()
    )
    assert (info.st_dev, info.st_ino) in kept.entries  # its hash is kept
    before = f"@{info.st_mtime_ns // 10**9}.{info.st_mtime_ns % 10**9:09d}"
    edit = "import sys; p = sys.argv[1]; b = open(p, 'rb').read(); open(p, 'r+b').write(bytes([b[0] ^ 1]))"
    as_nobody(sys.executable, "-c", edit, str(target))  # the owner's edit: the same size
    as_nobody("touch", "-d", before, str(target))  # its mtime set back, as only the owner may
    os.chown(target, 0, 0)  # root takes the environment over
    after = os.lstat(target)
    assert (after.st_size, after.st_mtime_ns, after.st_ino, after.st_uid) == (
        info.st_size,
        info.st_mtime_ns,
        info.st_ino,
        0,
    )
    dry = ["sipure", "--wheel", str(wheels["sipure-2"]), "--python", str(env), "--dry-run", "--json"]
    planned = run(*dry, env={**os.environ, "SAFEINSTALL_STATE_DIR": str(state)})
    assert planned.code == 0, planned.stderr
    assert planned.json["data"]["locally_modified"] == [str(target)]
