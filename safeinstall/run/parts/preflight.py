"""The checks before the first stop, shared by the run and ``--dry-run``, so that a dry run refuses
exactly when the run would (exit 2).

The run takes the lock and creates its state directory; a dry run creates nothing. docs/dry-run.md.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path

from packaging.utils import canonicalize_name

from safeinstall.env import importcheck, keep, renames
from safeinstall.env.bytecode import pyc_name
from safeinstall.env.containment import is_within
from safeinstall.env.drift import FindingKind
from safeinstall.env.environment import (
    Environment,
    inspect_environment,
    interpreter_in_prefix,
    resolve_python,
)
from safeinstall.env.hashing import Known
from safeinstall.env.inodetrust import InodeStore
from safeinstall.env.systemsite import placement_refusals
from safeinstall.env.uvplan import UvPlan, uv_binary
from safeinstall.env.verify import VerifyReport, verify_environment
from safeinstall.env.vouched import Vouched
from safeinstall.env.wheel import (
    Wheel,
    WheelMember,
    check_landing,
    fits,
    install_directories,
    installed_size,
    read_wheel,
    target_tags,
)
from safeinstall.env.wheelcopy import (
    copy_wheel,
    discard_dead_copies,
    discard_wheel_copy,
    passable_temporary_dir,
    temporary_copy,
)
from safeinstall.errors import NotConfirmed, PlanError, SafeInstallError, WheelError
from safeinstall.run.parts import prefill as run_prefill
from safeinstall.run.parts import requires, staging
from safeinstall.run.parts.options import RunOptions, check_options
from safeinstall.run.parts.patches import PatchSet, prepare_patches
from safeinstall.run.parts.survey import Survey, survey, systemd_for
from safeinstall.run.parts.undo import UndoTarget, undo_plan, undo_target, undo_uv_plan
from safeinstall.scan.plan import KeptBackupHeld, Plan
from safeinstall.store import oldimports
from safeinstall.store.backup import (
    disk_space_copied,
    disk_space_freed,
    disk_space_needed,
    free_space,
    space_problem,
)
from safeinstall.store.baseline import read_vouched
from safeinstall.store.inodestore import read_store, store_checker
from safeinstall.store.journal import prepared_waits, read_journal
from safeinstall.store.retention import KeptBackup, drop_said, kept_backups, kept_note
from safeinstall.store.runlog import human_bytes
from safeinstall.store.state import (
    RUN_DIR_REMOVAL_S,
    EnvironmentState,
    check_environment_dir,
    check_passable,
    ensure_environment_dir,
    environment_state,
    let_through,
    remove_dead_temps,
    remove_uv_caches,
    state_root,
)
from safeinstall.system.lock import HeldLock, acquire_lock, check_lock
from safeinstall.system.safefs import unwritable
from safeinstall.system.signals import held_while_threads_start
from safeinstall.system.systemd import exec_context


@dataclass(frozen=True, slots=True, kw_only=True)
class Prepared:
    """What the preflight found; ``lock`` is held (the caller releases it) only when it was asked to.
    ``options`` are the run's: with ``take_lock``, ``wheel`` is the run's own copy in the state
    directory (checked, installed and journalled; the caller discards it with the run)."""

    options: RunOptions
    env: Environment
    state: EnvironmentState
    wheel: Wheel | None
    survey: Survey
    lock: HeldLock | None
    notes: tuple[str, ...]
    #: the affected distributions' files as installed, hashed once before anything stops: the plan's
    #: ``locally_modified`` comes from it, and the run's backup reuses its hashes
    before: VerifyReport
    undo: UndoTarget | None = None  # --undo: the run undone, its backup the version put back
    #: the environment's baseline (:mod:`safeinstall.store.baseline`): what earlier runs verified against
    #: their wheels where the wheel's RECORD says otherwise (such a file is no local change)
    vouched: Mapping[str, tuple[Vouched, ...]] = field(default_factory=dict)
    #: the environment's verified-inode store (:mod:`safeinstall.store.inodestore`) as read here; None:
    #: not usable (the run reads every file and keeps nothing)
    inodes: InodeStore | None = None
    #: a commit's, from its prepare's record (:class:`Reuse`): its wheel is the prepare's own copy
    reused: bool = False
    #: the run's cache being filled from the owner's beside the preflight
    #: (:mod:`safeinstall.run.parts.prefill`): the prefetch takes it; a run that never gets there abandons it
    prefill: run_prefill.Prefill | None = None

    @property
    def plan(self) -> Plan:
        return self.survey.plan


@dataclass(frozen=True, slots=True)
class Reuse:
    """``--commit`` with the environment's directories unmoved: what its preflight takes from the
    prepare's record (docs/prepare.md); :func:`safeinstall.run.steps.prepare.commit_check` proves the rest."""

    uv_plan: UvPlan  # uv is not asked again
    members: Mapping[str, WheelMember]  # the wheel's members as hashed (the same bytes: its sha256)
    known: Known | None  # the environment's root-owned files by identity, as the prepare hashed them


