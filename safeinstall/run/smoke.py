"""The smoke step: after the prefetch, before the gate and the stop, the new version is imported (and the
operator's ``--smoke`` command run) as the environment's account, with each unit's own environment
(:mod:`safeinstall.env.smoke`); in a root-owned environment, as each unit's ``User=`` (root for a unit
without one), the tree opened to that user for reading while it runs (:func:`_let_units_in`). A failure
refuses the run (exit 2): nothing was stopped.

The tree imported from is the swap's staging tree, or, where the run does not swap, the prefetch's
``--target`` directory, which the prefetch then leaves for this step (it goes with the run's other
directories: at the end of the run, or by ``--recover`` after a crash). The shim directory is root's,
``<state>/<env>/smoke-RUN``, removed likewise.
"""

from __future__ import annotations

import os
from pathlib import Path

from packaging.utils import canonicalize_name

from safeinstall.env import smoke, swap
from safeinstall.env.environment import Environment, interpreter_in_prefix, who_else_controls
from safeinstall.env.swap import STAGED_TREE, staging_environment
from safeinstall.env.uvplan import install as uv_install
from safeinstall.env.uvplan import prefetch_command, uv_binary
from safeinstall.errors import PlanError, SafeInstallError
from safeinstall.run.running import Run
from safeinstall.store.state import (
    PASSABLE_MODE,
    PRIVATE_MODE,
    SMOKE_PREFIX,
    let_through,
    make_run_dir,
    remove_run_dir,
)
from safeinstall.system.safefs import Tree
from safeinstall.system.systemd import ExecContext, exec_context


def trees(run: Run) -> list[Path]:
    """Where the new version lies before the stop: the staging tree's site directories, or the
    prefetch's ``--target`` directory."""
    if run.staged is not None:
        staged = staging_environment(run.env, run.staged.root / STAGED_TREE)
        return list(dict.fromkeys([staged.purelib, staged.platlib]))
    return [run.scratch] if run.scratch is not None else []


def runs_as(env: Environment, context: ExecContext) -> smoke.RunAs | str | None:
    """Whom the check runs as for a unit (see :mod:`safeinstall.env.smoke`): the environment's account;
    in a root-owned environment, when safeinstall is root, the unit's ``User=`` (None: root, a unit
    without one; a str: why its user cannot be told)."""
    if env.account is not None:
        return smoke.owner_account(env)
    if os.geteuid() != 0:
        return None  # the caller's own run (a user's environment): no other account to become
    return smoke.unit_account(context)


def contexts(run: Run) -> tuple[list[smoke.Context], list[str]]:
    """One context per distinct way the plan's units run (none: the account with systemd's defaults);
    and the units whose check cannot run as their ``User=`` (why: never run as root instead)."""
    found: dict[tuple[smoke.RunAs | None, tuple[tuple[str, str], ...], str], smoke.Context] = {}
    skipped: list[str] = []
    for unit in run.plan.units:
        try:
            context = exec_context(run.systemd, unit.name)
        except SafeInstallError as exc:
            raise PlanError(
                f"cannot read how {unit.name} runs (its environment): {exc.message}",
                hint="nothing was stopped; --no-smoke skips the check of the new version",
            ) from exc
        run_as = runs_as(run.env, context)
        if isinstance(run_as, str):
            skipped.append(f"{unit.name}: {run_as}")
            continue
        home = smoke.account_of(run.env)[1] if run_as is None else run_as.home
        # what the child takes of a unit's must be root's or the child's own account's: another could
        # write a working directory, a PYTHONPATH entry, an environment file (the attacker review)
        runner = os.geteuid() if run_as is None else run_as.uid

        def ours(path: str, runner: int = runner) -> bool:
            return who_else_controls(Path(path), runner) is None

        files = [(path, ignore) for path, ignore in context.environment_files if ours(path)]
        from_files, notes = smoke.read_environment_files(files, None if run_as is None else run_as.ids)
        notes += [
            f"EnvironmentFile {path} was not read: {who_else_controls(Path(path), runner)}"
            for path, ignore in context.environment_files
            if (path, ignore) not in files
        ]
        variables, dropped = smoke.unit_variables(
            tuple({**dict(context.environment), **dict(from_files)}.items()), ours
        )
        if dropped:
            notes.append(
                f"{unit.name}: not given to the check, as another account could change what they name: "
                + ", ".join(dropped)
            )
        cwd = smoke.working_directory(context.working_directory, home, run.options.user)
        if cwd != "/" and not ours(cwd):
            notes.append(
                f"{unit.name}: the check runs in /, not in {cwd}: {who_else_controls(Path(cwd), runner)}"
            )
            cwd = "/"
        key = (run_as, variables, cwd)
        if key not in found:
            found[key] = smoke.Context(unit.name, variables, cwd, tuple(notes), run_as)
    if not found and not skipped:
        cwd = smoke.account_of(run.env)[1] if run.options.user else "/"
        return [smoke.Context(None, (), cwd, (), smoke.owner_account(run.env))], []
    return list(found.values()), skipped


#: The prefetch's ``--target`` tree while a unit's user reads it (the check lists its site directories)
OPEN_TREE_MODE = 0o755
#: uv's lock file at the top of a tree it installs into (0666: its locks are everyone's)
UV_LOCK = ".lock"


def _tree_top(run: Run) -> tuple[Path, Path, str]:
    """The directory that holds the tree of the new version, the directory it is in, and the tree
    below it: the staging directory in the prefix, or the prefetch's ``--target`` directory."""
    if run.staged is not None:
        return run.staged.root, run.env.prefix, swap.STAGED_TREE
    assert run.scratch is not None
    return run.scratch, run.scratch.parent, ""


