"""Whether every requirement of an environment holds, as ``uv pip check`` would say it, before and after
a run's change. Pure.

A requirement that cannot be parsed is never blamed. docs/reinstall.md ("Requirements")."""

from __future__ import annotations

import collections
import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from packaging.markers import InvalidMarker, UndefinedComparison, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from safeinstall.env.distributions import InstalledDistribution


@dataclass(frozen=True, slots=True)
class Dist:
    """One distribution as the check sees it: its name (canonical), version and ``Requires-Dist``."""

    name: str
    version: str
    requires: tuple[str, ...]
    display_name: str = ""


@dataclass(frozen=True, slots=True)
class Broken:
    """One requirement that does not hold: ``requirer`` (as said: name, extra, version) requires
    ``requirement`` (as written, marker aside); the required distribution is at ``found`` (None: not
    installed). ``key``: the same requirement whatever the versions."""

    key: tuple[str, str, str, str]  # requirer (canonical), its extra, required (canonical), requirement
    requirer: str
    requirement: str
    required: str
    found: str | None

    def describe(self) -> str:
        found = "is not installed" if self.found is None else f"would be {self.found}"
        return f"{self.requirer} requires {self.requirement}, {self.required} {found}"


@functools.lru_cache(maxsize=16384)
def _requirement(text: str) -> Requirement | None:
    """``text`` parsed (None: it cannot be). Cached: a check parses each line once for the state before
    and the one after, whatever the extras asked of it."""
    try:
        return Requirement(text)
    except (InvalidRequirement, RecursionError):  # packaging 24 recurses on a nested marker
        return None


def _parsed(text: str, extra: str, markers: tuple[tuple[str, str], ...]) -> Requirement | None:
    """``text`` parsed, where it applies for ``markers`` and ``extra`` (None: it does not, or cannot be
    parsed). A line that does not name ``extra`` is the same for every extra: the base's, never an
    extra's (not even parsed again)."""
    if extra and not names_extra(text):
        return None
    requirement = _requirement(text)
    return requirement if requirement is not None and _applies(requirement, dict(markers), extra) else None


#: The most one look at an environment's requirements weighs (here, and each survey of dependents,
#: :mod:`safeinstall.env.dependents`): :func:`line_weight` for each line weighed, base or extra. Every
#: extra another line asks for has the lines of its distribution that name an extra weighed again: the
#: owner's METADATA of N lines ``zzI; extra == "eI"`` made N * N (3,200 lines: 40 s); a marker costs by
#: its size (2,000 terms, 50 kB: 12 ms an evaluation; the attacker reviews). A unit is some 4 us at
#: worst: the bound some 2 s. vLLM's whole environment weighs about 10,000 pairs (some 100,000).
MAX_WEIGHED = 400_000

#: A line weighs one more for each this many bytes (a marker's comparison costs some 12 us, 25 bytes).
WEIGHT_BYTES = 8


def line_weight(text: str) -> int:
    """Pure: what one parse or evaluation of a ``Requires-Dist`` line weighs against :data:`MAX_WEIGHED`
    (a parse of a short line costs four evaluations of its marker)."""
    return 4 + len(text) // WEIGHT_BYTES


def names_extra(text: str) -> bool:
    """Pure: whether a ``Requires-Dist`` line may name an extra (False: it holds alike for every extra)."""
    return "extra" in text


def extra_weight(requires: Iterable[str]) -> int:
    """Pure: what weighing ``requires`` for one extra weighs: the lines that name one, and 1 for each
    other line (passed over unparsed)."""
    return sum(line_weight(text) if names_extra(text) else 1 for text in requires)


def _applies(requirement: Requirement, markers: Mapping[str, str], extra: str) -> bool:
    if requirement.marker is None:
        return not extra  # an unconditional requirement belongs to the base, not to an extra
    try:
        holds = requirement.marker.evaluate({**markers, "extra": extra})
        return holds if not extra else holds and not requirement.marker.evaluate({**markers, "extra": ""})
    except (InvalidMarker, UndefinedComparison, UndefinedEnvironmentName, ValueError, RecursionError):
        return False  # cannot tell (ValueError: a version of over 4,300 digits, int() refuses): not blamed


def _without_marker(requirement: Requirement) -> str:
    extras = f"[{','.join(sorted(requirement.extras))}]" if requirement.extras else ""
    return f"{requirement.name}{extras}{requirement.specifier}"


def _satisfied(requirement: Requirement, version: str) -> bool | None:
    """Whether ``version`` meets the requirement's specifier (pre-releases allowed, as an installed one
    is what it is); None when the version is not PEP 440 (not judged)."""
    if requirement.url:
        return True  # a direct reference names no version to compare
    try:
        return requirement.specifier.contains(Version(version), prereleases=True)
    except ValueError:  # InvalidVersion, or a version (either side) of over 4,300 digits: int() refuses
        return None


