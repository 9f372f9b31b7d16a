"""Stream resources over HTTP: background requests, GET /v1/streams/{id}, resume, detach, DELETE."""

from __future__ import annotations

import asyncio
import re
import shutil
from typing import Any

import orjson
import pytest

from nexus.protocol.sse import ServerSentEvent
from support import GatedProvider, MakeClient, chat, parse_sse

TEXT = "one two three four five six"
WORDS = TEXT.split()
SSE_FORMATS = ["sse", "nexus", "anthropic", "openai-responses"]


def ndjson(body: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in body.splitlines() if line]


def content(events: list[ServerSentEvent]) -> str:
    """The text of an OpenAI-SSE body."""
    out = []
    for event in events:
        if event.data.startswith("{"):
            for choice in orjson.loads(event.data).get("choices", []):
                out.append(choice["delta"].get("content") or "")
    return "".join(out)


async def background(client: Any, path: str = "/v1/chat/completions", **body: Any) -> str:
    resp = await client.post(path, json={**chat(TEXT), "background": True, **body})
    assert resp.status == 202, await resp.text()
    data = await resp.json()
    token = data["read_token"]
    assert re.fullmatch(r"\d+\.[\w-]{43}", token)
    assert data == {
        "id": data["id"],
        "url": f"/v1/streams/{data['id']}?token={token}",
        "status": "in_progress",
        "resumable": True,
        "read_token": token,
    }
    assert resp.headers["Location"] == f"/v1/streams/{data['id']}"  # no token in a header
    assert resp.headers["X-Nexus-Stream-Id"] == data["id"]
    return str(data["id"])


# --- background requests and GET ------------------------------------------------------


async def test_background_post_answers_at_once_and_get_streams_it(make_client: MakeClient) -> None:
    client = await make_client()
    stream_id = await background(client)
    assert re.fullmatch(r"chatcmpl-[0-9a-f]{32}", stream_id)  # 128 random bits
    resp = await client.get(f"/v1/streams/{stream_id}")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    assert resp.headers["X-Nexus-Stream-Id"] == stream_id
    events = parse_sse(await resp.read())
    assert content(events) == TEXT
    assert events[-1].data == "[DONE]"


@pytest.mark.parametrize(
    ("path", "body", "first_event"),
    [
        ("/v1/messages", {"max_tokens": 50}, "message_start"),
        ("/v1/responses", {"input": TEXT, "messages": None}, "response.created"),
    ],
)
async def test_get_defaults_to_the_format_of_the_endpoint_that_made_the_stream(
    make_client: MakeClient, path: str, body: dict[str, Any], first_event: str
) -> None:
    client = await make_client()
    payload = {k: v for k, v in {**chat(TEXT), **body}.items() if v is not None}
    resp = await client.post(path, json={**payload, "background": True})
    assert resp.status == 202, await resp.text()
    stream_id = (await resp.json())["id"]  # a background response's resp_ id names it too
    stream_id = stream_id.replace("resp_", "chatcmpl-")  # as its event ids do
    events = parse_sse(await (await client.get(f"/v1/streams/{stream_id}")).read())
    assert events[0].event == first_event
    assert all(event.id.startswith(stream_id + ".") for event in events)


@pytest.mark.parametrize(
    ("query", "headers", "media_type"),
    [
        ("?stream_format=ndjson", {}, "application/x-ndjson"),
        ("", {"X-Nexus-Stream-Format": "nexus"}, "application/vnd.nexus.events+sse"),
        ("", {"Accept": "application/x-ndjson"}, "application/x-ndjson"),
        ("", {"Accept": "text/event-stream"}, "text/event-stream"),
    ],
)
async def test_get_negotiates_any_format(
    make_client: MakeClient, query: str, headers: dict[str, str], media_type: str
) -> None:
    client = await make_client()
    stream_id = await background(client)
    resp = await client.get(f"/v1/streams/{stream_id}{query}", headers=headers)
    assert resp.headers["X-Nexus-Stream-Format"] == media_type
    body = await resp.read()
    assert b"three" in body


