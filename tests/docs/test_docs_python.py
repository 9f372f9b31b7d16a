"""The Python examples of the docs use the public surface only: what they import from
Nexus is a name of ``nexus.__all__`` (or ``nexus.errors``, the error tree)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

import nexus
import nexus.errors

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
PUBLIC = {"nexus": set(nexus.__all__), "nexus.errors": set(nexus.errors.__all__)}


def _blocks(page: Path) -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", page.read_text(encoding="utf-8"), re.M | re.S)


def _nexus_imports(code: str) -> list[tuple[str, str]]:
    """``(module, name)`` of each name imported from a ``nexus`` module."""
    found = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "nexus":
            found += [(node.module or "", alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.split(".")[0] == "nexus"]
    return found


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_doc_examples_import_public_names_only(page: Path) -> None:
    for code in _blocks(page):
        for module, name in _nexus_imports(code):
            assert module in PUBLIC, f"{page.name} imports from the internal {module}"
            assert not name or name in PUBLIC[module], f"{page.name}: {module}.{name} is internal"


def test_the_pages_have_python_examples() -> None:
    assert _blocks(ROOT / "docs" / "plugins.md")
    assert _nexus_imports(_blocks(ROOT / "docs" / "python-api.md")[0])
