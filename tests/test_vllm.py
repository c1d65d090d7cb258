"""Opt-in, on the stack this tool exists for: vLLM installed by uv into a venv (198 distributions,
about 9 GB), never part of the default suite. Set ``SAFEINSTALL_VLLM`` to that venv (made with
``uv venv V && VIRTUAL_ENV=V uv pip install vllm==0.33.0``) and, for the plan, ``SAFEINSTALL_VLLM_WHEEL``
to another version's wheel (``pip download --no-deps vllm==0.32.0``). What it checks is what an operator
reads on a fresh host: the drift that is true, in 30 lines; a plan of two units that fits 36 lines at 120
columns and names every process and unit."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.bed_systemd import Units, UserManager, cgroup_pids, wait_until
from tests.clirun import run

VENV = os.environ.get("SAFEINSTALL_VLLM")
WHEEL = os.environ.get("SAFEINSTALL_VLLM_WHEEL")

pytestmark = pytest.mark.skipif(not VENV, reason="opt-in: set SAFEINSTALL_VLLM to a venv with vllm==0.33.0")

#: the API process imports vllm and starts its engine as a child renamed as vLLM renames it
API = (
    "import multiprocessing as mp, time, setproctitle, vllm\n"
    "def engine():\n"
    "    setproctitle.setproctitle('VLLM::EngineCore')\n"
    "    time.sleep(3600)\n"
    "if __name__ == '__main__':\n"
    "    mp.set_start_method('fork')\n"
    "    mp.Process(target=engine).start()\n"
    "    time.sleep(3600)\n"
)


def screen_lines(text: str, columns: int = 120) -> int:
    """How many lines ``text`` takes on a terminal ``columns`` wide (a longer line wraps)."""
    return sum(max(1, -(-len(line) // columns)) for line in text.splitlines())


def test_verify_all_is_clean_but_for_a_wheel_whose_record_lies() -> None:
    assert VENV is not None
    doc = run("--verify-only", "--all", "--python", VENV, "--json", timeout=600).json
    drift = [f for f in doc["data"]["findings"] if f["drift"]]
    assert {f["distribution"] for f in drift} == {"pynvvideocodec"}, drift
    assert all("RECORD may be wrong" in f["detail"] for f in drift)
    # which of two distributions listing one file holds its copy is the install order's (either way)
    shared = {
        frozenset((f["distribution"], f["shared_with"]))
        for f in doc["data"]["findings"]
        if f["kind"] == "shared"
    }
    assert shared == {
        frozenset(("cuda-python", "cuda-bindings")),
        frozenset(("torch-c-dlpack-ext", "flashinfer-python")),
    }
    human = run("--verify-only", "--all", "--python", VENV, env={**os.environ, "COLUMNS": "120"}, timeout=600)
    print(human.stdout + human.stderr)
    assert human.code == 1
    assert screen_lines(human.stdout + human.stderr) <= 30


@pytest.mark.skipif(not WHEEL, reason="set SAFEINSTALL_VLLM_WHEEL to vllm-0.32.0's wheel")
def test_the_plan_of_two_units_fits_36_lines(units: Units, user_manager: UserManager, tmp_path: Path) -> None:
    assert VENV is not None and WHEEL is not None
    python = f"{VENV}/bin/python"
    script = tmp_path / "api.py"
    script.write_text(API)
    api = units.started("vllm-api", f"{python} {script}")
    sidecar = units.started("metrics", f"{python} -c 'import prometheus_client, time; time.sleep(3600)'")
    group = user_manager.show(api, "ControlGroup")["ControlGroup"]
    wait_until(lambda: len(cgroup_pids(group)) >= 2, 300, "vLLM's engine process", interval=1)
    environ = {
        **user_manager.env,
        "COLUMNS": "120",
        "SAFEINSTALL_NVML_LIBRARY": "/nonexistent/libnvidia-ml.so.1",
        "SAFEINSTALL_STATE_DIR": str(tmp_path / "state"),
    }
    args = ("--user", "vllm", "--wheel", WHEEL, "--python", VENV, "--dry-run")
    result = run(*args, env=environ, timeout=900)
    text = result.stdout + result.stderr
    print(text)
    assert result.code == 0, text
    assert screen_lines(text) <= 36  # issue 42: 45 lines, the helper's row, long warnings and uv's pins
    assert text.count("PID 1 ") + text.count("PID 1,") <= 1  # what cannot be read: said once
    table = result.stdout[result.stdout.index("processes using") : result.stdout.index("GPUs")]
    assert all(len(line) <= 120 for line in table.splitlines()), table
    rows = " ".join(table.split("units that would be stopped")[0].split())
    for pid in (*cgroup_pids(group), user_manager.main_pid(sidecar)):  # a row, or named in its unit's row
        assert f" {pid} " in f" {rows}" or f"PID {pid}:" in rows, pid
    assert api in result.stdout and sidecar in result.stdout
