"""Effort levels and Anthropic's ``output_config`` through a gateway, from the real SDKs to
fake upstreams that record the body they got: each upstream gets them in its own API's
terms; what it has no counterpart for is a 400 naming the field before any upstream call,
and a target that cannot honour it is skipped for one that can."""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel

from support import MakeClient
from upstreams import DONE, FakeUpstream, Reply, anthropic_stream, openai_chunk

USER: Any = {"role": "user", "content": "Who is she?"}
ANSWER = '{"name":"Ada","nick":null}'


class Person(BaseModel):
    name: str
    nick: str | None = None


async def gateway(make_client: MakeClient, claude: FakeUpstream, oai: FakeUpstream) -> str:
    config = {
        "providers": {
            "claude": {"kind": "anthropic", "base_url": claude.url},
            "oai": {"kind": "openai", "base_url": oai.url + "/v1"},
        },
        "models": {
            "either": {"targets": ["claude/m", "oai/m"]},
            "gpt-then-claude": {"targets": ["oai/m", "claude/m"]},
        },
    }
    client = await make_client(config)
    return str(client.make_url(""))


def openai_answer(text: str = ANSWER) -> Reply:
    return Reply.stream([openai_chunk(content=text), openai_chunk(finish_reason="stop"), DONE])


def anthropic_answer(text: str = "Hi.") -> Reply:
    return Reply.stream(anthropic_stream([{"type": "text", "text": text}]))


async def test_a_messages_clients_format_reaches_an_openai_upstream_strict(
    make_client: MakeClient, claude: FakeUpstream, oai: FakeUpstream
) -> None:
    """``messages.parse``: OpenAI gets a strict response format (the optional, nullable
    ``nick`` required), and the SDK parses the answer."""
    oai.add(openai_answer())
    url = await gateway(make_client, claude, oai)
    async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as api:
        message = await api.messages.parse(
            model="oai/m", max_tokens=50, messages=[USER], output_format=Person
        )
    assert message.parsed_output == Person(name="Ada")
    (seen,) = oai.requests
    assert "output_config" not in seen.body and "reasoning_effort" not in seen.body
    json_schema = seen.body["response_format"]["json_schema"]
    assert (json_schema["name"], json_schema["strict"]) == ("output", True)
    assert json_schema["schema"]["required"] == ["name", "nick"]
    assert json_schema["schema"]["additionalProperties"] is False
    assert claude.requests == []


async def test_a_messages_clients_effort_falls_back_past_an_openai_target(
    make_client: MakeClient, claude: FakeUpstream, oai: FakeUpstream
) -> None:
    """An alias from an OpenAI model to a Claude one: the OpenAI target refuses the effort
    (a non-reasoning model would answer 400, ending the request), so Claude answers with it;
    the OpenAI model alone is a 400 naming the field."""
    claude.add(anthropic_answer())
    url = await gateway(make_client, claude, oai)
    request: Any = {"max_tokens": 50, "messages": [USER], "output_config": {"effort": "high"}}
    async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as api:
        message = await api.messages.create(model="gpt-then-claude", **request)
        with pytest.raises(anthropic.BadRequestError) as info:
            await api.messages.create(model="oai/m", **request)
    assert message.content[0].type == "text"
    assert oai.requests == []
    assert [seen.body["output_config"] for seen in claude.requests] == [{"effort": "high"}]
    assert "output_config.effort" in str(info.value)


async def test_an_openai_clients_effort_stays_off_an_anthropic_upstream(
    make_client: MakeClient, claude: FakeUpstream, oai: FakeUpstream
) -> None:
    """``reasoning_effort`` (chat) and ``reasoning.effort`` (responses) are not sent to an
    Anthropic target, whose older models refuse an effort: an alias that falls back from an
    OpenAI model to a Claude one still answers; its OpenAI target gets the level."""
    claude.add(anthropic_answer(), anthropic_answer())
    oai.add(openai_answer("Hi."))
    url = await gateway(make_client, claude, oai)
    async with AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as api:
        await api.chat.completions.create(
            model="claude/m", messages=[USER], reasoning_effort="minimal"
        )
        await api.responses.create(model="claude/m", input="Hi", reasoning={"effort": "low"})
        assert [seen.body.get("output_config") for seen in claude.requests] == [None, None]
        assert all("reasoning_effort" not in seen.body for seen in claude.requests)
        await api.chat.completions.create(
            model="either", messages=[USER], reasoning_effort="minimal"
        )
    assert oai.requests[0].body["reasoning_effort"] == "minimal"


async def test_a_chat_clients_output_config_reaches_an_openai_upstream_in_its_terms(
    make_client: MakeClient, claude: FakeUpstream, oai: FakeUpstream
) -> None:
    """Anthropic's ``output_config`` from a chat client: its format has a counterpart; a
    setting without one (an effort level too) is a 400 naming it, never dropped."""
    oai.add(openai_answer())
    url = await gateway(make_client, claude, oai)
    schema = Person.model_json_schema()
    config = {"format": {"type": "json_schema", "schema": schema}}
    async with AsyncOpenAI(base_url=url + "/v1", api_key="k", max_retries=0) as api:
        await api.chat.completions.create(
            model="oai/m", messages=[USER], extra_body={"output_config": config}
        )
        refused = []
        for extra in ({"task_budget": {"type": "tokens", "total": 9}}, {"effort": "medium"}):
            with pytest.raises(openai.BadRequestError) as info:
                await api.chat.completions.create(
                    model="oai/m", messages=[USER], extra_body={"output_config": extra}
                )
            refused.append(info.value)
    (seen,) = oai.requests
    assert "output_config" not in seen.body and "reasoning_effort" not in seen.body
    assert seen.body["response_format"]["type"] == "json_schema"
    assert seen.body["response_format"]["json_schema"]["name"] == "output"
    assert [(error.code, error.param) for error in refused] == [
        ("invalid_request", "output_config.task_budget"),
        ("invalid_request", "output_config.effort"),
    ]
    assert all("cannot honour" in error.message for error in refused)


async def test_a_schema_strict_mode_cannot_hold_reaches_openai_as_before(
    make_client: MakeClient, claude: FakeUpstream, oai: FakeUpstream
) -> None:
    """A property that may be left out but not be null: strict mode would make the model
    write one, so the schema goes as sent, without strict, as it did."""
    oai.add(openai_answer('{"name":"Ada"}'))
    url = await gateway(make_client, claude, oai)
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string"}, "error": {"type": "string"}},
        "required": ["name"],
        "additionalProperties": False,
    }
    async with anthropic.AsyncAnthropic(base_url=url, api_key="k", max_retries=0) as api:
        await api.messages.create(
            model="oai/m",
            max_tokens=50,
            messages=[USER],
            output_config={"format": {"type": "json_schema", "schema": schema}},
        )
    (seen,) = oai.requests
    assert seen.body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "output", "schema": schema},
    }
