"""The downtime users see (issue 34): with ``--health-url``, ``service_downtime_s`` runs from the first
unit stopped until the health URL answers 200 again, not only while the unit is not active; in
``--json`` and in the summary line. A real unit of the private manager serves the health URL on
loopback, opened only a while after its import (as a model server loads before it serves)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from safeinstall.run.parts.results import service_downtime_s
from tests.bed_systemd import wait_until
from tests.beds import Bed, health_server, maps_so

#: Seconds the served process loads (after its import, before it listens): what a unit's own
#: downtime (stop -> active) does not see and the service downtime does.
LOADING_S = 1.5


def test_service_downtime_runs_until_the_health_url_answers(bed: Bed, tmp_path: Path) -> None:
    server, port = health_server(tmp_path, LOADING_S)
    name = bed.units.started("served", f"{bed.python} {server} {port}")
    wait_until(lambda: maps_so(bed.manager.main_pid(name)) is not None, 15, "server maps the .so")
    url = f"http://127.0.0.1:{port}/health"
    args = ("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.2", "--health-url", url)
    done = bed.safeinstall(*args, "--json")
    assert done.code == 0, done.stdout + done.stderr
    data = done.json["data"]
    unit_down, service_down = data["downtime_s"][name], data["service_downtime_s"]
    # the unit was active again before its process listened: the users' downtime holds its loading too
    assert service_down >= unit_down + LOADING_S, (unit_down, service_down)
    # the summary line says it (back to 1.0: the same run the other way, without --json)
    wait_until(lambda: maps_so(bed.manager.main_pid(name)) is not None, 15, "server maps the .so")
    back = bed.safeinstall("sicext", *args[1:2], str(bed.wheels["sicext-1"]), *args[3:])
    assert back.code == 0, back.stdout + back.stderr
    done_line = next(line for line in back.stdout.splitlines() if line.startswith("done:"))
    assert "; service down " in done_line and done_line.endswith(" s until healthy"), done_line
    # without --health-url there is no such figure (null), and no claim in the summary
    plain = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0.2", "--json")
    assert plain.code == 0, plain.stdout + plain.stderr
    assert plain.json["data"]["service_downtime_s"] is None


def test_the_settle_time_is_not_service_downtime(bed: Bed, tmp_path: Path) -> None:
    """Issue 43, item 5: the health URL is polled from the start, so ``--settle`` (which only adds "stays
    up that long") is not in ``service_downtime_s``: the same unit, the same change, with ``--settle 5``
    and ``--settle 0``, is down the same time, to within the 0.5 s the issue allows (before, the figure
    held the whole settle: 5.9 s against 1.0 s)."""
    server, port = health_server(tmp_path, LOADING_S)
    name = bed.units.started("served", f"{bed.python} {server} {port}")
    url = f"http://127.0.0.1:{port}/health"
    figures: dict[str, float] = {}
    for settle, wheel in (("0", "sicext-2"), ("5", "sicext-1")):
        wait_until(lambda: maps_so(bed.manager.main_pid(name)) is not None, 15, "server maps the .so")
        args = (
            "sicext",
            "--wheel",
            str(bed.wheels[wheel]),
            "--settle",
            settle,
            "--health-url",
            url,
            "--json",
        )
        done = bed.safeinstall(*args)
        assert done.code == 0, done.stdout + done.stderr
        restart = next(s for s in done.json["data"]["steps"] if s["name"] == "restart")
        assert restart["seconds"] >= float(settle), restart  # the settle was waited: after the 200
        down = done.json["data"]["service_downtime_s"]
        figures[settle] = down
    assert abs(figures["5"] - figures["0"]) < 0.5, figures


def test_a_new_version_that_crashes_after_its_start_is_rolled_back_at_once(bed: Bed, tmp_path: Path) -> None:
    """Issue 43, item 5: the new version's service comes up (active), then its main process exits 2 s
    later; the health check, waiting up to 300 s, sees the unit failed and ends at once: rolled back
    (exit 3) within the issue's 10 s of the crash, not after ``--health-timeout``; the old version
    serves again."""
    server, port = health_server(tmp_path)
    crashing = tmp_path / "crashing_server.py"
    crashing.write_text(
        'import runpy, sys, time, sicext\nif sicext.version() == "2.0":\n    time.sleep(2)\n    sys.exit(1)\n'
        f"runpy.run_path({str(server)!r}, run_name='__main__')\n"
    )
    name = bed.units.started("crashing", f"{bed.python} {crashing} {port}")
    wait_until(lambda: maps_so(bed.manager.main_pid(name)) is not None, 15, "server maps the .so")
    url = f"http://127.0.0.1:{port}/health"
    args = ("--settle", "0", "--health-url", url, "--health-timeout", "300", "--json")
    failed = bed.safeinstall("sicext", "--wheel", str(bed.wheels["sicext-2"]), *args)
    assert failed.code == 3, failed.stdout + failed.stderr
    steps = {s["name"]: s for s in failed.json["data"]["steps"]}
    restart = steps["restart"]
    assert restart["status"] == "failed" and f"{name} failed" in restart["detail"], restart
    assert restart["seconds"] < 2 + 10, restart  # the crash 2 s after the start, then 10 s at most
    assert bed.version() == "1.0"
    wait_until(lambda: bed.manager.active_state(name) == "active", 20, "the old version running again")


def test_service_downtime_is_from_the_first_unit_down() -> None:
    """Pure: several units went down at different moments; the first of them starts the figure."""
    assert service_downtime_s({"a.service": 10.0, "b.service": 12.5}, 20.0) == 10.0
    assert service_downtime_s({"a.service": 10.0}, None) is None
    assert service_downtime_s({}, 20.0) is None


#: Seconds the new version loads before it listens, in the test below: the wait it asks systemd in.
QUIET_LOADING_S = 3.0


def test_the_wait_for_health_asks_systemd_about_once_a_second(bed: Bed, tmp_path: Path) -> None:
    """Issue 43, item 5 at little cost: while the health URL is polled (every 0.1 s), the unit is watched
    by its main process's pidfd, and ``systemctl show`` (a process, and D-Bus work in the manager, beside
    the service's own start on a few CPUs) is asked about once a second, not at every poll. Counted by a
    ``systemctl`` on ``PATH`` that logs each call's time, over the seconds the new version loads."""
    server, port = health_server(tmp_path)
    started_at = tmp_path / "loading-since"
    loading = tmp_path / "loading_server.py"
    loading.write_text(
        "import pathlib, runpy, time, sicext\n"
        'if sicext.version() == "2.0":\n'
        f"    pathlib.Path({str(started_at)!r}).write_text(repr(time.time()))\n"
        f"    time.sleep({QUIET_LOADING_S})\n"
        f"runpy.run_path({str(server)!r}, run_name='__main__')\n"
    )
    calls = tmp_path / "systemctl-calls"
    shim = tmp_path / "bin"
    shim.mkdir()
    real = shutil.which("systemctl")
    assert real is not None
    (shim / "systemctl").write_text(f'#!/bin/sh\necho "$(date +%s.%N) $*" >> {calls}\nexec {real} "$@"\n')
    (shim / "systemctl").chmod(0o755)
    name = bed.units.started("loading", f"{bed.python} {loading} {port}")
    wait_until(lambda: maps_so(bed.manager.main_pid(name)) is not None, 15, "server maps the .so")
    url = f"http://127.0.0.1:{port}/health"
    path = f"{shim}{os.pathsep}{os.environ.get('PATH', '/usr/bin:/bin')}"
    args = ("sicext", "--wheel", str(bed.wheels["sicext-2"]), "--settle", "0", "--health-url", url)
    done = bed.safeinstall(*args, "--json", more_env={"PATH": path})
    assert done.code == 0, done.stdout + done.stderr
    since = float(started_at.read_text())
    shows = [
        float(line.split(" ", 1)[0])
        for line in calls.read_text().splitlines()
        if " show " in line and "ActiveState" in line
    ]
    during = [at for at in shows if since <= at <= since + QUIET_LOADING_S]
    # about one a second (the fallback), and one or two to trust the main process's pidfd; at every
    # poll it was 20 to 30 in these 3 s
    assert len(during) <= QUIET_LOADING_S + 3, (len(during), len(shows))
