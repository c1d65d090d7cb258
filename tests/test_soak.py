"""The fault soak (issue 22): a bounded, seeded, randomized harness that sends SIGKILL, SIGTERM or SIGINT
to real runs under a real ``systemd --user`` unit (real wheels, the real uv), at a uniform delay or
aimed at a journal phase, and checks after each trial:

* a SIGTERM or SIGINT run ends by itself with exit 0, 2 or 3 (an ``error:`` line for 2 and 3, never a
  traceback) and leaves no journal; after a SIGKILL, ``safeinstall --recover`` exits 0 or 3;
* the unit is active (or was started again by ``--recover``);
* the installed version is the old or the new one, and ``--verify-only`` against its wheel is clean;
* no journal, gate marker, gate drop-in or uv cache of the run is left;
* the next run is not refused (each trial's run is the previous trial's "next run"), and after the
  last trial a run without a signal succeeds and leaves no wheel copy behind.

The default suite runs a short, fixed soak (``SCHEDULE``: a SIGKILL aimed at each phase no other test
kills a run at, SIGTERM and SIGINT before the stop, in the window and as the restart begins, then
``SOAK_DRAWN`` trials drawn at random); ``SAFEINSTALL_SOAK=500`` runs 500 drawn trials (before a release; see
docs/faults.md), ``SAFEINSTALL_SOAK_SEED=N`` replays a seed. The seed is printed (``-s``) and is in
every failure's message.
"""

from __future__ import annotations

import collections
import contextlib
import os
import random
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from safeinstall.store.journal import PHASE_ORDER, Phase
from tests.bed_nvml import FakeNvml
from tests.bed_systemd import UserManager, wait_until
from tests.beds import (
    FULL_DISK_KINDS,
    FULL_DISK_LEAVE_KIB,
    FULL_DISK_MODES,
    Bed,
    DiskWriter,
    ServiceAccountBed,
    fill_disk,
    full_disk_bed,
    full_disk_wheels,
    hidden_tool,
    mode_args,
    running_with,
    smoke_escape_command,
)
from tests.clirun import run
from tests.wheelhouse import Wheelhouse

#: the phases a good run passes, in order (safeinstall.store.journal.Phase, up to "done")
PHASES = tuple(phase.value for phase in PHASE_ORDER[: PHASE_ORDER.index(Phase.DONE) + 1])
SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)
#: the phases the soak's runs pass (with the swap: never "installing"; "prepared" is --prepare's alone)
PASSED = tuple(phase for phase in PHASES if phase not in (Phase.PREPARED, Phase.INSTALLING))
#: the phases another test kills a run at, then recovers it (each run the same way every time)
KILLED_ELSEWHERE = {
    Phase.STAGED: "test_swap.py::test_a_kill_at_each_phase_around_the_swap_then_recover",
    Phase.STOPPED: "test_crash_safety.py::test_sigkill_at_step_boundary_then_recover",
    Phase.SWAPPING: "test_swap.py::test_a_kill_at_each_rename_of_the_swap_then_recover_puts_the_old_"
    "version_back",
    Phase.INSTALLED: "test_crash_safety.py::test_sigkill_at_step_boundary_then_recover",
    Phase.VERIFIED: "test_crash_safety.py::test_sigkill_at_step_boundary_then_recover",
    Phase.RESTARTING: "test_swap.py::test_a_kill_at_each_phase_around_the_swap_then_recover",
    Phase.DONE: "test_swap.py::test_a_kill_at_each_phase_around_the_swap_then_recover",
}
#: the default suite's soak, in order (a signal, the phase it is aimed at): a SIGKILL at each phase no
#: other test kills a run at (then --recover), SIGTERM before the stop (exit 2), SIGINT in the window
#: (rolled back, exit 3), SIGTERM as the restart begins; then SOAK_DRAWN trials drawn by the seed
SCHEDULE: tuple[tuple[signal.Signals, str], ...] = (
    *((signal.SIGKILL, phase) for phase in PASSED if phase not in KILLED_ELSEWHERE),
    (signal.SIGTERM, Phase.STAGED),
    (signal.SIGINT, Phase.STOPPED),
    (signal.SIGTERM, Phase.RESTARTING),
)
SOAK_DRAWN = 2
#: a uniform delay is drawn from [0, UNIFORM_MAX_S) once the run's signal handlers are installed
UNIFORM_MAX_S = 3.0
VERSIONS = {"1.0": "sicext-1", "2.0": "sicext-2"}


