"""Core's modules (and each backend's) import one another without cycles: each floor imports only the floors below it.

Every import counts, wherever it is written (module level, inside a function, under ``TYPE_CHECKING``): an import
moved into a function or under ``TYPE_CHECKING`` hides a cycle from Python, not from the design.  Any cycle fails,
naming its modules.
"""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

#: Core and the in-repo backends: each is checked on its own (a backend imports core, never the reverse).
PACKAGES = ["deepinfer", "deepinfer_cuda", "deepinfer_ascend"]


def _modules(package: str = "deepinfer") -> dict[str, Path]:
    spec = importlib.util.find_spec(package)  # located, not imported: a backend's import may need its hardware
    assert spec is not None and spec.origin is not None, f"{package} is not installed"
    root = Path(spec.origin).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of the package ``name`` imports anywhere in its source (a ``from a import b`` of a submodule ``b``
    imports ``a.b``; of a name, the nearest module that defines it)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([node.module] if node.module else []))
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for target in targets:
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target in modules and target != name:
                found.add(target)
    return found


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """Strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            child = next(edges, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(component)
    return found


def test_cycle_finder_finds_a_cycle_through_a_function_level_import():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert _cycles(graph) == [{"a", "b", "c"}]
    assert _cycles({"a": {"b"}, "b": set()}) == []


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_cycles(package):
    modules = _modules(package)
    graph = {name: _imports(name, path, modules) for name, path in modules.items()}
    assert package != "deepinfer" or graph["deepinfer.engine.llm"], "the import walk found nothing: it is broken"
    cycles = [sorted(c) for c in _cycles(graph)]
    assert not cycles, f"import cycles in {package}: {cycles}"
