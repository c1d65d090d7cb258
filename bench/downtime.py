"""Service downtime and whole-run time: safeinstall against the hand sequence, on the same unit and wheel.

Usage: python bench/downtime.py [--case torch|torch-warm|torch-index|torch-account[-warm]|vllm|vllm-cold
                                        |vllm-account|synthetic|both]
                                [--rounds 3] [--blob-mb 64] [--settle 1] [--safeinstall PATH]
                                [--baseline-safeinstall PATH] [--safeinstall-option OPTION]... [--logs DIR]

Starts a private ``systemd --user`` manager (needs /run/systemd/system, as the tests do) and, for each
case, a venv and a unit whose process imports the package, then runs each contender once a round
(the order: below):

* hand:        systemctl --user stop U; uv pip install --reinstall-package P W; systemctl --user start U
               (uv's default link mode, hardlinks into its cache: the fastest thing a person types; the
               same resolution as safeinstall's own command, which reinstalls only P)
* safeinstall: safeinstall P --wheel W --user --yes --settle S (backup, gate, checks, verify: all on)
* baseline:    with ``--baseline-safeinstall PATH``, a second safeinstall build (an older commit's
               venv: ``PATH`` is its ``safeinstall``) doing the same, with a state directory of its
               own, as a third contender in the same rounds; the report adds its figures and the
               new / old ratios (downtime, service downtime, whole run; each direction of a switch)

The order within a round: with two contenders it flips every round; with three it is reversed every
second round and turned by one every two rounds (hand, new, old; old, new, hand; new, old, hand; ...),
so in every six rounds each contender goes first twice, and in every two rounds of a switch case
each contender switches once each way.

Cases:

* ``torch``: the real torch 2.13.0 CPU wheel (192 MB, 12,254 files, 0.7 GB installed); the unit runs
  ``python -c "import torch; ..."``. The wheel is taken from ``.bench/`` or fetched there with
  ``pip download torch==2.13.0 --no-deps`` (an ignored path: it is never committed).
* ``torch-warm``: the same torch wheel, the same path every round (a clean reinstall, a rollback to
  yesterday's build): the hand's uv cache has it unpacked already (filled once before the rounds).
* ``torch-index``: torch reinstalled by name (``torch==2.13.0+cpu``, uv's ``--index-url``) from an index
  the bench serves on loopback holding the wheel alone, the bench's uv cache (root's) warm with it: a
  clean reinstall by name, where safeinstall fills its run's cache from root's (issue 43 item 3: copied
  or cloned since, hardlinked before). ``BENCH_TORCH_WHEEL``: the wheel's path, for any torch case.
* ``vllm``: a venv with vLLM 0.33.0 from the index (``--vllm-wheel``: the 0.32.0 wheel); every install
  switches it to the other release: 0.33.0 -> 0.32.0 (``--wheel``) and back (``vllm==0.33.0``), nine
  distributions each way (torch, triton, flashinfer, nvidia-cudnn, ...: about 4 GB). The hand uses the
  host's own uv cache (``--hand-cache``, default uv's: ``~/.cache/uv``), filled with both releases
  before the rounds: warm. The unit's process imports torch (which both releases change). With an even
  number of rounds each contender makes as many switches each way.
* ``vllm-cold``: the same, the hand's cache a new empty directory each round (it downloads).
  On a host without the CUDA driver (no ``libcuda.so.1``), a build whose smoke check imports vLLM's
  extension modules (8b4561d) refuses every switch (they link the driver):
  ``--safeinstall-option=--no-smoke`` measures it there without the check.
* ``torch-account``: the ``torch`` case in a venv that a service account owns, made for the bench with
  ``useradd`` (``si-bench``, removed with its home at the end): its unit runs as that account, the
  hand's uv runs as that account with the account's own cache (``~si-bench/.cache/uv``), and safeinstall
  (root) fills its run's cache from that cache and swaps in the account's worker.
  ``torch-account-warm``: the same, the same wheel path every round (the account's cache has it).
* ``vllm-account``: the ``vllm`` case in a venv the bench's account owns (as ``torch-account``): the
  unit runs as the account, the hand's uv as the account with the account's own cache, which the
  account fills with both releases before the rounds (it downloads vLLM 0.33.0's stack from the index
  once, about 9 GB); the 0.32.0 wheel is copied into a directory the account can read. safeinstall
  (root) runs with the bench's own uv cache and fills its run's cache from the account's.
* ``synthetic``: the fixture ``sicext`` 1.0 -> 2.0 with a random ``--blob-mb`` file (a C extension).

Each round installs a fresh copy of the wheel (a new path: uv has not seen it, as with a new nightly),
so both contenders start from a cold uv cache; both use one cache of the bench's own (deleted at the
end). Before each command the bench syncs the disks (``sync``): what the previous command left for
the kernel to write back (a run's deleted cache, a pruned backup) does not slow the next one's window.
The downtime is what the unit itself writes: ``ExecStopPost`` appends a timestamp when the main
process has exited, ``ExecStartPre`` when the next start begins; the difference is the downtime. The
service downtime is what users see: the served process opens a health endpoint on loopback after its
import (``BENCH_HEALTH_PORT``), which the bench polls every 10 ms through each round; from its first
unanswered poll (the stop: systemd keeps no timestamps of a unit it unloaded once inactive) until it
answers 200 again, for both contenders (safeinstall runs with ``--health-url``; its own
``service_downtime_s``, from the stop it asked for, is shown too). The
whole run is the wall time of each command. Medians and ratios are printed, and safeinstall's median
step times (from its ``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import http.server
import json
import os
import pwd
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import wheelhouse  # noqa: E402  (the bench reuses the test bed's builders)
from tests.bed_systemd import UserManager, start_user_manager, stop_user_manager  # noqa: E402

SAFEINSTALL = str(Path(sys.executable).parent / "safeinstall")
BENCH_DIR = ROOT / ".bench"
#: a wheel cached outside the checkout (shared by worktrees): taken before one is downloaded
BENCH_CACHE = Path(os.environ.get("BENCH_CACHE", "/work/benchcache"))
TORCH = "torch==2.13.0"
VLLM_NEW = "vllm==0.33.0"
VLLM_WHEEL = Path("/work/vllm-wheels/vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl")

#: After the import: a health endpoint on 127.0.0.1:$BENCH_HEALTH_PORT that answers 200 (the service
#: serves); a ``python -c`` line, as a unit's ExecStart holds it.
HEALTH = (
    "import http.server as h, os; h.HTTPServer(('127.0.0.1', int(os.environ['BENCH_HEALTH_PORT'])), "
    "type('H', (h.BaseHTTPRequestHandler,), {'do_GET': lambda r: (r.send_response(200), r.end_headers()), "
    "'log_message': lambda *a: None})).serve_forever()"
)
SERVE_TORCH = "import torch; torch.ones(4).sum(); " + HEALTH
HEALTH_POLL_S = 0.01
#: the contenders: the hand sequence, this safeinstall, and (``--baseline-safeinstall``) another build
HAND, NEW, OLD = "hand", "safeinstall", "baseline"


def _series() -> dict[str, list[float]]:
    return {HAND: [], NEW: [], OLD: []}


@dataclass
class Case:
    name: str
    package: str
    wheel: Path
    python: Path
    exec_start: str
    times: dict[str, list[float]] = field(default_factory=_series)
    walls: dict[str, list[float]] = field(default_factory=_series)
    #: each safeinstall build's step times (from its ``--json``)
    steps: dict[str, dict[str, list[float]]] = field(default_factory=lambda: {NEW: {}, OLD: {}})
    same_wheel: bool = False  # torch-warm: the same path every round (the hand's cache has it)
    switch: tuple[str, str] | None = None  # vllm: the two requirements an install switches between
    hand_cache: Path | None = None  # the hand's uv cache (None: the bench's own)
    cold: bool = False  # vllm-cold: the hand's cache is new and empty each round
    extra: tuple[str, ...] = ()  # more safeinstall options
    new_extra: tuple[str, ...] = ()  # --safeinstall-option: the new build's alone (the old may not know them)
    order: dict[str, list[int]] = field(default_factory=lambda: {HAND: [], NEW: [], OLD: []})
    #: first unit stopped -> the health endpoint answers 200 (the bench's own poll), and each build's
    #: ``service_downtime_s``
    service: dict[str, list[float]] = field(default_factory=_series)
    reported: dict[str, list[float]] = field(default_factory=lambda: {NEW: [], OLD: []})
    firsts: list[str] = field(default_factory=list)  # who went first in each round
    hand_as: str = ""  # torch-account: what runs the hand's uv as the account (setpriv ...)
    #: torch-index: the requirement installed by name (not ``--wheel``) and uv's options for it
    by_name: str | None = None
    uv_args: tuple[str, ...] = ()
    #: --prepare-commit: each safeinstall build prepares (timed, the service serving), then commits (the
    #: round); each prepare's wall time, by build
    prepare_commit: bool = False
    prepares: dict[str, list[float]] = field(default_factory=lambda: {NEW: [], OLD: []})
    #: --undo: after each round of the new build, its ``--undo`` (downtime, whole run)
    undo: bool = False
    undo_times: list[float] = field(default_factory=list)
    undo_walls: list[float] = field(default_factory=list)

    def options(self, who: str) -> tuple[str, ...]:
        """The options a safeinstall build adds last."""
        return (*self.extra, *self.new_extra) if who == NEW else self.extra


def torch_wheel() -> Path:
    given = os.environ.get("BENCH_TORCH_WHEEL")  # a wheel cached elsewhere (/work/benchcache/...)
    if given:
        return Path(given)
    found = sorted(BENCH_DIR.glob("torch-2.13.0*.whl")) or sorted(BENCH_CACHE.glob("torch-2.13.0*.whl"))
    if not found:
        BENCH_DIR.mkdir(exist_ok=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", TORCH, "--no-deps", "-d", str(BENCH_DIR)],
            check=True,
        )
        found = sorted(BENCH_DIR.glob("torch-2.13.0*.whl"))
    return found[0]


def with_blob(wheel: Path, out_dir: Path, megabytes: int) -> Path:
    """The wheel with an extra data file, so that the install itself takes measurable time."""
    blob = {"sicext/blob.bin": os.urandom(megabytes * 1024 * 1024)}
    return wheelhouse.rebuilt(wheel, out_dir, blob, deflate=False)


def uv_run(env: dict[str, str], *args: str) -> None:
    subprocess.run([wheelhouse.UV, *args], check=True, capture_output=True, text=True, env=env)


def unit_text(exec_start: str, stamps: Path) -> str:
    def stamp(name: str) -> str:  # "%%" is systemd's escape for "%"
        return f"/bin/sh -c 'date +%%s.%%N >> {stamps}/{name}'"

    return f"[Service]\nExecStartPre={stamp('start')}\nExecStart={exec_start}\nExecStopPost={stamp('stop')}\n"


def last_stamp(path: Path) -> float:
    return float(path.read_text().split()[-1])


class HealthWatch:
    """Polls ``http://127.0.0.1:PORT/`` every 10 ms in a thread: when it first did not answer 200
    (``down_at``, monotonic s: just before that poll) and when it answered 200 again (``up_at``)."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/"
        self.down_at: float | None = None
        self.up_at: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def _poll(self) -> None:
        while not self._stop.is_set():
            asked = time.monotonic()
            try:
                with urllib.request.urlopen(self.url, timeout=1) as answer:
                    ok = answer.status == 200
            except (OSError, ValueError):
                ok = False
            if not ok and self.down_at is None:
                self.down_at = asked
            elif ok and self.down_at is not None and self.up_at is None:
                self.up_at = time.monotonic()
            time.sleep(HEALTH_POLL_S)

    def __enter__(self) -> HealthWatch:
        if not self.url.endswith(":0/"):  # port 0: no endpoint to watch
            self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def downtime(self, timeout: float) -> float:
        """Seconds from the first unanswered poll until 200 again (waited for up to ``timeout``)."""
        deadline = time.monotonic() + timeout
        while self.up_at is None or self.down_at is None:
            if time.monotonic() > deadline:
                raise SystemExit(f"{self.url} did not answer 200 again within {timeout:g} s")
            time.sleep(HEALTH_POLL_S)
        return self.up_at - self.down_at


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_round(
    case: Case,
    who: str,
    manager: UserManager,
    unit: str,
    stamps: Path,
    command: list[str],
    env: dict[str, str],
    port: int | None = None,
) -> None:
    os.sync()  # what the previous command left to write back (a run's deletions) does not land in this one's
    with HealthWatch(port or 0) as watch:
        started = time.monotonic()
        proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
        wall = time.monotonic() - started
        if proc.returncode != 0:
            raise SystemExit(
                f"{who} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
            )
        manager.wait_active(unit, timeout=60)
        if port is not None:  # the stop -> health 200, as safeinstall's service_downtime_s
            case.service[who].append(watch.downtime(600))
    down = last_stamp(stamps / "start") - last_stamp(stamps / "stop")
    case.times[who].append(down)
    case.walls[who].append(wall)
    if who != HAND:
        data = json.loads(proc.stdout)["data"]
        for step in data["steps"]:
            case.steps[who].setdefault(step["name"], []).append(step["seconds"])
        if data.get("service_downtime_s") is not None:
            case.reported[who].append(data["service_downtime_s"])