@dataclass
class Tally:
    trials: int = 0
    seconds: float = 0.0
    hit: collections.Counter[str] = field(default_factory=collections.Counter)
    outcomes: collections.Counter[str] = field(default_factory=collections.Counter)

    def report(self, seed: int) -> str:
        per = self.seconds / self.trials if self.trials else 0.0
        return (
            f"soak seed {seed}: {self.trials} trials, {per:.2f} s per trial; phases hit "
            f"{dict(sorted(self.hit.items()))}; outcomes {dict(sorted(self.outcomes.items()))}"
        )


def _catches_sigterm(pid: int) -> bool:
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return False
    mask = next(int(line.split()[1], 16) for line in status.splitlines() if line.startswith("SigCgt:"))
    return bool(mask & (1 << (signal.SIGTERM - 1)))


def _aim(bed: Bed, proc: subprocess.Popen[str], target: str | None, delay: float) -> str:
    """Wait for the moment (the journal in ``target``, or ``delay`` seconds once the handlers are in);
    the phase the journal is in then ("-": none yet; "ended": the run finished first)."""
    while not _catches_sigterm(proc.pid):
        if proc.poll() is not None:
            return "ended"
        time.sleep(0.001)
    if target is None:
        deadline = time.monotonic() + delay
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.001)
    else:
        while proc.poll() is None:
            journal = bed.journal()
            if journal is not None and journal["phase"] == target:
                break
            time.sleep(0.0005)
    if proc.poll() is not None:
        return "ended"
    journal = bed.journal()
    return "-" if journal is None else str(journal["phase"])


#: one trial's fault: the signal, the phase it is aimed at (None: a uniform delay), the delay
Fault = tuple[signal.Signals, str | None, float]


def _drawn(rng: random.Random) -> Fault:
    """A fault drawn at random: any signal, aimed at any phase (or none: a uniform delay)."""
    signum = rng.choice(SIGNALS)
    target = rng.choice((None, *PHASES))  # None: a uniform delay
    return signum, target, rng.uniform(0.0, UNIFORM_MAX_S)


def _faults(trials: int | None, rng: random.Random) -> list[Fault]:
    """The soak's faults: ``trials`` drawn at random, or (None) the default suite's SCHEDULE and
    SOAK_DRAWN drawn."""
    if trials is not None:
        return [_drawn(rng) for _ in range(trials)]
    return [(signum, str(target), 0.0) for signum, target in SCHEDULE] + [
        _drawn(rng) for _ in range(SOAK_DRAWN)
    ]


def _trial(bed: Bed, unit: str, version: str, fault: Fault, tally: Tally, where: str) -> str:
    """One trial from ``version`` installed; the version installed after it."""
    other = "2.0" if version == "1.0" else "1.0"
    wheel = bed.wheels[VERSIONS[other]]
    signum, target, delay = fault
    where += f" {signum.name} at " + (target or f"{delay:.3f} s")
    proc = bed.start_run("sicext", "--wheel", str(wheel), "--settle", "0.3")
    try:
        hit = _aim(bed, proc, target, delay)
        if proc.poll() is None:
            proc.send_signal(signum)
        out, err = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    tally.hit[hit] += 1
    code = proc.returncode
    assert "Traceback" not in err, f"{where}: {err}"
    # refused by what an earlier trial left: its journal, or its run still holding the lock
    assert "a previous run (" not in err and "holds the lock" not in err, f"{where}: refused: {err}"
    recovered = None
    if code == -signal.SIGKILL:
        recovered = bed.cli("--recover")
        assert recovered.code in (0, 3), f"{where}: --recover exit {recovered.code}: {recovered.stderr}"
    else:
        assert code in (0, 2, 3), f"{where}: exit {code}: {out}{err}"
        assert code == 0 or "error:" in err, f"{where}: exit {code} without an error line: {err}"
        assert bed.journal() is None, f"{where}: exit {code} left a journal: {bed.journal()}"
    outcome = f"{signum.name}:{code}" + ("" if recovered is None else f"+recover:{recovered.code}")
    tally.outcomes[outcome] += 1
    wait_until(lambda: bed.manager.active_state(unit) == "active", 30, f"{where}: the unit running")
    now = bed.version()
    assert now in VERSIONS, f"{where}: installed version {now!r}"
    check = run(
        "sicext", "--verify-only", "--python", str(bed.python), "--wheel", str(bed.wheels[VERSIONS[now]])
    )
    assert check.code == 0, f"{where}: version {now} does not verify against its wheel: {check.stdout}"
    bed.no_trace()
    print(f"{where} hit {hit}: {outcome}, {version} -> {now}")  # with -s: a long soak's progress
    return now


