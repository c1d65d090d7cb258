"""Signals at the exact points of the smoke check's start and end beside the prefetch (issue 34; the
attacker review of the change found each of these). The run is the real CLI; a profile hook (the
standard library's ``sys.setprofile``, nothing of safeinstall's patched) sends the signal at the point
of the race, so that each case is deterministic."""

from __future__ import annotations

import sys
from pathlib import Path

from tests.beds import Bed

# A signal sent to the main thread when the smoke pool's submit() returns: it is then blocked
# (held_while_threads_start), so it is handled on leaving that `with`, inside start()'s try.
HOOK = r"""
import os, signal, sys, threading
fired = []
def hook(frame, event, arg):
    if fired or event != "return" or frame.f_code.co_name != "submit":
        return
    pool = frame.f_locals.get("self")
    if str(getattr(pool, "_thread_name_prefix", "")).startswith("safeinstall-smoke"):
        fired.append(True)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
sys.setprofile(hook)
from safeinstall.__main__ import main
sys.argv[0] = "safeinstall"
sys.exit(main())
"""


def test_a_signal_as_the_check_starts_ends_it_rather_than_waiting_for_it(bed: Bed, tmp_path: Path) -> None:
    """SIGTERM handled as start() leaves held_while_threads_start(): the check is known by then, and
    ended at once (not waited for: every context's imports and --smoke command, each up to
    --smoke-timeout) before the run stops with nothing stopped."""
    unit = bed.service("smoke-start-race")
    main = bed.manager.main_pid(unit)
    finished = tmp_path / "finished"
    bed.tool = (sys.executable, "-c", HOOK)
    result = bed.safeinstall(
        "sicext",
        "--wheel",
        str(bed.wheels["sicext-2"]),
        "--json",
        "--smoke",
        f"sleep 5; touch {finished}",
        "--smoke-timeout",
        "600",
    )
    assert result.code == 2, result.stdout + result.stderr
    assert "interrupted by SIGTERM" in result.stdout, result.stdout
    assert bed.manager.main_pid(unit) == main and bed.version() == "1.0"
    assert not finished.exists(), "the run waited for the whole check after SIGTERM (never cancelled)"


# The first SIGTERM as the smoke step begins (before its try: the check is still run.smoke_check, as
# after a signal swallowed in the prefetch and re-raised by Received.checked); the second while
# run_reinstall's `except Exception` waits in abandon() for the pool, before rollback_step defers them.
HOOK_TWICE = r"""
import os, signal, sys, threading
sent = []
def kill():
    sent.append(True)
    signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
def hook(frame, event, arg):  # main thread: the first signal (raised in here: the hook is then gone)
    if not sent and event == "call" and frame.f_code.co_name == "smoke_step" \
            and frame.f_globals.get("__name__") == "safeinstall.run.steps.smoke":
        kill()
def in_pool(frame, event, arg):  # the check's thread: it reaps its cancelled child, so the main
    # thread is in abandon() (which set the cancel event), waiting for this thread
    if len(sent) == 1 and event == "call" and frame.f_code.co_name == "_reap":
        kill()
sys.setprofile(hook)
threading.setprofile(in_pool)
from safeinstall.__main__ import main
sys.argv[0] = "safeinstall"
sys.exit(main())
"""


def test_a_second_signal_while_the_check_is_abandoned_still_rolls_back(bed: Bed, tmp_path: Path) -> None:
    """A second SIGTERM while the check is being ended (a child killed and reaped) waits: the check is
    ended inside the rollback, whose signals are held back, so the rollback runs whole (the journal
    cleared, the staging directory gone: the next run needs no --recover)."""
    unit = bed.service("smoke-twice")
    main = bed.manager.main_pid(unit)
    bed.tool = (sys.executable, "-c", HOOK_TWICE)
    result = bed.safeinstall(
        "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--json", "--smoke", "sleep 30",
        "--smoke-timeout", "600",
    )  # fmt: skip
    assert bed.manager.main_pid(unit) == main and bed.version() == "1.0"
    assert result.code == 2, result.stdout + result.stderr
    bed.no_trace()  # the journal cleared, the staging directory gone: the rollback ran


# SIGTERM as start() prepares the check (its contexts: systemctl show of each unit)
HOOK_PREPARE = r"""
import signal, sys, threading
sent = []
def hook(frame, event, arg):
    if sent or event != "call" or frame.f_code.co_name != "exec_context":
        return
    callers, up = [], frame.f_back
    while up is not None:
        callers.append(up.f_code.co_name)
        up = up.f_back
    if "start" in callers and "prefetch_step" in callers:
        sent.append(True)
        signal.pthread_kill(threading.main_thread().ident, signal.SIGTERM)
sys.setprofile(hook)
from safeinstall.__main__ import main
sys.argv[0] = "safeinstall"
sys.exit(main())
"""


def test_a_signal_while_the_check_is_prepared_stops_the_prefetch(bed: Bed) -> None:
    """A SIGTERM while the check is made ready (its units' settings read) stops the run there: it is not
    taken for a unit whose settings cannot be read (which leaves the check to the smoke step), and the
    prefetch does not go on hashing and verifying the staging tree."""
    unit = bed.service("smoke-prepare-signal")
    main = bed.manager.main_pid(unit)
    bed.tool = (sys.executable, "-c", HOOK_PREPARE)
    result = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--json")
    assert bed.manager.main_pid(unit) == main and bed.version() == "1.0"
    assert result.code == 2, result.stdout + result.stderr
    log = Path(result.json["data"]["log_file"]).read_text()
    assert "not started beside the prefetch" not in log, log
    assert "the run's cache written to disk" not in log, "the prefetch went on after SIGTERM"
