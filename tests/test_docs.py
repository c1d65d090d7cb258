"""The documentation holds together (issue 24): the README stays a one-sitting read, and every relative
link of the README and of ``docs/`` names a file that exists, and a heading of it when it has an anchor;
and the code's docstrings stay short (issue 48): reference prose lives in ``docs/``.

Pure reads of the checkout; nothing is run.
"""

from __future__ import annotations

import ast
import re
import statistics
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 350
#: A module docstring says what the module is for; a function's or class's is one line plus what it
#: raises and, where not obvious, why. Lengths as written (``ast.get_docstring(node, clean=False)``).
MODULE_DOC_MAX = 600
MODULE_DOC_MEDIAN_MAX = 300
FUNCTION_DOC_MAX = 400

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


def docstring_problems(package: Path) -> list[str]:
    """Each docstring of ``package`` over its bound, and the module docstrings' median over its own."""
    problems: list[str] = []
    module_lengths: list[int] = []
    for source in sorted(package.rglob("*.py")):
        tree = ast.parse(source.read_text(encoding="utf-8"))
        where = source.relative_to(package.parent).as_posix()
        module_doc = len(ast.get_docstring(tree, clean=False) or "")
        module_lengths.append(module_doc)
        if module_doc > MODULE_DOC_MAX:
            problems.append(
                f"{where}: module docstring of {module_doc} characters (at most {MODULE_DOC_MAX})"
            )
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                length = len(ast.get_docstring(node, clean=False) or "")
                if length > FUNCTION_DOC_MAX:
                    problems.append(
                        f"{where}:{node.lineno}: {node.name}'s docstring of {length} characters"
                        f" (at most {FUNCTION_DOC_MAX})"
                    )
    median = statistics.median(module_lengths) if module_lengths else 0
    if median > MODULE_DOC_MEDIAN_MAX:
        problems.append(f"module docstrings: median {median} characters (at most {MODULE_DOC_MEDIAN_MAX})")
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


#: the promise map of docs/testing.md: from its heading to the next heading of its level
_PROMISE_MAP = re.compile(r"^## Promise map.*?(?=^## )", re.MULTILINE | re.DOTALL)
_NAMED = re.compile(r"`([^`\s]+)`")


def named_tests(section: str) -> list[tuple[str, str | None]]:
    """Pure: every test a promise map's cells name, as (file under ``tests/``, test name or None for a
    whole file): ``test_x.py::test_y`` and ``test_x.py`` set the file that a following ``::test_z`` in
    the same cell names; ``P45`` the one a following bare ``test_z`` names; a bare ``test_z`` without
    it names a test of any file (file ``*``)."""
    found: list[tuple[str, str | None]] = []
    for line in section.splitlines():
        if not line.startswith("|"):
            continue
        for cell in line.split(" | ")[1:]:
            current: str | None = None
            p45 = False
            for match in _NAMED.finditer(cell):
                text = match.group(1).removeprefix("tests/")
                if cell[: match.start()].rstrip().endswith("P45"):
                    p45 = True
                file, _, name = text.partition("::")
                if file.endswith(".py") and file.startswith("test_"):
                    current, p45 = file, False
                    found.append((file, name.partition("[")[0] or None))
                elif not file and name and current is not None:
                    found.append((current, name.partition("[")[0]))
                elif re.fullmatch(r"test_\w+", text):
                    found.append(("test_promises_45.py" if p45 else "*", text))
    return found


def test_every_test_the_promise_map_names_exists() -> None:
    """docs/testing.md maps each promise of the threat model, privsep.md and faults.md to tests (issue
    45): every test file and test it names is there (a renamed test would leave a promise undefended
    while the map still says it is held)."""
    text = (ROOT / "docs" / "testing.md").read_text(encoding="utf-8")
    match = _PROMISE_MAP.search(text + "\n## end\n")
    assert match is not None, "docs/testing.md has no promise map"
    named = named_tests(match.group(0))
    assert len(named) > 100, len(named)
    sources = {path.name: path.read_text(encoding="utf-8") for path in (ROOT / "tests").glob("test_*.py")}
    missing = []
    for file, name in named:
        files = list(sources) if file == "*" else [file]
        if not any(f in sources and (name is None or f"def {name}(" in sources[f]) for f in files):
            missing.append(f"{file}::{name}" if name else file)
    assert not missing, missing
    assert "**undefended**" not in match.group(0).lower()


def test_the_promise_map_reader_sees_a_misnamed_test() -> None:
    """The reader above, on a made-up map: a ``::name`` takes the cell's last file, ``P45`` a bare name."""
    section = (
        "| promise | `test_faults.py::test_a`, `::test_b`, P45 `test_c`, `test_d` |\n"
        "| other | `test_backup.py`, `test_e` |\n"
    )
    assert named_tests(section) == [
        ("test_faults.py", "test_a"),
        ("test_faults.py", "test_b"),
        ("test_promises_45.py", "test_c"),
        ("test_promises_45.py", "test_d"),
        ("test_backup.py", None),
        ("*", "test_e"),
    ]


def test_every_promise_test_has_a_mutation() -> None:
    """docs/testing.md: each test of ``tests/test_promises_45.py`` is named by a mutation of
    ``bench/mutations.py`` (seen killed): read as text, nothing imported."""
    tests = re.findall(
        r"^def (test_\w+)\(", (ROOT / "tests" / "test_promises_45.py").read_text(), re.MULTILINE
    )
    bench = (ROOT / "bench" / "mutations.py").read_text()
    joined = re.sub(r'"\s*\n\s*"', "", bench)  # the names split across string literals joined again
    assert [t for t in tests if t not in joined] == []


def test_docstrings_are_short_and_reference_prose_lives_in_docs() -> None:
    problems = docstring_problems(ROOT / "safeinstall")
    assert not problems, "move the reference prose into docs/:\n" + "\n".join(problems)


def test_the_docstring_check_sees_a_long_module_a_long_function_and_a_long_median(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()

    def module(name: str, module_doc: int, method_doc: int = 0) -> None:
        method = (
            f'\n\nclass C:\n    def f(self) -> None:\n        """{"f" * method_doc}"""\n'
            if method_doc
            else ""
        )
        (package / name).write_text(f'"""{"m" * module_doc}"""\n{method}', encoding="utf-8")

    module("a.py", MODULE_DOC_MEDIAN_MAX)
    module("b.py", MODULE_DOC_MEDIAN_MAX)
    module("c.py", MODULE_DOC_MEDIAN_MAX, method_doc=FUNCTION_DOC_MAX)
    assert docstring_problems(package) == []
    module("c.py", MODULE_DOC_MEDIAN_MAX, method_doc=FUNCTION_DOC_MAX + 1)
    assert docstring_problems(package) == ["pkg/c.py:5: f's docstring of 401 characters (at most 400)"]
    module("c.py", MODULE_DOC_MAX + 1)
    assert docstring_problems(package) == ["pkg/c.py: module docstring of 601 characters (at most 600)"]
    module("c.py", MODULE_DOC_MEDIAN_MAX + 1)
    module("d.py", MODULE_DOC_MEDIAN_MAX + 1)
    assert docstring_problems(package) == ["module docstrings: median 300.5 characters (at most 300)"]
