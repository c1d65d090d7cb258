"""Nothing unlisted where Python looks first: the top of each site directory and each shared directory,
looked at for code no RECORD lists.

What a fresh environment holds there by its own maker is known: docs/verify.md."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from safeinstall.env.bytecode import pyc_name
from safeinstall.env.records import digest_bytes
from safeinstall.system.safefs import open_file

#: What Python runs or imports from a directory it looks in: modules, extension modules, bytecode,
#: ``.pth`` files (each ``import`` line runs), ``sitecustomize``/``usercustomize``.
CODE_SUFFIXES = (".py", ".pyc", ".pyo", ".pyw", ".pth", ".so", ".pyd")

#: A venv maker's own files, by name: the exact contents it writes (sha256, RECORD spelling).
KNOWN_FILES: Mapping[str, frozenset[str]] = {
    "_virtualenv.pth": frozenset(
        {digest_bytes(b"import _virtualenv"), digest_bytes(b"import _virtualenv\n")}
    ),
    # virtualenv 20.x-21.x's copy of create/via_global_ref/_virtualenv.py (written for Python < 3.10)
    "_virtualenv.py": frozenset({"Z-Vsr71o_TGg6HEA8RHX0va3FXJBCWUAATwH6I2Aoi8"}),
}
_KNOWN_LIMIT = 64 << 10


def is_code(name: str) -> bool:
    """Pure: a file name Python may import or run from a directory it looks in."""
    return name.endswith(CODE_SUFFIXES) or ".so." in name or name.endswith("customize.py")


@dataclass(frozen=True, slots=True)
class Unlisted:
    """A file where Python looks first that no RECORD lists."""

    location: str
    owner: str  # the distribution it is reported under ("" for the top of a site directory)
    detail: str


@dataclass(frozen=True, slots=True)
class Looked:
    unlisted: tuple[Unlisted, ...]
    bytecode: tuple[tuple[str, str], ...]  # (a __pycache__ .pyc found, the owner it is reported under)


def look(
    sites: Iterable[str],
    owners: Mapping[str, set[str]],
    listed: frozenset[str],
    walk: Callable[[str], list[str]],
) -> Looked:
    """The top of each of ``sites`` and each directory ``owners`` says two or more distributions share:
    each code file no RECORD lists (``listed``), a known venv file with its known contents left out;
    each directory no distribution has a file in, walked whole (``walk``), its code files too; and the
    ``__pycache__`` bytecode of both, to be judged."""
    unlisted: list[Unlisted] = []
    bytecode: list[tuple[str, str]] = []
    shared = sorted(d for d, names in owners.items() if len(names) > 1)
    places = [(site, "", f"at the top of {site}") for site in sites]
    places += [(d, sorted(owners[d])[0], f"in {d}, shared by {', '.join(sorted(owners[d]))}") for d in shared]
    for directory, owner, where in places:
        for name, path, is_dir, is_link in _listing(directory):
            if is_link and path not in listed and name.isidentifier():
                # a package by another name: Python follows the link (code kept anywhere), no walk does
                unlisted.append(Unlisted(path, owner, f"{where}, a symbolic link no RECORD lists"))
                continue
            if is_dir:
                if name == "__pycache__":
                    for pyc in walk(path):
                        if pyc_name(pyc) is not None:
                            bytecode.append((pyc, owner))
                        elif is_code(pyc) and pyc not in listed:
                            unlisted.append(Unlisted(pyc, owner, f"{where}, in no RECORD"))
                elif path not in owners and not name.endswith((".dist-info", ".egg-info")):
                    for found in walk(path):
                        if pyc_name(found) is not None:
                            bytecode.append((found, owner))
                        elif is_code(os.path.basename(found)) and found not in listed:
                            said = f"in {path}, a directory no RECORD lists a file of"
                            unlisted.append(Unlisted(found, owner, said))
                continue
            if path in listed or not is_code(name):
                continue
            known = KNOWN_FILES.get(name) if owner == "" else None
            if known is not None and _digest(path) in known:
                continue
            unlisted.append(Unlisted(path, owner, f"{where}, in no RECORD"))
    return Looked(tuple(unlisted), tuple(bytecode))


def _listing(directory: str) -> list[tuple[str, str, bool, bool]]:
    """(name, path, is a directory: not a symlink to one, is a symlink) of each entry; [] when it cannot
    be listed."""
    found: list[tuple[str, str, bool, bool]] = []
    try:
        with os.scandir(directory) as entries:
            for entry in entries:
                try:
                    is_dir = entry.is_dir(follow_symlinks=False)
                    is_link = entry.is_symlink()
                except OSError:
                    is_dir = is_link = False
                found.append((entry.name, entry.path, is_dir, is_link))
    except OSError:
        return []
    return sorted(found)


def _digest(path: str) -> str | None:
    """The sha256 of a small regular file (not followed if a symlink, never a FIFO or a device opened),
    or None."""
    try:
        fd, info = open_file(path, follow=False)
    except OSError:
        return None
    try:
        if info.st_size > _KNOWN_LIMIT:
            return None
        return digest_bytes(os.read(fd, _KNOWN_LIMIT + 1))
    except OSError:
        return None
    finally:
        os.close(fd)