def _let_units_in(run: Run) -> str | None:
    """Open the way to the new version for the units' users (root-owned environment; see
    docs/threat-model.md): the state root and the environment's directory 0711 (the shim's directory
    is 0755), the staging directory 0711: entered by name, never listed (its attic stays 0700); the
    tree below it as uv made it (the prefetch's ``--target`` tree, a site directory itself: 0755),
    checked first to be root's alone (uv's lock file at its top, which everyone may write and nothing
    reads once uv is done, is removed first). None, or why it was not opened."""
    top, parent, below = _tree_top(run)
    tree = top / below if below else top
    try:
        with Tree(tree) as new:
            new.unlink(UV_LOCK)
    except OSError as exc:
        return f"uv's lock file in the new version's tree could not be removed: {exc}"
    problem = smoke.others_may_write(tree)
    if problem is not None:
        return f"the new version's tree is not opened to it: {problem}"
    try:
        let_through(run.state)
        with Tree(parent) as holder:  # the prefetch's tree is the site directory itself: listed
            holder.set_mode(top.name, PASSABLE_MODE if below else OPEN_TREE_MODE)
    except (OSError, SafeInstallError) as exc:
        return f"the way to the new version could not be opened: {exc}"
    return None


def _close_again(run: Run) -> None:
    """The directory holding the tree private again (0700) once the check is done."""
    top, parent, _ = _tree_top(run)
    try:
        with Tree(parent) as tree:
            tree.set_mode(top.name, PRIVATE_MODE)
    except OSError as exc:
        run.notes.append(f"{top} stays mode {PASSABLE_MODE:04o} (it goes with the run): {exc}")


def smoke_step(run: Run) -> str:
    """Import the new version (and run ``--smoke``) in each unit's context; PlanError (exit 2) when
    anything fails. The prefetch's ``--target`` tree (``run.scratch``) stays until the run's cache goes
    (at the end of the run, or first thing in a rollback): its files are links of the cache's inodes,
    and removing a link changes an inode's change time, which the verification in the window proves
    the hashed inodes by (docs/window.md)."""
    return _smoke(run)


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
    run._log(f"smoke: the new version laid out from the run's cache: {' '.join(command)}")
    cache = run.state.uv_cache(run.run_id)
    result = uv_install(command, run.options.environ, cache_dir=cache, account=account)
    run._log(f"uv exit {result.returncode}:\n{result.output}")
    if result.returncode != 0:
        return f"uv could not lay it out for the check (exit {result.returncode}; see the log)"
    return None


def _smoke(run: Run) -> str:
    options = run.options
    if run.staged is None and run.scratch is None:
        problem = _target_tree(run)
        if problem is not None:
            run.notes.append(f"the new version was not checked before the stop: {problem}")
            return f"skipped: {problem}"
    sites = trees(run)
    found, skipped = contexts(run)
    unit_users = [c for c in found if c.run_as is not None and c.run_as.unit_user]
    shim = smoke.write_shim(run.state.dir / f"{SMOKE_PREFIX}{run.run_id}")
    outcomes: list[smoke.ChildOutcome] = []
    try:
        closed = _let_units_in(run) if unit_users else None
        changed = {canonicalize_name(c.name) for c in run.survey.uv_plan.changes if c.action != "uninstall"}
        python = interpreter_in_prefix(run.env)
        package = canonicalize_name(run.plan.package)
        for context in found:
            run.notes.extend(context.notes)
            run_as = context.run_as
            if run_as is not None and run_as.unit_user:
                problem = closed or smoke.reach_problem(run_as, [python], [*run.env.site_dirs, *sites, shim])
                if problem is not None:
                    skipped.append(f"{context.unit}: {problem}")
                    continue
            name, home = (run_as.name, run_as.home) if run_as is not None else smoke.account_of(run.env)
            variables = smoke.child_variables(
                options.environ, (name, home), context.variables, run.env, shim, sites
            )
            outcome = smoke.run_imports(
                python, context, variables, sites, package, changed, options.smoke_timeout
            )
            run._log(f"smoke: {smoke.logged(outcome)}")
            outcomes.append(outcome)
            if outcome.ok and options.smoke is not None:
                outcome = smoke.run_command(options.smoke, context, variables, options.smoke_timeout)
                run._log(f"smoke: {smoke.logged(outcome)}")
                outcomes.append(outcome)
        if not all(o.ok for o in outcomes):
            raise PlanError(
                smoke.failure_message(outcomes),
                hint="nothing was stopped: the running version is untouched; fix the new version (or, "
                "if the check is wrong here, --no-smoke skips it)",
            )
    finally:
        if unit_users:
            _close_again(run)
        remove_run_dir(shim)
    note = smoke.unavailable_note(outcomes)
    if note is not None:
        run.notes.append(note)
        run._log(note)
    run.notes.extend(
        f"the new version was not checked before the stop for {why}: the check never runs as root for "
        "a unit with User= (let its user reach them, or --no-smoke)"
        for why in skipped
    )
    if not outcomes:
        return f"skipped: {'; '.join(skipped)}"
    imported = len({m for o in outcomes for m in o.imported})
    units = [o.context.unit for o in outcomes if o.context.unit and o.what == "imports"]
    where = f" with the environment of {', '.join(units)}" if units else ""
    command = f"; `{options.smoke}` passed" if options.smoke is not None else ""
    who = ", ".join(dict.fromkeys(_who(run, o.context) for o in outcomes))
    left = f"; not checked for {', '.join(w.split(':')[0] for w in skipped)}" if skipped else ""
    return f"{imported} module(s) of the new version imported as {who}{where}{command}{left}"


def _who(run: Run, context: smoke.Context) -> str:
    return smoke.account_of(run.env)[0] if context.run_as is None else context.run_as.name
