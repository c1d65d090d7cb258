"""The safe reinstall: the steps of a run, each journalled before it starts, and :func:`run_reinstall`,
which calls them in order.

Any failure after the stop rolls back (:mod:`safeinstall.run.back.rollback`). docs/reinstall.md.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from packaging.utils import canonicalize_name

from safeinstall.env import cachefill, inodes, inodetrust, keep, renames, requirements
from safeinstall.env.bytecode import pyc_name
from safeinstall.env.distributions import InstalledDistribution, reload_distributions
from safeinstall.env.drift import Expectation, FindingKind
from safeinstall.env.environment import Account, Environment, interpreter_in_prefix
from safeinstall.env.hashing import FileState, Known
from safeinstall.env.recorded import kept_record
from safeinstall.env.uvplan import (
    chooses_network,
    prefetch_command,
    secure_uv_lock,
    uv_binary,
    window_command,
)
from safeinstall.env.uvplan import dry_run as uv_dry_run
from safeinstall.env.uvplan import install as uv_install
from safeinstall.env.verify import VerifyReport, verify_environment
from safeinstall.env.vouched import Vouched, vouched_of
from safeinstall.env.wheel import Wheel, install_locations, installed_size
from safeinstall.env.wheelcopy import discard_wheel_copy
from safeinstall.errors import (
    ExitCode,
    PlanError,
    RollbackFailed,
    SafeInstallError,
    StepFailed,
)
from safeinstall.run.back.rollback import rollback_step
from safeinstall.run.parts import prefill as run_prefill
from safeinstall.run.parts import probe as run_probe
from safeinstall.run.parts import requires, staging, undo
from safeinstall.run.parts.options import RunOptions
from safeinstall.run.parts.output import old_code_doc, patch_docs, plan_doc
from safeinstall.run.parts.patches import (
    carry,
    prepare_patches,
    rolled_back,
    save_patch_set,
)
from safeinstall.run.parts.preflight import (
    Prepared,
    dry_run_patches,
    install_overhead,
    locally_modified,
    refusal,
    unconfirmed,
)
from safeinstall.run.parts.preflight import preflight as shared_preflight
from safeinstall.run.parts.results import Reporter, service_downtime_s
from safeinstall.run.parts.running import Run
from safeinstall.run.parts.smokethread import staged_tree, target_tree
from safeinstall.run.parts.survey import scan_again
from safeinstall.run.parts.undo import UndoTarget, left_of
from safeinstall.run.parts.units import StartWatch, reset_start_limits, settle_units, start_units, stop_units
from safeinstall.run.steps import prepare
from safeinstall.run.steps import smoke as run_smoke
from safeinstall.run.steps.smoke import smoke_step
from safeinstall.scan.plan import PlannedProcess, left_on_old_code
from safeinstall.scan.processes import scan_processes
from safeinstall.store.anchors import carry_over, forget_anchors, keep_with_backup
from safeinstall.store.backup import (
    check_restored,
    create_backup,
    free_space,
    prune_into,
    restore_backup,
    stage_backup,
)
from safeinstall.store.baseline import record_run
from safeinstall.store.history import read_history
from safeinstall.store.inodestore import keep as keep_hashes
from safeinstall.store.inodestore import store_checker
from safeinstall.store.journal import (
    JournalUnit,
    Phase,
    clear_journal,
    new_journal,
    start_journal,
    update_unit,
)
from safeinstall.store.prepared import PreparedRecord, write_prepared
from safeinstall.store.records import keep_records, read_records
from safeinstall.store.retention import prune_backups, retention_status
from safeinstall.store.rundoc import RUN_FIELDS, ErrorDoc, RunData, RunDocument, StepDoc
from safeinstall.store.runlog import human_bytes
from safeinstall.store.state import (
    RUN_DIR_REMOVAL_S,
    atomic_write,
    make_run_dir,
    new_run_id,
    remove_run_dir,
    remove_uv_caches,
)
from safeinstall.system import signals
from safeinstall.system.gate import GATE_DROPIN, gate_dropin_text, gate_marker
from safeinstall.system.gpus import GpuSnapshot, NvmlSession, ReleaseStatus, wait_for_release
from safeinstall.system.health import shown as shown_url
from safeinstall.system.health import wait_healthy
from safeinstall.system.identity import (
    ProcessId,
    StatInfo,
    end_processes,
    own_process,
    read_stat,
    same_process,
    uninterruptible,
    wait_exited,
)
from safeinstall.system.signals import held_while_threads_start, interrupts_deferred, interrupts_raise
from safeinstall.system.worker import WorkerError

_T = TypeVar("_T")

# ------------------------------------------------------------------ 1. the journal


def start(prepared: Prepared, reporter: Reporter) -> Run:
    """The run begins: its id, its log, its journal (before anything changes), its systemd."""
    options, env, plan = prepared.options, prepared.env, prepared.survey.plan
    run_id = options.run_id or new_run_id(datetime.now(UTC), os.getpid())
    units = [
        JournalUnit(
            name=u.name,
            user_manager=options.user,
            was_active=u.active_state in ("active", "activating", "reloading"),
            unit_file_state=u.unit_file_state,
        )
        for u in plan.units
    ]
    journal = start_journal(
        prepared.state.dir,
        new_journal(
            run_id,
            own_process(),
            str(interpreter_in_prefix(env)),
            str(env.prefix),
            plan.package,
            str(prepared.wheel.path) if prepared.wheel else None,
            plan.uv_command,
            units,
            versions=next(
                ((d.old_version, d.new_version) for d in plan.distributions if d.requested), (None, None)
            ),
        ),
    )
    run = Run(prepared, reporter, run_id, journal, notes=list(prepared.notes))
    run.log("plan: " + " ".join(plan.uv_command))
    return run


# ------------------------------------------------------------------ 1b. local patches (--keep-patches)


def patches_step(run: Run) -> str:
    """Before anything stops: merge each local patch into the new version's file, or refuse (exit 2)."""
    run.patches = prepare_patches(
        run.survey,
        run.options.base_wheel,
        run.state.keep_patches_dir(run.run_id),  # scratch: removed once read
        run.options.environ,
        run.options.drop_conflicting,
        run.prepared.vouched,
    )
    refused = run.patches.refusal()
    if refused is not None:
        raise refused
    return run.patches.summary()


def save_patches(run: Run) -> None:
    """After a good run: keep the carried set in the state directory (best effort: it is also what
    ``--verify-only --wheel NEW --save-patch`` writes)."""
    if run.patches is None:
        return
    try:
        saved = save_patch_set(run.state, run.run_id, run.patches)
        run.record = replace(run.record, patch_file=str(saved) if saved else None)
    except (OSError, SafeInstallError) as exc:
        run.notes.append(f"the carried patch set was not saved: {exc}")


def save_left(run: Run) -> None:
    """After a good run: what it left, beside its backup, so that ``--undo`` can tell whether the
    environment is still as the run left it (best effort: without it the run cannot be undone)."""
    if run.left is None or run.backup is None:
        return
    try:
        undo.save_left(run.backup.dir, run.left)
    except (OSError, SafeInstallError) as exc:
        run.notes.append(f"what the run left was not recorded (it cannot be undone): {exc}")


# ------------------------------------------------------------------ 2. backup


#: How often the backup's progress is passed on, at most (a bar's refresh; the log's line is rarer): once
#: per file saved, vLLM's 29k files cost 0.2 s of the step in the reporter alone
PROGRESS_TICK_S = 0.1


def backup_step(run: Run) -> str:
    before = run.prepared.before  # hashed at preflight, just before this step: not read again
    patched = locally_modified(before)
    deleted = tuple(f.path for f in before.findings if f.kind == FindingKind.MISSING)
    run.record = replace(run.record, patched=patched, deleted=deleted)
    # each file is listed once, by the result (its patched and deleted files, with where the backup is)

    said = [-PROGRESS_TICK_S]

    def on_progress(done: int, total: int) -> None:  # per file saved: said a few times a second
        now = time.monotonic()
        if done >= total or now - said[0] >= PROGRESS_TICK_S:
            said[0] = now
            run.reporter.progress("backup", done, total, "bytes")

    run.backup = create_backup(
        run.env,
        list(run.survey.affected),
        run.state.backup_dir(run.run_id),
        patched,
        on_progress,
        known=before.observed,
        installed=run.survey.installed,
    )
    note = keep_with_backup(run.state.root, run.env.prefix, run.backup)  # a restore carries them over
    run.notes.extend([note] if note else [])
    run.journal_phase(Phase.BACKED_UP, backup_dir=str(run.backup.dir))
    size = run.backup.manifest.files
    changed = len(patched) - len(deleted)
    return (
        f"{len(size)} files saved in {run.backup.dir}"
        + (f"; {changed} locally patched" if changed else "")
        + (f"; {len(deleted)} deleted locally" if deleted else "")
    )


