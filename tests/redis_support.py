"""A real Redis for tests: connect or skip (fail under CI), and clean a key prefix up afterwards."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
from collections.abc import AsyncIterator, Callable, Sequence
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import RedisError

from nexus.cache.redis import RedisStore
from nexus.cache.store import StreamInfo, Write
from nexus.events import StreamEvent
from nexus_process import start_nexus, stop_nexus

REDIS_URL = "redis://127.0.0.1:6379/0"
_SERVING = re.compile(r"Nexus serving on (http://[\d.]+:\d+)")


async def connect_or_skip() -> aioredis.Redis:
    """A client of the test Redis. Skips the test if it is down, or fails it when ``CI=true``:
    CI must run these tests, not skip them."""
    client = aioredis.Redis.from_url(REDIS_URL, socket_connect_timeout=1.0, socket_timeout=5.0)
    try:
        await client.ping()
    except (RedisError, OSError) as exc:
        await client.aclose()
        reason = f"Redis not reachable at 127.0.0.1:6379: {exc}"
        if os.environ.get("CI") == "true":
            pytest.fail(reason)
        pytest.skip(reason)
    return client


def new_prefix() -> str:
    """A key prefix no other test (or concurrent test run) uses."""
    return "nexus-test-" + os.urandom(8).hex()


async def drop_keys(client: aioredis.Redis, prefix: str) -> None:
    keys = [key async for key in client.scan_iter(match=f"{prefix}:*", count=1000)]
    for i in range(0, len(keys), 500):
        await client.delete(*keys[i : i + 500])


async def append(
    store: RedisStore, info: StreamInfo, start: int, events: Sequence[StreamEvent]
) -> bool:
    """Log entries ``start``... of a live stream, as the keeper's mirror writes them; False
    when the log is gone from the store (nothing written)."""
    (written,) = await store.mirror([Write(info, events, start)], 30)
    return written


@contextlib.asynccontextmanager
async def redis_replicas(
    tmp_path: Path, config: Callable[[str], str], count: int = 2
) -> AsyncIterator[list[tuple[subprocess.Popen[bytes], str]]]:
    """``count`` real ``nexus serve`` processes sharing one Redis under a new prefix, each
    with the config ``config(prefix)``: [(process, url), ...]. Killed at the end, their
    keys dropped."""
    client = await connect_or_skip()
    prefix = new_prefix()
    path = tmp_path / "config.toml"
    path.write_text(config(prefix))
    started: list[tuple[subprocess.Popen[bytes], str]] = []
    try:
        for n in range(count):
            proc, match = start_nexus(path, tmp_path / f"nexus{n}.log", ready=_SERVING)
            started.append((proc, match.group(1)))
        yield started
    finally:
        for proc, _ in started:
            stop_nexus(proc, gently=False)
        await drop_keys(client, prefix)
        await client.aclose()
