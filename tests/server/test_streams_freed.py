"""A finished stream is freed by its reference count, not left to the cycle collector.

Each request's objects (its pump, reader, stream, routed run, and through them the
request, the response and the log) used to sit in a reference cycle: freed only by a
collection, which under load walked the lot again and again (a full one took 50 ms).
"""

from __future__ import annotations

import asyncio
import gc
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import orjson
import pytest
import websockets

from redis_support import REDIS_URL
from support import MakeClient, chat
from upstreams import FakeUpstream, Reply, anthropic_stream, openai_chunk, openai_usage_chunk, sse


@contextmanager
def cyclic_garbage() -> Iterator[list[str]]:
    """The names of the Nexus objects that only the collector could free, made inside."""
    names: list[str] = []
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        yield names
        gc.collect()
    finally:
        gc.set_debug(0)
        names += sorted(
            type(obj).__qualname__
            for obj in gc.garbage
            if type(obj).__module__.startswith("nexus.")
        )
        gc.garbage.clear()


def _stream(words: int) -> list[bytes]:
    usage = {"prompt_tokens": 3, "completion_tokens": words, "total_tokens": 3 + words}
    return [
        openai_chunk(role="assistant", content=""),
        *(openai_chunk(content=f"w{i} ") for i in range(words)),
        openai_chunk(finish_reason="stop"),
        openai_usage_chunk(usage),
        sse("[DONE]"),
    ]


USER = [{"role": "user", "content": "Hi"}]
REQUESTS = {
    "chat": ("/v1/chat/completions", {"messages": USER}, b"data: [DONE]\n\n"),
    "ndjson": ("/v1/chat/completions?stream_format=ndjson", {"messages": USER}, b'"done"'),
    "messages": (
        "/v1/messages",
        {"messages": USER, "max_tokens": 50},
        b'{"type":"message_stop"}\n\n',
    ),
    "responses": ("/v1/responses", {"input": "Hi"}, b'"type":"response.completed"'),
}


def _oai(fake: FakeUpstream) -> dict[str, Any]:
    """The config of a gateway whose provider ``oai`` is ``fake``."""
    return {"providers": {"oai": {"kind": "openai", "base_url": fake.url + "/v1"}}}


def _realtime(client: Any) -> str:
    return f"ws://{client.server.host}:{client.server.port}/v1/realtime"


REFUSAL = Reply.json(400, {"error": {"message": "bad", "type": "invalid_request_error"}})
START = orjson.dumps({"type": "start", "request": {"model": "oai/m", "messages": USER}}).decode()


@pytest.mark.parametrize("kind", REQUESTS)
async def test_a_streamed_request_leaves_no_cycle(make_client: MakeClient, kind: str) -> None:
    path, body, end = REQUESTS[kind]
    body = {**body, "model": "oai/m", "stream": True}
    async with FakeUpstream(default=Reply.stream(_stream(6), delay=0.01)) as fake:
        client = await make_client(_oai(fake))
        await (await client.post(path, json=body)).read()  # imports, first-use caches
        with cyclic_garbage() as names:
            for _ in range(3):
                resp = await client.post(path, json=body)
                assert resp.status == 200
                data = await resp.read()
                assert end in data[-1000:], data[-200:]
            await asyncio.sleep(0.05)  # the runs' ends, handed over after the last byte
        assert names == []


async def test_a_stream_a_fallback_answered_leaves_no_cycle(make_client: MakeClient) -> None:
    async with (
        FakeUpstream(default=Reply.json(503, {"error": {"message": "busy"}})) as down,
        FakeUpstream(default=Reply.stream(_stream(3), delay=0.01)) as up,
    ):
        client = await make_client(
            {
                "providers": {
                    "down": {"kind": "openai", "base_url": down.url + "/v1"},
                    "up": {"kind": "openai", "base_url": up.url + "/v1"},
                },
                "models": {"both": {"targets": ["down/m", "up/m"]}},
            }
        )
        with cyclic_garbage() as names:
            for _ in range(2):
                resp = await client.post(
                    "/v1/chat/completions", json=chat(model="both", stream=True)
                )
                assert resp.status == 200
                await resp.read()
            await asyncio.sleep(0.05)
        assert names == []


async def test_a_stream_its_upstream_cut_leaves_no_cycle(make_client: MakeClient) -> None:
    async with FakeUpstream(default=Reply.stream(_stream(4)[:3], delay=0.01, end="abort")) as fake:
        client = await make_client(_oai(fake))
        with cyclic_garbage() as names:
            resp = await client.post("/v1/chat/completions", json=chat(model="oai/m", stream=True))
            assert b"event: error" in await resp.read()
            await asyncio.sleep(0.05)
        assert names == []


async def test_a_stream_its_client_left_leaves_no_cycle(make_client: MakeClient) -> None:
    async with FakeUpstream(default=Reply.stream(_stream(40), delay=0.01)) as fake:
        client = await make_client(_oai(fake))
        with cyclic_garbage() as names:
            resp = await client.post("/v1/chat/completions", json=chat(model="oai/m", stream=True))
            await resp.content.readuntil(b"w1 ")
            resp.close()  # gone mid-stream
            await asyncio.sleep(0.3)  # the run cancelled, its upstream closed
        assert names == []


