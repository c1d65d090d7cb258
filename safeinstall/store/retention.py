"""Which old backups go: an environment keeps only the backups of its newest good runs.

:func:`backups_to_remove` is the pure choice; :func:`prune_backups` deletes. A rolled-back run never
pushes out a good run's backup (docs/reinstall.md, "Backups are bounded").
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from safeinstall.store.backup import MANIFEST_LIMIT, MANIFEST_NAME, TOTAL_NAME, manifest_identity
from safeinstall.store.runlog import human_bytes
from safeinstall.store.state import StateDirError, is_run_id, read_private_file

#: Backups kept per environment unless ``--keep-backups`` says otherwise.
DEFAULT_KEEP = 3
#: the status of a run that put back what it saved: its backup is no way back, and goes
ROLLED_BACK = "rolled-back"
#: the statuses whose backup is no way back and goes at the next pruning: a rolled-back run's, and a
#: discarded prepared run's (nothing was changed: its backup holds the live files, hard links of them)
_SPENT = frozenset({ROLLED_BACK, "discarded"})
#: a good run, a recovered run that kept its verified new version (the history entry's exit 0), and
#: one whose end is not known (the history keeps the newest 20): counted under keep. A prepared run's
#: (``prepared``, ``commit-refused``: its commit's way back), an errored run's, a failed rollback's are
#: neither: never chosen (docs/reinstall.md, "Backups are bounded")
_COUNTED = frozenset({"done", "recovered", ""})


def retention_status(status: str, exit_code: int) -> str:
    """Pure: the status retention reads for a history entry: a ``recovered`` run that put its backup
    back (exit other than 0: the environment is as before it) is spent as a rolled-back one."""
    return ROLLED_BACK if status == "recovered" and exit_code != 0 else status


def backups_to_remove(
    names: Iterable[str],
    keep: int,
    protected: Collection[str],
    statuses: Mapping[str, str] | None = None,
    good_run: bool = True,
) -> tuple[str, ...]:
    """The backups to delete, oldest first, never ``protected``: rolled-back and discarded runs', and after a
    ``good_run`` the good runs' beyond the newest ``keep``. ``statuses``: each run's status (see
    :func:`retention_status`); one whose rollback failed, that errored or that is prepared is kept. Names that
    are not run ids are never chosen."""
    if keep < 1:
        raise ValueError(f"keep must be at least 1, not {keep}")
    known = statuses or {}
    newest_first = sorted((name for name in names if is_run_id(name)), reverse=True)
    counted = [name for name in newest_first if known.get(name, "") in _COUNTED]
    spent = [name for name in newest_first if known.get(name) in _SPENT]
    beyond = counted[keep:] if good_run else []
    return tuple(sorted(name for name in (*beyond, *spent) if name not in protected))


def _remove_tree(path: Path) -> list[str]:
    """``rm -r path``, going on past errors; each error as "path: reason". Only for a backup: root's
    0700 tree, which nobody else can change meanwhile (unlike uv's run directories, which go through
    :func:`safeinstall.system.safefs.remove_at`)."""
    failures: list[str] = []

    def note(_function: object, where: str, error: BaseException) -> None:
        failures.append(f"{where}: {getattr(error, 'strerror', None) or error}")

    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=note)
    else:
        shutil.rmtree(path, onerror=lambda function, where, info: note(function, where, info[1]))
    return failures


@dataclass(frozen=True, slots=True)
class Pruned:
    removed: tuple[Path, ...]
    problems: tuple[str, ...]  # "path: reason" for each backup that could not be deleted


def prune_backups(
    backups: Path,
    keep: int,
    protected: Collection[str],
    statuses: Mapping[str, str] | None = None,
    good_run: bool = True,
) -> Pruned:
    """Delete the old backups under ``backups`` (see :func:`backups_to_remove`); never raises."""
    try:
        names = [entry.name for entry in os.scandir(backups) if entry.is_dir(follow_symlinks=False)]
    except OSError as exc:
        return Pruned((), (f"{backups}: could not list it: {exc.strerror or exc}",))
    removed: list[Path] = []
    problems: list[str] = []
    for name in backups_to_remove(names, keep, protected, statuses, good_run):
        path = backups / name
        failures = _remove_tree(path)
        if failures:
            problems.append(f"{path}: could not delete it all ({failures[0]})")
        else:
            removed.append(path)
    return Pruned(tuple(removed), tuple(problems))


@dataclass(frozen=True, slots=True)
class KeptBackup:
    path: Path
    bytes: int  # what its files take (as its manifest says; its hardlinks too: they keep old inodes)


def kept_backups(backups: Path) -> tuple[KeptBackup, ...]:
    """The environment's backups (run ids, oldest first) and what each holds, read from their
    manifests (one whose manifest cannot be read counts 0); never raises."""
    try:
        names = sorted(entry.name for entry in os.scandir(backups) if entry.is_dir(follow_symlinks=False))
    except OSError:
        return ()
    return tuple(KeptBackup(backups / name, _held(backups / name)) for name in names if is_run_id(name))


def _held(backup: Path) -> int:
    """What a backup's files take: its total (``bytes.json``) where it is of the manifest there now, else
    summed from the manifest; 0 when neither can be read."""
    try:
        identity = manifest_identity(os.lstat(backup / MANIFEST_NAME))
        total = json.loads(read_private_file(backup / TOTAL_NAME, 4096))
        if total["manifest"] == identity and type(total["bytes"]) is int:
            return int(total["bytes"])
    except (OSError, StateDirError, ValueError, TypeError, KeyError):
        pass
    try:
        data = json.loads(read_private_file(backup / MANIFEST_NAME, MANIFEST_LIMIT))
        return sum(int(f.get("size", 0)) for f in data.get("files", ()) if isinstance(f, dict))
    except (OSError, StateDirError, ValueError, TypeError, AttributeError):
        return 0


def kept_note(kept: tuple[KeptBackup, ...], keep: int) -> str | None:
    """Pure: what the plan says of the kept backups (None: there are none)."""
    if not kept:
        return None
    total = sum(k.bytes for k in kept)
    oldest = kept[0]
    return (
        f"the {len(kept)} kept backup(s) of this environment hold {human_bytes(total)} in "
        f"{oldest.path.parent} (--keep-backups {keep}; the oldest, {oldest.path.name}, "
        f"{human_bytes(oldest.bytes)})"
    )


def backups_to_drop(kept: tuple[KeptBackup, ...], short: int) -> tuple[KeptBackup, ...] | None:
    """Pure: the fewest of the ``kept`` backups (oldest first, as listed) whose removal frees ``short``
    bytes; None when even all of them do not (nothing is chosen where nothing is short)."""
    if short <= 0:
        return ()
    chosen: list[KeptBackup] = []
    for backup in kept:
        chosen.append(backup)
        if sum(k.bytes for k in chosen) >= short:
            return tuple(chosen)
    return None


def drop_said(kept: tuple[KeptBackup, ...], short: int, prefix: str) -> str:
    """Pure: what a refusal for room says of the kept backups (``short`` bytes missing): which to drop (the
    oldest first) and the exact command for each, or that dropping them all would not do; "" when there are
    none. The newest is named only where the older ones are not enough (it is ``--undo``'s way back)."""
    if not kept:
        return ""
    total = sum(k.bytes for k in kept)
    held = f"the {len(kept)} kept backup(s) of this environment hold {human_bytes(total)}"
    chosen = backups_to_drop(kept, short)
    if chosen is None:
        return f"{held}: even without them it would not fit"
    if not chosen:
        return held
    names = ", ".join(f"{k.path.name} ({human_bytes(k.bytes)})" for k in chosen)
    commands = " && ".join(f"safeinstall --forget --python {prefix} --run {k.path.name}" for k in chosen)
    newest = " (the newest: --undo's way back)" if chosen[-1] == kept[-1] else ""
    return f"{held}; dropping {names}{newest} makes the room: {commands}"
