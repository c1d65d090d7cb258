"""The command line conventions that uv, pip and pipx users expect: --version, -h, the requirement
argument, usage errors as every other error, shell completion, "did you mean", plain progress."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib.metadata import entry_points, version
from pathlib import Path

import pytest

from safeinstall.scan.plan import unreadable_warning
from safeinstall.scan.processes import ScanProblem
from safeinstall.store.runlog import progress_text
from safeinstall.store.state import ensure_environment_dir, environment_state
from tests import wheelhouse
from tests.beds import Bed
from tests.clirun import run
from tests.wheelhouse import Wheelhouse


@pytest.mark.parametrize("flag", ["--version", "-V"])
def test_version_prints_the_tools_version(flag: str) -> None:
    result = run(flag)
    assert result.code == 0 and result.stdout == f"safeinstall {version('safeinstall')}\n", result.stderr


def test_short_help_and_flags_without_a_value_type() -> None:
    short, long = run("-h"), run("--help")
    assert short.code == 0 and short.stdout == long.stdout
    assert "--user " in short.stdout and "<bool>" not in short.stdout
    assert "REQUIREMENT" in short.stdout and "--detach" in short.stdout
    assert "╭" not in short.stdout  # plain, as uv and pip print it


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sipure", "--no-such-flag"], "error: no such option: --no-such-flag"),
        (["sipure", "--settle"], "error: option '--settle' requires an argument"),
        # a new-user review: a number's option given none said click's words ("is not a valid float")
        (["sipure", "--settle", "soon"], "error: --settle soon: seconds must be a finite number, 0 or more"),
        (
            ["sipure", "--stop-timeout=x"],
            "error: --stop-timeout x: seconds must be a finite number more than 0",
        ),
        (["sipure", "--keep-backups", "2.5"], "error: --keep-backups 2.5: keep a whole number of backups"),
        # it bounds the wait for a health URL: without one it did nothing, in silence
        (["sipure", "--health-timeout", "60"], "error: --health-timeout bounds the wait for --health-url"),
        # uv would have taken it as one more requirement (installing torch too)
        (["sipure", "torch", "--dry-run"], "error: unexpected arguments: torch"),
        (["sipure", "torch", "--dry-run", "--", "--offline"], "error: unexpected arguments: torch"),
    ],
)
def test_a_usage_error_is_one_error_line_and_a_hint(args: list[str], message: str) -> None:
    result = run(*args)
    assert result.code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith(message) and lines[1].startswith("hint: "), lines
    assert "╭" not in result.stderr and "Usage:" not in result.stderr


def test_arguments_after_two_dashes_go_to_uv(venv: Path, wheels: Wheelhouse) -> None:
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    result = run("sipure", "--dry-run", "--python", str(venv), "--", "--offline")
    assert "unexpected arguments" not in result.stderr
    assert "network was disabled" in result.stderr, result.stderr  # uv was given --offline
    after = run("--dry-run", "--python", str(venv), "--", "sipure", "--offline", "--no-cache")
    assert "unexpected arguments" not in after.stderr and "network was disabled" in after.stderr


@pytest.mark.parametrize(
    ("elsewhere", "spelled"),
    [("--target", ["--target", "DIR"]), ("--target", ["-qt", "DIR"]), ("--prefix", ["--prefix=DIR"])],
)
def test_uv_arguments_that_install_elsewhere_are_refused_by_the_run_and_its_dry_run_alike(
    venv: Path, wheels: Wheelhouse, tmp_path: Path, elsewhere: str, spelled: list[str]
) -> None:
    """A new-user review: ``-- --target X`` (the prefetch's own scratch tree is given that way, and uv
    takes it once) let the dry run say the run would proceed (uv's dry run made X), while the run failed
    in its prefetch. Both refuse it now, in the preflight's check of the options, before anything."""
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    state, target = tmp_path / "state", tmp_path / "elsewhere"
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(state)}
    uv_args = [arg.replace("DIR", str(target)) for arg in spelled]
    said = []
    for mode in ("--dry-run", "--yes"):
        args = ("sipure", "--wheel", str(wheels["sipure-2"]), "--python", str(venv), mode, "--", *uv_args)
        result = run(*args, env=environ)
        assert result.code == 2 and "would proceed" not in result.stdout, result.stdout + result.stderr
        said.append(result.stderr)
    assert said[0] == said[1] and said[0].startswith(f"error: uv's {elsewhere} (after --) installs"), said
    assert said[0].splitlines()[1].startswith(f"hint: leave {elsewhere} out of uv's arguments")
    assert not state.exists() and not target.exists()
    assert [d.name for d in wheelhouse.site_packages(venv).glob("sipure-*.dist-info")] == [
        "sipure-1.0.dist-info"
    ]


def test_a_number_options_value_that_is_none_is_said_in_the_options_own_words() -> None:
    """A new-user review: ``--settle abc`` said "invalid value for '--settle': 'abc' is not a valid float"
    and a hint to read --help; now the words and hint of ``--settle nan``, with --json too."""
    said = run("sipure", "--dry-run", "--settle", "abc")
    nan = run("sipure", "--dry-run", "--settle", "nan")
    assert said.code == nan.code == 2, said.stderr + nan.stderr
    assert said.stderr.replace("abc", "nan") == nan.stderr, (said.stderr, nan.stderr)
    error = run("sipure", "--health-timeout", "soon", "--json").json["errors"][0]
    assert error["code"] == "usage" and error["message"].startswith("--health-timeout soon: seconds must")
    assert "give --health-timeout a number of seconds" in error["hint"], error


