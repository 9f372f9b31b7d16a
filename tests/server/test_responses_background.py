"""``background: true`` on ``/v1/responses`` answers with a ``response`` object the openai
SDK can use (it got the other endpoints' ``{"id": "chatcmpl-…", …}``: ``output`` None,
``output_text`` raising), carrying the stream's ``url`` like every background request."""

from __future__ import annotations

from openai import AsyncOpenAI

from support import MakeClient, parse_sse


async def test_background_is_a_response_the_sdk_reads(make_client: MakeClient) -> None:
    client = await make_client()
    api = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    raw = await api.responses.with_raw_response.create(
        model="mock/echo", input="one two", background=True
    )
    assert raw.status_code == 202
    response = raw.parse()
    assert response.object == "response"
    assert response.id.startswith("resp_")
    assert (response.status, response.output, response.output_text) == ("in_progress", [], "")
    assert response.background is True
    extra = response.model_extra or {}
    assert extra["resumable"] is True
    location = raw.headers["Location"]
    assert extra["url"].startswith(location + "?token=")
    assert location == "/v1/streams/" + extra["stream_id"]
    assert extra["stream_id"].endswith(response.id.removeprefix("resp_"))
    # The url streams the response in its own format, with the same id.
    body = await (await client.get(extra["url"])).read()
    events = parse_sse(body)
    assert events[-1].event == "response.completed"
    assert f'"id":"{response.id}"'.encode() in body
    await api.close()


async def test_the_response_id_names_the_stream(make_client: MakeClient) -> None:
    client = await make_client()
    body = {"model": "mock/echo", "input": "one two", "background": True}
    accepted = await (await client.post("/v1/responses", json=body)).json()
    got = await client.get(f"/v1/streams/{accepted['id']}")
    assert got.status == 200
    assert parse_sse(await got.read())[-1].event == "response.completed"
    deleted = await client.delete(f"/v1/streams/{accepted['id']}")
    assert (await deleted.json())["id"] == accepted["stream_id"]


async def test_background_and_stream_streams_at_once_as_openai_does(
    make_client: MakeClient,
) -> None:
    """OpenAI streams a response asked for with both (its SDK's background streaming):
    the SDK got a 202 body, yielded no event and raised nothing, and its stream helper's
    get_final_response() raised. The run is detached: it goes on for a client that left,
    which resumes it by the id of an event it saw."""
    client = await make_client()
    api = AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0)
    events = [
        event
        async for event in await api.responses.create(
            model="mock/echo", input="one two", background=True, stream=True
        )
    ]
    assert events[0].type == "response.created" and events[-1].type == "response.completed"
    assert events[-1].response.output_text == "one two"
    async with api.responses.stream(model="mock/echo", input="three", background=True) as stream:
        final = await stream.get_final_response()
    assert final.output_text == "three"
    # Left after its first event, it runs on and is read again from there.
    slow = {"model": "mock/echo", "input": "a b c d", "background": True, "stream": True}
    slow["mock"] = {"delay_ms": 50}  # type: ignore[assignment]
    resp = await client.post("/v1/responses", json=slow)
    assert resp.status == 200 and resp.headers["X-Nexus-Resumable"] == "true"
    first = await resp.content.readuntil(b"\n\n")
    resp.close()
    seen = next(line for line in first.split(b"\n") if line.startswith(b"id: "))[4:].decode()
    again = await client.get(f"/v1/streams/{seen.split('.')[0]}", headers={"Last-Event-ID": seen})
    assert parse_sse(await again.read())[-1].event == "response.completed"
    await api.close()
