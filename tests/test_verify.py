"""``--verify-only``: real wheels, installed by the real uv, then drifted by hand."""

from __future__ import annotations

import base64
import hashlib
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
from distlib.database import DistributionPath

from tests import wheelhouse
from tests.clirun import run
from tests.wheelhouse import Wheelhouse

ENVELOPE_KEYS = {"safeinstall_result_version", "command", "status", "exit_code", "data", "errors"}
FINDING_KEYS = {
    "distribution",
    "path",
    "kind",
    "detail",
    "drift",
    "baseline",
    "expected",
    "actual",
    "wheel_member",
    "shared_with",
    "acknowledged",
}


@pytest.fixture
def env(venv: Path, wheels: Wheelhouse) -> Path:
    """A venv with every fixture installed by uv, copied (no hardlinks into uv's cache)."""
    wheelhouse.uv_install(venv, wheels["sipure-1"], wheels["sicext-1"], wheels["sins-a"], wheels["sins-b"])
    return venv


def site(python: Path) -> Path:
    return wheelhouse.site_packages(python)


def kinds(result_json: dict[str, Any]) -> set[tuple[str, str]]:
    return {(f["kind"], os.path.basename(f["path"])) for f in result_json["data"]["findings"] if f["drift"]}


def test_clean_install_is_clean(env: Path) -> None:
    result = run("sipure", "--verify-only", "--python", str(env))
    assert result.code == 0, result.stderr
    assert "sipure 1.0" in result.stdout and "OK" in result.stdout
    doc = run("--verify-only", "--all", "--python", str(env), "--json").json
    assert doc["status"] == "clean" and doc["exit_code"] == 0
    assert {d["name"] for d in doc["data"]["distributions"]} >= {"sipure", "sicext", "sins-a", "sins-b"}
    assert doc["data"]["findings"] == []


def test_each_drift_kind_is_reported(env: Path) -> None:
    sp = site(env)
    (sp / "sipure" / "__init__.py").write_text("# patched locally\n")  # modified
    (sp / "sipure" / "data" / "notes.txt").unlink()  # missing
    (sp / "sipure" / "leftover.py").write_text("x = 1\n")  # extra
    (sp / "sicext" / "__pycache__").mkdir(exist_ok=True)
    # bytecode of a listed source that is not bytecode at all: judged by what it holds (issue 46)
    (sp / "sicext" / "__pycache__" / "__init__.cpython-311.pyc").write_bytes(b"compiled")
    (sp / "sicext" / "__pycache__" / "gone.cpython-311.pyc").write_bytes(b"stale")  # extra
    (env.parent / "sipure").write_text("#!/bin/sh\necho hijacked\n")  # script, ../../../bin/sipure
    result = run("--verify-only", "--all", "--python", str(env), "--json")
    assert result.code == 1, result.stderr
    doc = result.json
    assert set(doc) == ENVELOPE_KEYS and doc["status"] == "drift" and doc["exit_code"] == 1
    assert kinds(doc) == {
        ("modified", "__init__.py"),
        ("missing", "notes.txt"),
        ("extra", "leftover.py"),
        ("extra", "gone.cpython-311.pyc"),
        ("extra", "__init__.cpython-311.pyc"),
        ("modified", "sipure"),
    }
    human = run("sipure", "--verify-only", "--python", str(env))
    assert human.code == 1
    assert "modified" in human.stdout and "missing" in human.stdout and "DRIFT" in human.stdout


def test_namespace_package_shared_by_two_distributions(env: Path) -> None:
    sp = site(env)
    assert (sp / "sins" / "a").is_dir() and (sp / "sins" / "b").is_dir()
    for name in ("sins-a", "sins-b"):
        result = run(name, "--verify-only", "--python", str(env), "--json")
        assert result.code == 0, result.stdout
    (sp / "sins" / "b" / "added.py").write_text("")
    doc = run("--verify-only", "--all", "--python", str(env), "--json").json
    assert [(f["distribution"], f["kind"]) for f in doc["data"]["findings"]] == [("sins-b", "extra")]


def _append_record(python: Path, dist_info: str, line: str) -> None:
    record = site(python) / dist_info / "RECORD"
    record.write_text(record.read_text() + line + "\n")


def test_record_path_escaping_the_prefix_is_reported_and_never_read(env: Path, tmp_path: Path) -> None:
    fifo = tmp_path / "outside-fifo"
    os.mkfifo(fifo)  # reading it would block: the check must not open it
    escape = os.path.relpath(fifo, site(env))
    _append_record(env, "sipure-1.0.dist-info", f"{escape},sha256=AAAA,4")
    result = run("sipure", "--verify-only", "--python", str(env), "--json", timeout=60)
    assert result.code == 1
    (finding,) = result.json["data"]["findings"]
    assert finding["kind"] == "outside" and finding["path"] == escape


def test_package_directory_symlinked_out_of_the_prefix_is_outside_and_never_read(
    env: Path, tmp_path: Path
) -> None:
    package = site(env) / "sipure"
    elsewhere = tmp_path / "elsewhere" / "sipure"
    shutil.move(package, elsewhere)
    package.symlink_to(elsewhere, target_is_directory=True)
    listed = sorted(p.name for p in elsewhere.glob("*.py"))
    victim = elsewhere / listed[0]
    victim.unlink()
    os.mkfifo(victim)  # reading it would block: the check must not open it
    result = run("sipure", "--verify-only", "--python", str(env), "--json", timeout=60)
    assert result.code == 1
    findings = result.json["data"]["findings"]
    assert {f["kind"] for f in findings} == {"outside"}
    assert f"sipure/{victim.name}" in {f["path"] for f in findings}


@pytest.mark.parametrize("line", ["../../..", "../../../..", "../../../../.."])
def test_a_record_path_naming_the_prefix_or_above_is_outside(env: Path, line: str) -> None:
    """A RECORD line that resolves to the environment's own directory (or one above it) is reported as
    outside; the containment check climbed from its directory to "/" and never stopped (an internal
    error, exit 2, instead of a report)."""
    record = next(site(env).glob("sipure-*.dist-info")) / "RECORD"
    with record.open("a") as handle:
        handle.write(f"{line},sha256=AAAA,1\n")
    result = run("sipure", "--verify-only", "--python", str(env), "--json", timeout=60)
    assert result.code == 1, result.stderr
    assert [(f["kind"], f["path"]) for f in result.json["data"]["findings"]] == [("outside", line)]