def test_hints_and_help_name_the_environment_one_way() -> None:
    """A new-user review: hints said ``--python PY``, others ``--python PATH`` or ``--python ENV``, and
    --help ``--python PATH``; each says ``--python PY`` now."""
    import re

    import safeinstall

    spelled = {
        (path.name, word)
        for path in Path(safeinstall.__file__).parent.rglob("*.py")
        for word in re.findall(r"--python[ =]([A-Z]+)\b", path.read_text())
    }
    assert {word for _name, word in spelled} == {"PY"}, sorted(spelled)
    assert "--python PY " in run("--help").stdout
    for args in (["--status", "sipure"], ["sipure", "--all"]):
        hint = run(*args).stderr.splitlines()[-1]
        assert hint.startswith("hint: ") and "[--python PY]" in hint, hint


def test_a_usage_error_with_json_is_the_error_envelope() -> None:
    doc = run("--status", "--no-such-flag", "--json").json
    assert doc["command"] == "status" and doc["status"] == "error" and doc["exit_code"] == 2
    assert doc["errors"][0]["code"] == "usage" and "--no-such-flag" in doc["errors"][0]["message"]


def test_shell_completion() -> None:
    script = run("--show-completion", "bash")
    assert script.code == 0 and "_SAFEINSTALL_COMPLETE=complete_bash" in script.stdout
    env = {"_SAFEINSTALL_COMPLETE": "complete_bash", "COMP_WORDS": "safeinstall --sta", "COMP_CWORD": "1"}
    completed = run(env={**__import__("os").environ, **env})
    assert completed.code == 0 and completed.stdout.split() == ["--status"]


def test_an_unknown_package_suggests_the_closest_installed_names(venv: Path, wheels: Wheelhouse) -> None:
    wheelhouse.uv_install(venv, wheels["sicext-1"], wheels["sipure-1"])
    result = run("sicxet", "--verify-only", "--python", str(venv))
    assert result.code == 2 and "error: sicxet is not installed" in result.stderr
    assert "did you mean sicext?" in result.stderr, result.stderr
    nothing_close = run("torch", "--verify-only", "--python", str(venv))
    assert nothing_close.code == 2 and "did you mean" not in nothing_close.stderr


def test_a_misspelled_package_makes_no_history_entry(venv: Path, wheels: Wheelhouse, tmp_path: Path) -> None:
    """A typo ran nothing: ``--status`` lists no run of it (the error and "did you mean" say it all)."""
    wheelhouse.uv_install(venv, wheels["sicext-1"])
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state")}
    typo = run("sicxet", "--yes", "--python", str(venv), env=environ)
    assert typo.code == 2 and "did you mean sicext?" in typo.stderr, typo.stdout + typo.stderr
    environments = run("--status", "--json", env=environ).json["data"]["environments"]
    assert [r for e in environments for r in e["runs"]] == [], environments


def test_progress_lines_are_human_sizes_and_percentages_never_raw_counters() -> None:
    assert progress_text("backup", 223455895, 699299524, "bytes") == "backup: 213.1 MiB of 666.9 MiB (32%)"
    assert progress_text("waiting for GPU memory (PID 7)", 12.3, 120, "s") == (
        "waiting for GPU memory (PID 7): 12 s of 120 s (10%)"
    )
    assert progress_text("files", 3, None) == "files: 3"


def test_root_is_not_told_to_run_as_root() -> None:
    problems = [ScanProblem(1, "maps", "permission denied"), ScanProblem(1, "fd", "permission denied")]
    as_user = unreadable_warning(problems, as_root=False)
    as_root = unreadable_warning(problems, as_root=True)
    assert as_user is not None and as_root is not None
    assert "PID 1 (maps, fd)" in as_user and "run as root" in as_user
    assert "PID 1 (maps, fd)" in as_root and "run as root" not in as_root and "even to root" in as_root
    assert unreadable_warning([ScanProblem(5, "maps", "vanished")], as_root=True) is None


