"""What the smoke check is made of (:mod:`safeinstall.run.steps.smoke` makes and reads them): where the new
version lies, the check made ready, the check running beside the prefetch; and the check's children
themselves (:func:`execute`), which is all that runs in the check's thread."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from safeinstall.env import importcheck
from safeinstall.env.environment import Environment
from safeinstall.env.renames import STAGED_TREE, staging_environment


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
    """One context's check: its child's variables (the imports, then ``--smoke``), and the key of the
    running version's answers in it (:func:`safeinstall.env.importcheck.answers_key`)."""

    context: importcheck.Context
    variables: tuple[tuple[str, str], ...]
    key: str = ""


@dataclass(frozen=True, slots=True)
class Checks:
    """The check made ready (``safeinstall.run.steps.smoke.prepare``): what runs, and what is undone once it
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
    skip: tuple[str, ...] = ()  # --smoke-skip: modules never imported
    #: the running version of each changed distribution: (version, RECORD digest), by name
    old: Mapping[str, tuple[str, str]] = field(default_factory=dict)
    #: what the running version answered before (:mod:`safeinstall.store.oldimports`), by (distribution,
    #: the job's key)
    known: Mapping[tuple[str, str], Mapping[str, str]] = field(default_factory=dict)
    old_sites: tuple[Path, ...] = ()  # where the running version lies (the environment's sites)


@dataclass(frozen=True, slots=True)
class Checked:
    """The check's answer: its children's outcomes, and what the running version answered meanwhile
    (by distribution and the job's key: module -> "" imported, or its error), to be kept."""

    outcomes: list[importcheck.ChildOutcome]
    learned: dict[tuple[str, str], dict[str, str]]


@dataclass(frozen=True, slots=True)
class Background:
    """The check running beside the rest of the prefetch (``safeinstall.run.steps.smoke.start``): its thread's
    answer, the event that ends it (``abandon``) and when it started."""

    checks: Checks
    pool: ThreadPoolExecutor
    answer: Future[Checked]
    cancel: threading.Event
    started: float


def execute(checks: Checks, cancel: threading.Event | None = None) -> Checked:
    """The check's children, one context after another; the first failure ends it. A module the new version
    cannot import is held against it only when the running version imports it. Ends early once
    ``cancel`` is set.
    """
    outcomes: list[importcheck.ChildOutcome] = []
    learned: dict[tuple[str, str], dict[str, str]] = {}
    sites = list(checks.new.sites)
    for job in checks.jobs:
        variables = dict(job.variables)
        wanted = importcheck.Wanted(job.context.run, job.context.scripts, checks.skip)
        outcome = importcheck.run_imports(
            checks.python,
            job.context,
            variables,
            sites,
            checks.package,
            checks.changed,
            checks.timeout,
            cancel,
            wanted,
        )
        if not outcome.ok:
            outcome = _judged(checks, job, outcome, learned, cancel)
        outcomes.append(outcome)
        if outcome.ok and checks.smoke is not None:
            outcomes.append(
                importcheck.run_command(checks.smoke, job.context, variables, checks.timeout, cancel)
            )
        if not outcomes[-1].ok or (cancel is not None and cancel.is_set()):
            break
    return Checked(outcomes, learned)


def _judged(
    checks: Checks,
    job: Job,
    outcome: importcheck.ChildOutcome,
    learned: dict[tuple[str, str], dict[str, str]],
    cancel: threading.Event | None,
) -> importcheck.ChildOutcome:
    """``outcome`` with the failures the running version shares excused; the running version asked
    (one child, the job's context, the environment's own sites) about what is not known yet, its
    answers added to ``learned``. Only answers of the job's own context count, and what the service
    imports first (``must``) only as answered in this run, never as kept (the attacker review)."""
    kept = {d: checks.known.get((d, job.key), {}) for d in checks.old}
    known = {
        d: {**{m: e for m, e in kept[d].items() if m not in outcome.must}, **learned.get((d, job.key), {})}
        for d in checks.old
    }
    asked = importcheck.unknown(outcome, known)
    if asked:
        also = tuple(m for modules in asked.values() for m in modules)
        wanted = importcheck.Wanted(job.context.run, job.context.scripts, (), also)
        variables = {**dict(job.variables), importcheck.SITES_VARIABLE: ""}  # the shim adds nothing
        old = importcheck.run_imports(
            checks.python,
            job.context,
            variables,
            list(checks.old_sites),
            checks.package,
            asked,
            checks.timeout,
            cancel,
            wanted,
        )
        owners = {**dict(outcome.owners), **dict(old.owners)}
        answers = [(m, "") for m in old.imported] + list(old.failed)
        for module, error in answers:
            dist = owners.get(module)
            if dist in asked:
                learned.setdefault((dist, job.key), {})[module] = error
                known[dist][module] = error
    return importcheck.excuse(outcome, known)
