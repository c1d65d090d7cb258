"""The staging tree of a swap (:mod:`safeinstall.env.renames`): whether a run may swap, and the tree made,
checked and planned before the stop.

Anything unexpected drops the swap: the install then runs in the window. docs/window.md.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Sequence
from pathlib import Path

from safeinstall.env import renames
from safeinstall.env.containment import Containment, relative_to_prefix
from safeinstall.env.distributions import InstalledDistribution, find_distributions
from safeinstall.env.drift import FindingKind
from safeinstall.env.environment import Environment
from safeinstall.env.hashing import Known
from safeinstall.env.uvplan import UvChange, UvPlan, UvRequest, prefetch_command, window_command
from safeinstall.env.verify import verify_environment
from safeinstall.env.wheel import Wheel
from safeinstall.run.parts.options import RunOptions
from safeinstall.run.parts.undo import RESTORE
from safeinstall.store.backup import Backup
from safeinstall.store.state import PRIVATE_MODE, PROBE_SUFFIX, RUN_DIR_REMOVAL_S
from safeinstall.system.safefs import Tree, mounts_below, parent_directories, private_to
from safeinstall.system.worker import WorkerError

#: uv's options that change what an install writes beyond the wheels' files, or where
_NOT_SWAPPED = ("--compile-bytecode", "--compile", "--target", "--prefix", "--user", "--system")
#: Failing findings after an install: anything but leftovers (those are reported, --prune removes them).
INSTALL_FAILURES = frozenset(
    {
        FindingKind.MISSING,
        FindingKind.MODIFIED,
        FindingKind.VERSION_MISMATCH,
        FindingKind.UNREADABLE,
        FindingKind.MALFORMED,
        FindingKind.OUTSIDE,
        FindingKind.WHEEL_FAULT,  # a fresh install's ctimes say nothing: it must match its RECORD
    }
)
#: what the verification of the staged files must not find: a staging tree has no leftovers either
_FAILING = INSTALL_FAILURES | {FindingKind.EXTRA}


class NotStaged(Exception):
    """The staging tree is not what a swap needs: the install runs in the window instead."""


class StagedMismatch(Exception):
    """A staged file fails its verification: the new version itself is wrong (nothing is stopped)."""


def refusal(
    env: Environment, request: UvRequest, changes: Sequence[UvChange], flags: dict[str, bool]
) -> str | None:
    """Pure: why this run installs in the window rather than swapping (None: it swaps). ``flags``:
    the run's options that rule a swap out, by name (``--keep-patches``: True when given)."""
    given = [name for name, on in flags.items() if on]
    if given:
        return f"{given[0]} is given"
    if not env.is_venv:
        return "the environment is not a virtual environment"
    if request.link_mode != "hardlink":
        return "the run's uv cache is not on the environment's filesystem"
    if any(a == o or a.startswith(o + "=") for a in request.extra_args for o in _NOT_SWAPPED):
        return "uv's options after -- change what it writes"
    if not any(c.action != "uninstall" for c in changes) or any(
        c.action == "uninstall" and not any(o.name == c.name and o.action != "uninstall" for o in changes)
        for c in changes
    ):
        return "the plan removes a distribution without installing it again"
    return None


def rulers(options: RunOptions, vouched: bool) -> dict[str, bool]:
    """Pure: the run's options that rule a swap out (:func:`refusal`); ``vouched``: the environment has
    a baseline of files whose RECORD is wrong."""
    return {
        "--no-swap": options.no_swap,
        "--keep-patches": options.keep_patches,
        "--prune": options.prune,
        "--accept-record-mismatch": options.accept_record_mismatch,
        "a baseline of files whose RECORD is wrong": vouched,
    }


def install_lines(
    env: Environment, request: UvRequest, uv_plan: UvPlan, why_not: str | None, uv_bin: str
) -> tuple[str, ...]:
    """Pure: what the plan says will run to install (not uv's dry-run command): with a
    swap, uv's install into the staging tree before the stop and the renames during it; without, the
    prefetch before the stop and uv's install during it (why no swap); an undo, the restore."""
    if uv_plan.command[:1] == (RESTORE,):
        return (
            f"before the stop: the backup {uv_plan.command[-1]} is copied into a staging tree and verified "
            "(no uv runs)",
            f"during the stop: the staged files are renamed into {env.prefix} (the swap; where it cannot "
            "swap, the backup is put back in place)",
        )
    if why_not is None:
        staged = renames.staging_dir(env.prefix, "RUN_ID") / renames.STAGED_TREE
        command = prefetch_command(request, uv_bin, staged, uv_plan.changes, staging=True)
        return (
            f"before the stop: {' '.join(command)}",
            f"during the stop: the staged files are renamed into {env.prefix} (the swap)",
        )
    scratch = Path("PREFETCH_DIR")
    return (
        f"before the stop (fills the run's uv cache): "
        f"{' '.join(prefetch_command(request, uv_bin, scratch, uv_plan.changes))}",
        f"during the stop (no swap: {why_not}): {' '.join(window_command(uv_plan.command, request))}",
    )


