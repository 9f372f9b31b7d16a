"""Who may call: API keys, per-key models and limits, stream ownership, CORS, request ids.

Through the real app, and the real clients where their behaviour matters: the openai
and anthropic SDKs (their 401/403 exception classes) and ``websockets``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Any

import aiohttp
import anthropic
import openai
import orjson
import pytest
import websockets
from aiohttp import ClientResponse
from aiohttp.test_utils import TestClient

from nexus.auth import hash_key
from support import GatedProvider, MakeClient, chat, parse_sse, turn

KEY_A = "nx-alpha-0123456789-secret"
KEY_B = "nx-beta-9876543210-secret"
WRONG = "nx-not-a-configured-key"
PROVIDERS = {"mock": {"kind": "mock", "models": ["echo", "other"]}}


def keyed(**extra: Any) -> dict[str, Any]:
    """Two keys: alpha may use any model, beta only ``mock/echo``."""
    config: dict[str, Any] = {
        "providers": PROVIDERS,
        "auth": {
            "keys": [
                {"name": "alpha", "sha256": hash_key(KEY_A)},
                {"name": "beta", "sha256": hash_key(KEY_B), "models": ["mock/echo"]},
            ]
        },
    }
    config.update(extra)
    return config


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def anthropic_body(model: str = "mock/echo", **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": 50,
        "messages": [{"role": "user", "content": "Hello there world"}],
    }
    body.update(extra)
    return body


def responses_body(model: str = "mock/echo", **extra: Any) -> dict[str, Any]:
    return {"model": model, "input": "Hello there world", **extra}


def ws_url(client: TestClient[Any, Any]) -> str:
    return f"ws://{client.server.host}:{client.server.port}/v1/realtime"


def start_frame(model: str = "mock/echo", content: str = "hello socket") -> str:
    request = {"model": model, "messages": [{"role": "user", "content": content}]}
    return orjson.dumps({"type": "start", "request": request}).decode()


# --- auth off -------------------------------------------------------------------------


async def test_auth_off_needs_no_key(make_client: MakeClient) -> None:
    client = await make_client({"providers": PROVIDERS})
    resp = await client.post("/v1/chat/completions", json=chat())
    assert resp.status == 200, await resp.text()
    resp = await client.post("/v1/messages", json=anthropic_body())
    assert resp.status == 200, await resp.text()
    resp = await client.post("/v1/responses", json=responses_body())
    assert resp.status == 200, await resp.text()
    resp = await client.get("/v1/models")
    assert {m["id"] for m in (await resp.json())["data"]} >= {"mock/echo", "mock/other"}
    # A key sent to a gateway without keys is ignored, not refused.
    resp = await client.post("/v1/chat/completions", json=chat(), headers=bearer(WRONG))
    assert resp.status == 200
    async with websockets.connect(ws_url(client)) as ws:
        await ws.send(start_frame())
        assert (await turn(ws))[-1] == {"type": "done"}


# --- 401 in each endpoint's shape -----------------------------------------------------


@pytest.mark.parametrize(
    ("method", "path", "body"),
    [
        ("POST", "/v1/chat/completions", chat()),
        ("POST", "/v1/responses", responses_body()),
        ("GET", "/v1/models", None),
        ("GET", "/v1/models/mock/echo", None),
    ],
)
@pytest.mark.parametrize(
    "headers", [{}, bearer(WRONG), {"x-api-key": WRONG}, {"Authorization": "Basic xyz"}]
)
async def test_401_openai_shape(
    make_client: MakeClient,
    method: str,
    path: str,
    body: dict[str, Any] | None,
    headers: dict[str, str],
) -> None:
    client = await make_client(keyed())
    resp = await client.request(method, path, json=body, headers=headers)
    assert resp.status == 401
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    error = (await resp.json())["error"]
    assert error["type"] == "authentication_error"
    assert error["code"] == "invalid_api_key"
    assert error["message"]
    assert WRONG not in error["message"]


@pytest.mark.parametrize("headers", [{}, bearer(WRONG), {"x-api-key": WRONG}])
async def test_401_anthropic_shape(make_client: MakeClient, headers: dict[str, str]) -> None:
    client = await make_client(keyed())
    resp = await client.post("/v1/messages", json=anthropic_body(), headers=headers)
    assert resp.status == 401
    assert resp.headers["WWW-Authenticate"].startswith("Bearer")
    body = await resp.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "authentication_error"
    assert body["error"]["message"]


async def test_openai_sdk_sees_authentication_and_permission_errors(
    make_client: MakeClient,
) -> None:
    client = await make_client(keyed())
    base = str(client.make_url("/v1"))
    async with openai.AsyncOpenAI(base_url=base, api_key=WRONG, max_retries=0) as api:
        with pytest.raises(openai.AuthenticationError) as info:
            await api.chat.completions.create(
                model="mock/echo", messages=[{"role": "user", "content": "hi"}]
            )
        assert info.value.status_code == 401
        assert info.value.code == "invalid_api_key"
        with pytest.raises(openai.AuthenticationError):
            await api.models.list()
    async with openai.AsyncOpenAI(base_url=base, api_key=KEY_B, max_retries=0) as api:
        completion = await api.chat.completions.create(
            model="mock/echo", messages=[{"role": "user", "content": "hi there"}]
        )
        assert completion.choices[0].message.content == "hi there"
        with pytest.raises(openai.PermissionDeniedError) as denied:
            await api.chat.completions.create(
                model="mock/other", messages=[{"role": "user", "content": "hi"}], stream=True
            )
        assert denied.value.code == "model_not_allowed"
        page = await api.models.list()
        assert [m.id for m in page.data] == ["mock/echo"]


async def test_anthropic_sdk_sees_authentication_and_permission_errors(
    make_client: MakeClient,
) -> None:
    client = await make_client(keyed())
    base = str(client.make_url(""))
    messages: Any = [{"role": "user", "content": "hi there"}]
    async with anthropic.AsyncAnthropic(base_url=base, api_key=WRONG, max_retries=0) as api:
        with pytest.raises(anthropic.AuthenticationError) as info:
            await api.messages.create(model="mock/echo", max_tokens=10, messages=messages)
        assert info.value.status_code == 401
        assert info.value.body["error"]["type"] == "authentication_error"  # type: ignore[index]
    # The SDK sends x-api-key.
    async with anthropic.AsyncAnthropic(base_url=base, api_key=KEY_B, max_retries=0) as api:
        message = await api.messages.create(model="mock/echo", max_tokens=10, messages=messages)
        assert message.content[0].text == "hi there"  # type: ignore[union-attr]
        with pytest.raises(anthropic.PermissionDeniedError) as denied:
            await api.messages.create(model="mock/other", max_tokens=10, messages=messages)
        assert denied.value.status_code == 403
        assert denied.value.body["error"]["type"] == "permission_error"  # type: ignore[index]


@pytest.mark.parametrize(
    "headers",
    [bearer(KEY_A), {"x-api-key": KEY_A}, {"Authorization": f"bearer  {KEY_A} "}],
    ids=["bearer", "x-api-key", "lowercase-scheme"],
)
async def test_bearer_and_x_api_key_accepted(
    make_client: MakeClient, headers: dict[str, str]
) -> None:
    client = await make_client(keyed())
    resp = await client.post("/v1/chat/completions", json=chat(), headers=headers)
    assert resp.status == 200, await resp.text()
    resp = await client.post("/v1/messages", json=anthropic_body(), headers=headers)
    assert resp.status == 200, await resp.text()
    resp = await client.post("/v1/responses", json=responses_body(), headers=headers)
    assert resp.status == 200, await resp.text()
    resp = await client.post(
        "/v1/chat/completions?stream_format=sse", json=chat(stream=True), headers=headers
    )
    assert resp.status == 200
    assert parse_sse(await resp.read())[-1].data == "[DONE]"


async def test_open_endpoints_need_no_key(make_client: MakeClient) -> None:
    client = await make_client(keyed())
    assert (await client.get("/healthz")).status == 200
    assert (await client.get("/")).status == 200  # (/metrics: its own token, test_metrics_scrape)


async def test_the_console_may_not_be_framed_by_another_page(make_client: MakeClient) -> None:
    # It keeps a key in the browser: a hostile page must not frame it (clickjacking).
    client = await make_client(keyed())
    for path in ("/", "/web/app.js"):
        resp = await client.get(path)
        assert resp.status == 200
        assert "frame-ancestors 'none'" in resp.headers["Content-Security-Policy"]
        assert resp.headers["X-Frame-Options"] == "DENY"


# --- per-key models -------------------------------------------------------------------


async def test_per_key_models(make_client: MakeClient) -> None:
    client = await make_client(keyed())
    beta = bearer(KEY_B)
    resp = await client.post("/v1/chat/completions", json=chat(), headers=beta)
    assert resp.status == 200
    resp = await client.post(
        "/v1/chat/completions", json=chat(model="mock/other", stream=True), headers=beta
    )
    assert resp.status == 403
    error = (await resp.json())["error"]
    assert (error["code"], error["type"], error["param"]) == (
        "model_not_allowed",
        "permission_error",
        "model",
    )
    resp = await client.post("/v1/responses", json=responses_body("mock/other"), headers=beta)
    assert resp.status == 403
    assert (await resp.json())["error"]["code"] == "model_not_allowed"
    resp = await client.post("/v1/messages", json=anthropic_body("mock/other"), headers=beta)
    assert resp.status == 403
    body = await resp.json()
    assert body["type"] == "error"
    assert body["error"]["type"] == "permission_error"
    # GET /v1/models/{id} too.
    assert (await client.get("/v1/models/mock/echo", headers=beta)).status == 200
    resp = await client.get("/v1/models/mock/other", headers=beta)
    assert resp.status == 403
    # Whether a model it may not use exists is not told: 403 alike (a 404 listed the rest).
    resp = await client.get("/v1/models/nosuch/model", headers=beta)
    assert resp.status == 403
    assert (await resp.json())["error"]["code"] == "model_not_allowed"
    # The other key may use both.
    resp = await client.post(
        "/v1/chat/completions", json=chat(model="mock/other"), headers=bearer(KEY_A)
    )
    assert resp.status == 200


async def test_models_list_filtered_by_key(make_client: MakeClient) -> None:
    config = keyed()
    config["auth"]["keys"].append(
        {"name": "gamma", "sha256": hash_key("nx-gamma-key"), "models": ["mock/*"]}
    )
    client = await make_client(config)
    beta = await (await client.get("/v1/models", headers=bearer(KEY_B))).json()
    assert [m["id"] for m in beta["data"]] == ["mock/echo"]
    alpha = await (await client.get("/v1/models", headers=bearer(KEY_A))).json()
    assert {m["id"] for m in alpha["data"]} >= {"mock/echo", "mock/other"}
    gamma = await (await client.get("/v1/models", headers=bearer("nx-gamma-key"))).json()
    assert {m["id"] for m in gamma["data"]} == {"mock/echo", "mock/other"}


# --- WebSocket ------------------------------------------------------------------------


async def test_websocket_without_key_is_refused_at_upgrade(make_client: MakeClient) -> None:
    client = await make_client(keyed())
    with pytest.raises(websockets.InvalidStatus) as info:
        await websockets.connect(ws_url(client))
    assert info.value.response.status_code == 401
    with pytest.raises(websockets.InvalidStatus) as info:
        await websockets.connect(ws_url(client), subprotocols=["nexus.v1", f"nexus-key.{WRONG}"])  # type: ignore[list-item]
    assert info.value.response.status_code == 401


async def test_websocket_key_in_authorization_header(make_client: MakeClient) -> None:
    client = await make_client(keyed())
    async with websockets.connect(ws_url(client), additional_headers=bearer(KEY_A)) as ws:
        await ws.send(start_frame())
        frames = await turn(ws)
    assert frames[-1] == {"type": "done"}


async def test_websocket_key_in_subprotocol(make_client: MakeClient) -> None:
    client = await make_client(keyed())
    protocols: Any = ["nexus.v1", f"nexus-key.{KEY_B}"]
    async with websockets.connect(ws_url(client), subprotocols=protocols) as ws:
        assert ws.subprotocol == "nexus.v1"
        await ws.send(start_frame(content="hello socket"))
        frames = await turn(ws)
        text = "".join(f["delta"].get("content", "") for f in frames if f["type"] == "delta")
        assert text == "hello socket"
        # A model the key may not use: an error frame, and the socket stays open.
        await ws.send(start_frame(model="mock/other"))
        frames = await turn(ws)
        assert frames[-1]["type"] == "error"
        assert orjson.dumps(frames[-1]).find(b"model_not_allowed") > 0, frames[-1]
        await ws.send(start_frame(content="still open"))
        frames = await turn(ws)
        assert frames[-1] == {"type": "done"}


# --- stream ownership -----------------------------------------------------------------


async def _background(client: TestClient[Any, Any], key: str, model: str = "mock/echo") -> str:
    resp = await client.post(
        "/v1/chat/completions",
        json=chat(model=model, stream=True, background=True),
        headers=bearer(key),
    )
    assert resp.status == 202, await resp.text()
    return str((await resp.json())["id"])


async def test_stream_read_by_owner_or_read_token_only(make_client: MakeClient) -> None:
    client = await make_client(keyed())
    resp = await client.post(
        "/v1/chat/completions",
        json=chat(stream=True, background=True),
        headers=bearer(KEY_A),
    )
    assert resp.status == 202
    started = await resp.json()
    stream_id = started["id"]
    url = f"/v1/streams/{stream_id}?stream_format=sse"
    # The id alone is not a capability.
    resp = await client.get(url)
    assert resp.status == 401
    assert (await resp.json())["error"]["code"] == "invalid_api_key"
    resp = await client.get(url, headers=bearer(KEY_A))
    assert resp.status == 200
    assert parse_sse(await resp.read())[-1].data == "[DONE]"
    # Another key's stream is a stream that does not exist.
    missing = await client.get("/v1/streams/chatcmpl-nope?stream_format=sse", headers=bearer(KEY_B))
    assert missing.status == 404
    resp = await client.get(url, headers=bearer(KEY_B))
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "stream_not_found"
    resp = await client.get(url, headers={"x-api-key": KEY_B})
    assert resp.status == 404
    # A key that is no key at all is a 401, not a free pass.
    resp = await client.get(url, headers=bearer(WRONG))
    assert resp.status == 401
    # The read token of the 202 reads it without a key.
    resp = await client.get(started["url"] + "&stream_format=sse")
    assert resp.status == 200
    assert parse_sse(await resp.read())[-1].data == "[DONE]"
    # Resuming by POST with Last-Event-ID: the same rule.
    resp = await client.get(url, headers=bearer(KEY_A))
    first = parse_sse(await resp.read())[0].id
    assert first
    resume = {"Last-Event-ID": first}
    resp = await client.post(
        "/v1/chat/completions", json=chat(stream=True), headers=resume | bearer(KEY_B)
    )
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "stream_not_found"
    resp = await client.post("/v1/chat/completions", json=chat(stream=True), headers=resume)
    assert resp.status == 401
    resp = await client.post(
        "/v1/chat/completions", json=chat(stream=True), headers=resume | bearer(KEY_A)
    )
    assert resp.status == 200
    await resp.read()
    # A finished stream's DELETE: the same rule, and a read token is no key.
    resp = await client.delete(f"/v1/streams/{stream_id}", headers=bearer(KEY_B))
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "stream_not_found"
    resp = await client.delete(started["url"])
    assert resp.status == 401
    resp = await client.delete(f"/v1/streams/{stream_id}", headers=bearer(KEY_A))
    assert resp.status == 200


async def test_live_stream_delete_by_owner_only(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(keyed(), providers=[gated])
    first = await _background(client, KEY_A, "gated/m")
    second = await _background(client, KEY_A, "gated/m")
    resp = await client.delete(f"/v1/streams/{first}", headers=bearer(KEY_B))
    assert resp.status == 404
    assert (await resp.json())["error"]["code"] == "stream_not_found"
    resp = await client.delete(f"/v1/streams/{first}", headers=bearer(KEY_A))
    assert resp.status == 200
    assert (await resp.json())["status"] != "in_progress"
    resp = await client.delete(f"/v1/streams/{second}")
    assert resp.status == 401
    resp = await client.delete(f"/v1/streams/{second}", headers=bearer(KEY_A))
    assert resp.status == 200
    assert (await resp.json())["status"] != "in_progress"


# --- limits ---------------------------------------------------------------------------


async def test_requests_per_second_per_key(make_client: MakeClient) -> None:
    client = await make_client(keyed(limits={"requests_per_second_per_key": 2}))
    statuses = []
    for _ in range(3):
        resp = await client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
        statuses.append(resp.status)
        if resp.status == 429:
            limited = resp
            body = await resp.json()
        else:
            await resp.read()
    assert statuses == [200, 200, 429]
    assert body["error"]["code"] == "rate_limited"
    retry_after = limited.headers["Retry-After"]
    assert re.fullmatch(r"\d+", retry_after)
    assert int(retry_after) >= 1
    # The Anthropic endpoint says it in its own shape.
    resp = await client.post("/v1/messages", json=anthropic_body(), headers=bearer(KEY_A))
    assert resp.status == 429
    assert (await resp.json())["error"]["type"] == "rate_limit_error"
    assert int(resp.headers["Retry-After"]) >= 1
    # Another key has its own bucket.
    for _ in range(2):
        resp = await client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_B))
        assert resp.status == 200


async def test_reading_and_listing_take_a_token_of_the_keys_rate_cancelling_none(
    make_client: MakeClient,
) -> None:
    # A key's GET of a stream is a request of that key like any other (a reader that polls
    # a shared store costs the gateway); so is a read token's GET, of its stream's key: a
    # token leaked in a URL cannot re-render a log unmetered.
    client = await make_client(keyed(limits={"requests_per_second_per_key": 2}))
    slow = chat(" ".join(["word"] * 40), background=True, mock={"delay_ms": 50})
    resp = await client.post("/v1/chat/completions", json=slow, headers=bearer(KEY_A))
    assert resp.status == 202
    made = await resp.json()
    statuses = []
    for method in ("GET", "GET", "GET", "DELETE", "DELETE"):
        answer = await client.request(method, made["url"].split("?")[0], headers=bearer(KEY_A))
        answer.close()  # (the stream runs on: it is a background one)
        statuses.append(answer.status)
    # The bucket held two: the POST's, which also paid for the first GET (one action, one
    # token), and the second GET's. A DELETE that stops the stream takes none: a key past
    # its rate may still stop what spends its budget; asked again of the stopped stream, it
    # stops nothing, and is metered like any lookup.
    assert statuses == [200, 200, 429, 200, 429]
    listed = await client.get("/v1/models", headers=bearer(KEY_A))  # so does a listing
    assert listed.status == 429
    by_token = await client.get(made["url"])  # ?token=: the stream's key's rate
    assert by_token.status == 429
    assert (await by_token.json())["error"]["code"] == "rate_limited"
    await asyncio.sleep(1.0)  # the bucket refills (2 a second)
    by_token = await client.get(made["url"])
    await by_token.read()
    assert by_token.status == 200
    # Another key's bucket is not the stream's: it is not spent by the token's reads.
    for _ in range(2):
        other = await client.get("/v1/models", headers=bearer(KEY_B))
        assert other.status == 200


async def test_rate_limit_recovers(make_client: MakeClient) -> None:
    client = await make_client(keyed(limits={"requests_per_second_per_key": 20}))

    async def status() -> int:
        resp = await client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
        return resp.status

    # All at once: one after another, a busy machine refills the bucket as fast as it drains.
    statuses = await asyncio.gather(*(status() for _ in range(30)))
    assert 429 in statuses
    await asyncio.sleep(0.2)
    resp = await client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert resp.status == 200


async def _key_a_holds_its_one_stream(
    make_client: MakeClient,
) -> tuple[GatedProvider, TestClient[Any, Any], str, ClientResponse]:
    """A gateway with max_concurrent_streams_per_key = 1, and key A's stream held open on
    the gate (released by ``gated.gate.set()``)."""
    gated = GatedProvider(before=1, after=1)
    client = await make_client(
        keyed(limits={"max_concurrent_streams_per_key": 1}), providers=[gated]
    )
    url = "/v1/chat/completions?stream_format=sse"
    first = await client.post(url, json=chat(model="gated/m", stream=True), headers=bearer(KEY_A))
    assert first.status == 200
    return gated, client, url, first


async def test_max_concurrent_streams_per_key(make_client: MakeClient) -> None:
    gated, client, url, first = await _key_a_holds_its_one_stream(make_client)
    second = await client.post(url, json=chat(model="gated/m", stream=True), headers=bearer(KEY_A))
    assert second.status == 429
    assert (await second.json())["error"]["code"] == "too_many_streams"
    assert "Retry-After" in second.headers
    # A background one counts too.
    resp = await client.post(
        "/v1/chat/completions",
        json=chat(model="gated/m", background=True, stream=True),
        headers=bearer(KEY_A),
    )
    assert resp.status == 429
    # Another key is not limited by this one's streams.
    other = await client.post(url, json=chat(stream=True), headers=bearer(KEY_B))
    assert other.status == 200
    await other.read()
    gated.gate.set()
    assert parse_sse(await first.read())[-1].data == "[DONE]"
    # Its stream ended: the key may open another.
    for _ in range(50):
        resp = await client.post(url, json=chat(stream=True), headers=bearer(KEY_A))
        if resp.status == 200:
            break
        await asyncio.sleep(0.02)
    assert resp.status == 200
    await resp.read()


@pytest.mark.parametrize("keys", [True, False], ids=["per-key", "global"])
async def test_requests_arriving_together_cannot_pass_the_stream_limit(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch, keys: bool
) -> None:
    # Opening a stream may wait (a shared store, a middleware): requests that are being
    # opened count, or all of them would pass a limit that only two fit in.
    from nexus.cache.hub import StreamHub
    from nexus.server.state import HUB

    open_stream = StreamHub.open

    async def slow_open(self: StreamHub, *a: Any, **kw: Any) -> Any:
        await asyncio.sleep(0.1)
        return await open_stream(self, *a, **kw)

    monkeypatch.setattr(StreamHub, "open", slow_open)
    gated = GatedProvider(before=1, after=1)
    limits = {"max_concurrent_streams_per_key": 2} if keys else {"max_concurrent_streams": 2}
    config = keyed(limits=limits) if keys else {"providers": PROVIDERS, "limits": limits}
    client = await make_client(config, providers=[gated])
    url = "/v1/chat/completions?stream_format=sse"
    body = chat(model="gated/m", stream=True)
    responses = await asyncio.gather(
        *(client.post(url, json=body, headers=bearer(KEY_A)) for _ in range(6))
    )
    assert sorted(r.status for r in responses) == [200, 200, 429, 429, 429, 429]
    hub = client.app[HUB]
    assert hub.running("alpha" if keys else None) == 2
    gated.gate.set()
    for resp in responses:
        if resp.status == 200:
            assert parse_sse(await resp.read())[-1].data == "[DONE]"
        else:
            assert (await resp.json())["error"]["code"] == "too_many_streams"
    for _ in range(100):
        if hub.running() == 0:
            break
        await asyncio.sleep(0.02)
    assert hub.running() == 0
    assert hub.running("alpha") == 0


async def test_websocket_turns_count_toward_the_per_key_limit(make_client: MakeClient) -> None:
    gated, client, _, first = await _key_a_holds_its_one_stream(make_client)
    async with websockets.connect(ws_url(client), additional_headers=bearer(KEY_A)) as ws:
        await ws.send(start_frame())
        error = orjson.loads(await asyncio.wait_for(ws.recv(), 5))
        assert error["type"] == "error"
        assert error["error"]["code"] == "too_many_streams"
        assert "'alpha'" in error["error"]["message"]
        gated.gate.set()
        assert parse_sse(await first.read())[-1].data == "[DONE]"
        # Its HTTP stream ended: the same socket may start a turn now.
        for _ in range(50):
            await ws.send(start_frame())
            frames = await turn(ws)
            if frames[-1] == {"type": "done"}:
                break
            await asyncio.sleep(0.02)
        assert frames[-1] == {"type": "done"}
    # Another key is not limited by alpha's streams.
    async with websockets.connect(ws_url(client), additional_headers=bearer(KEY_B)) as ws:
        await ws.send(start_frame())
        assert (await turn(ws))[-1] == {"type": "done"}


# --- CORS -----------------------------------------------------------------------------

ORIGIN = "https://app.example"


def _assert_cors(headers: Any, origin: str = ORIGIN) -> None:
    assert headers["Access-Control-Allow-Origin"] == origin
    exposed = {h.strip().lower() for h in headers["Access-Control-Expose-Headers"].split(",")}
    assert {"x-request-id", "x-client-request-id", "x-nexus-stream-id", "retry-after"} <= exposed
    assert {"retry-after-ms", "x-should-retry"} <= exposed  # what the SDKs wait on
    assert "Origin" in headers.getall("Vary", []) or "Origin" in headers.get("Vary", "")


async def test_cors_allowed_origin(make_client: MakeClient) -> None:
    client = await make_client(keyed(cors={"allow_origins": [ORIGIN], "max_age_s": 123}))
    hdrs = {"Origin": ORIGIN} | bearer(KEY_A)
    resp = await client.get("/v1/models", headers=hdrs)
    assert resp.status == 200
    _assert_cors(resp.headers)
    resp = await client.post("/v1/chat/completions", json=chat(stream=True), headers=hdrs)
    assert resp.status == 200
    _assert_cors(resp.headers)
    await resp.read()
    # Errors too (a browser must be able to read a 401).
    resp = await client.get("/v1/models", headers={"Origin": ORIGIN})
    assert resp.status == 401
    _assert_cors(resp.headers)
    # Preflight: no key needed.
    resp = await client.options(
        "/v1/chat/completions",
        headers={
            "Origin": ORIGIN,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        },
    )
    assert resp.status == 204
    assert resp.headers["Access-Control-Allow-Origin"] == ORIGIN
    assert "POST" in resp.headers["Access-Control-Allow-Methods"]
    allowed = {h.strip().lower() for h in resp.headers["Access-Control-Allow-Headers"].split(",")}
    assert {"authorization", "content-type", "x-api-key", "last-event-id"} <= allowed
    assert resp.headers["Access-Control-Max-Age"] == "123"
    # The SDKs' own headers, which a browser asks for first (the Anthropic SDK's in a page
    # could not call the gateway): plain names are allowed; anything else gets ours alone.
    sdk = "anthropic-version, anthropic-beta, x-stainless-os, x-stainless-retry-count"
    for asked, expected in ((sdk, True), ("x-a;Set-Cookie: a", False), ("a b", False)):
        preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST"}
        resp = await client.options(
            "/v1/messages", headers=preflight | {"Access-Control-Request-Headers": asked}
        )
        allowed = {h.strip() for h in resp.headers["Access-Control-Allow-Headers"].split(",")}
        assert ("x-stainless-os" in allowed) is expected and "X-Api-Key" in allowed


async def test_cors_disallowed_origin(make_client: MakeClient) -> None:
    client = await make_client(keyed(cors={"allow_origins": [ORIGIN]}))
    evil = {"Origin": "https://evil.example"}
    resp = await client.get("/v1/models", headers=evil | bearer(KEY_A))
    assert resp.status == 403  # a page of another site: refused, even with a key
    assert (await resp.json())["error"]["code"] == "origin_not_allowed"
    assert not any(h.lower().startswith("access-control-") for h in resp.headers)
    resp = await client.options(
        "/v1/chat/completions", headers=evil | {"Access-Control-Request-Method": "POST"}
    )
    assert resp.status != 204
    assert not any(h.lower().startswith("access-control-") for h in resp.headers)
    # No [cors] at all: the gateway's own pages only, and no CORS headers for anyone.
    plain = await make_client(keyed())
    resp = await plain.get("/v1/models", headers={"Origin": ORIGIN} | bearer(KEY_A))
    assert resp.status == 403
    assert "Access-Control-Allow-Origin" not in resp.headers
    own = str(plain.make_url("/")).rstrip("/")
    resp = await plain.get("/v1/models", headers={"Origin": own} | bearer(KEY_A))
    assert resp.status == 200
    assert "Access-Control-Allow-Origin" not in resp.headers


async def test_cors_wildcard(make_client: MakeClient) -> None:
    client = await make_client({"cors": {"allow_origins": ["*"]}})
    for origin in ("https://a.example", "http://localhost:5173"):
        resp = await client.post(
            "/v1/chat/completions", json=chat(stream=True), headers={"Origin": origin}
        )
        assert resp.status == 200
        assert resp.headers["Access-Control-Allow-Origin"] in (origin, "*")
        await resp.read()
        resp = await client.options(
            "/v1/responses",
            headers={"Origin": origin, "Access-Control-Request-Method": "POST"},
        )
        assert resp.status == 204
        assert resp.headers["Access-Control-Allow-Origin"] in (origin, "*")


# --- request ids ----------------------------------------------------------------------

GENERATED = re.compile(r"req_[0-9a-f]{24}")


CLIENT_ID = "client-req.42:abc"


@pytest.mark.parametrize("header", ["X-Client-Request-Id", "X-Request-Id"])
async def test_a_client_request_id_is_echoed_beside_the_gateways_own(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture, header: str
) -> None:
    """The id a client gives (OpenAI's header for it, or X-Request-Id as a proxy sets it)
    comes back as X-Client-Request-Id and is logged as client_request_id, on every path;
    X-Request-Id is the gateway's own, new each time."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client(keyed())
    rid = {header: CLIENT_ID}
    answers = [await client.get("/v1/models", headers=rid | bearer(KEY_A))]
    answers.append(await client.get("/v1/models", headers=rid))  # 401
    answers.append(
        await client.post("/v1/chat/completions", json={"model": 3}, headers=rid | bearer(KEY_A))
    )
    answers.append(await client.get("/nowhere", headers=rid))
    answers.append(
        await client.post(
            "/v1/chat/completions", json=chat(stream=True), headers=rid | bearer(KEY_A)
        )
    )
    assert [a.status for a in answers] == [200, 401, 400, 404, 200]
    await answers[-1].read()
    assert answers[-1].headers["X-Nexus-Stream-Id"] != CLIENT_ID
    ids = [a.headers["X-Request-Id"] for a in answers]
    assert all(GENERATED.fullmatch(i) for i in ids) and len(set(ids)) == len(ids)
    assert {a.headers["X-Client-Request-Id"] for a in answers} == {CLIENT_ID}
    lines = [r for r in caplog.records if r.name == "nexus.access"]
    assert [r.request_id for r in lines] == ids  # type: ignore[attr-defined]
    assert {r.access["client_request_id"] for r in lines} == {CLIENT_ID}  # type: ignore[attr-defined]
    assert f"client_request_id={CLIENT_ID}" in lines[0].getMessage()


async def test_a_client_cannot_give_its_request_another_requests_id(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Were a client's id the request's, a tenant could send another's (from an error it
    saw) and have two access lines, two spend lines and two spans share one id, one of
    them charged to it."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client()
    first = await client.post("/v1/chat/completions", json=chat())
    victim = first.headers["X-Request-Id"]
    for header in ("X-Request-Id", "X-Client-Request-Id"):
        second = await client.post("/v1/chat/completions", json=chat(), headers={header: victim})
        assert second.status == 200
        assert second.headers["X-Request-Id"] != victim
        assert second.headers["X-Client-Request-Id"] == victim
    lines = [r for r in caplog.records if r.name == "nexus.access"]
    assert [r.request_id for r in lines].count(victim) == 1  # type: ignore[attr-defined]
    assert [r.access.get("client_request_id") for r in lines] == [None, victim, victim]  # type: ignore[attr-defined]


async def test_an_openai_sdk_retry_keeps_its_client_id_and_gets_a_new_request_id(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK sends the same headers on every attempt: a client id in them names the
    call, the gateway's id each attempt (two ids alike would be two requests, not one)."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client(keyed(limits={"requests_per_second_per_key": 1}))
    oa = openai.AsyncOpenAI(base_url=str(client.make_url("/v1")), api_key=KEY_A, max_retries=1)
    headers = {"X-Client-Request-Id": "job-7.step-2"}
    await oa.chat.completions.create(**chat(), extra_headers=headers)
    raw = await oa.chat.completions.with_raw_response.create(**chat(), extra_headers=headers)
    assert GENERATED.fullmatch(raw.request_id or "")
    await oa.close()
    lines = [r for r in caplog.records if r.name == "nexus.access"]
    assert [r.access["status"] for r in lines] == [200, 429, 200]  # type: ignore[attr-defined]
    assert {r.access["client_request_id"] for r in lines} == {"job-7.step-2"}  # type: ignore[attr-defined]
    assert len({r.request_id for r in lines}) == 3  # type: ignore[attr-defined]
    assert lines[-1].request_id == raw.request_id  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "incoming", ["x" * 129, "has space", "semi;colon", "ünïcode", "", KEY_A], ids=repr
)
async def test_a_bad_client_request_id_is_dropped(make_client: MakeClient, incoming: str) -> None:
    client = await make_client()
    for header in ("X-Client-Request-Id", "X-Request-Id"):
        resp = await client.get("/v1/models", headers={header: incoming})
        assert resp.status == 200
        assert GENERATED.fullmatch(resp.headers["X-Request-Id"])
        assert "X-Client-Request-Id" not in resp.headers


async def test_request_id_generated(make_client: MakeClient) -> None:
    client = await make_client()
    seen = set()
    for _ in range(3):
        resp = await client.post("/v1/chat/completions", json=chat(stream=True))
        assert resp.status == 200
        rid = resp.headers["X-Request-Id"]
        assert GENERATED.fullmatch(rid)
        assert rid != resp.headers["X-Nexus-Stream-Id"]
        seen.add(rid)
        await resp.read()
    assert len(seen) == 3
    resp = await client.post("/v1/chat/completions", json=chat())
    assert GENERATED.fullmatch(resp.headers["X-Request-Id"])
    resp = await client.post("/v1/chat/completions", json={})
    assert resp.status == 400
    assert GENERATED.fullmatch(resp.headers["X-Request-Id"])


async def test_a_key_past_its_rate_is_refused_before_its_body_is_read(
    make_client: MakeClient,
) -> None:
    # Refused first, whatever it sent: the gateway neither reads nor parses the body of a
    # key that may not run anything now (a flood of bad or huge bodies costs it nothing).
    client = await make_client(keyed(limits={"requests_per_second_per_key": 1}))
    resp = await client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
    assert resp.status == 200
    await resp.read()
    for body in (b"{not json", orjson.dumps({"model": "not/allowed"}), b"[" * 5000):
        resp = await client.post(
            "/v1/chat/completions",
            data=body,
            headers={"Content-Type": "application/json"} | bearer(KEY_A),
        )
        assert resp.status == 429, await resp.text()
        assert (await resp.json())["error"]["code"] == "rate_limited"


async def test_a_body_still_uploading_holds_no_place_among_the_streams(
    make_client: MakeClient,
) -> None:
    # A client trickling its body (a slow link, or on purpose) has taken its rate's token
    # but no place: the key's one stream and the gateway's one stream stay free meanwhile.
    limits = {"max_concurrent_streams": 1, "max_concurrent_streams_per_key": 1}
    client = await make_client(keyed(limits=limits))
    _, writer = await asyncio.open_connection(client.server.host, client.server.port)
    try:
        head = (
            "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY_A}\r\nContent-Length: 1000\r\n\r\n"
        )
        writer.write(head.encode() + b'{"model": "mock/echo", ')
        await writer.drain()
        await asyncio.sleep(0.2)  # the gateway has the head and waits for the rest
        resp = await client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_A))
        assert resp.status == 200, await resp.text()
        await resp.read()
    finally:
        writer.close()


