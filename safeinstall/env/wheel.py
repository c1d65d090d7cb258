"""Wheel files: read once into a typed :class:`Wheel`, with its RECORD checked against its contents.

A wheel whose own RECORD does not match its contents is the wheel's fault (some torch wheels ship
one, uv #11723); those are reported as :class:`WheelProblem`, never as drift of an installation."""

from __future__ import annotations

import hashlib
import io
import os
import re
import zipfile
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path, PurePosixPath
from typing import BinaryIO, cast

from packaging.tags import Tag
from packaging.utils import InvalidWheelFilename, NormalizedName, canonicalize_name, parse_wheel_filename

from safeinstall.env.containment import is_within
from safeinstall.env.distributions import (
    METADATA_LIMIT,
    RECORD_LIMIT,
    InstalledDistribution,
    package_roots,
    parse_console_scripts,
)
from safeinstall.env.environment import Environment
from safeinstall.env.hashing import LARGEST_FILE
from safeinstall.env.records import Record, encode_digest, parse_record
from safeinstall.errors import WheelError, one_line
from safeinstall.system.forking import cpu_count
from safeinstall.system.safefs import open_regular
from safeinstall.system.signals import held_while_threads_start

#: dist-info files an installer writes itself; never drift when comparing against a wheel.
INSTALLER_WRITTEN = frozenset(
    {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD", "uv_cache.json", "uv_build.json"}
)
_SIGNATURES = frozenset({"RECORD.jws", "RECORD.p7s"})


@dataclass(frozen=True, slots=True)
class WheelMember:
    name: str  # archive name, "/" separated
    size: int
    sha256: str  # RECORD spelling, computed from the content
    #: (algorithm, RECORD spelling) for the algorithm its RECORD line uses, when that is not sha256
    listed_digest: tuple[str, str] | None = None

    def digest(self, algorithm: str) -> str | None:
        if algorithm == "sha256":
            return self.sha256
        if self.listed_digest is not None and self.listed_digest[0] == algorithm:
            return self.listed_digest[1]
        return None


@dataclass(frozen=True, slots=True)
class WheelProblem:
    path: str
    reason: str


_SCRIPT_MAX = 1 << 20  # a larger "script" is data: compared byte for byte


@dataclass(frozen=True, slots=True)
class Wheel:
    path: Path
    name: NormalizedName
    display_name: str
    version: str
    tags: frozenset[Tag]
    dist_info: str  # "name-1.0.dist-info"
    data_dir: str  # "name-1.0.data"
    root_is_purelib: bool
    members: dict[str, WheelMember]
    record: Record
    problems: tuple[WheelProblem, ...]
    console_scripts: tuple[str, ...]
    #: the content of each ``#!python`` script under ``<data_dir>/scripts/`` (an installer rewrites its
    #: first line), kept so that a verify never opens the wheel again
    python_scripts: dict[str, bytes] = field(default_factory=dict)
    #: its METADATA's ``Requires-Dist`` values, as written (markers included; read, never evaluated here)
    requires: tuple[str, ...] = ()

    @property
    def record_ok(self) -> bool:
        return not self.problems


def _fail(path: Path, why: str) -> WheelError:
    return WheelError(
        f"cannot read wheel {one_line(path)}: {why}", hint="check the path, or download/build the wheel again"
    )


#: Bounds on what a wheel may unpack to: a small wheel must not take gigabytes of memory (its metadata
#: is read into memory) nor of time. Larger members and wheels are refused. Its WHEEL, METADATA,
#: entry_points.txt and RECORD are bounded as installed ones are (``METADATA_LIMIT``, ``RECORD_LIMIT``).
MEMBER_LIMIT = LARGEST_FILE  # 16 GiB: an installed file larger than this is reported, never hashed
TOTAL_LIMIT = 64 << 30
#: The most a wheel's central directory (its list of members) may take: zipfile reads it whole and
#: makes an object of about 500 bytes for each entry of at least 46 (torch's is 1.3 MB, 12k members).
CENTRAL_DIRECTORY_LIMIT = 16 << 20
#: What zipfile and zlib raise for an archive that is not a (whole) zip: a damaged end record, member
#: or deflated stream (zlib's own error), one cut short.
_DAMAGED = (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError, zlib.error)
#: Where a ``.data/<scheme>/`` member goes (the wheel spec's schemes; anything else is refused).
SCHEMES = ("purelib", "platlib", "scripts", "headers", "data")
_UTF8_FLAG = 0x800
_METADATA_FILES = {
    "WHEEL": METADATA_LIMIT,
    "METADATA": METADATA_LIMIT,
    "entry_points.txt": METADATA_LIMIT,
    "RECORD": RECORD_LIMIT,
}


#: Members at least this large are inflated and hashed on worker threads (zlib and hashlib release the
#: GIL on large buffers; zipfile serialises only the reads of the archive); smaller ones on the calling
#: thread, where thousands of them cost no GIL hand-offs.
_BIG_MEMBER = 1 << 20


def _hash_members(
    archive: zipfile.ZipFile, infos: Sequence[zipfile.ZipInfo], algorithms: dict[str, str]
) -> dict[str, WheelMember]:
    """Every member of ``infos`` hashed (in their order): the large ones, largest first, on threads."""
    big = sorted((i for i in infos if i.file_size >= _BIG_MEMBER), key=lambda i: -i.file_size)
    workers = min(len(big), cpu_count())
    if workers < 1:
        return {i.filename: _hash_member(archive, i, algorithms.get(i.filename)) for i in infos}
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="wheel-hash") as pool:
        with held_while_threads_start():
            futures = {
                i.filename: pool.submit(_hash_member, archive, i, algorithms.get(i.filename)) for i in big
            }
        try:
            small = {
                i.filename: _hash_member(archive, i, algorithms.get(i.filename))
                for i in infos
                if i.filename not in futures
            }
            return {i.filename: small.get(i.filename) or futures[i.filename].result() for i in infos}
        except BaseException:  # a damaged member or a Ctrl-C: the pool's exit waits only for those
            for future in futures.values():  # already inflating, not for every large member left
                future.cancel()
            raise


