"""The package's layout rules that code can check (docs/architecture.md section 5)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "clover_gguf"


def import_graph(root: Path = PACKAGE) -> dict[str, set[str]]:
    """module -> the package modules it imports, at the top or inside a function alike."""
    names = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in names.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(root.name):
                deps.add(node.module)
                deps.update(f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in names)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name in names)
        graph[name] = {d for d in deps if d in names and d not in (name, root.name)}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    found, state, stack = [], {}, []

    def visit(u: str) -> None:
        state[u] = 1
        stack.append(u)
        for v in sorted(graph[u]):
            if state.get(v) == 1:
                found.append(stack[stack.index(v):] + [v])
            elif v not in state:
                visit(v)
        stack.pop()
        state[u] = 2

    for u in sorted(graph):
        if u not in state:
            visit(u)
    return found


def test_no_module_imports_itself_through_others():
    """Every import goes one way: a module that needs another never gets imported back by it, not even from inside a
    function (config reads generation_config.json, metadata only names keys; llama_memory uses llama_context)."""
    assert cycles(import_graph()) == []


def test_the_cycle_finder_finds_a_cycle(tmp_path):
    pkg = tmp_path / "clover_gguf"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from clover_gguf.b import x\n")
    (pkg / "b.py").write_text("def f():\n    from clover_gguf import a\n")
    assert cycles(import_graph(pkg)) == [["clover_gguf.a", "clover_gguf.b", "clover_gguf.a"]]
