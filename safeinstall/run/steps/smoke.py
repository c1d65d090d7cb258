"""The smoke step: the new version imported (and ``--smoke`` run) as the environment's account, with each
unit's environment, after the prefetch and before the stop; a failure refuses the run (exit 2).

docs/reinstall.md ("The smoke check").
"""

from __future__ import annotations

import os
import pwd
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from packaging.utils import canonicalize_name

from safeinstall.env import importcheck
from safeinstall.env.environment import (
    Environment,
    distribution_sites,
    interpreter_in_prefix,
    user_site_enabled,
    who_else_controls,
    who_else_controls_tree,
)
from safeinstall.env.uvplan import install as uv_install
from safeinstall.env.uvplan import prefetch_command, uv_binary
from safeinstall.errors import PlanError, SafeInstallError
from safeinstall.run.parts import probe as run_probe
from safeinstall.run.parts.running import Run
from safeinstall.run.parts.smokethread import (
    Background,
    Checked,
    Checks,
    Job,
    NewTree,
    execute,
    staged_tree,
    target_tree,
)
from safeinstall.store import oldimports
from safeinstall.store.state import (
    PASSABLE_MODE,
    PRIVATE_MODE,
    SMOKE_PREFIX,
    let_through,
    make_run_dir,
    remove_run_dir,
)
from safeinstall.system import signals
from safeinstall.system.safefs import Tree
from safeinstall.system.signals import Interrupted, held_while_threads_start
from safeinstall.system.systemd import ExecContext, exec_context


def new_tree(run: Run) -> NewTree | None:
    """The tree the prefetch left for the check: the staging tree, or the ``--target`` tree; None."""
    if run.staged is not None:
        return staged_tree(run.env, run.staged.root)
    return target_tree(run.scratch) if run.scratch is not None else None


def runs_as(env: Environment, context: ExecContext) -> importcheck.RunAs | str | None:
    """Whom the check runs as for a unit (see :mod:`safeinstall.env.importcheck`): the environment's account;
    in a root-owned environment, when safeinstall is root, the unit's ``User=`` (None: root, a unit
    without one; a str: why its user cannot be told)."""
    if env.account is not None:
        return importcheck.owner_account(env)
    if os.geteuid() != 0:
        return None  # the caller's own run (a user's environment): no other account to become
    return importcheck.unit_account(context)


