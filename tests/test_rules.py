"""Each rule has one home (issue 48): who may write a file (``system/safefs``), whether a path lies
below a directory (``env/containment``), what a run id is, what a plain package name is. A rule
restated in a line or two elsewhere is too short for a duplicate finder; these checks find it."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

import safeinstall
from safeinstall.system import fields

PACKAGE = Path(safeinstall.__file__).parent
#: The home of the owner-plus-mode rule: the mode bits through which another may write are read there only.
MODE_HOME = "system/safefs.py"
#: The homes of containment: ``env/containment``, and the filesystem layer below it (``Tree.relative``).
CONTAINMENT_HOMES = frozenset({"env/containment.py", "system/safefs.py"})
#: The write bits of a group and of others, as a mode test spells them.
WRITE_BITS = frozenset({"S_IWGRP", "S_IWOTH"})
#: Octal masks that ask whether another may write (or read and write) a file.
MASKS = frozenset({0o022, 0o020, 0o002, 0o077})


def sources() -> dict[str, str]:
    return {p.relative_to(PACKAGE).as_posix(): p.read_text() for p in sorted(PACKAGE.rglob("*.py"))}


def mode_checks(text: str) -> list[str]:
    """Pure: where ``text`` reads the group's or others' write bits (``stat.S_IWGRP``, ``0o022`` and the
    like) itself; a umask is not a check."""
    found = []
    tokens = list(tokenize.generate_tokens(io.StringIO(text).readline))
    for i, token in enumerate(tokens):
        umask = [t.string for t in tokens[max(i - 2, 0) : i]] == ["umask", "("]
        octal = token.type == tokenize.NUMBER and token.string.lower().startswith("0o")
        if (token.type == tokenize.NAME and token.string in WRITE_BITS) or (
            octal and int(token.string, 8) in MASKS and not umask
        ):
            found.append(f"{token.start[0]}: {token.string}")
    return found


def _is_separator(node: ast.expr) -> bool:
    """A ``"/"`` or ``os.sep``."""
    return (isinstance(node, ast.Constant) and node.value == "/") or (
        isinstance(node, ast.Attribute) and node.attr == "sep"
    )


def _is_directory_start(node: ast.AST) -> bool:
    """``x.rstrip("/") + "/"``, ``os.fspath(x) + os.sep``: a directory made the start of what is below."""
    if not (isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add) and _is_separator(node.right)):
        return False
    left = node.left
    if not isinstance(left, ast.Call):
        return False
    func = left.func
    return (isinstance(func, ast.Attribute) and func.attr in ("rstrip", "fspath")) or (
        isinstance(func, ast.Name) and func.id == "fspath"
    )


def containment_checks(text: str) -> list[str]:
    """Pure: where ``text`` asks by itself whether a path lies below a directory: ``relative_to``,
    ``is_relative_to``, a directory made into a start (:func:`_is_directory_start`), or a ``startswith``
    on something plus ``"/"``."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if _is_directory_start(node):
            found.append(f"{getattr(node, 'lineno', 0)}: {ast.unparse(node)}")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr in ("relative_to", "is_relative_to"):
            found.append(f"{node.lineno}: {node.func.attr}")
        elif node.func.attr == "startswith" and node.args:
            argument = node.args[0]
            if (
                isinstance(argument, ast.BinOp)
                and isinstance(argument.op, ast.Add)
                and _is_separator(argument.right)
            ):
                found.append(f"{node.lineno}: startswith({ast.unparse(argument)})")
    return found


def definitions(text: str, names: frozenset[str]) -> list[str]:
    """Pure: the functions and module-level names of ``names`` that ``text`` defines."""
    found = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            found.append(node.name)
        elif isinstance(node, ast.Assign | ast.AnnAssign):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            found += [t.id for t in targets if isinstance(t, ast.Name) and t.id in names]
    return found


def test_who_may_write_a_file_is_asked_of_safefs_only() -> None:
    """The owner-plus-mode rule (``owner_alone_writes``, ``others_may_write``, ``private_to``,
    ``others_who_write``) lives in ``system/safefs``: no other module reads the write bits itself."""
    found = {
        name: checks for name, text in sources().items() if name != MODE_HOME if (checks := mode_checks(text))
    }
    assert found == {}


