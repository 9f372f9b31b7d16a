"""The ``anthropic`` kind against a fake Anthropic Messages API speaking its wire format."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from typing import Any

import orjson
import pytest

import nexus
from nexus import Engine, accumulate
from nexus.config import parse_config
from nexus.errors import InvalidRequest, UpstreamOverloaded
from nexus.events import Delta, Reasoning, ToolCall, Usage
from nexus.pricing import spend_of, tally, worst_cost
from nexus.protocol.anthropic_events import EventDecoder, messages_body, refusal
from nexus.protocol.openai_request import upstream_body
from nexus.request import ChatRequest
from support import MakeClient, parse_sse
from upstreams import FakeUpstream, Reply, sse

KEY_ENV = "NEXUS_TEST_ANTHROPIC_KEY"
KEY = "sk-ant-test-0123456789-secret"


@pytest.fixture(autouse=True)
def secret(monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    monkeypatch.setenv(KEY_ENV, KEY)
    yield
    assert all(KEY not in record.getMessage() for record in caplog.records)


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


def config(fake: FakeUpstream, **options: Any) -> dict[str, Any]:
    return {
        "providers": {
            "claude": {"kind": "anthropic", "base_url": fake.url, "api_key_env": KEY_ENV, **options}
        }
    }


def event(name: str, **fields: Any) -> bytes:
    return sse({"type": name, **fields}, event=name)


def message_start(input_tokens: int = 10, cache_read: int = 0, cache_write: int = 0) -> bytes:
    usage = {
        "input_tokens": input_tokens,
        "output_tokens": 1,
        "cache_read_input_tokens": cache_read,
        "cache_creation_input_tokens": cache_write,
    }
    message = {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "claude-opus-4.5",
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage,
    }
    return event("message_start", message=message)


def text_block(index: int, *parts: str) -> list[bytes]:
    frames = [event("content_block_start", index=index, content_block={"type": "text", "text": ""})]
    frames += [
        event("content_block_delta", index=index, delta={"type": "text_delta", "text": p})
        for p in parts
    ]
    frames.append(event("content_block_stop", index=index))
    return frames


def tool_block(index: int, tool_id: str, name: str, *partial: str) -> list[bytes]:
    block = {"type": "tool_use", "id": tool_id, "name": name, "input": {}}
    frames = [event("content_block_start", index=index, content_block=block)]
    frames += [
        event(
            "content_block_delta",
            index=index,
            delta={"type": "input_json_delta", "partial_json": p},
        )
        for p in partial
    ]
    frames.append(event("content_block_stop", index=index))
    return frames


def finish(stop_reason: str, output_tokens: int) -> list[bytes]:
    return [
        event(
            "message_delta",
            delta={"stop_reason": stop_reason, "stop_sequence": None},
            usage={"output_tokens": output_tokens},
        ),
        event("message_stop"),
    ]


def chat(**extra: Any) -> dict[str, Any]:
    return {
        "model": "claude/claude-opus-4.5",
        "messages": [{"role": "user", "content": "Hi"}],
        **extra,
    }


async def test_text_thinking_and_usage(make_client: MakeClient, upstream: FakeUpstream) -> None:
    thinking = [
        event(
            "content_block_start",
            index=0,
            content_block={"type": "thinking", "thinking": "", "signature": ""},
        ),
        event("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "Hmm"}),
        event("content_block_delta", index=0, delta={"type": "signature_delta", "signature": "s"}),
        event("content_block_stop", index=0),
        event("ping"),
    ]
    frames = [
        message_start(10, cache_read=5, cache_write=2),
        *thinking,
        *text_block(1, "Hel", "lo"),
        *finish("end_turn", 42),
    ]
    upstream.add(Reply.stream(frames, delay=0.005))
    client = await make_client(config(upstream))
    resp = await client.post(
        "/v1/chat/completions?stream_format=ndjson",
        json=chat(stream=True),
    )
    lines = [orjson.loads(line) for line in (await resp.read()).splitlines()]
    assert lines == [
        # message_start's input counts, ahead of the first output and marked partial
        {
            "type": "usage",
            "usage": {
                "prompt_tokens": 17,
                "completion_tokens": 0,
                "total_tokens": 17,
                "prompt_tokens_details": {"cached_tokens": 5, "cache_write_tokens": 2},
            },
            "partial": True,
        },
        {"type": "reasoning", "delta": {"reasoning": "Hmm"}},
        {"type": "reasoning", "delta": {"reasoning": "", "signature": "s"}},
        {"type": "delta", "delta": {"content": "Hel"}},
        {"type": "delta", "delta": {"content": "lo"}},
        {"type": "delta", "delta": {}, "finish_reason": "stop"},
        {
            "type": "usage",
            "usage": {
                "prompt_tokens": 17,
                "completion_tokens": 42,
                "total_tokens": 59,
                "prompt_tokens_details": {"cached_tokens": 5, "cache_write_tokens": 2},
            },
        },
        {"type": "done"},
    ]
    seen = upstream.requests[0]
    assert seen.path == "/v1/messages"
    assert seen.headers["x-api-key"] == KEY
    assert seen.headers["anthropic-version"] == "2023-06-01"
    assert seen.headers["User-Agent"] == f"nexus/{nexus.__version__}"
    assert "Authorization" not in seen.headers


async def test_tool_calls_fragmented(make_client: MakeClient, upstream: FakeUpstream) -> None:
    frames = [
        message_start(),
        *text_block(0, "Let me check."),
        *tool_block(1, "toolu_a", "get_weather", '{"city": ', '"Paris"}'),
        *tool_block(2, "toolu_b", "get_time", '{"zone"', ': "UTC"}'),
        *finish("tool_use", 30),
    ]
    upstream.add(Reply.stream(frames))
    client = await make_client(config(upstream))
    body = (await (await client.post("/v1/chat/completions", json=chat())).json())["choices"][0]
    assert body["finish_reason"] == "tool_calls"
    assert body["message"]["content"] == "Let me check."
    calls = body["message"]["tool_calls"]
    assert [(c["id"], c["function"]["name"]) for c in calls] == [
        ("toolu_a", "get_weather"),
        ("toolu_b", "get_time"),
    ]
    assert orjson.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    assert orjson.loads(calls[1]["function"]["arguments"]) == {"zone": "UTC"}


@pytest.mark.parametrize(
    ("stop_reason", "finish_reason"),
    [
        ("end_turn", "stop"),
        ("stop_sequence", "stop"),
        ("max_tokens", "length"),
        ("tool_use", "tool_calls"),
        ("refusal", "content_filter"),
    ],
)
async def test_stop_reasons(upstream: FakeUpstream, stop_reason: str, finish_reason: str) -> None:
    upstream.add(Reply.stream([message_start(), *text_block(0, "x"), *finish(stop_reason, 1)]))
    async with Engine.from_config(parse_config(config(upstream))) as engine:
        completion = await accumulate(engine.complete_stream(chat()))
    assert completion.finish_reason == finish_reason


@pytest.mark.parametrize(
    ("stop_reason", "finish_reason"),
    [("model_context_window_exceeded", "length"), ("pause_turn", "stop")],
)
async def test_anthropic_stop_reasons_ours_say_less_than_reach_anthropic_clients(
    make_client: MakeClient, upstream: FakeUpstream, stop_reason: str, finish_reason: str
) -> None:
    """A full context window is OpenAI's `length`, but an Anthropic client told
    `max_tokens` would raise max_tokens and go on, where it must compact: /v1/messages,
    streamed or not, says what Anthropic said; chat says `length`."""
    for _ in range(3):
        upstream.add(Reply.stream([message_start(), *text_block(0, "x"), *finish(stop_reason, 1)]))
    client = await make_client(config(upstream))
    body = {"model": "claude/claude-opus-4.5", "max_tokens": 10}
    body["messages"] = [{"role": "user", "content": "Hi"}]  # type: ignore[assignment]
    answer = await (await client.post("/v1/messages", json=body)).json()
    assert answer["stop_reason"] == stop_reason
    streamed = await (await client.post("/v1/messages", json={**body, "stream": True})).read()
    (delta,) = [e for e in parse_sse(streamed) if e.event == "message_delta"]
    assert orjson.loads(delta.data)["delta"]["stop_reason"] == stop_reason
    chat_answer = await (await client.post("/v1/chat/completions", json=chat())).json()
    assert chat_answer["choices"][0]["finish_reason"] == finish_reason


async def test_stop_sequence_names_the_sequence(upstream: FakeUpstream) -> None:
    stop = event(
        "message_delta",
        delta={"stop_reason": "stop_sequence", "stop_sequence": "three"},
        usage={"output_tokens": 1},
    )
    upstream.add(Reply.stream([message_start(), *text_block(0, "x"), stop, event("message_stop")]))
    async with Engine.from_config(parse_config(config(upstream))) as engine:
        completion = await accumulate(engine.complete_stream(chat()))
    assert (completion.finish_reason, completion.stop_sequence) == ("stop", "three")


async def test_citations(upstream: FakeUpstream) -> None:
    citation = {
        "type": "web_search_result_location",
        "url": "https://example.com/a",
        "title": "A",
        "cited_text": "quoted words",
    }
    frames = [
        message_start(),
        *text_block(0, "Fact."),
        event(
            "content_block_delta",
            index=0,
            delta={"type": "citations_delta", "citation": citation},
        ),
        *finish("end_turn", 2),
    ]
    upstream.add(Reply.stream(frames))
    async with Engine.from_config(parse_config(config(upstream))) as engine:
        completion = await accumulate(engine.complete_stream(chat()))
    [cited] = completion.citations
    assert (cited.url, cited.title, cited.quoted) == ("https://example.com/a", "A", "quoted words")


def test_request_translation() -> None:
    request = ChatRequest.model_validate(
        {
            "model": "claude/x",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "developer", "content": [{"type": "text", "text": "Use tools."}]},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is in this image?"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBO"}},
                        {"type": "image_url", "image_url": {"url": "https://e.com/cat.jpg"}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": "call_1",
                            "type": "function",
                            "function": {"name": "lookup", "arguments": '{"q": "cat"}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": "call_1", "content": "a cat"},
                {"role": "user", "content": "Thanks"},
            ],
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "lookup",
                        "description": "Look up",
                        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}},
                    },
                }
            ],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "stop": ["END"],
            "temperature": 0.7,
            "top_p": 0.9,
            "user": "u-1",
            "max_completion_tokens": 300,
        }
    )
    body = messages_body(request, "claude-opus-4.5", 4096)
    assert body["model"] == "claude-opus-4.5"
    assert body["system"] == "Be brief.\n\nUse tools."
    assert body["max_tokens"] == 300
    assert body["stream"] is True
    assert body["stop_sequences"] == ["END"]
    assert body["temperature"] == 0.7
    assert body["top_p"] == 0.9
    assert body["metadata"] == {"user_id": "u-1"}
    assert body["tools"] == [
        {
            "name": "lookup",
            "description": "Look up",
            "input_schema": {"type": "object", "properties": {"q": {"type": "string"}}},
        }
    ]
    assert body["tool_choice"] == {"type": "any", "disable_parallel_tool_use": True}
    assert body["messages"] == [
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "What is in this image?"},
                {
                    "type": "image",
                    "source": {"type": "base64", "media_type": "image/png", "data": "iVBO"},
                },
                {"type": "image", "source": {"type": "url", "url": "https://e.com/cat.jpg"}},
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "tool_use", "id": "call_1", "name": "lookup", "input": {"q": "cat"}}
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "call_1", "content": "a cat"},
                {"type": "text", "text": "Thanks"},
            ],
        },
    ]


def test_default_max_tokens_and_named_tool_choice() -> None:
    request = ChatRequest.model_validate(
        {
            **chat(),
            "tools": [{"type": "function", "function": {"name": "f"}}],
            "tool_choice": {"type": "function", "function": {"name": "f"}},
        }
    )
    body = messages_body(request, "m", 1234)
    assert body["max_tokens"] == 1234
    assert body["tool_choice"] == {"type": "tool", "name": "f"}
    assert body["tools"][0]["input_schema"] == {"type": "object", "properties": {}}


SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
    "additionalProperties": False,
}


def test_a_json_schema_response_format_is_anthropics_output_format() -> None:
    """Anthropic's structured outputs (``output_config.format``, the anthropic SDK's
    ``JSONOutputFormatParam``): the schema as sent; name and strict have no place there."""
    json_schema = {"name": "weather", "strict": True, "schema": SCHEMA}
    request = ChatRequest.model_validate(
        chat(response_format={"type": "json_schema", "json_schema": json_schema})
    )
    body = messages_body(request, "m", 100)
    assert body["output_config"] == {"format": {"type": "json_schema", "schema": SCHEMA}}
    plain = ChatRequest.model_validate(chat(response_format={"type": "text"}))
    assert "output_config" not in messages_body(plain, "m", 100)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"response_format": {"type": "json_object"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "n"}}},
            "response_format",
        ),
        ({"logit_bias": {"50256": -100}}, "logit_bias"),
        ({"functions": [{"name": "f", "parameters": {}}]}, "functions"),
        ({"modalities": ["text", "audio"]}, "modalities"),
        ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        ({"web_search_options": {}}, "web_search_options"),
        # A field Nexus does not know (OpenAI's newer ones): it went nowhere, unseen.
        ({"moderation": {"output": "block"}}, "moderation"),
        ({"prompt_cache_retention": "24h"}, "prompt_cache_retention"),
        # A tier Anthropic does not offer went as sent, and Anthropic refused it.
        ({"service_tier": "flex"}, "service_tier"),
        # Past Anthropic's range of 0 to 1: it was cut to 1, another answer than asked.
        ({"temperature": 1.5}, "temperature"),
    ],
)
def test_fields_the_messages_api_cannot_carry_are_refused(
    extra: dict[str, Any], param: str
) -> None:
    request = ChatRequest.model_validate(chat(**extra))
    error = refusal(request)
    assert error is not None
    assert (error.code, error.param, error.status) == ("invalid_request", param, 400)
    assert error.message.startswith(f"{param}: ")
    assert "cannot honour" in error.message
    with pytest.raises(InvalidRequest):  # nor can the provider be called with it
        messages_body(request, "m", 100)


def test_fields_that_only_tune_sampling_are_dropped() -> None:
    request = ChatRequest.model_validate(
        chat(
            seed=7,
            presence_penalty=0.5,
            frequency_penalty=0.5,
            logit_bias={},
            modalities=["text"],
            response_format={"type": "text"},
            prediction={"type": "content", "content": "x"},
        )
    )
    assert refusal(request) is None
    body = messages_body(request, "m", 100)
    assert set(body) == {"model", "messages", "max_tokens", "stream"}


async def test_max_tokens_zero_goes_upstream_to_warm_the_prompt_cache(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """``max_tokens: 0`` populates Anthropic's prompt cache without an answer (its SDK's
    documented way to warm it): it was answered here, empty, with no upstream call, so
    the cache was never warmed; and from ``/v1/messages`` it was refused."""
    warmed = [
        sse(
            {
                "type": "message_start",
                "message": {"usage": {"input_tokens": 3, "cache_creation_input_tokens": 900}},
            },
            event="message_start",
        ),
        sse(
            {
                "type": "message_delta",
                "delta": {"stop_reason": "max_tokens"},
                "usage": {"output_tokens": 0},
            },
            event="message_delta",
        ),
        sse({"type": "message_stop"}, event="message_stop"),
    ]
    upstream.add(Reply.stream(warmed))
    upstream.add(Reply.stream(warmed))
    client = await make_client(config(upstream))
    body = await (await client.post("/v1/chat/completions", json=chat(max_tokens=0))).json()
    assert body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["message"]["content"] == ""
    assert upstream.requests[-1].body["max_tokens"] == 0
    assert body["usage"]["prompt_tokens"] == 903
    messages = {
        "model": "claude/m",
        "max_tokens": 0,
        "messages": [{"role": "user", "content": "x"}],
    }
    answer = await client.post("/v1/messages", json=messages)
    assert answer.status == 200 and (await answer.json())["stop_reason"] == "max_tokens"
    assert upstream.requests[-1].body["max_tokens"] == 0


async def test_audio_input_is_refused(make_client: MakeClient, upstream: FakeUpstream) -> None:
    client = await make_client(config(upstream))
    audio = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}
    resp = await client.post(
        "/v1/chat/completions", json=chat(messages=[{"role": "user", "content": [audio]}])
    )
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "unsupported_input"
    assert upstream.requests == []


async def test_error_event_mid_stream(make_client: MakeClient, upstream: FakeUpstream) -> None:
    overloaded = {"type": "overloaded_error", "message": "Overloaded"}
    frames = [message_start(), *text_block(0, "par"), event("error", error=overloaded)]
    upstream.add(Reply.stream(frames))
    client = await make_client(config(upstream))
    events = parse_sse(
        await (await client.post("/v1/chat/completions", json=chat(stream=True))).read()
    )
    assert events[-2].event == "error"
    error = orjson.loads(events[-2].data)["error"]
    assert error["type"] == "overloaded_error"
    assert "Overloaded" in error["message"]
    assert events[-1].data == "[DONE]"


async def test_a_read_is_one_batch_and_an_error_keeps_the_events_before_it(
    upstream: FakeUpstream,
) -> None:
    # The whole body in one write: its events come as one batch, as for OpenAI-kind
    # upstreams; the error event in the same read ends the stream after them.
    overloaded = {"type": "overloaded_error", "message": "Overloaded"}
    body = b"".join([message_start(), *text_block(0, "a", "b", "c"), event("ping")])
    body += event("error", error=overloaded)
    upstream.add(Reply.stream([body]))
    async with Engine.from_config(parse_config(config(upstream))) as engine:
        stream = engine.complete_stream(chat())
        batches = []
        while batch := await stream.read_batch():
            batches.append(batch)
    early = Usage(10, 0, 10, cached_tokens=0, cache_write_tokens=0, partial=True)
    assert batches[0] == [early, Delta("a"), Delta("b"), Delta("c")]
    assert len(batches) == 2 and batches[1][0].type == "error"
    assert batches[1][0].error_type == "overloaded_error"  # type: ignore[union-attr]


def test_the_decoder_reads_up_to_message_stop() -> None:
    decoder = EventDecoder("claude")
    assert decoder.response_model is None
    out = decoder.decode(
        b"".join([message_start(), *text_block(0, "hi"), *finish("end_turn", 3), event("ping")])
    )
    assert decoder.error is None and decoder.done
    assert decoder.response_model == "claude-opus-4.5"  # message_start's, for the span
    assert out == [
        Usage(10, 0, 10, cached_tokens=0, cache_write_tokens=0, partial=True),
        Delta("hi"),
        Delta(finish_reason="stop"),
        Usage(10, 3, 13, cached_tokens=0, cache_write_tokens=0),
    ]


def test_the_usage_goes_out_with_the_stop_so_a_cut_after_it_is_charged_what_was_billed() -> None:
    """message_delta's counts are the turn's totals: they go out with its stop reason, and
    a stream cut before message_stop is charged them (9,000 output tokens of summarised
    thinking were charged 2, estimated), with the thinking among them as reasoning."""
    decoder = EventDecoder("claude")
    delta = event(
        "message_delta",
        delta={"stop_reason": "end_turn", "stop_sequence": None},
        usage={"output_tokens": 9000, "output_tokens_details": {"thinking_tokens": 8990}},
    )
    out = decoder.decode(b"".join([message_start(1000), *text_block(0, "Hi"), delta]))
    assert not decoder.done
    usage = Usage(1000, 9000, 10000, cached_tokens=0, cache_write_tokens=0, reasoning_tokens=8990)
    assert out[-2:] == [Delta(finish_reason="stop"), usage]
    spend = spend_of(tally(out, complete=False), None, complete=False)
    assert (spend.completion_tokens, spend.reasoning_tokens, spend.estimated) == (9000, 8990, False)
    assert decoder.decode(event("message_stop")) == [] and decoder.done  # not twice
    # Counts that move after the stop (a later message_delta) go out at message_stop.
    decoder = EventDecoder("claude")
    decoder.decode(b"".join([message_start(1000), *text_block(0, "Hi"), delta]))
    later = event("message_delta", delta={}, usage={"output_tokens": 9100})
    assert decoder.decode(later + event("message_stop"))[-1].completion_tokens == 9100  # type: ignore[union-attr]


def test_the_decoder_reads_redacted_thinking_and_tools_without_input() -> None:
    """A redacted_thinking block is reasoning of its own, its data kept; a tool_use block
    that closes with no input (a tool without arguments) has the arguments ``{}``."""
    redacted = {"type": "redacted_thinking", "data": "QkxPQg=="}
    decoder = EventDecoder("claude")
    out = decoder.decode(
        b"".join(
            [
                event("content_block_start", index=0, content_block=redacted),
                event("content_block_stop", index=0),
                *tool_block(1, "toolu_1", "now", ""),
                *tool_block(2, "toolu_2", "at", '{"tz":', '"UTC"}'),
            ]
        )
    )
    assert out == [
        Reasoning("", redacted="QkxPQg=="),
        ToolCall(0, "toolu_1", "now"),
        ToolCall(0, arguments="{}"),
        ToolCall(1, "toolu_2", "at"),
        ToolCall(1, arguments='{"tz":'),
        ToolCall(1, arguments='"UTC"}'),
    ]
    assert decoder.error is None
    decoder.decode(event("content_block_stop", index=[1]))
    assert decoder.error is not None and "index" in decoder.error.message


def test_early_input_counts_wait_for_the_first_output() -> None:
    """message_start's counts lead the first batch with output, never a batch of their
    own: a failure before any output stays a failure before the stream's first event
    (an HTTP status, or the next target)."""
    decoder = EventDecoder("claude")
    assert decoder.decode(message_start(41, 7, 3) + event("ping")) == []
    overloaded = {"type": "overloaded_error", "message": "Overloaded"}
    assert decoder.decode(event("error", error=overloaded)) == []
    assert isinstance(decoder.error, UpstreamOverloaded)
    assert decoder.error.error_type == "overloaded_error" and decoder.error.retryable
    decoder = EventDecoder("claude")
    assert decoder.decode(message_start(41, 7, 3)) == []
    assert decoder.decode(b"".join(text_block(0, "hi"))) == [
        Usage(51, 0, 51, cached_tokens=7, cache_write_tokens=3, partial=True),
        Delta("hi"),
    ]
    assert decoder.decode(b"".join(text_block(1, "more"))) == [Delta("more")]
    assert decoder.decode(message_start(99)) == [] and decoder.error is None


def test_data_that_is_not_json_is_a_protocol_error() -> None:
    decoder = EventDecoder("claude")
    out = decoder.decode(b"".join(text_block(0, "hi")) + b"event: ping\ndata: {oops\n\n")
    assert out == [Delta("hi")]
    assert decoder.error is not None and decoder.error.code == "upstream_protocol_error"


async def test_end_without_message_stop_is_an_error(upstream: FakeUpstream) -> None:
    upstream.add(Reply.stream([message_start(), *text_block(0, "cut")]))
    async with Engine.from_config(parse_config(config(upstream))) as engine:
        events = [e async for e in engine.complete_stream(chat())]
    assert events[-1].type == "error"
    assert events[-1].code == "upstream_disconnect"  # type: ignore[union-attr]


@pytest.mark.parametrize(
    ("status", "error_type", "expected_status", "code"),
    [
        (400, "invalid_request_error", 400, "upstream_invalid_request"),
        (401, "authentication_error", 502, "upstream_auth_error"),
        (429, "rate_limit_error", 429, "upstream_rate_limited"),
        (529, "overloaded_error", 502, "upstream_error"),
    ],
)
async def test_http_errors_in_anthropic_shape(
    make_client: MakeClient,
    upstream: FakeUpstream,
    status: int,
    error_type: str,
    expected_status: int,
    code: str,
) -> None:
    body = {"type": "error", "error": {"type": error_type, "message": "upstream says no"}}
    upstream.add(Reply.json(status, body, headers={"Retry-After": "7"}))
    client = await make_client(config(upstream))
    resp = await client.post("/v1/chat/completions", json=chat(stream=True))
    assert resp.status == expected_status
    error = (await resp.json())["error"]
    assert error["code"] == code
    if status == 429:
        assert resp.headers["Retry-After"] == "7"
    if status == 401:
        assert "upstream says no" not in error["message"]
    elif status == 400:
        assert "upstream says no" in error["message"]


@pytest.mark.parametrize(
    ("status", "error_type", "expected_status"),
    [(529, "overloaded_error", 529), (402, "billing_error", 502), (500, "api_error", 502)],
)
async def test_an_anthropic_http_error_keeps_its_type_for_anthropic_clients(
    make_client: MakeClient,
    upstream: FakeUpstream,
    status: int,
    error_type: str,
    expected_status: int,
) -> None:
    """A 529's overloaded_error (a client backs off) and a 402's billing_error (it stops)
    reach /v1/messages as Anthropic sent them, as they did from inside the stream; they
    came out as api_error. An overload is a 529 there, as Anthropic answers it (a 502 on
    the other endpoints)."""
    body = {"type": "error", "error": {"type": error_type, "message": "no"}, "request_id": "r"}
    for _ in range(2):
        upstream.add(Reply.json(status, body))
    client = await make_client(config(upstream))
    messages = {"model": "claude/claude-opus-4.5", "max_tokens": 10}
    messages["messages"] = [{"role": "user", "content": "Hi"}]  # type: ignore[assignment]
    for stream in (False, True):
        resp = await client.post("/v1/messages", json={**messages, "stream": stream})
        assert (await resp.json())["error"]["type"] == error_type
        assert resp.status == expected_status  # 529: the SDK's OverloadedError


async def test_client_going_away_closes_the_upstream(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(Reply.stream([message_start(), *text_block(0, "slow")], end="stall"))
    client = await make_client({**config(upstream), "streams": {"detach_timeout_s": 0}})
    resp = await client.post("/v1/chat/completions?stream_format=ndjson", json=chat(stream=True))
    first = orjson.loads(await asyncio.wait_for(resp.content.readline(), 5))
    assert (first["type"], first["partial"]) == ("usage", True)
    assert orjson.loads(await asyncio.wait_for(resp.content.readline(), 5))["type"] == "delta"
    gone = asyncio.get_running_loop().time()
    resp.close()
    ended = await upstream.requests[0].wait_ended(5)
    assert ended - gone < 0.1


async def test_thinking_signature_reaches_anthropic_clients(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """/v1/messages over an Anthropic upstream keeps the thinking block's signature."""
    block = {"type": "thinking", "thinking": "", "signature": ""}
    frames = [
        message_start(),
        event("content_block_start", index=0, content_block=block),
        event("content_block_delta", index=0, delta={"type": "thinking_delta", "thinking": "Hm"}),
        event(
            "content_block_delta", index=0, delta={"type": "signature_delta", "signature": "sig=="}
        ),
        event("content_block_stop", index=0),
        *text_block(1, "Yes"),
        *finish("end_turn", 3),
    ]
    upstream.add(Reply.stream(frames), Reply.stream(frames))
    client = await make_client(config(upstream))
    body = {"model": "claude/x", "max_tokens": 50, "messages": [{"role": "user", "content": "Q"}]}
    streamed = parse_sse(
        await (await client.post("/v1/messages", json={**body, "stream": True})).read()
    )
    deltas = [orjson.loads(e.data)["delta"] for e in streamed if e.event == "content_block_delta"]
    assert deltas[:2] == [
        {"type": "thinking_delta", "thinking": "Hm"},
        {"type": "signature_delta", "signature": "sig=="},
    ]
    message = await (await client.post("/v1/messages", json=body)).json()
    assert message["content"][0] == {"type": "thinking", "thinking": "Hm", "signature": "sig=="}


