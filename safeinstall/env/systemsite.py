"""A system Python: the distributions dpkg owns (its database read as data, never run) and the
interpreter's PEP 668 ``EXTERNALLY-MANAGED`` marker."""

from __future__ import annotations

import os
import stat
import textwrap
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from safeinstall.env.distributions import InstalledDistribution
from safeinstall.env.environment import Environment
from safeinstall.errors import ExternallyManagedError, SystemPackageError
from safeinstall.system.safefs import read_small

DPKG_INFO = Path("/var/lib/dpkg/info")
#: The most of one ``.list`` file read (the largest on a Debian host are a few MiB), and of them all
LIST_LIMIT = 32 << 20
LISTS_LIMIT = 512 << 20
#: The most of one ``.md5sums`` file read (dpkg's own md5 of each file of a package)
MD5SUMS_LIMIT = 32 << 20
#: The most of an ``EXTERNALLY-MANAGED`` marker read (Debian's is 600 bytes)
MARKER_LIMIT = 64 << 10
MARKER = "EXTERNALLY-MANAGED"
BREAK_SYSTEM_PACKAGES = "--break-system-packages"


@dataclass(frozen=True, slots=True)
class SystemPackage:
    """The system package that installed a distribution."""

    manager: str  # "dpkg"
    package: str  # "python3-yaml"

    @property
    def check(self) -> str:
        """The command that checks its files against the package manager's own sums."""
        return f"debsums {self.package}"


def dpkg_package_name(list_file: str) -> str | None:
    """Pure: the package a ``.list`` file of dpkg's database is for (``libc6:amd64.list`` -> ``libc6``)."""
    if not list_file.endswith(".list") or list_file.startswith("."):
        return None
    return list_file[: -len(".list")].partition(":")[0] or None


def owners_in(listing: str, package: str, wanted: Collection[str]) -> dict[str, str]:
    """Pure: which of ``wanted`` (absolute paths) one package's ``.list`` text names, each to ``package``."""
    return {line: package for line in listing.splitlines() if line in wanted}


def dpkg_owners(paths: Iterable[Path], info_dir: Path = DPKG_INFO) -> dict[Path, SystemPackage]:
    """The dpkg package that owns each of ``paths`` (those it owns; none where there is no dpkg). Only
    root-owned regular files are read, each up to :data:`LIST_LIMIT`, all up to :data:`LISTS_LIMIT`."""
    wanted = {os.fspath(p) for p in paths}
    if not wanted:
        return {}
    try:
        names = sorted(os.listdir(info_dir))
    except OSError:
        return {}
    found: dict[str, str] = {}
    left = LISTS_LIMIT
    for name in names:
        package = dpkg_package_name(name)
        if package is None or left <= 0:
            continue
        path = info_dir / name
        try:
            info = os.lstat(path)
            if not stat.S_ISREG(info.st_mode) or info.st_uid != 0:
                continue
            data = read_small(path, min(LIST_LIMIT, left))
        except OSError:
            continue
        left -= len(data)
        found.update(owners_in(data.decode("utf-8", "replace"), package, wanted - set(found)))
    return {Path(path): SystemPackage("dpkg", package) for path, package in found.items()}


def md5sums_entries(text: str) -> dict[str, str]:
    """Pure: a dpkg ``.md5sums`` text (``HEX  usr/lib/...``, one file a line) as absolute path -> md5
    (lowercase hex); a line that is not one is skipped."""
    found: dict[str, str] = {}
    for line in text.splitlines():
        digest, separator, path = line.partition("  ")
        digest = digest.lower()
        if separator and path and len(digest) == 32 and all(c in "0123456789abcdef" for c in digest):
            found["/" + path.lstrip("/")] = digest
    return found