async def test_unknown_stream_is_404_stream_not_found(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.get("/v1/streams/chatcmpl-" + "0" * 32)
    assert resp.status == 404
    error = (await resp.json())["error"]
    assert error["code"] == "stream_not_found"
    assert error["type"] == "invalid_request_error"
    resp = await client.delete("/v1/streams/chatcmpl-" + "0" * 32)
    assert resp.status == 404


async def test_a_finished_stream_expires_after_resume_ttl(make_client: MakeClient) -> None:
    # A TTL wide enough that a loaded CI machine reaches the first GET within it.
    client = await make_client({"streams": {"resume_ttl_s": 1.0}})
    resp = await client.post("/v1/chat/completions", json=chat(TEXT, stream=True))
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    await resp.read()
    assert (await client.get(f"/v1/streams/{stream_id}")).status == 200
    await asyncio.sleep(1.1)
    resp = await client.get(f"/v1/streams/{stream_id}")
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "stream_not_found"


# --- ids and resume ---------------------------------------------------------------------


@pytest.mark.parametrize("fmt", SSE_FORMATS)
async def test_every_sse_frame_carries_an_id_after_the_retry_line(
    make_client: MakeClient, fmt: str
) -> None:
    client = await make_client({"server": {"retry_ms": 1500}})
    resp = await client.post(
        f"/v1/chat/completions?stream_format={fmt}", json=chat(TEXT, stream=True)
    )
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    body = await resp.read()
    # Step 0 (start()) for most formats; Anthropic's message_start leads step 1.
    assert body.startswith(b"retry: 1500\nid: " + stream_id.encode() + b".")
    frames = [f for f in body.split(b"\n\n") if f.strip()]
    ids = []
    for frame in frames:
        lines = frame.split(b"\n")
        found = [line for line in lines if line.startswith(b"id: ")]
        assert len(found) == 1, frame
        ids.append(found[0][4:].decode())
    assert all(i.startswith(stream_id + ".") for i in ids)
    assert len(set(ids)) == len(ids)


@pytest.mark.parametrize("options", ["include_usage", "include_cost"])
@pytest.mark.parametrize("fmt", [*SSE_FORMATS, "ndjson"])
async def test_resume_after_any_event_gives_exactly_the_rest(
    make_client: MakeClient, fmt: str, options: str
) -> None:
    """For every event a client may have seen last, GET with it returns the rest, byte for
    byte: rendered with the stream options it was asked with (the cost rides on a usage
    chunk, which ``include_cost`` alone asks for)."""
    prices = {"mock/echo": {"input_usd_per_mtok": 1, "output_usd_per_mtok": 2}}
    client = await make_client({"models": prices})
    body = {**chat(TEXT, stream=True, model="mock/echo"), "stream_options": {options: True}}
    resp = await client.post(f"/v1/chat/completions?stream_format={fmt}", json=body)
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    full = await resp.read()
    if fmt == "ndjson":
        lines = full.splitlines(keepends=True)
        points = [(str(n), b"".join(lines[n:])) for n in range(len(lines) + 1)]
    else:
        points = []
        offset = 0
        for frame in full.split(b"\n\n")[:-1]:
            offset += len(frame) + 2
            match = re.search(rb"^id: (\S+)$", frame, re.M)
            assert match is not None
            points.append((match[1].decode(), full[offset:]))
    assert len(points) > 5
    for last_id, rest in points:
        for how in ("header", "query"):
            if how == "header":
                resp = await client.get(
                    f"/v1/streams/{stream_id}?stream_format={fmt}",
                    headers={"Last-Event-ID": last_id},
                )
            else:
                resp = await client.get(
                    f"/v1/streams/{stream_id}?stream_format={fmt}&last_event_id={last_id}"
                )
            if not rest:
                assert resp.status == 204, last_id  # EventSource stops reconnecting on 204
                continue
            assert resp.status == 200
            assert await resp.read() == rest, (last_id, how)


async def test_a_dropped_live_stream_resumes_with_nothing_lost_or_repeated(
    make_client: MakeClient,
) -> None:
    gated = GatedProvider(before=3, after=3)
    client = await make_client(providers=[gated])
    resp = await client.post(
        "/v1/chat/completions?stream_format=nexus",
        json=chat(model="gated/m", stream=True, stream_options={"resumable": True}),
    )
    assert resp.headers["X-Nexus-Resumable"] == "true"
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    seen = b""
    while seen.count(b"event: delta") < 2:
        seen += await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    resp.close()  # the network drops
    last = parse_sse(seen)[-1].id
    await asyncio.sleep(0.05)
    assert not gated.closed.is_set()  # the stream runs on without its client
    resumed = await client.get(f"/v1/streams/{stream_id}", headers={"Last-Event-ID": last})
    assert resumed.headers["X-Nexus-Stream-Format"] == "text/event-stream"  # endpoint default
    resumed.close()
    resumed = await client.get(
        f"/v1/streams/{stream_id}?stream_format=nexus", headers={"Last-Event-ID": last}
    )
    gated.gate.set()
    rest = await resumed.read()
    texts = [
        orjson.loads(e.data)["delta"].get("content", "")
        for e in parse_sse(seen + rest)
        if e.event == "delta"
    ]
    assert "".join(texts) == "before0 before1 before2 after0 after1 after2 "
    assert rest.endswith(b'event: done\ndata: {"type":"done"}\n\n')


async def test_post_with_last_event_id_resumes_in_the_endpoints_format(
    make_client: MakeClient,
) -> None:
    client = await make_client()
    resp = await client.post("/v1/chat/completions", json=chat(TEXT, stream=True))
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    events = parse_sse(await resp.read())
    second = events[2].id
    resumed = await client.post(
        "/v1/chat/completions", json={"ignored": True}, headers={"Last-Event-ID": second}
    )
    assert resumed.status == 200
    rest = parse_sse(await resumed.read())
    assert [e.id for e in rest] == [e.id for e in events[3:]]
    # Another endpoint resumes the same stream in its own format.
    messages = await client.post("/v1/messages", json={}, headers={"Last-Event-ID": second})
    assert messages.headers["X-Nexus-Stream-Format"].endswith("anthropic-messages+sse")
    names = [e.event for e in parse_sse(await messages.read())]
    assert names[-1] == "message_stop"
    as_ndjson = await client.post(
        f"/v1/chat/completions?stream_format=ndjson&last_event_id={stream_id}.0", json={}
    )
    assert [line["type"] for line in ndjson(await as_ndjson.read())][-1] == "done"


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("not an id!", "is not an event id"),
        ("chatcmpl-" + "1" * 32 + ".x", "is not an event id"),
    ],
)
async def test_a_bad_last_event_id_is_400(
    make_client: MakeClient, value: str, message: str
) -> None:
    client = await make_client()
    stream_id = await background(client)
    resp = await client.get(f"/v1/streams/{stream_id}", headers={"Last-Event-ID": value})
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["code"] == "invalid_last_event_id"
    assert message in error["message"]


