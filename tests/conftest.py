"""Fixtures: an app factory over the real server, with optional hand-steered providers."""

from __future__ import annotations

from typing import Any

import pytest
from aiohttp.test_utils import TestClient

from nexus import Engine, MockProvider, Provider
from nexus.config import Config, parse_config, price_table
from nexus.encoders.registry import default_registry
from nexus.server.app import create_app
from support import MakeClient


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