def dpkg_md5sums(package: SystemPackage, info_dir: Path = DPKG_INFO) -> dict[str, str]:
    """dpkg's own md5 of each file of ``package`` (``/var/lib/dpkg/info/PACKAGE[:ARCH].md5sums``, what
    ``dpkg --verify`` checks against): only root-owned regular files, each up to :data:`MD5SUMS_LIMIT`;
    {} where there is none."""
    if package.manager != "dpkg":
        return {}
    try:
        names = sorted(
            name
            for name in os.listdir(info_dir)
            if name.endswith(".md5sums") and name[: -len(".md5sums")].partition(":")[0] == package.package
        )
    except OSError:
        return {}
    found: dict[str, str] = {}
    for name in names:
        path = info_dir / name
        try:
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode) and info.st_uid == 0:
                found.update(md5sums_entries(read_small(path, MD5SUMS_LIMIT).decode("utf-8", "replace")))
        except OSError:
            continue
    return found


def system_packages(
    env: Environment, dists: Iterable[InstalledDistribution], info_dir: Path = DPKG_INFO
) -> dict[str, SystemPackage]:
    """The system package of each of ``dists`` that one installed (by name). A venv's own distributions
    are never a system package's: only a system interpreter's, and a venv's base ones, are looked up."""
    candidates = {d.dist_info: d.name for d in dists if not (env.is_venv and d.site in env.site_dirs)}
    owners = dpkg_owners(candidates, info_dir)
    return {candidates[path]: package for path, package in owners.items()}


def where_uv_installs(env: Environment, dist: InstalledDistribution) -> bool:
    """Pure: is ``dist`` in one of the environment's own site directories (purelib, platlib), where uv
    installs? (Not: a system interpreter's ``/usr/lib/python3/dist-packages``, a venv's base's.)"""
    return dist.site in env.site_dirs


def from_base(env: Environment, dist: InstalledDistribution) -> bool:
    """Pure: is ``dist`` a venv's distribution of its base installation (include-system-site-packages)?"""
    return env.is_venv and not where_uv_installs(env, dist)


def placement_problem(
    env: Environment, dist: InstalledDistribution, owner: SystemPackage | None
) -> SystemPackageError | None:
    """Pure: why a reinstall of ``dist`` through ``env`` is refused (before anything stops): a system
    package owns it, or it lies in a base site directory, where uv does not install (uv would add a
    second copy in the environment's own site-packages that shadows it); None when neither."""
    what = f"{dist.name} {dist.version} in {dist.site}"
    if owner is not None:
        return SystemPackageError(
            f"{what} belongs to the system package {owner.package} ({owner.manager}): a reinstall with uv "
            f"would replace files that {owner.manager} manages, and the next upgrade of {owner.package} "
            "would replace them again",
            hint=f"reinstall it with the package manager (apt-get install --reinstall {owner.package}; "
            f"{owner.check} checks its files), or install {dist.name} in a venv and run the services "
            "from it; nothing was stopped",
        )
    if where_uv_installs(env, dist):
        return None
    installs = " and ".join(str(s) for s in env.site_dirs)
    where = (
        f"it comes from the base installation {env.base_prefix} (the venv {env.prefix} includes the "
        "system site-packages)"
        if env.is_venv
        else "that is a site directory of the system's Python"
    )
    return SystemPackageError(
        f"{what}: {where}; uv installs into {installs}, so a reinstall would not replace it but add a "
        "second copy that shadows it",
        hint=(
            f"reinstall it in the base installation (safeinstall {dist.name} --python with the base "
            "interpreter), or install it in the venv on purpose with uv; nothing was stopped"
            if env.is_venv
            else f"reinstall it with whatever installed it in {dist.site}; nothing was stopped"
        ),
    )


def marker_path(env: Environment) -> Path | None:
    """Pure: where a PEP 668 marker of ``env`` would be: a venv has none (PEP 668: a venv is never
    externally managed), a system interpreter's is in its standard library's directory."""
    if env.is_venv or env.stdlib is None:
        return None
    return env.stdlib / MARKER


