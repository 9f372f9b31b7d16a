"""Requests aiohttp answers without the app: an access line and a count for them too.

aiohttp answers some requests itself, before any middleware runs: one its HTTP parser
refuses (a malformed request line or header, a line too long, a bad ``Content-Length``,
an invalid chunked body: 400) and one whose ``Expect`` it does not know (417). The access
middleware never sees them, so they had no access line and no count. aiohttp's public
way to see every response it writes, those included, is the access logger its request
handlers are built with (``access_log_class``): :class:`RejectionLog`, given to every
handler through the app's ``handler_args`` (aiohttp's runners apply them over their own;
``nexus serve``'s :class:`~nexus.server.connection.ConnectionSite` reads them from
:data:`~nexus.server.state.REQUEST_HANDLER_ARGS`). It accounts for the requests the
middleware did not see (:func:`~nexus.server.access.account`): the access line with
``endpoint=rejected``, ``outcome=rejected:<kind>``, the client's address, no key (none
was authenticated) and no method or path (the parser may not have got that far), and
``nexus_requests_total`` with that endpoint and outcome.

The kind comes from the parser's error, which only a request handler's ``handle_error``
is given: ``nexus serve``'s :class:`~nexus.server.connection.Connection` answers with a
:class:`Rejected` that carries it (:func:`describe`), and its description, never the raw
bytes. Under aiohttp's own handler (``web.run_app``) a 400 is ``malformed``: its answer
quotes the raw bytes, which are never read here. Another status is named by its phrase
(``expectation_failed``).

The line is under the request id the answer carries (``X-Request-Id``, ``request-id``): a
:class:`Rejected`'s own; the 417's, stamped by the app's ``on_response_prepare``
(:func:`~nexus.server.access.stamp_response`). aiohttp's own 400 (``web.run_app``)
carries none, as nothing of the app runs for it: its line has an id of its own. The 503
of a connection past ``[server] max_connections``, written as bytes before any request
exists, carries an id too but has no line: a client could write them at connect speed (they
are counted in ``nexus_connections_refused_total``, and warned of every 10 s at most).
"""

from __future__ import annotations

import logging
import time
from http import HTTPStatus
from typing import TYPE_CHECKING, Any, ClassVar

import orjson
from aiohttp import http_exceptions as bad
from aiohttp import web
from aiohttp.abc import AbstractAccessLogger
from aiohttp.http import HttpProcessingError

from ..config import Config
from ..errors import InvalidRequest
from .access import access_log, account
from .metrics import Metrics
from .redaction import parse_error_reason
from .state import EXCHANGE, Exchange, new_request_id, response_headers

if TYPE_CHECKING:
    from aiohttp.web_request import BaseRequest

__all__ = [
    "ENDPOINT",
    "Rejected",
    "RejectionLog",
    "describe",
    "describe_body_error",
    "malformed",
    "rejection_args",
]

log = logging.getLogger("nexus.server")

ENDPOINT = "rejected"
"""The ``endpoint`` of a request aiohttp answered without the app (its line, its label)."""

MALFORMED = "malformed"
"""The kind of a parser error nothing more is known of."""

_BY_CLASS: tuple[tuple[type[HttpProcessingError], str, str], ...] = (
    (bad.BadHttpMethod, "invalid_method", "invalid method"),
    (bad.BadStatusLine, "invalid_request_line", "invalid request line"),
    (bad.InvalidURLError, "invalid_target", "invalid request target"),
    (bad.LineTooLong, "line_too_long", "a request line or header line is too long"),
    (bad.InvalidHeader, "invalid_header", "invalid header"),
    (bad.TransferEncodingError, "invalid_chunked_body", "invalid chunked body"),
    (bad.ContentLengthError, "incomplete_body", "body shorter than its Content-Length"),
    (bad.PayloadEncodingError, "invalid_body_encoding", "invalid body encoding"),
)
"""Parser errors whose message may quote the raw bytes: their kind and description by
their class."""

_BY_REASON = (
    ("content-length", "invalid_content_length"),
    ("transfer-encoding", "invalid_transfer_encoding"),
    ("chunk", "invalid_chunked_body"),
    ("too many", "too_many_headers"),
    ("header", "invalid_header"),
    ("method", "invalid_method"),
    ("url", "invalid_target"),
)
"""The kind of a parser error that says it in its reason only (aiohttp's C parser
raises one class for most; llhttp's reasons: "Duplicate Content-Length", "Invalid
character in chunk size", "Invalid header value char"...): the first match."""


