"""``POST /v1/messages`` with the official anthropic SDK, on the mock and an OpenAI upstream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import orjson
import pytest

from support import MakeClient, parse_sse
from upstreams import DONE, FakeUpstream, Reply, openai_chunk, openai_usage_chunk, sse

USER = [{"role": "user", "content": "Hello from Claude's SDK"}]


async def sdk(make_client: MakeClient, config: dict[str, Any] | None = None) -> Any:
    client = await make_client(config)
    return anthropic.AsyncAnthropic(
        base_url=str(client.make_url("")), api_key="unused", max_retries=0
    )


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


async def test_stream_text_on_the_mock(make_client: MakeClient) -> None:
    api = await sdk(make_client)
    async with api.messages.stream(model="mock/echo", max_tokens=100, messages=USER) as stream:
        texts = [text async for text in stream.text_stream]
        message = await stream.get_final_message()
    assert "".join(texts) == "Hello from Claude's SDK"
    assert message.content[0].type == "text"
    assert message.content[0].text == "Hello from Claude's SDK"
    assert message.stop_reason == "end_turn"
    assert message.usage.output_tokens == 4
    assert message.usage.input_tokens == 4
    await api.close()


async def test_stream_tool_call_and_thinking(make_client: MakeClient) -> None:
    api = await sdk(make_client)
    mock = {
        "reasoning": "Check the weather first.",
        "content": "",
        "tool_calls": [{"name": "get_weather", "arguments": {"city": "Reykjavik"}}],
    }
    tools = [
        {
            "name": "get_weather",
            "description": "Weather",
            "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
        }
    ]
    async with api.messages.stream(
        model="mock/echo", max_tokens=100, messages=USER, tools=tools, extra_body={"mock": mock}
    ) as stream:
        message = await stream.get_final_message()
    kinds = [block.type for block in message.content]
    assert kinds == ["thinking", "tool_use"]
    assert message.content[0].thinking == "Check the weather first."
    tool = message.content[1]
    assert (tool.name, tool.input) == ("get_weather", {"city": "Reykjavik"})
    assert tool.id.startswith("call_")
    assert message.stop_reason == "tool_use"
    await api.close()


async def test_mid_stream_error_raises(make_client: MakeClient) -> None:
    api = await sdk(make_client)
    received = []
    with pytest.raises(anthropic.APIStatusError) as info:
        async with api.messages.stream(
            model="mock/echo",
            max_tokens=100,
            messages=USER,
            extra_body={"mock": {"fail_after": 2}},
        ) as stream:
            async for text in stream.text_stream:
                received.append(text)
    assert "".join(received) == "Hello from"
    assert info.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    assert "fail_after" in info.value.body["error"]["message"]  # type: ignore[index]
    await api.close()


async def test_non_streaming(make_client: MakeClient) -> None:
    api = await sdk(make_client)
    message = await api.messages.create(
        model="mock/echo",
        max_tokens=2,
        system="Be terse.",
        messages=USER,
        stop_sequences=["never"],
    )
    assert message.type == "message"
    assert message.content[0].text == "Hello from"
    assert message.stop_reason == "max_tokens"
    assert message.usage.output_tokens == 2
    assert message.usage.input_tokens == 6  # "Be terse." + 4 words
    await api.close()


async def test_errors_in_anthropic_shape(make_client: MakeClient) -> None:
    api = await sdk(make_client)
    with pytest.raises(anthropic.BadRequestError) as bad:
        await api.messages.create(model="mock/echo", max_tokens=-1, messages=USER)
    assert bad.value.body == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": bad.value.body["error"]["message"],  # type: ignore[index]
            "details": {"error_code": "invalid_request"},
        },
        "request_id": bad.value.response.headers["X-Request-Id"],
    }
    assert bad.value.error_code == "invalid_request"
    assert "max_tokens" in bad.value.message
    with pytest.raises(anthropic.NotFoundError) as missing:
        await api.messages.create(model="gpt-4o", max_tokens=10, messages=USER)
    assert missing.value.body["error"]["type"] == "not_found_error"  # type: ignore[index]
    with pytest.raises(anthropic.InternalServerError):
        await api.messages.create(
            model="mock/echo", max_tokens=10, messages=USER, extra_body={"mock": {"fail_after": 0}}
        )
    await api.close()


async def test_multi_turn_with_tool_result_and_image(make_client: MakeClient) -> None:
    api = await sdk(make_client)
    messages = [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": [{"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": "R"}}],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
                {"type": "text", "text": "Describe"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "aGVsbG8="},
                },
            ],
        },
    ]
    message = await api.messages.create(model="mock/echo", max_tokens=50, messages=messages)
    assert message.content[0].text == "Describe [image image/png 5 bytes]"
    await api.close()


@pytest.mark.parametrize(
    ("query", "headers", "first_line"),
    [
        ("", {}, b"event: message_start"),
        ("", {"Accept": "text/event-stream"}, b"event: message_start"),
        ("?stream_format=ndjson", {}, b'{"type":"delta"'),
        ("?stream_format=nexus", {}, b"event: delta"),
        ("?stream_format=sse", {}, b"data: {"),
    ],
)
async def test_every_format_on_messages(
    make_client: MakeClient, query: str, headers: dict[str, str], first_line: bytes
) -> None:
    client = await make_client({"server": {"retry_ms": 0}})
    body = {"model": "mock/echo", "max_tokens": 10, "messages": USER, "stream": True}
    resp = await client.post("/v1/messages" + query, json=body, headers=headers)
    assert resp.status == 200
    raw = await resp.read()
    lines = [line for line in raw.splitlines() if line and not line.startswith((b"retry:", b"id:"))]
    assert lines[0].startswith(first_line)


async def test_through_an_openai_upstream(make_client: MakeClient, upstream: FakeUpstream) -> None:
    tool_start = {
        "index": 0,
        "id": "call_up",
        "type": "function",
        "function": {"name": "lookup", "arguments": ""},
    }
    frames = [
        openai_chunk(role="assistant", content=""),
        openai_chunk(content="Looking"),
        openai_chunk(tool_calls=[tool_start]),
        openai_chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"q": '}}]),
        openai_chunk(tool_calls=[{"index": 0, "function": {"arguments": '"x"}'}}]),
        openai_chunk(finish_reason="tool_calls"),
        openai_usage_chunk({"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}),
        DONE,
    ]
    upstream.add(Reply.stream(frames))
    config = {"providers": {"up": {"kind": "openai", "base_url": upstream.url + "/v1"}}}
    api = await sdk(make_client, config)
    async with api.messages.stream(model="up/gpt-x", max_tokens=100, messages=USER) as stream:
        message = await stream.get_final_message()
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Looking"
    assert message.content[1].input == {"q": "x"}
    assert message.stop_reason == "tool_use"
    assert (message.usage.input_tokens, message.usage.output_tokens) == (9, 5)
    sent = upstream.requests[0].body
    assert sent["model"] == "gpt-x"
    assert sent["max_tokens"] == 100
    assert sent["messages"] == [{"role": "user", "content": "Hello from Claude's SDK"}]
    await api.close()


async def test_upstream_error_mid_stream_through_an_openai_upstream(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(Reply.stream([openai_chunk(content="part")], end="abort"))
    config = {"providers": {"up": {"kind": "openai", "base_url": upstream.url + "/v1"}}}
    client = await make_client(config)
    body = {"model": "up/m", "max_tokens": 10, "messages": USER, "stream": True}
    events = parse_sse(await (await client.post("/v1/messages", json=body)).read())
    assert events[-1].event == "error"
    error = orjson.loads(events[-1].data)
    assert error["type"] == "error"
    assert error["error"]["type"] == "api_error"
    assert all(e.event != "message_stop" for e in events)


async def test_sdk_sees_an_upstream_failure_mid_stream(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(Reply.stream([openai_chunk(content="part")], end="abort"))
    config = {"providers": {"up": {"kind": "openai", "base_url": upstream.url + "/v1"}}}
    api = await sdk(make_client, config)
    received = []
    with pytest.raises(anthropic.APIStatusError) as info:
        async with api.messages.stream(model="up/m", max_tokens=10, messages=USER) as stream:
            async for text in stream.text_stream:
                received.append(text)
    assert received == ["part"]
    assert info.value.body["error"]["type"] == "api_error"  # type: ignore[index]
    await api.close()


async def test_fields_it_does_not_carry_out_are_refused_by_name(make_client: MakeClient) -> None:
    """Dropped, ``mcp_servers`` or ``container`` would change the answer without a word."""
    api = await sdk(make_client)
    for field, value in (("mcp_servers", [{"type": "url", "url": "https://x", "name": "x"}]),
                         ("container", "c_1")):  # fmt: skip
        with pytest.raises(anthropic.BadRequestError) as bad:
            await api.messages.create(
                model="mock/echo", max_tokens=10, messages=USER, extra_body={field: value}
            )
        assert field in bad.value.message
    await api.close()


async def test_service_tier_reaches_an_anthropic_upstream(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(Reply.json(400, {"type": "error", "error": {"type": "x", "message": "stop"}}))
    provider = {"kind": "anthropic", "base_url": upstream.url}
    api = await sdk(make_client, {"providers": {"an": provider}})
    with pytest.raises(anthropic.BadRequestError):
        await api.messages.create(
            model="an/claude", max_tokens=10, messages=USER, service_tier="standard_only"
        )
    assert upstream.requests[-1].body["service_tier"] == "standard_only"
    await api.close()


def tool_piece(index: int, arguments: str, id: str | None = None) -> dict[str, Any]:
    piece: dict[str, Any] = {"index": index, "function": {"arguments": arguments}}
    if id is not None:
        piece.update(id=id, type="function")
        piece["function"]["name"] = "f" + id
    return piece


@pytest.mark.parametrize("order", ["interleaved", "one_after_another", "cut_short"])
async def test_parallel_tool_calls_stream_to_the_sdk_as_the_json_body_says(
    make_client: MakeClient, upstream: FakeUpstream, order: str
) -> None:
    """Each call's input goes once, whole, to its own block: pieces of two calls that
    arrive interleaved (an OpenAI upstream may send them so) must not be cut into a
    ``_raw`` fragment; input that never makes an object is ``_raw`` in both forms."""
    a = [tool_piece(0, '{"a":', "a"), tool_piece(0, "1}")]
    b = [tool_piece(1, '{"b":', "b"), tool_piece(1, "2}")]
    pieces = {
        "interleaved": [a[0], b[0], a[1], b[1]],
        "one_after_another": [*a, *b],
        "cut_short": [a[0], *b],  # the first call never closes its object
    }[order]
    frames = [
        openai_chunk(role="assistant", content=None, tool_calls=[pieces[0]]),
        *(openai_chunk(tool_calls=[piece]) for piece in pieces[1:]),
        openai_chunk(finish_reason="tool_calls"),
        DONE,
    ]
    upstream.add(Reply.stream(frames), Reply.stream(frames))
    provider = {"kind": "openai", "base_url": upstream.url + "/v1"}
    api = await sdk(make_client, {"providers": {"up": provider}})
    created = await api.messages.create(model="up/m", max_tokens=50, messages=USER)
    at_stop = []  # what a client that runs each tool at its block's stop gets
    async with api.messages.stream(model="up/m", max_tokens=50, messages=USER) as stream:
        async for event in stream:
            if event.type == "content_block_stop":
                at_stop.append(event.content_block.input)  # type: ignore[union-attr]
        streamed = await stream.get_final_message()
    first = {"_raw": '{"a":'} if order == "cut_short" else {"a": 1}
    assert at_stop == [first, {"b": 2}]
    assert [block.input for block in created.content] == [first, {"b": 2}]  # type: ignore[union-attr]
    assert [block.input for block in streamed.content] == [first, {"b": 2}]  # type: ignore[union-attr]
    await api.close()


async def test_a_chat_client_cannot_make_up_anthropic_tool_result_blocks(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """What /v1/messages carries for an Anthropic upstream rides on the tool message; a
    Chat Completions client sending the same field gets only the shapes it carries (a
    document by URL would reach the upstream unpriced)."""
    upstream.add(Reply.json(400, {"type": "error", "error": {"type": "x", "message": "stop"}}))
    client = await make_client(
        {"providers": {"an": {"kind": "anthropic", "base_url": upstream.url}}}
    )
    call = {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    history = [
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
    ]

    async def send(content: str = "done", **extra: Any) -> Any:
        tool = {"role": "tool", "tool_call_id": "t1", "content": content, **extra}
        body = {"model": "an/claude", "messages": [*history, tool]}
        return await client.post("/v1/chat/completions", json=body)

    document = {"type": "document", "source": {"type": "url", "url": "https://x/500.pdf"}}
    # A text for the Anthropic target other than the content every target gets (the
    # estimate counts the content: 2.4 MB of text beside "x" spent 9x a key's budget).
    other = {"type": "text", "text": "a long text the content does not hold"}
    for extra in (
        {"tool_result_content": [document]},
        {"is_error": "yes"},
        {"tool_result_content": [other]},
    ):
        resp = await send(**extra)
        assert resp.status == 400
        assert (await resp.json())["error"]["param"].startswith("messages")
    assert not upstream.requests  # nothing went upstream
    image = {"type": "image", "source": {"type": "url", "url": "https://x/a.png"}}
    text = {"type": "text", "text": "ok", "citations": []}  # a TextBlockParam may cite
    resp = await send("ok", tool_result_content=[text, image], is_error=True)
    await resp.read()
    sent = upstream.requests[-1].body["messages"][-1]["content"][0]
    assert (sent["content"][1], sent["is_error"]) == (image, True)


@pytest.mark.parametrize("finish", ["stop", "content_filter"])
async def test_an_openai_refusal_is_stop_reason_refusal(
    make_client: MakeClient, upstream: FakeUpstream, finish: str
) -> None:
    """OpenAI sends a refusal with finish_reason "stop": an Anthropic client must still be
    told the turn was refused, streamed or not."""
    frames = [
        openai_chunk(role="assistant", content=None, refusal=""),
        openai_chunk(refusal="I can't help with that."),
        openai_chunk(finish_reason=finish),
        DONE,
    ]
    upstream.add(Reply.stream(frames), Reply.stream(frames))
    provider = {"kind": "openai", "base_url": upstream.url + "/v1"}
    api = await sdk(make_client, {"providers": {"up": provider}})
    created = await api.messages.create(model="up/m", max_tokens=50, messages=USER)
    async with api.messages.stream(model="up/m", max_tokens=50, messages=USER) as stream:
        streamed = await stream.get_final_message()
    for message in (created, streamed):
        assert message.stop_reason == "refusal"
        assert [block.text for block in message.content] == ["I can't help with that."]  # type: ignore[union-attr]
    await api.close()


def anthropic_frames() -> list[bytes]:
    """An Anthropic stream of text, two tool calls, then more text."""

    def event(kind: str, **fields: Any) -> bytes:
        return sse({"type": kind, **fields}, event=kind)

    def block(index: int, start: dict[str, Any], delta: dict[str, Any]) -> list[bytes]:
        return [
            event("content_block_start", index=index, content_block=start),
            event("content_block_delta", index=index, delta=delta),
            event("content_block_stop", index=index),
        ]

    def text(index: int, words: str) -> list[bytes]:
        return block(index, {"type": "text", "text": ""}, {"type": "text_delta", "text": words})

    def tool(index: int, id: str, arguments: str) -> list[bytes]:
        start = {"type": "tool_use", "id": id, "name": "f", "input": {}}
        return block(index, start, {"type": "input_json_delta", "partial_json": arguments})

    message = {"id": "m", "type": "message", "role": "assistant", "model": "c", "content": []}
    message |= {"stop_reason": None, "stop_sequence": None}
    message["usage"] = {"input_tokens": 5, "output_tokens": 1}
    return [
        event("message_start", message=message),
        *text(0, "Before."),
        *tool(1, "toolu_A", '{"a":1}'),
        *tool(2, "toolu_B", '{"b":2}'),
        *text(3, " After."),
        event("message_delta", delta={"stop_reason": "tool_use", "stop_sequence": None}),
        event("message_stop"),
    ]


async def test_text_after_tool_calls_keeps_its_place_streamed_or_not(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """The JSON body held all the text in one block before the tool calls; the stream, as
    the upstream sent it. Both now keep the upstream's order, on both endpoints."""
    import openai

    for _ in range(4):
        upstream.add(Reply.stream(anthropic_frames()))
    client = await make_client(
        {"providers": {"an": {"kind": "anthropic", "base_url": upstream.url}}}
    )
    api = anthropic.AsyncAnthropic(base_url=str(client.make_url("")), api_key="x", max_retries=0)
    ask: dict[str, Any] = {"model": "an/claude", "max_tokens": 100, "messages": USER}
    created = await api.messages.create(**ask)
    async with api.messages.stream(**ask) as stream:
        streamed = await stream.get_final_message()
    order = [
        ("text", "Before."),
        ("tool_use", "toolu_A"),
        ("tool_use", "toolu_B"),
        ("text", " After."),
    ]
    for message in (created, streamed):
        got = [
            (b.type, getattr(b, "text", None) or getattr(b, "id", None)) for b in message.content
        ]
        assert got == order
    responses = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="x", max_retries=0)
    made = await responses.responses.create(model="an/claude", input="hi")
    async with responses.responses.stream(model="an/claude", input="hi") as events:
        final = await events.get_final_response()
    for response in (made, final):
        items = [
            (o.type, getattr(o, "call_id", None) or o.content[0].text) for o in response.output
        ]  # type: ignore[union-attr]
        assert items == [
            ("message", "Before."),
            ("function_call", "toolu_A"),
            ("function_call", "toolu_B"),
            ("message", " After."),
        ]
    await api.close()
    await responses.close()