def contexts(run: Run) -> tuple[list[importcheck.Context], list[str]]:
    """One context per distinct way the plan's units run (none: the account with systemd's defaults);
    and the units whose check cannot run as their ``User=`` (why: never run as root instead)."""
    found: dict[
        tuple[importcheck.RunAs | None, tuple[tuple[str, str], ...], str, tuple[str, ...]],
        importcheck.Context,
    ] = {}
    skipped: list[str] = []
    judged: dict[tuple[str, int], str | None] = {}
    for unit in run.plan.units:
        try:
            context = exec_context(run.systemd, unit.name)
        except Interrupted:  # a signal is no unit that cannot be read: the run stops
            raise
        except SafeInstallError as exc:
            raise PlanError(
                f"cannot read how {unit.name} runs (its environment): {exc.message}",
                hint="nothing was stopped; --no-smoke skips the check of the new version",
            ) from exc
        run_as = runs_as(run.env, context)
        if isinstance(run_as, str):
            skipped.append(f"{unit.name}: {run_as}")
            continue
        home = importcheck.account_of(run.env)[1] if run_as is None else run_as.home
        # what the child takes of a unit's must be root's or the child's own account's: another could
        # write a working directory, a PYTHONPATH entry, an environment file (the attacker review)
        runner = os.geteuid() if run_as is None else run_as.uid

        def ours(path: str, runner: int = runner) -> bool:
            return who_else_controls(Path(path), runner) is None

        def judge(path: str, runner: int = runner) -> str | None:
            return _tree_finding(path, runner, judged)

        files = [(path, ignore) for path, ignore in context.environment_files if ours(path)]
        from_files, notes = importcheck.read_environment_files(files, None if run_as is None else run_as.ids)
        notes += [
            f"EnvironmentFile {path} was not read: {who_else_controls(Path(path), runner)}"
            for path, ignore in context.environment_files
            if (path, ignore) not in files
        ]
        given = tuple({**dict(context.environment), **dict(from_files)}.items())
        entry = importcheck.service_entry(context.command)
        cwd = importcheck.working_directory(context.working_directory, home, run.options.user)
        # a working directory the unit names is on sys.path for the operator's command (``python -c``):
        # its whole tree then (the home a user manager's unit starts in: as the directories above it)
        named = context.working_directory.startswith("/") and cwd != home and run.options.smoke is not None
        cwd_problem = (judge(cwd) if named else _finding(cwd, runner)) if cwd != "/" else None
        # a relative HOME is taken from where the child runs: its directory, or / where it cannot enter it
        starts = dict.fromkeys(["/" if cwd_problem else cwd, "/"])
        found_sites = [
            importcheck.user_site(given, home, entry.flags, run.env.version[:2], at) for at in starts
        ]
        judged_sites = (
            [(s, judge(s)) for s in dict.fromkeys(found_sites) if s] if user_site_enabled(run.env) else []
        )
        user_site, site_problem = next(((s, p) for s, p in judged_sites if p), (found_sites[0], None))
        if runner == 0:  # never root's child loading what another user controls: refused, said
            found_here = importcheck.others_loaded(given, entry.flags, judge)
            found_here += [f"WorkingDirectory={cwd}: {cwd_problem}"] if cwd_problem else []
            found_here += [f"HOME's user site {user_site}: {site_problem}"] if site_problem else []
            if found_here:
                raise PlanError(
                    f"the smoke check would load, as root, what another user controls, for {unit.name}: "
                    + "; ".join(found_here),
                    hint="nothing was stopped; fix the unit (make what it names root's alone, give it "
                    "User=, or run its interpreter with -s), or --no-smoke skips the check",
                )
        variables, dropped = importcheck.unit_variables(given, lambda path: judge(path) is None)
        if runner == 0:  # root's child: nothing naming a path another controls (the attacker review, 4)
            variables, unlisted = importcheck.root_variables(
                variables, lambda path: judge(path) is None, ours, cwd
            )
            if unlisted:
                notes.append(
                    f"{unit.name}: not given to the check, which runs as root, as they name a path that "
                    "is not root's alone: " + ", ".join(sorted(set(unlisted)))
                )
        if site_problem:
            variables = (*variables, ("PYTHONNOUSERSITE", "1"))
            notes.append(f"{unit.name}: the check runs without the user site {user_site}: {site_problem}")
        if dropped:
            notes.append(
                f"{unit.name}: not given to the check, as another account could change what they name: "
                + ", ".join(dropped)
            )
        if cwd_problem:
            notes.append(f"{unit.name}: the check runs in /, not in {cwd}: {cwd_problem}")
            cwd = "/"
        # the same child for the units whose check would see the same environment (docs/reinstall.md)
        key = (run_as, importcheck.seen_variables(variables, entry.flags), cwd, entry.flags)
        if key not in found:
            found[key] = importcheck.Context(
                unit.name, variables, cwd, tuple(notes), run_as, entry.run, entry.scripts, entry.flags
            )
        else:  # one child for the units that run the same way: what each runs first is imported in it
            had = found[key]
            found[key] = replace(
                had,
                notes=(*had.notes, *(n for n in notes if n not in had.notes)),
                run=tuple(dict.fromkeys((*had.run, *entry.run))),
                scripts=tuple(dict.fromkeys((*had.scripts, *entry.scripts))),
                also=(*had.also, unit.name),
            )
    if not found and not skipped:
        cwd = importcheck.account_of(run.env)[1] if run.options.user else "/"
        return [importcheck.Context(None, (), cwd, (), importcheck.owner_account(run.env))], []
    return list(found.values()), skipped


def _user(uid: int | None) -> str:
    if uid is None:
        return "no single account"
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _finding(path: str, runner: int) -> str | None:
    """Who else controls ``path`` and the directories above it (not its tree), said."""
    return who_else_controls(Path(path), runner)


def _tree_finding(path: str, runner: int, judged: dict[tuple[str, int], str | None]) -> str | None:
    """Who else controls what may be loaded from ``path`` (its whole tree), said with the user's name;
    each path judged once per check (``judged``)."""
    if (path, runner) not in judged:
        found = who_else_controls_tree(Path(path), runner)
        said = None if found is None else found[1]
        if found is not None and found[0] is not None:
            said = found[1].replace(f"uid {found[0]}", _user(found[0]))
        judged[(path, runner)] = said
    return judged[(path, runner)]