def _soak(bed: Bed, trials: int | None, what: str) -> None:
    """``trials`` drawn at random, or (None) the default suite's schedule (:func:`_faults`)."""
    seed = int(os.environ.get("SAFEINSTALL_SOAK_SEED") or random.SystemRandom().randrange(2**32))
    faults = _faults(trials, random.Random(seed))
    print(f"{what} soak seed {seed}, {len(faults)} trials (replay: SAFEINSTALL_SOAK_SEED={seed})")
    unit = bed.unit("soak")
    tally = Tally()
    version = bed.version()
    for trial, fault in enumerate(faults):
        started = time.monotonic()
        version = _trial(bed, unit, version, fault, tally, f"seed {seed} trial {trial}:")
        tally.seconds += time.monotonic() - started
        tally.trials += 1
    other = "2.0" if bed.version() == "1.0" else "1.0"
    last = bed.cli("sicext", "--wheel", str(bed.wheels[VERSIONS[other]]), "--settle", "0.3", "--yes")
    assert last.code == 0, f"seed {seed}: the run after the soak: {last.stdout}{last.stderr}"
    assert bed.version() == other
    bed.no_trace()
    assert not list(bed.state.glob("*/wheels/*")), f"seed {seed}: wheel copies left"
    print(what, tally.report(seed))


def test_fault_soak(bed: Bed) -> None:
    trials = os.environ.get("SAFEINSTALL_SOAK")
    _soak(bed, int(trials) if trials else None, "root's environment:")


def test_the_default_soak_aims_a_kill_at_each_phase_and_a_signal_at_each_part_of_a_run() -> None:
    """The default suite's schedule: a SIGKILL at each phase a run passes that no other test kills a run
    at, SIGTERM or SIGINT before the stop, in the window and as the restart begins (the 40 trials drawn
    at random it replaced hit each only by chance); ``SAFEINSTALL_SOAK=N`` draws N."""
    killed = [phase for signum, phase in SCHEDULE if signum == signal.SIGKILL]
    assert sorted([*killed, *KILLED_ELSEWHERE], key=PASSED.index) == list(PASSED)
    assert {Phase.PLANNED, Phase.BACKED_UP, Phase.GATED, Phase.STOPPING, Phase.GPU_RELEASED} <= set(killed)
    stopping, restarting = PASSED.index(Phase.STOPPING), PASSED.index(Phase.RESTARTING)
    parts = {
        "before the stop" if at < stopping else "the window" if at < restarting else "the restart"
        for at in (PASSED.index(phase) for signum, phase in SCHEDULE if signum != signal.SIGKILL)
    }
    assert parts == {"before the stop", "the window", "the restart"}, parts
    assert {signum for signum, _ in SCHEDULE} == set(SIGNALS)
    assert len(_faults(None, random.Random(0))) == len(SCHEDULE) + SOAK_DRAWN
    assert len(_faults(7, random.Random(0))) == 7


