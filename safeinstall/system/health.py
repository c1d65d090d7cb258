"""The health check after the restart: GET ``--health-url`` until it answers 200.

The timeout bounds the whole wait, only the head is read, and a redirect is followed only to the same
scheme, host and port.
"""

from __future__ import annotations

import contextlib
import socket
import ssl
import threading
import time
import urllib.parse
from collections.abc import Callable

from safeinstall.errors import StepFailed
from safeinstall.system.signals import held_while_threads_start

MAX_HEAD_BYTES = 64 * 1024  # status line and headers together
MAX_REDIRECTS = 5
PAUSE_S = 0.1  # between attempts: when it answered 200 (service_downtime_s) is known to within this
CHECK_S = 0.25  # while an attempt waits for its answer: how often the caller's ``check`` runs
REDIRECTS = frozenset({301, 302, 303, 307, 308})
LATE = "no complete answer in the time left"


class _BadAnswer(Exception):
    """An answer that is no HTTP answer, or a larger one than a health check reads."""


def _origin(url: str) -> tuple[str, str | None, int | None]:
    parts = urllib.parse.urlsplit(url)
    return parts.scheme, parts.hostname, parts.port


class _Sockets:
    """The sockets of one attempt; ``shut`` ends whatever read or write the attempt is blocked in."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._open: list[socket.socket] = []
        self._shut = False

    def add(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            if self._shut:
                sock.close()
                raise _BadAnswer("out of time")
            self._open.append(sock)
        return sock

    def shut(self) -> None:
        with self._lock:
            self._shut = True
            for sock in self._open:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)


def _connect(url: str, seconds: float, sockets: _Sockets) -> socket.socket:
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    https = parts.scheme == "https"
    port = parts.port or (443 if https else 80)
    sock = sockets.add(socket.create_connection((host, port), timeout=seconds))
    if not https:
        return sock
    return sockets.add(ssl.create_default_context().wrap_socket(sock, server_hostname=host))


def _head(sock: socket.socket) -> tuple[int, dict[str, str]]:
    """The status code and headers (lower-case names) of the answer on ``sock``."""
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD_BYTES:
            raise _BadAnswer(f"headers larger than {MAX_HEAD_BYTES // 1024} KiB")
        chunk = sock.recv(4096)
        if not chunk:
            raise _BadAnswer("connection closed before the headers ended")
        data += chunk
    status, *lines = data.split(b"\r\n\r\n", 1)[0].decode("latin-1").split("\r\n")
    fields = status.split(" ", 2)
    if len(fields) < 2 or not fields[0].startswith("HTTP/") or not fields[1].isdigit():
        raise _BadAnswer(f"not an HTTP answer: {status[:80]!r}")
    pairs = (line.partition(":") for line in lines)
    return int(fields[1]), {name.strip().lower(): value.strip() for name, _, value in pairs}


def _get(url: str, seconds: float, sockets: _Sockets) -> str | None:
    """GET ``url``, following same-origin redirects: None when it answers 200, else what it answered."""
    origin = _origin(url)
    target = url
    for _ in range(MAX_REDIRECTS + 1):
        parts = urllib.parse.urlsplit(target)
        path = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        host = parts.netloc.rpartition("@")[2]
        with _connect(target, seconds, sockets) as sock:
            request = (
                f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUser-Agent: safeinstall\r\nConnection: close\r\n\r\n"
            )
            sock.sendall(request.encode("latin-1"))
            status, headers = _head(sock)
        if status == 200:
            return None
        if status not in REDIRECTS or "location" not in headers:
            return f"HTTP {status}"
        target = urllib.parse.urljoin(target, headers["location"])
        if _origin(target) != origin:
            return f"HTTP {status} redirect to another host ({target}), refused"
    return f"more than {MAX_REDIRECTS} redirects"


def _attempt(url: str, seconds: float, check: Callable[[], None] | None = None) -> str | None:
    """One GET in a daemon thread joined with ``seconds``; past them its socket is shut down. ``check``
    runs every :data:`CHECK_S` while it waits; what it raises ends the attempt (its socket shut too)."""
    sockets = _Sockets()
    answers: list[str | None] = []

    def work() -> None:
        try:
            answers.append(_get(url, seconds, sockets))
        except (OSError, ValueError, _BadAnswer) as exc:
            answers.append(str(exc) or type(exc).__name__)

    thread = threading.Thread(target=work, name="safeinstall-health", daemon=True)
    with held_while_threads_start():
        thread.start()
    late = True  # also when a signal or ``check`` interrupts the wait: the attempt is ended either way
    try:
        deadline = time.monotonic() + seconds
        while (left := deadline - time.monotonic()) > 0:
            thread.join(min(left, CHECK_S) if check is not None else left)
            if not thread.is_alive():
                break
            if check is not None:
                check()
        late = thread.is_alive()
    finally:
        if late:
            sockets.shut()  # decided before: what the shut attempt answers then does not count
    return LATE if late or not answers else answers[0]


def shown(url: str) -> str:
    """Pure: ``url`` as the run says it (log, progress, result): without its user information, query
    and fragment, where a token may be (``http://u:TOKEN@host/health?key=...`` -> ``http://host/health``)."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    with contextlib.suppress(ValueError):
        if parts.port is not None:
            netloc += f":{parts.port}"
    return urllib.parse.urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def wait_healthy(
    url: str,
    timeout: float,
    on_poll: Callable[[float, str], None] | None = None,
    check: Callable[[], None] | None = None,
) -> float:
    """Return when ``url`` answered 200 (``time.monotonic()``); raise StepFailed past ``timeout``.
    ``on_poll``: called before each attempt; ``check``: what it raises ends the wait at once."""
    started = time.monotonic()
    deadline = started + timeout
    last = "no answer"
    while (left := deadline - time.monotonic()) > 0:
        if check is not None:
            check()
        if on_poll is not None:
            on_poll(time.monotonic() - started, last)
        answer = _attempt(url, left, check)
        if answer is None:
            return time.monotonic()
        if answer != LATE or last == "no answer":  # one cut short by the deadline hides no earlier answer
            last = answer
        time.sleep(max(0.0, min(PAUSE_S, deadline - time.monotonic())))
    raise StepFailed(
        f"{shown(url)} did not answer 200 within {timeout:g} s (last: {last})",
        hint=f"if the service needs longer than {timeout:g} s to come up, raise --health-timeout",
    )
