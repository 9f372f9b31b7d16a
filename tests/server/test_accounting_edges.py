"""Accounting under an adversarial tenant and a hostile upstream.

Each test reproduces a way the numbers an operator relies on could be escaped or
blown up, on a real ``nexus serve`` where it needs one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nexus.auth import ApiKey, hash_key
from nexus.cache.limits import LocalLimits
from nexus_process import start_nexus, stop_nexus
from redis_support import connect_or_skip, drop_keys, new_prefix
from support import MakeClient
from upstreams import FakeUpstream, Reply, openai_chunk, sse

KEY = "nx-accounting-edges-0042"
BEARER = {"Authorization": f"Bearer {KEY}"}


@contextlib.contextmanager
def serve(tmp_path: Path, text: str) -> Iterator[str]:
    path = tmp_path / "config.toml"
    path.write_text(text)
    proc, match = start_nexus(path, tmp_path / "nexus.log")
    try:
        yield match.group(1)
    finally:
        stop_nexus(proc, gently=False)


BUDGETED = f"""
[[auth.keys]]
name = "tenant"
sha256 = "{hash_key(KEY)}"
budget_usd = 0.02                # $0.001 a token: one request, capped at 10 tokens, fits
budget_period = "total"

[providers.mock]
kind = "mock"
models = ["echo"]

[models."mock/echo"]             # the one model the operator priced
input_usd_per_mtok = 1000
output_usd_per_mtok = 1000

[models."cheap"]                 # an alias without a price of its own, one target priced
targets = ["mock/echo", "mock/other"]
"""


async def test_a_key_with_a_budget_cannot_spend_on_a_model_without_a_price(
    tmp_path: Path,
) -> None:
    """A model without a price has no cost, so it was never charged: a key with a budget
    ran it for free, forever. Fail closed, as for a budget Redis cannot check."""
    chat = {"messages": [{"role": "user", "content": "one two three"}]}
    with serve(tmp_path, BUDGETED) as url:
        async with aiohttp.ClientSession(url) as http:
            for model in ("mock/other", "cheap"):
                for stream in (False, True):
                    body = {**chat, "model": model, "stream": stream}
                    async with http.post("/v1/chat/completions", json=body, headers=BEARER) as r:
                        assert r.status == 403, (model, stream, await r.text())
                        error = (await r.json())["error"]
                        assert error["code"] == "model_not_priced"
                        assert model in error["message"]
            # An unknown model is still the 404 it always was.
            body = {**chat, "model": "nope/x"}
            async with http.post("/v1/chat/completions", json=body, headers=BEARER) as r:
                assert r.status == 404
            # The priced model is charged, and the budget then holds.
            body = {**chat, "model": "mock/echo", "max_tokens": 10}
            async with http.post("/v1/chat/completions", json=body, headers=BEARER) as r:
                assert r.status == 200
            async with http.post("/v1/chat/completions", json=body, headers=BEARER) as r:
                assert r.status == 429
                assert (await r.json())["error"]["code"] == "budget_exceeded"


UPSTREAM_KEY_ENV = "NEXUS_TEST_ACCOUNTING_UPSTREAM_KEY"


def hostile_upstream(url: str) -> str:
    return f"""
