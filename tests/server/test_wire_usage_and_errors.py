"""What accounting clients read off the wire: the input tokens in Anthropic's
``message_start``, and the request id, code and retryability of every error frame.

Against a real ``nexus serve`` in front of a fake Anthropic upstream (and an OpenAI
one): the anthropic SDK sees ``message_start.message.usage.input_tokens == 41`` as
Anthropic sent it, an OpenAI upstream gives 0 there and the totals at the end; an
upstream failure mid-stream reaches every format's error frame with the response's
``X-Request-Id`` (the gateway's, whatever id the client gave) and the code. In-process:
a GET follower of a stream and a WebSocket get their own request's id.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
import websockets

from nexus_process import start_nexus, stop_nexus
from support import MakeClient, chat, parse_sse
from upstreams import DONE, FakeUpstream, Reply, openai_chunk, openai_usage_chunk, sse

USER = [{"role": "user", "content": "Hello"}]
OVERLOADED = {"type": "overloaded_error", "message": "Overloaded"}


def event(name: str, **fields: Any) -> bytes:
    return sse({"type": name, **fields}, event=name)


def message_start(input_tokens: int, cache_read: int = 0, cache_write: int = 0) -> bytes:
    """Anthropic's first event: the input counts before any content."""
    usage = {
        "input_tokens": input_tokens,
        "cache_creation_input_tokens": cache_write,
        "cache_read_input_tokens": cache_read,
        "output_tokens": 1,
    }
    message = {
        "id": "msg_up",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "claude-x",
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    return event("message_start", message=message)


def text_block(*parts: str) -> list[bytes]:
    start = event("content_block_start", index=0, content_block={"type": "text", "text": ""})
    deltas = [
        event("content_block_delta", index=0, delta={"type": "text_delta", "text": p})
        for p in parts
    ]
    return [start, *deltas]


def anthropic_reply(*, fail: bool = False) -> Reply:
    frames = [message_start(41, cache_read=5, cache_write=2), *text_block("Hello", " world")]
    if fail:
        frames.append(event("error", error=OVERLOADED))
    else:
        frames += [
            event("content_block_stop", index=0),
            event(
                "message_delta",
                delta={"stop_reason": "end_turn", "stop_sequence": None},
                usage={"output_tokens": 2},
            ),
            event("message_stop"),
        ]
    return Reply.stream(frames, path="/v1/messages")


def openai_reply() -> Reply:
    frames = [
        openai_chunk(role="assistant", content=""),
        openai_chunk(content="Hi"),
        openai_chunk(finish_reason="stop"),
        openai_usage_chunk({"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}),
        DONE,
    ]
    return Reply.stream(frames, path="/v1/chat/completions")


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


@pytest.fixture
def gateway(tmp_path: Path, upstream: FakeUpstream) -> Iterator[str]:
    """``nexus serve`` with ``claude`` (Anthropic) and ``gpt`` (OpenAI) on the fake."""
    config = tmp_path / "config.toml"
    config.write_text(
        f'[providers.claude]\nkind = "anthropic"\nbase_url = "{upstream.url}"\n'
        f'[providers.gpt]\nkind = "openai"\nbase_url = "{upstream.url}/v1"\n'
    )
    proc, match = start_nexus(config, tmp_path / "nexus.log")
    try:
        yield match.group(1)
    finally:
        stop_nexus(proc, gently=False)


def sdk(url: str) -> anthropic.AsyncAnthropic:
    return anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0)


async def test_message_start_carries_the_input_tokens_an_anthropic_upstream_sent(
    gateway: str, upstream: FakeUpstream
) -> None:
    upstream.add(anthropic_reply())
    api = sdk(gateway)
    async with api.messages.stream(model="claude/claude-x", max_tokens=50, messages=USER) as s:
        events = [e async for e in s]
        final = await s.get_final_message()
    await api.close()
    assert events[0].type == "message_start"
    usage = events[0].message.usage
    assert usage.input_tokens == 41
    assert (usage.cache_read_input_tokens, usage.cache_creation_input_tokens) == (5, 2)
    assert usage.output_tokens == 0
    assert final.content[0].text == "Hello world"  # type: ignore[union-attr]
    assert (final.usage.input_tokens, final.usage.output_tokens) == (41, 2)
    assert final.usage.cache_read_input_tokens == 5
    assert final.usage.cache_creation_input_tokens == 2


async def test_an_openai_upstream_gives_zero_at_start_and_the_totals_at_the_end(
    gateway: str, upstream: FakeUpstream
) -> None:
    upstream.add(openai_reply())
    api = sdk(gateway)
    async with api.messages.stream(model="gpt/gpt-x", max_tokens=50, messages=USER) as s:
        events = [e async for e in s]
        final = await s.get_final_message()
    await api.close()
    assert events[0].type == "message_start"
    assert events[0].message.usage.input_tokens == 0
    assert (final.usage.input_tokens, final.usage.output_tokens) == (9, 5)


async def test_the_early_count_is_not_an_extra_usage_chunk_in_openai_sse(
    gateway: str, upstream: FakeUpstream
) -> None:
    upstream.add(anthropic_reply())
    body = {**chat("Hello", model="claude/claude-x"), "stream": True}
    body["stream_options"] = {"include_usage": True}
    async with (
        aiohttp.ClientSession() as session,
        session.post(gateway + "/v1/chat/completions", json=body) as resp,
    ):
        events = parse_sse(await resp.read())
    chunks = [orjson.loads(e.data) for e in events if e.data != "[DONE]"]
    usages = [c["usage"] for c in chunks if c.get("usage")]
    assert usages == [
        {
            "prompt_tokens": 48,
            "completion_tokens": 2,
            "total_tokens": 50,
            "prompt_tokens_details": {"cached_tokens": 5, "cache_write_tokens": 2},
        }
    ]


async def test_an_upstream_failure_reaches_every_error_frame_with_the_request_id(
    gateway: str, upstream: FakeUpstream
) -> None:
    # Anthropic's own error frame, through its SDK: still its error type, with the code
    # and the response's request id (the client's own id is echoed beside it).
    upstream.add(anthropic_reply(fail=True))
    api = sdk(gateway)
    with pytest.raises(anthropic.APIStatusError) as failed:
        async with api.messages.stream(
            model="claude/claude-x",
            max_tokens=50,
            messages=USER,
            extra_headers={"X-Client-Request-Id": "acct-messages-1"},
        ) as s:
            async for _ in s:
                pass
    await api.close()
    body: Any = failed.value.body
    headers = failed.value.response.headers
    assert body["request_id"] == headers["request-id"] == headers["x-request-id"]
    assert headers["x-client-request-id"] == "acct-messages-1"
    assert body["error"]["type"] == "overloaded_error"
    assert failed.value.error_code == "upstream_error"

    # OpenAI SSE, through its SDK: the code, retryable and the request id in the object.
    upstream.add(anthropic_reply(fail=True))
    client = openai.AsyncOpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0)
    stream = await client.chat.completions.create(
        model="claude/claude-x",
        messages=USER,  # type: ignore[arg-type]
        stream=True,
        extra_headers={"X-Client-Request-Id": "acct-chat-2"},
    )
    with pytest.raises(openai.APIError) as error:
        async for _ in stream:
            pass
    await client.close()
    assert stream.response.headers["x-client-request-id"] == "acct-chat-2"
    assert error.value.code == "upstream_error"
    assert error.value.body == {
        "message": error.value.message,
        "type": "overloaded_error",
        "param": None,
        "code": "upstream_error",
        "retryable": True,
        "request_id": stream.response.headers["x-request-id"],
    }

    async with aiohttp.ClientSession() as session:
        body = {**chat("Hello", model="claude/claude-x"), "stream": True}
        for fmt, given in (("ndjson", "acct-ndjson-3"), ("nexus", "acct-native-4")):
            upstream.add(anthropic_reply(fail=True))
            async with session.post(
                gateway + "/v1/chat/completions?stream_format=" + fmt,
                json=body,
                headers={"X-Client-Request-Id": given},
            ) as resp:
                raw = await resp.read()
                request_id = resp.headers["X-Request-Id"]
                assert request_id != given
            if fmt == "ndjson":
                errors = [orjson.loads(line) for line in raw.splitlines() if b'"error"' in line]
            else:
                errors = [orjson.loads(e.data) for e in parse_sse(raw) if e.event == "error"]
            assert errors == [
                {
                    "type": "error",
                    "error": {
                        "type": "overloaded_error",
                        "message": errors[0]["error"]["message"],
                        "code": "upstream_error",
                        "retryable": True,
                        "request_id": request_id,
                    },
                }
            ]

        upstream.add(anthropic_reply(fail=True))
        responses = {"model": "claude/claude-x", "input": "Hello", "stream": True}
        async with session.post(
            gateway + "/v1/responses", json=responses, headers={"X-Request-Id": "acct-resp-5"}
        ) as resp:
            events = parse_sse(await resp.read())
            request_id = resp.headers["X-Request-Id"]
        error_event = next(orjson.loads(e.data) for e in events if e.event == "error")
        assert error_event["code"] == "upstream_error"
        assert error_event["request_id"] == request_id != "acct-resp-5"
        assert events[-1].event == "response.failed"


async def test_a_get_follower_gets_its_own_request_id(make_client: MakeClient) -> None:
    """The request id is the response's, not the stream's."""
    client = await make_client()
    body = chat("one two three four", background=True, mock={"fail_after": 2, "delay_ms": 20})
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 202, await resp.text()
    stream_id = (await resp.json())["id"]
    followers, expected = [], []
    for _ in range(2):
        got = await client.get(f"/v1/streams/{stream_id}")
        events = parse_sse(await got.read())
        error = orjson.loads(next(e.data for e in events if e.event == "error"))["error"]
        followers.append((error["request_id"], error["code"], error["retryable"]))
        expected.append((got.headers["X-Request-Id"], "upstream_error", True))
    assert followers == expected
    assert len({resp.headers["X-Request-Id"], *(f[0] for f in followers)}) == 3


async def test_websocket_error_frames_carry_the_handshake_request_id(
    make_client: MakeClient,
) -> None:
    client = await make_client()
    url = f"ws://{client.server.host}:{client.server.port}/v1/realtime"
    async with websockets.connect(url, additional_headers={"X-Request-Id": "acct-ws-6"}) as ws:
        assert ws.response is not None
        handshake = ws.response.headers["X-Request-Id"]
        assert handshake != "acct-ws-6"
        await ws.send('{"type":"abort"}')  # refused in the session: nothing to abort
        refused = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert refused["error"]["code"] == "nothing_to_abort"
        assert refused["error"]["request_id"] == handshake
        request = {**chat("a b c", mock={"fail_after": 1})}
        await ws.send(orjson.dumps({"type": "start", "request": request}).decode())
        while (frame := orjson.loads(await asyncio.wait_for(ws.recv(), 5)))["type"] != "error":
            pass
    assert frame["error"]["code"] == "upstream_error"
    assert frame["error"]["request_id"] == handshake