def prefetch_step(run: Run) -> str:
    """Fill the run's own uv cache with the new artefacts, so that the install in the downtime only
    links (or copies) files from it; where the run may swap (:mod:`safeinstall.run.parts.staging`), install
    them into the staging tree instead, verify them there and plan the renames, all before the stop."""
    account = run.env.account  # uv runs as the environment's owner: the directories are its own
    request = run.survey.request
    prefill = run.prepared.prefill  # the run's cache, made and being filled beside the preflight
    cache = prefill.cache if prefill is not None else make_run_dir(run.state.uv_cache(run.run_id), account)
    why_not = staging.refusal(run.env, request, run.survey.uv_plan.changes, _swap_rulers(run))
    root: Path | None = None
    if why_not is None:
        try:
            root = staging.make_staging(run.env, run.run_id)
        except (staging.NotStaged, OSError) as exc:
            why_not = str(exc)
    scratch = (
        root / renames.STAGED_TREE
        if root is not None
        else make_run_dir(run.state.prefetch_dir(run.run_id), account)
    )
    command = prefetch_command(
        request, uv_binary(), scratch, run.survey.uv_plan.changes, staging=root is not None
    )
    _check_a_probe(run, root)  # the smoke check beside the fill's copy, on a tree that never goes live
    try:
        return _fetch_and_stage(run, root, scratch, cache, command, why_not)
    except BaseException:
        run_smoke.abandon(run)  # a check on the probe, and the probe, go with the step
        run_smoke.end_probe(run)
        raise


def _fetch_and_stage(
    run: Run, root: Path | None, scratch: Path, cache: Path, command: list[str], why_not: str | None
) -> str:
    """The prefetch once its tree is chosen: the fill waited for, uv's install, the check started on the
    new version's tree (unless it runs on the probe, and the probe stands for it), the tree staged."""
    account = run.env.account
    filled = _fill_from_owners_cache(run, cache)
    run.log(f"prefetch (UV_CACHE_DIR={cache}{_as(account)}): " + " ".join(command))
    result = None
    broken: str | None = None
    try:
        result = uv_install(command, run.options.environ, cache_dir=cache, account=account)
        if result.returncode == 0:  # before a --target tree goes: what the new versions require
            broken = _broken_once_fetched(run, root, scratch)
    # a good --target install stays for the smoke step (safeinstall.run.steps.smoke), which removes it
    finally:
        kept = root is None and result is not None and result.returncode == 0 and not run.options.no_smoke
        if root is None and not kept:
            remove_run_dir(scratch)
    run.scratch = scratch if kept else None
    run.log(f"uv exit {result.returncode}:\n{result.output}")
    if result.returncode != 0 or broken is not None:
        if root is not None:
            renames.discard_staging(run.env.prefix, root.name, RUN_DIR_REMOVAL_S, staging.owner_ids(run.env))
        if broken is not None:
            if kept:
                remove_run_dir(scratch)
                run.scratch = None
            raise PlanError(broken, hint=BROKEN_HINT)
        tail = "\n".join(result.output.strip().splitlines()[-6:])
        raise PlanError(
            f"uv could not fetch or unpack the new version (exit {result.returncode}): {tail}",
            hint=prefetch_hint(result.output, run.state.dir, run.env.prefix),
        )
    try:
        if not run.options.no_smoke and not _probe_stands(run, root):  # the check runs beside what follows
            new = staged_tree(run.env, root) if root else target_tree(scratch)
            run_smoke.start(run, new)
        return _prefetched(run, root, cache, filled, why_not)
    except BaseException:
        run_smoke.abandon(run)
        raise


def _check_a_probe(run: Run, root: Path | None) -> None:
    """Where the fill still copies root's cache into the run's: the probe tree made from links of root's
    cache (:mod:`safeinstall.run.parts.probe`) and the smoke check started on it; else nothing."""
    prefill = run.prepared.prefill
    request = run.survey.request
    why_not = run_probe.refusal(
        run.env,
        request.link_mode,
        prefill is not None,
        root is not None,
        run.options.no_smoke,
        request.wheel is not None,
        chooses_network(request),
    )
    if why_not is not None or prefill is None:
        if prefill is not None and not run.options.no_smoke and root is not None:
            run.log(f"prefetch: no probe: {why_not}")
        return
    said: list[str] = []
    probe = run_probe.make(
        run.env,
        run.state,
        run.run_id,
        prefill.source,
        run.survey.request,
        run.survey.uv_plan.changes,
        run.options.environ,
        said,
    )
    for line in said:
        run.log(f"prefetch: {line}")
    if probe is None:
        return
    run.probe = probe
    run_smoke.start(run, staged_tree(run.env, probe.root))
    if run.smoke_check is None:  # not started (said): the check waits for the staging tree
        run_smoke.end_probe(run)
        return
    run.log("smoke: the check runs on the probe tree, beside the fill's copy")


def _probe_stands(run: Run, root: Path | None) -> bool:
    """Whether the check running on the probe stands for the staging tree ``root``
    (:func:`safeinstall.run.parts.probe.verdict_problem`); where it does not, it is ended and the probe
    removed, said in the log: the check then runs on the staging tree."""
    probe = run.probe
    if probe is None:
        return False
    problem: str | None = "the run does not swap" if root is None or run.smoke_check is None else None
    if problem is None and root is not None:
        try:
            problem = run_probe.verdict_problem(
                run.fill,
                probe.linked,
                probe.prints,
                run_probe.records(run.env, probe.root),
                run_probe.records(run.env, root),
            )
        except (OSError, ValueError) as exc:
            problem = f"a RECORD could not be read: {exc}"
    if problem is None:
        run.log("smoke: the check on the probe tree stands for the staging tree (the same RECORDs)")
        return True
    run.log(f"smoke: the check on the probe tree was abandoned ({problem}): it runs on the staging tree")
    run_smoke.abandon(run)
    run_smoke.end_probe(run)
    return False


BROKEN_HINT = f"{requirements.FIXES}; nothing was stopped"


def prefetch_hint(output: str, state_dir: Path, prefix: Path) -> str:
    """Pure: what to do after uv failed before the stop; a full disk named as such, not the network."""
    if "No space left on device" in output or "os error 28" in output:
        return (
            f"nothing was stopped; a disk is full: free room where the run writes (its cache in {state_dir}, "
            f"the staging tree in {prefix}), then run again"
        )
    return "nothing was stopped; check the wheel, the index options or the network"


def _broken_once_fetched(run: Run, root: Path | None, scratch: Path) -> str | None:
    """The new versions' requirements, where the plan could not know them (a version only fetched now):
    the refusal when the change breaks one (a note with --allow-broken-requirements), else None."""
    if not requires.unknown_requires(run.survey.installed, run.survey.uv_plan.changes, run.wheel):
        return None
    sites = staged_tree(run.env, root).sites if root is not None else (scratch,)
    refused, notes = requires.fetched_said(
        run.env,
        run.survey.installed,
        run.survey.uv_plan.changes,
        run.options.allow_broken_requirements,
        sites,
    )
    run.notes.extend(notes)
    for note in notes:
        run.log(f"requirements: {note}")
    return refused


def _prefetched(run: Run, root: Path | None, cache: Path, filled: str, why_not: str | None) -> str:
    """The prefetch once uv has filled the run's cache and the new version's tree: the cache hashed,
    the staging tree verified and planned, the cache written to disk."""
    request = run.survey.request
    detail = f"the run's uv cache holds the new version ({request.link_mode} from it)" + filled
    # what the install links is what is hashed here; only in root's own cache: an account that owns the
    # run's cache could change a hashed file's bytes through a shared writable mapping without moving
    # its times (docs/window.md), so its installed files are read again in the window
    if request.link_mode == "hardlink" and run.env.account is None:
        store = None if run.options.full else run.prepared.inodes  # --full: every file read
        known = inodetrust.root_only_checker(store) if store is not None and store.entries else None
        copies = {os.path.join(cache, f[0]): (f[1], f[2], f[3], f[4]) for f in run.filled}
        run.hashed = inodes.hash_cache(cache, known=known, written=copies or None)
        stored = sum(1 for entry in run.hashed.values() if not entry.hashed_ns)  # taken, not read
        copied = sum(1 for entry in run.hashed.values() if entry.hashed_ns and entry.path in copies)
        unread = f" ({stored} of them kept by the verified-inode store, not read)" if stored else ""
        unread += f" ({copied} of them hashed as the fill copied them, not read again)" if copied else ""
        run.log(f"prefetch: {len(run.hashed)} files of the run's uv cache hashed{unread}")
        detail += f"; {len(run.hashed)} files hashed{unread}"
    if root is not None:
        why_not = _stage(run, root)
    if run.staged is None and window_command(run.plan.uv_command, request) != run.plan.uv_command:
        _resolve_into(run, cache)
    written = inodes.flush(cache)  # on disk now, not in the window
    run.log(f"prefetch: the run's cache written to disk in {written:.1f} s")
    if run.staged is not None:
        plan = run.staged.plan
        run.journal_phase(Phase.STAGED)
        return detail + (
            f"; staged and verified ({run.staged.files} files): the window renames {len(plan.moves)} "
            f"entries in and {len(plan.out)} out"
        )
    run.log(f"prefetch: no swap: {why_not}")
    return detail


