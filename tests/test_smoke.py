"""The new version exercised before anything stops (issue 34): a wheel whose extension module does not
load, or whose package raises at import, is refused (exit 2) while the service runs on, untouched.

Real units of the private manager, real wheels (``sicext`` 5: its C extension references an undefined
symbol; ``sicext`` 3: raises at import), the real uv; uid 65534 for a service account's environment.
"""

from __future__ import annotations

import dataclasses
import grp
import json
import os
import pwd
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from safeinstall.env import importcheck
from safeinstall.run.parts.options import RunOptions, option_problems
from safeinstall.system.systemd import parse_exec_context
from tests import wheelhouse
from tests.bed_nvml import FakeNvml
from tests.bed_systemd import Units, UserManager, wait_until
from tests.beds import (
    AS_ROOT,
    NOBODY,
    UNIT_TEXT,
    Bed,
    ServiceAccountBed,
    alive,
    chown_tree,
    maps_so,
    running_with,
    shared_interpreter_or_skip,
    smoke_escape_command,
)
from tests.clirun import Result


def _left_in_state(bed: Bed) -> list[str]:
    """The run's own directories (prefetch tree, shim, uv cache) still in the state directory."""
    return [p.name for p in bed.state.glob("*/*") if p.name.startswith(("prefetch-", "smoke-", "uv-cache-"))]


def _refused_before_the_stop(bed: Bed, unit: str, wheel: str, *extra: str) -> dict[str, Any]:
    main = bed.manager.main_pid(unit)
    before = bed.snapshot()
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels[wheel]), "--settle", "1", "--json", *extra)
    assert result.code == 2, result.stdout + result.stderr
    assert result.json["status"] == "error", result.json
    steps = [s["name"] for s in result.json["data"]["steps"]]
    assert steps[-1] == "smoke" and "stop" not in steps, steps
    assert bed.manager.main_pid(unit) == main  # never stopped
    assert bed.manager.active_state(unit) == "active"
    assert bed.snapshot() == before and bed.version() == "1.0"  # the old version untouched
    bed.no_trace()
    assert _left_in_state(bed) == []
    return dict(result.json)


def _planned(bed: Bed, command: str) -> Result:
    """The dry run (``--json``) of the update to sicext 2.0 with ``--smoke COMMAND``; it proceeds."""
    plan = bed.cli(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--dry-run", "--json", "--smoke", command
    )
    assert plan.code == 0, plan.stdout + plan.stderr
    return plan


def _checked(bed: Bed, command: str, more_env: dict[str, str] | None = None) -> tuple[Result, str]:
    """The run (``--json``) of the update to sicext 2.0 with ``--smoke COMMAND``, done; and what its smoke
    step says."""
    done = bed.safeinstall(
        "sicext",
        "--wheel",
        str(bed.wheels["sicext-2"]),
        "--settle",
        "1",
        "--json",
        "--smoke",
        command,
        more_env=more_env,
    )
    assert done.code == 0, done.stdout + done.stderr
    (step,) = [s for s in done.json["data"]["steps"] if s["name"] == "smoke"]
    return done, str(step["detail"])


def test_an_extension_module_with_an_undefined_symbol_is_refused_before_the_stop(bed: Bed) -> None:
    unit = bed.service("smoke-undefined")
    refused = _refused_before_the_stop(bed, unit, "sicext-5")
    message = refused["errors"][0]["message"]
    assert "sicext._native" in message and "undefined symbol: sicext_fixture_missing_symbol" in message, (
        message
    )
    # said once: the child's last lines of standard error only where they add to it (issue 42)
    assert message.count("undefined symbol: sicext_fixture_missing_symbol") == 1, message
    assert "--smoke-skip sicext._native" in refused["errors"][0]["hint"]
    # the running version was asked, and imports it: a regression (issue 43), still refused
    log = Path(refused["data"]["log_file"]).read_text()
    assert "the running version was asked about" in log, log
    # without the check, the same wheel is found broken only once the service is down: a rollback
    main = bed.manager.main_pid(unit)
    unchecked = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-5"]), "--settle", "1", "--no-smoke"
    )
    assert unchecked.code == 3, unchecked.stdout + unchecked.stderr
    assert bed.manager.main_pid(unit) != main and bed.version() == "1.0"


def test_a_package_that_raises_at_import_is_refused_before_the_stop(bed: Bed) -> None:
    unit = bed.service("smoke-raises")
    refused = _refused_before_the_stop(bed, unit, "sicext-3")
    message = refused["errors"][0]["message"]
    assert "sicext: ImportError: sicext 3.0 is broken on purpose" in message, message
    assert "nothing was stopped" in refused["errors"][0]["hint"]


def test_a_check_that_ran_too_long_says_to_raise_smoke_timeout(bed: Bed) -> None:
    """A new-user review: a check ended at ``--smoke-timeout`` gave a hint that did not name it."""
    unit = bed.service("smoke-slow")
    refused = _refused_before_the_stop(bed, unit, "sicext-2", "--smoke", "sleep 60", "--smoke-timeout", "5")
    assert "did not finish in 5 s (--smoke-timeout)" in refused["errors"][0]["message"], refused["errors"]
    assert "a larger --smoke-timeout than 5 s" in refused["errors"][0]["hint"], refused["errors"]


def test_a_run_whose_swap_is_dropped_checks_the_new_version_all_the_same(bed: Bed) -> None:
    """uv compiles bytecode into the staging tree (``UV_COMPILE_BYTECODE``): the swap is dropped, so
    the new version lies in no tree of its own; the check lays it out from the run's cache and refuses."""
    unit = bed.service("smoke-no-swap")
    main = bed.manager.main_pid(unit)
    result = bed.safeinstall(
        "sicext",
        "--wheel",
        str(bed.wheels["sicext-5"]),
        "--settle",
        "1",
        "--json",
        more_env={"UV_COMPILE_BYTECODE": "1"},
    )
    assert result.code == 2, result.stdout + result.stderr
    assert "undefined symbol" in result.json["errors"][0]["message"]
    assert "no swap" in Path(result.json["data"]["log_file"]).read_text()
    assert bed.manager.main_pid(unit) == main and bed.version() == "1.0"
    bed.no_trace()
    assert _left_in_state(bed) == []


#: what the checked command says of its session: ``_own_session`` judges it
_SESSION_PROBE = (
    "ctx=dict(sid=os.getsid(0), pid=os.getpid(), pidns=os.readlink('/proc/self/ns/pid'), "
    "ctty=int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[4])), "
)


def _own_session(ctx: dict[str, Any]) -> bool:
    """The check ran without a controlling terminal, in a session of its own: its own leader, or one
    outside the PID namespace it was given (``getsid`` says 0 there; so it can for the suite itself,
    in a container whose session began outside it)."""
    ours = os.readlink("/proc/self/ns/pid")
    leader = ctx["sid"] == ctx["pid"] or (ctx["sid"] == 0 and ctx["pidns"] != ours)
    return bool(ctx["ctty"] == 0 and leader)


def test_the_check_runs_with_the_units_environment_and_directory_without_a_gpu(
    bed: Bed, tmp_path: Path
) -> None:
    env_file = tmp_path / "unit.env"
    env_file.write_text(
        '# the unit\'s file\nSMOKE_FROM_FILE="from the file"\nSMOKE_BOTH=file\n'
        'PYTHONIOENCODING="utf-8"\nTZ=file\n'
    )
    workdir = tmp_path / "workdir"
    workdir.mkdir()
    report = tmp_path / "report.json"
    unit = bed.service(
        "smoke-context",
        Environment='SMOKE_FROM_UNIT=unit SMOKE_BOTH=unit CUDA_VISIBLE_DEVICES=0 "SMOKE_SPACED=two words" '
        "TZ=unit",
        EnvironmentFile=str(env_file),
        WorkingDirectory=str(workdir),
    )
    script = (
        "import json, os, sys, sicext; "
        f"json.dump(dict(env=dict(os.environ), cwd=os.getcwd(), sicext=sicext.__file__, "
        f"{_SESSION_PROBE}tty=os.path.exists('/proc/self/fd/0') and os.isatty(0), path=sys.path), "
        f"open({str(report)!r}, 'w'))"
    )
    command = f'python -c "{script}"'
    said = _planned(bed, command).json["data"]["smoke"]
    assert command in said and "sicext" in said and unit in said, said
    done, step = _checked(bed, command, more_env={"SMOKE_ROOTS_SECRET": "root's"})
    assert "3 module(s) of the new version imported" in step, step  # sicext, sicext.serve (its script's)
    seen = json.loads(report.read_text())
    env = seen["env"]
    assert (env["TZ"], env["PYTHONIOENCODING"]) == ("file", "utf-8")  # the file's over the unit's
    # naming no path, they reach a root check too (the attacker review, 4a, drops only what names a
    # path another user controls)
    assert (env["SMOKE_FROM_UNIT"], env["SMOKE_FROM_FILE"], env["SMOKE_BOTH"]) == (
        "unit",
        "from the file",
        "file",
    )
    assert env["SMOKE_SPACED"] == "two words"
    assert "not given to the check" not in "\n".join(done.json["data"]["notes"])
    assert env["CUDA_VISIBLE_DEVICES"] == "" and env["PYTHONDONTWRITEBYTECODE"] == "1"
    assert "SMOKE_ROOTS_SECRET" not in env  # nothing of root's environment but the locale
    assert seen["cwd"] == str(workdir)
    assert not seen["tty"] and _own_session(seen["ctx"])  # a session of its own, no terminal
    # the new version, from the run's own tree ahead of the environment's site-packages
    assert not seen["sicext"].startswith(str(bed.site)), seen["sicext"]
    assert bed.version() == "2.0"
    assert not list(workdir.iterdir())  # nothing written where it ran


