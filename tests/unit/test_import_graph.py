"""No two gateway modules import each other, directly or through others (lazy imports
inside functions included), and none is past 400 lines: each module can be read,
tested and moved on its own."""

from __future__ import annotations

from pathlib import Path

import grimp


def _cycles(graph: grimp.ImportGraph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return found


def test_the_package_has_no_import_circle() -> None:
    graph = grimp.build_graph("kvgateway")
    assert len(graph.modules) > 100
    assert _cycles(graph) == []


def test_no_module_holds_more_than_400_lines() -> None:
    """A module stays small enough to read in one sitting: at most 400 lines."""
    root = Path(__file__).resolve().parents[2] / "kvgateway"
    long = {
        str(p.relative_to(root)): n
        for p in root.rglob("*.py")
        if (n := len(p.read_text(encoding="utf-8").splitlines())) > 400
    }
    assert not long, long