async def test_realtime_turns_leave_no_cycle(make_client: MakeClient) -> None:
    async with FakeUpstream(default=Reply.stream(_stream(6), delay=0.01)) as fake:
        client = await make_client(_oai(fake))
        async with websockets.connect(_realtime(client)) as ws:
            await ws.send(START)
            while orjson.loads(await ws.recv())["type"] != "done":
                pass
            with cyclic_garbage() as names:
                for _ in range(3):
                    await ws.send(START)
                    while orjson.loads(await ws.recv())["type"] != "done":
                        pass
                await asyncio.sleep(0.05)
        assert names == []


async def test_other_paths_leave_no_cycle(make_client: MakeClient) -> None:
    """Not streamed; an Anthropic upstream; a cache miss, its replay; a resumed stream."""
    blocks = [{"type": "text", "text": "Hello there"}]
    async with (
        FakeUpstream(default=Reply.stream(_stream(4), delay=0.01)) as oai,
        FakeUpstream(default=Reply.stream(anthropic_stream(blocks), delay=0.01)) as claude,
    ):
        client = await make_client(
            {
                "providers": {
                    "oai": {"kind": "openai", "base_url": oai.url + "/v1"},
                    "claude": {"kind": "anthropic", "base_url": claude.url},
                },
                "cache": {"enabled": True},
            }
        )
        body = {"messages": USER, "model": "oai/m"}
        await (await client.post("/v1/chat/completions", json=body)).read()
        with cyclic_garbage() as names:
            made = await client.post("/v1/chat/completions", json={**body, "seed": 1})
            assert made.status == 200
            await made.read()
            for model in ("claude/m", "oai/m", "oai/m"):  # the second oai/m: a replay
                resp = await client.post(
                    "/v1/chat/completions", json={**body, "model": model, "stream": True}
                )
                assert resp.status == 200
                data = await resp.read()
                assert data.endswith(b"data: [DONE]\n\n")
            stream_id = data.split(b"id: ", 1)[1].split(b".", 1)[0].decode()
            again = await client.get(
                f"/v1/streams/{stream_id}", headers={"Last-Event-ID": f"{stream_id}.2"}
            )
            assert again.status == 200
            assert (await again.read()).endswith(b"data: [DONE]\n\n")
            await asyncio.sleep(0.1)
        assert names == []


async def test_streams_mirrored_to_redis_leave_no_cycle(
    make_client: MakeClient, prefix: str
) -> None:
    async with FakeUpstream(default=Reply.stream(_stream(6), delay=0.01)) as fake:
        client = await make_client(
            {
                "providers": {"oai": {"kind": "openai", "base_url": fake.url + "/v1"}},
                "store": {"kind": "redis", "url": REDIS_URL, "prefix": prefix},
            }
        )
        body = {"messages": USER, "model": "oai/m", "stream": True}
        await (await client.post("/v1/chat/completions", json=body)).read()
        await asyncio.sleep(0.2)  # its end written by the mirror
        with cyclic_garbage() as names:
            for _ in range(3):
                resp = await client.post("/v1/chat/completions", json=body)
                data = await resp.read()
                assert data.endswith(b"data: [DONE]\n\n")
            stream_id = data.split(b"id: ", 1)[1].split(b".", 1)[0].decode()
            await asyncio.sleep(0.2)  # the ends written, the runs let go
            again = await client.get(
                f"/v1/streams/{stream_id}", headers={"Last-Event-ID": f"{stream_id}.2"}
            )
            assert (await again.read()).endswith(b"data: [DONE]\n\n")
            await asyncio.sleep(0.05)
        assert names == []


async def test_refused_requests_leave_no_cycle(make_client: MakeClient) -> None:
    """A bad body, an unknown model, an upstream's refusal (its 400, passed on)."""
    async with FakeUpstream(default=REFUSAL) as fake:
        client = await make_client(_oai(fake))
        body = {"messages": USER, "model": "oai/m", "stream": True}
        await (await client.post("/v1/chat/completions", json=body)).read()
        with cyclic_garbage() as names:
            for sent, status in (
                ({"model": "oai/m"}, 400),
                ({**body, "model": "nobody/m"}, 404),
                (body, 400),
            ):
                resp = await client.post("/v1/chat/completions", json=sent)
                assert resp.status == status
                await resp.read()
            await asyncio.sleep(0.05)
        assert names == []


async def test_a_refused_realtime_turn_leaves_no_cycle(make_client: MakeClient) -> None:
    async with FakeUpstream(default=REFUSAL) as fake:
        client = await make_client(_oai(fake))
        async with websockets.connect(_realtime(client)) as ws:
            await ws.send(START)
            assert orjson.loads(await ws.recv())["type"] == "error"  # the turn's answer
            with cyclic_garbage() as names:
                for _ in range(2):
                    await ws.send(START)
                    error = orjson.loads(await ws.recv())
                    assert error["type"] == "error", error
                await asyncio.sleep(0.05)
        assert names == []
