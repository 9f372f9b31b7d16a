"""The mock provider, through the engine: echo, parts, limits, scripts, failures, usage."""

from __future__ import annotations

import asyncio
import base64
from typing import Any

import orjson
import pytest

from nexus import Engine, MockProvider
from nexus.errors import GatewayError, InvalidRequest, UpstreamError
from nexus.events import Delta, Error, Reasoning, StreamEvent, ToolCall, Usage
from nexus.providers.mock import ARGUMENT_FRAGMENT, words
from nexus.stream import accumulate


@pytest.fixture
def engine() -> Engine:
    return Engine([MockProvider("mock")])


def chat(content: Any = "Hello there world", **extra: Any) -> dict[str, Any]:
    return {"model": "mock/echo", "messages": [{"role": "user", "content": content}], **extra}


async def collect(engine: Engine, body: dict[str, Any]) -> list[StreamEvent]:
    async with engine.complete_stream(body) as stream:
        return [e async for e in stream]


def contents(events: list[StreamEvent]) -> list[str]:
    return [e.content for e in events if isinstance(e, Delta) and e.content is not None]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


# --- echo --------------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    [
        "Hello there world",
        "  leading spaces",
        "trailing spaces   ",
        "line one\nline two\n",
        "\n\ttabs\tand\r\nCRLF \n",
        "   ",
        "\n",
        "one",
        "",
    ],
)
async def test_echo_streams_word_sized_deltas_that_join_to_the_text(
    engine: Engine, text: str
) -> None:
    events = await collect(engine, chat(text))
    pieces = contents(events)
    assert pieces == words(text)
    assert "".join(pieces) == text
    assert all(len(piece.split()) <= 1 for piece in pieces)
    assert events[len(pieces)] == Delta(finish_reason="stop")
    assert type(events[-1]) is Usage
    assert len(events) == len(pieces) + 2
    result = await accumulate(engine.complete_stream(chat(text)))
    assert result.content == text


def test_words_keeps_whitespace_before_each_word() -> None:
    assert words("Hello there  world\n") == ["Hello", " there", "  world\n"]
    assert words(" a") == [" a"]
    assert words("  ") == ["  "]
    assert words("") == []


async def test_echo_answers_the_last_user_message(engine: Engine) -> None:
    body = {
        "model": "mock/echo",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "first question"},
            {"role": "assistant", "content": "an answer"},
            {"role": "user", "content": "second question"},
            {"role": "assistant", "content": "prefill"},
        ],
    }
    result = await engine.complete(body)
    assert result.content == "second question"


async def test_echo_describes_content_parts(engine: Engine) -> None:
    png = b"\x89PNG\r\n\x1a\n\x00\x01"
    parts = [
        {"type": "text", "text": "look at"},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{b64(png)}"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/cat.jpg"}},
        {"type": "input_audio", "input_audio": {"data": b64(bytes(1234)), "format": "wav"}},
        {"type": "text", "text": "please"},
    ]
    result = await engine.complete(chat(parts))
    assert result.content == (
        "look at [image image/png 10 bytes] [image https://example.com/cat.jpg] "
        "[audio wav 1234 bytes] please"
    )


@pytest.mark.parametrize(
    ("part", "param"),
    [
        (
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@not-b64@@"}},
            "image_url.url",
        ),
        (
            {"type": "input_audio", "input_audio": {"data": "abc", "format": "wav"}},
            "input_audio.data",
        ),
    ],
)
async def test_bad_base64_raises_invalid_request(
    engine: Engine, part: dict[str, Any], param: str
) -> None:
    stream = engine.complete_stream(chat([{"type": "text", "text": "x"}, part]))
    with pytest.raises(InvalidRequest) as info:
        await stream.next()
    await stream.close()
    assert info.value.param == param
    assert info.value.status == 400


# --- limits and stop sequences -----------------------------------------------


async def test_max_tokens_stops_after_that_many_chunks(engine: Engine) -> None:
    events = await collect(engine, chat("one two three four", max_tokens=2))
    assert contents(events) == ["one", " two"]
    assert events[2] == Delta(finish_reason="length")
    assert events[3] == Usage(prompt_tokens=4, completion_tokens=2, total_tokens=6)
    assert len(events) == 4


async def test_max_tokens_zero_gives_no_content(engine: Engine) -> None:
    events = await collect(engine, chat("one two", max_tokens=0))
    assert contents(events) == []
    assert events[0] == Delta(finish_reason="length")