def test_a_service_accounts_environment_is_checked_as_the_account(account: ServiceAccountBed) -> None:
    report = account.base / "report"
    report.mkdir()
    os.chown(report, NOBODY, NOBODY)
    # the unit's files: one the account may read, one only root may (a token): not given to the account
    shared, secret = account.base / "shared.env", account.base / "secret.env"
    shared.write_text("SMOKE_SHARED=yes\n")
    secret.write_text("SMOKE_SECRET=token\n")
    secret.chmod(0o600)
    settings = f"EnvironmentFile={shared}\nEnvironmentFile={secret}\n"
    unit = account.unit("smoke-account", text=UNIT_TEXT.replace("[Service]\n", "[Service]\n" + settings))
    main = account.manager.main_pid(unit)
    before = account.snapshot()
    script = (
        "import json, os, sicext; "
        f"json.dump(dict(env=dict(os.environ), ids=os.getresuid(), groups=os.getgroups(), "
        f"{_SESSION_PROBE}"
        f"sicext=sicext.__file__, tty=os.path.exists('/proc/self/fd/0') and os.isatty(0)), "
        f"open({str(report / 'seen.json')!r}, 'w')); "
        "print('\\x1b[2J[bold]the last words[/bold]', file=__import__('sys').stderr); raise SystemExit(3)"
    )
    result = account.safeinstall(
        "sicext",
        "--wheel",
        str(account.wheels["sicext-2"]),
        "--settle",
        "1",
        "--smoke",
        f'python -c "{script}"',
    )
    assert result.code == 2, result.stdout + result.stderr
    assert f"EnvironmentFile {secret} was not read as the check's account" in result.stderr
    logs = "".join(p.read_text() for p in account.state.glob("*/logs/*.log"))
    assert "smoke: " in logs and "SMOKE_SHARED" not in logs  # the unit's variables never in the log
    assert "exit 3" in result.stderr and "[bold]the last words[/bold]" in result.stderr  # as text
    assert "\x1b[2J" not in result.stderr and "\\x1b[2J" in result.stderr  # never a terminal's command
    seen = json.loads((report / "seen.json").read_text())
    assert seen["ids"][1] == NOBODY and seen["groups"] == [] and not seen["tty"], seen
    assert seen["env"]["SMOKE_SHARED"] == "yes" and "SMOKE_SECRET" not in seen["env"]
    assert _own_session(seen["ctx"])
    # the account's staging tree (issue 34: its environment swaps too), installed by uv as the account
    assert "/.safeinstall-swap-" in seen["sicext"], seen
    assert account.manager.main_pid(unit) == main and account.snapshot() == before
    assert account.version() == "1.0"
    account.no_trace()
    assert _left_in_state(account) == []
    # and its broken extension refused as well, without the operator's command
    _refused_before_the_stop(account, unit, "sicext-5")


#: A shell's own number as the machine sees it (``$$`` is the number in the check's PID namespace; this
#: ``/proc`` is the machine's)
_OWN_PID = "read -r pid rest </proc/self/stat && echo $pid"


def test_a_kill_during_the_check_leaves_nothing_stopped(bed: Bed, tmp_path: Path) -> None:
    unit = bed.service("smoke-kill")
    main = bed.manager.main_pid(unit)
    started = tmp_path / "started"
    # the shell says its pid, then becomes the sleep (exec): the process the run must not leave behind
    command = f"{_OWN_PID} >{started}.tmp && mv {started}.tmp {started} && exec sleep 120"
    proc = bed.start_run("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--smoke", command)
    try:
        wait_until(lambda: started.exists() or proc.poll() is not None, 120, "the smoke command running")
        assert proc.poll() is None, proc.communicate()
        sleeper = int(started.read_text())
        wait_until(lambda: _command_of(sleeper) == ["sleep", "120"], 10, "the smoke command sleeping")
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
        proc.communicate()
    wait_until(lambda: not alive(sleeper), 10, "the smoke command gone with the run")
    assert bed.manager.main_pid(unit) == main
    recovered = bed.cli("--recover", "--json")
    assert recovered.code == 0, recovered.stdout + recovered.stderr
    assert bed.manager.main_pid(unit) == main and bed.version() == "1.0"
    bed.no_trace()
    assert _left_in_state(bed) == []


def _command_of(pid: int) -> list[str]:
    try:
        return [a.decode() for a in Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[:-1]]
    except OSError:
        return []


def test_the_unit_environment_file_is_read_as_systemd_reads_it() -> None:
    text = "A=1\n# c\n; c\nB = \"two words\"\nC='single'\nD=con\\\ntinued\nnot an assignment\n"
    assert importcheck.parse_environment_file(text) == [
        ("A", "1"),
        ("B", "two words"),
        ("C", "single"),
        ("D", "continued"),
    ]


def test_the_childs_answers_are_data() -> None:
    lines = [
        json.dumps({"module": "a"}),
        json.dumps({"ok": "a"}),
        "not json",
        json.dumps({"module": "b"}),
        json.dumps({"failed": "b", "error": "ImportError: x"}),
        json.dumps({"module": "c"}),
    ]
    imported, failed, started, done, unavailable = importcheck.read_answers("\n".join(lines))
    assert (imported, failed, started, done, unavailable) == (
        ("a",),
        (("b", "ImportError: x"),),
        "c",
        False,
        (),
    )


def test_how_a_unit_runs_is_read_from_systemctl_show() -> None:
    text = (
        'Environment=A=1 "B=two words"\n'
        "EnvironmentFiles=/etc/a.env (ignore_errors=no)\n"
        "EnvironmentFiles=/etc/b (x).env (ignore_errors=yes)\n"
        "WorkingDirectory=!/srv/app\n"
    )
    context = parse_exec_context("x.service", text)
    assert context.environment == (("A", "1"), ("B", "two words"))
    assert context.environment_files == (("/etc/a.env", False), ("/etc/b (x).env", True))
    assert context.working_directory == "/srv/app"
    assert importcheck.working_directory("", "/home/x", user_manager=False) == "/"
    assert importcheck.working_directory("~", "/home/x", user_manager=False) == "/home/x"


def test_smoke_options_that_cannot_be_honoured_are_refused() -> None:
    def said(**given: Any) -> list[str]:
        return [p.message for p in option_problems(RunOptions(package="x", **given))]

    assert said(smoke="true") == [] and said(no_smoke=True) == []
    assert said(smoke="true", no_smoke=True) == ["--smoke needs a command, and cannot go with --no-smoke"]
    assert said(smoke="  ") == ["--smoke needs a command, and cannot go with --no-smoke"]
    assert said(smoke="true", undo="20261201T000000Z-1")[0].startswith("--smoke goes with a reinstall")
    assert said(smoke_timeout=float("nan"))[0].startswith("--smoke-timeout nan")
    assert said(smoke_skip=("numpy.core._umath_tests",)) == []
    assert said(smoke_skip=("numpy/core", ""))[0] == "--smoke-skip 'numpy/core': not a module's dotted name"


def test_what_another_account_controls_of_the_unit_never_runs_in_the_check(bed: Bed, tmp_path: Path) -> None:
    """The attacker review (issue 34): in a root-owned environment the check's child is root, and it took
    the unit's ``WorkingDirectory=``, ``PYTHONPATH`` and ``EnvironmentFile=`` as they were: a unit whose
    user (here uid 65534) owns them made root run its code (a ``sitecustomize`` on the unit's
    ``PYTHONPATH``, a module in the working directory). Now what another account controls is left out,
    said in the run's notes, the loader's variables never taken, and the check still runs."""
    if not AS_ROOT:
        pytest.skip("the child is root only in a root-owned environment of a run as root")
    markers = tmp_path / "markers"
    markers.mkdir()
    app = tmp_path / "app"
    app.mkdir()
    for name in ("sitecustomize", "evil_warning"):  # each writes a marker, only in the check's child
        (app / f"{name}.py").write_text(
            "import os\n"
            "if 'SAFEINSTALL_SMOKE_SITES' in os.environ:\n"
            f"    open({str(markers)!r} + '/{name}-' + str(os.getuid()), 'w').close()\n"
            "class W(Warning):\n    pass\n"
        )
    env_file = app / "unit.env"
    env_file.write_text(f"PYTHONPATH={app}\nSMOKE_FROM_FILE=1\n")
    chown_tree(app, NOBODY)
    unit = bed.service(
        "smoke-hostile",
        Environment="PYTHONWARNINGS=ignore::evil_warning.W LD_AUDIT=/none PYTHONHASHSEED=7",
        EnvironmentFile=str(env_file),
    )
    seen = tmp_path / "seen"
    done, _ = _checked(bed, f"pwd > {seen}; env >> {seen}")
    assert list(markers.iterdir()) == [], "the unit's user's code ran in the check"
    said = "\n".join(done.json["data"]["notes"])
    assert f"EnvironmentFile {env_file} was not read" in said, said
    assert "PYTHONWARNINGS" in said and "LD_AUDIT" in said, said
    lines = seen.read_text().splitlines()
    assert "PYTHONHASHSEED=7" in lines and not any(
        line.startswith(("LD_AUDIT=", "SMOKE_FROM_FILE=")) for line in lines
    )
    assert bed.manager.active_state(unit) == "active"


