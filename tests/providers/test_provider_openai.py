"""The ``openai`` provider kind against a fake OpenAI-compatible upstream (tests/upstreams.py).

Through the running gateway (``POST /v1/chat/completions`` with ``up/<model>``)
and, where simpler, through :class:`~nexus.Engine`: streaming, the upstream
request, tool calls, reasoning, refusal, usage, the error table of
``nexus.protocol.upstream``, timeouts, fallbacks, cancellation and secrets.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import orjson
import pytest
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient

import nexus
from nexus import Engine
from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.errors import ConfigError
from nexus.events import Delta, Error, Usage
from nexus.server.app import create_app
from support import MakeClient, parse_sse
from upstreams import (
    DONE,
    FakeUpstream,
    Reply,
    closed_port,
    openai_chunk,
    openai_error_body,
    openai_usage_chunk,
    sse,
)

Client = TestClient[Any, Any]
Connect = Callable[..., Awaitable[Client]]
Frames = list[tuple[str, Any]]

KEY_ENV = "NEXUS_TEST_OPENAI_KEY"
KEY = "sk-nexus-test-5f1e9c2ab7d04e6b"
UNSET_ENV = "NEXUS_TEST_UNSET_KEY"
USAGE = {
    "prompt_tokens": 11,
    "completion_tokens": 9,
    "total_tokens": 20,
    "prompt_tokens_details": {"cached_tokens": 5, "audio_tokens": 0},
    "completion_tokens_details": {"reasoning_tokens": 7, "audio_tokens": 0},
}


@pytest.fixture(autouse=True)
def secret(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Iterator[str]:
    """Sets the key; afterwards, no log record of the test may contain it."""
    monkeypatch.setenv(KEY_ENV, KEY)
    monkeypatch.delenv(UNSET_ENV, raising=False)
    caplog.set_level(logging.DEBUG)
    yield KEY
    formatter = logging.Formatter()
    leaked = [r for r in caplog.get_records("call") if KEY in formatter.format(r)]
    assert not leaked, leaked


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


def provider(base: FakeUpstream | str, **options: Any) -> dict[str, Any]:
    url = base.url if isinstance(base, FakeUpstream) else base
    return {"kind": "openai", "base_url": url + "/v1", "api_key_env": KEY_ENV, **options}


async def gateway(
    make_client: MakeClient, models: dict[str, list[str]] | None = None, **providers: Any
) -> Client:
    config: dict[str, Any] = {"providers": providers}
    if models:
        config["models"] = {alias: {"targets": targets} for alias, targets in models.items()}
    return await make_client(config)


@pytest.fixture
def connect(make_client: MakeClient, upstream: FakeUpstream) -> Connect:
    """``await connect(*replies, **options)``: a gateway whose provider ``up`` is the fake."""

    async def factory(*replies: Reply, **options: Any) -> Client:
        upstream.add(*replies)
        return await gateway(make_client, up=provider(upstream, **options))

    return factory


def chat(model: str = "up/gpt-up", stream: bool = True, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hi"}]
    return {"model": model, "messages": messages, "stream": stream, **extra}


async def post(client: Client, model: str = "up/gpt-up", **kw: Any) -> ClientResponse:
    return await client.post("/v1/chat/completions", json=chat(model, **kw))


def text_frames(*parts: str, usage: dict[str, Any] | None = None) -> list[bytes]:
    frames = [openai_chunk(role="assistant", content="")]
    frames += [openai_chunk(content=part) for part in parts]
    frames.append(openai_chunk(finish_reason="stop"))
    if usage is not None:
        frames.append(openai_usage_chunk(usage))
    return [*frames, DONE]


async def read_sse(resp: ClientResponse) -> Frames:
    """``(event name, parsed data)`` per frame; the key must not appear in the body."""
    assert resp.status == 200, await resp.text()
    raw = await asyncio.wait_for(resp.read(), 10)  # a hung stream fails instead of hanging
    assert KEY.encode() not in raw
    return [
        (e.event, e.data if e.data == "[DONE]" else orjson.loads(e.data)) for e in parse_sse(raw)
    ]


def contents(frames: Frames) -> list[str]:
    chunks = [data for name, data in frames if name == "message" and data != "[DONE]"]
    return [
        c["delta"]["content"] for d in chunks for c in d["choices"] if c["delta"].get("content")
    ]


async def error_of(resp: ClientResponse) -> dict[str, Any]:
    text = await resp.text()
    assert KEY not in text
    error: dict[str, Any] = orjson.loads(text)["error"]
    return error


async def result(resp: ClientResponse, stream: bool) -> dict[str, Any]:
    """The client's view, merged the same way from a stream and from a JSON body."""
    if not stream:
        assert resp.status == 200, await resp.text()
        data = await resp.json()
        [choice] = data["choices"]
        msg = choice["message"]
        out = {"content": msg["content"] or "", "reasoning": msg.get("reasoning_content", "")}
        out.update(
            refusal=msg["refusal"], finish_reason=choice["finish_reason"], usage=data["usage"]
        )
        calls = [
            (c["id"], c["function"]["name"], c["function"]["arguments"])
            for c in msg.get("tool_calls", [])
        ]
        out["tool_calls"] = [(i, name, orjson.loads(args)) for i, name, args in calls]
        return out
    frames = await read_sse(resp)
    assert frames[-1] == ("message", "[DONE]")
    out = {"content": "", "reasoning": "", "refusal": None, "usage": None, "finish_reason": None}
    built: dict[int, list[Any]] = {}
    for name, chunk in frames[:-1]:
        assert name == "message", chunk
        out["usage"] = chunk.get("usage") or out["usage"]
        for choice in chunk["choices"]:
            delta = choice["delta"]
            out["content"] += delta.get("content") or ""
            out["reasoning"] += delta.get("reasoning_content") or ""
            if delta.get("refusal"):
                out["refusal"] = (out["refusal"] or "") + delta["refusal"]
            for tc in delta.get("tool_calls", []):
                call = built.setdefault(tc["index"], [None, None, ""])
                call[0] = call[0] or tc.get("id")
                call[1] = call[1] or tc["function"].get("name")
                call[2] += tc["function"].get("arguments", "")
            out["finish_reason"] = choice["finish_reason"] or out["finish_reason"]
    out["tool_calls"] = [
        (i, name, orjson.loads(args)) for _, (i, name, args) in sorted(built.items())
    ]
    return out


