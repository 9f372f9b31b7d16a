"""Upstreams that send what no honest one does, through the running gateway: each test
is named for what it keeps from breaking (tests/upstreams.py is the fake)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from support import MakeClient
from upstreams import DONE, FakeUpstream, Reply, openai_chunk, openai_usage_chunk

KEY_ENV = "NEXUS_TEST_HOSTILE_KEY"
KEY = "sk-hostile-upstream-secret"
USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


@pytest.fixture(autouse=True)
def key(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_ENV, KEY)


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


def openai(fake: FakeUpstream, **options: Any) -> dict[str, Any]:
    provider = {"kind": "openai", "base_url": fake.url + "/v1", "api_key_env": KEY_ENV, **options}
    return {"providers": {"up": provider}}


def chat(stream: bool = True) -> dict[str, Any]:
    return {"model": "up/m", "messages": [{"role": "user", "content": "Hi"}], "stream": stream}


async def ndjson(client: Any, body: dict[str, Any] | None = None) -> list[dict[str, Any]]:
    resp = await client.post("/v1/chat/completions?stream_format=ndjson", json=body or chat())
    assert resp.status == 200, await resp.text()
    return [orjson.loads(line) for line in (await resp.read()).splitlines()]


async def test_an_event_past_max_event_bytes_ends_the_stream(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """A valid 100 MB event used to be held, then sent whole to the client."""
    big = [b"x" * 65536] * 8  # 512 KiB of one content string, in writes of 64 KiB
    upstream.add(
        Reply.stream(
            [
                openai_chunk(content="start"),
                b'data: {"choices":[{"index":0,"delta":{"content":"',
                *big,
                b'"}}]}\n\n',
                openai_usage_chunk(USAGE),
                DONE,
            ]
        )
    )
    client = await make_client(openai(upstream, max_event_bytes=128 * 1024))
    lines = await ndjson(client)
    assert lines[0] == {"type": "delta", "delta": {"content": "start"}}
    assert [line["type"] for line in lines] == ["delta", "error", "done"]
    assert lines[1]["error"]["code"] == "upstream_protocol_error"
    assert "max_event_bytes" in lines[1]["error"]["message"]