def preflight(
    options: RunOptions,
    *,
    take_lock: bool,
    env: Environment | None = None,
    reuse: Reuse | None = None,
    fill: bool = False,
) -> Prepared:
    """Every check of the run before its first stop. Raises SafeInstallError (exit 2) before there is a
    plan; later failures are the plan's ``refusals``. ``take_lock``: make the state directory and hold the
    lock (a run), else only check both; ``env``: inspected already; ``reuse``: a commit's (no copy, no
    room check); ``fill``: the run's cache filled beside it (``Prepared.prefill``).
    """
    check_options(options)
    env = env or inspect_environment(resolve_python(options.python, options.environ))
    state = environment_state(state_root(options.environ, os.geteuid()), env.prefix)
    notes: list[str] = [env.owner_note] if env.owner_note else []
    lock: HeldLock | None = None
    needed = root_needed(env, os.geteuid(), options.user) if take_lock else None  # the run, not its plan
    if needed is not None:
        raise needed
    if env.account is not None:  # uv runs as the environment's owner: it must reach the run's directories
        check_passable(state.root, env.account)
    if take_lock:
        notes.extend(s.warning for s in ensure_environment_dir(state) if s.warning)
        if env.account is not None:
            let_through(state)
        lock = acquire_lock(state.lock, str(env.prefix))
        if lock.takeover_note:
            notes.append(lock.takeover_note)
        if not state.journal.exists():  # under the lock, no run to recover: copies left are dead runs'
            discard_dead_copies(state.dir)
            remove_dead_temps(state)
            for left in remove_uv_caches(state):  # a dead run's uv cache and scratch (its log promised)
                notes.append(f"{left}, left by a run that died, could not be removed: remove it by hand")
            keep.discard_leftovers(env.prefix)  # a dead run's links of the old files (root's prefixes)
            for name in renames.leftover_stagings(env.prefix):  # a commit's old version, or a dead run's
                renames.discard_staging(env.prefix, name, RUN_DIR_REMOVAL_S, staging.owner_ids(env))
    else:
        check_environment_dir(state)
        check_lock(state.lock, str(env.prefix))
        if not options.commit and (waits := prepared_waits(read_journal(state.dir))) is not None:
            raise waits  # the run's own refusal (start_journal), said by its dry run too
    given = options.wheel
    # the wheel's members are hashed on a thread of their own while uv plans (uv's dry run reads only its
    # metadata, and what it says is used only once the wheel passed its checks)
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="wheel")
    filling: run_prefill.Prefill | None = None
    try:
        undo = undo_target(state, options.undo) if options.undo is not None else None
        reading: Future[Wheel] | None = None
        if given is not None:
            # checked, installed and journalled: the run's own copy, not a path others can write
            use = copy_wheel(given, state.dir, env.account) if take_lock and reuse is None else given
            options = replace(options, wheel=use)
            members = reuse.members if reuse is not None else None
            with held_while_threads_start():
                reading = pool.submit(
                    _checked_wheel, use, given, options.package, env, options.accept_record_mismatch, members
                )
        wait = None if reading is None else _waiter(reading, pool)
        try:
            if given is not None and not take_lock and env.account is not None:
                # uv reads it as the owner, who may not read `given`
                with temporary_copy(given, env.account) as copy:
                    found = _named_as_given(
                        survey(replace(options, wheel=copy), env, reading=wait), copy, given
                    )
            elif undo is not None:
                found = survey(options, env, None, undo_uv_plan(undo.backup))
            elif reuse is not None:
                found = survey(options, env, None, reuse.uv_plan, reading=wait)
            else:
                found = survey(options, env, reading=wait)
        except Exception:
            if wait is not None:
                wait()  # the wheel's own error first, as when it was read before uv was asked
            raise
        wheel = wait() if wait is not None else None
        unrecorded = record_problems(found)
        kept = kept_backups(state.backups)
        said = kept_note(kept, options.keep_backups)
        if said is not None:  # the plan says what they hold (a quiet run leaves it out)
            plan = found.plan
            more_notes = (*plan.warnings, said)
            held = tuple(KeptBackupHeld(k.path.name, str(k.path), k.bytes) for k in kept)
            found = replace(
                found,
                plan=replace(
                    plan, warnings=more_notes, host_notes=(*plan.host_notes, said), kept_backups=held
                ),
            )
        landing: tuple[str, ...] = ()
        if wheel is not None and not unrecorded:  # without a RECORD, what it would replace is unknown
            landing = check_landing(wheel, env, found.affected, found.installed)
        more = (
            *placement_refusals(env, found.affected),
            *landing,
            *unrecorded,
            *(room_problems(found, env, state.backups, wheel, kept) if reuse is None else ()),
            *writability_problems(env, found, wheel),
            *(
                [f"stopping {', '.join(u.name for u in found.plan.units)} needs root (the system manager's)"]
                if found.plan.units and not options.user and os.geteuid() != 0
                else []
            ),
        )
        broken, unmet = requires.plan_said(
            env,
            found.installed,
            found.uv_plan.changes,
            options.allow_broken_requirements,
            wheel,
            undo.backup if undo is not None else None,
            resolved="--no-deps" not in options.extra_args,
        )
        more = (*more, *broken)
        if more:
            found = replace(found, plan=replace(found.plan, refusals=(*found.plan.refusals, *more)))
        if unmet:
            found = replace(found, plan=replace(found.plan, warnings=(*found.plan.warnings, *unmet)))
        vouched, unused = read_vouched(state.root, env.prefix)
        notes.extend([unused] if unused else [])
        inodes, unread = read_store(state.root, env.prefix)
        notes.extend([unread] if unread else [])
        if fill and take_lock and options.run_id and not (reuse or undo or found.plan.refusals):
            # beside the old files' hash and the backup: the copy is the prefetch's longest part
            filling = run_prefill.start(
                options.environ,
                env,
                state,
                options.run_id,
                found.uv_plan.changes,
                found.request.link_mode,
                run_prefill.kept_digests(inodes, options.full),
                found.request,
            )
        before = verify_environment(
            env,
            [d.name for d in found.affected],
            installed=found.installed,
            vouched=lambda: vouched,
            # a root-only inode whose links changed (an old file uv's cache holds) is not read again
            known=None
            if options.full
            else store_checker(inodes, reuse.known if reuse is not None else None, root_links=True),
        )
        modified = locally_modified(before)
        if modified:
            local = with_local_changes(found.plan, modified, options.keep_patches, options.undo is not None)
            found = replace(found, plan=local)
        if wheel is not None and wheel.problems:  # accepted: the plan says so (--yes: before the stop)
            warned = (*found.plan.warnings, record_mismatch_note(wheel))
            found = replace(found, plan=replace(found.plan, warnings=warned))
        shared = shared_files(before)
        if shared:
            found = replace(found, plan=replace(found.plan, warnings=(*found.plan.warnings, *shared)))
        if undo is None and not options.no_smoke:
            runners, unchecked = smoke_runners(options, env, [u.name for u in found.plan.units])
            answers, _ = oldimports.load(state)
            changes = {c.name for c in found.uv_plan.changes if c.action != "uninstall"}
            known_bad = oldimports.failing(answers, found.installed, changes)
            said = importcheck.describe(
                found.plan.package,
                options.smoke,
                options.smoke_timeout,
                runners,
                options.smoke_skip,
                known_bad,
            )
            warned = (*found.plan.warnings, *unchecked)
            found = replace(found, plan=replace(found.plan, smoke=said, warnings=warned))
        if undo is not None:
            owner = os.geteuid() if env.account is None else env.account.uid
            found = replace(found, plan=undo_plan(found.plan, undo, before, found.installed, owner))
        why_not = staging.refusal(
            env, found.request, found.uv_plan.changes, staging.rulers(options, bool(vouched))
        )
        install = staging.install_lines(env, found.request, found.uv_plan, why_not, uv_binary())
        found = replace(found, plan=replace(found.plan, install=install))
    except BaseException:
        pool.shutdown(cancel_futures=True)
        run_prefill.abandon(filling)
        if options.wheel is not None and options.wheel != given:
            discard_wheel_copy(options.wheel, state.dir)
        if lock is not None:
            lock.release()
        raise
    finally:
        pool.shutdown()
    return Prepared(
        options=options,
        env=env,
        state=state,
        wheel=wheel,
        survey=found,
        lock=lock,
        notes=tuple(notes),
        before=before,
        undo=undo,
        vouched=vouched,
        inodes=inodes,
        reused=reuse is not None,
        prefill=filling,
    )


