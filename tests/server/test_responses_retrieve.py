"""A response is its stream: ``GET /v1/responses/{id}`` and ``POST /v1/responses/{id}/cancel``
through the openai SDK (``responses.retrieve``, ``responses.retrieve(stream=True,
starting_after=...)``, ``responses.stream(response_id=...)``, ``responses.cancel``), as
OpenAI's background mode is used: create, poll, resume, cancel. They answered 404.
"""

from __future__ import annotations

import asyncio
from typing import Any

import openai
import orjson
import pytest
from openai import AsyncOpenAI

from nexus.auth import hash_key
from support import MakeClient, parse_sse

KEY_A = "nx-alpha-0123456789abcdef0123456789"
KEY_B = "nx-beta-0123456789abcdef01234567890"


def _sdk(client: Any, key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=key, max_retries=0)


async def _background(api: AsyncOpenAI, text: str, **mock: Any) -> Any:
    """A background response of the mock, scripted by ``mock``."""
    return await api.responses.create(
        model="mock/echo", input=text, background=True, extra_body={"mock": mock}
    )


async def _finished(api: AsyncOpenAI, response_id: str) -> Any:
    for _ in range(200):
        response = await api.responses.retrieve(response_id)
        if response.status != "in_progress":
            return response
        await asyncio.sleep(0.02)
    raise AssertionError("the response never finished")


def _frames(body: bytes) -> list[bytes]:
    """A Responses SSE body's frames, the opening ``retry:`` line left out."""
    if body.startswith(b"retry:"):
        body = body.partition(b"\n")[2]
    return [frame + b"\n\n" for frame in body.split(b"\n\n") if frame]


async def test_a_background_response_is_polled_to_the_object_its_stream_ends_with(
    make_client: MakeClient,
) -> None:
    client = await make_client()
    api = _sdk(client)
    created = await _background(api, "one two three", delay_ms=60, reasoning="think first")
    running = await api.responses.retrieve(created.id)
    assert (running.id, running.status, running.output) == (created.id, "in_progress", [])
    final = await _finished(api, created.id)
    assert final.status == "completed" and final.output_text == "one two three"
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.usage is not None and final.usage.output_tokens == 5
    # What the stream's last event carried, field for field (the url's token reads it).
    streamed = parse_sse(await (await client.get(created.model_extra["url"])).read())
    assert streamed[-1].event == "response.completed"
    expected = orjson.loads(streamed[-1].data)["response"]
    expected["stream_id"] = created.model_extra["stream_id"]
    assert final.model_dump(exclude_unset=True) == expected
    await api.close()


async def test_starting_after_resumes_after_that_sequence_number_byte_for_byte(
    make_client: MakeClient,
) -> None:
    """Every resume point of a finished stream (reasoning, text, a tool call: steps that
    write several frames) gives the frames after it as the first rendering wrote them,
    ``id:`` lines included; past the last, nothing (204)."""
    client = await make_client()
    body = {
        "model": "mock/echo",
        "input": "one two",
        "background": True,
        "mock": {"reasoning": "so", "tool_calls": [{"name": "f", "arguments": {"a": 1}}]},
    }
    accepted = await (await client.post("/v1/responses", json=body)).json()
    path = f"/v1/responses/{accepted['id']}"
    full = _frames(await (await client.get(path, params={"stream": "true"})).read())
    numbers = [orjson.loads(parse_sse(frame)[0].data)["sequence_number"] for frame in full]
    assert numbers == list(range(len(full)))  # a frame per sequence number, in order
    for after in range(len(full)):
        got = await client.get(path, params={"stream": "true", "starting_after": str(after)})
        if after == len(full) - 1:
            assert got.status == 204
            continue
        assert _frames(await got.read()) == full[after + 1 :], after


