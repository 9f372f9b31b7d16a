"""What the upstream codecs share: the decoders' shape, and the map from an upstream's
error (a status, or an error object in the stream) to the most specific class.

An upstream's error text reaches clients, every tenant's, and the operator's log: it is
:func:`redacted` first (the providers' own keys, and the common shapes of credentials and
of OpenAI organisation, project and user ids), since upstreams and the proxies in front of
them quote headers and accounts in errors; then its control characters are escaped (a
line break in it would forge a line of a text log), and it is cut to
:data:`MAX_ERROR_TEXT` characters, whichever way it came (a status's body, an error
inside the stream). A 429's ``Retry-After`` is passed on up to
:data:`MAX_RETRY_AFTER_S`: an upstream's "a day" is not the gateway's to promise (a
longer one is named in the message, and the error is not retryable).
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, ClassVar, Protocol

import orjson

from ..errors import (
    UpstreamAuthError,
    UpstreamError,
    UpstreamInvalidRequest,
    UpstreamOverloaded,
    UpstreamProtocolError,
    UpstreamRateLimited,
    UpstreamServerError,
)
from ..events import MAX_TOKENS, StreamEvent

__all__ = [
    "ERROR_TYPES",
    "MAX_ERROR_TEXT",
    "MAX_RETRY_AFTER_S",
    "QUOTA_CODE",
    "Malformed",
    "UpstreamDecoder",
    "error_fields",
    "error_text",
    "event_too_large",
    "in_stream_error",
    "keep_secret",
    "malformed",
    "object_of",
    "optional_count",
    "plain_param",
    "plain_token",
    "redacted",
    "status_error",
    "text_of",
    "token_count",
]

_CREDENTIAL_SHAPES = re.compile(
    r"(?i:\b(?:bearer|basic)\s+[\"']?)[A-Za-z0-9._~+/=\-]{12,}"  # an Authorization header
    r"|\b(?:sk|rk|pk)-[A-Za-z0-9_\-]{16,}"  # OpenAI and Anthropic keys (sk-..., sk-ant-...)
    r"|\borg-[A-Za-z0-9]{16,}"  # an OpenAI organisation: the operator's account
    r"|\bproj_[A-Za-z0-9]{8,}"  # an OpenAI project
    r"|\buser-[A-Za-z0-9]{16,}"  # an OpenAI user id
    r"|\bAIza[0-9A-Za-z_\-]{30,}"  # a Google API key
    r"|\b(?:AKIA|ASIA)[0-9A-Z]{16}\b"  # an AWS access key id
    r"|\beyJ[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]{8,}\.[A-Za-z0-9_\-]*"  # a JWT
    r"|\bnx-[A-Za-z0-9_\-]{16,}"  # a Nexus key (a request an upstream echoed)
)
_SECRETS: set[str] = set()
MAX_ERROR_TEXT = 500
"""The most characters of an upstream's error text passed on."""
_READ_TEXT = 64 * 1024  # what of a longer text is redacted at all (its start is kept)
MAX_RETRY_AFTER_S = 60
"""The longest ``Retry-After`` (seconds) passed on from an upstream's 429."""
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029]")
_MIN_SECRET = 8  # shorter, a key would redact ordinary words


def keep_secret(secret: str | None) -> None:
    """Redact ``secret`` (a provider's key, whatever its shape) from upstream text from
    now on, in this process."""
    if secret is not None and len(secret) >= _MIN_SECRET:
        _SECRETS.add(secret)


def redacted(text: str) -> str:
    """``text`` without the keys :func:`keep_secret` was given, nor credential shapes."""
    for secret in _SECRETS:
        if secret in text:
            text = text.replace(secret, "[redacted]")
    return _CREDENTIAL_SHAPES.sub("[redacted]", text)


