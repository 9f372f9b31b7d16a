"""What the official SDKs read off an error: whether to retry it (``x-should-retry``), and
the request id (``x-request-id`` for openai, ``request-id`` for anthropic).

Both SDKs retry every 408, 409, 429 and 5xx unless the header says otherwise. An upstream
refusing the gateway's own key, or a request whose worst case is over its key's whole
budget, fails the same way every time: one attempt, not three (three upstream calls with
a refused key). A refusal that waiting fixes is still retried.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import anthropic
import httpx2
import openai
import pytest

from nexus.auth import hash_key
from nexus.errors import GatewayError, RequestTimeout
from nexus.server.errors import retry_advice
from support import MakeClient
from upstreams import DONE, FakeUpstream, Reply, openai_chunk, openai_error_body

USER = [{"role": "user", "content": "hi"}]
KEY = "nx-retry-advice-0123456789"


@pytest.fixture
async def upstream() -> AsyncIterator[FakeUpstream]:
    async with FakeUpstream() as fake:
        yield fake


class Attempts:
    """The SDK's HTTP client, counting the requests it sends."""

    def __init__(self) -> None:
        self.count = 0
        self.client = httpx2.AsyncClient(event_hooks={"request": [self._seen]})

    async def _seen(self, request: httpx2.Request) -> None:
        self.count += 1


def upstream_config(upstream: FakeUpstream, **extra: Any) -> dict[str, Any]:
    return {"providers": {"up": {"kind": "openai", "base_url": upstream.url + "/v1"}}, **extra}


async def sdks(make_client: MakeClient, config: dict[str, Any], key: str = "unused") -> Any:
    client = await make_client(config)
    base = str(client.make_url(""))
    attempts = Attempts()
    oa = openai.AsyncOpenAI(base_url=base + "/v1", api_key=key, http_client=attempts.client)
    an = anthropic.AsyncAnthropic(base_url=base, api_key=key, http_client=attempts.client)
    return oa, an, attempts


