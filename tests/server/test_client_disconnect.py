"""A client that goes away cancels its upstream at once, unless its stream is resumable.

Before, every stream ran on for ``[streams] detach_timeout_s`` (15 s) after its
client left, for a resume that the openai and anthropic SDKs never make: the
upstream kept generating, and billing, for nobody. Now the last reader of a stream
that is not resumable cancels it, and the upstream connection closes within
100 ms; the stream's log ends with ``client_disconnect``. A stream is resumable
when it was started with ``"background": true``, asked for it
(``"stream_options": {"resumable": true}``, or ``X-Nexus-Resumable: true``), and
is kept running while another client reads it.

The SDK tests run against a real ``nexus serve`` whose provider is a fake
upstream in this process (:mod:`upstreams`): the fake's handler is cancelled the
moment the gateway drops its connection, which is what is measured.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest

from nexus.cache.readers import LEASE_S
from nexus.cache.recording import cache_key
from nexus.request import ChatRequest
from nexus.server.state import HUB
from nexus_process import start_nexus, stop_nexus
from redis_support import REDIS_URL
from support import GatedProvider, MakeClient, parse_sse
from support import chat as support_chat
from upstreams import DONE, FakeUpstream, Reply, openai_chunk

CHAT = "/v1/chat/completions"
KEY_ENV = "NEXUS_TEST_DISCONNECT_KEY"
WORDS = 60  # one every 50 ms: 3 s, far longer than any test waits for it


def slow_reply(words: int = WORDS, delay: float = 0.05) -> Reply:
    """An OpenAI upstream that sends ``words`` deltas, one per ``delay``."""
    frames = [openai_chunk(role="assistant", content="")]
    frames += [openai_chunk(content=f"w{i} ") for i in range(words)]
    frames += [openai_chunk(finish_reason="stop"), DONE]
    return Reply.stream(frames, delay=[0.0] + [delay] * (len(frames) - 1))


def provider(fake: FakeUpstream) -> dict[str, Any]:
    return {"kind": "openai", "base_url": fake.url + "/v1", "api_key_env": KEY_ENV}


def body(**extra: Any) -> dict[str, Any]:
    return {"model": "up/gpt-up", "messages": [{"role": "user", "content": "Hi"}], **extra}


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-test-disconnect")


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


@pytest.fixture
def serve(tmp_path: Path) -> Iterator[Any]:
    """``serve(toml)``: a ``nexus serve`` process with that config; its URL."""
    procs = []

    def start(toml: str) -> str:
        config = tmp_path / "config.toml"
        config.write_text(toml)
        proc, match = start_nexus(config, tmp_path / "nexus.log")
        procs.append(proc)
        return match.group(1)

    yield start
    for proc in procs:
        stop_nexus(proc, gently=False)


def upstream_toml(fake: FakeUpstream) -> str:
    """The fake as provider ``up``, every other setting its default (detach_timeout_s: 15)."""
    return (
        f'[providers.up]\nkind = "openai"\nbase_url = "{fake.url}/v1"\napi_key_env = "{KEY_ENV}"\n'
    )


async def terminal_code(url: str, stream_id: str) -> str | None:
    """The code of the error that ends the stream's log (None: it ended well)."""
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{url}/v1/streams/{stream_id}?stream_format=ndjson") as resp,
    ):
        assert resp.status == 200, await resp.text()
        lines = [orjson.loads(line) for line in (await resp.read()).splitlines()]
    assert lines[-1]["type"] == "done"
    errors = [line["error"]["code"] for line in lines if line["type"] == "error"]
    return errors[-1] if errors else None


async def cancellations(url: str, cause: str) -> float:
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    prefix = f'nexus_cancellations_total{{cause="{cause}"}} '
    return sum(float(line[len(prefix) :]) for line in text.splitlines() if line.startswith(prefix))


# --- the SDKs, against a real ``nexus serve``: the upstream closes within 100 ms ----------


