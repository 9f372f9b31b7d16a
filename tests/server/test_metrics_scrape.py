"""``GET /metrics``: who may read it (a reverse proxy on the same host included), what a
refusal leaves behind, and what a scrape costs the streams running beside it."""

from __future__ import annotations

import asyncio
import gc
import logging
import threading
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from nexus.auth import Forbidden, hash_key
from nexus.config import parse_config
from nexus.errors import ConfigError
from nexus.pricing import Spend
from nexus.server.access import METRICS
from nexus.server.app import metrics_token
from nexus.server.metrics import Metrics, ModelLabels
from nexus.server.routes import metrics as metrics_page
from support import METRICS_TOKEN, METRICS_TOKEN_ENV, SCRAPER, MakeClient, chat

KEY_A = "nx-alpha-0123456789-secret"
KEY_B = "nx-beta-9876543210-secret"
TOKEN_CONFIG = {"token_env": METRICS_TOKEN_ENV}


def keyed(**extra: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "auth": {
            "keys": [
                {"name": "alpha", "sha256": hash_key(KEY_A)},
                {"name": "acme-secret-project", "sha256": hash_key(KEY_B)},
            ]
        },
        "models": {"mock/echo": {"input_usd_per_mtok": 1000, "output_usd_per_mtok": 1000}},
    }
    config.update(extra)
    return config


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def refused(metrics: Metrics) -> dict[str, float]:
    """``nexus_metrics_refused_total`` by reason, read from the registry itself."""
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(metrics.render().decode())
        for sample in family.samples
        if sample.name == "nexus_metrics_refused_total"
    }


# --- who may read it ------------------------------------------------------------------


