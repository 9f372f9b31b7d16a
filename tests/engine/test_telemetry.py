"""Traces: a span per request, a child span per upstream attempt, W3C context in and out.

The app runs in process with an in-memory exporter in place of the OTLP one
(``Telemetry.from_config(..., exporter=...)``); the upstreams are fake OpenAI servers
(tests/upstreams.py) that record the ``traceparent`` they receive.
"""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from nexus import cli
from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.errors import ConfigError
from nexus.server.app import create_app
from nexus.telemetry import Telemetry, traces_url
from nexus_process import start_nexus, stop_nexus
from upstreams import DONE, FakeUpstream, Reply, openai_chunk, openai_usage_chunk

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"

SERVED = "small-model-2025-01-31"
"""The model the upstream says answered: what ``gen_ai.response.model`` holds."""
ANSWER = [
    openai_chunk(content="Hello", model=SERVED),
    openai_chunk(content=" there", model=SERVED),
    openai_chunk(finish_reason="stop", model=SERVED),
    openai_usage_chunk(
        {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}, model=SERVED
    ),
    DONE,
]


@pytest.fixture
async def upstreams() -> AsyncIterator[tuple[FakeUpstream, FakeUpstream]]:
    async with FakeUpstream() as first, FakeUpstream() as second:
        yield first, second


def fallback_config(first: FakeUpstream, second: FakeUpstream, **telemetry: Any) -> dict[str, Any]:
    return {
        "providers": {
            "flaky": {"kind": "openai", "base_url": first.url + "/v1"},
            "steady": {"kind": "openai", "base_url": second.url + "/v1", "models": ["small-model"]},
        },
        "models": {"smart": {"targets": ["flaky/big-model", "steady/small-model"]}},
        "telemetry": telemetry,
    }


async def traced_client(
    aiohttp_client: Any, config: dict[str, Any], exporter: InMemorySpanExporter | None
) -> TestClient[Any, Any]:
    cfg = parse_config(config)
    telemetry = Telemetry.from_config(cfg.telemetry, exporter=exporter) if exporter else None
    app = create_app(cfg, registry=default_registry.copy(), telemetry=telemetry)
    return await aiohttp_client(app)


async def finished(exporter: InMemorySpanExporter, count: int) -> list[ReadableSpan]:
    """The spans once ``count`` ended (the request span ends just after the body)."""
    for _ in range(200):
        spans = list(exporter.get_finished_spans())
        if len(spans) >= count:
            return spans
        await asyncio.sleep(0.01)
    raise AssertionError(f"{len(spans)} spans ended, not {count}: {[s.name for s in spans]}")


def body(model: str = "smart", **extra: Any) -> dict[str, Any]:
    messages = [{"role": "user", "content": "Hi"}]
    return {"model": model, "messages": messages, "stream": True, **extra}


def traceparent_of(seen_headers: Any) -> tuple[str, str, str]:
    version, trace_id, span_id, flags = seen_headers["traceparent"].split("-")
    assert version == "00"
    return trace_id, span_id, flags


