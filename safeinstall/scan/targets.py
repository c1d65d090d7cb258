"""What a process can be found using: each affected distribution as a :class:`Target` (its files' inodes
and paths, its directories, console scripts, modules), and the environment as an
:class:`EnvironmentScope`. Built once per run from the installed snapshot; stats files, reads nothing else."""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from stat import S_ISLNK

from safeinstall.env.containment import bases
from safeinstall.env.distributions import InstalledDistribution
from safeinstall.env.environment import Environment

#: Directories at the top of site-packages that never belong to one distribution.
_NEVER_OWNED = frozenset({"__pycache__", "..", "."})
_EXTENSION_SUFFIXES = (".so", ".pyd")


@dataclass(frozen=True, slots=True)
class Target:
    """One affected distribution, as the scan recognises it."""

    distribution: str  # canonical name
    version: str
    files: frozenset[str]  # absolute installed paths of its RECORD entries
    file_ids: frozenset[tuple[int, int]]  # (st_dev, st_ino) of those files that exist
    directories: tuple[str, ...]  # its own package directories inside site-packages (absolute)
    console_scripts: frozenset[str]  # absolute paths of its scripts
    modules: frozenset[str]  # import names that ``python -m`` may run (``pkg``, ``ns.sub``, ``mod``)
    interpreters: frozenset[str]  # the environment's interpreter paths
    #: (st_dev, st_ino) of the directories holding its files: tells a bind mount of this environment
    #: (same directory) from a hardlink twin in another one (another directory)
    directory_ids: frozenset[tuple[int, int]] = frozenset()
    #: for a distribution that only *requires* affected ones (``depends`` evidence): the chains from it
    #: to each, ``(("sicext", "sipure"),)``; empty for an affected distribution
    requires: tuple[tuple[str, ...], ...] = ()


def _is_dotted_identifier(parts: Iterable[str]) -> bool:
    parts = list(parts)
    return bool(parts) and all(part.isidentifier() for part in parts)


def _module_of_file(parts: tuple[str, ...]) -> str | None:
    """``a/b.py`` -> ``a.b``; ``x.cpython-311-x86_64-linux-gnu.so`` -> ``x``; anything else -> None."""
    name = parts[-1]
    if name.endswith(".py"):
        stem = name[:-3]
    elif name.endswith(_EXTENSION_SUFFIXES):
        stem = name.split(".", 1)[0]
    else:
        return None
    dotted = (*parts[:-1], stem)
    return ".".join(dotted) if _is_dotted_identifier(dotted) and stem != "__init__" else None


def _own_directories(
    entries: list[tuple[str, ...]], prefix: tuple[str, ...], shared: frozenset[tuple[str, ...]]
) -> list[tuple[str, ...]]:
    """The directories (as path parts) that belong to this distribution alone.

    A directory is descended into instead of owned when another distribution also has files under it,
    or when, at the top, it looks like a namespace package (no ``__init__.py`` but subdirectories)."""
    groups: dict[str, list[tuple[str, ...]]] = {}
    for parts in entries:
        if len(parts) > 1:
            groups.setdefault(parts[0], []).append(parts[1:])
    owned: list[tuple[str, ...]] = []
    for name in sorted(groups):
        if name in _NEVER_OWNED or (not prefix and name.endswith((".dist-info", ".egg-info", ".data"))):
            continue
        below = groups[name]
        here = (*prefix, name)
        has_init = ("__init__.py",) in below
        has_subdirs = any(len(parts) > 1 for parts in below)
        if here in shared or (not prefix and has_subdirs and not has_init):
            owned.extend(_own_directories(below, here, shared))
        else:
            owned.append(here)
    return owned


def _inside_site(dist: InstalledDistribution) -> list[tuple[str, ...]]:
    """RECORD paths that stay inside the site directory, normalised, as parts."""
    inside: list[tuple[str, ...]] = []
    for entry in dist.record.entries:
        relative = os.path.normpath(entry.path)
        if relative.startswith(("..", "/")) or relative == ".":
            continue
        inside.append(tuple(relative.split("/")))
    return inside


#: (site, directory parts) -> the ``.dist-info`` of each distribution with files under it
DirectoryOwners = Mapping[tuple[str, tuple[str, ...]], frozenset[str]]


def directory_owners(dists: Iterable[InstalledDistribution]) -> DirectoryOwners:
    """Pure: for every directory (parts, relative to its site) the distributions with files under it;
    computed once for an environment (vLLM's 198 RECORDs hold 68k paths), not once per target."""
    owners: dict[tuple[str, tuple[str, ...]], set[str]] = {}
    for dist in dists:
        site, name = str(dist.site), str(dist.dist_info)
        for parts in _inside_site(dist):
            for depth in range(1, len(parts)):
                owners.setdefault((site, parts[:depth]), set()).add(name)
    return {key: frozenset(names) for key, names in owners.items()}


def _shared_directories(dist: InstalledDistribution, owners: DirectoryOwners) -> frozenset[tuple[str, ...]]:
    """Directories (parts, relative to ``dist.site``) under which another distribution has files
    (``owners``: :func:`directory_owners` of the environment)."""
    site, name = str(dist.site), str(dist.dist_info)
    return frozenset(
        parts
        for (where, parts), names in owners.items()
        if where == site and (len(names) > 1 or name not in names)
    )


def _interpreter_names(env: Environment) -> frozenset[str]:
    major, minor, _ = env.version
    names = ("python", "python3", f"python{major}", f"python{major}.{minor}")
    found = {str(env.python), str(env.executable)}
    for directory in {str(env.scripts), str(env.python.parent)}:
        found.update(f"{directory}/{name}" for name in names)
    return frozenset(found)


