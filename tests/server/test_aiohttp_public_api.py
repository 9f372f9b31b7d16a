"""Nexus uses aiohttp through its public API only: no private attribute of its objects.

A private attribute (``request.protocol._drain_helper()``, a ``_send_headers_immediately``
override, ``transport._sock``) may change or vanish in any aiohttp release, and what it
does is no part of aiohttp's contract.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src" / "nexus"

# Names an aiohttp object has in src/ (its requests, protocols, transports, responses,
# sockets, writers), then a private attribute: ``request.protocol._x``, ``ws._x``...
_OWNER = (
    r"(?:request|protocol|transport|response|resp|ws|writer|payload_writer|reader|"
    r"web|aiohttp|wire|connection|session|app|site|runner)"
)
PRIVATE = re.compile(
    rf"\b{_OWNER}\s*\.\s*_[a-z]\w*"
    r"|_drain_helper|_send_headers_immediately|_payload_writer|\b_req\b|_writer\._"
)


def private_uses(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if PRIVATE.search(line)]


@pytest.mark.parametrize(
    "line",
    [
        "await self.request.protocol._drain_helper()",
        "    _send_headers_immediately = False",
        "size = request.transport._buffer_size",
        "writer = response._payload_writer",
        "ws._writer.transport.write(frame)",
    ],
)
def test_the_check_finds_private_access(line: str) -> None:
    assert private_uses(line) == [line.strip()]


def test_src_uses_no_private_attribute_of_aiohttp() -> None:
    found = {
        str(path.relative_to(SRC)): uses
        for path in sorted(SRC.rglob("*.py"))
        if (uses := private_uses(path.read_text()))
    }
    assert found == {}
