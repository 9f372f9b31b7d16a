"""What each stream spent, as the end hooks get it, and who served it after fallbacks."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from nexus import (
    CallContext,
    ChatRequest,
    Completion,
    Delta,
    Engine,
    Error,
    Hooks,
    Provider,
    StreamEvent,
    Usage,
    accumulate,
)
from nexus.cache.recording import cache_key
from nexus.config import parse_config
from nexus.errors import UpstreamError
from nexus.pricing import Price, PriceTable, Spend, cost_usd
from nexus.server.state import HUB
from support import MakeClient, chat
from upstreams import DONE, FakeUpstream, Reply, openai_chunk, openai_usage_chunk

KEY_ENV = "NEXUS_TEST_ACCOUNTING_KEY"
PRICE = Price(2.5, 10.0, 1.25)
OTHER_PRICE = Price(1.0, 4.0, 0.5)


@pytest.fixture(autouse=True)
def key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, "sk-accounting-test")


@pytest.fixture
async def upstreams() -> AsyncIterator[tuple[FakeUpstream, FakeUpstream]]:
    async with FakeUpstream() as first, FakeUpstream() as second:
        yield first, second


class SpendPlugin:
    """Takes ``spend=``: records it with the hook's other arguments."""

    def __init__(self) -> None:
        self.ends: list[tuple[str, str, Any, Spend]] = []
        self.done = asyncio.Event()

    async def on_stream_completed(
        self,
        ctx: CallContext,
        request_id: str,
        model: str,
        provider: str,
        elapsed: float,
        final: Completion,
        *,
        spend: Spend,
    ) -> None:
        self.ends.append(("completed", provider, final, spend))
        self.done.set()

    async def on_stream_failed(
        self, ctx: CallContext, request_id: str, model: str, error: Error, **extra: Any
    ) -> None:
        self.ends.append(("failed", model, error, extra["spend"]))
        self.done.set()


PLUGINS: list[SpendPlugin] = []


def make_spend_plugin() -> SpendPlugin:
    """For ``[[plugins]] path = "test_accounting:make_spend_plugin"``."""
    PLUGINS.append(SpendPlugin())
    return PLUGINS[-1]


def with_plugin(config: dict[str, Any]) -> dict[str, Any]:
    return {**config, "plugins": [{"path": "test_accounting:make_spend_plugin"}]}


