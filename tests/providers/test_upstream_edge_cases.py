"""Upstream edge cases of the HTTP providers: each test is named for what it keeps from
breaking."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import orjson
import pytest

from support import MakeClient
from upstreams import DONE, FakeUpstream, Reply, openai_chunk

KEY_ENV = "NEXUS_TEST_REGRESSION_KEY"
KEY = "sk-regression-secret-key"


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


FRAMES = [openai_chunk(content="ok"), openai_chunk(finish_reason="stop"), DONE]


async def test_redirects_are_not_followed_so_keys_stay_home(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """A redirect used to carry the key headers and the body to another host."""
    async with FakeUpstream() as elsewhere:
        elsewhere.add(Reply.stream(FRAMES))
        upstream.add(Reply(status=307, headers={"Location": elsewhere.url + "/v1/steal"}))
        client = await make_client(
            {
                "providers": {
                    "claude": {
                        "kind": "anthropic",
                        "base_url": upstream.url,
                        "api_key_env": KEY_ENV,
                    }
                }
            }
        )
        body = {"model": "claude/x", "messages": [{"role": "user", "content": "Hi"}]}
        resp = await client.post("/v1/chat/completions", json=body)
        assert resp.status == 502
        error = (await resp.json())["error"]
        assert error["code"] == "upstream_error"
        assert "redirect" in error["message"]
        assert elsewhere.requests == []


async def test_an_error_body_in_several_writes_arrives_whole(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """Only the first TCP chunk of an upstream error body used to be read."""
    upstream.add(
        Reply(
            status=400,
            chunks=[b'{"error": {"message": ', b'"temperature is too high"}}'],
            delay=0.02,
            headers={"Content-Type": "application/json"},
        )
    )
    client = await make_client(openai(upstream))
    resp = await client.post("/v1/chat/completions", json=chat())
    assert resp.status == 400
    assert "temperature is too high" in (await resp.json())["error"]["message"]


async def test_clean_streams_keep_the_connection_alive(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """Every stream used to close its pooled connection, even after [DONE]."""
    for _ in range(3):
        upstream.add(Reply.stream(FRAMES, eof_delay=0.01))  # the body ends just after [DONE]
    client = await make_client(openai(upstream))
    for _ in range(3):
        resp = await client.post("/v1/chat/completions?stream_format=ndjson", json=chat())
        lines = [orjson.loads(line) for line in (await resp.read()).splitlines()]
        assert lines[0] == {"type": "delta", "delta": {"content": "ok"}}
    peers = {seen.peer for seen in upstream.requests}
    assert len(upstream.requests) == 3
    assert len(peers) == 1


async def test_first_byte_timeout_is_one_deadline(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """Headers and first body bytes used to get a full first_byte_timeout_s each."""
    upstream.add(Reply.stream(FRAMES, headers_delay=0.5, delay=[0.5, 0.0, 0.0]))
    client = await make_client(openai(upstream, first_byte_timeout_s=0.8))
    resp = await client.post("/v1/chat/completions", json=chat())
    assert resp.status == 504
    assert (await resp.json())["error"]["code"] == "upstream_timeout"


async def test_anthropic_only_fields_are_not_sent_to_openai_upstreams(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """/v1/messages with top_k / thinking used to forward them to OpenAI, which refuses them."""
    upstream.add(Reply.stream(FRAMES))
    client = await make_client(openai(upstream))
    body = {
        "model": "up/m",
        "max_tokens": 20,
        "top_k": 5,
        "thinking": {"type": "enabled", "budget_tokens": 1024},
        "messages": [{"role": "user", "content": "Hi"}],
    }
    resp = await client.post("/v1/messages", json=body)
    assert resp.status == 200
    sent = upstream.requests[0].body
    assert "top_k" not in sent
    assert "thinking" not in sent
    assert sent["max_tokens"] == 20


async def test_upstream_429_is_typed_as_a_rate_limit(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(
        Reply.json(
            429,
            {"error": {"message": "slow down"}},
            headers={"Retry-After": "3", "retry-after-ms": "2500"},
        )
    )
    client = await make_client(openai(upstream))
    resp = await client.post("/v1/chat/completions", json=chat())
    assert resp.status == 429
    assert (resp.headers["Retry-After"], resp.headers["retry-after-ms"]) == ("3", "2500")
    assert (await resp.json())["error"]["type"] == "rate_limit_error"


async def test_cache_control_is_not_sent_to_openai_upstreams(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(Reply.stream(FRAMES))
    client = await make_client(openai(upstream))
    ephemeral = {"type": "ephemeral"}
    body = {
        "model": "up/m",
        "max_tokens": 20,
        "system": [{"type": "text", "text": "Manual.", "cache_control": ephemeral}],
        "tools": [{"name": "f", "input_schema": {"type": "object"}, "cache_control": ephemeral}],
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "Q", "cache_control": ephemeral}]}
        ],
    }
    assert (await client.post("/v1/messages", json=body)).status == 200
    raw = upstream.requests[0].raw
    assert b"cache_control" not in raw
    sent = upstream.requests[0].body
    assert sent["messages"][0] == {
        "role": "system",
        "content": [{"type": "text", "text": "Manual."}],
    }


async def test_signed_thinking_is_not_sent_to_openai_upstreams(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.add(Reply.stream(FRAMES))
    client = await make_client(openai(upstream))
    thinking = {"type": "thinking", "thinking": "hm", "signature": "sig"}
    body = {
        "model": "up/m",
        "max_tokens": 20,
        "messages": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": [thinking, {"type": "text", "text": "A"}]},
            {"role": "user", "content": "Q2"},
        ],
    }
    assert (await client.post("/v1/messages", json=body)).status == 200
    assert upstream.requests[0].body["messages"][1] == {"role": "assistant", "content": "A"}


@pytest.mark.parametrize(
    ("field", "request_key", "expected"),
    [
        (None, "max_tokens", {"max_tokens": 7}),
        (None, "max_completion_tokens", {"max_completion_tokens": 7}),
        ("max_completion_tokens", "max_tokens", {"max_completion_tokens": 7}),
        ("max_tokens", "max_completion_tokens", {"max_tokens": 7}),
    ],
)
async def test_token_limit_field(
    make_client: MakeClient,
    upstream: FakeUpstream,
    field: str | None,
    request_key: str,
    expected: dict[str, int],
) -> None:
    """OpenAI's reasoning models refuse max_tokens: token_limit_field renames the limit."""
    upstream.add(Reply.stream(FRAMES))
    options = {} if field is None else {"token_limit_field": field}
    client = await make_client(openai(upstream, **options))
    assert (
        await client.post("/v1/chat/completions", json={**chat(), request_key: 7})
    ).status == 200
    sent = upstream.requests[0].body
    assert {k: sent[k] for k in ("max_tokens", "max_completion_tokens") if k in sent} == expected
