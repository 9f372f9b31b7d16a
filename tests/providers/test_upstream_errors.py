"""Upstream failures to error classes, mapped once: a status (``status_error``), an error
object in the stream (``in_stream_error``), a foreign exception (``map_upstream_errors``);
then what the client sees, and which of them send the engine to the next target."""

from __future__ import annotations

import asyncio
import ssl
from typing import Any

import orjson
import pytest

from nexus import Engine
from nexus.config import parse_config
from nexus.errors import (
    GatewayError,
    InvalidRequest,
    UpstreamAuthError,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamInvalidRequest,
    UpstreamOverloaded,
    UpstreamProtocolError,
    UpstreamRateLimited,
    UpstreamServerError,
    UpstreamTimeout,
)
from nexus.events import Delta
from nexus.protocol.upstream import error_text, in_stream_error, keep_secret, redacted, status_error
from nexus.providers.http import map_upstream_errors
from nexus.providers.http1 import UpstreamClosed, UpstreamMalformed
from support import MakeClient
from upstreams import DONE, FakeUpstream, Reply, openai_chunk, openai_error_body

KEY_ENV = "NEXUS_TEST_UPSTREAM_ERRORS_KEY"
SECRET = "sk-upstream-errors-0123456789"


@pytest.mark.parametrize(
    ("status", "cls", "client_status", "code", "error_type", "retryable"),
    [
        (400, UpstreamInvalidRequest, 400, "upstream_invalid_request", "invalid_request_error", 0),
        (404, UpstreamInvalidRequest, 404, "upstream_not_found", "invalid_request_error", 0),
        (413, UpstreamInvalidRequest, 413, "upstream_invalid_request", "invalid_request_error", 0),
        (422, UpstreamInvalidRequest, 422, "upstream_invalid_request", "invalid_request_error", 0),
        (401, UpstreamAuthError, 502, "upstream_auth_error", "upstream_error", 0),
        (403, UpstreamAuthError, 502, "upstream_auth_error", "upstream_error", 0),
        (429, UpstreamRateLimited, 429, "upstream_rate_limited", "rate_limit_error", 1),
        (500, UpstreamServerError, 502, "upstream_error", "upstream_error", 1),
        (502, UpstreamServerError, 502, "upstream_error", "upstream_error", 1),
        (503, UpstreamOverloaded, 502, "upstream_error", "upstream_error", 1),
        (529, UpstreamOverloaded, 502, "upstream_error", "upstream_error", 1),
        (301, UpstreamError, 502, "upstream_error", "upstream_error", 0),
        (408, UpstreamError, 502, "upstream_error", "upstream_error", 1),
        (409, UpstreamError, 502, "upstream_error", "upstream_error", 1),
        (418, UpstreamError, 502, "upstream_error", "upstream_error", 0),
    ],
)
def test_status_to_class(
    status: int, cls: type, client_status: int, code: str, error_type: str, retryable: int
) -> None:
    headers = {"Retry-After": "7", "retry-after-ms": "6500", "X-Other": "x"}
    error = status_error("up", status, f"provider 'up' answered {status}: {SECRET}", headers)
    assert type(error) is cls and isinstance(error, UpstreamError)
    assert (error.status, error.code, error.error_type) == (client_status, code, error_type)
    assert error.retryable is bool(retryable)
    body = error.openai_body()["error"]
    assert (body["code"], body["type"]) == (code, error_type)
    if status == 429:
        assert error.headers == {"Retry-After": "7", "retry-after-ms": "6500"}
    else:
        assert error.headers == {}
    if status in (401, 403, 301):
        assert SECRET not in error.message  # the upstream's text may quote the key
    else:
        assert SECRET in error.message


