"""The layering the folder names promise: no import circles anywhere in the package (imports inside
functions count too), and the model side never reaches up into the engine, the server or the tools."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "pagedserve"


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the package's modules it imports (``from pagedserve.x import y`` counts y when y is a
    module, else x)."""
    modules = {module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {m: set() for m in modules}
    for name, path in modules.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            for t in targets:
                if t.startswith("pagedserve") and t in modules and t != name:
                    graph[name].add(t)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert cycles(import_graph()) == []


def test_the_model_side_never_imports_the_layers_above_it():
    above = ("pagedserve.engine", "pagedserve.server", "pagedserve.bench", "pagedserve.tune", "pagedserve.entrypoints",
             "pagedserve.cli")
    graph = import_graph()
    wrong = {m: sorted(t for t in deps if t.startswith(above))
             for m, deps in graph.items() if m.startswith("pagedserve.model")}
    assert {m: d for m, d in wrong.items() if d} == {}


def test_config_and_the_memory_budget_sit_below_everything_they_describe():
    graph = import_graph()
    # sampling_params: config checks a model's recommended sampling defaults by the requests' own rules;
    # reasoning: the reasoning parsers' names; checks: values against their fields' types (both import
    # nothing of pagedserve)
    below = {"pagedserve.errors", "pagedserve.config", "pagedserve.builtin.known_models", "pagedserve.builtin.tiny",
             "pagedserve.sampling_params", "pagedserve.reasoning", "pagedserve.checks"}
    for m in ("pagedserve.config", "pagedserve.memory"):
        assert graph[m] <= below, (m, graph[m] - below)
    assert graph["pagedserve.sampling_params"] <= {"pagedserve.errors", "pagedserve.checks"}
    assert not graph["pagedserve.reasoning"] and not graph["pagedserve.checks"]