class OldPlugin:
    """Written before spends existed: must still be called, without them."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def on_stream_completed(
        self, ctx: CallContext, rid: str, model: str, provider: str, elapsed: float, final: Any
    ) -> None:
        self.calls.append("completed")

    async def on_stream_failed(self, ctx: CallContext, rid: str, model: str, error: Error) -> None:
        self.calls.append("failed")


def hooks_of(*plugins: object) -> Hooks:
    hooks = Hooks()
    for plugin in plugins:
        hooks.add(plugin)
    return hooks


def usage_chunk() -> bytes:
    return openai_usage_chunk(
        {
            "prompt_tokens": 1200,
            "completion_tokens": 300,
            "total_tokens": 1500,
            "prompt_tokens_details": {"cached_tokens": 1000},
            "completion_tokens_details": {"reasoning_tokens": 120},
        }
    )


def two_targets(first: FakeUpstream, second: FakeUpstream) -> dict[str, Any]:
    def provider(fake: FakeUpstream) -> dict[str, Any]:
        return {"kind": "openai", "base_url": fake.url + "/v1", "api_key_env": KEY_ENV}

    return {
        "providers": {"a": provider(first), "b": provider(second)},
        "models": {
            "smart": {
                "targets": ["a/m1", "b/m2"],
                "input_usd_per_mtok": 100.0,
                "output_usd_per_mtok": 100.0,
            },
            "b/m2": {
                "input_usd_per_mtok": 2.5,
                "output_usd_per_mtok": 10.0,
                "cached_input_usd_per_mtok": 1.25,
            },
        },
        "streams": {"detach_timeout_s": 0.2},
    }


ANSWER = [
    openai_chunk(content="Hi"),
    openai_chunk(content=" there"),
    openai_chunk(finish_reason="stop"),
    usage_chunk(),
    DONE,
]
UNAVAILABLE = Reply.json(503, {"error": {"message": "overloaded", "type": "server_error"}})


async def test_python_api_fallback_names_the_target_that_answered(
    upstreams: tuple[FakeUpstream, FakeUpstream],
) -> None:
    first, second = upstreams
    first.add(UNAVAILABLE)
    second.add(Reply.stream(ANSWER))
    config = parse_config(two_targets(first, second))
    engine = Engine.from_config(config)
    plugin, old = SpendPlugin(), OldPlugin()
    for p in (plugin, old):
        engine.hooks.add(p)
    async with engine:
        stream = await engine.open_stream(
            {"model": "smart", "messages": [{"role": "user", "content": "x"}]}
        )
        assert (stream.meta.provider, stream.meta.upstream_model) == ("a", "m1")  # not yet run
        completion = await accumulate(stream)
        assert (stream.meta.provider, stream.meta.upstream_model) == ("b", "m2")
    assert completion.content == "Hi there"
    assert len(first.requests) == len(second.requests) == 1
    [(kind, provider, _, spend)] = plugin.ends
    assert (kind, provider) == ("completed", "b")
    # The served target's price (b/m2), not the alias's.
    assert spend == Spend(1200, 300, 1000, 120, cost_usd(PRICE, 1200, 300, 1000), False)
    assert spend.cost_usd == pytest.approx((200 * 2.5 + 1000 * 1.25 + 300 * 10.0) / 1e6)
    assert old.calls == ["completed"]


async def test_server_fallback_names_the_target_that_answered(
    make_client: MakeClient, upstreams: tuple[FakeUpstream, FakeUpstream]
) -> None:
    first, second = upstreams
    first.add(UNAVAILABLE)
    second.add(Reply.stream(ANSWER))
    client = await make_client(with_plugin(two_targets(first, second)))
    plugin = PLUGINS[-1]
    hub = client.app[HUB]
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": "smart", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    )
    assert resp.status == 200
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    await resp.read()
    await asyncio.wait_for(plugin.done.wait(), 5)
    [(kind, provider, _, spend)] = plugin.ends
    assert (kind, provider) == ("completed", "b")
    assert spend.cost_usd == cost_usd(PRICE, 1200, 300, 1000)
    info = await hub.info(stream_id)
    assert info is not None
    assert (info.meta.provider, info.meta.upstream_model) == ("b", "m2")


async def test_upstream_errors_are_counted_per_attempt_under_the_provider_tried(
    make_client: MakeClient, upstreams: tuple[FakeUpstream, FakeUpstream]
) -> None:
    """A fallback that recovers still shows the failing provider in /metrics, and a stream
    that fails on its second target names the second, not the alias's first."""
    first, second = upstreams
    first.add(UNAVAILABLE)
    second.add(Reply.stream(ANSWER))  # recovered: the stream completes
    first.add(UNAVAILABLE)
    second.add(Reply.json(429, {"error": {"message": "slow down", "type": "rate_limit_error"}}))
    client = await make_client(two_targets(first, second))
    body = {"model": "smart", "stream": True, "messages": [{"role": "user", "content": "x"}]}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    await resp.read()
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 429
    await resp.read()
    metrics = await (await client.get("/metrics")).text()
    errors = {
        (sample.labels["provider"], sample.labels["code"]): sample.value
        for family in text_string_to_metric_families(metrics)
        if family.name == "nexus_upstream_errors"
        for sample in family.samples
        if sample.name == "nexus_upstream_errors_total"
    }
    assert errors == {("a", "upstream_error"): 2, ("b", "upstream_rate_limited"): 1}