def test_a_detached_run_gets_exactly_the_callers_options() -> None:
    """The detached unit's command line, parsed by the command line, gives back every option of the
    run: a field added to RunOptions but not passed on fails here."""
    import dataclasses

    from typer.main import get_command

    from safeinstall.cli.app import app
    from safeinstall.cli.usage import Usage, usage_problem
    from safeinstall.errors import UsageError
    from safeinstall.run.commands.modes import run_options
    from safeinstall.run.parts.detach import PrivateInputs, child_arguments
    from safeinstall.run.parts.options import Mode, RunOptions

    common = RunOptions(
        package="vllm",
        python="/srv/venv/bin/python",
        with_deps=True,
        user=True,
        kill_strays=True,
        extra_args=("--index-url", "https://example.com/simple", "--detach", "-h", "--"),
        stop_timeout=12.5,
        gpu_timeout=0.1,
        settle=7.25,
        health_url="http://127.0.0.1:8000/health?probe=--json",
        health_timeout=1e-3,
        no_restart=True,
        prune=True,
        no_swap=True,
        full=True,
        keep_backups=7,
        run_id="20261201T000000Z-42",
        only_loaded=True,
        strict=True,
        keep_patches=True,
        base_wheel=Path("/w/vllm-0.15.0-py3-none-any.whl"),
        drop_conflicting=True,
        accept_record_mismatch=True,
        allow_broken_requirements=True,
        smoke="python -c 'import vllm._C' --detach",
        smoke_timeout=9.5,
        smoke_skip=("numpy.core._umath_tests", "vllm.x"),
    )
    variants = [
        dataclasses.replace(
            common,
            wheel=Path("/w/vllm-0.16.0-py3-none-any.whl"),
            smoke=None,
            no_smoke=True,
            smoke_skip=(),
            smoke_timeout=RunOptions(package="x").smoke_timeout,
        ),
        dataclasses.replace(common, version_spec="<1,>=0.16"),
        dataclasses.replace(common, undo="20261201T000000Z-41"),
    ]
    default = RunOptions(package="x")
    # the environment travels in a file; proc_root is for tests; a detached run is never a --prepare or a
    # --commit (cli/usage refuses both with --detach: docs/prepare.md)
    not_options = {"environ", "proc_root", "prepare", "commit", "prepared_max_age"}
    for field in dataclasses.fields(RunOptions):
        if field.name not in not_options:
            assert any(getattr(v, field.name) != getattr(default, field.name) for v in variants), field.name
    for options in variants:
        assert options.run_id is not None
        args = child_arguments(
            options, Path(options.python or ""), options.run_id, Path("/state/environ.json")
        )
        # what may hold a credential is not on the unit's command line (any user may read it)
        assert not any("127.0.0.1:8000" in a or "example.com" in a for a in args)
        context = get_command(app).make_context("safeinstall", args)
        # the child's command line is one the CLI accepts (--no-smoke took a --smoke-timeout once)
        child = context.command.invoke(context)  # the command line, as the CLI parsed it
        assert isinstance(child, Usage) and (Mode.UNDO in child.request.modes) == bool(options.undo)
        if options.no_smoke:  # (the other variants give each option, valid together or not)
            assert usage_problem(child) is None, usage_problem(child)
        private = PrivateInputs({}, options.health_url, options.extra_args)
        request = child.request
        parsed = run_options(request.options, request.extra_args, private)
        # uv's index options reach uv in its environment, never on a command line (issue 21)
        assert parsed.environ["UV_INDEX_URL"] == "https://example.com/simple"
        uv_args = ("--detach", "-h", "--")
        assert parsed == dataclasses.replace(options, environ=parsed.environ, extra_args=uv_args)
        with pytest.raises(UsageError, match="from its --environ-from file only"):
            run_options(request.options, ["--index-url", "https://elsewhere.example/simple"], private)


def test_a_detached_runs_environment_file_must_be_private_and_ours(tmp_path: Path) -> None:
    """The caller's environment reaches the detached run through a file: taken only when it is a
    regular file of ours, mode 0600, in a directory only we can change; then removed."""
    import os

    from safeinstall.errors import UsageError
    from safeinstall.run.parts.detach import PrivateInputs, take_private, write_private
    from safeinstall.store.state import ensure_environment_dir, environment_state

    state = environment_state(tmp_path / "state", tmp_path / "venv")
    ensure_environment_dir(state)
    given = PrivateInputs(
        {"UV_INDEX_URL": "https://token@example.com/simple"},
        "http://user:pw@127.0.0.1:8000/health",
        ("--extra-index-url", "https://user:token@example.com/simple"),
    )
    path = write_private(state, "20261201T000000Z-1", given)
    assert oct(path.stat().st_mode & 0o777) == "0o600"
    assert take_private(path) == given
    assert not path.exists()
    loose = write_private(state, "20261201T000000Z-2", PrivateInputs({"A": "b"}))
    loose.chmod(0o644)
    link = state.dir / "link.json"
    link.symlink_to(write_private(state, "20261201T000000Z-3", PrivateInputs({"A": "b"})))
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o777)
    shared.chmod(0o777)
    (shared / "environ.json").write_text("{}")
    (shared / "environ.json").chmod(0o600)
    for bad in (loose, link, shared / "environ.json", tmp_path / "missing.json"):
        with pytest.raises(UsageError):
            take_private(bad)
    assert loose.exists() and os.path.lexists(link)  # refused files are left alone


