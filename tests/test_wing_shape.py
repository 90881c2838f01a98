"""The transfer wing keeps the shape issue 36 gave it, so that a merge cannot quietly undo it: the two facades stay
small (every other class of the wing is held under 250 lines with the channels' and the router's: test_class_sizes.py),
no module of the wing imports one that imports it back (type-only imports included), and no call in the wing passes
more than five positional arguments (state is built by keyword)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

WING = Path(__file__).resolve().parent.parent / "pdkv" / "transfer"
FACADES = {"sender.py": ("KVSender", 200), "receiver.py": ("KVReceiver", 250)}
MAX_POSITIONAL = 5


def _tree(name: str) -> ast.Module:
    return ast.parse((WING / name).read_text())


@pytest.mark.parametrize("module", sorted(FACADES))
def test_each_facade_stays_under_its_size(module: str) -> None:
    cls, limit = FACADES[module]
    found = [n for n in _tree(module).body if isinstance(n, ast.ClassDef) and n.name == cls]
    assert found, f"{cls} is no longer in pdkv/transfer/{module}"
    lines = found[0].end_lineno - found[0].lineno + 1  # type: ignore[operator]
    assert lines < limit, f"{cls} is {lines} lines; it is a facade over the wing's rooms: under {limit}"


def _wing_imports() -> dict[str, set[str]]:
    """Each wing module -> the wing modules it imports, at any level (under TYPE_CHECKING too)."""
    modules = {p.stem for p in WING.glob("*.py") if p.stem != "__init__"}
    graph: dict[str, set[str]] = {}
    for name in modules:
        deps: set[str] = set()
        for node in ast.walk(_tree(f"{name}.py")):
            if isinstance(node, ast.ImportFrom) and node.module:
                if node.module.startswith("pdkv.transfer."):
                    deps.add(node.module.split(".")[2])
                elif node.module == "pdkv.transfer":
                    deps.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.Import):
                deps.update(a.name.split(".")[2] for a in node.names if a.name.startswith("pdkv.transfer."))
        graph[name] = deps & modules - {name}
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1 on the path, 2 done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                return path[path.index(dep) :] + [dep]
            if dep not in state and (found := visit(dep)):
                return found
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_circle_in_the_wing() -> None:
    assert _cycle(_wing_imports()) is None, f"import circle in pdkv/transfer: {' -> '.join(_cycle(_wing_imports()))}"


def test_the_circle_check_finds_one() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]


def test_no_call_in_the_wing_passes_more_than_five_positional_arguments() -> None:
    wide = [
        f"{p.name}:{node.lineno}"
        for p in sorted(WING.glob("*.py"))
        for node in ast.walk(ast.parse(p.read_text()))
        if isinstance(node, ast.Call) and len(node.args) > MAX_POSITIONAL
    ]
    assert not wide, f"calls with more than {MAX_POSITIONAL} positional arguments (pass them by keyword): {wide}"