@pytest.mark.parametrize(
    ("error", "cls", "status", "code", "error_type", "retryable"),
    [
        (
            {"type": "invalid_request_error", "message": "bad"},
            UpstreamInvalidRequest,
            400,
            "upstream_invalid_request",
            "invalid_request_error",
            False,
        ),
        (
            {"type": "not_found_error", "message": "gone", "code": "model_gone"},
            UpstreamInvalidRequest,
            404,
            "model_gone",
            "not_found_error",
            False,
        ),
        (
            {"type": "rate_limit_error", "message": "slow"},
            UpstreamRateLimited,
            429,
            "upstream_rate_limited",
            "rate_limit_error",
            True,
        ),
        (
            {"type": "overloaded_error", "message": "busy"},
            UpstreamOverloaded,
            502,
            "upstream_error",
            "overloaded_error",
            True,
        ),
        (
            {"type": "authentication_error", "message": f"bad key {SECRET}"},
            UpstreamAuthError,
            502,
            "upstream_auth_error",
            "upstream_error",
            False,
        ),
        (
            {"type": "server_error", "message": "boom", "code": "internal"},
            UpstreamServerError,
            502,
            "internal",
            "server_error",
            True,
        ),
        (
            {"message": "no type"},
            UpstreamServerError,
            502,
            "upstream_error",
            "upstream_error",
            True,
        ),
        ("a bare string", UpstreamServerError, 502, "upstream_error", "upstream_error", True),
        (  # OpenAI's rate limit inside a stream: its code says the status, not its type
            {"type": "requests", "message": "slow", "code": "rate_limit_exceeded"},
            UpstreamRateLimited,
            429,
            "rate_limit_exceeded",
            "requests",
            True,
        ),
    ],
)
def test_in_stream_error_to_class(
    error: Any, cls: type, status: int, code: str, error_type: str, retryable: bool
) -> None:
    exc = in_stream_error("up", error)
    assert type(exc) is cls
    assert (exc.status, exc.code, exc.error_type, exc.retryable) == (
        status,
        code,
        error_type,
        retryable,
    )
    assert SECRET not in exc.message
    event = exc.to_event()
    assert (event.error_type, event.code, event.retryable) == (error_type, code, retryable)


@pytest.mark.parametrize(
    ("body", "text"),
    [
        (b'{"error": {"message": "m1", "type": "x"}}', "m1"),
        (b'{"type": "error", "error": {"type": "x", "message": "m2"}}', "m2"),
        (b'{"error": "m3"}', "m3"),
        (b'{"message": "m4"}', "m4"),
        (b'{"detail": "m5"}', '{"detail":"m5"}'),
        (b"  plain text  ", "plain text"),
        (b"", "(no message)"),
    ],
)
def test_error_text(body: bytes, text: str) -> None:
    assert error_text(body) == text


def _certificate_error() -> ssl.SSLCertVerificationError:
    error = ssl.SSLCertVerificationError(
        1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed"
    )
    error.reason = "CERTIFICATE_VERIFY_FAILED"
    return error


@pytest.mark.parametrize(
    ("foreign", "cls", "code", "says"),
    [
        (TimeoutError(), UpstreamTimeout, "upstream_timeout", "timed out between chunks"),
        (
            ConnectionRefusedError(111, "Connection refused"),
            UpstreamConnectError,
            "upstream_connect_error",
            "Connection refused",
        ),
        (
            UpstreamClosed("the upstream closed the connection"),
            UpstreamDisconnected,
            "upstream_disconnect",
            "closed the connection between chunks",
        ),
        (
            UpstreamMalformed("the upstream's response is not HTTP/1.1 (bad status)"),
            UpstreamProtocolError,
            "upstream_protocol_error",
            "not HTTP/1.1",
        ),
        (_certificate_error(), UpstreamConnectError, "upstream_connect_error", "TLS failed"),
    ],
)
def test_foreign_errors_are_mapped_with_their_cause(
    foreign: BaseException, cls: type, code: str, says: str
) -> None:
    """The upstream client's own errors (connections.py's, the socket's, ssl's) become
    one class each, the cause kept for the log; UpstreamClosed is a ConnectionError, an
    SSL error an OSError: the order of the mapping's clauses is what this holds."""
    with pytest.raises(UpstreamError) as info, map_upstream_errors("up", "between chunks"):
        raise foreign
    assert type(info.value) is cls and info.value.code == code
    assert info.value.__cause__ is foreign and info.value.retryable
    assert says in info.value.message


def test_gateway_errors_pass_the_edge_as_they_are() -> None:
    original = InvalidRequest("bad")
    with pytest.raises(GatewayError) as info, map_upstream_errors("up", "before responding"):
        raise original
    assert info.value is original


# --- through the engine: which failures fall back to the next target ----------------


def _config(bad: FakeUpstream, good: FakeUpstream, kind: str = "openai") -> dict[str, Any]:
    base = bad.url if kind == "anthropic" else bad.url + "/v1"
    return {
        "providers": {
            "bad": {"kind": kind, "base_url": base, "api_key_env": KEY_ENV},
            "good": {"kind": "openai", "base_url": good.url + "/v1", "api_key_env": KEY_ENV},
        },
        "models": {"fast": {"targets": ["bad/m1", "good/m2"]}},
    }


