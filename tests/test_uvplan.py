"""uv's plan: the command line and the dry-run parse, against the real uv."""

from __future__ import annotations

from pathlib import Path

import pytest

from safeinstall.env.environment import Account
from safeinstall.env.uvplan import (
    UvRequest,
    dry_run,
    elsewhere_option,
    install_command,
    link_mode_for,
    parse_changes,
    prefetch_command,
    same_filesystem,
    unpack_command,
    uv_environment,
    window_command,
)
from safeinstall.errors import PlanError
from tests import wheelhouse
from tests.wheelhouse import Wheelhouse


def test_a_given_wheel_is_unpacked_offline_through_a_throwaway_target_unless_uv_is_told_otherwise() -> None:
    """The unpack beside the fill (safeinstall/run/parts/prefill.py): the wheel alone, offline, into a
    ``--target`` thrown away; none by name, nor where uv's arguments choose the network or a cache."""
    given = UvRequest(Path("/p/bin/python"), "vllm", wheel=Path("/s/vllm.whl"), extra_args=("-q",))
    assert unpack_command(given, "uv", Path("/s/prefetch-1-unpack")) == [
        *("uv", "pip", "install", "--offline", "--python", "/p/bin/python"),
        *("--target", "/s/prefetch-1-unpack", "--no-deps", "--link-mode", "hardlink", "/s/vllm.whl"),
    ]
    assert unpack_command(UvRequest(Path("/p"), "vllm", version_spec="==1"), "uv", Path("/t")) is None
    for chosen in (("--no-cache",), ("--refresh",), ("--cache-dir", "/c"), ("--no-offline",)):
        request = UvRequest(Path("/p"), "vllm", wheel=Path("/s/vllm.whl"), extra_args=chosen)
        assert unpack_command(request, "uv", Path("/t")) is None, chosen


def test_parse_changes() -> None:
    text = """Using Python 3.11.7 environment at: v
Resolved 2 packages in 1ms
Would uninstall 1 package
Would install 2 packages
 - sicext==1.0 (from file:///w/sicext-1.0-cp311-cp311-linux_x86_64.whl)
 + sicext @ file:///w/sicext-2.0-cp311-cp311-linux_x86_64.whl
 + Typing_Extensions==4.12.0
"""
    changes = parse_changes(text)
    assert [(c.action, c.name, c.version) for c in changes] == [
        ("uninstall", "sicext", "1.0"),
        ("install", "sicext", None),
        ("install", "typing-extensions", "4.12.0"),
    ]
    assert changes[0].source == "file:///w/sicext-1.0-cp311-cp311-linux_x86_64.whl"


def test_named_package_only_unless_with_deps() -> None:
    request = UvRequest(python=Path("/v/bin/python"), package="vllm", wheel=Path("/w/vllm.whl"))
    cmd = install_command(request, "uv")
    assert cmd[cmd.index("--reinstall-package") + 1] == "vllm"
    assert "--reinstall" not in cmd and "--force-reinstall" not in cmd
    assert cmd[cmd.index("--link-mode") + 1] == "copy"
    wide = install_command(UvRequest(python=Path("/v/bin/python"), package="vllm", with_deps=True), "uv")
    assert "--reinstall" in wide and "--reinstall-package" not in wide
    again = install_command(
        UvRequest(Path("/p"), "vllm", installed_version="0.9.1", extra_args=("--index-url", "x")), "uv"
    )
    assert again[-3:] == ["--index-url", "x", "vllm==0.9.1"]


