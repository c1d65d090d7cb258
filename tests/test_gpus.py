"""safeinstall.system.gpus against the real pynvml and the fake libnvidia-ml.so.1 (tests/bed_nvml.py).

In-process tests share one loaded library (pynvml loads once per process); tests that need another build
or no library run their NVML part in a subprocess.
"""

from __future__ import annotations

import ctypes.util
import json
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pynvml
import pytest

from safeinstall.run.parts.output import jsonable
from safeinstall.system.gpus import (
    FdHolder,
    Gpu,
    GpuProcess,
    GpuSnapshot,
    NvmlSession,
    ReleaseStatus,
    release_status,
    scan_fd_holders,
    snapshot_gpus,
    wait_for_release,
)
from tests.bed_nvml import FakeNvml, FakeNvmlBuild, GiB, MiB, holder_process, kill, snapshot_in_subprocess

pytest_plugins = ("tests.bed_nvml",)  # the fake_nvml / fake_nvml_build fixtures

H100 = "NVIDIA H100 80GB HBM3"
UUID0 = "GPU-00000000-fake-0000-0000-000000000000"
UUID1 = "GPU-11111111-fake-1111-1111-111111111111"
TOTAL = 80 * GiB
RESERVED = 512 * MiB


def poll_until(predicate: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


def pids(snapshot: GpuSnapshot) -> set[int]:
    return {p.pid for p in snapshot.all_processes()}


# ---------------------------------------------------------------------------------------------- snapshot


def test_lists_gpus_with_v2_used_memory(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL, reserved=RESERVED, used=0)
    fake_nvml.add_gpu("NVIDIA A100-SXM4-40GB", UUID1, 40 * GiB, reserved=RESERVED, used=3 * MiB)
    fake_nvml.set_driver_version("550.54.15")

    # GPU 1 is used with no process listed: the fd scan runs, on an empty fake /proc (not this host's)
    snap = snapshot_gpus(proc_root=tmp_path)

    assert snap.available and snap.reason is None and snap.errors == () and snap.warnings == ()
    assert snap.driver_version == "550.54.15"
    assert [(g.index, g.name, g.uuid, g.total_bytes, g.used_bytes, g.memory_api) for g in snap.gpus] == [
        (0, H100, UUID0, TOTAL, 0, "v2"),
        (1, "NVIDIA A100-SXM4-40GB", UUID1, 40 * GiB, 3 * MiB, "v2"),
    ]
    # v1 (what the unversioned call reports) counts the driver's reservation as used: never 0
    pynvml.nvmlInit()
    try:
        v1 = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(0))
        assert v1.used == RESERVED
    finally:
        pynvml.nvmlShutdown()


def test_falls_back_to_v1_memory_when_v2_is_not_supported(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL, reserved=RESERVED, used=MiB)
    fake_nvml.inject_error("nvmlDeviceGetMemoryInfo_v2", pynvml.NVML_ERROR_NOT_SUPPORTED)

    snap = snapshot_gpus()

    (gpu,) = snap.gpus
    assert (gpu.memory_api, gpu.used_bytes) == ("v1", MiB + RESERVED)
    assert snap.errors == ()
    assert any("v1" in w and "reserved" in w for w in snap.warnings), snap.warnings


def test_holder_listed_with_its_memory_then_gone_when_killed(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL, used=MiB)
    fake_nvml.add_gpu(H100, UUID1, TOTAL)
    with holder_process() as proc:
        fake_nvml.hold(proc.pid, gpu_index=1, nbytes=2 * GiB)

        snap = snapshot_gpus()
        assert snap.gpus[1].processes == (GpuProcess(proc.pid, 1, 2 * GiB, in_namespace=True),)
        assert snap.gpus[1].used_bytes == 2 * GiB
        assert snap.gpus[0].processes == () and snap.gpus[0].used_bytes == MiB

        kill(proc)
        after = snapshot_gpus()
        assert pids(after) == set()
        assert after.gpus[1].used_bytes == 0