def test_a_record_path_thousands_of_directories_deep_is_checked(env: Path) -> None:
    """The containment check climbed one call per directory: a RECORD line 1,200 directories deep was
    an internal error (RecursionError) instead of a report."""
    deep = "sipure/" + "x/" * 1200 + "f.py"
    _append_record(env, "sipure-1.0.dist-info", f"{deep},sha256=AAAA,4")
    result = run("sipure", "--verify-only", "--python", str(env), "--json", timeout=60)
    assert result.code == 1, result.stderr
    assert [(f["kind"], f["path"].endswith("/x/f.py")) for f in result.json["data"]["findings"]] == [
        ("missing", True)
    ]


def test_a_link_to_a_sibling_whose_name_starts_with_the_prefixs_is_outside(env: Path) -> None:
    """Issue 35: the package directory is a symlink to ``<prefix>-evil/sipure``, a sibling directory whose
    name starts with the prefix's (``venv`` -> ``venv-evil``): outside the prefix (a path is inside only
    below ``PREFIX/``, never because it starts with the prefix's text), never read."""
    prefix = env.parent.parent
    package = site(env) / "sipure"
    sibling = prefix.parent / (prefix.name + "-evil") / "sipure"
    sibling.parent.mkdir()
    shutil.move(package, sibling)
    package.symlink_to(sibling, target_is_directory=True)
    result = run("sipure", "--verify-only", "--python", str(env), "--json", timeout=60)
    assert result.code == 1, result.stdout + result.stderr
    kinds = {(f["kind"], f["path"].startswith("sipure/")) for f in result.json["data"]["findings"]}
    assert kinds == {("outside", True)}, result.json["data"]["findings"]


def test_package_directory_symlinked_within_the_prefix_is_checked(env: Path) -> None:
    prefix = env.parent.parent
    package = site(env) / "sipure"
    moved = prefix / "share" / "sipure-real"
    moved.parent.mkdir(exist_ok=True)
    shutil.move(package, moved)
    package.symlink_to(os.path.relpath(moved, package.parent), target_is_directory=True)
    assert run("sipure", "--verify-only", "--python", str(env), "--json").code == 0
    (moved / "__init__.py").write_text("# patched\n")
    doc = run("sipure", "--verify-only", "--python", str(env), "--json").json
    assert [(f["kind"], f["path"].endswith("sipure/__init__.py")) for f in doc["data"]["findings"]] == [
        ("modified", True)
    ]


@pytest.mark.parametrize("length", ["short", "long"])
def test_python_scripts_rewritten_by_the_installer_are_not_drift(tmp_path: Path, length: str) -> None:
    """A ``#!python`` script in the wheel's .data/scripts gets a launcher for the environment's python:
    one shebang line, or with an interpreter path over 127 bytes the three-line ``#!/bin/sh`` form.
    Either way the launcher is the installer's, and only a change to the rest is drift."""
    body = b"import sidata\nprint('hi', sidata.X)\n"
    wheel = wheelhouse.make_wheel(
        tmp_path,
        "sidata",
        "1.0",
        {"sidata/__init__.py": b"X = 1\n", "sidata-1.0.data/scripts/hello": b"#!python\n" + body},
    )
    base = tmp_path / ("v" if length == "short" else "v" * 150)
    python = wheelhouse.make_venv(base)
    wheelhouse.uv_install(python, wheel)
    script = base / "bin" / "hello"
    launcher_lines = script.read_bytes()[: -len(body)].count(b"\n")
    assert launcher_lines == (1 if length == "short" else 3)
    assert subprocess.run([str(script)], capture_output=True, text=True).stdout == "hi 1\n"
    assert run("sidata", "--verify-only", "--python", str(python), "--wheel", str(wheel)).code == 0
    script.write_bytes(script.read_bytes() + b"print('patched')\n")
    doc = run("sidata", "--verify-only", "--python", str(python), "--wheel", str(wheel), "--json").json
    assert [(f["kind"], f["path"]) for f in doc["data"]["findings"]] == [("modified", str(script))]


@pytest.mark.parametrize("kind", ["pth", "data"])
def test_a_pth_or_data_file_verifies_clean_and_is_modified_when_changed(tmp_path: Path, kind: str) -> None:
    """Issue 35: a `.pth` file a wheel installs at the top of site-packages (code that runs at every
    start), or a `.data/data/` member (installed below the prefix, `share/...`): clean as installed,
    against its RECORD and against the wheel; changed, it is `modified` either way."""
    member = "sidata.pth" if kind == "pth" else "sidata-1.0.data/data/share/sidata/notes.txt"
    wheel = wheelhouse.make_wheel(
        tmp_path, "sidata", "1.0", {"sidata/__init__.py": b"X = 1\n", member: b"import sidata\n"}
    )
    python = wheelhouse.make_venv(tmp_path / "v")
    wheelhouse.uv_install(python, wheel)
    path = site(python) / member if kind == "pth" else tmp_path / "v" / "share" / "sidata" / "notes.txt"
    assert path.read_bytes() == b"import sidata\n"
    for against in ((), ("--wheel", str(wheel))):
        result = run("sidata", "--verify-only", "--python", str(python), *against, "--json")
        assert result.code == 0, (against, result.stdout)
    path.write_text("import os; os.system('id')\n")
    for against in ((), ("--wheel", str(wheel))):
        doc = run("sidata", "--verify-only", "--python", str(python), *against, "--json").json
        assert [(f["kind"], f["path"].endswith(path.name)) for f in doc["data"]["findings"]] == [
            ("modified", True)
        ], against