# --- text streaming -------------------------------------------------------------


async def test_text_from_a_slow_upstream_reaches_the_client_in_order(connect: Connect) -> None:
    reply = Reply.stream(text_frames("Hel", "lo", " world"), delay=0.15)  # within the timeouts
    client = await connect(reply, first_byte_timeout_s=0.5, idle_timeout_s=0.5)
    frames = await read_sse(await post(client))
    assert contents(frames) == ["Hel", "lo", " world"]
    assert frames[-1] == ("message", "[DONE]")
    assert frames[-2][1]["choices"][0]["finish_reason"] == "stop"
    assert {data["model"] for _, data in frames[:-1]} == {"up/gpt-up"}
    assert all("usage" not in data for _, data in frames[:-1])  # include_usage not asked


def split(blob: bytes, how: str) -> list[bytes]:
    if how == "one write":
        return [blob]
    if how == "byte by byte":
        return [blob[i : i + 1] for i in range(len(blob))]
    # Inside "data:", inside a frame's "\n\n", inside a 4-byte UTF-8 character.
    cuts = sorted({3, blob.index(b"\n\n") + 1, blob.index("🌍".encode()) + 2, len(blob) - 5})
    return [blob[a:b] for a, b in zip([0, *cuts], [*cuts, len(blob)], strict=True)]


@pytest.mark.parametrize("how", ["one write", "byte by byte", "awkward cuts"])
async def test_chunks_split_anywhere_give_the_same_stream(connect: Connect, how: str) -> None:
    blob = b"".join(text_frames("Hé", "llo 🌍", " wörld", usage=USAGE))
    delay = 0.0 if how == "byte by byte" else 0.01
    client = await connect(Reply.stream(split(blob, how), delay=delay))
    frames = await read_sse(await post(client, stream_options={"include_usage": True}))
    assert contents(frames) == ["Hé", "llo 🌍", " wörld"]
    assert frames[-2][1]["usage"]["total_tokens"] == 20
    assert frames[-1] == ("message", "[DONE]")