def test_a_units_variables_that_name_code_are_taken_only_where_no_one_else_controls_it() -> None:
    mine = {"/opt/app/lib", "/usr/local/cuda/lib64"}
    kept, dropped = importcheck.unit_variables(
        (
            ("PYTHONPATH", "/opt/app/lib:/home/app/lib:relative"),
            ("LD_LIBRARY_PATH", "/usr/local/cuda/lib64:/home/app/so"),
            ("LD_PRELOAD", "/home/app/hook.so"),
            ("GCONV_PATH", "/home/app/gconv"),
            ("PYTHONHOME", "/home/app"),
            ("PYTHONUSERBASE", "/home/app/.local"),
            ("PYTHONUNBUFFERED", "1"),
            ("VLLM_LOGGING_LEVEL", "DEBUG"),
        ),
        lambda path: path in mine,
    )
    assert kept == (
        ("PYTHONPATH", "/opt/app/lib"),
        ("LD_LIBRARY_PATH", "/usr/local/cuda/lib64"),
        ("PYTHONUNBUFFERED", "1"),
        ("VLLM_LOGGING_LEVEL", "DEBUG"),
    )
    assert dropped == (
        "PYTHONPATH entry /home/app/lib",
        "PYTHONPATH entry relative",
        "LD_LIBRARY_PATH entry /home/app/so",
        "LD_PRELOAD entry /home/app/hook.so",
        "GCONV_PATH",
        "PYTHONHOME",
        "PYTHONUSERBASE",
    )
    assert importcheck.read_answers("[" * 100_000) == ((), (), None, False, ())  # the account's word, nested


def test_a_module_that_needs_the_nvidia_driver_this_host_lacks_is_said_not_refused(
    bed: Bed, tmp_path: Path
) -> None:
    """On a host without the NVIDIA driver, an extension module linked against ``libcuda.so.1`` cannot
    load, whatever its version (vLLM: 10 of its 13): the check says it could not import it and goes on;
    a module that fails while handling such an error (vLLM's ``vllm_flash_attn``) too. Any other import
    error still refuses the run (the tests above)."""
    from tests import wheelhouse

    missing = (
        b'raise ImportError("libcuda.so.1: cannot open shared object file: No such file or directory")\n'
    )
    cascade = (
        b'try:\n    import sicext_gpu\nexcept ImportError:\n    raise ImportError("needs the CUDA kernels")\n'
    )
    wheel = wheelhouse.rebuilt(
        bed.wheels["sicext-2"], tmp_path / "w", {"sicext_gpu.py": missing, "sicext_fa.py": cascade}
    )
    unit = bed.service("smoke-no-driver")
    result = bed.safeinstall("sicext", "--wheel", str(wheel), "--settle", "0.5", "--json")
    assert result.code == 0, result.stdout + result.stderr
    notes = " ".join(result.json["data"]["notes"])
    assert "2 module(s) of the new version need libcuda.so.1 of the NVIDIA driver" in notes, notes
    assert "sicext_fa, sicext_gpu" in notes, notes
    assert bed.version() == "2.0" and bed.manager.active_state(unit) == "active"
    # the answer is data: only the driver's libraries make a module unavailable
    fake = json.dumps({"unavailable": "m", "error": "libevil.so"}) + "\n" + json.dumps({"unavailable": "n"})
    assert importcheck.read_answers(fake)[4] == ()
    answered = [{"module": "m"}, {"unavailable": "m", "error": "libcuda.so.1"}, {"done": 1}]
    text = "\n".join(json.dumps(a) for a in answered)
    # did not die in m
    assert importcheck.read_answers(text) == ((), (), None, True, (("m", "libcuda.so.1"),))
    # an undefined symbol raised while handling the driver's absence is the module's own breakage
    broken = cascade.replace(b"needs the CUDA kernels", b"_C.abi3.so: undefined symbol: cuda_kernel_v2")
    wheel = wheelhouse.rebuilt(
        bed.wheels["sicext-2"], tmp_path / "b", {"sicext_gpu.py": missing, "sicext_fa.py": broken}
    )
    main = bed.manager.main_pid(unit)
    refused = bed.safeinstall("sicext", "--wheel", str(wheel), "--settle", "0.5", "--json")
    assert refused.code == 2, refused.stdout + refused.stderr
    assert "sicext_fa: ImportError: _C.abi3.so: undefined symbol" in refused.json["errors"][0]["message"]
    assert bed.manager.main_pid(unit) == main


def test_what_the_check_started_never_outlives_it(bed: Bed) -> None:
    """An import that starts helper processes (vLLM's, torch's) or a ``--smoke`` command that leaves one
    running: once the check is done its process group is killed, so nothing of it is found using the
    package in the window (the second scan would take it for a process that started using the package
    after the plan: a rollback, seen on vLLM)."""
    unit = bed.service("smoke-leftover")
    # one lets go of the check's output, one holds it (the check used to wait for it: a time-out)
    quiet = "python -c 'import sicext, time; time.sleep(600)' >/dev/null 2>&1 &"
    holding = "python -c 'import time; time.sleep(600)' &"
    leftover = f"{quiet} {holding} sleep 2; exit 0"
    result = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json",
        "--smoke", leftover, "--smoke-timeout", "40",
    )  # fmt: skip
    assert result.code == 0, result.stdout + result.stderr
    assert bed.version() == "2.0" and bed.manager.active_state(unit) == "active"


# --- a root-owned environment whose units run as a user of their own (User=) -------------------------


@pytest.fixture
def open_bed(
    open_dir: Path,
    open_state: Path,
    units: Units,
    user_manager: UserManager,
    fake_nvml: FakeNvml,
    wheels: wheelhouse.Wheelhouse,
) -> Iterator[Bed]:
    """sicext 1.0 in a root-owned venv that others may enter (as ``/opt/app/venv`` is): its units may run
    as uid 65534 (``User=``); the state directory below directories others may enter."""
    if not AS_ROOT:
        pytest.skip("a unit's User= is taken by a run as root")
    python = wheelhouse.make_venv(open_dir / "venv", shared_interpreter_or_skip())
    wheelhouse.uv_install(python, wheels["sicext-1"])
    made = Bed(python, open_state, user_manager, fake_nvml, wheels, units)
    yield made
    made.cleanup()


#: What the --smoke command records (REPORT/seen-UID.json): who ran it and what it imported; as a user
#: not root, what it tried on the run's directories (each must be refused)
_SEEN = """
import json, os, sicext
staged = os.path.dirname(sicext.__file__)
top = staged.split("/tree/")[0]
tried = {}
attempts = {
    "list the staging directory": lambda: os.listdir(top),
    "write into the staged tree": lambda: open(os.path.join(staged, "planted.py"), "x"),
    "rename in the staged tree": lambda: os.rename(staged + "/serve.py", staged + "/x.py"),
    "list the state directory": lambda: os.listdir(STATE),
}
for what, attempt in attempts.items() if os.getuid() else ():
    try:
        attempt()
        tried[what] = "done"
    except OSError as exc:
        tried[what] = type(exc).__name__
seen = dict(ids=os.getresuid(), gids=os.getresgid(), groups=sorted(os.getgroups()), sicext=sicext.__file__,
            tried=tried)
json.dump(seen, open(os.path.join(REPORT, "seen-%d.json" % os.getuid()), "w"))
"""


