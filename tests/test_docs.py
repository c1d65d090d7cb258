"""The documentation holds together (issue 24): the README stays a one-sitting read, and every relative
link of the README and of ``docs/`` names a file that exists, and a heading of it when it has an anchor.

Pure reads of the checkout; nothing is run.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 350

#: ``[text](target)`` and ``[text](target "title")``; images too (``![alt](target)``).
_LINK = re.compile(r"\[[^\]]*\]\(\s*([^)\s]+)(?:\s+\"[^\"]*\")?\s*\)")
_FENCE = re.compile(r"^(```|~~~).*?^\1[^\n]*$", re.MULTILINE | re.DOTALL)
_CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")
_HEADING = re.compile(r"^(#{1,6})\s+(.+?)\s*#*\s*$", re.MULTILINE)


def markdown_files() -> list[Path]:
    """The pages whose links are checked: the README, every page of ``docs/``, the collection's README."""
    return [
        ROOT / "README.md",
        *sorted((ROOT / "docs").glob("*.md")),
        ROOT / "ansible_collections" / "safeinstall" / "fleet" / "README.md",
    ]


def without_code(text: str) -> str:
    """The text with fenced code blocks and code spans taken out: a ``[x](y)`` in code is not a link."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def links(text: str) -> Iterator[str]:
    """Every link target of a Markdown text, outside code."""
    for line in without_code(text).splitlines():
        for match in _LINK.finditer(line):
            yield match.group(1)


def is_relative(target: str) -> bool:
    return not re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE)


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: code marks and punctuation dropped, lower case, spaces as ``-``."""
    text = heading.replace("`", "").strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings (a repeated heading gets ``-1``, ``-2``, as on GitHub)."""
    seen: dict[str, int] = {}
    found: set[str] = set()
    for match in _HEADING.finditer(_FENCE.sub("", text)):
        base = slug(match.group(2))
        count = seen.get(base, 0)
        seen[base] = count + 1
        found.add(base if count == 0 else f"{base}-{count}")
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Each relative link of ``page`` whose file does not exist, or whose anchor is no heading there
    (named relative to ``root``)."""
    text = page.read_text(encoding="utf-8")
    problems = []
    for target in links(text):
        if not is_relative(target):
            continue
        path_part, _, anchor = target.partition("#")
        destination = (page.parent / path_part).resolve() if path_part else page
        where = f"{page.relative_to(root)}: {target}"
        if not destination.exists():
            problems.append(f"{where} (no such file)")
        elif (
            anchor
            and destination.suffix == ".md"
            and anchor not in anchors(destination.read_text(encoding="utf-8"))
        ):
            problems.append(f"{where} (no such heading)")
    return problems


def test_the_readme_is_a_one_sitting_read() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference text into docs/"


def test_ci_runs_exactly_the_readmes_test_command() -> None:
    """``.ci/run`` ends with the README's test command, word for word (the README promises it)."""
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    ci_command = (ROOT / ".ci" / "run").read_text(encoding="utf-8").strip().splitlines()[-1]
    assert ci_command in readme
    assert ci_command.endswith("-m pytest -q")


def test_every_relative_link_names_a_file_and_a_heading_that_exist() -> None:
    problems = [problem for page in markdown_files() for problem in broken_links(page)]
    assert not problems, "\n".join(problems)


def test_every_docs_page_the_code_names_exists() -> None:
    """Hints, help texts, docstrings and shipped units name ``docs/<page>.md``: each page exists."""
    named = {
        (match.group(0), source.relative_to(ROOT).as_posix())
        for folder in ("safeinstall", "ansible_collections", "bench", "tests")
        for source in sorted((ROOT / folder).rglob("*"))
        if source.is_file() and source.suffix in {".py", ".service", ".timer", ".yml"}
        for match in re.finditer(r"docs/[\w-]+\.md", source.read_text(encoding="utf-8", errors="replace"))
    }
    assert named, "no page named: the search is broken"
    missing = sorted(f"{where}: {page}" for page, where in named if not (ROOT / page).is_file())
    assert not missing, "\n".join(missing)


def test_the_link_check_sees_a_missing_file_and_a_missing_heading(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    (tmp_path / "other.md").write_text("# Other\n\n## `--json`: the result\n", encoding="utf-8")
    page.write_text(
        "# Page\n\n[ok](other.md) [ok](other.md#--json-the-result) [ok](#page) [web](https://x.invalid/y)\n"
        "[gone](missing.md) [no heading](other.md#nowhere)\n\n```\n[in code](nowhere.md)\n```\n"
        "`[span](nowhere.md)`\n",
        encoding="utf-8",
    )
    assert broken_links(page, root=tmp_path) == [
        "page.md: missing.md (no such file)",
        "page.md: other.md#nowhere (no such heading)",
    ]