async def test_prompt_caching_passes_through(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """cache_control marks reach an Anthropic upstream; cache reads and writes come back apart."""
    frames = [
        message_start(3, cache_read=100, cache_write=50),
        *text_block(0, "ok"),
        *finish("end_turn", 2),
    ]
    upstream.add(Reply.stream(frames))
    client = await make_client(config(upstream))
    ephemeral = {"type": "ephemeral"}
    body = {
        "model": "claude/x",
        "max_tokens": 20,
        "system": [{"type": "text", "text": "Long manual.", "cache_control": ephemeral}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": ephemeral}],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Q", "cache_control": ephemeral}],
            }
        ],
    }
    message = await (await client.post("/v1/messages", json=body)).json()
    assert message["usage"] == {
        "input_tokens": 3,
        "output_tokens": 2,
        "cache_read_input_tokens": 100,
        "cache_creation_input_tokens": 50,
        "cache_creation": {"ephemeral_5m_input_tokens": 50, "ephemeral_1h_input_tokens": 0},
    }
    sent = upstream.requests[0].body
    assert sent["system"] == [{"type": "text", "text": "Long manual.", "cache_control": ephemeral}]
    assert sent["tools"][0]["cache_control"] == ephemeral
    assert sent["messages"][0]["content"] == [
        {"type": "text", "text": "Q", "cache_control": ephemeral}
    ]


