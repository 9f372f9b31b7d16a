"""Two gateway replicas on one Redis: a stream started on one resumes, joins, replays on the other.

Runs against the real Redis at 127.0.0.1:6379 (skipped with the reason when
there is none, failed under ``CI=true``).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator
from typing import Any

import orjson

from nexus import Provider
from nexus.auth import hash_key
from nexus.events import Delta, StreamEvent, Usage
from nexus.request import ChatRequest
from nexus.server.state import HUB
from redis_support import REDIS_URL
from support import GatedProvider, MakeClient, chat, parse_sse


def redis_config(prefix: str, **tables: Any) -> dict[str, Any]:
    return {"store": {"kind": "redis", "url": REDIS_URL, "prefix": prefix}, **tables}


def ndjson(body: bytes) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in body.splitlines() if line]


def text_of(lines: list[dict[str, Any]]) -> str:
    return "".join(line["delta"].get("content") or "" for line in lines if line["type"] == "delta")


class EmojiProvider(Provider):
    """Ten deltas of 1,500 emoji each (4 bytes of UTF-8 per character), apart: most
    land in log entries of their own in Redis (a trim drops whole entries)."""

    kind = "emoji"

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        for _ in range(10):
            yield [Delta(content="\U0001f600" * 1500)]
            await asyncio.sleep(0.03)
        yield [Delta(finish_reason="stop")]
        yield [Usage(prompt_tokens=1, completion_tokens=10, total_tokens=11)]


async def kept(client: Any) -> None:
    """Until the replica's runs have handed their logs to the store."""
    async with asyncio.timeout(5):
        while client.app[HUB].live:
            await asyncio.sleep(0.01)


async def test_a_stream_started_on_one_replica_resumes_on_the_other(
    make_client: MakeClient, prefix: str
) -> None:
    gated = GatedProvider(before=2, after=2)
    config = redis_config(prefix, streams={"detach_timeout_s": 0.3})
    one = await make_client(config, providers=[gated])
    two = await make_client(config, providers=[GatedProvider()])
    resp = await one.post(
        "/v1/chat/completions?stream_format=nexus",
        json=chat(model="gated/m", stream=True),
        headers={"X-Nexus-Resumable": "true"},
    )
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    seen = b""
    while seen.count(b"event: delta") < 1:
        seen += await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    resp.close()  # the connection drops; the load balancer sends the reconnect elsewhere
    last = parse_sse(seen)[-1].id
    resumed = await two.get(
        f"/v1/streams/{stream_id}?stream_format=nexus", headers={"Last-Event-ID": last}
    )
    assert resumed.status == 200
    assert stream_id not in two.app[HUB].live  # followed from Redis, not run here
    # Attached on replica two, so replica one does not cancel it as detached.
    await asyncio.sleep(0.8)
    assert not gated.closed.is_set()
    gated.gate.set()
    rest = await asyncio.wait_for(resumed.read(), 10)
    texts = [
        orjson.loads(e.data)["delta"].get("content", "")
        for e in parse_sse(seen + rest)
        if e.event == "delta"
    ]
    assert "".join(texts) == "before0 before1 after0 after1 "
    assert rest.endswith(b'event: done\ndata: {"type":"done"}\n\n')
    # Once finished, either replica replays it, byte for byte the same.
    await asyncio.sleep(0.1)
    a = await (await one.get(f"/v1/streams/{stream_id}?stream_format=ndjson")).read()
    b = await (await two.get(f"/v1/streams/{stream_id}?stream_format=ndjson")).read()
    assert a == b
    assert text_of(ndjson(a)) == "before0 before1 after0 after1 "


async def test_resume_on_the_other_replica_is_exact_from_every_event(
    make_client: MakeClient, prefix: str
) -> None:
    one = await make_client(redis_config(prefix))
    two = await make_client(redis_config(prefix))
    resp = await one.post(
        "/v1/messages",
        json={**chat("a b c d e", stream=True), "max_tokens": 20},
    )
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    full = await resp.read()
    await asyncio.sleep(0.1)
    offset = 0
    for frame in full.split(b"\n\n")[:-1]:
        offset += len(frame) + 2
        last_id = next(line for line in frame.split(b"\n") if line.startswith(b"id: "))[4:]
        rest = await two.get(
            f"/v1/streams/{stream_id}", headers={"Last-Event-ID": last_id.decode()}
        )
        if offset == len(full):
            assert rest.status == 204
        else:
            assert await rest.read() == full[offset:]