#: The prefetch's ``--target`` tree while a unit's user reads it (the check lists its site directories)
OPEN_TREE_MODE = 0o755
#: uv's lock file at the top of a tree it installs into (0666: its locks are everyone's)
UV_LOCK = ".lock"


def _let_units_in(run: Run, new: NewTree) -> str | None:
    """Open the new version to the units' users in a root-owned environment: the state directories and
    the staging directory 0711 (entered, never listed), the tree checked to be root's alone first
    (docs/threat-model.md). None, or why it was not opened.
    """
    try:
        with Tree(new.tree) as tree:
            tree.unlink(UV_LOCK)
    except OSError as exc:
        return f"uv's lock file in the new version's tree could not be removed: {exc}"
    problem = importcheck.others_may_write(new.tree)
    if problem is not None:
        return f"the new version's tree is not opened to it: {problem}"
    try:
        let_through(run.state)
        with Tree(new.parent) as holder:  # the prefetch's tree is the site directory itself: listed
            holder.set_mode(new.top.name, PASSABLE_MODE if new.below else OPEN_TREE_MODE)
    except (OSError, SafeInstallError) as exc:
        return f"the way to the new version could not be opened: {exc}"
    return None


def _close_again(run: Run, new: NewTree) -> None:
    """The directory holding the tree private again (0700) once the check is done."""
    try:
        with Tree(new.parent) as tree:
            tree.set_mode(new.top.name, PRIVATE_MODE)
    except OSError as exc:
        run.notes.append(f"{new.top} stays mode {PASSABLE_MODE:04o} (it goes with the run): {exc}")


def prepare(run: Run, new: NewTree) -> Checks:
    """Everything of the check but its children: the contexts, the shim, the way opened to the units'
    users (and what each of them can reach); what was made is undone on a failure."""
    found, skipped = contexts(run)
    opened = any(c.run_as is not None and c.run_as.unit_user for c in found)
    python = interpreter_in_prefix(run.env)
    shim = importcheck.write_shim(run.state.dir / f"{SMOKE_PREFIX}{run.run_id}")
    jobs: list[Job] = []
    try:
        closed = _let_units_in(run, new) if opened else None
        for context in found:
            run_as = context.run_as
            if run_as is not None and run_as.unit_user:
                reach = [*run.env.site_dirs, *new.sites, shim]
                problem = closed or importcheck.reach_problem(run_as, [python], reach)
                if problem is not None:
                    skipped.append(f"{context.unit}: {problem}")
                    continue
            name, home = (run_as.name, run_as.home) if run_as is not None else importcheck.account_of(run.env)
            variables = importcheck.child_variables(
                run.options.environ,
                (name, home),
                context.variables,
                run.env,
                shim,
                list(new.sites),
                context.flags,
            )
            key = importcheck.answers_key(context, os.geteuid())
            jobs.append(Job(context, tuple(variables.items()), key))
    except BaseException:
        _undo(run, new, shim, opened)
        raise
    changed = {canonicalize_name(c.name) for c in run.survey.uv_plan.changes if c.action != "uninstall"}
    old = {
        d.name: (d.version, oldimports.code_digest(d))
        for d in run.survey.installed
        if d.name in changed and d.record.entries
    }
    stored, problem = oldimports.load(run.state)
    if problem is not None:
        run.log(f"smoke: {problem}")
    known = {(name, job.key): stored.get((name, *old[name], job.key), {}) for name in old for job in jobs}
    return Checks(
        new,
        shim,
        opened,
        tuple(jobs),
        tuple(skipped),
        python,
        canonicalize_name(run.plan.package),
        frozenset(changed),
        run.options.smoke,
        run.options.smoke_timeout,
        tuple(note for context in found for note in context.notes),
        tuple(run.options.smoke_skip),
        old,
        {name: answers for name, answers in known.items() if answers},
        tuple(distribution_sites(run.env)),
    )


def _undo(run: Run, new: NewTree, shim: Path, opened: bool) -> None:
    """What the check made undone: the tree closed again (where it was opened), the shim removed."""
    if opened:
        _close_again(run, new)
    remove_run_dir(shim)


