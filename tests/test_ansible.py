"""The Ansible collection ``safeinstall.fleet`` (ansible_collections/), run by the real ansible-core.

A fleet of three hosts, all ``ansible_connection=local``: each its own venv (made by uv, sicext 1.0 from
the fixture wheels), its own unit in the private systemd manager (a small HTTP server that imports
sicext and answers ``/health``) and its own state directory. The README's examples run against it as
they are: ``examples/rolling-upgrade.yml`` (serial 1, max_fail_percentage 0) and
``examples/drift-report.yml``. Ansible reads no configuration of this machine and writes only into the
test's temporary directories.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tarfile
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.samples import Sample as ParsedSample

from tests import wheelhouse
from tests.bed_systemd import Units, UserManager, wait_until
from tests.beds import HEALTH_SERVER
from tests.promcheck import read_metrics
from tests.wheelhouse import Wheelhouse

ROOT = Path(__file__).resolve().parent.parent
COLLECTION = ROOT / "ansible_collections" / "safeinstall" / "fleet"
BIN = Path(sys.executable).parent


def ansible_environ(base: Path, environ: Mapping[str, str]) -> dict[str, str]:
    """Ansible's environment: ``environ`` (for a play, the private systemd manager's, so that
    safeinstall's ``systemctl --user`` reaches it) with the test venv first on PATH (the modules'
    default executable), and Ansible's configuration, home and temporary directories all in ``base``."""
    (base / "ansible.cfg").touch()  # read instead of ./ansible.cfg, ~/.ansible.cfg, /etc/ansible
    return {
        **{k: v for k, v in environ.items() if not k.startswith("ANSIBLE_")},
        "PATH": f"{BIN}{os.pathsep}{environ.get('PATH', os.defpath)}",
        "ANSIBLE_CONFIG": str(base / "ansible.cfg"),
        "ANSIBLE_HOME": str(base / "home"),
        "ANSIBLE_LOCAL_TEMP": str(base / "local-tmp"),
        "ANSIBLE_REMOTE_TEMP": str(base / "remote-tmp"),
        "ANSIBLE_COLLECTIONS_PATH": str(ROOT),
        "ANSIBLE_COLLECTIONS_SCAN_SYS_PATH": "False",
        "ANSIBLE_CALLBACK_PLUGINS": str(ROOT / "tests" / "ansible_plugins"),
        "ANSIBLE_CALLBACKS_ENABLED": "safeinstall_record",
        "ANSIBLE_LOAD_CALLBACK_PLUGINS": "True",
        "ANSIBLE_PIPELINING": "True",
        "ANSIBLE_NOCOLOR": "True",
        "ANSIBLE_RETRY_FILES_ENABLED": "False",
        "ANSIBLE_DEPRECATION_WARNINGS": "False",
        "COLUMNS": "200",
    }


_LIBRARY_WARNING = re.compile(r"^\S*/site-packages/(?!ansible_collections/)\S+\.py:\d+: \w*Warning: ")


def not_ours_dropped(stderr: str) -> str:
    """``stderr`` without the Python warnings a library installed beside Ansible raises at import (and
    the source line Python prints under each): today's cryptography warns of DSA from ansible-core's
    own imports, which says nothing about this collection. Everything else is kept."""
    kept: list[str] = []
    lines = iter(stderr.splitlines(keepends=True))
    for line in lines:
        if _LIBRARY_WARNING.match(line):
            next(lines, None)  # the source line Python prints under a warning
            continue
        kept.append(line)
    return "".join(kept)


def test_not_ours_dropped_keeps_everything_but_a_librarys_import_warning() -> None:
    warned = (
        "/v/lib/python3.11/site-packages/ansible/_internal/_ssh/_ssh_agent.py:18: "
        "CryptographyDeprecationWarning: DSA is deprecated\n"
        "  from cryptography.hazmat.primitives.asymmetric.dsa import (\n"
    )
    ours = "[WARNING]: module documentation: option 'x' is not documented\n"
    assert not_ours_dropped(warned) == ""
    assert not_ours_dropped(warned + ours) == ours
    collection = "/r/site-packages/ansible_collections/safeinstall/fleet/plugins/x.py:3: UserWarning: x\n"
    assert not_ours_dropped(collection) == collection


@dataclass(frozen=True)
class Host:
    name: str
    python: Path
    site: Path
    state: Path  # its SAFEINSTALL_STATE_DIR
    staging: Path  # where the rolling upgrade stages the wheel (in a temporary directory it removes)
    unit: str
    port: int
    wheel: Path  # the wheel the rolling upgrade installs on it

    def version(self) -> str:
        """The installed sicext version, read from its metadata (no import: v3 crashes on import)."""
        metadata = next(self.site.glob("sicext-*.dist-info")) / "METADATA"
        return next(
            line.split(": ", 1)[1]
            for line in metadata.read_text().splitlines()
            if line.startswith("Version: ")
        )

    def state_files(self) -> list[str]:
        return (
            sorted(str(p.relative_to(self.state)) for p in self.state.rglob("*"))
            if self.state.exists()
            else []
        )

    def staged(self) -> list[Path]:
        return list(self.staging.iterdir())


