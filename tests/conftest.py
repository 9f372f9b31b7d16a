"""Fixtures: an app factory over the real server, with optional hand-steered providers;
fake upstreams of either kind; a Redis of the test's own."""

from __future__ import annotations

import signal
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from nexus import Engine, MockProvider, Provider
from nexus.config import Config, parse_config, price_table
from nexus.encoders.registry import default_registry
from nexus.server.app import create_app
from redis_server import RedisServer
from redis_support import connect_or_skip, drop_keys, new_prefix
from support import METRICS_TOKEN, METRICS_TOKEN_ENV, MakeClient
from upstreams import FakeUpstream


@pytest.fixture
def make_client(aiohttp_client: Any) -> MakeClient:
    """``await make_client(config_dict=None, providers=None)`` -> a test client.

    ``providers`` adds hand-made providers next to the config's mock provider.
    """

    async def factory(
        config: dict[str, Any] | None = None, providers: list[Provider] | None = None
    ) -> TestClient[Any, Any]:
        cfg: Config = parse_config(config or {})
        engine = None
        if providers:
            engine = Engine(
                [MockProvider(name, models=p.models) for name, p in cfg.providers.items()]
                + providers,
                {alias: a.targets for alias, a in cfg.models.items() if a.targets is not None},
                retry_ms=cfg.server.retry_ms,
                prices=price_table(cfg),
            )
        app = create_app(cfg, engine=engine, registry=default_registry.copy())
        return await aiohttp_client(app)

    return factory


@pytest.fixture
def metrics_token(monkeypatch: pytest.MonkeyPatch) -> None:
    """``METRICS_TOKEN`` in ``METRICS_TOKEN_ENV``, for this app and the processes it starts."""
    monkeypatch.setenv(METRICS_TOKEN_ENV, METRICS_TOKEN)


@pytest.fixture
async def prefix() -> AsyncIterator[str]:
    """A key prefix of its own in the test Redis (the test skipped without one, failed
    under CI), its keys dropped after the test."""
    client = await connect_or_skip()
    name = new_prefix()
    try:
        yield name
    finally:
        await drop_keys(client, name)
        await client.aclose()


@pytest.fixture
async def oai() -> AsyncIterator[FakeUpstream]:
    """A fake upstream (an OpenAI-kind provider's, by the replies a test adds)."""
    async with FakeUpstream() as fake:
        yield fake


@pytest.fixture
async def claude() -> AsyncIterator[FakeUpstream]:
    """A fake upstream (an Anthropic-kind provider's, by the replies a test adds)."""
    async with FakeUpstream() as fake:
        yield fake


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    """A ``redis-server`` of the test's own, to stop, pause and restart; stopped after it
    (continued first, should the test have left it paused with SIGSTOP)."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        if server.process is not None:
            server.process.send_signal(signal.SIGCONT)
        server.stop()
