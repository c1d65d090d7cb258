"""The threat model, as attacks (docs/threat-model.md): what the state directory, a journal, a service
account's environment, option values and cgroup names can make safeinstall do as root. Nothing.

Each attack runs the real ``safeinstall`` (as root, as at boot) against real venvs made by uv with real
fixture wheels; each asserts the exact refusal (error line, exit code) and that nothing outside changed:
the interpreter a journal names never ran (it would leave a marker), the files it names are still there.
"""

from __future__ import annotations

import contextlib
import functools
import http.server
import json
import os
import shutil
import socketserver
import subprocess
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from safeinstall.env.environment import inspect_environment
from safeinstall.errors import StepFailed
from safeinstall.run.parts.options import RunOptions, option_problems
from safeinstall.store.journal import JournalUnit, Phase, advance, journal_to_dict, new_journal
from safeinstall.store.state import environment_key
from safeinstall.system.health import wait_healthy
from safeinstall.system.identity import ProcessId
from safeinstall.system.safefs import permitted
from tests import wheelhouse
from tests.bed_systemd import CGROUP_ROOTS, UserManager, wait_until
from tests.beds import NOBODY, fill_disk, printing_interpreter
from tests.clirun import Result, run
from tests.wheelhouse import Wheelhouse

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the attacks are on root")

OTHER_UID = NOBODY  # the service account that owns an environment, or a state directory
RUN_ID = "20261130T031201Z-1234"


# --------------------------------------------------------------------------------------------- helpers


class Attack:
    """One attacker's setting: a trap interpreter (it leaves a marker when run) and a victim file."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.marker = base / "ran-as-root"
        self.victim = base / "victim.conf"
        self.victim.write_text("precious\n")
        self.trap = base / "trap-python"
        self.trap.write_text(f"#!/bin/sh\ntouch {self.marker}\n")
        self.trap.chmod(0o755)

    def nothing_happened(self) -> None:
        assert not self.marker.exists(), "root ran what the attacker named"
        assert self.victim.read_text() == "precious\n", "root deleted or changed what the attacker named"


def journal_doc(prefix: Path, envdir: Path, /, **fields: Any) -> dict[str, Any]:
    """A journal as a run of ``prefix`` writes it (phase installing), with ``fields`` changed."""
    journal = new_journal(
        RUN_ID, ProcessId(1234, None), str(prefix / "bin" / "python"), str(prefix), "sipure", None, ["uv"]
    )
    journal = advance(journal, Phase.BACKED_UP, backup_dir=str(envdir / "backups" / RUN_ID))
    journal = advance(journal, Phase.INSTALLING)
    return {**journal_to_dict(journal), **fields}


def plant(root: Path, prefix: Path, /, **fields: Any) -> Path:
    """An environment directory under the state ``root`` with a journal; its directory."""
    envdir = root / environment_key(prefix)
    envdir.mkdir(parents=True, mode=0o700, exist_ok=True)
    root.chmod(0o700)
    (envdir / "prefix").write_text(f"{prefix}\n")
    (envdir / "prefix").chmod(0o600)
    path = envdir / "journal.json"
    path.write_text(json.dumps(journal_doc(prefix, envdir, **fields)))
    path.chmod(0o600)
    return envdir


def cli(state: Path, *args: str, env: dict[str, str] | None = None) -> Result:
    return run(*args, env={**(env or os.environ), "SAFEINSTALL_STATE_DIR": str(state)}, timeout=120)


def error_lines(result: Result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


@pytest.fixture
def attack(tmp_path: Path) -> Attack:
    return Attack(tmp_path)


# ------------------------------------------------- 1. the state directory: owner and modes, parents too


def _hostile_journal(attack: Attack, state: Path) -> Path:
    """A journal that names the trap as the interpreter and the victim as a gate to delete."""
    prefix = attack.base / "venv"
    return plant(state, prefix, python=str(attack.trap), gate=[str(attack.victim)])


WRITABLE = "it is mode 0777: every user may write to it"
FOREIGN = f"it is owned by uid {OTHER_UID}, not by root or uid 0 which runs safeinstall"

#: attack -> (what is attacked: root, parent, envdir or journal; how: writable, foreign or a special)
STATE_ATTACKS = {
    "state-dir-writable-by-others": ("root", "writable"),
    "state-dir-owned-by-another-user": ("root", "foreign"),
    "parent-writable-by-others-not-sticky": ("parent", "writable"),
    "parent-owned-by-another-user": ("parent", "foreign"),
    "environment-dir-writable-by-others": ("envdir", "writable"),
    "environment-dir-owned-by-another-user": ("envdir", "foreign"),
    "journal-writable-by-others": ("journal", "writable"),
    "journal-owned-by-another-user": ("journal", "foreign"),
    "journal-is-a-symlink": ("journal", "symlink"),
    "journal-is-a-fifo": ("journal", "fifo"),
    "journal-too-large": ("journal", "huge"),
}


def _do_state_attack(root: Path, envdir: Path, target: str, how: str) -> str:
    """Carry out one attack; the error line safeinstall must print."""
    path = {"root": root, "parent": root.parent, "envdir": envdir, "journal": envdir / "journal.json"}[target]
    if how == "writable":
        path.chmod(0o666 if target == "journal" else 0o777)
        reason = WRITABLE.replace("0777", "0666") if target == "journal" else WRITABLE
    elif how == "foreign":
        os.chown(path, OTHER_UID, OTHER_UID)
        reason = FOREIGN
    elif how == "symlink":
        elsewhere = root.parent / "elsewhere.json"
        path.rename(elsewhere)
        path.symlink_to(elsewhere)
        reason = "it is a symbolic link"
    elif how == "fifo":
        path.unlink()
        os.mkfifo(path, 0o600)
        reason = "it is not a regular file"
    else:
        path.write_text(path.read_text() + " " * (2 * 1024 * 1024))
        reason = f"it is {path.stat().st_size} bytes, more than the 1048576 such a file ever needs"
    if target == "journal":
        return f"error: refusing to read {path}: {reason}"
    if target == "parent":
        return f"error: refusing to use the state directory {root}: its parent {path}: {reason}"
    return f"error: refusing to use the state directory {path}: {reason}"


@pytest.mark.parametrize("command", ["--recover", "--status"])
@pytest.mark.parametrize("name", sorted(STATE_ATTACKS))
def test_untrusted_state_is_refused(attack: Attack, tmp_path: Path, name: str, command: str) -> None:
    """A state directory (or journal) that another user could have written: root acts on nothing in it,
    neither the interpreter it names nor the paths it says to delete, for --recover as for --status."""
    root = tmp_path / "home" / "state"
    root.parent.mkdir()
    envdir = _hostile_journal(attack, root)
    expected = _do_state_attack(root, envdir, *STATE_ATTACKS[name])
    result = cli(root, command)
    assert result.code == 2, result.stdout + result.stderr
    assert error_lines(result) == [expected]
    assert "Traceback" not in result.stderr
    attack.nothing_happened()
    assert (envdir / "journal.json").exists() or (envdir / "journal.json").is_symlink()


@pytest.mark.parametrize("command", ["--recover", "--status"])
def test_an_untrusted_environment_dir_is_refused_when_named_with_python(
    attack: Attack, sipure_venv: Path, tmp_path: Path, command: str
) -> None:
    root = tmp_path / "state"
    prefix = Path(os.path.realpath(sipure_venv.parent.parent))
    envdir = plant(root, prefix, gate=[str(attack.victim)])
    envdir.chmod(0o777)
    result = cli(root, command, "--python", str(sipure_venv))
    assert result.code == 2, result.stdout + result.stderr
    assert error_lines(result) == [f"error: refusing to use the state directory {envdir}: {WRITABLE}"]
    attack.nothing_happened()


def test_a_root_owned_sticky_parent_is_trusted(tmp_path: Path) -> None:
    """/tmp-like parents (root, mode 1777) are fine, as with OpenSSH's StrictModes."""
    sticky = tmp_path / "tmp"
    sticky.mkdir()
    sticky.chmod(0o1777)
    result = cli(sticky / "state", "--status", "--json")
    assert result.code == 0, result.stderr
    assert result.json["status"] == "idle"


