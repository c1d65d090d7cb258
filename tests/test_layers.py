"""The layout shows the layers, and the import rule between them holds (docs/architecture.md).

    cli  ->  run  ->  scan | store  ->  env  ->  system  ->  errors

A module imports only from its own layer or a lower one; ``cli`` only from ``run`` (and ``errors``):
it parses, calls one command and renders; ``scan`` and ``store`` never import each
other; no two modules import each other, directly or around a circle. Every import counts: at the
top, inside a function, or under ``TYPE_CHECKING``.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable, Mapping
from pathlib import Path

import safeinstall

PACKAGE = Path(safeinstall.__file__).parent

#: Each layer's rank: a module may import what ranks the same or lower.
RANK = {"errors": 0, "system": 1, "env": 2, "scan": 3, "store": 3, "run": 4, "cli": 5}
#: Same rank, yet never importing each other.
APART = frozenset({"scan", "store"})
#: What ``cli`` may import: it parses, calls one command of ``run`` and renders (no layer below run).
CLI_READS = frozenset({"cli", "run", "errors"})
#: The entry points sit on top of everything.
ENTRY = frozenset({"safeinstall", "safeinstall.__main__"})


def _module_of(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {_module_of(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imports(path: Path, known: Iterable[str]) -> set[str]:
    """The safeinstall modules ``path`` imports, wherever the import statement is."""
    names = set(known)
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names if a.name in names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if not node.module.startswith("safeinstall"):
                continue
            for alias in node.names:
                child = f"{node.module}.{alias.name}"
                found.add(child if child in names else node.module)
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def violations(edges: Mapping[str, Iterable[str]]) -> list[str]:
    """Pure: every import that breaks the rule, as ``a -> b (why)``."""
    problems = []
    for source, targets in sorted(edges.items()):
        if source in ENTRY:
            continue
        for target in sorted(targets):
            if target in ENTRY or target == source:
                continue
            low, high = layer(target), layer(source)
            if low not in RANK or high not in RANK:
                problems.append(f"{source} -> {target} (a module outside the layers)")
            elif RANK[low] > RANK[high]:
                problems.append(f"{source} -> {target} (upward: {high} imports {low})")
            elif low != high and {low, high} <= APART:
                problems.append(f"{source} -> {target} ({high} and {low} never import each other)")
            elif high == "cli" and low not in CLI_READS:
                problems.append(f"{source} -> {target} (cli imports only run: {low} is below it)")
    return problems


def circles(edges: Mapping[str, Iterable[str]]) -> list[list[str]]:
    """Pure: the import circles (strongly connected components of more than one module)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in edges.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(edges):
        if node not in index:
            visit(node)
    return found


def graph() -> dict[str, set[str]]:
    found = modules()
    packages = {m for m, p in found.items() if p.name == "__init__.py"}
    return {
        m: {t for t in imports(p, found) if t not in packages} - {m}
        for m, p in found.items()
        if m not in packages or m == "safeinstall"
    }


def test_every_import_follows_the_layer_rule() -> None:
    assert violations(graph()) == []


def test_no_import_circle() -> None:
    assert circles(graph()) == []


def test_at_most_eight_modules_at_the_top_and_every_module_in_a_layer() -> None:
    top = [p.name for p in PACKAGE.glob("*.py")]
    assert len(top) <= 8, top
    assert {layer(m) for m in modules()} <= {*RANK, ""} | {"errors", "__main__"}


def test_the_rule_catches_an_upward_import_a_crossing_a_cli_below_run_and_a_circle() -> None:
    """The checks above would fail: an import against the rule is named (``cli`` reaching past ``run``
    too), and a circle is found."""
    edges = {
        "safeinstall.system.safefs": {"safeinstall.env.records"},
        "safeinstall.scan.plan": {"safeinstall.store.state"},
        "safeinstall.run.a": {"safeinstall.run.b"},
        "safeinstall.run.b": {"safeinstall.run.a"},
        "safeinstall.cli.app": {"safeinstall.run.a", "safeinstall.errors", "safeinstall.cli.render"},
        "safeinstall.cli.render": {"safeinstall.env.drift"},
    }
    assert violations(edges) == [
        "safeinstall.cli.render -> safeinstall.env.drift (cli imports only run: env is below it)",
        "safeinstall.scan.plan -> safeinstall.store.state (scan and store never import each other)",
        "safeinstall.system.safefs -> safeinstall.env.records (upward: system imports env)",
    ]
    assert circles(edges) == [["safeinstall.run.a", "safeinstall.run.b"]]


