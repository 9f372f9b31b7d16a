"""A Redis that answers but refuses commands (``OOM`` past ``maxmemory``, ``NOPERM`` from an
ACL, ``READONLY`` after a failover): every new stream is a 503 as when Redis is down, but
the refusal is said (a warning naming the error and what Redis said, a few at most) and
counted apart, as cause ``refused``; before, nothing was logged and it counted as
``unreachable``. Against a ``redis-server`` of the test's own, never the shared one.
"""

from __future__ import annotations

import logging
import re
from typing import Any

import pytest
import redis.asyncio as aioredis

from nexus.cache import redis_url
from redis_server import RedisServer
from support import MakeClient, chat


def config(url: str) -> dict[str, Any]:
    return {"store": {"kind": "redis", "url": url, "prefix": "refusals"}}


def refusals(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [
        r.getMessage()
        for r in caplog.records
        if r.name == "nexus.store" and "failed (refused" in r.getMessage()
    ]


async def test_a_redis_out_of_memory_is_warned_about_a_few_times_and_counted_as_refused(
    make_client: MakeClient,
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    client = await make_client(config(redis_server.url))
    async with aioredis.Redis.from_url(redis_server.url) as admin:
        await admin.config_set("maxmemory-policy", "noeviction")
        await admin.config_set("maxmemory", 1)
    with caplog.at_level(logging.WARNING, logger="nexus.store"):
        for _ in range(3):
            resp = await client.post("/v1/chat/completions", json=chat(stream=True))
            assert resp.status == 503
            assert (await resp.json())["error"]["code"] == "store_unavailable"
        (warned,) = refusals(caplog)  # one line, not one a request
        assert "OutOfMemoryError" in warned and "'maxmemory'" in warned, warned

        monkeypatch.setattr(redis_url, "WARN_EVERY_S", 0.0)  # (as if 10 s had passed)
        assert (await client.post("/v1/chat/completions", json=chat(stream=True))).status == 503
    _, second = refusals(caplog)
    suppressed = re.search(r"\((\d+) more refused suppressed since the last\)", second)
    assert suppressed is not None and int(suppressed.group(1)) >= 2, second

    metrics = await (await client.get("/metrics")).text()
    assert 'nexus_store_errors_total{cause="refused",op="begin"} 4.0' in metrics
    assert 'cause="unreachable"' not in metrics


async def test_a_refusal_by_an_acl_is_said_without_the_urls_credentials(
    make_client: MakeClient, redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    user, password = "gateway-user", "s3cret-pw-0042"
    async with aioredis.Redis.from_url(redis_server.url) as admin:
        await admin.execute_command(
            "ACL", "SETUSER", user, "on", f">{password}", "~*", "&*", "+@all"
        )
        url = redis_server.url.replace("redis://", f"redis://{user}:{password}@")
        client = await make_client(config(url))
        await admin.execute_command("ACL", "SETUSER", user, "-set")  # now it may not write
    with caplog.at_level(logging.WARNING, logger="nexus.store"):
        resp = await client.post("/v1/chat/completions", json=chat(stream=True))
    assert resp.status == 503
    (warned,) = refusals(caplog)
    assert "NoPermissionError" in warned and "'set'" in warned, warned
    assert password not in caplog.text and user not in caplog.text, caplog.text
