"""A stream, its recording and its in-flight join belong to the API key that made them.

Against a real ``nexus serve`` with two keys, A and B: no key (or a Basic
``Authorization``) can neither read nor cancel A's stream; B gets the very 404 a
stream that does not exist gets; the read token of a background ``202`` reads
(and resumes) that one stream, and does nothing else; B's identical request is
neither replayed from A's recording nor joined to A's in-flight stream. The
cache and join rules are also checked in-process on the memory store and on
Redis (two replicas), with and without ``[cache] share_across_keys``.
"""

from __future__ import annotations

import asyncio
import base64
import os
import re
import subprocess
import time
from collections.abc import AsyncGenerator, AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest

from nexus.auth import hash_key
from nexus.events import Delta, StreamEvent, Usage
from nexus.protocol.sse import ServerSentEvent
from nexus.request import ChatRequest
from nexus.server.state import HUB
from nexus_process import NEXUS, start_nexus, stop_nexus
from redis_support import REDIS_URL, connect_or_skip, drop_keys, new_prefix
from support import GatedProvider, MakeClient, chat, parse_sse

KEY_A = "nx-owner-a-0123456789abcdef"
KEY_B = "nx-owner-b-fedcba9876543210"
CHAT = "/v1/chat/completions"
SLOW = " ".join(f"w{i}" for i in range(30))  # 30 deltas
SECRET_ENV = "NEXUS_TEST_OWNER_SECRET"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def basic(key: str) -> dict[str, str]:
    return {"Authorization": "Basic " + base64.b64encode(f"user:{key}".encode()).decode()}


def keyed_toml(*tables: str) -> str:
    return "\n".join(
        [
            '[providers.mock]\nkind = "mock"\n',
            *tables,
            f'[auth]\ntoken_secret_env = "{SECRET_ENV}"\n',
            f'[[auth.keys]]\nname = "alpha"\nsha256 = "{hash_key(KEY_A)}"\n',
            f'[[auth.keys]]\nname = "beta"\nsha256 = "{hash_key(KEY_B)}"\n',
        ]
    )


class Gateway:
    """A ``nexus serve`` process; ``url`` to call it, ``log`` to read what it wrote."""

    def __init__(self, tmp_path: Path, toml: str, *args: str, ready: Any = None) -> None:
        config = tmp_path / "config.toml"
        config.write_text(toml)
        self.log = tmp_path / "nexus.log"
        extra = {} if ready is None else {"ready": ready}
        self.proc, match = start_nexus(config, self.log, *args, **extra)
        self.url = match.group(1)

    def stop(self) -> None:
        stop_nexus(self.proc, gently=False)


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Gateway]:
    """Keys A and B, the cache on, streams kept 1 s (read tokens last 1-2 s)."""
    os.environ.pop(SECRET_ENV, None)  # a secret of its own
    server = Gateway(
        tmp_path_factory.mktemp("owner"),
        keyed_toml("[streams]\nresume_ttl_s = 1\n", "[cache]\nenabled = true\n"),
    )
    yield server
    server.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


async def start(
    http: aiohttp.ClientSession, server: Gateway, key: str, text: str, delay_ms: int = 0
) -> dict[str, Any]:
    """A background stream of ``key``'s: the 202's JSON."""
    body = chat(text, stream=True, background=True, mock={"delay_ms": delay_ms})
    async with http.post(server.url + CHAT, json=body, headers=bearer(key)) as resp:
        assert resp.status == 202, await resp.text()
        started: dict[str, Any] = await resp.json()
    return started


def text_of(body: bytes | list[ServerSentEvent]) -> str:
    """The text of an OpenAI-SSE body (or of its events)."""
    out = []
    for event in parse_sse(body) if isinstance(body, bytes) else body:
        if event.data.startswith("{"):
            for choice in orjson.loads(event.data).get("choices", []):
                out.append(choice["delta"].get("content") or "")
    return "".join(out)


