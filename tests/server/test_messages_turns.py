"""What a ``/v1/messages`` client sends back reaches the upstream as it was sent: an
assistant turn's blocks in their order (thinking, text between tool calls, text blocks
apart) and the ``cache_control`` marks on every block that takes one, for an Anthropic
upstream; a valid chat turn for an OpenAI one. And structured outputs (the SDK's
``messages.parse``, ``output_config``) work with either kind of upstream."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anthropic
import pytest
from pydantic import BaseModel

from support import MakeClient
from upstreams import DONE, FakeUpstream, Reply, anthropic_stream, openai_chunk

MARK = {"type": "ephemeral"}
USER = {"role": "user", "content": "Weather and time?"}
TURN = [
    {"type": "thinking", "thinking": "First.", "signature": "SIG_ONE"},
    {"type": "redacted_thinking", "data": "BLOB"},
    {"type": "text", "text": "Let me check."},
    {"type": "thinking", "thinking": "Second.", "signature": "SIG_TWO"},
    {"type": "tool_use", "id": "toolu_1", "name": "weather", "input": {"city": "Oslo"}},
    {"type": "text", "text": "And the time:", "cache_control": MARK},
    {"type": "tool_use", "id": "toolu_2", "name": "now", "input": {}, "cache_control": MARK},
]
IMAGE = {
    "type": "image",
    "source": {"type": "base64", "media_type": "image/png", "data": "aGk="},
    "cache_control": MARK,
}
RESULTS = [
    {"type": "tool_result", "tool_use_id": "toolu_1", "content": "sunny"},
    {
        "type": "tool_result",
        "tool_use_id": "toolu_2",
        "content": [{"type": "text", "text": "noon", "cache_control": MARK}],
        "cache_control": MARK,
    },
    IMAGE,
]


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


async def sdk(make_client: MakeClient, kind: str, url: str) -> anthropic.AsyncAnthropic:
    config = {"providers": {"up": {"kind": kind, "base_url": url}}}
    client = await make_client(config)
    return anthropic.AsyncAnthropic(
        base_url=str(client.make_url("")), api_key="unused", max_retries=0
    )


async def test_an_anthropic_upstream_gets_the_turns_blocks_and_marks_as_sent(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(Reply.stream(anthropic_stream([{"type": "text", "text": "Done."}])))
    api = await sdk(make_client, "anthropic", upstream.url)
    turns: Any = [
        USER,
        {"role": "assistant", "content": TURN},
        {"role": "user", "content": RESULTS},
    ]
    await api.messages.create(model="up/m", max_tokens=50, messages=turns)
    sent = upstream.requests[0].body["messages"]
    assert sent[1:] == [
        {"role": "assistant", "content": TURN},
        {"role": "user", "content": RESULTS},
    ]
    await api.close()


async def test_thinking_without_a_signature_goes_back_as_sent(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """Some Anthropic-compatible servers send thinking without a signature; a client that
    sends it back was refused with a 400 naming a field it never sent."""
    upstream.add(Reply.stream(anthropic_stream([{"type": "text", "text": "Done."}])))
    api = await sdk(make_client, "anthropic", upstream.url)
    turn = [{"type": "thinking", "thinking": "Hm."}, {"type": "text", "text": "Hi."}]
    turns: Any = [USER, {"role": "assistant", "content": turn}, {"role": "user", "content": "?"}]
    await api.messages.create(model="up/m", max_tokens=50, messages=turns)
    assert upstream.requests[0].body["messages"][1] == {"role": "assistant", "content": turn}
    await api.close()


async def test_an_openai_upstream_gets_the_turn_as_a_chat_message(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(
        Reply.stream([openai_chunk(content="Done."), openai_chunk(finish_reason="stop"), DONE])
    )
    api = await sdk(make_client, "openai", upstream.url + "/v1")
    turns: Any = [
        USER,
        {"role": "assistant", "content": TURN},
        {"role": "user", "content": RESULTS[:2]},
    ]
    await api.messages.create(model="up/m", max_tokens=50, messages=turns)
    sent = upstream.requests[0].body["messages"]
    calls = [(c["id"], c["function"]["arguments"]) for c in sent[1]["tool_calls"]]
    assert sent[1]["content"] == "Let me check.And the time:"
    assert calls == [("toolu_1", '{"city":"Oslo"}'), ("toolu_2", "{}")]
    assert set(sent[1]) == {"role", "content", "tool_calls"}
    assert sent[2:] == [
        {"role": "tool", "tool_call_id": "toolu_1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "noon"},
    ]
    await api.close()


class Person(BaseModel):
    name: str
    age: int


ANSWER = '{"name":"Ada","age":36}'


@pytest.mark.parametrize("kind", ["anthropic", "openai"])
async def test_messages_parse_works_with_either_kind_of_upstream(
    make_client: MakeClient, upstream: FakeUpstream, kind: str
) -> None:
    if kind == "anthropic":
        frames = anthropic_stream([{"type": "text", "text": ANSWER}])
        api = await sdk(make_client, kind, upstream.url)
    else:
        frames = [openai_chunk(content=ANSWER), openai_chunk(finish_reason="stop"), DONE]
        api = await sdk(make_client, kind, upstream.url + "/v1")
    upstream.add(Reply.stream(frames))
    message = await api.messages.parse(
        model="up/m", max_tokens=50, messages=[USER], output_format=Person
    )
    assert message.parsed_output == Person(name="Ada", age=36)
    body = upstream.requests[0].body
    if kind == "anthropic":
        schema = body["output_config"]["format"]["schema"]
        assert body["output_config"] == {"format": {"type": "json_schema", "schema": schema}}
    else:
        assert body["response_format"]["type"] == "json_schema"
        schema = body["response_format"]["json_schema"]["schema"]
        assert body["response_format"]["json_schema"]["name"] == "output"
        assert "output_config" not in body
    assert schema["required"] == ["name", "age"]
    await api.close()


async def test_an_effort_level_reaches_anthropic_and_is_refused_by_name_elsewhere(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(Reply.stream(anthropic_stream([{"type": "text", "text": "Hi."}])))
    config = {
        "providers": {
            "an": {"kind": "anthropic", "base_url": upstream.url},
            "oa": {"kind": "openai", "base_url": upstream.url + "/v1"},
        }
    }
    client = await make_client(config)
    api = anthropic.AsyncAnthropic(
        base_url=str(client.make_url("")), api_key="unused", max_retries=0
    )
    request: Any = {"max_tokens": 50, "messages": [USER], "output_config": {"effort": "high"}}
    await api.messages.create(model="an/m", **request)
    assert upstream.requests[0].body["output_config"] == {"effort": "high"}
    with pytest.raises(anthropic.BadRequestError) as info:
        await api.messages.create(model="oa/m", **request)
    assert "output_config.effort: a setting" in info.value.message
    assert len(upstream.requests) == 1  # nothing went to the OpenAI upstream
    await api.close()