async def test_last_event_id_of_another_stream_is_400(make_client: MakeClient) -> None:
    client = await make_client()
    first, second = await background(client), await background(client)
    resp = await client.get(f"/v1/streams/{first}", headers={"Last-Event-ID": f"{second}.1"})
    assert resp.status == 400
    assert "another stream" in (await resp.json())["error"]["message"]


async def test_a_post_resumes_only_with_a_full_event_id(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post("/v1/chat/completions", json=chat(), headers={"Last-Event-ID": "3"})
    assert resp.status == 400
    assert (await resp.json())["error"]["code"] == "invalid_last_event_id"
    resp = await client.post(
        "/v1/chat/completions", json=chat(), headers={"Last-Event-ID": f"chatcmpl-{'a' * 32}.3"}
    )
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "stream_not_found"


async def test_an_empty_last_event_id_starts_from_the_beginning(make_client: MakeClient) -> None:
    client = await make_client()
    stream_id = await background(client)
    resp = await client.get(f"/v1/streams/{stream_id}", headers={"Last-Event-ID": ""})
    assert content(parse_sse(await resp.read())) == TEXT


# --- detach and cancel ------------------------------------------------------------------


async def test_a_stream_with_no_client_is_cancelled_after_detach_timeout(
    make_client: MakeClient,
) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client({"streams": {"detach_timeout_s": 0.2}}, providers=[gated])
    resp = await client.post(
        "/v1/chat/completions?stream_format=ndjson",
        json=chat(model="gated/m", stream=True),
        headers={"X-Nexus-Resumable": "true"},
    )
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    await asyncio.wait_for(resp.content.readline(), 5)
    loop = asyncio.get_running_loop()
    gone = loop.time()
    resp.close()
    await asyncio.wait_for(gated.closed.wait(), 5)
    assert gated.closed_at is not None and gated.closed_at - gone >= 0.15
    lines = ndjson(await (await client.get(f"/v1/streams/{stream_id}?stream_format=ndjson")).read())
    assert lines[0]["delta"]["content"] == "before0 "
    assert lines[-2]["error"]["code"] == "stream_detached"
    assert lines[-1] == {"type": "done"}


async def test_a_client_that_comes_back_in_time_keeps_the_stream(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=2)
    client = await make_client({"streams": {"detach_timeout_s": 0.3}}, providers=[gated])
    resp = await client.post(
        "/v1/chat/completions?stream_format=ndjson",
        json=chat(model="gated/m", stream=True, stream_options={"resumable": True}),
    )
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    await asyncio.wait_for(resp.content.readline(), 5)
    resp.close()
    await asyncio.sleep(0.1)
    back = await client.get(f"/v1/streams/{stream_id}?stream_format=ndjson&last_event_id=1")
    await asyncio.sleep(0.4)  # past the detach timeout: attached, so it keeps running
    assert not gated.closed.is_set()
    gated.gate.set()
    lines = ndjson(await back.read())
    assert [line.get("delta", {}).get("content") for line in lines[:2]] == ["after0 ", "after1 "]
    assert lines[-1] == {"type": "done"}


async def test_a_background_stream_nobody_reads_is_cancelled(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client({"streams": {"detach_timeout_s": 0.1}}, providers=[gated])
    resp = await client.post(
        "/v1/chat/completions", json=chat(model="gated/m", stream=True, background=True)
    )
    assert resp.status == 202
    await asyncio.wait_for(gated.closed.wait(), 5)


async def test_delete_cancels_a_running_stream(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(providers=[gated])
    stream_id = await background(client, model="gated/m")
    reader = await client.get(f"/v1/streams/{stream_id}?stream_format=ndjson")
    await asyncio.wait_for(reader.content.readline(), 5)
    resp = await client.delete(f"/v1/streams/{stream_id}")
    assert resp.status == 200
    assert await resp.json() == {
        "id": stream_id,
        "url": f"/v1/streams/{stream_id}",
        "status": "cancelled",
        "resumable": True,
    }
    assert gated.closed.is_set()
    assert not gated.gate.is_set()
    rest = ndjson(await asyncio.wait_for(reader.read(), 5))
    assert rest[-1]["type"] == "done"
    # Idempotent: the status of a stream that is over.
    again = await client.delete(f"/v1/streams/{stream_id}")
    assert (await again.json())["status"] == "cancelled"


async def test_delete_of_a_finished_stream_reports_it(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post("/v1/chat/completions", json=chat(stream=True))
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    await resp.read()
    await asyncio.sleep(0.05)
    done = await client.delete(f"/v1/streams/{stream_id}")
    assert (await done.json())["status"] == "completed"


async def test_a_stream_that_failed_before_output_is_attached_with_its_error(
    make_client: MakeClient,
) -> None:
    """The resource exists: GET answers 200 and the stream carries the failure."""
    client = await make_client()
    body = chat(stream=True, background=True, mock={"fail_after": 0})
    stream_id = (await (await client.post("/v1/chat/completions", json=body)).json())["id"]
    resp = await client.get(f"/v1/streams/{stream_id}")
    assert resp.status == 200
    events = parse_sse(await resp.read())
    assert events[-2].event == "error"
    assert orjson.loads(events[-2].data)["error"]["code"] == "upstream_error"
    assert events[-1].data == "[DONE]"


async def test_background_request_errors_come_back_at_once(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post(
        "/v1/chat/completions", json=chat(model="nope/x", stream=True, background=True)
    )
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "model_not_found"


async def test_a_stream_past_max_stream_duration_is_ended(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client({"limits": {"max_stream_duration_s": 0.3}}, providers=[gated])
    resp = await client.post(
        "/v1/chat/completions?stream_format=ndjson", json=chat(model="gated/m", stream=True)
    )
    lines = ndjson(await asyncio.wait_for(resp.read(), 5))
    assert lines[0]["delta"]["content"] == "before0 "
    assert lines[-2]["error"]["code"] == "max_stream_duration"
    assert lines[-1] == {"type": "done"}
    assert gated.closed.is_set()


# --- curl ---------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
async def test_curl_resumes_with_last_event_id(make_client: MakeClient) -> None:
    client = await make_client()
    stream_id = await background(client)
    url = f"http://{client.server.host}:{client.server.port}/v1/streams/{stream_id}"
    full = await _curl(url)
    events = parse_sse(full)
    last = events[3].id
    rest = await _curl(url, "-H", f"Last-Event-ID: {last}")
    assert [e.id for e in parse_sse(rest)] == [e.id for e in events[4:]]


async def _curl(url: str, *args: str) -> bytes:
    proc = await asyncio.create_subprocess_exec(
        "curl", "-sSN", *args, url, stdout=asyncio.subprocess.PIPE
    )
    out, _ = await asyncio.wait_for(proc.communicate(), 10)
    assert proc.returncode == 0
    return out


async def test_an_id_past_what_a_live_stream_has_sent_is_204_at_once(
    make_client: MakeClient,
) -> None:
    """No client was sent it: answered like an id past a finished stream's end, rather than
    attached until the stream ends (a reader held, a plain stream kept running, no byte)."""
    gated = GatedProvider(before=2, after=2)
    client = await make_client(providers=[gated])
    resp = await client.post("/v1/chat/completions", json=chat(model="gated/m", stream=True))
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    seen = b""
    while seen.count(b"before") < 2:
        seen += await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    last = parse_sse(seen)[-1].id
    step = int(last.rsplit(".", 1)[1])
    try:
        for beyond in (
            f"{stream_id}.{step + 1}",
            f"{stream_id}.999999",
            f"{stream_id}.{step + 1}.0",
        ):
            headers = {"Last-Event-ID": beyond}
            answer = await asyncio.wait_for(
                client.get(f"/v1/streams/{stream_id}", headers=headers), 5
            )
            assert answer.status == 204, beyond  # (its headers come, at once, either way)
            assert await answer.read() == b""
            posted = client.post("/v1/chat/completions", json=chat(stream=True), headers=headers)
            assert (await asyncio.wait_for(posted, 5)).status == 204
        for count in (str(step + 1), "999999"):  # a count past the log (NDJSON)
            url = f"/v1/streams/{stream_id}?stream_format=ndjson&last_event_id={count}"
            assert (await asyncio.wait_for(client.get(url), 5)).status == 204
        # The last id it sent still attaches, and gets the rest.
        headers = {"Last-Event-ID": last}
        resumed = await asyncio.wait_for(client.get(f"/v1/streams/{stream_id}", headers=headers), 5)
        assert resumed.status == 200
    finally:
        gated.gate.set()  # (without the rule, a hold until the end: the test ends)
    assert content(parse_sse(await resumed.read())) == "after0 after1 "
    assert content(parse_sse(seen + await resp.read())) == "before0 before1 after0 after1 "
