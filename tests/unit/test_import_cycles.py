"""No import circles among the four packages' modules (docs/architecture.md; issue 44).

The graph has an edge from a module to every module of the packages it imports, at the top, in a
function or under ``TYPE_CHECKING`` alike: an import inside a function holds a circle apart at
load time but leaves both modules needing each other (a type one needs from its caller is a
protocol declared below). Every strongly connected set of two or more modules must be one of
``ALLOWED``, the circles not yet broken; an entry that is no longer a circle fails too, so the
list only shrinks."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("detfp_format", "detfp_capture", "detfp_analyze", "detfp_guards")

#: The circles not yet broken (issue 44 named five; all are broken now, and the list may only shrink).
ALLOWED: set[frozenset[str]] = set()


def _module(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """Each module of the packages and the modules of the packages it imports (``from p import
    name``: the module ``p.name`` if there is one, else ``p`` itself)."""
    modules = {_module(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}

    def known(name: str) -> str | None:
        while name and name not in modules:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                targets.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module:
                targets.update(known(f"{node.module}.{a.name}") for a in node.names)
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def circles(graph: dict[str, set[str]]) -> set[frozenset[str]]:
    """The strongly connected sets of two or more modules (Tarjan's algorithm, without recursion)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            v, edges = work[-1]
            w = next(edges, None)
            if w is not None:
                if w not in index:
                    index[w] = low[w] = len(index)
                    stack.append(w)
                    on_stack.add(w)
                    work.append((w, iter(sorted(graph[w]))))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                part = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    part.add(w)
                    if w == v:
                        break
                if len(part) > 1:
                    found.add(frozenset(part))
    return found


def test_circles_are_found_through_function_level_and_type_only_imports():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"f"}, "f": {"e"}, "g": set()}
    assert circles(graph) == {frozenset("abc"), frozenset("ef")}
    real = import_graph()
    # The launcher's imports of its mode and of the Session are inside main(): they still count.
    assert "detfp_capture._launch.mode" in real["detfp_capture._launch.cli"]
    assert "detfp_capture.session" in real["detfp_capture._launch.cli"]


def test_the_import_graph_has_no_circle_but_the_allowed_ones():
    found = circles(import_graph())
    new = sorted(sorted(c) for c in found - ALLOWED)
    assert new == [], f"import circles (move what they share into a module below them): {new}"
    gone = sorted(sorted(c) for c in ALLOWED - found)
    assert gone == [], f"no longer circles: remove them from ALLOWED: {gone}"
