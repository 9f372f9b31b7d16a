"""OpenTelemetry traces: a span per request, a child span per upstream attempt.

Optional: the ``nexus-gateway[otel]`` extra and ``[telemetry] otlp_endpoint`` turn it
on. Without the endpoint nothing imports OpenTelemetry and every call is a ``None``
check; with it but without the packages, :meth:`Telemetry.from_config` refuses to
start (:class:`~nexus.errors.ConfigError`): tracing asked for must not go missing.

The request span (:class:`RequestSpan`, opened by the access middleware) is current
while the handler runs, so a stream's run (a task that copies the handler's context) and
the engine's :class:`Attempt` spans are its children; a background request's span ends
with its run (:func:`end_with`), not its ``202``, and says how the run ended (an error,
a cancellation). An incoming ``traceparent`` makes it a child of the caller's span, and
:func:`upstream_headers` sends the attempt's upstream. Sampling is parent-based,
``sample_ratio`` deciding for new traces. The caller's ``tracestate`` is not taken in:
the gateway is a trust boundary, and the upstream is a third party that has no business
reading a tenant's tracing vendors' entries (W3C Trace Context, "Security": keep
``tracestate`` out of requests to external systems); the trace id and the sampled flag
are all that cross it.

Attributes follow the OpenTelemetry GenAI semantic conventions (``gen_ai.provider.name``,
not the replaced ``gen_ai.system``); the first output sets
``gen_ai.response.time_to_first_chunk`` and one ``gen_ai.first_token`` event. Nothing
is done per chunk. Traces carry no prompt, completion, key or upstream error message.

Span names are low-cardinality, as the conventions require (a trace backend keeps a list
of operations by name): the route pattern for a request, ``chat`` and the model's bounded
name for an attempt (the metrics' ``model`` label); never a path or a model a client
chose. Attributes that hold a client's text (``url.path``, the models) go through the
access line's redaction, so a key a client puts there is not exported. Both functions are
the server's, which gives them to its :class:`Telemetry` (:attr:`Telemetry.model_label`,
:attr:`Telemetry.redact`): this module is below the server and imports none of it.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import importlib
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

from .errors import ConfigError
from .events import Delta, StreamEvent, Usage
from .protocol.upstream import redacted

if TYPE_CHECKING:
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter
    from opentelemetry.trace import Span

    from .config import TelemetryConfig
    from .request import ChatRequest

__all__ = [
    "Attempt",
    "RequestSpan",
    "Telemetry",
    "check_installed",
    "end_with",
    "request_model",
    "upstream_headers",
]

INSTALL_HINT = "pip install 'nexus-gateway[otel]'"

PROVIDER_NAMES = {"openai": "openai", "anthropic": "anthropic", "mock": "nexus.mock"}
"""``gen_ai.provider.name`` by provider kind: any OpenAI-compatible server is ``openai``
(the wire spoken; ``server.address`` tells the host)."""

_HTTP_METHODS = frozenset(
    {"CONNECT", "DELETE", "GET", "HEAD", "OPTIONS", "PATCH", "POST", "PUT", "TRACE"}
)

_ATTEMPT: contextvars.ContextVar[Attempt | None] = contextvars.ContextVar(
    "nexus_attempt", default=None
)
"""The upstream attempt being made in this task (its span goes upstream)."""
_REQUEST: contextvars.ContextVar[RequestSpan | None] = contextvars.ContextVar(
    "nexus_request_span", default=None
)
"""The request span of the handler running in this task."""

Ended = Callable[[], tuple[str | None, str | None]]
"""How a run ended, once it has: the code of the error it failed with, and the reason it
was ended early for; None for each it did not (:func:`end_with`)."""


class Telemetry:
    """A tracer and the W3C propagator around an SDK ``TracerProvider``; one per app."""

    def __init__(self, provider: TracerProvider) -> None:
        from opentelemetry import context, trace
        from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

        self.provider = provider
        self.tracer = provider.get_tracer("nexus")
        self.propagator = TraceContextTextMapPropagator()
        self._context = context
        self._trace = trace
        self.redact: Callable[[str], str] = _withheld
        """Applied to every attribute that holds a client's text (or an upstream's echo of
        it). The app gives the access line's, :func:`nexus.server.redaction.redact`; until
        then such text is withheld whole."""
        self.model_label: Callable[[str | None], str] = _unknown
        """A model's bounded name, for span names. The app gives the one its metrics use,
        :class:`nexus.server.metrics.ModelLabels`; until then every model is ``unknown``."""

    @classmethod
    def from_config(
        cls, config: TelemetryConfig, *, exporter: SpanExporter | None = None
    ) -> Telemetry | None:
        """The tracing ``[telemetry]`` describes (spans to ``exporter`` instead, when
        given); None when ``otlp_endpoint`` is unset. Raises
        :class:`~nexus.errors.ConfigError` when the OpenTelemetry packages are missing."""
        if config.otlp_endpoint is None and exporter is None:
            return None
        _require(_SDK if exporter is not None else (*_SDK, _EXPORTER))
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import SpanLimits, TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
        from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased

        provider = TracerProvider(
            resource=Resource.create({"service.name": config.service_name}),
            sampler=ParentBased(TraceIdRatioBased(config.sample_ratio)),
            # Client-chosen strings reach attributes: bounded, whatever a caller sends.
            span_limits=SpanLimits(max_attribute_length=1024),
        )
        if exporter is None:
            assert config.otlp_endpoint is not None
            # A worker thread batches and sends: the event loop never waits on the collector.
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

            endpoint = traces_url(config.otlp_endpoint)
            provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        else:
            provider.add_span_processor(SimpleSpanProcessor(exporter))
        return cls(provider)

    def shutdown(self) -> None:
        """Export what is pending and stop (at the app's end)."""
        self.provider.shutdown()

    async def close(self, timeout_s: float) -> bool:
        """:meth:`shutdown`, waited for ``timeout_s`` at most (False: given up). In a
        thread of its own, a daemon: an exporter retrying a collector that is down or does
        not answer would hold the process past its shutdown's bound (an orchestrator then
        kills it mid-close, spend not yet charged); its last spans are dropped instead."""
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def run() -> None:
            try:
                self.shutdown()
            finally:
                with contextlib.suppress(RuntimeError):  # (the loop closed meanwhile)
                    loop.call_soon_threadsafe(done.set_result, None)

        threading.Thread(target=run, name="nexus-telemetry-close", daemon=True).start()
        try:
            await asyncio.wait_for(done, timeout_s)
        except TimeoutError:
            return False
        return True

    def request_span(
        self,
        method: str,
        route: str | None,
        path: str,
        headers: Mapping[str, str],
        *,
        scheme: str,
        request_id: str,
        client_request_id: str | None = None,
    ) -> RequestSpan:
        """Open the SERVER span of one HTTP request, current in this task until
        :meth:`RequestSpan.close`. ``route`` is the matched pattern (None: none matched),
        the span's name with the method; ``path`` is the client's, redacted. ``headers``
        may carry the caller's ``traceparent`` (its ``tracestate`` is not read: see the
        module docstring)."""
        known = method if method in _HTTP_METHODS else "_OTHER"
        name = "HTTP" if known == "_OTHER" else known
        if route is not None:
            name += " " + route
        attributes: dict[str, Any] = {
            "http.request.method": known,
            "url.path": self.redact(path),
            "url.scheme": scheme,
            "nexus.request_id": request_id,
        }
        if route is not None:
            attributes["http.route"] = route
        if client_request_id is not None:
            attributes["nexus.client_request_id"] = client_request_id
        parent = self.propagator.extract({"traceparent": headers.get("traceparent", "")})
        span = self.tracer.start_span(
            name, parent, kind=self._trace.SpanKind.SERVER, attributes=attributes
        )
        token = self._context.attach(self._trace.set_span_in_context(span, parent))
        return RequestSpan(self, span, token)

    def attempt(
        self, provider: str, kind: str, model: str, request: ChatRequest, index: int
    ) -> Attempt:
        """Open the CLIENT span of one upstream attempt (a child of the current span),
        the one :func:`upstream_headers` sends upstream from this task. It is named by
        the bounded name of ``provider/model``, not by ``model`` (a client may choose it)."""
        attributes: dict[str, Any] = {
            "gen_ai.operation.name": "chat",
            "gen_ai.provider.name": PROVIDER_NAMES.get(kind, kind),
            "gen_ai.request.model": self.redact(model),
            "gen_ai.request.stream": True,  # the gateway always streams from upstream
            "nexus.provider": provider,
            "nexus.attempt": index,
        }
        if request.token_limit is not None:
            attributes["gen_ai.request.max_tokens"] = request.token_limit
        if request.temperature is not None:
            attributes["gen_ai.request.temperature"] = request.temperature
        if request.top_p is not None:
            attributes["gen_ai.request.top_p"] = request.top_p
        started = time.time_ns()
        span = self.tracer.start_span(
            f"chat {self.model_label(f'{provider}/{model}')}",
            kind=self._trace.SpanKind.CLIENT,
            attributes=attributes,
            start_time=started,
        )
        attempt = Attempt(self, span, started)
        _ATTEMPT.set(attempt)
        return attempt


class RequestSpan:
    """The SERVER span of one HTTP request (see :meth:`Telemetry.request_span`)."""

    __slots__ = ("_request", "_telemetry", "_token", "ended", "span", "until")

    def __init__(self, telemetry: Telemetry, span: Span, token: object) -> None:
        self._telemetry = telemetry
        self.span = span
        self._token = token
        self._request = _REQUEST.set(self)
        self.until: asyncio.Future[Any] | None = None
        """Set by :func:`end_with`: the span ends when this is done, not at :meth:`close`."""
        self.ended: Ended | None = None
        """Set by :func:`end_with`: how the run ended, asked once :attr:`until` is done."""

    def close(
        self,
        status: int,
        stream_id: str = "",
        cancelled: str | None = None,
        stream_error: str | None = None,
    ) -> None:
        """The response is out (or the handler failed): record ``status`` (a 5xx is an
        error, and so is a stream that ended with the error ``stream_error`` after its
        headers: its status stays 200), leave the span's context, and end it, or have it
        end with its run, recording how the run ended (:attr:`ended`)."""
        telemetry = self._telemetry
        _REQUEST.reset(self._request)
        telemetry._context.detach(self._token)
        span = self.span
        span.set_attribute("http.response.status_code", status)
        if stream_id:
            span.set_attribute("nexus.stream.id", stream_id)
        _mark(telemetry, span, str(status) if status >= 500 else stream_error, cancelled)
        until, ended = self.until, self.ended
        if until is None or ended is None:
            span.end()
        elif until.done():
            _end_run(telemetry, span, ended)
        else:  # (the callback holds the span and the run's outcome alone, until the run ends)
            until.add_done_callback(lambda _: _end_run(telemetry, span, ended))


def _mark(telemetry: Telemetry, span: Span, error: str | None, cancelled: str | None) -> None:
    """``error`` (a code): the span's ``error.type`` and error status; ``cancelled``: why it
    was ended early (no error)."""
    if cancelled is not None:
        span.set_attribute("nexus.cancelled", cancelled)
    if error is not None:
        span.set_attribute("error.type", error)
        span.set_status(telemetry._trace.Status(telemetry._trace.StatusCode.ERROR))


def _end_run(telemetry: Telemetry, span: Span, ended: Ended) -> None:
    """The run a span waited for is done: how it ended, then the span's end."""
    try:
        _mark(telemetry, span, *ended())
    finally:
        span.end()


class Attempt:
    """The CLIENT span of one upstream attempt (see :meth:`Telemetry.attempt`)."""

    __slots__ = ("_started", "_telemetry", "done", "span")

    def __init__(self, telemetry: Telemetry, span: Span, started: int) -> None:
        self._telemetry = telemetry
        self.span = span
        self._started = started
        self.done = False

    def first_output(self) -> None:
        """The attempt's first events arrived (once per attempt)."""
        now = time.time_ns()
        self.span.set_attribute("gen_ai.response.time_to_first_chunk", (now - self._started) / 1e9)
        self.span.add_event("gen_ai.first_token", timestamp=now)

    def answered(self, *tail: list[StreamEvent] | None) -> None:
        """The upstream ended its stream well; ``tail``, its last reads, holds the
        finish reason and the usage."""
        span = self.span
        usage, finish = _outcome(tail)
        if usage is not None:
            span.set_attribute("gen_ai.usage.input_tokens", usage.prompt_tokens)
            span.set_attribute("gen_ai.usage.output_tokens", usage.completion_tokens)
            if usage.cached_tokens is not None:
                span.set_attribute("gen_ai.usage.cache_read.input_tokens", usage.cached_tokens)
            if usage.reasoning_tokens is not None:
                span.set_attribute("gen_ai.usage.reasoning.output_tokens", usage.reasoning_tokens)
        if finish is not None:
            span.set_attribute("gen_ai.response.finish_reasons", [finish])
        self.done = True

    def failed(self, code: str) -> None:
        """The attempt failed with the error ``code`` (before or after its first output)."""
        trace = self._telemetry._trace
        self.span.set_attribute("error.type", code)
        self.span.set_status(trace.Status(trace.StatusCode.ERROR, code))
        self.done = True

    def end(self, response_model: str | None = None) -> None:
        """End the span (an attempt neither answered nor failed was cancelled).
        ``response_model``: the model the upstream said answered (the ``model`` of its
        chunks), redacted (it may echo the client's); None leaves
        ``gen_ai.response.model`` out rather than guess it from the request."""
        if not self.done:
            self.span.set_attribute("nexus.cancelled", True)
        if response_model:
            # The upstream's word: without the provider keys an upstream may echo, too.
            model = self._telemetry.redact(redacted(response_model))
            self.span.set_attribute("gen_ai.response.model", model)
        self.span.end()
        if _ATTEMPT.get() is self:
            _ATTEMPT.set(None)

    def outgoing(self, headers: dict[str, str], url: str) -> dict[str, str]:
        """A copy of ``headers`` with this attempt's trace context; the upstream's address
        goes on the span."""
        parts = urlsplit(url)
        if parts.hostname:
            self.span.set_attribute("server.address", parts.hostname)
            port = parts.port or (443 if parts.scheme == "https" else 80)
            self.span.set_attribute("server.port", port)
        telemetry = self._telemetry
        carrier = dict(headers)
        context: Context = telemetry._trace.set_span_in_context(self.span)
        telemetry.propagator.inject(carrier, context=context)
        return carrier


def _withheld(text: str) -> str:
    return "[withheld]"


def _unknown(model: str | None) -> str:
    return "unknown"


def upstream_headers(headers: dict[str, str], url: str) -> dict[str, str]:
    """``headers`` for an upstream request to ``url``, with the current attempt's trace
    context when there is one."""
    attempt = _ATTEMPT.get()
    if attempt is None:
        return headers
    return attempt.outgoing(headers, url)


def request_model(model: str) -> None:
    """Note the model the client asked for on the current request span (redacted)."""
    current = _REQUEST.get()
    if current is not None:
        current.span.set_attribute("gen_ai.operation.name", "chat")
        current.span.set_attribute("gen_ai.request.model", current._telemetry.redact(model))


def end_with(until: asyncio.Future[Any], ended: Ended) -> None:
    """Have the current request span end when ``until`` (a background run) is done, then
    record how ``ended`` says the run ended: the run's failure after the ``202`` is the
    request's, as a stream's failure after its headers is."""
    request = _REQUEST.get()
    if request is not None:
        request.until = until
        request.ended = ended


_SDK = ("opentelemetry.trace.propagation.tracecontext", "opentelemetry.sdk.trace.sampling")
_EXPORTER = "opentelemetry.exporter.otlp.proto.http.trace_exporter"


def check_installed(config: TelemetryConfig) -> None:
    """Raise :class:`~nexus.errors.ConfigError` if ``config`` turns tracing on without
    the ``otel`` extra (``nexus serve`` asks before it starts any worker)."""
    if config.otlp_endpoint is not None:
        _require((*_SDK, _EXPORTER))


def _require(modules: tuple[str, ...]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except ImportError as exc:
            raise ConfigError(
                "[telemetry] otlp_endpoint is set, but the OpenTelemetry packages are not "
                f"installed (no {exc.name or name}): {INSTALL_HINT}, or unset otlp_endpoint"
            ) from None


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of a collector address."""
    endpoint = endpoint.rstrip("/")
    return endpoint if endpoint.endswith("/v1/traces") else endpoint + "/v1/traces"


def _outcome(tail: tuple[list[StreamEvent] | None, ...]) -> tuple[Usage | None, str | None]:
    """The last usage and the last finish reason in ``tail`` (reads, oldest first)."""
    usage: Usage | None = None
    finish: str | None = None
    for batch in reversed(tail):
        for event in reversed(batch or ()):
            if usage is None and type(event) is Usage:
                usage = event
            elif finish is None and type(event) is Delta and event.finish_reason is not None:
                finish = event.finish_reason
            if usage is not None and finish is not None:
                return usage, finish
    return usage, finish