def test_fault_soak_of_an_account_environment(account: ServiceAccountBed, tmp_path: Path) -> None:
    """The same soak on uid 65534's environment (uv, the removal, the cache's emptying run as that
    account), run by a safeinstall whose interpreter, standard library and own files that account cannot
    read (:func:`tests.beds.hidden_tool`; issue 35: ``--recover`` failed there on every retry). On demand
    only (``SAFEINSTALL_SOAK=N``): the default suite's soak is root's environment's."""
    trials = int(os.environ.get("SAFEINSTALL_SOAK") or 0)
    if not trials:
        pytest.skip("on demand: SAFEINSTALL_SOAK=N runs N trials")
    account.tool = hidden_tool(tmp_path / "tool")
    _soak(account, trials, "uid 65534's environment, a tool it cannot read:")


#: the phases a disk-full trial's writer starts in (before the stop, at it, in the window)
WRITER_PHASES = ("gated", "stopping", "stopped", "gpu-released")


@pytest.mark.parametrize("kind", FULL_DISK_KINDS)
def test_disk_full_soak(
    kind: str,
    wheels: Wheelhouse,
    tmp_path: Path,
    user_manager: UserManager,
    fake_nvml: FakeNvml,
    small_disk: Callable[..., Path],
    open_dir: Path,
    open_state: Path,
) -> None:
    """Issue 44's disk-full families, on demand (``SAFEINSTALL_SOAK=N``), for root's environment and an
    account's: each trial, sicext 1.0 <-> 2.0 (a 4 MiB blob; 2.0's 128 KiB bigger) on a 48 MiB
    filesystem, with the swap or ``--no-swap``, either full but a random few KiB before the run, or
    taken by a writer that keeps taking what is freed from a random phase on. The run is refused before
    the stop (exit 2) or ends 0 or 3 with the unit running one whole version that verifies against its
    wheel, and nothing left; never exit 4."""
    trials = int(os.environ.get("SAFEINSTALL_SOAK") or 0)
    if not trials:
        pytest.skip("on demand: SAFEINSTALL_SOAK=N runs N trials")
    seed = int(os.environ.get("SAFEINSTALL_SOAK_SEED") or random.SystemRandom().randrange(2**32))
    print(f"disk-full soak ({kind}) seed {seed}, {trials} trials (replay: SAFEINSTALL_SOAK_SEED={seed})")
    rng = random.Random(seed)
    versions = full_disk_wheels(wheels, open_dir)
    bed = full_disk_bed(
        kind, versions["1.0"], wheels, tmp_path, user_manager, fake_nvml, small_disk, open_dir, open_state
    )
    disk = bed.python.parent.parent.parent
    outcomes: collections.Counter[str] = collections.Counter()
    try:
        unit = bed.unit("full-soak")
        version = "1.0"
        for trial in range(trials):
            target = "2.0" if version == "1.0" else "1.0"
            mode = rng.choice(FULL_DISK_MODES)
            phase = rng.choice((None, *WRITER_PHASES))  # None: full before the run
            leave = rng.choice((*FULL_DISK_LEAVE_KIB, rng.randrange(0, 1024))) << 10
            where = f"seed {seed} trial {trial}: {version} -> {target}, {mode}, " + (
                f"full but {leave >> 10} KiB" if phase is None else f"a writer from {phase}"
            )
            args = (
                "sicext",
                "--wheel",
                str(versions[target]),
                "--settle",
                "0.3",
                "--no-smoke",
                *mode_args(mode),
            )
            if phase is None:
                fill_disk(disk, leave)
                try:
                    result = bed.cli(*args, "--yes")
                finally:
                    (disk / "filler").unlink()
                code, err = result.code, result.stderr
            else:
                proc = bed.start_run(*args)
                try:
                    with contextlib.suppress(AssertionError):  # a short run may be past it
                        bed.wait_phase(proc, phase, timeout=60)
                    with DiskWriter(disk):
                        _out, err = proc.communicate(timeout=180)
                finally:
                    if proc.poll() is None:
                        proc.kill()
                        proc.communicate()
                code = proc.returncode
            outcomes[f"{'before' if phase is None else 'writer'}:{code}"] += 1
            assert "Traceback" not in err, f"{where}: {err}"
            assert code in (0, 2, 3), f"{where}: exit {code}: {err}"
            wait_until(lambda: bed.manager.active_state(unit) == "active", 30, f"{where}: the unit running")
            now = bed.version()
            assert now == (target if code == 0 else version), f"{where}: exit {code}, version {now}"
            check = bed.verify("--wheel", str(versions[now]))
            assert check.code == 0, f"{where}: {now} does not verify: {check.stdout}"
            bed.no_trace()
            print(f"{where}: exit {code}")
            version = now
    finally:
        bed.cleanup()
    print(f"disk-full soak ({kind}) seed {seed}: {dict(sorted(outcomes.items()))}")