@pytest.mark.parametrize(
    "content",
    [
        b"not json",
        b"[]",
        b'{"health_url": null, "extra_args": []}',
        b'{"environ": {"A": 1}, "health_url": null, "extra_args": []}',
        b'{"environ": {}, "health_url": 8000, "extra_args": []}',
        b'{"environ": {}, "health_url": null}',
        b'{"environ": {}, "health_url": null, "extra_args": ["--index-url", 1]}',
    ],
)
def test_a_detached_runs_environment_file_of_another_shape_is_refused(tmp_path: Path, content: bytes) -> None:
    """A private file of ours whose document is not the one --detach writes: a usage error, no value
    taken from it; a document with every field as written is taken (its health URL may be absent)."""
    from safeinstall.errors import UsageError
    from safeinstall.run.parts.detach import PrivateInputs, take_private
    from safeinstall.store.state import atomic_write, ensure_environment_dir, environment_state

    state = environment_state(tmp_path / "state", tmp_path / "venv")
    ensure_environment_dir(state)
    path = state.dir / "environ-20261201T000000Z-1.json"
    atomic_write(path, content)
    with pytest.raises(UsageError, match="not an environment file written by safeinstall --detach"):
        take_private(path)
    atomic_write(path, b'{"environ": {"A": "b"}, "extra_args": ["-q"]}')
    assert take_private(path) == PrivateInputs({"A": "b"}, None, ("-q",))


@pytest.mark.parametrize(
    "args",
    [
        ["--status", "--forget"],
        ["--status", "--recover"],
        ["--forget", "--recover"],
        ["--status", "--dry-run"],
        ["sipure", "--detach", "--verify-only"],
        ["sipure", "--verify-only", "--dry-run"],
        ["sipure", "--dry-run", "--detach"],
    ],
)
def test_modes_given_together_are_a_usage_error_not_a_silent_choice(args: list[str], tmp_path: Path) -> None:
    """Each of these flags chooses what safeinstall does: two of them are refused before anything (the
    state of a gone environment is not forgotten by --status --forget)."""
    root = tmp_path / "state"
    gone = environment_state(root, tmp_path / "gone")
    ensure_environment_dir(gone)
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(root)}
    result = run(*args, env=environ)
    assert result.code == 2 and result.stdout == "", result.stdout + result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("error: ") and lines[1].startswith("hint: "), lines
    assert gone.dir.is_dir()
    doc = run(*args, "--json", env=environ).json
    assert doc["status"] == "error" and doc["errors"][0]["code"] == "usage" and doc["errors"][0]["hint"]


@pytest.mark.parametrize(
    ("args", "hint"),
    [
        (["--all"], "--verify-only --all"),
        (["sipure", "--all"], "--verify-only --all"),
        (["sipure", "--diff"], "--verify-only --wheel W --diff"),
    ],
)
def test_verify_only_flags_without_verify_only_say_so(args: list[str], hint: str) -> None:
    result = run(*args)
    assert result.code == 2 and "go" in result.stderr and "with --verify-only" in result.stderr
    assert hint in result.stderr.splitlines()[-1] and result.stderr.splitlines()[-1].startswith("hint: ")


@pytest.mark.parametrize(
    "args",
    [
        ["sipure", "--verify-only", "--settle", "30"],
        ["sipure", "--verify-only", "--gpu-timeout", "5"],
        ["--status", "--kill-strays"],
        ["--recover", "--keep-backups", "2"],
    ],
)
def test_a_runs_options_in_a_mode_that_runs_nothing_are_a_usage_error(args: list[str]) -> None:
    """Issue 37: they did nothing, in silence."""
    result = run(*args)
    error, hint = result.stderr.strip().splitlines()
    assert result.code == 2 and result.stdout == "" and "does nothing with --" in error, result.stderr
    assert error.startswith(f"error: {args[-2] if args[-1].isdigit() else args[-1]} ")
    assert hint.startswith("hint: drop ")


def test_no_arguments_is_a_usage_error_with_a_short_usage_on_stderr() -> None:
    """Not the 100-line help: the five commands and the modes, then the error (issue 37)."""
    result = run()
    assert result.code == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert lines[0].startswith("Usage: safeinstall REQUIREMENT") and len(lines) <= 15, result.stderr
    commands = [line.split("  ")[1] for line in lines if line.startswith("  safeinstall ")]
    assert commands == [
        "safeinstall PACKAGE [--wheel W]",
        "safeinstall PACKAGE --dry-run",
        "safeinstall PACKAGE --verify-only",
        "safeinstall --status [--wait]",
        "safeinstall --undo --python PY",
        "safeinstall PACKAGE --prepare",
    ]
    for mode in ("--dry-run", "--detach", "--verify-only", "--recover", "--status", "--undo", "--forget"):
        assert mode in result.stderr
    assert "--settle" not in result.stderr and "safeinstall --help lists every option" in result.stderr
    error, hint = lines[-2:]
    assert error.startswith("error: no REQUIREMENT") and hint.startswith("hint: safeinstall PACKAGE")


def test_help_groups_the_options_by_command() -> None:
    """``--help``: each command's options under its own heading (issue 37)."""
    sections: dict[str, list[str]] = {}
    heading = ""
    for line in run("--help").stdout.splitlines():
        if line and not line.startswith(" ") and line.endswith(":"):
            heading = line[:-1]
        elif line.startswith("  -"):
            sections.setdefault(heading, []).append(line.split()[0].rstrip(","))
    options = {heading: " ".join(flags) for heading, flags in sections.items()}
    assert options["Commands (one at most; none: reinstall)"].split() == [
        "--dry-run",
        "--detach",
        "--verify-only",
        "--recover",
        "--status",
        "--undo",
        "--forget",
        "--commit",
        "--discard",
    ]
    assert options["--verify-only"].split() == [
        "--all",
        "--full",
        "--acknowledge-wheel-faults",
        "--diff",
        "--save-patch",
    ]
    assert options["--status"].split() == ["--wait", "--run"]
    assert "--settle" in options["A run (reinstall, --undo; shown by --dry-run, --detach)"]
    assert options["Local patches (a run)"].split() == [
        "--keep-patches",
        "--base-wheel",
        "--drop-conflicting",
    ]
    assert "--json" in options["Output"] and "-h" in options["Other options"]