def describe(exc: HttpProcessingError) -> tuple[str, str]:
    """A parser error's kind (one of a few fixed names: a label) and what it says is
    wrong, never what the client sent."""
    for cls, kind, description in _BY_CLASS:
        if isinstance(exc, cls):
            return kind, description
    reason = parse_error_reason(exc.message)
    lowered = reason.lower()
    for word, kind in _BY_REASON:
        if word in lowered:
            return kind, reason
    return MALFORMED, reason


def describe_body_error(exc: HttpProcessingError | web.RequestPayloadError) -> str:
    """What the parser said of a body it refused after the route began reading it, never
    what the client sent: the error it set on the request's payload (aiohttp's pure-Python
    parser does), or the one inside aiohttp's ``RequestPayloadError`` (whose own message
    quotes the bytes)."""
    cause = exc if isinstance(exc, HttpProcessingError) else exc.__cause__
    return describe(cause)[1] if isinstance(cause, HttpProcessingError) else "invalid body"


def malformed(description: str, status: int = 400) -> InvalidRequest:
    """What the client of a request the parser refused is told: ``invalid_request``, with
    the parser's ``description`` (:func:`describe`)."""
    return InvalidRequest(f"Malformed HTTP request: {description}.", status=status)


class Rejected(web.Response):
    """The JSON 400 a request the parser refused gets from ``nexus serve``: its ``kind``
    and ``description`` (:func:`describe`) for its access line, a request id for both."""

    def __init__(self, exc: HttpProcessingError, status: int) -> None:
        self.kind, self.description = describe(exc)
        self.request_id = new_request_id()
        error = malformed(self.description, status)
        super().__init__(
            status=status,
            body=orjson.dumps(error.openai_body(self.request_id)),
            content_type="application/json",
            headers=response_headers(self.request_id),
        )
        self.force_close()


class RejectionLog(AbstractAccessLogger):
    """aiohttp's access logger, for the responses the access middleware did not see
    (see the module docstring). :func:`rejection_args` makes one per app, bound to its
    config and metrics."""

    config: ClassVar[Config | None] = None
    metrics: ClassVar[Metrics | None] = None

    def log(self, request: BaseRequest, response: web.StreamResponse, time: float) -> None:
        config = self.config
        if config is None or EXCHANGE in request:
            return  # the access middleware wrote its line
        try:
            ex = rejection(request, response, time)
            account(config, self.metrics, ex, response.status)
        except Exception:  # (as aiohttp's own: a logger's fault must not fail the response)
            log.exception("accounting for a request answered without the app failed")


def rejection(request: BaseRequest, response: web.StreamResponse, elapsed: float) -> Exchange:
    """The :class:`Exchange` of a request aiohttp answered without the app, under the id
    its answer carries (a :class:`Rejected`'s; the 417's, from the app's
    ``on_response_prepare``, :func:`~nexus.server.access.stamp_response`)."""
    request_id = response.headers.get("X-Request-Id") or new_request_id()
    ex = Exchange(request_id, time.monotonic() - elapsed)
    ex.endpoint = ENDPOINT
    ex.client = request.remote
    if isinstance(response, Rejected):
        ex.rejected, ex.reason = response.kind, response.description
    elif response.status == HTTPStatus.BAD_REQUEST:
        ex.rejected = MALFORMED  # aiohttp's own handler: its answer quotes the raw bytes
    else:
        try:
            ex.rejected = HTTPStatus(response.status).phrase.lower().replace(" ", "_")
        except ValueError:
            ex.rejected = str(response.status)
    return ex


def rejection_args(config: Config, metrics: Metrics | None) -> dict[str, Any]:
    """The request handler arguments that account for an app's rejections: an access
    logger bound to its ``config`` and ``metrics`` (and ``access_log``: aiohttp makes
    none without a logger)."""
    bound = type("RejectionLog", (RejectionLog,), {"config": config, "metrics": metrics})
    return {"access_log": access_log, "access_log_class": bound}