async def test_engine_events_from_a_byte_by_byte_upstream(upstream: FakeUpstream) -> None:
    usage = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    blob = b"".join(text_frames("a", "ü", usage=usage))
    upstream.add(Reply.stream(split(blob, "byte by byte")))
    engine = Engine.from_config(parse_config({"providers": {"up": provider(upstream)}}))
    async with engine, engine.complete_stream(chat()) as stream:
        events = [event async for event in stream]
    assert events == [
        Delta(content="a"),
        Delta(content="ü"),
        Delta(finish_reason="stop"),
        Usage(prompt_tokens=1, completion_tokens=2, total_tokens=3),
    ]


@pytest.mark.parametrize("end", ["abort", "error chunk", "clean, no finish"])
async def test_the_usage_a_cut_stream_was_given_is_what_it_is_charged(
    upstream: FakeUpstream, end: str
) -> None:
    """A usage beside choices (vLLM's running counts, a finish chunk's) waits for the end:
    a stream cut before it, by a reset, an error chunk or a clean end, lost it and was
    charged an estimate. It goes out before the failure."""
    frames = [
        b"data: "
        + orjson.dumps(
            {
                "choices": [{"index": 0, "delta": {"content": f"w{n} "}}],
                "usage": {"prompt_tokens": 100, "completion_tokens": n, "total_tokens": 100 + n},
            }
        )
        + b"\n\n"
        for n in (1, 2, 3)
    ]
    if end == "error chunk":
        frames.append(b'data: {"error": {"message": "boom", "type": "server_error"}}\n\n')
    upstream.add(Reply.stream(frames, end="abort" if end == "abort" else "eof"))
    engine = Engine.from_config(parse_config({"providers": {"up": provider(upstream)}}))
    async with engine, engine.complete_stream(chat()) as stream:
        events = [event async for event in stream]
    assert [e for e in events if type(e) is Usage] == [Usage(100, 3, 103)]
    assert events[-1].type == "error"


# --- the upstream request --------------------------------------------------------


@pytest.mark.parametrize("stream", [True, False])
async def test_upstream_request_body_and_headers(
    connect: Connect, upstream: FakeUpstream, stream: bool
) -> None:
    client = await connect(Reply.stream(text_frames("ok")))
    resp = await post(
        client,
        stream=stream,
        temperature=0.5,
        logit_bias={"50256": -100},
        mock={"content": "for the mock provider only"},
        stream_options={"include_usage": False},
    )
    assert (await result(resp, stream))["content"] == "ok"
    [seen] = upstream.requests
    assert (seen.method, seen.path) == ("POST", "/v1/chat/completions")
    sent = seen.body
    assert sent["model"] == "gpt-up"
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True}
    assert "mock" not in sent
    assert sent["logit_bias"] == {"50256": -100}
    assert sent["temperature"] == 0.5
    assert sent["messages"] == [{"role": "user", "content": "Hi"}]
    assert seen.headers["Authorization"] == f"Bearer {KEY}"
    assert seen.headers["Content-Type"] == "application/json"
    assert seen.headers["User-Agent"] == f"nexus/{nexus.__version__}"  # which release sent it