async def test_signed_thinking_goes_back_with_its_turn(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """Extended thinking with tool use: the assistant's thinking block returns to Anthropic."""
    upstream.add(Reply.stream([message_start(), *text_block(0, "Done"), *finish("end_turn", 1)]))
    client = await make_client(config(upstream))
    thinking = {"type": "thinking", "thinking": "Need the weather.", "signature": "sig=="}
    body = {
        "model": "claude/x",
        "max_tokens": 50,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": [
                    thinking,
                    {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": "R"}},
                ],
            },
            {
                "role": "user",
                "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "sun"}],
            },
        ],
    }
    assert (await client.post("/v1/messages", json=body)).status == 200
    sent = upstream.requests[0].body
    assert sent["thinking"] == {"type": "enabled", "budget_tokens": 1024}
    assert sent["messages"][1] == {
        "role": "assistant",
        "content": [
            thinking,
            {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"c": "R"}},
        ],
    }


def test_a_pdf_or_text_file_is_a_document_and_a_file_it_cannot_take_is_refused() -> None:
    """A file part went nowhere: Anthropic got the text beside it alone (or no content at
    all), and answered about a PDF it never saw."""
    import base64

    pdf = base64.b64encode(b"%PDF-1.7 ...").decode()
    text = base64.b64encode("notes: é".encode()).decode()
    parts = [
        {"type": "text", "text": "summarise"},
        {"type": "file", "file": {"file_data": f"data:application/pdf;base64,{pdf}"}},
        {
            "type": "file",
            "file": {"file_data": f"data:text/plain;base64,{text}", "filename": "notes.txt"},
        },
    ]
    request = ChatRequest.model_validate(chat(messages=[{"role": "user", "content": parts}]))
    assert refusal(request) is None
    (turn,) = messages_body(request, "m", 100)["messages"]
    assert turn["content"][1:] == [
        {
            "type": "document",
            "source": {"type": "base64", "media_type": "application/pdf", "data": pdf},
        },
        {
            "type": "document",
            "source": {"type": "text", "media_type": "text/plain", "data": "notes: é"},
            "title": "notes.txt",
        },
    ]
    for file, why in [
        ({"file_id": "file-abc"}, "file_id"),
        ({"file_data": "data:application/zip;base64,UEsDBA=="}, "application/zip"),
        ({"file_data": "data:application/pdf;base64,not base64!"}, "not valid base64"),
        ({"file_data": "JVBERi0x"}, "data: URL"),
    ]:
        content = [{"type": "text", "text": "x"}, {"type": "file", "file": file}]
        request = ChatRequest.model_validate(chat(messages=[{"role": "user", "content": content}]))
        error = refusal(request)
        assert error is not None and error.param == "messages[0].content[1].file"
        assert why in error.message and "cannot take" in error.message