def _passed_on(text: str) -> str:
    """An upstream's error text as it may go out: :func:`redacted`, its control
    characters escaped (``\\n``, ``\\u001b``: no line of a log can be forged), cut."""
    text = redacted(text[:_READ_TEXT])
    if _CONTROL.search(text):
        text = _CONTROL.sub(_escape, text)
    return text[:MAX_ERROR_TEXT]


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    return {"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(char) or f"\\u{ord(char):04x}"


class UpstreamDecoder(Protocol):
    """A stream's body, read by read: ``decode(chunk)`` gives the events the bytes completed;
    then ``error``, if set, is to be raised once they are out (an error object in the
    stream, data that is not JSON), and ``done`` says ``terminator`` came. Nothing after
    either is read. ``response_model`` is the model the upstream says answered, once its
    stream named it (for the attempt's span: never guessed from the request)."""

    terminator: ClassVar[str]
    done: bool
    error: UpstreamError | None
    response_model: str | None

    def decode(self, chunk: bytes) -> list[StreamEvent]: ...

    def closed(self) -> list[StreamEvent]:
        """The body ended cleanly before ``terminator``: the events that end it, ``done``
        set, when the stream is whole all the same (else it was cut)."""

    def cut(self) -> list[StreamEvent]:
        """The body was cut: what the decoder holds that the stream is charged by."""


def status_error(
    provider: str,
    status: int,
    message: str,
    headers: Mapping[str, str] | None = None,
    *,
    code: str | None = None,
    error_type: str | None = None,
    param: str | None = None,
    body: bytes = b"",
) -> UpstreamError:
    """The error for an upstream's non-2xx ``status`` (``message`` quoting its text):
    400/404/413/422 keep their status, and the ``code`` and ``param`` the client is to act
    on (``context_length_exceeded``); 401/403 drop the text, which may quote the key; 429
    keeps ``Retry-After``, and an exhausted quota says so and asks for no retry;
    redirects are not followed (they would carry the key). ``error_type``, ``code`` and
    ``param`` are the ones the error body (``body``) names, if not given."""
    sent_code = None
    if body:
        kind, sent_code, sent_param = error_fields(body)
        error_type = error_type or kind
        param = param or sent_param
    if status in (401, 403):
        return UpstreamAuthError(provider, f" ({status})")
    if status in (400, 404, 413, 422):
        code = code or sent_code or ("upstream_not_found" if status == 404 else None)
        return UpstreamInvalidRequest(
            message, status=status, code=code, error_type=error_type, param=param
        )
    if status == 429:
        kept = _retry_after(headers or {})
        if kept is None:  # a wait longer than the gateway passes on: the client's to plan
            message = f"{message} (the provider asks to wait longer than {MAX_RETRY_AFTER_S} s)"
            # Still retryable here (an alias's next target may answer), not by the SDKs,
            # which would only come back to the same refusal within seconds.
            kept = {"x-should-retry": "false"}
        if (code or sent_code) == QUOTA_CODE:  # billing: waiting does not cure it
            code, kept = QUOTA_CODE, {"x-should-retry": "false"}
        return UpstreamRateLimited(message, code=code, error_type=error_type, headers=kept)
    if status in (503, 529):
        return UpstreamOverloaded(message, code=code, error_type=error_type)
    if status >= 500:
        return UpstreamServerError(message, code=code, error_type=error_type)
    if 300 <= status < 400:
        message = f"provider {provider!r} answered {status}, a redirect: check its base_url"
    return UpstreamError(message, code=code, error_type=error_type, retryable=status in (408, 409))


def _retry_after(headers: Mapping[str, str]) -> dict[str, str] | None:
    """A 429's ``Retry-After`` (seconds; a date is dropped) and ``retry-after-ms``; None
    when the upstream asks for longer than :data:`MAX_RETRY_AFTER_S` (then neither is
    passed on, and the client is told not to retry: told "60", it would only come back to
    the same refusal)."""
    kept: dict[str, str] = {}
    seconds = headers.get("Retry-After", "").strip()
    if seconds.isascii() and seconds.isdigit():
        if int(seconds) > MAX_RETRY_AFTER_S:
            return None
        kept["Retry-After"] = str(int(seconds))
    try:
        ms = float(headers.get("retry-after-ms", ""))
    except ValueError:
        return kept
    if ms >= 0:  # (NaN is not)
        if ms > MAX_RETRY_AFTER_S * 1000:
            return None
        kept["retry-after-ms"] = str(int(ms))
    return kept


def error_text(body: bytes, *, whole: bool = True) -> str:
    """The message of an upstream's error body as it may go out (:func:`redacted`, then
    escaped and cut, so that no key is cut in two first): ``error.message``, ``error``
    or ``message`` of a JSON object, else the start of the text. Not ``whole`` (for a
    log line): a JSON body without a message is not quoted, since it may be the request
    echoed (its messages: no log line holds them)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return _passed_on(body.decode("utf-8", "replace").strip()) or "(no message)"
    if isinstance(data, dict):
        error = data.get("error")
        for text in (
            error.get("message") if isinstance(error, dict) else error,
            data.get("message"),
        ):
            if isinstance(text, str):
                return _passed_on(text)
    if not whole:
        return f"(JSON without a message, {len(body)} bytes)"
    return _passed_on(orjson.dumps(data).decode())


def error_fields(body: bytes) -> tuple[str | None, str | None, str | None]:
    """An upstream's error body's ``error.type``, ``error.code`` and ``error.param``, each
    when plain (:func:`plain_token`, :func:`plain_param`): Anthropic's ``overloaded_error``
    of a 529, OpenAI's ``context_length_exceeded`` on ``messages``, which clients act on."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError:
        return None, None, None
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict):
        return None, None, None
    kind, code = plain_token(error.get("type")), plain_token(error.get("code"))
    return kind, code, plain_param(error.get("param"))


QUOTA_CODE = "insufficient_quota"
"""OpenAI's 429 for an account out of credit: a billing matter, which no retry cures."""


ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    504: "timeout_error",
    529: "overloaded_error",
}
"""An HTTP status's error ``type`` as Anthropic names it (OpenAI shares the names it has)."""
_STATUS_OF_TYPE = {kind: status for status, kind in ERROR_TYPES.items()}  # overloaded: 529


