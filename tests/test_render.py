"""One renderer over the run's JSON document: the foreground run and ``--status --wait`` (which reads
the same document from the run's history entry) show the same lines."""

from __future__ import annotations

import io
from typing import Any

from rich.console import Console
from rich.text import Text

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
    from safeinstall.store.rundoc import StepDoc

    out = io.StringIO()
    console = Console(file=out, width=200, no_color=True)
    reporter = ConsoleReporter(console, Console(file=io.StringIO(), width=200))
    for name, status in (("backup", "ok"), ("verify-in-place", "skipped"), ("end-check", "failed")):
        reporter.step(StepDoc(name=name, status=status, seconds=1.25, detail="the detail"))
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
    from safeinstall.run.steps.reinstall import swapped_detail

    assert swapped_detail(1, 1) == "swapped: 1 entry renamed into place, 1 old one out"
    assert swapped_detail(3, 0) == "swapped: 3 entries renamed into place, 0 old ones out"


def _unbroken(lines: list[str], width: int) -> None:
    """No line is longer than ``width``, and none ends inside a word: a line as wide as the screen goes
    on to the next only when it is one word, longer than a line (folded: nothing else could be done)."""
    for line, after in zip(lines, [*lines[1:], ""], strict=True):
        assert len(line) <= width, (width, line)
        if len(line) == width and after.strip():
            assert " " not in line.strip(), (line, after)


def test_off_a_terminal_a_wait_is_said_at_once_and_a_sizes_progress_once_it_lasts() -> None:
    """A new-user review: a quick backup's first line (``backup: 337 B of 27.5 KiB (1%)``), said at once,
    was stale by its step line; a wait's and a rollback's first line are still said at once."""
    from safeinstall.cli.render import ConsoleReporter
    from safeinstall.store.rundoc import StepDoc

    err = io.StringIO()
    reporter = ConsoleReporter(Console(file=io.StringIO(), width=200), Console(file=err, width=200))
    reporter.progress("backup", 337, 28160, "bytes")
    reporter.progress("backup", 28160, 28160, "bytes")
    reporter.step(StepDoc(name="backup", status="ok", seconds=0.0, detail="14 files saved"))
    reporter.progress("waiting for GPU memory (PID 7)", 0.1, 120, "s")
    reporter.progress("rolling back (the unit failed)", None, None)
    assert err.getvalue().splitlines() == [
        "waiting for GPU memory (PID 7): 0.1 s of 120 s (0%)",
        "rolling back (the unit failed)",
    ]


def test_a_detail_of_several_lines_shows_its_lines_never_an_escaped_newline() -> None:
    """Issue 42: a failed import's detail (and uv's errors) in the step table showed a literal \\x0a."""
    from safeinstall.cli.render import stacked_table, step_lines

    detail = (
        "the import failed: ImportError: undefined symbol: s\nits last lines of standard error:\n  Error: x"
    )
    lines = [Text.from_markup(line).plain for line in step_lines("smoke", "failed", 0.1, detail, 80)]
    assert "\\x0a" not in "".join(lines) and all(len(line) <= 80 for line in lines), lines
    assert [line.strip() for line in lines[-2:]] == ["its last lines of standard error:", "Error: x"], lines
    assert "\\x1b" in "".join(step_lines("smoke", "failed", 0.1, "a\x1b[2Jb", 80))  # still escaped
    table = stacked_table(("A", "WHY"), [("1", "line one\nline two")], 80)
    assert table[1] == "1  line one line two", table


def test_on_a_terminal_long_lines_wrap_between_words_and_a_pipe_keeps_them_whole() -> None:
    """Issue 42: at 80 columns a warning was folded by the terminal in the middle of its words."""
    from safeinstall.cli.render import WordWrapping, literal

    text = "could not read 1 process(es): PID 1 (maps, fd): permission denied even to root " * 3
    text += "/a/path/" + "p" * 100 + " and more words after it"
    terminal, pipe = io.StringIO(), io.StringIO()
    WordWrapping(file=terminal, width=80, force_terminal=True, color_system=None, highlight=False).print(
        f"warning: {literal(text)}", soft_wrap=True
    )
    WordWrapping(file=pipe, width=80, highlight=False).print(f"warning: {literal(text)}", soft_wrap=True)
    wrapped = [line.rstrip() for line in terminal.getvalue().splitlines()]
    assert len(wrapped) > 3, wrapped
    _unbroken(wrapped, 80)
    rejoined = "".join(
        line.strip() + ("" if len(line) == 80 and " " not in line.strip() else " ") for line in wrapped
    )
    assert rejoined.split() == f"warning: {text}".split()  # every word whole, the long one folded
    assert pipe.getvalue() == f"warning: {text}\n"


