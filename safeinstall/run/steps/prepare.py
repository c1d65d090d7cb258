"""``--prepare``, ``--commit`` and ``--discard``: prepare a run ahead, commit it in the window.

``--commit`` runs the preflight again under the lock and refuses (exit 2) when anything the prepare
found has changed. docs/prepare.md.
"""

from __future__ import annotations

import hashlib
import os
import stat
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any

from safeinstall.env import inodes
from safeinstall.env.containment import is_within
from safeinstall.env.drift import FindingKind
from safeinstall.env.environment import Environment
from safeinstall.env.hashing import FileState, Known
from safeinstall.env.renames import STAGED_TREE, STAGING_PREFIX, Staged
from safeinstall.errors import PreparedRunError, SafeInstallError
from safeinstall.run.back.recover import read_checked_journal, recover_one, states_of
from safeinstall.run.parts import staging
from safeinstall.run.parts.detach import COMMIT_REFUSED, NOT_COMMITTED
from safeinstall.run.parts.options import RunOptions
from safeinstall.run.parts.preflight import Prepared, Reuse, locally_modified
from safeinstall.run.parts.results import Reporter
from safeinstall.run.parts.running import Run
from safeinstall.scan.plan import PlannedProcess
from safeinstall.store.backup import load_backup
from safeinstall.store.history import find as find_entry
from safeinstall.store.journal import Journal, Phase, advance, read_journal, write_journal
from safeinstall.store.prepared import Identity, PreparedRecord, read_prepared
from safeinstall.store.rundoc import RunData, RunDocument
from safeinstall.store.state import EnvironmentState
from safeinstall.system.identity import own_process
from safeinstall.system.safefs import owner_alone_writes

#: A prepared run older than this is refused at commit (``--prepared-max-age``, seconds): a day
PREPARED_MAX_AGE_S = 86400.0
#: The options of the window and after: the commit's own (a prepare refuses them, docs/prepare.md)
WINDOW_OPTIONS = ("stop_timeout", "gpu_timeout", "settle", "health_url", "health_timeout")
#: What the record does not keep of a run's options: the commit's own, or its process's
_NOT_KEPT = frozenset(
    {"environ", "proc_root", "run_id", "prepare", "commit", "prepared_max_age", *WINDOW_OPTIONS}
)
#: uv's lock file in the staging tree (writable by all; no part of the swap: swap.walk_staged)
UV_LOCK = f"{STAGED_TREE}/.lock"
PREPARE_AGAIN = "nothing was stopped; safeinstall --discard --python PY, then prepare again"


def options_json(options: RunOptions) -> dict[str, Any]:
    """Pure: the run's options the commit takes from its prepare, as JSON."""
    kept: dict[str, Any] = {}
    for f in fields(RunOptions):
        if f.name in _NOT_KEPT:
            continue
        value = getattr(options, f.name)
        kept[f.name] = (
            str(value) if isinstance(value, Path) else list(value) if isinstance(value, tuple) else value
        )
    return kept


def commit_options(record: PreparedRecord, given: RunOptions) -> RunOptions:
    """Pure: the prepared run's options, with the window's (and the process's) from the commit."""
    values: dict[str, Any] = {}
    for f in fields(RunOptions):
        if f.name in _NOT_KEPT or f.name not in record.options:
            continue
        value = record.options[f.name]
        if f.name in ("wheel", "base_wheel") and value is not None:
            value = Path(str(value))
        elif isinstance(value, list):
            value = tuple(str(v) for v in value)
        values[f.name] = value
    window = {name: getattr(given, name) for name in WINDOW_OPTIONS}
    return RunOptions(
        **values | window,
        run_id=record.run_id,
        commit=True,
        prepared_max_age=given.prepared_max_age,
        environ=given.environ,
        proc_root=given.proc_root,
    )


def identity(path: str) -> Identity:
    """A path's identity, not followed (() when gone): a change of its bytes or entries moves it."""
    try:
        st = os.lstat(path)
    except OSError:
        return ()
    return _identity_of(st)