def _requirement(text: str) -> list[str]:
    """safeinstall's arguments for a requirement or a wheel path."""
    return ["vllm", "--wheel", text] if text.endswith(".whl") else [text]


def _hand_command(unit: str, case: Case, target: str) -> list[str]:
    """The hand sequence: stop, ``uv pip install --reinstall-package`` of ``target``, start."""
    return [
        "sh",
        "-c",
        f"systemctl --user stop {unit} && "
        f"{case.hand_as}{wheelhouse.UV} pip install --quiet --python {case.python} "
        f"--reinstall-package {case.package} {target} && "
        f"systemctl --user start {unit}",
    ]


def _safeinstall_command(
    safeinstall: str, case: Case, settle: float, args: list[str], extra: tuple[str, ...] = ()
) -> list[str]:
    """safeinstall doing the same: ``args`` name what it installs, ``extra`` goes last (then uv's own
    options after ``--``)."""
    options = ["--python", str(case.python), "--user", "--yes", "--json", "--settle", f"{settle:g}"]
    return [safeinstall, *args, *options, *extra, *(("--", *case.uv_args) if case.uv_args else ())]


#: The options ``--commit`` takes (the window's); the others go to ``--prepare`` (``--keep-backups``...)
WINDOW_OPTIONS = ("--settle", "--health-url", "--health-timeout", "--stop-timeout", "--gpu-timeout")


