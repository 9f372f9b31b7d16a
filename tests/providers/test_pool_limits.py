"""No silent queue, no unhandled 500 when a pool runs out, on a real ``nexus serve``.

A provider's connection pool (``max_connections``): a request that finds it full
waits at most ``pool_timeout_s``, then gets 503 ``upstream_pool_exhausted`` (or the
next target of its alias); the wait shows in ``nexus_upstream_pool_wait_seconds``
and in the access line's ``pool_wait_ms``. The Redis store's pool: a request that
cannot get a connection in ``[store] pool_timeout_s`` gets 503 ``store_unavailable``
with ``Retry-After``, counted in ``nexus_store_errors_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiohttp
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nexus_process import start_nexus, stop_nexus
from redis_support import connect_or_skip, drop_keys, new_prefix
from upstreams import FakeUpstream, Reply, openai_chunk

CHAT = "/v1/chat/completions"


@contextlib.contextmanager
def serve(tmp_path: Path, text: str) -> Iterator[tuple[str, Path]]:
    path = tmp_path / "config.toml"
    path.write_text(text)
    log = tmp_path / "nexus.log"
    proc, match = start_nexus(path, log)
    try:
        yield match.group(1), log
    finally:
        stop_nexus(proc)


def access_lines(log: Path) -> dict[str, dict[str, Any]]:
    lines = {}
    for line in log.read_text().splitlines():
        if line.startswith("{"):
            record = orjson.loads(line)
            if record.get("logger") == "nexus.access" and "client_request_id" in record:
                lines[record["client_request_id"]] = record  # the id the test gave
    return lines


async def wait_for_line(log: Path, request_id: str) -> dict[str, Any]:
    for _ in range(100):
        found = access_lines(log).get(request_id)
        if found is not None:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"no access line for {request_id}:\n{log.read_text()}")


Samples = dict[tuple[str, frozenset[Any]], float]


async def metrics(session: aiohttp.ClientSession, url: str) -> Samples:
    async with session.get(url + "/metrics") as resp:
        text = await resp.text()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def body(model: str) -> dict[str, Any]:
    return {"model": model, "stream": True, "messages": [{"role": "user", "content": "hi"}]}


PROVIDER_CONFIG = """
[server]
shutdown_grace_s = 0.2

[logging]
format = "json"

[providers.mock]
kind = "mock"
models = ["echo"]

[providers.oai]
kind = "openai"
base_url = "{url}/v1"
models = ["gpt-x"]
max_connections = 2
pool_timeout_s = 0.5

