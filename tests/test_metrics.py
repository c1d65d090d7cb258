"""--metrics-file: results as Prometheus text exposition format, for node_exporter's textfile collector.

Every file a test writes is read by Prometheus' own text parser and checked by promtool
(:mod:`tests.promcheck`).
"""

from __future__ import annotations

import json
import os
import re
import resource
import shutil
import stat
import subprocess
from collections.abc import Iterator
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import pytest
import yaml  # type: ignore[import-untyped]  # PyYAML, with ansible-core
from prometheus_client.parser import text_string_to_metric_families

from safeinstall.run.commands.metrics import Family, Sample, render, verify_families
from tests import wheelhouse
from tests.bed_systemd import Units, UserManager, wait_until
from tests.clirun import SAFEINSTALL, Result, run
from tests.promcheck import PROMTOOL, parsed, read_metrics, value
from tests.wheelhouse import Wheelhouse


@pytest.fixture
def textfile_dir(tmp_path: Path) -> Path:
    """A directory as node_exporter's textfile directory is made: the caller's, 0755."""
    directory = tmp_path / "textfile"
    directory.mkdir(mode=0o755)
    directory.chmod(0o755)
    return directory


def test_promtool_is_there_to_check_the_files() -> None:
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; .ci/run installs it)")
    version = subprocess.run([PROMTOOL, "--version"], capture_output=True, text=True)
    assert version.returncode == 0 and "promtool" in version.stdout + version.stderr


def test_label_values_and_help_are_escaped_as_the_format_requires() -> None:
    hostile = [
        '/opt/a "quoted" venv',
        "/opt/back\\slash\\n",
        "/opt/new\nline",
        "/opt/[red]rich[/] :warning:",
        "/opt/\u00e9\u4e2d",
        "/opt/not-utf8-\udcff",
        "",
    ]
    family = Family(
        "safeinstall_test_value",
        'help with \\ and "quotes"\nand a second line',
        tuple(Sample((("prefix", p), ("unit", "x.service")), n) for n, p in enumerate(hostile)),
    )
    odd = Family(
        "safeinstall_test_odd_values",
        "odd values",
        tuple(
            Sample((("case", k),), v)
            for k, v in (("nan", float("nan")), ("inf", float("inf")), ("neg", -2.5))
        ),
    )
    samples = parsed(render([family, odd]))
    expected = [p.replace("\udcff", "\\xff") for p in hostile]
    assert [s.labels["prefix"] for s in samples["safeinstall_test_value"]] == expected
    assert [s.value for s in samples["safeinstall_test_value"]] == list(range(len(hostile)))
    by_case = {s.labels["case"]: s.value for s in samples["safeinstall_test_odd_values"]}
    assert by_case["inf"] == float("inf") and by_case["neg"] == -2.5 and by_case["nan"] != by_case["nan"]
    families = {f.name: f for f in text_string_to_metric_families(render([family]))}
    assert families["safeinstall_test_value"].documentation == 'help with \\ and "quotes"\nand a second line'


@pytest.fixture
def patched_env(venv: Path, wheels: Wheelhouse) -> Path:
    """sipure installed, one of its files patched locally and one file added by hand."""
    wheelhouse.uv_install(venv, wheels["sipure-1"], wheels["sicext-1"])
    package = wheelhouse.site_packages(venv) / "sipure"
    cli = package / "cli.py"
    cli.write_text(cli.read_text() + "\n# a local patch\n")
    (package / "added_by_hand.py").write_text("x = 1\n")
    return venv


def test_a_distributions_hardlinked_finding_counts_each_of_its_files() -> None:
    """Issue 36: one ``hardlinked`` finding holds every linked file of its distribution: the metric
    counts the files, as when there was a finding each."""
    from safeinstall.env.drift import hardlinked
    from safeinstall.env.verify import DistributionReport, VerifyReport

    finding = hardlinked("sipure", [("/v/sipure/a.py", 2), ("/v/sipure/b.py", 2), ("/v/sipure/c.py", 3)])
    assert finding is not None
    dist = DistributionReport("sipure", "1.0", "/v/sipure-1.0.dist-info", 3, (finding,), "record")
    families = {
        f.name: f for f in verify_families("/v", VerifyReport("/v/bin/python", "/v", (dist,), None), 0, 1.0)
    }
    warnings = {s.labels: s.value for s in families["safeinstall_verify_warning_findings"].samples}
    assert warnings[(("prefix", "/v"), ("distribution", "sipure"), ("kind", "hardlinked"))] == 3