def test_in_a_root_owned_environment_the_check_runs_as_the_units_user(open_bed: Bed, open_dir: Path) -> None:
    """Issue 34: in a root-owned environment the check's child was root, whatever the unit's User=:
    the new wheel's import-time code ran as root before the stop. Now it runs as the unit's user (its
    group, its groups as systemd gives them), the staged tree opened to it for reading alone; a unit
    without User= keeps running it as root (as it runs that code at its start), and the plan says whom."""
    bed = open_bed
    report = open_dir / "report"
    report.mkdir()
    chown_tree(report, NOBODY)
    script = open_dir / "seen.py"
    script.write_text(_SEEN.replace("STATE", repr(str(bed.state))).replace("REPORT", repr(str(report))))
    users = grp.getgrnam("users").gr_gid
    as_user = bed.service("smoke-user", User=str(NOBODY), SupplementaryGroups="users")
    as_root = bed.service("smoke-root")
    command = f"python {script}"
    said = _planned(bed, command).json["data"]["smoke"]
    nobody = pwd.getpwuid(NOBODY)
    assert f"as {nobody.pw_name} (uid {NOBODY}, the unit's User=), environment of {as_user}" in said, said
    assert f"as root (the unit has no User=: it runs as root too), environment of {as_root}" in said, said
    mains = {unit: bed.manager.main_pid(unit) for unit in (as_user, as_root)}
    _, step = _checked(bed, command)
    who = step.partition("imported as ")[2].partition(" with")[0]
    assert set(who.split(", ")) == {nobody.pw_name, "root"} and "not checked" not in step, step
    user = json.loads((report / f"seen-{NOBODY}.json").read_text())
    assert user["ids"] == [NOBODY] * 3 and user["gids"] == [nobody.pw_gid] * 3, user
    assert user["groups"] == sorted({*os.getgrouplist(nobody.pw_name, nobody.pw_gid), users}), user
    assert "/.safeinstall-swap-" in user["sicext"], user  # the staged new version, read as the user
    assert set(user["tried"].values()) == {"PermissionError"}, user["tried"]  # and nothing more
    root = json.loads((report / "seen-0.json").read_text())
    assert root["ids"] == [0, 0, 0] and "/.safeinstall-swap-" in root["sicext"], root
    assert bed.version() == "2.0"
    assert all(bed.manager.main_pid(unit) != main for unit, main in mains.items())  # restarted
    bed.no_trace()
    assert not list(bed.python.parent.parent.glob(".safeinstall-swap-*"))
    assert _left_in_state(bed) == []


def test_a_units_user_that_cannot_reach_the_environment_is_never_replaced_by_root(
    bed: Bed, tmp_path: Path
) -> None:
    """A unit with User= whose user cannot enter the environment (below pytest's 0700 directories: its
    ExecStart= runs with full privileges, ``+``): the check is not run for it, never as root instead;
    the plan and the run's notes say so, and the run goes on as it would without the check."""
    if not AS_ROOT:
        pytest.skip("a unit's User= is taken by a run as root")
    unit = bed.units.started("smoke-closed", f"+{bed.python.parent}/sicext-serve", User=str(NOBODY))
    main = bed.manager.main_pid(unit)
    wait_until(lambda: maps_so(main) is not None, 15, "service maps the .so")
    marker = tmp_path / "ran"
    command = f"touch {marker}"
    warned = [
        w for w in _planned(bed, command).json["data"]["warnings"] if "not checked before the stop" in w
    ]
    assert len(warned) == 1 and unit in warned[0] and "never runs as root" in warned[0], warned
    assert f"uid {NOBODY}, the unit's User=) cannot reach {bed.python}" in warned[0], warned
    done, step = _checked(bed, command)
    assert not marker.exists()  # not as root, not at all
    assert step.startswith("skipped: "), step
    notes = "\n".join(done.json["data"]["notes"])
    assert f"not checked before the stop for {unit}" in notes, notes
    assert bed.version() == "2.0" and bed.manager.main_pid(unit) != main
    bed.no_trace()
    assert _left_in_state(bed) == []


def test_a_units_user_is_resolved_as_systemd_resolves_it() -> None:
    text = "User=nobody\nGroup=\nSupplementaryGroups=users 65534\nDynamicUser=no\n"
    context = parse_exec_context("x.service", text)
    assert (context.user, context.group, context.supplementary_groups) == ("nobody", "", ("users", "65534"))
    nobody = pwd.getpwuid(NOBODY)
    found = importcheck.unit_account(context)
    assert isinstance(found, importcheck.RunAs)
    assert (found.name, found.uid, found.gid) == (nobody.pw_name, NOBODY, nobody.pw_gid)
    assert set(found.groups) == {
        *os.getgrouplist(nobody.pw_name, nobody.pw_gid),
        grp.getgrnam("users").gr_gid,
    }
    numeric = importcheck.unit_account(parse_exec_context("x.service", f"User={NOBODY}\nGroup=users\n"))
    assert isinstance(numeric, importcheck.RunAs) and numeric.gid == grp.getgrnam("users").gr_gid
    assert importcheck.unit_account(parse_exec_context("x.service", "User=\n")) is None  # root
    assert importcheck.unit_account(parse_exec_context("x.service", "User=root\n")) is None
    assert importcheck.unit_account(parse_exec_context("x.service", "User=no-such-user-here\n")) == (
        "its User=no-such-user-here is no user this machine knows"
    )
    assert "no group" in str(
        importcheck.unit_account(parse_exec_context("x.service", "User=nobody\nGroup=nope\n"))
    )


def test_without_a_swap_the_units_user_reads_the_prefetched_tree(open_bed: Bed, open_dir: Path) -> None:
    """The swap dropped (uv compiles bytecode): the new version lies in the prefetch's ``--target``
    directory in root's state directory, which is opened to the unit's user as the staging directory is
    (entered by name, never listed); the check runs as that user there too."""
    bed = open_bed
    report = open_dir / "report"
    report.mkdir()
    chown_tree(report, NOBODY)
    unit = bed.service("smoke-user-no-swap", User=str(NOBODY))
    script = (
        "import json, os, sicext; "
        f"seen = dict(ids=os.getresuid(), sicext=sicext.__file__); "
        f"json.dump(seen, open({str(report / 'seen.json')!r}, 'w'))"
    )
    done, _ = _checked(bed, f'python -c "{script}"', more_env={"UV_COMPILE_BYTECODE": "1"})
    assert "no swap" in Path(done.json["data"]["log_file"]).read_text()
    assert "not checked" not in "\n".join(done.json["data"]["notes"]), done.json["data"]["notes"]
    seen = json.loads((report / "seen.json").read_text())
    assert seen["ids"] == [NOBODY] * 3 and "/prefetch-" in seen["sicext"], seen
    assert bed.version() == "2.0" and bed.manager.active_state(unit) == "active"
    bed.no_trace()
    assert _left_in_state(bed) == []


def test_a_tree_is_opened_to_a_units_user_only_when_root_alone_may_change_it(tmp_path: Path) -> None:
    if not AS_ROOT:
        pytest.skip("the tree is root's in a run as root")
    tree = tmp_path / "tree"
    (tree / "pkg").mkdir(parents=True)
    module = tree / "pkg" / "mod.py"
    module.write_text("")
    module.chmod(0o644)
    (tree / "pkg" / "link").symlink_to("mod.py")  # a symlink's own mode (0777) is no one's write
    assert importcheck.others_may_write(tree) is None
    module.chmod(0o666)
    assert importcheck.others_may_write(tree) == f"{module} is not root's alone (every user)"
    module.chmod(0o664)  # root's group too: an access list's mask
    assert importcheck.others_may_write(tree) == f"{module} is not root's alone (group 0)"
    module.chmod(0o644)
    os.chown(tree / "pkg", NOBODY, NOBODY)
    assert importcheck.others_may_write(tree) == f"{tree / 'pkg'} is not root's alone (uid {NOBODY})"


def test_a_driver_library_this_host_has_is_no_excuse(bed: Bed, tmp_path: Path) -> None:
    """The same answer ("libcuda.so.1: cannot open shared object file") where the unit's processes can
    load ``libcuda.so.1`` (a stub on the unit's ``LD_LIBRARY_PATH``, a directory only root controls): the
    driver is there, so the module is broken on this host and the run is refused before the stop."""
    import shutil
    import subprocess

    from tests import wheelhouse

    gcc = shutil.which("gcc") or shutil.which("cc")
    if gcc is None:
        pytest.skip("no C compiler to build a stub libcuda.so.1")
    driver = tmp_path / "driver"
    driver.mkdir()
    (driver / "stub.c").write_text("int cuInit(unsigned int flags) { return flags ? 1 : 0; }\n")
    stub = driver / "libcuda.so.1"
    subprocess.run(
        [gcc, "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(stub), str(driver / "stub.c")],
        check=True,
    )
    missing = (
        b'raise ImportError("libcuda.so.1: cannot open shared object file: No such file or directory")\n'
    )
    wheel = wheelhouse.rebuilt(bed.wheels["sicext-2"], tmp_path / "w", {"sicext_gpu.py": missing})
    unit = bed.service("smoke-has-driver", Environment=f"LD_LIBRARY_PATH={driver}")
    main = bed.manager.main_pid(unit)
    result = bed.safeinstall("sicext", "--wheel", str(wheel), "--settle", "0.5", "--json")
    assert result.code == 2, result.stdout + result.stderr
    assert "sicext_gpu: ImportError: libcuda.so.1" in result.json["errors"][0]["message"]
    assert bed.manager.main_pid(unit) == main and bed.version() == "1.0"


def test_the_check_runs_beside_the_rest_of_the_prefetch(bed: Bed) -> None:
    """Issue 34 (nothing slower): the check starts once uv has laid out the new version, and runs while
    the prefetch hashes the run's cache and verifies the staging tree; the smoke step waits for it."""
    bed.service("smoke-beside")
    done, detail = _checked(bed, "true")
    assert "imported" in detail and "beside the prefetch)" in detail, detail
    log = Path(done.json["data"]["log_file"]).read_text()
    started, prefetched = log.index("smoke: started beside the prefetch"), log.index("prefetch: ok")
    assert started < prefetched, log
    assert "the check took" in log and "beside the prefetch" in log[prefetched:], log
    assert _left_in_state(bed) == []
    # a good upgrade pays no pass of the running version (issue 43): only a module that fails under the
    # new version is asked about, so nothing was asked and nothing kept
    assert "the running version was asked" not in log, log
    assert not list(bed.state.glob("*/old-imports.json"))


def test_a_sigterm_while_the_check_runs_beside_the_run_ends_it_and_stops_nothing(
    bed: Bed, tmp_path: Path
) -> None:
    """SIGTERM while the check runs in its thread: the run's main thread is interrupted (only it handles
    signals), the check's children are ended at once (not after ``--smoke-timeout``), nothing was
    stopped and nothing is left."""
    unit = bed.service("smoke-sigterm")
    main = bed.manager.main_pid(unit)
    started = tmp_path / "started"
    command = f"{_OWN_PID} >{started}.tmp && mv {started}.tmp {started} && exec sleep 600"
    proc = bed.start_run(
        "sicext",
        "--wheel",
        str(bed.wheels["sicext-2"]),
        "--json",
        "--smoke",
        command,
        "--smoke-timeout",
        "600",
    )
    try:
        wait_until(lambda: started.exists() or proc.poll() is not None, 120, "the smoke command running")
        assert proc.poll() is None, proc.communicate()
        sleeper = int(started.read_text())
        wait_until(lambda: _command_of(sleeper) == ["sleep", "600"], 10, "the smoke command sleeping")
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=120)  # within a poll: never the 600 s of --smoke-timeout
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 2, out + err
    assert "interrupted by SIGTERM" in out, out
    assert not alive(sleeper)
    assert bed.manager.main_pid(unit) == main and bed.version() == "1.0"
    bed.no_trace()
    assert _left_in_state(bed) == []