GOOD = [openai_chunk(content="from good"), openai_chunk(finish_reason="stop"), DONE]


@pytest.mark.parametrize(("kind", "status"), [("openai", 429), ("openai", 500), ("anthropic", 529)])
async def test_rate_limits_and_server_errors_fall_back(
    monkeypatch: pytest.MonkeyPatch, kind: str, status: int
) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)
    async with FakeUpstream() as bad, FakeUpstream() as good:
        bad.add(Reply.json(status, openai_error_body("busy", "server_error")))
        good.add(Reply.stream(GOOD))
        async with Engine.from_config(parse_config(_config(bad, good, kind))) as engine:
            stream = engine.complete_stream({"model": "fast", "messages": [_HI]})
            events = [e async for e in stream]
        assert stream.meta.provider == "good"
        assert events[0] == Delta("from good")
        assert len(bad.requests) == len(good.requests) == 1


@pytest.mark.parametrize("status", [401, 400])
async def test_auth_and_request_errors_do_not_fall_back(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch, status: int
) -> None:
    monkeypatch.setenv(KEY_ENV, SECRET)
    async with FakeUpstream() as bad, FakeUpstream() as good:
        bad.add(Reply.json(status, openai_error_body(f"refused {SECRET}, says the upstream")))
        good.add(Reply.stream(GOOD))
        client = await make_client(_config(bad, good))
        resp = await client.post("/v1/chat/completions", json={"model": "fast", "messages": [_HI]})
        text = await asyncio.wait_for(resp.text(), 10)
        assert resp.status == (502 if status == 401 else 400)
        assert ("says the upstream" in text) is (status == 400)  # a 401's may quote the key
        assert good.requests == []


_HI = {"role": "user", "content": "Hi"}


# --- upstream text reaches every tenant: no secret in it -------------------------------

PLAIN_KEY = "plainkey-without-a-shape-42"  # a self-hosted upstream's key: no sk- to spot
LEAKY = (
    f"echo: Authorization: Bearer {PLAIN_KEY}; x-api-key {SECRET}; your key {PLAIN_KEY} "
    "in organization org-AbCdEfGhIjKlMnOpQrStUvWx (Used 29500)"
)


@pytest.mark.parametrize("status", [400, 404, 422, 429, 500, 503])
async def test_an_upstream_error_quoting_keys_reaches_the_client_without_them(
    make_client: MakeClient,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    status: int,
) -> None:
    monkeypatch.setenv(KEY_ENV, PLAIN_KEY)
    async with FakeUpstream() as up:
        up.add(Reply.json(status, openai_error_body(LEAKY, "server_error")))
        provider = {"kind": "openai", "base_url": up.url + "/v1", "api_key_env": KEY_ENV}
        client = await make_client({"providers": {"up": provider}})
        with caplog.at_level("WARNING", logger="nexus"):
            resp = await client.post(
                "/v1/chat/completions", json={"model": "up/m", "messages": [_HI]}
            )
            text = await asyncio.wait_for(resp.text(), 10)
    assert resp.status >= 400
    for secret in (PLAIN_KEY, SECRET, "org-AbCdEfGhIjKlMnOpQrStUvWx"):
        assert secret not in text
        assert secret not in caplog.text
    if status < 500:  # the client's own trouble: it reads why, redacted
        assert "[redacted]" in text and "Used 29500" in text
    else:  # the upstream's: the operator reads it, in the log
        assert "Used 29500" not in text
        assert "Used 29500" in caplog.text and "[redacted]" in caplog.text


