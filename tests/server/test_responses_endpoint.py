"""``POST /v1/responses`` with the official openai SDK, on the mock and on fake upstreams.

``client.responses.stream()`` + ``get_final_response()`` and
``client.responses.create()`` (with and without ``stream=True``) against the
running app: text, a tool call, reasoning, a mid-stream failure; validation
errors; stream-format negotiation; translation through an ``openai``-kind and an
``anthropic``-kind upstream.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import orjson
import pytest
from openai import AsyncOpenAI

from support import MakeClient, parse_sse
from upstreams import DONE, FakeUpstream, Reply, openai_chunk, openai_usage_chunk, sse

TEXT = "Hello from the SDK"
TOOLS: list[Any] = [
    {
        "type": "function",
        "name": "f",
        "description": "A function",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}},
        "strict": False,
    }
]
CALL_F = {"tool_calls": [{"name": "f", "arguments": {"x": 1}}]}


async def sdk(make_client: MakeClient, config: dict[str, Any] | None = None) -> AsyncOpenAI:
    client = await make_client(config)
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


# --- responses.stream() + get_final_response() -------------------------------


async def test_stream_text(make_client: MakeClient) -> None:
    async with (
        await sdk(make_client) as api,
        api.responses.stream(model="mock/echo", input=TEXT) as stream,
    ):
        events = [event async for event in stream]
        final = await stream.get_final_response()
    assert events[0].type == "response.created"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) == 4
    assert "".join(deltas) == TEXT
    assert events[-1].type == "response.completed"
    assert final.id == events[0].response.id
    assert final.id.startswith("resp_")
    assert final.status == "completed"
    assert final.output_text == TEXT
    assert [item.type for item in final.output] == ["message"]
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens, final.usage.total_tokens) == (
        4,
        4,
        8,
    )


async def test_stream_tool_call(make_client: MakeClient) -> None:
    async with (
        await sdk(make_client) as api,
        api.responses.stream(
            model="mock/echo",
            input=TEXT,
            tools=TOOLS,
            extra_body={
                "mock": {
                    "content": "",
                    "tool_calls": [{"name": "f", "arguments": {"x": 123456789}}],
                }
            },
        ) as stream,
    ):
        events = [event async for event in stream]
        final = await stream.get_final_response()
    fragments = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    assert len(fragments) > 1  # the arguments really arrived in pieces
    assert "".join(fragments) == '{"x":123456789}'
    assert [item.type for item in final.output] == ["function_call"]
    call = final.output[0]
    assert call.type == "function_call"
    assert call.name == "f"
    assert orjson.loads(call.arguments) == {"x": 123456789}
    assert call.call_id.startswith("call_")
    assert call.status == "completed"
    assert final.output_text == ""


async def test_stream_reasoning_text_and_tool_call(make_client: MakeClient) -> None:
    mock = {"reasoning": "thinking about it", **CALL_F, "usage": {"cached_tokens": 2}}
    async with (
        await sdk(make_client) as api,
        api.responses.stream(
            model="mock/echo",
            input=TEXT,
            instructions="Be brief.",
            tools=TOOLS,
            extra_body={"mock": mock},
        ) as stream,
    ):
        events = [event async for event in stream]
        final = await stream.get_final_response()
    summary = [e.delta for e in events if e.type == "response.reasoning_summary_text.delta"]
    assert "".join(summary) == "thinking about it"
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    reasoning = final.output[0]
    assert reasoning.type == "reasoning"
    assert reasoning.summary[0].text == "thinking about it"
    assert final.output_text == TEXT
    assert final.usage is not None
    assert final.usage.output_tokens_details.reasoning_tokens == 3
    assert final.usage.input_tokens_details.cached_tokens == 2
    assert final.usage.input_tokens == 6  # "Be brief." counts: instructions went upstream


async def test_stream_mid_stream_failure(make_client: MakeClient) -> None:
    async with (
        await sdk(make_client) as api,
        api.responses.stream(
            model="mock/echo", input=TEXT, extra_body={"mock": {"fail_after": 2}}
        ) as stream,
    ):
        events = [event async for event in stream]
        with pytest.raises(RuntimeError, match=r"response\.completed"):
            await stream.get_final_response()
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Hello from"
    error, failed = events[-2:]
    assert error.type == "error"
    assert error.code == "upstream_error"
    assert "fail_after" in error.message
    assert failed.type == "response.failed"
    assert failed.response.status == "failed"
    assert failed.response.error is not None
    assert failed.response.error.code == "server_error"  # the SDK's closed set
    assert failed.response.output[0].type == "message"
    assert all(e.type != "response.completed" for e in events)


async def test_stream_with_heartbeats_between_events(make_client: MakeClient) -> None:
    config = {"server": {"heartbeat_interval_s": 0.02}}
    body = {"model": "mock/echo", "input": "a b", "stream": True, "mock": {"delay_ms": 120}}
    client = await make_client(config)
    raw = await (await client.post("/v1/responses", json=body)).read()
    assert b"\n\n: ping\n" in raw
    async with (
        await sdk(make_client, config) as api,
        api.responses.stream(
            model="mock/echo", input="a b", extra_body={"mock": {"delay_ms": 120}}
        ) as stream,
    ):
        final = await stream.get_final_response()
    assert final.output_text == "a b"


# --- responses.create() ----------------------------------------------------------


async def test_create_text_and_length(make_client: MakeClient) -> None:
    async with await sdk(make_client) as api:
        response = await api.responses.create(model="mock/echo", input=TEXT)
        assert response.object == "response"
        assert response.status == "completed"
        assert response.output_text == TEXT
        assert response.output[0].id.startswith("msg_")
        assert response.usage is not None and response.usage.total_tokens == 8

        cut = await api.responses.create(model="mock/echo", input=TEXT, max_output_tokens=2)
    assert cut.status == "incomplete"
    assert cut.incomplete_details is not None
    assert cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output_text == "Hello from"
    assert cut.output[0].type == "message" and cut.output[0].status == "incomplete"


async def test_create_tool_call_and_reasoning(make_client: MakeClient) -> None:
    async with await sdk(make_client) as api:
        response = await api.responses.create(
            model="mock/echo",
            input=TEXT,
            tools=TOOLS,
            tool_choice={"type": "function", "name": "f"},
            extra_body={"mock": {"reasoning": "hmm", "content": "", **CALL_F}},
        )
    assert [item.type for item in response.output] == ["reasoning", "function_call"]
    call = response.output[1]
    assert call.type == "function_call"
    assert (call.name, orjson.loads(call.arguments)) == ("f", {"x": 1})
    assert response.usage is not None
    assert response.usage.output_tokens_details.reasoning_tokens == 1


async def test_create_multi_turn_with_a_function_call_output(make_client: MakeClient) -> None:
    """The usual tool loop: feed the output items back, plus the function's result."""
    async with await sdk(make_client) as api:
        first = await api.responses.create(
            model="mock/echo", input=TEXT, tools=TOOLS, extra_body={"mock": CALL_F}
        )
        call = first.output[-1]
        assert call.type == "function_call"
        items: list[Any] = [
            {"role": "user", "content": TEXT},
            *[item.model_dump(exclude_none=True) for item in first.output],
            {"type": "function_call_output", "call_id": call.call_id, "output": "42"},
            {"role": "user", "content": [{"type": "input_text", "text": "And now?"}]},
        ]
        second = await api.responses.create(model="mock/echo", input=items, tools=TOOLS)
    assert second.output_text == "And now?"


