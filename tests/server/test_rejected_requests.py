"""Requests aiohttp answers without the app (its HTTP parser's 400s, a 417 for an unknown
``Expect``) have an access line and a count, as every other request.

They never reached a middleware, so they had neither: a flood of malformed requests was
invisible in ``nexus.access`` and ``nexus_requests_total``. Raw sockets against a real
gateway, on ``nexus serve``'s connection layer and on aiohttp's own server."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import orjson
import pytest
from aiohttp import web
from prometheus_client.parser import text_string_to_metric_families

from nexus.auth import hash_key
from nexus.config import parse_config
from nexus.encoders.registry import default_registry
from nexus.server.app import create_app
from nexus.server.connection import ConnectionRegistry, ConnectionSite
from support import METRICS_TOKEN, METRICS_TOKEN_ENV, MakeClient

KEY = "nx-rejected-requests-0123456789"
K = KEY.encode()
GET = b"GET /v1/models HTTP/1.1\r\nHost: localhost\r\n"
POST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer " + K

REJECTED = {
    "invalid_request_line": b"GET /v1/models HTTP/1.1 junk\r\nHost: localhost\r\n\r\n",
    "line_too_long": GET + b"X-Api-Key: " + K + b"A" * 9000 + b"\r\n\r\n",
    "invalid_content_length": POST + b"\r\nContent-Length: 12abc\r\n\r\n{}",
    "invalid_chunked_body": POST + b"\r\nTransfer-Encoding: chunked\r\n\r\nzz" + K + b"\r\n",
    "invalid_header": GET + b"Authorization: Bearer " + K + b"\x7f\r\n\r\n",
}
"""What a client sends, by the kind its access line names (each carries the key)."""


@dataclass
class Gateway:
    host: str
    port: int


async def roundtrip(gateway: Gateway, raw: bytes) -> bytes:
    """Send ``raw`` on a connection of its own; what comes back until the server closes."""
    reader, writer = await asyncio.open_connection(gateway.host, gateway.port)
    try:
        writer.write(raw)
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


def head_and_body(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ")[1]), headers, body


async def access_records(
    caplog: pytest.LogCaptureFixture, count: int, timeout: float = 5.0
) -> list[logging.LogRecord]:
    """The access lines, once there are ``count`` (they come after the response)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        records = [r for r in caplog.records if r.name == "nexus.access"]
        if len(records) >= count or asyncio.get_running_loop().time() > deadline:
            return records
        await asyncio.sleep(0.01)


async def requests_counted(gateway: Gateway) -> dict[tuple[str, str, str], float]:
    """``nexus_requests_total`` by (endpoint, model, outcome), scraped over a raw socket."""
    answer = await roundtrip(
        gateway,
        b"GET /metrics HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n"
        + f"Authorization: Bearer {METRICS_TOKEN}\r\n\r\n".encode(),
    )
    status, _, body = head_and_body(answer)
    assert status == 200
    counted = {}
    for family in text_string_to_metric_families(body.decode()):
        for sample in family.samples:
            if sample.name == "nexus_requests_total":
                labels = sample.labels
                counted[labels["endpoint"], labels["model"], labels["outcome"]] = sample.value
    return counted


@pytest.fixture(autouse=True)
def _scraper(metrics_token: None) -> None:
    """Every gateway here has keys: its ``/metrics`` answers the scraper's token only."""


def config() -> dict[str, Any]:
    return {
        "auth": {"keys": [{"name": "app", "sha256": hash_key(KEY)}]},
        "metrics": {"token_env": METRICS_TOKEN_ENV},
        "providers": {"mock": {"kind": "mock"}},
    }


@contextlib.asynccontextmanager
async def serving(max_connections: int = 100) -> AsyncIterator[Gateway]:
    """The app on ``nexus serve``'s connection layer (its :class:`ConnectionSite`)."""
    app = create_app(parse_config(config()), registry=default_registry.copy())
    runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.5)
    await runner.setup()
    registry = ConnectionRegistry(
        header_timeout_s=5,
        keepalive_timeout_s=5,
        max_connections=max_connections,
        write_timeout_s=5,
    )
    site = ConnectionSite(runner, "127.0.0.1", 0, registry=registry)
    await site.start()
    try:
        host, port = site.addresses[0][:2]
        yield Gateway(host, port)
    finally:
        await runner.cleanup()


@pytest.fixture
async def served() -> AsyncIterator[Gateway]:
    async with serving() as gateway:
        yield gateway


