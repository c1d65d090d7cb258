"""One renderer over the run's JSON document: the foreground run and ``--status --wait`` (which reads
the same document from the run's history entry) show the same lines."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console

from safeinstall.cli.render import render_entry, render_run
from safeinstall.store.history import HistoryEntry, new_entry
from safeinstall.store.rundoc import RunDocument

RUN_ID = "20261202T060000Z-42"


def _document() -> dict[str, Any]:
    return {
        "safeinstall_result_version": 1,
        "command": "reinstall",
        "status": "done",
        "exit_code": 0,
        "data": {
            "run_id": RUN_ID,
            "plan": {"distributions": [{"name": "sipure", "old_version": "1.0", "new_version": "2.0"}]},
            "downtime_s": {"api.service": 1.25},
            "service_downtime_s": 3.5,
            "not_restarted": ["batch.service"],
            "strays_killed": [4242],
            "old_code": [
                {
                    "pid": 77,
                    "name": "worker",
                    "cmdline": ["python"],
                    "unit": None,
                    "scope": "session-1.scope",
                    "distributions": ["sipure"],
                    "paths": ["/v/lib/sipure/_x.so"],
                }
            ],
            "patches": [{"path": "sipure/a.py", "status": "carried", "detail": "merged", "diff": ""}],
            "patch_file": "/state/patches/x.patch",
            "patched": ["sipure/b.py", "sipure/gone.py"],
            "deleted": ["sipure/gone.py"],
            "extras": ["sipure/stale.py"],
            "pruned": [],
            "backup_dir": "/state/backups/x",
            "backups_removed": ["/state/backups/old"],
            "log_file": "/state/logs/x.log",
            "notes": ["[bold]a note[/] with markup"],
        },
        "errors": [],
    }


def _render(draw: Any) -> list[str]:
    out, err = io.StringIO(), io.StringIO()
    draw(Console(file=out, width=200, no_color=True), Console(file=err, width=200, no_color=True))
    return (out.getvalue() + err.getvalue()).splitlines()


def test_status_wait_shows_every_line_the_foreground_run_shows() -> None:
    document = RunDocument.from_json(_document())
    foreground = _render(lambda out, err: render_run(out, err, document, RUN_ID))
    entry = new_entry(RUN_ID, "sipure", "2026-12-02T06:00:00+00:00", "2026-12-02T06:01:00+00:00", document)
    assert HistoryEntry.from_json(entry.to_json()) == entry and document.to_json() == _document()
    waited = _render(lambda out, err: render_entry(out, err, entry))
    for expected in (
        "done: sipure 1.0 -> 2.0; installed and verified; service down 3.5 s until healthy",
        "  sipure/gone.py",  # under "files deleted locally", not "locally patched"
        "api.service was down for 1.2 s",
        "batch.service left stopped (--no-restart)",
        "stray PID 4242 was ended and not restarted",
        "still maps replaced files of sipure (/v/lib/sipure/_x.so): it runs old code",
        "carried sipure/a.py: merged",
        "leftover sipure/stale.py: left in place (--prune removes)",
        "note: [bold]a note[/] with markup",  # markup in a note is shown, never interpreted
    ):
        assert any(expected in line for line in foreground), (expected, foreground)
    assert set(foreground) <= set(waited), sorted(set(foreground) - set(waited))
    assert waited[0].startswith(f"run {RUN_ID}: done (exit 0); sipure 1.0 -> 2.0")


def test_the_step_table_is_aligned_whatever_the_status_and_the_step() -> None:
    """Issue 37: the status's markup counted in its padding, and verify-in-place overflowed its column."""
    from safeinstall.cli.render import ConsoleReporter
    from safeinstall.run.results import StepOutcome

    out = io.StringIO()
    console = Console(file=out, width=200, no_color=True)
    reporter = ConsoleReporter(console, Console(file=io.StringIO(), width=200))
    for name, status in (("backup", "ok"), ("verify-in-place", "skipped"), ("end-check", "failed")):
        reporter.step(StepOutcome(name, status, 1.25, "the detail"))
    lines = out.getvalue().splitlines()
    assert len(lines) == 3 and len({line.index("1.2 s") for line in lines}) == 1, lines
    assert len({line.index("the detail") for line in lines}) == 1, lines
    assert lines[2].split()[:2] == ["end-check", "FAILED"]


def test_a_deleted_file_is_not_called_locally_patched_and_counts_read_as_english() -> None:
    document = _document()
    document["data"]["patched"] = ["sipure/b.py", "sipure/gone.py"]
    document["data"]["deleted"] = ["sipure/gone.py"]
    lines = _render(lambda out, err: render_run(out, err, RunDocument.from_json(document), RUN_ID))
    patched = lines.index("locally patched files (copies kept in /state/backups/x):")
    assert lines[patched + 1] == "  sipure/b.py" and "gone.py" not in lines[patched + 2]
    assert "files deleted locally (nothing of them to keep):" in lines
    assert "deleted 1 older backup (--keep-backups)" in lines


def test_the_swap_step_counts_in_english() -> None:
    from safeinstall.run.reinstall import swapped_detail

    assert swapped_detail(1, 1) == "swapped: 1 entry renamed into place, 1 old one out"
    assert swapped_detail(3, 0) == "swapped: 3 entries renamed into place, 0 old ones out"
