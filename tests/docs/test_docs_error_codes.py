"""Every error ``code`` the gateway can send is in docs/http-api.md's error tables, and
every code those tables list is one it can send.

The codes are read from the source: the ``code`` of each error class, every literal
``code="..."`` / ``code = "..."`` / ``{"code": "..."}``, the first argument of a module's
``_error(code, ...)`` helper, and the values of a ``*_CODES`` table.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import nexus

SRC = Path(nexus.__file__).parent
HTTP_API = Path(__file__).resolve().parents[2] / "docs" / "http-api.md"


def _strings(node: ast.AST) -> set[str]:
    return {
        n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)
    }


def _helpers(tree: ast.Module) -> set[str]:
    """The module's functions whose first parameter (after ``self``) is ``code``."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef):
            params = [a.arg for a in node.args.args if a.arg not in ("self", "cls")]
            if params[:1] == ["code"]:
                names.add(node.name)
    return names


def _codes_in(tree: ast.Module) -> set[str]:
    helpers = _helpers(tree)
    codes: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            codes |= {s for kw in node.keywords if kw.arg == "code" for s in _strings(kw.value)}
            func = node.func
            name = getattr(func, "id", None) or getattr(func, "attr", None)
            if name in helpers and node.args and isinstance(node.args[0], ast.Constant):
                codes.add(node.args[0].value)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = {getattr(t, "id", "") for t in targets}
            if node.value is not None and "code" in names:
                codes |= _strings(node.value)
            if node.value is not None and any(n.endswith("_CODES") for n in names):
                codes |= {s for v in getattr(node.value, "values", []) for s in _strings(v)}
        elif isinstance(node, ast.Dict):
            codes |= {
                v.value
                for k, v in zip(node.keys, node.values, strict=True)
                if isinstance(k, ast.Constant) and k.value == "code" and isinstance(v, ast.Constant)
            }
    return codes


def emitted() -> set[str]:
    return set().union(*(_codes_in(ast.parse(p.read_text())) for p in SRC.rglob("*.py")))


def documented() -> set[str]:
    """The codes in the ``code`` column of each table under ``## Errors``."""
    section = HTTP_API.read_text().split("\n## Errors\n", 1)[1].split("\n## ", 1)[0]
    codes: set[str] = set()
    column = None
    for line in section.splitlines():
        if not line.startswith("|"):
            column = None
            continue
        cells = [c.strip() for c in line.strip("|").split("|")]
        if column is None:
            column = cells.index("`code`")
        elif not set(cells[0]) <= {"-"}:
            codes |= set(re.findall(r"`([a-z_]+)`", cells[column]))
    return codes


def test_the_source_is_read() -> None:
    # (a reader that found nothing would pass the checks below)
    assert {"internal_error", "stream_lost", "max_stream_duration", "not_found"} <= emitted()
    assert {"invalid_json", "upstream_timeout"} <= documented()


def test_every_code_the_gateway_sends_is_documented() -> None:
    assert sorted(emitted() - documented()) == []


def test_every_documented_code_is_one_the_gateway_sends() -> None:
    assert sorted(documented() - emitted()) == []


def test_the_gateways_own_codes_are_listed_for_the_metrics() -> None:
    """``/metrics`` keeps a label for each of the gateway's own codes, however many codes
    upstreams mint (:data:`nexus.errors.GATEWAY_CODES`): every code it sends is there."""
    from nexus.errors import GATEWAY_CODES

    assert sorted(GATEWAY_CODES ^ emitted()) == []