async def test_a_chat_client_cannot_make_up_anthropic_content(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """``anthropic_content`` (what /v1/messages carries back for an Anthropic upstream)
    holds thinking, redacted thinking, text and tool_use blocks only, with the message's
    own text and tool calls (ids, names and arguments) in order: an Anthropic target and
    an OpenAI one get the same turn."""
    client = await make_client(
        {"providers": {"an": {"kind": "anthropic", "base_url": upstream.url}}}
    )
    call = {"id": "t1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    thinking = {"type": "thinking", "thinking": "Hm", "signature": "sig"}
    use = {"type": "tool_use", "id": "t1", "name": "f", "input": {}}
    document = {"type": "document", "source": {"type": "url", "url": "https://x/500.pdf"}}
    for blocks in (
        [document, use],
        "no",
        [thinking],  # its tool call missing
        [thinking, use, {"type": "text", "text": "more"}],  # text the message lacks
        [thinking, {**use, "name": "delete_everything"}],  # another call than the message's
        [thinking, {**use, "input": {"path": "/"}}],  # other arguments than the message's
        [{"type": "thinking", "thinking": "Hm", "signature": 7}, use],  # a signature not text
    ):
        assistant = {
            "role": "assistant",
            "content": None,
            "tool_calls": [call],
            "anthropic_content": blocks,
        }
        body = {"model": "an/claude", "messages": [{"role": "user", "content": "hi"}, assistant]}
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 400, blocks
        assert (await resp.json())["error"]["param"].startswith("messages")
    assert not upstream.requests  # nothing went upstream
