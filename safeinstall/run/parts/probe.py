"""The probe tree: the smoke check's throwaway copy of the staging tree, installed by uv from links of
root's own cache while the fill still copies it, so that the check and the copy overlap. Nothing of it
goes live; its verdict stands only where it holds the bytes the staging tree holds. Why and what is
compared: docs/window.md ("The smoke check beside the fill's copy").
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from safeinstall.env import cachefill, owner, renames
from safeinstall.env.containment import Containment
from safeinstall.env.environment import Environment
from safeinstall.env.uvplan import UvChange, UvRequest, prefetch_command, uv_binary
from safeinstall.env.uvplan import install as uv_install
from safeinstall.run.parts import staging
from safeinstall.store.state import RUN_DIR_REMOVAL_S, EnvironmentState, make_run_dir, remove_run_dir
from safeinstall.system import worker
from safeinstall.system.safefs import Tree
from safeinstall.system.worker import WorkerError

#: How long the probe's cache of links may take to make (vLLM's 29k files: about a second)
LINK_TIMEOUT_S = 120.0
#: A RECORD larger than this is not compared (the check then runs on the staging tree)
RECORD_LIMIT = 64 << 20


@dataclass(frozen=True, slots=True)
class Probe:
    """The probe: its staging directory in the prefix, its cache of links in the state directory, and
    the unpacked wheels of root's cache it linked (``archive-vN/ID``)."""

    root: Path
    cache: Path
    linked: frozenset[str]
    #: ``(archive, print)`` of each linked one once linked (:func:`owner.archive_print`)
    prints: tuple[tuple[str, str], ...] = ()


def refusal(
    env: Environment, link_mode: str, filling: bool, staged: bool, no_smoke: bool, wheel: bool, network: bool
) -> str | None:
    """Pure: why the run makes no probe (None: it makes one): only for a root-owned environment whose
    run swaps, links from its cache, checks the new version and fills its cache from root's; not for a
    wheel given by its path (uv would unpack it a second time for the probe), nor where uv's arguments
    choose the network or a cache (``--no-offline`` would undo the probe's ``--offline``)."""
    if no_smoke:
        return "--no-smoke"
    if network:
        return "uv's arguments choose the network or a cache"
    if env.account is not None:
        return "the environment is an account's"
    if link_mode != "hardlink" or not staged:
        return "the run does not swap from a cache it links"
    if not filling:
        return "the run's cache is not filled from root's"
    if wheel:
        return "a wheel is given by its path"
    return None


def offline(command: list[str]) -> list[str]:
    """Pure: uv's install ``command`` (``uv pip install ...``) told to fetch nothing (once: uv refuses
    an option given twice)."""
    return command if "--offline" in command else [*command[:3], "--offline", *command[3:]]


def make(
    env: Environment,
    state: EnvironmentState,
    run_id: str,
    source: Path,
    request: UvRequest,
    changes: tuple[UvChange, ...],
    environ: Mapping[str, str],
    log: list[str],
) -> Probe | None:
    """The probe made: its directory, its cache of root's links, uv's offline install of the prefetch's
    command into its tree. None when anything fails (what was made is
    removed; why, in ``log``): the check then waits for the staging tree, as without a probe."""
    try:
        root = staging.make_probe(env, run_id)
    except (staging.NotStaged, OSError) as exc:
        log.append(f"no probe: {exc}")
        return None
    cache = state.probe_cache(run_id)
    probe = Probe(root, cache, frozenset())
    try:
        make_run_dir(cache, None)
        want = cachefill.wanted(changes)
        text_source, text_cache = str(source), str(cache)
        answer = worker.call(
            None,
            lambda: owner.link_cached_wheels(text_source, text_cache, want),
            timeout=LINK_TIMEOUT_S,
            what=f"links cached wheels of {source}",
        )
        listed = answer.get("archives") if isinstance(answer, dict) else None
        if not isinstance(listed, list) or not all(isinstance(a, str) for a in listed):
            log.append("no probe: the worker's answer was not understood")
            discard(env, probe)
            return None
        probe = Probe(root, cache, frozenset(listed), cachefill.prints_of(answer.get("prints")))
        command = prefetch_command(request, uv_binary(), root / renames.STAGED_TREE, changes, staging=True)
        log.append(f"probe (UV_CACHE_DIR={cache}): " + " ".join(offline(command)))
        result = uv_install(offline(command), environ, cache_dir=cache)
    except (OSError, WorkerError) as exc:
        log.append(f"no probe: {exc}")
        discard(env, probe)
        return None
    except BaseException:  # a signal while uv installs it: nothing of the probe outlives the step
        discard(env, probe)
        raise
    if result.returncode != 0:
        tail = " ".join(result.output.strip().splitlines()[-2:])
        log.append(
            f"no probe: uv could not install it offline from root's cache (exit {result.returncode}; {tail})"
        )
        discard(env, probe)
        return None
    log.append(f"probe: {root} installed offline from links of {source} ({len(listed)} unpacked wheel(s))")
    return probe