[providers.oai]
kind = "openai"
base_url = "{url}/v1"
api_key_env = "{UPSTREAM_KEY_ENV}"
models = ["gpt-x"]
"""


async def test_an_upstreams_error_codes_cannot_mint_metric_series(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The code of an error inside an upstream's stream went verbatim into the labels of
    ``nexus_upstream_errors_total`` and ``nexus_requests_total{outcome}``: an upstream (any
    OpenAI-compatible server) that puts an id in its codes grows /metrics without bound."""
    monkeypatch.setenv(UPSTREAM_KEY_ENV, "sk-upstream")
    count = 120
    async with FakeUpstream() as fake:
        for i in range(count):
            error = sse(
                {"error": {"code": f"busy_{i:04d}", "type": "server_error", "message": "x"}}
            )
            # Half fail mid-stream (after a delta), half before any output (an HTTP error).
            head = [openai_chunk(content="Hi")] if i % 2 else []
            fake.add(Reply.stream([*head, error]))
        with serve(tmp_path, hostile_upstream(fake.url)) as url:
            async with aiohttp.ClientSession(url) as http:
                body = {
                    "model": "oai/gpt-x",
                    "stream": True,
                    "messages": [{"role": "user", "content": "hi"}],
                }
                for i in range(count):
                    async with http.post("/v1/chat/completions", json=body) as r:
                        text = await r.text()
                        assert f"busy_{i:04d}" in text  # the client still gets the code
                # The gateway's own codes keep their labels past the upstream's 64.
                async with http.post("/v1/chat/completions", json={**body, "max_tokens": -5}) as r:
                    assert r.status == 400
                async with http.get("/metrics") as r:
                    metrics = await r.text()
    families = {f.name: f for f in text_string_to_metric_families(metrics)}
    codes = {s.labels["code"] for s in families["nexus_upstream_errors"].samples}
    outcomes = {s.labels["outcome"] for s in families["nexus_requests"].samples}
    assert len(codes) <= 65, sorted(codes)
    assert len(outcomes) <= 2 * 65 + 1, sorted(outcomes)
    assert "other" in codes
    assert "error:invalid_request" in outcomes