async def _returns_nothing(request: Any) -> Any:
    return None  # (a route's bug: no response)


async def _fails_after_its_headers(request: Any) -> Any:
    from aiohttp import web

    response = web.StreamResponse()
    await response.prepare(request)
    await response.write(b"partial")
    raise RuntimeError("a plugin route's bug, past its headers")


async def test_a_bug_past_the_routes_is_an_error_on_its_line_not_a_client_gone(
    aiohttp_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """An error that gets past every middleware is the gateway's (500), not a client that
    left: its line says ``error:500``, where it said ``cancelled:client_disconnect``."""
    from nexus.config import parse_config
    from nexus.encoders.registry import default_registry
    from nexus.server.app import create_app

    app = create_app(parse_config({}), registry=default_registry.copy())
    app.router.add_get("/broken", _returns_nothing)
    app.router.add_get("/half", _fails_after_its_headers)
    client = await aiohttp_client(app)
    caplog.set_level(logging.CRITICAL, logger="aiohttp")  # (its traceback)
    caplog.set_level(logging.INFO, logger="nexus.access")  # (and the handler's level: last)
    response = await client.get("/broken")
    assert response.status == 500
    for _ in range(100):
        lines = [r for r in caplog.records if r.name == "nexus.access"]
        if lines:
            break
        await asyncio.sleep(0.01)
    (line,) = lines
    assert (line.access["status"], line.access["outcome"]) == (500, "error:500")  # type: ignore[attr-defined]
    # Past its headers (a route that wrote before failing): the stream did not end well.
    with contextlib.suppress(aiohttp.ClientError):
        await (await client.get("/half")).read()
    for _ in range(100):
        lines = [r for r in caplog.records if r.name == "nexus.access"]
        if len(lines) == 2:
            break
        await asyncio.sleep(0.01)
    assert lines[1].access["outcome"] == "mid_stream_error:internal_error"  # type: ignore[attr-defined]


async def test_a_refusal_before_any_route_is_readable_by_an_allowed_page(
    make_client: MakeClient,
) -> None:
    """A keyless gateway's host refusal had no CORS headers: the page saw "Failed to
    fetch", not why."""
    client = await make_client({"cors": {"allow_origins": [ORIGIN]}})
    resp = await client.get("/v1/models", headers={"Origin": ORIGIN, "Host": "devbox.lan"})
    assert resp.status == 403
    assert (await resp.json())["error"]["code"] == "host_not_allowed"
    _assert_cors(resp.headers)