# --- the check refuses regressions only (issue 43) -----------------------------------------------------

#: numpy 1.26.4's test-only extension that raises at import under any numpy (1.26.4's own included)
UMATH_TESTS = "numpy.core._umath_tests"


@pytest.fixture(scope="session")
def numpy_wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """numpy 1.26.4 and 2.2.6 for this interpreter, downloaded from PyPI once per session."""
    out = tmp_path_factory.mktemp("numpy-wheels")
    found: dict[str, Path] = {}
    for version in ("1.26.4", "2.2.6"):
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
             f"numpy=={version}", "-d", str(out)],
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        wheels = sorted(out.glob(f"numpy-{version}-*.whl"))
        if got.returncode != 0 or not wheels:
            pytest.skip(f"numpy {version} could not be downloaded: {got.stderr.strip()[-300:]}")
        found[version] = wheels[0]
    return found


def _numpy_unit(bed: Bed, installed: Path) -> str:
    """numpy ``installed`` in the bed's venv, and a unit whose process imports it; the unit's name."""
    wheelhouse.uv_install(bed.python, installed)
    script = "import numpy, time; time.sleep(3600)"
    return bed.units.started("numpy", f"{bed.python} -c '{script}'")


def _numpy_run(bed: Bed, wheel: Path, *extra: str) -> Result:
    return bed.safeinstall("numpy", "--wheel", str(wheel), "--settle", "0.5", "--json", *extra)


def _shared_failure_said(done: Result) -> None:
    assert done.code == 0, done.stdout + done.stderr
    (step,) = [s for s in done.json["data"]["steps"] if s["name"] == "smoke"]
    assert f"not held against it: {UMATH_TESTS}" in step["detail"], step
    notes = "\n".join(done.json["data"]["notes"])
    assert UMATH_TESTS in notes and "cannot import either" in notes, notes


def test_a_module_the_running_version_cannot_import_either_is_said_not_refused(
    bed: Bed, numpy_wheels: dict[str, Path]
) -> None:
    """Issue 43: numpy 1.26.4 reinstalled (the same version) was refused: its test-only
    ``numpy.core._umath_tests`` raises at import, under the running version too. Now the running version
    is asked, once per version: the failure is said, not held against the new one."""
    unit = _numpy_unit(bed, numpy_wheels["1.26.4"])
    main = bed.manager.main_pid(unit)
    done = _numpy_run(bed, numpy_wheels["1.26.4"])
    _shared_failure_said(done)
    assert bed.manager.main_pid(unit) != main  # restarted on the new files
    kept = json.loads(next(bed.state.glob("*/old-imports.json")).read_text())
    ((key, answers),) = kept["distributions"].items()
    assert key.startswith("numpy 1.26.4 ") and answers[UMATH_TESTS].startswith("RuntimeError"), kept
    log = Path(done.json["data"]["log_file"]).read_text()
    assert "the running version was asked about" in log
    # the next run of the same version takes the kept answer: the running version is not asked again
    again = _numpy_run(bed, numpy_wheels["1.26.4"])
    _shared_failure_said(again)
    assert "the running version was asked about" not in Path(again.json["data"]["log_file"]).read_text()
    plan = bed.cli("numpy", "--wheel", str(numpy_wheels["1.26.4"]), "--dry-run", "--json")
    assert plan.code == 0, plan.stdout + plan.stderr
    assert f"said, not refused (known: {UMATH_TESTS})" in plan.json["data"]["smoke"], plan.json


def test_a_downgrade_whose_module_the_running_version_lacks_is_said_not_refused(
    bed: Bed, numpy_wheels: dict[str, Path]
) -> None:
    """numpy 2.x -> 1.26.4: the running 2.x has no ``numpy.core._umath_tests`` at all (a test module,
    moved): it cannot import it either; said. --smoke-skip leaves a module out altogether."""
    _numpy_unit(bed, numpy_wheels["2.2.6"])
    done = _numpy_run(bed, numpy_wheels["1.26.4"])
    _shared_failure_said(done)
    again = _numpy_run(bed, numpy_wheels["1.26.4"], "--smoke-skip", UMATH_TESTS)
    assert again.code == 0, again.stdout + again.stderr
    (step,) = [s for s in again.json["data"]["steps"] if s["name"] == "smoke"]
    assert f"left out (--smoke-skip): {UMATH_TESTS}" in step["detail"], step
    assert "not held against it" not in step["detail"], step


def test_a_failure_is_excused_only_where_the_running_version_fails_too() -> None:
    """Pure: only a failure the running version shares is excused; what the service imports first and
    the running version lacks altogether is the new version's own; a child that died is never excused."""
    context = importcheck.Context("x.service", (), "/")
    failed = (
        ("p.tests", "RuntimeError: new"),
        ("p.server", "ImportError: new"),
        ("p._ext", "ImportError: x"),
    )
    outcome = importcheck.ChildOutcome(
        "imports", context, False, ("p",), failed, None, (),
        owners=(("p", "p"), ("p.tests", "p"), ("p.server", "p"), ("p._ext", "p")),
        must=frozenset({"p", "p.server"}),
    )  # fmt: skip
    absent = "ModuleNotFoundError: No module named 'p.server'"
    old = {"p": {"p.tests": "RuntimeError: old", "p.server": absent, "p._ext": ""}}
    assert importcheck.unknown(outcome, {"p": {}}) == {"p": ("p.tests", "p.server", "p._ext")}
    assert importcheck.unknown(outcome, old) == {}
    judged = importcheck.excuse(outcome, old)
    assert not judged.ok and judged.excused == (("p.tests", "RuntimeError: new"),)
    assert [m for m, _ in judged.failed] == ["p.server", "p._ext"]
    only_shared = importcheck.excuse(dataclasses.replace(outcome, failed=failed[:1]), old)
    assert only_shared.ok and only_shared.failed == ()
    died = dataclasses.replace(outcome, failed=failed[:1], problem="it died while importing p.tests")
    assert importcheck.excuse(died, old) == died


def test_the_running_versions_answers_are_checked_when_read(tmp_path: Path) -> None:
    """The kept answers are root's data: a damaged or foreign document is said and asked again."""
    from safeinstall.store import oldimports
    from safeinstall.store.state import EnvironmentState

    state = EnvironmentState(tmp_path, tmp_path, None)
    assert oldimports.load(state) == ({}, None)
    key = ("numpy", "1.26.4", "abc", "context")
    assert oldimports.save(state, {key: {UMATH_TESTS: "RuntimeError: x", "numpy": ""}}) is None
    assert oldimports.load(state)[0] == {key: {UMATH_TESTS: "RuntimeError: x", "numpy": ""}}
    # an earlier safeinstall's answers, not kept by context: not used, asked again
    (tmp_path / oldimports.OLD_IMPORTS_NAME).write_text(
        '{"old_imports_version": 1, "distributions": {"a b c": {}}}'
    )
    assert oldimports.load(state) == ({}, None)
    for bad in ('{"old_imports_version": 2, "distributions": {"a b c": {}}}', "[", '{"x": 1}'):
        (tmp_path / oldimports.OLD_IMPORTS_NAME).write_text(bad)
        answers, why = oldimports.load(state)
        assert answers == {} and why is not None and "damaged" in why, why
    (tmp_path / oldimports.OLD_IMPORTS_NAME).chmod(0o666)
    answers, why = oldimports.load(state)
    assert answers == {} and why is not None and "refusing to read" in why, why


