"""What ``/v1/messages`` carries for an Anthropic target (a tool's Anthropic fields, a
document's, the betas) is checked there; from any other surface a client's own copy of
those fields reached Anthropic unchecked (a server tool, an unknown field, a cache mark
the budget's hold never saw). They are refused by name on chat and on the WebSocket; a
chat tool's field Anthropic has no place for is refused, not dropped; the WebSocket's
handshake ``anthropic-beta`` holds for its turns; and the end hooks tell a client that
went away (``client_disconnect``) from one that aborted (``stream_cancelled``)."""

from __future__ import annotations

import asyncio
from typing import Any

import orjson
import pytest
import websockets

from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.engine import Engine
from nexus.hooks import Hooks
from nexus.providers.mock import MockProvider
from nexus.server.app import create_app
from support import MakeClient
from upstreams import FakeUpstream, Reply, anthropic_stream

USER = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
SERVER_TOOL = {"type": "web_search_20250305", "name": "web_search", "max_uses": 99}
INJECTED = [
    ({"anthropic_beta": ["context-1m-2025-08-07"]}, "anthropic_beta"),
    ({"tools": [TOOL | {"anthropic_tool": SERVER_TOOL}]}, "tools[0].anthropic_tool"),
    (
        {"messages": [{"role": "user", "content": [{"type": "file", "file": {"file_id": "f"}}]}]}
        | {"_part": {"anthropic_document": {"source": {"type": "url", "url": "x"}}}},
        "messages[0].content[0].anthropic_document",
    ),
]


def body(extra: dict[str, Any], model: str = "an/claude") -> dict[str, Any]:
    chat = {"model": model, "max_tokens": 8, "messages": USER} | extra
    part = chat.pop("_part", None)
    if part is not None:
        chat["messages"][0]["content"][0].update(part)
    return chat


def providers(url: str) -> dict[str, Any]:
    return {
        "providers": {
            "an": {"kind": "anthropic", "base_url": url},
            "op": {"kind": "openai", "base_url": url + "/v1"},
        }
    }


@pytest.mark.parametrize(("extra", "param"), INJECTED, ids=[p for _, p in INJECTED])
async def test_what_only_v1_messages_sets_is_refused_from_a_client_on_chat_and_the_websocket(
    make_client: MakeClient, extra: dict[str, Any], param: str
) -> None:
    async with FakeUpstream(default=Reply.stream(anthropic_stream([]))) as fake:
        client = await make_client(providers(fake.url))
        sent = await client.post("/v1/chat/completions", json=body(extra))
        assert sent.status == 400
        error = (await sent.json())["error"]
        assert error["param"] == param and "a field Nexus sets itself" in error["message"]
        url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
        async with websockets.connect(url) as ws:
            await ws.send(orjson.dumps({"type": "start", "request": body(extra)}).decode())
            frame = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert frame["type"] == "error" and frame["error"]["param"] == f"request.{param}"
        assert fake.requests == []


async def test_a_chat_tools_unknown_field_is_refused_for_anthropic_not_dropped(
    make_client: MakeClient,
) -> None:
    reply = Reply.stream(anthropic_stream([{"type": "text", "text": "ok"}]))
    async with FakeUpstream(default=reply) as fake:
        client = await make_client(providers(fake.url))
        tools = [TOOL | {"defer_loading": True}]
        sent = await client.post("/v1/chat/completions", json=body({"tools": tools}))
        assert sent.status == 400
        assert (await sent.json())["error"]["param"] == "tools[0].defer_loading"
        strict = [{"type": "function", "function": TOOL["function"] | {"x_hint": 1}}]
        sent = await client.post("/v1/chat/completions", json=body({"tools": strict}))
        assert (await sent.json())["error"]["param"] == "tools[0].function.x_hint"
        assert fake.requests == []
        # What /v1/messages carries of a tool still goes: its cache mark, its fields.
        tool = {"name": "f", "input_schema": {"type": "object"}, "defer_loading": True}
        tool |= {"cache_control": {"type": "ephemeral"}}
        sent = await client.post("/v1/messages", json=body({"tools": [tool]}))
        assert sent.status == 200
        (sent_tool,) = fake.requests[-1].body["tools"]
        assert sent_tool.items() >= tool.items()


async def test_a_bad_content_part_is_named_not_called_a_string(make_client: MakeClient) -> None:
    client = await make_client()
    content = [{"type": "text", "text": "a"}, {"type": "image_url"}]
    sent = await client.post(
        "/v1/chat/completions",
        json={"model": "mock/echo", "messages": [{"role": "user", "content": content}]},
    )
    error = (await sent.json())["error"]
    assert (error["param"], error["message"]) == (
        "messages[0].content[1].image_url",
        "messages[0].content[1].image_url: Field required",
    )


async def test_the_handshakes_betas_hold_for_each_realtime_turn(make_client: MakeClient) -> None:
    reply = Reply.stream(anthropic_stream([{"type": "text", "text": "ok"}]))
    async with FakeUpstream(default=reply) as fake:
        config = providers(fake.url)
        config["providers"]["an"]["betas"] = ["context-management-2025-06-27"]
        client = await make_client(config)
        url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
        start = orjson.dumps({"type": "start", "request": body({})}).decode()
        beta = {"anthropic-beta": "claude-code-20250219,context-management-2025-06-27"}
        async with websockets.connect(url, additional_headers=beta) as ws:
            for _ in range(2):
                await ws.send(start)
                while orjson.loads(await asyncio.wait_for(ws.recv(), 5))["type"] != "done":
                    pass
                seen = fake.requests[-1].headers.get("anthropic-beta")
                assert seen == "context-management-2025-06-27"
        with pytest.raises(websockets.InvalidStatus) as refused:  # the handshake, not a turn
            await websockets.connect(url, additional_headers={"anthropic-beta": "Bad"})
        assert refused.value.response.status_code == 400
        assert b"anthropic-beta" in refused.value.response.body


class Ends:
    def __init__(self) -> None:
        self.codes: list[str] = []

    async def on_stream_failed(
        self, ctx: Any, request_id: str, model: str, error: Any, spend: Any = None
    ) -> None:
        self.codes.append(error.code)


async def test_the_end_hooks_tell_a_client_gone_from_an_abort(aiohttp_client: Any) -> None:
    ends = Ends()
    hooks = Hooks()
    hooks.add(ends)
    engine = Engine([MockProvider("mock")], hooks=hooks)
    app = create_app(parse_config({}), engine=engine, registry=default_registry.copy())
    client = await aiohttp_client(app)
    slow = {"model": "mock/echo", "messages": USER, "mock": {"content": "a " * 200}}
    slow["mock"]["delay_ms"] = 50
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    start = orjson.dumps({"type": "start", "request": slow}).decode()
    for leave in ("abort", "close"):
        async with websockets.connect(url) as ws:
            await ws.send(start)
            assert orjson.loads(await asyncio.wait_for(ws.recv(), 5))["type"] == "delta"
            if leave == "abort":
                await ws.send('{"type":"abort"}')
                while orjson.loads(await asyncio.wait_for(ws.recv(), 5))["type"] != "done":
                    pass
    # A JSON answer's client that hangs up is gone too.
    task = asyncio.create_task(client.post("/v1/chat/completions", json=slow))
    await asyncio.sleep(0.3)
    task.cancel()
    for _ in range(500):
        if len(ends.codes) == 3:
            break
        await asyncio.sleep(0.01)
    assert ends.codes == ["stream_cancelled", "client_disconnect", "client_disconnect"]