#: what a smoke-escape trial's check leaves in a session of its own: a sleep, a Python that imports
#: the package, or both
ESCAPES = {"sleep": (True, False), "import": (False, True), "both": (True, True)}


@pytest.mark.parametrize("kind", FULL_DISK_KINDS)
def test_smoke_escape_soak(request: pytest.FixtureRequest, kind: str) -> None:
    """Issue 44's smoke-escape family, on demand (``SAFEINSTALL_SOAK=N``), for root's environment and
    an account's (its unit with ``User=``, the check run as that account): each trial, sicext 1.0 <->
    2.0, with the swap or ``--no-swap``, and a ``--smoke`` command that leaves a ``setsid sleep 1000``,
    a ``setsid`` Python that imports sicext, or both. The run ends 0, not rolled back for them (the
    plan's second scan never counts them); nothing of them outlives the run; the unit runs the new
    version, which verifies against its wheel; nothing of the run is left."""
    trials = int(os.environ.get("SAFEINSTALL_SOAK") or 0)
    if not trials:
        pytest.skip("on demand: SAFEINSTALL_SOAK=N runs N trials")
    seed = int(os.environ.get("SAFEINSTALL_SOAK_SEED") or random.SystemRandom().randrange(2**32))
    print(f"smoke-escape soak ({kind}) seed {seed}, {trials} trials (replay: SAFEINSTALL_SOAK_SEED={seed})")
    rng = random.Random(seed)
    bed: Bed = request.getfixturevalue("bed" if kind == "root" else "account")
    unit = bed.unit("escape-soak") if kind == "account" else bed.service("escape-soak")
    outcomes: collections.Counter[str] = collections.Counter()
    version = bed.version()
    for trial in range(trials):
        target = "2.0" if version == "1.0" else "1.0"
        mode = rng.choice(FULL_DISK_MODES)
        escape = rng.choice(sorted(ESCAPES))
        marker = f"1000.{os.getpid()}{trial:05d}"
        sleeps, imports = ESCAPES[escape]
        where = f"seed {seed} trial {trial}: {version} -> {target}, {mode}, {escape}"
        try:
            result = bed.safeinstall(
                "sicext", "--wheel", str(bed.wheels[VERSIONS[target]]), "--settle", "0.3", "--json",
                "--smoke", smoke_escape_command(marker, sleeps, imports), *mode_args(mode),
            )  # fmt: skip
            left = running_with(marker)
        finally:
            for pid in running_with(marker):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        said = result.stdout + result.stderr
        assert "Traceback" not in said, f"{where}: {said}"
        assert result.code == 0, f"{where}: exit {result.code}: {said}"
        steps = [s["name"] for s in result.json["data"]["steps"]]
        assert "rollback" not in steps, f"{where}: rolled back: {said}"
        assert left == [], f"{where}: what the check started runs on: PIDs {left}"
        wait_until(lambda: bed.manager.active_state(unit) == "active", 30, f"{where}: the unit running")
        assert bed.version() == target, f"{where}: version {bed.version()}"
        check = bed.verify("--wheel", str(bed.wheels[VERSIONS[target]]))
        assert check.code == 0, f"{where}: {target} does not verify: {check.stdout}"
        bed.no_trace()
        outcomes[f"{escape}:{mode}:{result.code}"] += 1
        print(f"{where}: exit {result.code}")
        version = target
    print(f"smoke-escape soak ({kind}) seed {seed}: {dict(sorted(outcomes.items()))}")
