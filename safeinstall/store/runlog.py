"""The run's log ``<envdir>/logs/<run-id>.log``: what a run did, line by line, appended best effort."""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from safeinstall.system.safefs import open_file

#: A plain progress line (stderr off a terminal, the run's log) at most this often.
PROGRESS_EVERY_S = 5.0


def said_at_change(unit: str, now: float) -> float:
    """Pure: when a plain progress line counts as last said once what it is about changed: a wait's (in
    seconds) or a line without amounts (a rollback begins) is said at once; a size counted up (the
    backup's bytes) a heartbeat later, so that a step shorter than that says only its step line (its
    first line, "0%", was stale by then)."""
    return now if unit == "bytes" else now - PROGRESS_EVERY_S


def append_line(path: Path | None, text: str, now: datetime | None = None) -> None:
    """Append ``[time] text`` to the log; best effort."""
    if path is None:
        return
    stamp = (now or datetime.now(UTC)).astimezone(UTC).isoformat(timespec="seconds")
    with contextlib.suppress(OSError), open(path, "a", encoding="utf-8") as log:
        log.write(f"[{stamp}] {text}\n")


def human_bytes(n: float | None) -> str:
    """Pure: ``223455895`` -> ``213.1 MiB``."""
    if n is None:
        return "-"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(value) < 1024:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def progress_key(what: str) -> str:
    """Pure: what a progress line is about, without its changing part: ``waiting for GPU memory (PID
    7)`` -> ``waiting for GPU memory``. A new key is a change: said at once, not at the next heartbeat."""
    return what.split(" (", 1)[0]


def progress_text(what: str, done: float | None, total: float | None, unit: str = "") -> str:
    """Pure: one plain progress line, e.g. ``backup: 213.1 MiB of 666.9 MiB (32%)``. ``unit`` is ``"bytes"``
    (sizes), ``"s"`` (seconds waited) or ``""`` (a count)."""

    def amount(value: float) -> str:
        if unit == "bytes":
            return human_bytes(value)
        if unit == "s":  # a whole number, or a fraction under 10 s as given (--settle 0.5)
            return f"{value:.0f} s" if value >= 10 or value == int(value) else f"{value:.1f} s"
        return f"{value:.0f}"

    if done is None:
        return what
    text = f"{what}: {amount(done)}"
    if total:
        text += f" of {amount(total)} ({min(100.0, 100.0 * done / total):.0f}%)"
    return text


@dataclass
class LogTail:
    """The complete lines added to a log since the last call (for ``--status --wait``)."""

    path: Path
    offset: int = 0
    partial: bytes = b""

    def new_lines(self) -> list[str]:
        try:
            fd, _info = open_file(self.path, follow=False)
        except OSError:
            return []
        try:
            chunks: list[bytes] = []
            while chunk := os.pread(fd, 65536, self.offset):
                chunks.append(chunk)
                self.offset += len(chunk)
        finally:
            os.close(fd)
        data = self.partial + b"".join(chunks)
        *lines, self.partial = data.split(b"\n")
        return [line.decode("utf-8", "replace") for line in lines]