def _swap_rulers(run: Run) -> dict[str, bool]:
    """The run's options that rule a swap out (:func:`safeinstall.run.parts.staging.refusal`)."""
    return staging.rulers(run.options, bool(run.prepared.vouched))


def _stage(run: Run, root: Path) -> str | None:
    """The staging tree uv filled: checked, verified and planned (``run.staged``); else removed, and
    why (the install then runs in the window). Raises PlanError when the new version fails its
    verification there: nothing is stopped."""
    known = inodes.checker(run.hashed, time.time_ns()) if run.hashed else None
    try:
        run.staged = prepare.stage_of(run, root, known)
    except (staging.NotStaged, staging.StagedMismatch, OSError, SafeInstallError) as exc:
        run_smoke.abandon(run)  # it reads the tree that goes now (the smoke step checks a --target one)
        renames.discard_staging(run.env.prefix, root.name, RUN_DIR_REMOVAL_S, staging.owner_ids(run.env))
        if isinstance(exc, staging.StagedMismatch):
            raise PlanError(
                f"the new version's files do not match the wheel: {exc}",
                hint="nothing was stopped; check the wheel (or the index) it comes from",
            ) from exc
        # else (a staged RECORD it cannot read, too): uv's install in the window, verified there
        return exc.message if isinstance(exc, SafeInstallError) else str(exc)
    return None


def _resolve_into(run: Run, cache: Path) -> None:
    """The plan's resolution once more, with the run's cache: the prefetch (``--no-deps``) stores the
    new wheels but not their metadata, which the window's offline install resolves with (without it,
    uv offline says the wheel "needs to be downloaded from a registry"). Best effort: the window runs
    the planned command should the offline one fail."""
    started = time.monotonic()
    try:
        uv_dry_run(
            run.survey.request,
            run.options.environ,
            account=run.env.account,
            prefix=run.env.prefix,
            cache_dir=cache,
        )
    except SafeInstallError as exc:
        run.log(f"prefetch: the plan's resolution with the run's cache failed: {exc.message}")
        return
    took = time.monotonic() - started
    run.log(f"prefetch: the plan resolved again with the run's cache in {took:.1f} s")


def _fill_from_owners_cache(run: Run, cache: Path) -> str:
    """Copy into the run's cache what the owner's uv cache already holds of what the plan installs
    (:mod:`safeinstall.env.cachefill`), or take what the fill beside the preflight copied
    (:mod:`safeinstall.run.parts.prefill`); the step's detail about it ("" when nothing was copied)."""
    prefill = run.prepared.prefill
    beside = ""
    if prefill is not None:
        source = prefill.source
        filled, waited, unpacked = run_prefill.take(prefill)
        run.fill = filled
        if unpacked is not None:
            run.log(f"prefetch: {unpacked}")
        beside = f", beside the preflight (the prefetch waited {waited:.1f} s for it)"
    else:
        found, why_not = run_prefill.source_of(run.options.environ, run.env, run.survey.request.link_mode)
        if found is None:
            if why_not:
                run.log(f"prefetch: {why_not}")
            return ""
        source = found
        kept = run_prefill.kept_digests(run.prepared.inodes, run.options.full)
        filled = cachefill.fill(source, cache, run.survey.uv_plan.changes, run.env.account, kept)
    run.filled = filled.digests if run.env.account is None else ()  # root's own copies: hashed as written
    how = "copied"  # cloned where the filesystem can; never linked (an edit in place would edit the cache)
    for damaged in filled.damaged:
        name = damaged.split(" ", 1)[0]
        said = (
            f"uv's cache holds a changed copy of {damaged}: `uv cache clean {name}`; a fresh copy was fetched"
        )
        run.notes.append(said)
        run.log(f"prefetch: {said} (its files differ from its RECORD, in {source})")
    if filled.problem is not None:
        run.log(f"prefetch: nothing {how} from {source}: {filled.problem}")
        return ""
    if not filled.archives:
        return ""
    run.log(f"prefetch: {how} from {source}{beside}: {', '.join(filled.entries)} ({filled.bytes} bytes)")
    if filled.unread:
        run.log(
            f"prefetch: {filled.unread} of the files copied in the kernel, not read: root's verified-inode "
            "store keeps their digests"
        )
    size = f"{filled.bytes / 1e6:.0f} MB"
    return f"; {filled.archives} unpacked wheel(s) {how} from {source}{beside} ({size}, not fetched)"


# ------------------------------------------------------------------ 3. gate


def gate_step(run: Run) -> str:
    """Keep the units from starting on a half-installed package (a crash, a reboot); and keep anyone but
    the environment's owner from holding uv's lock while they are down."""
    lock = secure_uv_lock(run.env.prefix, run.env.account)
    run.log(lock)
    if run.hashed:  # the last look before the stop: an entry changed since its hash is read in the window
        before = len(run.hashed)
        run.hashed = inodes.still_hashed(run.hashed)
        if len(run.hashed) != before:
            run.log(
                f"gate: {before - len(run.hashed)} cache files changed since hashed: read after the install"
            )
    units = [u.name for u in run.journal.units]
    if not units:
        return "no units"
    marker = gate_marker(run.state.dir)
    paths = [str(run.systemd.dropin_path(u, GATE_DROPIN, persistent=True)) for u in units]
    atomic_write(marker, f"{run.run_id}\n".encode())
    run.journal_phase(Phase.GATED, gate=paths)  # journalled before written: recovery removes them
    text = gate_dropin_text(marker, run.run_id)
    for unit in units:
        run.systemd.add_dropin(unit, GATE_DROPIN, text, persistent=True)
    return f"{len(units)} unit(s) gated on {marker}"


def remove_gate(run: Run) -> None:
    gate_marker(run.state.dir).unlink(missing_ok=True)


def remove_dropins(run: Run) -> None:
    for unit in run.journal.units:
        run.systemd.remove_dropin(unit.name, GATE_DROPIN, persistent=True)


# ------------------------------------------------------------------ 4. stop


def stop_step(run: Run) -> str:
    systemd = run.systemd
    units = list(run.plan.units)
    for unit in units:
        run.journal = update_unit(run.journal, unit.name, systemd.user, stopped=True)
    run.journal_phase(Phase.STOPPING)
    reset = reset_start_limits(run, [u.name for u in units])  # before the stop: not in the window

    stuck = _StuckOnGpu.of(run.plan.processes)
    timeouts = {u.name: run.stop_timeout(u.stop_timeout_s) for u in units}
    outcomes = stop_units(systemd, timeouts, run.reporter.progress, stuck)
    run.down_since.update((o.unit, o.down_since) for o in outcomes if o.down_since is not None)
    failed = [o for o in outcomes if not o.stopped]
    if failed:
        first = failed[0]
        timeout = run.stop_timeout(next(u.stop_timeout_s for u in units if u.name == first.unit))
        waited = f" in {timeout:g} s" if first.waited_s >= timeout else ""  # else: said at once, why
        raise StepFailed(f"unit {first.unit} did not stop{waited} ({first.reason})")
    killed = _kill_strays(run)
    leftover = _wait_gone(run.plan.processes, run.stop_timeout(90.0), stuck)
    if leftover:
        raise StepFailed(f"processes {', '.join(map(str, leftover))} still run after their units stopped")
    run.journal_phase(Phase.STOPPED, strays_killed=list(killed))
    detail = f"{len(units)} unit(s) stopped, {len(run.plan.processes)} process(es) gone"
    if reset:
        detail += f"; start limit reset first (systemctl reset-failed): {', '.join(reset)}"
    if killed:
        detail += f"; stray PIDs {', '.join(map(str, killed))} ended (not restarted)"
    return detail


def _kill_strays(run: Run) -> tuple[int, ...]:
    killed = end_processes(p.process for p in run.plan.strays)
    run.record = replace(run.record, strays_killed=killed)
    return killed


#: How long a process that started using the package after the plan may take to go away by itself
#: before the install (a `python -c` check, another safeinstall's probe of the environment)
LATE_GRACE_S = 2.0


