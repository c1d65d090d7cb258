"""Unified diffs of locally modified text files against the wheel's contents (``--diff``)."""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from pathlib import Path

from safeinstall.env.drift import Finding, FindingKind
from safeinstall.env.wheel import read_member
from safeinstall.system.safefs import NotRegularFile, Tree


@dataclass(frozen=True, slots=True)
class FileDiff:
    path: str
    text: str | None  # None: not shown (binary, or unreadable), see `reason`
    reason: str = ""


def text_lines(data: bytes) -> list[str] | None:
    """The lines of a UTF-8 text file; None for a binary one (a NUL byte, or not UTF-8)."""
    if b"\0" in data:
        return None
    try:
        return data.decode("utf-8").splitlines(keepends=True)
    except UnicodeDecodeError:
        return None


def unified(path: str, expected: bytes, actual: bytes) -> FileDiff:
    """Pure: the diff from the wheel's bytes to the installed bytes."""
    before, after = text_lines(expected), text_lines(actual)
    if before is None or after is None:
        return FileDiff(path, None, "binary file")
    lines = difflib.unified_diff(before, after, fromfile=f"a/{path}", tofile=f"b/{path}")
    marker = "\n\\ No newline at end of file\n"
    text = "".join(line if line.endswith("\n") else line + marker for line in lines)
    return FileDiff(path, text)


#: Files larger than this are not diffed (a diff is for reading).
DIFF_LIMIT = 16 << 20


def diffs_for(findings: tuple[Finding, ...], wheel_path: Path, prefix: Path) -> list[FileDiff]:
    """Diffs for every modified file that came from the wheel, with paths relative to ``prefix``.

    The result applies with ``patch -p1 -d PREFIX`` (and ``-R`` takes the local edits out). Installed
    files are read by descriptor below the prefix: a file outside it, a symlink (or one on the way), a
    FIFO or a device is never read, and is said to be so."""
    found: list[FileDiff] = []
    with Tree(prefix) as tree:
        for finding in findings:
            if finding.kind != FindingKind.MODIFIED or finding.wheel_member is None:
                continue
            relative = tree.relative(finding.path)
            if relative is None:
                found.append(FileDiff(finding.path, None, "outside the environment: not read"))
                continue
            try:
                actual = tree.read_bytes(relative, DIFF_LIMIT)
                expected = read_member(wheel_path, finding.wheel_member, DIFF_LIMIT)
            except NotRegularFile as exc:
                found.append(FileDiff(finding.path, None, f"not a regular file ({exc.what}): not read"))
                continue
            except ValueError:
                found.append(FileDiff(finding.path, None, f"larger than {DIFF_LIMIT} bytes: not diffed"))
                continue
            except OSError as exc:
                found.append(FileDiff(finding.path, None, exc.strerror or str(exc)))
                continue
            found.append(unified(relative, expected, actual))
    return found


def patch_text(diffs: list[FileDiff]) -> str:
    return "".join(d.text for d in diffs if d.text)
