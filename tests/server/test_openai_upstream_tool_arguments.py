"""A tool call without arguments from an OpenAI-compatible upstream (``"arguments": ""`` or
no ``arguments`` at all, as some servers send it) reaches the openai SDK as ``"{}"`` on
every endpoint, streamed or not, so ``chat.completions.parse`` with pydantic tools and
``json.loads`` work."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import openai
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel

from support import MakeClient
from upstreams import DONE, FakeUpstream, Reply, openai_chunk

USER = [{"role": "user", "content": "x"}]


class get_weather(BaseModel):  # the tool's name
    city: str


class now(BaseModel):  # the tool's name
    pass


def _stream(function: dict[str, Any]) -> list[bytes]:
    first = {"index": 0, "id": "call_A", "type": "function", "function": {"name": "get_weather"}}
    second = {"index": 1, "id": "call_B", "type": "function", "function": function}
    return [
        openai_chunk(role="assistant", content=None),
        openai_chunk(tool_calls=[{**first, "function": {**first["function"], "arguments": ""}}]),
        openai_chunk(tool_calls=[{"index": 0, "function": {"arguments": '{"city":"Oslo"}'}}]),
        openai_chunk(tool_calls=[second]),
        openai_chunk(finish_reason="tool_calls"),
        DONE,
    ]


@pytest.fixture(params=["empty", "absent"])
async def api(
    request: pytest.FixtureRequest, make_client: MakeClient
) -> AsyncIterator[AsyncOpenAI]:
    function = {"name": "now", "arguments": ""} if request.param == "empty" else {"name": "now"}
    async with FakeUpstream(default=Reply.stream(_stream(function))) as fake:
        client = await make_client(
            {"providers": {"oai": {"kind": "openai", "base_url": fake.url + "/v1"}}}
        )
        url = str(client.make_url("/v1"))
        async with AsyncOpenAI(base_url=url, api_key="unused", max_retries=0) as sdk:
            yield sdk


TOOLS = [openai.pydantic_function_tool(get_weather), openai.pydantic_function_tool(now)]
WANT = ['{"city":"Oslo"}', "{}"]


async def test_chat_arguments_are_an_empty_object(api: AsyncOpenAI) -> None:
    made = await api.chat.completions.create(model="oai/m", messages=USER, tools=TOOLS)  # type: ignore[arg-type]
    assert [c.function.arguments for c in made.choices[0].message.tool_calls or ()] == WANT  # type: ignore[union-attr]
    parsed = await api.chat.completions.parse(model="oai/m", messages=USER, tools=TOOLS)  # type: ignore[arg-type]
    calls = parsed.choices[0].message.tool_calls or []
    assert [c.function.parsed_arguments for c in calls] == [get_weather(city="Oslo"), now()]


async def test_streamed_chat_arguments_are_an_empty_object(api: AsyncOpenAI) -> None:
    async with api.chat.completions.stream(model="oai/m", messages=USER, tools=TOOLS) as stream:  # type: ignore[arg-type]
        final = await stream.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    assert [c.function.arguments for c in calls] == WANT
    assert [c.function.parsed_arguments for c in calls] == [get_weather(city="Oslo"), now()]
    assert final.choices[0].finish_reason == "tool_calls"


async def test_responses_arguments_are_an_empty_object(api: AsyncOpenAI) -> None:
    made = await api.responses.create(model="oai/m", input="x")
    assert [getattr(item, "arguments", None) for item in made.output] == WANT
    async with api.responses.stream(model="oai/m", input="x") as stream:
        done = [
            event.arguments
            async for event in stream
            if event.type == "response.function_call_arguments.done"
        ]
        final = await stream.get_final_response()
    assert done == WANT
    assert [getattr(item, "arguments", None) for item in final.output] == WANT