def test_a_strict_tool_stays_strict_both_ways() -> None:
    """Strict tool use (the input held to its schema) was dropped on the way to Anthropic,
    and on the way from /v1/messages to any provider."""
    from nexus.protocol.anthropic_messages import parse_messages_request

    schema = {"type": "object", "properties": {}, "additionalProperties": False}
    tool = {"type": "function", "function": {"name": "f", "parameters": schema, "strict": True}}
    request = ChatRequest.model_validate(chat(tools=[tool]))
    (sent,) = messages_body(request, "m", 100)["tools"]
    assert sent["strict"] is True
    anthropic_tool = {"name": "f", "input_schema": schema, "strict": True}
    body = {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "x"}]}
    parsed = parse_messages_request(orjson.dumps({**body, "tools": [anthropic_tool]}))
    assert parsed.tools is not None and parsed.tools[0].function.strict is True
    (again,) = messages_body(parsed, "m", 100)["tools"]
    assert again["strict"] is True


def test_service_tiers_are_told_in_each_provider_s_words() -> None:
    """OpenAI's standard tier is ``default``, Anthropic's ``standard_only``: each went as
    sent to the other, which refused it."""
    request = ChatRequest.model_validate(chat(service_tier="default"))
    assert refusal(request) is None
    assert messages_body(request, "m", 100)["service_tier"] == "standard_only"
    standard = ChatRequest.model_validate(chat(service_tier="standard_only"))
    assert upstream_body(standard, "gpt")["service_tier"] == "default"
    auto = ChatRequest.model_validate(chat(service_tier="auto"))
    assert messages_body(auto, "m", 100)["service_tier"] == "auto"
    assert upstream_body(auto, "gpt")["service_tier"] == "auto"