def test_help_names_the_argument_without_a_type() -> None:
    text = run("--help").stdout
    assert "<str>" not in text and "REQUIREMENT  The distribution to reinstall" in text


@pytest.mark.parametrize("name", ["nope.whl", "sipure-2.0-py3-none-any.whl", "nope.txt", "x-y.whl"])
@pytest.mark.parametrize("mode", ["reinstall", "dry-run", "verify-only"])
def test_a_missing_wheel_is_no_such_file_whatever_its_name(
    name: str, mode: str, tmp_path: Path, venv: Path
) -> None:
    wheel = tmp_path / "wh" / name
    extra = {"reinstall": ["--yes"], "dry-run": ["--dry-run"], "verify-only": ["--verify-only"]}[mode]
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state")}
    result = run("sipure", "--wheel", str(wheel), "--python", str(venv), *extra, env=environ)
    assert result.code == 2, result.stdout + result.stderr
    first = result.stderr.splitlines()[0]
    assert first.startswith(f"error: cannot read wheel {wheel}: ") and "no such file" in first.lower(), first


def test_waiting_with_no_run_is_an_error_with_a_hint(tmp_path: Path) -> None:
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state")}
    doc = run("--status", "--wait", "--json", env=environ).json
    assert doc["exit_code"] == 2 and "no run to wait for" in doc["errors"][0]["message"]
    assert isinstance(doc["errors"][0]["hint"], str) and doc["errors"][0]["hint"].strip()


_STARTUP_PROBE = """
import sys
sys.argv = ["safeinstall", *sys.argv[1:]]
from safeinstall.cli.app import main
code = 0
try:
    main()
except SystemExit as exit:
    code = exit.code
import gc
print(code, gc.get_freeze_count(), " ".join(sorted(sys.modules)), file=sys.stderr)
"""