# ---------------------------------------------------- 2. journal fields: each checked before it is used


def _fields(attack: Attack, venv: Path, envdir: Path) -> dict[str, tuple[dict[str, Any], str]]:
    prefix = Path(os.path.realpath(venv.parent.parent))
    config = Path(os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config")
    unit = {
        "name": "si-victim.service",
        "user_manager": True,
        "was_active": True,
        "unit_file_state": "enabled",
        "stopped": True,
        "restarted": False,
    }
    return {
        "python-outside-the-environment": (
            {"python": str(attack.trap)},
            f"its python {str(attack.trap)!r} is not the interpreter of {prefix} (PREFIX/bin/python*)",
        ),
        "gate-path-elsewhere": (
            {"units": [unit], "gate": [str(attack.victim)]},
            f"gate paths that are not the boot-gate drop-ins of its units: {str(attack.victim)!r}",
        ),
        "gate-path-of-a-unit-not-in-the-journal": (
            {
                "units": [unit],
                "gate": [str(config / "systemd/user/other.service.d/50-safeinstall-gate.conf")],
            },
            "gate paths that are not the boot-gate drop-ins of its units: "
            + repr(str(config / "systemd/user/other.service.d/50-safeinstall-gate.conf")),
        ),
        "backup-outside-the-state-directory": (
            {"backup_dir": str(attack.base)},
            f"its backup {str(attack.base)!r} is not this run's backup directory "
            f"{envdir / 'backups' / RUN_ID}",
        ),
        "unit-name-with-glob-characters": (
            {"units": [{**unit, "name": "si-*.service"}]},
            "unit names that are not valid systemd unit names: 'si-*.service'",
        ),
        "prefix-of-another-environment": (
            {"prefix": "/etc", "python": "/etc/bin/python"},
            f"its prefix /etc is not the environment this directory ({envdir.name}) is for",
        ),
        "run-id-that-walks-out": (
            {"run_id": "../../../etc"},
            "its run id '../../../etc' is not one safeinstall makes",
        ),
    }


FIELD_ATTACKS = [
    "python-outside-the-environment",
    "gate-path-elsewhere",
    "gate-path-of-a-unit-not-in-the-journal",
    "backup-outside-the-state-directory",
    "unit-name-with-glob-characters",
    "prefix-of-another-environment",
    "run-id-that-walks-out",
]


@pytest.mark.parametrize("name", FIELD_ATTACKS)
def test_journal_fields_are_validated_before_recover_acts(
    attack: Attack, sipure_venv: Path, tmp_path: Path, name: str
) -> None:
    """A journal in a trusted directory whose fields are not what a run of this environment writes:
    that environment is refused and listed (exit 2); another environment is still recovered."""
    root = tmp_path / "state"
    prefix = Path(os.path.realpath(sipure_venv.parent.parent))
    envdir = root / environment_key(prefix)
    changes, problem = _fields(attack, sipure_venv, envdir)[name]
    plant(root, prefix, **changes)
    # another environment, whose run died before it changed anything: recovered all the same
    other_prefix = Path(os.path.realpath(wheelhouse.make_venv(tmp_path / "other").parent.parent))
    other = plant(root, other_prefix)
    doc = json.loads((other / "journal.json").read_text())
    doc.update(phase="planned", backup_dir=None, history=doc["history"][:1])
    (other / "journal.json").write_text(json.dumps(doc))
    result = cli(root, "--recover")
    assert result.code == 2, result.stdout + result.stderr
    assert error_lines(result) == [f"error: refusing the run journal {envdir / 'journal.json'}: {problem}"]
    assert f"recovered run {RUN_ID} in {other_prefix} (died in phase planned)" in result.stdout
    assert not (other / "journal.json").exists() and (envdir / "journal.json").exists()
    attack.nothing_happened()
    status = cli(root, "--status")
    assert status.code == 2 and error_lines(status) == error_lines(result)


def test_a_wheel_outside_the_state_directory_is_not_read_again(sipure_venv: Path, tmp_path: Path) -> None:
    """--recover restores from the backup; the wheel the journal names outside the state directory
    (its download directory may have been rewritten since) is not opened: it is said."""
    from safeinstall.env.distributions import find_distribution, find_distributions
    from safeinstall.env.environment import inspect_environment
    from safeinstall.store.backup import create_backup

    root = tmp_path / "state"
    prefix = Path(os.path.realpath(sipure_venv.parent.parent))
    envdir = root / environment_key(prefix)
    fifo = tmp_path / "downloads" / "sipure-2.0-py3-none-any.whl"
    fifo.parent.mkdir()
    os.mkfifo(fifo)  # reading it would hang: it is never opened
    plant(root, prefix, wheel=str(fifo))
    env = inspect_environment(sipure_venv)
    create_backup(
        env,
        [find_distribution(env, "sipure", find_distributions(env))],
        envdir / "backups" / RUN_ID,
        (),
        installed=find_distributions(env),
    )
    result = cli(root, "--recover")
    assert result.code == 0, result.stdout + result.stderr
    assert (
        f"note: the wheel {fifo} is not the run's own copy in the state directory and was not read again"
    ) in result.stdout


# ------------------------------------------------- 3. no code of the target environment runs as root


def _pth(site: Path, marker: Path) -> None:
    (site / "zz-hostile.pth").write_text(f"import os; open({str(marker)!r}, 'w').write(str(os.geteuid()))\n")


def test_a_pth_file_does_not_run_as_root_even_for_verify_only(sipure_venv: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pth-ran"
    _pth(wheelhouse.site_packages(sipure_venv), marker)
    result = run("sipure", "--verify-only", "--python", str(sipure_venv))
    assert result.code == 0, result.stdout + result.stderr
    assert "sipure 1.0: " in result.stdout and "files checked against RECORD: OK" in result.stdout
    assert not marker.exists(), f"the .pth file ran, as uid {marker.read_text()}"


@pytest.fixture
def service_account_venv(wheels: Wheelhouse) -> Iterator[Path]:
    """A venv owned by another uid (a service account), on a base interpreter that uid can run."""
    base = shutil.which("python3.11", path="/usr/bin") or pytest.skip("no /usr/bin/python3.11")
    top = Path(tempfile.mkdtemp(prefix="si-svc-"))
    try:
        subprocess.run(
            [wheelhouse.UV, "venv", "--quiet", "--python", base, str(top / "venv")],
            check=True,
            capture_output=True,
            env=wheelhouse.uv_env(),
        )
        python = top / "venv" / "bin" / "python"
        wheelhouse.uv_install(python, wheels["sipure-1"])
        subprocess.run(["chown", "-R", f"{OTHER_UID}:{OTHER_UID}", str(top)], check=True)
        yield python
    finally:
        shutil.rmtree(top, ignore_errors=True)


def test_a_service_accounts_environment_is_probed_as_that_account(
    service_account_venv: Path, wheels: Wheelhouse
) -> None:
    top = service_account_venv.parent.parent.parent
    marker = top / "pth-ran"
    _pth(wheelhouse.site_packages(service_account_venv), marker)
    result = run("sipure", "--verify-only", "--python", str(service_account_venv))
    assert result.code == 0, result.stdout + result.stderr
    prefix = service_account_venv.parent.parent
    assert (
        f"note: the environment {prefix} belongs to uid {OTHER_UID}: its interpreter was asked for its paths "
        f"as uid {OTHER_UID}, never as root, and without site (no .pth file runs)"
    ) in result.stderr
    assert "files checked against RECORD: OK" in result.stdout
    assert not marker.exists()
    dry = run(
        "sipure",
        "--dry-run",
        "--python",
        str(service_account_venv),
        "--wheel",
        str(wheels["sipure-2"]),
        "--json",
    )
    assert dry.code == 0, dry.stdout + dry.stderr
    assert f"belongs to uid {OTHER_UID}" in dry.json["data"]["warnings"][0]


def test_a_state_directory_the_owner_cannot_reach_is_refused_before_anything(
    service_account_venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """uv runs as the environment's owner and must reach the run's uv cache in the state directory:
    one below a directory closed to the owner (pytest's are 0700) is refused, for a run and a dry run,
    before the wheel is copied or anything else is done (exit 2)."""
    closed = next(d for d in reversed(tmp_path.parents) if not d.stat().st_mode & 0o001)  # to others
    state = tmp_path / "state"
    for extra in ("--dry-run", "--yes"):
        result = cli(
            state, "sipure", extra, "--python", str(service_account_venv), "--wheel", str(wheels["sipure-2"])
        )
        assert result.code == 2, result.stdout + result.stderr
        assert (
            f"error: uv runs as uid {OTHER_UID}, the environment's owner, and could not reach the run's uv "
            f"cache in the state directory {state}: {closed} is mode 0700"
        ) in " ".join(result.stderr.split())
        assert not list(state.glob("*/wheels")) and not list(state.glob("*/journal.json"))  # nothing copied
    assert list(state.glob("*/history/*.json"))  # only the refused run's result, as for every refusal


def test_who_may_enter_or_write_a_directory() -> None:
    nobody = (OTHER_UID, OTHER_UID)
    assert permitted(0o40700, OTHER_UID, 0, nobody, 0o3)  # its owner
    assert not permitted(0o40577, OTHER_UID, 0, nobody, 0o3)  # its owner, without write: not others' bits
    assert permitted(0o40710, 0, OTHER_UID, nobody, 0o1) and not permitted(0o40701, 0, OTHER_UID, nobody, 0o1)
    assert permitted(0o40711, 0, 0, nobody, 0o1) and not permitted(0o40711, 0, 0, nobody, 0o3)
    assert not permitted(0o40700, 0, 0, nobody, 0o1)


def test_an_interpreter_that_lies_about_its_prefix_is_refused(sipure_venv: Path, tmp_path: Path) -> None:
    """A venv whose python answers for another prefix (root would then act there): refused."""
    fake = sipure_venv.parent / "python-liar"
    answer: dict[str, object] = {"executable": "/usr/bin/python3", "prefix": "/etc", "base_prefix": "/usr"}
    answer["purelib"] = "/etc"
    answer |= {"platlib": "/etc", "scripts": "/etc", "data": "/etc", "version": [3, 11, 0], "uid": 0}
    answer |= {"implementation": "cpython", "soabi": None, "platform": "linux-x86_64"}
    fake.write_text(f'#!/bin/sh\necho "{answer!r}"\n')
    fake.chmod(0o755)
    result = run("sipure", "--verify-only", "--python", str(fake))
    assert result.code == 2
    assert error_lines(result) == [
        f"error: refusing the environment of {fake}: it reports the prefix /etc, but its pyvenv.cfg is in "
        f"{sipure_venv.parent.parent}"
    ]


def _lying_probe(python: Path, prefix: Path, site: Path, *, uid: int = 0) -> None:
    """Make ``python`` answer the probe with ``prefix`` and ``site``, claiming to run as ``uid``; then hand
    its directory to the service account."""
    answer = {
        "executable": str(python),
        "prefix": str(prefix),
        "base_prefix": str(prefix),
        "purelib": str(site),
        "platlib": str(site),
        "scripts": str(prefix / "bin"),
        "data": str(prefix),
        "version": [3, 11, 0],
        "implementation": "cpython",
        "soabi": None,
        "platform": "linux-x86_64",
        "uid": uid,
    }
    printing_interpreter(python, f"cat <<'EOF'\n{answer!r}\nEOF\n")


def _own_site(top: Path, victim_site: Path) -> Path:
    """A copy of the victim's site-packages inside ``top`` (so that a check of it would pass)."""
    site = top / "lib" / "python3.11" / "site-packages"
    shutil.copytree(victim_site, site, symlinks=True)
    return site


#: how the service account's interpreter names what is not its own -> the refusal (TOP, VICTIM: prefixes)
NAMING_ATTACKS = {
    "another-prefix": "it reports the prefix VICTIM, but its interpreter TOP/bin/python is in TOP",
    "own-prefix-another-site": "it reports directories outside its prefix TOP: SITE, SITE",
    "own-prefix-site-symlinked-to-another": "it reports directories outside its prefix TOP: SITE, SITE",
    "a-third-accounts-directory": "it reports TOP/lib/python3.11/site-packages, owned by uid 4242: "
    f"neither its owner (uid {OTHER_UID}) nor root",
}


@pytest.mark.parametrize("name", sorted(NAMING_ATTACKS))
def test_a_service_accounts_interpreter_cannot_name_another_environment(
    sipure_venv: Path, nobody_interpreter: Path, name: str
) -> None:
    """No pyvenv.cfg, an interpreter its owner wrote: its answer must still be its own prefix (the one above
    its real binary's bin/), directories inside it, owned by it or root; else root would verify, back up,
    prune and restore the root-owned victim venv."""
    top = nobody_interpreter.parent.parent
    victim = Path(os.path.realpath(sipure_venv.parent.parent))
    victim_site = Path(os.path.realpath(wheelhouse.site_packages(sipure_venv)))
    if name == "another-prefix":
        _lying_probe(nobody_interpreter, victim, victim_site)
    elif name == "own-prefix-another-site":
        _lying_probe(nobody_interpreter, top, victim_site)
    elif name == "own-prefix-site-symlinked-to-another":
        (top / "lib" / "python3.11").mkdir(parents=True)
        (top / "lib" / "python3.11" / "site-packages").symlink_to(victim_site)
        _lying_probe(nobody_interpreter, top, top / "lib" / "python3.11" / "site-packages")
    else:
        site = _own_site(top, victim_site)
        _lying_probe(nobody_interpreter, top, site)
        subprocess.run(["chown", "-R", "4242:4242", str(site)], check=True)
    result = run("sipure", "--verify-only", "--python", str(nobody_interpreter))
    assert result.code == 2, result.stdout + result.stderr
    problem = NAMING_ATTACKS[name].replace("VICTIM", str(victim)).replace("SITE", str(victim_site))
    assert error_lines(result) == [
        f"error: refusing the environment of {nobody_interpreter}: {problem.replace('TOP', str(top))}"
    ]
    assert "sipure 1.0" not in result.stdout


def test_the_probe_is_said_to_run_as_the_uid_it_was_started_as(
    sipure_venv: Path, nobody_interpreter: Path
) -> None:
    """An interpreter that claims it ran as root is not believed: the note names the uid root started it
    as. (Its own prefix, a copy of the package inside it: accepted, and checked.)"""
    top = nobody_interpreter.parent.parent
    site = _own_site(top, Path(os.path.realpath(wheelhouse.site_packages(sipure_venv))))
    shutil.copy2(sipure_venv.parent / "sipure", top / "bin" / "sipure")
    _lying_probe(nobody_interpreter, top, site, uid=0)
    result = run("sipure", "--verify-only", "--python", str(nobody_interpreter))
    assert result.code == 0, result.stdout + result.stderr
    assert "files checked against RECORD: OK" in result.stdout
    assert (
        f"note: the environment {top} belongs to uid {OTHER_UID}: its interpreter was asked for its paths "
        f"as uid {OTHER_UID}, never as root, and without site (no .pth file runs)"
    ) in result.stderr


#: what the service account's interpreter prints instead of its answer -> what the error quotes of it
PROBE_ANSWERS = {
    "not-utf-8": ("printf '\\377\\376'", "'\ufffd\ufffd'"),
    "code-not-a-literal": (
        "echo \"__import__('os').system('touch /tmp/si-probe-ran')\"",
        "\"__import__('os').system('touch /tmp/si-probe-ran')",
    ),
    "nested-beyond-the-parser": ("printf '%.0s[' $(seq 1000)", "'[[[["),
    "a-float-in-the-version": ("echo \"{'version': [1e999, 11, 0]}\"", "\"{'version': [1e999, 11, 0]}"),
    "not-a-dict": ("echo '[1, 2]'", "'[1, 2]"),
    "a-path-not-a-string": ("echo \"{'executable': b'/x'}\"", "\"{'executable': b'/x'}"),
}


@pytest.mark.parametrize("name", sorted(PROBE_ANSWERS))
def test_whatever_the_interpreter_prints_is_read_as_a_literal_or_refused(
    nobody_interpreter: Path, name: str
) -> None:
    """The probe's answer is a Python literal (ascii()) read with ast.literal_eval: what a service
    account's interpreter prints instead (bytes that are not UTF-8, code, nesting past the parser's
    limits, a version of floats) is refused with an error and a hint, never run, never an internal
    error."""
    script, quoted = PROBE_ANSWERS[name]
    printing_interpreter(nobody_interpreter, script + "\n")
    result = run("sipure", "--verify-only", "--python", str(nobody_interpreter))
    assert result.code == 2, result.stdout + result.stderr
    first, hint = result.stderr.strip().splitlines()[-2:]
    assert first.startswith(f"error: {nobody_interpreter} printed something unexpected: {quoted}"), first
    assert hint == "hint: check that --python names a working Python 3 interpreter"
    assert "internal error" not in result.stderr and not Path("/tmp/si-probe-ran").exists()


@pytest.mark.parametrize("script", ["exec yes", "head -c 70000 /dev/zero | tr '\\0' 1"])
def test_an_interpreter_that_prints_more_than_an_answer_is_stopped(
    nobody_interpreter: Path, script: str
) -> None:
    """Root keeps at most 64 KiB of what the owner's interpreter prints (its answer is a few hundred
    bytes; parsed, a MiB of nested literals would cost root about 500 MB); then it is killed."""
    printing_interpreter(nobody_interpreter, script + "\n")
    result = run("sipure", "--verify-only", "--python", str(nobody_interpreter))
    assert result.code == 2, result.stdout + result.stderr
    assert error_lines(result) == [
        f"error: could not run {nobody_interpreter} as uid {OTHER_UID} (its owner): "
        f"it printed more than {64 << 10} bytes on stdout"
    ]


def test_the_probe_answers_in_ascii_whatever_its_paths_hold(tmp_path: Path) -> None:
    """A prefix whose name is not UTF-8 comes back from the probe intact (as surrogate escapes)."""
    prefix = Path(os.fsdecode(os.fsencode(str(tmp_path)) + b"/venv-\xff"))
    os.rename(wheelhouse.make_venv(tmp_path / "venv").parent.parent, prefix)  # uv makes none so named
    env = inspect_environment(prefix / "bin" / "python")
    assert os.fsencode(env.prefix).endswith(b"/venv-\xff") and env.purelib.is_relative_to(env.prefix)


# ---------------------------------------------------------- 4. values, URLs, names and text


VALUE_ATTACKS = {
    "settle-nan": (["--settle", "nan"], "--settle nan: seconds must be a finite number, 0 or more"),
    "settle-not-a-number": (
        ["--settle", "soon"],
        "--settle soon: seconds must be a finite number, 0 or more",
    ),
    "stop-timeout-infinite": (
        ["--stop-timeout", "inf"],
        "--stop-timeout inf: seconds must be a finite number more than 0",
    ),
    "stop-timeout-zero": (  # to systemd, TimeoutStopSec=0 is no timeout; here every stop would fail
        ["--stop-timeout", "0"],
        "--stop-timeout 0: seconds must be a finite number more than 0",
    ),
    "gpu-timeout-negative": (
        ["--gpu-timeout", "-1"],
        "--gpu-timeout -1: seconds must be a finite number, 0 or more",
    ),
    "health-timeout-nan": (
        ["--health-url", "http://127.0.0.1:9/health", "--health-timeout", "nan"],
        "--health-timeout nan: seconds must be a finite number more than 0",
    ),
    "keep-backups-negative": (
        ["--keep-backups", "-1"],
        "--keep-backups -1: keep a whole number of backups, at least 1 (the run's own)",
    ),
    "health-url-file": (
        ["--health-url", "file:///etc/shadow"],
        "--health-url file:///etc/shadow: only http:// and https:// URLs with a host are asked",
    ),
    # a new-user review: each passed, or was an internal error; a real run stopped the units first
    "health-url-port-too-large": (
        ["--health-url", "http://127.0.0.1:99999/"],
        "--health-url http://127.0.0.1:99999/: its port must be a number 1-65535",
    ),
    "health-url-token-not-shown": (  # SAFEINSTALL_HEALTH_URL keeps a token off the command line
        ["--health-url", "http://u:SECRET@127.0.0.1:99999/health?key=SECRET#SECRET"],
        "--health-url http://127.0.0.1:99999/health: its port must be a number 1-65535",
    ),
    "health-url-port-not-a-number": (
        ["--health-url", "http://127.0.0.1:abc/"],
        "--health-url http://127.0.0.1:abc/: its port must be a number 1-65535",
    ),
    "health-url-ipv6-unclosed": (
        ["--health-url", "http://[::1/"],
        "--health-url http://[::1/: not a URL (Invalid IPv6 URL)",
    ),
    "health-url-ipv6-not-an-address": (
        ["--health-url", "http://[zz]/"],
        "--health-url http://[zz]/: not a URL ('zz' does not appear to be an IPv4 or IPv6 address)",
    ),
    "health-url-space": (
        ["--health-url", "http://a b/"],
        "--health-url http://a b/: a URL has no spaces, control or non-ASCII characters "
        "(percent-encode them)",
    ),
    "health-url-newline": (  # refused, and said on one line (urlsplit would drop the newline)
        ["--health-url", "http://127.0.0.1\n:8000/"],
        "--health-url http://127.0.0.1\\x0a:8000/: a URL has no spaces, control or non-ASCII characters "
        "(percent-encode them)",
    ),
    "health-timeout-zero": (  # no answer can come in 0 s: the run stopped the units, then rolled back
        ["--health-url", "http://127.0.0.1:9/health", "--health-timeout", "0"],
        "--health-timeout 0: seconds must be a finite number more than 0",
    ),
    "smoke-timeout-zero": (
        ["--smoke-timeout", "0"],
        "--smoke-timeout 0: seconds must be a finite number more than 0",
    ),
}


@pytest.mark.parametrize("mode", ["run", "dry-run"])
@pytest.mark.parametrize("name", sorted(VALUE_ATTACKS))
def test_values_are_refused_before_anything(
    sipure_venv: Path, wheels: Wheelhouse, tmp_path: Path, name: str, mode: str
) -> None:
    args, message = VALUE_ATTACKS[name]
    state = tmp_path / "state"
    extra = ["--dry-run"] if mode == "dry-run" else ["--yes"]
    result = cli(
        state, "sipure", "--wheel", str(wheels["sipure-2"]), "--python", str(sipure_venv), *args, *extra
    )
    assert result.code == 2, result.stdout + result.stderr
    assert error_lines(result) == [f"error: {message}"]
    assert "SECRET" not in result.stdout + result.stderr  # a token is never said
    hint = result.stderr.splitlines()[-1]
    assert hint.startswith("hint: ") and hint[len("hint: ") :].strip()
    if name.startswith("stop-timeout"):
        assert "TimeoutStopSec" in hint
    assert not state.exists()  # nothing was touched, not even the state directory


def test_a_timeout_that_could_never_pass_is_refused_and_0_elsewhere_is_kept() -> None:
    """A new-user review: 0 s of --health-timeout, --smoke-timeout or --prepared-max-age can never
    pass (the run stopped the units, then rolled back); --settle 0 and --gpu-timeout 0 (no wait) can."""

    def said(**given: Any) -> list[str]:
        return [p.message for p in option_problems(RunOptions(package="x", **given))]

    assert said(settle=0.0, gpu_timeout=0.0) == []
    assert said(prepared_max_age=0.0) == ["--prepared-max-age 0: seconds must be a finite number more than 0"]
    assert said(health_timeout=0.0, smoke_timeout=-1.0) == [
        "--health-timeout 0: seconds must be a finite number more than 0",
        "--smoke-timeout -1: seconds must be a finite number more than 0",
    ]


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        if self.path == "/moved":
            self.send_response(302)
            self.send_header("Location", self.server.location)  # type: ignore[attr-defined]
            self.end_headers()
            return
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def health_server() -> Iterator[http.server.HTTPServer]:
    server = http.server.HTTPServer(("127.0.0.1", 0), _Health)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_a_health_redirect_to_another_host_is_not_healthy(health_server: http.server.HTTPServer) -> None:
    """A service's /health that redirects root's request to another host (here the same server under
    the name "localhost") is never counted as healthy; one to its own origin is followed."""
    port = health_server.server_address[1]
    health_server.location = f"http://localhost:{port}/health"  # type: ignore[attr-defined]
    with pytest.raises(StepFailed) as caught:
        wait_healthy(f"http://127.0.0.1:{port}/moved", 0.5)
    assert caught.value.message == (
        f"http://127.0.0.1:{port}/moved did not answer 200 within 0.5 s (last: HTTP 302 redirect to another "
        f"host (http://localhost:{port}/health), refused)"
    )
    health_server.location = f"http://127.0.0.1:{port}/health"  # type: ignore[attr-defined]
    wait_healthy(f"http://127.0.0.1:{port}/moved", 5)


class _RawAnswer(socketserver.StreamRequestHandler):
    """Answers any request with the server's ``head`` at once, then its ``trickle`` a byte every ``pace``
    seconds (until the client goes, or the server stops)."""

    server: _RawServer

    def handle(self) -> None:
        self.rfile.readline()
        try:
            self.wfile.write(self.server.head)
            for byte in self.server.trickle:
                if self.server.stopping.wait(self.server.pace):
                    return
                self.wfile.write(bytes([byte]))
        except OSError:
            return  # the client shut its socket: what a bounded health check does


class _RawServer(socketserver.ThreadingTCPServer):
    daemon_threads = True

    def __init__(self, head: bytes, trickle: bytes = b"", pace: float = 0.0) -> None:
        super().__init__(("127.0.0.1", 0), _RawAnswer)
        self.head, self.trickle, self.pace = head, trickle, pace
        self.stopping = threading.Event()


@contextlib.contextmanager
def raw_server(head: bytes, trickle: bytes = b"", pace: float = 0.0) -> Iterator[str]:
    """A real local HTTP server that answers as told; yields its /health URL."""
    server = _RawServer(head, trickle, pace)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/health"
    finally:
        server.stopping.set()
        server.shutdown()
        server.server_close()


def _outcome(url: str, timeout: float) -> BaseException | None:
    """What ``wait_healthy`` ended with (None: healthy); it must end within the harness's generous bound."""
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            wait_healthy(url, timeout)
            outcome.append(None)
        except StepFailed as exc:
            outcome.append(exc)

    waiter = threading.Thread(target=wait, daemon=True)
    waiter.start()
    waiter.join(30)
    assert outcome, f"the health check with --health-timeout {timeout:g} is still waiting after 30 s"
    return outcome[0]


def test_a_health_answer_trickled_a_byte_at_a_time_cannot_outlast_the_timeout() -> None:
    """A service that sends its 200 status line and then its headers a byte every half second (a whole
    minute; the answer would be healthy at its end) does not hold root's run: the wait fails within its
    1 s, not at the answer's end."""
    with raw_server(b"HTTP/1.1 200 OK\r\n", b"X-Slow: " + b"a" * 110 + b"\r\n\r\n", pace=0.5) as url:
        outcome = _outcome(url, 1)
    assert isinstance(outcome, StepFailed)
    assert outcome.message == (
        f"{url} did not answer 200 within 1 s (last: no complete answer in the time left)"
    )


def test_a_health_answer_with_oversized_headers_is_not_healthy() -> None:
    """90 KiB of headers (each within what http.client allows) after a 200: not read on, not healthy."""
    pad = b"".join(b"X-Pad-%02d: %s\r\n" % (n, b"a" * 1000) for n in range(90))
    with raw_server(b"HTTP/1.1 200 OK\r\n" + pad + b"\r\n") as url:
        outcome = _outcome(url, 1)
    assert isinstance(outcome, StepFailed)
    assert outcome.message == f"{url} did not answer 200 within 1 s (last: headers larger than 64 KiB)"


@pytest.fixture
def glob_cgroup() -> Iterator[Path]:
    """A real cgroup named like a unit with glob characters: ``/si-hostile-PID/si-*.service``."""
    unified = next((r for r in CGROUP_ROOTS if (r / "cgroup.subtree_control").exists()), None)
    if unified is None:
        pytest.skip("no cgroup2 hierarchy")
    top = unified / f"si-hostile-{os.getpid()}"
    cgroup = top / "si-*.service"
    cgroup.mkdir(parents=True)
    try:
        yield cgroup
    finally:
        for directory in (cgroup, top):
            wait_until(functools.partial(_gone, directory), 10, f"{directory} removed")


def _gone(directory: Path) -> bool:
    return not directory.exists() or _rmdir(directory)


def _rmdir(directory: Path) -> bool:
    try:
        directory.rmdir()
    except OSError:
        return False
    return True


def test_a_unit_name_with_glob_characters_from_a_cgroup_is_never_passed_to_systemctl(
    venv: Path, wheels: Wheelhouse, tmp_path: Path, glob_cgroup: Path, user_manager: UserManager
) -> None:
    wheelhouse.uv_install(venv, wheels["sicext-1"])
    user = subprocess.Popen([str(venv), "-c", "import sicext, time; time.sleep(120)"])
    try:
        (glob_cgroup / "cgroup.procs").write_text(f"{user.pid}\n")
        site = wheelhouse.site_packages(venv)
        wait_until(lambda: str(site) in Path(f"/proc/{user.pid}/maps").read_text(), 15, "sicext imported")
        args = ["sicext", "--user", "--python", str(venv), "--wheel", str(wheels["sicext-2"])]
        dry = cli(tmp_path / "state", *args, "--dry-run", env=user_manager.env)
        assert dry.code == 2, dry.stdout + dry.stderr
        refusal = (
            f"the cgroup /{glob_cgroup.parent.name}/si-*.service names 'si-*.service', which is not a "
            "valid systemd unit name: it is never passed to systemctl (it could match other units there) "
            "nor gated; stop its processes yourself"
        )
        assert f"  - {refusal}" in dry.stdout
        real = cli(tmp_path / "state", *args, "--yes", env=user_manager.env)
        assert real.code == 2
        assert error_lines(real) == [f"error: the run would refuse: {refusal}"]
        assert not list(user_manager.unit_dir.glob("*.d")) and user.poll() is None
    finally:
        user.kill()
        user.wait()


def test_rich_markup_in_names_and_paths_is_printed_not_interpreted(sipure_venv: Path, tmp_path: Path) -> None:
    result = run("evil[/]", "--verify-only", "--python", str(sipure_venv))
    assert result.code == 2 and "Traceback" not in result.stderr
    assert error_lines(result) == [
        "error: 'evil[/]' is not a requirement: "
        "Expected matching RIGHT_BRACKET for LEFT_BRACKET, after extras"
    ]
    marked = tmp_path / "evil[" / "]x"  # the path reads .../evil[/]x
    absent = marked / "[bold]venv" / "bin" / "python"
    missing = run("sipure", "--verify-only", "--python", str(absent))
    assert missing.code == 2 and "Traceback" not in missing.stderr
    assert str(absent) in missing.stderr
    emoji = tmp_path / ":warning:" / ":white_check_mark: OK" / "bin" / "python"  # not shown as signs
    named = run("sipure", "--verify-only", "--python", str(emoji))
    assert named.code == 2 and str(emoji) in named.stderr, named.stderr
    marked.mkdir(parents=True)
    marked.chmod(0o777)
    recover = cli(marked / "state", "--recover")
    assert recover.code == 2 and "Traceback" not in recover.stderr
    assert error_lines(recover) == [
        f"error: refusing to use the state directory {marked / 'state'}: its parent {marked}: "
        "it is mode 0777: every user may write to it"
    ]


# ------------------------------------------------------------------ 5. faults before the stop


def test_a_run_that_fails_before_the_stop_leaves_no_backup(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """The prefetch fails (a new dependency cannot be unpacked): exit 2, and this run's backup is gone."""
    wheelhouse.uv_install(venv, wheels["sicext-1"])
    v2, links = wheelhouse.with_broken_dependency(wheels["sicext-2"], tmp_path)
    state = tmp_path / "state"
    result = cli(
        state,
        "sicext",
        "--python",
        str(venv),
        "--wheel",
        str(v2),
        "--yes",
        "--json",
        "--",
        "--offline",
        "--find-links",
        str(links),
    )
    assert result.code == 2, result.stdout + result.stderr
    assert [(s["name"], s["status"]) for s in result.json["data"]["steps"]] == [
        ("preflight", "ok"),
        ("backup", "ok"),
        ("prefetch", "failed"),
    ]
    assert result.json["data"]["backup_dir"] is None
    assert [p.name for p in state.glob("*/backups/*")] == []
    assert not list(state.glob("*/journal.json"))


def test_the_space_check_counts_the_prefetch(
    venv: Path,
    wheels: Wheelhouse,
    tmp_path: Path,
    small_disk: Callable[[int], Path],
) -> None:
    """The backup fits on the state disk, the new version unpacked beside it does not: refused at
    preflight, before any backup is taken."""
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    blob = {"sipure/blob.bin": bytes(24 * 1024 * 1024)}  # the wheel (deflated) fits; unpacked, it does not
    big = wheelhouse.rebuilt(wheels["sipure-2"], tmp_path / "big", blob)
    state = small_disk(16) / "state"
    result = cli(state, "sipure", "--python", str(venv), "--wheel", str(big), "--yes")
    assert result.code == 2, result.stdout + result.stderr
    [line] = error_lines(result)
    assert line.startswith(
        "error: the run would refuse: the backup and the prefetch (the new version unpacked beside it, "
        "what uv writes there and a margin) needs 24."
    )
    assert (
        f"but {state / environment_key(Path(os.path.realpath(venv.parent.parent))) / 'backups'} has" in line
    )
    assert not list(state.glob("*/backups/*"))


def test_the_space_check_counts_what_uv_writes_in_the_runs_cache(
    venv: Path,
    wheels: Wheelhouse,
    small_disk: Callable[[int], Path],
) -> None:
    """The state directory on a disk of its own with room for the backup and the new version unpacked,
    160 KiB more: uv's interpreter query writes more than that in the run's cache (its scripts, its
    temporary files), and the run failed with uv's "No space left on device" (with units, in the
    window: exit 3). Now the margin is counted, and the run is refused at preflight with the figures."""
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    disk = small_disk(4)
    state = disk / "state"
    new = wheels["sipure-2"]
    fill_disk(disk, new.stat().st_size + 4096 + (160 << 10))  # the run's copy of the wheel, and 160 KiB
    try:
        result = cli(state, "sipure", "--python", str(venv), "--wheel", str(new), "--yes")
        assert result.code == 2, result.stdout + result.stderr
        [line] = error_lines(result)
        assert "the run would refuse: the backup and the prefetch" in line and "a margin) needs" in line, line
        assert (wheelhouse.site_packages(venv) / "sipure-1.0.dist-info").is_dir()
    finally:
        (disk / "filler").unlink()


def test_unit_names_are_checked_before_every_systemctl_call() -> None:
    """The systemctl layer takes nothing systemd would read as a pattern or an option."""
    from safeinstall.errors import SystemdError
    from safeinstall.system.cgroups import valid_unit_name
    from safeinstall.system.systemd import Systemd

    for name in ("foo*.service", "foo?.service", "foo[ab].service", "-x.service", "a b.service", "x"):
        assert not valid_unit_name(name)
        with pytest.raises(SystemdError, match="not a valid unit name"):
            Systemd(user=True, environ={"PATH": os.environ["PATH"]}).start(name)
    assert valid_unit_name("vllm@0.service") and valid_unit_name("a\\x2db.service")


def test_journal_json_is_what_the_run_writes(tmp_path: Path) -> None:
    """The journal written by a run passes the checks --recover applies (units of the user manager)."""
    from safeinstall.store.journal import journal_problems

    prefix = tmp_path / "venv"
    envdir = tmp_path / "state" / environment_key(prefix)
    unit = JournalUnit("si-a.service", True, True, "enabled", stopped=True)
    root = tmp_path / "config" / "systemd" / "user"
    doc = journal_doc(prefix, envdir)
    journal = advance(
        new_journal(RUN_ID, ProcessId(1, None), doc["python"], doc["prefix"], "sipure", None, ["uv"], [unit]),
        Phase.GATED,
        backup_dir=doc["backup_dir"],
        gate=[str(root / "si-a.service.d" / "50-safeinstall-gate.conf")],
    )
    assert journal_problems(journal, envdir, {True: (root,)}) == []


def test_a_uv_configuration_in_the_working_directory_or_above_is_never_read(
    venv: Path, wheels: Wheelhouse, tmp_path: Path
) -> None:
    """Row: anyone may put a `uv.toml` in `/tmp`, and a service account one in its own directories;
    uv discovers it in its working directory and every directory above, and would then take its index
    (and run the build backend of a source distribution found there) as root. uv runs in `/`: a
    configuration above the caller's directory (here one uv cannot even parse) changes nothing."""
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    above = tmp_path / "downloads"
    (above / "here").mkdir(parents=True)
    (above / "uv.toml").write_text("[pip]\nindex-url = 'http://127.0.0.1:9/simple'\nthis is not toml\n")
    (above / "pyproject.toml").write_text("[tool.uv]\nnot toml either = = =\n")
    args = ("sipure", "--wheel", str(wheels["sipure-2"]), "--python", str(venv), "--dry-run", "--json")
    result = run(
        *args, env={**os.environ, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state")}, cwd=above / "here"
    )
    assert result.code == 0, result.stdout + result.stderr
    assert result.json["status"] == "would-proceed"