def _check_no_late_users(run: Run) -> str:
    """Scan again just before the install: a process that started using the package after the plan
    was made (a cron job, a tmux session) would have its files replaced under it, unless it ends
    within ``LATE_GRACE_S`` (while the services are down: only when there is one)."""
    scan = scan_again(run.survey, run.options)
    every = not run.options.only_loaded  # --only-loaded: certain evidence only, as in the plan
    late = [p for p in scan.affected if not p.is_self and p.state != "Z" and (every or p.certain)]
    if late:  # a short-lived one (a cron job's check, another safeinstall's probe) that is gone is none
        procs = [proc for p in late if (proc := same_process(p.process)) is not None]
        still = {proc.pid for proc in wait_exited(procs, LATE_GRACE_S)}
        late = [p for p in late if p.pid in still]
    if not late:
        return ""
    listed = ", ".join(f"{p.pid} ({' '.join(p.cmdline)[:60] or p.name})" for p in late)
    if not run.options.kill_strays:
        raise StepFailed(
            f"process(es) {listed} started using {run.plan.package} after the plan was made",
            hint="stop them, or pass --kill-strays to end them (they are not restarted)",
        )
    ended = end_processes(p.process for p in late)
    run.record = replace(run.record, strays_killed=(*run.record.strays_killed, *ended))
    return f"; late user(s) {listed} ended (not restarted)"


# ------------------------------------------------------------------ 5. GPU release


def gpu_release_step(run: Run, session: NvmlSession, baseline: GpuSnapshot) -> str:
    if not session.available:
        run.journal_phase(Phase.GPU_RELEASED, note=f"GPU check skipped: {session.reason}")
        return f"skipped: {session.reason}"

    # (no D-state check here: the stop step waited until every planned process was gone, and one
    # stuck in D never is: that wait names it)
    def on_poll(status: ReleaseStatus) -> None:
        holders = ", ".join(f"PID {h.pid}" for h in status.holders) or "memory not yet freed"
        run.reporter.progress(
            f"waiting for GPU memory ({holders})", status.waited_s, run.options.gpu_timeout, "s"
        )

    stopped = frozenset(p.pid for p in run.plan.processes)
    status = wait_for_release(session, baseline, stopped, run.options.gpu_timeout, on_poll)
    if status.skipped:
        run.journal_phase(Phase.GPU_RELEASED, note=f"GPU check skipped: {status.reason}")
        return f"skipped: {status.reason}"
    if not status.released:
        holders = ", ".join(
            f"PID {h.pid} on GPU {h.gpu_index}" + (f" ({h.used_bytes} bytes)" if h.used_bytes else "")
            for h in status.holders
        )
        raise StepFailed(
            f"GPU memory was not released within {run.options.gpu_timeout:g} s"
            + (f": still held by {holders}" if holders else f": {status.reason}")
        )
    run.journal_phase(Phase.GPU_RELEASED)
    return f"released after {status.waited_s:.1f} s"


# ------------------------------------------------------------------ 6. install


def install_step(run: Run) -> str:
    late = _check_no_late_users(run)
    run.journal_phase(Phase.INSTALLING)
    command = window_command(run.plan.uv_command, run.survey.request)
    cache = run.state.uv_cache(run.run_id)
    run.log(f"install (UV_CACHE_DIR={cache}{_as(run.env.account)}): " + " ".join(command))
    result = uv_install(command, run.options.environ, cache_dir=cache, account=run.env.account)
    run.log(f"uv exit {result.returncode}:\n{result.output}")
    if result.returncode > 0 and tuple(command) != run.plan.uv_command:  # offline did not do: the plan's
        command = run.plan.uv_command
        run.log("install again, as planned (not offline): " + " ".join(command))
        result = uv_install(command, run.options.environ, cache_dir=cache, account=run.env.account)
        run.log(f"uv exit {result.returncode}:\n{result.output}")
    run.installed_ns = time.time_ns()  # a file changed after this is read in the verification
    if result.returncode != 0:
        tail = "\n".join(result.output.strip().splitlines()[-6:])
        raise StepFailed(f"uv pip install failed (exit {result.returncode}): {tail}")
    carried = carry(run.env.prefix, run.patches, run.env.account) if run.patches is not None else 0
    run.journal_phase(Phase.INSTALLED)
    return " ".join(command) + late + (f"; {carried} local patch(es) carried" if carried else "")


def swap_step(run: Run) -> str:
    """The staged version renamed into place (:mod:`safeinstall.env.renames`): the window's install when
    the run staged one. Each entry in place must then be the inode verified in the staging tree."""
    staged = run.staged
    if staged is None:
        raise StepFailed("internal error: a swap without a staging tree")
    started = time.monotonic()
    late = _check_no_late_users(run)
    run.journal_phase(Phase.SWAPPING)
    scanned = time.monotonic()
    try:
        renames.execute(staged, run.env.prefix, staging.owner_ids(run.env))
    except (OSError, WorkerError) as exc:
        raise StepFailed(f"the swap failed: {exc}") from exc
    run.installed_ns = time.time_ns()
    renamed = time.monotonic()
    by = "" if run.env.account is None else f" (the worker of uid {run.env.account.uid})"
    run.log(f"swap: scan, journal {scanned - started:.2f} s; renames, fsync{by} {renamed - scanned:.2f} s")
    wrong = renames.moved_as_staged(staged, run.env.prefix)
    if wrong:
        raise StepFailed(f"not the verified files in place after the swap: {', '.join(wrong[:5])}")
    run.journal_phase(Phase.INSTALLED)
    return swapped_detail(len(staged.plan.moves), len(staged.plan.out)) + late


def swapped_detail(moved: int, out: int) -> str:
    """Pure: what the swap step says it did ("1 entry ..., 1 old one out", never "1 old ones")."""
    return (
        f"swapped: {moved} {'entry' if moved == 1 else 'entries'} renamed into place, "
        f"{out} old {'one' if out == 1 else 'ones'} out"
    )


# ------------------------------------------------------------------ 7. verify


def verify_step(run: Run) -> str:
    if run.staged is not None:  # verified in the staging tree; the swap put those very inodes in place
        run.journal_phase(Phase.VERIFIED)
        remove_gate(run)
        return (
            f"{run.staged.files} files verified in the staging tree before the stop; every entry in place "
            "is the inode verified there"
        )
    detail = _check_in_place(run)
    run.journal_phase(Phase.VERIFIED)
    remove_gate(run)
    return detail


def confirm_step(run: Run) -> str:
    """After a swap, once the units run: the installed files verified in place, as a run that installed
    in the window does before the start (what the run leaves is taken from it); a failure rolls back."""
    return _check_in_place(run, "once the units ran again (they had been verified in the staging tree)")


def _check_in_place(run: Run, when: str = "") -> str:
    """Every installed file of the affected distributions against the wheel or its RECORD (StepFailed on
    a mismatch); what the run leaves, vouches for and left over are taken from it."""
    cached = (
        inodes.checker(run.hashed, run.installed_ns) if run.hashed and run.installed_ns is not None else None
    )
    known = cached if run.options.full else store_checker(run.prepared.inodes, cached)
    names = [d.name for d in run.survey.affected]
    installed = reload_distributions(run.env, run.survey.installed, names)  # once: the check and its outcome
    report = _verify_installed(
        run.env,
        run.plan.package,
        run.wheel,
        names,
        installed,
        run.patches.expected() if run.patches is not None else None,
        run.prepared.vouched,
        known,
    )
    failures = [f for f in report.findings if f.kind in staging.INSTALL_FAILURES]
    if failures:
        listed = "; ".join(f"{f.kind.value} {f.path}" for f in failures[:5])
        said = f" {when}" if when else ""
        raise StepFailed(f"the installed files do not match the wheel{said}: {listed}")
    run.in_place = report.observed
    # the RECORDs it installed, not every distribution's: one edited since root found it clean must stay
    # record-changed (docs/verify.md), and hashing 200 RECORDs is no part of the window's checks
    run.records = {os.fspath(d.dist_info): kept_record(d) for d in installed if d.name in names}
    run.left = left_of(report, installed, names)
    run.vouched = _vouched(run, report, installed)
    extras = tuple(f.path for f in report.findings if f.kind == FindingKind.EXTRA)
    pruned = _prune(run, extras) if extras and run.options.prune else ()
    run.record = replace(run.record, extras=extras, pruned=pruned)
    checked = sum(d.files_checked for d in report.distributions)
    proven = sum(1 for state in report.observed.values() if state.by_identity)
    detail = f"{checked} files match" + (
        f" ({proven} of them links of the run's cache, hashed before the stop)" if proven else ""
    )
    if extras and not pruned:
        detail += f"; {len(extras)} leftover file(s) not in the new version (--prune removes them)"
    elif pruned:
        detail += f"; {len(pruned)} leftover file(s) pruned (saved in the backup)"
    return detail