def _waiter(reading: Future[Wheel], pool: ThreadPoolExecutor) -> Callable[[], Wheel]:
    """What waits for the wheel being read: its answer (or its error) once its thread is gone (the /proc
    scan forks its workers only while no other thread runs)."""

    def wait() -> Wheel:
        try:
            return reading.result()
        finally:
            pool.shutdown()

    return wait


def _checked_wheel(
    use: Path,
    given: Path,
    package: str,
    env: Environment,
    accept_record_mismatch: bool,
    members: Mapping[str, WheelMember] | None = None,
) -> Wheel:
    """The wheel at ``use`` (the run's copy of ``given``) read, every member hashed (or ``members``,
    as hashed before), and checked (:func:`check_wheel`); its errors name it as the user gave it."""
    try:
        wheel = read_wheel(use, members)
    except WheelError as exc:  # named as the user gave it
        raise WheelError(exc.message.replace(str(use), str(given)), exc.hint) from exc
    check_wheel(wheel, package, env, accept_record_mismatch)
    return wheel


def smoke_runners(
    options: RunOptions, env: Environment, units: list[str]
) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """Whom the smoke check runs as, and for which units (the plan says it): the environment's account;
    in a root-owned environment, each unit's ``User=`` (root for a unit without one). And the plan's
    warnings: a unit whose user is unknown, or cannot reach the environment's interpreter and site
    directories, is not checked (never as root instead)."""
    if env.account is not None or os.geteuid() != 0 or not units:
        return [(importcheck.account_of(env)[0], units)], []
    systemd = systemd_for(options)
    runners: dict[str, list[str]] = {}
    accounts: dict[importcheck.RunAs | str, list[str]] = {}
    for unit in units:
        try:
            found: importcheck.RunAs | str | None = importcheck.unit_account(exec_context(systemd, unit))
        except SafeInstallError as exc:
            found = f"its User= could not be read: {exc.message}"
        runners.setdefault(importcheck.runner_said(found), []).append(unit)
        if found is not None:
            accounts.setdefault(found, []).append(unit)
    warnings: list[str] = []
    for account, named in accounts.items():
        problem = (
            account
            if isinstance(account, str)
            else importcheck.reach_problem(account, [interpreter_in_prefix(env)], env.site_dirs)
        )
        if problem is not None:
            warnings.append(
                f"the new version is not checked before the stop for {', '.join(named)}: {problem} "
                "(the check never runs as root for a unit with User=; let its user reach them, or --no-smoke)"
            )
    return list(runners.items()), warnings