def test_verify_only_writes_files_checked_and_findings_per_kind(
    patched_env: Path, textfile_dir: Path
) -> None:
    prefix = str(patched_env.parent.parent)
    out = textfile_dir / "verify.prom"
    result = run("--verify-only", "--all", "--python", str(patched_env), "--metrics-file", str(out), "--json")
    assert result.code == 1, result.stdout + result.stderr
    samples = read_metrics(out)
    summary = {(d["name"], d["files_checked"]) for d in result.json["data"]["distributions"]}
    assert {
        (s.labels["distribution"], s.value) for s in samples["safeinstall_verify_files_checked"]
    } == summary
    assert {s.labels["prefix"] for s in samples["safeinstall_verify_files_checked"]} == {prefix}
    assert value(samples, "safeinstall_verify_drift_findings", distribution="sipure", kind="modified") == 1
    assert value(samples, "safeinstall_verify_drift_findings", distribution="sipure", kind="extra") == 1
    assert value(samples, "safeinstall_verify_drift_findings", distribution="sicext", kind="modified") == 0
    assert (
        value(samples, "safeinstall_verify_warning_findings", distribution="sipure", kind="hardlinked") == 0
    )
    drift_kinds = {s.labels["kind"] for s in samples["safeinstall_verify_drift_findings"]}
    assert "hardlinked" not in drift_kinds and {"missing", "modified", "extra"} <= drift_kinds
    assert value(samples, "safeinstall_verify_success", prefix=prefix) == 1
    assert value(samples, "safeinstall_verify_exit_code", prefix=prefix) == 1
    assert value(samples, "safeinstall_verify_timestamp_seconds", prefix=prefix) > 1.7e9

    one = run("sicext", "--verify-only", "--python", str(patched_env), "--metrics-file", str(out))
    assert one.code == 0, one.stdout + one.stderr
    samples = read_metrics(out)  # replaced whole: only the one distribution now
    assert [s.labels["distribution"] for s in samples["safeinstall_verify_files_checked"]] == ["sicext"]
    assert value(samples, "safeinstall_verify_exit_code", prefix=prefix) == 0


def test_a_check_that_cannot_run_says_so(patched_env: Path, textfile_dir: Path, tmp_path: Path) -> None:
    out = textfile_dir / "verify.prom"
    unknown = run("nosuchdist", "--verify-only", "--python", str(patched_env), "--metrics-file", str(out))
    assert unknown.code == 2 and "error:" in unknown.stderr
    samples = read_metrics(out)
    prefix = str(patched_env.parent.parent)
    assert value(samples, "safeinstall_verify_success", prefix=prefix) == 0
    assert value(samples, "safeinstall_verify_exit_code", prefix=prefix) == 2
    assert "safeinstall_verify_files_checked" not in samples
    gone = tmp_path / "gone" / "bin" / "python"
    missing = run("--verify-only", "--all", "--python", str(gone), "--metrics-file", str(out))
    assert missing.code == 2
    assert value(read_metrics(out), "safeinstall_verify_success", prefix=str(gone)) == 0


def test_metrics_file_goes_only_with_the_commands_that_have_a_result(textfile_dir: Path) -> None:
    out = textfile_dir / "x.prom"
    for args in (("sipure", "--dry-run"), ("--forget",), ("--status", "--wait"), ("sipure", "--detach")):
        result = run(*args, "--metrics-file", str(out))
        assert result.code == 2 and "error: --metrics-file goes with" in result.stderr, (args, result.stderr)
        assert "hint:" in result.stderr and "Traceback" not in result.stderr
    assert not out.exists()


def _refused(result: Result) -> None:
    assert result.code == 2, result.stdout + result.stderr
    assert "error: refusing to write the metrics file" in result.stderr and "hint:" in result.stderr


