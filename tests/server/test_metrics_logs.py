"""Observability: Prometheus ``/metrics`` after real traffic, and the access log."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import Any

import pytest
from aiohttp.test_utils import TestClient
from prometheus_client.parser import text_string_to_metric_families

from nexus.auth import hash_key
from nexus.server.log_lines import JsonFormatter
from support import METRICS_TOKEN_ENV, SCRAPER, GatedProvider, MakeClient, chat, parse_sse

SSE = "text/event-stream"
CHAT = "/v1/chat/completions"

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


async def scrape(client: TestClient[Any, Any]) -> Samples:
    resp = await client.get("/metrics", headers=SCRAPER)  # (ignored without a token)
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    samples: Samples = {}
    for family in text_string_to_metric_families(await resp.text()):
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sample ``name`` with exactly ``labels`` (0 if absent)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


async def eventually(
    client: TestClient[Any, Any], check: Callable[[Samples], bool], timeout: float = 3.0
) -> Samples:
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        samples = await scrape(client)
        if check(samples) or asyncio.get_running_loop().time() > deadline:
            return samples
        await asyncio.sleep(0.02)


# --- /metrics -------------------------------------------------------------------------


async def test_metrics_disabled(make_client: MakeClient) -> None:
    client = await make_client({"metrics": {"enabled": False}})
    resp = await client.get("/metrics")
    assert resp.status == 404


async def test_metrics_exposition_format(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.get("/metrics")
    assert resp.status == 200
    assert resp.headers["Content-Type"].startswith("text/plain; version=")
    names = {family.name for family in text_string_to_metric_families(await resp.text())}
    assert {
        "nexus_requests",
        "nexus_active_streams",
        "nexus_time_to_first_byte_seconds",
        "nexus_stream_duration_seconds",
        "nexus_events_out",
        "nexus_bytes_out",
        "nexus_upstream_errors",
        "nexus_cancellations",
        "nexus_cache",
        "nexus_resumes",
    } <= names


async def test_requests_by_endpoint_model_outcome(make_client: MakeClient) -> None:
    client = await make_client()
    for _ in range(2):
        resp = await client.post(CHAT, json=chat(stream=True))
        assert resp.status == 200
        await resp.read()
    resp = await client.post(CHAT, json=chat())
    assert resp.status == 200
    resp = await client.post(CHAT, json={"model": 1})
    assert resp.status == 400
    resp = await client.post(
        "/v1/messages?stream_format=ndjson", json=chat(max_tokens=5, stream=True)
    )
    assert resp.status == 200
    await resp.read()
    assert (await client.get("/v1/models")).status == 200
    await client.get("/metrics")  # not counted
    samples = await scrape(client)
    total = "nexus_requests_total"
    assert value(samples, total, endpoint=CHAT, model="mock/echo", outcome="ok") == 3
    assert (
        value(samples, total, endpoint=CHAT, model="unknown", outcome="error:invalid_request") == 1
    )
    assert value(samples, total, endpoint="/v1/messages", model="mock/echo", outcome="ok") == 1
    assert value(samples, total, endpoint="/v1/models", model="unknown", outcome="ok") == 1
    assert all("-" not in dict(labels).values() for _, labels in samples)
    assert not any(
        name == total and dict(labels).get("endpoint") == "/metrics" for name, labels in samples
    )


async def test_active_streams_and_histograms(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(providers=[gated])
    assert value(await scrape(client), "nexus_active_streams") == 0
    resp = await client.post(f"{CHAT}?stream_format=sse", json=chat(model="gated/m", stream=True))
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    assert value(await scrape(client), "nexus_active_streams") == 1
    gated.gate.set()
    await resp.read()
    samples = await eventually(client, lambda s: value(s, "nexus_active_streams") == 0)
    assert value(samples, "nexus_active_streams") == 0
    labels = {"endpoint": CHAT, "format": SSE}
    by_model = {"model": "gated/*"}  # not an advertised model: its provider's
    for metric, of in (
        ("nexus_time_to_first_byte_seconds", labels),
        ("nexus_time_to_first_token_seconds", by_model),
        ("nexus_stream_duration_seconds", by_model),
    ):
        assert value(samples, f"{metric}_count", **of) == 1
        assert value(samples, f"{metric}_sum", **of) > 0
        assert value(samples, f"{metric}_bucket", le="+Inf", **of) == 1
    ttfb = value(samples, "nexus_time_to_first_byte_seconds_sum", **labels)
    assert ttfb <= value(samples, "nexus_stream_duration_seconds_sum", **by_model)


async def test_bytes_out_equal_the_body_the_client_read(make_client: MakeClient) -> None:
    client = await make_client()
    bodies = []
    for text in ("one two three four five six", "a b c d e f g h i j k l m n o p"):
        resp = await client.post(
            f"{CHAT}?stream_format=sse", json=chat(text, stream=True, mock={"delay_ms": 5})
        )
        assert resp.status == 200
        bodies.append(await resp.read())
    samples = await scrape(client)
    received = sum(len(body) for body in bodies)
    assert value(samples, "nexus_bytes_out_total", format=SSE) == received
    assert value(samples, "nexus_events_out_total", format=SSE) >= sum(
        len(parse_sse(body)) - 1 for body in bodies
    )


async def test_events_and_bytes_out_by_format(make_client: MakeClient) -> None:
    """What is counted today, whatever the bug above: by format, and never more than sent."""
    client = await make_client()
    resp = await client.post(
        f"{CHAT}?stream_format=sse",
        json=chat("one two three four five six seven eight", stream=True, mock={"delay_ms": 5}),
    )
    sse_body = await resp.read()
    resp = await client.post(
        f"{CHAT}?stream_format=ndjson",
        json=chat("one two three four five six seven eight", stream=True, mock={"delay_ms": 5}),
    )
    ndjson_body = await resp.read()
    samples = await scrape(client)
    sse_bytes = value(samples, "nexus_bytes_out_total", format=SSE)
    ndjson_bytes = value(samples, "nexus_bytes_out_total", format="application/x-ndjson")
    assert 0 < sse_bytes <= len(sse_body)
    assert 0 < ndjson_bytes <= len(ndjson_body)
    assert value(samples, "nexus_events_out_total", format=SSE) > 0
    assert value(samples, "nexus_events_out_total", format="application/x-ndjson") > 0


async def test_upstream_errors_in_stream(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post(
        f"{CHAT}?stream_format=sse",
        json=chat("one two three four five", stream=True, mock={"fail_after": 2, "delay_ms": 5}),
    )
    assert resp.status == 200
    body = await resp.read()
    assert b"error" in body
    samples = await scrape(client)
    errors = {
        dict(labels)["code"]: count
        for (name, labels), count in samples.items()
        if name == "nexus_upstream_errors_total" and dict(labels)["provider"] == "mock"
    }
    assert sum(errors.values()) == 1, samples
    assert all(kind and kind != "-" for kind in errors)


async def test_upstream_errors_before_output(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post(CHAT, json=chat(stream=True, mock={"fail_after": 0}))
    assert resp.status >= 500
    resp = await client.post(CHAT, json=chat(mock={"fail_after": 0}))
    assert resp.status >= 500
    samples = await scrape(client)
    errors = sum(
        count
        for (name, labels), count in samples.items()
        if name == "nexus_upstream_errors_total" and dict(labels)["provider"] == "mock"
    )
    assert errors == 2


async def test_cancellation_by_client_disconnect(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(providers=[gated])
    resp = await client.post(f"{CHAT}?stream_format=sse", json=chat(model="gated/m", stream=True))
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    resp.close()
    cause = "nexus_cancellations_total"
    samples = await eventually(client, lambda s: value(s, cause, cause="client_disconnect") >= 1)
    assert value(samples, cause, cause="client_disconnect") == 1
    assert value(samples, cause, cause="cancelled") == 0


async def test_cancellation_by_delete_of_a_read_stream(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(providers=[gated])
    resp = await client.post(f"{CHAT}?stream_format=sse", json=chat(model="gated/m", stream=True))
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    deleted = await client.delete(f"/v1/streams/{stream_id}")
    assert deleted.status == 200
    await resp.read()
    samples = await eventually(
        client, lambda s: value(s, "nexus_cancellations_total", cause="cancelled") >= 1
    )
    assert value(samples, "nexus_cancellations_total", cause="cancelled") == 1
    assert value(samples, "nexus_cancellations_total", cause="client_disconnect") == 0


async def test_cancellation_by_delete_of_a_background_stream(make_client: MakeClient) -> None:
    gated = GatedProvider(before=1, after=1)
    client = await make_client(providers=[gated])
    resp = await client.post(CHAT, json=chat(model="gated/m", stream=True, background=True))
    assert resp.status == 202
    stream_id = (await resp.json())["id"]
    assert (await client.delete(f"/v1/streams/{stream_id}")).status == 200
    samples = await eventually(
        client, lambda s: value(s, "nexus_cancellations_total", cause="cancelled") >= 1, 1.0
    )
    assert value(samples, "nexus_cancellations_total", cause="cancelled") == 1


async def test_cache_hits_and_misses(make_client: MakeClient) -> None:
    client = await make_client({"cache": {"enabled": True}})
    for _ in range(3):
        resp = await client.post(CHAT, json=chat("cache me please"))
        assert resp.status == 200
    resp = await client.post(f"{CHAT}?stream_format=sse", json=chat("a streamed one", stream=True))
    await resp.read()
    resp = await client.post(f"{CHAT}?stream_format=sse", json=chat("a streamed one", stream=True))
    assert resp.headers["X-Nexus-Cache"] == "hit"
    await resp.read()
    samples = await scrape(client)
    assert value(samples, "nexus_cache_total", result="miss") == 2
    assert value(samples, "nexus_cache_total", result="hit") == 3


async def test_resumes(make_client: MakeClient) -> None:
    client = await make_client()
    resp = await client.post(CHAT, json=chat(stream=True, background=True))
    stream_id = (await resp.json())["id"]
    resp = await client.get(f"/v1/streams/{stream_id}?stream_format=sse")
    events = parse_sse(await resp.read())
    assert value(await scrape(client), "nexus_resumes_total") == 0
    resp = await client.get(
        f"/v1/streams/{stream_id}?stream_format=sse", headers={"Last-Event-ID": events[0].id}
    )
    assert resp.status == 200
    await resp.read()
    assert value(await scrape(client), "nexus_resumes_total") == 1


# --- what the histograms and the event counters observe --------------------------------

TTFT = "nexus_time_to_first_token_seconds_count"
DURATION = "nexus_stream_duration_seconds_count"
MOCK = {"model": "mock/echo"}


async def test_a_stream_is_timed_from_its_first_output_and_whole_for_its_duration(
    make_client: MakeClient,
) -> None:
    """A stream that failed before any output (an HTTP error) is in neither histogram; one
    that failed after its output, or that its client left, has its time to first token
    but no duration (that would say when it was cut); one that ended well has both."""
    gated = GatedProvider(before=1, after=1)
    client = await make_client(providers=[gated])
    resp = await client.post(CHAT, json=chat(stream=True, mock={"fail_after": 0}))
    assert resp.status == 502
    samples = await eventually(client, lambda s: value(s, "nexus_requests_total", **MOCK) > 0)
    assert (value(samples, TTFT, **MOCK), value(samples, DURATION, **MOCK)) == (0, 0)
    resp = await client.post(f"{CHAT}?stream_format=sse", json=chat(stream=True))
    assert b"[DONE]" in await resp.read()
    resp = await client.post(
        f"{CHAT}?stream_format=sse", json=chat(stream=True, mock={"fail_after": 2})
    )
    assert resp.status == 200 and b"upstream_error" in await resp.read()
    resp = await client.post(f"{CHAT}?stream_format=sse", json=chat(model="gated/m", stream=True))
    await resp.content.readuntil(b"\n\n")
    resp.close()
    samples = await eventually(
        client, lambda s: value(s, "nexus_cancellations_total", cause="client_disconnect") >= 1
    )
    assert (value(samples, TTFT, **MOCK), value(samples, DURATION, **MOCK)) == (2, 1)
    cut = {"model": "gated/*"}
    assert (value(samples, TTFT, **cut), value(samples, DURATION, **cut)) == (1, 0)


async def test_a_json_answer_is_timed_as_a_stream_is(make_client: MakeClient) -> None:
    """A non-streaming answer runs a stream as well: it was in neither histogram, so a
    latency dashboard saw none of the JSON traffic. A failure before any output is still
    in neither."""
    client = await make_client()
    resp = await client.post(CHAT, json=chat(mock={"fail_after": 0}))
    assert resp.status == 502
    resp = await client.post(CHAT, json=chat())
    assert resp.status == 200
    samples = await eventually(client, lambda s: value(s, TTFT, **MOCK) > 0)
    assert (value(samples, TTFT, **MOCK), value(samples, DURATION, **MOCK)) == (1, 1)


async def test_replays_are_not_timed_as_upstream_streams(make_client: MakeClient) -> None:
    """A replay's pace is the cache's: only its first byte, which its client waited for,
    is observed (``nexus_time_to_first_byte_seconds``)."""
    client = await make_client({"cache": {"enabled": True}})
    for cache in ("miss", "hit"):
        resp = await client.post(f"{CHAT}?stream_format=sse", json=chat("again", stream=True))
        assert resp.headers["X-Nexus-Cache"] == cache
        await resp.read()
    ttfb = {"endpoint": CHAT, "format": SSE}
    samples = await eventually(
        client, lambda s: value(s, "nexus_time_to_first_byte_seconds_count", **ttfb) == 2
    )
    assert value(samples, "nexus_time_to_first_byte_seconds_count", **ttfb) == 2
    assert (value(samples, TTFT, **MOCK), value(samples, DURATION, **MOCK)) == (1, 1)


async def test_events_are_those_written_to_the_client_resumes_too(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """An event is counted when it is written: not the log entries a resume skipped, nor
    those its format leaves out (a usage nobody asked for), nor a stream that failed
    before any output."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client()
    words = " ".join(f"w{i}" for i in range(60))
    resp = await client.post(
        f"{CHAT}?stream_format=sse",
        json=chat(words, stream=True, stream_options={"resumable": True}),
        headers={"X-Client-Request-Id": "rid-first"},
    )
    frames = parse_sse(await resp.read())
    stream_id = resp.headers["X-Nexus-Stream-Id"]
    resp = await client.get(
        f"/v1/streams/{stream_id}?stream_format=sse",
        headers={"Last-Event-ID": frames[-3].id, "X-Client-Request-Id": "rid-resume"},
    )
    assert len(parse_sse(await resp.read())) == 2
    resp = await client.post(
        CHAT,
        json=chat(stream=True, mock={"fail_after": 0}),
        headers={"X-Client-Request-Id": "rid-502"},
    )
    assert resp.status == 502
    for _ in range(300):
        lines = {client_id(r): r.access for r in access_records(caplog)}  # type: ignore[attr-defined]
        if len(lines) == 3:
            break
        await asyncio.sleep(0.01)
    assert lines["rid-first"]["events"] == len(frames)
    assert lines["rid-resume"]["events"] == 2
    assert (lines["rid-502"]["events"], lines["rid-502"]["bytes"]) == (0, 0)
    samples = await scrape(client)
    assert value(samples, "nexus_events_out_total", format=SSE) == len(frames) + 2