def test_a_wheel_read_once_is_enough_and_a_corrupted_file_is_still_found(tmp_path: Path) -> None:
    """A run verifies its install against the wheel it read and checked before the stop (its member
    hashes, its #!python scripts) and never opens the wheel again; a corrupted file is still found."""
    from safeinstall.env.distributions import find_distributions
    from safeinstall.env.drift import FindingKind
    from safeinstall.env.environment import inspect_environment
    from safeinstall.env.verify import verify_environment
    from safeinstall.env.wheel import read_wheel

    wheel_path = wheelhouse.make_wheel(
        tmp_path,
        "sidata",
        "1.0",
        {"sidata/__init__.py": b"X = 1\n", "sidata-1.0.data/scripts/hello": b"#!python\nprint('hi')\n"},
    )
    python = wheelhouse.make_venv(tmp_path / "v")
    wheelhouse.uv_install(python, wheel_path)
    wheel = read_wheel(wheel_path)
    wheel_path.unlink()  # what the verify needs from the wheel was read at preflight
    env = inspect_environment(python)
    installed = find_distributions(env)
    assert verify_environment(env, ["sidata"], wheel, installed=installed).findings == ()
    module = env.purelib / "sidata" / "__init__.py"
    module.write_bytes(b"X = 2\n")  # same size: only the hash tells
    report = verify_environment(env, ["sidata"], wheel, installed=installed)
    assert [(f.kind, f.path) for f in report.findings] == [(FindingKind.MODIFIED, str(module))]


def test_malformed_record_line(env: Path) -> None:
    _append_record(env, "sipure-1.0.dist-info", "sipure/x.py,md5=abc,3,extra-field")
    doc = run("sipure", "--verify-only", "--python", str(env), "--json").json
    assert doc["exit_code"] == 1
    assert [f["kind"] for f in doc["data"]["findings"]] == ["malformed"]


def test_a_nul_byte_in_a_record_path_is_a_malformed_line(env: Path) -> None:
    """A RECORD path with a NUL byte (no file can have one) is a malformed line, never an internal
    error (an ``embedded null byte`` ValueError when the path is looked up)."""
    _append_record(env, "sipure-1.0.dist-info", '"sipure/a\0b.py",sha256=abc,1')
    result = run("sipure", "--verify-only", "--python", str(env), "--json")
    assert result.code == 1, result.stdout + result.stderr
    assert "Traceback" not in result.stderr
    (finding,) = result.json["data"]["findings"]
    assert finding["kind"] == "malformed" and "NUL" in finding["detail"]


def test_unknown_package_and_bad_interpreter_exit_2(env: Path, tmp_path: Path) -> None:
    result = run("no-such-dist", "--verify-only", "--python", str(env))
    assert result.code == 2
    assert "error: no-such-dist is not installed" in result.stderr and "hint:" in result.stderr
    assert "Traceback" not in result.stderr
    result = run("sipure", "--verify-only", "--python", str(tmp_path / "nope"), "--json")
    assert result.code == 2
    doc = result.json
    assert doc["status"] == "error" and doc["errors"][0]["code"] == "interpreter"


def test_corrupt_wheel_exit_2(env: Path, tmp_path: Path) -> None:
    bad = tmp_path / "sipure-1.0-py3-none-any.whl"
    bad.write_bytes(b"this is not a zip")
    result = run("sipure", "--verify-only", "--python", str(env), "--wheel", str(bad))
    assert result.code == 2
    assert "not a valid zip" in result.stderr and "Traceback" not in result.stderr


def test_against_wheel_clean_then_diff_and_patch(env: Path, wheels: Wheelhouse, tmp_path: Path) -> None:
    wheel = str(wheels["sipure-1"])
    assert run("sipure", "--verify-only", "--python", str(env), "--wheel", wheel).code == 0
    target = site(env) / "sipure" / "__init__.py"
    original = target.read_text()
    target.write_text(original.replace("hello from sipure 1", "hello from a local patch"))
    patch = tmp_path / "local.patch"
    result = run(
        "sipure",
        "--verify-only",
        "--python",
        str(env),
        "--wheel",
        wheel,
        "--diff",
        "--save-patch",
        str(patch),
    )
    assert result.code == 1
    assert '-    return "hello from sipure 1"' in result.stdout
    assert '+    return "hello from a local patch"' in result.stdout
    assert f"patch of 1 modified file written to {patch}" in result.stderr  # issue 37: not "1 ... files"
    # The saved patch reverses cleanly with patch(1), taking the local edit out.
    prefix = env.parent.parent
    subprocess.run(
        ["patch", "-R", "-p1", "-d", str(prefix), "-i", str(patch)], check=True, capture_output=True
    )
    assert target.read_text() == original
    assert run("sipure", "--verify-only", "--python", str(env), "--wheel", wheel).code == 0
    saved = patch.read_text()  # an existing file (or a symlink in its place) is never written over
    args = ("sipure", "--verify-only", "--python", str(env), "--wheel", wheel, "--diff", "--save-patch")
    again = run(*args, str(patch))
    assert again.code == 2 and "does not overwrite" in again.stderr and patch.read_text() == saved
    victim, link = tmp_path / "victim", tmp_path / "link.patch"
    victim.write_text("keep\n")
    link.symlink_to(victim)
    assert run(*args, str(link)).code == 2 and victim.read_text() == "keep\n"
    # the wheel names its package: no PACKAGE needed
    assert (
        run("--verify-only", "--python", str(env), "--wheel", wheel, "--json").json["data"]["distributions"][
            0
        ]["name"]
        == "sipure"
    )


def test_version_mismatch_against_other_wheel(env: Path, wheels: Wheelhouse) -> None:
    doc = run(
        "sipure", "--verify-only", "--python", str(env), "--wheel", str(wheels["sipure-2"]), "--json"
    ).json
    assert doc["exit_code"] == 1
    found = {f["kind"] for f in doc["data"]["findings"]}
    assert "version-mismatch" in found and "missing" in found  # extra_v2.py is not installed
    extra = [f for f in doc["data"]["findings"] if f["kind"] == "extra"]
    assert [os.path.basename(f["path"]) for f in extra] == ["old.txt"]  # in v1, not in the v2 wheel
    assert extra[0]["detail"] == "installed, but not in the wheel"
    wrong = run("sipure", "--verify-only", "--python", str(env), "--wheel", str(wheels["sicext-1"]))
    assert wrong.code == 2 and "is for sicext, not sipure" in wrong.stderr


