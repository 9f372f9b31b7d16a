"""Rendering happens at the edge: nothing under ``nexus.cache`` knows a wire format."""

from __future__ import annotations

import ast
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / "src" / "nexus" / "cache"


def imported(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            names.add("." * node.level + (node.module or ""))
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_the_cache_imports_no_encoder_and_no_renderer() -> None:
    found = {
        path.name: sorted(name for name in imported(path) if "encoders" in name or "server" in name)
        for path in sorted(CACHE.glob("*.py"))
    }
    assert {name: uses for name, uses in found.items() if uses} == {}