def _hash_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo, algorithm: str | None) -> WheelMember:
    hasher = hashlib.sha256()
    other = hashlib.new(algorithm) if algorithm not in (None, "sha256") else None
    with archive.open(info) as handle:
        while chunk := handle.read(1 << 20):
            hasher.update(chunk)
            if other is not None:
                other.update(chunk)
    listed = None if other is None or algorithm is None else (algorithm, encode_digest(other.digest()))
    return WheelMember(info.filename, info.file_size, encode_digest(hasher.digest()), listed)


def member_problem(name: str, data_dir: str) -> str | None:
    """Pure: why an archive member name cannot be installed safely, or None. A member must be a plain
    relative path (no ``..``, no absolute path, no backslash, no NUL), and a ``.data`` member must lie
    inside one of the wheel spec's scheme directories."""
    if not name or name.startswith("/") or "\\" in name or "\0" in name:
        return "is not a plain relative path"
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return "has an empty, '.' or '..' component"
    if parts[0] == data_dir and (len(parts) < 3 or parts[1] not in SCHEMES):
        return f"is not inside a scheme directory ({', '.join(SCHEMES)}) of {data_dir}"
    return None


def _bounded(info: zipfile.ZipInfo, limit: int, path: Path) -> None:
    """Refuses (WheelError) a member that says it unpacks to more than ``limit`` bytes."""
    if info.file_size > limit:
        raise _fail(path, f"{info.filename} unpacks to {info.file_size} bytes, more than the {limit} allowed")


def _read_text(
    archive: zipfile.ZipFile, info: zipfile.ZipInfo, limit: int, path: Path, errors: str = "replace"
) -> str:
    """A member's text, at most ``limit`` bytes unpacked (WheelError past it)."""
    _bounded(info, limit, path)
    with archive.open(info) as handle:
        data = handle.read(limit + 1)
    if len(data) > limit:
        raise _fail(path, f"{info.filename} unpacks to more than the {limit} bytes allowed")
    return data.decode("utf-8", errors)


def _check_names(infos: list[zipfile.ZipInfo], path: Path) -> None:
    """Refuse names that are not UTF-8 (zipfile decodes unflagged names as cp437) or that could land
    outside the environment; refuse members (and totals) beyond the size bounds."""
    for info in infos:
        if not info.flag_bits & _UTF8_FLAG and not info.filename.isascii():
            try:
                info.filename.encode("cp437").decode("utf-8")
            except UnicodeError:
                raise _fail(path, f"the member name {info.filename!r} is not valid UTF-8") from None
        _bounded(info, MEMBER_LIMIT, path)
    total = sum(i.file_size for i in infos)
    if total > TOTAL_LIMIT:
        raise _fail(path, f"it unpacks to {total} bytes, more than the {TOTAL_LIMIT} allowed")