# --- the access log -------------------------------------------------------------------

SECRET_KEY = "nx-very-secret-key-0042"
PROMPT = "zanzibar-quokka-marmalade"


def access_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "nexus.access"]


def client_id(record: logging.LogRecord) -> str | None:
    """The id the client gave the request its line is about (its own id is the gateway's)."""
    return record.access.get("client_request_id")  # type: ignore[attr-defined, no-any-return]


async def test_one_access_line_per_request(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client()
    resp = await client.post(
        f"{CHAT}?stream_format=sse",
        json=chat("one two three", stream=True),
        headers={"X-Client-Request-Id": "rid-stream"},
    )
    body = await resp.read()
    resp = await client.post(CHAT, json=chat(), headers={"X-Client-Request-Id": "rid-json"})
    await resp.read()
    resp = await client.post(CHAT, json={"model": 1}, headers={"X-Client-Request-Id": "rid-bad"})
    await resp.read()
    await client.get("/healthz")
    await client.get("/metrics")
    await asyncio.sleep(0.05)
    records = access_records(caplog)
    by_id = {client_id(r): r for r in records}
    assert len(records) == 3
    assert set(by_id) == {"rid-stream", "rid-json", "rid-bad"}
    fields = {
        "endpoint",
        "status",
        "format",
        "provider",
        "ttfb_ms",
        "duration_ms",
        "events",
        "bytes",
    }
    for record in records:
        assert fields <= set(record.access)  # type: ignore[attr-defined]
        bad_request = client_id(record) == "rid-bad"
        assert record.levelno == (logging.WARNING if bad_request else logging.INFO)
        assert record.getMessage().startswith(record.request_id)  # type: ignore[attr-defined]
    stream = by_id["rid-stream"].access  # type: ignore[attr-defined]
    assert stream["endpoint"] == CHAT
    assert stream["status"] == 200
    assert stream["format"] == SSE
    assert stream["provider"] == "mock"
    assert stream["ttfb_ms"] is not None and stream["ttfb_ms"] >= 0
    assert stream["duration_ms"] >= stream["ttfb_ms"]
    assert stream["events"] > 0
    assert 0 < stream["bytes"] <= len(body)
    plain = by_id["rid-json"].access  # type: ignore[attr-defined]
    assert (plain["status"], plain["format"]) == (200, "application/json")
    assert (plain["events"], plain["bytes"]) == (None, None)  # no stream was written
    bad = by_id["rid-bad"].access  # type: ignore[attr-defined]
    assert (bad["status"], bad["outcome"]) == (400, "error:invalid_request")
    assert (bad["events"], bad["bytes"]) == (None, None)


async def test_a_cors_preflight_has_its_access_line(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The middleware answers it itself, yet it is a request: one line (INFO, outcome
    ``preflight``, the endpoint it asks about) and one count."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    origin = "https://app.example.com"
    client = await make_client({"cors": {"allow_origins": [origin]}})
    for path, method, rid in (
        (CHAT, "POST", "rid-chat"),
        ("/v1/streams/chatcmpl-x", "DELETE", "rid-stream"),
        (CHAT, "BREW", "rid-brew"),
    ):
        asked = {"Origin": origin, "Access-Control-Request-Method": method}
        resp = await client.options(path, headers=asked | {"X-Client-Request-Id": rid})
        assert resp.status == 204
    lines = {client_id(r): r for r in access_records(caplog)}
    assert set(lines) == {"rid-chat", "rid-stream", "rid-brew"}
    for record in lines.values():
        assert record.levelno == logging.INFO
        access = record.access  # type: ignore[attr-defined]
        assert (access["method"], access["status"], access["outcome"]) == (
            "OPTIONS",
            204,
            "preflight",
        )
    assert lines["rid-chat"].access["endpoint"] == CHAT  # type: ignore[attr-defined]
    assert lines["rid-stream"].access["endpoint"] == "/v1/streams/{id}"  # type: ignore[attr-defined]
    assert lines["rid-brew"].access["endpoint"] == "unmatched"  # type: ignore[attr-defined]
    samples = await scrape(client)
    counted = {"endpoint": CHAT, "model": "unknown", "outcome": "preflight"}
    assert value(samples, "nexus_requests_total", **counted) == 1


async def test_a_model_name_cannot_split_the_text_line(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    # A client's model name with Unicode line boundaries (U+2028, U+2029, U+0085) or a
    # newline: one record, one line under every reader's idea of a line.
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client()
    forged = "x\u2028INFO nexus.access: req_f key=admin\u2029y\u0085z\nw"
    resp = await client.post(
        CHAT, json=chat(model=forged), headers={"X-Client-Request-Id": "rid-f"}
    )
    await resp.read()
    await asyncio.sleep(0.05)
    (record,) = access_records(caplog)
    line = record.getMessage()
    assert len(line.splitlines()) == 1
    assert line.isascii()
    assert '"x\\u2028INFO nexus.access: req_f key=admin\\u2029y\\u0085z\\nw"' in line
    assert record.access["model"] == forged  # type: ignore[attr-defined]


async def test_a_client_value_cannot_forge_a_field(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """A client's request id (or model) holding ``=`` read as a field of its own
    (``client_request_id=key=victim``: a ``key`` for whoever greps the line): quoted."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client()
    resp = await client.post(
        CHAT, json=chat(model="cost_usd=0"), headers={"X-Client-Request-Id": "key=victim"}
    )
    await resp.read()
    await asyncio.sleep(0.05)
    (record,) = access_records(caplog)
    line = record.getMessage()
    assert ' client_request_id="key=victim"' in line and ' model="cost_usd=0"' in line
    assert " key=victim" not in line and " cost_usd=0" not in line


async def test_access_log_bytes_equal_the_body(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client()
    resp = await client.post(
        f"{CHAT}?stream_format=sse",
        json=chat("one two three four", stream=True, mock={"delay_ms": 5}),
    )
    body = await resp.read()
    await asyncio.sleep(0.05)
    (record,) = access_records(caplog)
    assert record.access["bytes"] == len(body)  # type: ignore[attr-defined]


async def test_no_keys_or_contents_in_logs(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    config = {"auth": {"keys": [{"name": "ops", "sha256": hash_key(SECRET_KEY)}]}}
    client = await make_client(config)
    auth = {"Authorization": f"Bearer {SECRET_KEY}"}
    resp = await client.post(
        f"{CHAT}?stream_format=sse", json=chat(PROMPT, stream=True), headers=auth
    )
    await resp.read()
    resp = await client.post(CHAT, json=chat(PROMPT), headers={"x-api-key": SECRET_KEY})
    await resp.read()
    resp = await client.post(
        CHAT, json=chat(PROMPT, stream=True, mock={"fail_after": 1}), headers=auth
    )
    await resp.read()
    resp = await client.post(CHAT, json=chat(PROMPT), headers={"x-api-key": SECRET_KEY + "x"})
    assert resp.status == 401
    await asyncio.sleep(0.05)
    assert len(access_records(caplog)) == 4
    formatter = JsonFormatter()
    for record in caplog.records:
        rendered = [
            record.getMessage(),
            repr(getattr(record, "access", None)),
            str(getattr(record, "request_id", "")),
            formatter.format(record),
        ]
        for text in rendered:
            assert SECRET_KEY not in text
            assert hash_key(SECRET_KEY) not in text
            assert PROMPT not in text
    keyed = [r for r in access_records(caplog) if r.access["status"] == 200]  # type: ignore[attr-defined]
    assert keyed and all(r.access["key"] == "ops" for r in keyed)  # type: ignore[attr-defined]


async def test_json_formatter(make_client: MakeClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client()
    resp = await client.post(
        f"{CHAT}?stream_format=sse",
        json=chat(stream=True),
        headers={"X-Client-Request-Id": "rid-json-1"},
    )
    await resp.read()
    await asyncio.sleep(0.05)
    (record,) = access_records(caplog)
    line = JsonFormatter().format(record)
    assert "\n" not in line
    out = json.loads(line)
    assert out["request_id"] == resp.headers["X-Request-Id"]
    assert out["client_request_id"] == "rid-json-1"
    assert out["logger"] == "nexus.access"
    assert out["level"] == "info"
    assert out["time"].endswith("Z")
    assert out["message"] == record.getMessage()
    for field in ("endpoint", "status", "format", "provider", "ttfb_ms", "duration_ms"):
        assert out[field] is not None, field
    assert (out["endpoint"], out["status"], out["format"], out["provider"]) == (
        CHAT,
        200,
        SSE,
        "mock",
    )
    assert out["events"] > 0 and out["bytes"] > 0


async def test_access_log_off(make_client: MakeClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client({"logging": {"access_log": False}})
    resp = await client.post(CHAT, json=chat(stream=True))
    await resp.read()
    assert access_records(caplog) == []


async def test_a_stream_cut_short_keeps_its_status_in_the_access_log(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Headers out, then the client leaves: the client got a 200, and so says the log."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    gated = GatedProvider(before=1, after=1)
    client = await make_client(providers=[gated])
    resp = await client.post(
        f"{CHAT}?stream_format=sse",
        json=chat(model="gated/m", stream=True),
        headers={"X-Client-Request-Id": "rid-cut"},
    )
    assert resp.status == 200
    await resp.content.readuntil(b"\n\n")
    resp.close()
    samples = await eventually(
        client, lambda s: value(s, "nexus_cancellations_total", cause="client_disconnect") >= 1
    )
    requests = "nexus_requests_total"
    cut = "cancelled:client_disconnect"
    assert value(samples, requests, endpoint=CHAT, model="gated/*", outcome=cut) == 1
    assert value(samples, requests, endpoint=CHAT, model="gated/*", outcome="ok") == 0
    (record,) = [r for r in access_records(caplog) if client_id(r) == "rid-cut"]
    assert record.access["status"] == 200  # type: ignore[attr-defined]
    assert record.access["cancelled"] == "client_disconnect"  # type: ignore[attr-defined]
    assert record.access["outcome"] == cut  # type: ignore[attr-defined]
    assert record.levelno == logging.WARNING


async def test_a_client_that_leaves_before_any_answer_is_a_499(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    gated = GatedProvider(before=0, after=1)
    client = await make_client(providers=[gated])
    request = asyncio.ensure_future(
        client.post(
            f"{CHAT}?stream_format=sse",
            json=chat(model="gated/m", stream=True),
            headers={"X-Client-Request-Id": "rid-gone"},
        )
    )
    await asyncio.wait_for(gated.started.wait(), 3)
    request.cancel()
    with pytest.raises(asyncio.CancelledError):
        await request
    deadline = asyncio.get_running_loop().time() + 3
    while not [r for r in access_records(caplog) if client_id(r) == "rid-gone"]:
        assert asyncio.get_running_loop().time() < deadline, "no access line"
        await asyncio.sleep(0.02)
    (record,) = [r for r in access_records(caplog) if client_id(r) == "rid-gone"]
    assert record.access["status"] == 499  # type: ignore[attr-defined]
    assert record.access["cancelled"] == "client_disconnect"  # type: ignore[attr-defined]


def spend_records(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == "nexus.spend"]


async def until_spend_lines(caplog: pytest.LogCaptureFixture, count: int) -> list[Any]:
    for _ in range(300):
        if len(spend_records(caplog)) >= count:
            break
        await asyncio.sleep(0.01)
    return [r.access for r in spend_records(caplog)]  # type: ignore[attr-defined]


PRICED = {"models": {"mock/echo": {"input_usd_per_mtok": 0, "output_usd_per_mtok": 1_000_000}}}


async def test_a_background_streams_spend_has_a_line_of_its_own_at_its_end(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    # Its request's access line is the 202's, written before the stream ran: the spend
    # comes in a nexus.spend line at the stream's end, under the same request id.
    caplog.set_level(logging.INFO, logger="nexus")
    client = await make_client(PRICED)
    body = chat("one two three", background=True, model="mock/echo")
    resp = await client.post(CHAT, json=body, headers={"X-Client-Request-Id": "rid-bg"})
    assert resp.status == 202
    made = await resp.json()
    (line,) = await until_spend_lines(caplog, 1)
    access = [r for r in access_records(caplog) if client_id(r) == "rid-bg"]
    assert len(access) == 1 and "cost_usd" not in access[0].access  # type: ignore[attr-defined]
    assert spend_records(caplog)[0].request_id == access[0].request_id  # type: ignore[attr-defined]
    assert line["client_request_id"] == "rid-bg"
    assert (line["stream_id"], line["outcome"], line["served"]) == (made["id"], "ok", "mock/echo")
    assert line["completion_tokens"] == 3 and line["cost_usd"] == pytest.approx(3)
    assert (
        spend_records(caplog)[0]
        .getMessage()
        .startswith(f"{resp.headers['X-Request-Id']} endpoint=")
    )


async def test_a_background_stream_no_target_answered_names_none_served(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """Its meta names the first target tried; a spend line that said ``served=`` it
    named a provider that served nothing."""
    caplog.set_level(logging.INFO, logger="nexus")
    client = await make_client(PRICED)
    body = chat("one two", background=True, model="mock/echo", mock={"fail_after": 0})
    resp = await client.post(CHAT, json=body)
    assert resp.status == 202
    (line,) = await until_spend_lines(caplog, 1)
    assert line["outcome"].startswith("mid_stream_error:")
    assert line["served"] is None


async def test_each_realtime_turn_has_its_spend_line(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    import orjson
    import websockets

    caplog.set_level(logging.INFO, logger="nexus")
    client = await make_client(PRICED)
    url = str(client.make_url("/v1/realtime")).replace("http", "ws", 1)
    client_id = {"X-Client-Request-Id": "rid-socket"}
    async with websockets.connect(url, additional_headers=client_id) as ws:
        for content in ("a b", "c d e"):
            request = {"model": "mock/echo", "messages": [{"role": "user", "content": content}]}
            await ws.send(orjson.dumps({"type": "start", "request": request}).decode())
            while orjson.loads(await ws.recv())["type"] != "done":
                pass
        lines = await until_spend_lines(caplog, 2)
    assert [line["completion_tokens"] for line in lines] == [2, 3]
    assert [line["cost_usd"] for line in lines] == [pytest.approx(2), pytest.approx(3)]
    assert [line["client_request_id"] for line in lines] == ["rid-socket"] * 2  # the socket's
    assert {(line["endpoint"], line["model"], line["outcome"]) for line in lines} == {
        ("/v1/realtime", "mock/echo", "ok")
    }
    assert len({line["stream_id"] for line in lines}) == 2


async def test_a_resumable_stream_its_client_left_has_its_spend_line_at_its_end(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexus")
    client = await make_client(PRICED)
    body = chat("a b c d", stream=True, model="mock/echo")
    body["mock"] = {"content": "a b c d", "delay_ms": 300}
    body["stream_options"] = {"resumable": True}
    resp = await client.post(f"{CHAT}?stream_format=sse", json=body)
    await resp.content.readuntil(b"\n\n")
    resp.close()  # it runs on without its client
    (line,) = await until_spend_lines(caplog, 1)
    assert line["completion_tokens"] == 4 and line["cost_usd"] == pytest.approx(4)
    (access,) = access_records(caplog)
    assert "cost_usd" not in access.access  # type: ignore[attr-defined]
    # A stream that ended within its request has its spend on the access line only.
    resp = await client.post(CHAT, json=chat("x y", model="mock/echo"))
    await resp.read()
    await asyncio.sleep(0.1)
    assert len(spend_records(caplog)) == 1


@pytest.mark.parametrize("stream", [True, False])
async def test_a_spend_wait_cut_by_the_client_leaving_leaves_the_spend_to_a_line_of_its_own(
    make_client: MakeClient,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    stream: bool,
) -> None:
    # A pump that saw its client go (a failed write) waits briefly for the stream's spend;
    # aiohttp then cancels the handler in that wait. The dollars must still reach a line.
    from nexus.cache.readers import RunReader

    async def cancelled_wait(self: RunReader, wait_s: float) -> None:
        raise asyncio.CancelledError

    monkeypatch.setattr(RunReader, "settled_spend", cancelled_wait)
    caplog.set_level(logging.INFO, logger="nexus")
    client = await make_client(PRICED)
    body = chat("a b c d e f", stream=stream, model="mock/echo")
    body["mock"] = {"content": "a b c d e f", "delay_ms": 100}
    request = asyncio.create_task(
        client.post(CHAT, json=body, headers={"X-Client-Request-Id": "rid-c"})
    )
    if stream:
        resp = await request
        await resp.content.readuntil(b"\n\n")
        await resp.content.readuntil(b"\n\n")
        resp.close()
    else:
        await asyncio.sleep(0.25)
        request.cancel()
    (line,) = await until_spend_lines(caplog, 1)
    assert line["client_request_id"] == "rid-c"
    assert line["outcome"].startswith("cancelled") and line["cost_usd"] > 0
    for _ in range(100):
        if access_records(caplog):
            break
        await asyncio.sleep(0.02)
    (access,) = access_records(caplog)
    assert "cost_usd" not in access.access  # type: ignore[attr-defined]


async def test_a_json_request_left_while_another_reads_its_stream_has_its_spend_line(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    # The JSON origin's client leaves while a joiner still reads the stream: the stream
    # runs on, so the origin's access line cannot carry its spend; its spend line does.
    from support import GatedProvider

    caplog.set_level(logging.INFO, logger="nexus")
    gated = GatedProvider(before=1, after=2)
    client = await make_client({"cache": {"enabled": True}}, providers=[gated])
    body = chat(model="gated/m")
    origin = asyncio.create_task(
        client.post(CHAT, json=body, headers={"X-Client-Request-Id": "rid-a"})
    )
    await asyncio.wait_for(gated.started.wait(), 5)
    await asyncio.sleep(0.05)
    joiner = asyncio.create_task(client.post(CHAT, json={**body, "stream": True}))
    await asyncio.sleep(0.1)
    origin.cancel()
    await asyncio.sleep(0.05)
    gated.gate.set()
    resp = await asyncio.wait_for(joiner, 5)
    assert resp.headers["X-Nexus-Cache"] == "hit"
    await resp.read()
    (line,) = await until_spend_lines(caplog, 1)
    assert line["client_request_id"] == "rid-a"
    assert (line["outcome"], line["completion_tokens"]) == ("ok", 2)  # the upstream's count


async def test_the_json_log_cannot_be_split_by_unicode_line_boundaries() -> None:
    record = logging.LogRecord("nexus.access", logging.INFO, "", 0, "x", None, None)
    record.access = {"model": "a\u2028b\u2029c\x85d"}  # type: ignore[attr-defined]
    line = JsonFormatter().format(record)
    assert len(line.splitlines()) == 1
    assert json.loads(line)["model"] == "a\u2028b\u2029c\x85d"


@pytest.mark.usefixtures("metrics_token")
async def test_entries_a_key_pushed_out_of_the_store_are_counted(make_client: MakeClient) -> None:
    from nexus.auth import hash_key as hashed

    keys = [{"name": "alpha", "sha256": hashed("nx-evict-key-000042")}]
    client = await make_client(
        {
            "auth": {"keys": keys},
            "store": {"max_bytes_per_key": 60_000},
            "metrics": {"token_env": METRICS_TOKEN_ENV},
        }
    )
    bearer = {"Authorization": "Bearer nx-evict-key-000042"}
    for n in range(6):
        body = chat(f"answer number {n} " * 100, stream=True, stream_options={"resumable": True})
        resp = await client.post(CHAT, json=body, headers=bearer)
        assert resp.status == 200
        await resp.read()
    samples = await scrape(client)
    assert value(samples, "nexus_store_evictions_total", reason="key_limit") >= 1


async def test_a_refused_realtime_start_is_logged(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    # The socket's access line is one for all its turns: a refused start has its own line.
    import orjson
    import websockets

    caplog.set_level(logging.INFO, logger="nexus")
    keys = [{"name": "alpha", "sha256": hash_key("nx-ws-refused-00042"), "budget_usd": 0}]
    client = await make_client({"auth": {"keys": keys}, **PRICED})
    url = str(client.make_url("/v1/realtime")).replace("http", "ws", 1)
    headers = {"Authorization": "Bearer nx-ws-refused-00042"}
    async with websockets.connect(url, additional_headers=headers) as ws:
        request = {"model": "mock/echo\n forged", "messages": [{"role": "user", "content": "x"}]}
        await ws.send(orjson.dumps({"type": "start", "request": request}).decode())
        assert orjson.loads(await ws.recv())["error"]["code"] == "model_not_priced"
        request["model"] = "mock/echo"
        await ws.send(orjson.dumps({"type": "start", "request": request}).decode())
        assert orjson.loads(await ws.recv())["error"]["code"] == "budget_exceeded"
    lines = [r.getMessage() for r in caplog.records if "start refused" in r.getMessage()]
    assert len(lines) == 2
    assert "budget_exceeded (key=alpha model=mock/echo)" in lines[1]
    assert "\n" not in lines[0] and '"mock/echo\\n forged"' in lines[0]