def owner_ids(env: Environment) -> renames.Ids:
    """Pure: who does the swap's writes in ``env`` (None: root itself)."""
    return None if env.account is None else env.account.ids


def make_staging(env: Environment, run_id: str) -> Path:
    """The run's staging directory in the prefix (0700, made by the prefix's owner: root's, or the
    account's by its worker), after removing what runs that died left there. Raises NotStaged when a
    directory uv installs into is on another filesystem (a rename cannot reach it), or when the
    directory cannot be made or is not the owner's own (OSError and WorkerError included)."""
    prefix, ids = env.prefix, owner_ids(env)
    mounted = mounts_below(prefix)
    if mounted:  # an exchange would carry it off with the old tree
        raise NotStaged(f"{mounted[0]} is a mount point inside the environment")
    for name in renames.leftover_stagings(prefix):
        renames.discard_staging(prefix, name, RUN_DIR_REMOVAL_S, ids)
    return _made(env, renames.staging_dir(prefix, run_id))


def make_probe(env: Environment, run_id: str) -> Path:
    """The run's probe directory in the prefix, ``.safeinstall-swap-RUN-probe`` (a staging directory's
    name: rollback, ``--recover`` and the next run remove it), made as :func:`make_staging` makes the
    staging one, after it (the run's own staging directory is not a leftover). Raises NotStaged."""
    return _made(env, renames.staging_dir(env.prefix, run_id + PROBE_SUFFIX))


def _made(env: Environment, root: Path) -> Path:
    """The staging directory ``root`` made in the prefix and checked (:func:`make_staging`)."""
    prefix, ids = env.prefix, owner_ids(env)
    try:
        renames.make_staging_dir(prefix, root.name, PRIVATE_MODE, ids)
    except (OSError, WorkerError) as exc:
        raise NotStaged(f"the staging directory could not be made: {exc}") from exc
    with Tree(prefix) as tree:
        info = tree.lstat(root.name)
        devices = {found.st_dev for r in _install_dirs(env) if (found := tree.lstat(r)) is not None}
    uid = os.geteuid() if ids is None else ids[0]  # None: the caller itself (root, or a user in its own)
    if info is None or not stat.S_ISDIR(info.st_mode) or not private_to(info.st_uid, info.st_mode, uid):
        renames.discard_staging(prefix, root.name, RUN_DIR_REMOVAL_S, ids)
        raise NotStaged(f"{root} is not a directory of uid {uid}'s alone")
    if devices - {info.st_dev}:
        renames.discard_staging(prefix, root.name, RUN_DIR_REMOVAL_S, ids)
        raise NotStaged("a directory uv installs into is on another filesystem than the prefix")
    return root


def _install_dirs(env: Environment) -> list[str]:
    """The prefix's directories uv installs into, relative to it."""
    inside = Containment(env.prefix)
    return [r for r in (inside.relative(str(p)) for p in (*env.site_dirs, env.scripts)) if r is not None]


def frame(env: Environment) -> frozenset[str]:
    """The directories uv installs into and every directory above them (relative): never removed."""
    found: set[str] = set()
    for directory in _install_dirs(env):
        while directory:
            found.add(directory)
            directory = directory.rpartition("/")[0]
    return frozenset(found)


def _kept_directories(
    prefix: Path, own: frozenset[str], staged: frozenset[str], old_files: frozenset[str]
) -> frozenset[str]:
    """Directories below the replaced distributions' own ones that uv's install would keep and an
    exchange would carry off: one the new version does not have that holds no old file (an empty
    directory, or one handed to the service; ``__pycache__`` aside), and one whose owner or mode is not
    the staged one's (compared by the caller for those the new version has)."""
    holding = parent_directories(old_files)
    kept: set[str] = set()
    with Tree(prefix) as live:
        for root in sorted(own):
            for directory in live.walk(root)[1]:
                cached = "__pycache__" in directory.split("/")
                if directory not in staged and directory not in holding and not cached:
                    kept.add(directory)
    return frozenset(kept)


def bearing(prefix: str, locations: Sequence[str], asked: frozenset[str]) -> list[str]:
    """Pure: the ``locations`` whose path relative to ``prefix`` (lexically, as
    :func:`safeinstall.env.containment.relative_to_prefix`) bears on the swap's plan
    (:func:`safeinstall.env.renames.bears_on_plan`); a plain path is cut, not normalised."""
    base = prefix if prefix.endswith("/") else prefix + "/"
    found: list[str] = []
    for location in locations:
        rest = location[len(base) :] if location.startswith(base) else ""
        if rest and "/." not in f"/{rest}" and "//" not in rest and not rest.endswith("/"):
            relative = rest  # no ".", ".." or empty name: what normalising it would give
        else:
            relative = relative_to_prefix(location, prefix) or ""
        if renames.bears_on_plan(relative, asked):
            found.append(location)
    return found


def _relative(inside: Containment, paths: Sequence[str]) -> frozenset[str]:
    return frozenset(r for r in map(inside.relative, paths) if r is not None)


