"""The package's floors: each folder imports only the folders below it, never one above."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "shardtune"
# Ground floor first. A module may import its own floor and the floors before it.
FLOORS = ["errors", "config", "runtime", "model", "parallel", "train", "tools", "top"]
TOP = {"choice", "cli", "cli_tools", "launch", "plan", "preflight", "__init__", "__main__"}


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