class SameHostProxy:
    """A reverse proxy as nginx's default ``proxy_pass http://127.0.0.1:PORT;`` is: it
    connects from 127.0.0.1 and sends the upstream's own name as ``Host``."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.url = ""

    async def relay(self, request: web.Request) -> web.Response:
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host",)}
        async with (
            aiohttp.ClientSession() as http,
            http.request(
                request.method,
                self.upstream + request.rel_url.path_qs,
                headers=headers,
                data=await request.read(),
            ) as resp,
        ):
            return web.Response(status=resp.status, body=await resp.read())

    async def __aenter__(self) -> SameHostProxy:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self.relay)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.runner.cleanup()


@pytest.mark.parametrize(
    "auth",
    [keyed()["auth"], {"allow_unauthenticated": True}],
    ids=["keys", "allow-unauthenticated"],
)
async def test_metrics_behind_a_same_host_proxy_are_closed_without_a_token(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch, auth: dict[str, Any]
) -> None:
    """Through a proxy on this machine every client is a loopback peer asking for a
    loopback name: without a token /metrics named every key and what it spent to anyone
    who reached the proxy. Served to others, it now answers its bearer token only."""
    client = await make_client({**keyed(), "auth": auth})
    spend = await client.post("/v1/chat/completions", json=chat(), headers=bearer(KEY_B))
    assert spend.status == 200
    upstream = str(client.make_url("")).rstrip("/")
    async with SameHostProxy(upstream) as proxy, aiohttp.ClientSession() as outside:
        for headers in ({"Host": "api.example.com"}, {}, bearer(KEY_A)):
            async with outside.get(proxy.url + "/metrics", headers=headers) as resp:
                text = await resp.text()
                assert resp.status == 403, text
                assert "acme-secret-project" not in text and "nexus_cost" not in text
    # Directly, from this machine by a loopback name: closed too (nothing tells it apart).
    resp = await client.get("/metrics", headers={"Host": "127.0.0.1"})
    assert resp.status == 403
    error = (await resp.json())["error"]
    assert error["code"] == "metrics_token_not_set"
    assert "[metrics] token_env" in error["message"]
    assert refused(client.server.app[METRICS]) == {"token_not_set": 4}
    # With a token, its holder reads it through the proxy as from anywhere.
    monkeypatch.setenv(METRICS_TOKEN_ENV, METRICS_TOKEN)
    client = await make_client({**keyed(), "auth": auth, "metrics": TOKEN_CONFIG})
    upstream = str(client.make_url("")).rstrip("/")
    async with SameHostProxy(upstream) as proxy, aiohttp.ClientSession() as outside:
        async with outside.get(proxy.url + "/metrics") as resp:
            assert resp.status == 401
        async with outside.get(proxy.url + "/metrics", headers=SCRAPER) as resp:
            assert resp.status == 200 and "nexus_requests_total" in await resp.text()


async def test_metrics_behind_a_token_when_one_is_set(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(METRICS_TOKEN_ENV, METRICS_TOKEN)
    client = await make_client(keyed(metrics=TOKEN_CONFIG))
    for headers in ({}, bearer(KEY_A), bearer("scrape-me"), {"Authorization": "Basic x"}):
        resp = await client.get("/metrics", headers=headers)
        assert resp.status == 401
        assert "scrape-me" not in await resp.text()
    resp = await client.get("/metrics", headers=SCRAPER)
    assert resp.status == 200 and "nexus_requests_total" in await resp.text()
    # Bytes that are no UTF-8 in the header: a 401, not a 500.
    reader, writer = await asyncio.open_connection(client.server.host, client.server.port)
    writer.write(b"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe\r\n\r\n")
    assert (await reader.readline()).startswith(b"HTTP/1.1 401")
    writer.close()
    # With its token, /metrics is for whoever holds it, under any name (a scraper's).
    headers = {"Host": "gateway.internal", **SCRAPER}
    assert (await client.get("/metrics", headers=headers)).status == 200
    # A token read from a secret file ends with its newline: not a part of it.
    monkeypatch.setenv(METRICS_TOKEN_ENV, METRICS_TOKEN + "\n")
    client = await make_client(keyed(metrics=TOKEN_CONFIG))
    assert (await client.get("/metrics", headers=SCRAPER)).status == 200
    monkeypatch.delenv(METRICS_TOKEN_ENV)
    with pytest.raises(ConfigError, match="token_env: the environment variable it names is not"):
        await make_client(keyed(metrics=TOKEN_CONFIG))
    # /metrics turned off asks for no token: an unset one no longer refuses the start
    # (`nexus serve` checks it before any worker starts, with metrics_token).
    assert metrics_token(parse_config({"metrics": {**TOKEN_CONFIG, "enabled": False}})) is None
    # The name is not repeated: a token put there by mistake is a valid name too.
    with pytest.raises(ConfigError) as refusal:
        await make_client(keyed(metrics={"token_env": "mtok_Zq81xYwV7uT6sR5q"}))
    assert "mtok_Zq81xYwV7uT6sR5q" not in str(refusal.value)


async def test_a_keyless_gateway_serves_metrics_to_this_machine_by_its_names(
    make_client: MakeClient,
) -> None:
    # A page the operator opened read it through DNS rebinding (attacker.example -> 127.0.0.1).
    client = await make_client()
    resp = await client.get("/metrics", headers={"Host": "attacker.example"})
    assert resp.status == 403
    assert (await resp.json())["error"]["code"] == "host_not_allowed"
    for host in ("localhost:8080", "127.0.0.1", "[::1]:9"):
        resp = await client.get("/metrics", headers={"Host": host})
        assert resp.status == 200 and "nexus_requests_total" in await resp.text()
    # Refused before the route runs (by the access middleware), and counted as the route's
    # own refusals are; so is a page of another site's (its Origin).
    resp = await client.get("/metrics", headers={"Origin": "https://attacker.example"})
    assert resp.status == 403
    assert (await resp.json())["error"]["code"] == "origin_not_allowed"
    assert refused(client.server.app[METRICS]) == {"not_local": 1, "origin": 1}
    # Other paths' refusals are not /metrics'.
    assert (await client.get("/v1/models", headers={"Host": "attacker.example"})).status == 403
    assert refused(client.server.app[METRICS]) == {"not_local": 1, "origin": 1}


async def test_a_keyless_gateway_serves_metrics_to_no_client_beyond_this_machine() -> None:
    # On a public interface anyone could send "Host: localhost": the peer must be local too.
    from unittest import mock

    from aiohttp.test_utils import make_mocked_request

    app = web.Application()
    app[METRICS] = Metrics()
    serve = metrics_page.endpoint(None, served_to_others=False)
    for peer in (("203.0.113.9", 40000), ("192.168.1.20", 40000), ("::ffff:10.0.0.1", 1, 0, 0)):
        transport = mock.Mock()
        transport.get_extra_info.side_effect = lambda name, default=None, p=peer: (
            p if name == "peername" else default
        )
        request = make_mocked_request(
            "GET", "/metrics", headers={"Host": "localhost"}, transport=transport, app=app
        )
        with pytest.raises(Forbidden) as refusal:
            await serve(request)
        assert refusal.value.code == "host_not_allowed", peer
    assert refused(app[METRICS]) == {"not_local": 3}


# --- what a refusal leaves ------------------------------------------------------------


async def test_refused_tokens_are_counted_and_warned_of_once_a_minute(
    make_client: MakeClient,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Wrong guesses at the token left no trace: each now counts, and a warning says how
    many came since the last one, at most once a minute (a guesser cannot flood the log)."""
    caplog.set_level(logging.WARNING, logger="nexus")
    monkeypatch.setenv(METRICS_TOKEN_ENV, METRICS_TOKEN)
    client = await make_client(keyed(metrics=TOKEN_CONFIG))
    guesses = ["scrape-me-0123456788", "guess-two", "", KEY_A]
    for guess in guesses:
        assert (await client.get("/metrics", headers=bearer(guess))).status == 401

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if "/metrics refused" in r.getMessage()]

    assert len(warnings()) == 1
    assert "refused 1 request(s)" in warnings()[0]
    assert "127.0.0.1" in warnings()[0]
    resp = await client.get("/metrics", headers=SCRAPER)
    samples = {
        s.labels.get("reason"): s.value
        for family in text_string_to_metric_families(await resp.text())
        for s in family.samples
        if s.name == "nexus_metrics_refused_total"
    }
    assert samples == {"token": len(guesses)}
    # A minute on, the next refusal warns again, with the ones held back.
    later = time.monotonic() + metrics_page.WARN_EVERY_S + 1
    monkeypatch.setattr(metrics_page, "monotonic", lambda: later)
    assert (await client.get("/metrics", headers=bearer("again"))).status == 401
    assert len(warnings()) == 2
    assert f"refused {len(guesses)} request(s)" in warnings()[1]
    logged = " ".join(warnings())
    assert not any(guess and guess in logged for guess in guesses)