async def test_a_stream_nobody_follows_anywhere_is_cancelled(
    make_client: MakeClient, prefix: str
) -> None:
    gated = GatedProvider(before=1, after=1)
    one = await make_client(
        redis_config(prefix, streams={"detach_timeout_s": 0.2}), providers=[gated]
    )
    resp = await one.post(
        "/v1/chat/completions", json=chat(model="gated/m", stream=True, background=True)
    )
    assert resp.status == 202
    await asyncio.wait_for(gated.closed.wait(), 5)


async def test_recordings_and_in_flight_requests_are_shared(
    make_client: MakeClient, prefix: str
) -> None:
    gated = GatedProvider(before=1, after=1)
    other = GatedProvider()
    config = redis_config(prefix, cache={"enabled": True})
    one = await make_client(config, providers=[gated])
    two = await make_client(config, providers=[other])
    body = chat(model="gated/m", stream=True)
    first = await one.post("/v1/chat/completions?stream_format=ndjson", json=body)
    assert first.headers["X-Nexus-Cache"] == "miss"
    await asyncio.wait_for(first.content.readline(), 5)
    joined = await two.post("/v1/chat/completions?stream_format=ndjson", json=body)
    assert joined.headers["X-Nexus-Cache"] == "hit"  # joined replica one's stream
    gated.gate.set()
    expected = "before0 after0 "
    lines = ndjson(await asyncio.wait_for(joined.read(), 10))
    assert lines[0]["type"] == "delta"  # the log so far came at once, not after a heartbeat
    assert text_of(lines) == expected
    await first.read()
    assert not other.started.is_set()  # replica two never called its provider
    await asyncio.sleep(0.1)
    replay = await two.post("/v1/chat/completions?stream_format=ndjson", json=body)
    assert replay.headers["X-Nexus-Cache"] == "hit"
    assert text_of(ndjson(await replay.read())) == expected
    assert not other.started.is_set()


async def test_a_websocket_turn_follows_a_stream_it_joined_on_the_other_replica(
    make_client: MakeClient, prefix: str
) -> None:
    # The turn reads replica one's log from Redis (not a local run): it waits in a task.
    gated = GatedProvider(before=1, after=2)
    config = redis_config(prefix, cache={"enabled": True})
    one = await make_client(config, providers=[gated])
    two = await make_client(config, providers=[GatedProvider()])
    body = chat(model="gated/m", stream=True)
    first = await one.post("/v1/chat/completions?stream_format=ndjson", json=body)
    await asyncio.wait_for(first.content.readline(), 5)
    async with two.ws_connect("/v1/realtime") as ws:
        await ws.send_str(orjson.dumps({"type": "start", "request": body}).decode())
        frame = await asyncio.wait_for(ws.receive_json(), 5)
        assert frame == {"type": "delta", "delta": {"content": "before0 "}}
        assert not two.app[HUB].live  # followed from Redis, not run here
        gated.gate.set()
        frames = [frame]
        while frames[-1]["type"] not in ("done", "error"):
            frames.append(await asyncio.wait_for(ws.receive_json(), 5))
    assert text_of(frames) == "before0 after0 after1 "
    assert frames[-1] == {"type": "done"}
    await first.read()


async def test_cancel_answers_409_on_a_replica_that_does_not_run_the_stream(
    make_client: MakeClient, prefix: str
) -> None:
    gated = GatedProvider(before=1, after=1)
    one = await make_client(redis_config(prefix), providers=[gated])
    two = await make_client(redis_config(prefix))
    resp = await one.post(
        "/v1/chat/completions?stream_format=ndjson", json=chat(model="gated/m", stream=True)
    )
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    await asyncio.wait_for(resp.content.readline(), 5)
    await asyncio.sleep(0.05)
    refused = await two.delete(f"/v1/streams/{stream_id}")
    assert refused.status == 409
    assert (await refused.json())["error"]["code"] == "stream_not_local"
    done = await one.delete(f"/v1/streams/{stream_id}")
    assert (await done.json())["status"] == "cancelled"
    resp.close()


