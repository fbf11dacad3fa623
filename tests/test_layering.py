"""Imports flow one way: cli → mcp/dashboard → tools → export → fleet → metrics/demo → agent (trace, api) → explain → store.

Each package has a layer; a module may import its own package or any package of a lower layer, never a
higher one (so no cycles between packages). Imports under ``if TYPE_CHECKING:`` count too: a type
that must come from above is a sign the code is in the wrong room.
"""

from __future__ import annotations

import ast
import functools
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
    "clickhouse": 3,  # the fleet's history: schema, client, shipper, read-only queries (over store only)
    "agent": 4,  # what runs on every node: agent/trace (the recorder) and agent/api (the server)
    "metrics": 5,
    "demo": 5,
    "fleet": 6,
    "export": 7,
    "tools": 8,
    "mcp": 9,
    "dashboard": 9,
    "cli": 10,
    "__main__": 11,
}


def _package(path: Path) -> str:
    rel = path.relative_to(ROOT)
    return rel.parts[0].removesuffix(".py")


@functools.cache
def _import_statements(path: Path) -> tuple[ast.Import | ast.ImportFrom, ...]:
    """Every import statement in ``path``, function-level ones included (parsed once for all the tests)."""
    tree = ast.parse(path.read_text(), str(path))
    return tuple(node for node in ast.walk(tree) if isinstance(node, ast.Import | ast.ImportFrom))


def _imported_packages(path: Path) -> set[str]:
    found: set[str] = set()
    for node in _import_statements(path):
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
        for target in _imported_packages(path):
            if target != own and LAYERS[target] >= LAYERS[own] and target != "__init__":
                wrong.append(
                    f"{path.relative_to(ROOT.parent)} imports ingero.{target} (layer {LAYERS[target]} ≥ {LAYERS[own]})"
                )
    assert not wrong, "\n".join(wrong)


def _module_graph() -> dict[str, set[str]]:
    """Module → the ingero modules it imports anywhere (function-level imports included);
    ``from pkg import sub`` counts as importing ``pkg.sub``, not the package."""
    mods: dict[str, Path] = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        mods[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in _import_statements(path):
            names: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names]
                names = [s for s in subs if s in mods] + ([node.module] if any(s not in mods for s in subs) else [])
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            graph[mod] |= {n for n in names if n in mods and n != mod}
    return graph


def test_no_import_circles_between_modules() -> None:
    """No module reaches itself through its imports, lazy ones included (e.g. the tool registry never
    imports the tool modules that register with it: ingero.tools.toolset does)."""
    graph = _module_graph()
    circles = []
    for start in sorted(graph):
        stack, seen = [(start, [start])], {start}
        while stack:
            mod, trail = stack.pop()
            for nxt in sorted(graph[mod]):
                if nxt == start:
                    circles.append(" → ".join([*trail, start]))
                elif nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*trail, nxt]))
    assert not circles, "\n".join(sorted(set(circles))[:20])