def split_window(options: tuple[str, ...]) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Pure: ``options`` as (the window's, the rest); an option's value (the next word, where it does not
    start with ``--``) goes with it."""
    window: list[str] = []
    rest: list[str] = []
    index = 0
    while index < len(options):
        word = options[index]
        takes = index + 1 < len(options) and not options[index + 1].startswith("--") and "=" not in word
        group = list(options[index : index + (2 if takes else 1)])
        (window if word.split("=", 1)[0] in WINDOW_OPTIONS else rest).extend(group)
        index += len(group)
    return tuple(window), tuple(rest)


def _prepare(
    safeinstall: str, case: Case, args: list[str], env: dict[str, str], extra: tuple[str, ...] = ()
) -> float:
    """``--prepare`` (nothing stops) with ``extra`` (the options ``--commit`` does not take): its wall
    time."""
    options = ["--python", str(case.python), "--user", "--yes", "--json", "--prepare", *extra]
    uv = ("--", *case.uv_args) if case.uv_args else ()
    os.sync()
    started = time.monotonic()
    proc = subprocess.run(
        [safeinstall, *args, *options, *uv], env=env, capture_output=True, text=True, check=False
    )
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(
            f"prepare failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    return wall


def _undo_round(
    case: Case,
    safeinstall: str,
    settle: float,
    manager: UserManager,
    unit: str,
    stamps: Path,
    env: dict[str, str],
) -> None:
    """The new build's ``--undo`` of the run it just made: its downtime (the unit's stamps) and wall."""
    command = [safeinstall, "--undo", "--python", str(case.python), "--user", "--yes", "--json"]
    command += ["--settle", f"{settle:g}"]
    os.sync()
    started = time.monotonic()
    proc = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    wall = time.monotonic() - started
    if proc.returncode != 0:
        raise SystemExit(
            f"undo failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
        )
    manager.wait_active(unit, timeout=60)
    case.undo_times.append(last_stamp(stamps / "start") - last_stamp(stamps / "stop"))
    case.undo_walls.append(wall)
    steps = {step["name"]: round(step["seconds"], 2) for step in json.loads(proc.stdout)["data"]["steps"]}
    print(f"  {case.name} undo downtime {case.undo_times[-1]:6.2f} s  whole run {wall:6.2f} s  steps {steps}")


def round_order(contenders: tuple[str, ...], round_: int) -> tuple[str, ...]:
    """Who goes when in round ``round_``: reversed every second round (so that in a switch case each
    contender switches once each way in every two rounds) and, with more than two contenders, turned
    by one every two rounds (each goes first as often as the others in every ``2 * len`` rounds)."""
    turn = (round_ // 2) % len(contenders) if len(contenders) > 2 else 0
    order = contenders[turn:] + contenders[:turn]
    return order if round_ % 2 == 0 else order[::-1]


def bench_case(
    case: Case,
    manager: UserManager,
    work: Path,
    rounds: int,
    settle: float,
    uv_cache: Path,
    builds: dict[str, str],
    pause: float = 0.0,
) -> None:
    """The rounds of one case; ``builds``: the safeinstall of each contender but the hand (NEW, and
    OLD with ``--baseline-safeinstall``)."""
    unit = f"bench-{case.name}.service"
    stamps = work / f"stamps-{case.name}"
    stamps.mkdir()
    port = free_port()  # the served process's health endpoint (HEALTH)
    manager.write_unit(unit, unit_text(case.exec_start, stamps) + f"Environment=BENCH_HEALTH_PORT={port}\n")
    case.extra = (*case.extra, "--health-url", f"http://127.0.0.1:{port}/")
    manager.start(unit)
    manager.wait_active(unit, timeout=60)
    env = {**manager.env, "UV_CACHE_DIR": str(uv_cache)}
    env.pop("VIRTUAL_ENV", None)
    fresh = work / "fresh"
    contenders = (HAND, *builds)
    installs = 0
    try:
        for round_ in range(rounds):
            order = round_order(contenders, round_)
            case.firsts.append(order[0])
            for who in order:
                target = fresh / f"{case.name}-{round_}-{who}"
                target.mkdir(parents=True)
                hand_env = dict(env)
                if case.hand_cache is not None:
                    hand_env["UV_CACHE_DIR"] = str(case.hand_cache)
                if case.cold:
                    hand_env["UV_CACHE_DIR"] = str(target / "cold-cache")
                # each build its own state (an older build may not read a newer one's)
                state = {"SAFEINSTALL_STATE_DIR": str(work / ("state" if who == NEW else f"state-{who}"))}
                if case.switch is not None:
                    wanted = case.switch[installs % 2]
                    case.order[who].append(installs)
                    installs += 1
                    what, args = f"'{wanted}'", _requirement(wanted)
                    label = f"-> {wanted.rsplit('/', 1)[-1]:<24} "
                    # the host's cache (vllm, vllm-cold) for everyone; an account's is the hand's alone:
                    # root's safeinstall keeps the bench's own and fills its run's cache from the account's
                    shared = case.hand_as == "" or who == HAND
                elif case.by_name is not None:  # torch-index: by name, from the bench's index
                    what = " ".join((f"'{case.by_name}'", *case.uv_args))
                    args, label, shared = [case.by_name], "", who == HAND
                else:
                    wheel = case.wheel
                    if not case.same_wheel:
                        wheel = Path(shutil.copy(case.wheel, target / case.wheel.name))
                    what, args, label = str(wheel), [case.package, "--wheel", str(wheel)], ""
                    shared = who == HAND
                if who == HAND:
                    command = _hand_command(unit, case, what)
                else:
                    command = _safeinstall_command(builds[who], case, settle, args, case.options(who))
                run_env = {**(hand_env if shared else env), **state}
                if who != HAND and case.prepare_commit:  # the checks while it serves; the round commits
                    window, fixed = split_window(case.options(who))
                    case.prepares[who].append(_prepare(builds[who], case, args, run_env, fixed))
                    commit = replace(case, uv_args=())  # uv's options were the prepare's
                    command = _safeinstall_command(builds[who], commit, settle, ["--commit"], window)
                run_round(case, who, manager, unit, stamps, command, run_env, port)
                if who == NEW and case.undo:  # back to what ran before, as the hand would reinstall it
                    _undo_round(case, builds[who], settle, manager, unit, stamps, run_env)
                shutil.rmtree(target)
                if pause > 0:  # every contender alike: the last run's writes and trims settle first
                    os.sync()
                    time.sleep(pause)
                print(
                    f"  {case.name} round {round_ + 1} {who:<11} {label}downtime {case.times[who][-1]:6.2f} s"
                    f"  service {case.service[who][-1]:6.2f} s  whole run {case.walls[who][-1]:6.2f} s",
                    flush=True,
                )
    finally:
        manager.stop(unit)


#: torch-account: the service account the bench makes (and removes with its home at the end)
BENCH_ACCOUNT = "si-bench"


def make_account() -> tuple[int, int, Path]:
    """The bench's service account, made with ``useradd`` (a home of its own, where its uv cache is)."""
    subprocess.run(
        ["useradd", "--system", "--create-home", "--shell", "/usr/sbin/nologin", BENCH_ACCOUNT],
        check=True,
        capture_output=True,
        text=True,
    )
    entry = pwd.getpwnam(BENCH_ACCOUNT)
    return entry.pw_uid, entry.pw_gid, Path(entry.pw_dir)


