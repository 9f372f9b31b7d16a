"""The HTTP surface through aiohttp's test server: headers, negotiation, errors, flushing."""

from __future__ import annotations

import asyncio
import gzip
import os
import random
from collections.abc import AsyncGenerator
from typing import Any

import orjson
import pytest

from nexus import ChatRequest, Delta, Provider, StreamEvent
from nexus.protocol.sse import SSEDecoder
from support import EndlessProvider, GatedProvider, MakeClient, chat, parse_sse


async def test_default_stream_is_openai_sse_with_streaming_headers(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post(
        "/v1/chat/completions",
        json=chat(stream=True, stream_options={"include_usage": True}),
        headers={"Accept": "application/json"},  # what the official SDKs send
    )
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    assert resp.headers["Cache-Control"] == "no-cache"
    assert resp.headers["X-Accel-Buffering"] == "no"
    assert resp.headers["Vary"] == "Accept, X-Nexus-Stream-Format"
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    events = parse_sse(await resp.read())
    assert events[-1].data == "[DONE]"
    chunks = [orjson.loads(e.data) for e in events[:-1]]
    assert {c["id"] for c in chunks} == {stream_id}
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    text = "".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"])
    assert text == "Hello there world"
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


async def test_usage_chunk_only_with_include_usage(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post("/v1/chat/completions", json=chat(stream=True))
    chunks = [orjson.loads(e.data) for e in parse_sse(await resp.read())[:-1]]
    assert all(c["choices"] for c in chunks)
    assert all("usage" not in c for c in chunks)


async def test_sse_starts_with_retry_field(make_client: MakeClient) -> None:
    client = await make_client({"server": {"retry_ms": 2500}})
    resp = await client.post("/v1/chat/completions", json=chat(stream=True))
    body = await resp.read()
    stream_id = resp.headers["X-Nexus-Stream-Id"].encode()
    assert body.startswith(b"retry: 2500\nid: %s.0\ndata: {" % stream_id)
    native = await client.post("/v1/chat/completions?stream_format=nexus", json=chat(stream=True))
    stream_id = native.headers["X-Nexus-Stream-Id"].encode()
    assert (await native.read()).startswith(
        b"retry: 2500\nid: %s.0\n\nid: %s.1\nevent: delta\n" % (stream_id, stream_id)
    )


@pytest.mark.parametrize(
    ("query", "headers", "content_type", "media_type"),
    [
        ("", {}, "text/event-stream; charset=utf-8", "text/event-stream"),
        ("?stream_format=ndjson", {}, "application/x-ndjson", "application/x-ndjson"),
        ("?stream_format=JSONL", {}, "application/x-ndjson", "application/x-ndjson"),
        (
            "?stream_format=nexus",
            {"Accept": "application/x-ndjson"},
            "text/event-stream; charset=utf-8",
            "application/vnd.nexus.events+sse",
        ),
        ("", {"X-Nexus-Stream-Format": "nexus-sse"}, None, "application/vnd.nexus.events+sse"),
        (
            "?stream_format=sse",
            {"X-Nexus-Stream-Format": "ndjson"},
            None,
            "text/event-stream",
        ),
        ("", {"Accept": "application/x-ndjson"}, None, "application/x-ndjson"),
        (
            "",
            {"Accept": "text/event-stream;q=0.5, application/vnd.nexus.events+sse"},
            None,
            "application/vnd.nexus.events+sse",
        ),
        ("", {"Accept": "*/*"}, None, "text/event-stream"),
    ],
)
async def test_negotiation_end_to_end(
    make_client: MakeClient,
    query: str,
    headers: dict[str, str],
    content_type: str | None,
    media_type: str,
) -> None:
    client = await make_client()
    resp = await client.post(
        "/v1/chat/completions" + query, json=chat(stream=True), headers=headers
    )
    assert resp.status == 200
    assert resp.headers["X-Nexus-Stream-Format"] == media_type
    if content_type is not None:
        assert resp.headers["Content-Type"] == content_type
    await resp.read()


async def test_ndjson_stream_lines(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post(
        "/v1/chat/completions?stream_format=ndjson",
        json=chat("a b", stream=True, mock={"reasoning": "hm", "tool_calls": [{"name": "f"}]}),
    )
    lines = [orjson.loads(line) for line in (await resp.read()).splitlines()]
    assert [line["type"] for line in lines] == [
        "reasoning",
        "delta",
        "delta",
        "tool_call",
        "tool_call",
        "delta",
        "usage",
        "done",
    ]
    assert lines[0] == {"type": "reasoning", "delta": {"reasoning": "hm"}}
    assert lines[3]["delta"]["tool_calls"][0]["function"] == {"arguments": "", "name": "f"}
    assert lines[4]["delta"]["tool_calls"][0] == {"index": 0, "function": {"arguments": "{}"}}
    assert lines[5] == {"type": "delta", "delta": {}, "finish_reason": "tool_calls"}
    assert lines[-1] == {"type": "done"}


async def test_unknown_stream_format_is_400_listing_formats(make_client: MakeClient) -> None:
    client = await make_client()
    for kwargs in (
        {"params": {"stream_format": "xml"}},
        {"headers": {"X-Nexus-Stream-Format": "xml"}},
    ):
        resp = await client.post("/v1/chat/completions", json=chat(stream=True), **kwargs)
        assert resp.status == 400
        error = (await resp.json())["error"]
        assert error["code"] == "unsupported_stream_format"
        assert error["type"] == "invalid_request_error"
        for name in ("text/event-stream", "application/x-ndjson", "nexus-sse", "jsonl"):
            assert name in error["message"]


async def test_mid_stream_failure_each_format(make_client: MakeClient) -> None:
    client = await make_client()
    body = chat("one two three", stream=True, mock={"fail_after": 2})
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    events = parse_sse(await resp.read())
    assert [e.event for e in events[-2:]] == ["error", "message"]
    assert events[-1].data == "[DONE]"
    error = orjson.loads(events[-2].data)
    assert set(error) == {"error"}
    assert error["error"]["code"] == "upstream_error"
    assert set(error["error"]) == {"message", "type", "param", "code", "retryable", "request_id"}
    assert error["error"]["request_id"] == resp.headers["X-Request-Id"]
    assert error["error"]["retryable"] is True

    resp = await client.post("/v1/chat/completions?stream_format=ndjson", json=body)
    lines = [orjson.loads(line) for line in (await resp.read()).splitlines()]
    assert [line["type"] for line in lines] == ["delta", "delta", "error", "done"]
    assert lines[2]["error"]["retryable"] is True

    resp = await client.post("/v1/chat/completions?stream_format=nexus", json=body)
    events = parse_sse(await resp.read())
    assert [e.event for e in events] == ["delta", "delta", "error", "done"]


async def test_failure_before_first_event_is_an_http_error(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post("/v1/chat/completions", json=chat(stream=True, mock={"fail_after": 0}))
    assert resp.status == 502
    assert resp.headers["Content-Type"].startswith("application/json")
    error = (await resp.json())["error"]
    assert error["code"] == "upstream_error"
    assert "fail_after" in error["message"]


async def test_non_streaming_completion(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post("/v1/chat/completions", json=chat("Hi there"))
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("application/json")
    body = await resp.json()
    assert body["object"] == "chat.completion"
    assert body["id"].startswith("chatcmpl-")
    assert body["model"] == "mock/echo"
    assert body["choices"] == [
        {
            "index": 0,
            "message": {
                "role": "assistant",
                "content": "Hi there",
                "refusal": None,
                "annotations": [],
            },
            "logprobs": None,
            "finish_reason": "stop",
        }
    ]
    assert body["usage"] == {"prompt_tokens": 2, "completion_tokens": 2, "total_tokens": 4}


async def test_non_streaming_tool_calls_and_reasoning(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post(
        "/v1/chat/completions",
        json=chat(
            mock={
                "content": "",
                "reasoning": "Let me look.",
                "tool_calls": [{"name": "get_weather", "arguments": {"city": "Reykjavik"}}],
            }
        ),
    )
    message = (await resp.json())["choices"][0]
    assert message["finish_reason"] == "tool_calls"
    assert message["message"]["content"] is None
    assert message["message"]["reasoning_content"] == "Let me look."
    [call] = message["message"]["tool_calls"]
    assert call["type"] == "function"
    assert call["function"]["name"] == "get_weather"
    assert orjson.loads(call["function"]["arguments"]) == {"city": "Reykjavik"}


async def test_max_tokens_zero_is_legal(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post("/v1/chat/completions", json=chat(max_tokens=0))
    choice = (await resp.json())["choices"][0]
    assert choice["finish_reason"] == "length"
    assert choice["message"]["content"] == ""


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        (chat(temperature=3), "temperature", "less than or equal to 2"),
        (chat(top_p=-0.1), "top_p", "greater than or equal to 0"),
        (chat(stop=["a", "b", "c", "d", "e"]), "stop", "at most 4"),
        (chat(max_tokens=-1), "max_tokens", "greater than or equal to 0"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model", "Field required"),
        ({"model": "mock/x", "messages": []}, "messages", "at least 1"),
        (
            {"model": "mock/x", "messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
            "robot",
        ),
        (
            {"model": "mock/x", "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].tool_call_id",
            "Field required",
        ),
        (chat(n=2), "n", "n=1"),
        (chat(stream="yes"), "stream", "boolean"),
        (chat(tool_choice={"type": "function", "function": {"name": "f"}}), "tool_choice", "f"),
        (chat(mock={"delay": 5}), "mock.delay", "Unknown field"),
    ],
)
async def test_validation_errors_name_the_field(
    make_client: MakeClient, body: dict[str, Any], param: str | None, fragment: str
) -> None:
    client = await make_client()
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert set(error) == {"message", "type", "param", "code", "request_id"}
    assert error["request_id"] == resp.headers["X-Request-Id"]
    assert error["type"] == "invalid_request_error"
    assert error["code"] == "invalid_request"
    assert error["param"] == param
    assert fragment in error["message"]


@pytest.mark.parametrize("payload", [b"{not json", b"[1, 2]", b"", b"\xff\xfe"])
async def test_malformed_json_is_400(make_client: MakeClient, payload: bytes) -> None:
    client = await make_client()
    resp = await client.post(
        "/v1/chat/completions", data=payload, headers={"Content-Type": "application/json"}
    )
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "invalid_json"


async def test_unknown_model_is_404(make_client: MakeClient) -> None:
    client = await make_client()
    for model in ("gpt-4o", "nope/x", "mock/"):
        resp = await client.post("/v1/chat/completions", json=chat(model=model))
        assert resp.status == 404
        error = (await resp.json())["error"]
        assert error["code"] == "model_not_found"
        assert error["param"] == "model"


async def test_body_over_limit_is_413(make_client: MakeClient) -> None:
    client = await make_client({"limits": {"max_body_bytes": 2048}})
    resp = await client.post("/v1/chat/completions", json=chat("x" * 4096))
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == "request_too_large"

    async def chunks() -> Any:  # no Content-Length: the limit still holds
        for _ in range(8):
            yield b" " * 1024

    resp = await client.post("/v1/chat/completions", data=chunks())
    assert resp.status == 413
    ok = await client.post("/v1/chat/completions", json=chat("small"))
    assert ok.status == 200


async def test_a_compressed_request_body_is_read_whole(make_client: MakeClient) -> None:
    client = await make_client({"limits": {"max_body_bytes": 3_000_000}})
    history = {"role": "user", "content": "word " * 400_000}  # 2 MB: several pieces
    request = chat("the last words", stream=True)
    request["messages"] = [history, {"role": "assistant", "content": "ok"}, *request["messages"]]
    headers = {"Content-Encoding": "gzip", "Content-Type": "application/json"}
    resp = await client.post(
        "/v1/chat/completions?stream_format=ndjson",
        data=gzip.compress(orjson.dumps(request)),
        headers=headers,
    )
    assert resp.status == 200, await resp.text()
    lines = [orjson.loads(line) for line in (await resp.read()).splitlines()]
    deltas = [line["delta"].get("content") or "" for line in lines if line["type"] == "delta"]
    assert "".join(deltas) == "the last words"  # the echo of the last message: all parsed
    # Past the limit once decompressed: 413, whatever the compressed size.
    big = gzip.compress(orjson.dumps(chat("x" * 4_000_000)))
    assert len(big) < 3_000_000
    resp = await client.post("/v1/chat/completions", data=big, headers=headers)
    assert resp.status == 413
    assert (await resp.json())["error"]["code"] == "request_too_large"


async def test_a_streaming_request_does_not_hold_its_body_for_the_stream(
    make_client: MakeClient,
) -> None:
    # request.read() would cache the body on the request for its whole life: a long
    # conversation's bytes held for as long as the stream runs.
    from nexus.server.state import RUNTIME

    gated = GatedProvider(before=1, after=1)
    client = await make_client(providers=[gated])
    body = chat("x" * 100_000, model="gated/m", stream=True)
    resp = await client.post("/v1/chat/completions?stream_format=ndjson", json=body)
    assert resp.status == 200
    assert b"before0" in await resp.content.readline()
    (pump,) = client.app[RUNTIME].active
    assert pump.request._read_bytes is None
    gated.gate.set()
    lines = [orjson.loads(line) for line in (await resp.read()).splitlines()]
    assert lines[-1] == {"type": "done"}


async def test_a_stream_writes_its_headers_with_its_first_bytes_and_its_end_with_its_last(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One system call (and one packet) each, not a write of the headers alone before
    # the first bytes, nor the chunked body's end alone after the last.
    from aiohttp.http_writer import StreamWriter

    writes: list[bytes] = []
    write, writelines = StreamWriter._write, StreamWriter._writelines

    def record(self: StreamWriter, chunk: Any) -> None:
        writes.append(bytes(chunk))
        write(self, chunk)

    def record_lines(self: StreamWriter, chunks: Any) -> None:
        chunks = list(chunks)
        writes.append(b"".join(bytes(c) for c in chunks))
        writelines(self, chunks)

    monkeypatch.setattr(StreamWriter, "_write", record)
    monkeypatch.setattr(StreamWriter, "_writelines", record_lines)
    gated = GatedProvider(before=1, after=1)
    client = await make_client(providers=[gated])
    resp = await client.post("/v1/chat/completions", json=chat(model="gated/m", stream=True))
    assert resp.status == 200
    head = b""
    while b"before0" not in head:
        head += await resp.content.readuntil(b"\n\n")
    served = [w for w in writes if w.startswith(b"HTTP/1.1 200")]
    assert len(served) == 1 and b"before0" in served[0]  # the headers, with the first frame
    gated.gate.set()
    assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    last = writes[-1]
    assert last.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")  # the last frame, then the end


async def test_unknown_route_and_method_are_json(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.get("/v1/nothing")
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "not_found"
    resp = await client.get("/v1/chat/completions")
    assert resp.status == 405
    assert resp.headers["Allow"] == "POST"
    assert (await resp.json())["error"]["code"] == "method_not_allowed"


async def test_models_and_health(make_client: MakeClient) -> None:
    client = await make_client(
        {
            "providers": {"mock": {"kind": "mock", "models": ["echo", "big"]}},
            "models": {"fast": {"targets": ["mock/big"]}},
        }
    )
    body = await (await client.get("/v1/models")).json()
    assert body["object"] == "list"
    assert [m["id"] for m in body["data"]] == ["fast", "mock/echo", "mock/big"]
    assert body["data"][1] == {
        "id": "mock/echo",
        "object": "model",
        "created": 0,
        "owned_by": "mock",
    }
    one = await client.get("/v1/models/mock/anything")
    assert (await one.json())["id"] == "mock/anything"
    missing = await client.get("/v1/models/gpt-4o")
    assert missing.status == 404
    health = await client.get("/healthz")
    assert await health.json() == {"status": "ok", "streams": 0, "clients": 0, "pid": os.getpid()}


async def test_alias_routes_to_its_target(make_client: MakeClient) -> None:
    client = await make_client({"models": {"demo": {"targets": ["mock/echo"]}}})
    resp = await client.post("/v1/chat/completions", json=chat("via alias", model="demo"))
    body = await resp.json()
    assert body["model"] == "demo"
    assert body["choices"][0]["message"]["content"] == "via alias"


async def test_each_frame_is_flushed_as_produced(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(providers=[gated])
    resp = await client.post(
        "/v1/chat/completions?stream_format=ndjson", json=chat(model="gated/m", stream=True)
    )
    # The provider is blocked after its first delta: that delta must already be here.
    first = await asyncio.wait_for(resp.content.readline(), 5)
    assert orjson.loads(first) == {"type": "delta", "delta": {"content": "before0 "}}
    gated.gate.set()
    rest = [orjson.loads(line) for line in (await resp.read()).splitlines()]
    assert rest[0] == {"type": "delta", "delta": {"content": "after0 "}}
    assert rest[-1] == {"type": "done"}


@pytest.mark.parametrize(
    ("fmt", "heartbeat"),
    [("sse", b": ping\n"), ("nexus", b": ping\n"), ("ndjson", b'{"type":"heartbeat"}\n')],
)
async def test_heartbeats_when_idle(make_client: MakeClient, fmt: str, heartbeat: bytes) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client({"server": {"heartbeat_interval_s": 0.05}}, providers=[gated])
    resp = await client.post(
        f"/v1/chat/completions?stream_format={fmt}", json=chat(model="gated/m", stream=True)
    )
    received = b""
    while received.count(heartbeat) < 2:
        received += await asyncio.wait_for(resp.content.readany(), 5)
    gated.gate.set()
    received += await resp.read()
    assert received.index(b"before0") < received.index(heartbeat) < received.index(b"after0")


async def test_slow_first_event_sends_headers_and_heartbeats(make_client: MakeClient) -> None:
    gated = GatedProvider(before=0, after=1)
    client = await make_client({"server": {"heartbeat_interval_s": 0.05}}, providers=[gated])
    resp = await asyncio.wait_for(
        client.post("/v1/chat/completions", json=chat(model="gated/m", stream=True)), 5
    )
    assert resp.status == 200
    head = await asyncio.wait_for(resp.content.readuntil(b": ping\n"), 5)
    decoded = SSEDecoder().decode(head)
    assert orjson.loads(decoded[0].data)["choices"][0]["delta"]["role"] == "assistant"
    gated.gate.set()
    rest = await resp.read()
    # The read the deadline cut was made again: the event it waited for is not lost.
    assert b"after0" in rest and rest.endswith(b"data: [DONE]\n\n")


class LateFirstProvider(Provider):
    """Its first event comes 0 to 20 ms after the request: past a 10 ms deadline that a
    loop busy with 100 such streams mostly lets pass first."""

    kind = "late"

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        await asyncio.sleep(random.uniform(0.0, 0.02))
        for word in WORDS:
            yield [Delta(content=word)]
        yield [Delta(finish_reason="stop")]


WORDS = [f"w{i} " for i in range(5)]


async def test_a_first_event_racing_the_first_output_deadline_is_never_lost(
    make_client: MakeClient,
) -> None:
    # The deadline (the heartbeat interval, 10 ms) cuts most first reads of the run's log,
    # a few of them as the event arrives; each read made again must find it all. The exact
    # race, both ways round, is tests/streams/test_reader_waiters.py's.
    late = LateFirstProvider("late")
    client = await make_client({"server": {"heartbeat_interval_s": 0.01}}, providers=[late])

    async def one() -> bytes:
        resp = await client.post("/v1/chat/completions", json=chat(model="late/m", stream=True))
        assert resp.status == 200
        return await resp.read()

    bodies = await asyncio.gather(*(one() for _ in range(100)))
    early = 0
    for body in bodies:
        early += b": ping" in body and body.index(b": ping") < body.index(b"w0")
        text = "".join(
            choice["delta"].get("content") or ""
            for event in SSEDecoder().decode(body)
            if event.data.startswith("{")
            for choice in orjson.loads(event.data)["choices"]
        )
        assert text == "".join(WORDS), body
        assert body.endswith(b"data: [DONE]\n\n")
    assert early, "no stream's headers went out before its first event"


async def test_client_disconnect_closes_provider_at_once(make_client: MakeClient) -> None:
    """With ``detach_timeout_s = 0`` a stream ends with its last client."""
    gated = GatedProvider(before=1, after=1)
    client = await make_client({"streams": {"detach_timeout_s": 0}}, providers=[gated])
    resp = await client.post(
        "/v1/chat/completions?stream_format=ndjson", json=chat(model="gated/m", stream=True)
    )
    await asyncio.wait_for(resp.content.readline(), 5)
    loop = asyncio.get_running_loop()
    gone = loop.time()
    resp.close()  # drops the connection while the provider waits for its next chunk
    await asyncio.wait_for(gated.closed.wait(), 2)
    assert gated.closed_at is not None
    assert gated.closed_at - gone < 0.5
    assert not gated.gate.is_set()
    health = await (await client.get("/healthz")).json()
    assert health["streams"] == 0


async def test_client_that_stops_reading_is_dropped(make_client: MakeClient) -> None:
    endless = EndlessProvider()
    client = await make_client(
        {"server": {"write_timeout_s": 0.3}, "streams": {"detach_timeout_s": 0}},
        providers=[endless],
    )
    server = client.server
    _, writer = await asyncio.open_connection(server.host, server.port)
    body = orjson.dumps(chat(model="endless/m", stream=True))
    writer.write(
        b"POST /v1/chat/completions?stream_format=ndjson HTTP/1.1\r\n"
        b"Host: localhost\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n" % len(body) + body
    )
    await writer.drain()
    # Read nothing: once the socket buffers fill, the write stalls and the
    # gateway must drop us and close the provider, instead of buffering forever.
    await asyncio.wait_for(endless.closed.wait(), 10)
    produced = endless.produced
    assert produced * endless.size < 64 * 1024 * 1024  # bounded by socket buffers, not 100s of MB
    health = await (await client.get("/healthz")).json()
    assert health["streams"] == 0
    writer.close()


async def test_concurrent_stream_limit(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client({"limits": {"max_concurrent_streams": 1}}, providers=[gated])
    first = await client.post(
        "/v1/chat/completions?stream_format=ndjson", json=chat(model="gated/m", stream=True)
    )
    await asyncio.wait_for(first.content.readline(), 5)
    second = await client.post("/v1/chat/completions", json=chat(stream=True))
    assert second.status == 429
    assert second.headers["Retry-After"] == "1"
    assert (await second.json())["error"]["code"] == "too_many_streams"
    gated.gate.set()
    await first.read()
    third = await client.post("/v1/chat/completions", json=chat(stream=True))
    assert third.status == 200
    await third.read()


async def test_config_encoder_is_negotiable(make_client: MakeClient) -> None:
    client = await make_client({"encoders": {"text/plain": "support:PlainTextEncoder"}})
    resp = await client.post(
        "/v1/chat/completions?stream_format=PLAIN", json=chat("custom format", stream=True)
    )
    assert resp.headers["Content-Type"].startswith("text/plain")
    assert await resp.read() == b"custom format\n"
    resp = await client.post(
        "/v1/chat/completions",
        json=chat("a b c", stream=True, mock={"fail_after": 1}),
        headers={"Accept": "text/plain"},
    )
    assert await resp.read() == b"a\n[error upstream_error]\n"
    resp = await client.post("/v1/chat/completions?stream_format=xml", json=chat(stream=True))
    assert "text/plain (plain)" in (await resp.json())["error"]["message"]


async def test_registry_freezes_when_the_app_starts(aiohttp_client: Any) -> None:
    from nexus.config import Config
    from nexus.encoders.registry import default_registry
    from nexus.errors import RegistryFrozen
    from nexus.server.app import create_app
    from support import PlainTextEncoder

    registry = default_registry.copy()
    app = create_app(Config(), registry=registry)
    registry.register("text/plain", PlainTextEncoder)  # before start: fine, and used
    client = await aiohttp_client(app)
    with pytest.raises(RegistryFrozen, match="before the app starts"):
        registry.register("text/x-late", PlainTextEncoder)
    resp = await client.post("/v1/chat/completions?stream_format=xml", json=chat(stream=True))
    message = (await resp.json())["error"]["message"]
    assert "text/plain (plain)" in message
    assert "text/x-late" not in message
    resp = await client.post("/v1/chat/completions?stream_format=plain", json=chat(stream=True))
    assert await resp.read() == b"Hello there world\n"


def test_bad_config_encoder_fails_at_create_app() -> None:
    from nexus.config import parse_config
    from nexus.errors import ConfigError
    from nexus.server.app import create_app

    config = parse_config({"encoders": {"text/x-broken": "no_such_module:Encoder"}})
    with pytest.raises(ConfigError, match=r"\[encoders\] 'text/x-broken'.*no_such_module"):
        create_app(config, config_source="my.toml")


async def test_no_new_streams_while_shutting_down(make_client: MakeClient) -> None:
    from nexus.server.state import RUNTIME

    client = await make_client()
    client.app[RUNTIME].shutting_down = True
    resp = await client.post("/v1/chat/completions", json=chat(stream=True))
    assert resp.status == 503
    assert (await resp.json())["error"]["code"] == "server_shutting_down"
    assert (await client.get("/healthz")).status == 503
    client.app[RUNTIME].shutting_down = False