[models."pooled"]
targets = ["oai/gpt-x", "mock/echo"]
"""


async def test_a_full_provider_pool_is_a_bounded_visible_wait(tmp_path: Path) -> None:
    # Every upstream stream sends one chunk, then holds its connection until dropped.
    held = Reply.stream([openai_chunk(content="Hi")], end="stall")
    async with FakeUpstream(default=held) as fake, aiohttp.ClientSession() as session:
        with serve(tmp_path, PROVIDER_CONFIG.format(url=fake.url)) as (url, log):

            async def hold(request_id: str) -> aiohttp.ClientResponse:
                resp = await session.post(
                    url + CHAT, json=body("oai/gpt-x"), headers={"X-Client-Request-Id": request_id}
                )
                assert resp.status == 200
                while b"Hi" not in await resp.content.readuntil(b"\n\n"):
                    pass  # the role delta first, then the upstream's chunk
                return resp

            first, second = await hold("r-held-1"), await hold("r-held-2")

            # Third: the pool is full. A 503 after pool_timeout_s, not a hang.
            started = time.monotonic()
            async with session.post(
                url + CHAT, json=body("oai/gpt-x"), headers={"X-Client-Request-Id": "r-exhausted"}
            ) as resp:
                error = await resp.json()
                assert resp.status == 503, error
                assert resp.headers["Retry-After"] == "1"
            elapsed = time.monotonic() - started
            assert error["error"]["code"] == "upstream_pool_exhausted"
            assert 0.4 <= elapsed < 3.0, elapsed

            # With a fallback target, the alias moves on to it instead.
            async with session.post(
                url + CHAT, json=body("pooled"), headers={"X-Client-Request-Id": "r-fallback"}
            ) as resp:
                assert resp.status == 200
                assert b"data: [DONE]" in await resp.read()

            # A request that waits, then gets the connection a leaving client frees.
            waiting = asyncio.ensure_future(hold("r-waited"))
            await asyncio.sleep(0.2)
            first.close()  # the gateway drops its upstream: a connection is free
            third = await asyncio.wait_for(waiting, 5)

            found = await metrics(session, url)
            third.close()
            second.close()

            exhausted = await wait_for_line(log, "r-exhausted")
            assert (exhausted["status"], exhausted["outcome"]) == (
                503,
                "error:upstream_pool_exhausted",
            )
            assert 400 <= exhausted["pool_wait_ms"] < 3000
            fallback = await wait_for_line(log, "r-fallback")
            assert fallback["served"] == "mock/echo"
            assert 400 <= fallback["pool_wait_ms"] < 3000
            waited = await wait_for_line(log, "r-waited")
            assert waited["status"] == 200
            assert 100 <= waited["pool_wait_ms"] < 450, waited
            assert (await wait_for_line(log, "r-held-1"))["pool_wait_ms"] < 50

    def sample(name: str, **labels: str) -> float:
        return found.get((name, frozenset(labels.items())), 0.0)

    wait = "nexus_upstream_pool_wait_seconds"
    # One observation per upstream request: two held, two exhausted, one that waited.
    assert sample(wait + "_count", provider="oai") == 5
    assert 1.1 <= sample(wait + "_sum", provider="oai") < 5.0
    assert sample(wait + "_bucket", provider="oai", le="0.1") == 2  # the two that got one
    assert sample(wait + "_bucket", provider="oai", le="0.25") == 3  # and the one that waited
    assert sample(wait + "_bucket", provider="oai", le="+Inf") == 5


STORE_CONFIG = """
[server]
shutdown_grace_s = 0.2

[logging]
format = "json"

[store]
kind = "redis"
prefix = "{prefix}"
max_connections = 1
pool_timeout_s = 0.001

[providers.mock]
kind = "mock"
models = ["echo"]
"""


async def test_a_busy_store_pool_is_a_503_never_a_500(tmp_path: Path) -> None:
    client = await connect_or_skip()
    prefix = new_prefix()
    try:
        with serve(tmp_path, STORE_CONFIG.format(prefix=prefix)) as (url, _log):
            async with aiohttp.ClientSession() as session:

                async def one(i: int) -> tuple[int, str | None, str | None]:
                    request = body("mock/echo")
                    request["messages"][0]["content"] = f"request {i} " + "word " * 20
                    async with session.post(url + CHAT, json=request) as resp:
                        raw = await resp.read()
                        if resp.status == 200:
                            assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
                            return 200, None, None
                        return (
                            resp.status,
                            orjson.loads(raw)["error"]["code"],
                            resp.headers.get("Retry-After"),
                        )

                # Alone, a request has the connection to itself; in a burst of 60, which
                # ones find it busy is up to the scheduler (at times every one of them).
                alone = await one(-1)
                answers = await asyncio.gather(*(one(i) for i in range(60)))
                found = await metrics(session, url)
    finally:
        await drop_keys(client, prefix)
        await client.aclose()

    statuses = {status for status, _, _ in answers}
    assert statuses <= {200, 503}, answers
    refused = [a for a in answers if a[0] == 503]
    assert refused, "the burst never found the one connection busy"
    assert all(code == "store_unavailable" and retry == "1" for _, code, retry in refused)
    assert alone == (200, None, None)
    # Counted as the pool being busy, not Redis failing: what to raise differs.
    busy = frozenset({("op", "begin"), ("cause", "busy")})
    assert found.get(("nexus_store_errors_total", busy), 0.0) == len(refused)
    assert not any(
        ("cause", "unreachable") in labels
        for (name, labels) in found
        if name == "nexus_store_errors_total"
    )
    requests = sum(
        value
        for (name, labels), value in found.items()
        if name == "nexus_requests_total" and ("outcome", "error:store_unavailable") in labels
    )
    assert requests == len(refused)


@pytest.mark.parametrize("max_connections", [0, 10_000])
def test_provider_pool_defaults_and_unlimited(max_connections: int) -> None:
    from nexus.config import OpenAIProviderConfig

    default = OpenAIProviderConfig(kind="openai", base_url="http://x")
    assert (default.max_connections, default.pool_timeout_s) == (10_000, 10.0)
    chosen = OpenAIProviderConfig(
        kind="openai", base_url="http://x", max_connections=max_connections
    )
    assert chosen.max_connections == max_connections


def test_a_provider_pool_left_unset_holds_as_many_streams_as_the_gateway_allows() -> None:
    """Raising ``[limits] max_concurrent_streams`` raises the pools left at their default,
    so no stream the gateway admits waits for an upstream connection; a pool that was set
    (0 included: no limit) stays as set."""
    import tomllib

    from nexus.config import parse_config

    config = parse_config(
        tomllib.loads(
            """