def locally_modified(report: VerifyReport) -> tuple[str, ...]:
    """Pure: the installed files that differ from their RECORD (changed or deleted locally); bytecode
    is never a local change (one that is not its source's is drift, which a reinstall does not carry)."""
    return tuple(
        f.path
        for f in report.findings
        if f.kind in (FindingKind.MODIFIED, FindingKind.MISSING) and pyc_name(f.path) is None
    )


def shared_files(report: VerifyReport) -> tuple[str, ...]:
    """Pure: the plan's warnings for the affected distributions' files that another distribution's
    RECORD lists too and whose copy is there (``shared``, not local changes): one per pair, naming both."""
    pairs: dict[tuple[str, str], list[str]] = {}
    for f in report.findings:
        if f.kind == FindingKind.SHARED:
            pairs.setdefault((f.distribution, f.shared_with or "?"), []).append(f.path)
    return tuple(
        f"{len(paths)} file(s) of {name} hold the copy of {other} (both RECORDs list them, e.g. {paths[0]}): "
        f"the reinstall of {name} removes or replaces them, and the copies of {other} are lost unless it "
        f"is reinstalled too (--with-deps, when it is a dependency; or uninstall one of them)"
        for (name, other), paths in sorted(pairs.items())
    )


def with_local_changes(
    plan: Plan, modified: tuple[str, ...], keep_patches: bool = False, undo: bool = False
) -> Plan:
    """Pure: the plan says that the reinstall replaces files changed locally, before anything stops;
    ``--keep-patches`` is named only where it is not given and could be (not for an undo, which puts
    back the backup's copies); with it, its own outcomes say what becomes of each patch."""
    if keep_patches:
        return replace(plan, locally_modified=modified)
    count = f"{len(modified)} installed file" + ("" if len(modified) == 1 else "s")
    changed = "was" if len(modified) == 1 else "were"
    what = (
        "the undo puts back the backup's copies; this run's backup keeps them"
        if undo
        else "the reinstall replaces them with the new version's; they are kept in the backup, and "
        "--keep-patches carries them over"
    )
    example = modified[0]
    warning = (
        f"{count} of the distributions of {plan.package} {changed} changed locally (e.g. {example}): {what}"
    )
    return replace(plan, locally_modified=modified, warnings=(*plan.warnings, warning))