async def test_an_upstream_refusing_the_gateways_key_is_tried_once(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    upstream.default = Reply.json(401, openai_error_body("bad key", code="invalid_api_key"))
    oa, an, attempts = await sdks(make_client, upstream_config(upstream))
    with pytest.raises(openai.InternalServerError) as chat_error:
        await oa.chat.completions.create(model="up/m", messages=USER)
    assert chat_error.value.code == "upstream_auth_error"
    assert chat_error.value.response.headers["x-should-retry"] == "false"
    assert (attempts.count, len(upstream.requests)) == (1, 1)
    with pytest.raises(anthropic.InternalServerError) as message_error:
        await an.messages.create(model="up/m", max_tokens=5, messages=USER)
    assert (attempts.count, len(upstream.requests)) == (2, 2)
    # The request id each SDK reports is the response's.
    response = message_error.value.response
    assert message_error.value.request_id == response.headers["x-request-id"]
    assert chat_error.value.request_id == chat_error.value.response.headers["x-request-id"]
    await attempts.client.aclose()


async def test_a_request_over_the_whole_budget_is_tried_once(make_client: MakeClient) -> None:
    config = {
        "auth": {"keys": [{"name": "t", "sha256": hash_key(KEY), "budget_usd": 0.01}]},
        "models": {"mock/echo": {"input_usd_per_mtok": 1000, "output_usd_per_mtok": 1000}},
    }
    oa, an, attempts = await sdks(make_client, config, key=KEY)
    with pytest.raises(openai.RateLimitError) as chat_error:
        await oa.chat.completions.create(model="mock/echo", messages=USER, max_tokens=20_000)
    assert chat_error.value.code == "budget_exceeded"
    assert attempts.count == 1
    with pytest.raises(anthropic.RateLimitError):
        await an.messages.create(model="mock/echo", max_tokens=20_000, messages=USER)
    assert attempts.count == 2
    await attempts.client.aclose()


async def test_what_waiting_may_fix_is_still_retried(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    limited = Reply.json(429, openai_error_body("slow down"), headers={"Retry-After": "0"})
    answer = [openai_chunk(role="assistant", content="fine"), openai_chunk(finish_reason="stop")]
    upstream.add(limited, Reply.stream([*answer, DONE]), limited, Reply.stream([*answer, DONE]))
    oa, an, attempts = await sdks(make_client, upstream_config(upstream))
    completion = await oa.with_options(max_retries=1).chat.completions.create(
        model="up/m", messages=USER
    )
    assert completion.choices[0].message.content == "fine"
    assert (attempts.count, len(upstream.requests)) == (2, 2)
    message = await an.with_options(max_retries=1).messages.create(
        model="up/m", max_tokens=5, messages=USER
    )
    assert message.content[0].text == "fine"  # type: ignore[union-attr]
    assert (attempts.count, len(upstream.requests)) == (4, 4)
    assert message._request_id is not None and message._request_id.startswith("req_")
    await attempts.client.aclose()


async def test_an_upstream_wait_too_long_to_pass_on_is_tried_once(
    make_client: MakeClient, upstream: FakeUpstream
) -> None:
    """An upstream's "come back in an hour" was passed on as ``Retry-After: 60`` with
    ``x-should-retry: true``: each SDK came back twice, to the same refusal."""
    hour = Reply.json(429, openai_error_body("quota"), headers={"Retry-After": "3600"})
    upstream.add(hour, hour)
    oa, an, attempts = await sdks(make_client, upstream_config(upstream))
    with pytest.raises(openai.RateLimitError) as chat_error:
        await oa.chat.completions.create(model="up/m", messages=USER)
    headers = chat_error.value.response.headers
    assert (headers["x-should-retry"], headers.get("Retry-After")) == ("false", None)
    assert "wait longer than 60 s" in chat_error.value.message
    with pytest.raises(anthropic.RateLimitError):
        await an.messages.create(model="up/m", max_tokens=5, messages=USER)
    assert (attempts.count, len(upstream.requests)) == (2, 2)
    await attempts.client.aclose()


async def test_every_response_carries_the_id_as_request_id_too(make_client: MakeClient) -> None:
    """Not /v1/messages only: the anthropic SDK reads ``request-id`` off whatever it calls
    (a 404 below /v1/messages, /v1/models), and a refusal the access middleware or the
    error middleware writes is a response as any other."""
    origin = "https://app.example"
    client = await make_client({"cors": {"allow_origins": [origin]}})
    body = {"model": "mock/echo", "max_tokens": 5, "messages": USER}
    chat = {"model": "mock/echo", "messages": USER}
    asked: list[tuple[str, str, dict[str, Any]]] = [
        *(("POST", "/v1/messages", {"json": body | extra}) for extra in MESSAGES_VARIANTS),
        ("POST", "/v1/chat/completions", {"json": chat}),
        ("POST", "/v1/chat/completions", {"json": chat | {"stream": True}}),
        ("GET", "/v1/models", {}),
        ("GET", "/healthz", {}),
        ("POST", "/v1/messages/count_tokens", {"json": body}),  # 404
        ("GET", "/v1/messages/batches", {}),  # 404
        ("GET", "/v1/messages", {}),  # 405
        ("GET", "/v1/models", {"headers": {"Host": "attacker.example"}}),  # 403 host_not_allowed
        ("POST", "/v1/messages", {"json": body, "headers": {"Origin": "https://evil.example"}}),
        (
            "OPTIONS",  # a CORS preflight, answered by the access middleware
            "/v1/messages",
            {"headers": {"Origin": origin, "Access-Control-Request-Method": "POST"}},
        ),
    ]
    statuses = set()
    for method, path, options in asked:
        resp = await client.request(method, path, **options)
        await resp.read()
        statuses.add(resp.status)
        assert resp.headers["request-id"] == resp.headers["X-Request-Id"], (method, path, options)
        assert resp.headers["X-Request-Id"].startswith("req_")
    assert statuses == {200, 204, 400, 403, 404, 405}


MESSAGES_VARIANTS: tuple[dict[str, Any], ...] = (
    {},
    {"stream": True},
    {"model": "nope/x"},
    {"max_tokens": "x"},
)
"""A success and errors, streamed and not."""


async def test_an_anthropic_sdk_error_below_messages_names_its_request(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """The SDK calls endpoints below /v1/messages that Nexus does not serve: their 404 had
    no ``request-id``, and the SDK's error no request id to quote to the operator."""
    caplog.set_level(logging.INFO, logger="nexus.access")
    _, an, attempts = await sdks(make_client, {})
    with pytest.raises(anthropic.NotFoundError) as one_batch:
        await an.messages.batches.retrieve("msgbatch_01")
    with pytest.raises(anthropic.NotFoundError) as batches:
        await an.messages.batches.list()
    lines = {
        record.request_id: record.access  # type: ignore[attr-defined]
        for record in caplog.records
        if record.name == "nexus.access"
    }
    for error, path in (
        (one_batch.value, "/v1/messages/batches/msgbatch_01"),
        (batches.value, "/v1/messages/batches"),
    ):
        assert error.request_id is not None
        assert error.request_id == error.response.headers["x-request-id"]
        assert (lines[error.request_id]["path"], lines[error.request_id]["status"]) == (path, 404)
    await attempts.client.aclose()


@pytest.mark.parametrize(
    ("headers", "retryable", "advice"),
    [
        ({}, False, False),
        ({}, True, True),
        ({"Retry-After": "1"}, False, True),  # a budget its running streams will free
        ({"Retry-After": "60"}, True, True),
        ({"Retry-After": "3600"}, False, False),  # a budget window that resets in an hour
        ({"Retry-After": "3600"}, True, False),
        ({"Retry-After": "Wed, 21 Oct 2015 07:28:00 GMT"}, True, True),
        ({"x-should-retry": "false"}, True, False),  # an upstream's wait too long to pass on
    ],
)
def test_retry_advice(headers: dict[str, str], retryable: bool, advice: bool) -> None:
    error = GatewayError("x", status=429, retryable=retryable, headers=headers)
    assert retry_advice(error) is advice


def test_a_stalled_upload_is_worth_retrying() -> None:
    """A 408 (the body stopped coming) says what the SDKs' own rule does for a 408."""
    assert retry_advice(RequestTimeout("the body stalled")) is True