def _vouched(run: Run, report: VerifyReport, installed: Sequence[InstalledDistribution]) -> Vouched | None:
    """The package's files that its wheel's RECORD does not describe and that hold the wheel's own
    bytes (the environment's baseline keeps them: :mod:`safeinstall.store.baseline`); a carried patch is the
    run's merge and a script's first line the installer's, not the wheel's: both are left out."""
    wheel = run.wheel
    dist = next((d for d in installed if wheel is not None and d.name == wheel.name), None)
    if wheel is None or dist is None:
        return None
    carried = run.patches.expected() if run.patches is not None else {}
    scripts = f"{wheel.data_dir}/scripts/"  # their first line is the installer's, not the wheel's
    shipped = {
        location: f"sha256={wheel.members[member].sha256}:{wheel.members[member].size}"
        for member, location in install_locations(wheel, run.env).items()
        if not member.startswith(scripts) and location not in carried
    }
    return vouched_of(dist, report.observed, shipped, run.run_id, wheel.path.name)


def _prune(run: Run, extras: tuple[str, ...]) -> tuple[str, ...]:
    pruned, notes = prune_into(run.saved(), run.env.prefix, extras)
    run.notes.extend(notes)
    return pruned


# ------------------------------------------------------------------ 8. restart


def restart_step(run: Run) -> str:
    units = run.units_to_restart()
    if run.options.no_restart:
        run.journal_phase(Phase.RESTARTING, note="--no-restart: units left stopped")
        return "left stopped (--no-restart): " + (", ".join(units) or "none")
    if not units:
        run.journal_phase(Phase.RESTARTING)
        return "no unit was running"
    run.journal_phase(Phase.RESTARTING)
    run.restart_started = True
    befores = start_units(run.systemd, units)
    watch = StartWatch(run, befores)
    said = ""
    if run.options.health_url:  # polled from the start: the users' downtime ends at its first 200
        url, timeout = run.options.health_url, run.options.health_timeout
        said = shown_url(url)  # never a token the URL may hold

        def on_poll(waited: float, last: str) -> None:
            run.reporter.progress(f"waiting for {said} to answer 200 (last: {last})", waited, timeout, "s")

        try:
            healthy_at = wait_healthy(url, timeout, on_poll, check=watch)
        finally:
            watch.close()
        run.record = replace(run.record, service_downtime_s=service_downtime_s(run.down_since, healthy_at))
    detail = settle_units(run, units, run.options.settle, befores, watch.seen)  # then stays up that long
    for journalled in run.journal.units:
        if journalled.name in units and journalled.stopped and journalled.was_active:
            run.journal = update_unit(run.journal, journalled.name, journalled.user_manager, restarted=True)
    return detail + (f"; {said} answers 200" if said else "")


# ------------------------------------------------------------------ 9. end check


def end_check_step(run: Run) -> str:
    """One more scan: a process anywhere on the host that still maps a replaced file of an affected
    distribution runs old code (it was not in the plan: it could not be read, or started using the
    package in the last instant before the install). Said, or with --strict a failure (rolled back:
    then every process agrees on the old version again)."""
    old_code = left_on_old_code(scan_processes(run.survey.targets, run.options.proc_root))
    run.record = replace(run.record, old_code=tuple(old_code_doc(process) for process in old_code))
    if not old_code:
        return "no process runs replaced files"
    listed = "; ".join(p.describe() for p in old_code)
    run.log(f"end check: {listed}")
    if run.options.strict:
        raise StepFailed(
            f"{listed}: still running old code after the restart (--strict)",
            hint="restart or end those processes, then run again",
        )
    return f"warning: {listed}: restart them to run the new version"


def _wait_gone(
    processes: tuple[PlannedProcess, ...], timeout: float, check: Callable[[], None] | None = None
) -> list[int]:
    """The PIDs of ``processes`` still running after ``timeout`` s; ``check`` at each poll may raise."""
    procs = [p for p in (same_process(planned.process) for planned in processes) if p is not None]
    deadline = time.monotonic() + timeout
    while True:
        procs = wait_exited(procs, max(0.0, min(GONE_POLL_S, deadline - time.monotonic())))
        if not procs or time.monotonic() >= deadline:
            return [p.pid for p in procs]
        if check is not None:
            check()


GONE_POLL_S = 0.2

#: How long a stopped process that holds GPU memory may stay in uninterruptible sleep (``D``) before
#: the run says it needs a reboot: one that frees its GPU memory as it exits passes through ``D`` for a
#: moment; one stuck in the driver (vllm#25127) never leaves it, and no timeout would help.
STUCK_AFTER_S = 3.0


def stuck_on_gpu(stat: StatInfo, gpu_bytes: int | None, d_since: float, now: float) -> str | None:
    """Pure: what to say of a stopped process (its ``/proc/PID/stat``, parsed; the GPU memory it holds;
    since when it has been seen in ``D`` without a break) that cannot exit: None while it may yet."""
    if not uninterruptible(stat) or not gpu_bytes or now - d_since < STUCK_AFTER_S:
        return None
    return (
        f"PID {stat.pid} ({stat.name}) stays in uninterruptible sleep (D state, {now - d_since:.0f} s) "
        f"holding {human_bytes(gpu_bytes)} of GPU memory: it cannot exit until the kernel call it is in "
        "returns (in a GPU driver, e.g. nvidia_uvm, often never): the host needs a reboot to free the GPU"
    )


@dataclass
class _StuckOnGpu:
    """At each poll of a wait for stopped processes: ends it (StepFailed) at once when one that holds
    GPU memory stays in ``D`` (:func:`stuck_on_gpu`), instead of waiting out a timeout."""

    holders: dict[ProcessId, int]  # the GPU bytes the plan saw each hold
    since: dict[ProcessId, float] = field(default_factory=dict)

    @classmethod
    def of(cls, processes: Sequence[PlannedProcess]) -> _StuckOnGpu:
        return cls({p.process: p.gpu_bytes for p in processes if p.gpu_bytes})

    def __call__(self) -> None:
        now = time.monotonic()
        for process, held in self.holders.items():
            stat = read_stat(process)
            if stat is None or not uninterruptible(stat):
                self.since.pop(process, None)
                continue
            said = stuck_on_gpu(stat, held, self.since.setdefault(process, now), now)
            if said is not None:
                raise StepFailed(
                    said,
                    hint=f"reboot the host; before, `cat /proc/{process.pid}/stack` (as root) and the kernel "
                    "log (`journalctl -k`) show where it hangs",
                )


def _verify_installed(
    env: Environment,
    package: str,
    wheel: Wheel | None,
    affected: list[str],
    installed: Sequence[InstalledDistribution],
    carried: dict[str, Expectation] | None = None,
    vouched: Mapping[str, tuple[Vouched, ...]] | None = None,
    known: Known | None = None,
) -> VerifyReport:
    """The new installation: the package against the wheel (or RECORD), the others against their RECORD,
    ``carried`` patches against the merge. ``installed``: the distributions read again; ``vouched``: the
    baseline; ``known``: inodes hashed before the stop, not read again.
    """
    baseline = None if not vouched else lambda: vouched
    main = verify_environment(
        env, [package], wheel, installed=installed, expected=carried, vouched=baseline, known=known
    )
    present = {d.name for d in installed}
    others = [n for n in affected if n != package and n in present]
    if not others:
        return main
    rest = verify_environment(env, others, installed=installed, vouched=baseline, known=known)
    return replace(
        main,
        distributions=(*main.distributions, *rest.distributions),
        observed={**main.observed, **rest.observed},
    )


# ------------------------------------------------------------------ the two steps of an undo run


def _undo_target(run: Run) -> UndoTarget:
    target = run.prepared.undo
    if target is None:
        raise StepFailed("internal error: an undo step in a run that undoes nothing")
    return target


def undo_restore_step(run: Run, late_users: Callable[[], str]) -> str:
    """The swap: the undone run's backup put back into the environment, byte for byte (the put-back
    of a rollback: what is installed now under those names removed by the owner's worker, then every
    saved file written back and hashed again)."""
    target = _undo_target(run)
    late = late_users()
    run.journal_phase(Phase.INSTALLING)
    run.log(f"restore the backup of run {target.run_id}: {target.backup.dir}")
    result = restore_backup(target.backup, run.env, ())
    if not result.ok:
        problems = [*result.mismatches, *result.failures]
        raise StepFailed(f"the backup of run {target.run_id} could not be put back: {undo.listed(problems)}")
    run.journal_phase(Phase.INSTALLED)
    return f"{result.restored} file(s) of run {target.run_id}'s backup put back" + late