def _named_as_given(found: Survey, copy: Path, given: Path) -> Survey:
    """Pure: the dry-run's plan with the wheel named as the user gave it, not as its temporary copy."""

    def named(command: tuple[str, ...]) -> tuple[str, ...]:
        return tuple(str(given) if arg == str(copy) else arg for arg in command)

    return replace(
        found,
        request=replace(found.request, wheel=given),
        uv_plan=replace(found.uv_plan, command=named(found.uv_plan.command)),
        plan=replace(found.plan, uv_command=named(found.plan.uv_command)),
    )


def dry_run_patches(prepared: Prepared) -> tuple[Plan, PatchSet | None]:
    """``--keep-patches --dry-run``: the run's patches step, its scratch in a temporary directory. A patch
    that cannot be carried is a refusal of the plan; missing pristine files raise. Returns the plan and
    the patches (None without the step).
    """
    options, plan = prepared.options, prepared.plan
    if not options.keep_patches or not plan.proceeds:
        return plan, None
    with passable_temporary_dir("the --keep-patches merge") as top:  # uv makes its scratch as the owner
        patches = prepare_patches(
            prepared.survey,
            options.base_wheel,
            top / "merge",
            options.environ,
            options.drop_conflicting,
            prepared.vouched,
        )
    refused = patches.refusal()
    if refused is not None:
        plan = replace(plan, refusals=(*plan.refusals, refused.message))
    return plan, patches


def refusal(plan: Plan) -> PlanError | None:
    """The error a run stops with before anything changed when its plan refuses; None if it proceeds."""
    if plan.proceeds:
        return None
    return PlanError(
        "the run would refuse: " + "; ".join(plan.refusals),
        hint="the same command with --dry-run shows the whole plan; nothing was stopped",
    )