@dataclass(frozen=True)
class Play:
    code: int
    output: str
    events: list[dict[str, Any]]  # from the safeinstall_record callback, in the controller's order

    @property
    def results(self) -> list[dict[str, Any]]:
        """One per task and host (its start left out)."""
        return [e for e in self.events if e["outcome"] != "started"]

    def index(self, host: str, task_prefix: str, outcome: str) -> int:
        """Where in :attr:`events` ``host``'s task started (``started``) or ended (any other)."""
        (found,) = [
            i
            for i, e in enumerate(self.events)
            if e["host"] == host
            and e["task"].startswith(task_prefix)
            and (e["outcome"] == "started") == (outcome == "started")
        ]
        return found

    def of(self, host: str, task_prefix: str) -> dict[str, Any]:
        (found,) = [r for r in self.results if r["host"] == host and r["task"].startswith(task_prefix)]
        return found

    def hosts(self) -> set[str]:
        return {r["host"] for r in self.results}


@dataclass
class Fleet:
    base: Path
    hosts: list[Host]
    manager: UserManager
    inventory: Path
    env: dict[str, str]

    def __getitem__(self, name: str) -> Host:
        return next(h for h in self.hosts if h.name == name)

    def _run(self, argv: list[str], environ: Mapping[str, str] | None = None) -> Play:
        record = self.base / "record.jsonl"
        record.unlink(missing_ok=True)
        proc = subprocess.run(
            argv,
            cwd=self.base,
            env={**self.env, **(environ or {}), "SAFEINSTALL_TEST_RECORD": str(record)},
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )
        lines = record.read_text().splitlines() if record.exists() else []
        return Play(proc.returncode, proc.stdout + proc.stderr, [json.loads(line) for line in lines])

    def playbook(self, playbook: str, *args: str, inventory: Path | None = None) -> Play:
        return self._run(
            [
                str(BIN / "ansible-playbook"),
                "-i",
                str(inventory or self.inventory),
                str(ROOT / playbook),
                *args,
            ]
        )

    def adhoc(self, module: str, module_args: str, *args: str, host: Host | None = None) -> Play:
        """``ansible`` on every host, or on ``host`` alone with its state directory (a module run by
        the local connection inherits the controller's environment)."""
        where, environ = (
            ("all", None) if host is None else (host.name, {"SAFEINSTALL_STATE_DIR": str(host.state)})
        )
        argv = [
            str(BIN / "ansible"),
            where,
            "-i",
            str(self.inventory),
            "-m",
            module,
            "-a",
            module_args,
            *args,
        ]
        return self._run(argv, environ)

    def main_pids(self) -> dict[str, int]:
        return {h.name: self.manager.main_pid(h.unit) for h in self.hosts}


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _health(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as response:
        return str(response.read().decode())


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


@pytest.fixture(scope="module")
def fleet(
    tmp_path_factory: pytest.TempPathFactory, user_manager: UserManager, wheels: Wheelhouse
) -> Iterator[Fleet]:
    """Three hosts, made once for this module: the scenarios share it (Ansible starts slowly)."""
    base = tmp_path_factory.mktemp("fleet")
    server = base / "health_server.py"
    server.write_text(HEALTH_SERVER.format(loading=0))  # maps sicext's extension, serves /health
    units = Units(user_manager)
    # host2's wheel crashes on import: its unit fails to start on it, and the run rolls back
    upgrades = {"host1": wheels["sicext-2"], "host2": wheels["sicext-3"], "host3": wheels["sicext-2"]}
    hosts: list[Host] = []
    try:
        for name, wheel in upgrades.items():
            python = wheelhouse.make_venv(base / name / "venv")
            wheelhouse.uv_install(python, wheels["sicext-1"])
            port = _free_port()
            unit = units.started(name, f"{python} {server} {port}")
            wait_until(functools.partial(_answers, port), 15, f"{name} serving on {port}")
            (base / name / "staging").mkdir()
            hosts.append(
                Host(
                    name,
                    python,
                    wheelhouse.site_packages(python),
                    base / name / "state",
                    base / name / "staging",
                    unit,
                    port,
                    wheel,
                )
            )
        inventory = base / "inventory.json"
        inventory.write_text(
            json.dumps(
                {
                    "all": {
                        "vars": {
                            "ansible_connection": "local",
                            "ansible_python_interpreter": sys.executable,
                            "safeinstall_package": "sicext",
                            "safeinstall_user": True,
                            "safeinstall_settle": 1,
                        },
                        "hosts": {
                            h.name: {
                                "safeinstall_python": str(h.python),
                                "safeinstall_wheel": str(h.wheel),
                                "safeinstall_wheel_dir": str(h.staging),
                                "safeinstall_health_url": f"http://127.0.0.1:{h.port}/health",
                                "safeinstall_environment": {"SAFEINSTALL_STATE_DIR": str(h.state)},
                                # host2's crash is found after the stop only without the smoke check
                                # (with it, refused before the stop: tests/test_smoke.py)
                                "safeinstall_no_smoke": h.name == "host2",
                            }
                            for h in hosts
                        },
                    }
                }
            )
        )
        yield Fleet(base, hosts, user_manager, inventory, ansible_environ(base, user_manager.env))
    finally:
        units.cleanup()


def _environment_status(host: Host) -> dict[str, Any]:
    """safeinstall's own ``--status`` of the host's environment (its journal, its prepared run)."""
    proc = subprocess.run(
        [str(BIN / "safeinstall"), "--status", "--json", "--python", str(host.python)],
        env={**os.environ, "SAFEINSTALL_STATE_DIR": str(host.state)},
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (environment,) = json.loads(proc.stdout)["data"]["environments"]
    return dict(environment)


PREPARE = "Prepare (checks"
COMMIT = "Commit the prepared run"


def test_check_mode_changes_nothing_and_reports_what_would_change(fleet: Fleet) -> None:
    before = {h.name: (h.version(), h.state_files()) for h in fleet.hosts}
    pids = fleet.main_pids()

    play = fleet.playbook("examples/rolling-upgrade.yml", "--check", "--diff", "-e", "safeinstall_batch=3")

    assert play.code == 0, play.output
    for host in fleet.hosts:
        task = play.of(host.name, PREPARE)
        result = task["result"]
        assert task["outcome"] == "ok" and result["changed"] is True, result
        assert result["rc"] == 0 and result["status"] == "would-proceed"
        assert result["result"]["command"] == "dry-run" and "--dry-run" in result["cmd"]
        assert "--prepare" not in result["cmd"]  # a dry-run of the whole run: nothing is prepared
        new = "3.0" if host.wheel == fleet["host2"].wheel else "2.0"
        assert f"would reinstall sicext {host.version()} -> {new}; restarts {host.unit}" == result["msg"]
        diff = result["diff"]
        assert (
            diff["before"]
            == f"sicext {host.version()}\nunit {host.unit}: active, main PID {pids[host.name]}\n"
        )
        assert diff["after"] == f"sicext {new}\nunit {host.unit}: restarted\n"
        assert play.of(host.name, "Discard the prepared run when")["outcome"] == "skipped"
        assert play.of(host.name, COMMIT)["outcome"] == "skipped"  # nothing prepared to commit
        assert play.of(host.name, "The service answers")["outcome"] == "skipped"
    assert f"+unit {fleet['host1'].unit}: restarted" in play.output  # --diff shows it
    assert {h.name: (h.version(), h.state_files()) for h in fleet.hosts} == before
    assert all(h.staged() == [] for h in fleet.hosts)  # the staged wheel went again
    assert fleet.main_pids() == pids


def test_rolling_upgrade_prepares_every_host_at_once_then_commits_until_one_fails(fleet: Fleet) -> None:
    """Issue 47: every host prepared side by side before the first stop; commits one at a time; host2's
    commit rolls back, which stops the play; host3's prepared run is discarded, its unit untouched."""
    host1, host2, host3 = fleet.hosts
    pids = fleet.main_pids()

    play = fleet.playbook("examples/rolling-upgrade.yml", "--diff")

    assert play.code != 0, play.output
    # the prepares: on every host, nothing stopped, each unit still on its first main PID
    for host in fleet.hosts:
        prepared = play.of(host.name, PREPARE)
        result = prepared["result"]
        assert prepared["outcome"] == "ok" and result["changed"] is True, result
        assert result["rc"] == 0 and result["status"] == "prepared" and "--prepare" in result["cmd"]
        assert result["result"]["command"] == "reinstall" and result["result"]["status"] == "prepared"
        new = "3.0" if host is host2 else "2.0"
        assert (
            result["msg"] == f"prepared sicext 1.0 -> {new}; nothing stopped; the commit restarts {host.unit}"
        )
        (unit,) = result["result"]["data"]["plan"]["units"]
        assert (unit["name"], unit["main_pid"]) == (host.unit, pids[host.name])
        assert "stop" not in [s["name"] for s in result["result"]["data"]["steps"]]
    # side by side: every prepare started before any ended; all ended before the first commit began
    starts = [play.index(h.name, PREPARE, "started") for h in fleet.hosts]
    ends = [play.index(h.name, PREPARE, "ended") for h in fleet.hosts]
    assert max(starts) < min(ends), play.events
    assert max(ends) < play.index("host1", COMMIT, "started")
    # host1: committed, restarted, healthy
    done = play.of("host1", COMMIT)["result"]
    assert done["changed"] is True and done["rc"] == 0 and done["status"] == "done", done
    assert "--commit" in done["cmd"] and done["result"]["command"] == "reinstall"
    steps = [s["name"] for s in done["result"]["data"]["steps"]]
    assert steps[:2] == ["preflight", "gate"] and "stop" in steps and "smoke" not in steps  # checks, window
    assert done["msg"] == f"reinstalled sicext 1.0 -> 2.0; restarted {host1.unit}"
    assert done["diff"]["after"] == f"sicext 2.0\nunit {host1.unit}: restarted\n"
    assert host1.version() == "2.0" and fleet.manager.main_pid(host1.unit) != pids["host1"]
    assert play.of("host1", "The service answers")["result"]["content"] == "2.0"
    # host2: its wheel crashes the service, so safeinstall put 1.0 back and the play stopped there
    failed = play.of("host2", COMMIT)
    assert failed["outcome"] == "failed", failed
    assert failed["result"]["rc"] == 3 and failed["result"]["status"] == "rolled-back"
    assert failed["result"]["msg"].startswith("rolled back: ") and host2.unit in failed["result"]["msg"]
    assert failed["result"]["result"]["errors"][0]["code"] == "rolled-back"
    assert host2.version() == "1.0"
    fleet.manager.wait_active(host2.unit)
    wait_until(lambda: _answers(host2.port), 15, "host2 serving again")
    assert _health(host2.port) == "1.0"
    assert play.of("host2", "Stop the rolling upgrade")["outcome"] == "failed"
    assert not any(r["host"] == "host2" and r["task"].startswith("The service") for r in play.results)
    # the rescue discarded, once, on every host not committed: host2's run went with its rollback
    discard = play.of("host2", "Discard the prepared runs")["result"]["results"]
    assert [(d["item"], d["status"], d["changed"]) for d in discard] == [
        ("host2", "not-prepared", False),
        ("host3", "discarded", True),
    ]
    assert discard[1]["msg"].startswith("discarded the prepared run ") and "1.0 -> 2.0" in discard[1]["msg"]
    # host3: prepared, never committed, its prepared run discarded: its unit untouched, nothing left
    assert not any(r["host"] == "host3" and r["task"].startswith(COMMIT) for r in play.events)
    assert host3.version() == "1.0" and fleet.manager.main_pid(host3.unit) == pids["host3"]
    for host in fleet.hosts:
        status = _environment_status(host)
        assert status["prepared"] is None and status["journal_phase"] is None, status
        assert not status["needs_recovery"] and not status["running"]
    assert all(h.staged() == [] for h in fleet.hosts)


def test_a_host_that_cannot_prepare_stops_the_upgrade_before_any_commit(fleet: Fleet) -> None:
    """host2's environment is gone: its prepare fails, the other hosts discard theirs, nothing commits."""
    pids = fleet.main_pids()
    versions = {h.name: h.version() for h in fleet.hosts}
    inventory = json.loads(fleet.inventory.read_text())
    inventory["all"]["hosts"]["host2"]["safeinstall_python"] = str(fleet.base / "host2" / "gone" / "python")
    broken = fleet.base / "inventory-host2-gone.json"
    broken.write_text(json.dumps(inventory))

    play = fleet.playbook("examples/rolling-upgrade.yml", inventory=broken)

    assert play.code != 0, play.output
    failed = play.of("host2", PREPARE)
    assert failed["outcome"] == "failed" and failed["result"]["changed"] is False, failed
    for name in ("host1", "host3"):
        assert play.of(name, PREPARE)["result"]["status"] == "prepared"
        discarded = play.of(name, "Discard the prepared run when")["result"]
        assert (discarded["status"], discarded["changed"], discarded["rc"]) == ("discarded", True, 0), (
            discarded
        )
        stop = play.of(name, "Stop before any commit")
        assert stop["outcome"] == "failed" and "host2 failed" in stop["result"]["msg"], stop
    assert not any(e["task"].startswith(COMMIT) for e in play.events)
    assert fleet.main_pids() == pids and {h.name: h.version() for h in fleet.hosts} == versions
    for host in fleet.hosts:
        status = _environment_status(host)
        assert status["prepared"] is None and status["journal_phase"] is None, status
    assert all(h.staged() == [] for h in fleet.hosts)


def test_a_commit_refused_for_a_change_since_the_prepare_leaves_the_run_to_discard(fleet: Fleet) -> None:
    """The module's phases one by one on host3: a file of the package changed after the prepare, so the
    commit exits 2 (failed, not changed, the unit untouched) and the run stays prepared; a commit naming
    another package is refused before anything runs; the discard drops it (in check mode, says it would)."""
    host3 = fleet["host3"]
    pid = fleet.manager.main_pid(host3.unit)
    common = f"name=sicext python={host3.python} user=true"
    reinstall = "safeinstall.fleet.reinstall"

    prepared = fleet.adhoc(reinstall, f"phase=prepare wheel={host3.wheel} {common}", host=host3)
    assert prepared.results[0]["result"]["status"] == "prepared", prepared.output
    changed = host3.site / "sicext" / "serve.py"
    original = changed.read_bytes()
    changed.write_bytes(original + b"# changed after the prepare\n")
    try:
        commit = fleet.adhoc(reinstall, f"phase=commit settle=1 {common}", host=host3)
    finally:
        changed.write_bytes(original)
    other = fleet.adhoc(reinstall, f"phase=commit name=markupsafe python={host3.python}", host=host3)
    check = fleet.adhoc(reinstall, f"phase=discard {common}", "--check", host=host3)
    discard = fleet.adhoc(reinstall, f"phase=discard {common}", host=host3)

    (refused,) = commit.results
    assert refused["outcome"] == "failed", commit.output
    result = refused["result"]
    assert (result["rc"], result["changed"], result["status"]) == (2, False, "error"), result
    assert result["msg"].startswith("refused, nothing changed: ") and "serve.py" in result["msg"]
    assert fleet.manager.main_pid(host3.unit) == pid and host3.version() == "1.0"
    (guarded,) = other.results
    assert guarded["outcome"] == "failed" and guarded["result"]["cmd"][-2:] == [
        "--json",
        f"--python={host3.python}",
    ]
    assert guarded["result"]["msg"].endswith("is of sicext, not markupsafe"), guarded
    (would,) = check.results
    assert (would["outcome"], would["result"]["changed"], would["result"]["status"]) == (
        "ok",
        True,
        "prepared",
    )
    assert would["result"]["msg"].startswith("would discard the prepared run ")
    (dropped,) = discard.results
    assert (dropped["result"]["changed"], dropped["result"]["status"], dropped["result"]["rc"]) == (
        True,
        "discarded",
        0,
    )
    assert "--discard" in dropped["result"]["cmd"]
    status = _environment_status(host3)
    assert status["prepared"] is None and status["journal_phase"] is None, status
    assert fleet.manager.main_pid(host3.unit) == pid


def test_verify_reports_a_patched_file_on_one_host_only(fleet: Fleet) -> None:
    patched = fleet["host3"].site / "sicext" / "serve.py"
    original = patched.read_bytes()
    patched.write_bytes(original + b"# a local fix\n")
    removed = fleet["host1"].site / "sicext" / "serve.py"  # drift of another kind on another host
    removed_bytes = removed.read_bytes()
    removed.unlink()
    metrics = {}
    try:
        report = fleet.playbook("examples/drift-report.yml")
        strict = fleet.adhoc(
            "safeinstall.fleet.verify", "name=sicext python={{ safeinstall_python }} fail_on_drift=true"
        )
        for host in fleet.hosts:  # the same check, written for Prometheus
            out = fleet.base / "metrics" / f"{host.name}.prom"
            out.parent.mkdir(mode=0o755, exist_ok=True)
            subprocess.run(
                [
                    str(BIN / "safeinstall"),
                    "--verify-only",
                    "--all",
                    "--python",
                    str(host.python),
                    "--metrics-file",
                    str(out),
                ],
                capture_output=True,
                check=False,
            )
            metrics[host.name] = read_metrics(out)
    finally:
        patched.write_bytes(original)
        removed.write_bytes(removed_bytes)

    assert report.code == 0, report.output
    for host in fleet.hosts:
        result = report.of(host.name, "Check the installed files")["result"]
        assert result["changed"] is False and result["result"]["command"] == "verify"
        if host.name == "host3":
            assert result["drifted"] is True and result["status"] == "drift" and result["rc"] == 1
            assert [(f["kind"], f["path"]) for f in result["drift"]] == [("modified", str(patched))]
        elif host.name == "host2":
            assert result["drifted"] is False and result["drift"] == [] and result["status"] == "clean"
        # the module's counts are the ones --metrics-file writes, kind by kind, zeros included
        assert result["counts"] == _metric_counts(metrics[host.name]), host.name
    counted = {h.name: report.of(h.name, "Check the installed")["result"]["counts"] for h in fleet.hosts}
    assert counted["host3"]["sicext"]["drift"]["modified"] == 1
    assert counted["host1"]["sicext"]["drift"]["missing"] == 1
    (table,) = [r["result"]["msg"] for r in report.results if r["task"].startswith("Drift per host")]
    assert table[0].split() == ["HOST", "STATUS", "DRIFT", "sicext"]  # hosts x distributions with drift
    rows = {row.split()[0]: row.split() for row in table[1:]}
    assert rows == {
        "host1": ["host1", "drift", "1", "1"],
        "host2": ["host2", "clean", "0", "0"],
        "host3": ["host3", "drift", "1", "1"],
    }
    files = report.of("host3", "The drifted files")["result"]["msg"]
    assert files == [f"modified {patched}"]
    # fail_on_drift fails the patched host only
    assert strict.code != 0
    assert {r["host"]: r["outcome"] for r in strict.results} == {
        "host1": "failed",
        "host2": "ok",
        "host3": "failed",
    }


def _metric_counts(samples: dict[str, list[ParsedSample]]) -> dict[str, dict[str, Any]]:
    """The per-distribution counts of a --metrics-file, in the verify module's shape."""
    counts: dict[str, dict[str, Any]] = {}
    for named in samples.values():
        for sample in named:
            entry = counts.setdefault(sample.labels.get("distribution", ""), {"drift": {}, "warnings": {}})
            if sample.name == "safeinstall_verify_files_checked":
                entry["files_checked"] = int(sample.value)
            elif sample.name == "safeinstall_verify_drift_findings":
                entry["drift"][sample.labels["kind"]] = int(sample.value)
            elif sample.name == "safeinstall_verify_warning_findings":
                entry["warnings"][sample.labels["kind"]] = int(sample.value)
    counts.pop("", None)  # the check's own metrics, of no distribution
    return counts


def test_the_collection_counts_the_kinds_that_safeinstall_reports() -> None:
    from ansible_collections.safeinstall.fleet.plugins.module_utils import cli as module_cli
    from safeinstall.run.commands.metrics import DRIFT_KINDS, WARNING_KIND_NAMES

    assert (module_cli.DRIFT_KINDS, module_cli.WARNING_KINDS) == (DRIFT_KINDS, WARNING_KIND_NAMES)
    assert module_cli.finding_counts(None) == {}


def test_ansible_doc_documents_each_option_as_the_module_declares_it(tmp_path: Path) -> None:
    """``ansible-doc`` reads DOCUMENTATION/EXAMPLES/RETURN; every documented option is one the module
    takes, with the same type, default and requiredness (what ansible-test's validate-modules checks)."""
    from ansible_collections.safeinstall.fleet.plugins.modules import reinstall, verify

    env = ansible_environ(tmp_path, os.environ)
    names = ["safeinstall.fleet.reinstall", "safeinstall.fleet.verify"]
    proc = subprocess.run(
        [str(BIN / "ansible-doc"), "--json", *names], env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0 and not_ours_dropped(proc.stderr) == "", (
        proc.stderr
    )  # no warning about the docs
    docs = json.loads(proc.stdout)
    for name, module in zip(names, (reinstall, verify), strict=True):
        doc = docs[name]
        assert doc["examples"].strip() and doc["return"]["rc"]["type"] == "int"
        options = doc["doc"]["options"]
        assert set(options) == set(module.ARGUMENT_SPEC)
        for option, spec in module.ARGUMENT_SPEC.items():
            documented = options[option]
            assert documented["type"] == spec["type"], option
            assert documented.get("default") == spec.get("default"), option
            assert documented.get("required", False) == spec.get("required", False), option
    text = subprocess.run(
        [str(BIN / "ansible-doc"), "safeinstall.fleet.reinstall"], env=env, capture_output=True, text=True
    )
    assert text.returncode == 0 and "rolled back" in text.stdout and "keep_patches" in text.stdout


def test_ansible_galaxy_builds_the_collection(tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(BIN / "ansible-galaxy"), "collection", "build", str(COLLECTION), "--output-path", str(tmp_path)],
        env=ansible_environ(tmp_path, os.environ),
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    with tarfile.open(tmp_path / "safeinstall-fleet-0.1.0.tar.gz") as archive:
        members = set(archive.getnames())
        manifest = json.load(archive.extractfile("MANIFEST.json"))  # type: ignore[arg-type]
    assert {
        "plugins/modules/reinstall.py",
        "plugins/modules/verify.py",
        "plugins/module_utils/cli.py",
        "plugins/module_utils/host.py",
        "meta/runtime.yml",
        "README.md",
    } <= members
    assert not any("__pycache__" in m for m in members)
    assert (
        manifest["collection_info"]["namespace"] == "safeinstall"
        and manifest["collection_info"]["name"] == "fleet"
    )


# The command line and the result mapping, as pure functions (module_utils/cli.py): the cases the fleet
# above cannot reach cheaply.


def test_the_reinstall_command_mirrors_the_cli_and_passes_each_value_as_one_argument() -> None:
    from ansible_collections.safeinstall.fleet.plugins.module_utils.cli import (
        executable_argv,
        reinstall_argv,
        reinstall_environ,
    )

    executable = executable_argv("'/opt/safe install/bin/python' -m safeinstall")
    assert executable == ["/opt/safe install/bin/python", "-m", "safeinstall"]
    params: dict[str, Any] = {
        "name": "vllm",
        "requirement": "vLLM==0.16.0",
        "wheel": None,
        "python": "/opt/vllm venv",
        "user": True,
        "with_deps": False,
        "stop_timeout": 30.0,
        "gpu_timeout": None,
        "settle": 2.5,
        "health_url": "http://127.0.0.1:8000/health?a=$HOME",
        "health_timeout": None,
        "kill_strays": False,
        "prune": True,
        "keep_patches": False,
        "keep_backups": 2,
    }
    assert reinstall_argv(executable, params, check_mode=False) == [
        *executable,
        "vLLM==0.16.0",  # the requirement is the positional argument
        "--json",
        "--yes",
        "--python=/opt/vllm venv",
        "--stop-timeout=30",
        "--settle=2.5",
        "--keep-backups=2",
        "--user",
        "--prune",
    ]
    # the health URL (it may hold a token) goes in safeinstall's environment, never on its command line
    assert reinstall_environ(params) == {"SAFEINSTALL_HEALTH_URL": "http://127.0.0.1:8000/health?a=$HOME"}
    assert reinstall_environ({**params, "health_url": None}) == {}
    wheel = {**params, "requirement": None, "wheel": "/w/vllm.whl", "keep_patches": True}
    argv = reinstall_argv(["safeinstall"], wheel, check_mode=True)
    assert argv[:5] == ["safeinstall", "vllm", "--json", "--yes", "--dry-run"]
    assert "--wheel=/w/vllm.whl" in argv and argv[-1] == "--keep-patches"  # only when asked for


@pytest.mark.parametrize(
    ("name", "requirement", "problem"),
    [
        ("vllm", "torch==2.9", "does not name the package 'vllm'"),
        ("vllm", "vllm-extra>=1", "does not name the package 'vllm'"),
        ("vllm", "==0.16", "does not name the package 'vllm'"),
        ("--all", None, "is not a distribution name"),
    ],
)
def test_a_requirement_must_name_the_package(name: str, requirement: str | None, problem: str) -> None:
    from ansible_collections.safeinstall.fleet.plugins.module_utils.cli import CommandError, reinstall_argv

    with pytest.raises(CommandError, match=problem):
        reinstall_argv(["safeinstall"], {"name": name, "requirement": requirement}, check_mode=False)


def test_the_exit_codes_map_to_failed_and_changed() -> None:
    from ansible_collections.safeinstall.fleet.plugins.module_utils.cli import reinstall_outcome

    def envelope(code: int, status: str, data: Any, errors: list[dict[str, str]]) -> dict[str, Any]:
        return {"safeinstall_result_version": 1, "command": "reinstall", "status": status, "exit_code": code,
                "data": data, "errors": errors}  # fmt: skip

    locked = {"code": "locked", "message": "another run holds the lock", "hint": "wait for it"}
    refused = reinstall_outcome(2, envelope(2, "error", None, [locked]), "", check_mode=False)
    assert (refused.failed, refused.changed) == (True, False)
    assert refused.msg == "refused, nothing changed: another run holds the lock (hint: wait for it)"
    commands = ["safeinstall --recover --python /v/bin/python", "systemctl start vllm.service"]
    lost = {"code": "rollback-failed", "message": "restart failed; then putting things back failed too"}
    stuck = reinstall_outcome(
        4, envelope(4, "rollback-failed", {"manual_commands": commands}, [lost]), "", False
    )
    assert stuck.failed and stuck.status == "rollback-failed" and stuck.commands == tuple(commands)
    assert " && ".join(commands) in stuck.msg
    missing = reinstall_outcome(127, None, "safeinstall: not found\n", check_mode=True)
    assert (
        missing.failed
        and missing.msg == "safeinstall exited 127 without a --json result: safeinstall: not found"
    )


def test_each_phase_has_its_command_line_and_refuses_what_another_phase_takes() -> None:
    from ansible_collections.safeinstall.fleet.plugins.module_utils.cli import CommandError, phase_argv

    base: dict[str, Any] = {"name": "vllm", "python": "/opt/v", "user": True}
    prepare = {**base, "phase": "prepare", "wheel": "/w/vllm.whl", "no_smoke": True, "keep_backups": 2}
    assert phase_argv(["si"], prepare, check_mode=False) == [
        "si", "vllm", "--json", "--yes", "--prepare", "--python=/opt/v", "--wheel=/w/vllm.whl",
        "--keep-backups=2", "--user", "--no-smoke",
    ]  # fmt: skip
    dry = phase_argv(["si"], prepare, check_mode=True)
    assert "--dry-run" in dry and "--prepare" not in dry  # a prepare's check: the run's dry-run
    window = {"settle": 1.0, "health_url": "http://h/health", "stop_timeout": 30.0, "prepared_max_age": 60.0}
    commit = {**base, "phase": "commit", **window}
    assert phase_argv(["si"], commit, check_mode=False) == [
        "si",
        "--commit",
        "--json",
        "--yes",
        "--python=/opt/v",
        "--stop-timeout=30",
        "--settle=1",
        "--prepared-max-age=60",
        "--user",
    ]  # fmt: skip  (the health URL goes in the environment, as for a run)
    assert phase_argv(["si"], {**base, "phase": "discard"}, check_mode=False) == [
        "si", "--discard", "--json", "--python=/opt/v",
    ]  # fmt: skip
    refused = [
        ({**prepare, "settle": 1.0}, "phase=prepare does not take settle: they are the window's"),
        ({**prepare, "undo": True}, "phase=prepare does not take undo"),
        ({**commit, "wheel": "/w/x.whl", "no_smoke": True}, "does not take wheel, no_smoke: the prepare"),
        ({**base, "phase": "discard", "requirement": "vllm==1"}, "phase=discard does not take requirement"),
        ({**base, "phase": "discard", "health_url": "http://h"}, "does not take health_url: nothing is"),
        ({**base, "phase": "run", "prepared_max_age": 1.0}, "prepared_max_age goes with phase=commit"),
        ({**base, "phase": "commit", "name": "--all"}, "is not a distribution name"),
    ]
    for params, problem in refused:
        with pytest.raises(CommandError, match=re.escape(problem)):
            phase_argv(["si"], params, check_mode=False)


def test_a_prepare_a_commit_and_a_discard_map_to_changed_and_failed() -> None:
    from ansible_collections.safeinstall.fleet.plugins.module_utils.cli import (
        Prepared,
        phase_outcome,
        prepared_of,
        prepared_problem,
    )

    plan = {"distributions": [{"name": "vllm", "old_version": "1", "new_version": "2"}],
            "units": [{"name": "v.service"}]}  # fmt: skip

    def envelope(code: int, status: str, data: Any, errors: Any = ()) -> dict[str, Any]:
        return {"safeinstall_result_version": 1, "command": "reinstall", "status": status, "exit_code": code,
                "data": data, "errors": list(errors)}  # fmt: skip

    prepared = phase_outcome("prepare", 0, envelope(0, "prepared", {"plan": plan}), "", False)
    assert (prepared.failed, prepared.changed, prepared.status) == (False, True, "prepared")
    assert prepared.msg == "prepared vllm 1 -> 2; nothing stopped; the commit restarts v.service"
    changed = {
        "code": "prepared-changed",
        "message": "the file x changed since the prepare",
        "hint": "discard",
    }
    refused = phase_outcome("commit", 2, envelope(2, "error", None, [changed]), "", False)
    assert (refused.failed, refused.changed) == (True, False)
    assert refused.msg == "refused, nothing changed: the file x changed since the prepare (hint: discard)"
    lost = {"code": "rolled-back", "message": "v.service did not start"}
    rolled = phase_outcome("commit", 3, envelope(3, "rolled-back", {"plan": plan}, [lost]), "", False)
    assert (rolled.failed, rolled.changed, rolled.status) == (True, True, "rolled-back")
    done = phase_outcome("commit", 0, envelope(0, "done", {"plan": plan}), "", False)
    assert (done.failed, done.changed, done.msg) == (
        False,
        True,
        "reinstalled vllm 1 -> 2; restarted v.service",
    )
    discarded = {"discarded": {"run_id": "r1", "changes": ["vllm 1 -> 2"]}}
    dropped = phase_outcome(
        "discard", 0, {**envelope(0, "discarded", discarded), "command": "discard"}, "", False
    )
    assert (dropped.failed, dropped.changed, dropped.msg) == (
        False,
        True,
        "discarded the prepared run r1 (vllm 1 -> 2)",
    )
    several = {"code": "prepared-run", "message": "2 environments have a prepared run"}
    assert phase_outcome("discard", 2, envelope(2, "error", None, [several]), "", False).failed
    status = {"data": {"environments": [
        {"package": "vllm", "prepared": {"run_id": "r1", "changes": ["vllm 1 -> 2"], "units": ["v.service"]}},
        {"package": None, "prepared": None},
    ]}}  # fmt: skip
    (found,) = prepared_of(status)
    assert found == Prepared("r1", "vllm", ("vllm 1 -> 2",), ("v.service",))
    assert prepared_problem("VLLM", [found]) is None and prepared_problem(None, [found]) is None
    assert prepared_problem("torch", [found]) == "the prepared run r1 is of vllm, not torch"
    assert (
        prepared_problem("vllm", [found, found]) == "2 environments have a prepared run: name one with python"
    )


def test_the_reinstall_modules_command_line_is_what_the_cli_parses(monkeypatch: pytest.MonkeyPatch) -> None:
    """The module's argv and environment, parsed by safeinstall's own command line, give the options the
    play asked for: the requirement as the positional argument, every value as given (the health URL
    from the environment, never on the command line)."""
    from typer.main import get_command

    from ansible_collections.safeinstall.fleet.plugins.module_utils.cli import (
        reinstall_argv,
        reinstall_environ,
    )
    from safeinstall.cli.app import app
    from safeinstall.run.commands.modes import run_options

    params: dict[str, Any] = {
        "name": "vllm",
        "requirement": "vllm>=0.16,<1",
        "wheel": None,
        "python": "/opt/vllm venv/bin/python",
        "user": True,
        "with_deps": True,
        "stop_timeout": 30.0,
        "gpu_timeout": 12.5,
        "settle": 2.5,
        "health_url": "http://127.0.0.1:8000/health",
        "health_timeout": 600.0,
        "kill_strays": True,
        "prune": True,
        "keep_patches": True,
        "no_swap": True,
        "no_smoke": True,
        "keep_backups": 2,
    }
    argv = reinstall_argv(["safeinstall"], params, check_mode=False)
    assert not any("health" in arg and "url" in arg for arg in argv)
    for name, value in reinstall_environ(params).items():
        monkeypatch.setenv(name, value)
    context = get_command(app).make_context("safeinstall", argv[1:])
    assert context.params["as_json"] is True and context.params["yes"] is True
    request = context.command.invoke(context).request  # the command line, as the CLI parsed it
    options = run_options(request.options, request.extra_args)
    assert (options.package, options.version_spec, options.wheel) == ("vllm", "<1,>=0.16", None)
    assert (options.python, options.user, options.with_deps) == ("/opt/vllm venv/bin/python", True, True)
    assert (options.stop_timeout, options.gpu_timeout, options.settle) == (30.0, 12.5, 2.5)
    assert (options.health_url, options.health_timeout) == ("http://127.0.0.1:8000/health", 600.0)
    assert (options.kill_strays, options.prune, options.keep_patches, options.keep_backups) == (
        True,
        True,
        True,
        2,
    )
    assert options.no_swap is True and options.no_smoke is True


#: A stand-in for the get-pip.py that ansible-test downloads from its own CI host and runs in each venv
#: it makes (one per sanity test): the pinned pip, downloaded once from the package registry by the
#: test's own pip (as this machine's pip is set up to reach it) into a directory of the test's, then
#: installed from there by uv, offline (pip's own install of itself took 2 to 3 s a venv: a third of
#: the sanity run)
GET_PIP = """\
import os, subprocess, sys
wanted = [a for a in sys.argv[1:] if not a.startswith("-")]
wheels = {wheels!r}
def install():
    return subprocess.call([{uv!r}, "pip", "install", "--quiet", "--offline", "--no-index", "--find-links",
                            wheels, "--python", sys.executable, *wanted])
if not os.path.isdir(wheels) or install() != 0:
    got = subprocess.call([{python!r}, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary",
                           ":all:", "--dest", wheels, *wanted])
    sys.exit(got or install())
"""


@pytest.mark.slow  # about 40 s: each sanity test gets a venv of its own, from the registry
def test_ansible_test_sanity_passes(tmp_path: Path) -> None:
    """Ansible's own checks of a collection (``ansible-test sanity``, the real ansible-core, each test in
    a venv of its own), on a copy of the collection; only the ``author`` format and the GPLv3 header
    of the two modules are ignored (tests/sanity/ignore-*.txt: the collection is MIT-licensed)."""
    spec = importlib.util.find_spec("ansible_test")  # ansible-core's, beside ansible
    assert spec is not None and spec.origin is not None
    source = Path(spec.origin).parent / "_internal" / "python_requirements.py"
    found = re.search(r"pip='([0-9.]+)'", source.read_text())
    assert found, f"the pip version ansible-test bootstraps is no longer in {source}"
    home = tmp_path / "home"
    cache = home / ".ansible" / "test" / "cache"
    cache.mkdir(parents=True)
    (cache / f"get_pip_{found.group(1).replace('.', '_')}.py").write_text(
        GET_PIP.format(python=sys.executable, uv=wheelhouse.UV, wheels=str(tmp_path / "bootstrap"))
    )
    copy = tmp_path / "ansible_collections" / "safeinstall" / "fleet"
    shutil.copytree(COLLECTION, copy, ignore=shutil.ignore_patterns("__pycache__", "output"))
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    proc = subprocess.run(
        [str(BIN / "ansible-test"), "sanity", "--venv", "--python", version, "--color", "no"],
        cwd=copy,
        env={**ansible_environ(tmp_path, os.environ), "HOME": str(home)},
        capture_output=True,
        text=True,
        timeout=1200,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-6000:]
    assert 'Running sanity test "validate-modules"' in output and "ERROR" not in output, output[-6000:]
    ignored = {
        line.split()[1]
        for ignore in (copy / "tests" / "sanity").glob("ignore-*.txt")
        for line in ignore.read_text().splitlines()
    }
    assert ignored == {"validate-modules:invalid-documentation", "validate-modules:missing-gplv3-license"}