def start(run: Run, new: NewTree) -> None:
    """Start the check beside the rest of the prefetch, its children on a thread of their own; its answer
    is read by :func:`smoke_step`. What cannot be started here is left to that step, which says why.
    """
    try:
        checks = prepare(run, new)
    except Interrupted:
        raise
    except (SafeInstallError, OSError) as exc:
        run.log(f"smoke: not started beside the prefetch: {getattr(exc, 'message', None) or exc}")
        return
    cancel = threading.Event()
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="safeinstall-smoke")
    try:
        with held_while_threads_start():  # a signal now waits until the check is known: abandon() ends it
            answer = pool.submit(execute, checks, cancel)
            run.smoke_check = Background(checks, pool, answer, cancel, time.monotonic())
    except BaseException as exc:
        if run.smoke_check is not None:  # the signal held back during the start: the caller abandons it
            raise
        cancel.set()
        pool.shutdown(wait=True)
        _undo(run, checks.new, checks.shim, checks.opened)
        if not isinstance(exc, RuntimeError):  # "can't start new thread": the smoke step runs it
            raise
        run.log(f"smoke: not started beside the prefetch: {exc}")
        return
    run.log(f"smoke: started beside the prefetch, from {new.tree}")


def abandon(run: Run) -> None:
    """End the check running in the background, if any: its children killed, its thread joined, what it
    opened closed; a signal meanwhile waits until then. Its answer is never the run's. Idempotent.
    """
    background = run.smoke_check
    if background is None:
        return
    background.cancel.set()  # first: whatever happens next, its children end within a poll
    mask = signals.block()
    try:
        run.smoke_check = None
        background.pool.shutdown(wait=True)
        _undo(run, background.checks.new, background.checks.shim, background.checks.opened)
        run.log("smoke: the check that ran beside the prefetch was ended")
        end_probe(run)
    finally:
        signals.unblock(mask)


def end_probe(run: Run) -> None:
    """The probe tree and its cache removed (safeinstall.run.parts.probe), once no check reads them;
    what could not be, said. Idempotent."""
    probe, run.probe = run.probe, None
    if probe is None:
        return
    left = run_probe.discard(run.env, probe)
    run.notes.extend(left)
    for line in left or ["the probe tree and its cache removed"]:
        run.log(f"smoke: {line}")


def smoke_step(run: Run) -> str:
    """Import the new version (and run ``--smoke``) in each unit's context, waiting for :func:`start`'s check
    or running it here. Raises PlanError (exit 2) when anything fails. The ``--target`` tree stays with the
    run's cache: removing its links would move the hashed inodes' ctime (docs/window.md).
    """
    background = run.smoke_check
    if background is not None:
        try:
            checked = background.answer.result()
        except BaseException:  # a signal while it is waited for: the children go with the run
            abandon(run)
            raise
        run.smoke_check = None
        background.pool.shutdown(wait=True)
        probed = run.probe is not None and background.checks.new.top == run.probe.root
        on = "on the probe tree, beside the fill's copy" if probed else "beside the prefetch"
        beside = f"the check took {time.monotonic() - background.started:.1f} s, {on}"
        run.log(f"smoke: {beside}")
        moved = run_probe.changed_since_linked(run.probe) if probed and run.probe is not None else None
        if moved is None:
            # a refusal's probe goes with the run (at its end, before the stop); a pass's, with the
            # staging directory once the units run again (its removal is not on the way to the stop)
            return f"{_conclude(run, background.checks, checked)} ({beside})"
        _undo(run, background.checks.new, background.checks.shim, background.checks.opened)
        said = f"the check on the probe tree was set aside ({moved}): it ran again on the staging tree"
        run.notes.append(f"{said}; the next run's fill says whether root's uv cache holds a changed copy")
        run.log(f"smoke: {said}")
        end_probe(run)
    new = new_tree(run)
    if new is None:
        problem = _target_tree(run)
        if problem is not None:
            run.notes.append(f"the new version was not checked before the stop: {problem}")
            return f"skipped: {problem}"
        new = new_tree(run)
        assert new is not None
    checks = prepare(run, new)
    try:
        checked = execute(checks)
    except BaseException:
        _undo(run, checks.new, checks.shim, checks.opened)
        raise
    return _conclude(run, checks, checked)