def remove_account() -> None:
    """The account and its home gone (its processes, the units', are stopped before)."""
    home = Path("/home") / BENCH_ACCOUNT
    with contextlib.suppress(KeyError):
        home = Path(pwd.getpwnam(BENCH_ACCOUNT).pw_dir)
    done = subprocess.run(["userdel", "--remove", BENCH_ACCOUNT], check=False, capture_output=True, text=True)
    if done.returncode not in (0, 6):  # 6: no such user
        print(f"userdel {BENCH_ACCOUNT}: {done.stderr.strip()}", file=sys.stderr)
    if home.name == BENCH_ACCOUNT and home.exists():
        shutil.rmtree(home, ignore_errors=True)


#: the cases whose venv the bench's account owns
ACCOUNT_CASES = ("torch-account", "torch-account-warm", "vllm-account")


def account_case(work: Path, name: str, vllm_wheel: Path) -> Case:
    """A case (``ACCOUNT_CASES``) in a venv the bench's account owns, installed by that account's uv
    with its own cache; the unit runs as the account, the hand's uv too."""
    remove_account()  # one a bench that died left
    uid, gid, home = make_account()
    try:
        if name == "vllm-account":
            return _vllm_account_case(work, uid, gid, home, vllm_wheel)
        return _account_case(work, uid, gid, home, warm=name == "torch-account-warm")
    except BaseException:
        remove_account()
        raise