async def test_an_openai_sdk_client_that_leaves_closes_the_upstream_at_once(
    serve: Any, upstream: FakeUpstream
) -> None:
    upstream.add(slow_reply())
    url = serve(upstream_toml(upstream))
    loop = asyncio.get_running_loop()
    async with openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0) as api:
        stream = await api.chat.completions.create(
            model="up/gpt-up", messages=[{"role": "user", "content": "Hi"}], stream=True
        )
        seen = 0
        async for chunk in stream:
            stream_id = chunk.id
            seen += 1
            if seen == 3:
                break
        gone = loop.time()
        await stream.close()
        ended = await upstream.requests[0].wait_ended(5)
    assert ended - gone < 0.1, f"the upstream ran {ended - gone:.3f}s past its client"
    assert upstream.requests[0].cancelled
    assert upstream.requests[0].chunks_sent < WORDS
    # The log says why it ended; counted once, as the client that left.
    assert await terminal_code(url, stream_id) == "client_disconnect"
    assert await cancellations(url, "client_disconnect") == 1
    assert await cancellations(url, "detach_timeout") == 0


async def test_an_anthropic_sdk_client_that_leaves_closes_the_upstream_at_once(
    serve: Any, upstream: FakeUpstream
) -> None:
    upstream.add(slow_reply())
    url = serve(upstream_toml(upstream))
    loop = asyncio.get_running_loop()
    async with anthropic.AsyncAnthropic(base_url=url, api_key="unused", max_retries=0) as api:
        stream = await api.messages.create(
            model="up/gpt-up",
            max_tokens=100,
            messages=[{"role": "user", "content": "Hi"}],
            stream=True,
        )
        texts = 0
        async for event in stream:
            if event.type == "content_block_delta":
                texts += 1
                if texts == 2:
                    break
        gone = loop.time()
        await stream.close()
        ended = await upstream.requests[0].wait_ended(5)
    assert ended - gone < 0.1, f"the upstream ran {ended - gone:.3f}s past its client"
    assert upstream.requests[0].chunks_sent < WORDS


# --- resumable streams outlive their client for detach_timeout_s -------------------------


async def leave_early(resp: aiohttp.ClientResponse, events: int = 2) -> tuple[str, str]:
    """Read ``events`` SSE events of a streaming answer, then drop the connection: the
    stream id and the last event id seen."""
    seen = b""
    while seen.count(b"\n\n") < events:
        seen += await asyncio.wait_for(resp.content.readuntil(b"\n\n"), 5)
    resp.close()
    last = parse_sse(seen)[-1].id
    assert last is not None
    return resp.headers["X-Nexus-Stream-Id"], last


def text_after(body: bytes) -> str:
    out = []
    for event in parse_sse(body):
        if event.data.startswith("{"):
            for choice in orjson.loads(event.data).get("choices", []):
                out.append(choice["delta"].get("content") or "")
    return "".join(out)


@pytest.mark.parametrize(
    ("extra", "headers"),
    [
        ({"stream_options": {"resumable": True}}, {}),
        ({"stream_options": {"include_usage": True, "resumable": True}}, {}),
        ({}, {"X-Nexus-Resumable": "true"}),
        ({}, {"X-Nexus-Resumable": "TRUE"}),
    ],
    ids=["body", "body-with-usage", "header", "header-any-case"],
)
async def test_a_resumable_stream_outlives_its_client_and_resumes(
    make_client: MakeClient,
    upstream: FakeUpstream,
    extra: dict[str, Any],
    headers: dict[str, str],
) -> None:
    upstream.add(slow_reply(words=12, delay=0.03))
    client = await make_client(
        {"providers": {"up": provider(upstream)}, "streams": {"detach_timeout_s": 0.5}}
    )
    resp = await client.post(CHAT, json=body(stream=True, **extra), headers=headers)
    assert resp.status == 200
    assert resp.headers["X-Nexus-Resumable"] == "true"
    stream_id, last = await leave_early(resp)
    await asyncio.sleep(0.2)
    assert not upstream.requests[0].ended.is_set()  # it runs on without its client
    info = await client.get(f"/v1/streams/{stream_id}", headers={"Last-Event-ID": last})
    assert info.status == 200
    assert info.headers["X-Nexus-Resumable"] == "true"
    rest = await info.read()
    assert text_after(rest) == "".join(f"w{i} " for i in range(1, 12))
    assert rest.endswith(b"data: [DONE]\n\n")
    # Never sent upstream; the request it made is the plain one.
    sent = upstream.requests[0].body
    assert "resumable" not in sent["stream_options"]


