"""``tools/`` is a package run as modules (``python -m tools.bench.kernels``): its modules import one another by
package name, never through ``sys.path``, and never from the tests (tests may import tools, not the reverse)."""

from __future__ import annotations

import ast
from pathlib import Path

TOOLS = Path(__file__).resolve().parents[2] / "tools"


def _imports(tree: ast.AST) -> list[str]:
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.append(node.module)
    return names


def test_tools_import_neither_the_tests_nor_through_sys_path():
    modules = sorted(TOOLS.rglob("*.py"))
    assert len(modules) > 20 and all((p.parent / "__init__.py").is_file() for p in modules)
    for path in modules:
        text = path.read_text()
        where = path.relative_to(TOOLS.parent)
        assert "sys.path" not in text, f"{where} edits sys.path"
        imported = _imports(ast.parse(text))
        assert not [n for n in imported if n.split(".")[0] == "tests"], f"{where} imports the tests"
        local = {p.stem for p in modules}
        assert not [n for n in imported if n in local], f"{where} imports a tool by its file name, not its package"
