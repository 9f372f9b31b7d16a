"""The openai SDK through an Anthropic upstream: what it reads must be what OpenAI sends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import openai
import pydantic
import pytest
from openai import AsyncOpenAI

from support import MakeClient
from upstreams import FakeUpstream, Reply, anthropic_stream

USER: Any = [{"role": "user", "content": "What time is it?"}]


class GetTime(pydantic.BaseModel):
    """A tool that takes no arguments."""


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


async def test_a_tool_call_without_arguments_has_an_empty_object(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """Anthropic sends ``input: {}`` and an empty ``partial_json`` for a tool that takes no
    arguments; OpenAI sends ``"{}"``. ``""`` is not JSON: ``.parse`` raised on it."""
    call = {"type": "tool_use", "id": "toolu_1", "name": "GetTime", "input": {}}
    frames = anthropic_stream([call], "tool_use")
    upstream.add(*(Reply.stream(frames) for _ in range(3)))
    config = {"providers": {"an": {"kind": "anthropic", "base_url": upstream.url}}}
    client = await make_client(config)
    api = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    tools = [openai.pydantic_function_tool(GetTime)]
    parsed = await api.chat.completions.parse(model="an/claude", messages=USER, tools=tools)
    (tool_call,) = parsed.choices[0].message.tool_calls or []
    assert tool_call.function.arguments == "{}"
    assert tool_call.function.parsed_arguments == GetTime()  # type: ignore[union-attr]
    async with api.chat.completions.stream(model="an/claude", messages=USER, tools=tools) as s:
        streamed = await s.get_final_completion()
    (tool_call,) = streamed.choices[0].message.tool_calls or []
    assert tool_call.function.arguments == "{}"
    response = await api.responses.create(model="an/claude", input="What time is it?")
    (item,) = response.output
    assert item.type == "function_call"
    assert json.loads(item.arguments) == {}
    await api.close()
