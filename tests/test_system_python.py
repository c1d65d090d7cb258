"""The host's own Python (issue 28): this machine's Debian ``/usr/bin/python3``, real dpkg, its real
PEP 668 marker, and a venv made with ``--system-site-packages`` from it.

What the tests add to the system (a package from apt, a wheel installed by pip with
``--break-system-packages``, a small .deb built here) they remove in their fixtures' teardown; what
was there before is left alone (a test that would have to change it is skipped).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from safeinstall.env.environment import Environment, inspect_environment
from safeinstall.env.systemsite import (
    dpkg_package_name,
    externally_managed,
    externally_managed_problem,
    marker_error_text,
    owners_in,
)
from safeinstall.env.uvplan import UvRequest, dry_run, uv_said
from safeinstall.errors import PlanError
from tests import wheelhouse
from tests.beds import printing_interpreter
from tests.clirun import run

SYSTEM_PYTHON = Path("/usr/bin/python3")
DPKG_INFO = Path("/var/lib/dpkg/info")


def _system_python() -> Path:
    if os.geteuid() != 0:
        pytest.skip("changes the system's Python: needs root")
    if not SYSTEM_PYTHON.is_file() or not DPKG_INFO.is_dir() or shutil.which("dpkg-query") is None:
        pytest.skip("no Debian system Python with dpkg here")
    return SYSTEM_PYTHON


def _purelib() -> Path:
    return inspect_environment(SYSTEM_PYTHON).purelib


def _installed_packages() -> set[str]:
    out = subprocess.run(
        ["dpkg-query", "-W", "-f", "${Package} ${db:Status-Status}\n"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    return {line.split()[0] for line in out.splitlines() if line.endswith(" installed")}


@pytest.fixture(scope="module", autouse=True)
def _system_python_alone() -> Iterator[None]:
    """This module changes the machine's system Python: another suite's runs of it wait (and it waits
    for theirs), so that two suites at once on one machine never see each other's packages."""
    with wheelhouse.system_python_held():
        yield


@pytest.fixture(scope="module")
def python3_yaml() -> Iterator[Path]:
    """dpkg's python3-yaml (PyYAML with a RECORD) in /usr/lib/python3/dist-packages: installed with apt
    when it is not there (then purged again, with what apt pulled in for it)."""
    _system_python()
    before = _installed_packages()
    if "python3-yaml" not in before:
        apt = subprocess.run(
            ["apt-get", "install", "-y", "-q", "--no-install-recommends", "python3-yaml"],
            capture_output=True,
            text=True,
            env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"},
            check=False,
        )
        if apt.returncode != 0:
            pytest.skip(f"python3-yaml is not installed and apt could not install it: {apt.stderr[-300:]}")
    yield Path("/usr/lib/python3/dist-packages")
    added = sorted(_installed_packages() - before)
    if added:
        subprocess.run(["apt-get", "purge", "-y", "-q", *added], check=True, capture_output=True)