@pytest.mark.parametrize("kind", sorted(REJECTED))
async def test_a_request_the_parser_rejects_has_an_access_line_and_a_count(
    served: Gateway, caplog: pytest.LogCaptureFixture, kind: str
) -> None:
    caplog.set_level(logging.INFO, logger="nexus.access")
    status, headers, body = head_and_body(await roundtrip(served, REJECTED[kind]))
    assert status == 400
    error = orjson.loads(body)["error"]
    assert error["code"] == "invalid_request"
    assert error["request_id"] == headers["X-Request-Id"]  # as every error body has it
    assert headers["request-id"] == headers["X-Request-Id"]  # as every response has it
    assert headers["X-Content-Type-Options"] == "nosniff"  # (so does this)
    [record] = await access_records(caplog, 1)
    fields = record.access  # type: ignore[attr-defined]
    assert record.levelno == logging.WARNING
    assert fields["endpoint"] == "rejected"
    assert fields["status"] == 400
    assert fields["outcome"] == f"rejected:{kind}"
    assert fields["key"] is None  # none was authenticated
    assert fields["client"] == "127.0.0.1"
    assert fields["method"] is None and fields["path"] is None
    assert fields["reason"]  # what the parser said, as the client was told
    assert record.request_id == headers["X-Request-Id"]  # type: ignore[attr-defined]
    line = record.getMessage()
    assert f"outcome=rejected:{kind}" in line
    assert KEY not in line and KEY[3:20] not in line
    assert all(KEY[3:20] not in str(value) for value in fields.values())
    counted = await requests_counted(served)
    assert counted[("rejected", "unknown", f"rejected:{kind}")] == 1