@pytest.mark.parametrize("stream", [True, False], ids=["streaming", "json"])
async def test_after_a_fallback_the_access_line_hooks_and_recording_name_who_answered(
    make_client: MakeClient,
    upstreams: tuple[FakeUpstream, FakeUpstream],
    caplog: pytest.LogCaptureFixture,
    stream: bool,
) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    first, second = upstreams
    first.add(UNAVAILABLE)
    second.add(Reply.stream(ANSWER))
    config = with_plugin({**two_targets(first, second), "cache": {"enabled": True}})
    client = await make_client(config)
    plugin = PLUGINS[-1]
    body = {"model": "smart", "stream": stream, "messages": [{"role": "user", "content": "x"}]}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    await resp.read()
    await asyncio.wait_for(plugin.done.wait(), 5)
    [(kind, provider, _, _)] = plugin.ends
    assert (kind, provider) == ("completed", "b")
    (record,) = [r for r in caplog.records if r.name == "nexus.access"]
    line = record.access  # type: ignore[attr-defined]
    assert (line["provider"], line["served"], line["cache"]) == ("b", "b/m2", "miss")
    store = client.app[HUB].store
    request = ChatRequest.model_validate(body)
    for _ in range(100):  # the recording is kept once the run's log is
        recording = await store.get_recording(cache_key(request))
        if recording is not None:
            break
        await asyncio.sleep(0.01)
    assert recording is not None
    assert (recording.provider, recording.upstream_model) == ("b", "m2")


class FailingProvider(Provider):
    """Reports its input first, sends three deltas, then fails (an upstream cut)."""

    kind = "failing"

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        yield [Usage(prompt_tokens=40, completion_tokens=1, total_tokens=41, cached_tokens=8)]
        for word in ("one", "two", "three"):
            yield [Delta(content=word)]
        raise UpstreamError("connection reset", code="upstream_error")


async def test_on_stream_failed_gets_the_billed_input_and_the_output_seen() -> None:
    plugin, old = SpendPlugin(), OldPlugin()
    engine = Engine(
        [FailingProvider("f")], hooks=hooks_of(plugin, old), prices=PriceTable({"f/x": PRICE})
    )
    async with engine:
        stream = await engine.open_stream(
            {"model": "f/x", "messages": [{"role": "user", "content": "x"}]}
        )
        events = [event async for event in stream]
    assert isinstance(events[-1], Error)
    [(kind, model, error, spend)] = plugin.ends
    assert (kind, model, error.code) == ("failed", "f/x", "upstream_error")
    assert spend == Spend(40, 3, 8, 0, cost_usd(PRICE, 40, 3, 8), True)
    assert old.calls == ["failed"]


async def test_a_stream_cut_mid_way_reports_an_estimate_to_the_hooks(
    make_client: MakeClient, upstreams: tuple[FakeUpstream, FakeUpstream]
) -> None:
    first, _ = upstreams
    frames = [openai_chunk(content=w) for w in ("a", "b", "c", "d")]
    first.add(Reply.stream(frames, end="abort"))
    config = two_targets(first, first)
    config["models"]["a/m1"] = {"input_usd_per_mtok": 2.5, "output_usd_per_mtok": 10.0}
    client = await make_client(with_plugin(config))
    plugin = PLUGINS[-1]
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": "a/m1", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    )
    body = await resp.read()
    assert b"event: error" in body
    await asyncio.wait_for(plugin.done.wait(), 5)
    [(kind, _, error, spend)] = plugin.ends
    assert kind == "failed"
    assert error.code != "stream_cancelled"
    # No usage came (OpenAI reports it last): the prompt is estimated, "x" at 1 + 4 tokens.
    assert spend == Spend(5, 4, 0, 0, (5 * 2.5 + 4 * 10.0) / 1e6, True)


# --- usage.cost ----------------------------------------------------------------------------