def test_hardlinks_only_from_the_runs_own_cache_on_the_prefixs_filesystem(tmp_path: Path) -> None:
    """The install hardlinks from the run's cache when that cache can be on the prefix's filesystem;
    arguments after -- that choose a cache or a link mode leave the run to copy (or to their own link
    mode, given once: uv refuses --link-mode twice)."""
    assert link_mode_for((), same_filesystem=True) == "hardlink"
    assert link_mode_for((), same_filesystem=False) == "copy"
    chosen = (("--cache-dir", "/c"), ("--cache-dir=/c",), ("--no-cache",), ("-n",), ("--link-mode", "clone"))
    for args in chosen:
        assert link_mode_for(args, same_filesystem=True) == "copy", args
    assert same_filesystem(tmp_path / "not" / "yet", tmp_path)
    request = UvRequest(Path("/p"), "vllm", extra_args=("--link-mode", "symlink"), link_mode="copy")
    cmd = install_command(request, "uv")
    assert cmd.count("--link-mode") == 1 and cmd[cmd.index("--link-mode") + 1] == "symlink"
    hard = install_command(UvRequest(Path("/p"), "vllm", link_mode="hardlink"), "uv")
    assert hard[hard.index("--link-mode") + 1] == "hardlink"


def test_the_window_installs_offline_from_the_runs_own_cache_unless_told_otherwise() -> None:
    """--reinstall-package implies --refresh-package in uv: online, the window would download again the
    wheel the prefetch fetched. From the run's own cache (hardlink) the window's install is offline;
    with a cache, a link mode or network options of the caller's it is the plan's command."""
    request = UvRequest(Path("/p"), "vllm", version_spec="==0.33.0", link_mode="hardlink")
    plan = install_command(request, "uv")
    window = window_command(plan, request)
    assert window == ("uv", "pip", "install", "--offline", *plan[3:]) and "--offline" not in plan
    copied = UvRequest(Path("/p"), "vllm", link_mode="copy")
    assert window_command(install_command(copied, "uv"), copied) == tuple(install_command(copied, "uv"))
    for extra in (("--offline",), ("--no-offline",), ("--refresh",), ("--refresh-package", "x"), ("-n",)):
        told = UvRequest(Path("/p"), "vllm", extra_args=extra, link_mode="hardlink")
        assert window_command(install_command(told, "uv"), told) == tuple(install_command(told, "uv")), extra


def test_prefetch_pins_every_new_distribution_of_the_plan() -> None:
    """A nightly that needs a new dependency: the dependency is fetched before the stop as well."""
    request = UvRequest(
        Path("/v/bin/python"), "vllm", wheel=Path("/w/vllm.whl"), extra_args=("--index-url", "x")
    )
    changes = parse_changes(
        " - vllm==0.9.1\n + vllm @ file:///w/vllm.whl\n - torch==2.12.0\n + torch==2.13.0\n"
        " + newdep @ https://example.invalid/newdep-1.0-py3-none-any.whl\n + torch==2.13.0\n"
    )
    cmd = prefetch_command(request, "uv", Path("/scratch"), changes)
    assert cmd[:10] == [
        "uv",
        "pip",
        "install",
        "--python",
        "/v/bin/python",
        "--target",
        "/scratch",
        "--no-deps",
        "--link-mode",  # the scratch copy is thrown away: hardlinked from the run's cache
        "hardlink",
    ]
    assert cmd[10:] == [
        "--index-url",
        "x",
        "/w/vllm.whl",
        "torch==2.13.0",
        "newdep @ https://example.invalid/newdep-1.0-py3-none-any.whl",
    ]
    assert prefetch_command(request, "uv", Path("/scratch"))[-1] == "/w/vllm.whl"
    copying = UvRequest(Path("/p"), "vllm", wheel=Path("/w/vllm.whl"), extra_args=("--link-mode=copy", "-q"))
    assert prefetch_command(copying, "uv", Path("/s"))[-5:] == [
        "--no-deps",
        "--link-mode",
        "hardlink",
        "-q",
        "/w/vllm.whl",
    ]


def test_real_dry_run(venv: Path, wheels: Wheelhouse) -> None:
    wheelhouse.uv_install(venv, wheels["sicext-1"], wheels["sipure-1"])
    plan = dry_run(UvRequest(python=venv, package="sicext", wheel=wheels["sicext-2"]))
    assert plan.affected == ("sicext",)
    assert {c.action for c in plan.changes} == {"uninstall", "install"}
    assert "--dry-run" not in plan.command
    with pytest.raises(PlanError, match="uv cannot resolve"):
        dry_run(UvRequest(python=venv, package="sicext", version_spec="==9.9", extra_args=("--offline",)))