async def test_a_request_that_reaches_the_app_has_one_line_only(
    served: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    """The access logger that sees the rejections sees every response: the middleware's
    line is not written twice, nor counted twice."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    raw = GET + b"Authorization: Bearer " + K + b"\r\nConnection: close\r\n\r\n"
    status, _, _ = head_and_body(await roundtrip(served, raw))
    assert status == 200
    await asyncio.sleep(0.2)
    records = await access_records(caplog, 1)
    assert [r.access["outcome"] for r in records] == ["ok"]  # type: ignore[attr-defined]
    assert records[0].access["key"] == "app"  # type: ignore[attr-defined]
    counted = await requests_counted(served)
    assert counted[("/v1/models", "unknown", "ok")] == 1
    assert not [labels for labels in counted if labels[0] == "rejected"]


@pytest.mark.parametrize("path", ["/v1/models", "/nowhere"])
async def test_an_expect_aiohttp_does_not_know_is_counted_too(
    served: Gateway, caplog: pytest.LogCaptureFixture, path: str
) -> None:
    """aiohttp answers an unknown ``Expect`` with 417 before any middleware runs (on a
    route, or on a path that has none): its answer had no request id, its line one of
    its own. It carries the id of its line now."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    raw = f"GET {path} HTTP/1.1\r\nHost: localhost\r\nExpect: something\r\n".encode()
    status, headers, _ = head_and_body(await roundtrip(served, raw + b"Connection: close\r\n\r\n"))
    assert status == 417
    [record] = await access_records(caplog, 1)
    assert record.access["outcome"] == "rejected:expectation_failed"  # type: ignore[attr-defined]
    assert headers["X-Request-Id"].startswith("req_")
    assert headers["request-id"] == headers["X-Request-Id"] == record.request_id  # type: ignore[attr-defined]
    assert headers["X-Content-Type-Options"] == "nosniff"  # its body quotes the Expect
    counted = await requests_counted(served)
    assert counted[("rejected", "unknown", "rejected:expectation_failed")] == 1


async def test_connections_past_the_cap_carry_ids_and_are_counted_not_logged_each(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The 503 a connection past ``[server] max_connections`` gets is written as bytes,
    before any request exists: it carries a request id as every answer does, but no access
    line each (a client could write them at connect speed): one warning, with a count,
    every 10 s at most (and ``nexus_connections_refused_total``: test_connection_limits)."""
    caplog.set_level(logging.INFO, logger="nexus")
    async with serving(max_connections=1) as gateway:
        _, held = await asyncio.open_connection(gateway.host, gateway.port)
        await asyncio.sleep(0.1)  # accepted: the one connection the cap allows
        ids = set()
        for _ in range(20):
            answer = await roundtrip(gateway, GET + b"\r\n")
            if not answer:
                continue  # closed at once: as many refused ones were still being answered
            status, headers, body = head_and_body(answer)
            assert status == 503
            error = orjson.loads(body)["error"]
            assert error["code"] == "too_many_connections"
            assert headers["X-Request-Id"].startswith("req_")
            assert error["request_id"] == headers["request-id"] == headers["X-Request-Id"]
            assert headers["X-Content-Type-Options"] == "nosniff"
            ids.add(headers["X-Request-Id"])
        assert len(ids) >= 2  # (a new id each)
        assert [r for r in caplog.records if r.name == "nexus.access"] == []
        warned = [r.getMessage() for r in caplog.records if "max_connections" in r.getMessage()]
        assert len(warned) == 1, warned
        held.close()


async def test_on_aiohttps_own_server_a_rejection_is_counted_as_malformed(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """``create_app`` run by aiohttp's runner (``web.run_app``, the test server): its
    request handler keeps the parser's error to itself, so the kind is ``malformed``."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client(config())
    gateway = Gateway(client.server.host, client.server.port)
    status, _, _ = head_and_body(await roundtrip(gateway, REJECTED["invalid_header"]))
    assert status == 400
    [record] = await access_records(caplog, 1)
    fields = record.access  # type: ignore[attr-defined]
    assert fields["outcome"] == "rejected:malformed"
    assert fields["key"] is None and fields["client"] == "127.0.0.1"
    assert KEY[3:20] not in record.getMessage()
    counted = await requests_counted(gateway)
    assert counted[("rejected", "unknown", "rejected:malformed")] == 1


@pytest.mark.parametrize("origin", [None, "https://evil.example"])
async def test_a_client_that_leaves_with_its_body_half_sent_is_a_quiet_499(
    caplog: pytest.LogCaptureFixture, origin: str | None
) -> None:
    """On aiohttp's own runner (``web.run_app``: handlers are not cancelled when their
    client leaves) the route answers a body that ends early; writing that answer met the
    closed socket, and the error went up to aiohttp, which logged it at ERROR with a
    traceback: any client could fill an integrator's error log by hanging up mid-body. So
    could one from a page the gateway refuses (``origin_not_allowed``), without a key."""
    caplog.set_level(logging.INFO)
    runner = web.AppRunner(create_app(parse_config(config()), registry=default_registry.copy()))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    host, port = runner.addresses[0][:2]
    head = POST if origin is None else POST + f"\r\nOrigin: {origin}".encode()
    try:
        await _leave_mid_body(Gateway(host, port), caplog, head)
    finally:
        await runner.cleanup()


async def _leave_mid_body(gateway: Gateway, caplog: pytest.LogCaptureFixture, head: bytes) -> None:
    _, writer = await asyncio.open_connection(gateway.host, gateway.port)
    writer.write(head + b'\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{"m')
    await writer.drain()
    if b"Origin" in head:
        writer.transport.abort()  # gone (a reset) before the refusal, answered at once, is out
    else:
        await asyncio.sleep(0.2)  # the route reads the body until the client leaves
        writer.close()
    (record,) = await access_records(caplog, 1)
    await asyncio.sleep(0.2)  # (an error aiohttp logs comes after the access line)
    fields = record.access  # type: ignore[attr-defined]
    assert (fields["outcome"], fields["status"]) == ("cancelled:client_disconnect", 499)
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR] == []


async def _none(request: web.Request) -> web.StreamResponse:
    return None  # type: ignore[return-value]  # (a bug past every middleware)


@pytest.mark.parametrize("server", ["nexus", "aiohttp"])
async def test_what_aiohttp_answers_itself_is_never_sniffed_either(
    caplog: pytest.LogCaptureFixture, server: str
) -> None:
    """Every response carries ``X-Content-Type-Options: nosniff``, but the middleware sets
    it: aiohttp's plain-text 417 (which quotes the client's ``Expect``) and the 500 it makes
    of an error past the middlewares had none. Both get it from the app's
    ``on_response_prepare``, on ``nexus serve``'s connection layer and on aiohttp's own."""
    app = create_app(parse_config(config()), registry=default_registry.copy())
    app.router.add_get("/broken", _none)
    runner = web.AppRunner(app, shutdown_timeout=0.5)
    await runner.setup()
    registry = ConnectionRegistry(
        header_timeout_s=5, keepalive_timeout_s=5, max_connections=10, write_timeout_s=5
    )
    site: web.BaseSite = (
        ConnectionSite(runner, "127.0.0.1", 0, registry=registry)
        if server == "nexus"
        else web.TCPSite(runner, "127.0.0.1", 0)
    )
    await site.start()
    try:
        host, port = (site.addresses if server == "nexus" else runner.addresses)[0][:2]  # type: ignore[attr-defined]
        gateway = Gateway(host, port)
        expect = GET + b"Expect: <html><script>x()</script>\r\nConnection: close\r\n\r\n"
        status, headers, body = head_and_body(await roundtrip(gateway, expect))
        assert (status, headers["Content-Type"]) == (417, "text/plain; charset=utf-8")
        assert b"<script>" in body  # quoted: text/plain it must stay
        assert headers["X-Content-Type-Options"] == "nosniff"
        with caplog.at_level(logging.CRITICAL, logger="aiohttp"):  # (its traceback)
            broken = b"GET /broken HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
            status, headers, _ = head_and_body(await roundtrip(gateway, broken))
        assert status == 500
        assert headers["X-Request-Id"].startswith("req_")
        assert headers["X-Content-Type-Options"] == "nosniff"
    finally:
        await runner.cleanup()
