"""Which installed distributions require the affected ones, directly or through others. Pure.

A process that imported ``vllm`` imported ``transformers`` too (``depends`` evidence). Markers are
evaluated for the target environment, never for safeinstall's own."""

from __future__ import annotations

import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from packaging.markers import InvalidMarker, Marker, UndefinedComparison, UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from safeinstall.env.distributions import InstalledDistribution
from safeinstall.env.environment import Environment
from safeinstall.env.requirements import MAX_WEIGHED, WEIGHT_BYTES, extra_weight, line_weight, names_extra

#: the name at the start of a requirement that packaging cannot parse (kept: the safe side)
_NAME = re.compile(r"^\s*([A-Za-z0-9][A-Za-z0-9._-]*)")


@dataclass(frozen=True, slots=True)
class Required:
    """One ``Requires-Dist`` line, parsed: the name it requires and the marker that gates it."""

    name: str  # canonical
    marker: Marker | None
    extras: frozenset[str]  # extras of the required distribution it asks for


def marker_environment(env: Environment, uname: os.uname_result | None = None) -> dict[str, str]:
    """PEP 508 marker values of ``env`` (from its probe; release and version of the running kernel,
    which the environment shares: it runs on this host)."""
    major, minor, micro = env.version
    full = f"{major}.{minor}.{micro}"
    platform = env.platform  # sysconfig.get_platform(): "linux-x86_64", "macosx-11.0-arm64", "win-amd64"
    system = platform.split("-", 1)[0]
    sys_platform = {"macosx": "darwin", "win": "win32"}.get(system, system)
    machine = platform.rsplit("-", 1)[-1] if "-" in platform else ""
    kernel = uname or os.uname()
    implementation = env.implementation
    return {
        "implementation_name": implementation,
        "implementation_version": full,
        "os_name": "nt" if sys_platform == "win32" else "posix",
        "platform_machine": machine or kernel.machine,
        "platform_release": kernel.release,
        "platform_system": {"linux": "Linux", "darwin": "Darwin", "win32": "Windows"}.get(sys_platform, ""),
        "platform_version": kernel.version,
        "python_full_version": full,
        "platform_python_implementation": {"cpython": "CPython", "pypy": "PyPy"}.get(
            implementation, implementation
        ),
        "python_version": f"{major}.{minor}",
        "sys_platform": sys_platform,
    }


def parse_requirement(text: str) -> Required | None:
    """One ``Requires-Dist`` value; an unparsable one keeps its name and no marker (it counts)."""
    try:
        parsed = Requirement(text)
    except (InvalidRequirement, RecursionError):  # packaging 24 recurses on a nested marker
        match = _NAME.match(text)
        return Required(canonicalize_name(match.group(1)), None, frozenset()) if match else None
    extras = frozenset(canonicalize_name(e) for e in parsed.extras)
    return Required(canonicalize_name(parsed.name), parsed.marker, extras)


def _holds(marker: Marker | None, markers: Mapping[str, str], extra: str) -> bool:
    if marker is None:
        return True
    try:
        return marker.evaluate({**markers, "extra": extra})
    except (InvalidMarker, UndefinedComparison, UndefinedEnvironmentName, ValueError, RecursionError):
        return True  # cannot tell (ValueError: a version of over 4,300 digits): the safe side


#: an extra a marker names (``extra == "gpu"``)
_EXTRA = re.compile(r"extra\s*==\s*['\"]([^'\"]+)['\"]")


def _marker_extras(marker: Marker | None) -> set[str]:
    return {canonicalize_name(e) for e in _EXTRA.findall(str(marker or ""))}


def required_names(
    requirements: Iterable[Required], installed: frozenset[str], markers: Mapping[str, str]
) -> frozenset[str]:
    """The installed distributions these requirements (of one distribution) bring in, for ``markers``:
    the unconditional ones, and those of each extra whose every distribution is installed."""
    requirements = list(requirements)
    always = {r.name for r in requirements if _holds(r.marker, markers, "")}
    found = always & installed
    # a line whose marker names no extra holds alike for every extra: in ``always`` or never added
    gated = [r for r in requirements if r.marker is not None and names_extra(str(r.marker))]
    for extra in sorted({e for r in gated for e in _marker_extras(r.marker)}):
        added = {r.name for r in gated if _holds(r.marker, markers, extra)} - always
        if added and added <= installed:
            found |= added
    return frozenset(found)


