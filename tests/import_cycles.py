"""Import cycles between the folders of a package (``python/hsdp`` by default).

usage: python tests/import_cycles.py [PACKAGE_DIR]      prints each cycle; exit 1 if any

A folder is a package's first level: ``hsdp/engine/api.py`` is in ``engine``, ``hsdp/hub.py``
in ``hub``, ``hsdp/__init__.py`` in the root (named as the package). Every import statement
counts, lazy ones inside functions too (a lazy import is still a dependency; it only runs
later), except those under ``if TYPE_CHECKING:``, which never run. The root is left out: it
re-exports the public names, so everything is below it, and a folder that imports the root
(``import hsdp``) is reported as such instead (the root would close a cycle with every folder).
Imports inside one folder are not edges. The layers are in docs/design.md ("File map").
"""

from __future__ import annotations

import ast
import sys
from collections.abc import Iterator
from pathlib import Path


def _module_name(root: Path, path: Path) -> list[str]:
    parts = [root.name, *path.relative_to(root).with_suffix("").parts]
    return parts[:-1] if parts[-1] == "__init__" else parts


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the statements under ``if TYPE_CHECKING:`` (or ``typing.TYPE_CHECKING``)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                for inner in node.body:
                    skip.update(id(n) for n in ast.walk(inner))
    return skip


def _imports(root: Path, path: Path) -> Iterator[list[str]]:
    """The absolute module names (as lists) ``path`` imports from within ``root``'s package."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skip = _type_checking_nodes(tree)
    here = _module_name(root, path)
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name.split(".")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)]
            else:
                base = []
            mod = base + (node.module.split(".") if node.module else [])
            for alias in node.names:  # a submodule, or a name of the module (same folder)
                if len(mod) == 1 and not _is_module(root, alias.name):
                    yield mod  # a name the root package defines or re-exports: the root
                else:
                    yield [*mod, alias.name]


def _is_module(root: Path, name: str) -> bool:
    """Whether the root package has a module or subpackage ``name`` (an extension too: _C)."""
    return (root / f"{name}.py").exists() or (root / name).is_dir() or any(root.glob(f"{name}.*.so"))


def folder_edges(root: Path) -> dict[str, set[str]]:
    """folder -> the folders it imports (the root package's own name for ``import hsdp``)."""
    pkg = root.name
    edges: dict[str, set[str]] = {}
    for path in sorted(root.rglob("*.py")):
        name = _module_name(root, path)
        src = name[1] if len(name) > 1 else pkg
        if src == pkg:
            continue  # the root re-exports everything (see the docstring)
        for target in _imports(root, path):
            if target[0] != pkg:
                continue
            dst = target[1] if len(target) > 1 else pkg
            if dst != src:
                edges.setdefault(src, set()).add(dst)
    return edges


def folder_cycles(root: Path) -> list[list[str]]:
    """One cycle per strongly connected group of folders, each as [a, ..., a] starting at its
    smallest name; a folder importing the root package counts as a cycle [folder, root, folder]."""
    edges = folder_edges(root)
    pkg = root.name
    cycles = [[src, pkg, src] for src in sorted(edges) if pkg in edges[src]]
    graph = {src: {d for d in dsts if d != pkg} for src, dsts in edges.items()}
    for group in _strong_groups(graph):
        if len(group) > 1:
            cycles.append(_cycle_through(min(group), group, graph))
    return sorted(cycles)


def _strong_groups(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's strongly connected components (iterative enough for a package's few folders)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []
    nodes = sorted(set(graph) | {d for ds in graph.values() for d in ds})

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            groups.append(group)

    for v in nodes:
        if v not in index:
            visit(v)
    return groups


def _cycle_through(start: str, group: set[str], graph: dict[str, set[str]]) -> list[str]:
    """A shortest cycle from ``start`` back to itself inside ``group`` (breadth first)."""
    prev: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph.get(v, ())):
                if w not in group:
                    continue
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(prev[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} is in a strong group but on no cycle")


def main(argv: list[str]) -> int:
    root = Path(argv[0]) if argv else Path(__file__).resolve().parent.parent / "python" / "hsdp"
    cycles = folder_cycles(root)
    for c in cycles:
        print(" -> ".join(c))
    print(f"{len(cycles)} import cycle(s) between the folders of {root}")
    return 1 if cycles else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