[limits]
max_concurrent_streams = 50000
[providers.a]
kind = "openai"
base_url = "http://127.0.0.1:1/v1"
[providers.b]
kind = "anthropic"
base_url = "http://127.0.0.1:1"
max_connections = 64
[providers.c]
kind = "openai"
base_url = "http://127.0.0.1:1/v1"
max_connections = 0
"""
        )
    )
    pools = {name: cfg.max_connections for name, cfg in config.providers.items()}
    assert pools == {"a": 50_000, "b": 64, "c": 0}
    # Rebuilt from those providers with another limit, the one left unset follows it.
    from nexus.config import Config, LimitsConfig

    rebuilt = Config(providers=config.providers, limits=LimitsConfig(max_concurrent_streams=900))
    pools = {name: cfg.max_connections for name, cfg in rebuilt.providers.items()}
    assert pools == {"a": 900, "b": 64, "c": 0}
    assert (
        parse_config(
            tomllib.loads('[providers.a]\nkind = "openai"\nbase_url = "http://127.0.0.1:1/v1"\n')
        )
        .providers["a"]
        .max_connections
        == 10_000
    )  # the default limit's


async def test_a_busy_store_before_a_stream_costs_no_upstream_call(make_client: Any) -> None:
    """The one pooled connection is busy: 503 store_unavailable with Retry-After, and
    nothing was sent upstream (the stream is opened, and closed, before it is read)."""
    from nexus.server.state import HUB
    from support import GatedProvider

    redis = await connect_or_skip()
    prefix = new_prefix()
    provider = GatedProvider()
    store_table = {"kind": "redis", "prefix": prefix, "max_connections": 1, "pool_timeout_s": 0.05}
    try:
        client = await make_client({"store": store_table}, providers=[provider])
        store = client.server.app[HUB].store
        # A blocking read holds the only connection for a second.
        holder = asyncio.ensure_future(store.client.xread({f"{prefix}:none": "0-0"}, block=1000))
        await asyncio.sleep(0.05)
        started = time.monotonic()
        resp = await client.post(CHAT, json={**body("gated/x"), "stream": True})
        error = await resp.json()
        assert resp.status == 503, error
        assert time.monotonic() - started < 0.5
        assert error["error"]["code"] == "store_unavailable"
        assert resp.headers["Retry-After"] == "1"
        assert not provider.started.is_set()
        await holder  # the read ends on its own: its connection is back in the pool
        resp = await client.post(CHAT, json={**body("gated/x"), "stream": True})
        assert resp.status == 200  # the pool is free again
        provider.gate.set()
        assert b"data: [DONE]" in await resp.read()
    finally:
        await drop_keys(redis, prefix)
        await redis.aclose()