async def test_the_sdk_resumes_a_running_response_with_starting_after(
    make_client: MakeClient,
) -> None:
    client = await make_client()
    api = _sdk(client)
    created = await _background(api, "a b c d e f", delay_ms=30)
    stream = await api.responses.retrieve(created.id, stream=True, starting_after=4)
    events = [event async for event in stream]
    numbers = [event.sequence_number for event in events]
    assert numbers == list(range(5, 5 + len(events)))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == "a b c d e f"
    # The stream helper reads it from the start and leaves out what the client had.
    async with api.responses.stream(response_id=created.id, starting_after=2) as helper:
        seen = [event.sequence_number async for event in helper]
        final = await helper.get_final_response()
    assert seen[0] == 3 and final.output_text == "a b c d e f"
    await api.close()


async def test_cancel_stops_the_response_and_says_so_however_often_it_is_asked(
    make_client: MakeClient,
) -> None:
    client = await make_client()
    api = _sdk(client)
    created = await _background(api, " ".join(f"w{i}" for i in range(200)), delay_ms=20)
    await asyncio.sleep(0.15)
    cancelled = await api.responses.cancel(created.id)
    assert cancelled.status == "cancelled" and cancelled.error is None
    assert cancelled.output_text.startswith("w0 w1")  # what it had made
    assert len(cancelled.output_text.split()) < 200
    assert (await api.responses.retrieve(created.id)).status == "cancelled"
    again = await api.responses.cancel(created.id)
    assert again.model_dump() == cancelled.model_dump()
    # Its stream ends with the cancel as an error, never as a whole answer.
    events = parse_sse(await (await client.get(created.model_extra["url"])).read())
    assert events[-1].event == "response.failed"
    # A response that had finished stays as it was.
    done = await api.responses.create(model="mock/echo", input="done", background=True)
    await _finished(api, done.id)
    assert (await api.responses.cancel(done.id)).status == "completed"
    await api.close()


async def test_a_failed_response_says_why(make_client: MakeClient) -> None:
    client = await make_client()
    api = _sdk(client)
    created = await _background(api, "one two three", fail_after=2)
    failed = await _finished(api, created.id)
    assert failed.status == "failed"
    assert failed.error is not None and failed.error.code == "server_error"
    assert failed.output_text == "one two"
    await api.close()


async def test_bad_queries_are_refused_by_name(make_client: MakeClient) -> None:
    client = await make_client()
    body = {"model": "mock/echo", "input": "x", "background": True}
    accepted = await (await client.post("/v1/responses", json=body)).json()
    path = f"/v1/responses/{accepted['id']}"
    cases: list[tuple[dict[str, str], dict[str, str], str]] = [
        ({"stream": "true", "starting_after": "-1"}, {}, "starting_after"),
        ({"stream": "true", "starting_after": "x"}, {}, "starting_after"),
        ({"stream": "maybe"}, {}, "stream"),
        ({"include_obfuscation": "yes"}, {}, "include_obfuscation"),
        ({"include[]": "reasoning.encrypted_content"}, {}, "include"),
        (
            {"stream": "true", "starting_after": "1", "stream_format": "ndjson"},
            {},
            "starting_after",
        ),
        (
            {"stream": "true", "starting_after": "1"},
            {"Last-Event-ID": f"{accepted['stream_id']}.1"},
            "starting_after",
        ),
    ]
    for params, headers, param in cases:
        got = await client.get(path, params=params, headers=headers)
        assert got.status == 400, params
        assert (await got.json())["error"]["param"] == param
    api = _sdk(client)
    with pytest.raises(openai.NotFoundError):
        await api.responses.retrieve("resp_0123456789abcdef0123456789abcdef")
    with pytest.raises(openai.NotFoundError):
        await api.responses.cancel("resp_0123456789abcdef0123456789abcdef")
    await api.close()


