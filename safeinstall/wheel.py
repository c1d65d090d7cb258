"""Wheel files: read once into a typed :class:`Wheel`, with its RECORD checked against its contents.

A wheel whose own RECORD does not match its contents is the wheel's fault (some torch wheels ship
one, uv #11723); those are reported as :class:`WheelProblem`, never as drift of an installation.
"""

from __future__ import annotations

import hashlib
import os
import threading
import zipfile
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path, PurePosixPath

from packaging.tags import Tag
from packaging.utils import (
    InvalidWheelFilename,
    NormalizedName,
    canonicalize_name,
    parse_wheel_filename,
)

from safeinstall.distributions import parse_console_scripts
from safeinstall.environment import Environment
from safeinstall.errors import WheelError
from safeinstall.records import Record, encode_digest, parse_record

#: dist-info files an installer writes itself; never drift when comparing against a wheel.
INSTALLER_WRITTEN = frozenset(
    {"INSTALLER", "REQUESTED", "direct_url.json", "RECORD", "uv_cache.json", "uv_build.json"}
)
_SIGNATURES = frozenset({"RECORD.jws", "RECORD.p7s"})
_SCRIPT_MAX = 1 << 20  # a larger "script" is data: compared byte for byte


@dataclass(frozen=True, slots=True)
class WheelMember:
    name: str  # archive name, "/" separated
    size: int
    sha256: str  # RECORD spelling, computed from the content


@dataclass(frozen=True, slots=True)
class WheelProblem:
    path: str
    reason: str


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

    @property
    def record_ok(self) -> bool:
        return not self.problems


def _fail(path: Path, why: str) -> WheelError:
    return WheelError(
        f"cannot read wheel {path}: {why}",
        hint="check the path, or download/build the wheel again",
    )


def _hash_member(archive: zipfile.ZipFile, info: zipfile.ZipInfo) -> WheelMember:
    hasher = hashlib.sha256()
    with archive.open(info) as handle:
        while chunk := handle.read(1 << 20):
            hasher.update(chunk)
    return WheelMember(name=info.filename, size=info.file_size, sha256=encode_digest(hasher.digest()))


#: Members at least this large (uncompressed) are inflated and hashed on worker threads: zlib and
#: hashlib release the GIL on large buffers, so a GB wheel (torch) reads on every core.
_BIG_MEMBER = 1 << 20


def _hash_members(
    path: Path, infos: list[zipfile.ZipInfo], archive: zipfile.ZipFile
) -> dict[str, WheelMember]:
    """Every member's size and sha256: the large ones, largest first, on worker threads (each with its
    own handle on the zip), the small ones on this thread meanwhile."""
    big = sorted((i for i in infos if i.file_size >= _BIG_MEMBER), key=lambda i: -i.file_size)
    pending = iter(big)
    lock = threading.Lock()
    found: dict[str, WheelMember] = {}
    failures: list[BaseException] = []

    def work() -> None:
        try:
            with zipfile.ZipFile(path) as own:
                while True:
                    with lock:
                        info = next(pending, None)
                    if info is None:
                        return
                    member = _hash_member(own, info)
                    with lock:
                        found[info.filename] = member
        except BaseException as exc:  # re-raised on the calling thread
            failures.append(exc)

    threads = [threading.Thread(target=work, daemon=True) for _ in range(min(len(big), os.cpu_count() or 1))]
    for thread in threads:
        thread.start()
    small = {i.filename: _hash_member(archive, i) for i in infos if i.file_size < _BIG_MEMBER}
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]
    found.update(small)
    return {i.filename: found[i.filename] for i in infos}


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
        elif entry.hash.algorithm == "sha256" and entry.hash.digest != member.sha256:
            problems.append(WheelProblem(name, "RECORD hash does not match the content"))
        if entry.size is not None and entry.size != member.size:
            problems.append(
                WheelProblem(name, f"RECORD size {entry.size} does not match the content ({member.size})")
            )
    for name in listed:
        if name not in members and name != record_name:
            problems.append(WheelProblem(name, "listed in RECORD but not in the wheel"))
    return tuple(problems)


