"""Chat fields an Anthropic-kind target cannot carry, through the openai SDK: a JSON schema
reaches it as Anthropic's structured outputs (the SDK's ``.parse`` helpers then read the
answer); a format it has no place for is a 400 naming the field before any upstream call,
on every endpoint and path; a fallback list skips such a target."""

from __future__ import annotations

from typing import Any

import openai
import pydantic
import pytest
from openai import AsyncOpenAI

from support import MakeClient
from upstreams import DONE, FakeUpstream, Reply, openai_chunk, sse

USER = [{"role": "user", "content": "Weather in Oslo?"}]
ANSWER = '{"city": "Oslo"}'
SCHEMA = {  # what the SDK makes of Weather (strict: every object closed)
    "type": "object",
    "title": "Weather",
    "properties": {"city": {"type": "string", "title": "City"}},
    "required": ["city"],
    "additionalProperties": False,
}


class Weather(pydantic.BaseModel):
    city: str


def event(name: str, **fields: Any) -> bytes:
    return sse({"type": name, **fields}, event=name)


def anthropic_json_answer() -> Reply:
    message = {"id": "msg_1", "type": "message", "role": "assistant", "content": []}
    usage = {"input_tokens": 5, "output_tokens": 1}
    return Reply.stream(
        [
            event("message_start", message={**message, "model": "m", "usage": usage}),
            event("content_block_start", index=0, content_block={"type": "text", "text": ""}),
            event("content_block_delta", index=0, delta={"type": "text_delta", "text": ANSWER}),
            event("content_block_stop", index=0),
            event("message_delta", delta={"stop_reason": "end_turn"}, usage={"output_tokens": 6}),
            event("message_stop"),
        ]
    )


async def sdk(make_client: MakeClient, claude: FakeUpstream, oai: FakeUpstream) -> AsyncOpenAI:
    config = {
        "providers": {
            "claude": {"kind": "anthropic", "base_url": claude.url},
            "oai": {"kind": "openai", "base_url": oai.url + "/v1"},
        },
        "models": {
            "claude-first": {"targets": ["claude/m", "oai/m"]},
            "oai-first": {"targets": ["oai/m", "claude/m"]},
        },
    }
    client = await make_client(config)
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)


async def test_a_json_schema_reaches_anthropic_and_the_sdk_parses_the_answer(
    make_client: MakeClient, claude: FakeUpstream, oai: FakeUpstream
) -> None:
    claude.add(*(anthropic_json_answer() for _ in range(4)))
    async with await sdk(make_client, claude, oai) as api:
        chat = await api.chat.completions.parse(
            model="claude/m", messages=USER, response_format=Weather
        )
        assert chat.choices[0].message.parsed == Weather(city="Oslo")
        async with api.chat.completions.stream(
            model="claude/m", messages=USER, response_format=Weather
        ) as stream:
            streamed = await stream.get_final_completion()
        assert streamed.choices[0].message.parsed == Weather(city="Oslo")
        response = await api.responses.parse(model="claude/m", input="Oslo?", text_format=Weather)
        assert response.output_parsed == Weather(city="Oslo")
        async with api.responses.stream(
            model="claude/m", input="Oslo?", text_format=Weather
        ) as events:
            final = await events.get_final_response()
        assert final.output_parsed == Weather(city="Oslo")
        assert len(claude.requests) == 4
        for seen in claude.requests:
            assert seen.body["output_config"] == {
                "format": {"type": "json_schema", "schema": SCHEMA}
            }


@pytest.mark.parametrize("stream", [False, True])
async def test_a_format_anthropic_cannot_honour_is_refused_before_any_upstream_call(
    make_client: MakeClient, claude: FakeUpstream, oai: FakeUpstream, stream: bool
) -> None:
    async with await sdk(make_client, claude, oai) as api:
        with pytest.raises(openai.BadRequestError) as chat:
            await api.chat.completions.create(
                model="claude/m",
                messages=USER,
                response_format={"type": "json_object"},
                stream=stream,
            )
        with pytest.raises(openai.BadRequestError) as responses:
            await api.responses.create(
                model="claude/m",
                input="Oslo?",
                text={"format": {"type": "json_object"}},
                stream=stream,
            )
        with pytest.raises(openai.BadRequestError) as bias:
            await api.chat.completions.create(
                model="claude/m", messages=USER, logit_bias={"1": -100}, stream=stream
            )
        with pytest.raises(openai.BadRequestError) as background:
            await api.chat.completions.create(
                model="claude/m",
                messages=USER,
                response_format={"type": "json_object"},
                stream=stream,
                extra_body={"background": True},
            )
        for info, param in (
            (chat, "response_format"),
            (responses, "text.format"),
            (bias, "logit_bias"),
            (background, "response_format"),
        ):
            assert (info.value.code, info.value.param) == ("invalid_request", param)
            message = info.value.body["message"]  # type: ignore[index]
            assert message.startswith(f"{param}: ")
            assert "cannot honour" in message
        assert claude.requests == []


async def test_a_fallback_list_skips_a_target_that_cannot_honour_the_request(
    make_client: MakeClient, claude: FakeUpstream, oai: FakeUpstream
) -> None:
    """Each target decides for itself, as for input it cannot take: the Anthropic target
    is passed over, first or as a fallback, and never called."""
    oai.add(
        Reply.stream([openai_chunk(content=ANSWER), openai_chunk(finish_reason="stop"), DONE]),
        Reply.json(500, {"error": {"message": "down", "type": "server_error"}}),
    )
    async with await sdk(make_client, claude, oai) as api:
        json_object: Any = {"type": "json_object"}
        chat = await api.chat.completions.create(
            model="claude-first", messages=USER, response_format=json_object
        )
        assert chat.choices[0].message.content == ANSWER
        assert oai.requests[0].body["response_format"] == json_object
        with pytest.raises(openai.APIStatusError) as failed:  # no fallback to the Anthropic target
            await api.chat.completions.create(
                model="oai-first", messages=USER, response_format=json_object
            )
        assert failed.value.status_code == 502
        assert claude.requests == []