async def test_another_keys_response_is_not_found(make_client: MakeClient) -> None:
    """Retrieve, resume and cancel need the key that made the response (or, to read it,
    its read token): another key gets the 404 an unknown id gets."""
    keys = [
        {"name": "alpha", "sha256": hash_key(KEY_A)},
        {"name": "beta", "sha256": hash_key(KEY_B)},
    ]
    client = await make_client({"auth": {"keys": keys}})
    alpha, beta = _sdk(client, KEY_A), _sdk(client, KEY_B)
    created = await alpha.responses.create(
        model="mock/echo",
        input="secret words",
        background=True,
        extra_body={"mock": {"delay_ms": 50}},
    )
    for call in (
        beta.responses.retrieve(created.id),
        beta.responses.retrieve(created.id, stream=True),
        beta.responses.cancel(created.id),
    ):
        with pytest.raises(openai.NotFoundError):
            await call
    token = created.model_extra["read_token"]
    path = f"/v1/responses/{created.id}"
    assert (await client.get(path, params={"token": token})).status == 200
    refused = await client.post(f"{path}/cancel", params={"token": token})
    assert refused.status == 401  # a read token reads; it does not cancel
    assert (await _finished(alpha, created.id)).output_text == "secret words"
    await alpha.close()
    await beta.close()


ECHOED = {
    "instructions": "Be brief.",
    "metadata": {"job": "42"},
    "tool_choice": "required",
    "parallel_tool_calls": False,
    "temperature": 0.2,
    "top_p": 0.5,
    "max_output_tokens": 77,
}
TOOL = {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}}


async def test_a_response_echoes_its_request_in_every_form(make_client: MakeClient) -> None:
    """The request's ``instructions``, ``metadata``, tools and sampling came back as their
    defaults (``metadata: {}``, ``tool_choice: auto``...), however the response was read:
    a background job tagged with its metadata could not be told by it."""
    client = await make_client()
    api = _sdk(client)
    asked: dict[str, Any] = {"model": "mock/echo", "input": "one two", **ECHOED, "tools": [TOOL]}
    asked["extra_body"] = {"mock": {"content": "one two"}}

    def echoed(response: Any) -> None:
        got = response.model_dump()
        assert {name: got[name] for name in ECHOED} == ECHOED
        assert [t.model_dump(exclude_none=True) for t in response.tools] == [TOOL]

    echoed(await api.responses.create(**asked))
    async with api.responses.stream(**asked) as stream:
        echoed(await stream.get_final_response())
    created = await api.responses.create(**asked, background=True)
    echoed(created)
    echoed(await _finished(api, created.id))
    plain = await api.responses.create(model="mock/echo", input="hi")
    assert (plain.metadata, plain.tool_choice, plain.tools) == ({}, "auto", [])
    await api.close()
    refused = await client.post(
        "/v1/chat/completions",
        json={
            "model": "mock/echo",
            "messages": [{"role": "user", "content": "hi"}],
            "responses_echo": {"metadata": {"a": "b"}},
        },
    )
    assert refused.status == 400


async def test_a_cached_response_echoes_its_own_requests_metadata(make_client: MakeClient) -> None:
    """What a response echoes is its request's, not the one whose stream the cache kept
    (metadata goes nowhere upstream, so it would not tell two requests apart)."""
    client = await make_client({"cache": {"enabled": True}})
    api = _sdk(client)
    asked: dict[str, Any] = {"model": "mock/echo", "input": "one two"}
    first = await api.responses.create(**asked, metadata={"tenant": "a"})
    again = await api.responses.create(**asked, metadata={"tenant": "a"})
    other = await api.responses.create(**asked, metadata={"tenant": "b"})
    assert [r.metadata for r in (first, again, other)] == [{"tenant": "a"}] * 2 + [{"tenant": "b"}]
    await api.close()


async def test_long_instructions_and_tools_are_not_kept_to_be_echoed(
    make_client: MakeClient,
) -> None:
    """Kept with the stream for resume_ttl_s, outside its log's bounds: 8 MiB of
    instructions a request grew the gateway (or Redis) by 8 MiB, for failed ones too."""
    from nexus.protocol.openai_responses_output import ECHO_MAX_BYTES

    client = await make_client()
    api = _sdk(client)
    long = "x" * (ECHO_MAX_BYTES + 1)
    created = await api.responses.create(
        model="mock/echo", input="hi", instructions=long, metadata={"job": "7"}, temperature=0.5
    )
    assert (created.instructions, created.tools) == (None, [])
    assert (created.metadata, created.temperature) == ({"job": "7"}, 0.5)
    await api.close()