async def test_a_cancel_that_stops_nothing_elsewhere_takes_a_token_and_one_that_stops_is_free(
    make_client: MakeClient, prefix: str
) -> None:
    """A 409 stops nothing: it is metered as any request (it was free, each one two Redis
    round trips, without bound); the cancel on the replica that runs it stays free."""
    key = "nx-cancel-rate-0123456789"
    keys = {"keys": [{"name": "alpha", "sha256": hash_key(key)}]}
    config = redis_config(prefix, auth=keys, limits={"requests_per_second_per_key": 0.2})
    gated = GatedProvider(before=1, after=1)
    one = await make_client(config, providers=[gated])
    two = await make_client(config, providers=[GatedProvider()])
    headers = {"Authorization": f"Bearer {key}"}
    body = chat(model="gated/m", stream=True, background=True)
    made = await (await one.post("/v1/chat/completions", json=body, headers=headers)).json()
    await asyncio.wait_for(gated.started.wait(), 5)  # the key's one token is spent
    elsewhere = await two.delete(f"/v1/streams/{made['id']}", headers=headers)
    assert elsewhere.status == 429
    assert (await elsewhere.json())["error"]["code"] == "rate_limited"
    done = await one.delete(f"/v1/streams/{made['id']}", headers=headers)
    assert (await done.json())["status"] == "cancelled"


async def test_a_stream_that_finished_under_max_log_bytes_resumes_whole_on_every_replica(
    make_client: MakeClient, prefix: str
) -> None:
    # About 16 kB as max_log_bytes counts it (128 + characters per delta), 60 kB of UTF-8.
    config = redis_config(prefix, streams={"max_log_bytes": 20_000})
    one = await make_client(config, providers=[EmojiProvider("emoji")])
    two = await make_client(config)
    resp = await one.post(
        "/v1/chat/completions?stream_format=ndjson", json=chat(model="emoji/m", stream=True)
    )
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    full = await resp.read()
    assert full.endswith(b'{"type":"done"}\n')
    await kept(one)
    for replica in (one, two):
        again = await replica.get(f"/v1/streams/{stream_id}?stream_format=ndjson")
        assert again.status == 200, await again.text()
        assert await again.read() == full


async def test_a_background_request_joining_a_plain_stream_on_another_replica_makes_it_resumable(
    make_client: MakeClient, prefix: str
) -> None:
    gated = GatedProvider(before=1, after=2)
    config = redis_config(prefix, cache={"enabled": True}, streams={"detach_timeout_s": 30})
    one = await make_client(config, providers=[gated])
    two = await make_client(config, providers=[GatedProvider()])
    body = chat(model="gated/m", stream=True)
    plain = await one.post("/v1/chat/completions?stream_format=ndjson", json=body)
    assert plain.headers["X-Nexus-Resumable"] == "false"
    stream_id = plain.headers["X-Nexus-Stream-Id"]
    await asyncio.wait_for(plain.content.readline(), 5)
    accepted = await two.post("/v1/chat/completions", json={**body, "background": True})
    assert accepted.status == 202
    assert accepted.headers["X-Nexus-Cache"] == "hit"
    described = await accepted.json()
    assert described["id"] == stream_id
    assert described["resumable"] is True
    plain.close()  # its only client here leaves: replica one learns it is resumable
    run = one.app[HUB].live[stream_id]
    async with asyncio.timeout(5):
        while not run.info.resumable:
            await asyncio.sleep(0.01)
    assert not run.ending
    gated.gate.set()
    got = await two.get(f"{described['url']}&stream_format=ndjson")
    lines = ndjson(await asyncio.wait_for(got.read(), 10))
    assert text_of(lines) == "before0 after0 after1 "
    assert lines[-1] == {"type": "done"}


