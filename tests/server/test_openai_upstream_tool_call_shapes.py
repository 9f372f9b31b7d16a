"""Tool calls as OpenAI-compatible upstreams stream them, which is not always as OpenAI
does, read back by the official SDKs on every surface, streamed and not:

* ``"id": ""`` on a call's later pieces (Qwen, DashScope): each was taken for a new call
  with no name, the JSON answers holding calls without names and split arguments;
* the id and name repeated on every piece: the chat stream passed them on, and the OpenAI
  SDK's stream helper joins repeated strings (``call_Acall_A``, ``fafa``);
* parallel calls with one index, or none (Gemini's OpenAI-compatible API): their arguments
  ran together in one call, or the Anthropic stream lost the second.
"""

from __future__ import annotations

import json
from typing import Any

import anthropic
import openai
import pydantic
import pytest

from support import MakeClient
from upstreams import DONE, FakeUpstream, Reply, openai_chunk

USER = [{"role": "user", "content": "x"}]


def call(index: int | None, id: str | None, name: str | None, arguments: str) -> dict[str, Any]:
    piece: dict[str, Any] = {"function": {"arguments": arguments}}
    if index is not None:
        piece["index"] = index
    if id is not None:
        piece["id"] = id
        piece["type"] = "function"
    if name is not None:
        piece["function"]["name"] = name
    return piece


SHAPES = {
    "empty-later-ids": [
        [call(0, "call_A", "fa", "")],
        [call(0, "", None, '{"x":')],
        [call(0, "", None, "1}")],
        [call(1, "call_B", "fb", "")],
        [call(1, "", None, '{"y":2}')],
    ],
    "repeated-id-and-name": [
        [call(0, "call_A", "fa", "")],
        [call(0, "call_A", "fa", '{"x":')],
        [call(0, "call_A", "fa", "1}")],
        [call(1, "call_B", "fb", '{"y":2}')],
    ],
    "no-index": [
        [call(None, "call_A", "fa", '{"x":1}')],
        [call(None, "call_B", "fb", '{"y":2}')],
    ],
    "one-index": [
        [call(0, "call_A", "fa", '{"x":1}')],
        [call(0, "call_B", "fb", '{"y":2}')],
    ],
}
EXPECTED = [("call_A", "fa", {"x": 1}), ("call_B", "fb", {"y": 2})]


def frames(shape: str) -> list[bytes]:
    return [
        openai_chunk(role="assistant", content=None),
        *(openai_chunk(tool_calls=pieces) for pieces in SHAPES[shape]),
        openai_chunk(finish_reason="tool_calls"),
        DONE,
    ]


def parsed(calls: list[tuple[str, str, str]]) -> list[tuple[str, str, Any]]:
    return [(id, name, json.loads(arguments)) for id, name, arguments in calls]


@pytest.mark.parametrize("shape", list(SHAPES))
async def test_every_surface_reads_the_calls_as_they_were_made(
    make_client: MakeClient, shape: str
) -> None:
    async with FakeUpstream(default=Reply.stream(frames(shape))) as fake:
        client = await make_client(
            {"providers": {"up": {"kind": "openai", "base_url": fake.url + "/v1"}}}
        )
        url = str(client.make_url(""))
        async with (
            openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0) as chat,
            anthropic.AsyncAnthropic(base_url=url, api_key="x", max_retries=0) as messages,
        ):
            for surface, read in READS.items():
                got = await read(chat, messages)
                assert got == EXPECTED, (surface, got)


async def chat_json(chat: openai.AsyncOpenAI, _: Any) -> Any:
    created = await chat.chat.completions.create(model="up/m", messages=USER)  # type: ignore[arg-type]
    calls = created.choices[0].message.tool_calls or []
    return parsed([(c.id, c.function.name, c.function.arguments) for c in calls])  # type: ignore[union-attr]


async def chat_stream(chat: openai.AsyncOpenAI, _: Any) -> Any:
    async with chat.chat.completions.stream(model="up/m", messages=USER) as stream:  # type: ignore[arg-type]
        final = await stream.get_final_completion()
    calls = final.choices[0].message.tool_calls or []
    return parsed([(c.id, c.function.name, c.function.arguments) for c in calls])


async def responses_json(chat: openai.AsyncOpenAI, _: Any) -> Any:
    done = await chat.responses.create(model="up/m", input="x")
    return parsed(
        [(o.call_id, o.name, o.arguments) for o in done.output if o.type == "function_call"]
    )


async def responses_stream(chat: openai.AsyncOpenAI, _: Any) -> Any:
    async with chat.responses.stream(model="up/m", input="x") as stream:
        done = await stream.get_final_response()
    return parsed(
        [(o.call_id, o.name, o.arguments) for o in done.output if o.type == "function_call"]
    )


