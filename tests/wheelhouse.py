"""Real wheels built from ``fixtures/packages`` and real venvs made and filled by the real uv.

Test-bed code, not safeinstall's: it builds with setuptools (no build isolation, so no network) and
installs with ``uv pip install --offline``.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import uv

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ROOT / "fixtures" / "packages"
UV = uv.find_uv_bin()
#: the machine's one lock for the tests that change (or read all of) the system Python: two suites at
#: once on one machine take turns there (tests/test_system_python.py installs into it)
SYSTEM_PYTHON_LOCK = Path("/tmp/safeinstall-tests-system-python.lock")


@contextlib.contextmanager
def system_python_held(*, exclusive: bool = True) -> Iterator[None]:
    """The system Python for this test alone (``exclusive``: it installs there), or unchanged meanwhile."""
    fd = os.open(SYSTEM_PYTHON_LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        yield
    finally:
        os.close(fd)


#: fixture key -> source directory name under fixtures/packages
SOURCES = {
    "sipure-1": "sipure-1",
    "sipure-2": "sipure-2",
    "sicext-1": "sicext-1",
    "sicext-2": "sicext-2",
    "sicext-3": "sicext-3",  # crashes on import
    "sicext-4": "sicext-4",  # crashes on import, with version 1's serve.py (a patch of it carries over)
    "sicext-5": "sicext-5",  # imports, but its C extension has an undefined symbol (a bad nightly)
    "sins-a": "sins-a",
    "sins-b": "sins-b",
}


def build_wheel(source: Path, out_dir: Path) -> Path:
    """Build one wheel from a copy of ``source`` (the fixture tree stays clean)."""
    work = out_dir / f".src-{source.name}"
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(source, work)
    before = set(out_dir.glob("*.whl"))
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--disable-pip-version-check",
            "-q",
            "-w",
            str(out_dir),
            str(work),
        ],
        check=True,
        capture_output=True,
        text=True,
    )
    shutil.rmtree(work, ignore_errors=True)
    built = set(out_dir.glob("*.whl")) - before
    assert len(built) == 1, built
    return built.pop()


@dataclass(frozen=True)
class Wheelhouse:
    directory: Path
    wheels: dict[str, Path]

    def __getitem__(self, key: str) -> Path:
        return self.wheels[key]


def build_all(out_dir: Path) -> Wheelhouse:
    out_dir.mkdir(parents=True, exist_ok=True)
    wheels = {key: build_wheel(PACKAGES / name, out_dir) for key, name in SOURCES.items()}
    return Wheelhouse(out_dir, wheels)


def uv_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("VIRTUAL_ENV", None)
    env["UV_NO_PROGRESS"] = "1"
    return env


def make_venv(path: Path, base: str | None = None) -> Path:
    """A fresh venv made by uv (from ``base``, default this interpreter); returns its python."""
    subprocess.run(
        [UV, "venv", "--quiet", "--python", base or sys.executable, str(path)],
        check=True,
        capture_output=True,
        text=True,
        env=uv_env(),
    )
    return path / "bin" / "python"


def shared_interpreter() -> str | None:
    """An interpreter of this Python version that every user may run (a service account's venv is
    made from it): this one when its directories let others through, else the system's; None: none."""
    version = f"python{sys.version_info[0]}.{sys.version_info[1]}"
    for candidate in (os.path.realpath(sys.executable), f"/usr/bin/{version}", f"/usr/local/bin/{version}"):
        path = Path(candidate)
        if not path.is_file():
            continue
        steps = [path, *path.parents]
        if all(os.stat(step).st_mode & 0o001 for step in steps):  # others may pass and run it
            return str(path)
    return None


def uv_install(python: Path, *wheels: Path, link_mode: str = "copy", reinstall: bool = False) -> None:
    cmd = [UV, "pip", "install", "--quiet", "--offline", "--python", str(python), "--link-mode", link_mode]
    if reinstall:
        cmd.append("--reinstall")
    subprocess.run([*cmd, *map(str, wheels)], check=True, capture_output=True, text=True, env=uv_env())


