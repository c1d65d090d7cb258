"""Requirements hold after the run: what a change does to the environment's requirements, said by the
plan and checked again once the new versions are fetched.

Nothing of the environment is run (:mod:`safeinstall.env.requirements`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

from packaging.utils import parse_wheel_filename

from safeinstall.env.dependents import marker_environment
from safeinstall.env.distributions import (
    METADATA_LIMIT,
    InstalledDistribution,
    MetadataReader,
    dist_info_name,
    metadata_values,
)
from safeinstall.env.environment import Environment
from safeinstall.env.requirements import Dist, as_dists, check_change, refusal
from safeinstall.env.uvplan import UvChange
from safeinstall.env.wheel import Wheel
from safeinstall.store.backup import Backup
from safeinstall.system.safefs import read_small


def _backup_requires(backup: Backup, dist_info: str) -> tuple[str, ...] | None:
    """The ``Requires-Dist`` of a saved distribution (root's own backup directory), None if unread."""
    try:
        text = read_small(backup.files_dir / dist_info / "METADATA", METADATA_LIMIT)
    except OSError:
        return None
    return metadata_values(text.decode("utf-8", errors="replace"), "Requires-Dist")


def _version_of(change: UvChange, wheel: Wheel | None) -> str | None:
    """The version a change installs where uv's plan names none (a wheel given by its path)."""
    if wheel is not None and wheel.name == change.name:
        return wheel.version
    source = (change.source or "").rsplit("/", 1)[-1]
    try:
        return str(parse_wheel_filename(source)[1]) if source.endswith(".whl") else None
    except ValueError:  # InvalidWheelFilename, or a version of over 4,300 digits (int() refuses)
        return None


def after_change(
    installed: Sequence[Dist],
    changes: Iterable[UvChange],
    wheel: Wheel | None = None,
    backup: Backup | None = None,
    fetched: Mapping[str, tuple[str, ...]] | None = None,
) -> tuple[dict[str, Dist | None], tuple[str, ...]]:
    """What each changed distribution becomes (None: uninstalled), and the names whose requirements are
    not known yet (a version fetched only by the run: checked again once it is)."""
    by_name = {d.name: d for d in installed}
    saved = {d.name: d.dist_info for d in backup.manifest.distributions} if backup is not None else {}
    after: dict[str, Dist | None] = {}
    unknown: list[str] = []
    for change in changes:
        if change.action == "uninstall":
            after.setdefault(change.name, None)
            continue
        old = by_name.get(change.name)
        version = change.version or _version_of(change, wheel) or (old.version if old is not None else "")
        requires: tuple[str, ...] | None = None
        if fetched is not None and change.name in fetched:
            requires = fetched[change.name]
        elif wheel is not None and wheel.name == change.name:
            requires = wheel.requires
        elif change.name in saved and backup is not None:
            requires = _backup_requires(backup, saved[change.name])
        elif old is not None and old.version == version:
            requires = old.requires
        if requires is None:
            unknown.append(change.name)
        display = old.display_name if old is not None else change.name
        after[change.name] = Dist(change.name, version, requires or (), display)
    return after, tuple(unknown)


def plan_said(
    env: Environment,
    installed: Iterable[InstalledDistribution],
    changes: Iterable[UvChange],
    allowed: bool,
    wheel: Wheel | None = None,
    backup: Backup | None = None,
    resolved: bool = True,
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The plan's refusals and warnings for the run's change (before anything stops). ``resolved``: uv
    resolved the new versions' own requirements (not told ``--no-deps``); else those the plan cannot
    know yet are said to be checked once fetched."""
    dists = as_dists(installed)
    after, unknown = after_change(dists, changes, wheel, backup)
    refused, warnings = refusal(check_change(dists, after, marker_environment(env)), allowed)
    if unknown and not resolved:
        warnings = (
            *warnings,
            f"the requirements of the new {', '.join(unknown)} are checked once fetched, before the stop",
        )
    return refused, warnings


def fetched_requires(
    env: Environment, sites: Sequence[Path], names: Iterable[str]
) -> dict[str, tuple[str, ...]]:
    """The ``Requires-Dist`` of each of ``names`` as uv laid it out in ``sites`` (the staging tree's or
    the ``--target`` directory), read as the environment's owner would (never run)."""
    wanted = set(names)
    reader = MetadataReader.of(env)
    found: dict[str, tuple[str, ...]] = {}
    for site in sites:
        try:
            entries = sorted(site.iterdir())
        except OSError:
            continue
        for entry in entries:
            name = dist_info_name(entry.name)
            if name is None or name not in wanted or name in found:
                continue
            text = reader.text(entry / "METADATA")
            if text is not None:
                found[name] = metadata_values(text, "Requires-Dist")
    return found


def unknown_requires(
    installed: Iterable[InstalledDistribution], changes: Iterable[UvChange], wheel: Wheel | None
) -> tuple[str, ...]:
    """The changed distributions whose new requirements the plan could not know (fetched by the run)."""
    return after_change(as_dists(installed), changes, wheel)[1]


def fetched_said(
    env: Environment,
    installed: Iterable[InstalledDistribution],
    changes: Iterable[UvChange],
    allowed: bool,
    sites: Sequence[Path],
) -> tuple[str | None, tuple[str, ...]]:
    """Once uv has laid the new versions out in ``sites`` (before the stop): the refusal when the change
    breaks a requirement (None: it does not, or ``allowed``), and what to note (what it breaks, allowed)."""
    dists = as_dists(installed)
    changes = tuple(changes)
    _, unknown = after_change(dists, changes)
    fetched = fetched_requires(env, sites, unknown)
    after, _ = after_change(dists, changes, fetched=fetched)
    check = check_change(dists, after, marker_environment(env))
    refused, warnings = refusal(check, allowed)
    notes = tuple(w for w in warnings if not w.startswith("requirement already broken"))  # said by the plan
    return (refused[0] if refused else None), notes