def _unsafe(path: Path, problems: list[str]) -> WheelError:
    listed = "; ".join(problems[:3]) + (f" (and {len(problems) - 3} more)" if len(problems) > 3 else "")
    return WheelError(
        f"refusing the wheel {one_line(path)}: {listed}; nothing was read from or written to those paths",
        hint="a wheel's members must be plain relative paths inside the environment; get the wheel from "
        "a source you trust",
    )


def record_problems(
    members: dict[str, WheelMember], record: Record, dist_info: str
) -> tuple[WheelProblem, ...]:
    """Pure: where the wheel's RECORD and its actual contents disagree."""
    problems = [WheelProblem(f"{dist_info}/RECORD", f"line {p.line}: {p.reason}") for p in record.problems]
    listed = {entry.path: entry for entry in record.entries}
    record_name = f"{dist_info}/RECORD"
    for name, member in members.items():
        if name == record_name or (name.rsplit("/", 1)[-1] in _SIGNATURES and name.startswith(dist_info)):
            continue
        entry = listed.get(name)
        if entry is None:
            problems.append(WheelProblem(name, "in the wheel but not in its RECORD"))
            continue
        if entry.hash is None:
            problems.append(WheelProblem(name, "RECORD lists it without a hash"))
        elif member.digest(entry.hash.algorithm) is None:
            problems.append(WheelProblem(name, f"RECORD hash {entry.hash.algorithm} was not computed"))
        elif entry.hash.digest != member.digest(entry.hash.algorithm):
            problems.append(
                WheelProblem(name, f"RECORD {entry.hash.algorithm} hash does not match the content")
            )
        if entry.size is not None and entry.size != member.size:
            problems.append(
                WheelProblem(name, f"RECORD size {entry.size} does not match the content ({member.size})")
            )
    for name in listed:
        if name not in members and name != record_name:
            problems.append(WheelProblem(name, "listed in RECORD but not in the wheel"))
    return tuple(problems)


def read_wheel(path: Path, hashed: Mapping[str, WheelMember] | None = None) -> Wheel:
    """Open and check a wheel; WheelError when it is unusable or unsafe (a member landing outside its
    directory, a name not UTF-8, sizes beyond the bounds). Every member is hashed, or ``hashed`` taken
    when names and sizes match (the caller proves the bytes the same: a commit's sha256)."""
    try:  # a missing file is said as such, whatever its name
        fd = open_regular(path)
    except FileNotFoundError:
        raise _fail(path, "no such file") from None
    except OSError as exc:
        raise _fail(path, exc.strerror or str(exc)) from exc
    try:
        name, version, _build, tags = parse_wheel_filename(path.name)
    except InvalidWheelFilename as exc:
        os.close(fd)
        raise _fail(path, f"not a wheel file name ({exc})") from exc
    try:
        with os.fdopen(fd, "rb") as handle, _archive(handle, path) as archive:
            # not is_dir(): it indexes the name's last character, and a member may have an empty name
            infos = [i for i in archive.infolist() if not i.filename.endswith("/")]
            _check_names(infos, path)
            heads = (PurePosixPath(i.filename).parts[:1] for i in infos)
            dist_infos = {head[0] for head in heads if head and head[0].endswith(".dist-info")}
            if len(dist_infos) != 1:
                raise _fail(path, f"expected one .dist-info directory, found {sorted(dist_infos)}")
            dist_info = dist_infos.pop()
            data_dir = dist_info[: -len(".dist-info")] + ".data"
            unsafe = [
                f"member {i.filename!r} {problem}"
                for i in infos
                if (problem := member_problem(i.filename, data_dir)) is not None
            ]
            if unsafe:
                raise _unsafe(path, unsafe)
            by_name = {i.filename: i for i in infos}
            for required in ("WHEEL", "METADATA", "RECORD"):
                if f"{dist_info}/{required}" not in by_name:
                    raise _fail(path, f"{dist_info}/{required} is missing")
            for meta, limit in _METADATA_FILES.items():  # before anything is unpacked
                info = by_name.get(f"{dist_info}/{meta}")
                if info is not None:
                    _bounded(info, limit, path)
            record = parse_record(_read_text(archive, by_name[f"{dist_info}/RECORD"], RECORD_LIMIT, path))
            algorithms = {e.path: e.hash.algorithm for e in record.entries if e.hash is not None}
            sizes = {i.filename: i.file_size for i in infos}
            members = (
                dict(hashed)
                if hashed is not None and {n: m.size for n, m in hashed.items()} == sizes
                else _hash_members(archive, infos, algorithms)
            )
            python_scripts = {
                i.filename: content
                for i in infos
                if PurePosixPath(i.filename).parts[:2] == (data_dir, "scripts")
                and i.file_size <= _SCRIPT_MAX
                and (content := archive.read(i)).startswith(b"#!python")
            }
            wheel_text = _read_text(archive, by_name[f"{dist_info}/WHEEL"], METADATA_LIMIT, path, "strict")
            wheel_meta = HeaderParser().parsestr(wheel_text)
            metadata = HeaderParser().parsestr(
                _read_text(archive, by_name[f"{dist_info}/METADATA"], METADATA_LIMIT, path)
            )
            entry_points_info = by_name.get(f"{dist_info}/entry_points.txt")
            entry_points = (
                None
                if entry_points_info is None
                else _read_text(archive, entry_points_info, METADATA_LIMIT, path)
            )
    except _DAMAGED as exc:
        raise _fail(path, f"not a valid zip archive ({exc})") from exc
    except UnicodeDecodeError as exc:  # a member name flagged as UTF-8 that is not, or a WHEEL file
        raise _fail(path, f"a name or metadata file is not valid UTF-8 ({exc.reason})") from exc
    except NotImplementedError as exc:  # an unsupported compression method
        raise _fail(path, str(exc)) from exc
    except OSError as exc:
        raise _fail(path, exc.strerror or str(exc)) from exc
    meta_name = metadata.get("Name") or ""
    if canonicalize_name(meta_name) != name:
        raise _fail(path, f"its METADATA names {meta_name!r}, its file name {name!r}")
    return Wheel(
        path=path,
        name=name,
        display_name=meta_name,
        version=str(metadata.get("Version") or version),
        tags=frozenset(tags),
        dist_info=dist_info,
        data_dir=data_dir,
        root_is_purelib=(wheel_meta.get("Root-Is-Purelib", "true").strip().lower() == "true"),
        members=members,
        record=record,
        problems=record_problems(members, record, dist_info),
        console_scripts=parse_console_scripts(entry_points),
        python_scripts=python_scripts,
        requires=tuple(str(v) for v in metadata.get_all("Requires-Dist") or ()),
    )


