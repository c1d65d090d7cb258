"""What the running version could import, kept in ``old-imports.json`` so that the smoke check asks it
once per version and refuses regressions only. Each answer is kept for the context the running version
was asked in (whom the child ran as, the unit's variables, directory and flags: a digest): one unit's
user never answers for another's check (the attacker review).

Root's file, every field checked when read.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping

from safeinstall.env.distributions import InstalledDistribution
from safeinstall.store.state import EnvironmentState, StateDirError, atomic_write, read_private_file

OLD_IMPORTS_NAME = "old-imports.json"
OLD_IMPORTS_VERSION = 2
#: The file of an earlier safeinstall, whose answers were not kept by context: not used (asked again).
_UNKEYED_VERSION = 1
#: The most bytes the file may hold, distributions kept, and modules kept per distribution.
LIMIT = 8 << 20
KEPT_DISTRIBUTIONS = 64
KEPT_MODULES = 20_000

#: (distribution, version, RECORD digest, context) -> {module: "" (imported) or the error}
Answers = dict[tuple[str, str, str, str], dict[str, str]]


def code_digest(dist: InstalledDistribution) -> str:
    """Pure: a digest of what ``dist``'s RECORD says of its files (path, hash, size), its ``.dist-info``
    and bytecode aside (an installer's own files there, ``INSTALLER``, ``direct_url.json``..., differ
    between two installs of one wheel): the key of the running version's import answers."""
    digest = hashlib.sha256()
    for entry in sorted(dist.record.entries, key=lambda e: e.path):
        if entry.path.split("/", 1)[0].endswith(".dist-info") or "__pycache__/" in entry.path:
            continue
        digest.update(f"{entry.path}\0{entry.hash or ''}\0{entry.size}\n".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()


def failing(answers: Answers, installed: Iterable[InstalledDistribution], names: Iterable[str]) -> list[str]:
    """Pure: the modules the installed versions of ``names`` are known (``answers``, in any context) not to
    import: for the plan's words only (a failure is excused by its own context's answers alone)."""
    wanted = set(names)
    found: set[str] = set()
    for dist in installed:
        if dist.name in wanted and dist.record.entries:
            key = (dist.name, dist.version, code_digest(dist))
            for (name, version, digest, _), modules in answers.items():
                if (name, version, digest) == key:
                    found.update(module for module, error in modules.items() if error)
    return sorted(found)


def from_dict(raw: object) -> Answers:
    """Pure: the answers from the parsed file (ValueError when it is not what this module writes)."""
    if isinstance(raw, dict) and raw.get("old_imports_version") == _UNKEYED_VERSION:
        return {}
    if not isinstance(raw, dict) or raw.get("old_imports_version") != OLD_IMPORTS_VERSION:
        raise ValueError("not an old-imports file of this version")
    entries = raw.get("distributions")
    if not isinstance(entries, dict):
        raise ValueError("no distributions")
    found: Answers = {}
    for text, modules in entries.items():
        parts = text.split(" ") if isinstance(text, str) else []
        if len(parts) != 4 or not all(parts) or not isinstance(modules, dict):
            raise ValueError(f"a damaged entry {str(text)[:80]!r}")
        if not all(isinstance(m, str) and isinstance(e, str) for m, e in modules.items()):
            raise ValueError(f"a damaged entry {text[:80]!r}")
        found[(parts[0], parts[1], parts[2], parts[3])] = dict(modules)
    return found


def to_dict(answers: Answers) -> dict[str, object]:
    """Pure: the file's document (the newest :data:`KEPT_DISTRIBUTIONS` entries, each bounded)."""
    kept = list(answers.items())[-KEPT_DISTRIBUTIONS:]
    return {
        "old_imports_version": OLD_IMPORTS_VERSION,
        "distributions": {" ".join(k): dict(list(v.items())[:KEPT_MODULES]) for k, v in kept},
    }


def merged(current: Answers, learned: Mapping[tuple[str, str, str, str], Mapping[str, str]]) -> Answers:
    """Pure: ``current`` with what a check learned (a learned entry moves to the newest place)."""
    out = {k: dict(v) for k, v in current.items() if k not in learned}
    for key, modules in learned.items():
        out[key] = {**current.get(key, {}), **modules}
    return out


def load(state: EnvironmentState) -> tuple[Answers, str | None]:
    """The kept answers (empty when there are none), and why they were not used (a file others could
    have written, a damaged one: asked again then)."""
    path = state.dir / OLD_IMPORTS_NAME
    try:
        raw = read_private_file(path, LIMIT)
        return from_dict(json.loads(raw)), None
    except FileNotFoundError:
        return {}, None
    except StateDirError as exc:
        why = exc.message
    except (ValueError, RecursionError) as exc:  # json's errors are ValueErrors
        why = f"it is damaged ({str(exc)[:200]})"
    except OSError as exc:
        why = f"it could not be read ({exc.strerror or exc})"
    return {}, f"the running version's import answers ({path}) were not used: {why}"


def save(state: EnvironmentState, answers: Answers) -> str | None:
    """Written atomically, 0600, in the environment's state directory (under the run's lock); a note
    when it could not be (best effort: the next run asks the running version again)."""
    try:
        atomic_write(state.dir / OLD_IMPORTS_NAME, json.dumps(to_dict(answers)).encode())
    except OSError as exc:
        return f"the running version's import answers were not kept ({exc.strerror or exc})"
    return None
