"""Service downtime: safeinstall against the hand sequence, side by side on the same unit and wheel.

Usage: python bench/downtime.py [--rounds 5] [--blob-mb 64]

Starts a private ``systemd --user`` manager (needs /run/systemd/system, as the tests do), installs the
fixture package ``sicext`` 1.0 in a venv, runs it as a unit, then alternates:

* hand:        systemctl --user stop U; uv pip install --force-reinstall W; systemctl --user start U
* safeinstall: safeinstall sicext --wheel W --user --yes --settle 0 (backup, gate, checks, verify: all on)

The downtime is what systemd says: a sampler asks for the unit's ActiveState about every 10 ms and
sums the time it is not "active". Medians and their ratio are printed.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests import wheelhouse  # noqa: E402  (the bench reuses the test bed's builders)
from tests.bed_systemd import UserManager, start_user_manager, stop_user_manager  # noqa: E402

SAFEINSTALL = str(Path(sys.executable).parent / "safeinstall")


class DowntimeWatch:
    """Samples the unit's ActiveState from systemd about every 10 ms; sums the time it is not active."""

    def __init__(self, manager: UserManager, unit: str) -> None:
        self.manager, self.unit = manager, unit
        self.down = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        last = time.monotonic()
        while not self._stop.is_set():
            state = self.manager.show(self.unit, "ActiveState").get("ActiveState")
            now = time.monotonic()
            if state != "active":
                self.down += now - last
            last = now
            time.sleep(0.005)

    def __enter__(self) -> DowntimeWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def with_blob(wheel: Path, out_dir: Path, megabytes: int) -> Path:
    """The wheel with an extra data file, so that the install itself takes measurable time."""
    with zipfile.ZipFile(wheel) as archive:
        members = {i.filename: archive.read(i) for i in archive.infolist() if not i.is_dir()}
    dist_info = next(n.split("/")[0] for n in members if n.endswith(".dist-info/METADATA"))
    members.pop(f"{dist_info}/RECORD")
    members["sicext/blob.bin"] = os.urandom(megabytes * 1024 * 1024)
    return wheelhouse.write_wheel(out_dir / wheel.name, members, dist_info)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--blob-mb", type=int, default=64)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="si-bench-"))
    built = wheelhouse.build_all(work / "wheels")
    (work / "big").mkdir()
    wheel = with_blob(built["sicext-2"], work / "big", args.blob_mb)
    python = wheelhouse.make_venv(work / "venv")
    wheelhouse.uv_install(python, built["sicext-1"])
    manager = start_user_manager(work / "manager")
    unit = "bench-downtime.service"
    manager.write_unit(unit, f"[Service]\nExecStart={python.parent}/sicext-serve\n")
    manager.start(unit)
    manager.wait_active(unit)
    env = {**manager.env, "SAFEINSTALL_STATE_DIR": str(work / "state")}
    uv = wheelhouse.UV

    def make_hand(wheel: Path) -> str:
        return (
            f"systemctl --user stop {unit} && "
            f"{uv} pip install --quiet --python {python} --force-reinstall --link-mode copy {wheel} && "
            f"systemctl --user start {unit}"
        )

    ours = [
        SAFEINSTALL,
        "sicext",
        "--python",
        str(python),
        "--user",
        "--yes",
        "--settle",
        "0",
    ]
    times: dict[str, list[float]] = {"hand": [], "safeinstall": []}
    fresh = work / "fresh"
    try:
        for round_ in range(args.rounds):
            # Each round installs a wheel file uv has not seen (a new nightly): cold cache for both.
            for who in ("hand", "ours"):
                (fresh / f"{round_}-{who}").mkdir(parents=True)
                shutil.copy(wheel, fresh / f"{round_}-{who}" / wheel.name)
            hand_cmd = make_hand(fresh / f"{round_}-hand" / wheel.name)
            ours_cmd = [*ours, "--wheel", str(fresh / f"{round_}-ours" / wheel.name)]
            with DowntimeWatch(manager, unit) as watch:
                subprocess.run(["sh", "-c", hand_cmd], env=env, check=True)
                manager.wait_active(unit)
            times["hand"].append(watch.down)
            with DowntimeWatch(manager, unit) as watch:
                subprocess.run(
                    ours_cmd, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
                )
                manager.wait_active(unit)
            times["safeinstall"].append(watch.down)
    finally:
        stop_user_manager(manager)
    hand, ours = statistics.median(times["hand"]), statistics.median(times["safeinstall"])
    print(f"sicext 1.0 -> 2.0 with a {args.blob_mb} MiB file, {args.rounds} rounds, unit {unit}")
    print(f"  hand sequence  median downtime {hand:.3f} s  {[round(t, 3) for t in times['hand']]}")
    print(f"  safeinstall    median downtime {ours:.3f} s  {[round(t, 3) for t in times['safeinstall']]}")
    print(f"safeinstall / hand = {ours / hand:.2f}x  (goal <= 1.0x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