async def test_no_authorization_header_without_api_key_env(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(Reply.stream(text_frames("ok")))
    client = await gateway(make_client, up={"kind": "openai", "base_url": upstream.url + "/v1"})
    assert contents(await read_sse(await post(client))) == ["ok"]
    assert "Authorization" not in upstream.requests[0].headers


async def test_azure_openai_takes_the_key_in_api_key_and_the_version_in_the_query(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """``api_key_header = "api-key"``: the key as Azure OpenAI takes it, never also as a
    bearer token; a deployment's ``base_url`` keeps its path and ``api-version`` query."""
    upstream.add(Reply.stream(text_frames("ok")))
    base = upstream.url + "/openai/deployments/gpt-4o?api-version=2024-10-21"
    azure = {
        "kind": "openai",
        "base_url": base,
        "api_key_env": KEY_ENV,
        "api_key_header": "api-key",
    }
    client = await gateway(make_client, az=azure)
    assert contents(await read_sse(await post(client, "az/gpt-4o"))) == ["ok"]
    [seen] = upstream.requests
    assert seen.headers["api-key"] == KEY
    assert "Authorization" not in seen.headers
    assert seen.path == "/openai/deployments/gpt-4o/chat/completions"
    assert seen.query == "api-version=2024-10-21"


# --- tool calls, reasoning, refusal, usage ---------------------------------------


def call_frames(index: int, call_id: str, name: str, *fragments: str) -> list[bytes]:
    head = {"index": index, "id": call_id, "type": "function"}
    first = openai_chunk(tool_calls=[{**head, "function": {"name": name, "arguments": ""}}])
    more = [{"index": index, "function": {"arguments": f}} for f in fragments]
    return [first, *(openai_chunk(tool_calls=[m]) for m in more)]


WEATHER = call_frames(0, "call_w", "get_weather", '{"ci', 'ty": "Par', 'is", "unit"', ': "c"}')
TIME = call_frames(1, "call_t", "get_time", '{"tz', '": "Europe/', 'Paris"}')


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("several", [False, True])
async def test_tool_calls_with_fragmented_arguments(
    connect: Connect, stream: bool, several: bool
) -> None:
    frames = [openai_chunk(role="assistant", content=None), *WEATHER, *(TIME if several else [])]
    frames += [openai_chunk(finish_reason="tool_calls"), DONE]
    client = await connect(Reply.stream(frames, delay=0.005))
    got = await result(await post(client, stream=stream), stream)
    expected = [("call_w", "get_weather", {"city": "Paris", "unit": "c"})]
    if several:
        expected.append(("call_t", "get_time", {"tz": "Europe/Paris"}))
    assert got["tool_calls"] == expected
    assert got["finish_reason"] == "tool_calls"
    assert got["content"] == ""


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
async def test_reasoning_fields(connect: Connect, stream: bool, field: str) -> None:
    deltas: list[dict[str, Any]] = [{field: "Let me "}, {field: "think."}]
    frames = [openai_chunk(**delta) for delta in deltas]
    client = await connect(Reply.stream([*frames, *text_frames("42")]))
    got = await result(await post(client, stream=stream), stream)
    assert (got["reasoning"], got["content"]) == ("Let me think.", "42")


@pytest.mark.parametrize("stream", [True, False])
async def test_refusal(connect: Connect, stream: bool) -> None:
    frames = [openai_chunk(refusal="I can't "), openai_chunk(refusal="help with that.")]
    client = await connect(Reply.stream([*frames, openai_chunk(finish_reason="stop"), DONE]))
    got = await result(await post(client, stream=stream), stream)
    assert (got["refusal"], got["content"]) == ("I can't help with that.", "")


@pytest.mark.parametrize("stream", [True, False])
async def test_a_body_that_ends_on_done_without_its_blank_line_is_a_whole_answer(
    connect: Connect, stream: bool
) -> None:
    """``data: [DONE]\n`` and the end of the body, as some compatible servers end: the
    SDKs read it as the end. It was a 502 ``upstream_disconnect`` (retryable: the SDK
    called again, and paid twice), or an error frame after the whole answer."""
    frames = [openai_chunk(content="all "), openai_chunk(content="here")]
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    finish = [openai_chunk(finish_reason="stop"), openai_usage_chunk(usage)]
    client = await connect(Reply.stream([*frames, *finish, b"data: [DONE]\n"]))
    got = await result(await post(client, stream=stream), stream)
    assert (got["content"], got["finish_reason"]) == ("all here", "stop")
    if not stream:  # (a stream carries it when the client asks: include_usage)
        assert got["usage"]["completion_tokens"] == 2


@pytest.mark.parametrize("stream", [True, False])
async def test_a_body_that_ends_cleanly_after_its_finish_is_a_whole_answer(
    connect: Connect, stream: bool
) -> None:
    """Perplexity sends no [DONE] (its usage rides on every chunk): each answer ended with
    upstream_disconnect after its last word (retryable: the SDK called again and paid
    twice), and its usage was lost. A body that ends cleanly before a finish is cut."""
    usage = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}
    frames = [
        b"data: "
        + orjson.dumps(
            {
                "id": "p",
                "object": "chat.completion.chunk",
                "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": finish}],
                "usage": usage,
            }
        )
        + b"\n\n"
        for text, finish in (("all ", None), ("here", "stop"))
    ]
    client = await connect(Reply.stream(frames))
    got = await result(
        await post(client, stream=stream, stream_options={"include_usage": True}), stream
    )
    assert (got["content"], got["finish_reason"]) == ("all here", "stop")
    assert got["usage"]["completion_tokens"] == 2
    client = await connect(Reply.stream(frames[:1]))  # no finish: cut
    resp = await post(client, stream=False)
    assert (resp.status, (await resp.json())["error"]["code"]) == (502, "upstream_disconnect")