def one_upstream(fake: FakeUpstream, **cache: Any) -> dict[str, Any]:
    config = two_targets(fake, fake)
    config["models"]["a/m1"] = {
        "input_usd_per_mtok": 2.5,
        "output_usd_per_mtok": 10.0,
        "cached_input_usd_per_mtok": 1.25,
    }
    if cache:
        config["cache"] = cache
    return config


COST = cost_usd(PRICE, 1200, 300, 1000)


async def test_include_cost_over_the_openai_sdk(
    make_client: MakeClient, upstreams: tuple[FakeUpstream, FakeUpstream]
) -> None:
    from openai import AsyncOpenAI

    fake, _ = upstreams
    fake.add(Reply.stream(ANSWER), Reply.stream(ANSWER))
    client = await make_client(one_upstream(fake))
    async with AsyncOpenAI(
        base_url=str(client.make_url("/v1")), api_key="unused", max_retries=0
    ) as api:
        stream = await api.chat.completions.create(
            model="a/m1",
            messages=[{"role": "user", "content": "x"}],
            stream=True,
            stream_options={"include_usage": True, "include_cost": True},  # type: ignore[typeddict-unknown-key]
        )
        chunks = [chunk async for chunk in stream]
        usage = chunks[-1].usage
        assert usage is not None
        assert (usage.prompt_tokens, usage.completion_tokens) == (1200, 300)
        assert usage.model_extra == {"cost": COST}
        # Without include_cost: no cost.
        plain = await api.chat.completions.create(
            model="a/m1",
            messages=[{"role": "user", "content": "x"}],
            stream=True,
            stream_options={"include_usage": True},
        )
        last = [chunk async for chunk in plain][-1]
        assert last.usage is not None and not last.usage.model_extra
    # Never sent upstream.
    assert [seen.body["stream_options"] for seen in fake.requests] == [{"include_usage": True}] * 2


async def test_include_cost_over_raw_sse_and_json(
    make_client: MakeClient, upstreams: tuple[FakeUpstream, FakeUpstream]
) -> None:
    fake, _ = upstreams
    fake.add(Reply.stream(ANSWER), Reply.stream(ANSWER))
    client = await make_client(one_upstream(fake))
    body = {
        "model": "a/m1",
        "messages": [{"role": "user", "content": "x"}],
        "stream": True,
        "stream_options": {"include_usage": True, "include_cost": True},
    }
    resp = await client.post("/v1/chat/completions", json=body)
    frames = [f for f in (await resp.read()).split(b"\n") if f.startswith(b"data: {")]
    usage = orjson.loads(frames[-1][len(b"data: ") :])["usage"]
    assert usage["cost"] == COST
    assert isinstance(usage["cost"], float)
    resp = await client.post("/v1/chat/completions", json={**body, "stream": False})
    assert (await resp.json())["usage"]["cost"] == COST
    # include_cost alone asks for the usage chunk too.
    fake.add(Reply.stream(ANSWER))
    alone = {**body, "stream_options": {"include_cost": True}}
    resp = await client.post("/v1/chat/completions", json=alone)
    frames = [f for f in (await resp.read()).split(b"\n") if f.startswith(b"data: {")]
    assert orjson.loads(frames[-1][len(b"data: ") :])["usage"]["cost"] == COST


async def test_include_cost_keeps_the_cache_key_and_a_hit_costs_nothing(
    make_client: MakeClient, upstreams: tuple[FakeUpstream, FakeUpstream]
) -> None:
    fake, _ = upstreams
    fake.add(Reply.stream(ANSWER))
    client = await make_client(one_upstream(fake, enabled=True))
    body = {"model": "a/m1", "messages": [{"role": "user", "content": "x"}], "stream": False}
    first = await client.post("/v1/chat/completions", json=body)
    assert first.headers["X-Nexus-Cache"] == "miss"
    assert "cost" not in (await first.json())["usage"]
    costed = {**body, "stream_options": {"include_cost": True}}
    hit = await client.post("/v1/chat/completions", json=costed)
    assert hit.headers["X-Nexus-Cache"] == "hit"
    usage = (await hit.json())["usage"]
    assert (usage["prompt_tokens"], usage["cost"]) == (1200, 0.0)
    assert len(fake.requests) == 1