async def test_create_streaming_yields_every_event(make_client: MakeClient) -> None:
    async with await sdk(make_client) as api:
        stream = await api.responses.create(
            model="mock/echo", input=TEXT, stream=True, extra_body={"mock": CALL_F}
        )
        events = [event async for event in stream]
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"]
    assert types.count("response.output_item.added") == 2
    assert types.count("response.output_item.done") == 2
    assert types[-1] == "response.completed"
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output_text == TEXT


async def test_create_streaming_failure_is_yielded_not_raised(make_client: MakeClient) -> None:
    async with await sdk(make_client) as api:
        stream = await api.responses.create(
            model="mock/echo", input=TEXT, stream=True, extra_body={"mock": {"fail_after": 1}}
        )
        events = [event async for event in stream]
    assert [e.type for e in events[-2:]] == ["error", "response.failed"]


async def test_create_failure_before_output_is_an_http_error(make_client: MakeClient) -> None:
    async with await sdk(make_client) as api:
        with pytest.raises(openai.InternalServerError) as info:
            await api.responses.create(
                model="mock/echo", input=TEXT, extra_body={"mock": {"fail_after": 2}}
            )
    assert info.value.status_code == 502
    assert info.value.code == "upstream_error"


# --- validation --------------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id", "stores no responses"),
        ({"conversation": "conv_1"}, "conversation", "stores no responses"),
        ({"model": ""}, "model", "at least 1 character"),
        ({"input": 5}, "input", "a string or a list"),
        ({"input": []}, "input", "Field required"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type", "'web_search_call'"),
        ({"input": [{"type": "function_call", "name": "f"}]}, "input[0].call_id", "required"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "'user'"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0].image_url",
            "Field required",
        ),
        ({"max_output_tokens": 0}, "max_output_tokens", "greater than or equal to 1"),
        ({"temperature": 5}, "temperature", "less than or equal to 2"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type", "'function'"),
        ({"tool_choice": "any"}, "tool_choice", "'auto', 'none' or 'required'"),
        ({"tool_choice": {"type": "function", "name": "g"}}, "tool_choice.name", "'g'"),
        ({"mock": {"bogus": 1}}, "mock.bogus", "Unknown field"),
    ],
)
async def test_validation_errors_name_the_responses_field(
    make_client: MakeClient, body: dict[str, Any], param: str, fragment: str
) -> None:
    client = await make_client()
    request = {"model": "mock/echo", "input": TEXT, "stream": True, **body}
    resp = await client.post("/v1/responses", json=request)
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(f"{param}: ")
    assert fragment in error["message"]


