"""The --json contract: one versioned envelope for every command, and clear errors for bad input."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from safeinstall.env.hashing import FileState
from safeinstall.env.records import RecordEntry, RecordHash
from safeinstall.run.parts.output import STATUS_VALUES, jsonable
from tests import wheelhouse
from tests.clirun import run
from tests.wheelhouse import Wheelhouse

ENVELOPE = {"safeinstall_result_version", "command", "status", "exit_code", "data", "errors"}
ROOT = Path(__file__).resolve().parent.parent


def test_verify_envelope_shape(venv: Path, wheels: Wheelhouse) -> None:
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    doc = run("sipure", "--verify-only", "--python", str(venv), "--json").json
    assert set(doc) == ENVELOPE and doc["safeinstall_result_version"] == 1
    assert set(doc["data"]) == {
        "python",
        "prefix",
        "wheel",
        "site_dirs",
        "egg_info",
        "distributions",
        "findings",
        "summary",
        "patch",
        "notes",
    }
    assert set(doc["data"]["distributions"][0]) == {
        "name",
        "version",
        "dist_info",
        "files_checked",
        "against",
        "drift",
        "wheel_fault",
        "site",
        "from_base",
        "system_package",
    }
    assert set(doc["data"]["summary"]) == {
        "distributions",
        "files_checked",
        "drift",
        "wheel_faults",
        "warnings",
        "bytecode",
    }


def test_status_and_recover_with_nothing_to_do(tmp_path: Path) -> None:
    env = {"SAFEINSTALL_STATE_DIR": str(tmp_path / "state"), "PATH": "/usr/bin:/bin"}
    status = run("--status", "--json", env=env)
    assert status.code == 0 and status.json["command"] == "status" and status.json["status"] == "idle"
    assert status.json["data"] == {"environments": []}
    recover = run("--recover", "--json", env=env)
    assert recover.code == 0 and recover.json["data"] == {"recoveries": []}
    assert run("--recover", env=env).stdout.strip() == "nothing to recover"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["sipure==2", "--wheel", "x.whl"], "give --wheel or a version in the requirement, not both"),
        (["sipure", "--version", "2"], "--version prints safeinstall's version and takes nothing else"),
        (
            ["sipure @ https://example.com/sipure.whl"],
            "the requirement 'sipure @ https://example.com/sipure.whl' has a URL",
        ),
        (
            ["sipure; python_version > '3'"],
            "the requirement \"sipure; python_version > '3'\" has an environment marker",
        ),
        (["sipure==2", "--verify-only"], "--verify-only checks the installed version"),
        (["--bogus"], "no such option: --bogus"),
        (["sipure", "--recover"], "--recover takes no PACKAGE"),
        (["--verify-only"], "no PACKAGE given"),
        (["sipure", "--python", "/nonexistent/python"], "no such interpreter"),
    ],
)
def test_bad_input_is_an_error_line_with_a_hint(args: list[str], message: str) -> None:
    result = run(*args)
    assert result.code == 2
    assert f"error: {message}" in result.stderr and "hint:" in result.stderr
    assert "Traceback" not in result.stderr
    doc = run(*args, "--json").json
    assert set(doc) == ENVELOPE and doc["status"] == "error" and doc["exit_code"] == 2
    assert message in doc["errors"][0]["message"] and doc["errors"][0]["hint"]


def test_help_documents_exit_codes() -> None:
    result = run("--help")
    assert result.code == 0
    text = " ".join(result.stdout.split())
    for code in (
        "0 success",
        "1 drift found",
        "2 could not check, refused or declined",
        "3 failed after services",
        "4 failed and putting things back failed too",
        "--recover: the new version did not come up",
        "--status --wait exits with the run's own code",
    ):
        assert code in text


def test_recover_unit_is_shipped() -> None:
    unit = (ROOT / "safeinstall" / "data" / "safeinstall-recover.service").read_text()
    assert "ExecStart=/usr/local/bin/safeinstall --recover" in unit and "Before=multi-user.target" in unit


def test_named_tuples_are_objects_in_json_as_dataclasses_are() -> None:
    """The per-file records are NamedTuples (cheaper to build than frozen dataclasses): in JSON they are
    objects with their field names, as they were as dataclasses, not arrays."""
    entry = RecordEntry("pkg/a.py", RecordHash("sha256", "abc"), 3)
    state = FileState("/env/pkg/a.py", True, True, 3, "abc", "sha256")
    doc = jsonable({"entry": entry, "states": [state]})
    assert doc["entry"] == {"path": "pkg/a.py", "hash": {"algorithm": "sha256", "digest": "abc"}, "size": 3}
    assert doc["states"][0]["path"] == "/env/pkg/a.py" and doc["states"][0]["digest"] == "abc"
    assert jsonable(("a", 1)) == ["a", 1]  # a plain tuple is still an array


def _documented_statuses() -> dict[str, set[str]]:
    """docs/json.md's paragraph of `status` values, per command: ``{command: {value, ...}}``."""
    text = (ROOT / "docs" / "json.md").read_text()
    start = text.index("`status` values:")
    paragraph = text[start : text.index("\n\n", start)].replace("\n", " ")
    found: dict[str, set[str]] = {}
    # each command's part: "`command`: `a`, `b` (why), ...;" up to the next "; `command`:"
    parts = re.split(r"(?:^`status` values:|;) `([a-z-]+)`: ", paragraph)
    for command, said in zip(parts[1::2], parts[2::2], strict=True):
        found[command] = set(re.findall(r"`([a-z-]+)`", re.sub(r"\([^()]*\)", "", said)))
    return found


def test_every_json_status_value_is_in_the_docs() -> None:
    """Issue 44 item 4: ``--recover --json`` said ``rolled-back``, which docs/json.md did not list. Every
    status a command's document can carry (safeinstall/run/parts/output.py's ``STATUS_VALUES``, which the
    commands use) is listed there; an undo is a reinstall document."""
    documented = _documented_statuses()
    for command, values in STATUS_VALUES.items():
        listed = documented["reinstall" if command == "undo" else command]
        unlisted = set(values) - listed
        assert not unlisted, f"{command}: {sorted(unlisted)} not in docs/json.md"
    assert "rolled-back" in documented["recover"]


def test_the_commands_say_only_the_statuses_listed() -> None:
    """Every status literal the code passes to ``envelope`` is one of
    ``STATUS_VALUES``: a new one must be added there, and so to docs/json.md."""
    source = ROOT / "safeinstall"
    everything = {value for values in STATUS_VALUES.values() for value in values}
    for path in source.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "envelope":
                status = node.args[1] if len(node.args) > 1 else None
                if isinstance(status, ast.Constant):
                    command = node.args[0]
                    assert status.value in everything, f"{path}: {status.value!r}"
                    if isinstance(command, ast.Constant) and isinstance(command.value, str):
                        assert status.value in STATUS_VALUES[command.value], f"{path}: {status.value!r}"