def test_containment_is_asked_of_env_containment_only() -> None:
    """Whether a path lies below a directory is asked of ``env/containment`` (``base``, ``bases``,
    ``is_below``, ``relative_path``, ``is_within``, ``relative_to_prefix``, ``Containment``)."""
    found = {
        name: checks
        for name, text in sources().items()
        if name not in CONTAINMENT_HOMES
        if (checks := containment_checks(text))
    }
    assert found == {}


def test_a_run_id_and_a_plain_name_are_defined_once() -> None:
    """One ``is_run_id`` (``store/state``: its pid part bounded, as it was for the history and the
    baseline) and one ``PLAIN_NAME`` (``run/parts/options``); no second run-id pattern under another name."""
    names = frozenset({"is_run_id", "_RUN_ID", "RUN_ID", "PLAIN_NAME", "_PLAIN_NAME"})
    found = sorted((name, module) for module, text in sources().items() for name in definitions(text, names))
    assert found == [
        ("PLAIN_NAME", "run/parts/options.py"),
        ("_RUN_ID", "store/state.py"),
        ("is_run_id", "store/state.py"),
    ]
    patterns = [module for module, text in sources().items() if re.search(r"\\d\{8\}T\\d\{6\}Z", text)]
    assert patterns == ["store/state.py"]


def test_the_checks_catch_a_rule_restated() -> None:
    """The finders above would fail: each way of restating a rule inline is found, a umask is not."""
    restated = "\n".join(
        [
            "import os, stat",
            "a = info.st_mode & 0o022",
            "b = mode & (stat.S_IWGRP | stat.S_IWOTH)",
            "c = info.st_mode & 0o077",
            "os.umask(0o022)",
            "d = path.relative_to(root)",
            "e = path.is_relative_to(root)",
            'f = root.rstrip("/") + "/"',
            "g = os.fspath(root) + os.sep",
            'h = name.startswith(dist_info + "/")',
        ]
    )
    assert [f.split(":")[0] for f in mode_checks(restated)] == ["2", "3", "3", "4"]
    assert [f.split(":")[0] for f in containment_checks(restated)] == ["6", "7", "8", "9", "10"]
    assert definitions("def is_run_id(x): ...\nPLAIN_NAME = 1\n", frozenset({"is_run_id", "PLAIN_NAME"})) == [
        "is_run_id",
        "PLAIN_NAME",
    ]


#: The typed field readers of ``system/fields``, as the modules that read JSON named their own copies.
READERS = frozenset(
    {"_check", "_text", "_text_or_none", "_texts", "_objects", "_is_number", "_typed", "_optional"}
    | {"_optional_text", "_get", "_list_of"}
)


def test_typed_json_field_readers_live_in_one_module() -> None:
    """The readers of a document's fields are ``system/fields``'s (issue 48: 13 private helpers in five
    modules); a module that reads JSON imports them, and defines none of its own under those names."""
    found = sorted(
        (node.name, module)
        for module, text in sources().items()
        if module != "system/fields.py"
        for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.FunctionDef) and node.name in READERS
        if node.args.args and node.args.args[0].arg in ("value", "data", "raw")
    )
    assert found == []


def test_the_field_readers_say_what_the_modules_said() -> None:
    """The messages a damaged journal, run document, prepared record or baseline gives are the ones each
    module gave before the readers moved (they reach the error line)."""
    with pytest.raises(ValueError, match=r"^steps\.name: int where the document has another type$"):
        fields.text(1, "steps.name")
    assert fields.texts(["a"], "x") == ("a",) and fields.text_or_none(None, "x") is None
    with pytest.raises(ValueError, match=r"^True is not a \(<class 'int'>, <class 'float'>\)$"):
        fields.typed(True, (int, float))
    with pytest.raises(ValueError, match=r"^'phase' is missing$"):
        fields.field({}, "phase", str)
    with pytest.raises(ValueError, match=r"^'pid' has the wrong type \(bool\)$"):
        fields.field({"pid": True}, "pid", int)
    with pytest.raises(ValueError, match=r"^'units' must be a list of str$"):
        fields.list_of({"units": [1]}, "units", str)
    with pytest.raises(ValueError, match=r"^wheel must be a non-empty string$"):
        fields.nonempty_text({"wheel": ""}, "wheel")
    assert fields.field({}, "x", int, optional=True) is None and fields.optional_text(None) is None
