"""Imports run one way: no module of the project imports, directly or through others, one that imports it.

Every import statement counts, wherever it stands: at the top of a module, under ``if TYPE_CHECKING:``
or inside a function (a lazy import is still a dependency). A part that needs what the module above it
holds describes that in a small ``Protocol`` of its own (shard/delayed.py ``DelayShard``, say), and the
module above imports the part, never the other way round (docs/architecture.md, "Import direction").
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Not the project's modules: the tests themselves, environments and generated trees.
SKIP = {"tests", "build", "dist", "node_modules"}


def project_modules() -> dict[str, Path]:
    """Dotted name -> file, for every .py of the project (a package as its __init__.py)."""
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = path.relative_to(ROOT).parts
        if parts[0] in SKIP or any(p.startswith(".") for p in parts):
            continue
        names = list(parts[:-1]) + ([] if path.name == "__init__.py" else [path.stem])
        if names:
            found[".".join(names)] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules that ``name`` imports anywhere in its file."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            # `from pkg import mod` names the module mod; `from mod import name` names mod.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                       for alias in node.names]
        else:
            continue
        for target in targets:
            while target and target not in modules:  # `import a.b.c` of a name defined in a.b
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))
    return found


def test_the_check_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": set()}
    assert circles(graph) == [["a", "b", "c"]]


def test_no_module_imports_one_that_imports_it():
    modules = project_modules()
    assert "shard.worker" in modules and "frontend.amqp.channel" in modules  # the walk sees the tree
    graph = {name: imports_of(name, path, modules) for name, path in modules.items()}
    assert "shard.delayed" in graph["shard.worker"] and "frontend.amqp.channel" in graph["frontend.amqp.connection"]
    found = circles(graph)
    detail = "\n".join(
        " <-> ".join(group) + ":\n" + "\n".join(f"    {a} imports {', '.join(sorted(graph[a] & set(group)))}"
                                                for a in group)
        for group in found)
    assert not found, f"import circles:\n{detail}"