def _account_venv(work: Path, uid: int, gid: int, name: str) -> tuple[str, Path]:
    """The setpriv prefix that runs a command as the account, and the python of its new venv."""
    work.chmod(0o755)  # the account opens its venv, the fresh wheels and the run's uv cache below it
    as_account = f"setpriv --reuid={uid} --regid={gid} --clear-groups "
    interpreter = wheelhouse.shared_interpreter()
    if interpreter is None:
        raise SystemExit(f"{name}: no interpreter every user may run")
    python = wheelhouse.make_venv(work / f"{name}-venv", interpreter)
    subprocess.run(["chown", "-R", f"{uid}:{gid}", str(python.parent.parent)], check=True)
    return as_account, python


def _as_account_install(as_account: str, cache: Path, python: Path, requirement: str) -> None:
    """``uv pip install`` of ``requirement`` as the account, with its own cache."""
    env = {**wheelhouse.uv_env(), "UV_CACHE_DIR": str(cache)}
    install = [wheelhouse.UV, "pip", "install", "--quiet", "--python", str(python), requirement]
    subprocess.run([*as_account.split(), *install], check=True, env=env)


def _readable_copy(wheel: Path, directory: Path) -> Path:
    """``wheel`` copied into ``directory`` (made 0755: the account reads it)."""
    directory.mkdir()
    directory.chmod(0o755)
    copy = Path(shutil.copy(wheel, directory / wheel.name))
    copy.chmod(0o644)
    return copy