async def test_an_upstream_5xx_that_echoes_the_request_logs_neither_its_messages_nor_keys(
    make_client: MakeClient, caplog: pytest.LogCaptureFixture
) -> None:
    """An upstream that answered 500 with the request it got logged it whole: the
    prompt's text, and a Nexus key the user had pasted in it."""
    nexus_key = "nx-Zq9Zq9Zq9Zq9Zq9Zq9Zq9"
    prompt = f"my private prompt; NEXUS_KEY={nexus_key}"
    async with FakeUpstream() as up:
        echoed = {"model": "m", "messages": [{"role": "user", "content": prompt}]}
        text_echo = f"Bad gateway while serving {nexus_key}"
        up.add(Reply.json(500, echoed), Reply.json(502, {"error": {"message": text_echo}}))
        client = await make_client({"providers": {"up": {"kind": "openai", "base_url": up.url}}})
        with caplog.at_level("WARNING", logger="nexus"):
            for _ in range(2):
                body = {"model": "up/m", "messages": [{"role": "user", "content": prompt}]}
                resp = await client.post("/v1/chat/completions", json=body)
                assert resp.status == 502
                assert nexus_key not in await resp.text()
    assert "my private prompt" not in caplog.text and nexus_key not in caplog.text
    assert "JSON without a message" in caplog.text  # the operator still hears of it
    assert "Bad gateway while serving [redacted]" in caplog.text