def read_wheel(path: Path) -> Wheel:
    """Open and check a wheel. Raises WheelError when it is not a usable wheel at all."""
    if not path.is_file():
        raise _fail(path, "no such file")
    try:
        name, version, _build, tags = parse_wheel_filename(path.name)
    except InvalidWheelFilename as exc:
        raise _fail(path, f"not a wheel file name ({exc})") from exc
    try:
        with zipfile.ZipFile(path) as archive:
            infos = [i for i in archive.infolist() if not i.is_dir()]
            dist_infos = {
                PurePosixPath(i.filename).parts[0]
                for i in infos
                if PurePosixPath(i.filename).parts[0].endswith(".dist-info")
            }
            if len(dist_infos) != 1:
                raise _fail(path, f"expected one .dist-info directory, found {sorted(dist_infos)}")
            dist_info = dist_infos.pop()
            names = {i.filename for i in infos}
            for required in ("WHEEL", "METADATA", "RECORD"):
                if f"{dist_info}/{required}" not in names:
                    raise _fail(path, f"{dist_info}/{required} is missing")
            members = _hash_members(path, infos, archive)
            data_dir = dist_info[: -len(".dist-info")] + ".data"
            scripts = [
                i
                for i in infos
                if PurePosixPath(i.filename).parts[:2] == (data_dir, "scripts") and i.file_size <= _SCRIPT_MAX
            ]
            python_scripts = {
                i.filename: content for i in scripts if (content := archive.read(i)).startswith(b"#!python")
            }
            wheel_meta = HeaderParser().parsestr(archive.read(f"{dist_info}/WHEEL").decode("utf-8"))
            metadata = HeaderParser().parsestr(
                archive.read(f"{dist_info}/METADATA").decode("utf-8", errors="replace")
            )
            record = parse_record(archive.read(f"{dist_info}/RECORD").decode("utf-8", errors="replace"))
            entry_points_name = f"{dist_info}/entry_points.txt"
            entry_points = (
                archive.read(entry_points_name).decode("utf-8", errors="replace")
                if entry_points_name in names
                else None
            )
    except (zipfile.BadZipFile, zipfile.LargeZipFile, EOFError) as exc:
        raise _fail(path, f"not a valid zip archive ({exc})") from exc
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
    )


def install_location(wheel: Wheel, member: str, env: Environment) -> Path | None:
    """Pure: where an installer puts a wheel member in ``env`` (None for unknown .data schemes)."""
    parts = PurePosixPath(member).parts
    if parts and parts[0] == wheel.data_dir:
        if len(parts) < 3:
            return None
        scheme, rest = parts[1], parts[2:]
        roots = {
            "purelib": env.purelib,
            "platlib": env.platlib,
            "scripts": env.scripts,
            "data": env.data,
            "headers": env.prefix
            / "include"
            / "site"
            / f"python{env.version[0]}.{env.version[1]}"
            / wheel.display_name,
        }
        root = roots.get(scheme)
        return None if root is None else root.joinpath(*rest)
    root = env.purelib if wheel.root_is_purelib else env.platlib
    return root.joinpath(*parts)


def is_installer_written(wheel: Wheel, relative: str) -> bool:
    """Pure: a dist-info file that installers write themselves (not expected to match the wheel)."""
    parts = PurePosixPath(relative).parts
    return len(parts) == 2 and parts[0] == wheel.dist_info and parts[1] in INSTALLER_WRITTEN


def installed_size(wheel: Wheel, block: int = 4096) -> int:
    """Pure: bytes the wheel's files take once installed (each rounded up to whole blocks)."""
    return sum(-(-member.size // block) * block for member in wheel.members.values())


def read_member(wheel_path: Path, member: str) -> bytes:
    with zipfile.ZipFile(wheel_path) as archive:
        return archive.read(member)


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
        interpreter = f"{tags.INTERPRETER_SHORT_NAMES.get(env.implementation, env.implementation)}" + (
            f"{version[0]}{version[1]}"
        )
        supported = list(tags.generic_tags(interpreter, None, platforms))
    supported += list(tags.compatible_tags(version, interpreter, platforms))
    return supported


def fits(wheel: Wheel, supported: list[Tag]) -> bool:
    """Pure: does any of the wheel's tags appear among the interpreter's supported tags?"""
    accepted = set(supported)
    return any(tag in accepted for tag in wheel.tags)