async def test_max_completion_tokens_wins_over_max_tokens(engine: Engine) -> None:
    events = await collect(engine, chat("a b c d e", max_tokens=1, max_completion_tokens=3))
    assert contents(events) == ["a", " b", " c"]
    assert events[3] == Delta(finish_reason="length")


async def test_max_tokens_at_or_above_the_length_finishes_with_stop(engine: Engine) -> None:
    result = await engine.complete(chat("a b c", max_tokens=3))
    assert (result.content, result.finish_reason) == ("a b c", "stop")


@pytest.mark.parametrize(
    ("stop", "expected", "matched"),
    [
        ("world", "hello ", "world"),
        (["zzz", "lo w"], "hel", "lo w"),
        (["ll", "world"], "he", "ll"),
        (["world", "ll"], "he", "ll"),
        (["world", "o w"], "hell", "o w"),
        (["o w", "world"], "hell", "o w"),
        (["absent"], "hello world", None),
    ],
)
async def test_stop_cuts_before_the_earliest_stop_sequence(
    engine: Engine, stop: str | list[str], expected: str, matched: str | None
) -> None:
    """The finishing delta names the sequence it stopped on (``/v1/messages`` reports it)."""
    result = await engine.complete(chat("hello world", stop=stop))
    assert result.content == expected
    assert (result.finish_reason, result.stop_sequence) == ("stop", matched)


# --- scripts -----------------------------------------------------------------


async def test_mock_content_replaces_the_echo(engine: Engine) -> None:
    events = await collect(engine, chat("ignored", mock={"content": "Scripted reply."}))
    assert contents(events) == ["Scripted", " reply."]


async def test_mock_reasoning_comes_first_as_reasoning_events(engine: Engine) -> None:
    events = await collect(engine, chat("a b", mock={"reasoning": "Think first."}))
    assert events[:4] == [
        Reasoning("Think"),
        Reasoning(" first."),
        Delta(content="a"),
        Delta(content=" b"),
    ]
    result = await accumulate(engine.complete_stream(chat("a b", mock={"reasoning": "Hm ok"})))
    assert (result.reasoning, result.content) == ("Hm ok", "a b")


@pytest.mark.parametrize(
    "arguments",
    [
        {"city": "Paris", "days": [1, 2, 3], "units": "metric"},
        '{"city": "Paris", "days": [1, 2, 3], "units": "metric"}',
    ],
)
async def test_mock_tool_calls_stream_as_fragments(
    engine: Engine, arguments: str | dict[str, Any]
) -> None:
    script = {"content": "", "tool_calls": [{"name": "weather", "arguments": arguments}]}
    events = await collect(engine, chat("x", mock=script))
    calls = [e for e in events if isinstance(e, ToolCall)]
    opening = calls[0]
    assert opening.index == 0
    assert opening.name == "weather"
    assert opening.id is not None
    assert opening.id.startswith("call_")
    assert opening.arguments == ""
    fragments = calls[1:]
    assert len(fragments) >= 2
    assert all(f.id is None and f.name is None and f.index == 0 for f in fragments)
    assert all(0 < len(f.arguments) <= ARGUMENT_FRAGMENT for f in fragments)
    joined = "".join(f.arguments for f in fragments)
    expected = arguments if isinstance(arguments, dict) else orjson.loads(arguments)
    assert orjson.loads(joined) == expected
    assert events[len(calls)] == Delta(finish_reason="tool_calls")
    result = await accumulate(engine.complete_stream(chat("x", mock=script)))
    assert result.finish_reason == "tool_calls"
    assert [(c.id, c.name, c.arguments) for c in result.tool_calls] == [
        (opening.id, "weather", joined)
    ]


async def test_mock_tool_call_ids_are_deterministic(engine: Engine) -> None:
    script = {"tool_calls": [{"name": "a", "arguments": {"x": 1}}, {"name": "b"}]}
    first = await engine.complete(chat("x", mock=script))
    second = await engine.complete(chat("x", mock=script))
    ids = [c.id for c in first.tool_calls]
    assert ids == [c.id for c in second.tool_calls]
    assert len(set(ids)) == 2
    assert [c.index for c in first.tool_calls] == [0, 1]
    assert [c.arguments for c in first.tool_calls] == ['{"x":1}', "{}"]
    assert first.content == "x"


