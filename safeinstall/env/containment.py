"""The one containment rule: is a path inside the environment's prefix, lexically and after
resolving the symlinks of the directories above it (the file itself is never followed). Verification
refuses to read what lies outside; the backup never saves it."""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from pathlib import Path, PurePath
from typing import TypeVar

P = TypeVar("P", bound=PurePath)


def base(root: str) -> str:
    """Pure: the start of every path strictly below ``root``: ``root`` with one trailing ``/``."""
    return root.rstrip("/") + "/"


def bases(roots: Iterable[str | os.PathLike[str]]) -> tuple[str, ...]:
    """Pure: :func:`base` of each of ``roots``, in order (for one ``str.startswith`` over them all)."""
    return tuple(base(os.fspath(root)) for root in roots)


def is_below(path: str, root: str) -> bool:
    """Pure: ``path`` lies strictly below ``root``, lexically (both normalised; never ``root`` itself)."""
    return path.startswith(base(root))


def relative_path(path: P, root: PurePath) -> P:
    """Pure: ``path`` relative to ``root``, lexically (:meth:`PurePath.relative_to`). Raises ValueError
    when it does not lie at or below ``root``."""
    return path.relative_to(root)


def is_within(path: str, root: str) -> bool:
    """String containment of normalised absolute paths (pathlib is too slow for 100k checks)."""
    return path == root or path.startswith(root if root.endswith(os.sep) else root + os.sep)


def relative_to_prefix(location: Path | str, prefix: Path | str) -> str | None:
    """Pure: ``location`` (normalised lexically) relative to ``prefix``, or None when outside it."""
    normal = os.path.normpath(location)
    root = os.fspath(prefix)
    base = root if root.endswith(os.sep) else root + os.sep
    if not normal.startswith(base) or len(normal) == len(base):
        return None
    return normal[len(base) :]


class Containment:
    """Is a path inside the prefix, lexically and after resolving its directory's symlinks?

    Files are never followed, so resolving the directory (cached, an ``lstat`` each) is enough."""

    def __init__(self, prefix: Path) -> None:
        self.prefix = os.fspath(prefix)
        self._real_dirs: dict[str, bool] = {self.prefix: True}

    def relative(self, location: Path | str) -> str | None:
        """``location`` relative to the prefix when it lies inside (lexically and after resolving its
        directory's symlinks), else None. (:func:`relative_to_prefix` written out: normalised once.)"""
        normal = os.path.normpath(location)
        base = self.prefix if self.prefix.endswith(os.sep) else self.prefix + os.sep
        if not normal.startswith(base) or len(normal) == len(base) or self.outside(normal):
            return None
        return normal[len(base) :]

    def outside(self, location: str) -> bool:
        directory = location.rpartition("/")[0]  # normalised absolute: its name has no ".."
        inside = self._real_dirs.get(directory)  # known: within the prefix (nothing else is cached)
        if inside is None:
            if not is_within(location, self.prefix):
                return True
            inside = self._inside(directory)
        return not inside

    def _inside(self, directory: str) -> bool:
        """Climbs (a loop: a RECORD path may be thousands of directories deep) to a directory known,
        a symlink (resolved) or the prefix's parent; every directory on the way gets the answer."""
        climbed: list[str] = []
        inside = self._real_dirs.get(directory)
        while inside is None:
            if not is_within(directory, self.prefix):
                inside = False  # above the prefix (a RECORD path naming the prefix itself)
                break
            climbed.append(directory)
            try:
                is_link = stat.S_ISLNK(os.lstat(directory).st_mode)
            except OSError:
                is_link = False  # missing: reported as missing, never read
            if is_link:
                inside = is_within(os.path.realpath(directory), self.prefix)
            else:
                directory = os.path.dirname(directory)
                inside = self._real_dirs.get(directory)
        for each in climbed:
            self._real_dirs[each] = inside
        return inside