@contextlib.asynccontextmanager
async def lossy_redis(marker: bytes) -> AsyncIterator[str]:
    """A TCP proxy to the test Redis that loses the reply to the first command carrying
    ``marker``: the command is carried out, the client's connection then drops (what a
    network blip or a timed-out read does)."""
    dropped = False
    cut: set[asyncio.StreamWriter] = set()  # client connections whose replies are lost

    async def pipe(
        reader: asyncio.StreamReader, writer: asyncio.StreamWriter, client: asyncio.StreamWriter
    ) -> None:
        nonlocal dropped
        up = writer is not client
        with contextlib.suppress(OSError):
            while data := await reader.read(65536):
                if up and marker in data and not dropped:
                    dropped = True
                    cut.add(client)
                    writer.write(data)
                    await asyncio.sleep(0.2)  # Redis has carried it out by now
                    return
                if client in cut:
                    continue
                writer.write(data)
                await writer.drain()

    async def handle(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        redis_r, redis_w = await asyncio.open_connection("127.0.0.1", 6379)
        upward = asyncio.ensure_future(pipe(client_r, redis_w, client_w))
        downward = asyncio.ensure_future(pipe(redis_r, client_w, client_w))
        await asyncio.wait((upward, downward), return_when=asyncio.FIRST_COMPLETED)
        for end in (upward, downward):
            end.cancel()
        for writer in (client_w, redis_w):
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        server.close()
    assert dropped, "no command carried the marker"


async def test_a_charge_whose_reply_is_lost_is_counted_once() -> None:
    """A charge was an INCRBYFLOAT retried when its reply did not come back (by redis-py,
    and again on the next tick): a reply lost after Redis added the spend added it twice,
    and the tenant was refused at half its budget."""
    from nexus.cache.redis import RedisStore
    from nexus.cache.redis_limits import RedisLimits

    direct = await connect_or_skip()
    prefix = new_prefix()
    key = ApiKey("alpha", budget_usd=1.0, budget_period="total")
    spend_key = f"{prefix}:spend:alpha:total"
    try:
        async with lossy_redis(spend_key.encode()) as url:
            store = RedisStore(url, prefix=prefix)
            await store.start()
            limits = RedisLimits(
                store, rate=0, per_key=None, lease_s=0.3, fallback=LocalLimits(0, None)
            )
            await limits.start()
            try:
                await limits.charge(key, 0.25)
                await asyncio.sleep(0.4)  # a tick: a charge that failed is retried
            finally:
                await limits.close()
                await store.close()
        assert float(await direct.get(spend_key) or 0) == pytest.approx(0.25)
    finally:
        await drop_keys(direct, prefix)
        await direct.aclose()


async def test_a_non_streaming_request_is_held_to_max_stream_duration(tmp_path: Path) -> None:
    """Without the cache a non-streaming request runs no stream of its own, and nothing
    timed it: a tenant escaped ``max_stream_duration_s`` (and the gateway paid for the
    whole generation) by asking for JSON instead of a stream."""
    text = """
[limits]
max_stream_duration_s = 0.5

[providers.mock]
kind = "mock"
models = ["echo"]
"""
    body = {
        "model": "mock/echo",
        "mock": {"delay_ms": 150},
        "messages": [{"role": "user", "content": "a b c d e f g h i j k l m n o p"}],
    }
    with serve(tmp_path, text) as url:
        async with aiohttp.ClientSession(url) as http:
            loop = asyncio.get_running_loop()
            started = loop.time()
            async with http.post("/v1/chat/completions", json=body) as r:
                error = (await r.json())["error"]
            assert loop.time() - started < 1.5  # not the 2.4 s the whole answer takes
            assert r.status == 500 and error["code"] == "max_stream_duration"
            async with http.post("/v1/messages", json={**body, "max_tokens": 64}) as r:
                assert r.status == 500
                assert (await r.json())["error"]["type"] == "api_error"


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"service_tier": "priority"}, "service_tier"),
        ({"web_search_options": {}}, "web_search_options"),
        ({"plugins": [{"id": "web"}]}, "plugins"),  # OpenRouter's, per call
        ({"models": ["openai/gpt-4o", "anthropic/claude-3-opus"]}, "models"),
        (
            {"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}},
            "modalities",
        ),
        (
            {
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {
                                "type": "input_audio",
                                "input_audio": {"data": "UklGRg==", "format": "wav"},
                            }
                        ],
                    }
                ]
            },
            "messages[0]",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "user", "content": [{"type": "file", "file": {"file_id": "file-1"}}]},
                ]
            },
            "messages[1]",
        ),
        (  # an earlier audio answer, named by its id: the upstream reads it as audio input
            {
                "messages": [
                    {"role": "user", "content": "hi"},
                    {"role": "assistant", "audio": {"id": "audio_1"}},
                    {"role": "user", "content": "again"},
                ]
            },
            "messages[1].audio",
        ),
    ],
)
async def test_a_budget_refuses_what_the_price_does_not_cover(
    make_client: MakeClient, extra: dict[str, Any], param: str
) -> None:
    """A dearer tier, audio tokens and per-call search fees are billed above the listed
    text price: charged at it, a budget would undercount them. Refused for a key with a
    budget; a key without one sends them on."""
    config = {
        "auth": {
            "keys": [
                {"name": "tenant", "sha256": hash_key(KEY), "budget_usd": 100},
                {"name": "free", "sha256": hash_key(KEY + "-free")},
            ]
        },
        "models": {"mock/echo": {"input_usd_per_mtok": 1, "output_usd_per_mtok": 1}},
    }
    client = await make_client(config)
    body = {"model": "mock/echo", "messages": [{"role": "user", "content": "hi"}], **extra}
    resp = await client.post("/v1/chat/completions", json=body, headers=BEARER)
    assert resp.status == 403
    error = (await resp.json())["error"]
    assert (error["code"], error["param"]) == ("model_not_priced", param)
    plain = {"model": "mock/echo", "messages": [{"role": "user", "content": "hi"}]}
    resp = await client.post("/v1/chat/completions", json=plain, headers=BEARER)
    assert resp.status == 200
    free = {"Authorization": f"Bearer {KEY}-free"}
    resp = await client.post("/v1/chat/completions", json=body, headers=free)
    assert resp.status != 403