def unconfirmed(plan: Plan, why: str, commit: bool = False) -> NotConfirmed | None:
    """Pure: the error of a run that would stop units and cannot ask (``why``: no terminal, ``--json``)
    and was not given ``--yes``, as apt aborts without a terminal; None when it stops no unit."""
    if not plan.units:
        return None
    units = ", ".join(u.name for u in plan.units)
    shown = (
        "safeinstall --status shows the prepared run"
        if commit
        else f"safeinstall {plan.package} --dry-run shows it"
    )
    return NotConfirmed(
        f"not confirmed: the run would stop {units}, and {why}",
        hint="give --yes to stop them without a question (as apt-get -y), or run it on a terminal to see "
        f"the plan and answer ({shown}); nothing was stopped",
    )


#: the reasons of :func:`safeinstall.env.wheel.record_problems` that are about a listed member's content
_CONTENT_MISMATCH = re.compile(
    r"RECORD \w+ hash does not match the content|RECORD size \d+ does not match the content \(\d+\)"
)


def only_content_mismatches(wheel: Wheel) -> bool:
    """Pure: the wheel's RECORD lists each of its members, and is wrong only about some hashes or sizes
    (pynvvideocodec 2.0.4's packaging error), not about which members there are."""
    return bool(wheel.problems) and all(_CONTENT_MISMATCH.fullmatch(p.reason) for p in wheel.problems)


def record_mismatch_note(wheel: Wheel) -> str:
    """Pure: what an accepted wheel whose RECORD is wrong gets said (the plan's notes, and the log)."""
    members = sorted({p.path for p in wheel.problems})
    return (
        f"--accept-record-mismatch: the wheel's own RECORD is wrong about {len(members)} member(s) "
        f"(e.g. {members[0]}): the installed files are verified against the wheel's contents, and the "
        "environment's baseline keeps them (--verify-only reports them as wheel-record, not drift)"
    )


def check_wheel(wheel: Wheel, package: str, env: Environment, accept_record_mismatch: bool = False) -> None:
    """The wheel is for ``package``, its RECORD matches its contents (or, ``accept_record_mismatch``,
    is wrong only about hashes or sizes), and it fits ``env``'s tags."""
    if wheel.name != canonicalize_name(package):
        raise WheelError(
            f"the wheel {wheel.path.name} is for {wheel.name}, not {package}",
            hint="pass the wheel of the package being reinstalled; nothing was stopped",
        )
    if not wheel.record_ok and not (accept_record_mismatch and only_content_mismatches(wheel)):
        listed = "; ".join(f"{p.path}: {p.reason}" for p in wheel.problems[:3])
        accept = (
            "; if it is the wheel as its publisher shipped it (compare its sha256 with the index's), "
            "--accept-record-mismatch installs it and verifies it against its contents"
            if only_content_mismatches(wheel)
            else ""
        )
        raise WheelError(
            f"the wheel {wheel.path.name} is damaged: its RECORD does not match its contents ({listed})",
            hint=f"download or build the wheel again{accept}; nothing was stopped",
        )
    if not fits(wheel, target_tags(env)):
        tags = ", ".join(sorted(str(t) for t in wheel.tags))
        raise WheelError(
            f"the wheel {wheel.path.name} ({tags}) does not fit Python "
            f"{env.version[0]}.{env.version[1]} ({env.implementation}) at {env.python}",
            hint="use a wheel built for that interpreter, or pass --python for the right environment; "
            "nothing was stopped",
        )


def record_problems(found: Survey) -> tuple[str, ...]:
    """Pure: an affected distribution whose RECORD could not be read, or has lines that could not be
    parsed: what it installed is not (all) known, so some of its files could be neither backed up nor
    checked, and uv, which reads the RECORD as the owner and may take such a line, would remove files no
    backup holds."""
    problems: list[str] = []
    for dist in found.affected:
        record = f"the RECORD of {dist.name} {dist.version} ({dist.dist_info}/RECORD)"
        if dist.record_problem is not None:
            problems.append(
                f"{record} could not be read ({dist.record_problem}): its files can be neither backed up "
                "nor checked"
            )
        elif dist.record.problems:
            first = dist.record.problems[0]
            problems.append(
                f"{record} has lines that cannot be parsed (line {first.line}: {first.reason}): the files "
                "they name can be neither backed up nor checked"
            )
    return tuple(problems)