def _identity_of(st: os.stat_result) -> Identity:
    return (st.st_dev, st.st_ino, st.st_mode, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


@dataclass(frozen=True, slots=True)
class TreeSeen:
    """The staged tree as one walk found it."""

    identities: dict[str, Identity]  # every entry by its identity, the root as ``.``
    #: the entries that are not the caller's alone to write (or could not be seen): where none the swap
    #: takes is, no other account can change its bytes, and an identity unchanged since the prepare
    #: verified it proves them (docs/prepare.md)
    not_alone: frozenset[str]


def tree_seen(root: Path) -> TreeSeen:
    """Every entry below ``root`` (not followed) by its identity, one ``lstat`` each: one walk."""
    uid = os.geteuid()
    found: dict[str, Identity] = {}
    odd: set[str] = set()
    try:
        st = os.lstat(root)
    except OSError:
        return TreeSeen({".": ()}, frozenset({"."}))
    found["."] = _identity_of(st)
    if not owner_alone_writes(st.st_uid, st.st_mode, uid):
        odd.add(".")
    pending = [(str(root), "")]
    while pending:
        top, relative = pending.pop()
        try:
            listing = list(os.scandir(top))
        except OSError:
            odd.add(relative.rstrip("/") or ".")
            continue
        for entry in listing:
            key = f"{relative}{entry.name}"
            try:
                st = entry.stat(follow_symlinks=False)
            except OSError:
                found[key] = ()
                odd.add(key)
                continue
            found[key] = _identity_of(st)
            # a symlink's own mode bits are never used: its owner alone can replace it
            link = stat.S_ISLNK(st.st_mode)
            if not (st.st_uid == uid if link else owner_alone_writes(st.st_uid, st.st_mode, uid)):
                odd.add(key)
            if stat.S_ISDIR(st.st_mode):
                pending.append((entry.path, f"{key}/"))
    return TreeSeen(found, frozenset(odd))


def tree_identities(root: Path) -> dict[str, Identity]:
    """Every entry below ``root`` (not followed) by its identity, ``root`` itself as ``.``."""
    return tree_seen(root).identities


def seen_identity(state: FileState | None, path: str) -> Identity:
    """A file's identity as a check observed it under the lock (a regular file it proved by its
    ``lstat``, or read with its ``fstat`` unmoved throughout), else :func:`identity` again."""
    if (
        state is None
        or not state.is_file
        or not state.mode
        or state.size is None
        or state.error
        or not (state.by_identity or state.hashed_ns)
    ):
        return identity(path)
    return (state.device, state.inode, state.mode, state.size, state.mtime_ns, state.ctime_ns)


def file_identities(locations: Sequence[str]) -> dict[str, Identity]:
    return {location: identity(location) for location in locations}


def wheel_digest(path: Path) -> str:
    """The sha256 of the run's copy of the wheel (root's own, in the state directory)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def new_record(run: Run) -> PreparedRecord:
    """What the commit checks again, taken once the prepare is complete (after its kept links)."""
    plan = run.plan
    root = run.staged.root if run.staged is not None else None
    wheel = run.options.wheel
    # the copy's identity before its hash: a write since moves its change time (root's alone to write)
    wheel_identity = identity(str(wheel)) if wheel is not None else ()
    return PreparedRecord(
        run_id=run.run_id,
        prepared_at=time.time(),
        prefix=str(run.env.prefix),
        package=plan.package,
        changes=changes_of(run.prepared),
        options=options_json(run.options),
        uv_command=plan.uv_command,
        units=tuple(u.name for u in plan.units),
        processes=_processes(plan.processes),
        files=file_identities(sorted(run.prepared.before.observed)),
        staged_root=root.name if root is not None else None,
        staged=tree_identities(root) if root is not None else {},
        staged_files=run.staged.files if run.staged is not None else None,
        wheel=str(wheel) if wheel is not None else None,
        wheel_sha256=wheel_digest(wheel) if wheel is not None else None,
        wheel_identity=wheel_identity,
        backup_dir=str(run.saved().dir),
        uv_plan=run.survey.uv_plan,
        members=dict(run.wheel.members) if run.wheel is not None else {},
        cache_hashed=dict(run.hashed),
        before_hashed=root_hashed(run.prepared.before.observed.values()),
        dirs=file_identities(directories(run.env)),
    )


def directories(env: Environment) -> list[str]:
    """Pure: the environment's site and scripts directories: a distribution added or removed since
    moves one of them (the commit then takes the whole preflight again)."""
    return sorted({str(d) for d in (*env.site_dirs, env.scripts)})


def root_hashed(states: Iterable[FileState]) -> dict[tuple[int, int], inodes.HashedInode]:
    """Pure: the files the prepare read and hashed (sha256) that root owns, by inode: the commit takes
    their digests by identity (an account's files are read again: :mod:`safeinstall.env.inodes`)."""
    return {
        (s.device, s.inode): inodes.HashedInode(
            s.path, s.size, s.mtime_ns, s.ctime_ns, s.uid, s.digest, s.hashed_ns
        )
        for s in states
        if s.is_file
        and owner_alone_writes(s.uid, s.mode, 0)
        and s.digest is not None
        and s.size is not None
        and s.algorithm == inodes.ALGORITHM
        and s.error is None
    }


def _processes(processes: Sequence[PlannedProcess]) -> tuple[tuple[int, int], ...]:
    """Pure: each process by identity (-1: a start time not known)."""
    return tuple((p.process.pid, -1 if p.process.start is None else p.process.start) for p in processes)


def changes_of(prepared: Prepared) -> tuple[str, ...]:
    """Pure: what the run changes, one line a distribution ("sicext 1.0 -> 2.0")."""
    return tuple(
        f"{d.name} {d.old_version or '(none)'} -> {d.new_version or '(removed)'}"
        for d in prepared.plan.distributions
    )


def staging_name(run_id: str) -> str:
    """Pure: the name of the run's staging directory in the prefix (env/renames.py)."""
    return f"{STAGING_PREFIX}{run_id}"


def prepared_ns(record: PreparedRecord) -> int:
    """Pure: when the prepare ended, in ``time.time_ns()``: a file it hashed whose change time is later
    was touched since (read again)."""
    return int(record.prepared_at * 1e9)


def reuse_of(record: PreparedRecord, full: bool) -> Reuse | None:
    """What the commit's preflight may take from the record (None: the whole preflight again): its
    uv plan, wheel members and hashes, when the environment's site and scripts directories are as the
    prepare left them (no distribution added or removed: uv would plan the same). ``--full`` (or a
    record without them) takes nothing."""
    if full or record.uv_plan is None or not record.dirs:
        return None
    if file_identities(list(record.dirs)) != dict(record.dirs):
        return None
    known = inodes.checker(record.before_hashed, prepared_ns(record)) if record.before_hashed else None
    return Reuse(record.uv_plan, record.members, known)


def what_changed(record: PreparedRecord, prepared: Prepared, tree: TreeSeen | None = None) -> list[str]:
    """What the commit's preflight finds otherwise than the prepare left it (empty: nothing); ``tree``:
    the staged tree as the commit's one walk found it."""
    plan = prepared.plan
    said: list[str] = []
    command = tuple(plan.uv_command)
    copy = prepared.options.wheel  # the commit's own copy of the prepare's: the same bytes (checked below)
    if copy is not None and record.wheel is not None:
        command = tuple(part.replace(str(copy), record.wheel) for part in command)
    if command != record.uv_command or changes_of(prepared) != record.changes:
        said.append(f"the plan: now {'; '.join(changes_of(prepared)) or 'nothing to change'}")
    units = tuple(u.name for u in plan.units)
    if units != record.units:
        said.append(f"the units: {', '.join(record.units) or 'none'} then, {', '.join(units) or 'none'} now")
    processes = set(_processes(plan.processes))
    if processes != set(record.processes):
        gone = len(set(record.processes) - processes)
        new = len(processes - set(record.processes))
        said.append(f"the processes using the package: {new} new, {gone} gone")
    if prepared.reused:  # taken from the record as the directories were then: still so, under the lock
        moved_dirs = [path for path, was in record.dirs.items() if identity(path) != was]
        if moved_dirs:
            said.append(f"the environment's directory {moved_dirs[0]} (a distribution added or removed?)")
    now = set(prepared.before.observed)
    if now != set(record.files):
        said.append(f"the package's files: {len(now ^ set(record.files))} listed otherwise")
    observed = prepared.before.observed  # each file's identity as the preflight's check saw it
    moved = [path for path, was in record.files.items() if seen_identity(observed.get(path), path) != was]
    if moved:
        said.append(f"{len(moved)} file(s) of the environment changed (first: {moved[0]})")
    if record.staged_root is not None and record.staged_root != staging_name(record.run_id):
        said.append(f"the record's staging directory {record.staged_root!r} (not the run's own)")
    elif record.staged_root is not None:
        root = Path(record.prefix) / record.staged_root
        found = (tree or tree_seen(root)).identities
        if found != dict(record.staged):
            odd = sorted(set(found) ^ set(record.staged)) or [
                p for p in found if found[p] != record.staged.get(p)
            ]
            said.append(f"the staged tree {root} (first: {odd[0] if odd else root})")
    if record.wheel is not None and not wheel_unchanged(record):
        said.append(f"the run's copy of the wheel {record.wheel}")
    return said


def wheel_unchanged(record: PreparedRecord) -> bool:
    """The run's copy of the wheel is the one the prepare hashed: by its identity where root alone may
    write it (a write since moves its change time, which nobody can set back), else by its sha256."""
    if record.wheel is None:
        return True
    try:
        st = os.lstat(record.wheel)
    except OSError:
        return False
    if (
        record.wheel_identity
        and owner_alone_writes(st.st_uid, st.st_mode, os.geteuid())
        and _identity_of(st) == tuple(record.wheel_identity)
    ):
        return True
    try:
        return wheel_digest(Path(record.wheel)) == record.wheel_sha256
    except OSError:
        return False


def commit_check(record: PreparedRecord, prepared: Prepared) -> TreeSeen | None:
    """Under the commit's lock, before anything: the journal is still this prepared run's, not too
    old, and nothing it depends on changed; the staged tree as its walk found it (None: none). Raises
    PreparedRunError (exit 2, nothing stopped)."""
    journal = read_journal(prepared.state.dir)
    if journal is None or journal.run_id != record.run_id or journal.phase != Phase.PREPARED:
        raise PreparedRunError(
            f"the prepared run {record.run_id} is gone (committed, discarded or recovered meanwhile)",
            hint="safeinstall --status shows the environment; prepare again",
        )
    age = time.time() - record.prepared_at
    if age > prepared.options.prepared_max_age:
        raise PreparedRunError(
            f"the prepared run {record.run_id} is {age:.0f} s old, more than --prepared-max-age "
            f"{prepared.options.prepared_max_age:g} s",
            hint=PREPARE_AGAIN + " (or give a larger --prepared-max-age)",
        )
    own = record.staged_root is not None and record.staged_root == staging_name(record.run_id)
    tree = tree_seen(Path(record.prefix) / record.staged_root) if own and record.staged_root else None
    changed = what_changed(record, prepared, tree)
    if changed:
        raise PreparedRunError(
            f"changed since the prepare of {record.run_id}: {'; '.join(changed)}", hint=PREPARE_AGAIN
        )
    return tree


def resume(
    prepared: Prepared, reporter: Reporter, record: PreparedRecord, tree: TreeSeen | None = None
) -> Run:
    """The prepared run again, as the prepare left it: its journal, backup and staging tree (checked,
    verified and planned again: what the swap renames is what was verified now). ``tree``: the staged
    tree as :func:`commit_check` found it, unchanged since the prepare: where it is root's alone, its
    verification by the prepare stands (its identities prove its bytes), and it is planned again."""
    journal = read_journal(prepared.state.dir)
    if journal is None:  # commit_check read it under the same lock
        raise PreparedRunError("the prepared run's journal is gone", hint=PREPARE_AGAIN)
    # the run's process is the commit's now (--status, --status --wait and --recover look at it)
    journal = advance(journal, Phase.PREPARED, "commit", process=own_process())
    write_journal(prepared.state.dir, journal)
    if record.backup_dir is None or not is_within(
        os.path.normpath(record.backup_dir), str(prepared.state.backups)
    ):
        raise PreparedRunError("the prepared run's record names no backup of its own", hint=PREPARE_AGAIN)
    run = Run(prepared, reporter, record.run_id, journal, notes=list(prepared.notes))
    run.backup = load_backup(Path(record.backup_dir))
    before = prepared.before
    deleted = tuple(f.path for f in before.findings if f.kind == FindingKind.MISSING)
    run.record = replace(run.record, patched=locally_modified(before), deleted=deleted)
    if record.staged_root is not None:
        # the staged files are links of the run's cache as the prepare hashed it: an inode unchanged
        # since is taken by identity, not read again (a changed one is read: :mod:`safeinstall.env.inodes`)
        root = prepared.env.prefix / record.staged_root
        proven = tree if verified_as_prepared(record, tree, prepared.options.full) else None
        # a tree taken as verified reads no hash now: the gate's look before the stop drops the
        # entries changed since (:func:`safeinstall.run.steps.reinstall.gate_step`), one walk of them
        run.hashed = (
            {}
            if prepared.options.full
            else dict(record.cache_hashed)
            if proven is not None
            else inodes.still_hashed(record.cache_hashed)
        )
        try:
            if proven is not None and record.staged_files is not None:
                files, dirs = staged_entries(proven)
                run.staged = staging.plan_staged(
                    prepared.env,
                    root,
                    files,
                    dirs,
                    record.staged_files,
                    prepared.survey.installed,
                    prepared.survey.affected,
                    run.backup,
                )
            else:
                known = inodes.checker(run.hashed, prepared_ns(record)) if run.hashed else None
                run.staged = stage_of(run, root, known)
        except (staging.NotStaged, staging.StagedMismatch, OSError, SafeInstallError) as exc:
            raise PreparedRunError(
                f"the staged tree does not check any more: {exc}", hint=PREPARE_AGAIN
            ) from exc
        how = "taken as the prepare verified it" if proven is not None else "verified again"
        run.log(f"commit: the staged tree unchanged by identity, {how} ({run.staged.files} files)")
    run.log("commit: the prepared run goes on from the gate")
    return run


def stage_of(run: Run, root: Path, known: Known | None) -> Staged:
    """The run's staging tree in ``root`` checked, verified (``known``: the run's cache by identity)
    and planned (:func:`safeinstall.run.parts.staging.stage`: it raises what that raises)."""
    return staging.stage(
        run.env,
        root,
        run.plan.package,
        run.wheel,
        run.survey.uv_plan.changes,
        run.survey.installed,
        run.survey.affected,
        run.saved(),
        known,
    )


def verified_as_prepared(record: PreparedRecord, tree: TreeSeen | None, full: bool) -> bool:
    """Pure: the staged tree stands as the prepare verified it, not read again: every entry root's
    alone but uv's lock file, the same by identity (change times included) as the record. An account's
    tree, ``--full``, or a record without its count: verified again (docs/prepare.md)."""
    return (
        not full
        and tree is not None
        and tree.not_alone <= {UV_LOCK}  # uv's lock file (0666) is no part of the swap
        and record.staged_files is not None
        and tree.identities == dict(record.staged)
    )


def staged_entries(tree: TreeSeen) -> tuple[frozenset[str], frozenset[str]]:
    """Pure: the staging tree's files and directories, relative to it (uv's lock file aside), from
    the walk of the staging directory: what :func:`safeinstall.env.renames.walk_staged` lists."""
    below = f"{STAGED_TREE}/"
    files: set[str] = set()
    dirs: set[str] = set()
    for key, seen in tree.identities.items():
        if not key.startswith(below):
            continue
        relative = key[len(below) :]
        (dirs if seen and stat.S_ISDIR(seen[2]) else files).add(relative)
    files.discard(UV_LOCK[len(below) :])
    return frozenset(files), frozenset(dirs)


def refused_commit(state: EnvironmentState, run_id: str, failed: RunDocument) -> RunDocument:
    """The history entry of a ``--commit`` that raised (``failed``, exit 2) while its run stays prepared
    (its journal still says so): the prepare's entry, said refused, with the error and a note; a run
    no longer prepared keeps ``failed``."""
    try:
        journal = read_journal(state.dir)
    except SafeInstallError:
        return failed
    if journal is None or journal.run_id != run_id or journal.phase != Phase.PREPARED:
        return failed
    note = (
        f"a commit was refused (exit {failed.exit_code}), nothing stopped: the run stays prepared "
        "(safeinstall --commit again, or --discard)"
    )
    try:
        entry = find_entry(state, run_id)
    except SafeInstallError:
        entry = None
    data = entry.result.data if entry is not None and entry.result.status in NOT_COMMITTED else None
    if data is not None:
        present = data.present if "notes" in data.present else (*data.present, "notes")
        data = replace(data, present=present, notes=(*data.notes, note))
    else:
        data = RunData(present=("notes",), notes=(note,))
    return replace(failed, status=COMMIT_REFUSED, data=data)


# -- finding and dropping a prepared run ------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Found:
    state: EnvironmentState
    record: PreparedRecord
    python: str  # the interpreter the journal names


def prepared_runs(
    environ: Mapping[str, str], python: str | None, env: Environment | None = None, summary: bool = False
) -> list[Found]:
    """The prepared runs of every environment (or the one ``python`` names; ``env``: it, inspected
    already); ``summary``: their records' own fields only (any format: a discard)."""
    found: list[Found] = []
    for state, journal in _prepared_journals(environ, python, env):
        record = read_prepared(state, summary=summary)
        if record is None:
            raise PreparedRunError(
                f"the prepared run {journal.run_id} in {journal.prefix} has no record",
                hint=f"safeinstall --discard --python {journal.python} drops it; then prepare again",
            )
        found.append(Found(state, record, journal.python))
    return found


def _prepared_journals(
    environ: Mapping[str, str], python: str | None, env: Environment | None = None
) -> list[tuple[EnvironmentState, Journal]]:
    """Each environment (or the one ``python`` names) whose journal says a run is prepared."""
    journals = ((state, read_checked_journal(state, environ)) for state in states_of(environ, python, env))
    return [
        (state, journal)
        for state, journal in journals
        if journal is not None and journal.phase == Phase.PREPARED
    ]


def the_prepared_run(
    environ: Mapping[str, str], python: str | None, verb: str = "commit", env: Environment | None = None
) -> Found:
    """The one prepared run ``--commit`` or ``--discard`` (``verb``) takes (``env``: the environment
    ``python`` names, inspected already); PreparedRunError for none or several."""
    found = prepared_runs(environ, python, env, summary=verb == "discard")
    if not found:
        where = f" of {python}" if python else ""
        hint = (
            "nothing is prepared there, nothing to drop (safeinstall --status lists each environment's runs)"
            if verb == "discard"
            else "prepare one first: safeinstall REQ [--wheel W] --prepare --python PY"
        )
        raise PreparedRunError(f"no prepared run{where} to {verb}", hint=hint)
    if len(found) > 1:
        raise _several([f.record.prefix for f in found])
    return found[0]


def _several(prefixes: list[str]) -> PreparedRunError:
    """Pure: the refusal of a ``--commit`` or ``--discard`` without ``--python`` that finds several."""
    return PreparedRunError(
        f"{len(prefixes)} environments have a prepared run ({', '.join(prefixes)})",
        hint="name one with --python PY",
    )


@dataclass(frozen=True, slots=True)
class Discarded:
    prefix: str
    run_id: str
    package: str
    changes: tuple[str, ...]
    notes: tuple[str, ...]


def discard(environ: Mapping[str, str], python: str | None) -> Discarded:
    """The prepared run dropped as ``--recover`` drops a run that died before its stop: its staging
    tree, uv cache, kept links, wheel copy, journal and record go; nothing was ever stopped. Its journal
    says which run it is: a record that is missing or damaged goes with it."""
    runs = _prepared_journals(environ, python)
    if len(runs) > 1:
        raise _several([journal.prefix for _, journal in runs])
    if not runs:
        the_prepared_run(environ, python, "discard")  # its error: nothing prepared there
    state, journal = runs[0]
    try:
        record = read_prepared(state, summary=True)
        unread = "" if record is not None else "it had no record"
    except SafeInstallError as exc:
        record, unread = None, f"its record could not be read ({exc.message})"
    recovery = recover_one(state, environ, discarding=True)
    notes = (*recovery.notes, *([f"{unread}: dropped with it"] if unread else []))
    changes = record.changes if record is not None else ()
    return Discarded(journal.prefix, journal.run_id, journal.package, changes, notes)