async def test_an_error_inside_the_stream_quoting_keys_is_redacted(
    make_client: MakeClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(KEY_ENV, PLAIN_KEY)
    error = (
        b'data: {"error": ' + orjson.dumps({"message": LEAKY, "type": "server_error"}) + b"}\n\n"
    )
    async with FakeUpstream() as up:
        up.add(Reply.stream([openai_chunk(content="partial"), error]))
        provider = {"kind": "openai", "base_url": up.url + "/v1", "api_key_env": KEY_ENV}
        client = await make_client({"providers": {"up": provider}})
        resp = await client.post(
            "/v1/chat/completions", json={"model": "up/m", "messages": [_HI], "stream": True}
        )
        text = await asyncio.wait_for(resp.text(), 10)
    assert "partial" in text and "[redacted]" in text
    for secret in (PLAIN_KEY, SECRET, "org-AbCdEfGhIjKlMnOpQrStUvWx"):
        assert secret not in text


@pytest.mark.parametrize(
    ("text", "kept"),
    [
        ("Authorization: Bearer abcdefghijklmnopqrstuv", "Authorization: [redacted]"),
        ("Basic dXNlcjpwYXNzd29yZA==", "[redacted]"),
        ("key sk-ant-api03-abcdefghijklmnop", "key [redacted]"),
        ("google AIzaSyA1234567890abcdefghijklmnopqrstu", "google [redacted]"),
        ("aws AKIAABCDEFGHIJKLMNOP", "aws [redacted]"),
        ("jwt eyJhbGciOiJIUzI1NiJ9.eyJzdWIiOiIxMjM0In0.c2lnbmF0dXJl", "jwt [redacted]"),
        ("in organization org-AbCdEfGhIjKlMnOpQrStUvWx", "in organization [redacted]"),
        # What only looks like one stays: a message must still say what went wrong.
        ("The bearer token is missing", "The bearer token is missing"),
        ("send 'Bearer <token>'", "send 'Bearer <token>'"),
        ("org-level limits apply", "org-level limits apply"),
    ],
)
def test_credential_shapes_are_redacted_and_words_are_not(text: str, kept: str) -> None:
    assert redacted(text) == kept


@pytest.mark.parametrize(
    ("code", "kind"),
    [
        (f"c_{PLAIN_KEY}", "server_error"),  # the provider's key, in a code of plain characters
        ("sk-proj-abcdefghijklmnop0123", "server_error"),  # a key's shape
        ("busy 42 key=x", "server_error"),  # spaces: a forged access-log field
        ("x" * 65, "server_error"),  # no bound on a label's length
        ("internal", f"t_{PLAIN_KEY}"),
        ("internal", "bad type\nlevel=ERROR"),
        (7, ["not", "a", "string"]),
    ],
)
def test_an_in_stream_errors_code_and_type_pass_only_as_plain_tokens(
    code: object, kind: object
) -> None:
    """They reach the client, the access line's outcome and metric labels: they were
    passed as they came, keys included."""
    keep_secret(PLAIN_KEY)
    exc = in_stream_error("up", {"message": "m", "code": code, "type": kind})
    shown = f"{exc.code} {exc.error_type} {exc.to_event()}"
    assert PLAIN_KEY not in shown and "sk-proj" not in shown and "key=x" not in shown
    if code == "internal":
        assert exc.code == "internal"  # a plain code still passes
    else:
        assert exc.code == "upstream_error"
    if kind == "server_error":
        assert exc.error_type == "server_error"
    assert exc.status == 502 and exc.retryable  # an unknown or dropped type: a 5xx


def test_a_long_error_is_redacted_before_it_is_cut() -> None:
    keep_secret(PLAIN_KEY)
    text = error_text(b"x" * 480 + b" echo: " + PLAIN_KEY.encode())
    assert PLAIN_KEY[:8] not in text and text.endswith("[redacted]")


def test_an_invalid_requests_code_and_param_reach_the_client_on_both_paths() -> None:
    """What a client acts on (``context_length_exceeded`` on ``messages``: trim the
    history) came back as ``upstream_invalid_request`` with no param from an HTTP 400,
    and without its param from inside a stream."""
    error = {
        "message": "This model's maximum context length is 8192 tokens.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    body = orjson.dumps({"error": error})
    for made in (
        status_error("up", 400, "provider 'up' answered 400", body=body),
        in_stream_error("up", error),
    ):
        assert type(made) is UpstreamInvalidRequest
        wire = made.openai_body()["error"]
        assert (made.status, wire["code"], wire["param"]) == (
            400,
            "context_length_exceeded",
            "messages",
        )
    indexed = orjson.dumps({"error": {"param": "messages[3].content", "code": "bad"}})
    assert status_error("up", 422, "x", body=indexed).param == "messages[3].content"
    for param in ("a b", "x" * 200, "sk-" + "a" * 40, 7):
        forged = orjson.dumps({"error": {"param": param, "code": "bad"}})
        assert status_error("up", 400, "x", body=forged).param is None


def test_an_exhausted_quota_is_not_retried_by_the_sdks() -> None:
    """OpenAI's 429 ``insufficient_quota`` is billing: the SDKs retried it (three calls
    upstream for one refusal) and the client could not tell it from a rate limit."""
    body = orjson.dumps({"error": {"type": "insufficient_quota", "code": "insufficient_quota"}})
    error = status_error("up", 429, "x", {"Retry-After": "1"}, body=body)
    assert (error.status, error.code) == (429, "insufficient_quota")
    assert error.headers == {"x-should-retry": "false"}
    limited = status_error(
        "up", 429, "x", {"Retry-After": "1"}, body=b'{"error":{"code":"rate_limit_exceeded"}}'
    )
    assert (limited.code, limited.headers) == ("upstream_rate_limited", {"Retry-After": "1"})


async def test_a_json_answer_to_a_stream_request_is_its_error_and_falls_back(
    make_client: MakeClient,
) -> None:
    """A 200 in JSON with an error body (some servers and proxies answer so) was read as a
    stream and reported as one that ended without [DONE], the upstream's words lost."""
    overloaded = {"error": {"message": "The server is overloaded", "type": "server_error"}}
    answer = Reply.stream([openai_chunk(content="fine"), openai_chunk(finish_reason="stop"), DONE])
    whole = {"id": "c", "object": "chat.completion", "choices": []}
    async with FakeUpstream(Reply.json(200, overloaded), answer, Reply.json(200, whole)) as fake:
        up = {"kind": "openai", "base_url": fake.url + "/v1"}
        config = {
            "providers": {"one": up, "two": up},
            "models": {"pair": {"targets": ["one/m", "two/m"]}},
        }
        client = await make_client(config)
        body = {"model": "pair", "messages": [{"role": "user", "content": "hi"}]}
        resp = await client.post("/v1/chat/completions", json=body)
        assert (await resp.json())["choices"][0]["message"]["content"] == "fine"
        resp = await client.post("/v1/chat/completions", json={**body, "model": "one/m"})
        error = (await resp.json())["error"]
        assert (resp.status, error["code"]) == (502, "upstream_protocol_error")
        assert "answered JSON" in error["message"]


async def test_a_stream_a_relay_labelled_json_is_read_as_a_stream(make_client: MakeClient) -> None:
    """Some relays send SSE as ``application/json``: its first byte says it is a stream."""
    frames = [openai_chunk(content="fine"), openai_chunk(finish_reason="stop"), DONE]
    labelled = Reply.stream(frames, headers={"Content-Type": "application/json; charset=utf-8"})
    async with FakeUpstream(labelled) as fake:
        client = await make_client(
            {"providers": {"up": {"kind": "openai", "base_url": fake.url + "/v1"}}}
        )
        body = {"model": "up/m", "messages": [{"role": "user", "content": "hi"}]}
        resp = await client.post("/v1/chat/completions", json=body)
        assert (await resp.json())["choices"][0]["message"]["content"] == "fine"