@pytest.fixture
def pip_sipure(wheels: wheelhouse.Wheelhouse) -> Iterator[Path]:
    """sipure 1.0 installed into the system Python by pip (``--break-system-packages``: into
    /usr/local/lib/python3.X/dist-packages), uninstalled again after the test."""
    python = _system_python()
    purelib = _purelib()
    if list(purelib.glob("sipure-*.dist-info")):
        pytest.skip(f"sipure is already installed in {purelib}: not this test's to change")
    pip = [str(python), "-m", "pip"]
    if subprocess.run([*pip, "--version"], capture_output=True, check=False).returncode != 0:
        pytest.skip("the system Python has no pip (apt-get install python3-pip)")
    quiet = ["--break-system-packages", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", *quiet, "--no-deps", "--no-index", str(wheels["sipure-1"])], check=True)
    try:
        yield purelib
    finally:
        subprocess.run([*pip, "uninstall", "-y", *quiet, "sipure"], check=True, capture_output=True)


@pytest.fixture(scope="module")
def deb_without_record(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A real .deb (built here with dpkg-deb, installed with dpkg) whose distribution has no RECORD, as
    many a distribution's packages have; purged again."""
    _system_python()
    if shutil.which("dpkg-deb") is None or shutil.which("dpkg") is None:
        pytest.skip("no dpkg-deb here")
    if "python3-sitest" in _installed_packages():
        pytest.skip("python3-sitest is installed already: not this test's")
    root = tmp_path_factory.mktemp("deb") / "python3-sitest"
    site = root / "usr/lib/python3/dist-packages"
    (site / "sitest").mkdir(parents=True)
    (site / "sitest" / "__init__.py").write_text("VALUE = 1\n")
    (site / "sitest-1.0.dist-info").mkdir()
    (site / "sitest-1.0.dist-info" / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: sitest\nVersion: 1.0\n"
    )
    (site / "sitest_egg-1.0.egg-info").write_text("Metadata-Version: 1.1\nName: sitest-egg\nVersion: 1.0\n")
    (root / "DEBIAN").mkdir()
    (root / "DEBIAN" / "control").write_text(
        "Package: python3-sitest\nVersion: 1.0-1\nArchitecture: all\nMaintainer: safeinstall tests <t@t>\n"
        "Description: safeinstall test fixture (issue 28), safe to remove\n"
    )
    deb = root.parent / "python3-sitest.deb"
    subprocess.run(
        ["dpkg-deb", "--root-owner-group", "--build", str(root), str(deb)], check=True, capture_output=True
    )
    subprocess.run(["dpkg", "-i", str(deb)], check=True, capture_output=True)
    try:
        yield Path("/usr/lib/python3/dist-packages/sitest-1.0.dist-info")
    finally:
        subprocess.run(["dpkg", "--purge", "python3-sitest"], check=True, capture_output=True)


@pytest.fixture
def state(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state"), "COLUMNS": "400"}


def _by_name(document: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {d["name"]: d for d in document["data"]["distributions"]}


# ------------------------------------------------------------------------------- every site directory


def test_verify_all_finds_every_site_directory_of_the_system_python_and_says_which(
    python3_yaml: Path, pip_sipure: Path
) -> None:
    result = run("--verify-only", "--all", "--python", str(SYSTEM_PYTHON), "--json")
    assert result.code in (0, 1), result.stderr
    data = result.json["data"]
    assert str(python3_yaml) in data["site_dirs"] and str(pip_sipure) in data["site_dirs"]
    found = _by_name(result.json)
    assert found["pyyaml"]["site"] == str(python3_yaml)  # dpkg's: was not looked at
    assert found["pyyaml"]["system_package"] == {
        "manager": "dpkg",
        "package": "python3-yaml",
        "check": "debsums python3-yaml",
    }
    assert found["pyyaml"]["files_checked"] > 0  # verified against its RECORD
    assert found["sipure"]["site"] == str(pip_sipure) and found["sipure"]["system_package"] is None
    assert not found["sipure"]["drift"]
    # -v: every distribution (without it, --all lists only those with drift)
    text = run(
        "--verify-only", "--all", "-v", "--python", str(SYSTEM_PYTHON), env={**os.environ, "COLUMNS": "400"}
    )
    assert f"pyyaml 6.0 in {python3_yaml} (dpkg package python3-yaml: debsums python3-yaml checks it)" in (
        text.stdout.replace("\n", " ")
    )
    assert f"sipure 1.0 in {pip_sipure}: " in text.stdout


def test_one_distribution_of_dpkgs_is_found_and_verified(python3_yaml: Path) -> None:
    result = run("pyyaml", "--verify-only", "--python", str(SYSTEM_PYTHON), "--json")
    assert result.code in (0, 1), result.stderr  # Debian strips its libraries after writing RECORD
    (dist,) = result.json["data"]["distributions"]
    assert dist["site"] == str(python3_yaml) and dist["system_package"]["package"] == "python3-yaml"


def test_a_dpkg_distribution_without_record_is_dpkgs_to_check_not_drift(deb_without_record: Path) -> None:
    result = run("sitest", "--verify-only", "--python", str(SYSTEM_PYTHON), "--json")
    assert result.code == 0, result.stdout + result.stderr
    (dist,) = result.json["data"]["distributions"]
    assert dist["system_package"]["check"] == "debsums python3-sitest"
    assert dist["files_checked"] == 0 and result.json["data"]["findings"] == []
    text = run(
        "sitest", "--verify-only", "--python", str(SYSTEM_PYTHON), env={**os.environ, "COLUMNS": "400"}
    )
    assert "debsums python3-sitest checks it" in text.stdout and "nothing checked" in text.stdout
    assert "OK" not in text.stdout


def test_egg_info_distributions_are_said_not_to_be_checked(deb_without_record: Path) -> None:
    egg = deb_without_record.parent / "sitest_egg-1.0.egg-info"
    result = run("--verify-only", "--all", "--python", str(SYSTEM_PYTHON), "--json")
    assert str(egg) in result.json["data"]["egg_info"]
    assert "sitest-egg" not in {d["name"] for d in result.json["data"]["distributions"]}
    # -v: every distribution (without it, --all lists only those with drift)
    text = run(
        "--verify-only", "--all", "-v", "--python", str(SYSTEM_PYTHON), env={**os.environ, "COLUMNS": "400"}
    )
    assert ".egg-info distribution(s) have no RECORD and were not checked" in text.stderr


def test_a_check_that_found_nothing_says_so_and_is_not_clean(venv: Path) -> None:
    result = run("--verify-only", "--all", "--python", str(venv), "--json")
    assert result.code == 2, result.stdout
    (error,) = result.json["errors"]
    assert error["code"] == "nothing-to-check" and "no distribution to check" in error["message"]
    assert result.json["status"] != "clean"
    text = run("--verify-only", "--all", "--python", str(venv))
    assert text.code == 2 and "error: no distribution to check" in text.stderr and "hint:" in text.stderr


# ---------------------------------------------------------------------------- refusals before the stop


def test_a_reinstall_of_a_dpkg_distribution_is_refused_naming_the_system_package(
    python3_yaml: Path, state: dict[str, str]
) -> None:
    record = python3_yaml / "PyYAML-6.0.dist-info" / "RECORD"
    before = record.stat()
    for args in (("--dry-run",), ("--yes",), ("--yes", "--", "--break-system-packages")):
        result = run("pyyaml", "--python", str(SYSTEM_PYTHON), "--only-loaded", "--json", *args, env=state)
        assert result.code == 2, result.stdout + result.stderr
        (error,) = result.json["errors"]
        assert error["code"] == "system-package"
        assert "python3-yaml" in error["message"] and str(python3_yaml) in error["message"]
        assert "apt-get install --reinstall python3-yaml" in error["hint"] and "venv" in error["hint"]
        assert "nothing was stopped" in error["hint"]
    assert record.stat().st_mtime_ns == before.st_mtime_ns
    assert not list(Path(state["SAFEINSTALL_STATE_DIR"]).glob("*/backups/*"))  # no run got as far


def test_pep_668_is_refused_at_preflight_and_break_system_packages_lets_the_run_proceed(
    pip_sipure: Path, wheels: wheelhouse.Wheelhouse, state: dict[str, str]
) -> None:
    marker = inspect_environment(SYSTEM_PYTHON).stdlib
    if marker is None or not (marker / "EXTERNALLY-MANAGED").is_file():
        pytest.skip("this system Python has no PEP 668 marker")
    new = str(wheels["sipure-2"])
    # --only-loaded: any python3 of this machine's (another user's, started during the run) runs the
    # system environment's interpreter; the run is about sipure, which none of them loads
    system = ("--python", str(SYSTEM_PYTHON), "--only-loaded")
    refused = run("sipure", "--dry-run", *system, "--wheel", new, "--json", env=state)
    assert refused.code == 2, refused.stdout + refused.stderr
    (error,) = refused.json["errors"]
    assert error["code"] == "externally-managed"
    assert "PEP 668" in error["message"] and "EXTERNALLY-MANAGED" in error["message"]
    assert "-- --break-system-packages" in error["hint"] and str(pip_sipure) in error["hint"]
    plan = run(
        "sipure", "--dry-run", *system, "--wheel", new, "--json",
        "--", "--break-system-packages", env=state,
    )  # fmt: skip
    assert plan.code == 0, plan.stdout + plan.stderr
    assert plan.json["data"]["proceeds"] and "--break-system-packages" in plan.json["data"]["uv_command"]
    args = ("sipure", "--dry-run", *system, "--wheel", new, "--json")
    from_uvs_variable = run(*args, env={**state, "UV_BREAK_SYSTEM_PACKAGES": "1"})  # uv reads it too
    assert from_uvs_variable.code == 0, from_uvs_variable.stdout + from_uvs_variable.stderr
    done = run(
        "sipure", *system, "--wheel", new, "--yes", "--json",
        "--", "--break-system-packages", env=state,
    )  # fmt: skip
    assert done.code == 0, done.stdout + done.stderr
    assert [p.name for p in pip_sipure.glob("sipure-*.dist-info")] == ["sipure-2.0.dist-info"]
    check = run("sipure", "--verify-only", "--python", str(SYSTEM_PYTHON), "--json")
    assert check.code == 0 and check.json["data"]["distributions"][0]["version"] == "2.0"


def test_uvs_own_refusal_is_quoted_from_its_error_line_never_cut_in_a_word(
    pip_sipure: Path, wheels: wheelhouse.Wheelhouse
) -> None:
    env = inspect_environment(SYSTEM_PYTHON)
    if env.stdlib is None or not (env.stdlib / "EXTERNALLY-MANAGED").is_file():
        pytest.skip("this system Python has no PEP 668 marker")
    request = UvRequest(python=SYSTEM_PYTHON, package="sipure", wheel=wheels["sipure-2"])
    with pytest.raises(PlanError) as caught:
        dry_run(request)  # uv's own PEP 668 refusal (safeinstall's preflight refuses before this)
    said = caught.value.message.removeprefix("uv cannot resolve the install: ")
    assert said.startswith("error: The interpreter at"), said  # not "ronment at: /usr / error: ..."
    assert "externally managed" in said


def test_uv_said_shortens_at_a_word_boundary() -> None:
    output = (
        "Using Python 3.11.2 environment at: /usr\nerror: The interpreter at /usr is externally managed\n"
    )
    output += textwrap.fill("word " * 400) + "\n"
    said = uv_said(output, 300)
    assert said.startswith("error: The interpreter") and said.endswith(" …") and len(said) <= 300
    assert all(part in {"error:", "The", "interpreter", "at", "/usr", "is", "externally", "managed", "/",
                        "word", "…"} for part in said.split())  # fmt: skip
    assert uv_said("error: short\n  hint: do this\n") == "error: short / hint: do this"
    wrapped = (
        "error: No solution found\n  ╰─▶ Because sicext was not found and\n      you require it, we stop.\n"
    )
    assert uv_said(wrapped) == (  # issue 42: not " / " in the middle of uv's sentence
        "error: No solution found / ╰─▶ Because sicext was not found and you require it, we stop."
    )


# ------------------------------------------------------------------ a venv with the system site-packages


@pytest.fixture
def system_site_venv(tmp_path: Path, wheels: wheelhouse.Wheelhouse) -> Path:
    _system_python()
    venv = tmp_path / "venv"
    subprocess.run(
        [wheelhouse.UV, "venv", "-q", "--system-site-packages", "--python", str(SYSTEM_PYTHON), str(venv)],
        check=True,
        env=wheelhouse.uv_env(),
    )
    wheelhouse.uv_install(venv / "bin" / "python", wheels["sins-a"])
    return venv / "bin" / "python"


def test_a_system_site_packages_venv_shows_and_refuses_what_comes_from_the_base(
    system_site_venv: Path,
    python3_yaml: Path,
    pip_sipure: Path,
    wheels: wheelhouse.Wheelhouse,
    state: dict[str, str],
) -> None:
    result = run("--verify-only", "--all", "--python", str(system_site_venv), "--json")
    found = _by_name(result.json)
    assert found["pyyaml"]["from_base"] and found["pyyaml"]["site"] == str(python3_yaml)
    assert found["sipure"]["from_base"] and found["sipure"]["site"] == str(pip_sipure)
    assert not found["sipure"]["drift"]  # its files are checked within the base installation
    assert not found["sins-a"]["from_base"]
    text = run(
        "--verify-only",
        "--all",
        "-v",
        "--python",
        str(system_site_venv),
        env={**os.environ, "COLUMNS": "400"},
    )
    assert f"sipure 1.0 in {pip_sipure} (the base installation): " in text.stdout
    new = str(wheels["sipure-2"])
    refused = run(
        "sipure", "--dry-run", "--python", str(system_site_venv), "--wheel", new, "--json", env=state
    )
    assert refused.code == 2, refused.stdout + refused.stderr
    (error,) = refused.json["errors"]
    assert error["code"] == "system-package"
    assert "base installation /usr" in error["message"] and "shadows it" in error["message"]
    assert "--python" in error["hint"]
    dpkgs = run("pyyaml", "--dry-run", "--python", str(system_site_venv), "--json", env=state)
    assert dpkgs.code == 2 and "python3-yaml" in dpkgs.json["errors"][0]["message"]
    assert [p.name for p in pip_sipure.glob("sipure-*.dist-info")] == ["sipure-1.0.dist-info"]


def test_a_base_site_directory_another_account_controls_is_not_read_for_its_environment(
    nobody_interpreter: Path,
) -> None:
    """A service account's interpreter says its base installation is "/" with a site directory the
    account writes, holding a RECORD that names a file of root's: that directory is not looked in (root
    would hash the file and report its digest), only a base directory that root alone controls is."""
    top = nobody_interpreter.parent.parent
    site = top / "lib" / "python3.11" / "site-packages"
    site.mkdir(parents=True)
    fake = top / "base-site" / "evil-1.0.dist-info"
    fake.mkdir(parents=True)
    (fake / "METADATA").write_text("Metadata-Version: 2.1\nName: evil\nVersion: 1.0\n")
    (fake / "RECORD").write_text("../../../../../../../../etc/hostname,sha256=AAAA,1\n")
    answer = {
        "executable": str(nobody_interpreter),
        "prefix": str(top),
        "base_prefix": "/",
        "purelib": str(site),
        "platlib": str(site),
        "scripts": str(top / "bin"),
        "data": str(top),
        "base_site_dirs": [str(top / "base-site")],
        "version": [3, 11, 0],
        "implementation": "cpython",
        "soabi": None,
        "platform": "linux-x86_64",
    }
    printing_interpreter(nobody_interpreter, f"cat <<'EOF'\n{answer!r}\nEOF\n")
    result = run("--verify-only", "--all", "--python", str(nobody_interpreter), "--json")
    assert "evil" not in result.stdout and "/etc/hostname" not in result.stdout, result.stdout
    assert result.code == 2 and result.json["errors"][0]["code"] == "nothing-to-check"
    assert result.json["errors"][0]["message"].endswith(f"no .dist-info directory in {site}")


# ----------------------------------------------------------------------------------------- pure parts


def test_a_record_mismatch_dpkg_says_is_intact_is_a_warning_and_one_dpkg_flags_stays_drift(
    python3_yaml: Path,
) -> None:
    """Issue 37: Debian strips its libraries after writing RECORD, so every check of the host's Python
    alerted (exit 1), each file with the same long hint suggesting what is refused for dpkg's packages.
    A file dpkg's own md5sums say is intact is ``dpkg-intact`` (a warning, its hint once); one changed
    here, which dpkg flags too, stays ``modified``."""
    found = run("pyyaml", "--verify-only", "--python", str(SYSTEM_PYTHON), "--json")
    kinds = {f["path"]: f for f in found.json["data"]["findings"]}
    intact = [f for f in kinds.values() if f["kind"] == "dpkg-intact"]
    if not intact:
        pytest.skip("this python3-yaml matches its RECORD: nothing of Debian's to tell apart")
    assert found.code == 0 and found.json["status"] == "clean", found.stdout
    assert "dpkg's md5sums of python3-yaml say it is as the package shipped it" in intact[0]["detail"]
    assert all("--accept-record-mismatch" not in f["detail"] for f in kinds.values())
    text = run(
        "pyyaml", "--verify-only", "--python", str(SYSTEM_PYTHON), env={**os.environ, "COLUMNS": "400"}
    )
    assert text.code == 0 and text.stderr.count("hint: dpkg-intact") == 1, text.stderr
    changed = python3_yaml / "yaml" / "__init__.py"
    before = changed.read_bytes()
    try:
        changed.write_bytes(before + b"# changed here\n")
        flagged = run("pyyaml", "--verify-only", "--python", str(SYSTEM_PYTHON), "--json")
    finally:
        changed.write_bytes(before)
    assert flagged.code == 1, flagged.stdout
    (drift,) = [f for f in flagged.json["data"]["findings"] if f["path"] == str(changed)]
    assert drift["kind"] == "modified" and "dpkg's md5sums of python3-yaml differ too" in drift["detail"]


def test_dpkg_md5sums_are_read_as_dpkg_writes_them() -> None:
    from safeinstall.env.drift import Finding, FindingKind, against_dpkg
    from safeinstall.env.systemsite import md5sums_entries

    text = "bf7e4961ea6dc8d307c1cf05889427b2  usr/lib/a.py\nnot a line\nXYZ  usr/lib/b.py\n"
    assert md5sums_entries(text) == {"/usr/lib/a.py": "bf7e4961ea6dc8d307c1cf05889427b2"}
    modified = Finding("pyyaml", "/usr/lib/a.py", FindingKind.MODIFIED, "size 1, expected 2")
    assert against_dpkg(modified, True, "python3-yaml").kind == FindingKind.DPKG_INTACT
    assert not against_dpkg(modified, True, "python3-yaml").is_drift
    assert against_dpkg(modified, False, "python3-yaml").kind == FindingKind.MODIFIED
    assert "do not list it" in against_dpkg(modified, None, "python3-yaml").detail


def test_dpkg_list_files_name_their_package() -> None:
    assert dpkg_package_name("python3-yaml.list") == "python3-yaml"
    assert dpkg_package_name("libc6:amd64.list") == "libc6"
    assert dpkg_package_name("python3-yaml.md5sums") is None
    listing = "/.\n/usr\n/usr/lib/python3/dist-packages/PyYAML-6.0.dist-info\n"
    wanted = {"/usr/lib/python3/dist-packages/PyYAML-6.0.dist-info", "/usr/lib/other"}
    assert owners_in(listing, "python3-yaml", wanted) == {
        "/usr/lib/python3/dist-packages/PyYAML-6.0.dist-info": "python3-yaml"
    }


def test_the_pep_668_marker_error_is_read_as_pep_668_says() -> None:
    marker = (
        "[externally-managed]\nError=To install system-wide,\n try apt.\n\n See README.\n[other]\nError=no\n"
    )
    assert marker_error_text(marker) == "To install system-wide, try apt. See README."
    assert marker_error_text("[externally-managed]\n") == ""


def test_a_dependency_from_the_base_is_one_of_the_plans_refusals(
    system_site_venv: Path,
    pip_sipure: Path,
    wheels: wheelhouse.Wheelhouse,
    tmp_path: Path,
    state: dict[str, str],
) -> None:
    requiring = wheelhouse.with_requirement(wheels["sins-a"], tmp_path / "requiring", "sipure")
    install = [wheelhouse.UV, "pip", "install", "-q", "--offline", "--no-deps", "--reinstall", "--python"]
    subprocess.run(  # --no-deps: its sipure is the base's
        [*install, str(system_site_venv), str(requiring)],
        check=True,
        env=wheelhouse.uv_env(),
    )
    offline = ("--offline", "--find-links", str(wheels.directory))
    result = run(
        "sins-a", "--dry-run", "--with-deps", "--python", str(system_site_venv), "--wheel", str(requiring),
        "--json", "--", *offline, env=state,
    )  # fmt: skip
    assert result.code == 2, result.stdout + result.stderr
    refusals = result.json["data"]["refusals"]
    assert any("sipure 1.0 in " + str(pip_sipure) in r and "base installation /usr" in r for r in refusals), (
        refusals
    )
    assert [p.name for p in pip_sipure.glob("sipure-*.dist-info")] == ["sipure-1.0.dist-info"]


def test_the_plan_says_once_what_every_process_of_the_system_interpreter_shares(
    pip_sipure: Path, wheels: wheelhouse.Wheelhouse, state: dict[str, str]
) -> None:
    """Every process of /usr/bin/python3 is a possible user of the system environment (the same
    evidence rules as a venv's): the plan lists each in its table and says why once, not once each."""
    sleepers = [
        subprocess.Popen([str(SYSTEM_PYTHON), "-c", "import time; time.sleep(600)"]) for _ in range(3)
    ]
    try:
        args = ("sipure", "--dry-run", "--python", str(SYSTEM_PYTHON), "--wheel", str(wheels["sipure-2"]))
        plan = run(*args, "--json", "--", "--break-system-packages", env=state)
        processes = {p["pid"]: p for p in plan.json["data"]["processes"]}
        pids = [s.pid for s in sleepers]
        assert all(processes[pid]["evidence"] == ["environment"] for pid in pids), processes
        # at a glance: one row per process (its one reason); with -v, each piece of evidence once
        human = run(*args, "-v", "--", "--break-system-packages", env=state).stdout
        lines = [
            line
            for line in human.splitlines()
            if "runs the environment's interpreter" in line and line.lstrip().startswith("PID")
        ]
        assert len(lines) == 1, human
        assert lines[0].lstrip().startswith("PIDs ") and all(str(pid) in lines[0] for pid in pids)
    finally:
        for sleeper in sleepers:  # only what this test started, by PID
            sleeper.kill()
            sleeper.wait()


def _system_environment(stdlib: Path) -> Environment:
    """A system interpreter's environment (no venv: prefix and base prefix the same) whose standard
    library is ``stdlib``: where its PEP 668 marker lies."""
    prefix = stdlib.parent
    return Environment(
        python=prefix / "bin" / "python3",
        executable=prefix / "bin" / "python3",
        prefix=prefix,
        base_prefix=prefix,
        purelib=prefix / "site-packages",
        platlib=prefix / "site-packages",
        scripts=prefix / "bin",
        data=prefix,
        version=(3, 11, 2),
        implementation="cpython",
        soabi=None,
        platform="linux-x86_64",
        stdlib=stdlib,
    )


@pytest.mark.parametrize("marker", ["no-error-line", "fifo", "symlink"])
def test_a_marker_without_its_error_or_not_a_regular_file_still_refuses(tmp_path: Path, marker: str) -> None:
    """Issue 35: an ``EXTERNALLY-MANAGED`` marker that gives no ``Error=`` (PEP 668: the installer then
    uses its own message), or that is a FIFO or a symlink (never opened, never waited on), still makes
    the interpreter externally managed: the install is refused unless --break-system-packages."""
    stdlib = tmp_path / "lib" / "python3.11"
    stdlib.mkdir(parents=True)
    path = stdlib / "EXTERNALLY-MANAGED"
    if marker == "no-error-line":
        path.write_text("[externally-managed]\n")
    elif marker == "fifo":
        os.mkfifo(path)
    else:
        (tmp_path / "elsewhere").write_text("[externally-managed]\nError=from elsewhere\n")
        path.symlink_to(tmp_path / "elsewhere")
    env = _system_environment(stdlib)
    said = externally_managed(env)
    assert said == ""
    problem = externally_managed_problem(env, said, [], {})
    assert problem is not None and "externally managed" in problem.message
    assert externally_managed_problem(env, said, ["--break-system-packages"], {}) is None
