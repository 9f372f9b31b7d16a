"""An encoder whose ``end()`` raised gave a 200 that stopped short, with neither its
terminator nor an error: the error frame the gateway writes for a failed encoder was
rendered with ``end()`` again, which raised again, and the frame was dropped."""

from __future__ import annotations

from typing import Any

from nexus import Engine, MockProvider
from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.events import Error
from nexus.server.app import create_app
from nexus.server.render import Renderer
from nexus.types import StreamMeta
from support import PlainTextEncoder

BODY = {
    "model": "mock/echo",
    "stream": True,
    "messages": [{"role": "user", "content": "a b"}],
    "mock": {"delay_ms": 20},  # the first word goes out with the headers
}


class BadEnd(PlainTextEncoder):
    media_type = "text/x-bad-end"
    aliases = ("badend",)

    def end(self) -> bytes:
        raise RuntimeError("end bug")


def test_a_gateway_error_is_rendered_when_end_raises() -> None:
    renderer = Renderer(BadEnd(StreamMeta.new("mock/echo")), "s1", ids=False)
    error = Error(error_type="server_error", message="failed", code="internal_error")
    assert renderer.fail(error) == b"\n[error internal_error]"
    assert renderer.done and renderer.written == 1


async def test_the_response_ends_with_an_internal_error_frame(aiohttp_client: Any) -> None:
    registry = default_registry.copy()
    registry.register(BadEnd.media_type, BadEnd)
    config = parse_config({"metrics": {"enabled": False}})
    app = create_app(config, engine=Engine([MockProvider("mock")]), registry=registry)
    client = await aiohttp_client(app)
    resp = await client.post("/v1/chat/completions?stream_format=badend", json=BODY)
    assert resp.status == 200
    assert await resp.read() == b"a b\n[error internal_error]"