def test_broken_wheel_record_is_the_wheels_fault(env: Path, wheels: Wheelhouse, tmp_path: Path) -> None:
    (tmp_path / "w").mkdir()
    broken = wheelhouse.rewrite_record_hash(
        wheels["sipure-1"], tmp_path / "w" / wheels["sipure-1"].name, "sipure/cli.py"
    )
    result = run("sipure", "--verify-only", "--python", str(env), "--wheel", str(broken), "--json")
    doc = result.json
    assert result.code == 0, doc  # the installation itself matches the wheel's real contents
    (finding,) = doc["data"]["findings"]
    assert finding["kind"] == "wheel-record" and finding["drift"] is False
    assert doc["data"]["wheel"]["record_ok"] is False
    assert (
        "wheel's fault" in run("sipure", "--verify-only", "--python", str(env), "--wheel", str(broken)).stderr
    )


def test_hardlinks_into_uv_cache_warn(venv: Path, wheels: Wheelhouse) -> None:
    wheelhouse.uv_install(venv, wheels["sipure-1"], link_mode="hardlink")
    result = run("sipure", "--verify-only", "--python", str(venv))
    assert result.code == 0
    assert "share their inode" in result.stderr and "uv #10579" in result.stderr
    # verify cannot tell uv's cache from a kept backup (a prepared run's is hard links of the live files)
    assert "or a backup safeinstall keeps of this environment" in result.stderr, result.stderr
    doc = run("sipure", "--verify-only", "--python", str(venv), "--json").json
    assert doc["status"] == "clean"
    assert {f["kind"] for f in doc["data"]["findings"]} == {"hardlinked"}


def test_hardlinked_files_are_one_finding_per_distribution_and_one_per_file_in_json(
    venv: Path, wheels: Wheelhouse
) -> None:
    """Issue 36: a venv uv hardlinked from its cache has every file linked (61k on vLLM's); the report
    holds one ``hardlinked`` finding per distribution, with each file and its link count, and counts
    them all; ``--json`` and ``-v`` still list a finding per file."""
    from safeinstall.env.drift import FindingKind
    from safeinstall.env.environment import inspect_environment
    from safeinstall.env.verify import verify_environment

    wheelhouse.uv_install(venv, wheels["sipure-1"], wheels["sins-a"], link_mode="hardlink")
    report = verify_environment(inspect_environment(venv), ["sipure", "sins-a"])
    linked = [f for f in report.findings if f.kind == FindingKind.HARDLINKED]
    assert sorted(f.distribution for f in linked) == ["sins-a", "sipure"]
    listed = {path: links for f in linked for path, links in f.linked}
    assert all(f.files == len(f.linked) > 1 and f.path == f.linked[0][0] for f in linked)
    assert listed == {p: s.nlink for p, s in report.observed.items() if s.nlink > 1}
    doc = run("sipure", "--verify-only", "--python", str(venv), "--json").json
    each = {f["path"]: f["detail"] for f in doc["data"]["findings"] if f["kind"] == "hardlinked"}
    assert each.keys() == {f for f in listed if "sipure" in f} and doc["data"]["summary"]["warnings"] == len(
        each
    )
    assert all(detail.startswith(f"{listed[path]} links: ") for path, detail in each.items())


def test_python_defaults_to_virtual_env(env: Path) -> None:
    environ = dict(os.environ, VIRTUAL_ENV=str(env.parent.parent))
    result = run("sicext", "--verify-only", env=environ)
    assert result.code == 0 and "sicext 1.0" in result.stdout


def test_target_environment_variables_are_not_trusted(env: Path, tmp_path: Path) -> None:
    """PYTHONPATH/PYTHONHOME of the caller must not change which files are checked."""
    decoy = tmp_path / "decoy"
    shutil.copytree(site(env), decoy)
    environ = dict(os.environ, PYTHONPATH=str(decoy), PYTHONHOME=str(tmp_path))
    (site(env) / "sipure" / "__init__.py").write_text("patched\n")
    assert run("sipure", "--verify-only", "--python", str(env), env=environ).code == 1


def test_cross_check_with_distlib(env: Path) -> None:
    """An independent implementation agrees on missing and modified files."""
    sp = site(env)
    (sp / "sipure" / "cli.py").write_text("patched = True\n")
    (sp / "sipure" / "data" / "old.txt").unlink()
    (sp / "sicext" / "serve.py").write_text("# same size? no\n")
    dists = DistributionPath([str(sp)])
    theirs = set()
    for name in ("sipure", "sicext"):
        dist = dists.get_distribution(name)
        assert dist is not None
        for path, problem, *_ in dist.check_installed_files():
            theirs.add(("missing" if problem == "exists" else "modified", os.path.realpath(path)))
    doc = run("--verify-only", "--all", "--python", str(env), "--json").json
    ours = {(f["kind"], os.path.realpath(f["path"])) for f in doc["data"]["findings"] if f["drift"]}
    assert ours == theirs
    assert len(ours) == 3


def test_usage_errors(env: Path) -> None:
    result = run("--verify-only", "--python", str(env))
    assert result.code == 2 and "no PACKAGE given" in result.stderr
    result = run("sipure", "--verify-only", "--diff", "--python", str(env))
    assert result.code == 2 and "--wheel" in result.stderr


RECORD_PROBLEMS = {
    "malformed": ("malformed", "hash algorithm 'md5' is not accepted", "has lines that cannot be parsed"),
    "missing": ("missing", "no RECORD: none of its files can be checked", "missing"),
    "fifo": ("unreadable", "RECORD: not a regular file (a FIFO): none of its files", "not a regular file"),
    "too-large": ("unreadable", f"RECORD: larger than {64 << 20} bytes: none of its files", "larger than"),
}


