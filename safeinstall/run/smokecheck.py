"""What the smoke check is made of (:mod:`safeinstall.run.smoke` makes and reads them): where the new
version lies, the check made ready, the check running beside the prefetch; and the check's children
themselves (:func:`execute`), which is all that runs in the check's thread."""

from __future__ import annotations

import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from safeinstall.env import smoke
from safeinstall.env.environment import Environment
from safeinstall.env.swap import STAGED_TREE, staging_environment


@dataclass(frozen=True, slots=True)
class NewTree:
    """Where the new version lies before the stop: ``top``, the directory that holds it, in ``parent``;
    ``below``, the tree in it ("" when ``top`` is the tree); ``sites``, what the check imports from."""

    top: Path
    parent: Path
    below: str
    sites: tuple[Path, ...]

    @property
    def tree(self) -> Path:
        return self.top / self.below if self.below else self.top


def staged_tree(env: Environment, root: Path) -> NewTree:
    """The swap's staging directory ``root``: its tree's site directories."""
    staged = staging_environment(env, root / STAGED_TREE)
    return NewTree(root, env.prefix, STAGED_TREE, tuple(dict.fromkeys([staged.purelib, staged.platlib])))


def target_tree(scratch: Path) -> NewTree:
    """The prefetch's ``--target`` directory: a site directory itself."""
    return NewTree(scratch, scratch.parent, "", (scratch,))


@dataclass(frozen=True, slots=True)
class Job:
    """One context's check: its child's variables (the imports, then ``--smoke``)."""

    context: smoke.Context
    variables: tuple[tuple[str, str], ...]


@dataclass(frozen=True, slots=True)
class Checks:
    """The check made ready (``safeinstall.run.smoke.prepare``): what runs, and what is undone once it
    is over (the shim's directory removed, the tree closed again where it was opened)."""

    new: NewTree
    shim: Path
    opened: bool  # the way to the tree was opened to units' users (closed again after)
    jobs: tuple[Job, ...]
    skipped: tuple[str, ...]
    python: Path
    package: str
    changed: frozenset[str]
    smoke: str | None  # the operator's --smoke command
    timeout: float
    notes: tuple[str, ...]  # what of the units' could not be taken (said once the check is over)


@dataclass(frozen=True, slots=True)
class Background:
    """The check running beside the rest of the prefetch (``safeinstall.run.smoke.start``): its thread's
    answer, the event that ends it (``abandon``) and when it started."""

    checks: Checks
    pool: ThreadPoolExecutor
    answer: Future[list[smoke.ChildOutcome]]
    cancel: threading.Event
    started: float


def execute(checks: Checks, cancel: threading.Event | None = None) -> list[smoke.ChildOutcome]:
    """The check's children, one context after another (the operator's command once its imports
    passed); they end early, said, once ``cancel`` is set. Only children: run in a thread of its own."""
    outcomes: list[smoke.ChildOutcome] = []
    sites = list(checks.new.sites)
    for job in checks.jobs:
        variables = dict(job.variables)
        outcome = smoke.run_imports(
            checks.python,
            job.context,
            variables,
            sites,
            checks.package,
            checks.changed,
            checks.timeout,
            cancel,
        )
        outcomes.append(outcome)
        if outcome.ok and checks.smoke is not None:
            outcomes.append(smoke.run_command(checks.smoke, job.context, variables, checks.timeout, cancel))
        if cancel is not None and cancel.is_set():
            break
    return outcomes