def test_output_that_is_not_a_terminal_is_laid_out_at_columns_or_80(monkeypatch: Any) -> None:
    """Issue 42: piped to less or cat, the output was laid out about 150 columns wide."""
    from safeinstall.cli.render import make_console

    monkeypatch.delenv("COLUMNS", raising=False)
    assert make_console().width == 80 and make_console(stderr=True).width == 80
    monkeypatch.setenv("COLUMNS", "132")
    assert make_console().width == 132


def test_a_run_that_stopped_before_the_install_says_only_what_is_true() -> None:
    """Issue 42: refused before anything stopped (the smoke check), its backup already removed: no
    "copies kept in )" with an empty path, no patch "carried"; each file listed once."""
    document = _document()
    document["status"], document["exit_code"] = "error", 2
    document["errors"] = [{"code": "smoke", "message": "the import failed", "hint": "nothing was stopped"}]
    data = document["data"]
    data |= {"backup_dir": None, "deleted": [], "patched": ["sipure/a.py"], "extras": [], "notes": []}
    data["patches"] = [{"path": "sipure/a.py", "status": "carried", "detail": "merged", "diff": ""}]
    lines = _render(lambda out, err: render_run(out, err, RunDocument.from_json(document), RUN_ID))
    text = "\n".join(lines)
    assert "kept in" not in text and "carried to the new version" not in text, lines
    assert "local patches merged but not carried (the run stopped before the install" in text, lines
    assert sum(line.count("sipure/a.py") for line in lines) == 1, lines
    assert "the locally patched files above: left as they are: nothing was replaced" in lines, lines
    data["patches"] = []
    lines = _render(lambda out, err: render_run(out, err, RunDocument.from_json(document), RUN_ID))
    assert "locally patched files (left as they are: nothing was replaced):" in lines, lines


def test_kept_patches_are_listed_once_with_where_their_copies_are() -> None:
    """Issue 42: --keep-patches listed each file three times (a note, the patches, the patched files)."""
    document = _document()
    document["data"]["patched"] = ["sipure/a.py"]
    lines = _render(lambda out, err: render_run(out, err, RunDocument.from_json(document), RUN_ID))
    assert sum(line.count("sipure/a.py") for line in lines) == 1, lines
    assert "the locally patched files above: copies kept in /state/backups/x" in lines, lines


def test_a_progress_line_on_a_terminal_shows_its_amounts_wrapped_never_cut() -> None:
    """Issue 42: at 80 columns the progress line was cut just before "12 s of 90 s"."""
    from safeinstall.cli.render import ConsoleReporter
    from safeinstall.store.rundoc import StepDoc

    err = Console(file=io.StringIO(), width=80, force_terminal=True, record=True, color_system=None)
    reporter = ConsoleReporter(Console(file=io.StringIO(), width=80), err)
    what = "waiting for si-vllm-api-1.service, si-metrics-2.service to be stopped (2 of 2)"
    reporter.progress(what, 12.0, 90.0, "s")
    reporter.step(
        StepDoc(name="stop", status="ok", seconds=12.0, detail="2 unit(s) stopped")
    )  # the display ends with the step
    shown = [line.rstrip() for line in err.export_text().splitlines() if line.strip()]
    said = f"{what}: 12 s of 90 s (13%)".split()
    assert "12 s of 90 s (13%)" in " ".join(" ".join(shown).split()), shown
    for line in shown:  # (the frames of the live display follow each other in the record)
        assert all(word in said or set(word) <= set("━╸╺ ") for word in line.split()), line