def test_uv_as_the_environments_owner_gets_its_home_and_none_of_roots_directories() -> None:
    caller = {
        "PATH": "/usr/bin",
        "HOME": "/root",
        "XDG_CONFIG_HOME": "/root/.config",
        "XDG_CACHE_HOME": "/root/.cache",
        "TMPDIR": "/root/tmp",
        "VIRTUAL_ENV": "/elsewhere",
        "UV_INDEX_URL": "https://index.example/simple",
        "HTTPS_PROXY": "http://proxy:3128",
        "no_proxy": "localhost",
        "SSL_CERT_FILE": "/etc/ssl/corp.pem",
        "LC_ALL": "C.UTF-8",
        # root's, never the owner's: it can read uv's environment while uv runs
        "AWS_SECRET_ACCESS_KEY": "secret",
        "HF_TOKEN": "hf_secret",
        "SSH_AUTH_SOCK": "/tmp/ssh-root/agent.1",
        "PYTHONPATH": "/root/lib",
        "SAFEINSTALL_STATE_DIR": "/var/lib/safeinstall",
        "UV_PUBLISH_TOKEN": "pypi-secret",
        "UV_PUBLISH_PASSWORD": "pw",
        "UV_GITHUB_TOKEN": "ghp_secret",
        "UV_INSTALLER_GITHUB_BASE_URL": "https://mirror.example",
    }
    owner = Account(65534, 65534, "/nonexistent")
    as_root = uv_environment(caller, Path("/state/uv-cache-1"))
    assert as_root == {
        **{k: v for k, v in caller.items() if k != "VIRTUAL_ENV"},
        "UV_NO_PROGRESS": "1",
        "UV_CACHE_DIR": "/state/uv-cache-1",
    }
    as_owner = uv_environment(caller, Path("/state/uv-cache-1"), owner)
    assert as_owner == {
        "PATH": "/usr/bin",
        "HOME": "/nonexistent",
        "UV_INDEX_URL": "https://index.example/simple",  # the caller's uv settings still apply
        "HTTPS_PROXY": "http://proxy:3128",  # and what the network needs
        "no_proxy": "localhost",
        "SSL_CERT_FILE": "/etc/ssl/corp.pem",
        "LC_ALL": "C.UTF-8",
        "UV_NO_PROGRESS": "1",
        "UV_CACHE_DIR": "/state/uv-cache-1",
    }
    # no run cache (a dry-run): uv's own temporary one, never root's cache nor a home that may not exist
    assert uv_environment(caller, None, owner)["UV_NO_CACHE"] == "1"
    assert "UV_NO_CACHE" not in uv_environment(caller, None)


def test_prefetch_takes_no_deps_once() -> None:
    """``-- --no-deps`` from the operator: the prefetch has it already, and uv refuses it twice."""
    request = UvRequest(
        Path("/v/bin/python"), "sicext", version_spec="==2.0", extra_args=("--no-deps", "--offline")
    )
    cmd = prefetch_command(request, "uv", Path("/scratch"))
    assert cmd.count("--no-deps") == 1 and "--offline" in cmd


@pytest.mark.parametrize(
    ("args", "found"),
    [
        (("--target", "/x"), "--target"),
        (("--offline", "--target=/x"), "--target"),
        (("-t", "/x"), "--target"),
        (("-t/x",), "--target"),
        (("-qt", "/x"), "--target"),
        (("--prefix", "/x"), "--prefix"),
        (("--prefix=/x", "-t", "/y"), "--prefix"),
        (("-r", "t.txt"), None),
        (("-rt.txt",), None),  # clap's -r t.txt: the option that takes a value ends the cluster
        (("--offline", "--no-deps", "-q"), None),
        (("--", "--target"), None),  # after uv's own --: a requirement
        (("--targets",), None),
    ],
)
def test_the_options_that_install_elsewhere_are_found_as_uv_reads_them(
    args: tuple[str, ...], found: str | None
) -> None:
    """A new-user review: ``-- --target X`` let the dry run say the run would proceed (the run's prefetch
    gives its scratch tree that way, and uv takes it once); the preflight now refuses each spelling."""
    assert elsewhere_option(args) == found