@pytest.mark.parametrize("how", sorted(RECORD_PROBLEMS))
def test_a_record_that_cannot_be_read_is_never_ok(env: Path, wheels: Wheelhouse, how: str) -> None:
    """Without its RECORD nothing of a distribution can be checked (and a run could back up none of
    its files): verification reports it as drift, never "0 files checked: OK", and a run refuses."""
    record = site(env) / "sipure-1.0.dist-info" / "RECORD"
    text = record.read_text()
    record.unlink()
    if how == "malformed":  # uv takes the line (and removes the file): a backup must hold it too
        record.write_text(text.replace("sipure/__init__.py,sha256=", "sipure/__init__.py,md5="))
    elif how == "fifo":
        os.mkfifo(record)
    elif how == "too-large":
        with open(record, "wb") as sparse:
            sparse.truncate((64 << 20) + 1)
    kind, detail, reason = RECORD_PROBLEMS[how]
    result = run("sipure", "--verify-only", "--python", str(env), "--json")
    assert result.code == 1, result.stdout + result.stderr
    (finding,) = [f for f in result.json["data"]["findings"] if f["path"].startswith(str(record))]
    assert finding["kind"] == kind and finding["detail"].startswith(detail)
    line = (
        text.splitlines().index(next(x for x in text.splitlines() if x.startswith("sipure/__init__.py,"))) + 1
    )
    assert finding["path"] == str(record) + (f":{line}" if how == "malformed" else "")
    human = run("sipure", "--verify-only", "--python", str(env))
    assert f"files checked against RECORD: DRIFT {'1 extra, ' * (how == 'malformed')}1 {kind}" in human.stdout
    plan = run("sipure", "--wheel", str(wheels["sipure-2"]), "--python", str(env), "--dry-run", "--json")
    assert plan.json["data"] is not None, plan.stdout + plan.stderr
    (refusal,) = [r for r in plan.json["data"]["refusals"] if "RECORD" in r]
    if how == "malformed":
        assert refusal.startswith(f"the RECORD of sipure 1.0 ({record}) {reason} (line {line}: {detail})")
        assert refusal.endswith("the files they name can be neither backed up nor checked")
    else:
        assert refusal.startswith(f"the RECORD of sipure 1.0 ({record}) could not be read ({reason}")
        assert refusal.endswith("its files can be neither backed up nor checked")