def _vllm_host_plan() -> Any:
    """The plan of tests/test_vllm.py's vLLM host, as its real run gave it (issue 42: 45 lines at 120
    columns): an API unit (its process, vLLM's engine and multiprocessing's resource_tracker), a
    sidecar unit, ten distributions, the staging uv command with every pin, the smoke check, and the
    two host warnings of that machine."""
    from safeinstall.scan.plan import AffectedDistribution, Plan, PlannedProcess, PlannedUnit
    from safeinstall.system.gpus import GpuSnapshot
    from safeinstall.system.identity import ProcessId

    venv, tmp = "/work/benchdata/vllm-venv", "/tmp/pytest-of-root/pytest-337/test_the_plan_of_two_units_fit0"
    downgrades = [
        ("flashinfer-python", "0.7.2.post1", "0.7.0.post1"),
        ("humming-kernels", "0.1.19", "0.1.17"),
        ("nvidia-cudnn-cu13", "9.24.0.43", "9.20.0.48"),
        ("nvidia-nccl-cu13", "2.30.7", "2.29.7"),
        ("tokenspeed-mla", "2.0.3", "0.2.15"),
        ("torch", "2.14.0", "2.13.0"),
        ("torchvision", "0.29.0", "0.28.0"),
        ("transformers", "5.20.2", "5.19.0"),
        ("triton", "3.8.0", "3.7.1"),
        ("vllm", "0.33.0", "0.32.0"),
    ]
    dists = tuple(AffectedDistribution(n, old, new, n == "vllm") for n, old, new in downgrades)

    def process(pid: int, unit: str, cmdline: tuple[str, ...], kind: str, reason: str) -> PlannedProcess:
        strength = "possible" if kind == "environment" else "certain"
        return PlannedProcess(
            ProcessId(pid, 1), "root", cmdline[0].rsplit("/", 1)[-1], cmdline, unit, None, (kind,), (reason,),
            ("vllm",), False, None, strength, reason,
        )  # fmt: skip

    api, sidecar = "si-vllm-api-1.service", "si-metrics-2.service"
    python = f"{venv}/bin/python"
    tracker = (python, "-c", "from multiprocessing.resource_tracker import main;main(23)")
    processes = (
        process(30772, api, (python, f"{tmp}/api.py"), "mapped", "maps triton/_C/libtriton.so"),
        process(30794, sidecar, (python, "-c", "import prometheus_client, time; time.sleep(3600)"),
                "environment", "runs the environment's interpreter"),
        process(31585, api, ("VLLM::EngineCore",), "mapped", "maps triton/_C/libtriton.so"),
        process(31600, api, tracker, "mapped", "maps torch/lib/libtorch_cpu.so"),
    )  # fmt: skip
    units = (
        PlannedUnit(sidecar, "active", "static", 30794, 90.0, "/x", (30794,)),
        PlannedUnit(api, "active", "static", 30772, 90.0, "/y", (30772, 31585, 31600)),
    )
    pins = " ".join(f"{n}=={new}" for n, _old, new in downgrades if n != "vllm")
    wheel = "/work/benchdata/vllm-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl"
    install = (
        f"before the stop: /work/main/.venv/bin/uv pip install --python {python} --prefix "
        f"{venv}/.safeinstall-swap-RUN_ID/tree --no-deps --link-mode hardlink {wheel} {pins}",
        f"during the stop: the staged files are renamed into {venv} (the swap)",
    )
    smoke = (
        f"as root (the unit has no User=: it runs as root too), environment of {sidecar}, {api}; no GPU: "
        "import vllm's top-level modules and the changed distributions' extension modules from the new "
        "version (at most 300 s each)"
    )
    from safeinstall.scan.plan import unreadable_warning
    from safeinstall.scan.processes import ScanProblem

    unread = unreadable_warning(
        [ScanProblem(1, r, "permission denied") for r in ("maps", "fd")], as_root=True
    )
    nvml = (
        "GPU check unavailable: cannot load the NVML library named by SAFEINSTALL_NVML_LIBRARY "
        "(/nonexistent/libnvidia-ml.so.1): /nonexistent/libnvidia-ml.so.1: cannot open shared object file: "
        "No such file or directory"
    )
    return Plan(
        "vllm", python, venv, True, False, False, dists, processes, units, (),
        GpuSnapshot(False, nvml, (), (), (), (), 0.0), ("uv",), (), (), (str(unread), nvml),
        install=install, host_notes=(str(unread), nvml), smoke=smoke,
    )  # fmt: skip