def test_blocks_a_compatible_server_sends_whole_at_their_start_are_read() -> None:
    """Anthropic-compatible servers may put a tool's whole input, or a thinking block's
    text and signature, in its ``content_block_start`` and send no delta: the input came
    out as ``{}`` and the thinking not at all."""
    decoder = EventDecoder("claude")
    tool = {"type": "tool_use", "id": "toolu_1", "name": "get", "input": {"city": "Oslo"}}
    thinking = {"type": "thinking", "thinking": "hm", "signature": "SIG"}
    frames = [
        message_start(),
        event("content_block_start", index=0, content_block=thinking),
        event("content_block_stop", index=0),
        event("content_block_start", index=1, content_block=tool),
        event("content_block_stop", index=1),
        *finish("tool_use", 3),
    ]
    out = [e for e in decoder.decode(b"".join(frames)) if not isinstance(e, Usage)]
    assert out == [
        Reasoning("hm"),
        Reasoning("", signature="SIG"),
        ToolCall(0, "toolu_1", "get"),
        ToolCall(0, arguments='{"city":"Oslo"}'),
        Delta(finish_reason="tool_calls"),
    ]


def test_hour_long_cache_writes_are_charged_at_their_own_price() -> None:
    """Anthropic bills an hour's cache writes at 2x the input price, five minutes' at 1.25x;
    there was one write price: 100,000 hour-long writes cost $0.60 upstream and were
    charged $0.376, and three such requests spent $1.26 of a $1 budget (held at 1.25x)."""
    decoder = EventDecoder("claude")
    start = orjson.loads(message_start(100, cache_write=100_000).split(b"data: ", 1)[1])
    start["message"]["usage"]["cache_creation"] = {
        "ephemeral_5m_input_tokens": 40_000,
        "ephemeral_1h_input_tokens": 60_000,
    }
    frames = [sse(start, event="message_start"), *text_block(0, "ok"), *finish("end_turn", 50)]
    out = decoder.decode(b"".join(frames))
    usage = [e for e in out if isinstance(e, Usage) and not e.partial][-1]
    assert (usage.cache_write_tokens, usage.cache_write_1h_tokens) == (100_000, 60_000)
    price = nexus.pricing.Price(3.0, 15.0, 0.3, 3.75)
    spend = spend_of(tally(out, complete=True), price, complete=True)
    expected = (100 * 3.0 + 40_000 * 3.75 + 60_000 * 6.0 + 50 * 15.0) / 1e6
    assert spend.cost_usd == pytest.approx(expected)
    set_price = nexus.pricing.Price(3.0, 15.0, 0.3, 3.75, cache_write_1h_usd_per_mtok=5.0)
    spend = spend_of(tally(out, complete=True), set_price, complete=True)
    assert spend.cost_usd == pytest.approx(expected - 60_000 * 1.0 / 1e6)