def site_packages(python: Path) -> Path:
    out = subprocess.run(
        [str(python), "-I", "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    )
    return Path(out.stdout.strip())


def record_digest(data: bytes, algorithm: str = "sha256") -> str:
    """``data``'s digest as a RECORD line writes it (urlsafe base64, no padding)."""
    import base64
    import hashlib

    return base64.urlsafe_b64encode(hashlib.new(algorithm, data).digest()).rstrip(b"=").decode()


def write_wheel(
    path: Path, members: dict[str, bytes], dist_info: str, *, deflate: bool = False, algorithm: str = "sha256"
) -> Path:
    """A wheel with ``members`` and a correct RECORD (written last, digests with ``algorithm``), stored
    uncompressed unless ``deflate``."""
    import zipfile

    record = [
        f"{name},{algorithm}={record_digest(data, algorithm)},{len(data)}" for name, data in members.items()
    ]
    record.append(f"{dist_info}/RECORD,,")
    compression = zipfile.ZIP_DEFLATED if deflate else zipfile.ZIP_STORED
    with zipfile.ZipFile(path, "w", compression=compression) as archive:
        for name, data in members.items():
            archive.writestr(name, data)
        archive.writestr(f"{dist_info}/RECORD", "\n".join(record) + "\n")
    return path


def members_of(wheel: Path) -> tuple[dict[str, bytes], str]:
    """The members of ``wheel`` but its RECORD, and the name of its .dist-info directory."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        members = {i.filename: archive.read(i) for i in archive.infolist() if not i.is_dir()}
    dist_info = next(n.split("/")[0] for n in members if n.endswith(".dist-info/METADATA"))
    members.pop(f"{dist_info}/RECORD")
    return members, dist_info


def rebuilt(
    wheel: Path, out: Path, changes: dict[str, bytes], algorithm: str = "sha256", *, deflate: bool = True
) -> Path:
    """A copy of ``wheel`` in ``out`` with ``changes`` (members added or replaced), its RECORD consistent
    with them (digests with ``algorithm``), deflated unless not ``deflate``."""
    members, dist_info = members_of(wheel)
    members.update(changes)
    out.mkdir(parents=True, exist_ok=True)
    return write_wheel(out / wheel.name, members, dist_info, deflate=deflate, algorithm=algorithm)


def make_wheel(
    out_dir: Path, name: str, version: str, files: dict[str, bytes], requires: tuple[str, ...] = ()
) -> Path:
    """A small pure-Python wheel made by hand (for dependency and damage cases)."""
    dist_info = f"{name}-{version}.dist-info"
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    metadata += "".join(f"Requires-Dist: {r}\n" for r in requires)
    wheel_meta = (
        "Wheel-Version: 1.0\nGenerator: safeinstall-tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
    )
    members = {**files, f"{dist_info}/METADATA": metadata.encode(), f"{dist_info}/WHEEL": wheel_meta.encode()}
    return write_wheel(out_dir / f"{name}-{version}-py3-none-any.whl", members, dist_info)


def with_requirement(wheel: Path, out_dir: Path, requirement: str) -> Path:
    """A copy of ``wheel`` whose METADATA also requires ``requirement`` (RECORD rewritten to match)."""
    members, dist_info = members_of(wheel)
    metadata = members[f"{dist_info}/METADATA"].decode()
    head, _sep, body = metadata.partition("\n\n")
    headers = head.rstrip("\n") + f"\nRequires-Dist: {requirement}\n"
    members[f"{dist_info}/METADATA"] = (headers + ("\n" + body if body else "")).encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    return write_wheel(out_dir / wheel.name, members, dist_info)


def corrupt_member(wheel: Path, member: str) -> None:
    """Flip bytes inside one stored member's data: its METADATA stays readable, extracting it fails."""
    import zipfile

    with zipfile.ZipFile(wheel) as archive:
        info = archive.getinfo(member)
        offset = info.header_offset
    raw = bytearray(wheel.read_bytes())
    name_len = int.from_bytes(raw[offset + 26 : offset + 28], "little")
    extra_len = int.from_bytes(raw[offset + 28 : offset + 30], "little")
    start = offset + 30 + name_len + extra_len
    for i in range(start, start + min(8, info.file_size)):
        raw[i] ^= 0xFF
    wheel.write_bytes(bytes(raw))


def with_broken_dependency(wheel: Path, out_dir: Path) -> tuple[Path, Path]:
    """A copy of ``wheel`` that requires ``sidep``, whose wheel resolves but cannot be extracted (a
    corrupt member): (the new wheel, the find-links directory that holds sidep)."""
    links = out_dir / "links"
    links.mkdir(parents=True)
    dep = make_wheel(links, "sidep", "1.0", {"sidep/__init__.py": b"X = 1\n" * 100})
    corrupt_member(dep, "sidep/__init__.py")
    return with_requirement(wheel, out_dir / "new", "sidep"), links


def two_owners(python: Path, out: Path) -> tuple[Path, Path, Path]:
    """siownera 1.0, then siownerb 1.0 installed over one of its files (both RECORDs list
    ``sishared/core.py``, as cuda-python's and cuda-bindings' list ``cuda/bindings/*``): the file on
    disk is siownerb's. (the shared file, siownera's wheel, siownerb's wheel)"""
    out.mkdir(parents=True)
    first = make_wheel(out, "siownera", "1.0", {"sishared/core.py": b"A = 1\n", "siownera.py": b"x = 1\n"})
    second = make_wheel(out, "siownerb", "1.0", {"sishared/core.py": b"B = 2\n"})
    uv_install(python, first)
    uv_install(python, second)
    return site_packages(python) / "sishared" / "core.py", first, second


PIP_DOWNLOAD = (sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--only-binary", ":all:")


def pypi_wheels(out_dir: Path, specs: tuple[str, ...]) -> dict[str, Path]:
    """Wheels of ``specs`` (``name==version``, no dependencies) from the package index, by pip; keyed by
    name and by ``name-version`` (``idna``, ``idna-2.0``; a name downloaded at two versions: the first).
    One pip call for the first version of each name, one more for each further version (pip resolves
    the specs of one call together)."""
    rounds: list[list[str]] = []
    for spec in specs:
        name = spec.partition("==")[0]
        free = next((r for r in rounds if all(s.partition("==")[0] != name for s in r)), None)
        if free is None:
            rounds.append(free := [])
        free.append(spec)
    for specs_of_round in rounds:
        subprocess.run(
            [*PIP_DOWNLOAD, "-d", str(out_dir), *specs_of_round],
            check=True,
            capture_output=True,
            text=True,
        )
    found: dict[str, Path] = {}
    for spec in specs:
        name, _, version = spec.partition("==")
        stem = name.replace("-", "_").lower()
        (wheel,) = [w for w in out_dir.glob("*.whl") if w.name.lower().startswith(f"{stem}-{version}-")]
        found.setdefault(name, wheel)
        found[f"{name}-{version}"] = wheel
    return found


def rewrite_record_hash(wheel: Path, out: Path, member: str) -> Path:
    """A copy of ``wheel`` whose RECORD lies about one member (the wheel's fault, as in uv #11723)."""
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename.endswith(".dist-info/RECORD"):
                lines = []
                for line in data.decode().splitlines():
                    if line.startswith(member + ","):
                        fake = base64.urlsafe_b64encode(hashlib.sha256(b"x").digest()).rstrip(b"=").decode()
                        line = f"{member},sha256={fake},{line.rsplit(',', 1)[1]}"
                    lines.append(line)
                data = ("\n".join(lines) + "\n").encode()
            dst.writestr(info, data)
    return out
