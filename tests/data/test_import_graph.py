"""The modules of ``ssl_xcit.data`` import each other without a circle (function-level imports included), so
data flows one way: folders and shards -> datasets -> the data module."""

from __future__ import annotations

import ast
from pathlib import Path

import ssl_xcit.data

PACKAGE = "ssl_xcit.data"


def _modules() -> dict[str, Path]:
    folder = Path(ssl_xcit.data.__file__).parent
    return {
        (PACKAGE if path.stem == "__init__" else f"{PACKAGE}.{path.stem}"): path
        for path in sorted(folder.glob("*.py"))
    }


def _imports(path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the package that ``path`` imports anywhere in its body (top level or inside functions)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            # `from ssl_xcit.data import datasets` names a submodule; `from ssl_xcit.data import X` else the package.
            names = [f"{node.module}.{alias.name}" for alias in node.names] + [node.module]
        else:
            continue
        for name in names:
            if name in modules:
                found.add(name)
                break
    return found


def _cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle of ``graph`` as a path that starts and ends at the same module, or None."""
    state: dict[str, str] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(path, modules) - {name} for name, path in modules.items()}


def test_the_cycle_finder_finds_a_circle_and_accepts_a_chain():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b", "c"}, "b": {"c"}, "c": set()}) is None


def test_the_graph_sees_function_level_imports():
    graph = _graph()
    # shards.py reads the folder listing inside a function only.
    assert "ssl_xcit.data.folders" in graph["ssl_xcit.data.shards"]
    assert graph["ssl_xcit.data.datasets"] >= {"ssl_xcit.data.shards", "ssl_xcit.data.shard_dataset"}


def test_no_import_circle_in_the_data_package():
    cycle = _cycle(_graph())
    assert cycle is None, "import circle: " + " -> ".join(cycle)