class _ListingBounded(io.RawIOBase):
    """A wheel's file as zipfile sees it while it reads the members' list: a read over
    :data:`CENTRAL_DIRECTORY_LIMIT` bytes is refused, on the read itself, so nothing differs between a check
    and zipfile's reading. Lifted once the list is read."""

    def __init__(self, handle: BinaryIO, path: Path) -> None:
        super().__init__()
        self._handle = handle
        self._path = path
        self.bounded = True

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        return self._handle.seek(offset, whence)

    def tell(self) -> int:
        return self._handle.tell()

    def read(self, size: int | None = -1) -> bytes:
        size = -1 if size is None or size < 0 else size
        if not self.bounded:
            return self._handle.read(size)
        limit = CENTRAL_DIRECTORY_LIMIT
        if size > limit:
            raise _fail(
                self._path, f"its list of members takes {size} bytes, more than the {limit} bytes allowed"
            )
        data = self._handle.read(limit + 1 if size < 0 else size)  # to the end: as it is now, at most
        if len(data) > limit:
            raise _fail(self._path, f"its list of members takes more than the {limit} bytes allowed")
        return data


@contextmanager
def _archive(handle: BinaryIO, path: Path) -> Iterator[zipfile.ZipFile]:
    """The wheel open as a zip archive whose list of members fit :data:`CENTRAL_DIRECTORY_LIMIT`."""
    listing = _ListingBounded(handle, path)
    with zipfile.ZipFile(cast(BinaryIO, listing)) as archive:
        listing.bounded = False
        yield archive


def scheme_roots(wheel: Wheel, env: Environment) -> dict[str, Path]:
    """Pure: the environment's directory for each ``.data`` scheme."""
    return {
        "purelib": env.purelib,
        "platlib": env.platlib,
        "scripts": env.scripts,
        "data": env.data,
        "headers": env.prefix
        / "include/site"
        / f"python{env.version[0]}.{env.version[1]}"
        / wheel.display_name,
    }