async def test_sdk_sees_bad_requests_and_unknown_models(make_client: MakeClient) -> None:
    async with await sdk(make_client) as api:
        with pytest.raises(openai.BadRequestError) as bad:
            await api.responses.create(
                model="mock/echo", input=TEXT, previous_response_id="resp_123"
            )
        assert bad.value.param == "previous_response_id"
        with pytest.raises(openai.NotFoundError) as missing:
            await api.responses.create(model="gpt-nope", input=TEXT)
        assert missing.value.code == "model_not_found"


async def test_body_that_is_not_json(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post("/v1/responses", data=b"{nope")
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "invalid_json"


# --- stream formats ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("query", "headers", "media_type", "first"),
    [
        ("", {}, "application/vnd.nexus.openai-responses+sse", b"event: response.created"),
        (
            "",
            {"Accept": "text/event-stream"},
            "application/vnd.nexus.openai-responses+sse",
            b"event: response.created",
        ),
        ("?stream_format=ndjson", {}, "application/x-ndjson", b'{"type":"delta"'),
        ("?stream_format=nexus", {}, "application/vnd.nexus.events+sse", b"event: delta"),
        ("?stream_format=sse", {}, "text/event-stream", b"data: {"),
        (
            "",
            {"X-Nexus-Stream-Format": "openai-responses"},
            "application/vnd.nexus.openai-responses+sse",
            b"event: response.created",
        ),
    ],
)
async def test_every_format_on_responses(
    make_client: MakeClient, query: str, headers: dict[str, str], media_type: str, first: bytes
) -> None:
    client = await make_client({"server": {"retry_ms": 0}})
    body = {"model": "mock/echo", "input": TEXT, "stream": True}
    resp = await client.post("/v1/responses" + query, json=body, headers=headers)
    assert resp.status == 200
    assert resp.headers["X-Nexus-Stream-Format"] == media_type
    raw = await resp.read()
    lines = [line for line in raw.splitlines() if line and not line.startswith((b"retry:", b"id:"))]
    assert lines[0].startswith(first)
    assert TEXT.split()[-1].encode() in raw