def test_verify_only_starts_without_pydantic_or_the_runs_modules(venv: Path, wheels: Wheelhouse) -> None:
    """A verification's time on a package of one large library is mostly start-up: it loads neither
    typer's pydantic validators (typer 0.29) nor what only a run needs (journal, uv, systemd, NVML),
    nor rich's tables when there is nothing to tabulate, nor json (only --json prints it) and the run
    lock's module. At its end every object left is frozen: the collection Python runs at shutdown would
    walk them all."""
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    proc = subprocess.run(
        [sys.executable, "-c", _STARTUP_PROBE, "sipure", "--verify-only", "--python", str(venv)],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    code, frozen, *modules = proc.stderr.strip().splitlines()[-1].split()
    assert int(frozen) > 1000
    assert code == "0" and "sipure 1.0" in proc.stdout and "OK" in proc.stdout, proc.stdout + proc.stderr
    loaded = set(modules)
    assert "safeinstall.env.verify" in loaded
    never = {
        "pydantic",
        "safeinstall.run.steps.reinstall",
        "safeinstall.store.journal",
        "safeinstall.env.uvplan",
    }
    never |= {  # the state directory is read (the verified-inode store, issue 36), not written
        "safeinstall.system.systemd",
        "safeinstall.system.gpus",
        "pynvml",
        "psutil",
    }
    # json: the clean distributions' store (unchanged.json, issue 36) is read and written by the check
    never |= {"safeinstall.system.lock"}
    # a second check's start (issue 46): the anchors read without the backup's module, and the signals'
    # module without concurrent.futures (which loads logging)
    never |= {"safeinstall.store.backup", "concurrent.futures"}
    assert not never & loaded, never & loaded
    assert "rich.console" in loaded and "rich.table" not in loaded


_COLLECTOR_PROBE = """
import gc, sys
off, tracked = set(), []
def hook(event, args):
    if event != "import":
        return
    if not gc.isenabled():
        off.add(args[0])
    elif "safeinstall.cli.app" in sys.modules and not tracked:  # the command runs: the CLI is loaded
        cli = vars(sys.modules["safeinstall.cli.app"])
        tracked.append(any(o is cli for o in gc.get_objects()))  # frozen: in no generation
sys.addaudithook(hook)
sys.argv = ["safeinstall", "--version"]
from safeinstall.__main__ import main
try:
    main()
except SystemExit:
    pass
print(len(off), "safeinstall.cli.app" in off and "typer" in off, gc.isenabled(), tracked, file=sys.stderr)
"""


def test_the_console_script_loads_the_cli_with_the_collector_off_and_freezes_it() -> None:
    """Loading typer, rich and safeinstall makes about 100k objects and no garbage: the console script's
    entry imports them with the cycle collector off, turns it back on, and freezes what they made,
    which no collection walks again (``bench/startup.py`` counts the collections it saves)."""
    (entry,) = (e for e in entry_points(group="console_scripts") if e.name == "safeinstall")
    assert entry.value == "safeinstall.__main__:main"
    proc = subprocess.run(
        [sys.executable, "-c", _COLLECTOR_PROBE], capture_output=True, text=True, timeout=60, check=True
    )
    assert proc.stdout.startswith("safeinstall "), proc.stdout
    imported_off, cli_and_typer_off, enabled_after, tracked = (
        proc.stderr.strip().splitlines()[-1].split(" ", 3)
    )
    assert int(imported_off) > 20 and cli_and_typer_off == "True", proc.stderr
    assert enabled_after == "True" and tracked == "[False]", proc.stderr  # on again; the CLI's objects frozen


def test_a_wrapper_script_as_python_is_refused_with_the_interpreter_it_runs(
    venv: Path, tmp_path: Path
) -> None:
    """A pyenv shim is a script that runs another interpreter: its environment is not the shim's, so it is
    refused, and the hint names what the shim said it runs."""
    shim = tmp_path / "shims" / "python3"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec {venv} "$@"\n')
    shim.chmod(0o755)
    result = run("pip", "--verify-only", "--python", str(shim))
    assert result.code == 2 and f"error: refusing the environment of {shim}" in result.stderr
    executable = os.path.realpath(venv)
    assert "(a pyenv shim) name the interpreter it runs (it said" in result.stderr
    assert any(part in result.stderr for part in (str(venv), executable)), result.stderr


def test_the_options_annotations_are_objects_not_strings() -> None:
    """typer evaluates each option's annotation given as a string at every start (0.015 s of every
    command, before the command does anything): cli.py is written without postponed annotations."""
    import inspect

    from safeinstall.cli import app as cli

    annotations = inspect.get_annotations(cli.main_command)
    assert len(annotations) > 20
    assert not [name for name, annotation in annotations.items() if isinstance(annotation, str)]


def test_a_wheel_path_as_the_requirement_gets_a_hint_and_a_wheel_names_its_package(
    venv: Path, wheels: Wheelhouse
) -> None:
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    given = run(str(wheels["sipure-2"]), "--python", str(venv), "--dry-run")
    assert given.code == 2 and "is a wheel file, not a requirement" in given.stderr
    assert f"safeinstall sipure --wheel {wheels['sipure-2']}" in given.stderr
    named = run("--wheel", str(wheels["sipure-2"]), "--python", str(venv), "--dry-run", "--json")
    assert named.code == 0, named.stdout + named.stderr
    assert named.json["data"]["package"] == "sipure"


@pytest.mark.parametrize("program", ["/bin/ls", "/bin/true"])
def test_a_program_that_is_not_python_is_said_so_without_the_probes_source(program: str) -> None:
    """Issue 37: ``--python /bin/ls`` showed ls's complaint about its arguments, the probe's source."""
    result = run("sipure", "--verify-only", "--python", program)
    error, hint = result.stderr.strip().splitlines()
    assert result.code == 2 and error.startswith(f"error: {program} is not a Python interpreter"), error
    assert "sysconfig" not in result.stderr and "paths[" not in result.stderr
    assert hint == "hint: check that --python names a working Python 3 interpreter"


def test_without_a_terminal_and_without_yes_a_run_that_would_stop_units_is_refused(bed: Bed) -> None:
    """As apt without a terminal: ``ssh host safeinstall ...`` (no ``-t``) does not stop services that
    nobody confirmed. ``--json`` and ``--detach`` imply nothing: they need ``--yes`` too; nothing is
    stopped, nothing installed, exit 2 with a hint naming ``--yes``."""
    name = bed.service("unasked")
    main = bed.manager.main_pid(name)
    wheel = str(bed.wheels["sicext-2"])
    for extra in ((), ("--json",), ("--detach",), ("--detach", "--json")):
        refused = bed.cli("sicext", "--wheel", wheel, *extra)
        assert refused.code == 2, refused.stdout + refused.stderr
        said = (
            refused.json["errors"][0]["message"] + "\nhint: " + refused.json["errors"][0]["hint"]
            if "--json" in extra
            else refused.stderr
        )
        assert f"not confirmed: the run would stop {name}" in said, said
        assert "standard input is not a terminal" in said and "give --yes" in said.split("hint: ")[1]
    assert bed.manager.main_pid(name) == main and bed.version() == "1.0"
    done = bed.cli("sicext", "--wheel", wheel, "--yes", "--settle", "0.5")
    assert done.code == 0 and bed.version() == "2.0", done.stdout + done.stderr


def test_without_a_unit_to_stop_a_run_needs_no_yes(venv: Path, wheels: Wheelhouse, tmp_path: Path) -> None:
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state")}
    done = run("sipure", "--wheel", str(wheels["sipure-2"]), "--python", str(venv), env=environ, timeout=240)
    assert done.code == 0, done.stdout + done.stderr


def test_a_runs_step_table_off_a_terminal_has_the_json_steps_and_no_stale_progress(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """A new-user review: the text step table had no preflight row, which --json's steps has first; and
    off a terminal a quick backup said ``backup: 337 B of 27.5 KiB (1%)`` (its first progress line, said
    at once) beside its step line saying it was done. Now the rows are --json's steps, and a size's
    progress is said off a terminal (and in the log) only once its step has gone on a heartbeat."""
    import re

    wheelhouse.uv_install(venv, wheels["sicext-1"])
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state")}
    text = run("sicext", "--wheel", str(wheels["sicext-2"]), "--python", str(venv), env=environ)
    assert text.code == 0, text.stdout + text.stderr
    row = re.compile(r"(\S+) +(ok|FAILED|skipped) +\d+\.\d s")
    rows = [m.groups() for line in text.stdout.splitlines() if (m := row.match(line))]
    back = run("sicext", "--wheel", str(wheels["sicext-1"]), "--python", str(venv), "--json", env=environ)
    steps = [(s["name"], s["status"]) for s in back.json["data"]["steps"]]
    assert rows == steps and rows[0] == ("preflight", "ok"), (rows, steps)
    assert [line for line in text.stderr.splitlines() if line.startswith("backup")] == [], text.stderr
    logs = sorted((tmp_path / "state").glob("*/logs/*.log"))
    said = [
        line.split("] ", 1)[1] for log in logs for line in log.read_text().splitlines() if "] backup" in line
    ]
    assert said and all(line.startswith("backup: ok in ") for line in said), said


def test_a_run_into_safeinstalls_own_environment_is_refused(tmp_path: Path) -> None:
    """``--python`` naming the environment safeinstall runs from: no plan to replace its own uv (a run,
    its dry run, --detach and --undo), a clear error; --verify-only still checks it."""
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state")}
    for extra in (["uv", "--yes"], ["uv", "--dry-run"], ["uv", "--detach", "--yes"], ["--undo", "--yes"]):
        result = run(*extra, "--python", sys.prefix, env=environ)
        assert result.code == 2, result.stdout + result.stderr
        first = result.stderr.splitlines()[0]
        if extra[0] == "--undo":  # no run of it to undo: said before the environment's own check
            assert first.startswith("error: "), first
            continue
        own = f"error: {sys.prefix} is safeinstall's own environment: a run there would replace the uv"
        assert first == own + " and the code that run it", first
        assert "would proceed" not in result.stdout and result.stderr.splitlines()[1].startswith("hint: ")
    checked = run("uv", "--verify-only", "--python", sys.prefix, env=environ)
    assert checked.code in (0, 1), checked.stdout + checked.stderr


def test_journal_lines_leave_journalctls_own_notices_out() -> None:
    from safeinstall.system.systemd import JOURNAL_LINE_LIMIT, journal_lines

    output = "-- Boot 1234 --\nDec 06 host python[7]: Traceback\n\nDec 06 host python[7]: " + "x" * 400 + "\n"
    lines = journal_lines(output + "-- No entries --\n", 10)
    assert lines[0] == "Dec 06 host python[7]: Traceback" and len(lines) == 2
    assert len(lines[1]) == JOURNAL_LINE_LIMIT and lines[1].endswith(" …")
    assert journal_lines("\n".join(f"line {n}" for n in range(30)), 10) == tuple(
        f"line {n}" for n in range(20, 30)
    )


def test_a_failed_restarts_error_shows_the_services_last_journal_lines(bed: Bed, tmp_path: Path) -> None:
    """Issue 42: the error gave the journalctl command, not what the service said. This machine has no
    journald: a ``journalctl`` first on PATH answers as one would, and says what it was asked."""
    name = bed.service("crashes")
    shim = tmp_path / "bin" / "journalctl"
    shim.parent.mkdir()
    shim.write_text(
        '#!/bin/sh\necho "-- Boot 1 --"\necho "host python[7]: asked: $*"\necho "host python[7]: Boom"\n'
    )
    shim.chmod(0o755)
    path = {"PATH": f"{shim.parent}:{os.environ['PATH']}"}
    args = ("sicext", "--wheel", str(bed.wheels["sicext-3"]), "--settle", "1", "--no-smoke", "--json")
    crashed = bed.safeinstall(*args, more_env=path)
    assert crashed.code == 3, crashed.stdout + crashed.stderr
    message = crashed.json["errors"][0]["message"]
    said = f"the last lines of {name} in its journal:\n  host python[7]: asked: --user -u {name} -n 10"
    assert said in message and "\n  host python[7]: Boom" in message and "-- Boot" not in message, message
    assert bed.version() == "1.0"


def _tool_for_nobody(top: Path) -> tuple[list[str], dict[str, str]]:
    """safeinstall as uid 65534 can run it: :func:`tests.beds.hidden_tool` opened to others, with this
    interpreter's libpython beside it (its RUNPATH may lie below /root)."""
    import sysconfig

    from tests.beds import hidden_tool

    tool = hidden_tool(top)
    top.chmod(0o755)
    environ = {"PATH": "/usr/bin:/bin", "HOME": "/nonexistent", "LANG": "C.UTF-8"}
    if sysconfig.get_config_var("Py_ENABLE_SHARED"):
        library = Path(sysconfig.get_config_var("LIBDIR"), sysconfig.get_config_var("INSTSONAME"))
        shutil.copy2(library, top / "lib" / library.name)
        environ["LD_LIBRARY_PATH"] = str(top / "lib")
    return ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *tool], environ


def test_without_root_a_run_into_roots_environment_says_it_needs_root(
    open_dir: Path, wheels: Wheelhouse
) -> None:
    """Issue 42: as another user, the run complained about the state directory, then said "not writable
    (it is not writable)" once per directory; now: one error, "needs root", and a hint to run as root."""
    system_python = shutil.which("python3", path="/usr/bin:/bin")
    if os.geteuid() != 0 or system_python is None:
        pytest.skip("needs root (to act as uid 65534) and a python3 that uid 65534 can run")
    venv = wheelhouse.make_venv(open_dir / "venv", base=system_python)
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    tool, environ = _tool_for_nobody(open_dir / "tool")
    wheel = Path(shutil.copy2(wheels["sipure-2"], open_dir))  # where uid 65534 can read it
    args = ["sipure", "--wheel", str(wheel), "--python", str(venv), "--yes"]
    # HOME is not theirs: the state directory could not be made, and is not what they are told
    proc = subprocess.run([*tool, *args], env=environ, capture_output=True, text=True, timeout=120, cwd="/")
    assert proc.returncode == 2, proc.stdout + proc.stderr
    errors = [line for line in proc.stderr.splitlines() if line.startswith(("error:", "hint:"))]
    assert errors[0].startswith(f"error: reinstalling into {open_dir / 'venv'} needs root: uid 65534 cannot")
    assert errors[1].startswith("hint: run it as root") and len(errors) == 2, proc.stderr
    assert "state directory" not in proc.stderr and "(it is not writable)" not in proc.stderr
    home = open_dir / "home"  # the dry run checks the state directory: a home of its own
    home.mkdir()
    os.chown(home, 65534, 65534)
    environ["HOME"] = str(home)
    dry = subprocess.run(
        [*tool, *args[:-1], "--dry-run"], env=environ, capture_output=True, text=True, cwd="/"
    )
    refusals = [line for line in dry.stdout.splitlines() if line.startswith("  - ")]
    assert dry.returncode == 2 and len(refusals) == 1, dry.stdout + dry.stderr
    assert refusals[0].endswith(": it is not writable (to uid 65534: the run needs root)"), refusals
    closed = open_dir / "closed"  # an environment below a directory closed to them: an error, no traceback
    closed.mkdir(mode=0o700)
    unreachable = subprocess.run(
        [*tool, "sipure", "--python", str(closed / "venv"), "--dry-run"],
        env=environ,
        capture_output=True,
        text=True,
    )
    assert unreachable.returncode == 2, unreachable.stdout + unreachable.stderr
    assert unreachable.stderr.startswith(f"error: cannot reach {closed / 'venv'}: permission denied\nhint: ")


def _any_in(hint: object, where: str, seen: set[object]) -> list[str]:
    """Each place ``Any`` stands in ``hint``, walking into the dataclasses of safeinstall it names."""
    import dataclasses
    import typing

    if hint is typing.Any:
        return [where]
    found = [spot for arg in typing.get_args(hint) for spot in _any_in(arg, where, seen)]
    if dataclasses.is_dataclass(hint) and isinstance(hint, type) and hint not in seen:
        seen.add(hint)
        hints = typing.get_type_hints(hint)
        for f in dataclasses.fields(hint):
            found += _any_in(hints[f.name], f"{where}.{f.name}", seen)
    return found


def test_nothing_between_the_cli_and_the_commands_is_typed_any() -> None:
    """Issue 48: what cli/app.py hands the layers below is typed field by field (the request, the run's
    options, the modes), never a ``Mapping[str, Any]`` matched to the options by name: no ``Any`` in the
    annotations of what it imports from ``run/``, nor in the dataclasses those annotations name."""
    import ast
    import importlib
    import inspect
    import typing

    from safeinstall.cli import app as cli

    tree = ast.parse(Path(inspect.getfile(cli)).read_text())
    imported = [
        (node.module, alias.name)
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("safeinstall.run")
        for alias in node.names
    ]
    assert {name for _, name in imported} >= {"execute", "Request", "RunOptions", "Mode"}
    seen: set[object] = set()
    found: list[str] = []
    for module, name in imported:
        value = getattr(importlib.import_module(module or ""), name)
        if inspect.isfunction(value):
            hints = typing.get_type_hints(value)
            found += [s for param, hint in hints.items() for s in _any_in(hint, f"{name}({param})", seen)]
        else:
            found += _any_in(value, name, seen)
    assert not found, found


def test_the_review_wordings_read_as_english() -> None:
    """A new-user review: "--undo takes no a version", and --discard's help said its "backup's run"
    went (the prepare's backup is kept with the others)."""
    undo = run("vllm==1", "--undo")
    assert undo.code == 2 and undo.stderr.startswith(
        "error: --undo takes no version (vllm==1): it puts back what the run it undoes replaced\n"
    ), undo.stderr
    shown = " ".join(run("--help", env={**os.environ, "COLUMNS": "400"}).stdout.split())
    assert "its staging tree, uv cache, wheel copy and journal (its backup is kept with the others)" in shown