def room_problems(
    found: Survey, env: Environment, backups: Path, wheel: Wheel | None, kept: tuple[KeptBackup, ...] = ()
) -> tuple[str, ...]:
    """Room for the backup and the prefetch (the new version unpacked in the run's uv cache, in the
    state directory), and for the install (in the environment). Where one filesystem holds both, one
    sum (:func:`shared_room`); otherwise each on its own. Where the state directory is short, the
    ``kept`` backups are named: which to drop, and the command."""
    dists = list(found.affected)
    prefetch = installed_size(wheel) if wheel is not None else 0
    prefix = str(env.prefix)
    if _device(backups) == _device(env.prefix):
        copied = disk_space_copied(dists, env, found.installed, backups)
        room = shared_room(copied, prefetch, found.request.link_mode, wheel is not None)
        free = free_space(backups)
        said = drop_said(kept, room.needed - free, prefix)
        what = "the backup" + (f", the run's uv cache and the install of {wheel.path.name}" if wheel else "")
        return tuple(
            problem
            for problem in [space_problem(room.needed, free, backups, what, room.said(said))]
            if problem is not None
        )
    problems: list[str] = []
    backup = disk_space_needed(dists, env, found.installed)
    # uv writes more in the run's cache than the new version (its interpreter query, its temporary
    # files; in the window too, where the run does not swap): the install's margin
    cache = prefetch + install_overhead(prefetch) if prefetch else 0
    what = (
        "the backup and the prefetch (the new version unpacked beside it, what uv writes there and a margin)"
    )
    free = free_space(backups)
    said = drop_said(kept, backup + cache - free, prefix)
    remedy = "free some space there or point SAFEINSTALL_STATE_DIR at a larger filesystem"
    remedy += f"; {said}" if said else ""
    problem = space_problem(backup + cache, free, backups, what if prefetch else "the backup", remedy)
    if problem:
        problems.append(problem)
    if wheel is not None:
        freed = disk_space_freed(dists, env, found.installed)
        files = installed_size(wheel)
        beside = install_overhead(files)
        problem = space_problem(
            install_room(files, freed) + beside,
            free_space(env.prefix),
            env.prefix,
            what=f"the install of {wheel.path.name}",
            remedy=f"its files {human_bytes(files)}, what uv writes beside them and a margin "
            f"{human_bytes(beside)}, freed by the uninstall {human_bytes(freed)}: free some space on that "
            "filesystem",
        )
        if problem:
            problems.append(problem)
    return tuple(problems)


@dataclass(frozen=True, slots=True)
class SharedRoom:
    """What a run takes on the one filesystem of its state directory and its environment."""

    copied: int  # the backup's copies (a RECORD entry it hardlinks takes no room)
    cache: int  # the run's uv cache: the new version unpacked (the prefetch links from it)
    install: int  # the install's own copies: none where it hardlinks from that cache
    beside: int  # what uv writes beside them, and a margin

    @property
    def needed(self) -> int:
        return self.copied + self.cache + self.install + self.beside

    def said(self, kept: str) -> str:
        """Pure: the figures, the remedy and what ``kept`` (:func:`drop_said`) says of the kept backups."""
        how = "copied" if self.install else "hardlinked from that cache"
        figures = (
            f"one filesystem holds the state directory and the environment: the backup's copies "
            f"{human_bytes(self.copied)}"
        )
        if self.cache:
            figures += (
                f", the run's uv cache (the new version unpacked) {human_bytes(self.cache)}, the install "
                f"({how}) {human_bytes(self.install)}, what uv writes beside it and a margin "
                f"{human_bytes(self.beside)}"
            )
        remedy = "free some space there or point SAFEINSTALL_STATE_DIR at another filesystem"
        return f"{figures}; {remedy}" + (f"; {kept}" if kept else "")