def _screen_lines(text: str, columns: int) -> int:
    """How many lines ``text`` takes on a terminal ``columns`` wide (a longer line wraps)."""
    return sum(max(1, -(-len(line) // columns)) for line in text.splitlines())


def test_the_plan_of_the_vllm_host_fits_36_lines_at_120_columns_naming_every_process_and_unit() -> None:
    """Issue 42 (3): the plan of tests/test_vllm.py's host was 45 lines at 120 columns. Without -v: the
    resource_tracker folded into its unit's row, short host warnings, the uv command and the smoke check
    compact; with -v, all of it."""
    from safeinstall.cli.render import render_plan

    plan = _vllm_host_plan()
    for width in (120, 80):
        lines = _render_at(lambda out, err: render_plan(out, err, plan, 0), width)
        text = "\n".join(lines)
        if width == 120:
            assert _screen_lines(text, 120) <= 36, "\n".join(lines)
        for pid in (30772, 30794, 31585, 31600):
            assert str(pid) in text.split("units that would be stopped")[0], (pid, text)
        for unit in ("si-vllm-api-1.service", "si-metrics-2.service"):
            assert any(line.startswith(unit) for line in lines), (unit, text)
        assert "(+ PID 31600: multiprocessing's resource_tracker)" in " ".join(text.split()), text
        assert (
            "9 more, each a downgrade (-v: each): flashinfer-python," in text
            and "vllm 0.33.0 -> 0.32.0" in text
        )
        assert "and the 9 other versions above" in " ".join(text.split()), text
        assert "import the new vllm and its changed extension modules" in " ".join(text.split())
    verbose = "\n".join(_render_at(lambda out, err: render_plan(out, err, plan, 1), 120))
    assert "torch==2.13.0" in verbose and "torch 2.14.0 -> 2.13.0" in verbose
    assert any(line.startswith("31600 ") for line in verbose.splitlines()), verbose


def test_a_dry_runs_plan_says_the_smoke_check_is_not_run_by_it() -> None:
    """A ``--dry-run`` imports nothing: its plan says so where it names the check (a run's plan, asked
    before the stop, does not)."""
    from safeinstall.cli.render import render_plan

    plan = _vllm_host_plan()
    dry = " ".join(
        "\n".join(_render_at(lambda out, err: render_plan(out, err, plan, 0, dry_run=True), 120)).split()
    )
    run = " ".join("\n".join(_render_at(lambda out, err: render_plan(out, err, plan, 0), 120)).split())
    assert "smoke check (a run's; --dry-run imports nothing): " in dry, dry
    assert "--dry-run imports nothing" not in run and "smoke check: " in run, run


def _render_at(draw: Any, width: int) -> list[str]:
    out, err = io.StringIO(), io.StringIO()
    draw(Console(file=out, width=width, no_color=True), Console(file=err, width=width, no_color=True))
    return (out.getvalue() + err.getvalue()).splitlines()


def test_a_steps_long_detail_wraps_within_the_detail_column() -> None:
    """Issue 45: at 80 columns a long detail goes on under the detail column, between words, never
    back at the line's start nor past the screen."""
    from safeinstall.cli.render import step_lines

    detail = " ".join(f"word{n}" for n in range(60))
    lines = [Text.from_markup(line).plain for line in step_lines("prefetch", "ok", 1.0, detail, 80)]
    column = lines[0].index("word0")
    assert len(lines) > 2 and all(len(line) <= 80 for line in lines), lines
    # under the column, hanging by two (a wrapped line apart from a detail's next line)
    assert all(line[: column + 2] == " " * (column + 2) and line[column + 2] != " " for line in lines[1:])
    assert " ".join(line.strip() if i else line[column:] for i, line in enumerate(lines)) == detail


def test_a_failed_recover_never_says_nothing_to_recover() -> None:
    """``--recover`` that could not recover an environment (exit 4: a unit file gone; exit 2: a live run
    holds the lock) says so on stderr; stdout said "nothing to recover" beside it. Not any more; a
    recover with nothing to do and no failure still says it."""
    from safeinstall.cli.show import draw
    from safeinstall.errors import LockHeldError, RollbackFailed
    from safeinstall.run.back.recover import Recovered, Recovery
    from safeinstall.run.commands.modes import RecoverResult

    def said(recovered: Recovered) -> str:
        out, err = io.StringIO(), io.StringIO()
        result = RecoverResult(
            exit_code=int(recovered.exit_code), failures=recovered.failures, outcome=recovered
        )
        draw(result, Console(file=out, width=200), Console(file=err, width=200), 0)
        return out.getvalue()

    idle = Recovery("/v", None, None, notes=("nothing to recover",))
    assert said(Recovered((idle,), ())).strip() == "nothing to recover"
    for failure in (RollbackFailed("a unit file is gone"), LockHeldError("another safeinstall run holds it")):
        assert "nothing to recover" not in said(Recovered((), (failure,)))
        assert "nothing to recover" not in said(Recovered((idle,), (failure,)))
