"""The exception tree. Each error carries an HTTP status hint, a stable ``code``
and an OpenAI-style ``type``; the server turns them into each endpoint's error
shape, and the engine turns them into :class:`~nexus.events.Error` events once
a stream has started::

    NexusError
    ├── ConfigError                  the config file is wrong (names file, key, problem)
    ├── RegistryFrozen               an encoder registered after start-up
    └── GatewayError                 anything a request can fail with (status, code, type)
        ├── InvalidRequest           400 invalid_request / invalid_json / ...
        │   ├── UnsupportedStreamFormat   400 unsupported_stream_format
        │   ├── UnsupportedInput     400 unsupported_input (image/audio a provider cannot take)
        │   └── InvalidLastEventId   400 invalid_last_event_id
        ├── ModelNotFound            404 model_not_found
        ├── StreamNotFound           404 stream_not_found (unknown or expired stream id)
        ├── RequestTimeout           408 request_timeout (the body stalled: [server] body_timeout_s)
        ├── RequestTooLarge          413 request_too_large
        ├── UnsupportedMediaType     415 unsupported_media_type (a Content-Encoding not taken)
        ├── TooManyStreams           429 too_many_streams (retryable)
        ├── ServerShuttingDown       503 server_shutting_down (retryable)
        ├── StoreUnavailable         503 store_unavailable (retryable, Retry-After): Redis down,
        │                            or its pool busy past [store] pool_timeout_s
        ├── StreamLost               502 stream_lost (retryable): the replica running it stopped
        ├── StreamIncomplete         410 stream_incomplete: the store's copy of the log has a hole
        └── UpstreamError            502 upstream_error (retryable): the upstream failed
            ├── UpstreamInvalidRequest   400 upstream_invalid_request (404 upstream_not_found,
            │                        413, 422 kept): the upstream refused the request
            ├── UpstreamAuthError    502 upstream_auth_error: 401/403, the gateway's key refused
            ├── UpstreamRateLimited  429 upstream_rate_limited (retryable, Retry-After kept)
            ├── UpstreamServerError  502 upstream_error (retryable): a 5xx
            │   └── UpstreamOverloaded   502 upstream_error (retryable): 503, Anthropic's 529
            ├── UpstreamConnectError 502 upstream_connect_error (retryable)
            ├── UpstreamDisconnected 502 upstream_disconnect (retryable): the body ended early
            ├── UpstreamProtocolError    502 upstream_protocol_error (retryable): not JSON
            ├── UpstreamTimeout      504 upstream_timeout (retryable)
            └── UpstreamPoolExhausted   503 upstream_pool_exhausted (retryable, Retry-After):
                                     the provider's pool busy past its pool_timeout_s
"""

from __future__ import annotations

from typing import Any

from .events import Error


class NexusError(Exception):
    """Base of every error Nexus raises on purpose."""


class ConfigError(NexusError):
    """The configuration cannot be used. The message names the file, key and problem."""


class RegistryFrozen(NexusError):
    """An encoder was registered after the registry froze at start-up."""