def test_the_dist_info_files_read_in_one_scan_are_bounded(
    env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The environment's owner decides how many .dist-info directories there are, and hardlinks to one
    RECORD make them free: a scan reads at most distributions.SCAN_LIMIT bytes of them in all (128 MiB;
    1 MiB here), then stops with an error instead of parsing on into root's memory."""
    from safeinstall.env import distributions
    from safeinstall.env.environment import inspect_environment
    from safeinstall.env.verify import verify_environment
    from safeinstall.errors import RecordError

    inspected = inspect_environment(env)
    assert verify_environment(inspected, ["sipure"]).findings == ()
    shared = tmp_path / "RECORD"
    shared.write_text("".join(f"zz/f{n},sha256=x,1\n" for n in range(5000)))  # about 100 KB
    for n in range(20):
        dist_info = site(env) / f"zz{n}-1.0.dist-info"
        dist_info.mkdir()
        (dist_info / "METADATA").write_text(f"Name: zz{n}\nVersion: 1.0\n")
        os.link(shared, dist_info / "RECORD")
    monkeypatch.setattr(distributions, "SCAN_LIMIT", 1 << 20)
    with pytest.raises(RecordError) as raised:
        verify_environment(inspected, ["sipure"])
    assert raised.value.message.startswith(
        f"the .dist-info files in {site(env)} hold more than {1 << 20} bytes in all (reading {site(env)}/zz"
    )
    assert "look for copies of .dist-info directories" in raised.value.advice
    # lines, however short: each parsed one costs root memory
    monkeypatch.setattr(distributions, "SCAN_LIMIT", 128 << 20)
    monkeypatch.setattr(distributions, "SCAN_LINES_LIMIT", 50_000)
    with pytest.raises(RecordError) as raised:
        verify_environment(inspected, ["sipure"])
    assert raised.value.message.startswith(f"the RECORDs in {site(env)} list more than 50000 files in all")
    # the named distribution and the others are one scan: the limit is for both together
    for n in range(5, 20):
        shutil.rmtree(site(env) / f"zz{n}-1.0.dist-info")
    every = sum(record.read_text().count("\n") + 1 for record in site(env).glob("*.dist-info/RECORD"))
    monkeypatch.setattr(distributions, "SCAN_LINES_LIMIT", every)
    assert verify_environment(inspected, ["zz0"]).distributions[0].name == "zz0"  # each RECORD read once
    monkeypatch.setattr(distributions, "SCAN_LINES_LIMIT", every - 1)
    with pytest.raises(RecordError):
        verify_environment(inspected, ["zz0"])


def test_a_record_the_owner_writes_cannot_hide_a_tampered_file_from_the_wheel(
    venv: Path, tmp_path: Path
) -> None:
    """The second review's finding: with ``--wheel`` the wheel is the baseline; a RECORD written into
    site-packages (a fake ``.dist-info`` listing the tampered file with its own hash) made the file
    ``shared``, exit 0, "OK". An installed RECORD never overrules the wheel: it stays ``modified``."""

    out = tmp_path / "w"
    out.mkdir()
    wheel = wheelhouse.make_wheel(
        out, "siownera", "1.0", {"sishared/core.py": b"A = 1\n", "siownera.py": b"x = 1\n"}
    )
    wheelhouse.uv_install(venv, wheel)
    site = wheelhouse.site_packages(venv)
    evil = b"import os\n"
    (site / "sishared" / "core.py").write_bytes(evil)
    digest = base64.urlsafe_b64encode(hashlib.sha256(evil).digest()).rstrip(b"=").decode()
    fake = site / "zzfake-1.0.dist-info"
    fake.mkdir()
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: zzfake\nVersion: 1.0\n")
    (fake / "RECORD").write_text(
        f"sishared/core.py,sha256={digest},{len(evil)}\nzzfake-1.0.dist-info/METADATA,,\nzzfake-1.0.dist-info/RECORD,,\n"
    )
    result = run("siownera", "--verify-only", "--wheel", str(wheel), "--python", str(venv), "--json")
    assert result.code == 1, result.stdout
    (finding,) = [f for f in result.json["data"]["findings"] if f["path"].endswith("core.py")]
    assert finding["kind"] == "modified" and finding["drift"] is True
    assert "does not overrule the wheel" in finding["detail"]
    # against the RECORDs alone, the file is the other distribution's, as before
    assert run("siownera", "--verify-only", "--python", str(venv)).code == 0


def test_a_file_two_records_list_belongs_to_the_one_whose_copy_is_there(venv: Path, tmp_path: Path) -> None:
    shared = wheelhouse.two_owners(venv, tmp_path / "owners")[0]
    assert shared.read_bytes() == b"B = 2\n"
    result = run("--verify-only", "--all", "--python", str(venv), "--json")
    assert result.code == 0, result.stdout  # not drift
    (finding,) = result.json["data"]["findings"]
    assert finding["kind"] == "shared" and finding["drift"] is False
    assert finding["distribution"] == "siownera" and finding["shared_with"] == "siownerb"
    assert "siownerb 1.0 lists it too" in finding["detail"]
    named = run("siownera", "--verify-only", "--python", str(venv), "--json")  # the others read too
    assert named.code == 0 and [f["kind"] for f in named.json["data"]["findings"]] == ["shared"]
    assert run("siownerb", "--verify-only", "--python", str(venv), "--json").json["data"]["findings"] == []
    human = run("--verify-only", "--all", "--python", str(venv))
    assert human.code == 0
    assert "1 file of siownera holds siownerb's copy" in human.stderr and "not drift" in human.stderr
    shared.write_text("C = 3\n")  # neither's: drift of both, each naming the other
    doc = run("--verify-only", "--all", "--python", str(venv), "--json").json
    assert doc["exit_code"] == 1
    details = {f["distribution"]: f["detail"] for f in doc["data"]["findings"]}
    assert {f["kind"] for f in doc["data"]["findings"]} == {"modified"}
    assert "siownerb 1.0 lists it too, and it matches neither" in details["siownera"]
    assert "siownera 1.0 lists it too, and it matches neither" in details["siownerb"]


def test_a_file_whose_wheel_lied_in_its_record_is_a_wheel_fault(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """uv installs a wheel whose RECORD does not match a member (pynvvideocodec 2.0.4) without a word;
    the file was never changed since (its ctime no newer than its RECORD's): ``wheel-fault``, exit 5,
    not drift, saying how to settle it; with the wheel it is wheel-record (issue 46 item 4)."""
    (tmp_path / "w").mkdir()
    broken = wheelhouse.rewrite_record_hash(
        wheels["sipure-1"], tmp_path / "w" / wheels["sipure-1"].name, "sipure/cli.py"
    )
    wheelhouse.uv_install(venv, broken)
    # root's first sight explains nothing away (the RECORD's ctime is anchored then): drift once
    first = run("sipure", "--verify-only", "--python", str(venv), "--json")
    assert first.code == 1 and [f["kind"] for f in first.json["data"]["findings"]] == ["modified"]
    result = run("sipure", "--verify-only", "--python", str(venv), "--json")
    doc = result.json
    (finding,) = doc["data"]["findings"]
    assert result.code == doc["exit_code"] == 5 and doc["status"] == "wheel-fault", doc
    assert finding["kind"] == "wheel-fault" and not finding["drift"] and not finding["acknowledged"]
    assert "the wheel's own RECORD is wrong about it" in finding["detail"]
    # a command that runs as said: the package named (without it: "no PACKAGE given", exit 2)
    assert "(safeinstall sipure --verify-only --acknowledge-wheel-faults [--python PY])" in finding["detail"]
    assert doc["data"]["summary"]["wheel_faults"] == 1 and doc["data"]["summary"]["drift"] == 0
    # on a terminal the hint is said once, not under each file (issue 37)
    human = run("sipure", "--verify-only", "--python", str(venv))
    assert human.code == 5 and "WHEEL FAULT" in human.stdout
    assert "the wheel's own RECORD is wrong" not in human.stdout and human.stderr.count("hint: ") == 1
    assert "not changed since it was installed (its inode no newer than its RECORD)" in human.stdout
    with_wheel = run("sipure", "--verify-only", "--python", str(venv), "--wheel", str(broken), "--json")
    assert with_wheel.code == 0 and {f["kind"] for f in with_wheel.json["data"]["findings"]} == {
        "wheel-record"
    }
    edited = site(venv) / "sipure" / "__init__.py"
    edited.write_text(edited.read_text() + "# patched\n")
    doc = run("sipure", "--verify-only", "--python", str(venv), "--json").json
    found = {os.path.basename(f["path"]): f["kind"] for f in doc["data"]["findings"]}
    assert found == {"__init__.py": "modified", "cli.py": "wheel-fault"} and doc["exit_code"] == 1


def test_a_wheel_fault_acknowledged_is_quiet_until_its_file_changes(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """Root acknowledges the wheel's fault once (``--acknowledge-wheel-faults``, kept in its state by the
    file's identity and sha256): exit 0 after, still listed as acknowledged; a change to the file (its
    content, or the same size with its mtime set back) is drift again, never the wheel's fault."""
    (tmp_path / "w").mkdir()
    broken = wheelhouse.rewrite_record_hash(
        wheels["sipure-1"], tmp_path / "w" / wheels["sipure-1"].name, "sipure/cli.py"
    )
    wheelhouse.uv_install(venv, broken)
    check = ("--verify-only", "--all", "--python", str(venv), "--json")
    assert run(*check).code == 1  # root's first sight: the RECORD's ctime anchored, nothing explained away
    assert run(*check).code == 5
    refused = run(
        "sipure", "--verify-only", "--python", str(venv), "--wheel", str(broken), "--acknowledge-wheel-faults"
    )
    assert refused.code == 2 and "--acknowledge-wheel-faults goes with --verify-only" in refused.stderr
    acknowledging = run(*check, "--acknowledge-wheel-faults")
    assert acknowledging.code == 0 and acknowledging.json["status"] == "clean", acknowledging.stdout
    (finding,) = acknowledging.json["data"]["findings"]
    assert finding["kind"] == "wheel-fault" and finding["acknowledged"]
    later = run(*check)
    (finding,) = later.json["data"]["findings"]
    assert later.code == 0 and finding["acknowledged"] and later.json["data"]["summary"]["wheel_faults"] == 0
    human = run("--verify-only", "--all", "--python", str(venv))
    assert (
        human.code == 0 and "wheel-fault, acknowledged" in human.stderr and "WHEEL FAULT" not in human.stdout
    )
    cli = site(venv) / "sipure" / "cli.py"
    before = cli.stat()
    text = cli.read_bytes()
    cli.write_bytes(bytes([text[0] ^ 1]) + text[1:])  # the same size, its mtime set back
    os.utime(cli, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert cli.stat().st_mtime_ns == before.st_mtime_ns and cli.stat().st_size == before.st_size
    edited = run(*check)
    (finding,) = edited.json["data"]["findings"]
    assert edited.code == 1 and finding["kind"] == "modified" and not finding["acknowledged"], edited.stdout
    cli.write_bytes(text)  # its very bytes back: a new ctime, still never the wheel's fault again
    again = run(*check)
    (finding,) = again.json["data"]["findings"]
    assert again.code == 1 and finding["kind"] == "modified"
    # the owner edits it and then touches RECORD (its ctime newer): root's anchor keeps the RECORD's
    # ctime as first seen, so the edit is drift, never the wheel's fault (the review)
    cli.write_bytes(bytes([text[0] ^ 1]) + text[1:])
    record = next(site(venv).glob("sipure-*.dist-info")) / "RECORD"
    os.chmod(record, record.stat().st_mode)
    touched = run(*check)
    (finding,) = touched.json["data"]["findings"]
    assert touched.code == 1 and finding["kind"] == "modified" and not finding["acknowledged"]


def test_an_edit_is_never_the_wheels_fault_by_a_record_touched_after_roots_first_check(env: Path) -> None:
    """The owner edits a file after root's first check, then touches its RECORD (a ``chmod``: a ctime
    newer than the edit's): drift (exit 1), never a ``wheel-fault`` that ``--acknowledge-wheel-faults``
    would quiet for ever; the RECORD's ctime is the one root anchored (the review)."""
    check = ("--verify-only", "--all", "--python", str(env), "--json")
    assert run(*check).code == 0
    edited = site(env) / "sipure" / "__init__.py"
    edited.write_text(edited.read_text() + "import os; os.system('id')\n")
    record = next(site(env).glob("sipure-*.dist-info")) / "RECORD"
    os.chmod(record, record.stat().st_mode)
    found = run(*check, "--acknowledge-wheel-faults")
    kinds_found = {os.path.basename(f["path"]): f["kind"] for f in found.json["data"]["findings"]}
    assert found.code == 1 and kinds_found == {"__init__.py": "modified"}, found.stdout
    assert run(*check).code == 1


def test_an_edit_is_never_the_wheels_fault_by_a_dist_info_renamed_after_roots_first_check(env: Path) -> None:
    """The owner edits a file, renames the ``.dist-info`` (another spelling of the same name) and writes
    its RECORD anew for it: a ``.dist-info`` root never anchored, first seen with that RECORD's ctime
    (the review)."""
    check = ("--verify-only", "--all", "--python", str(env), "--json")
    assert run(*check).code == 0
    edited = site(env) / "sipure" / "__init__.py"
    edited.write_text(edited.read_text() + "import os; os.system('id')\n")
    old = next(site(env).glob("sipure-*.dist-info"))
    new = old.with_name(old.name.upper().replace(".DIST-INFO", ".dist-info"))
    old.rename(new)
    record = new / "RECORD"
    record.write_text(record.read_text().replace(f"{old.name}/", f"{new.name}/"))
    found = run(*check, "--acknowledge-wheel-faults")
    kinds_found = {os.path.basename(f["path"]): f["kind"] for f in found.json["data"]["findings"]}
    assert found.code == 1 and kinds_found.get("__init__.py") == "modified", found.stdout


def test_a_fresh_install_that_differs_from_its_record_fails_a_runs_verification(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """What a run installed (a dependency checked against its RECORD, a staged tree, an undo's restore)
    must match its RECORD: a file that differs is a failure, though its ctime (a fresh install's) is never
    newer than the RECORD's; ``wheel-fault`` settles only ``--verify-only`` (the review)."""
    from safeinstall.env.environment import inspect_environment
    from safeinstall.env.verify import verify_environment
    from safeinstall.run.parts.staging import INSTALL_FAILURES

    (tmp_path / "w").mkdir()
    broken = wheelhouse.rewrite_record_hash(
        wheels["sipure-1"], tmp_path / "w" / wheels["sipure-1"].name, "sipure/cli.py"
    )
    wheelhouse.uv_install(venv, broken)
    report = verify_environment(inspect_environment(venv), ["sipure"])  # a run's: never the wheel's fault
    assert [f.kind.value for f in report.findings if f.kind in INSTALL_FAILURES] == ["modified"]


def test_warnings_are_summarised_once_per_kind(venv: Path, wheels: Wheelhouse) -> None:
    wheelhouse.uv_install(venv, wheels["sipure-1"], wheels["sins-a"], wheels["sins-b"], link_mode="hardlink")
    result = run("--verify-only", "--all", "--python", str(venv))
    assert result.code == 0
    assert result.stderr.count("share their inode") == 1, result.stderr
    assert "of 3 distributions" in result.stderr and "-v lists them" in result.stderr
    assert "distributions," in result.stdout and "sins-a 1.0" not in result.stdout  # no clean line each
    verbose = run("--verify-only", "--all", "--python", str(venv), "-v")
    listed = [line for line in verbose.stderr.splitlines() if line.startswith("hardlinked ")]
    doc = run("--verify-only", "--all", "--python", str(venv), "--json").json
    assert len(listed) == len(doc["data"]["findings"]) > 3
    assert "sins-a 1.0" in verbose.stdout
    quiet = run("--verify-only", "--all", "--python", str(venv), "-q")
    assert quiet.code == 0 and quiet.stderr == ""
    both = run("--verify-only", "--all", "--python", str(venv), "-q", "-v")
    assert both.code == 2 and "error:" in both.stderr


def test_an_anchor_is_keyed_by_a_name_and_version_a_directory_name_could_hold(tmp_path: Path) -> None:
    """Root's anchors are keyed by the METADATA's name and version: another spelling of the same is the
    same key; one no directory name could hold (a path, a name of megabytes, which would fill root's
    store of anchors until none is kept) has no anchor (the review)."""
    from safeinstall.env.distributions import InstalledDistribution
    from safeinstall.env.records import Record
    from safeinstall.run.commands.verifyonly import anchor_key

    def dist(name: str, version: str, directory: str) -> InstalledDistribution:
        site = tmp_path / "site"
        return InstalledDistribution(
            name, name, version, site, site / directory, Record((), ()), (), None, ()
        )

    key = anchor_key(dist("sipure", "1.0", "sipure-1.0.dist-info"))
    assert key == str(tmp_path / "site" / "sipure-1.0.dist-info")
    assert anchor_key(dist("sipure", "1.00", "SIPURE-1.0.dist-info")) == key
    assert anchor_key(dist("sipure", "../../x", "sipure-1.0.dist-info")) is None
    assert anchor_key(dist("s" * 300, "1.0", "s-1.0.dist-info")) is None


def test_a_run_that_reinstalls_a_distribution_leaves_its_anchor_to_the_next_check(
    env: Path, wheels: Wheelhouse
) -> None:
    """Root's own run installs a new RECORD (another inode): the anchor of the old one would keep that
    distribution from its install window and its wheel faults for ever; the run drops it, verified, and
    the next check anchors the new RECORD."""
    from safeinstall.store.anchors import read_anchors

    root, prefix = Path(os.environ["SAFEINSTALL_STATE_DIR"]), env.parent.parent

    def sipure_anchor() -> Any:
        kept, _ = read_anchors(root, prefix)
        return next(
            (a for key, a in (kept or {}).items() if os.path.basename(key).startswith("sipure-")), None
        )

    check = ("--verify-only", "--all", "--python", str(env), "--json")
    assert run(*check).code == 0
    first = sipure_anchor()
    assert first is not None
    reinstalled = run("sipure", "--wheel", str(wheels["sipure-1"]), "--python", str(env), "--yes", "--json")
    assert reinstalled.code == 0, reinstalled.stdout + reinstalled.stderr
    record = next(site(env).glob("sipure-*.dist-info")) / "RECORD"
    assert record.stat().st_ino != first.inode
    assert sipure_anchor() is None
    assert run(*check).code == 0
    again = sipure_anchor()
    assert again is not None and again.inode == record.stat().st_ino


def test_a_wheels_install_locations_are_worked_out_once_per_environment(tmp_path: Path) -> None:
    """A run asks where each of the wheel's members lands four times (the landing check, the directories
    it writes, the verify's plan, the vouched files): 12k members for torch, worked out once, each caller
    given its own copy; another environment (or wheel) has its own."""
    from safeinstall.env import wheel as wheels
    from safeinstall.env.environment import inspect_environment

    wheel_path = wheelhouse.make_wheel(
        tmp_path, "sidata", "1.0", {"sidata/__init__.py": b"", "sidata-1.0.data/scripts/hello": b"x\n"}
    )
    wheel = wheels.read_wheel(wheel_path)
    env = inspect_environment(wheelhouse.make_venv(tmp_path / "v"))
    other = inspect_environment(wheelhouse.make_venv(tmp_path / "w"))
    first = wheels.install_locations(wheel, env)
    used = wheels._ALL_LOCATIONS_USED[0]
    first["sidata/__init__.py"] = "elsewhere"  # a caller's own copy
    again = wheels.install_locations(wheel, env)
    assert wheels._ALL_LOCATIONS_USED[0] == used + 1
    assert again["sidata/__init__.py"] == os.path.join(env.purelib, "sidata", "__init__.py")
    assert again["sidata-1.0.data/scripts/hello"] == os.path.join(env.scripts, "hello")
    assert wheels.install_locations(wheel, other)["sidata-1.0.data/scripts/hello"] == os.path.join(
        other.scripts, "hello"
    )
    assert wheels._ALL_LOCATIONS_USED[0] == used + 1
    assert wheels.install_locations(wheel, env, ["sidata/__init__.py"]) == {
        "sidata/__init__.py": again["sidata/__init__.py"]
    }


def test_containment_says_what_lies_inside_the_prefix_lexically_and_through_links(tmp_path: Path) -> None:
    """What the staging plan, the backup and the verify ask of every RECORD path (12k for torch,
    normalised once each): inside lexically and once its directory's links are resolved."""
    from safeinstall.env.containment import Containment

    prefix = tmp_path / "venv"
    (prefix / "lib" / "pkg").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (prefix / "lib" / "out").symlink_to(tmp_path / "elsewhere")
    (prefix / "lib" / "in").symlink_to(prefix / "lib" / "pkg")
    for root in (str(prefix), f"{prefix}/"):
        inside = Containment(Path(root))
        assert inside.relative(f"{prefix}/lib/pkg/a.py") == "lib/pkg/a.py"
        assert inside.relative(prefix / "lib" / "pkg" / ".." / "pkg" / "./a.py") == "lib/pkg/a.py"
        assert inside.relative(f"{prefix}/lib/in/a.py") == "lib/in/a.py"  # a link that stays inside
        assert inside.relative(f"{prefix}/lib/out/a.py") is None  # its directory resolves outside
        assert inside.relative(f"{prefix}/lib/../../x") is None
        assert inside.relative(str(prefix)) is None and inside.relative(f"{prefix}/") is None
        assert inside.relative(f"{prefix}x/a.py") is None  # a sibling whose name starts with the prefix's
