"""The smoke step: after the prefetch, before the gate and the stop, the new version is imported (and the
operator's ``--smoke`` command run) as the environment's account, with each unit's own environment
(:mod:`safeinstall.env.smoke`). A failure refuses the run (exit 2): nothing was stopped.

The tree imported from is the swap's staging tree, or, where the run does not swap, the prefetch's
``--target`` directory, which the prefetch then leaves for this step (it goes with the run's other
directories: at the end of the run, or by ``--recover`` after a crash). The shim directory is root's,
``<state>/<env>/smoke-RUN``, removed likewise.
"""

from __future__ import annotations

import os
from pathlib import Path

from packaging.utils import canonicalize_name

from safeinstall.env import smoke
from safeinstall.env.environment import interpreter_in_prefix, who_else_controls
from safeinstall.env.swap import STAGED_TREE, staging_environment
from safeinstall.env.uvplan import install as uv_install
from safeinstall.env.uvplan import prefetch_command, uv_binary
from safeinstall.errors import PlanError, SafeInstallError
from safeinstall.run.running import Run
from safeinstall.store.state import SMOKE_PREFIX, make_run_dir, remove_run_dir
from safeinstall.system.systemd import exec_context


def trees(run: Run) -> list[Path]:
    """Where the new version lies before the stop: the staging tree's site directories, or the
    prefetch's ``--target`` directory."""
    if run.staged is not None:
        staged = staging_environment(run.env, run.staged.root / STAGED_TREE)
        return list(dict.fromkeys([staged.purelib, staged.platlib]))
    return [run.scratch] if run.scratch is not None else []


def contexts(run: Run) -> list[smoke.Context]:
    """One context per distinct way the plan's units run (none: the account with systemd's defaults)."""
    home = smoke.account_of(run.env)[1]
    found: dict[tuple[tuple[tuple[str, str], ...], str], smoke.Context] = {}
    # what the child (root for a root-owned environment) takes of a unit's must be root's or its own:
    # the unit's user could write a working directory, a PYTHONPATH entry, an environment file
    runner = os.geteuid() if run.env.account is None else run.env.account.uid

    def ours(path: str) -> bool:
        return who_else_controls(Path(path), runner) is None

    for unit in run.plan.units:
        try:
            context = exec_context(run.systemd, unit.name)
        except SafeInstallError as exc:
            raise PlanError(
                f"cannot read how {unit.name} runs (its environment): {exc.message}",
                hint="nothing was stopped; --no-smoke skips the check of the new version",
            ) from exc
        files = [(path, ignore) for path, ignore in context.environment_files if ours(path)]
        from_files, notes = smoke.read_environment_files(files, run.env.account)
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
        key = (variables, cwd)
        if key not in found:
            found[key] = smoke.Context(unit.name, variables, cwd, tuple(notes))
    if not found:
        return [smoke.Context(None, (), home if run.options.user else "/")]
    return list(found.values())


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
    shim = smoke.write_shim(run.state.dir / f"{SMOKE_PREFIX}{run.run_id}")
    try:
        account = smoke.account_of(run.env)
        changed = {canonicalize_name(c.name) for c in run.survey.uv_plan.changes if c.action != "uninstall"}
        outcomes: list[smoke.ChildOutcome] = []
        python = interpreter_in_prefix(run.env)
        package = canonicalize_name(run.plan.package)
        for context in contexts(run):
            run.notes.extend(context.notes)
            variables = smoke.child_variables(
                options.environ, account, context.variables, run.env, shim, sites
            )
            outcome = smoke.run_imports(
                run.env, python, context, variables, sites, package, changed, options.smoke_timeout
            )
            run._log(f"smoke: {smoke.logged(outcome)}")
            outcomes.append(outcome)
            if outcome.ok and options.smoke is not None:
                outcome = smoke.run_command(run.env, options.smoke, context, variables, options.smoke_timeout)
                run._log(f"smoke: {smoke.logged(outcome)}")
                outcomes.append(outcome)
        if not all(o.ok for o in outcomes):
            raise PlanError(
                smoke.failure_message(outcomes),
                hint="nothing was stopped: the running version is untouched; fix the new version (or, "
                "if the check is wrong here, --no-smoke skips it)",
            )
    finally:
        remove_run_dir(shim)
    note = smoke.unavailable_note(outcomes)
    if note is not None:
        run.notes.append(note)
        run._log(note)
    imported = len({m for o in outcomes for m in o.imported})
    units = [o.context.unit for o in outcomes if o.context.unit and o.what == "imports"]
    where = f" with the environment of {', '.join(units)}" if units else ""
    command = f"; `{options.smoke}` passed" if options.smoke is not None else ""
    return f"{imported} module(s) of the new version imported as {account[0]}{where}{command}"
