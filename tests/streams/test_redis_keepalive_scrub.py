"""A warning about Redis quotes the driver's error with the URL's credentials cut out, as
every other one does: the keep-alive's renewal quoted it as it was."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from nexus.cache import redis_holds
from nexus.cache.redis import RedisStore
from nexus.errors import StoreUnavailable


async def test_the_keep_alive_warning_never_quotes_the_password(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    store = RedisStore("redis://nexus:s3cret-pw@127.0.0.1:1/0", "scrub")

    async def call(*args: Any) -> list[Any]:
        try:
            raise RedisConnectionError("Error connecting to nexus:s3cret-pw@127.0.0.1:1")
        except RedisConnectionError as exc:
            raise StoreUnavailable("The stream store cannot be reached right now.") from exc

    monkeypatch.setattr(store, "call", call)
    monkeypatch.setattr(redis_holds, "OWNER_TTL_S", 0.03)
    with caplog.at_level(logging.WARNING, logger="nexus"):
        beat = asyncio.ensure_future(store._beat())
        await asyncio.sleep(0.1)
        beat.cancel()
    warned = [r.getMessage() for r in caplog.records if "keep-alive" in r.getMessage()]
    assert warned, caplog.text
    assert not any("s3cret-pw" in line for line in warned), warned
