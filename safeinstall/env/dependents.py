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
    except InvalidRequirement:
        match = _NAME.match(text)
        return Required(canonicalize_name(match.group(1)), None, frozenset()) if match else None
    extras = frozenset(canonicalize_name(e) for e in parsed.extras)
    return Required(canonicalize_name(parsed.name), parsed.marker, extras)


def _holds(marker: Marker | None, markers: Mapping[str, str], extra: str) -> bool:
    if marker is None:
        return True
    try:
        return marker.evaluate({**markers, "extra": extra})
    except (InvalidMarker, UndefinedComparison, UndefinedEnvironmentName, ValueError):
        return True  # cannot tell (ValueError: a version of over 4,300 digits): the safe side


def _marker_extras(marker: Marker | None) -> set[str]:
    return {canonicalize_name(e) for e in re.findall(r"extra\s*==\s*['\"]([^'\"]+)['\"]", str(marker or ""))}


def required_names(
    requirements: Iterable[Required], installed: frozenset[str], markers: Mapping[str, str]
) -> frozenset[str]:
    """The installed distributions these requirements (of one distribution) bring in, for ``markers``:
    the unconditional ones, and those of each extra whose every distribution is installed."""
    requirements = list(requirements)
    always = {r.name for r in requirements if _holds(r.marker, markers, "")}
    found = always & installed
    for extra in sorted({e for r in requirements for e in _marker_extras(r.marker)}):
        added = {r.name for r in requirements if _holds(r.marker, markers, extra)} - always
        if added and added <= installed:
            found |= added
    return frozenset(found)


def dependents(
    installed: Iterable[InstalledDistribution], wanted: Iterable[str], markers: Mapping[str, str]
) -> dict[str, tuple[tuple[str, ...], ...]]:
    """Every installed distribution that requires one of ``wanted``, directly or transitively (one of
    ``wanted`` itself excluded), with the shortest chain to each: ``{"vllm": (("vllm", "transformers"),)}``,
    or ``("app", "lib", "transformers")`` through ``lib``."""
    dists = list(installed)
    names = frozenset(d.name for d in dists)
    required_by: dict[str, set[str]] = {}
    for dist in dists:
        parsed = [r for r in map(parse_requirement, dist.requires) if r is not None]
        for name in required_names(parsed, names, markers) - {dist.name}:
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
    return {name: tuple(found[t] for t in sorted(found)) for name, found in sorted(chains.items())}


def describe_chain(chain: tuple[str, ...]) -> str:
    """``("app", "lib", "sipure")`` -> ``"which requires sipure (through lib)"``."""
    through = f" (through {', '.join(chain[1:-1])})" if len(chain) > 2 else ""
    return f"which requires {chain[-1]}{through}"