def weighed_requirements(
    dists: Iterable[Dist], markers: Mapping[str, str]
) -> tuple[tuple[Broken, ...], bool]:
    """Pure: every requirement of ``dists`` (an environment's whole set) that the set does not meet, for
    the target's ``markers``, sorted; and whether every requirement was weighed (False: past
    :data:`MAX_WEIGHED`, the base requirements first, the rest not)."""
    by_name = {d.name: d for d in dists}
    base = {d.name: sum(map(line_weight, d.requires)) for d in by_name.values()}
    # an extra's pass goes over the lines that name one alone, picked out once (not scanned again)
    gated = {d.name: tuple(t for t in d.requires if names_extra(t)) for d in by_name.values()}
    extras = {name: 1 + sum(map(line_weight, lines)) for name, lines in gated.items()}
    wanted: set[tuple[str, str]] = {(name, "") for name in by_name}  # (distribution, extra) whose needs count
    todo = collections.deque(sorted(wanted))  # first in, first out: the base requirements first
    found: dict[tuple[str, str, str, str], Broken] = {}
    frozen = tuple(sorted(markers.items()))
    weighed = 0
    while todo:
        name, extra = todo.popleft()
        dist = by_name[name]
        weighed += extras[name] if extra else base[name]
        if weighed > MAX_WEIGHED:
            return tuple(found[key] for key in sorted(found)), False
        for text in gated[name] if extra else dist.requires:
            requirement = _parsed(text, extra, frozen)
            if requirement is None:
                continue
            required = canonicalize_name(requirement.name)
            present = by_name.get(required)
            shown = f"{dist.display_name or dist.name}{f'[{extra}]' if extra else ''} {dist.version}"
            said = _without_marker(requirement)
            key = (dist.name, extra, required, said)
            if present is None:
                found.setdefault(key, Broken(key, shown, said, required, None))
                continue
            weighed += len(present.version) // WEIGHT_BYTES  # its parse and comparison, by its size
            if weighed > MAX_WEIGHED:
                return tuple(found[key] for key in sorted(found)), False
            if _satisfied(requirement, present.version) is False:
                found.setdefault(key, Broken(key, shown, said, required, present.version))
            for asked in sorted(canonicalize_name(e) for e in requirement.extras):
                if (required, asked) not in wanted:
                    wanted.add((required, asked))
                    todo.append((required, asked))
    return tuple(found[key] for key in sorted(found)), True


@dataclass(frozen=True, slots=True)
class RequirementsCheck:
    """What a change does to the environment's requirements: ``broken`` by it, and ``already`` broken
    before it (said as such, not blamed on the run)."""

    broken: tuple[Broken, ...]
    already: tuple[Broken, ...]
    complete: bool = True  # False: past MAX_WEIGHED, not every requirement was weighed


def check_change(
    installed: Iterable[Dist], after: Mapping[str, Dist | None], markers: Mapping[str, str]
) -> RequirementsCheck:
    """Pure: the environment ``installed``, then with each distribution of ``after`` in place of its
    installed namesake (None: removed): the requirements the change breaks, and those broken before it
    (a requirement broken both before and after is the latter, whatever version it finds)."""
    before = {d.name: d for d in installed}
    changed = {name: dist for name, dist in {**before, **after}.items() if dist is not None}
    was, complete_before = weighed_requirements(before.values(), markers)
    now, complete_after = weighed_requirements(changed.values(), markers)
    old = {b.key for b in was}
    return RequirementsCheck(
        broken=tuple(b for b in now if b.key not in old),
        already=tuple(b for b in now if b.key in old),
        complete=complete_before and complete_after,
    )


#: what a user can do about a broken requirement: --with-deps resolves only what the new versions
#: themselves require, never a distribution that requires them
FIXES = (
    "choose a version the requirer accepts, or change the requirer too; where the new version is the "
    "requirer, --with-deps lets uv bring what it needs; --allow-broken-requirements goes on knowingly"
)


def refusal(check: RequirementsCheck, allowed: bool) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """Pure: the plan's refusals and warnings for ``check``; ``allowed`` (``--allow-broken-requirements``):
    what the run breaks is a warning instead."""
    warnings = [f"requirement already broken before the run: {b.describe()}" for b in check.already]
    if not check.complete:
        warnings.append(
            f"requirements not all checked: the environment's METADATA weigh more than {MAX_WEIGHED} "
            f"(4 for each requirement weighed, base or extra, 1 more per {WEIGHT_BYTES} bytes of its line)"
        )
    if not check.broken:
        return (), tuple(warnings)
    said = "; ".join(b.describe() for b in check.broken)
    if allowed:
        return (), (f"the run breaks a requirement (--allow-broken-requirements): {said}", *warnings)
    return (f"the run would break a requirement: {said} ({FIXES})",), tuple(warnings)


def as_dists(installed: Iterable[InstalledDistribution]) -> tuple[Dist, ...]:
    """The check's view of installed distributions."""
    return tuple(Dist(d.name, d.version, d.requires, d.display_name) for d in installed)