def test_a_later_cache_creation_without_the_hours_count_keeps_it() -> None:
    """A compatible server's message_delta with a cache_creation of five minutes' writes
    alone reset the hour's count: its writes charged at the 5-minute price."""
    decoder = EventDecoder("claude")
    start = orjson.loads(message_start(100, cache_write=2000).split(b"data: ", 1)[1])
    start["message"]["usage"]["cache_creation"] = {
        "ephemeral_5m_input_tokens": 500,
        "ephemeral_1h_input_tokens": 1500,
    }
    delta = {"stop_reason": "end_turn", "stop_sequence": None}
    usage = {"output_tokens": 5, "cache_creation": {"ephemeral_5m_input_tokens": 500}}
    end = [event("message_delta", delta=delta, usage=usage), event("message_stop")]
    frames = [sse(start, event="message_start"), *text_block(0, "ok"), *end]
    out = decoder.decode(b"".join(frames))
    final = [e for e in out if isinstance(e, Usage) and not e.partial][-1]
    assert (final.cache_write_tokens, final.cache_write_1h_tokens) == (2000, 1500)


def test_a_request_asking_an_hours_cache_is_held_at_that_price() -> None:
    price = nexus.pricing.Price(3.0, 15.0, 0.3, 3.75)
    text = "word " * 4000
    plain = ChatRequest.model_validate(
        {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": text}]}
    )
    marked = {"type": "text", "text": text, "cache_control": {"type": "ephemeral", "ttl": "1h"}}
    long = ChatRequest.model_validate(
        {"model": "m", "max_tokens": 1, "messages": [{"role": "user", "content": [marked]}]}
    )
    assert worst_cost(long, [price]) / worst_cost(plain, [price]) == pytest.approx(
        6.0 / 3.75, rel=0.01
    )
