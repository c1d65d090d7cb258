"""The command line's one validation, :func:`safeinstall.cli.usage.usage_problem`: pure, from what was
given, before anything is read or changed (the CLI tests run the same lines end to end)."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from safeinstall.cli.usage import Usage, usage_problem
from safeinstall.run.commands.modes import Request
from safeinstall.run.parts.options import Mode, RunOptions


def _usage(*modes: str, **given: Any) -> Usage:
    """A command line as the validation sees it, each value where the CLI puts it (a flag given a
    path: ``True`` stands for one)."""
    own = {
        name: given.pop(name)
        for name in ("given", "uv_args", "verbose", "quiet", "show_version")
        if name in given
    }
    names = {f.name for f in fields(RunOptions)}
    options = RunOptions(**{"package": ""} | {k: v for k, v in given.items() if k in names})
    asked = {("extra_args" if k == "args" else k): v for k, v in given.items() if k not in names}
    return Usage(request=Request(modes=frozenset(map(Mode, modes)), options=options, **asked), **own)


@pytest.mark.parametrize(
    ("usage", "message"),
    [
        (_usage(package="vllm", verbose=1, quiet=1), "-v and -q do not go together"),
        (_usage(show_version=True, given=("show_version", "package"), package="x"), "--version prints"),
        (_usage("--status", "--forget"), "--status and --forget do not go together"),
        (_usage("--dry-run", "--detach", package="x"), "there is nothing to detach"),
        (_usage(package="x", wait=True), "--wait goes with --status"),
        # a new-user review: "--wait and --run go with --status", though --run goes with --undo, --forget
        (_usage("--commit", run="20261202T060000Z-1"), "--run goes with --status --wait, --undo or --forget"),
        (_usage("--dry-run", package="x", metrics_file=True), "--metrics-file goes with"),
        (_usage("--status", wait=True, metrics_file=True), "--metrics-file goes with"),
        (_usage("--recover", package="x"), "--recover takes no PACKAGE"),
        (_usage("--status", run="20261202T060000Z-1"), "--run goes with --status --wait"),
        # issue 44: --forget --run drops one kept backup, of the environment --python names
        (_usage("--forget", run="20261202T060000Z-1"), "--forget --run drops one kept backup"),
        (_usage(package="x", all_=True), "--all goes with --verify-only"),
        (_usage(package="x", diff=True), "--diff and --save-patch go with --verify-only"),
        (_usage(package="x", acknowledge=True), "--acknowledge-wheel-faults goes with --verify-only"),
        (
            _usage("--verify-only", wheel=Path("x-1.0-py3-none-any.whl"), acknowledge=True),
            "--acknowledge-wheel-faults goes with --verify-only, without --wheel",
        ),
        (_usage(package="x", base_wheel=True), "go with --keep-patches"),
        (_usage("--verify-only", package="x", keep_patches=True), "--keep-patches is for the reinstall"),
        (_usage(package="./x-1.0-py3-none-any.whl"), "is a wheel file, not a requirement"),
        (_usage("--verify-only", package="x==1.0"), "give the name without a version"),
        (_usage("--verify-only", package="x", args=("y",)), "unexpected arguments: y"),
        (_usage("--verify-only", package="x", all_=True), "give either a PACKAGE or --all"),
        (_usage("--verify-only"), "no PACKAGE given"),
        (_usage("--verify-only", package="x", diff=True), "compare against a wheel's contents"),
        (
            _usage("--verify-only", all_=True, wheel=Path("x-1.0-py3-none-any.whl")),
            "--wheel checks one package",
        ),
        (_usage(), "no PACKAGE given"),
        # issue 37: a run's options with a mode that runs nothing would do nothing, in silence
        (_usage("--verify-only", package="x", given=("settle",)), "--settle does nothing with --verify-only"),
        (
            _usage("--status", given=("kill_strays", "keep_backups")),
            "--kill-strays, --keep-backups do nothing with --status",
        ),
        (_usage("--recover", given=("gpu_timeout",)), "--gpu-timeout does nothing with --recover"),
        (_usage("--forget", given=("stop_timeout",)), "--stop-timeout does nothing with --forget"),
        (_usage("--status", given=("full",)), "--full does nothing with --status"),
        (_usage("--recover", given=("full",)), "--full does nothing with --recover"),
        (
            _usage("--verify-only", package="x", given=("smoke_skip",)),
            "--smoke-skip does nothing with --verify-only",
        ),
        (
            _usage("--status", given=("smoke", "no_smoke", "smoke_timeout")),
            "--smoke, --no-smoke, --smoke-timeout do nothing with --status",
        ),
        (
            _usage(package="x", given=("no_smoke", "smoke_skip")),
            "--smoke-skip does nothing with --no-smoke",
        ),
        (
            _usage(package="x", given=("smoke", "smoke_timeout", "no_smoke")),
            "--smoke, --smoke-timeout do nothing with --no-smoke",
        ),
        (_usage(wheel=Path("not-a-wheel.zip")), "no PACKAGE given"),
        # a new-user review: it bounds the wait for a health URL, and without one did nothing in silence
        (_usage(package="x", given=("health_timeout",)), "--health-timeout bounds the wait for --health-url"),
        (_usage("--dry-run", package="x", given=("health_timeout",)), "without a URL it does nothing"),
        (_usage("--commit", given=("commit_", "health_timeout")), "without a URL it does nothing"),
        (
            _usage(package="vllm", args=("torch", "-i", "URL"), uv_args=("-i", "URL")),
            "unexpected arguments: torch",
        ),
    ],
)
def test_each_problem_is_said(usage: Usage, message: str) -> None:
    problem = usage_problem(usage)
    assert problem is not None and message in problem.message, (problem, message)


@pytest.mark.parametrize(
    "usage",
    [
        _usage(show_version=True, given=("show_version",)),
        _usage(package="vllm"),
        _usage(wheel=Path("vllm-0.16.0-cp38-abi3-manylinux_2_28_x86_64.whl")),  # the wheel names it
        _usage(package="vllm", args=("-i", "URL"), uv_args=("-i", "URL")),
        _usage("--verify-only", all_=True),
        _usage("--verify-only", all_=True, given=("full",)),
        _usage("--verify-only", all_=True, acknowledge=True),
        _usage("--verify-only", wheel=Path("x-1.0-py3-none-any.whl")),  # the wheel names the package
        _usage("--status", wait=True, run="20261202T060000Z-1"),
        _usage("--verify-only", package="vllm", metrics_file=True),
        _usage("--undo", run="20261202T060000Z-1"),
        _usage("--forget", run="20261202T060000Z-1", given=("forget_", "python", "run")),
        # a run's options with a run, its dry run, its undo; --user and --yes with any mode
        _usage(package="x", given=("settle", "keep_backups", "gpu_timeout", "kill_strays")),
        _usage("--dry-run", package="x", given=("settle", "keep_backups", "gpu_timeout", "kill_strays")),
        _usage("--undo", given=("settle", "stop_timeout")),
        _usage("--verify-only", package="x", given=("user", "yes")),
        _usage("--recover", given=("user", "yes")),
        # --health-timeout with a URL: given, from SAFEINSTALL_HEALTH_URL, a detached run's private file
        _usage(package="x", health_url="http://127.0.0.1/", given=("health_url", "health_timeout")),
        _usage(package="x", health_url="http://127.0.0.1/", given=("health_timeout",)),
        _usage(package="x", environ_from=Path("/run/f"), given=("environ_from", "health_timeout")),
    ],
)
def test_a_sensible_command_line_has_no_problem(usage: Usage) -> None:
    assert usage_problem(usage) is None


@pytest.mark.parametrize(
    ("usage", "message"),
    [
        (_usage(package="x", prepare=True, keep_patches=True), "does not carry local patches"),
        (_usage("--undo", package="x", prepare=True), "--prepare does not go with --undo"),
        (_usage("--detach", package="x", prepare=True), "--prepare does not go with --detach"),
        (_usage(package="x", prepare=True, given=("health_url",)), "--health-url is for the window"),
        (_usage("--commit", given=("commit_", "no_swap")), "--commit takes only the window's options"),
        (_usage("--commit", package="x", given=("commit_", "package")), "--commit takes no PACKAGE"),
        (_usage("--discard", given=("discard_", "settle")), "--settle does nothing with --discard"),
        (_usage(package="x", given=("prepared_max_age",)), "--prepared-max-age goes with --commit"),
        (_usage("--commit", "--status"), "do not go together"),
    ],
)
def test_prepare_commit_and_discard_take_what_they_use(usage: Usage, message: str) -> None:
    """Issue 47 (docs/prepare.md): each refusal, before anything is read."""
    problem = usage_problem(usage)
    assert problem is not None and message in problem.message, (problem, message)


def test_a_commit_takes_the_windows_options_and_may_detach() -> None:
    window = ("commit_", "detach_", "yes", "user", "settle", "health_url", "stop_timeout", "gpu_timeout")
    assert (
        usage_problem(_usage("--commit", "--detach", given=(*window, "prepared_max_age", "as_json"))) is None
    )
    assert usage_problem(_usage(package="x", prepare=True, given=("package", "prepare", "with_deps"))) is None
