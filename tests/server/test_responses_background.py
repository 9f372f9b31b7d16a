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