async def test_delay_ms_paces_the_chunks(engine: Engine) -> None:
    loop = asyncio.get_running_loop()
    start = loop.time()
    events = await collect(engine, chat("one two three", mock={"delay_ms": 50}))
    elapsed = loop.time() - start
    assert contents(events) == ["one", " two", " three"]
    assert elapsed >= 0.095


# --- fail_after --------------------------------------------------------------


async def test_fail_after_zero_raises_before_output(engine: Engine) -> None:
    stream = engine.complete_stream(chat("a b c", mock={"fail_after": 0}))
    with pytest.raises(GatewayError) as info:
        await stream.next()
    await stream.close()
    assert isinstance(info.value, UpstreamError)
    assert info.value.code == "upstream_error"
    assert info.value.retryable is True


@pytest.mark.parametrize(("fail_after", "data_events"), [(1, 1), (2, 2), (3, 3), (9, 3)])
async def test_fail_after_n_gives_n_events_then_an_error_event(
    engine: Engine, fail_after: int, data_events: int
) -> None:
    events = await collect(engine, chat("a b c", mock={"fail_after": fail_after}))
    assert len(events) == data_events + 1
    assert contents(events) == ["a", " b", " c"][:data_events]
    error = events[-1]
    assert isinstance(error, Error)
    assert error.code == "upstream_error"
    assert error.retryable is True
    assert f"after {data_events} chunks" in error.message


async def test_fail_after_counts_reasoning_and_tool_chunks(engine: Engine) -> None:
    script = {"reasoning": "r1 r2", "tool_calls": [{"name": "f"}], "fail_after": 3}
    events = await collect(engine, chat("c", mock=script))
    assert events[:3] == [Reasoning("r1"), Reasoning(" r2"), Delta(content="c")]
    assert isinstance(events[3], Error)
    assert len(events) == 4


# --- usage -------------------------------------------------------------------


async def test_usage_counts_prompt_words_and_emitted_chunks(engine: Engine) -> None:
    body = {
        "model": "mock/echo",
        "messages": [
            {"role": "system", "content": "You are  terse."},
            {"role": "user", "content": "one two"},
            {"role": "assistant", "content": "three"},
            {"role": "user", "content": "four five six\nseven"},
        ],
    }
    result = await engine.complete(body)
    assert result.usage == Usage(prompt_tokens=10, completion_tokens=4, total_tokens=14)


async def test_usage_counts_reasoning_and_tool_chunks(engine: Engine) -> None:
    script = {
        "reasoning": "a b c",
        "content": "d e",
        "tool_calls": [{"name": "f", "arguments": "0123456789"}],
    }
    result = await engine.complete(chat("p q", mock=script))
    # 3 reasoning + 2 content + 1 opening + 2 argument fragments
    assert result.usage == Usage(
        prompt_tokens=2, completion_tokens=8, total_tokens=10, reasoning_tokens=3
    )


async def test_mock_usage_overrides_and_recomputes_total(engine: Engine) -> None:
    result = await engine.complete(chat("a b c", mock={"usage": {"prompt_tokens": 100}}))
    assert result.usage == Usage(prompt_tokens=100, completion_tokens=3, total_tokens=103)
    result = await engine.complete(
        chat(
            "a b c",
            mock={"usage": {"completion_tokens": 7, "cached_tokens": 2, "reasoning_tokens": 1}},
        )
    )
    assert result.usage == Usage(
        prompt_tokens=3, completion_tokens=7, total_tokens=10, cached_tokens=2, reasoning_tokens=1
    )


async def test_mock_usage_total_is_kept_when_given(engine: Engine) -> None:
    script = {"reasoning": "r", "usage": {"total_tokens": 42}}
    result = await engine.complete(chat("a b", mock=script))
    assert result.usage == Usage(
        prompt_tokens=2, completion_tokens=3, total_tokens=42, reasoning_tokens=1
    )


# --- determinism -------------------------------------------------------------


async def test_identical_requests_give_identical_events(engine: Engine) -> None:
    body = chat(
        "Tell me\n a story ",
        max_tokens=50,
        mock={"reasoning": "Plan it.", "tool_calls": [{"name": "lookup", "arguments": {"q": 1}}]},
    )
    first = await collect(engine, body)
    second = await collect(engine, body)
    assert first == second
    assert len(first) == 2 + 4 + 1 + 1 + 2
