"""The direction of imports between the layers, read from the source (every import,
those under ``TYPE_CHECKING`` and inside functions included).

``server`` -> ``cache`` (streams) -> ``engine`` -> ``providers`` -> ``protocol`` ->
``events``, and ``server`` -> ``encoders`` -> ``protocol``: nothing imports upwards,
and the modules of ``server`` import one another without a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import nexus

SRC = Path(nexus.__file__).parent


def _module(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path) -> set[str]:
    """The nexus modules ``path`` imports (``from x import y``: ``x.y`` when a module)."""
    package = path.relative_to(SRC.parent).parent.parts
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = list(package[: len(package) - node.level + 1]) if node.level else []
            module = ".".join([*base, *(node.module.split(".") if node.module else [])])
            names.add(module)
            names.update(f"{module}.{alias.name}" for alias in node.names)
    return {n for n in names if n == "nexus" or n.startswith("nexus.")}


MODULES = {_module(p): p for p in sorted(SRC.rglob("*.py"))}
GRAPH = {
    name: {i for i in _imports(path) if i in MODULES} - {name} for name, path in MODULES.items()
}


def _in(module: str, *packages: str) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def test_the_server_package_has_no_import_circle() -> None:
    server = {m for m in GRAPH if _in(m, "nexus.server") and m != "nexus.server"}
    edges = {m: {i for i in GRAPH[m] if i in server} for m in server}
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            cycle = [*path[path.index(module) :], module]
            pytest.fail("import circle: " + " -> ".join(cycle))
        if module in done:
            return
        for imported in sorted(edges[module]):
            visit(imported, [*path, module])
        done.add(module)

    for module in sorted(server):
        visit(module, [])


# (layer, what it must never import)
RULES = [
    (("nexus.cache",), ("nexus.server", "nexus.encoders")),
    (
        (
            "nexus.engine",
            "nexus.routed",
            "nexus.hooks",
            "nexus.stream",
            "nexus.merger",
            "nexus.providers",
            "nexus.protocol",
        ),
        ("nexus.cache", "nexus.server"),
    ),
    (("nexus.protocol", "nexus.encoders"), ("nexus.server", "nexus.engine", "nexus.stream")),
]

KNOWN: set[tuple[str, str]] = set()  # (module, import) pairs allowed for now: none


@pytest.mark.parametrize("layer,forbidden", RULES, ids=lambda v: "+".join(v))
def test_nothing_imports_upwards(layer: tuple[str, ...], forbidden: tuple[str, ...]) -> None:
    wrong = [
        (module, imported)
        for module, imports in GRAPH.items()
        if _in(module, *layer)
        for imported in imports
        if _in(imported, *forbidden) and (module, imported) not in KNOWN
    ]
    assert wrong == []


@pytest.mark.parametrize(
    "path",
    sorted(p for folder in ("protocol", "encoders") for p in (SRC / folder).rglob("*.py")),
    ids=lambda p: f"{p.parent.name}/{p.name}",
)
def test_codecs_import_no_aiohttp(path: Path) -> None:
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "aiohttp" for a in node.names), path
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            assert node.module.split(".")[0] != "aiohttp", path


def test_the_graph_is_read() -> None:
    """The checks above see real edges (a parser that found none would pass them all)."""
    assert "nexus.cache.hub" in GRAPH["nexus.server.app"]
    assert "nexus.engine" in GRAPH["nexus.cache.hub"]
    assert "nexus.stream" in GRAPH["nexus.engine"]


MAX_MODULE_LINES = 500


def test_no_module_is_over_500_lines() -> None:
    """A module past 500 lines holds more than one thing: split it by what it holds."""
    long = {
        str(path.relative_to(SRC)): lines
        for path in SRC.rglob("*.py")
        if (lines := len(path.read_text().splitlines())) > MAX_MODULE_LINES
    }
    assert long == {}