def install_location(wheel: Wheel, member: str, env: Environment) -> Path | None:
    """Pure: where an installer puts a wheel member in ``env``; None for a member that would not land
    inside its scheme directory (such a wheel is refused by :func:`read_wheel` already)."""
    location = install_locations(wheel, env, (member,)).get(member)
    return None if location is None else Path(location)


def install_locations(wheel: Wheel, env: Environment, members: Iterable[str] | None = None) -> dict[str, str]:
    """Pure: :func:`install_location` of each of ``members`` (default: all), as absolute path text
    (member -> location; members that would not land inside their scheme directory are left out). By
    string operations: a wheel of 12k members costs pathlib more than the rest of the check. All of them
    are worked out once for a wheel and an environment (a run asks four times), a copy returned."""
    if members is not None:
        return _locations(wheel, env, members)
    for seen, where, found in _ALL_LOCATIONS:
        if seen is wheel and where == env:
            _ALL_LOCATIONS_USED[0] += 1
            return dict(found)
    found = _locations(wheel, env, wheel.members)
    _ALL_LOCATIONS[:] = [(wheel, env, found)]
    return dict(found)


#: the last wheel's (a frozen object, by identity) locations of all members in the last environment, and
#: how often they were taken from here (tests)
_ALL_LOCATIONS: list[tuple[Wheel, Environment, dict[str, str]]] = []
_ALL_LOCATIONS_USED = [0]


def _locations(wheel: Wheel, env: Environment, members: Iterable[str]) -> dict[str, str]:
    roots = {scheme: os.fspath(root) for scheme, root in scheme_roots(wheel, env).items()}
    base = os.fspath(env.purelib if wheel.root_is_purelib else env.platlib)
    found: dict[str, str] = {}
    for member in members:
        if member_problem(member, wheel.data_dir) is not None:
            continue
        head, _, rest = member.partition("/")
        if head == wheel.data_dir:
            scheme, _, rest = rest.partition("/")
            found[member] = os.path.join(roots[scheme], rest)
        else:
            found[member] = os.path.join(base, member)
    return found


_INTERPRETER = re.compile(r"^(python|pypy|pythonw)(\d+(\.\d+)?t?)?$")


def environment_files(env: Environment) -> frozenset[str]:
    """The environment's own files that no install may replace: ``pyvenv.cfg`` and the interpreters in
    its scripts directory (``python``, ``python3``, ``python3.12``, ...)."""
    own = {os.path.join(env.prefix, "pyvenv.cfg"), os.fspath(env.python), os.fspath(env.executable)}
    try:
        names = os.listdir(env.scripts)
    except OSError:
        names = []
    own.update(os.path.join(env.scripts, n) for n in names if _INTERPRETER.match(n))
    own.update(os.path.join(env.scripts, n) for n in ("python", "python3"))
    return frozenset(own)


def shared_landing(wheel: Wheel, locations: dict[str, str], others: dict[str, tuple[str, str]]) -> list[str]:
    """Pure: the plan's refusals for members that would land on files another distribution's RECORD
    lists (``others``), one per distribution, naming it and what to do (as dpkg refuses to overwrite
    another package's file)."""
    by_owner: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for member, location in sorted(locations.items()):
        if location in others:
            by_owner.setdefault(others[location], []).append((member, location))
    refusals: list[str] = []
    for (name, version), landed in sorted(by_owner.items()):
        member, location = landed[0]
        more = f" and {len(landed) - 1} more" if len(landed) > 1 else ""
        refusals.append(
            f"the wheel {wheel.path.name} would replace {len(landed)} file(s) of {name} {version}, which is "
            f"not being reinstalled ({member} would replace {location}, a file of {name}{more}): both "
            f"would then list them, and {name}'s would be lost. Uninstall one of them (uv pip uninstall "
            f"{name}); or, if the run should replace both, add --with-deps when {name} is among "
            f"{wheel.name}'s dependencies"
        )
    return refusals


