"""The layout rules of docs/architecture.md, checked on the source: no import cycle among the
modules of pyengine/, no module importing another's underscore name, no switch read from the
environment at run time (kernels and the engine take typed config fields instead)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PACKAGE = REPO / "pyengine"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def load_modules() -> dict[str, ast.Module]:
    return {module_name(p): ast.parse(p.read_text(), str(p)) for p in sorted(PACKAGE.rglob("*.py"))}


def module_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    """Imports that run when the module is imported (not those in functions or TYPE_CHECKING)."""
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and "TYPE_CHECKING" not in ast.unparse(node.test):
            found += module_level_imports(node.body) + module_level_imports(node.orelse)
        elif isinstance(node, ast.Try):
            found += module_level_imports(node.body)
            for handler in node.handlers:
                found += module_level_imports(handler.body)
    return found


def import_graph(modules: dict[str, ast.Module]) -> dict[str, set[str]]:
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, tree in modules.items():
        for node in module_level_imports(tree.body):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                assert node.level == 0, f"{name}: relative import (pyengine imports absolutely)"
                base = node.module or ""
                targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        path.pop()
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (cycle := visit(start)):
            return cycle
    return None


def test_find_cycle_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_no_import_cycle_in_pyengine() -> None:
    graph = import_graph(load_modules())
    assert len(graph) > 40, "the walk found too few modules"
    assert find_cycle(graph) is None, f"import cycle: {' -> '.join(find_cycle(graph) or [])}"


def test_no_module_imports_another_modules_private_name() -> None:
    offenders = []
    for name, tree in load_modules().items():
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("pyengine"):
                offenders += [f"{name}: from {node.module} import {a.name}" for a in node.names
                              if a.name.startswith("_") and not a.name.startswith("__") and a.name != "_C"]
    assert offenders == []


def test_no_runtime_switch_is_read_from_the_environment() -> None:
    native = [p for d in ("csrc", "hipkernels") for p in (REPO / d).rglob("*") if p.suffix in (".h", ".cpp", ".hip")]
    assert native, "no native sources found"
    assert [str(p) for p in native if re.search(r"\bgetenv\s*\(", p.read_text())] == []
    python = [p for p in PACKAGE.rglob("*.py") if re.search(r"os\.environ|getenv", p.read_text())]
    assert [str(p.relative_to(REPO)) for p in python] == []
