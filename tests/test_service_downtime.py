"""The downtime users see (issue 34): with ``--health-url``, ``service_downtime_s`` runs from the first
unit stopped until the health URL answers 200 again, not only while the unit is not active; in
``--json`` and in the summary line. A real unit of the private manager serves the health URL on
loopback, opened only a while after its import (as a model server loads before it serves)."""

from __future__ import annotations

from pathlib import Path

from safeinstall.run.results import service_downtime_s
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


def test_service_downtime_is_from_the_first_unit_down() -> None:
    """Pure: several units went down at different moments; the first of them starts the figure."""
    assert service_downtime_s({"a.service": 10.0, "b.service": 12.5}, 20.0) == 10.0
    assert service_downtime_s({"a.service": 10.0}, None) is None
    assert service_downtime_s({}, 20.0) is None