async def messages_json(_: Any, messages: anthropic.AsyncAnthropic) -> Any:
    message = await messages.messages.create(model="up/m", max_tokens=50, messages=USER)  # type: ignore[arg-type]
    return [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"]


async def messages_stream(_: Any, messages: anthropic.AsyncAnthropic) -> Any:
    async with messages.messages.stream(model="up/m", max_tokens=50, messages=USER) as stream:  # type: ignore[arg-type]
        message = await stream.get_final_message()
    return [(b.id, b.name, b.input) for b in message.content if b.type == "tool_use"]


READS = {
    "chat": chat_json,
    "chat stream": chat_stream,
    "responses": responses_json,
    "responses stream": responses_stream,
    "messages": messages_json,
    "messages stream": messages_stream,
}


async def test_gemini_s_thought_signature_reaches_the_client_and_goes_back(
    make_client: MakeClient,
) -> None:
    """Gemini 3's OpenAI-compatible API attaches each call's thought signature as
    ``extra_content``, and refuses the next turn without it. It was dropped: tool use
    through Nexus failed on its second turn."""
    signed = {"google": {"thought_signature": "SIG_A"}}
    piece = {**call(None, "call_A", "fa", '{"x":1}'), "extra_content": signed}
    stream = [openai_chunk(tool_calls=[piece]), openai_chunk(finish_reason="tool_calls"), DONE]
    async with FakeUpstream(default=Reply.stream(stream)) as fake:
        client = await make_client(
            {"providers": {"up": {"kind": "openai", "base_url": fake.url + "/v1"}}}
        )
        url = str(client.make_url("")) + "/v1"
        async with openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0) as chat:
            created = await chat.chat.completions.create(model="up/m", messages=USER)  # type: ignore[arg-type]
            (made,) = created.choices[0].message.tool_calls or []
            assert (made.model_extra or {}).get("extra_content") == signed
            async with chat.chat.completions.stream(model="up/m", messages=USER) as streamed:  # type: ignore[arg-type]
                final = await streamed.get_final_completion()
            (got,) = final.choices[0].message.tool_calls or []
            assert (got.model_extra or {}).get("extra_content") == signed
            # The next turn carries it back upstream, as the client sent it.
            turn = [*USER, created.choices[0].message.model_dump(exclude_none=True)]
            turn.append({"role": "tool", "tool_call_id": "call_A", "content": "1"})
            await chat.chat.completions.create(model="up/m", messages=turn)  # type: ignore[arg-type]
        sent = fake.requests[-1].body["messages"][1]["tool_calls"][0]
        assert sent["extra_content"] == signed


async def test_a_call_without_arguments_ends_with_an_object_before_the_next_begins(
    make_client: MakeClient,
) -> None:
    """A tool that takes no arguments, its call streamed with ``""``, then another call: the
    SDK's stream helper takes the second index for the end of the first and parses what it
    holds. Its ``"{}"`` came only before the finish: the helper raised mid-stream on a
    strict tool (``Invalid JSON: EOF``), and its ``arguments.done`` said ``""``."""

    class Noop(pydantic.BaseModel):
        pass

    class Weather(pydantic.BaseModel):
        city: str

    pieces = [[call(0, "call_A", "Noop", "")], [call(1, "call_B", "Weather", "")]]
    pieces += [[call(1, None, None, '{"city":')], [call(1, None, None, '"Oslo"}')]]
    stream = [openai_chunk(role="assistant", content=None)]
    stream += [openai_chunk(tool_calls=piece) for piece in pieces]
    stream += [openai_chunk(finish_reason="tool_calls"), DONE]
    tools = [openai.pydantic_function_tool(Noop), openai.pydantic_function_tool(Weather)]
    async with FakeUpstream(default=Reply.stream(stream)) as fake:
        client = await make_client(
            {"providers": {"up": {"kind": "openai", "base_url": fake.url + "/v1"}}}
        )
        url = str(client.make_url("")) + "/v1"
        chat = openai.AsyncOpenAI(base_url=url, api_key="x", max_retries=0)
        async with (
            chat,
            chat.chat.completions.stream(
                model="up/m",
                messages=USER,  # type: ignore[arg-type]
                tools=tools,
            ) as streamed,
        ):
            done = [
                (event.name, event.arguments, event.parsed_arguments)
                async for event in streamed
                if event.type == "tool_calls.function.arguments.done"
            ]
            final = await streamed.get_final_completion()
    assert done == [("Noop", "{}", Noop()), ("Weather", '{"city":"Oslo"}', Weather(city="Oslo"))]
    calls = final.choices[0].message.tool_calls or []
    assert [c.function.arguments for c in calls] == ["{}", '{"city":"Oslo"}']
