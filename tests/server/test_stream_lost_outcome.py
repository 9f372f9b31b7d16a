"""A stream whose reading fails after its headers (the replica running it died:
``stream_lost``) ends in-band with its error, and its access line says so: it was
logged ``outcome=ok`` at INFO, as if it had ended well."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from nexus.cache.readers import RunReader
from nexus.errors import StreamLost
from support import MakeClient


async def test_a_stream_lost_after_its_headers_is_not_logged_ok(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    read = RunReader.__anext__
    reads = 0

    async def lost_after_the_first(self: RunReader) -> Any:
        nonlocal reads
        reads += 1
        if reads > 1:
            raise StreamLost("The replica running this stream stopped.")
        return await read(self)

    monkeypatch.setattr(RunReader, "__anext__", lost_after_the_first)
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client()
    body = {
        "model": "mock/echo",
        "stream": True,
        "messages": [{"role": "user", "content": "one two three four"}],
        "mock": {"delay_ms": 20},
    }
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    text = await resp.text()
    assert '"code":"stream_lost"' in text
    async with asyncio.timeout(5):  # written as the handler returns, after the body
        while not (lines := [r for r in caplog.records if r.name == "nexus.access"]):
            await asyncio.sleep(0.01)
    [line] = lines
    assert "outcome=mid_stream_error:stream_lost" in line.getMessage()
    assert line.levelno == logging.WARNING


async def test_a_stream_lost_after_early_headers_and_before_any_output_is_not_logged_ok(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Nothing to send within the first wait: the headers went out early (with a
    heartbeat); then the read failed before any output. The client got the error frame,
    but the line said ``outcome=ok``."""
    reads = 0

    async def slow_then_lost(self: RunReader) -> Any:
        nonlocal reads
        reads += 1
        if reads == 1:
            await asyncio.sleep(0.5)  # past the first wait: the headers go out early
        raise StreamLost("The replica running this stream stopped.")

    monkeypatch.setattr(RunReader, "__anext__", slow_then_lost)
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client({"server": {"heartbeat_interval_s": 0.1}})
    body = {"model": "mock/echo", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    resp = await client.post("/v1/chat/completions", json=body)
    assert resp.status == 200
    text = await resp.text()
    assert '"code":"stream_lost"' in text
    [line] = await access_lines(caplog)
    assert "outcome=mid_stream_error:stream_lost" in line.getMessage()
    assert line.levelno == logging.WARNING


async def test_a_log_that_ends_without_its_end_before_any_output_is_not_logged_ok(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def ends(self: RunReader) -> Any:
        raise StopAsyncIteration

    monkeypatch.setattr(RunReader, "__anext__", ends)
    caplog.set_level(logging.INFO, logger="nexus.access")
    client = await make_client()
    body = {"model": "mock/echo", "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    resp = await client.post("/v1/chat/completions", json=body)
    text = await resp.text()
    assert '"code":"stream_incomplete"' in text
    [line] = await access_lines(caplog)
    assert "outcome=mid_stream_error:stream_incomplete" in line.getMessage()


async def access_lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """The access lines, once written (as the handler returns, after the body)."""
    async with asyncio.timeout(5):
        while not (lines := [r for r in caplog.records if r.name == "nexus.access"]):
            await asyncio.sleep(0.01)
    return lines