def _account_case(work: Path, uid: int, gid: int, home: Path, warm: bool) -> Case:
    """torch; ``warm``: the same wheel path every round, which the account's cache holds unpacked
    (torch-account-warm)."""
    name = "torch-account-warm" if warm else "torch-account"
    as_account, python = _account_venv(work, uid, gid, "torch-account")
    cache = home / ".cache" / "uv"
    wheel = torch_wheel()
    readable = work / "torch-account-wheel"
    first = _readable_copy(wheel, readable)
    _as_account_install(as_account, cache, python, str(first))
    if not warm:
        shutil.rmtree(readable)
    return Case(
        name,
        "torch",
        first if warm else wheel,
        python,
        f'{as_account}{python} -c "{SERVE_TORCH}"',
        same_wheel=warm,
        hand_cache=cache,
        hand_as=as_account,
    )


def _vllm_account_case(work: Path, uid: int, gid: int, home: Path, vllm_wheel: Path) -> Case:
    """vllm: switched between 0.33.0 from the index and the 0.32.0 wheel (a copy the account can
    read); the account's cache filled with both releases by installing each once, as the account."""
    as_account, python = _account_venv(work, uid, gid, "vllm-account")
    cache = home / ".cache" / "uv"
    wheel = _readable_copy(vllm_wheel, work / "vllm-account-wheel")
    for requirement in (str(wheel), VLLM_NEW):  # both releases in the account's cache; 0.33.0 stays
        started = time.monotonic()
        _as_account_install(as_account, cache, python, requirement)
        print(
            f"  vllm-account: {requirement.rsplit('/', 1)[-1]} installed as {BENCH_ACCOUNT} "
            f"({time.monotonic() - started:.0f} s)",
            flush=True,
        )
    return Case(
        "vllm-account",
        "vllm",
        wheel,
        python,
        f'{as_account}{python} -c "{SERVE_TORCH}"',
        switch=(str(wheel), VLLM_NEW),
        hand_cache=cache,
        hand_as=as_account,
        extra=("--keep-backups", "1"),  # each backup holds the old release's 4 GB of inodes
    )


def _listed(values: list[float]) -> list[float]:
    return [round(value, 2) for value in values]


def _median_line(label: str, who: str, values: list[float]) -> str:
    return f"  {label:<10} {who:<11} median {statistics.median(values):6.2f} s {_listed(values)}"


def _ratio(case: Case, series: dict[str, list[float]], mine: str, theirs: str) -> str:
    """The ratio of ``mine``'s and ``theirs``' medians, and per pair: the n-th of each (one round), or
    in a switch case the n-th of each to the same release (within a round the contenders switch
    different ways), those to ``switch[0]`` first."""
    ratio = statistics.median(series[mine]) / statistics.median(series[theirs])
    if case.switch is None:
        pairs = list(zip(series[mine], series[theirs], strict=True))
    else:
        pairs = [  # with an odd number of rounds one contender has one more of a direction: left out
            pair
            for index in (0, 1)
            for pair in zip(
                _direction(case, series, mine, index), _direction(case, series, theirs, index), strict=False
            )
        ]
    return f"{ratio:.2f}x (per {'pair' if case.switch else 'round'} {_listed([m / t for m, t in pairs])})"


def _direction(case: Case, series: dict[str, list[float]], who: str, index: int) -> list[float]:
    """``who``'s figures of the installs to ``case.switch[index]`` (the n-th install goes to n % 2)."""
    return [t for n, t in zip(case.order[who], series[who], strict=True) if n % 2 == index]


