"""The realtime handshake's subprotocol, as a table: ``nexus.v1`` or nothing, never the
key's own."""

from __future__ import annotations

import pytest

from nexus.errors import InvalidRequest
from nexus.protocol.negotiation import select_subprotocol


@pytest.mark.parametrize(
    ("offered", "chosen"),
    [
        ((), None),
        (("nexus.v1",), "nexus.v1"),
        (("nexus.v1", "nexus-key.nx-secret-0001"), "nexus.v1"),
        (("nexus-key.nx-secret-0001", "nexus.v1"), "nexus.v1"),
        (("chat", "nexus.v1"), "nexus.v1"),
    ],
)
def test_nexus_v1_when_offered_else_nothing(offered: tuple[str, ...], chosen: str | None) -> None:
    assert select_subprotocol(offered) == chosen


@pytest.mark.parametrize("offered", [("nexus-key.nx-secret-0001",), ("chat",), ("NEXUS.V1",)])
def test_offers_without_nexus_v1_are_refused_without_repeating_them(
    offered: tuple[str, ...],
) -> None:
    with pytest.raises(InvalidRequest) as refused:
        select_subprotocol(offered)
    assert refused.value.status == 400
    assert refused.value.param == "Sec-WebSocket-Protocol"
    assert "nx-secret" not in refused.value.message and "chat" not in refused.value.message
