"""`make lint`'s import check: no import circle in src/corolla, and no module importing a layer above its own.

Every import counts, at module level or inside a function, `TYPE_CHECKING` ones included. The packages
are layered (LAYERS, bottom first): a module may import its own layer and those below. Inside `client/`,
its folders are layered the same way (CLIENT_LAYERS).
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

LAYERS = [
    {"errors", "config", "utils", "version"},
    {"wire"},
    {"models"},
    {"swarm"},
    {"engine"},
    {"server"},
    {"decoding"},
    {"client"},
    {"api", "sim"},
    {"launch"},
    {"cli"},
    {"__init__", "__main__"},  # the package's facade and `python -m corolla`
]
# client/'s folders (and its top modules), bottom first: docs/architecture.md says what each holds
CLIENT_LAYERS = [
    {"runtime"},
    {"rpc"},
    {"routing"},
    {"chain"},
    {"checks"},
    {"generation", "training"},
    {"hf"},
    {"client"},
    {"model"},
    {"__init__"},
]


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(root: Path) -> dict[str, set[str]]:
    """Each module of the package at `root` -> the package's modules it imports."""
    paths = {module_name(root, path): path for path in root.rglob("*.py")}
    graph = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        found = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join([*package.split(".")[: len(package.split(".")) - node.level + 1], base])
                found.update(
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else base
                    for alias in node.names
                )
        graph[name] = {target for target in found if target in paths and target != name}
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while (member := stack.pop()) != node:
                component.append(member)
            component.append(node)
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def rank(name: str, layers: list[set[str]]) -> int | None:
    return next((i for i, layer in enumerate(layers) if name in layer), None)


def arrows_up(graph: dict[str, set[str]], package: str) -> list[str]:
    """Imports of a layer above the importer's: packages of corolla, then modules of corolla.client."""
    problems = []
    for name, targets in sorted(graph.items()):
        for target in sorted(targets):
            for layers, depth in ((LAYERS, 1), (CLIENT_LAYERS, 2)):
                parts, target_parts = name.split("."), target.split(".")
                if depth == 2 and not (parts[1:2] == target_parts[1:2] == ["client"]):
                    continue
                mine = parts[depth] if len(parts) > depth else "__init__"
                theirs = target_parts[depth] if len(target_parts) > depth else "__init__"
                mine_rank, their_rank = rank(mine, layers), rank(theirs, layers)
                where = f"{package}.{parts[1]}" if depth == 2 else package
                if mine_rank is None or their_rank is None:
                    problems.append(
                        f"{name}: {mine if mine_rank is None else theirs} is in no layer of {where}"
                    )
                elif their_rank > mine_rank:
                    problems.append(f"{name} imports {target}, a layer above it")
    return problems


def problems(root: Path) -> list[str]:
    graph = imports(root)
    found = [f"import circle: {' <-> '.join(component)}" for component in circles(graph)]
    return found + arrows_up(graph, root.name)


if __name__ == "__main__":
    found = problems(Path(sys.argv[1] if len(sys.argv) > 1 else "src/corolla"))
    print("\n".join(found) or "imports: no circle, no import of a layer above")
    sys.exit(1 if found else 0)