def undo_swap_refusal(run: Run) -> str | None:
    """Pure but for the run: why an undo restores its backup in the window rather than swapping it in
    (None: it swaps). A backup that holds local patches or files no RECORD lists (but bytecode, which
    the import writes again) is put back as saved, in the window."""
    manifest = _undo_target(run).backup.manifest
    if run.options.no_swap:
        return "--no-swap is given"
    if not run.env.is_venv:
        return "the environment is not a virtual environment"
    if run.prepared.vouched:  # verified against the baseline, not the RECORDs: as saved, in the window
        return "the environment has a baseline of files whose RECORD is wrong"
    if manifest.patched:
        return (
            f"the backup holds {len(manifest.patched)} locally patched file(s) (e.g. {manifest.patched[0]})"
        )
    unlisted = [f.path for f in manifest.files if not f.listed and pyc_name(f.path) is None]
    if unlisted:
        return f"the backup holds {len(unlisted)} file(s) no RECORD lists (e.g. {unlisted[0]})"
    return None


def undo_stage_step(run: Run) -> str:
    """``--undo``, before the stop: the undone run's backup copied into a staging tree and staged as a
    forward run's (the window renames it in); where it cannot, why (the restore runs in the window).
    Raises PlanError when the backup's files do not match it (docs/undo.md)."""
    target = _undo_target(run)
    why_not = undo_swap_refusal(run)
    if why_not is not None:
        run.log(f"undo: no swap: {why_not}")
        return f"no swap ({why_not}): the backup is put back during the stop"
    ids = staging.owner_ids(run.env)
    try:
        root = staging.make_staging(run.env, run.run_id)
        renames.make_staging_dir(root, renames.STAGED_TREE, 0o755, ids)
    except (staging.NotStaged, OSError, WorkerError) as exc:
        run.log(f"undo: no swap: {exc}")
        return f"no swap ({exc}): the backup is put back during the stop"
    manifest = target.backup.manifest
    listed = replace(manifest, files=tuple(f for f in manifest.files if f.listed))
    written = stage_backup(replace(target.backup, manifest=listed), root / renames.STAGED_TREE)
    if not written.ok:
        renames.discard_staging(run.env.prefix, root.name, RUN_DIR_REMOVAL_S, ids)
        differ = (
            [f"{undo.listed(written.mismatches)} (not the bytes the backup saved: changed since it was made)"]
            if written.mismatches
            else []
        )
        raise PlanError(
            f"the backup of run {target.run_id} could not be staged: "
            + "; ".join([*differ, *written.failures[: undo.LISTED]]),
            hint="nothing was stopped; a backup whose files changed since its run (a file linked with uv's "
            "cache or another venv changes with it) is not undone to; safeinstall --verify-only shows the "
            "environment",
        )
    why_not = _stage(run, root)
    if run.staged is None:
        return f"no swap ({why_not}): the backup is put back during the stop"
    run.journal_phase(Phase.STAGED)
    return (
        f"{written.restored} file(s) of run {target.run_id}'s backup staged and verified: the window "
        f"renames {len(run.staged.plan.moves)} entries in and {len(run.staged.plan.out)} out"
    )


def undo_confirm_step(run: Run) -> str:
    """After an undo's swap, once the units run: the environment against the backup's manifest, as an
    undo that restored in the window checks it before the start (a failure rolls back)."""
    return _undo_checked(run) + " (swapped in; verified in the staging tree before the stop)"


def undo_verify_step(run: Run, open_gate: Callable[[], None]) -> str:
    """The environment against the backup's manifest: each distribution at its saved version, each
    saved file (a local patch included) with its saved content, and the RECORDs' other files intact."""
    detail = _undo_checked(run)
    run.journal_phase(Phase.VERIFIED)
    open_gate()
    return detail


def _undo_checked(run: Run) -> str:
    """:func:`undo_verify_step`'s check (StepFailed on a difference); what the run leaves is taken."""
    target = _undo_target(run)
    manifest = target.backup.manifest
    names = [d.name for d in manifest.distributions]
    installed = reload_distributions(run.env, run.survey.installed, names)
    versions = {d.name: d.version for d in installed}
    wrong = [
        f"{d.name} is {versions.get(d.name, 'not installed')}, not {d.version}"
        for d in manifest.distributions
        if versions.get(d.name) != d.version
    ]
    vouched = run.prepared.vouched  # an older version whose wheel's RECORD is wrong: verified as before
    report = verify_environment(run.env, names, installed=installed, vouched=lambda: vouched)
    patched = set(manifest.patched)
    failing = {
        FindingKind.MISSING,
        FindingKind.MODIFIED,
        FindingKind.UNREADABLE,
        FindingKind.MALFORMED,
        FindingKind.WHEEL_FAULT,
    }
    wrong += [
        f"{f.kind.value} {f.path}" for f in report.findings if f.kind in failing and f.path not in patched
    ]
    wrong += [f"differs from the backup: {path}" for path in check_restored(target.backup, run.env.prefix)]
    if wrong:
        raise StepFailed(
            f"the restored files do not match the backup of run {target.run_id}: {undo.listed(wrong)}"
        )
    run.left = left_of(report, installed, names)
    note = carry_over(run.state.root, run.env.prefix, target.backup)  # the restored RECORDs' windows
    run.notes.extend([note] if note else [])
    return (
        f"{sum(d.files_checked for d in report.distributions)} files match the backup of run {target.run_id}"
    )