async def test_a_resumable_stream_nobody_comes_back_to_ends_as_detached(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(slow_reply())
    client = await make_client(
        {"providers": {"up": provider(upstream)}, "streams": {"detach_timeout_s": 0.3}}
    )
    resp = await client.post(
        f"{CHAT}?stream_format=ndjson", json=body(stream=True), headers={"X-Nexus-Resumable": "1"}
    )
    assert resp.status == 400  # only true or false
    resp = await client.post(
        f"{CHAT}?stream_format=ndjson",
        json=body(stream=True),
        headers={"X-Nexus-Resumable": "true"},
    )
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    await asyncio.wait_for(resp.content.readline(), 5)
    loop = asyncio.get_running_loop()
    gone = loop.time()
    resp.close()
    ended = await upstream.requests[0].wait_ended(5)
    assert 0.25 <= ended - gone < 1.0
    lines = [
        orjson.loads(line)
        for line in (
            await (await client.get(f"/v1/streams/{stream_id}?stream_format=ndjson")).read()
        ).splitlines()
        if line.startswith(b"{")
    ]
    assert any(line.get("error", {}).get("code") == "stream_detached" for line in lines), lines


async def test_a_background_stream_outlives_its_reader_and_resumes(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(slow_reply(words=12, delay=0.03))
    client = await make_client(
        {"providers": {"up": provider(upstream)}, "streams": {"detach_timeout_s": 0.5}}
    )
    started = await client.post(CHAT, json=body(stream=True, background=True))
    assert started.status == 202
    data = await started.json()
    assert data["resumable"] is True
    assert started.headers["X-Nexus-Resumable"] == "true"
    resp = await client.get(data["url"])
    assert resp.headers["X-Nexus-Resumable"] == "true"
    stream_id, last = await leave_early(resp)
    assert stream_id == data["id"]
    await asyncio.sleep(0.2)
    assert not upstream.requests[0].ended.is_set()
    rest = await (await client.get(data["url"], headers={"Last-Event-ID": last})).read()
    assert text_after(rest) == "".join(f"w{i} " for i in range(1, 12))


# --- a stream that is not resumable ---------------------------------------------------


async def test_a_plain_stream_says_it_is_not_resumable_and_ends_with_its_client(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(slow_reply())
    client = await make_client({"providers": {"up": provider(upstream)}})  # detach_timeout_s 15
    resp = await client.post(CHAT, json=body(stream=True), headers={"X-Nexus-Resumable": "false"})
    assert resp.headers["X-Nexus-Resumable"] == "false"
    stream_id, _ = await leave_early(resp)
    gone = asyncio.get_running_loop().time()
    ended = await upstream.requests[0].wait_ended(5)
    assert ended - gone < 0.1
    got = await client.get(f"/v1/streams/{stream_id}?stream_format=ndjson")
    assert got.headers["X-Nexus-Resumable"] == "false"
    lines = [orjson.loads(line) for line in (await got.read()).splitlines()]
    assert lines[-2]["error"]["code"] == "client_disconnect"
    assert "not resumable" in lines[-2]["error"]["message"]


async def test_a_follower_keeps_a_stream_its_origin_left_until_it_leaves_too(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """A GET follower keeps a plain stream running past its origin; when the last reader
    leaves, the stream is not resumable: it is cancelled at once."""
    upstream.add(slow_reply())
    client = await make_client({"providers": {"up": provider(upstream)}})
    origin = await client.post(f"{CHAT}?stream_format=ndjson", json=body(stream=True))
    stream_id = origin.headers["X-Nexus-Stream-Id"]
    await asyncio.wait_for(origin.content.readline(), 5)
    follower = await client.get(f"/v1/streams/{stream_id}?stream_format=ndjson")
    assert follower.headers["X-Nexus-Resumable"] == "false"
    await asyncio.wait_for(follower.content.readline(), 5)
    origin.close()
    await asyncio.sleep(0.2)
    assert not upstream.requests[0].ended.is_set()  # the follower still reads it
    lines = [await asyncio.wait_for(follower.content.readline(), 5) for _ in range(3)]
    assert all(orjson.loads(line)["type"] == "delta" for line in lines)
    gone = asyncio.get_running_loop().time()
    follower.close()
    ended = await upstream.requests[0].wait_ended(5)
    assert ended - gone < 0.1


async def test_a_follower_reads_to_the_end_after_its_origin_left(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(slow_reply(words=10, delay=0.03))
    client = await make_client({"providers": {"up": provider(upstream)}})
    origin = await client.post(f"{CHAT}?stream_format=ndjson", json=body(stream=True))
    stream_id = origin.headers["X-Nexus-Stream-Id"]
    await asyncio.wait_for(origin.content.readline(), 5)
    follower = await client.get(f"/v1/streams/{stream_id}?stream_format=ndjson")
    await asyncio.wait_for(follower.content.readline(), 5)
    origin.close()
    lines = [orjson.loads(line) for line in (await follower.read()).splitlines()]
    assert lines[-1] == {"type": "done"}
    assert not any(line["type"] == "error" for line in lines)


# --- the option at the boundary ---------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "request_body"),
    [
        (CHAT, body(stream=True, stream_options={"resumable": "yes"})),
        (CHAT, body(stream=True, stream_options={"resumable": 1})),
        ("/v1/messages", {**body(stream=True, max_tokens=5), "stream_options": {"resumable": 0}}),
        (
            "/v1/responses",
            {"model": "up/gpt-up", "input": "Hi", "stream_options": {"resumable": "true"}},
        ),
    ],
)
async def test_a_resumable_that_is_not_a_boolean_is_400(
    make_client: MakeClient, path: str, request_body: dict[str, Any]
) -> None:
    client = await make_client()
    resp = await client.post(path, json=request_body)
    assert resp.status == 400
    text = await resp.text()
    assert "invalid_request" in text
    assert "stream_options.resumable" in text


@pytest.mark.parametrize("value", ["yes", "1", "", "true, true", "on"])
async def test_a_resumable_header_other_than_true_or_false_is_400(
    make_client: MakeClient, value: str
) -> None:
    client = await make_client()
    resp = await client.post(
        CHAT, json={**body(stream=True), "model": "mock/echo"}, headers={"X-Nexus-Resumable": value}
    )
    assert resp.status == 400
    error = (await resp.json())["error"]
    assert error["code"] == "invalid_request"
    assert error["param"] == "X-Nexus-Resumable"


@pytest.mark.parametrize(
    ("path", "request_body", "headers"),
    [
        (
            "/v1/messages",
            {**body(stream=True, max_tokens=5), "stream_options": {"resumable": True}},
            {},
        ),
        ("/v1/messages", body(stream=True, max_tokens=5), {"X-Nexus-Resumable": "true"}),
        (
            "/v1/responses",
            {
                "model": "up/gpt-up",
                "input": "Hi",
                "stream": True,
                "stream_options": {"resumable": True},
            },
            {},
        ),
        (
            "/v1/responses",
            {"model": "up/gpt-up", "input": "Hi", "stream": True},
            {"X-Nexus-Resumable": "true"},
        ),
    ],
)
async def test_every_endpoint_asks_for_a_resumable_stream_the_same_way(
    make_client: MakeClient,
    upstream: FakeUpstream,
    path: str,
    request_body: dict[str, Any],
    headers: dict[str, str],
) -> None:
    upstream.add(slow_reply(words=3, delay=0), slow_reply(words=3, delay=0))
    client = await make_client({"providers": {"up": provider(upstream)}})
    resp = await client.post(path, json=request_body, headers=headers)
    assert resp.status == 200, await resp.text()
    assert resp.headers["X-Nexus-Resumable"] == "true"
    await resp.read()
    assert "resumable" not in upstream.requests[0].body["stream_options"]
    plain = await client.post(path, json={**request_body, "stream_options": {}})
    assert plain.headers["X-Nexus-Resumable"] == "false"


def test_resumable_is_neither_in_the_cache_key_nor_in_a_dump() -> None:
    plain = ChatRequest.model_validate(body(stream=True))
    asked = ChatRequest.model_validate(body(stream=True, stream_options={"resumable": True}))
    assert asked.resumable and not plain.resumable
    assert cache_key(asked) == cache_key(plain)
    assert "resumable" not in asked.model_dump_json()


# --- with a shared store: another replica's reader holds a lease ---------------------------


async def test_a_reader_on_another_replica_keeps_a_plain_stream_until_its_lease_lapses(
    make_client: MakeClient, prefix: str
) -> None:
    gated = GatedProvider(before=2, after=2)
    config = {
        "store": {"kind": "redis", "url": REDIS_URL, "prefix": prefix},
        "streams": {"detach_timeout_s": 0.2},  # leases last 2 s at least
    }
    one = await make_client(config, providers=[gated])
    two = await make_client(config, providers=[GatedProvider()])
    origin = await one.post(
        f"{CHAT}?stream_format=ndjson", json=support_chat(model="gated/m", stream=True)
    )
    assert origin.headers["X-Nexus-Resumable"] == "false"
    stream_id = origin.headers["X-Nexus-Stream-Id"]
    await asyncio.wait_for(origin.content.readline(), 5)
    follower = await two.get(f"/v1/streams/{stream_id}?stream_format=ndjson")
    await asyncio.wait_for(follower.content.readline(), 5)
    assert stream_id not in two.app[HUB].live  # followed from Redis, under a lease
    origin.close()
    await asyncio.sleep(0.5)
    assert not gated.closed.is_set()  # the lease of replica two's reader keeps it
    follower.close()
    # The follower's lease lapses (LEASE_S / 2 after it left) and the owner cancels it then.
    await asyncio.wait_for(gated.closed.wait(), LEASE_S / 2 + 1.0)
    got = await one.get(f"/v1/streams/{stream_id}?stream_format=ndjson")
    lines = [orjson.loads(line) for line in (await got.read()).splitlines()]
    assert lines[-2]["error"]["code"] == "client_disconnect"


async def test_a_resumable_request_that_joins_a_plain_stream_makes_it_resumable(
    make_client: MakeClient,
) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(
        {"cache": {"enabled": True}, "streams": {"detach_timeout_s": 0.3}}, providers=[gated]
    )
    request = support_chat(model="gated/m", stream=True)
    plain = await client.post(f"{CHAT}?stream_format=ndjson", json=request)
    assert plain.headers["X-Nexus-Resumable"] == "false"
    await asyncio.wait_for(plain.content.readline(), 5)
    joined = await client.post(
        f"{CHAT}?stream_format=ndjson", json=request, headers={"X-Nexus-Resumable": "true"}
    )
    assert joined.headers["X-Nexus-Cache"] == "hit"
    assert joined.headers["X-Nexus-Stream-Id"] == plain.headers["X-Nexus-Stream-Id"]
    assert joined.headers["X-Nexus-Resumable"] == "true"
    await asyncio.wait_for(joined.content.readline(), 5)
    plain.close()
    joined.close()
    await asyncio.sleep(0.1)
    assert not gated.closed.is_set()  # waits detach_timeout_s for the joiner to come back
    await asyncio.wait_for(gated.closed.wait(), 2)


@pytest.mark.parametrize("fmt", ["ndjson", "sse"])
async def test_a_resumable_stream_whose_client_left_before_its_headers_ends_at_once(
    make_client: MakeClient, fmt: str
) -> None:
    """Its headers wait for the first output, and they alone name the stream: a client
    gone before them can never resume it, yet it ran on for ``detach_timeout_s``, its
    upstream generating (and billed) for nobody."""
    gated = GatedProvider(before=0)
    config = {"streams": {"detach_timeout_s": 60}, "server": {"heartbeat_interval_s": 30}}
    client = await make_client(config, providers=[gated])
    body = support_chat(model="gated/x", stream=True)
    headers = {"X-Nexus-Resumable": "true"}
    asking = asyncio.ensure_future(
        client.post(f"/v1/chat/completions?stream_format={fmt}", json=body, headers=headers)
    )
    await asyncio.wait_for(gated.started.wait(), 5)
    asking.cancel()
    await asyncio.wait_for(gated.closed.wait(), 5)  # not a minute later


async def test_a_stream_whose_clients_all_left_before_its_headers_ends_joined_or_not(
    make_client: MakeClient,
) -> None:
    """A join marked the stream's id as given out before any headers had gone out: its
    owner and its joiner gone, nobody could resume it, yet it ran on."""
    gated = GatedProvider(before=0)
    config = {"cache": {"enabled": True}, "streams": {"detach_timeout_s": 60}}
    client = await make_client(config, providers=[gated])
    body = support_chat(model="gated/x", stream=True)
    owner = asyncio.ensure_future(
        client.post("/v1/chat/completions", json=body, headers={"X-Nexus-Resumable": "true"})
    )
    await asyncio.wait_for(gated.started.wait(), 5)
    joiner = asyncio.ensure_future(client.post("/v1/chat/completions", json=body))
    await asyncio.sleep(0.3)
    owner.cancel()
    joiner.cancel()
    await asyncio.wait_for(gated.closed.wait(), 5)
