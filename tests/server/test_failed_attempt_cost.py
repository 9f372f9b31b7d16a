"""An upstream attempt that fails after its 2xx may be billed its prompt: the access line
and ``/metrics`` show what it may have cost, and the key's budget is not charged for it.

The router falls back (or gives up) when a target fails before its first event, even
after the upstream took the request and began to answer: such an attempt's prompt was
neither logged nor counted anywhere. A fake upstream answers 200 and cuts the stream
mid-frame; the next target answers."""

from __future__ import annotations

import logging
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from nexus.auth import ApiKey, hash_key
from nexus.server.state import HUB
from support import METRICS_TOKEN_ENV, SCRAPER, MakeClient, access_record
from upstreams import DONE, FakeUpstream, Reply, anthropic_event, openai_chunk, openai_usage_chunk

KEY = "nx-failed-attempts-0123456789"
BEARER = {"Authorization": f"Bearer {KEY}"}
TENANT = ApiKey("tenant", budget_usd=100.0, budget_period="total")
UPSTREAM_KEY = "NEXUS_TEST_FAILED_ATTEMPT_UPSTREAM_KEY"
CONTENT = "one two three four"
"""18 bytes: a prompt estimate of 5 tokens, and 4 for the message: 9."""
ESTIMATE = 9
CUT = Reply.stream([b": warming up\n\n", b'data: {"id":"chatcmpl-1","choi'], end="abort")
"""200, a keepalive, half a frame, then the connection dropped: no event came."""
ANSWER = Reply.stream(
    [
        openai_chunk(role="assistant", content="Hello"),
        openai_chunk(finish_reason="stop"),
        openai_usage_chunk({"prompt_tokens": 7, "completion_tokens": 3, "total_tokens": 10}),
        DONE,
    ]
)


@pytest.fixture(autouse=True)
def upstream_key(monkeypatch: pytest.MonkeyPatch, metrics_token: None) -> None:
    monkeypatch.setenv(UPSTREAM_KEY, "sk-upstream")


def config(fake: FakeUpstream, kind: str = "openai") -> dict[str, Any]:
    first: dict[str, Any] = {"kind": kind, "base_url": fake.url, "models": ["m1"]}
    if kind == "openai":
        first.update(base_url=fake.url + "/v1", api_key_env=UPSTREAM_KEY)
    second = {"kind": "openai", "base_url": fake.url + "/v1", "api_key_env": UPSTREAM_KEY}
    return {
        "metrics": {"token_env": METRICS_TOKEN_ENV},
        "auth": {
            "keys": [
                {
                    "name": "tenant",
                    "sha256": hash_key(KEY),
                    "budget_usd": TENANT.budget_usd,
                    "budget_period": "total",
                }
            ]
        },
        "providers": {"first": first, "second": {**second, "models": ["m2"]}},
        "models": {
            "smart": {"targets": ["first/m1", "second/m2"]},
            "first/m1": {"input_usd_per_mtok": 1000, "output_usd_per_mtok": 1000},
            "second/m2": {"input_usd_per_mtok": 10, "output_usd_per_mtok": 20},
        },
    }


def body(stream: bool) -> dict[str, Any]:
    return {
        "model": "smart",
        "messages": [{"role": "user", "content": CONTENT}],
        "max_tokens": 10,
        "stream": stream,
    }


async def access_line(caplog: pytest.LogCaptureFixture) -> dict[str, Any]:
    return (await access_record(caplog)).access  # type: ignore[attr-defined, no-any-return]


async def metrics(client: TestClient[Any, Any]) -> dict[tuple[str, str, str], float]:
    """Every sample by (name, model, key) of the cost and token series."""
    text = await (await client.get("/metrics", headers=SCRAPER)).text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = sample.labels
            if "key" in labels and "kind" not in labels:
                samples[sample.name, labels["model"], labels["key"]] = sample.value
    return samples


async def spent(client: TestClient[Any, Any]) -> float:
    """The tenant's budget spend (its stream's end hooks, which charge it, ran before
    its client could read the end)."""
    return await client.app[HUB].limits.spent(TENANT)