# --- what a scrape costs --------------------------------------------------------------


def fill(metrics: Metrics, keys: int = 200, models: int = 20) -> None:
    """Spend of ``keys`` keys on ``models`` models: 25,000 series with their tokens."""
    labels = metrics.model_label
    metrics.model_label = ModelLabels(
        labels.models | {f"model-{i}" for i in range(models)}, labels.providers
    )
    spend = Spend(
        prompt_tokens=10,
        completion_tokens=5,
        cached_tokens=1,
        reasoning_tokens=1,
        cost_usd=0.1,
        estimated=False,
        cache_write_tokens=1,
    )
    for k in range(keys):
        for i in range(models):
            metrics.spent(f"model-{i}", f"key-{k}", spend)


async def test_a_scrape_does_not_stall_the_streams(make_client: MakeClient) -> None:
    """Each scrape rendered on the event loop: every stream of the process stopped for the
    length of the render. The loop now stays free while it renders (a lag probe), and a
    stream's chunks keep coming."""
    client = await make_client()
    metrics = client.server.app[METRICS]
    fill(metrics)
    began = time.perf_counter()
    metrics.render()
    render_s = time.perf_counter() - began

    lags: list[float] = []
    done = asyncio.Event()

    async def probe() -> None:
        while not done.is_set():
            asked = time.perf_counter()
            await asyncio.sleep(0.005)
            lags.append(time.perf_counter() - asked - 0.005)

    body = chat(" ".join(["w"] * 1000), stream=True, mock={"delay_ms": 5})
    stream = await client.post("/v1/chat/completions", json=body)
    assert stream.status == 200
    gaps: list[float] = []

    async def read() -> None:
        last = time.perf_counter()
        async for _ in stream.content.iter_any():
            now = time.perf_counter()
            gaps.append(now - last)
            last = now
            if done.is_set():
                break

    probing = asyncio.create_task(probe())
    reading = asyncio.create_task(read())
    await asyncio.sleep(0.05)
    # The cyclic collector stops every thread while it runs, wherever the render is: one
    # collection in a test process full of earlier tests' objects took 0.29 s, in the
    # render's thread. What is measured here is where the render runs.
    gc.disable()
    try:
        lags.clear()
        gaps.clear()
        resp = await client.get("/metrics")
        page = await resp.read()
        done.set()
        await probing
        await reading
    finally:
        gc.enable()
    stream.close()
    assert resp.status == 200 and page.count(b"\nnexus_tokens_total{") == 200 * 20 * 5
    assert lags and gaps
    # On the loop, the probe waited the whole render once; in a thread, a switch interval.
    assert max(lags) < render_s / 2, (max(lags), render_s)
    assert max(gaps) < render_s / 2, (max(gaps), render_s)


class HeldRender:
    """A collector whose collection waits until it is let go, counting collections."""

    def __init__(self) -> None:
        self.collections = 0
        self.entered = threading.Event()
        self.release = threading.Event()

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        self.collections += 1
        self.entered.set()
        self.release.wait(timeout=5)  # (on the loop, without the fix: no deadlock)
        return iter(())


async def test_concurrent_scrapes_share_one_render(make_client: MakeClient) -> None:
    """Every scrape rendered its own page: N at once cost N renders. Those that arrive
    while one renders now get its page."""
    client: TestClient[Any, Any] = await make_client()
    metrics = client.server.app[METRICS]
    held = HeldRender()
    metrics.registry.register(held)  # type: ignore[arg-type]
    server = client.server.runner.server
    assert server is not None
    before = server.requests_count
    scrapes = [asyncio.create_task(client.get("/metrics")) for _ in range(4)]
    for _ in range(200):  # every scrape reached the gateway
        if server.requests_count - before >= len(scrapes):
            break
        await asyncio.sleep(0.01)
    await asyncio.sleep(0.1)  # and waits in its handler
    held.release.set()
    pages = [await (await scrape).read() for scrape in scrapes]
    assert held.collections == 1
    assert len(set(pages)) == 1 and b"nexus_requests_total" in pages[0]
    # The next scrape renders anew.
    assert (await client.get("/metrics")).status == 200
    assert held.collections == 2


async def test_a_scraper_that_leaves_does_not_cancel_the_render_others_wait_for() -> None:
    metrics = Metrics()
    held = HeldRender()
    metrics.registry.register(held)  # type: ignore[arg-type]
    first = asyncio.create_task(metrics.scrape())
    second = asyncio.create_task(metrics.scrape())
    await asyncio.to_thread(held.entered.wait, 5)
    first.cancel()
    held.release.set()
    assert b"nexus_requests_total" in await second
    assert held.collections == 1
    with pytest.raises(asyncio.CancelledError):
        await first