def discard(env: Environment, probe: Probe | None) -> list[str]:
    """The probe's tree and cache removed, by descriptor, never following a link; what is left, said."""
    if probe is None:
        return []
    left: list[str] = []
    if not renames.discard_staging(env.prefix, probe.root.name, RUN_DIR_REMOVAL_S, staging.owner_ids(env)):
        left.append(f"the probe tree {probe.root} could not be removed: remove it by hand")
    if not remove_run_dir(probe.cache):
        left.append(f"the probe's cache {probe.cache} could not be removed (the next run removes it)")
    return left


def records(env: Environment, root: Path) -> dict[str, bytes]:
    """Every ``*.dist-info/RECORD`` of the staging directory ``root``'s tree, by its path in the tree,
    read by descriptor (never through a link). Raises OSError."""
    tree_path = root / renames.STAGED_TREE
    staged = renames.staging_environment(env, tree_path)
    inside = Containment(tree_path)
    sites = [r for r in dict.fromkeys(inside.relative(str(p)) for p in (staged.purelib, staged.platlib)) if r]
    found: dict[str, bytes] = {}
    with Tree(tree_path) as tree:
        for site in sites:
            if not tree.is_dir(site):
                continue
            for name in tree.names(site):
                if name.endswith(".dist-info"):
                    found[f"{site}/{name}"] = tree.read_bytes(f"{site}/{name}/RECORD", RECORD_LIMIT)
    return found


def verdict_problem(
    filled: cachefill.Filled | None,
    linked: frozenset[str],
    prints: Sequence[tuple[str, str]],
    probe: Mapping[str, bytes],
    staged: Mapping[str, bytes],
) -> str | None:
    """Pure: why the check on the probe does not stand for the staging tree (None: it does): the fill
    must have copied, found nothing damaged, and copied every unpacked wheel the probe linked, each with
    the print the probe linked (``prints``); the two trees must hold the same distributions (some) with
    byte-identical RECORDs."""
    if filled is None or filled.problem is not None:
        return "the fill copied nothing from root's cache"
    if filled.damaged:
        return f"root's cache holds a changed copy of {', '.join(filled.damaged)}"
    if not linked <= set(filled.taken):
        return "the probe linked an unpacked wheel that the fill did not copy"
    copied, printed = dict(filled.prints), dict(prints)
    changed = sorted(a for a in linked if copied.get(a) is None or copied.get(a) != printed.get(a))
    if changed:
        return f"root's cache changed {changed[0]} between the fill's copy and the probe's links"
    if not staged or set(probe) != set(staged):
        return f"the probe holds {sorted(probe)}, the staging tree {sorted(staged)}"
    differ = sorted(name for name in staged if staged[name] != probe[name])
    if differ:
        return f"{differ[0]}/RECORD differs from the staging tree's"
    return None


def changed_since_linked(probe: Probe) -> str | None:
    """Why the probe's links of root's cache are no longer what the fill copied (None: each linked
    archive has the print it had once linked): a write in place while the check ran (by root's own
    processes, or by the check itself through the links). Never raises."""
    for archive, linked in probe.prints:
        try:
            now = owner.archive_print(probe.cache / archive)
        except OSError as exc:
            return f"{archive} of the probe's cache could not be walked: {exc}"
        if now != linked:
            return (
                f"a file of root's uv cache ({archive}) was written in place while the check ran on the probe"
            )
    return None