def run_reinstall(
    options: RunOptions,
    reporter: Reporter,
    interactive: bool,
    env: Environment | None = None,
    cannot_ask: str | None = None,
) -> RunDocument:
    """The whole run, as its document; ``cannot_ask``: why a run without ``--yes`` cannot ask (then one
    that stops units is refused). Raises SafeInstallError only before anything changed (exit 2).
    Signals at each point: docs/crash-safety.md.
    """
    began = time.monotonic()  # the preflight step: from here to the run's start (docs/json.md)
    record = read_prepared_run(options, env) if options.commit else None
    reuse = prepare.reuse_of(record, options.full) if record is not None else None
    given_id = options.run_id  # a declined run's document says only an id the caller gave
    if options.run_id is None:  # known before the preflight: the run's cache is filled beside it
        options = replace(options, run_id=new_run_id(datetime.now(UTC), os.getpid()))
    # not for a run that will be refused for want of a yes (it would wait for the fill to say so)
    fill = record is None and options.undo is None and (interactive or cannot_ask is None or options.prepare)
    prepared = shared_preflight(options, take_lock=True, env=env, reuse=reuse, fill=fill)
    tidying: list[bool] = []
    cache_removed: list[bool] = []

    def held_back(signum: int) -> None:
        if tidying:
            reporter.note(
                f"{signal.Signals(signum).name} received while the run tidies up: finishing it first"
            )

    deferral = contextlib.ExitStack()  # from the journal to the end, signals are held back unless raised
    try:
        tree = None  # --commit: the staged tree as its one walk found it
        if record is not None:  # --commit: under the lock, before anything, nothing it relies on changed
            tree = prepare.commit_check(record, prepared)
        refused = refusal(prepared.plan)
        if refused is not None:
            raise refused
        if not interactive and cannot_ask is not None and not options.prepare:  # a prepare stops nothing
            unasked = unconfirmed(prepared.plan, cannot_ask, commit=record is not None)
            if unasked is not None:
                raise unasked
        merged = None  # --keep-patches: the merge made before the question, which says whether it holds
        if interactive and options.keep_patches:
            plan, patches = dry_run_patches(prepared)
            refused = refusal(plan)
            if refused is not None:
                raise refused
            merged = None if patches is None else patches.outcomes
        if interactive and not reporter.confirm(prepared.plan, merged):
            run_prefill.abandon(prepared.prefill)  # the fill and the wheel's unpack, and the run's cache
            _discard_wheel_copy(prepared)
            if prepared.lock is not None:  # a declined run is finished: the next is not told it died
                prepared.lock.release()
            return _declined(prepared, given_id)
        if not interactive:  # --yes, --json, no terminal: what will be lost is still said, and logged
            for warning in prepared.plan.warnings:
                reporter.note(f"before the stop: {warning}", host=warning in prepared.plan.host_notes)
        held = deferral.enter_context(interrupts_deferred(held_back))
        run = (
            start(prepared, reporter) if record is None else prepare.resume(prepared, reporter, record, tree)
        )
        preflight_done = preflight_outcome(prepared, record is not None, reuse is not None, began)
        run.add_step(preflight_done)
        reporter.step(preflight_done)  # the step table's first row, as in --json (and the run's log)
    except BaseException:
        deferral.close()
        run_prefill.abandon(prepared.prefill)
        _discard_wheel_copy(prepared)
        if prepared.lock is not None:
            prepared.lock.release()
        raise
    try:
        # the raising handlers go in with the signals blocked, and they are unblocked first thing in the
        # try: a signal that comes at the switch (the journal just written) rolls back, never escapes
        mask = signals.block()
        with interrupts_raise() as received:

            def step(name: str, action: Callable[[], str]) -> None:
                run.timed(name, received.checked(action))

            try:
                signals.unblock(mask)
                received.signals.extend(held)  # held back while the journal was written: no step starts
                if record is None:  # --commit: the prepare did these
                    if options.keep_patches:
                        step("patches", lambda: patches_step(run))
                    step("backup", lambda: backup_step(run))
                if options.undo is not None and record is None:  # the backup staged: a swap
                    step("stage", lambda: undo_stage_step(run))
                # an undo installs from a backup: nothing to fetch; a commit's prepare fetched it
                if options.undo is None and record is None:
                    step("prefetch", lambda: prefetch_step(run))
                    if not options.no_smoke:  # the new version exercised before anything stops
                        step("smoke", lambda: smoke_step(run))
                    keep_old_links(run)  # the way back that needs no room
                if options.prepare:  # nothing stopped: the run waits for --commit
                    received.checked(lambda: prepared_step(run))()
                    cache_removed.append(True)  # the run's cache stays for the commit
                    signals.block()
                    return _result(run, "prepared", ExitCode.OK, None)
                step("gate", lambda: gate_step(run))
                with NvmlSession(options.environ, options.proc_root) as session:
                    baseline = session.snapshot()  # before the stop: what the processes held
                    step("stop", lambda: stop_step(run))
                    step("gpu-release", lambda: gpu_release_step(run, session, baseline))
                if options.undo is not None and run.staged is not None:  # the backup's tree renamed in
                    step("restore", lambda: swap_step(run))
                    step("verify", lambda: verify_step(run))
                elif options.undo is not None:  # the undone run's backup put back in the window
                    step("restore", lambda: undo_restore_step(run, lambda: _check_no_late_users(run)))
                    step("verify", lambda: undo_verify_step(run, lambda: remove_gate(run)))
                else:
                    step("install", lambda: swap_step(run) if run.staged else install_step(run))
                    step("verify", lambda: verify_step(run))
                step("restart", lambda: restart_step(run))
                if run.staged is not None:
                    step(
                        "verify-in-place",
                        lambda: confirm_step(run) if options.undo is None else undo_confirm_step(run),
                    )
                step("end-check", lambda: end_check_step(run))
                signals.block()  # done: a signal now waits for the tidy-up's handler (held back, said)
            except Exception as exc:  # any failure once the run started rolls back, bugs included
                error = (
                    exc if isinstance(exc, SafeInstallError) else StepFailed(f"{type(exc).__name__}: {exc}")
                )
                outcome = rollback_step(run, error, run_smoke.abandon)
                status = {
                    ExitCode.ROLLED_BACK: "rolled-back",
                    ExitCode.ROLLBACK_FAILED: "rollback-failed",
                }.get(outcome.exit_code, "error")
                # put back whole: earlier rolled-back runs' backups go (they piled up), never a good one's
                removed = _prune_old_backups(run, status) if outcome.exit_code == ExitCode.ROLLED_BACK else ()
                return _result(run, status, outcome.exit_code, outcome, backups_removed=removed)
        # The run succeeded: the services run the new, verified version. What is left is tidying up
        # (signals held back meanwhile); a failure there is said, and must not turn a good run into an
        # error (nor leave a journal that blocks the next run): the gate marker is gone already, so a
        # leftover drop-in is inert.
        tidying.append(True)
        signals.unblock(mask)  # the deferral's handler is back in place: a pending signal is held back
        run.journal_phase_if_possible(Phase.DONE)
        save_patches(run)
        save_left(run)
        note = record_run(run.state, run.env.prefix, run.wheel.name if run.wheel else "", run.vouched)
        run.notes.extend([note] if note else [])
        # what the run read and hashed: the verification in place, the old files (their inodes live on
        # where uv's cache holds them: a switch back takes their hashes), the run's cache (the installed
        # files' own inodes, where the install linked them from it: the next run takes them as the old
        # files); a file installed within the store's granularity of its hash is racy, and hashed by
        # the next check
        hashed = [*run.in_place.values(), *run.prepared.before.observed.values()]
        removed = _tidy_up(run, [*hashed, *inodes.read_states(run.hashed)])
        cache_removed.append(True)
        not_restarted = tuple(run.units_to_restart()) if options.no_restart else ()
        return _result(run, "done", ExitCode.OK, None, not_restarted, removed)
    finally:
        run_smoke.abandon(run)  # never left running, whatever ended the run
        run_smoke.end_probe(run)  # after a rollback's restart: its removal keeps no unit down
        run_prefill.join(prepared.prefill)  # the fill's copies are in the run's cache, removed next
        # what its owner kept filling stays for the next run
        if not cache_removed:  # a good run's tidy-up removed it already
            _remove_run_cache(run)
        if not run.state.journal.exists():  # else the wheel copy is kept for --recover
            _discard_wheel_copy(prepared)
            if record is not None and record.wheel is not None:  # the prepare's own copy
                discard_wheel_copy(Path(record.wheel), prepared.state.dir)
        if prepared.lock is not None:
            prepared.lock.release()
        deferral.close()


def preflight_outcome(prepared: Prepared, commit: bool, reused: bool, began: float) -> StepDoc:
    """The preflight as the run's first step (its row in the step table, as in ``--json``): its seconds,
    from the run's start to its journal, and what it was."""
    plan = prepared.plan
    detail = (
        f"{len(plan.processes)} process(es) using {plan.package}, {len(plan.units)} unit(s); "
        f"{sum(d.files_checked for d in prepared.before.distributions)} installed files checked"
    )
    if commit:
        detail += (
            "; the prepare's plan, wheel and hashes taken again, nothing changed since"
            if reused
            else "; the whole preflight again (the environment's directories changed, or --full)"
        )
    return StepDoc(name="preflight", status="ok", seconds=time.monotonic() - began, detail=detail)


def read_prepared_run(options: RunOptions, env: Environment | None) -> PreparedRecord:
    """--commit: the record of the one prepared run of the environment, read before the lock;
    :func:`safeinstall.run.steps.prepare.commit_check` checks under it that the journal is still that
    run's."""
    python = str(interpreter_in_prefix(env)) if env is not None else options.python
    return prepare.the_prepared_run(options.environ, python, env=env).record


def prepared_step(run: Run) -> None:
    """--prepare, once the smoke check passed: the record of what the commit relies on, then the
    journal says ``prepared``; the lock is released with the run, nothing was stopped."""
    write_prepared(run.state, prepare.new_record(run))
    run.journal_phase(Phase.PREPARED)
    run.log("prepared: safeinstall --commit goes on from the gate")
    run.notes.append(
        f"prepared, nothing stopped: safeinstall --commit --python {interpreter_in_prefix(run.env)}"
        f"{' --user' if run.options.user else ''} [--yes] goes on from the stop "
        f"(safeinstall --discard drops it; --prepared-max-age {run.options.prepared_max_age:g} s)"
    )


def _tidy_up(run: Run, hashed: Sequence[FileState]) -> tuple[str, ...]:
    """After a good run, under its lock: the hashes kept, the drop-ins, the run's cache, the staging
    directory, the kept links, the journal and older backups removed (returns those). A failure is said,
    never an error; the large trees go on threads of their own.
    """
    started = time.monotonic()
    later = run.options.commit  # a commit leaves what need not hold the lock to the next run
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="tidy") as pool:
        with held_while_threads_start():
            staging_gone = pool.submit(
                _timed_call, lambda: _discard_staged_noted(run, keep_tree=later, probe=True)
            )
            pruned = pool.submit(_timed_call, lambda: () if later else _prune_old_backups(run, "done"))
        # the run's cache stays until its hashes are kept (an open of one of them tells the filesystem)
        note = keep_hashes(run.state.root, run.env.prefix, run.prepared.inodes, hashed)
        run.notes.extend([note] if note else [])
        if run.records:  # the RECORDs it installed are the reference a later check holds them to
            records, note = read_records(run.state.root, run.env.prefix)
            note = keep_records(run.state.root, run.env.prefix, records, run.records) or note
            run.notes.extend([note] if note else [])
            names = {canonicalize_name(os.path.basename(d).split("-", 1)[0]) for d in run.records}
            note = forget_anchors(run.state.root, run.env.prefix, names)  # the next check anchors them anew
            run.notes.extend([note] if note else [])
        kept = time.monotonic()
        try:
            remove_dropins(run)
        except SafeInstallError as exc:
            run.notes.append(
                f"could not remove the boot gate drop-ins ({GATE_DROPIN}.conf; inert, the gate is open): "
                f"{exc.message}"
            )
        dropped = time.monotonic()
        cache_s = 0.0 if later else _remove_run_cache(run)
        staging_s, _ = staging_gone.result()
        prune_s, removed = pruned.result()
    if later:
        run.log(
            "tidy-up: the old version's staging directory, the kept links, the run's uv cache and the "
            "backups beyond --keep-backups are left to the next run (or --recover): a commit ends with "
            "its checks"
        )
    elif not keep.discard(run.env.prefix, run.run_id, RUN_DIR_REMOVAL_S):
        run.notes.append(
            f"{run.env.prefix / keep.keep_name(run.run_id)} was not removed: the next run removes it"
        )
    with contextlib.suppress(OSError):
        clear_journal(run.state.dir)
    run.log(
        f"tidy-up: hashes kept {kept - started:.1f} s, drop-ins {dropped - kept:.1f} s, the run's uv cache "
        f"{cache_s:.1f} s; alongside: staging directory {staging_s:.1f} s, older backups {prune_s:.1f} s; "
        f"in all {time.monotonic() - started:.1f} s"
    )
    return removed