@pytest.mark.parametrize("stream", [True, False])
async def test_a_body_cut_before_its_done_is_still_an_error(connect: Connect, stream: bool) -> None:
    frames = [openai_chunk(content="cut "), openai_chunk(finish_reason="stop")]
    client = await connect(Reply.stream([*frames, b'data: {"choices": [{"ind']))
    resp = await post(client, stream=stream)
    if not stream:
        assert resp.status == 502
        assert (await resp.json())["error"]["code"] == "upstream_disconnect"
        return
    assert b'"code":"upstream_disconnect"' in await resp.read()


@pytest.mark.parametrize("stream", [True, False])
async def test_usage_details_reach_the_client(connect: Connect, stream: bool) -> None:
    client = await connect(Reply.stream(text_frames("ok", usage=USAGE)))
    resp = await post(client, stream=stream, stream_options={"include_usage": True})
    usage = (await result(resp, stream))["usage"]
    assert [usage[k] for k in ("prompt_tokens", "completion_tokens", "total_tokens")] == [11, 9, 20]
    assert usage["prompt_tokens_details"]["cached_tokens"] == 5
    assert usage["completion_tokens_details"]["reasoning_tokens"] == 7


# --- errors before the first byte ------------------------------------------------

AUTH_TEXT = f"Incorrect API key provided: {KEY}. Upstream says no"


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize(
    ("status", "client_status", "code"),
    [
        (400, 400, "upstream_invalid_request"),
        (404, 404, "upstream_not_found"),
        (422, 422, "upstream_invalid_request"),
        (429, 429, "upstream_rate_limited"),
        (401, 502, "upstream_auth_error"),
        (403, 502, "upstream_auth_error"),
        (500, 502, "upstream_error"),
        (503, 502, "upstream_error"),
    ],
)
async def test_upstream_status_before_output(
    connect: Connect,
    upstream: FakeUpstream,
    stream: bool,
    status: int,
    client_status: int,
    code: str,
) -> None:
    message = AUTH_TEXT if status in (401, 403) else f"upstream said {status} about logit_bias"
    client = await connect(Reply.json(status, openai_error_body(message), {"Retry-After": "7"}))
    resp = await post(client, stream=stream)
    assert resp.status == client_status
    error = await error_of(resp)
    assert error["code"] == code
    if status in (400, 404, 422):
        assert message in error["message"]
        assert error["type"] == "invalid_request_error"
    if status in (401, 403):
        assert "Upstream says no" not in error["message"]
        assert "Incorrect API key" not in error["message"]
    if status == 429:
        assert resp.headers["Retry-After"] == "7"
    assert len(upstream.requests) == 1  # one target: no retry


@pytest.mark.parametrize("stream", [True, False])
async def test_connect_refused_is_502(make_client: MakeClient, stream: bool) -> None:
    client = await gateway(make_client, up=provider(f"http://127.0.0.1:{closed_port()}"))
    resp = await post(client, stream=stream)
    assert resp.status == 502
    assert (await error_of(resp))["code"] == "upstream_connect_error"


@pytest.mark.parametrize("headers_delay", [30.0, 0.0], ids=["no headers", "no body"])
async def test_first_byte_timeout_is_504(
    connect: Connect, upstream: FakeUpstream, headers_delay: float
) -> None:
    client = await connect(
        Reply.stream([], end="stall", headers_delay=headers_delay), first_byte_timeout_s=0.2
    )
    loop = asyncio.get_running_loop()
    start = loop.time()
    resp = await post(client)
    assert resp.status == 504
    assert (await error_of(resp))["code"] == "upstream_timeout"
    assert loop.time() - start < 2.0
    assert await upstream.requests[0].wait_ended(2.0) - start < 2.0  # connection dropped


# --- errors after output -----------------------------------------------------------


def assert_ends_with_error(frames: Frames, code: str) -> dict[str, Any]:
    assert frames[-1] == ("message", "[DONE]")
    name, data = frames[-2]
    assert name == "error"
    assert data["error"]["code"] == code
    assert all(name == "message" for name, _ in frames[:-2])
    assert not any(c["finish_reason"] for _, chunk in frames[:-2] for c in chunk["choices"])
    error: dict[str, Any] = data["error"]
    return error