def test_dead_holder_lingers_then_goes(fake_nvml: FakeNvml) -> None:
    linger = 1.0
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    with holder_process() as proc:
        fake_nvml.hold(proc.pid, nbytes=GiB, linger=linger)
        kill(proc)
        t0 = time.monotonic()
        # the library starts the linger when it first sees the process dead: this snapshot, or later
        first = snapshot_gpus()
        assert pids(first) == {proc.pid} and first.gpus[0].used_bytes == GiB
        assert poll_until(lambda: pids(snapshot_gpus()) == set(), timeout=linger + 10)
        assert time.monotonic() - t0 >= linger * 0.9
        assert snapshot_gpus().gpus[0].used_bytes == 0


def test_not_available_memory_stays_none(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    with holder_process() as proc:
        fake_nvml.hold(proc.pid, nbytes=None)
        (process,) = snapshot_gpus().all_processes()
        assert process.pid == proc.pid and process.used_bytes is None


def test_host_pid_is_flagged_not_dropped(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    host = fake_nvml.host_pid(nbytes=GiB)
    with holder_process() as proc:
        fake_nvml.hold(proc.pid, nbytes=GiB)
        procs = {p.pid: p for p in snapshot_gpus().all_processes()}
    assert procs[host].in_namespace is False and procs[host].used_bytes == GiB
    assert procs[proc.pid].in_namespace is True


def test_reused_pid_does_not_count(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    with holder_process() as proc:
        fake_nvml.hold(proc.pid, nbytes=GiB, start=1)  # "started" at another time: the PID was reused
        snap = snapshot_gpus()
    assert snap.all_processes() == () and snap.gpus[0].used_bytes == 0


def test_fake_follows_the_two_call_protocol(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    with holder_process() as a, holder_process() as b:
        fake_nvml.hold(a.pid, nbytes=GiB)
        fake_nvml.hold(b.pid, nbytes=GiB)
        pynvml.nvmlInit()
        try:
            fn = pynvml._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
            count = ctypes.c_uint(0)
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            assert fn(handle, ctypes.byref(count), None) == pynvml.NVML_ERROR_INSUFFICIENT_SIZE
            assert count.value == 2
        finally:
            pynvml.nvmlShutdown()


def test_snapshot_is_json_able(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    with holder_process() as proc:
        fake_nvml.hold(proc.pid, nbytes=None)
        data = json.loads(json.dumps(jsonable(snapshot_gpus())))
    assert data["gpus"][0]["processes"] == [
        {"pid": proc.pid, "gpu_index": 0, "used_bytes": None, "in_namespace": True}
    ]


def test_session_shuts_nvml_down_on_exit(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    with NvmlSession() as nvml:
        assert nvml.available
        assert nvml.snapshot().available and nvml.snapshot().gpus
    assert not nvml.available
    assert nvml.snapshot().available is False
    with pytest.raises(pynvml.NVMLError_Uninitialized):  # the fake library counted init/shutdown
        pynvml.nvmlDeviceGetCount()


# ---------------------------------------------------------------------------------------------- unavailable


def test_missing_v3_reports_the_process_list_unavailable(
    fake_nvml: FakeNvml, fake_nvml_build: FakeNvmlBuild
) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    with holder_process() as proc:
        fake_nvml.hold(proc.pid, nbytes=GiB)
        snap = snapshot_in_subprocess(fake_nvml.env_with(fake_nvml_build.library_no_v3))
    assert snap["available"] is True and snap["errors"] == []
    (gpu,) = snap["gpus"]
    assert gpu["processes"] == [] and gpu["used_bytes"] == GiB
    assert "library mismatch" in gpu["processes_error"].lower()
    assert "nvmlDeviceGetComputeRunningProcesses_v3" in gpu["processes_error"]
    assert any("library mismatch" in w.lower() for w in snap["warnings"])


def test_pynvml_reports_a_missing_v3_as_library_mismatch(
    fake_nvml: FakeNvml, fake_nvml_build: FakeNvmlBuild
) -> None:
    """What the binding does (not our code): the unversioned call raises NVMLLibraryMismatchError, which
    is not an NVMLError; the _v3 call itself raises NVMLError_FunctionNotFound."""
    script = (
        "import ctypes, os, pynvml\n"
        "ctypes.CDLL(os.environ['SAFEINSTALL_NVML_LIBRARY'], mode=ctypes.RTLD_GLOBAL)\n"
        "pynvml.nvmlInit(); h = pynvml.nvmlDeviceGetHandleByIndex(0)\n"
        "assert not issubclass(pynvml.NVMLLibraryMismatchError, pynvml.NVMLError)\n"
        "try: pynvml.nvmlDeviceGetComputeRunningProcesses(h)\n"
        "except pynvml.NVMLLibraryMismatchError: print('mismatch')\n"
        "try: pynvml.nvmlDeviceGetComputeRunningProcesses_v3(h)\n"
        "except pynvml.NVMLError_FunctionNotFound: print('function-not-found')\n"
    )
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    env = {**fake_nvml.env_with(fake_nvml_build.library_no_v3), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["mismatch", "function-not-found"]


def test_no_library_at_the_configured_path_is_unavailable(tmp_path: Path) -> None:
    missing = tmp_path / "empty" / "libnvidia-ml.so.1"
    snap = snapshot_gpus({"SAFEINSTALL_NVML_LIBRARY": str(missing)})
    assert snap.available is False and snap.gpus == ()
    assert snap.reason is not None and str(missing) in snap.reason
    with NvmlSession({"SAFEINSTALL_NVML_LIBRARY": str(missing)}) as nvml:
        assert not nvml.available and nvml.reason == snap.reason


def test_relative_library_path_is_refused() -> None:
    snap = snapshot_gpus({"SAFEINSTALL_NVML_LIBRARY": "libnvidia-ml.so.1"})
    assert snap.available is False and snap.reason is not None and "absolute" in snap.reason


def test_no_library_anywhere_is_unavailable_in_a_fresh_process(tmp_path: Path) -> None:
    if ctypes.util.find_library("nvidia-ml"):
        pytest.skip("this machine has a real libnvidia-ml")
    snap = snapshot_in_subprocess({"SAFEINSTALL_NVML_LIBRARY": None, "FAKE_NVML_DIR": None})
    assert snap["available"] is False and "not found" in snap["reason"]


def test_no_library_in_a_fresh_process_with_an_empty_dir(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    snap = snapshot_in_subprocess({"SAFEINSTALL_NVML_LIBRARY": str(tmp_path / "empty" / "libnvidia-ml.so.1")})
    assert snap["available"] is False and "cannot load" in snap["reason"]


def test_driver_not_loaded_is_unavailable(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    fake_nvml.set_init_error(pynvml.NVML_ERROR_DRIVER_NOT_LOADED)
    snap = snapshot_gpus()
    assert snap.available is False and snap.reason is not None and "not loaded" in snap.reason.lower()


def test_other_init_error_is_unavailable(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    fake_nvml.set_init_error(pynvml.NVML_ERROR_NO_PERMISSION)
    snap = snapshot_gpus()
    assert snap.available is False and snap.reason is not None and "nvmlInit failed" in snap.reason


def test_fake_without_config_dir_acts_as_no_driver(
    fake_nvml: FakeNvml, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("FAKE_NVML_DIR")
    snap = snapshot_gpus()
    assert snap.available is False and snap.reason is not None and "not loaded" in snap.reason.lower()


# ---------------------------------------------------------------------------------------------- errors


def test_error_in_the_process_query_is_reported(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    fake_nvml.add_gpu(H100, UUID1, TOTAL)
    fake_nvml.inject_error("nvmlDeviceGetComputeRunningProcesses_v3", pynvml.NVML_ERROR_UNKNOWN)
    snap = snapshot_gpus()
    assert snap.available is True
    assert all(g.processes_error and "Unknown Error" in g.processes_error for g in snap.gpus)
    assert len(snap.errors) == 2 and "GPU 0" in snap.errors[0]


def test_error_reading_a_gpu_is_reported_and_the_gpu_left_out(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    fake_nvml.inject_error("nvmlDeviceGetUUID", pynvml.NVML_ERROR_GPU_IS_LOST)
    snap = snapshot_gpus()
    assert snap.available is True and snap.gpus == ()
    assert snap.errors == (f"GPU 0: GPU is lost (NVML error {pynvml.NVML_ERROR_GPU_IS_LOST})",)


def test_error_counting_gpus_is_reported(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    fake_nvml.inject_error("nvmlDeviceGetCount_v2", pynvml.NVML_ERROR_UNKNOWN)
    snap = snapshot_gpus()
    assert snap.available and snap.gpus == () and "nvmlDeviceGetCount" in snap.errors[0]


# ---------------------------------------------------------------------------------------------- fd fallback


def fake_proc(root: Path, links: dict[int, dict[int, str]]) -> Path:
    """root/<pid>/fd/<fd> -> target symlinks (targets need not exist: only readlink matters)."""
    for pid, fds in links.items():
        (root / str(pid) / "fd").mkdir(parents=True)
        for fd, target in fds.items():
            (root / str(pid) / "fd" / str(fd)).symlink_to(target)
    return root


def test_fd_holders_when_nvml_lists_nobody_but_memory_is_used(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    proc = fake_proc(
        tmp_path / "proc",
        {
            4242: {0: "/dev/null", 3: "/dev/nvidia0", 4: "/dev/nvidiactl"},
            4243: {0: "/dev/null", 1: "pipe:[1234]"},
            4244: {5: "/dev/nvidia-uvm"},
        },
    )
    (proc / "self").mkdir()  # not a PID: ignored
    fake_nvml.add_gpu(H100, UUID0, TOTAL, used=GiB)  # used, but no process listed
    snap = snapshot_gpus(proc_root=proc)
    assert snap.fd_holders == (
        FdHolder(4242, ("/dev/nvidia0", "/dev/nvidiactl")),
        FdHolder(4244, ("/dev/nvidia-uvm",)),
    )


def test_no_fd_scan_when_nvml_lists_the_processes(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    proc = fake_proc(tmp_path / "proc", {4242: {3: "/dev/nvidia0"}})
    fake_nvml.add_gpu(H100, UUID0, TOTAL, used=GiB)
    fake_nvml.host_pid(nbytes=GiB)
    snap = snapshot_gpus(proc_root=proc)
    assert snap.fd_holders == () and len(snap.all_processes()) == 1


def test_no_fd_scan_on_an_idle_gpu(fake_nvml: FakeNvml, tmp_path: Path) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL, used=0)
    assert snapshot_gpus(proc_root=fake_proc(tmp_path / "proc", {4242: {3: "/dev/nvidia0"}})).fd_holders == ()


def test_fd_scan_counts_unreadable_fd_tables(tmp_path: Path) -> None:
    root = fake_proc(tmp_path / "proc", {7: {3: "/dev/nvidia1"}})
    (root / "8").mkdir()  # no fd dir: a process that exited during the scan, skipped
    (root / "9").mkdir()
    (root / "9" / "fd").write_text("")  # fd table not listable (stands in for EACCES, as root ignores modes)
    assert scan_fd_holders(root) == ((FdHolder(7, ("/dev/nvidia1",)),), 1)
    assert scan_fd_holders(root, exclude={7}) == ((), 1)
    assert scan_fd_holders(tmp_path / "nowhere") == ((), 0)


# ---------------------------------------------------------------------------------------------- release


def test_released_after_the_holder_dies(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL, used=MiB)
    with holder_process() as proc, NvmlSession() as nvml:
        fake_nvml.hold(proc.pid, nbytes=4 * GiB)
        baseline = nvml.snapshot()
        assert not release_status(baseline, {proc.pid}, nvml.snapshot()).released
        kill(proc)
        polls: list[ReleaseStatus] = []
        status = wait_for_release(nvml, baseline, {proc.pid}, timeout=10, on_poll=polls.append)
    assert status.released and not status.timed_out and status.reason is None and status.holders == ()
    (gpu,) = status.gpus
    assert (gpu.baseline_used_bytes, gpu.held_by_stopped_bytes) == (MiB + 4 * GiB, 4 * GiB)
    assert (gpu.expected_used_bytes, gpu.used_bytes, gpu.memory_released) == (MiB, MiB, True)
    assert polls and polls[-1] == status
    json.dumps(jsonable(status))


def test_not_released_while_lingering_and_times_out_naming_the_holder(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    with holder_process() as proc, NvmlSession() as nvml:
        fake_nvml.hold(proc.pid, nbytes=2 * GiB, linger=60)
        baseline = nvml.snapshot()
        kill(proc)
        polls: list[ReleaseStatus] = []
        status = wait_for_release(
            nvml, baseline, [proc.pid], timeout=0.5, on_poll=polls.append, poll_interval=0.05
        )
    assert not status.released and status.timed_out and not status.skipped
    assert status.holders[0].pid == proc.pid and status.holders[0].gpu_index == 0
    assert status.reason is not None and "timed out" in status.reason and f"PID {proc.pid}" in status.reason
    assert status.gpus[0].memory_released is False
    assert len(polls) >= 2 and status.waited_s >= 0.4


def test_released_when_memory_drops_while_unrelated_holders_stay(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    fake_nvml.add_gpu(H100, UUID1, TOTAL)
    host = fake_nvml.host_pid(gpu_index=1, nbytes=GiB)
    with holder_process() as stopped, holder_process() as other, NvmlSession() as nvml:
        fake_nvml.hold(stopped.pid, gpu_index=0, nbytes=3 * GiB)
        fake_nvml.hold(other.pid, gpu_index=0, nbytes=5 * GiB)
        baseline = nvml.snapshot()
        kill(stopped)
        status = wait_for_release(nvml, baseline, {stopped.pid}, timeout=10)
        assert pids(nvml.snapshot()) == {other.pid, host}
    assert status.released
    assert [(g.expected_used_bytes, g.used_bytes) for g in status.gpus] == [(5 * GiB, 5 * GiB), (GiB, GiB)]


def test_other_processes_growing_do_not_block_the_release(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    with holder_process() as stopped, holder_process() as newcomer, NvmlSession() as nvml:
        fake_nvml.hold(stopped.pid, nbytes=3 * GiB)
        baseline = nvml.snapshot()
        kill(stopped)
        fake_nvml.hold(newcomer.pid, nbytes=10 * GiB)  # started on the GPU meanwhile
        status = wait_for_release(nvml, baseline, {stopped.pid}, timeout=10)
    assert status.released and status.gpus[0].expected_used_bytes == 10 * GiB


def test_not_released_while_memory_stays_used_after_the_process_is_gone(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    with holder_process() as proc, NvmlSession() as nvml:
        fake_nvml.hold(proc.pid, nbytes=2 * GiB)
        baseline = nvml.snapshot()
        kill(proc)
        fake_nvml.set_used(0, 2 * GiB)  # NVML no longer lists it, but the driver has not freed the memory

        polls: list[ReleaseStatus] = []

        def free_on_third_poll(status: ReleaseStatus) -> None:
            polls.append(status)
            if len(polls) == 3:
                fake_nvml.set_used(0, 0)

        status = wait_for_release(nvml, baseline, {proc.pid}, timeout=10, on_poll=free_on_third_poll)
    assert polls[0].holders == () and not polls[0].released
    assert polls[0].reason is not None and "expected" in polls[0].reason
    assert status.released and len(polls) >= 4


def test_not_available_memory_relies_on_the_process_list(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    with holder_process() as proc, NvmlSession() as nvml:
        fake_nvml.hold(proc.pid, nbytes=None)
        baseline = nvml.snapshot()
        fake_nvml.set_used(0, GiB)  # memory stays high: must not matter, it cannot be attributed
        assert not release_status(baseline, {proc.pid}, nvml.snapshot()).released
        kill(proc)
        status = wait_for_release(nvml, baseline, {proc.pid}, timeout=10)
    assert status.released and status.gpus[0].memory_released is None
    assert any("unknown" in note for note in status.notes)


def test_an_nvml_error_during_the_wait_is_not_a_release(fake_nvml: FakeNvml) -> None:
    fake_nvml.add_gpu(H100, UUID0, TOTAL)
    with holder_process() as proc, NvmlSession() as nvml:
        fake_nvml.hold(proc.pid, nbytes=GiB)
        baseline = nvml.snapshot()
        kill(proc)
        fake_nvml.inject_error("nvmlDeviceGetComputeRunningProcesses_v3", pynvml.NVML_ERROR_UNKNOWN)
        failed = wait_for_release(nvml, baseline, {proc.pid}, timeout=0.3)
        assert not failed.released and failed.timed_out and failed.errors
        assert failed.reason is not None and "NVML error" in failed.reason

        polls: list[ReleaseStatus] = []

        def recover(status: ReleaseStatus) -> None:
            polls.append(status)
            fake_nvml.clear_error("nvmlDeviceGetComputeRunningProcesses_v3")

        status = wait_for_release(nvml, baseline, {proc.pid}, timeout=10, on_poll=recover)
    assert not polls[0].released and status.released and len(polls) >= 2


def test_release_is_skipped_without_nvml(tmp_path: Path) -> None:
    env = {"SAFEINSTALL_NVML_LIBRARY": str(tmp_path / "libnvidia-ml.so.1")}
    with NvmlSession(env) as nvml:
        baseline = nvml.snapshot()
        status = wait_for_release(nvml, baseline, {1}, timeout=5)
    assert status.skipped and not status.released
    assert status.reason is not None and status.reason.startswith("skipped: cannot load")


# ---------------------------------------------------------------------------------------------- pure


def snapshot(*gpus: Gpu, fd_holders: tuple[FdHolder, ...] = (), errors: tuple[str, ...] = ()) -> GpuSnapshot:
    return GpuSnapshot(True, None, gpus, fd_holders, (), errors, 0.0)


def gpu(
    used: int,
    *procs: tuple[int, int | None],
    uuid: str = UUID0,
    in_ns: bool = True,
    processes_error: str | None = None,
) -> Gpu:
    return Gpu(
        0,
        H100,
        uuid,
        TOTAL,
        used,
        "v2",
        tuple(GpuProcess(pid, 0, size, in_ns) for pid, size in procs),
        processes_error,
    )


def test_release_of_a_gpu_missing_from_the_current_snapshot_is_an_error() -> None:
    status = release_status(snapshot(gpu(GiB, (10, GiB))), {10}, snapshot())
    assert not status.released and status.errors and "missing" in status.errors[0]


def test_release_when_nvml_went_away_is_an_error() -> None:
    gone = GpuSnapshot(False, "driver unloaded", (), (), (), (), 1.0)
    status = release_status(snapshot(gpu(GiB, (10, GiB))), {10}, gone)
    assert not status.released and not status.skipped and "driver unloaded" in (status.reason or "")


def test_release_without_a_process_list_uses_the_fd_scan() -> None:
    blind = gpu(0, processes_error="process list unavailable: NVML library mismatch")
    held = snapshot(blind, fd_holders=(FdHolder(10, ("/dev/nvidia0",)),))
    status = release_status(snapshot(blind), {10}, held)
    assert not status.released and status.holders[0].source == "fd" and status.holders[0].gpu_index is None
    assert release_status(snapshot(blind), {10}, snapshot(blind)).released


def test_release_notes_host_pids_that_cannot_be_matched() -> None:
    base = snapshot(gpu(GiB, (3_900_001, GiB), in_ns=False))
    status = release_status(base, {10}, base)
    assert status.released and any("outside this PID namespace" in n for n in status.notes)
