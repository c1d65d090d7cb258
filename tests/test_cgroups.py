from __future__ import annotations

import pytest

from safeinstall.system.cgroups import (
    CgroupPlacement,
    parse_proc_cgroup,
    placement_of_path,
    placement_of_proc_cgroup,
    unescape_component,
)

V2 = "0::/system.slice/vllm.service\n"

V1 = """\
12:pids:/system.slice/vllm.service
11:memory:/system.slice/vllm.service
4:cpu,cpuacct:/system.slice/vllm.service
1:name=systemd:/system.slice/vllm.service
"""

# the hybrid layout seen on the test machine: v1 controllers, name=systemd, and cgroup2
HYBRID = """\
9:name=systemd:/app.slice/t1.service
8:pids:/init.scope
7:blkio:/
4:memory:/process_api/b8756166e9eaa40c55ef52d863b3eea1
1:cpu:/init.scope
0::/app.slice/t1.service
"""

# hybrid, but systemd only maintains the v1 name=systemd tree: the v2 line says "/"
HYBRID_V2_ROOT = """\
1:name=systemd:/system.slice/api.service
0::/
"""


@pytest.mark.parametrize(
    ("text", "path"),
    [
        (V2, "/system.slice/vllm.service"),
        (V1, "/system.slice/vllm.service"),
        (HYBRID, "/app.slice/t1.service"),
        (HYBRID_V2_ROOT, "/system.slice/api.service"),
        ("0::/\n", "/"),
        ("0::/gone.service (deleted)\n", "/gone.service"),
        ("", None),
        ("garbage\n4:memory:/x\n", None),
        ("0::/a:b.slice/c.service\n", "/a:b.slice/c.service"),
    ],
)
def test_parse_proc_cgroup(text: str, path: str | None) -> None:
    assert parse_proc_cgroup(text) == path


def test_v2_line_wins_over_name_systemd_when_they_differ() -> None:
    text = "1:name=systemd:/system.slice/old.service\n0::/system.slice/new.service\n"
    assert parse_proc_cgroup(text) == "/system.slice/new.service"


@pytest.mark.parametrize(
    ("path", "unit", "scope", "uid"),
    [
        ("/system.slice/vllm.service", "vllm.service", None, None),
        # sub-cgroups below a service belong to it
        ("/system.slice/vllm.service/worker", "vllm.service", None, None),
        ("/system.slice/vllm.service/a/b/c", "vllm.service", None, None),
        # a service wins over a scope below it (Delegate=yes services may make any sub-cgroup)
        ("/system.slice/runner.service/job-1.scope", "runner.service", None, None),
        # nested slices
        ("/system.slice/system-inference.slice/vllm@gpu0.service", "vllm@gpu0.service", None, None),
        # the private test manager running at the root (or in its own cgroup)
        ("/app.slice/t1.service", "t1.service", None, None),
        ("/safeinstall-test-1-2/app.slice/t1.service", "t1.service", None, None),
        # user units below user@UID.service
        (
            "/user.slice/user-1000.slice/user@1000.service/app.slice/foo.service",
            "foo.service",
            None,
            1000,
        ),
        (
            "/user.slice/user-1000.slice/user@1000.service/app.slice/foo.service/sub",
            "foo.service",
            None,
            1000,
        ),
        # the user manager itself: the system unit user@UID.service
        ("/user.slice/user-1000.slice/user@1000.service/init.scope", "user@1000.service", None, None),
        ("/user.slice/user-1000.slice/user@1000.service", "user@1000.service", None, None),
        # a scope of the user manager (e.g. a terminal's processes): stray, but inside user 1000's manager
        (
            "/user.slice/user-1000.slice/user@1000.service/app.slice/app-tmux-1234.scope",
            None,
            "app-tmux-1234.scope",
            1000,
        ),
        ("/user.slice/user-1000.slice/user@1000.service/app.slice", None, None, 1000),
        # strays: sessions, containers, init, the root, slices
        ("/user.slice/user-1000.slice/session-3.scope", None, "session-3.scope", None),
        ("/system.slice/docker-0123abcd.scope", None, "docker-0123abcd.scope", None),
        ("/init.scope", None, "init.scope", None),
        ("/", None, None, None),
        ("", None, None, None),
        ("/user.slice", None, None, None),
        ("/machine.slice/libpod-abc.scope/container", None, "libpod-abc.scope", None),
        # template instances and escaped names keep their spelling
        ("/system.slice/system-getty.slice/getty@tty1.service", "getty@tty1.service", None, None),
        ("/system.slice/foo\\x2dbar.service", "foo\\x2dbar.service", None, None),
        ("/system.slice/srv@a\\x2fb.service/x", "srv@a\\x2fb.service", None, None),
        # systemd's cgroup escaping: a leading "_" is dropped
        ("/system.slice/_cpu.service", "cpu.service", None, None),
        # ".service" alone is not a unit
        ("/system.slice/.service", None, None, None),
    ],
)
def test_placement_of_path(path: str, unit: str | None, scope: str | None, uid: int | None) -> None:
    placement = placement_of_path(path)
    assert (placement.path, placement.unit, placement.scope, placement.user_manager_uid) == (
        path,
        unit,
        scope,
        uid,
    )
    assert placement.is_stray is (unit is None)
    if unit is None:
        assert placement.unit_path is None
    else:  # the unit's own cgroup: a prefix of the path that ends with the unit
        assert placement.unit_path is not None and path.startswith(placement.unit_path)
        assert unescape_component(placement.unit_path.rsplit("/", 1)[1]) == unit