async def test_responses_format_on_chat_completions(make_client: MakeClient) -> None:
    client = await make_client()
    body = {"model": "mock/echo", "messages": [{"role": "user", "content": TEXT}], "stream": True}
    resp = await client.post("/v1/chat/completions?stream_format=responses", json=body)
    assert resp.status == 200
    assert resp.headers["Content-Type"] == "text/event-stream; charset=utf-8"
    events = parse_sse(await resp.read())
    assert [e.event for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].event == "response.completed"
    assert orjson.loads(events[-1].data)["response"]["output"][0]["content"][0]["text"] == TEXT


# --- across provider kinds ---------------------------------------------------------


async def test_through_an_openai_upstream(make_client: MakeClient, upstream: FakeUpstream) -> None:
    tool_start = {
        "index": 0,
        "id": "call_up",
        "type": "function",
        "function": {"name": "lookup", "arguments": ""},
    }
    upstream.add(
        Reply.stream(
            [
                openai_chunk(role="assistant", content=""),
                openai_chunk(content="Look"),
                openai_chunk(content="ing"),
                openai_chunk(tool_calls=[tool_start]),
                openai_chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"q": '}}]),
                openai_chunk(tool_calls=[{"index": 0, "function": {"arguments": '"x"}'}}]),
                openai_chunk(finish_reason="tool_calls"),
                openai_usage_chunk(
                    {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}
                ),
                DONE,
            ]
        )
    )
    config = {"providers": {"up": {"kind": "openai", "base_url": upstream.url + "/v1"}}}
    tool = {**TOOLS[0], "name": "lookup"}
    async with (
        await sdk(make_client, config) as api,
        api.responses.stream(
            model="up/gpt-x",
            instructions="Be helpful.",
            input=[
                {"role": "user", "content": "Find x"},
                {"type": "function_call", "call_id": "c0", "name": "lookup", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c0", "output": "nothing"},
            ],
            tools=[tool],
            max_output_tokens=50,
            store=False,
            metadata={"k": "v"},
        ) as stream,
    ):
        final = await stream.get_final_response()
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output_text == "Looking"
    call = final.output[1]
    assert call.type == "function_call"
    assert (call.call_id, call.name, orjson.loads(call.arguments)) == (
        "call_up",
        "lookup",
        {"q": "x"},
    )
    assert final.usage is not None
    assert (final.usage.input_tokens, final.usage.output_tokens) == (9, 5)

    sent = upstream.requests[0].body
    assert upstream.requests[0].path == "/v1/chat/completions"
    assert sent["model"] == "gpt-x"
    assert sent["max_tokens"] == 50
    assert sent["messages"] == [
        {"role": "system", "content": "Be helpful."},
        {"role": "user", "content": "Find x"},
        {
            "role": "assistant",
            "tool_calls": [
                {"id": "c0", "type": "function", "function": {"name": "lookup", "arguments": "{}"}}
            ],
        },
        {"role": "tool", "content": "nothing", "tool_call_id": "c0"},
    ]
    assert sent["tools"] == [
        {
            "type": "function",
            "function": {
                "name": "lookup",
                "description": "A function",
                "parameters": TOOLS[0]["parameters"],
                "strict": False,
            },
        }
    ]
    # Nothing of the Responses API that Chat Completions does not know goes upstream.
    for field in ("input", "instructions", "max_output_tokens", "store", "text"):
        assert field not in sent
    # The response's own (echoed): Chat Completions refuses metadata without store: true.
    assert "metadata" not in sent


async def test_through_an_anthropic_upstream(
    make_client: MakeClient, upstream: FakeUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    def event(name: str, **fields: Any) -> bytes:
        return sse({"type": name, **fields}, event=name)

    def delta(index: int, **fields: Any) -> bytes:
        return event("content_block_delta", index=index, delta=fields)

    usage = {"input_tokens": 7, "output_tokens": 1}
    start = {
        "id": "msg_up",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "claude-x",
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    thinking = {"type": "thinking", "thinking": "", "signature": ""}
    tool = {"type": "tool_use", "id": "toolu_1", "name": "f", "input": {}}
    upstream.add(
        Reply.stream(
            [
                event("message_start", message=start),
                event("content_block_start", index=0, content_block=thinking),
                delta(0, type="thinking_delta", thinking="Hmm."),
                event("content_block_stop", index=0),
                event("content_block_start", index=1, content_block={"type": "text", "text": ""}),
                delta(1, type="text_delta", text="On it."),
                event("content_block_stop", index=1),
                event("content_block_start", index=2, content_block=tool),
                delta(2, type="input_json_delta", partial_json='{"x": 1}'),
                event("content_block_stop", index=2),
                event(
                    "message_delta",
                    delta={"stop_reason": "tool_use", "stop_sequence": None},
                    usage={"output_tokens": 12},
                ),
                event("message_stop"),
            ]
        )
    )
    monkeypatch.setenv("NEXUS_TEST_ANTHROPIC_KEY", "sk-ant-test")
    config = {
        "providers": {
            "claude": {
                "kind": "anthropic",
                "base_url": upstream.url,
                "api_key_env": "NEXUS_TEST_ANTHROPIC_KEY",
            }
        }
    }
    async with (
        await sdk(make_client, config) as api,
        api.responses.stream(model="claude/claude-x", input=TEXT, tools=TOOLS) as stream,
    ):
        final = await stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "message", "function_call"]
    assert final.output_text == "On it."
    call = final.output[2]
    assert call.type == "function_call"
    assert (call.call_id, call.name, orjson.loads(call.arguments)) == ("toolu_1", "f", {"x": 1})
    assert final.usage is not None and final.usage.output_tokens == 12
    sent = upstream.requests[0].body
    assert upstream.requests[0].path == "/v1/messages"
    assert sent["messages"] == [{"role": "user", "content": [{"type": "text", "text": TEXT}]}]
    assert sent["tools"][0]["name"] == "f"


async def test_upstream_failure_mid_stream_through_an_openai_upstream(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(Reply.stream([openai_chunk(content="part")], end="abort"))
    config = {"providers": {"up": {"kind": "openai", "base_url": upstream.url + "/v1"}}}
    async with (
        await sdk(make_client, config) as api,
        api.responses.stream(model="up/m", input=TEXT) as stream,
    ):
        events = [event async for event in stream]
        with pytest.raises(RuntimeError, match=r"response\.completed"):
            await stream.get_final_response()
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "part"
    error, failed = events[-2:]
    assert (error.type, error.code) == ("error", "upstream_disconnect")
    assert failed.type == "response.failed"


async def test_an_upstreams_refusal_names_the_responses_field(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """An upstream's ``context_length_exceeded`` on ``messages`` named the chat field, which
    a Responses client never sent: it is ``input`` there."""
    refusal = {
        "error": {
            "message": "This model's maximum context length is 128000 tokens.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    upstream.add(Reply.json(400, refusal), Reply.json(400, refusal))
    config = {"providers": {"up": {"kind": "openai", "base_url": upstream.url + "/v1"}}}
    async with await sdk(make_client, config) as api:
        with pytest.raises(openai.BadRequestError) as refused:
            await api.responses.create(model="up/m", input=TEXT)
        assert (refused.value.param, refused.value.code) == ("input", "context_length_exceeded")
        assert "maximum context length" in refused.value.message
        with pytest.raises(openai.BadRequestError) as refused:
            async with api.responses.stream(model="up/m", input=TEXT) as stream:
                async for _ in stream:
                    pass
        assert refused.value.param == "input"