def build_target(
    dist: InstalledDistribution,
    env: Environment,
    *,
    file_ids: Iterable[tuple[int, int]] = (),
    extra_interpreters: Iterable[str] = (),
    aliases: Iterable[str] = (),
    directory_ids: Iterable[tuple[int, int]] = (),
    requires: tuple[tuple[str, ...], ...] = (),
    owners: DirectoryOwners | None = None,
) -> Target:
    """Pure: ``dist`` described for the scan. ``owners`` (:func:`directory_owners`): a directory another
    distribution shares is not its own; ``file_ids`` and ``aliases`` (where installed symlinks lead) come from
    :func:`probe_files`."""
    installed = frozenset(dist.locations)
    files = installed | frozenset(aliases)
    inside = _inside_site(dist)
    owned = _own_directories(inside, (), _shared_directories(dist, owners or {}))
    site = str(dist.site)
    directories = tuple(sorted(os.path.join(site, *parts) for parts in owned))
    modules = {".".join(parts) for parts in owned if _is_dotted_identifier(parts)}
    owned_set = set(owned)
    for parts in inside:
        parents = {parts[:depth] for depth in range(1, len(parts))}
        if parents & owned_set or parts[0].endswith(".dist-info"):
            continue
        module = _module_of_file(parts)
        if module:
            modules.add(module)
    # scripts are looked for under both spellings of the scripts directory (resolved, and as given)
    script_dirs = {str(env.scripts), str(env.python.parent)}
    script_names = {os.path.basename(path) for path in installed if os.path.dirname(path) in script_dirs}
    script_names.update(dist.console_scripts)
    scripts = frozenset(f"{directory}/{name}" for directory in script_dirs for name in script_names)
    return Target(
        distribution=dist.name,
        version=dist.version,
        files=files,
        file_ids=frozenset(file_ids),
        directories=directories,
        console_scripts=scripts,
        modules=frozenset(modules),
        interpreters=_interpreter_names(env) | frozenset(extra_interpreters),
        directory_ids=frozenset(directory_ids),
        requires=requires,
    )


def probe_files(paths: Iterable[str]) -> tuple[frozenset[tuple[int, int]], frozenset[str]]:
    """The (st_dev, st_ino) of every existing path, and where the symlinks among them lead.

    Symlinks are followed, as the kernel does when it maps a file; both sets feed :func:`build_target`
    (``file_ids``, ``aliases``). One lstat per plain file."""
    ids: set[tuple[int, int]] = set()
    aliases: set[str] = set()
    for path in paths:
        try:
            st = os.lstat(path)
            if S_ISLNK(st.st_mode):
                aliases.add(os.path.realpath(path))
                st = os.stat(path)
        except OSError:
            continue
        ids.add((st.st_dev, st.st_ino))
    return frozenset(ids), frozenset(aliases)


def probe_directories(paths: Iterable[str]) -> frozenset[tuple[int, int]]:
    """The (st_dev, st_ino) of the directories holding ``paths`` (one stat per directory)."""
    ids: set[tuple[int, int]] = set()
    for directory in {os.path.dirname(path) for path in paths}:
        try:
            st = os.stat(directory)
        except OSError:
            continue
        ids.add((st.st_dev, st.st_ino))
    return frozenset(ids)


def load_targets(
    dists: Iterable[InstalledDistribution],
    env: Environment,
    installed: Iterable[InstalledDistribution],
    requires: Mapping[str, tuple[tuple[str, ...], ...]] | None = None,
    owners: DirectoryOwners | None = None,
) -> tuple[Target, ...]:
    """Targets for ``dists`` of ``env``, each file stated once; ``installed``: the environment's
    distributions. ``requires``: those that only require an affected one (their evidence becomes
    ``depends``)."""
    everything = list(installed)
    # Outside a venv the interpreter is the real binary: let /proc/PID/exe recognise it too.
    extra = () if env.is_venv else (os.path.realpath(env.executable),)
    targets: list[Target] = []
    owners = directory_owners(everything) if owners is None else owners  # once per environment
    for dist in dists:
        file_ids, aliases = probe_files(dist.locations)
        targets.append(
            build_target(
                dist,
                env,
                file_ids=file_ids,
                extra_interpreters=extra,
                aliases=aliases,
                directory_ids=probe_directories(dist.locations),
                requires=(requires or {}).get(dist.name, ()),
                owners=owners,
            )
        )
    return tuple(targets)


@dataclass(frozen=True, slots=True)
class EnvironmentScope:
    """The target environment as ``environment`` evidence recognises it."""

    prefix: str
    #: "<dir>/": a file mapped or open below one of these is the environment's (a venv: its prefix, both
    #: spellings; a system environment: its site directories, not /usr, which every process maps)
    roots: tuple[str, ...]
    interpreters: frozenset[str]  # absolute paths of its interpreter (see _interpreter_names)
    prefix_id: tuple[int, int] | None  # (st_dev, st_ino) of the prefix directory, None if unknown


def environment_scope(env: Environment) -> EnvironmentScope:
    """The scope of ``env`` (one stat of its prefix)."""
    if env.is_venv:
        directories = {str(env.prefix), os.path.normpath(str(env.python.parent.parent))}
    else:
        directories = {str(site) for site in env.site_dirs}
    extra = () if env.is_venv else (os.path.realpath(env.executable),)
    try:
        st = os.stat(env.prefix)
        prefix_id: tuple[int, int] | None = (st.st_dev, st.st_ino)
    except OSError:
        prefix_id = None
    return EnvironmentScope(
        prefix=str(env.prefix),
        roots=tuple(sorted(bases(directories))),
        interpreters=_interpreter_names(env) | frozenset(extra),
        prefix_id=prefix_id,
    )
