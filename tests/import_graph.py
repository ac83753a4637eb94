"""The generated package's import graph as it runs: every import that executes, deferred ones
and `importlib.import_module` of the package's own modules included (test_layout.py tests the
finder itself; test_render.py requires every render's graph to be free of cycles)."""

from __future__ import annotations

import ast
import re
from pathlib import Path


def module_name(package: Path, path: Path) -> str:
    parts = list(path.relative_to(package.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph(package: Path) -> dict[str, set[str]]:
    """{module: modules it imports when it runs}: top-level and deferred imports, and
    `importlib.import_module` of `f"{__package__}..."` (a name from a `*_MODULES` tuple of the
    same file counts as each of them); imports under `if TYPE_CHECKING:` never run."""
    modules = {module_name(package, path): path for path in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        typing_only = {
            id(child)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)
            for stmt in node.body
            for child in ast.walk(stmt)
        }
        here = name if path.name == "__init__.py" else name.rpartition(".")[0]
        listed = [
            ast.literal_eval(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(isinstance(t, ast.Name) and t.id.endswith("_MODULES") for t in node.targets)
        ]
        targets: set[str] = set()
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.ImportFrom):
                module = node.module or ""
                if node.level:
                    base = here.split(".")[: len(here.split(".")) - (node.level - 1)]
                    module = ".".join([*base, module]).strip(".")
                targets.add(module)
                targets |= {f"{module}.{alias.name}" for alias in node.names}
            elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith("import_module"):
                text = ast.unparse(node.args[0]) if node.args else ""
                found = re.search(r"\{__package__(\.rpartition\('\.'\)\[0\])?\}\.([\w.{}]+)", text)
                if found:
                    parent = here.rpartition(".")[0] if found[1] else here
                    names = (
                        [n for group in listed for n in group] if "{" in found[2] else [found[2]]
                    )
                    targets |= {f"{parent}.{n}" for n in names}
        edges: set[str] = set()
        for target in targets:
            while target:  # importing a.b.c runs a.b and a.b.c (a, the package, is running)
                if target in modules and target != name and not name.startswith(target + "."):
                    edges.add(target)
                target = target.rpartition(".")[0]
        graph[name] = edges
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            group: list[str] = []
            while not group or group[-1] != node:
                group.append(stack.pop())
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found