async def test_a_fallback_is_a_request_span_with_two_attempts(
    aiohttp_client: Any, upstreams: tuple[FakeUpstream, FakeUpstream]
) -> None:
    first, second = upstreams
    first.add(Reply.json(503, {"error": {"message": "overloaded"}}))
    second.add(Reply.stream(ANSWER))
    exporter = InMemorySpanExporter()
    client = await traced_client(aiohttp_client, fallback_config(first, second), exporter)
    resp = await client.post("/v1/chat/completions", json=body(max_tokens=50, temperature=0.5))
    assert resp.status == 200
    assert b"Hello" in await resp.read()

    spans = await finished(exporter, 3)
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    attempts = sorted(
        (s for s in spans if s.kind is SpanKind.CLIENT), key=lambda s: s.attributes["nexus.attempt"]
    )
    assert server.name == "POST /v1/chat/completions"
    assert server.parent is None
    assert server.attributes["http.request.method"] == "POST"
    assert server.attributes["http.route"] == "/v1/chat/completions"
    assert server.attributes["http.response.status_code"] == 200
    assert server.attributes["gen_ai.request.model"] == "smart"
    assert server.attributes["nexus.request_id"] == resp.headers["X-Request-Id"]
    assert server.attributes["nexus.stream.id"]
    # Named by the model's bounded name: advertised, or <provider>/*.
    assert [a.name for a in attempts] == ["chat flaky/*", "chat steady/small-model"]
    for attempt in attempts:
        assert attempt.parent is not None
        assert attempt.parent.span_id == server.context.span_id
        assert attempt.context.trace_id == server.context.trace_id
        assert attempt.attributes["gen_ai.operation.name"] == "chat"
        assert attempt.attributes["gen_ai.provider.name"] == "openai"
        assert attempt.attributes["gen_ai.request.max_tokens"] == 50
        assert attempt.attributes["gen_ai.request.temperature"] == 0.5
        assert attempt.attributes["server.address"] == "127.0.0.1"
        assert attempt.start_time is not None and server.start_time is not None
        assert attempt.end_time is not None and server.end_time is not None
        assert server.start_time <= attempt.start_time <= attempt.end_time <= server.end_time

    failed, answered = attempts
    assert failed.attributes["nexus.provider"] == "flaky"
    assert failed.attributes["gen_ai.request.model"] == "big-model"
    assert failed.status.status_code is StatusCode.ERROR
    assert failed.attributes["error.type"] == "upstream_error"
    assert "gen_ai.usage.input_tokens" not in failed.attributes
    assert "gen_ai.response.model" not in failed.attributes  # no stream named one
    assert [e.name for e in failed.events] == []

    assert answered.attributes["nexus.provider"] == "steady"
    assert answered.status.status_code is StatusCode.UNSET
    assert answered.attributes["gen_ai.request.model"] == "small-model"
    assert answered.attributes["gen_ai.response.model"] == SERVED  # the upstream's word
    assert answered.attributes["gen_ai.usage.input_tokens"] == 7
    assert answered.attributes["gen_ai.usage.output_tokens"] == 2
    assert answered.attributes["gen_ai.response.finish_reasons"] == ("stop",)
    assert [e.name for e in answered.events] == ["gen_ai.first_token"]
    assert answered.attributes["gen_ai.response.time_to_first_chunk"] >= 0

    # Each upstream got the trace context of its own attempt.
    for seen, attempt in zip((first.requests[0], second.requests[0]), attempts, strict=True):
        trace_id, span_id, flags = traceparent_of(seen.headers)
        assert int(trace_id, 16) == server.context.trace_id
        assert int(span_id, 16) == attempt.context.span_id
        assert int(flags, 16) & 1  # sampled


async def test_an_incoming_traceparent_is_the_parent_and_goes_upstream_its_tracestate_not(
    aiohttp_client: Any, upstreams: tuple[FakeUpstream, FakeUpstream]
) -> None:
    """The trace id crosses the gateway; a tenant's tracestate (its vendors' entries) is
    not for a third-party provider, and is not taken in (W3C Trace Context: keep it out
    of requests to external systems)."""
    first, second = upstreams
    first.add(Reply.stream(ANSWER))
    exporter = InMemorySpanExporter()
    client = await traced_client(aiohttp_client, fallback_config(first, second), exporter)
    headers = {
        "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01",
        "tracestate": "vendor=opaque,tenant=acme-internal",
    }
    resp = await client.post("/v1/chat/completions", json=body(), headers=headers)
    assert resp.status == 200
    await resp.read()

    spans = await finished(exporter, 2)
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    (attempt,) = [s for s in spans if s.kind is SpanKind.CLIENT]
    assert server.context.trace_id == int(TRACE_ID, 16)
    assert server.parent is not None and server.parent.is_remote
    assert server.parent.span_id == int(PARENT_ID, 16)
    seen = first.requests[0]
    trace_id, span_id, _ = traceparent_of(seen.headers)
    assert trace_id == TRACE_ID
    assert int(span_id, 16) == attempt.context.span_id
    assert "tracestate" not in seen.headers
    assert not server.context.trace_state and not attempt.context.trace_state


async def test_sample_ratio_zero_exports_nothing_but_a_sampled_caller_stays_sampled(
    aiohttp_client: Any, upstreams: tuple[FakeUpstream, FakeUpstream]
) -> None:
    first, second = upstreams
    first.add(Reply.stream(ANSWER), Reply.stream(ANSWER))
    exporter = InMemorySpanExporter()
    config = fallback_config(first, second, sample_ratio=0.0)
    client = await traced_client(aiohttp_client, config, exporter)

    resp = await client.post("/v1/chat/completions", json=body())
    assert resp.status == 200
    await resp.read()
    await asyncio.sleep(0.05)
    assert exporter.get_finished_spans() == ()
    # The trace is not recorded, but its context still goes upstream, marked unsampled.
    _, _, flags = traceparent_of(first.requests[0].headers)
    assert not int(flags, 16) & 1

    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    resp = await client.post("/v1/chat/completions", json=body(), headers=headers)
    assert resp.status == 200
    await resp.read()
    spans = await finished(exporter, 2)
    assert {s.context.trace_id for s in spans} == {int(TRACE_ID, 16)}