async def answer(
    http: aiohttp.ClientSession, method: str, url: str, headers: dict[str, str] | None = None
) -> tuple[int, dict[str, str], bytes]:
    async with http.request(method, url, headers=headers or {}) as resp:
        return resp.status, dict(resp.headers), await resp.read()


def error_code(body: bytes) -> str:
    return str(orjson.loads(body)["error"]["code"])


def same_headers(headers: dict[str, str]) -> dict[str, str]:
    """What two answers must have alike: all headers but the date and the request id."""
    unlike = ("date", "x-request-id", "request-id")
    return {k.lower(): v for k, v in headers.items() if k.lower() not in unlike}


def as_missing(body: bytes, stream_id: str, missing: str) -> bytes:
    """``body`` with the stream id swapped for ``missing`` and without its request id
    (each answer carries its own request's)."""
    return without_request_id(body.replace(stream_id.encode(), missing.encode()))


def without_request_id(body: bytes) -> bytes:
    return re.sub(rb'"request_id":"[^"]*"', b'"request_id":"-"', body)


# --- stream resources -------------------------------------------------------------------


async def test_no_key_or_basic_auth_can_neither_read_nor_cancel_a_keyed_stream(
    gateway: Gateway, http: aiohttp.ClientSession
) -> None:
    started = await start(http, gateway, KEY_A, SLOW, delay_ms=20)
    url = gateway.url + f"/v1/streams/{started['id']}"
    for headers in ({}, basic(KEY_A), {"Authorization": "Bearer"}, bearer("nx-wrong")):
        for method in ("GET", "DELETE"):
            status, sent, body = await answer(http, method, url, headers)
            assert status == 401, (method, headers, body)
            assert error_code(body) == "invalid_api_key"
            assert sent["WWW-Authenticate"] == 'Bearer realm="nexus"'
        # Resuming by POST with its Last-Event-ID: the same.
        resume = {"Last-Event-ID": f"{started['id']}.0"}
        async with http.post(gateway.url + CHAT, json=chat(), headers=headers | resume) as resp:
            assert resp.status == 401
    # None of that cancelled it: its owner reads it to the end.
    status, _, body = await answer(http, "GET", url, bearer(KEY_A))
    assert status == 200
    assert text_of(body) == SLOW
    assert body.endswith(b"data: [DONE]\n\n")


async def test_another_keys_stream_is_a_stream_that_does_not_exist(
    gateway: Gateway, http: aiohttp.ClientSession
) -> None:
    started = await start(http, gateway, KEY_A, SLOW, delay_ms=20)
    stream_id = started["id"]
    missing = "chatcmpl-" + os.urandom(16).hex()  # the same length, never made
    for method, path in [
        ("GET", "/v1/streams/{}"),
        ("GET", "/v1/streams/{}?stream_format=ndjson&last_event_id=2"),
        ("DELETE", "/v1/streams/{}"),
    ]:
        theirs = await answer(http, method, gateway.url + path.format(stream_id), bearer(KEY_B))
        nothing = await answer(http, method, gateway.url + path.format(missing), bearer(KEY_B))
        assert theirs[0] == nothing[0] == 404
        assert error_code(theirs[2]) == "stream_not_found"
        assert as_missing(theirs[2], stream_id, missing) == without_request_id(nothing[2])
        assert same_headers(theirs[1]) == same_headers(nothing[1])
    resumed = []
    for target in (stream_id, missing):
        headers = bearer(KEY_B) | {"Last-Event-ID": f"{target}.1"}
        async with http.post(gateway.url + CHAT, json=chat(stream=True), headers=headers) as resp:
            resumed.append((resp.status, await resp.read()))
    assert resumed[0][0] == resumed[1][0] == 404
    assert as_missing(resumed[0][1], stream_id, missing) == without_request_id(resumed[1][1])
    # B's DELETE did not cancel it; A's key reads it, and resumes it by POST.
    status, _, body = await answer(
        http, "GET", gateway.url + f"/v1/streams/{stream_id}", bearer(KEY_A)
    )
    assert status == 200
    assert text_of(body) == SLOW
    events = parse_sse(body)
    headers = bearer(KEY_A) | {"Last-Event-ID": events[1].id}
    async with http.post(gateway.url + CHAT, json=chat(stream=True), headers=headers) as resp:
        assert resp.status == 200
        assert text_of(await resp.read()) == text_of(events[2:])