def report(case: Case, rounds: int, settle: float, baseline: str | None = None) -> None:
    """The medians, safeinstall / hand, and with ``baseline`` (its path) the old build's figures and
    new / old."""
    builds = (NEW, OLD) if baseline is not None else (NEW,)
    print(
        f"\n{case.name}: {case.wheel.name}, {rounds} rounds, --settle {settle:g}, "
        f"load {os.getloadavg()[0]:.1f}; first in each round: {', '.join(case.firsts)}"
    )
    if baseline is not None:
        print(f"  {OLD}: {baseline}")
    if case.new_extra:
        print(f"  {NEW} ran with {' '.join(case.new_extra)} (--safeinstall-option)")
    for label, series in (("downtime", case.times), ("whole run", case.walls)):
        for who in (HAND, *builds):
            print(_median_line(label, who, series[who]))
    warm = ("torch-warm", "torch-index", "vllm", "torch-account", "torch-account-warm", "vllm-account")
    goal = "0.5x" if case.name in warm else "0.3x" if case.name == "vllm-cold" else "1.0x"
    for who in builds:
        print(f"  downtime {who} / hand = {_ratio(case, case.times, who, HAND)}; goal <= {goal}")
    if case.service[HAND] and case.service[NEW]:  # first unit stopped -> health answers 200
        for who in (HAND, *builds):
            print(_median_line("service", who, case.service[who]))
        for who in builds:
            print(
                f"  service downtime {who} / hand = {_ratio(case, case.service, who, HAND)}; "
                f"{who}'s own service_downtime_s {_listed(case.reported[who]) or 'not reported'}"
            )
    if case.prepares[NEW]:  # the prepare is the service's time serving; the commit is the round
        for who in builds:
            print(_median_line("prepare", who, case.prepares[who]))
        for who in builds:
            ratio = _ratio(case, case.walls, who, HAND)
            print(f"  commit whole run {who} / hand whole sequence = {ratio}; goal <= 2x")
    if case.undo_times:
        undo = statistics.median(case.undo_times) / statistics.median(case.times[HAND])
        print(_median_line("undo down", NEW, case.undo_times))
        print(_median_line("undo run", NEW, case.undo_walls))
        print(f"  undo downtime / hand downtime = {undo:.2f}x; goal <= 0.5x")
    whole_goal = "4x" if case.name.startswith("vllm") else "3x"
    for who in builds:
        print(f"  whole run {who} / hand = {_ratio(case, case.walls, who, HAND)}; goal <= {whole_goal}")
    if baseline is not None:  # side by side: nothing existing may get slower by more than 10%
        print(f"  new / old: downtime {_ratio(case, case.times, NEW, OLD)}")
        if case.service[OLD]:
            print(f"             service downtime {_ratio(case, case.service, NEW, OLD)}")
        print(f"             whole run {_ratio(case, case.walls, NEW, OLD)}")
    if case.switch is not None:  # each direction by itself: every contender doing the same switch
        for index, target in enumerate(case.switch):
            label = target.rsplit("/", 1)[-1]
            for what, series in (("downtime", case.times), ("whole run", case.walls)):
                mine = {who: _direction(case, series, who, index) for who in (HAND, *builds)}
                if not all(mine.values()):
                    continue
                hand = statistics.median(mine[HAND])
                figures = "  ".join(
                    f"{who} {statistics.median(mine[who]):6.2f} s {_listed(mine[who])}"
                    + ("" if who == HAND else f" {statistics.median(mine[who]) / hand:.2f}x")
                    for who in (HAND, *builds)
                )
                if baseline is not None:
                    figures += f"  new/old {statistics.median(mine[NEW]) / statistics.median(mine[OLD]):.2f}x"
                print(f"  -> {label:<24} {what:<9} {figures}")
    for who in builds:
        steps = ", ".join(
            f"{name} {statistics.median(values):.2f}" for name, values in case.steps[who].items()
        )
        print(f"  {who} median step seconds: {steps}")


class _Quiet(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args: object) -> None:
        pass


def serve_index(work: Path, wheel: Path) -> str:
    """A simple index (PEP 503) on loopback holding ``wheel`` alone, served from a thread until the bench
    exits; its URL."""
    files, project = work / "index" / "files", work / "index" / "simple" / "torch"
    files.mkdir(parents=True)
    project.mkdir(parents=True)
    shutil.copy(wheel, files / wheel.name)
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    (project / "index.html").write_text(
        f'<a href="../../files/{wheel.name}#sha256={digest}">{wheel.name}</a>\n'
    )
    handler = functools.partial(_Quiet, directory=str(work / "index"))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_address[1]}/simple"


def index_case(work: Path, uv_env: dict[str, str]) -> Case:
    """torch-index: torch reinstalled by name from an index (the bench's own, on loopback), the bench's
    uv cache (root's, which safeinstall's run fills its own from) warm with it: the clean reinstall of
    issue 43 item 3, where a build before it linked from root's cache and one after it copies."""
    python = wheelhouse.make_venv(work / "torch-index-venv")
    wheel = torch_wheel()
    uv_run(uv_env, "pip", "install", "--quiet", "--python", str(python), "--link-mode", "copy", str(wheel))
    url = serve_index(work, wheel)
    requirement = "torch==" + wheel.name.split("-")[1]  # 2.13.0+cpu
    warm = ("--reinstall-package", "torch", "--link-mode", "copy", requirement, "--index-url", url)
    uv_run(uv_env, "pip", "install", "--quiet", "--python", str(python), *warm)  # the cache warm
    return Case(
        "torch-index",
        "torch",
        wheel,
        python,
        f'{python} -c "{SERVE_TORCH}"',
        by_name=requirement,
        uv_args=("--index-url", url),
    )