def _prefix_checks(path: Path) -> list[str]:
    """Where ``path`` asks by itself whether a path lies in another: ``Path.is_relative_to``, or
    ``startswith`` on an environment's prefix (``env.prefix``, ``env.base_prefix``)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr == "is_relative_to":
            found.append(f"{path.name}:{node.lineno} is_relative_to")
        elif node.func.attr == "startswith" and node.args:
            text = ast.unparse(node.args[0])
            if "prefix" in text and "env." in text:
                found.append(f"{path.name}:{node.lineno} startswith({text})")
    return found


def test_containment_in_a_prefix_has_one_rule() -> None:
    """Whether a path lies inside an environment's prefix is asked of ``env/containment`` only
    (``is_within``, ``relative_to_prefix``, ``Containment``; issue 37), never answered again inline."""
    found = [
        check
        for module, path in modules().items()
        if module != "safeinstall.env.containment"
        for check in _prefix_checks(path)
    ]
    assert found == []


def test_the_cli_only_parses_and_renders() -> None:
    """``cli/app.py`` parses, calls one command and exits (issue 37: it was 1,029 lines that read the
    history, chose runs and wrote metrics): it stays small, and it calls ``run`` through one function,
    with the run's typed options (``run/parts/options``: issue 48)."""
    app = PACKAGE / "cli" / "app.py"
    assert len(app.read_text().splitlines()) < 400
    assert imports(app, modules()) <= {
        "safeinstall.cli.params",
        "safeinstall.cli.render",
        "safeinstall.cli.show",
        "safeinstall.cli.usage",
        "safeinstall.errors",
        "safeinstall.run.commands.modes",
        "safeinstall.run.parts.options",
        "safeinstall.run.parts.output",
        "safeinstall",
    }


# ------------------------------------------------------------------ the rooms of run (issue 48 item 3)

#: Inside a layer, its rooms (subpackages), highest first: a module imports from its own room or a lower one.
ROOMS = {"run": ("commands", "steps", "back", "parts")}


def room(module: str) -> str | None:
    """The room of ``module`` within its layer (``safeinstall.run.steps.smoke``: ``steps``), or None."""
    parts = module.split(".")
    return parts[2] if len(parts) > 3 and parts[1] in ROOMS else None


def room_violations(edges: Mapping[str, Iterable[str]]) -> list[str]:
    """Pure: every import from a higher room of the same layer, or of a module of a roomed layer that
    lies in no room, as ``a -> b (why)``."""
    problems = []
    for source, targets in sorted(edges.items()):
        for target in sorted(targets):
            if layer(source) != layer(target) or layer(source) not in ROOMS:
                continue
            order = ROOMS[layer(source)]
            high, low = room(source), room(target)
            if high is None or low is None or high not in order or low not in order:
                problems.append(f"{source} -> {target} (a module outside the rooms {', '.join(order)})")
            elif order.index(low) < order.index(high):
                problems.append(f"{source} -> {target} (upward: {high} imports {low})")
    return problems


def test_every_import_inside_run_follows_the_room_order() -> None:
    assert room_violations(graph()) == []


def test_every_module_of_run_lies_in_a_room() -> None:
    loose = [
        m
        for m, p in modules().items()
        if layer(m) in ROOMS and p.name != "__init__.py" and room(m) not in ROOMS[layer(m)]
    ]
    assert loose == []


def test_the_room_rule_catches_an_upward_import_and_a_module_outside_the_rooms() -> None:
    edges = {
        "safeinstall.run.parts.running": {"safeinstall.run.steps.reinstall", "safeinstall.env.keep"},
        "safeinstall.run.back.rollback": {"safeinstall.run.parts.running", "safeinstall.run.loose"},
        "safeinstall.run.commands.modes": {"safeinstall.run.back.recover", "safeinstall.run.commands.view"},
    }
    assert room_violations(edges) == [
        "safeinstall.run.back.rollback -> safeinstall.run.loose (a module outside the rooms "
        "commands, steps, back, parts)",
        "safeinstall.run.parts.running -> safeinstall.run.steps.reinstall (upward: parts imports steps)",
    ]
