"""Hostile requests: against a real ``nexus serve`` where a client can
show them, in-process where only the gateway's own steps can.

* JSON nested too deep inside a *string* (a tool call's ``arguments``) slipped past
  ``[limits] max_json_depth``: the Anthropic provider parses it into the upstream
  body and the Messages endpoint into its answer, and orjson's encoder stops at 254
  levels, so both gave a 500 (and a WebSocket turn lost its socket).
* A client that sends requests but never reads the answers kept its connection
  for ever: an answer that does not fit the socket's buffers waits for the client,
  and no timer covered a response the stream pump does not write, so a few
  pipelined requests per connection, unauthenticated, held every connection slot.
  And a connection aiohttp had let go of (closing, its buffer unsent) was counted
  gone at its deadline but never closed.
* With a shared store, another key's stream running on this replica was told
  from a missing one by the time of the 404 (no store round trip).
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Iterator
from unittest import mock

import orjson
import pytest
from aiohttp import web

from nexus.auth import hash_key
from nexus.cache.store import StreamInfo
from nexus.server import state
from nexus.server.connection import HANDLER_ARGS, Connection, ConnectionRegistry
from nexus_process import start_nexus, stop_nexus
from redis_support import REDIS_URL, connect_or_skip, drop_keys, new_prefix
from support import GatedProvider, MakeClient, chat

KEY_A = "nx-hostile-a-0123456789abcdef"
KEY_B = "nx-hostile-b-fedcba9876543210"
DEEP = "[" * 300 + "]" * 300
"""Valid JSON (orjson parses up to 1024 levels) that orjson cannot write back (254)."""


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A keyless gateway: the mock, and an Anthropic provider nobody listens for (the
    upstream body is built before any connection is tried)."""
    tmp = tmp_path_factory.mktemp("hostile")
    config = tmp / "config.toml"
    config.write_text(
        # asyncio's own loop (uvloop is optional): its native sendfile writes past the
        # protocol's pause_writing, so a file answer would not be seen stalling.
        "[server]\nheader_timeout_s = 2\nkeepalive_timeout_s = 2\nwrite_timeout_s = 1\n"
        "uvloop = false\n"
        '[providers.mock]\nkind = "mock"\n'
        '[providers.anth]\nkind = "anthropic"\nbase_url = "http://127.0.0.1:9"\n'
    )
    proc, match = start_nexus(config, tmp / "nexus.log")
    try:
        yield match.group(1)
    finally:
        stop_nexus(proc, gently=False)


def _post(url: str, path: str, body: dict[str, object]) -> tuple[int, dict[str, object]]:
    host, port = url.removeprefix("http://").split(":")
    data = orjson.dumps(body)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode()
            + data
        )
        raw = b""
        while chunk := sock.recv(65536):
            raw += chunk
    head, _, rest = raw.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), orjson.loads(rest)


def test_deep_json_in_a_tool_calls_arguments_is_a_400_not_a_500(gateway: str) -> None:
    body = {
        "model": "anth/claude-x",
        "messages": [
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "f", "arguments": DEEP}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "ok"},
        ],
    }
    for stream in (False, True):
        status, answer = _post(gateway, "/v1/chat/completions", body | {"stream": stream})
        assert status == 400, answer
        error = answer["error"]
        assert isinstance(error, dict)
        assert error["code"] == "invalid_request"
        assert "nested deeper" in str(error["message"])


def test_deep_tool_call_arguments_in_a_messages_answer_are_not_a_500(gateway: str) -> None:
    """The model's arguments (here the mock's, as a model could be led to write them)."""
    status, answer = _post(
        gateway,
        "/v1/messages",
        {
            "model": "mock/echo",
            "max_tokens": 100,
            "messages": [{"role": "user", "content": "hi"}],
            "mock": {"tool_calls": [{"name": "f", "arguments": DEEP}]},
        },
    )
    assert status == 200, answer
    content = answer["content"]
    assert isinstance(content, list)
    assert content[-1]["type"] == "tool_use"
    assert content[-1]["input"] == {"_raw": DEEP}  # as for arguments that are not JSON


@pytest.mark.parametrize(("path", "count"), [("/v1/models", 20_000), ("/web/app.js", 300)])
def test_a_client_that_pipelines_requests_and_reads_nothing_is_dropped(
    gateway: str, path: str, count: int
) -> None:
    """Answers (any would do: no key needed for either) pile up past the socket's
    buffers: the connection is closed three times ``write_timeout_s`` (here 3 s) after its
    last byte left. The console's files too, which were sent with sendfile."""
    host, port = gateway.removeprefix("http://").split(":")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 1)  # a window as small as can be
    sock.connect((host, int(port)))
    sock.settimeout(5)
    with sock, contextlib.suppress(TimeoutError):
        sock.sendall(f"GET {path} HTTP/1.1\r\nHost: {host}\r\n\r\n".encode() * count)
        # Reads nothing: until the gateway stops answering (it may still be at it after
        # seconds on a busy host), then for the stall it drops a connection after (3 s).
        _wait_until_answered(gateway)
        time.sleep(4.5)
        received, answers = b"", 0
        with contextlib.suppress(ConnectionError):
            while chunk := sock.recv(1 << 20):
                received += chunk
                answers = received.count(b"HTTP/1.1 200 OK")
        # Only what the kernel buffers held when the gateway gave up, not every answer
        # (as a connection kept open for ever would send once read).
        assert answers < count / 2