async def test_a_background_request_span_covers_its_run(
    aiohttp_client: Any, upstreams: tuple[FakeUpstream, FakeUpstream]
) -> None:
    first, second = upstreams
    first.add(Reply.stream(ANSWER, delay=[0.0, 0.3, 0.0, 0.0, 0.0]))
    exporter = InMemorySpanExporter()
    client = await traced_client(aiohttp_client, fallback_config(first, second), exporter)
    resp = await client.post("/v1/chat/completions", json=body(background=True))
    assert resp.status == 202
    await asyncio.sleep(0.1)
    assert exporter.get_finished_spans() == ()  # the 202 is out, the run goes on
    spans = await finished(exporter, 2)
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    (attempt,) = [s for s in spans if s.kind is SpanKind.CLIENT]
    assert server.attributes["http.response.status_code"] == 202
    assert attempt.end_time is not None and server.end_time is not None
    assert attempt.end_time <= server.end_time
    assert attempt.attributes["gen_ai.usage.output_tokens"] == 2


async def test_a_background_run_that_fails_after_its_202_is_an_error_on_its_span(
    aiohttp_client: Any,
) -> None:
    """The 202 went out before the failure: the span keeps its status code, and ends with
    the run as an error, its code as ``error.type`` (a stream failing after its headers)."""
    async with FakeUpstream() as up:
        up.add(Reply.stream([openai_chunk(content="Hi")], delay=0.2, end="stall"))
        providers = {"slow": {"kind": "openai", "base_url": up.url + "/v1", "idle_timeout_s": 0.3}}
        exporter = InMemorySpanExporter()
        client = await traced_client(aiohttp_client, {"providers": providers}, exporter)
        resp = await client.post("/v1/chat/completions", json=body("slow/m", background=True))
        assert resp.status == 202
        await asyncio.sleep(0.05)
        assert exporter.get_finished_spans() == ()  # the run goes on past its 202
        spans = await finished(exporter, 2)
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    (attempt,) = [s for s in spans if s.kind is SpanKind.CLIENT]
    assert server.attributes["http.response.status_code"] == 202
    assert server.status.status_code is StatusCode.ERROR
    assert server.attributes["error.type"] == attempt.attributes["error.type"] == "upstream_timeout"


async def test_a_background_run_cancelled_after_its_202_is_no_error_on_its_span(
    aiohttp_client: Any,
) -> None:
    """A ``DELETE`` ends the run on purpose: the span says so, not that it failed."""
    exporter = InMemorySpanExporter()
    client = await traced_client(aiohttp_client, {}, exporter)
    slow = {"content": "a b c d e f g h", "delay_ms": 100}
    resp = await client.post(
        "/v1/chat/completions", json=body("mock/echo", background=True, mock=slow)
    )
    assert resp.status == 202
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    assert (await client.delete(f"/v1/streams/{stream_id}")).status == 200
    spans = await finished(exporter, 3)
    (server,) = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert server.status.status_code is StatusCode.UNSET
    assert "error.type" not in server.attributes
    assert server.attributes["nexus.cancelled"] == "aborted"