def make_cases(args: argparse.Namespace, work: Path) -> list[Case]:
    """The cases ``--case`` names, each with its venv installed and its unit's command."""
    uv_env = {**wheelhouse.uv_env(), "UV_CACHE_DIR": str(work / "uv-cache")}
    cases: list[Case] = []
    if args.case in ("torch", "both"):
        python = wheelhouse.make_venv(work / "torch-venv")
        wheel = torch_wheel()
        uv_run(
            uv_env, "pip", "install", "--quiet", "--python", str(python), "--link-mode", "copy", str(wheel)
        )
        cases.append(Case("torch", "torch", wheel, python, f'{python} -c "{SERVE_TORCH}"'))
    if args.case == "torch-warm":
        python = wheelhouse.make_venv(work / "torch-warm-venv")
        wheel = Path(shutil.copy(torch_wheel(), work / torch_wheel().name))  # one path for every round
        uv_run(uv_env, "pip", "install", "--quiet", "--python", str(python), str(wheel))  # the cache warm
        cases.append(
            Case("torch-warm", "torch", wheel, python, f'{python} -c "{SERVE_TORCH}"', same_wheel=True)
        )
    if args.case == "torch-index":
        cases.append(index_case(work, uv_env))
    if args.case in ACCOUNT_CASES:
        cases.append(account_case(work, args.case, args.vllm_wheel))
    if args.case in ("vllm", "vllm-cold"):
        hand_env = {**wheelhouse.uv_env(), "UV_CACHE_DIR": str(args.hand_cache)}
        python = wheelhouse.make_venv(work / "vllm-venv")
        for requirement in (str(args.vllm_wheel), VLLM_NEW):  # both releases in the hand's cache
            uv_run(hand_env, "pip", "install", "--quiet", "--python", str(python), requirement)
        cases.append(
            Case(
                args.case,
                "vllm",
                args.vllm_wheel,
                python,
                f'{python} -c "{SERVE_TORCH}"',
                switch=(str(args.vllm_wheel), VLLM_NEW),
                hand_cache=args.hand_cache,
                cold=args.case == "vllm-cold",
                extra=("--keep-backups", "1"),  # each backup holds the old release's 4 GB of inodes
            )
        )
    if args.case in ("synthetic", "both"):
        built = wheelhouse.build_all(work / "wheels")
        (work / "big").mkdir()
        wheel = with_blob(built["sicext-2"], work / "big", args.blob_mb)
        python = wheelhouse.make_venv(work / "sicext-venv")
        wheelhouse.uv_install(python, built["sicext-1"])
        serve = f'{python} -c "import sicext; {HEALTH}"'
        cases.append(Case(f"synthetic-{args.blob_mb}MiB", "sicext", wheel, python, serve))
    return cases


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--case",
        choices=(
            "torch",
            "torch-warm",
            "torch-index",
            "torch-account",
            "torch-account-warm",
            "vllm",
            "vllm-cold",
            "vllm-account",
            "synthetic",
            "both",
        ),
        default="both",
    )
    parser.add_argument("--safeinstall", default=SAFEINSTALL, help="the safeinstall to run (another build)")
    parser.add_argument(
        "--baseline-safeinstall",
        metavar="PATH",
        help="a second safeinstall build (e.g. an older commit's venv/bin/safeinstall): a third contender "
        "in the same rounds, reported side by side (new / old)",
    )
    parser.add_argument(
        "--safeinstall-option",
        action="append",
        default=[],
        metavar="OPTION",
        help="an option the new build (--safeinstall) adds to every run, not the baseline: "
        "--safeinstall-option=--no-smoke measures the new build without its smoke check",
    )
    parser.add_argument("--vllm-wheel", type=Path, default=VLLM_WHEEL, help="vLLM 0.32.0's wheel")
    parser.add_argument(
        "--hand-cache",
        type=Path,
        default=Path.home() / ".cache" / "uv",
        help="vllm: the hand's uv cache (the host's; filled with both releases before the rounds)",
    )
    parser.add_argument("--work", type=Path, default=BENCH_DIR, help="where the bench's files go")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--logs", type=Path, help="copy safeinstall's run logs here before the work goes")
    parser.add_argument("--blob-mb", type=int, default=64)
    parser.add_argument("--settle", type=float, default=1.0)
    parser.add_argument(
        "--pause",
        type=float,
        default=0.0,
        help="seconds to wait after each contender's run, the disk synced first (a host does not reinstall "
        "every half minute: a disk mounted with discard is still trimming the last run's deletes)",
    )
    parser.add_argument(
        "--prepare-commit",
        action="store_true",
        help="each safeinstall build runs --prepare (timed apart, nothing stops), then --commit: the "
        "round's figures",
    )
    parser.add_argument("--undo", action="store_true", help="after each round, the new build's --undo")
    args = parser.parse_args()
    builds = {NEW: args.safeinstall}
    if args.baseline_safeinstall is not None:
        builds[OLD] = args.baseline_safeinstall
    args.work.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="downtime-", dir=args.work))
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a bench stopped still cleans up
    cases: list[Case] = []
    try:
        cases = make_cases(args, work)
        for case in cases:
            case.new_extra = (*case.new_extra, *args.safeinstall_option)
            case.prepare_commit, case.undo = args.prepare_commit, args.undo
        manager = start_user_manager(work / "manager")
        try:
            for case in cases:
                bench_case(
                    case, manager, work, args.rounds, args.settle, work / "uv-cache", builds, args.pause
                )
        finally:
            stop_user_manager(manager)
    finally:
        if args.logs is not None:  # the runs' own step times (what the summary's medians come from)
            args.logs.mkdir(parents=True, exist_ok=True)
            for state in work.glob("state*"):
                for log in state.glob("*/logs/*.log"):
                    shutil.copy(log, args.logs / f"{state.name}-{log.name}")
        shutil.rmtree(work, ignore_errors=True)
        if args.case in ACCOUNT_CASES:
            remove_account()
    for case in cases:
        report(case, args.rounds, args.settle, args.baseline_safeinstall)
    return 0


if __name__ == "__main__":
    sys.exit(main())