async def test_the_read_token_reads_and_resumes_its_stream_and_nothing_else(
    gateway: Gateway, http: aiohttp.ClientSession
) -> None:
    started = await start(http, gateway, KEY_A, SLOW, delay_ms=10)
    other = await start(http, gateway, KEY_A, "another stream")
    stream_id, token = started["id"], started["read_token"]
    assert started["url"] == f"/v1/streams/{stream_id}?token={token}"
    # GET with the token alone (as an EventSource does): the whole stream.
    status, _, body = await answer(http, "GET", gateway.url + started["url"])
    assert status == 200, body
    assert text_of(body) == SLOW
    # Resume with it: the header, or the query parameter.
    events = parse_sse(body)
    rest = text_of(events[3:])
    assert rest and rest != SLOW
    status, _, tail = await answer(
        http, "GET", gateway.url + started["url"], {"Last-Event-ID": events[2].id}
    )
    assert status == 200
    assert text_of(tail) == rest
    status, _, tail = await answer(
        http, "GET", gateway.url + started["url"] + f"&last_event_id={events[2].id}"
    )
    assert status == 200
    assert text_of(tail) == rest
    # Not a DELETE, not another stream, not a POST resume, not once tampered with.
    refused = [
        ("DELETE", started["url"], {}),
        ("GET", f"/v1/streams/{other['id']}?token={token}", {}),
        ("GET", f"/v1/streams/chatcmpl-{os.urandom(16).hex()}?token={token}", {}),
        ("GET", f"/v1/streams/{stream_id}?token={token[:-2]}", {}),
        ("GET", f"/v1/streams/{stream_id}?token={int(token.split('.')[0]) + 60}.{token[11:]}", {}),
        ("GET", f"/v1/streams/{stream_id}?token=", {}),
        ("GET", f"/v1/streams/{stream_id}?token={other['read_token']}", {}),
    ]
    for method, path, headers in refused:
        status, sent, body = await answer(http, method, gateway.url + path, headers)
        assert status == 401, (method, path, body)
        assert error_code(body) == "invalid_api_key"
        assert "WWW-Authenticate" in sent
    resume = {"Last-Event-ID": events[2].id}
    async with http.post(gateway.url + CHAT + f"?token={token}", json=chat(), headers=resume) as r:
        assert r.status == 401
    # The token of a stream that is B's: B's, not A's key, made it; A's token does not read it.
    theirs = await start(http, gateway, KEY_B, "beta's stream")
    status, _, _ = await answer(
        http, "GET", gateway.url + f"/v1/streams/{theirs['id']}?token={token}"
    )
    assert status == 401
    status, _, body = await answer(http, "GET", gateway.url + theirs["url"])
    assert status == 200
    assert text_of(body) == "beta's stream"
    # The token never reached the log.
    await asyncio.sleep(0.1)
    log = gateway.log.read_text()
    assert stream_id in log or "stream_id=" in log  # the access log is on
    for secret in (token, token.split(".")[1], theirs["read_token"]):
        assert secret not in log


