"""The state directory: pure path computation, modes, listing."""

from __future__ import annotations

import os
import stat
from datetime import UTC, datetime
from pathlib import Path

import pytest

from safeinstall.store.state import (
    SYSTEM_STATE_ROOT,
    StateDirError,
    atomic_write,
    check_environment_dir,
    check_trusted,
    ensure_dir,
    ensure_environment_dir,
    environment_key,
    environment_state,
    list_environment_dirs,
    mode_problem,
    new_run_id,
    state_root,
    trust_problem,
)
from safeinstall.system.safefs import others_who_write


def mode_of(path: Path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_state_root_override_wins() -> None:
    environ = {"SAFEINSTALL_STATE_DIR": "/srv/si-state", "XDG_STATE_HOME": "/x", "HOME": "/home/u"}
    assert state_root(environ, 0) == Path("/srv/si-state")
    assert state_root(environ, 1000) == Path("/srv/si-state")


def test_state_root_root_and_users() -> None:
    assert state_root({"HOME": "/root"}, 0) == SYSTEM_STATE_ROOT == Path("/var/lib/safeinstall")
    xdg = {"HOME": "/home/u", "XDG_STATE_HOME": "/home/u/st"}
    assert state_root(xdg, 1000) == Path("/home/u/st/safeinstall")
    assert state_root({"HOME": "/home/u"}, 1000) == Path("/home/u/.local/state/safeinstall")
    # the XDG spec: a relative XDG_STATE_HOME is invalid and ignored
    assert state_root({"HOME": "/home/u", "XDG_STATE_HOME": "rel"}, 1000) == Path(
        "/home/u/.local/state/safeinstall"
    )


def test_environment_key_is_readable_stable_and_distinct() -> None:
    a = environment_key(Path("/opt/svc/venv"))
    b = environment_key(Path("/srv/other/venv"))
    assert a.startswith("venv-") and b.startswith("venv-") and a != b
    assert a == environment_key(Path("/opt/svc/venv"))
    assert len(a.split("-")[-1]) == 12
    assert environment_key(Path("/")).startswith("root-")
    assert environment_key(Path("/opt/.venv")).startswith("venv-")
    assert "/" not in environment_key(Path("/opt/we ird:name"))


def test_environment_state_paths(tmp_path: Path) -> None:
    state = environment_state(tmp_path, Path("/opt/svc/venv"))
    assert state.dir.parent == tmp_path and state.key == state.dir.name
    assert state.lock == state.dir / "lock"
    assert state.journal == state.dir / "journal.json"
    assert state.backup_dir("r1") == state.dir / "backups" / "r1"
    assert state.log_file("r1") == state.dir / "logs" / "r1.log"


def test_new_run_id_sorts_by_time() -> None:
    first = new_run_id(datetime(2026, 11, 30, 3, 12, 1, tzinfo=UTC), 1234)
    assert first == "20261130T031201Z-1234"
    assert first < new_run_id(datetime(2026, 11, 30, 3, 12, 2, tzinfo=UTC), 5)


def test_ensure_dir_creates_private_directories(tmp_path: Path) -> None:
    old = os.umask(0o022)
    try:
        status = ensure_dir(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert status.created and status.warning is None
    assert mode_of(tmp_path / "a" / "b") == 0o700
    again = ensure_dir(tmp_path / "a" / "b")
    assert not again.created and again.old_mode is None


def test_ensure_dir_tightens_a_readable_mode_and_refuses_a_writable_one(tmp_path: Path) -> None:
    loose = tmp_path / "loose"
    loose.mkdir()
    os.chmod(loose, 0o755)
    status = ensure_dir(loose)
    assert status.old_mode == 0o755
    assert status.warning is not None and "0755" in status.warning
    assert mode_of(loose) == 0o700
    os.chmod(loose, 0o777)  # others could have put anything there: never adopted
    with pytest.raises(StateDirError, match="mode 0777: every user may write to it"):
        ensure_dir(loose)
    assert mode_of(loose) == 0o777


def test_ensure_dir_refuses_a_file(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(StateDirError, match="not a directory") as caught:
        ensure_dir(tmp_path / "file")
    assert caught.value.hint


def test_the_dry_run_check_refuses_what_ensure_refuses_and_creates_nothing(tmp_path: Path) -> None:
    fresh = environment_state(tmp_path / "fresh", Path("/venv"))
    check_environment_dir(fresh)  # could be made: no error
    assert not (tmp_path / "fresh").exists()  # and nothing was made
    blocked = environment_state(tmp_path / "root", Path("/venv"))
    ensure_dir(blocked.root)
    blocked.dir.write_text("a file where the environment's directory goes")
    for check in (check_environment_dir, ensure_environment_dir):
        with pytest.raises(
            StateDirError, match=f"refusing to use the state directory {blocked.dir}: it is not"
        ):
            check(blocked)


def test_mode_problem_is_pure() -> None:
    directory = stat.S_IFDIR | 0o700
    assert mode_problem(directory, 0, 0) is None
    assert "owned by uid 1000" in (mode_problem(directory, 1000, 0) or "")
    assert "not a directory" in (mode_problem(stat.S_IFREG | 0o600, 0, 0) or "")


def test_environment_dirs_are_listed_with_their_prefix(tmp_path: Path) -> None:
    root = tmp_path / "state"
    assert list_environment_dirs(root) == []
    one = environment_state(root, Path("/opt/one/venv"))
    two = environment_state(root, Path("/opt/two/venv"))
    for state in (one, two):
        ensure_environment_dir(state)
        ensure_environment_dir(state)  # idempotent
    assert mode_of(root) == 0o700 and mode_of(one.dir) == 0o700 and mode_of(one.backups) == 0o700
    (root / "stray-file").write_text("")
    listed = list_environment_dirs(root)
    assert {(s.dir, s.prefix) for s in listed} == {(one.dir, one.prefix), (two.dir, two.prefix)}


def test_atomic_write_replaces_whole_and_leaves_no_temp(tmp_path: Path) -> None:
    target = tmp_path / "f.json"
    atomic_write(target, b"one")
    atomic_write(target, b"two")
    assert target.read_bytes() == b"two"
    assert mode_of(target) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["f.json"]


def test_trust_problem_is_pure() -> None:
    directory = stat.S_IFDIR
    assert trust_problem(directory | 0o700, 0, 0, parent=False) is None
    assert trust_problem(directory | 0o755, 1000, 1000, parent=True) is None  # the caller's own
    assert trust_problem(directory | 0o755, 0, 1000, parent=True) is None  # root's
    assert "owned by uid 1000" in (trust_problem(directory | 0o700, 1000, 0, parent=False) or "")
    assert "mode 0775" in (trust_problem(directory | 0o775, 0, 0, parent=True) or "")
    assert trust_problem(directory | 0o1777, 0, 0, parent=True) is None  # /tmp
    assert trust_problem(directory | 0o1777, 0, 0, parent=False) is not None  # but not as the state dir
    assert trust_problem(directory | 0o1777, 1000, 0, parent=True) is not None  # a user's sticky dir
    assert "not a directory" in (trust_problem(stat.S_IFLNK | 0o777, 0, 0, parent=False) or "")


def test_one_rule_says_who_else_may_write_for_the_state_and_the_environment() -> None:
    """``others_who_write`` is the rule of both the state directory's trust check and the environment's
    owner check. Everyone, another group and an ACL's groups are someone else for both; the group root
    is root's in an environment (``/usr/local``), never for what root keeps for itself: an account may
    have gid 0, and with an access ACL the group bits are its mask, which named users' writes pass."""
    directory = stat.S_IFDIR
    assert others_who_write(directory | 0o775, 0) is None
    assert others_who_write(directory | 0o775, 0, group_root_is_root=False) == "group 0"
    assert others_who_write(directory | 0o775, 1000) == "group 1000"
    assert others_who_write(directory | 0o757, 0) == "every user"
    assert others_who_write(directory | 0o755, 0, {0, 27}) == "group(s) [27] (its ACL)"
    assert "group 0 may write" in (trust_problem(directory | 0o775, 0, 0, parent=False, gid=0) or "")
    assert "group 1000 may write" in (trust_problem(directory | 0o775, 0, 0, parent=False, gid=1000) or "")


def test_a_state_directory_an_acl_lets_another_user_write_is_refused(tmp_path: Path) -> None:
    """root:root, mode 0770 because an ACL grants uid 65534 write: the group bits are the ACL's mask."""
    if os.geteuid() != 0:
        pytest.skip("needs root")
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    entries = [(0x01, 7, 0xFFFFFFFF), (0x02, 7, 65534), (0x04, 0, 0xFFFFFFFF), (0x10, 7, 0xFFFFFFFF)]
    entries.append((0x20, 0, 0xFFFFFFFF))  # u::rwx,u:65534:rwx,g::---,m::rwx,o::---
    acl = (2).to_bytes(4, "little") + b"".join(
        tag.to_bytes(2, "little") + perm.to_bytes(2, "little") + ident.to_bytes(4, "little")
        for tag, perm, ident in entries
    )
    os.setxattr(state, "system.posix_acl_access", acl)
    assert stat.S_IMODE(os.stat(state).st_mode) & 0o020  # the mask shows as the group's write bit
    with pytest.raises(StateDirError, match="group 0 may write"):
        check_trusted(state)
