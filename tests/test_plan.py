"""safeinstall.scan.plan (pure): how the evidence's strength decides what is planned."""

from __future__ import annotations

from safeinstall.env.uvplan import UvPlan
from safeinstall.scan.evidence import Evidence, EvidenceKind
from safeinstall.scan.plan import Plan, build_plan
from safeinstall.scan.processes import ProcessRecord, ScanProblem, ScanResult
from safeinstall.system.gpus import GpuSnapshot
from safeinstall.system.identity import ProcessId

ENVIRONMENT = Evidence(
    EvidenceKind.ENVIRONMENT, "", "/v/bin/python", False, "runs the environment's interpreter"
)
MAPPED = Evidence(EvidenceKind.MAPPED, "sicext", "/v/lib/sicext/_native.so", False, "path")


NO_GPUS = GpuSnapshot(False, "none", (), (), (), (), 0.0)


def process(pid: int, unit: str | None, *evidence: Evidence) -> ProcessRecord:
    group = f"/app.slice/{unit}" if unit else "/user.slice/session-1.scope"
    return ProcessRecord(
        process=ProcessId(pid, pid),
        ppid=1,
        uid=0,
        user="root",
        name="python",
        state="S",
        cmdline=("/v/bin/python",),
        cgroup_text=f"0::{group}\n",
        evidence=evidence,
    )


def plan(
    *records: ProcessRecord,
    only_loaded: bool,
    kill_strays: bool = True,
    problems: tuple[ScanProblem, ...] = (),
    gpus: GpuSnapshot = NO_GPUS,
) -> Plan:
    return build_plan(
        package="sicext",
        python="/v/bin/python",
        prefix="/v",
        user=False,
        with_deps=False,
        kill_strays=kill_strays,
        only_loaded=only_loaded,
        uv_plan=UvPlan((), (), ""),
        installed_versions={"sicext": "1.0"},
        wheel_version="2.0",
        scan=ScanResult(records, problems, len(records), 999),
        units={},
        gpus=gpus,
        as_root=True,
    )


def test_strength_decides_what_only_loaded_leaves_out() -> None:
    records = (
        process(10, "engine.service", MAPPED),  # certain
        process(11, "engine.service", ENVIRONMENT),  # the API server of that unit: certain by its unit
        process(12, "engine.service"),  # no evidence of its own: unit evidence, certain
        process(20, "pure.service", ENVIRONMENT),  # only possible
        process(21, "pure.service"),
        process(30, None, ENVIRONMENT),  # a stray of the environment
    )
    everything = plan(*records, only_loaded=False)
    found = {p.pid: (p.evidence, p.strength) for p in everything.processes}
    assert found == {
        10: (("mapped",), "certain"),
        11: (("environment", "unit"), "certain"),
        12: (("unit",), "certain"),
        20: (("environment",), "possible"),
        21: (("unit",), "possible"),
        30: (("environment",), "possible"),
    }
    assert {u.name for u in everything.units} == {"engine.service", "pure.service"}
    assert [s.pid for s in everything.strays] == [30] and everything.left_out == ()

    narrowed = plan(*records, only_loaded=True)
    assert {p.pid for p in narrowed.processes} == {10, 11, 12}
    assert [u.name for u in narrowed.units] == ["engine.service"] and narrowed.strays == ()
    assert narrowed.left_out == (20, 30) and narrowed.only_loaded
    assert any("--only-loaded leaves out 2 process(es)" in w for w in narrowed.warnings)


def test_the_stray_refusal_names_only_loaded_only_for_the_strays_it_leaves_out() -> None:
    """Issue 37: --only-loaded leaves out a stray with only ``environment`` (possible) evidence, so the
    refusal names it for that one, and never for a stray that maps the package."""
    (only_possible,) = plan(process(30, None, ENVIRONMENT), only_loaded=False, kill_strays=False).refusals
    assert "--kill-strays" in only_possible and "--only-loaded would leave them out" in only_possible
    (certain,) = plan(process(31, None, MAPPED), only_loaded=False, kill_strays=False).refusals
    assert "--kill-strays" in certain and "--only-loaded" not in certain
    records = (process(30, None, ENVIRONMENT), process(31, None, MAPPED))
    (both,) = plan(*records, only_loaded=False, kill_strays=False).refusals
    assert "--only-loaded would leave PID 30 out" in both
    assert plan(*records, only_loaded=True, kill_strays=False).refusals == (
        "1 process(es) use the package (or run its environment's Python) outside any systemd service: "
        "31 (python); stop them, or pass --kill-strays to end them (they are not restarted)",
    )