async def test_error_object_inside_the_stream(connect: Connect) -> None:
    failure = {"message": "The model is overloaded", "type": "server_error", "code": "overloaded"}
    client = await connect(Reply.stream([openai_chunk(content="partial"), sse({"error": failure})]))
    frames = await read_sse(await post(client))
    assert contents(frames) == ["partial"]
    error = assert_ends_with_error(frames, "overloaded")
    assert "The model is overloaded" in error["message"]
    assert error["type"] == "server_error"


@pytest.mark.parametrize("end", ["eof", "abort"])
async def test_end_of_body_without_done_is_upstream_disconnect(connect: Connect, end: Any) -> None:
    sent = [openai_chunk(role="assistant", content=""), openai_chunk(content="Hello")]
    client = await connect(Reply.stream(sent, end=end))
    frames = await read_sse(await post(client))
    assert contents(frames) == ["Hello"]
    assert_ends_with_error(frames, "upstream_disconnect")


@pytest.mark.parametrize(
    ("end", "status", "code"),
    [("eof", 502, "upstream_disconnect"), ("stall", 504, "upstream_timeout")],
)
async def test_non_streaming_failure_after_output_is_an_error_status(
    connect: Connect, end: Any, status: int, code: str
) -> None:
    client = await connect(Reply.stream([openai_chunk(content="Hel")], end=end), idle_timeout_s=0.2)
    resp = await post(client, stream=False)
    assert resp.status == status  # never a 200 with the partial "Hel"
    assert (await error_of(resp))["code"] == code


async def test_idle_timeout_between_chunks(connect: Connect, upstream: FakeUpstream) -> None:
    client = await connect(
        Reply.stream([openai_chunk(content="first")], end="stall"), idle_timeout_s=0.2
    )
    loop = asyncio.get_running_loop()
    start = loop.time()
    frames = await read_sse(await post(client))
    assert contents(frames) == ["first"]
    assert_ends_with_error(frames, "upstream_timeout")
    assert loop.time() - start < 2.0
    assert await upstream.requests[0].wait_ended(1.0) - start < 2.0
    assert upstream.requests[0].cancelled  # the gateway dropped the connection


# --- fallbacks --------------------------------------------------------------------


async def fallback_gateway(
    make_client: MakeClient, bad: FakeUpstream | str, good: FakeUpstream
) -> Client:
    """``fast`` = ``bad/m1`` then ``good/m2``."""
    return await gateway(
        make_client,
        models={"fast": ["bad/m1", "good/m2"]},
        bad=provider(bad, first_byte_timeout_s=0.2),
        good=provider(good),
    )


@pytest.mark.parametrize("failure", ["503", "429", "first byte timeout", "connect refused"])
async def test_fallback_to_the_next_target_before_output(
    make_client: MakeClient, failure: str
) -> None:
    async with FakeUpstream() as bad, FakeUpstream() as good:
        if failure == "first byte timeout":
            bad.add(Reply.stream([], end="stall"))
        elif failure != "connect refused":
            bad.add(Reply.json(int(failure), openai_error_body("nope", "server_error")))
        good.add(Reply.stream(text_frames("from ", "good")))
        base = f"http://127.0.0.1:{closed_port()}" if failure == "connect refused" else bad
        client = await fallback_gateway(make_client, base, good)
        frames = await read_sse(await post(client, "fast"))
        assert contents(frames) == ["from ", "good"]
        assert {data["model"] for _, data in frames[:-1]} == {"fast"}
        assert len(bad.requests) == (0 if failure == "connect refused" else 1)
        assert [seen.body["model"] for seen in good.requests] == ["m2"]


async def test_no_fallback_on_a_client_error(make_client: MakeClient) -> None:
    async with FakeUpstream() as bad, FakeUpstream() as good:
        bad.add(Reply.json(400, openai_error_body("bad temperature")))
        client = await fallback_gateway(make_client, bad, good)
        resp = await post(client, "fast")
        assert resp.status == 400
        assert "bad temperature" in (await error_of(resp))["message"]
        assert good.requests == []