async def test_a_resumable_stream_ends_a_detach_timeout_after_its_follower_elsewhere_left(
    make_client: MakeClient, prefix: str
) -> None:
    gated = GatedProvider(before=1, after=1)
    config = redis_config(prefix, streams={"detach_timeout_s": 2})
    one = await make_client(config, providers=[gated])
    two = await make_client(config)
    origin = await one.post(
        "/v1/chat/completions?stream_format=ndjson",
        json=chat(model="gated/m", stream=True),
        headers={"X-Nexus-Resumable": "true"},
    )
    stream_id = origin.headers["X-Nexus-Stream-Id"]
    await asyncio.wait_for(origin.content.readline(), 5)
    follower = await two.get(f"/v1/streams/{stream_id}?stream_format=ndjson")
    await asyncio.wait_for(follower.content.readline(), 5)
    origin.close()
    run = one.app[HUB].live[stream_id]
    async with asyncio.timeout(5):
        while run.attached:  # replica one has no client of its own left
            await asyncio.sleep(0.01)
    follower.close()
    left = asyncio.get_running_loop().time()
    await asyncio.wait_for(gated.closed.wait(), 10)
    assert gated.closed_at is not None
    waited = gated.closed_at - left
    # detach_timeout_s after the last reader anywhere left: not a lease's full TTL (twice
    # that), nor that and a whole detach_timeout_s more once the owner found the lease.
    assert 2 - 0.05 <= waited < 2 + 1.0


async def test_a_cancel_elsewhere_says_where_it_runs_or_that_its_replica_died(
    make_client: MakeClient, prefix: str, monkeypatch: Any
) -> None:
    """A stream running on another replica is that replica's to cancel (409); one whose
    replica died (its keep-alive gone: readers get stream_lost) was answered the same 409,
    "runs on another replica", though none ever would run it again. It is ``failed``."""
    gated = GatedProvider(before=1, after=1)
    config = redis_config(prefix)
    one = await make_client(config, providers=[gated])
    two = await make_client(config, providers=[GatedProvider()])
    body = chat(model="gated/m", stream=True, background=True)
    made = await (await one.post("/v1/chat/completions", json=body)).json()
    await asyncio.wait_for(gated.started.wait(), 5)
    elsewhere = await two.delete(f"/v1/streams/{made['id']}")
    assert elsewhere.status == 409
    assert (await elsewhere.json())["error"]["code"] == "stream_not_local"

    async def dead(stream_id: str) -> bool:
        return False

    monkeypatch.setattr(two.app[HUB].store, "alive", dead)
    lost = await two.delete(f"/v1/streams/{made['id']}")
    assert lost.status == 200
    assert (await lost.json())["status"] == "failed"
    # So does its response object, polled or cancelled (it said in_progress until the
    # stream's keys expired).
    for answer in (
        await two.get(f"/v1/responses/{made['id']}"),
        await two.post(f"/v1/responses/{made['id']}/cancel"),
    ):
        body = await answer.json()
        assert (body["status"], body["error"]["code"]) == ("failed", "server_error"), body
    gated.gate.set()


async def test_a_response_that_ends_elsewhere_while_it_is_polled_reads_as_it_ended(
    make_client: MakeClient, prefix: str, monkeypatch: Any
) -> None:
    """Read in progress, then found without its keep-alive: it may have ended meanwhile
    (its end lets the keep-alive go), and then it is not lost. It read failed."""
    config = redis_config(prefix)
    one = await make_client(config)
    two = await make_client(config)
    body = {"model": "mock/echo", "input": "one two", "background": True}
    made = await (await one.post("/v1/responses", json=body)).json()
    await kept(one)
    hub = two.app[HUB]
    real_info = hub.info
    stale = [True]

    async def info(stream_id: str) -> Any:
        found = await real_info(stream_id)
        if stale and found is not None:  # the first read: before its end landed
            stale.clear()
            return dataclasses.replace(found, status="in_progress")
        return found

    async def gone(stream_id: str) -> bool:
        return False

    monkeypatch.setattr(hub, "info", info)
    monkeypatch.setattr(hub.store, "alive", gone)
    polled = await (await two.get(f"/v1/responses/{made['id']}")).json()
    assert polled["status"] == "completed", polled
    assert polled["output"][0]["content"][0]["text"] == "one two"
