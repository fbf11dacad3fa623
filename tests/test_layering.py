"""Imports flow one way: cli → mcp/dashboard → api → tools → export → fleet → metrics/demo → explain/trace → store.

Each package has a layer; a module may import its own package or any package of a lower layer, never a
higher one (so no cycles between packages). Imports under ``if TYPE_CHECKING:`` count too: a type
that must come from above is a sign the code is in the wrong room.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ingero"

LAYERS: dict[str, int] = {
    "__init__": 0,
    "errors": 0,
    "timeutil": 1,
    "identity": 1,
    "texttable": 1,
    "asgi": 1,
    "compactjson": 1,
    "annotate": 1,  # ingero.annotate: the annotation protocol and the stdlib-only helper
    "tls": 1,
    "config": 2,
    "store": 2,
    "explain": 3,
    "trace": 3,
    "metrics": 4,
    "demo": 4,
    "fleet": 5,
    "export": 6,
    "tools": 7,
    "api": 8,
    "mcp": 9,
    "dashboard": 9,
    "cli": 10,
    "__main__": 11,
}


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


def _imported_packages(tree: ast.AST) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"ingero.{a.name}" for a in node.names] if node.module == "ingero" else [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "ingero" and len(parts) > 1:
                top = parts[1]
                found.add(top if top in LAYERS else "__init__")
    return found


def test_every_package_has_a_layer() -> None:
    packages = {_package(p) for p in ROOT.rglob("*.py")}
    assert packages <= set(LAYERS), f"give these a layer: {sorted(packages - set(LAYERS))}"


def test_imports_flow_one_way() -> None:
    wrong = []
    for path in sorted(ROOT.rglob("*.py")):
        own = _package(path)
        for target in _imported_packages(ast.parse(path.read_text(), str(path))):
            if target != own and LAYERS[target] >= LAYERS[own] and target != "__init__":
                wrong.append(
                    f"{path.relative_to(ROOT.parent)} imports ingero.{target} (layer {LAYERS[target]} ≥ {LAYERS[own]})"
                )
    assert not wrong, "\n".join(wrong)