def stage(
    env: Environment,
    root: Path,
    package: str,
    wheel: Wheel | None,
    changes: Sequence[UvChange],
    installed: Sequence[InstalledDistribution],
    affected: Sequence[InstalledDistribution],
    backup: Backup,
    known: Known | None,
) -> renames.Staged:
    """Check, verify and plan the staging tree in ``root/tree``: exactly the planned distributions, every
    file verified, nothing else. Raises NotStaged (the install then runs in the window) or StagedMismatch
    with the findings of a file that failed."""
    tree_path = root / renames.STAGED_TREE
    staged_env = renames.staging_environment(env, tree_path)
    staged = find_distributions(staged_env)
    versions = {c.name: c.version for c in changes if c.action != "uninstall"}
    if wheel is not None:
        versions[wheel.name] = wheel.version
    found = {(d.name, d.version) for d in staged}
    wanted = {(name, version) for name, version in versions.items()}
    if {n for n, _ in found} != set(versions) or any(
        v is not None and (n, v) not in found for n, v in wanted
    ):
        raise NotStaged(f"the staging tree holds {sorted(found)}, not the planned {sorted(wanted)}")
    # what uv wrote besides the RECORDs' files (bytecode, say: UV_COMPILE_BYTECODE) drops the swap
    inside_staged = Containment(tree_path)
    recorded = _relative(inside_staged, [loc for d in staged for loc in d.locations])
    with Tree(tree_path) as new:
        files, dirs = renames.walk_staged(new)
    if files != recorded:
        odd = sorted(files ^ recorded)[:3]
        raise NotStaged(f"the staging tree's files are not its RECORDs' ({', '.join(odd)})")
    names = [d.name for d in staged]
    first = [n for n in names if n == package]
    report = verify_environment(
        staged_env, first or names, wheel if first else None, installed=staged, known=known
    )
    rest = [n for n in names if n not in first]
    findings = list(report.findings)
    checked = sum(d.files_checked for d in report.distributions)
    if first and rest:
        others = verify_environment(staged_env, rest, installed=staged, known=known)
        findings += others.findings
        checked += sum(d.files_checked for d in others.distributions)
    failing = [f for f in findings if f.kind in _FAILING]
    if failing:
        listed = "; ".join(f"{f.kind.value} {f.path}" for f in failing[:5])
        raise StagedMismatch(listed)
    return plan_staged(env, root, files, dirs, checked, installed, affected, backup)


def plan_staged(
    env: Environment,
    root: Path,
    files: frozenset[str],
    dirs: frozenset[str],
    checked: int,
    installed: Sequence[InstalledDistribution],
    affected: Sequence[InstalledDistribution],
    backup: Backup,
) -> renames.Staged:
    """The swap of a staging tree checked and verified already (its ``files`` and ``dirs``, relative
    to ``root/tree``; ``checked`` files verified), planned against the environment as it is now: what
    each move replaces, the directories it keeps, the attic. Raises NotStaged."""
    tree_path = root / renames.STAGED_TREE
    inside = Containment(env.prefix)
    mine = {d.name for d in affected}
    old_files = _relative(inside, [loc for d in affected for loc in d.locations])
    unlisted = frozenset(f.path for f in backup.manifest.files if not f.listed)
    own = frozenset(backup.manifest.roots) | _relative(inside, [str(d.dist_info) for d in affected])
    # the other distributions' files that bear on the plan (lexically; each then checked as before)
    others = [loc for d in installed if d.name not in mine for loc in d.locations]
    held = _relative(inside, bearing(os.fspath(env.prefix), others, old_files | own))
    if any(path.startswith("include/") for path in files):  # uv's --prefix puts headers elsewhere
        raise NotStaged("the new version installs headers (include/)")
    with Tree(tree_path) as new:
        staged_entries = renames.entries(new, sorted(dirs))
    with Tree(env.prefix) as live, live.batch():
        there = renames.entries(live, sorted(dirs | own))
        differs = frozenset(
            d
            for d in dirs
            if d in there and there[d].kind == "dir" and there[d].owner != staged_entries[d].owner
        ) | _kept_directories(env.prefix, own, dirs, old_files)
        # the files' kinds only where the plan asks (each path by descriptor, as swap.entries)
        kinds = renames.LiveKinds(live, there)
        plan = renames.plan_swap(files, dirs, kinds, old_files, own, held | unlisted, differs)
    if plan.problems:
        raise NotStaged(plan.problems[0])
    with Tree(root) as staging_root:
        mount = staging_root.mount_id("")
    if mount is None:  # no /proc: a mount inside could not be told
        raise NotStaged("the mounts below the prefix cannot be told (/proc/self/fdinfo)")
    with Tree(env.prefix) as live:
        crossing = renames.crossings(live, plan, mount)
    if crossing:
        raise NotStaged(f"{crossing[0]} is on another mount than the prefix")
    try:
        renames.prepare_attic(root, plan, owner_ids(env))
    except WorkerError as exc:
        raise NotStaged(f"the attic could not be made: {exc.message}") from exc
    with Tree(tree_path) as new:
        ids = renames.identities(new, plan.moves)
    if len(ids) != len(plan.moves):
        raise NotStaged("an entry of the staging tree went away")
    return renames.Staged(root, plan, ids, checked)