class GatewayError(NexusError):
    """A request failed. ``status`` is the HTTP status it maps to before a stream starts."""

    status: int = 500
    code: str = "internal_error"
    error_type: str = "server_error"
    retryable: bool = False

    def __init__(
        self,
        message: str,
        *,
        code: str | None = None,
        status: int | None = None,
        param: str | None = None,
        retryable: bool | None = None,
        headers: dict[str, str] | None = None,
        error_type: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code
        if status is not None:
            self.status = status
        if retryable is not None:
            self.retryable = retryable
        if error_type is not None:
            self.error_type = error_type
        self.param = param
        self.headers = headers or {}

    def to_event(self) -> Error:
        return Error(self.error_type, self.message, self.code, self.retryable, self.param)

    def openai_body(self, request_id: str | None = None) -> dict[str, Any]:
        """``{"error": {"message", "type", "param", "code"}}`` (docs/protocols.md §5), with
        ``request_id`` (the response's ``X-Request-Id``) in the error object when given:
        OpenAI's own bodies have no such field, and its SDK keeps the object whole."""
        error = {"message": self.message, "type": self.error_type, "param": self.param}
        error["code"] = self.code
        if request_id is not None:
            error["request_id"] = request_id
        return {"error": error}


class InvalidRequest(GatewayError):
    status = 400
    code = "invalid_request"
    error_type = "invalid_request_error"


class UnsupportedStreamFormat(InvalidRequest):
    code = "unsupported_stream_format"


class UnsupportedInput(InvalidRequest):
    code = "unsupported_input"


class InvalidLastEventId(InvalidRequest):
    code = "invalid_last_event_id"


class StreamNotFound(GatewayError):
    status = 404
    code = "stream_not_found"
    error_type = "invalid_request_error"


class StreamLost(GatewayError):
    status = 502
    code = "stream_lost"
    retryable = True


class StreamIncomplete(GatewayError):
    status = 410
    code = "stream_incomplete"


class ModelNotFound(GatewayError):
    status = 404
    code = "model_not_found"
    error_type = "invalid_request_error"


class RequestTimeout(GatewayError):
    status = 408
    code = "request_timeout"
    error_type = "invalid_request_error"
    retryable = True  # the body stalled: a new attempt may well go through


class RequestTooLarge(GatewayError):
    status = 413
    code = "request_too_large"
    error_type = "invalid_request_error"


class UnsupportedMediaType(GatewayError):
    status = 415
    code = "unsupported_media_type"
    error_type = "invalid_request_error"


class TooManyStreams(GatewayError):
    status = 429
    code = "too_many_streams"
    error_type = "rate_limit_error"
    retryable = True


class ServerShuttingDown(GatewayError):
    status = 503
    code = "server_shutting_down"
    retryable = True


class StoreUnavailable(GatewayError):
    status = 503
    code = "store_unavailable"
    retryable = True


class UpstreamError(GatewayError):
    status = 502
    code = "upstream_error"
    error_type = "upstream_error"
    retryable = True


class UpstreamInvalidRequest(UpstreamError):
    status = 400
    code = "upstream_invalid_request"
    error_type = "invalid_request_error"
    retryable = False


class UpstreamAuthError(UpstreamError):
    """The upstream refused the gateway's credentials: the operator's problem, not the
    client's. The message is ours alone: the upstream's may quote the key."""

    code = "upstream_auth_error"
    retryable = False

    def __init__(self, provider: str, detail: str = "") -> None:
        super().__init__(
            f"provider {provider!r} refused the gateway's credentials{detail}; "
            "check the key in its api_key_env"
        )


class UpstreamRateLimited(UpstreamError):
    status = 429
    code = "upstream_rate_limited"
    error_type = "rate_limit_error"


class UpstreamServerError(UpstreamError):
    """A 5xx from the upstream."""


class UpstreamOverloaded(UpstreamServerError):
    """503, or Anthropic's 529 and ``overloaded_error``: the upstream is overloaded."""


class UpstreamConnectError(UpstreamError):
    code = "upstream_connect_error"


class UpstreamDisconnected(UpstreamError):
    code = "upstream_disconnect"


class UpstreamProtocolError(UpstreamError):
    code = "upstream_protocol_error"


class UpstreamTimeout(UpstreamError):
    status = 504
    code = "upstream_timeout"


class UpstreamPoolExhausted(UpstreamError):
    status = 503
    code = "upstream_pool_exhausted"


class StreamError(GatewayError):
    """An :class:`~nexus.events.Error` event (``event``) met by :func:`nexus.accumulate`."""

    def __init__(self, event: Error) -> None:
        status = _STATUS_BY_CODE.get(event.code or "", _STATUS_BY_TYPE.get(event.error_type, 502))
        super().__init__(
            event.message,
            code=event.code,
            status=status,
            param=event.param,
            retryable=event.retryable,
            error_type=event.error_type,
        )
        self.event = event


_STATUS_BY_CODE = {"upstream_timeout": 504, "server_shutting_down": 503, "too_many_streams": 429}
_STATUS_BY_CODE |= {"internal_error": 500, "max_stream_duration": 500, "stream_too_large": 500}
_STATUS_BY_CODE |= {"store_unavailable": 503, "plugin_timeout": 503}
_STATUS_BY_TYPE = {"invalid_request_error": 400, "rate_limit_error": 429, "server_error": 502}
"""A stream's error as an HTTP status: a server error is the upstream's (502) but the
gateway's own (its failure, its limits: 500), as it would have been before any output."""


_CODES = """
    budget_exceeded client_disconnect host_not_allowed http_error input_too_large
    internal_error invalid_api_key invalid_envelope invalid_json invalid_last_event_id
    invalid_request max_stream_duration method_not_allowed metrics_token_not_set
    model_not_allowed model_not_found model_not_priced not_found nothing_to_abort
    origin_not_allowed plugin_timeout rate_limited request_timeout request_too_large
    server_shutting_down store_unavailable stream_cancelled stream_detached
    stream_in_progress stream_incomplete stream_lost stream_not_found stream_not_local
    stream_rejected stream_too_large too_many_connections too_many_readers too_many_sockets
    too_many_streams unsupported_input unsupported_media_type unsupported_stream_format
    upstream_auth_error upstream_connect_error upstream_disconnect upstream_error
    upstream_invalid_request upstream_not_found upstream_pool_exhausted
    upstream_protocol_error upstream_rate_limited upstream_timeout
"""
GATEWAY_CODES = frozenset(_CODES.split())
"""Every error ``code`` the gateway itself sends (docs/http-api.md, *Errors*; a test holds
the two together). An upstream may send others: those are its own."""


__all__ = sorted(
    name
    for name, value in list(globals().items())
    if isinstance(value, type) and issubclass(value, NexusError)
)
__all__ += ["GATEWAY_CODES"]