_PLAIN_TOKEN = re.compile(r"[A-Za-z0-9_.\-]{1,64}")
_PLAIN_PARAM = re.compile(r"[A-Za-z0-9_.\-\[\]]{1,128}")


def plain_token(value: object) -> str | None:
    """``value`` if it is a short plain token once :func:`redacted` (an error code or type
    as upstreams send them: ``rate_limit_exceeded``), else None. A code reaches the
    client, the access line and a metric label: it may carry no key, no spaces or quotes
    (a forged log field) and no unbounded length."""
    if not isinstance(value, str) or not _PLAIN_TOKEN.fullmatch(value):
        return None
    return value if redacted(value) == value else None


def plain_param(value: object) -> str | None:
    """``value`` if a field's path as errors name it (``messages[0].content``), plain as
    :func:`plain_token` is, else None."""
    if not isinstance(value, str) or not _PLAIN_PARAM.fullmatch(value):
        return None
    return value if redacted(value) == value else None


_STATUS_OF_CODE = {"rate_limit_exceeded": 429, QUOTA_CODE: 429}
"""Codes that stand for a status inside a stream, whatever the type beside them (OpenAI's
``{"type": "requests", "code": "rate_limit_exceeded"}``)."""


def in_stream_error(provider: str, error: Any) -> UpstreamError:
    """The error for an error object inside the stream (docs/protocols.md §2, §3): its
    ``type`` stands for a status (:func:`status_error`), or else an integer ``code``
    from 400 to 599 (a status, as vLLM, OpenRouter and llama.cpp send it); the type and
    the code (``upstream_error`` if none) reach the client when each is a
    :func:`plain_token` (else no type, and ``upstream_error``)."""
    if not isinstance(error, dict):
        error = {"message": str(error)}
    kind, code = plain_token(error.get("type")), plain_token(error.get("code"))
    param = plain_param(error.get("param"))
    text = _passed_on(str(error.get("message") or "error inside the stream"))
    status = _STATUS_OF_TYPE.get(kind or "") or _STATUS_OF_CODE.get(code or "")
    number = error.get("code")
    if status is None and type(number) is int and 400 <= number <= 599:
        # A status as the code (vLLM, OpenRouter, llama.cpp): a 400 is no retryable 502,
        # a 429 a rate limit; the code is the status's own (upstream_invalid_request, ...).
        message = f"provider {provider!r}: {text}"
        return status_error(provider, number, message, error_type=kind, param=param)
    return status_error(
        provider,
        status or 500,
        f"provider {provider!r}: {text}",
        # (a status's own code when none came: upstream_rate_limited, ...)
        code=code or (None if status else "upstream_error"),
        error_type=kind,
        param=param,
    )


def event_too_large(provider: str, exc: Exception) -> UpstreamProtocolError:
    """The error for an upstream event past the provider's ``max_event_bytes``: the stream
    ends there rather than hold an event no client could use."""
    return UpstreamProtocolError(f"provider {provider!r} sent {exc}")


class Malformed(ValueError):
    """A field of an upstream event of the wrong type, or a count out of bounds: raised by
    the readers of the codecs, made :class:`~nexus.errors.UpstreamProtocolError` by their
    decoders (:func:`malformed`). Checked where the field is read anyway: a string passed on
    as it came would reach an OpenAI client as an object, a count as an infinite cost."""


def malformed(provider: str, exc: Malformed) -> UpstreamProtocolError:
    return UpstreamProtocolError(f"provider {provider!r} sent {exc}")


def text_of(value: object, field: str) -> str | None:
    """``value`` if a string or None (absent), else :class:`Malformed`."""
    if value is None or type(value) is str:
        return value
    raise Malformed(f"a {field} that is not a string")


def object_of(value: Any, field: str) -> dict[str, Any]:
    """``value`` if an object, {} if None (absent), else :class:`Malformed`."""
    if value is None:
        return {}
    if type(value) is not dict:
        raise Malformed(f"a {field} that is not an object")
    return value


def token_count(value: object, field: str) -> int:
    """``value`` if a count of tokens (an integer from 0 to :data:`~nexus.events.MAX_TOKENS`,
    or a float of a whole number in that range, as some compatible servers write counts;
    None or absent: 0), else :class:`Malformed`. Not a fraction, a string nor a bool: a
    count is billed."""
    if value is None:
        return 0
    if type(value) is int and 0 <= value <= MAX_TOKENS:
        return value
    if type(value) is float and value.is_integer() and 0 <= value <= MAX_TOKENS:
        return int(value)
    raise Malformed(f"a usage {field} that is not a count of tokens (0 to {MAX_TOKENS})")


def optional_count(value: object, field: str) -> int | None:
    """:func:`token_count`, None kept: a detail the upstream did not report."""
    return None if value is None else token_count(value, field)
