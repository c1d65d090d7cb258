"""Human output prints what others wrote as text: rich markup in a path is printed, not interpreted
(and never crashes a run that already installed), and terminal control sequences in another user's
command line, a file name or a log line are shown escaped, never sent to root's terminal. JSON stays
exact."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from safeinstall.cli.render import literal, printable
from safeinstall.run.parts.output import envelope, jsonable
from safeinstall.store import history
from safeinstall.store.rundoc import RunDocument
from safeinstall.store.state import ensure_environment_dir, environment_state
from tests import wheelhouse
from tests.bed_systemd import UserManager, wait_until
from tests.beds import Bed, declined_on_a_terminal
from tests.clirun import run
from tests.wheelhouse import Wheelhouse

#: Clear the screen, set the window title, and a C1 CSI: what a hostile command line would send.
HOSTILE = "\x1b[2J\x1b]0;owned\x07\x9b31m"
SHOWN = "\\x1b[2J\\x1b]0;owned\\x07\\x9b31m"


def test_printable_shows_control_characters_and_keeps_other_unicode() -> None:
    assert printable(HOSTILE) == SHOWN
    assert printable("del\x7f nul\x00 tab\t nl\n") == "del\\x7f nul\\x00 tab\\x09 nl\\x0a"
    assert printable("a\tb\nc\rd", lines=True) == "a\tb\nc\\x0dd"
    assert printable("vllm ünïcode → ✓ 模型") == "vllm ünïcode → ✓ 模型"
    assert literal("evil[/]x\x1b[0m") == "evil\\[/]x\\x1b[0m"


def _no_control_characters(text: str) -> bool:
    return not any((ord(c) < 0x20 and c != "\n") or 0x7F <= ord(c) <= 0x9F for c in text)


def test_a_stray_with_escape_sequences_in_its_command_line_is_shown_escaped(
    venv: Path, wheels: Wheelhouse, user_manager: UserManager
) -> None:
    wheelhouse.uv_install(venv, wheels["sicext-1"])
    stray = subprocess.Popen([str(venv), "-c", "import sicext, time; time.sleep(600)", HOSTILE])
    try:
        wait_until(lambda: "_native" in Path(f"/proc/{stray.pid}/maps").read_text(), 15, "maps the .so")
        args = ("--user", "sicext", "--wheel", str(wheels["sicext-2"]), "--python", str(venv), "--dry-run")
        environ = {**user_manager.env, "SAFEINSTALL_NVML_LIBRARY": "/nonexistent/libnvidia-ml.so.1"}
        human = run(*args, env=environ)
        assert human.code == 2 and "the run would refuse" in human.stdout, human.stdout + human.stderr
        assert SHOWN in human.stdout and str(stray.pid) in human.stdout
        assert _no_control_characters(human.stdout + human.stderr)
        doc = run(*args, "--json", env=environ).json  # JSON keeps the command line exactly
        (process,) = [p for p in doc["data"]["strays"] if p["pid"] == stray.pid]
        assert process["cmdline"][-1] == HOSTILE
    finally:
        stray.kill()
        stray.wait()


def test_a_carried_patch_whose_path_reads_as_markup_does_not_turn_a_done_run_into_an_error(
    wheels: Wheelhouse, user_manager: UserManager, tmp_path: Path
) -> None:
    """The prefix reads ``.../evil[/]venv``: printing the carried file's path as markup raised
    MarkupError after the install, and the run that installed exited 2 ("internal error")."""
    python = wheelhouse.make_venv(tmp_path / "evil[" / "]venv")
    wheelhouse.uv_install(python, wheels["sicext-1"])
    serve = wheelhouse.site_packages(python) / "sicext" / "serve.py"
    serve.write_text(serve.read_text() + "# a local fix\n")  # serve.py is the same in 1.0 and 2.0
    environ = {
        **user_manager.env,
        "SAFEINSTALL_STATE_DIR": str(tmp_path / "state"),
        "SAFEINSTALL_NVML_LIBRARY": "/nonexistent/libnvidia-ml.so.1",
    }
    result = run(
        "--user",
        "--python",
        str(python),
        "--yes",
        "sicext",
        "--wheel",
        str(wheels["sicext-2"]),
        "--keep-patches",
        "--base-wheel",
        str(wheels["sicext-1"]),
        env=environ,
    )
    assert result.code == 0, result.stdout + result.stderr
    assert f"carried {serve}: merged" in result.stdout and "error" not in result.stderr
    assert serve.read_text().endswith("# a local fix\n")


def test_status_wait_replays_log_lines_escaped_and_status_prints_paths_whole(tmp_path: Path) -> None:
    """The log holds uv's output and names others chose: replayed escaped. A long log path is printed
    on a line of its own, never folded in the middle; a run that ended in an error names its log."""
    root = tmp_path / "state"
    prefix = tmp_path / ("p" * 120) / ("q" * 120)
    prefix.mkdir(parents=True)
    state = environment_state(root, prefix)
    ensure_environment_dir(state)
    run_id = "20261201T010000Z-100"
    log = state.log_file(run_id)
    log.write_text(f"[t] install: uv says {HOSTILE}\n")
    result = envelope("reinstall", "error", 2, None)
    finished = "2026-12-01T01:00:00+00:00"
    document = RunDocument.from_json(jsonable(result))
    history.append(state, history.new_entry(run_id, "sicext", finished, finished, document, str(log)))
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(root), "COLUMNS": "80"}

    waited = run("--status", "--wait", "--run", run_id, env=environ)
    assert waited.code == 2 and f"uv says {SHOWN}" in waited.stderr
    assert _no_control_characters(waited.stderr)
    quiet = run("--status", "--wait", "--run", run_id, "-q", env=environ)  # -q: the result, not the log
    assert quiet.code == 2 and "uv says" not in quiet.stderr + quiet.stdout
    assert quiet.stdout.startswith(f"run {run_id}: error (exit 2)"), quiet.stdout + quiet.stderr
    status = run("--status", env=environ)
    assert status.code == 0 and len(str(log)) > 200
    assert f"log of {run_id}: {log}\n" in status.stdout and f"environment {prefix}: idle" in status.stdout
    (environment,) = run("--status", "--json", env=environ).json["data"]["environments"]
    assert environment["runs"][0]["log_file"] == str(log)


def test_a_run_refused_at_preflight_keeps_its_log_in_the_history(sipure_venv: Path, tmp_path: Path) -> None:
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state")}
    missing = tmp_path / "sipure-2.0-py3-none-any.whl"
    refused = run("sipure", "--python", str(sipure_venv), "--wheel", str(missing), "--yes", env=environ)
    assert refused.code == 2 and "hint:" in refused.stderr
    (environment,) = run("--status", "--json", env=environ).json["data"]["environments"]
    (entry,) = environment["runs"]
    assert entry["status"] == "error" and Path(entry["log_file"]).is_file()
    assert f"cannot read wheel {missing}" in Path(entry["log_file"]).read_text()


def test_a_newline_the_operator_typed_never_splits_the_error_line(sipure_venv: Path, tmp_path: Path) -> None:
    """A new-user review: a newline in a value typed on the command line (a wheel's path, a run's id)
    was printed raw, the ``error:`` line split in two; it is shown as ``\\x0a``, as an ESC is."""
    environ = {**os.environ, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state")}
    wheel = f"{tmp_path}/a\nb.whl"
    refused = run("sipure", "--python", str(sipure_venv), "--wheel", wheel, "--dry-run", env=environ)
    assert refused.code == 2 and refused.stderr.splitlines()[0] == (
        f"error: cannot read wheel {tmp_path}/a\\x0ab.whl: no such file"
    ), refused.stderr
    waited = run("--status", "--wait", "--run", "x\ny", env=environ)
    assert waited.code == 2 and waited.stderr.splitlines() == [
        "error: no run x\\x0ay is known here",
        "hint: safeinstall --status lists the runs",
    ], waited.stderr


def _whole_words(lines: list[str], cells: list[str], width: int) -> None:
    """Every line fits ``width`` (but a line of one word longer than any line), and every word printed
    is a whole word of a cell: none was cut or broken across lines (issue 37)."""
    words = {word for cell in cells for word in cell.split()}
    for line in lines:
        assert len(line) <= width or len(line.split()) == 1, (width, line)
        for word in line.split():
            assert word in words, (width, word, lines)


def test_tables_stack_columns_that_do_not_fit_and_never_cut_a_word() -> None:
    from safeinstall.cli.render import stacked_table, wrap_words

    rows = [
        (
            "1",
            "api.service",
            "mapped (certain)",
            "maps torch/lib/libtorch_cpu.so",
            "python -m vllm " + "x" * 80,
        ),
        ("22", "webapp.service", "unit (certain)", "shares webapp.service", "gunicorn app:app -w 4"),
    ]
    header = ("PID", "UNIT", "EVIDENCE", "WHY", "COMMAND")
    cells = [*header, *(c for row in rows for c in row), *(f"{h.lower()}:" for h in header)]
    wide = stacked_table(header, rows, 400)
    assert len(wide) == 3 and wide[1].endswith("x" * 80) and all(line == line.rstrip() for line in wide)
    for width in (120, 80, 60, 40, 20):
        lines = stacked_table(header, rows, width)
        _whole_words(lines, cells, width)
        for cell in (c for row in rows for c in row):
            assert cell in " ".join(" ".join(lines).split()), (width, cell, lines)
    at80 = stacked_table(header, rows, 80)
    assert at80[0].split() == ["PID", "UNIT", "EVIDENCE", "WHY"] and at80[2].startswith("    command: python")
    assert stacked_table(("A", "B", "C"), [("\x1b[2J", "b", "c")], 80)[1].startswith("\\x1b[2J")
    assert wrap_words("a bb " + "c" * 30 + " d", 10, 2) == ["  a bb", "    " + "c" * 30, "    d"]


def test_status_at_80_and_120_columns_breaks_no_word(tmp_path: Path) -> None:
    """Issue 37: --status at 80 columns broke PACKAGE/AGE and mark/upsa, at 120 webapp.servic/e."""
    root = tmp_path / "state"
    prefix = tmp_path / "venv"
    prefix.mkdir()
    state = environment_state(root, prefix)
    ensure_environment_dir(state)
    run_id = "20261201T010000Z-100"
    data = {
        "plan": {"distributions": [{"name": "markupsafe", "old_version": "2.1.5", "new_version": "3.0.2"}]},
        "downtime_s": {"webapp.service": 1.25, "worker-queue.service": 2.5},
    }
    finished = "2026-12-01T01:00:00+00:00"
    result = RunDocument.from_json(jsonable(envelope("reinstall", "done", 0, data)))
    history.append(state, history.new_entry(run_id, "markupsafe", finished, finished, result))
    for width in (80, 120):
        status = run(
            "--status", env={**os.environ, "SAFEINSTALL_STATE_DIR": str(root), "COLUMNS": str(width)}
        )
        assert status.code == 0, status.stderr
        lines = status.stdout.splitlines()
        runs = lines[lines.index("  last runs:") + 1 : lines.index(f"  log of {run_id}: -")]
        header = ["RUN", "STATUS", "EXIT", "PACKAGE", "VERSION", "STARTED", "FINISHED", "DOWNTIME", "UNDO"]
        row = [run_id, "done", "0", "markupsafe", "2.1.5", "->", "3.0.2", "webapp.service", "1.2", "s,"]
        row += [
            "worker-queue.service",
            "2.5",
            "s",
            "-",
            "yes",
            "UTC",
            "started:",
            "finished:",
            "downtime:",
            "undo:",
        ]
        stamps = " ".join(lines).split()
        cells = [*header, *row, *(w for w in stamps if w[:4].isdigit() or ":" in w)]
        _whole_words(runs, cells, width)
        assert "webapp.service" in " ".join(runs).split() and "markupsafe" in " ".join(runs).split()


def _patch_init(bed: Bed) -> Path:
    """A local patch at the end of sicext/__init__.py: a region 1.0 and 2.0 share, so it merges."""
    init = bed.site / "sicext" / "__init__.py"
    init.write_text(init.read_text() + 'PATCH = " with a local fix"\n')
    return init


def test_the_keep_patches_question_says_whether_the_patches_merge(bed: Bed) -> None:
    """Issue 42: the merge ran only after ``y``; now it is made first, and the question says it holds."""
    bed.service("asked")
    init = _patch_init(bed)
    code, out, err = declined_on_a_terminal(
        bed, "--keep-patches", "--base-wheel", str(bed.wheels["sicext-1"])
    )
    assert code == 2 and "nothing done (not confirmed)" in out, out + err
    assert f"local patches that merge into the new version (the run carries them):\n  carried {init}" in out
    assert "stop these units and reinstall, carrying 1 local patch (it merges)? [y/N]" in err, err
    assert bed.version() == "1.0"


def test_a_run_refused_before_the_stop_lists_each_patched_file_once_and_keeps_no_false_words(
    bed: Bed,
) -> None:
    """Issue 42: after the smoke check refused (nothing stopped, the backup removed), a patched file was
    said three times, "kept in the backup" and "copies kept in )"."""
    bed.service("refused-patched")
    init = _patch_init(bed)
    args = ("sicext", "--wheel", str(bed.wheels["sicext-5"]), "--keep-patches")
    refused = bed.safeinstall(*args, "--base-wheel", str(bed.wheels["sicext-1"]))
    assert refused.code == 2 and "nothing was stopped" in refused.stderr, refused.stdout + refused.stderr
    said = refused.stdout + refused.stderr
    assert said.count(str(init)) == 1 and "kept in" not in said, said
    assert "local patches merged but not carried (the run stopped before the install" in said, said
    assert init.read_text().endswith('PATCH = " with a local fix"\n') and bed.version() == "1.0"


def _on_a_terminal(
    tmp_path: Path, argv: list[str], environ: dict[str, str], name: str
) -> tuple[str, str, int]:
    """``argv`` in a tmux pane of 80 columns: what the screen holds (lines the terminal folded joined
    again: ``capture-pane -J``), every byte written to it (``pipe-pane``), and the exit status."""
    work = tmp_path / name
    work.mkdir()
    conf, script, done, raw = work / "tmux.conf", work / "run.sh", work / "status", work / "raw"
    conf.write_text("set -g history-limit 20000\n")
    exports = "".join(f"export {k}={shlex.quote(v)}\n" for k, v in environ.items() if k != "COLUMNS")
    script.write_text(
        f"unset COLUMNS LINES\n{exports}while [ ! -e {work}/go ]; do sleep 0.05; done\n"
        f"{shlex.join(argv)} </dev/tty\necho $? > {done}.tmp && mv {done}.tmp {done}\nexec sleep 600\n"
    )
    tmux = ["tmux", "-S", str(work / "socket"), "-f", str(conf)]
    subprocess.run([*tmux, "new-session", "-d", "-x", "80", "-y", "50", "sh", str(script)], check=True)
    try:
        subprocess.run([*tmux, "pipe-pane", "-o", f"cat >> {shlex.quote(str(raw))}"], check=True)
        (work / "go").touch()
        wait_until(done.exists, 240, f"{name} to finish in tmux")
        screen = subprocess.run(
            [*tmux, "capture-pane", "-p", "-J", "-S", "-", "-E", "-"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    finally:
        subprocess.run([*tmux, "kill-server"], check=False, capture_output=True)
    return screen, raw.read_text(errors="replace"), int(done.read_text())


def _no_word_broken_at(screen: str, width: int) -> None:
    """A line the terminal folded (longer than the screen, once joined) is one word longer than a line
    (nothing else could be done); every other line was laid out within the width, between words; and
    no control character is shown escaped (a newline as a literal ``\\x0a``)."""
    for line in screen.splitlines():
        if len(line.rstrip()) > width:
            assert " " not in line.strip(), f"a word broken at {width} columns: {line!r}"
    assert "\\x0a" not in screen and "\\x1b" not in screen, screen


def test_at_80_columns_a_run_its_plan_and_status_break_no_word(bed: Bed, tmp_path: Path) -> None:
    """Issue 42: at 80 columns, on a terminal (tmux): the plan, a run (with a failed import's detail of
    several lines first) and --status: no word broken, no literal escape; the preflight says something
    while it works."""
    if shutil.which("tmux") is None:
        pytest.skip("tmux is not installed (apt-get install tmux)")
    bed.service("narrow-api")
    bed.service("narrow-sidecar")
    environ = {k: v for k, v in bed.environ().items()}
    base = [*bed.tool, "--user", "--python", str(bed.python)]
    plan, raw, code = _on_a_terminal(
        tmp_path, [*base, "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--dry-run"], environ, "plan"
    )
    assert code == 0 and "the run would proceed" in plan, plan
    _no_word_broken_at(plan, 80)
    assert "preflight:" in raw.split("plan for")[0], raw[:2000]  # said while the preflight worked
    typo, _raw, code = _on_a_terminal(tmp_path, [*base, "sicxet", "--dry-run"], environ, "typo")
    assert code == 2 and "did you mean sicext?" in " ".join(typo.split()), typo
    assert "preflight:" not in typo, typo  # the spinner gone before the error is said
    failed, _raw, code = _on_a_terminal(
        tmp_path, [*base, "sicext", "--wheel", str(bed.wheels["sicext-5"]), "--yes"], environ, "failed"
    )
    assert code == 2 and "undefined symbol" in failed and "\\x0a" not in failed, failed
    _no_word_broken_at(failed, 80)
    run, raw, code = _on_a_terminal(
        tmp_path,
        [*base, "sicext", "--wheel", str(bed.wheels["sicext-2"]), "--yes", "--settle", "1"],
        environ,
        "run",
    )
    assert code == 0 and "done: sicext 1.0 -> 2.0" in run, run
    _no_word_broken_at(run, 80)
    status, _raw, code = _on_a_terminal(tmp_path, [*base, "--status"], environ, "status")
    assert code == 0 and "last runs" in status, status
    _no_word_broken_at(status, 80)
