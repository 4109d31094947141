"""The package's floors: each folder imports only the folders below it, never one above."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "shardtune"
# Ground floor first. A module may import its own floor and the floors before it.
FLOORS = ["errors", "config", "runplan", "runtime", "model", "parallel", "train", "tools", "top"]
TOP = {"cli", "cli_tools", "launch", "memory_table", "preflight", "__init__", "__main__"}


def floor_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] != "shardtune":
        raise ValueError(module)
    if len(parts) == 1 or parts[1] in TOP:
        return "top"
    return parts[1]


def imports(path: Path) -> list[tuple[int, str]]:
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardtune"):
            found += [(node.lineno, node.module)]
            if node.module == "shardtune":  # from shardtune import runtime
                found += [(node.lineno, f"shardtune.{a.name}") for a in node.names
                          if (PACKAGE / a.name).is_dir() or (PACKAGE / f"{a.name}.py").is_file()]
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("shardtune")]
    return found


def test_every_module_sits_on_a_known_floor():
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(("shardtune", *path.relative_to(PACKAGE).with_suffix("").parts))
        assert floor_of(module) in FLOORS, f"{path}: not on any floor; add it to FLOORS or TOP"


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_no_import_runs_upward(path: Path):
    module = ".".join(("shardtune", *path.relative_to(PACKAGE).with_suffix("").parts))
    here = FLOORS.index(floor_of(module))
    upward = [f"line {line}: {target}" for line, target in imports(path)
              if target != "shardtune" and FLOORS.index(floor_of(target)) > here]
    assert not upward, f"{path.relative_to(PACKAGE)} imports from a floor above its own: {upward}"


def module_of(path: Path, package: Path = PACKAGE) -> str:
    parts = path.relative_to(package).with_suffix("").parts
    return ".".join(("shardtune", *(parts[:-1] if parts[-1] == "__init__" else parts)))


def import_graph(package: Path = PACKAGE) -> dict[str, set[str]]:
    """{module: the shardtune modules it imports}, function-level imports included (a circle hidden
    behind an import inside a function is still a circle); a package stands for its ``__init__``."""
    modules = {module_of(p, package): p for p in package.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        named = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("shardtune"):
                # `from shardtune.parallel import host_gather` imports the submodule, not the package's __init__
                subs = {f"{node.module}.{a.name}" for a in node.names} & set(modules)
                named |= subs or {node.module}
            elif isinstance(node, ast.Import):
                named |= {a.name for a in node.names if a.name.startswith("shardtune")}
        targets = set()
        for target in named:
            while target not in modules and "." in target:
                target = target.rpartition(".")[0]
            if target not in (module, "shardtune"):
                targets.add(target)
        graph[module] = targets
    return graph


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan): each holds an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while True:
                member = stack.pop()
                group.append(member)
                if member == node:
                    break
            if len(group) > 1:
                found.append(sorted(group))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_two_modules_import_each_other_even_on_one_floor():
    assert circles(import_graph()) == []


def test_the_circle_finder_finds_a_circle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert circles(graph) == [["a", "b", "c"]]