def marker_error_text(text: str) -> str:
    """Pure: the marker's ``Error`` (PEP 668: ``[externally-managed]`` ``Error=``, continued on indented
    lines), on one line; "" when it has none. Read line by line, not with configparser (the standard
    library's directory may be another account's)."""
    said: list[str] = []
    section = ""
    inside = False
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("[") and stripped.endswith("]"):
            section, inside = stripped[1:-1].strip(), False
            continue
        if inside and not stripped:
            continue  # an empty line inside the value (configparser keeps reading it)
        if inside and line[:1] in (" ", "\t"):
            said.append(stripped)
            continue
        key, equals, value = line.partition("=")
        inside = section == "externally-managed" and bool(equals) and key.strip() == "Error"
        if inside:
            said.append(value.strip())
    return " ".join(part for part in said if part)


def externally_managed(env: Environment) -> str | None:
    """The PEP 668 marker's ``Error`` when ``env`` is externally managed ("" when it gives none); None
    when it is not (a venv, or no marker)."""
    path = marker_path(env)
    if path is None:
        return None
    try:
        info = os.lstat(path)
    except OSError:
        return None
    if not stat.S_ISREG(info.st_mode):
        return ""  # there, but not read (a FIFO, a link): still a marker
    account = env.account.ids if env.account is not None else None
    try:
        return marker_error_text(read_small(path, MARKER_LIMIT, account).decode("utf-8", "replace"))
    except OSError:
        return ""


def breaks_system_packages(extra_args: Collection[str], environ: Mapping[str, str]) -> bool:
    """Pure: does uv get ``--break-system-packages`` (after ``--``, or as ``UV_BREAK_SYSTEM_PACKAGES``,
    which uv reads as a boolean)?"""
    value = environ.get("UV_BREAK_SYSTEM_PACKAGES", "").strip().lower()
    return BREAK_SYSTEM_PACKAGES in extra_args or value in ("1", "true", "yes", "on")


def externally_managed_problem(
    env: Environment, marker: str | None, extra_args: Collection[str], environ: Mapping[str, str]
) -> ExternallyManagedError | None:
    """Pure: the refusal of an install into an externally managed interpreter (PEP 668), unless
    ``--break-system-packages`` is passed on to uv."""
    if marker is None or breaks_system_packages(extra_args, environ):
        return None
    said = f"; it says: {textwrap.shorten(marker, 300, placeholder=' …')}" if marker else ""
    return ExternallyManagedError(
        f"the interpreter {env.python} is externally managed (PEP 668: its marker {marker_path(env)} "
        f"says that the system's package manager owns the packages of {env.prefix}){said}",
        hint=f"install into a venv instead; or, for a package the system's package manager did not "
        f"install, pass {BREAK_SYSTEM_PACKAGES} on to uv (after --: safeinstall PACKAGE -- "
        f"{BREAK_SYSTEM_PACKAGES}); uv then installs into {' and '.join(str(s) for s in env.site_dirs)}; "
        "nothing was stopped",
    )


def check_target(
    env: Environment,
    target: InstalledDistribution,
    extra_args: Collection[str],
    environ: Mapping[str, str],
    info_dir: Path = DPKG_INFO,
) -> None:
    """Refuse (before uv is asked, before anything stops) a reinstall of ``target`` that a system
    package owns or that lies in a base site directory (:func:`placement_problem`), then one into an
    externally managed interpreter without ``--break-system-packages``."""
    owner = system_packages(env, [target], info_dir).get(target.name)
    problem = placement_problem(env, target, owner) or externally_managed_problem(
        env, externally_managed(env), extra_args, environ
    )
    if problem is not None:
        raise problem


def placement_refusals(
    env: Environment, affected: Iterable[InstalledDistribution], info_dir: Path = DPKG_INFO
) -> tuple[str, ...]:
    """The plan's refusals for the distributions an install would replace that a system package owns or
    that lie in a base site directory (a dependency of the target, or everything with --with-deps)."""
    dists = list(affected)
    owners = system_packages(env, dists, info_dir)
    return tuple(
        f"{problem.message} ({problem.advice})"
        for dist in dists
        if (problem := placement_problem(env, dist, owners.get(dist.name))) is not None
    )
