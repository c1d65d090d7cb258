"""The run's uv cache filled from the account's, so that nothing the host has is fetched twice.

Cloned or copied as the owner, never linked: no installed file may share its inode with a cache that
outlives the run. Why: docs/window.md ("The run's cache filled from the owner's").
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from safeinstall.env import owner
from safeinstall.env.environment import Account
from safeinstall.env.uvplan import UvChange
from safeinstall.system import worker
from safeinstall.system.worker import WorkerError

#: How long the copy may take (4 GB of a vLLM nightly's dependencies: about 10 s on a cloud disk)
FILL_TIMEOUT_S = 600.0


@dataclass(frozen=True, slots=True)
class Filled:
    archives: int  # unpacked wheels copied
    bytes: int
    entries: tuple[str, ...]  # "name version"
    problem: str | None = None  # why nothing was copied (the prefetch then fetches everything)
    damaged: tuple[str, ...] = ()  # "name version" whose cached files differ from their RECORD: not taken
    #: the copies the fill wrote and hashed as it wrote them: (path below the run's cache, sha256, size,
    #: inode, mtime in ns)
    digests: tuple[tuple[str, str, int, int, int], ...] = ()
    unread: int = 0  # files copied in the kernel under a digest root's verified-inode store kept
    #: the unpacked wheels copied, as ``archive-vN/ID`` below the cache (what a probe must have linked)
    taken: tuple[str, ...] = ()
    #: ``(archive-vN/ID, print)`` of each taken one, walked before its copy (:func:`owner.archive_print`)
    prints: tuple[tuple[str, str], ...] = ()


def source_cache(environ: Mapping[str, str], account: Account | None) -> Path | None:
    """Pure: the uv cache of the environment's owner (see the module), None when none can be named."""
    if account is not None:
        return Path(account.home) / ".cache" / "uv" if account.home not in ("", "/") else None
    if environ.get("UV_CACHE_DIR"):
        return Path(environ["UV_CACHE_DIR"])
    if environ.get("XDG_CACHE_HOME"):
        return Path(environ["XDG_CACHE_HOME"]) / "uv"
    return Path(environ["HOME"]) / ".cache" / "uv" if environ.get("HOME") else None


def wanted(changes: Sequence[UvChange]) -> list[list[str]]:
    """Pure: ``[name, version]`` of every distribution uv's plan installs from an index (a wheel given
    by its path is not in the cache under its name)."""
    found = {
        (c.name, c.version)
        for c in changes
        if c.action != "uninstall" and c.version is not None and c.source is None
    }
    return [[name, version] for name, version in sorted(found)]


def fill(
    source: Path,
    run_cache: Path,
    changes: Sequence[UvChange],
    account: Account | None,
    known: owner.Known | None = None,
) -> Filled:
    """Copy (clone) what ``changes`` install from ``source`` into ``run_cache``, as ``account`` (root for a
    root-owned environment); best effort: a failure is said, and the prefetch fetches what is missing.
    ``known``: root's kept digests of root-only inodes, never for an account (docs/window.md)."""
    want = wanted(changes)
    if not want or not source.is_dir():
        return Filled(0, 0, ())
    text_source, text_target = str(source), str(run_cache)
    mine = known if account is None else None
    try:
        answer = worker.call(
            None if account is None else account.ids,
            lambda: owner.copy_cached_wheels(text_source, text_target, want, mine),
            timeout=FILL_TIMEOUT_S,
            what=f"copies cached wheels from {source}",
        )
    except WorkerError as exc:
        return Filled(0, 0, (), exc.message)
    if not isinstance(answer, dict):
        return Filled(0, 0, (), "the worker's answer was not understood")
    archives, size, entries = answer.get("archives"), answer.get("bytes"), answer.get("entries")
    damaged = answer.get("damaged", [])
    if (
        not isinstance(archives, int)
        or not isinstance(size, int)
        or not isinstance(entries, list)
        or not isinstance(damaged, list)
    ):
        return Filled(0, 0, (), "the worker's answer was not understood")
    said = tuple(str(e)[:200] for e in damaged[:1000])
    written = answer.get("digests", {})
    digests = tuple(
        (path, said[0], said[1], said[2], said[3])
        for path, said in (written.items() if isinstance(written, dict) else ())
        if isinstance(path, str)
        and _below(path)
        and isinstance(said, list)
        and len(said) == 4
        and isinstance(said[0], str)
        and _DIGEST.fullmatch(said[0])
        and all(isinstance(n, int) and not isinstance(n, bool) for n in said[1:])
    )
    unread = answer.get("unread", 0)
    unread = unread if isinstance(unread, int) and not isinstance(unread, bool) and unread >= 0 else 0
    entries_said = tuple(str(e)[:200] for e in entries[:1000])
    listed = answer.get("taken", [])
    taken = tuple(
        str(t)
        for t in (listed if isinstance(listed, list) else [])[:1000]
        if isinstance(t, str) and _below(t)
    )
    return Filled(
        archives,
        size,
        entries_said,
        damaged=said,
        digests=digests,
        unread=unread,
        taken=taken,
        prints=prints_of(answer.get("prints")),
    )


def prints_of(answer: object) -> tuple[tuple[str, str], ...]:
    """Pure: a worker's ``{archive: print}`` (:func:`owner.archive_print`), what is well formed of it."""
    return tuple(
        (archive, said)
        for archive, said in (answer.items() if isinstance(answer, dict) else ())
        if isinstance(archive, str) and _below(archive) and isinstance(said, str) and _PRINT.fullmatch(said)
    )[:1000]


#: A sha256 digest as a RECORD spells it (urlsafe base64, no padding)
_DIGEST = re.compile(r"[A-Za-z0-9_-]{43}")
_PRINT = re.compile(r"[0-9a-f]{64}")


def _below(path: str) -> bool:
    """Pure: ``path`` names something below a directory (relative, no ``..``, no empty part)."""
    parts = path.split("/")
    return (
        not path.startswith("/") and all(part not in ("", ".", "..") for part in parts) and "\0" not in path
    )