#: A ``sitecustomize`` of uid 65534's on its own unit's ``PYTHONPATH``: when the running version is asked
#: (``SAFEINSTALL_SMOKE_SITES`` empty), it answers that every module asked about fails
_POISON = """import os
if os.environ.get("SAFEINSTALL_SMOKE_SITES") == "":
    import json, sys
    asked = json.loads(sys.argv[1]).get("also", [])
    lines = []
    for module in asked:
        lines += [{"module": module, "dist": "sicext"},
                  {"failed": module, "error": "RuntimeError: planted by uid %d" % os.getuid()}]
    lines.append({"done": len(asked)})
    os.write(1, "".join(json.dumps(line) + "\\n" for line in lines).encode())
    os._exit(1)
"""


def test_one_units_user_never_answers_for_another_units_check(open_bed: Bed, open_dir: Path) -> None:
    """The attacker review (5): the running version's answers were kept by distribution alone. A unit's
    user (uid 65534, its own ``sitecustomize`` on its unit's ``PYTHONPATH``) answered that the running
    version fails too: sicext 3 (raises at import) was let through for a root unit's check as well,
    both units stopped, rolled back; the answer kept for later runs. Now answers count only in the
    context they were given in, and what the service imports first only as answered in this run:
    exit 2 before the stop, and the next run is refused again."""
    bed = open_bed
    evil = open_dir / "evil"
    evil.mkdir()
    (evil / "sitecustomize.py").write_text(_POISON)
    chown_tree(evil, NOBODY)
    bed.service("aa-poison", User=str(NOBODY), Environment=f"PYTHONPATH={evil}")
    victim = bed.service("zz-victim")  # no User=: its check is root's own
    refused = _refused_before_the_stop(bed, victim, "sicext-3")
    assert "sicext 3.0 is broken on purpose" in refused["errors"][0]["message"], refused
    (kept_file,) = bed.state.glob("*/old-imports.json")
    kept = json.loads(kept_file.read_text())
    answers = list(kept["distributions"].values())
    assert len(answers) == 2 and sorted(a["sicext"][:12] for a in answers) == ["", "RuntimeError"], kept
    # what the service imports first is never excused on a kept answer, even of its own context
    for modules in kept["distributions"].values():
        modules.update(dict.fromkeys(modules, "RuntimeError: kept"))
    kept_file.write_text(json.dumps(kept))
    _refused_before_the_stop(bed, victim, "sicext-3")


# --- the check imports what the service starts with (issue 43) -------------------------------------------

#: sicext's server module broken on purpose, as a loader that chains the real cause does
BROKEN_SERVER = b'''"""sicext's server, broken on purpose: its loader raises over the real cause."""
try:
    raise ImportError("libsicext_server.so: undefined symbol: sicext_fixture_server_symbol")
except ImportError as exc:
    raise OSError("Could not load this library") from exc


def main() -> int:
    return 0
'''


def test_what_the_units_command_runs_is_imported_before_the_stop(bed: Bed, tmp_path: Path) -> None:
    """Issue 43: a new version whose module run by the unit's command raises at import, while the
    top-level package and its extension import, passed the check (the API crashed after the start).
    Now the module each unit runs (a console script's entry point; ``python -m MOD``) is imported too;
    units that run the same way share one child; the first failure ends the check (the other unit's
    child never runs); the failure shows its whole cause chain, in the output and in the log."""
    broken = wheelhouse.rebuilt(
        bed.wheels["sicext-2"], tmp_path / "broken", {"sicext/serve.py": BROKEN_SERVER}
    )
    script = bed.service("smoke-script")  # sicext-serve: the console script
    module = bed.units.started("smoke-module", f"{bed.python} -m sicext.serve")
    other = bed.units.started("smoke-other", f"{bed.python} -m sicext.serve", Environment="PYTHONHASHSEED=1")
    # on another GPU: the check gives every child none, so this unit's child would be the module's own
    gpu = bed.units.started(
        "smoke-gpu", f"{bed.python} -m sicext.serve", Environment="CUDA_VISIBLE_DEVICES=1"
    )
    mains = {unit: bed.manager.main_pid(unit) for unit in (script, module, other, gpu)}
    result = bed.safeinstall("sicext", "--wheel", str(broken), "--settle", "0.5", "--json")
    assert result.code == 2, result.stdout + result.stderr
    assert "stop" not in [s["name"] for s in result.json["data"]["steps"]]
    assert {unit: bed.manager.main_pid(unit) for unit in mains} == mains
    message = result.json["errors"][0]["message"]
    chained = "sicext.serve: OSError: Could not load this library <- ImportError: libsicext_server.so: "
    assert chained + "undefined symbol: sicext_fixture_server_symbol" in message, message
    log = Path(result.json["data"]["log_file"]).read_text()
    assert "undefined symbol: sicext_fixture_server_symbol" in log
    children = [line for line in log.splitlines() if "smoke: imports (" in line]
    assert len(children) == 1, children  # one child for both units, and none for the other after it
    assert script in children[0] and module in children[0] and other not in children[0], children
    assert gpu in children[0], children  # what its check would see is the module's: the same child
    assert bed.version() == "1.0"


def test_units_whose_check_sees_the_same_environment_share_one_child() -> None:
    """Pure: the key the units' children are shared by is what the child sees of a unit's variables:
    the ones every child is given whatever the unit says (no GPU, no bytecode written), ``PATH`` left
    to systemd's default or named as it, the order, the ``PYTHON*`` ones under ``-E``/``-I``, and
    ``PYTHONNOUSERSITE`` against ``-s``, make no other child; any other variable does."""
    seen = importcheck.seen_variables
    env = smoke_environment()
    base = [("A", "1"), ("PYTHONPATH", "/srv/lib")]
    same = [
        ([("CUDA_VISIBLE_DEVICES", "1"), *base, ("HIP_VISIBLE_DEVICES", "2")], ()),
        ([*base[::-1], ("PATH", importcheck.DEFAULT_PATH), ("PYTHONDONTWRITEBYTECODE", "0")], ()),
    ]
    for unit, flags in same:
        assert seen(unit, flags) == seen(base), unit
        assert child(env, unit, flags) == child(env, base), unit
    assert seen([("PYTHONNOUSERSITE", "1")]) == seen([], ("-s",))
    assert seen([("PYTHONPATH", "/x")], ("-I",)) == seen([], ("-I",))  # the flags are a key of their own
    for other in ([*base, ("VLLM_USE_V1", "0")], [("A", "2"), base[1]], [base[0]], [*base, ("PATH", "/x")]):
        assert seen(other) != seen(base), other
        assert child(env, other, ()) != child(env, base), other


def smoke_environment() -> Any:
    """An environment as :func:`smoke.child_variables` reads it (its ``scripts`` only)."""
    return dataclasses.make_dataclass("Env", [("scripts", Path)])(Path("/v/bin"))


def child(env: Any, unit: list[tuple[str, str]], flags: tuple[str, ...] = ()) -> dict[str, str]:
    """The child's whole environment for a unit's variables."""
    return importcheck.child_variables(
        {}, ("svc", "/home/svc"), unit, env, Path("/shim"), [Path("/new")], flags
    )


def test_what_a_units_command_runs_first_is_read_from_its_argv() -> None:
    """Pure: ``ExecStart=`` as ``systemctl show`` says it, and what it runs first: a module, a program
    by name (a console script), the interpreter's options that change what it loads."""
    shown = "ExecStart={ path=/v/bin/python ; argv[]=/v/bin/python -s -X dev -m pkg.server --port 1 ; x=y }\n"
    assert parse_exec_context("a.service", shown).command == (
        "/v/bin/python", "-s", "-X", "dev", "-m", "pkg.server", "--port", "1",
    )  # fmt: skip
    entry = importcheck.service_entry
    assert entry(["/v/bin/python", "-s", "-X", "dev", "-m", "pkg.server"]) == importcheck.Entry(
        ("pkg.server",), (), ("-s",)
    )
    assert entry(["/v/bin/python3.11", "-Im", "pkg"]) == importcheck.Entry(("pkg",), (), ("-I",))
    assert entry(["/v/bin/vllm", "serve", "m"]) == importcheck.Entry((), ("vllm",))
    assert entry(["/usr/bin/env", "A=1", "python", "-E", "/v/bin/vllm"]) == importcheck.Entry(
        (), ("vllm",), ("-E",)
    )
    # a .py file's own imports are not guessed
    assert entry(["/v/bin/python", "app.py"]) == importcheck.Entry()
    assert entry(["/v/bin/python", "-c", "import x"]) == importcheck.Entry()
    assert entry([]) == importcheck.Entry()


# --- nothing the check started outlives it (issue 44) ----------------------------------------------------