async def test_the_text_access_line_quotes_what_a_client_chose(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client()
    model = 'mock/x y\nforged=1 "z'
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "a b"}]},
    )
    assert resp.status == 200
    (record,) = [r for r in caplog.records if r.name == "nexus.access"]
    line = record.getMessage()
    assert "\n" not in line
    assert f"model={orjson.dumps(model).decode()} " in line
    assert record.access["model"] == model  # type: ignore[attr-defined]


async def test_a_cache_hit_spends_nothing(
    make_client: MakeClient,
    upstreams: tuple[FakeUpstream, FakeUpstream],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    fake, _ = upstreams
    fake.add(Reply.stream(ANSWER))
    client = await make_client(with_plugin(one_upstream(fake, enabled=True)))
    plugin = PLUGINS[-1]
    body = {"model": "a/m1", "messages": [{"role": "user", "content": "x"}], "stream": True}
    for request_id in ("first", "again"):
        resp = await client.post(
            "/v1/chat/completions", json=body, headers={"X-Client-Request-Id": request_id}
        )
        await resp.read()
    await asyncio.sleep(0.05)
    access = [r.access for r in caplog.records if r.name == "nexus.access"]  # type: ignore[attr-defined]
    lines = {line["client_request_id"]: line for line in access}
    assert (lines["first"]["cache"], lines["first"]["cost_usd"]) == ("miss", round(COST, 10))
    assert lines["first"]["prompt_tokens"] == 1200
    again = lines["again"]
    assert (again["cache"], again["outcome"], again["cost_usd"]) == ("hit", "ok", 0.0)
    assert (again["prompt_tokens"], again["completion_tokens"]) == (0, 0)
    assert [spend.cost_usd for *_, spend in plugin.ends] == [COST, 0.0]
    metrics = await (await client.get("/metrics")).text()
    assert 'nexus_tokens_total{key="anonymous",kind="prompt",model="a/*"} 1200.0' in metrics


async def test_a_request_no_target_answered_names_none(
    make_client: MakeClient,
    upstreams: tuple[FakeUpstream, FakeUpstream],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    first, second = upstreams
    first.add(UNAVAILABLE)
    second.add(UNAVAILABLE)
    client = await make_client(two_targets(first, second))
    resp = await client.post(
        "/v1/chat/completions",
        json={"model": "smart", "stream": True, "messages": [{"role": "user", "content": "x"}]},
    )
    assert resp.status == 502
    (record,) = [r for r in caplog.records if r.name == "nexus.access"]
    line = record.access  # type: ignore[attr-defined]
    assert record.levelno == logging.WARNING
    assert (line["model"], line["served"], line["outcome"]) == (
        "smart",
        None,
        f"error:{(await resp.json())['error']['code']}",
    )
    assert "prompt_tokens" not in line


@pytest.mark.parametrize("cache", [False, True])
async def test_a_non_streaming_request_that_fails_mid_way_logs_what_it_spent(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture, cache: bool
) -> None:
    """A JSON request whose stream fails after some output: its access line has the
    output counted so far (estimated) and who answered, cache on or off."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client({"cache": {"enabled": cache}})
    body = chat("one two three four five six", mock={"fail_after": 3})
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status >= 500, await resp.text()
    (record,) = [r for r in caplog.records if r.name == "nexus.access"]
    line = record.access  # type: ignore[attr-defined]
    assert line["outcome"].startswith("error:")
    assert line["served"] == "mock/echo"
    assert line["completion_tokens"] >= 1
    assert line["estimated"] is True