@dataclass(frozen=True, slots=True)
class Dependents:
    """:func:`weigh_dependents`'s answer: the chains, and the distributions whose requirements weighed
    past what was left of :data:`~safeinstall.env.requirements.MAX_WEIGHED` (each taken to require every
    installed distribution its lines name, the safe side)."""

    chains: dict[str, tuple[tuple[str, ...], ...]]
    unweighed: tuple[str, ...]

    def note(self) -> str | None:
        """The plan's warning for what was not weighed (None: everything was)."""
        if not self.unweighed:
            return None
        shown = ", ".join(self.unweighed[:5]) + (
            f" and {len(self.unweighed) - 5} more" if len(self.unweighed) > 5 else ""
        )
        return (
            f"dependents not all weighed: the requirements of {shown} weigh more than was left of "
            f"{MAX_WEIGHED} (4 a line for its parse, its base and each extra its markers name, 1 more "
            f"per {WEIGHT_BYTES} bytes): each taken to require every installed distribution it names"
        )


def _extras_weight(parsed: Iterable[Required], requires: tuple[str, ...]) -> int:
    """Pure: what :func:`required_names` weighs for the extras the markers of ``parsed`` name: the
    lines that name one (:func:`~safeinstall.env.requirements.extra_weight`) for each extra."""
    named = {e for r in parsed if r.marker is not None for e in _marker_extras(r.marker)}
    return len(named) * extra_weight(requires) if named else 0


def _required(
    requires: tuple[str, ...], installed: frozenset[str], markers: Mapping[str, str], left: int
) -> tuple[frozenset[str] | None, int]:
    """Pure: :func:`required_names` of ``requires`` and what it weighed, or None where that weighs more
    than ``left`` (and what finding it out weighed: the parse)."""
    base = sum(map(line_weight, requires))  # the parse, then the base's evaluation
    if base * 2 > left:
        return None, 0
    parsed = [r for r in map(parse_requirement, requires) if r is not None]
    weight = base * 2 + _extras_weight(parsed, requires)
    if weight > left:
        return None, base
    return required_names(parsed, installed, markers), weight


def _named(requires: Iterable[str]) -> frozenset[str]:
    """Pure: every name ``requires`` begin with (the safe side where they are not weighed)."""
    return frozenset(canonicalize_name(m.group(1)) for m in map(_NAME.match, requires) if m)


def dependents(
    installed: Iterable[InstalledDistribution], wanted: Iterable[str], markers: Mapping[str, str]
) -> dict[str, tuple[tuple[str, ...], ...]]:
    """:func:`weigh_dependents`'s chains."""
    return weigh_dependents(installed, wanted, markers).chains


def weigh_dependents(
    installed: Iterable[InstalledDistribution], wanted: Iterable[str], markers: Mapping[str, str]
) -> Dependents:
    """Every installed distribution that requires one of ``wanted``, directly or transitively (one of
    ``wanted`` itself excluded), with the shortest chain to each: ``{"vllm": (("vllm", "transformers"),)}``,
    or ``("app", "lib", "transformers")`` through ``lib``. Within :data:`MAX_WEIGHED` in all: a
    distribution whose requirements weigh more than is left requires every name they list."""
    dists = list(installed)
    names = frozenset(d.name for d in dists)
    required_by: dict[str, set[str]] = {}
    left = MAX_WEIGHED
    unweighed: list[str] = []
    for dist in dists:
        required, spent = _required(dist.requires, names, markers, left)
        left -= spent
        if required is None:  # the safe side
            unweighed.append(dist.name)
            required = _named(dist.requires) & names
        for name in required - {dist.name}:
            required_by.setdefault(name, set()).add(dist.name)
    targets: list[str] = sorted({canonicalize_name(w) for w in wanted})
    chains: dict[str, dict[str, tuple[str, ...]]] = {}
    for target in targets:
        frontier: list[tuple[str, ...]] = [(target,)]
        seen = {target}
        while frontier:  # breadth first: the shortest chain to each dependent
            following: list[tuple[str, ...]] = []
            for chain in frontier:
                for requirer in sorted(required_by.get(chain[0], ())):
                    if requirer in seen:
                        continue
                    seen.add(requirer)
                    longer = (requirer, *chain)
                    following.append(longer)
                    if requirer not in targets:
                        chains.setdefault(requirer, {})[target] = longer
            frontier = following
    return Dependents(
        {name: tuple(found[t] for t in sorted(found)) for name, found in sorted(chains.items())},
        tuple(sorted(unweighed)),
    )


def describe_chain(chain: tuple[str, ...]) -> str:
    """``("app", "lib", "sipure")`` -> ``"which requires sipure (through lib)"``."""
    through = f" (through {', '.join(chain[1:-1])})" if len(chain) > 2 else ""
    return f"which requires {chain[-1]}{through}"