@pytest.mark.parametrize("kind", ["root", "account"])
def test_what_the_check_started_in_a_session_of_its_own_never_outlives_it(
    request: pytest.FixtureRequest, kind: str
) -> None:
    """Issue 44: only the check's process group was ended, so a ``setsid`` child lived on (as root or
    as the account); one that imported the package was found by the second scan after the stop, and the
    run rolled back. Now the check's children run in a PID namespace of their own: nothing of them
    outlives the check, and the run is not rolled back for them."""
    bed: Bed = request.getfixturevalue("bed" if kind == "root" else "account")
    if kind == "account":
        bed.unit("smoke-escape")
    else:
        bed.service("smoke-escape")
    marker = f"1000.{os.getpid()}"
    command = smoke_escape_command(marker)
    try:
        result = bed.safeinstall(
            "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json", "--smoke", command
        )
        assert result.code == 0, result.stdout + result.stderr
        assert "rollback" not in [s["name"] for s in result.json["data"]["steps"]]
        assert bed.version() == "2.0"
        assert running_with(marker) == [], "a process the check started runs on"
    finally:
        for pid in running_with(marker):
            os.kill(pid, signal.SIGKILL)


# --- the check runs only what the service would (issue 43) -----------------------------------------------

#: Planted code of another user's: writes a marker, only in the check's child (never in the service)
_PLANTED = "import os\nif 'SAFEINSTALL_SMOKE_SITES' in os.environ:\n    open({marker!r}, 'w').close()\n"


def _plant(path: Path, marker: Path, text: str = _PLANTED) -> None:
    path.write_text(text.format(marker=str(marker)))
    os.chown(path, NOBODY, NOBODY)


@pytest.mark.parametrize("planted", ["pythonpath", "path-and-cwd"])
def test_what_another_user_controls_inside_what_a_root_unit_names_is_refused(
    bed: Bed, tmp_path: Path, planted: str
) -> None:
    """Issue 43: for a root unit, a ``PYTHONPATH`` directory or the ``WorkingDirectory=`` of a ``--smoke``
    command was judged by its own owner, not by the files in it (another user's ``json.py`` there ran as
    root), and ``PATH`` was not judged at all (another user's ``timeout`` ran for ``--smoke "timeout
    ..."``). Now each is judged by its whole tree: exit 2 before the stop, naming the entry and the
    user; none of that user's code runs."""
    if not AS_ROOT:
        pytest.skip("the child is root only in a root-owned environment of a run as root")
    markers = tmp_path / "markers"
    markers.mkdir()
    app, work, tools = tmp_path / "app", tmp_path / "work", tmp_path / "tools"
    for directory in (app, work, tools):
        directory.mkdir()  # root's own directories, each with another user's file in it
    _plant(app / "json.py", markers / "pythonpath")
    _plant(work / "json.py", markers / "cwd")
    planted_tool = f'#!/bin/sh\ntouch {markers}/path\nexec /usr/bin/timeout "$@"\n'
    _plant(tools / "timeout", markers / "path", planted_tool)
    (tools / "timeout").chmod(0o755)
    if planted == "pythonpath":  # the check's own child imports json: the planted one, before the fix
        unit = bed.service("smoke-planted", Environment=f"PYTHONPATH={app}")
        names = [f"PYTHONPATH entry {app}: {app}/json.py"]
    else:  # the operator's command: `timeout` found on PATH, `json` in its working directory
        unit = bed.service(
            "smoke-planted", Environment=f"PATH={tools}:/usr/bin:/bin", WorkingDirectory=str(work)
        )
        names = [f"PATH entry {tools}: {tools}/timeout", f"WorkingDirectory={work}: {work}/json.py"]
    main = bed.manager.main_pid(unit)
    result = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.5", "--json",
        "--smoke", "timeout 5 python -c 'import json'",
    )  # fmt: skip
    assert result.code == 2, result.stdout + result.stderr
    assert list(markers.iterdir()) == [], "another user's code ran as root in the check"
    message, hint = result.json["errors"][0]["message"], result.json["errors"][0]["hint"]
    for said in names:
        assert said in message, message
    assert "uid 65534 (nobody)" in message and "fix the unit" in hint and "--no-smoke" in hint, result.json
    assert bed.manager.main_pid(unit) == main and bed.version() == "1.0"


#: An OpenSSL provider of another user's: its constructor leaves a marker (named by uid) in the check
_PROVIDER_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>
__attribute__((constructor)) static void planted(void) {
    if (!getenv("SAFEINSTALL_SMOKE_SITES")) return;
    char path[4096];
    snprintf(path, sizeof path, "%s-uid%d", MARKER, (int)getuid());
    FILE *f = fopen(path, "w");
    if (f) fclose(f);
}
"""

#: The OpenSSL configuration that loads it (next to the default provider)
_OPENSSL_CNF = """openssl_conf = openssl_init
[openssl_init]
providers = provider_sect
[provider_sect]
default = default_sect
planted = planted_sect
[default_sect]
activate = 1
[planted_sect]
module = {so}
activate = 1
"""


def test_a_root_check_takes_only_the_units_variables_that_name_no_code(bed: Bed, tmp_path: Path) -> None:
    """The attacker review (4a): a root unit's every variable but the judged lists reached the root
    check: ``OPENSSL_CONF`` naming another user's configuration loaded that user's provider (a ``.so``)
    as root for ``--smoke "python -c 'import ssl'"``. Now a root check leaves out, said in the notes, a
    variable naming a path that is not root's alone; one naming none, or root's, still reaches it (the
    final review: a unit's ``MODEL_DIR`` or ``HF_HOME`` dropped failed a good upgrade's ``--smoke``)."""
    if not AS_ROOT:
        pytest.skip("the child is root only in a root-owned environment of a run as root")
    markers = tmp_path / "markers"
    markers.mkdir()
    other = tmp_path / "other"  # another user's directory
    other.mkdir()
    (other / "planted.c").write_text(_PROVIDER_C)
    so = other / "planted.so"
    subprocess.run(
        [
            shutil.which("gcc") or "cc",
            "-shared",
            "-fPIC",
            f'-DMARKER="{markers}/ssl"',
            "-o",
            str(so),
            str(other / "planted.c"),
        ],
        check=True,
    )
    (other / "openssl.cnf").write_text(_OPENSSL_CNF.format(so=so))
    chown_tree(other, NOBODY)
    roots = tmp_path / "models"  # root's alone: a variable naming it reaches the root check
    roots.mkdir()
    unit = bed.service(
        "smoke-ssl",
        Environment=f"OPENSSL_CONF={other}/openssl.cnf LC_ALL=C.UTF-8 APP_MODE=serve MODEL_DIR={roots} "
        "MODEL=meta-llama/Llama-3.1-8B-Instruct",
    )
    done, _ = _checked(
        bed,
        "python -c 'import os, ssl, hashlib; hashlib.sha256(); "
        'assert (os.environ["APP_MODE"], os.environ["MODEL_DIR"], os.environ["MODEL"]) == ("serve", '
        f'"{roots}", "meta-llama/Llama-3.1-8B-Instruct") and "OPENSSL_CONF" not in os.environ\'',
    )
    assert list(markers.iterdir()) == [], "another user's OpenSSL provider ran as root in the check"
    notes = "\n".join(done.json["data"]["notes"])
    assert f"{unit}: not given to the check, which runs as root, as they name a path" in notes, notes
    assert ": OPENSSL_CONF" in notes and "APP_MODE" not in notes and "LC_ALL" not in notes, notes
    kept, dropped = importcheck.root_variables(
        (("LANG", "de_DE.UTF-8"), ("LC_ALL", "/home/app/locale"), ("TZ", "Europe/Berlin"),
         ("TZ", ":/home/app/tz"), ("TZ", ":/etc/localtime"), ("PYTHONPATH", "/opt/app"), ("HOME", "/root"),
         ("OPENSSL_CONF", "/home/bob/x"), ("OPENSSL_CONF", "/etc/ssl/x"), ("HF_HOME", "/models"),
         ("URL", "http://0.0.0.0:8000/v1"), ("REL", "conf/x"), ("UP", "/etc/../home/bob"), ("N", "8"),
         ("FILE", "file:///home/bob/x.cnf")),
        lambda path: not path.startswith("/home/"),
        lambda path: not path.startswith("/home/"),
        "/home/app",  # where the child runs: ``conf/x`` is /home/app/conf/x
    )  # fmt: skip
    assert kept == (
        ("LANG", "de_DE.UTF-8"),
        ("TZ", "Europe/Berlin"),
        ("TZ", ":/etc/localtime"),
        ("PYTHONPATH", "/opt/app"),
        ("HOME", "/root"),
        ("OPENSSL_CONF", "/etc/ssl/x"),
        ("HF_HOME", "/models"),
        ("URL", "http://0.0.0.0:8000/v1"),
        ("N", "8"),
    )
    assert dropped == ("LC_ALL", "TZ", "OPENSSL_CONF", "REL", "UP", "FILE")


def _bobs(path: str) -> bool:
    """A judgement as the real one: a path below /home/bob is another user's (a missing one under a
    root-owned directory is root's alone: nobody else can make it)."""
    if "\0" in path:
        raise ValueError("embedded null byte")  # as os.lstat, in the real one
    return not path.startswith("/home/bob")