async def test_no_retry_after_the_first_byte(make_client: MakeClient) -> None:
    async with FakeUpstream() as bad, FakeUpstream() as good:
        bad.add(Reply.stream([openai_chunk(content="partial")], end="abort"))
        good.add(Reply.stream(text_frames("duplicate")))
        client = await fallback_gateway(make_client, bad, good)
        frames = await read_sse(await post(client, "fast"))
        assert contents(frames) == ["partial"]
        assert_ends_with_error(frames, "upstream_disconnect")
        assert len(bad.requests) == 1
        assert good.requests == []


# --- cancellation -------------------------------------------------------------------


async def test_client_disconnect_closes_the_upstream_within_100ms(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """With ``detach_timeout_s = 0`` a stream ends with its last client."""
    upstream.add(Reply.stream([openai_chunk(content="first")], end="stall"))
    client = await make_client(
        {"providers": {"up": provider(upstream)}, "streams": {"detach_timeout_s": 0}}
    )
    resp = await post(client)
    assert resp.status == 200
    received = b""
    while b'"content":"first"' not in received:
        received += await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    gone = asyncio.get_running_loop().time()
    resp.close()
    ended = await upstream.requests[0].wait_ended(2.0)
    assert upstream.requests[0].cancelled
    assert ended - gone < 0.1


async def test_stream_close_closes_the_upstream_within_100ms(upstream: FakeUpstream) -> None:
    upstream.add(Reply.stream([openai_chunk(content="first")], end="stall"))
    engine = Engine.from_config(parse_config({"providers": {"up": provider(upstream)}}))
    async with engine:
        stream = engine.complete_stream(chat())
        assert await stream.next() == Delta(content="first")
        gone = asyncio.get_running_loop().time()
        await stream.close()
        ended = await upstream.requests[0].wait_ended(2.0)
    assert upstream.requests[0].cancelled
    assert ended - gone < 0.1


# --- secrets --------------------------------------------------------------------------


MISPLACED_KEY = "gsk_Xq7LmN2pR8sT4vW9yZ1aB3cD5eF6gH0jKLMNOPQRSTUV"
"""A provider key put in api_key_env by mistake: a valid variable name, so let through."""


def test_a_key_read_from_a_file_is_sent_without_its_newline(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key set from a mounted secret file ends with a newline (a header value aiohttp
    refuses); one of spaces only is as good as unset."""
    from nexus.providers import build_provider

    monkeypatch.setenv("NEXUS_TEST_FILED_KEY", "sk-filed-0123456789\n")
    up = provider("http://127.0.0.1:9", api_key_env="NEXUS_TEST_FILED_KEY")
    config = parse_config({"providers": {"up": up}})
    built = build_provider("up", config.providers["up"])
    assert built is not None and built._api_key == "sk-filed-0123456789"  # type: ignore[attr-defined]
    monkeypatch.setenv("NEXUS_TEST_FILED_KEY", "  \n")
    with pytest.raises(ConfigError, match="not set"):
        build_provider("up", config.providers["up"])


def test_unset_key_variable_fails_at_start_naming_its_config_key_not_its_value() -> None:
    # The value may be the secret itself: the message was "the environment variable
    # gsk_Xq7L... is not set", on the terminal and in whatever collects it.
    for name in (UNSET_ENV, MISPLACED_KEY):
        up = provider("http://127.0.0.1:9", api_key_env=name)
        with pytest.raises(ConfigError) as info:
            create_app(parse_config({"providers": {"up": up}}), registry=default_registry.copy())
        assert "[providers.up] api_key_env: the environment variable it names is not set" in (
            str(info.value)
        )
        assert name not in str(info.value)


async def test_optional_provider_without_key_is_left_out_with_a_warning(
    make_client: MakeClient, upstream: FakeUpstream, caplog: pytest.LogCaptureFixture
) -> None:
    upstream.add(Reply.stream(text_frames("ok")))
    client = await gateway(
        make_client,
        models={"opt-only": ["opt/m"]},
        up=provider(upstream),
        opt=provider(upstream, api_key_env=MISPLACED_KEY, optional=True),
    )
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("'opt'" in w and "api_key_env" in w for w in warnings), warnings
    assert not any(MISPLACED_KEY in w for w in warnings)
    for model in ("opt/m", "opt-only"):
        resp = await post(client, model)
        assert resp.status == 404
        assert (await error_of(resp))["code"] == "model_not_found"
    assert contents(await read_sse(await post(client))) == ["ok"]
    assert len(upstream.requests) == 1


async def test_waiting_for_a_pooled_connection_is_not_a_first_byte_timeout(
    connect: Connect, upstream: FakeUpstream
) -> None:
    """One pooled connection, held ~1 s by a stream: a second stream waits for it longer
    than ``first_byte_timeout_s``, and still gets its answer (the wait is the gateway's)."""
    slow = Reply.stream(text_frames("a", "b", "c", "d"), delay=0.2)
    client = await connect(slow, slow, max_connections=1, first_byte_timeout_s=0.5)
    loop = asyncio.get_running_loop()
    start = loop.time()
    first, second = await asyncio.gather(post(client), post(client))
    assert (first.status, second.status) == (200, 200)
    for resp in (first, second):
        frames = await read_sse(resp)
        assert contents(frames) == ["a", "b", "c", "d"]
    assert loop.time() - start > 1.5  # one after the other: the pool held one
    assert len(upstream.requests) == 2


async def test_a_connection_from_the_pool_still_has_the_whole_first_byte_timeout(
    connect: Connect,
) -> None:
    """After the wait for the pool, the upstream's own silence is timed in full."""
    slow = Reply.stream(text_frames("a"), delay=0.6)
    stalled = Reply.stream([], end="stall", headers_delay=5)
    client = await connect(slow, stalled, max_connections=1, first_byte_timeout_s=0.8)
    loop = asyncio.get_running_loop()
    first = asyncio.ensure_future(post(client))
    await asyncio.sleep(0.05)
    start = loop.time()
    second = await post(client)
    assert second.status == 504
    assert (await error_of(second))["code"] == "upstream_timeout"
    # Waited ~1.2 s for the pool (the first stream), then the full 0.8 s.
    assert loop.time() - start > 1.7
    assert (await first).status == 200


# --- the read timer: one per response -----------------------------------------------


async def test_time_the_consumer_takes_between_events_is_not_an_idle_timeout(
    upstream: FakeUpstream,
) -> None:
    """Frames that came in one read wait on a slow consumer for longer than the idle
    timeout: only time spent waiting for the upstream counts."""
    upstream.add(Reply.stream([b"".join(text_frames("a", "b", "c"))], eof_delay=0.1))
    config = parse_config({"providers": {"up": provider(upstream, idle_timeout_s=0.2)}})
    engine = Engine.from_config(config)
    events = []
    async with engine, engine.complete_stream(chat()) as stream:
        async for event in stream:
            events.append(event)
            await asyncio.sleep(0.3)
    assert [e.content for e in events if isinstance(e, Delta)] == ["a", "b", "c", None]


async def test_an_idle_timeout_after_slow_consumption_still_fires(upstream: FakeUpstream) -> None:
    """The timer set for a long first-byte wait does not delay a shorter idle deadline."""
    upstream.add(Reply.stream([openai_chunk(content="first")], end="stall"))
    config = parse_config(
        {
            "providers": {
                "up": provider(upstream, first_byte_timeout_s=30, idle_timeout_s=0.2),
            }
        }
    )
    engine = Engine.from_config(config)
    loop = asyncio.get_running_loop()
    async with engine, engine.complete_stream(chat()) as stream:
        first = await stream.next()
        assert first == Delta(content="first")
        start = loop.time()
        last = await stream.next()
    assert isinstance(last, Error) and last.code == "upstream_timeout"
    assert 0.15 < loop.time() - start < 2.0


async def test_cancelling_a_read_is_a_cancellation_not_a_timeout(upstream: FakeUpstream) -> None:
    upstream.add(Reply.stream([openai_chunk(content="first")], end="stall"))
    config = parse_config({"providers": {"up": provider(upstream, idle_timeout_s=0.3)}})
    engine = Engine.from_config(config)
    async with engine, engine.complete_stream(chat()) as stream:
        assert await stream.next() == Delta(content="first")
        read = asyncio.ensure_future(stream.next())
        await asyncio.sleep(0.05)
        read.cancel()
        with pytest.raises(asyncio.CancelledError):
            await read
        # The timer of that read is gone with it: nothing fires into this task later.
        await asyncio.sleep(0.5)