def _target_tree(run: Run) -> str | None:
    """Where the prefetch left no tree of the new version (it meant to swap, and the staging tree was
    dropped): uv lays it out again from the run's cache, as the prefetch does, into its ``--target``
    directory (``run.scratch``). None, or why it could not."""
    account = run.env.account
    scratch = make_run_dir(run.state.prefetch_dir(run.run_id), account)
    run.scratch = scratch
    request = run.survey.request
    command = prefetch_command(request, uv_binary(), scratch, run.survey.uv_plan.changes)
    # copies: a new link of a hashed inode of the run's cache would change its change time
    command[command.index("--link-mode") + 1] = "copy"
    run.log(f"smoke: the new version laid out from the run's cache: {' '.join(command)}")
    cache = run.state.uv_cache(run.run_id)
    result = uv_install(command, run.options.environ, cache_dir=cache, account=account)
    run.log(f"uv exit {result.returncode}:\n{result.output}")
    if result.returncode != 0:
        return f"uv could not lay it out for the check (exit {result.returncode}; see the log)"
    return None


def _keep_old_answers(run: Run, checks: Checks, learned: dict[tuple[str, str], dict[str, str]]) -> None:
    """What the running version answered, kept for the next run of the same versions in the same context."""
    if not learned:
        return
    stored, _ = oldimports.load(run.state)
    keyed = {
        (name, *checks.old[name], key): answers
        for (name, key), answers in learned.items()
        if name in checks.old
    }
    note = oldimports.save(run.state, oldimports.merged(stored, keyed))
    run.log(f"smoke: the running version was asked about {sum(map(len, learned.values()))} module(s)")
    if note is not None:
        run.log(f"smoke: {note}")


def _conclude(run: Run, checks: Checks, checked: Checked) -> str:
    """The check's answer: logged, what it opened closed again; PlanError when anything failed."""
    outcomes = checked.outcomes
    run.notes.extend(checks.notes)
    try:
        _keep_old_answers(run, checks, checked.learned)
        for outcome in outcomes:
            run.log(f"smoke: {importcheck.logged(outcome)}")
        if not all(o.ok for o in outcomes):
            failed = [module for o in outcomes for module, _ in o.failed]
            skip = f"--smoke-skip {failed[0]} leaves out a module you know is bad, " if failed else ""
            slow = any(o.problem and importcheck.TIMED_OUT in o.problem for o in outcomes)
            longer = f"a larger --smoke-timeout than {run.options.smoke_timeout:g} s, " if slow else ""
            raise PlanError(
                importcheck.failure_message(outcomes),
                hint="nothing was stopped: the running version is untouched; fix the new version "
                f"(if the check is wrong here: {longer}{skip}--no-smoke skips the whole check)",
            )
    finally:
        _undo(run, checks.new, checks.shim, checks.opened)
    for note in (
        importcheck.unavailable_note(outcomes),
        importcheck.excused_note(outcomes),
        importcheck.skipped_note(outcomes),
    ):
        if note is not None:
            run.notes.append(note)
            run.log(note)
    skipped = checks.skipped
    run.notes.extend(
        f"the new version was not checked before the stop for {why}: the check never runs as root for "
        "a unit with User= (let its user reach them, or --no-smoke)"
        for why in skipped
    )
    if not outcomes:
        return f"skipped: {'; '.join(skipped)}"
    imported = len({m for o in outcomes for m in o.imported})
    units = [
        u
        for o in outcomes
        if o.context.unit and o.what == "imports"
        for u in (o.context.unit, *o.context.also)
    ]
    where = f" with the environment of {', '.join(units)}" if units else ""
    command = f"; `{checks.smoke}` passed" if checks.smoke is not None else ""
    who = ", ".join(dict.fromkeys(_who(run, o.context) for o in outcomes))
    left = f"; not checked for {', '.join(w.split(':')[0] for w in skipped)}" if skipped else ""
    excused = sorted({m for o in outcomes for m, _ in o.excused})
    shared = f"; not held against it: {', '.join(excused)} (the running version cannot import it either)"
    said = shared if excused else ""
    left_out = sorted({m for o in outcomes for m in o.skipped})
    said += f"; left out (--smoke-skip): {', '.join(left_out)}" if left_out else ""
    return f"{imported} module(s) of the new version imported as {who}{where}{command}{said}{left}"


def _who(run: Run, context: importcheck.Context) -> str:
    return importcheck.account_of(run.env)[0] if context.run_as is None else context.run_as.name