def check_landing(
    wheel: Wheel,
    env: Environment,
    affected: Sequence[InstalledDistribution],
    installed: Sequence[InstalledDistribution],
) -> tuple[str, ...]:
    """Refuse a wheel (WheelError, exit 2) a member or script of which would land on the environment's
    own files or on an unlisted file the run would not back up. Landings on another distribution's files
    are returned as the plan's refusals (:func:`shared_landing`)."""
    from safeinstall.system.safefs import Tree

    locations = install_locations(wheel, env)
    for script in wheel.console_scripts:
        locations[f"console script {script}"] = os.path.join(env.scripts, script)
    affected_names = {d.name for d in affected}
    owned: set[str] = set()
    roots = package_roots(env, installed)
    with Tree(env.prefix) as tree:
        for dist in affected:
            owned.update(dist.locations)
            for directory in (os.fspath(dist.dist_info), *roots.get(dist.name, [])):
                relative = tree.relative(directory)
                if relative is not None:
                    owned.update(os.path.join(env.prefix, p) for p in tree.files_below(relative))
    others = {
        location: (dist.name, dist.version)
        for dist in installed
        if dist.name not in affected_names
        for location in dist.locations
    }
    protected = environment_files(env)
    problems = [
        f"{member} would replace the environment's own {location}"
        for member, location in sorted(locations.items())
        if location in protected
    ]
    problems += [
        f"{member} would replace {location}, which no distribution being replaced holds"
        for member, location in sorted(locations.items())
        if location not in owned
        and location not in others
        and location not in protected
        and os.path.lexists(location)
    ]
    if problems:
        raise _unsafe(wheel.path, problems)
    return tuple(
        shared_landing(wheel, {m: loc for m, loc in locations.items() if loc not in protected}, others)
    )


def install_directories(
    env: Environment, affected: Sequence[InstalledDistribution], wheel: Wheel | None
) -> set[Path]:
    """The directories an install writes: the site and scripts directories, every directory holding a
    file of the distributions it replaces, and where each of the wheel's members lands."""
    found = {os.fspath(d) for d in (*env.site_dirs, env.scripts)}
    for dist in affected:
        found.update(os.path.dirname(location) for location in dist.locations)
    if wheel is not None:
        found.update(os.path.dirname(location) for location in install_locations(wheel, env).values())
    return {Path(d) for d in found if is_within(d, os.fspath(env.prefix))}


def is_installer_written(wheel: Wheel, relative: str) -> bool:
    """Pure: a dist-info file that installers write themselves (not expected to match the wheel)."""
    head, _, name = relative.partition("/")
    return head == wheel.dist_info and "/" not in name and name in INSTALLER_WRITTEN


def installed_size(wheel: Wheel, block: int = 4096) -> int:
    """Pure: bytes the wheel's files take once installed (each rounded up to whole blocks)."""
    return sum(-(-member.size // block) * block for member in wheel.members.values())


def read_member(wheel_path: Path, member: str, limit: int = METADATA_LIMIT) -> bytes:
    """One member's content, at most ``limit`` bytes (ValueError when larger), the wheel opened as
    :func:`read_wheel` opens it (WheelError if it is no longer a wheel of a bounded list)."""
    fd = open_regular(wheel_path)
    try:
        with os.fdopen(fd, "rb") as handle, _archive(handle, wheel_path) as archive:
            info = archive.getinfo(member)
            if info.file_size > limit:
                raise ValueError(f"{member} is larger than {limit} bytes")
            with archive.open(info) as stream:
                return stream.read(limit)
    except (*_DAMAGED, KeyError) as exc:  # replaced since it was read
        raise _fail(wheel_path, f"not the wheel it was ({exc})") from exc


def target_tags(env: Environment) -> list[Tag]:
    """The wheel tags the target interpreter accepts (its version and ABI; this host's platforms)."""
    from packaging import tags

    version = (env.version[0], env.version[1])
    platforms = list(tags.platform_tags())
    if env.implementation == "cpython":
        # SOABI is e.g. "cpython-311-x86_64-linux-gnu" ("cpython-313t-..." for free-threaded builds)
        soabi_version = (env.soabi or "").split("-")[1:2]
        suffix = soabi_version[0].removeprefix(f"{version[0]}{version[1]}") if soabi_version else ""
        abi = f"cp{version[0]}{version[1]}{suffix}"
        supported = list(tags.cpython_tags(version, [abi], platforms))
        interpreter = f"cp{version[0]}{version[1]}"
    else:
        short = tags.INTERPRETER_SHORT_NAMES.get(env.implementation, env.implementation)
        interpreter = f"{short}{version[0]}{version[1]}"
        supported = list(tags.generic_tags(interpreter, None, platforms))
    supported += list(tags.compatible_tags(version, interpreter, platforms))
    return supported


def fits(wheel: Wheel, supported: list[Tag]) -> bool:
    """Pure: does any of the wheel's tags appear among the interpreter's supported tags?"""
    return not wheel.tags.isdisjoint(supported)