async def test_a_read_token_lasts_the_longest_stream_then_resume_ttl_s(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    """A token is good while its stream may run ([limits] max_stream_duration_s) and then
    [streams] resume_ttl_s; past that it is refused (401), however it is presented."""
    server = Gateway(
        tmp_path,
        keyed_toml("[limits]\nmax_stream_duration_s = 1\n", "[streams]\nresume_ttl_s = 1\n"),
    )
    try:
        issued = time.time()
        started = await start(http, server, KEY_A, "short")
        token_url = server.url + started["url"]
        expires = int(started["read_token"].split(".")[0])
        assert issued + 1 <= expires <= issued + 3  # 1 s + 1 s, in whole seconds
        status, _, body = await answer(http, "GET", token_url)
        assert status == 200 and text_of(body) == "short"
        await asyncio.sleep(max(expires - time.time(), 0) + 0.1)
        status, _, body = await answer(http, "GET", token_url)
        assert status == 401, body
        assert error_code(body) == "invalid_api_key"
    finally:
        server.stop()


async def test_a_read_token_outlives_resume_ttl_s_while_the_stream_may_run(
    gateway: Gateway, http: aiohttp.ClientSession
) -> None:
    """resume_ttl_s = 1 and the default 900 s limit: a token made now still reads the stream
    after resume_ttl_s (an EventSource reconnecting late in a long stream)."""
    started = await start(http, gateway, KEY_A, SLOW, delay_ms=60)
    expires = int(started["read_token"].split(".")[0])
    assert expires - time.time() > 900
    await asyncio.sleep(1.2)
    async with http.get(gateway.url + started["url"]) as resp:
        assert resp.status == 200
        assert text_of(await resp.read()) == SLOW


async def worker_of(http: aiohttp.ClientSession, url: str) -> int:
    """The pid of the worker behind ``http``'s kept-alive connection."""
    async with http.get(url + "/healthz") as resp:
        pid: int = (await resp.json())["pid"]
        return pid


async def test_a_read_token_from_one_worker_reads_on_another(tmp_path: Path) -> None:
    """``--workers 2`` with no secret configured: the supervisor makes one for both."""
    client = await connect_or_skip()
    prefix = new_prefix()
    os.environ.pop(SECRET_ENV, None)
    store = f'[store]\nkind = "redis"\nurl = "{REDIS_URL}"\nprefix = "{prefix}"\n'
    serving = re.compile(r"Nexus serving on (http://\S+) with 2 workers")
    server = Gateway(tmp_path, keyed_toml(store), "--workers", "2", ready=serving)
    try:
        crossed = 0
        for i in range(12):
            async with aiohttp.ClientSession() as http:
                started = await start(http, server, KEY_A, f"across workers {i}")
                maker = await worker_of(http, server.url)
            async with aiohttp.ClientSession() as http:
                async with http.get(server.url + started["url"]) as resp:
                    assert resp.status == 200, await resp.text()
                    assert text_of(await resp.read()) == f"across workers {i}"
                crossed += await worker_of(http, server.url) != maker
            if crossed >= 2:
                break
        assert crossed >= 1  # all 12 on one worker: once in ~4,000 runs
    finally:
        server.stop()
        await drop_keys(client, prefix)
        await client.aclose()
    log = server.log.read_text()
    assert f"other replicas do not; set {SECRET_ENV} to one secret" in log
    assert "secret made by this process" not in log  # the workers were handed one


# --- the cache and joins ------------------------------------------------------------------


async def post_ndjson(
    http: aiohttp.ClientSession, url: str, key: str, body: dict[str, Any]
) -> aiohttp.ClientResponse:
    return await http.post(url + CHAT + "?stream_format=ndjson", json=body, headers=bearer(key))


async def test_another_key_neither_replays_nor_joins_a_keys_stream(
    gateway: Gateway, http: aiohttp.ClientSession
) -> None:
    body = chat("alpha asked this " + os.urandom(4).hex(), stream=True, mock={"delay_ms": 30})
    first = await post_ndjson(http, gateway.url, KEY_A, body)
    assert first.headers["X-Nexus-Cache"] == "miss"
    await first.content.readline()
    # In flight: A's second request joins it, B's starts its own.
    joined = await post_ndjson(http, gateway.url, KEY_A, body)
    alone = await post_ndjson(http, gateway.url, KEY_B, body)
    assert joined.headers["X-Nexus-Cache"] == "hit"
    assert joined.headers["X-Nexus-Stream-Id"] == first.headers["X-Nexus-Stream-Id"]
    assert alone.headers["X-Nexus-Cache"] == "miss"
    assert alone.headers["X-Nexus-Stream-Id"] != first.headers["X-Nexus-Stream-Id"]
    for resp in (first, joined, alone):
        await resp.read()
        resp.close()
    await asyncio.sleep(0.1)
    # Recorded: A's replays to A; B has (only) its own recording.
    for key in (KEY_A, KEY_B):
        async with http.post(
            gateway.url + CHAT, json=body | {"stream": False}, headers=bearer(key)
        ) as r:
            assert r.headers["X-Nexus-Cache"] == "hit"
    fresh = chat("beta never asked this " + os.urandom(4).hex())
    async with http.post(gateway.url + CHAT, json=fresh, headers=bearer(KEY_A)) as resp:
        assert resp.headers["X-Nexus-Cache"] == "miss"
        recorded = await resp.json()
    async with http.post(gateway.url + CHAT, json=fresh, headers=bearer(KEY_B)) as resp:
        assert resp.headers["X-Nexus-Cache"] == "miss"
        assert (await resp.json())["id"] != recorded["id"]


@pytest.fixture(params=["memory", "redis"])
async def store(request: pytest.FixtureRequest) -> AsyncIterator[dict[str, Any]]:
    """The ``[store]`` table: the memory store, or Redis under a prefix of its own."""
    if request.param == "memory":
        yield {"kind": "memory"}
        return
    client = await connect_or_skip()
    prefix = new_prefix()
    try:
        yield {"kind": "redis", "url": REDIS_URL, "prefix": prefix}
    finally:
        await drop_keys(client, prefix)
        await client.aclose()


def keyed_config(store: dict[str, Any], share: bool) -> dict[str, Any]:
    return {
        "auth": {
            "keys": [
                {"name": "alpha", "sha256": hash_key(KEY_A)},
                {"name": "beta", "sha256": hash_key(KEY_B)},
            ]
        },
        "cache": {"enabled": True, "share_across_keys": share},
        "store": store,
    }


class CountingProvider(GatedProvider):
    """Gated; each call's text and usage name the call, so an answer tells who made it."""

    def __init__(self, tag: str) -> None:
        super().__init__()
        self.tag = tag
        self.calls = 0

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        self.calls += 1
        call = self.calls
        self.started.set()
        yield [Delta(content=f"{self.tag}-call{call} ")]
        await self.gate.wait()
        yield [Delta(content="the end")]
        yield [Delta(finish_reason="stop")]
        yield [Usage(prompt_tokens=call, completion_tokens=2, total_tokens=call + 2)]


def ndjson(body: bytes) -> tuple[str, dict[str, Any]]:
    """The text of an NDJSON body, and its usage."""
    lines = [orjson.loads(line) for line in body.splitlines() if line]
    text = "".join(line["delta"].get("content") or "" for line in lines if line["type"] == "delta")
    usage = next(line["usage"] for line in lines if line["type"] == "usage")
    return text, usage


@pytest.mark.parametrize("share", [False, True], ids=["own", "shared"])
async def test_recordings_and_joins_are_per_key_unless_shared(
    make_client: MakeClient, store: dict[str, Any], share: bool
) -> None:
    """A streams on replica one; B's identical request (on replica two, sharing the
    Redis store; on the same gateway with the memory store) joins A's in-flight stream,
    and later replays A's recording, only with share_across_keys."""
    config = keyed_config(store, share)
    one_provider, two_provider = CountingProvider("one"), CountingProvider("two")
    one = await make_client(config, providers=[one_provider])
    two = await make_client(config, providers=[two_provider]) if store["kind"] == "redis" else one
    body = chat(model="gated/m", stream=True, stream_options={"include_usage": True})
    url = CHAT + "?stream_format=ndjson"
    first = await one.post(url, json=body, headers=bearer(KEY_A))
    assert first.headers["X-Nexus-Cache"] == "miss"
    a_head = await asyncio.wait_for(first.content.readline(), 5)
    # B asks for a resumable stream: joining A's, it could never find it to resume it, so
    # it is told so, and A's stream is not made to outlive A's client for B.
    resumable = {**bearer(KEY_B), "X-Nexus-Resumable": "true"}
    other = await two.post(url, json=body, headers=resumable)
    same_stream = other.headers["X-Nexus-Stream-Id"] == first.headers["X-Nexus-Stream-Id"]
    assert same_stream is share
    assert other.headers["X-Nexus-Resumable"] == ("false" if share else "true")
    if share and store["kind"] == "memory":
        assert one.app[HUB].live[first.headers["X-Nexus-Stream-Id"]].info.resumable is False
    assert other.headers["X-Nexus-Cache"] == ("hit" if share else "miss")
    b_head = b""
    if not share:
        b_head = await asyncio.wait_for(other.content.readline(), 5)  # its own upstream call
    one_provider.gate.set()
    two_provider.gate.set()
    a_answer = ndjson(a_head + await asyncio.wait_for(first.read(), 5))
    b_answer = ndjson(b_head + await asyncio.wait_for(other.read(), 5))
    assert a_answer == ("one-call1 the end", {**a_answer[1], "prompt_tokens": 1})
    assert (b_answer == a_answer) is share
    # Recorded (A's only, when B joined it): B's replay is A's answer and usage only if shared.
    await asyncio.sleep(0.1)
    replay = await two.post(url, json=body, headers=bearer(KEY_B))
    assert replay.headers["X-Nexus-Cache"] == "hit"
    assert (ndjson(await asyncio.wait_for(replay.read(), 5)) == a_answer) is share
    calls = one_provider.calls + two_provider.calls
    assert calls == (1 if share else 2)


def test_a_short_token_secret_stops_the_start(tmp_path: Path) -> None:
    config = tmp_path / "config.toml"
    config.write_text(keyed_toml())
    for args in ((), ("--workers", "2")):
        out = subprocess.run(
            [NEXUS, "serve", "--config", str(config), "--port", "0", *args],
            env={**os.environ, SECRET_ENV: "too-short"},
            capture_output=True,
            text=True,
            timeout=20,
        )
        assert out.returncode == 2, out.stderr
        assert f"{SECRET_ENV} holds a secret of 9 characters" in out.stderr
        assert "too-short" not in out.stderr


async def test_replicas_with_one_secret_read_each_others_tokens(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = await connect_or_skip()
    prefix = new_prefix()
    store = {"kind": "redis", "url": REDIS_URL, "prefix": prefix}
    config = keyed_config(store, share=False)
    config["auth"]["token_secret_env"] = SECRET_ENV
    try:
        monkeypatch.setenv(SECRET_ENV, "one secret for every replica, 32+ chars")
        one = await make_client(config)
        two = await make_client(config)
        monkeypatch.setenv(SECRET_ENV, "another secret, as long as the first one")
        stranger = await make_client(config)
        resp = await one.post(CHAT, json=chat(stream=True, background=True), headers=bearer(KEY_A))
        started = await resp.json()
        await asyncio.sleep(0.1)
        resp = await two.get(started["url"])
        assert resp.status == 200
        assert text_of(await resp.read()) == "Hello there world"
        resp = await stranger.get(started["url"])
        assert resp.status == 401
        resp = await stranger.get(started["url"].split("?")[0], headers=bearer(KEY_A))
        assert resp.status == 200  # the stream is there: only the token is refused
    finally:
        await drop_keys(client, prefix)
        await client.aclose()