def shared_room(copied: int, cache: int, link_mode: str, install: bool) -> SharedRoom:
    """Pure: the room a run needs where its state directory shares the environment's filesystem, all
    parts summed (they are there at once; nothing freed by the uninstall): the backup's copies, the
    run's cache, the install's own copies (``link_mode`` copy only) and the margin; with no
    ``install`` (no wheel), the backup alone (docs/faults.md, "Room")."""
    if not install:
        return SharedRoom(copied, 0, 0, 0)
    copies = cache if link_mode != "hardlink" else 0
    return SharedRoom(copied, cache, copies, install_overhead(cache))


#: what uv writes in each installed ``.dist-info`` beside the wheel's files (measured: uv 0.5 to 0.9)
UV_EXTRA_FILES = ("INSTALLER", "REQUESTED", "direct_url.json", "uv_cache.json")


def install_overhead(new: int, dist_infos: int = 1, block: int = 4096) -> int:
    """Pure: the room an install of ``new`` bytes of files takes beyond them: uv's own files in each
    ``.dist-info`` (:data:`UV_EXTRA_FILES`), the RECORD it rewrites longer and the temporary file it
    writes each through (a block each), and a margin (1/64 of the new version, at least 256 KiB: new
    directories, a filesystem's metadata)."""
    return dist_infos * (len(UV_EXTRA_FILES) + 2) * block + max(256 << 10, new // 64)


def install_room(new: int, freed: int) -> int:
    """Pure: the room the install of ``new`` bytes needs in the environment, the state directory on
    another filesystem: beyond the ``freed`` bytes of old files with no other link, which uv's
    uninstall frees first (docs/faults.md, "Room")."""
    return max(0, new - freed)


def _device(path: Path) -> int:
    probe = Path(os.path.abspath(path))
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe.stat().st_dev


def writability_problems(env: Environment, found: Survey, wheel: Wheel | None) -> tuple[str, ...]:
    """uv writes into the site and scripts directories, the directories of the files it replaces and
    where the wheel's members land: a read-only one would fail the install during the downtime."""
    as_user = None if env.account is None else env.account.ids
    said = unwritable_said(unwritable(install_directories(env, found.affected, wheel), as_user))
    if os.geteuid() != 0:  # a dry run without root (the run itself says root_needed's error)
        said = tuple(f"{s} (to uid {os.geteuid()}: the run needs root)" for s in said)
    return said


def unwritable_said(problems: Sequence[str]) -> tuple[str, ...]:
    """Pure: :func:`safeinstall.system.safefs.unwritable`'s problems ("PATH: why"), one refusal per
    reason, each directory once: "the install could not write A, B: it is not writable"."""
    by_reason: dict[str, list[str]] = {}
    for problem in problems:
        path, _, reason = problem.rpartition(": ")
        paths = by_reason.setdefault(reason, [])
        if path not in paths:
            paths.append(path)
    return tuple(
        f"the install could not write {', '.join(paths)}: it is "
        + (reason if reason.startswith("not writable") else f"not writable ({reason})")
        for reason, paths in by_reason.items()
    )


def root_needed(env: Environment, euid: int, user: bool) -> PlanError | None:
    """The error of a caller that is not root and cannot write the environment's site and scripts
    directories (root's, or another account's, as a service's venv): the run needs root (before the
    state directory, whose own complaint would hide it); None when it can, or is root."""
    if euid == 0:
        return None
    directories = [d for d in (*env.site_dirs, env.scripts) if is_within(str(d), str(env.prefix))]
    denied = [p.rpartition(": ")[0] for p in unwritable(directories) if p.endswith(": not writable")]
    if not denied:
        return None
    return PlanError(
        f"reinstalling into {env.prefix} needs root: uid {euid} cannot write "
        + ", ".join(dict.fromkeys(denied)),
        hint="run it as root (sudo safeinstall ...); --dry-run shows the plan without root"
        + ("" if user else ", and --user works on your own user manager's units in your own environments"),
    )