def _wait_until_answered(gateway: str, steady_s: float = 1.0) -> None:
    """Until the gateway's count of requests answered (``/metrics``, its own scrapes
    left out) holds still for ``steady_s``."""
    host, port = gateway.removeprefix("http://").split(":")
    last, steady_since = -1.0, time.monotonic()
    while time.monotonic() - steady_since < steady_s:
        time.sleep(0.25)
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(
                f"GET /metrics HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode()
            )
            text = b"".join(iter(lambda: sock.recv(1 << 16), b"")).decode()
        answered = sum(
            float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("nexus_requests_total{") and 'endpoint="/metrics"' not in line
        )
        if answered != last:
            last, steady_since = answered, time.monotonic()


async def test_an_expired_connection_aiohttp_let_go_of_is_aborted() -> None:
    """aiohttp's ``force_close`` (a ``Connection: close`` answer, a refusal with its body
    unread) closes the transport and forgets it; a close waits to write its buffer, to a
    client that may read nothing. The registry counted such a connection gone at its
    deadline while its socket stayed open, uncounted: the deadline must abort it."""
    registry = ConnectionRegistry(
        header_timeout_s=1, keepalive_timeout_s=1, max_connections=5, write_timeout_s=1
    )
    conn = Connection(
        web.Server(_never_called), registry, loop=asyncio.get_running_loop(), **HANDLER_ARGS
    )
    transport = mock.Mock(spec=asyncio.Transport)
    transport.get_write_buffer_size.return_value = 70_000
    transport.get_extra_info.return_value = None
    conn.connection_made(transport)
    conn.force_close()
    assert not transport.abort.called
    registry.check(asyncio.get_running_loop().time() + 2)
    assert registry.open == 0
    assert transport.abort.called


async def _never_called(request: web.BaseRequest) -> web.StreamResponse:
    raise AssertionError("no request here")


async def test_another_keys_live_stream_takes_the_lookup_a_missing_one_takes(
    make_client: MakeClient,
) -> None:
    """With a shared store, a stream running on this replica was found without asking the
    store, a missing one only after a round trip to it: the time told another key that
    an id it holds is a live stream here. Both now ask the store once."""
    client = await connect_or_skip()
    prefix = new_prefix()
    try:
        provider = GatedProvider()
        gateway = await make_client(
            {
                "auth": {
                    "keys": [
                        {"name": "alpha", "sha256": hash_key(KEY_A)},
                        {"name": "beta", "sha256": hash_key(KEY_B)},
                    ]
                },
                "store": {"kind": "redis", "url": REDIS_URL, "prefix": prefix},
            },
            providers=[provider],
        )
        store = gateway.server.app[state.HUB].store
        lookups: list[str] = []
        info = store.info

        async def counted(stream_id: str) -> StreamInfo | None:
            lookups.append(stream_id)
            return await info(stream_id)

        store.info = counted  # type: ignore[method-assign]
        owned = await gateway.post(
            "/v1/chat/completions",
            json=chat(model="gated/m", stream=True),
            headers={"Authorization": f"Bearer {KEY_A}"},
        )
        await asyncio.wait_for(owned.content.readline(), 5)
        live = owned.headers["X-Nexus-Stream-Id"]
        missing = "chatcmpl-" + "0" * 32
        answers = []
        for stream_id in (live, missing):
            lookups.clear()
            resp = await gateway.get(
                f"/v1/streams/{stream_id}", headers={"Authorization": f"Bearer {KEY_B}"}
            )
            answers.append((resp.status, lookups[:]))
        assert answers == [(404, [live]), (404, [missing])]
        provider.gate.set()
        await owned.read()
    finally:
        await drop_keys(client, prefix)
        await client.aclose()


async def test_a_body_of_too_many_values_is_413_on_every_endpoint(make_client: MakeClient) -> None:
    client = await make_client({"limits": {"max_json_items": 50}})
    user = {"role": "user", "content": "hi"}
    bodies = {
        "/v1/chat/completions": {"model": "mock/echo", "messages": [user] * 30},
        "/v1/messages": {"model": "mock/echo", "max_tokens": 5, "messages": [user] * 30},
        "/v1/responses": {"model": "mock/echo", "input": [user] * 30},
    }
    for path, body in bodies.items():
        resp = await client.post(path, json=body)
        assert resp.status == 413, (path, await resp.text())
        error = (await resp.json())["error"]
        assert "max_json_items" in error["message"]
        small = {**body, "messages" if "messages" in body else "input": [user]}
        resp = await client.post(path, json=small)
        assert resp.status == 200, (path, await resp.text())
        await resp.read()