@pytest.mark.parametrize(
    ("path", "unit_path"),
    [
        ("/system.slice/vllm.service", "/system.slice/vllm.service"),
        ("/system.slice/vllm.service/worker/a", "/system.slice/vllm.service"),
        ("/system.slice/_cpu.service/x", "/system.slice/_cpu.service"),  # as the kernel spells it
        (
            "/user.slice/user-1000.slice/user@1000.service/app.slice/vllm.service",
            "/user.slice/user-1000.slice/user@1000.service/app.slice/vllm.service",
        ),
        (
            "/user.slice/user-1000.slice/user@1000.service/init.scope",
            "/user.slice/user-1000.slice/user@1000.service",
        ),
        ("/safeinstall-test-1/app.slice/vllm.service/sub", "/safeinstall-test-1/app.slice/vllm.service"),
    ],
)
def test_unit_path_is_the_units_own_cgroup(path: str, unit_path: str) -> None:
    assert placement_of_path(path).unit_path == unit_path


def test_units_of_the_same_name_under_two_managers_are_two_units() -> None:
    system = placement_of_path("/system.slice/vllm.service")
    user = placement_of_path("/user.slice/user-1000.slice/user@1000.service/app.slice/vllm.service")
    assert system.unit == user.unit == "vllm.service"
    assert system.unit_path != user.unit_path


def test_placement_of_proc_cgroup() -> None:
    placement = placement_of_proc_cgroup(HYBRID)
    assert placement.unit == "t1.service"
    assert placement.path == "/app.slice/t1.service"
    assert not placement.is_stray
    assert placement_of_proc_cgroup("").is_stray


def test_deepest_user_manager_wins() -> None:
    # a user manager nested in a container that runs under another user manager
    path = "/user.slice/user-1000.slice/user@1000.service/x.slice/user@2000.service/app.slice/y.service"
    assert placement_of_path(path) == CgroupPlacement(path, "y.service", None, 2000, path)


@pytest.mark.parametrize(
    ("component", "expected"),
    [("_cpu.service", "cpu.service"), ("__x.service", "_x.service"), ("a_b.service", "a_b.service")],
)
def test_unescape_component(component: str, expected: str) -> None:
    assert unescape_component(component) == expected


def test_a_cgroup_name_holding_a_line_separator_is_one_line() -> None:
    """The kernel ends each line with "\\n" only: a cgroup any user may name (its own subtree) holding
    U+2028 or \\x1e is not split into a forged second line that places the process in another unit."""
    forged = "0::/user.slice/user-1000.slice/x\u20280::/system.slice/victim.service\n"
    assert parse_proc_cgroup(forged) == "/user.slice/user-1000.slice/x\u20280::/system.slice/victim.service"
    assert (
        parse_proc_cgroup("0::/a\x1e0::/system.slice/victim.service\n")
        == "/a\x1e0::/system.slice/victim.service"
    )