async def test_a_cut_attempt_before_a_fallback_is_logged_and_counted_not_charged(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    async with FakeUpstream(CUT, ANSWER) as fake:
        client = await make_client(config(fake))
        resp = await client.post("/v1/chat/completions", json=body(True), headers=BEARER)
        assert resp.status == 200
        assert "Hello" in await resp.text()
        assert len(fake.requests) == 2  # the fallback answered
        line = await access_line(caplog)
    served_usd = (7 * 10 + 3 * 20) / 1e6
    failed_usd = ESTIMATE * 1000 / 1e6  # the prompt estimate, at the first target's price
    assert line["served"] == "second/m2"
    assert line["cost_usd"] == pytest.approx(served_usd)
    assert line["failed_attempts"] == 1
    assert line["failed_attempts_prompt_tokens"] == ESTIMATE
    assert line["failed_attempts_cost_usd"] == pytest.approx(failed_usd)
    counted = await metrics(client)
    assert counted["nexus_failed_attempt_cost_usd_total", "smart", "tenant"] == pytest.approx(
        failed_usd
    )
    assert counted["nexus_failed_attempt_prompt_tokens_total", "smart", "tenant"] == ESTIMATE
    assert counted["nexus_cost_usd_total", "smart", "tenant"] == pytest.approx(served_usd)
    assert await spent(client) == pytest.approx(served_usd)  # not the failed attempt's


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_attempts_cut_until_none_is_left_end_in_an_error_that_shows_them(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture, stream: bool
) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    async with FakeUpstream(CUT, CUT) as fake:
        client = await make_client(config(fake))
        resp = await client.post("/v1/chat/completions", json=body(stream), headers=BEARER)
        assert resp.status >= 500
        await resp.read()
        assert len(fake.requests) == 2
        line = await access_line(caplog)
    failed_usd = ESTIMATE * (1000 + 10) / 1e6  # each at its own target's price
    assert line["outcome"].startswith("error:")
    # No target answered: none is named (a stream named the first, which had failed).
    assert line.get("provider") is None and line.get("served") is None
    assert line["failed_attempts"] == 2
    assert line["failed_attempts_prompt_tokens"] == 2 * ESTIMATE
    assert line["failed_attempts_cost_usd"] == pytest.approx(failed_usd)
    assert line["cost_usd"] == 0  # what the request is charged
    counted = await metrics(client)
    assert counted["nexus_failed_attempt_cost_usd_total", "smart", "tenant"] == pytest.approx(
        failed_usd
    )
    assert await spent(client) == 0


async def test_the_upstreams_own_count_of_the_prompt_is_taken_over_the_estimate(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """An Anthropic upstream says the prompt's size in its first event, ``message_start``
    (no event of Nexus's yet): its count is the failed attempt's, not the estimate."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    message = {
        "id": "msg_01",
        "type": "message",
        "role": "assistant",
        "content": [],
        "model": "m1",
        "stop_reason": None,
        "usage": {"input_tokens": 1200, "output_tokens": 1},
    }
    cut = Reply.stream([anthropic_event("message_start", message=message)], end="abort")
    async with FakeUpstream(cut, ANSWER) as fake:
        client = await make_client(config(fake, kind="anthropic"))
        resp = await client.post("/v1/chat/completions", json=body(True), headers=BEARER)
        assert resp.status == 200
        assert "Hello" in await resp.text()
        line = await access_line(caplog)
    assert line["failed_attempts_prompt_tokens"] == 1200
    assert line["failed_attempts_cost_usd"] == pytest.approx(1200 * 1000 / 1e6)
    assert await spent(client) == pytest.approx((7 * 10 + 3 * 20) / 1e6)


RUNNING = b'data: {"id":"c","object":"chat.completion.chunk","created":1,"model":"m1",'
RUNNING += b'"choices":[{"index":0,"delta":{"role":"assistant","content":""}}],'
RUNNING += b'"usage":{"prompt_tokens":11,"completion_tokens":0,"total_tokens":11}}\n\n'
"""vLLM's role chunk with ``continuous_usage_stats``: a running count, no output."""


@pytest.mark.parametrize(
    "failure",
    [
        Reply.stream([RUNNING, b'data: {"error":{"message":"overloaded"}}\n\n']),
        Reply.stream([RUNNING], end="abort"),
    ],
    ids=["in-stream-error", "cut"],
)
@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
async def test_a_running_count_before_any_output_is_the_failed_attempts_prompt(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture, failure: Reply, stream: bool
) -> None:
    """The count held from the role chunk went out as the attempt's first event: no
    fallback, and the key charged for an attempt that answered nothing."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    async with FakeUpstream(failure, ANSWER) as fake:
        client = await make_client(config(fake))
        resp = await client.post("/v1/chat/completions", json=body(stream), headers=BEARER)
        assert resp.status == 200
        assert "Hello" in await resp.text()
        line = await access_line(caplog)
    assert line["served"] == "second/m2"
    assert line["failed_attempts_prompt_tokens"] == 11  # the upstream's count
    assert await spent(client) == pytest.approx((7 * 10 + 3 * 20) / 1e6)