async def test_with_tracing_off_nothing_is_made_nor_imported(
    aiohttp_client: Any,
    upstreams: tuple[FakeUpstream, FakeUpstream],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No otlp_endpoint: no span, no traceparent upstream, and OpenTelemetry is never
    imported (it could be absent: importing it here would fail)."""
    first, second = upstreams
    first.add(Reply.stream(ANSWER))
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    client = await traced_client(aiohttp_client, fallback_config(first, second), None)
    resp = await client.post("/v1/chat/completions", json=body())
    assert resp.status == 200
    assert b"Hello" in await resp.read()
    assert "traceparent" not in first.requests[0].headers
    assert client.app is not None
    from nexus.server.access import TELEMETRY
    from nexus.server.state import ENGINE

    assert TELEMETRY not in client.app
    assert client.app[ENGINE].telemetry is None


@pytest.mark.parametrize(
    "missing",
    ["opentelemetry", "opentelemetry.sdk.trace", "opentelemetry.exporter.otlp.proto.http"],
)
def test_an_endpoint_without_the_extra_is_refused_at_start(
    monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    for name in [m for m in sys.modules if m == missing or m.startswith(missing + ".")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, missing, None)  # "import" now fails, as if not installed
    cfg = parse_config({"telemetry": {"otlp_endpoint": "http://127.0.0.1:4318"}})
    with pytest.raises(ConfigError, match=r"nexus-gateway\[otel\]"):
        create_app(cfg, registry=default_registry.copy())


def test_the_config_is_checked() -> None:
    cfg = parse_config({})
    assert cfg.telemetry.otlp_endpoint is None
    assert cfg.telemetry.service_name == "nexus"
    assert cfg.telemetry.sample_ratio == 1.0
    for bad, where in [
        ({"sample_ratio": 1.5}, "sample_ratio"),
        ({"sample_ratio": -0.1}, "sample_ratio"),
        ({"otlp_endpoint": "collector:4318"}, "otlp_endpoint"),
        ({"otlp_endpoint": "https://user:secret@collector:4318"}, "OTEL_EXPORTER_OTLP_HEADERS"),
        ({"otlp_endpoint": "http://c:4318/?api_key=x"}, "OTEL_EXPORTER_OTLP_HEADERS"),
        ({"otlp_endpoint": "http://c:4318/#x"}, "no credentials, query or fragment"),
        ({"service_name": ""}, "service_name"),
        ({"endpoint": "http://x"}, "unknown key"),
    ]:
        with pytest.raises(ConfigError, match=where):
            parse_config({"telemetry": bad})
    assert traces_url("http://c:4318") == "http://c:4318/v1/traces"
    assert traces_url("http://c:4318/") == "http://c:4318/v1/traces"
    assert traces_url("https://c/otlp/v1/traces") == "https://c/otlp/v1/traces"


async def test_nexus_serve_sends_its_spans_to_an_otlp_collector(tmp_path: Path) -> None:
    """The real exporter: OTLP/HTTP protobuf to <otlp_endpoint>/v1/traces, flushed when
    the server stops."""
    received: list[bytes] = []

    async def traces(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        received.append(await request.read())
        return web.Response(body=b"", content_type="application/x-protobuf")

    collector = web.Application()
    collector.router.add_post("/v1/traces", traces)
    runner = web.AppRunner(collector, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    config = tmp_path / "nexus.toml"
    config.write_text(
        "[telemetry]\n"
        f'otlp_endpoint = "http://127.0.0.1:{port}"\n'
        'service_name = "nexus-test"\n'
        "[providers.mock]\n"
        'kind = "mock"\n'
    )
    try:
        proc, match = await asyncio.to_thread(start_nexus, config, tmp_path / "nexus.log")
        try:
            async with aiohttp.ClientSession() as session:
                url = match.group(1) + "/v1/chat/completions"
                async with session.post(url, json=body("mock/echo")) as resp:
                    assert resp.status == 200
                    await resp.read()
        finally:
            # In a thread: the collector must go on answering while the server flushes.
            await asyncio.to_thread(stop_nexus, proc)
    finally:
        await runner.cleanup()
    assert received, (tmp_path / "nexus.log").read_text()
    spans = []
    for payload in received:
        export = ExportTraceServiceRequest.FromString(payload)
        for resource_spans in export.resource_spans:
            service = {a.key: a.value.string_value for a in resource_spans.resource.attributes}[
                "service.name"
            ]
            assert service == "nexus-test"
            spans += [s for scope in resource_spans.scope_spans for s in scope.spans]
    assert sorted(s.name for s in spans) == ["POST /v1/chat/completions", "chat mock/echo"]


def test_the_gateway_imports_no_opentelemetry_until_tracing_is_on() -> None:
    code = (
        "import sys, nexus, nexus.server.app, nexus.providers.openai, nexus.telemetry; "
        "from nexus.config import parse_config; from nexus.server.app import create_app; "
        "create_app(parse_config({})); "
        "print(sorted(m for m in sys.modules if m.startswith('opentelemetry')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_nexus_serve_refuses_an_endpoint_without_the_extra_before_any_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "nexus.toml"
    config.write_text(
        '[telemetry]\notlp_endpoint = "http://127.0.0.1:4318"\n[server]\nworkers = 2\n'
    )
    for name in [m for m in sys.modules if m.startswith("opentelemetry")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "opentelemetry", None)
    assert cli.main(["serve", "--config", str(config), "--port", "0"]) == 2
    assert "pip install 'nexus-gateway[otel]'" in capsys.readouterr().err


async def test_a_clients_strings_reach_a_span_bounded(
    aiohttp_client: Any, upstreams: tuple[FakeUpstream, FakeUpstream]
) -> None:
    """A caller's sampled traceparent exports its span whatever sample_ratio says: its
    path and model must not make it as large as the request (a 2 MB model name, a 7 KB
    path reached the collector whole)."""
    first, second = upstreams
    exporter = InMemorySpanExporter()
    config = fallback_config(first, second, sample_ratio=0.0)
    client = await traced_client(aiohttp_client, config, exporter)
    headers = {"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}
    resp = await client.get("/v1/streams/" + "A" * 7000, headers=headers)
    assert resp.status == 404
    resp = await client.post("/v1/chat/completions", json=body("m" * 300_000), headers=headers)
    assert resp.status == 400
    assert "model" in (await resp.json())["error"]["param"]
    spans = await finished(exporter, 2)
    for span in spans:
        for value in (span.attributes or {}).values():
            assert len(str(value)) <= 1024, (span.name, str(value)[:80])
    assert resp.headers["X-Content-Type-Options"] == "nosniff"


KEY = "nx-" + "A" * 43
SECRET = "sk-proj-" + "S" * 32


async def test_spans_carry_no_key_and_are_named_by_bounded_values(
    aiohttp_client: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A key a client puts in its path or model is redacted on the spans as in the access
    line (one redaction), an upstream echoing it too; the names are the route and the
    model's bounded name (a model per request would be an operation per request)."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    echoed = f"Bearer {SECRET}"  # what an upstream that echoes the model would say
    answer = [openai_chunk(content="hi", model=echoed), openai_chunk(finish_reason="stop"), DONE]
    async with FakeUpstream(default=Reply.stream(answer)) as up:
        exporter = InMemorySpanExporter()
        providers = {"up": {"kind": "openai", "base_url": up.url + "/v1"}}
        client = await traced_client(aiohttp_client, {"providers": providers}, exporter)
        assert (await client.get(f"/v1/streams/{KEY}")).status == 404
        models = [f"up/{KEY}", f"up/Bearer {SECRET}", *(f"up/tenant-{i}" for i in range(5))]
        for model in models:
            resp = await client.post("/v1/chat/completions", json=body(model))
            assert resp.status == 200
            await resp.read()
        spans = await finished(exporter, 1 + 2 * len(models))
    for span in spans:
        assert KEY not in span.name and SECRET not in span.name
        for value in (span.attributes or {}).values():
            assert KEY not in str(value) and SECRET not in str(value), span.name
    assert {s.name for s in spans} == {
        "GET /v1/streams/{id}",
        "POST /v1/chat/completions",
        "chat up/*",
    }
    (lost,) = [s for s in spans if s.name == "GET /v1/streams/{id}"]
    (line,) = [
        r.access for r in caplog.records if r.name == "nexus.access" and r.levelname == "WARNING"
    ]  # type: ignore[attr-defined]
    assert lost.attributes["url.path"] == line["path"] == "/v1/streams/nx-[redacted]"
    assert lost.attributes["http.route"] == "/v1/streams/{id}"
    servers = [s for s in spans if s.name == "POST /v1/chat/completions"]
    attempts = [s for s in spans if s.kind is SpanKind.CLIENT]
    assert [s.attributes["gen_ai.request.model"] for s in servers[:2]] == [
        "up/nx-[redacted]",
        "up/Bearer [redacted]",
    ]
    requested = {s.attributes["gen_ai.request.model"] for s in attempts}
    assert {"nx-[redacted]", "Bearer [redacted]", "tenant-0"} <= requested
    # What the upstream said answered (its chunks' model), not what was asked for.
    assert {s.attributes["gen_ai.response.model"] for s in attempts} == {"[redacted]"}


async def test_a_provider_key_an_upstream_echoes_as_its_model_is_not_on_the_span(
    aiohttp_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The span's ``gen_ai.response.model`` (the upstream's word) went through the
    server's redaction alone, which does not know the providers' keys: one of no known
    shape reached the collector."""
    plain = "PROVIDERSECRETzz9Qw7Lk3Xc"
    monkeypatch.setenv("NEXUS_TEST_PLAIN_KEY", plain)
    answer = [openai_chunk(content="hi", model=plain), openai_chunk(finish_reason="stop"), DONE]
    async with FakeUpstream(default=Reply.stream(answer)) as up:
        exporter = InMemorySpanExporter()
        up_table = {"kind": "openai", "base_url": up.url + "/v1"}
        providers = {"up": {**up_table, "api_key_env": "NEXUS_TEST_PLAIN_KEY"}}
        client = await traced_client(aiohttp_client, {"providers": providers}, exporter)
        resp = await client.post("/v1/chat/completions", json=body("up/m"))
        assert resp.status == 200
        await resp.read()
        spans = await finished(exporter, 2)
    (attempt,) = [s for s in spans if s.kind is SpanKind.CLIENT]
    assert attempt.attributes["gen_ai.response.model"] == "[redacted]"


async def test_an_attempt_without_an_upstream_model_has_no_response_model(
    aiohttp_client: Any,
) -> None:
    """The mock names no model in its stream: the span leaves the attribute out rather
    than repeat the request's."""
    exporter = InMemorySpanExporter()
    client = await traced_client(aiohttp_client, {}, exporter)
    resp = await client.post("/v1/chat/completions", json=body("mock/echo"))
    assert resp.status == 200
    await resp.read()
    (attempt,) = [s for s in await finished(exporter, 2) if s.kind is SpanKind.CLIENT]
    assert attempt.name == "chat mock/echo"  # an advertised model is its own name
    assert attempt.attributes["gen_ai.request.model"] == "echo"
    assert "gen_ai.response.model" not in attempt.attributes


async def test_a_stream_that_fails_after_its_headers_is_an_error_on_the_request_span(
    aiohttp_client: Any,
) -> None:
    """The status stays 200 (the headers were out), the span says the request failed."""
    async with FakeUpstream() as up:
        up.add(Reply.stream([openai_chunk(content="Hi")], end="stall"))
        providers = {"slow": {"kind": "openai", "base_url": up.url + "/v1", "idle_timeout_s": 0.3}}
        exporter = InMemorySpanExporter()
        client = await traced_client(aiohttp_client, {"providers": providers}, exporter)
        resp = await client.post("/v1/chat/completions", json=body("slow/m"))
        assert resp.status == 200
        assert b"upstream_timeout" in await resp.read()
        spans = await finished(exporter, 2)
    (server,) = [s for s in spans if s.kind is SpanKind.SERVER]
    (attempt,) = [s for s in spans if s.kind is SpanKind.CLIENT]
    assert server.attributes["http.response.status_code"] == 200
    assert server.status.status_code is StatusCode.ERROR
    assert server.attributes["error.type"] == attempt.attributes["error.type"] == "upstream_timeout"


async def test_a_cancelled_stream_is_no_error_on_the_request_span(aiohttp_client: Any) -> None:
    exporter = InMemorySpanExporter()
    client = await traced_client(aiohttp_client, {}, exporter)
    slow = {"content": "a b c d e f g h", "delay_ms": 50}
    resp = await client.post("/v1/chat/completions", json=body("mock/echo", mock=slow))
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    await resp.content.readany()
    assert (await client.delete(f"/v1/streams/{stream_id}")).status == 200
    await resp.read()
    spans = await finished(exporter, 3)
    (server,) = [s for s in spans if s.name == "POST /v1/chat/completions"]
    assert server.status.status_code is StatusCode.UNSET
    assert "error.type" not in server.attributes


async def test_the_request_span_has_the_gateways_id_and_the_clients_beside_it(
    aiohttp_client: Any,
) -> None:
    exporter = InMemorySpanExporter()
    client = await traced_client(aiohttp_client, {}, exporter)
    ids = []
    for _ in range(2):
        resp = await client.post(
            "/v1/chat/completions", json=body("mock/echo"), headers={"X-Request-Id": "mine-1"}
        )
        await resp.read()
        ids.append(resp.headers["X-Request-Id"])
    servers = [s for s in await finished(exporter, 4) if s.kind is SpanKind.SERVER]
    assert sorted(s.attributes["nexus.request_id"] for s in servers) == sorted(ids)
    assert len(set(ids)) == 2
    assert {s.attributes["nexus.client_request_id"] for s in servers} == {"mine-1"}


async def test_closing_waits_for_a_collector_no_longer_than_it_is_given() -> None:
    """With a collector down or silent, the exporter's retries held the process 3-5 s past
    its shutdown's bound (an orchestrator kills it there, mid-close)."""
    import time

    from opentelemetry.sdk.trace import TracerProvider

    from nexus.telemetry import Telemetry

    class Stuck(TracerProvider):
        def shutdown(self) -> None:
            time.sleep(3)

    started = time.monotonic()
    assert await Telemetry(Stuck()).close(0.2) is False
    assert time.monotonic() - started < 1.0
    assert await Telemetry(TracerProvider()).close(2.0) is True