@pytest.mark.parametrize(
    "value",
    [
        "https://mirror:/home/bob/certs",  # a URL first in a list split at ':' (SSL_CERT_DIR)
        "http://a,/home/bob/plugin.so",  # ... or at ','
        "unix:///home/bob/sock",  # a URL naming a local path whatever its scheme
        "sqlite:////home/bob/db.sqlite",
        "file:///home/bo%62/evil.cnf",  # judged as the literal (missing) path, read as /home/bob/...
        "file:%2Fhome%2Fbob%2Fevil.cnf",  # urllib reads /home/bob/evil.cnf
        "http+unix://%2Fhome%2Fbob%2Fsock/v1",
        "~bob",  # os.path.expanduser (HF_HOME, TORCH_HOME)
        "file:///etc/x%00/home/bob",  # decoded, no path can hold a NUL (lstat raises): dropped
        "file:///%25252525252Fhome",  # more rounds of escapes than a library would decode: dropped
        "bob/x.cnf",  # relative, from a working directory of bob's
    ],
)
def test_a_root_child_takes_no_value_that_names_another_users_path_in_any_shape(value: str) -> None:
    """Each names /home/bob (another user's) for a library that reads it, yet was taken whole (the
    attacker review of this session: a URL read to the next blank, escapes judged undecoded)."""
    kept, dropped = importcheck.root_variables((("V", value),), _bobs, _bobs, "/home")
    assert kept == () and dropped == ("V",), kept


def test_a_root_child_takes_urls_model_ids_and_root_paths() -> None:
    """What a good upgrade's root unit names reaches its check: URLs with a port and a path, a ``file:``
    URL of root's, a list of them, a model by its hub id, a CIDR (relative tokens, judged from the
    working directory, root's); ``HOME`` root's (its directory, not its whole tree: caches)."""
    values = (
        ("URL", "http://0.0.0.0:8000/v1"),
        ("PROXY", "http://proxy.example:3128"),
        ("CONF", "file:///etc/ssl/x.cnf"),
        ("LIST", "https://a.example/simple,https://b.example:8443/x"),
        ("TZ", ":/etc/localtime"),
        ("IPV6", "http://[::1]:8000/v1"),
        ("DB", "postgresql://app:secret@db.example:5432/app"),
        ("MODEL", "meta-llama/Llama-3.1-8B-Instruct"),
        ("NO_PROXY", "localhost,10.0.0.0/8"),
        ("HOME", "/root"),
    )
    kept, dropped = importcheck.root_variables(values, _bobs, _bobs, "/srv")
    assert kept == values and dropped == ()


def test_a_root_child_takes_no_home_of_another_user() -> None:
    """``HOME=/home/bob`` reached root's child with only its user site judged: ~/.cache/huggingface (a
    model's remote code), ~/.gitconfig, ~/.config/matplotlib are bob's. Dropped: the child's is root's."""
    assert importcheck.root_variables((("HOME", "/home/bob"),), _bobs, _bobs, "/") == ((), ("HOME",))
    relative = (("HOME", "app"),)  # relative: its user site judged from where the child runs
    assert importcheck.root_variables(relative, _bobs, _bobs, "/") == (relative, ())
    roots = (("HOME", "/root"),)  # root's home by its directories, never its whole tree (uv's cache)
    assert importcheck.root_variables(roots, lambda path: False, _bobs, "/") == (roots, ())


def _user_site_bed(
    tmp_path: Path,
    units: Units,
    user_manager: UserManager,
    fake_nvml: FakeNvml,
    wheels: wheelhouse.Wheelhouse,
) -> Bed:
    """sicext 1.0 in a root-owned venv that sees the system's site-packages (its interpreter adds a user
    site)."""
    python = tmp_path / "venv" / "bin" / "python"
    subprocess.run(
        [wheelhouse.UV, "venv", "--quiet", "--system-site-packages", "--python", sys.executable,
         str(python.parent.parent)],
        check=True, capture_output=True, env=wheelhouse.uv_env(),
    )  # fmt: skip
    wheelhouse.uv_install(python, wheels["sicext-1"])
    return Bed(python, tmp_path / "state", user_manager, fake_nvml, wheels, units)


def _planted_user_site(home: Path, markers: Path) -> Path:
    """Another user's (uid 65534's) ``home``, whose user site's ``.pth`` leaves a marker in ``markers``
    when the check's child runs it; the user site."""
    markers.mkdir()
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    site = home / ".local" / "lib" / version / "site-packages"
    site.mkdir(parents=True)
    marker = str(markers / "pth")
    (site / "planted.pth").write_text(
        f"import os; 'SAFEINSTALL_SMOKE_SITES' in os.environ and open({marker!r}, 'w').close()\n"
    )
    chown_tree(home, NOBODY)
    return site


def test_the_units_python_s_is_kept_and_its_home_judged(
    tmp_path: Path,
    units: Units,
    user_manager: UserManager,
    fake_nvml: FakeNvml,
    wheels: wheelhouse.Wheelhouse,
) -> None:
    """Issue 43: the check took the unit's ``HOME`` as given and ran without the unit's ``-s``: another
    user's user-site ``.pth`` ran as root in the check, never in the service. Now ``-s`` (and ``-I``,
    ``PYTHONNOUSERSITE``) is kept: the check does not load the user site either."""
    if not AS_ROOT:
        pytest.skip("the child is root only in a root-owned environment of a run as root")
    bed = _user_site_bed(tmp_path, units, user_manager, fake_nvml, wheels)
    python = bed.python
    markers = tmp_path / "markers"
    home = tmp_path / "home"
    site = _planted_user_site(home, markers)
    try:
        unit = bed.units.started("smoke-home", f"{python} -s -m sicext.serve", Environment=f"HOME={home}")
        result = bed.safeinstall("sicext", "--wheel", str(wheels["sicext-2"]), "--settle", "0.5", "--json")
        assert result.code == 0, result.stdout + result.stderr
        assert list(markers.iterdir()) == [], "another user's .pth ran as root in the check"
        assert bed.manager.active_state(unit) == "active" and bed.version() == "2.0"
        # a unit without -s would load that user site as root: judged, and refused before the stop
        loose = bed.units.started("smoke-home-loose", f"{python} -m sicext.serve", Environment=f"HOME={home}")
        main = bed.manager.main_pid(loose)
        refused = bed.safeinstall("sicext", "--wheel", str(wheels["sicext-1"]), "--settle", "0.5", "--json")
        assert refused.code == 2, refused.stdout + refused.stderr
        message = refused.json["errors"][0]["message"]
        assert f"HOME's user site {site}: {home}" in message and "uid 65534 (nobody)" in message, message
        assert list(markers.iterdir()) == [] and bed.manager.main_pid(loose) == main
    finally:
        bed.cleanup()


def test_a_relative_home_is_judged_where_the_check_runs(
    tmp_path: Path,
    units: Units,
    user_manager: UserManager,
    fake_nvml: FakeNvml,
    wheels: wheelhouse.Wheelhouse,
) -> None:
    """The attacker review (4b): a root unit's ``HOME=home`` (relative) with ``WorkingDirectory=`` root's
    directory holding another user's ``home/``: the user site was not judged (only an absolute ``HOME``
    was), and that user's ``.pth`` ran as root in the check. Now a relative ``HOME`` is resolved as the
    interpreter resolves it (against the directory the child starts in, and ``/`` where it falls back
    to it) and judged: exit 2 before the stop, naming the user site and the user."""
    if not AS_ROOT:
        pytest.skip("the child is root only in a root-owned environment of a run as root")
    bed = _user_site_bed(tmp_path, units, user_manager, fake_nvml, wheels)
    markers = tmp_path / "markers"
    work = tmp_path / "work"  # root's: the unit's WorkingDirectory=
    work.mkdir()
    site = _planted_user_site(work / "home", markers)
    try:
        unit = bed.units.started(
            "smoke-relhome",
            f"{bed.python} -m sicext.serve",
            Environment="HOME=home",
            WorkingDirectory=str(work),
        )
        main = bed.manager.main_pid(unit)
        refused = bed.safeinstall("sicext", "--wheel", str(wheels["sicext-2"]), "--settle", "0.5", "--json")
        assert refused.code == 2, refused.stdout + refused.stderr
        assert list(markers.iterdir()) == [], "another user's .pth ran as root in the check"
        message = refused.json["errors"][0]["message"]
        assert f"HOME's user site {site}: " in message and "uid 65534 (nobody)" in message, message
        assert bed.manager.main_pid(unit) == main and bed.version() == "1.0"
    finally:
        bed.cleanup()
    version = (3, 12)
    at = "/.local/lib/python3.12/site-packages"
    assert importcheck.user_site((("HOME", "home"),), "/root", (), version, "/srv/w") == f"/srv/w/home{at}"
    assert importcheck.user_site((("HOME", "home/../x"),), "/root", (), version, "/") == f"/x{at}"
    assert importcheck.user_site((("HOME", ""),), "/root", (), version, "/srv/w") == at
    assert importcheck.user_site((("HOME", "/a/b/.."),), "/root", (), version, "/srv") == f"/a{at}"
    assert importcheck.user_site((), "/root", (), version, "/srv") == f"/root{at}"
