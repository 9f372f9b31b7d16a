"""A plugin cannot keep a stream from being charged and counted, nor hold its end.

The server's budgets and metrics run before every plugin; a plugin's hook that
raises ``CancelledError`` of its own, or hangs, is one hook error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from nexus.auth import hash_key
from support import METRICS_TOKEN_ENV, SCRAPER, MakeClient, chat

KEY = "nx-plugin-bounds-key-0042"
BEARER = {"Authorization": f"Bearer {KEY}"}

pytestmark = pytest.mark.usefixtures("metrics_token")


class CancelInCompleted:
    """Awaits a future some other task cancelled: a ``CancelledError`` of its own."""

    async def on_stream_completed(self, *args: Any) -> None:
        future = asyncio.get_running_loop().create_future()
        future.cancel()
        await future


class HangCompleted:
    async def on_stream_completed(self, *args: Any) -> None:
        await asyncio.sleep(3600)


class SlowGate:
    """A quota plugin whose backend takes 0.5 s, then refuses."""

    async def on_stream_started(self, *args: Any) -> None:
        from nexus.hooks import StreamRejected

        await asyncio.sleep(0.5)
        raise StreamRejected("Over quota.", code="quota_exceeded", status=429)


def config(plugin: str, **limits: Any) -> dict[str, Any]:
    return {
        "auth": {
            "keys": [
                {
                    "name": "tenant",
                    "sha256": hash_key(KEY),
                    "budget_usd": 0.02,  # $0.001 a token: one request capped at 10 fits
                    "budget_period": "total",
                }
            ]
        },
        "limits": {"requests_per_second_per_key": 0, **limits},
        "metrics": {"token_env": METRICS_TOKEN_ENV},
        "models": {"mock/echo": {"input_usd_per_mtok": 1000, "output_usd_per_mtok": 1000}},
        "plugins": [{"path": f"{__name__}:{plugin}", "timeout_s": 0.3}],
    }


def samples(text: str, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {
        tuple(sorted(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == name
    }


async def test_a_hook_raising_its_own_cancelled_error_leaves_billing_and_metrics(
    make_client: MakeClient,
) -> None:
    """The built-ins ran after user plugins, and a ``CancelledError`` (a BaseException)
    skipped them: the stream was never charged nor counted."""
    client = await make_client(config("CancelInCompleted"))
    resp = await client.post(
        "/v1/chat/completions", json=chat(stream=True, max_tokens=10), headers=BEARER
    )
    assert resp.status == 200
    assert (await resp.read()).endswith(b"data: [DONE]\n\n")
    again = await client.post("/v1/chat/completions", json=chat(max_tokens=10), headers=BEARER)
    assert again.status == 429  # charged: the budget now holds
    assert (await again.json())["error"]["code"] == "budget_exceeded"
    metrics = await (await client.get("/metrics", headers=SCRAPER)).text()
    cost = samples(metrics, "nexus_cost_usd_total")
    assert cost[(("key", "tenant"), ("model", "mock/echo"))] > 0
    errors = samples(metrics, "nexus_hook_errors_total")
    assert errors[(("hook", "on_stream_completed"),)] == 1


async def test_a_hung_end_hook_is_abandoned_at_its_timeout(make_client: MakeClient) -> None:
    """Once settled, a run ignores cancel(): a hung end hook held the key's stream slot
    and the client's response forever (max_stream_duration_s and shutdown waited too)."""
    client = await make_client(
        config("HangCompleted", max_concurrent_streams_per_key=1, max_stream_duration_s=600)
    )
    resp = await asyncio.wait_for(
        client.post("/v1/chat/completions", json=chat(stream=True, max_tokens=10), headers=BEARER),
        5,
    )
    body = await asyncio.wait_for(resp.read(), 5)
    assert body.endswith(b"data: [DONE]\n\n")
    # Its slot is free, and it was charged before the plugin ran.
    again = await client.post("/v1/chat/completions", json=chat(max_tokens=10), headers=BEARER)
    assert again.status == 429
    assert (await again.json())["error"]["code"] == "budget_exceeded"
    metrics = await (await client.get("/metrics", headers=SCRAPER)).text()
    errors = samples(metrics, "nexus_hook_errors_total")
    assert errors[(("hook", "on_stream_completed"),)] == 1


async def test_a_gate_that_cannot_decide_in_time_refuses(make_client: MakeClient) -> None:
    """A policy hook past its timeout would otherwise let every request through whenever
    its backend is slow: it refuses, retryable, rather than fail open."""
    client = await make_client(config("SlowGate"))  # timeout_s = 0.3
    resp = await client.post("/v1/chat/completions", json=chat(max_tokens=10), headers=BEARER)
    assert resp.status == 503
    assert resp.headers["Retry-After"] == "1"
    assert (await resp.json())["error"]["code"] == "plugin_timeout"
    metrics = await (await client.get("/metrics", headers=SCRAPER)).text()
    errors = samples(metrics, "nexus_hook_errors_total")
    assert errors[(("hook", "on_stream_started"),)] == 1
    patient = await make_client(
        {**config("SlowGate"), "plugins": [{"path": f"{__name__}:SlowGate", "timeout_s": 2}]}
    )
    resp = await patient.post("/v1/chat/completions", json=chat(max_tokens=10), headers=BEARER)
    assert resp.status == 429
    assert (await resp.json())["error"]["code"] == "quota_exceeded"