def _timed_call(action: Callable[[], _T]) -> tuple[float, _T]:
    """``action()``'s seconds and answer (a tidy-up thread's part, logged)."""
    started = time.monotonic()
    answer = action()
    return time.monotonic() - started, answer


def _discard_staged_noted(run: Run, keep_tree: bool = False, probe: bool = False) -> None:
    """:func:`_discard_staged`, and with ``probe`` the probe tree the check ran on
    (:func:`safeinstall.run.steps.smoke.end_probe`); a failure is a note (a good run stays one: the next
    run, or ``--recover``, removes what is left)."""
    try:
        _discard_staged(run, keep_tree)
    except Exception as exc:
        run.notes.append(f"the staging directory was not removed: {exc}")
    if probe:
        run_smoke.end_probe(run)


def _remove_run_cache(run: Run) -> float:
    """The run's uv cache removed (installed files then share their inodes with nothing: the cache was
    filled by clone or copy, never by link); its seconds, logged."""
    started = time.monotonic()
    for left in remove_uv_caches(run.state, run.run_id):
        run.log(f"{left} could not be removed in {RUN_DIR_REMOVAL_S:g} s: the next run removes it")
    took = time.monotonic() - started
    run.log(f"tidy-up: the run's uv cache removed in {took:.1f} s")
    return took


def keep_old_links(run: Run) -> None:
    """Before the stop: links of the old files kept in the prefix (:mod:`safeinstall.env.keep`), so a
    rollback on a full disk needs no new blocks. All of them where the new version fits beside the old,
    else those whose uninstall frees nothing; best effort. In an account's environment, its worker's.
    """
    if run.backup is None:
        return
    paths = [f.path for f in run.backup.manifest.files if f.link_target is None]
    every = run.staged is not None or both_fit(run)
    account = run.env.account
    if account is not None and not every:
        return
    try:
        if account is not None:
            kept = keep.keep_links_as(account.ids, run.env.prefix, run.run_id, paths)
        else:
            kept = keep.keep_links(run.env.prefix, run.run_id, paths, every=every)
    except OSError as exc:
        run.log(f"no links of the old files kept ({exc}): a rollback copies them back")
        return
    if kept:
        which = "all the old files" if every else "old file(s) shared with other links"
        run.log(f"{kept} links of {which} kept in {keep.keep_name(run.run_id)}")


def both_fit(run: Run) -> bool:
    """The new version (the wheel's files, what uv writes beside them, a margin) fits in the
    environment's filesystem with the old one still there: the uninstall's room is not needed."""
    if run.wheel is None:
        return False
    files = installed_size(run.wheel)
    return free_space(run.env.prefix) >= files + install_overhead(files)


def _discard_staged(run: Run, keep_tree: bool = False) -> None:
    """After a good swap: the old files it moved out and the staging directory go (the backup keeps the
    old version); before the journal is cleared, so that a kill here leaves it to ``--recover``.
    ``keep_tree`` (a commit): the directory, holding only old files the backup keeps, is left to the
    next run (or ``--recover``), which removes every leftover staging directory."""
    if run.staged is None:
        return
    ids = staging.owner_ids(run.env)
    try:
        renames.tidy(run.staged.plan, run.env.prefix, staging.frame(run.env), ids)
    except (OSError, SafeInstallError) as exc:
        run.log(f"the bytecode and empty directories of moved-out files were not all removed: {exc}")
    unknown: list[tuple[str, str]] = []
    try:
        known = frozenset(f.path for f in run.saved().manifest.files)
        unknown = renames.unknown_in_old(run.staged.root, known)
        left = renames.put_back_unknown(run.staged.root, run.env.prefix, unknown, ids)
    except (OSError, SafeInstallError) as exc:
        left = [f"(the old files could not be listed: {exc})"]
    if unknown:
        run.log(f"put back where they were (they appeared after the backup): {[p for _, p in unknown]}")
    if left:  # never deleted unseen
        kept = renames.keep_staging(run.env.prefix, run.staged.root.name, ids) or run.staged.root
        run.notes.append(
            f"{len(left)} file(s) that appeared in the old version's directories after the backup could "
            f"not be put back (first: {left[0]}): kept in {kept}; copy back what you need, then delete it"
        )
        return
    if keep_tree:
        return
    if not renames.discard_staging(run.env.prefix, run.staged.root.name, RUN_DIR_REMOVAL_S, ids):
        run.notes.append(f"{run.staged.root} could not be removed: the next run removes it")


def _prune_old_backups(run: Run, status: str) -> tuple[str, ...]:
    """After a run that ended with the environment whole (``status`` done, or rolled back): the backups
    of the newest ``--keep-backups`` good runs stay (this run's, when it is one), those of rolled-back
    runs go but this run's; the ones deleted."""
    try:
        statuses = {
            entry.run_id: retention_status(entry.status, entry.exit_code)
            for entry in read_history(run.state).runs
        }
    except SafeInstallError as exc:  # unreadable: nothing is deleted on a guess
        run.notes.append(f"old backups not pruned: the history could not be read ({exc.message})")
        return ()
    statuses[run.run_id] = status
    old = prune_backups(
        run.state.backups,
        run.options.keep_backups,
        protected={run.run_id},
        statuses=statuses,
        good_run=status == "done",
    )
    run.notes.extend(f"old backup not deleted: {problem}" for problem in old.problems)
    return tuple(map(str, old.removed))


def _as(account: Account | None) -> str:
    """Pure: how the log says whom uv runs as (nothing: the caller)."""
    return "" if account is None else f", as uid {account.uid}"


def _discard_wheel_copy(prepared: Prepared) -> None:
    """The run's copy of the wheel (``prepared.options.wheel``) goes with it; never a commit's that is
    its prepare's own (a refused commit leaves the prepared run whole: ``--discard`` removes it)."""
    if prepared.options.wheel is not None and not prepared.reused:
        discard_wheel_copy(prepared.options.wheel, prepared.state.dir)


def _declined(prepared: Prepared, run_id: str | None) -> RunDocument:
    """The user said no at the prompt: nothing was journalled, nothing changed (``run_id``: the caller's)."""
    data = RunData(plan=plan_doc(prepared.plan), notes=tuple(prepared.notes))
    return run_document(replace(prepared.options, run_id=run_id), "declined", ExitCode.REFUSED, data)


def _result(
    run: Run,
    status: str,
    code: ExitCode,
    error: SafeInstallError | None,
    not_restarted: tuple[str, ...] = (),
    backups_removed: tuple[str, ...] = (),
) -> RunDocument:
    patches = () if run.patches is None else run.patches.outcomes
    data = replace(
        run.record,
        plan=plan_doc(run.plan),
        service_downtime_s=run.record.service_downtime_s if status == "done" else None,
        backup_dir=str(run.backup.dir) if run.backup else None,
        backups_removed=backups_removed,
        log_file=str(run.log_file),
        not_restarted=not_restarted,
        notes=tuple(run.notes),
        patches=patch_docs(rolled_back(patches) if status == "rolled-back" else patches),
        manual_commands=error.commands if isinstance(error, RollbackFailed) else (),
    )
    return run_document(run.options, status, code, data, error)


def run_document(
    options: RunOptions, status: str, code: ExitCode, data: RunData, error: SafeInstallError | None = None
) -> RunDocument:
    """Pure: the run's ``--json`` document (docs/json.md): ``data`` with the run's id (an undo's: the
    run it undoes), every field of a run written."""
    present = tuple(name for name in RUN_FIELDS if name != "undo_of" or options.undo is not None)
    return RunDocument(
        command="reinstall" if options.undo is None else "undo",
        status=status,
        exit_code=int(code),
        data=replace(data, present=present, run_id=options.run_id, undo_of=options.undo),
        errors=() if error is None else (ErrorDoc.of(error),),
    )