def test_the_plan_says_whether_a_version_is_an_upgrade_a_downgrade_or_the_same() -> None:
    from safeinstall.scan.plan import AffectedDistribution

    def change(old: str | None, new: str | None) -> str:
        return AffectedDistribution("idna", old, new, True).change

    assert change("3.10", "3.20") == "upgrade"
    assert change("3.20", "3.10") == "downgrade"  # 3.20 > 3.10 as versions, not as strings
    assert change("2.13.0", "2.13.0") == "same version"
    assert change("0.16.0.dev5+g1234", "0.16.0") == "upgrade"
    assert change(None, "1.0") == "" and change("1.0", None) == "" and change("x!y", "1.0") == ""


def test_what_the_scan_cannot_read_is_said_once_each_reading_only_with_v() -> None:
    """A VM's init (PID 1) that denies root its maps and fds is one warning, not a line per reading
    (issue 23: three lines about PID 1 on every plan of such a machine); ``-v`` lists each."""
    import io

    from rich.console import Console

    from safeinstall.cli.render import _scan_problems
    from safeinstall.scan.plan import unreadable_warning
    from safeinstall.scan.processes import ScanProblem

    problems = [ScanProblem(1, reading, "permission denied") for reading in ("maps", "fd", "environ")]
    warning = unreadable_warning(problems, as_root=True)
    assert warning is not None
    assert warning.startswith("could not read 1 process(es): PID 1 (maps, fd, environ)")
    assert "even to root" in warning and "run as root" not in warning
    for verbosity, lines in ((0, 0), (1, 3)):
        out = io.StringIO()
        _scan_problems(Console(file=out, width=120), problems, verbosity)
        assert len(out.getvalue().splitlines()) == lines


def test_host_state_notes_are_left_out_by_q_and_said_otherwise() -> None:
    """Issue 37: -q printed on every command that PID 1 is unreadable and NVML missing. They are the
    plan's ``host_notes`` (still among its warnings, for --json): -q leaves them out, on the plan and
    in a run's notes before the stop; without -q they are said."""
    import io

    from rich.console import Console

    from safeinstall.cli.render import ConsoleReporter, render_plan

    problems = (ScanProblem(1, "maps", "permission denied"),)
    no_nvml = GpuSnapshot(False, "NVML library libnvidia-ml.so.1 not found", (), (), (), (), 0.0)
    found = plan(process(10, "engine.service", MAPPED), only_loaded=False, problems=problems, gpus=no_nvml)
    assert len(found.host_notes) == 2 and set(found.host_notes) <= set(found.warnings)
    for verbosity, shown in ((-1, False), (0, True), (1, True)):
        out, err = io.StringIO(), io.StringIO()
        render_plan(Console(file=out, width=120), Console(file=err, width=200), found, verbosity)
        assert ("PID 1" in err.getvalue() and "GPU check unavailable" in err.getvalue()) is shown
        notes = io.StringIO()
        reporter = ConsoleReporter(
            Console(file=io.StringIO()), Console(file=notes, width=200), verbosity=verbosity
        )
        reporter.note(f"before the stop: {found.host_notes[0]}", host=True)
        reporter.note("before the stop: a local patch is replaced")
        assert ("PID 1" in notes.getvalue()) is shown and "a local patch" in notes.getvalue()


def test_local_changes_name_keep_patches_only_where_it_can_be_given() -> None:
    """Issue 37: "--keep-patches carries them over" was said with --keep-patches, and on --undo."""
    from safeinstall.run.parts.preflight import with_local_changes

    base = plan(process(10, "engine.service", MAPPED), only_loaded=False)
    (said,) = set(with_local_changes(base, ("/v/lib/sicext/a.py",)).warnings) - set(base.warnings)
    assert said.startswith("1 installed file of the distributions of sicext was changed locally")
    assert "--keep-patches carries them over" in said
    kept = with_local_changes(base, ("/v/a.py", "/v/b.py"), keep_patches=True)
    assert kept.warnings == base.warnings and kept.locally_modified == ("/v/a.py", "/v/b.py")
    (undone,) = set(with_local_changes(base, ("/v/a.py", "/v/b.py"), undo=True).warnings) - set(base.warnings)
    assert "2 installed files" in undone and "were changed" in undone and "--keep-patches" not in undone
    assert "the undo puts back the backup's copies" in undone