def test_a_symlink_a_fifo_or_a_directory_at_the_path_is_refused_untouched(
    venv: Path, textfile_dir: Path, tmp_path: Path
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("root's file\n")
    (textfile_dir / "link.prom").symlink_to(victim)
    os.mkfifo(textfile_dir / "fifo.prom")
    (textfile_dir / "dir.prom").mkdir()
    for name in ("link.prom", "fifo.prom", "dir.prom"):
        # a FIFO opened for writing would block until a reader came: the timeout would fail the test
        result = run(
            "--verify-only",
            "--all",
            "--python",
            str(venv),
            "--metrics-file",
            str(textfile_dir / name),
            timeout=60,
        )
        _refused(result)
        assert "files checked" not in result.stdout  # refused before the check
    assert victim.read_text() == "root's file\n" and (textfile_dir / "link.prom").is_symlink()
    assert (
        stat.S_ISFIFO((textfile_dir / "fifo.prom").lstat().st_mode) and (textfile_dir / "dir.prom").is_dir()
    )


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to give a directory to another account")
def test_a_directory_others_could_redirect_is_refused(venv: Path, tmp_path: Path) -> None:
    cases = {"writable": 0o777, "group-writable": 0o775, "sticky-not-root": 0o1777}
    for name, mode in cases.items():
        directory = tmp_path / name
        directory.mkdir()
        directory.chmod(mode)
        if name == "sticky-not-root":
            os.chown(directory, 65534, 65534)
        if name == "group-writable":
            os.chown(directory, 0, 65534)  # the group root's would be root's (safefs.others_who_write)
        _refused(run("--status", "--metrics-file", str(directory / "m.prom")))
        assert list(directory.iterdir()) == []
    above = tmp_path / "open-parent"
    (above / "textfile").mkdir(parents=True)
    above.chmod(0o777)  # whoever can write here could swap textfile/ for a symlink into /etc
    _refused(run("--status", "--metrics-file", str(above / "textfile" / "m.prom")))
    sticky = tmp_path / "sticky-root"  # as /tmp: others may not rename or delete what is ours
    sticky.mkdir()
    sticky.chmod(0o1777)
    state = tmp_path / "state"
    result = run(
        "--status",
        "--metrics-file",
        str(sticky / "m.prom"),
        env={**os.environ, "SAFEINSTALL_STATE_DIR": str(state)},
    )
    assert result.code == 0, result.stderr
    assert value(read_metrics(sticky / "m.prom"), "safeinstall_status_success") == 1


def test_a_write_that_fails_leaves_no_temporary_file_and_keeps_the_old_file(
    venv: Path, wheels: Wheelhouse, textfile_dir: Path
) -> None:
    wheelhouse.uv_install(venv, wheels["sipure-1"])
    out = textfile_dir / "verify.prom"
    out.write_text("# the previous scrape's file\n")
    out.chmod(0o644)

    def small_files() -> None:  # any file larger than 300 bytes fails to write (EFBIG)
        resource.setrlimit(resource.RLIMIT_FSIZE, (300, 300))

    proc = subprocess.run(
        [SAFEINSTALL, "--verify-only", "--all", "--python", str(venv), "--metrics-file", str(out)],
        capture_output=True,
        text=True,
        preexec_fn=small_files,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr  # the check's own result stands
    assert "error: could not write the metrics file" in proc.stderr and "hint:" in proc.stderr
    assert out.read_text() == "# the previous scrape's file\n"
    assert sorted(p.name for p in textfile_dir.iterdir()) == ["verify.prom"]


@pytest.fixture
def run_bed(
    venv: Path, wheels: Wheelhouse, tmp_path: Path, units: Units, user_manager: UserManager
) -> Iterator[tuple[Path, str, dict[str, str]]]:
    wheelhouse.uv_install(venv, wheels["sicext-1"])
    name = units.started("metrics", f"{venv.parent}/sicext-serve")
    environ = {**user_manager.env, "SAFEINSTALL_STATE_DIR": str(tmp_path / "state")}
    yield venv, name, environ


def test_a_run_writes_its_status_versions_times_and_downtime(
    run_bed: tuple[Path, str, dict[str, str]], wheels: Wheelhouse, textfile_dir: Path
) -> None:
    python, unit, environ = run_bed
    prefix = str(python.parent.parent)
    out = textfile_dir / "run.prom"
    ours = ("--user", "--python", str(python), "--yes", "--json", "--settle", "1", "--metrics-file", str(out))
    done = run("sicext", "--wheel", str(wheels["sicext-2"]), *ours, env=environ, timeout=240)
    assert done.code == 0, done.stdout + done.stderr
    samples = read_metrics(out)
    (info,) = samples["safeinstall_run_info"]
    assert info.labels == {  # no run id among the labels: a run makes no new series (issue 42)
        "prefix": prefix,
        "package": "sicext",
        "old_version": "1.0",
        "new_version": "2.0",
    }
    assert value(samples, "safeinstall_run_status", status="done") == 1
    stamp = datetime.fromtimestamp(value(samples, "safeinstall_run_id_timestamp_seconds", prefix=prefix), UTC)
    pid = int(value(samples, "safeinstall_run_id_pid", prefix=prefix))
    assert f"{stamp:%Y%m%dT%H%M%SZ}-{pid}" == done.json["data"]["run_id"]  # the id, as values
    assert value(samples, "safeinstall_run_status", status="rolled-back") == 0
    assert value(samples, "safeinstall_run_exit_code", prefix=prefix) == 0
    downtime = value(samples, "safeinstall_run_unit_downtime_seconds", prefix=prefix, unit=unit)
    assert downtime == done.json["data"]["downtime_s"][unit] > 0
    start = value(samples, "safeinstall_run_start_timestamp_seconds", prefix=prefix)
    end = value(samples, "safeinstall_run_end_timestamp_seconds", prefix=prefix)
    assert 1.7e9 < start <= end

    crashed = run("sicext", "--wheel", str(wheels["sicext-3"]), "--no-smoke", *ours, env=environ, timeout=240)
    assert crashed.code == 3, crashed.stdout + crashed.stderr
    samples = read_metrics(out)
    assert value(samples, "safeinstall_run_status", status="rolled-back") == 1
    assert value(samples, "safeinstall_run_status", status="done") == 0
    assert value(samples, "safeinstall_run_exit_code", prefix=prefix) == 3

    status_file = textfile_dir / "status.prom"
    status = run("--status", "--metrics-file", str(status_file), env=environ)
    assert status.code == 0, status.stderr
    samples = read_metrics(status_file)
    assert value(samples, "safeinstall_status_success") == 1
    assert value(samples, "safeinstall_status_needs_recovery", prefix=prefix) == 0
    assert value(samples, "safeinstall_status_running", prefix=prefix) == 0
    assert value(samples, "safeinstall_run_status", prefix=prefix, status="rolled-back") == 1  # the last run
    assert samples["safeinstall_run_info"][0].labels["new_version"] == "3.0"

    recover_file = textfile_dir / "recover.prom"
    recovered = run("--user", "--recover", "--metrics-file", str(recover_file), env=environ)
    assert recovered.code == 0, recovered.stderr
    samples = read_metrics(recover_file)
    assert value(samples, "safeinstall_recover_success") == 1
    assert value(samples, "safeinstall_recover_exit_code") == 0


def test_a_run_refused_before_it_starts_is_an_error_in_the_metrics(
    run_bed: tuple[Path, str, dict[str, str]], textfile_dir: Path, tmp_path: Path
) -> None:
    python, _unit, environ = run_bed
    out = textfile_dir / "run.prom"
    bad = tmp_path / "not-a-wheel.whl"
    bad.write_text("no zip")
    ours = ("--user", "--python", str(python), "--yes", "--metrics-file", str(out))
    refused = run("sicext", "--wheel", str(bad), *ours, env=environ, timeout=120)
    assert refused.code == 2, refused.stdout + refused.stderr
    samples = read_metrics(out)
    assert value(samples, "safeinstall_run_status", status="error") == 1
    assert value(samples, "safeinstall_run_exit_code", prefix=str(python.parent.parent)) == 2


ROOT = Path(__file__).resolve().parent.parent
RULES = ROOT / "contrib" / "prometheus" / "safeinstall.rules.yml"


def _annotations(name: str, labels: dict[str, str], value: str) -> dict[str, str]:
    """The annotations of the shipped rule ``name``, its templates filled as Prometheus fills them."""
    rules = yaml.safe_load(RULES.read_text())["groups"][0]["rules"]
    (rule,) = [r for r in rules if r["alert"] == name]
    filled = {}
    for key, template in rule["annotations"].items():
        text = re.sub(r"\{\{ \$labels\.(\w+) \}\}", lambda m: labels[m.group(1)], template)
        filled[key] = text.replace("{{ $value }}", value)
    return filled


def _alerts(at: str, name: str, *expected: dict[str, str], value: str = "") -> dict[str, object]:
    return {
        "eval_time": at,
        "alertname": name,
        "exp_alerts": [{"exp_labels": e, "exp_annotations": _annotations(name, e, value)} for e in expected],
    }


#: each run status and the alerts its host raises: a run that changed nothing on purpose (a prepared
#: one until its commit: every host a rolling upgrade prepares) raises no critical alert
_STATUS_ALERTS = {
    "done": (),
    "prepared": (),
    "discarded": (),
    "declined": (),
    "commit-refused": (("SafeinstallCommitRefused", "warning"),),
    "rolled-back": (("SafeinstallLastRunNotDone", "critical"),),
    "rollback-failed": (("SafeinstallLastRunNotDone", "critical"),),
    "error": (("SafeinstallLastRunNotDone", "critical"),),
    "recovered": (("SafeinstallLastRunNotDone", "critical"),),
    "someday-new": (("SafeinstallLastRunNotDone", "critical"),),
}


def _by_status() -> dict[str, object]:
    """A promtool test: a host per run status, each with the series a run of that status writes (1 for
    its own status, 0 for every other that ``RUN_STATUSES`` lists)."""
    from safeinstall.run.commands.metrics import RUN_STATUSES, run_families
    from safeinstall.store.history import RunSummary

    assert set(RUN_STATUSES) <= set(_STATUS_ALERTS), "a status without its expected alerts"
    series = []
    expected: dict[str, list[dict[str, str]]] = {
        "SafeinstallLastRunNotDone": [],
        "SafeinstallCommitRefused": [],
    }
    for n, own in enumerate(_STATUS_ALERTS):
        host = {"instance": f"gpu-{n}", "prefix": "/opt/vllm/venv"}
        labels = ",".join(f'{k}="{v}"' for k, v in host.items())
        run_ = RunSummary("R1", own, 0, "vllm", "1", "2", None, None, {}, None)
        written = parsed(render(run_families(host["prefix"], run_)))["safeinstall_run_status"]
        for sample in written:
            status = sample.labels["status"]
            series.append(
                {
                    "series": f'safeinstall_run_status{{{labels},status="{status}"}}',
                    "values": "0x10" if sample.value == 0 else "1x10",
                }
            )
        for name, severity in _STATUS_ALERTS[own]:
            expected[name].append({**host, "status": own, "severity": severity})
    return {
        "interval": "1m",
        "input_series": series,
        "alert_rule_test": [_alerts("5m", name, *alerts) for name, alerts in expected.items()],
    }


def test_the_alert_rules_fire_on_drift_a_run_not_done_and_a_check_failing(tmp_path: Path) -> None:
    """The shipped rules, run by Prometheus' own rule engine (``promtool test rules``) over series as
    safeinstall writes them (names and labels taken from files written by :func:`render`)."""
    if PROMTOOL is None:
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; .ci/run installs it)")
    check = subprocess.run([PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr
    host = {"instance": "gpu-02", "prefix": "/opt/vllm/venv"}
    drift = {**host, "distribution": "vllm"}
    series = [
        ('safeinstall_verify_drift_findings{%s,kind="modified"}', drift, "0 0 0 1 1 1"),
        ('safeinstall_verify_drift_findings{%s,kind="missing"}', drift, "0 0 0 0 2 2"),
        ('safeinstall_run_status{%s,status="done"}', host, "1 1 0 0 0 0"),
        ('safeinstall_run_status{%s,status="rolled-back"}', host, "0 0 1 1 1 1"),
        ("safeinstall_status_needs_recovery{%s}", host, "0x300"),
        ("safeinstall_verify_success{%s}", host, "1x60 0x240"),
        ("safeinstall_verify_timestamp_seconds{%s}", host, "0+60x300"),  # written every minute
        ('safeinstall_verify_success{instance="gpu-03",prefix="/opt/vllm/venv"}', None, "1x300"),
        ('safeinstall_verify_timestamp_seconds{instance="gpu-03",prefix="/opt/vllm/venv"}', None, "0x300"),
    ]

    def labels(pattern: str, values: dict[str, str] | None) -> str:
        text = ",".join(f'{k}="{v}"' for k, v in (values or {}).items())
        return pattern % text if values is not None else pattern

    stale = {"instance": "gpu-03", "prefix": "/opt/vllm/venv"}
    tests = {
        "rule_files": [str(RULES)],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": [{"series": labels(p, v), "values": values} for p, v, values in series],
                "alert_rule_test": [
                    _alerts("1m", "SafeinstallDrift"),
                    _alerts("3m", "SafeinstallDrift", {**drift, "severity": "warning"}, value="1"),
                    _alerts("1m", "SafeinstallLastRunNotDone"),
                    _alerts(
                        "2m",
                        "SafeinstallLastRunNotDone",
                        {**host, "status": "rolled-back", "severity": "critical"},
                    ),
                    _alerts("100m", "SafeinstallNeedsRecovery"),
                    _alerts("90m", "SafeinstallCheckFailing"),
                    _alerts("3h", "SafeinstallCheckFailing", {**host, "severity": "warning"}),
                    _alerts(
                        "4h30m",
                        "SafeinstallCheckFailing",
                        {**host, "severity": "warning"},
                        {**stale, "severity": "warning"},
                    ),
                ],
            },
            _by_status(),
        ],
    }
    test_file = tmp_path / "rules.test.yml"
    test_file.write_text(json.dumps(tests))  # YAML is a superset of JSON
    result = subprocess.run([PROMTOOL, "test", "rules", str(test_file)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    written = parsed(render(verify_families("/opt/vllm/venv", None, 2, 1.8e9)))  # the names the rules use
    assert {"safeinstall_verify_success", "safeinstall_verify_timestamp_seconds"} <= set(written)


def test_the_shipped_service_and_timer_write_the_metrics(
    patched_env: Path, textfile_dir: Path, user_manager: UserManager, tmp_path: Path
) -> None:
    """safeinstall-verify@.service as shipped (only safeinstall's path and the textfile directory
    changed, as an installation does), an instance per environment, started by the real manager."""
    shipped = ROOT / "safeinstall" / "data"
    prefix = patched_env.parent.parent
    instance = subprocess.run(
        ["systemd-escape", "--path", str(prefix)], capture_output=True, text=True, check=True
    ).stdout.strip()
    service, timer = f"safeinstall-verify@{instance}.service", f"safeinstall-verify@{instance}.timer"
    for name in ("safeinstall-verify@.service", "safeinstall-verify@.timer"):
        text = (shipped / name).read_text().replace("/usr/local/bin/safeinstall", SAFEINSTALL)
        (user_manager.unit_dir / name).write_text(text)
    dropin = user_manager.unit_dir / "safeinstall-verify@.service.d"
    dropin.mkdir(exist_ok=True)
    (dropin / "test.conf").write_text(
        f'[Service]\nEnvironment="SAFEINSTALL_TEXTFILE_DIR={textfile_dir}" '
        f'"SAFEINSTALL_STATE_DIR={tmp_path / "state"}"\n'
    )
    user_manager.daemon_reload()
    try:
        # a oneshot: returns when it is done (Nice=10 and the idle I/O class: slow on a loaded machine)
        user_manager.systemctl("start", service, timeout=600)
        assert user_manager.show(service, "Result")["Result"] == "success"
        verify = read_metrics(textfile_dir / f"safeinstall-verify-{instance}.prom")
        assert value(verify, "safeinstall_verify_drift_findings", distribution="sipure", kind="modified") == 1
        assert value(verify, "safeinstall_verify_exit_code", prefix=str(prefix)) == 1  # drift: not a failure
        status = read_metrics(textfile_dir / f"safeinstall-status-{instance}.prom")
        assert value(status, "safeinstall_status_success") == 1
        user_manager.systemctl("start", timer)
        # OnBootSec=10min lies in the past on a host up for longer: the timer elapses at once and has
        # no next elapse until the check it started is over (Nice=10, idle I/O: slow under load)
        wait_until(
            lambda: (
                user_manager.show(timer, "NextElapseUSecRealtime")["NextElapseUSecRealtime"] not in ("", "0")
            ),
            timeout=600,
            what=f"{timer}'s next elapse",
            interval=0.5,
        )
        shown = user_manager.show(timer, "ActiveState", "NextElapseUSecRealtime", "RandomizedDelayUSec")
        assert shown["ActiveState"] == "active" and shown["NextElapseUSecRealtime"] not in ("", "0")
        assert shown["RandomizedDelayUSec"] == "30min"
    finally:
        user_manager.systemctl("stop", timer, service, check=False)
        for name in ("safeinstall-verify@.service", "safeinstall-verify@.timer"):
            (user_manager.unit_dir / name).unlink()
        shutil.rmtree(dropin)
        user_manager.systemctl("reset-failed", check=False)
        user_manager.daemon_reload()


def test_status_and_recover_name_each_environment_by_its_prefix() -> None:
    """Pure: ``--status`` and ``--recover`` of several environments, one with an odd prefix, a run
    whose status is unknown to this version, and a failure."""
    from safeinstall.errors import SafeInstallError
    from safeinstall.run.back.recover import Recovered, Recovery
    from safeinstall.run.commands.metrics import recover_families, status_families
    from safeinstall.run.commands.status import EnvironmentStatus, StatusReport
    from safeinstall.store.history import RunSummary

    odd = '/srv/a "b"\nc'
    run_ = RunSummary(
        "R1", "someday-new", 7, "vllm", "1", "2", "2026-12-01T00:00:00+00:00", "nonsense", {}, None
    )
    report = StatusReport(
        (
            EnvironmentStatus(odd, True, None, "install", False, False, "vllm", runs=(run_,)),
            EnvironmentStatus("/opt/b", False, None, None, True, True, None),
        ),
        (SafeInstallError("refused", hint="h"),),
    )
    samples = parsed(render(status_families(report, 1.8e9)))
    assert (
        value(samples, "safeinstall_status_success") == 0
        and value(samples, "safeinstall_status_exit_code") == 2
    )
    assert value(samples, "safeinstall_status_running", prefix=odd) == 1
    assert value(samples, "safeinstall_status_needs_recovery", prefix="/opt/b") == 1
    assert value(samples, "safeinstall_run_status", prefix=odd, status="someday-new") == 1
    assert value(samples, "safeinstall_run_start_timestamp_seconds", prefix=odd) == 1796083200
    assert "safeinstall_run_end_timestamp_seconds" not in samples  # not a time: left out, not invented
    recovered = Recovered(
        (
            Recovery(odd, "R1", "install", restored=True, started=("a.service", "b.service")),
            Recovery("/opt/b", None, None),
        ),
        (),
    )
    samples = parsed(render(recover_families(recovered, 1.8e9)))
    assert value(samples, "safeinstall_recover_success") == 1
    assert value(samples, "safeinstall_recover_restored", prefix=odd) == 1
    assert value(samples, "safeinstall_recover_units_started", prefix=odd) == 2
    assert value(samples, "safeinstall_recover_recovered", prefix="/opt/b") == 0


def test_a_status_that_cannot_read_the_state_says_so(textfile_dir: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    state.mkdir()
    state.chmod(0o777)  # others could plant a journal: refused
    out = textfile_dir / "status.prom"
    result = run(
        "--status", "--metrics-file", str(out), env={**os.environ, "SAFEINSTALL_STATE_DIR": str(state)}
    )
    assert result.code == 2 and "error:" in result.stderr, result.stdout + result.stderr
    samples = read_metrics(out)
    assert (
        value(samples, "safeinstall_status_success") == 0
        and value(samples, "safeinstall_status_exit_code") == 2
    )
    assert all(not s.labels for s in samples["safeinstall_status_success"])


def test_the_service_downtime_users_saw_is_a_metric_and_in_the_status_list() -> None:
    """With ``--health-url`` a run's result holds ``service_downtime_s`` (the first unit stopped -> the
    health URL answering 200): the metrics file and ``--status`` show it; without one, nothing."""
    from safeinstall.cli.render import _runs_rows
    from safeinstall.run.commands.metrics import run_families
    from safeinstall.store.history import RunSummary

    base = RunSummary("r1", "done", 0, "vllm", "0.33.0", "0.32.0", None, None, {"v.service": 0.4}, None)
    seen = replace(base, service_downtime_s=61.5)
    names = {family.name: family for family in run_families("/opt/v", seen)}
    (sample,) = names["safeinstall_run_service_downtime_seconds"].samples
    assert sample.value == 61.5 and dict(sample.labels) == {"prefix": "/opt/v"}
    assert "safeinstall_run_service_downtime_seconds" not in {f.name for f in run_families("/opt/v", base)}
    assert "v.service 0.4 s; service 61.5 s" in _runs_rows((seen,))[0]
    assert "v.service 0.4 s" in _runs_rows((base,))[0]
