"""Prometheus metrics, one registry per app (``GET /metrics``).

Counted at the edges, never per event in a hot loop: the access middleware
counts requests and times them, the pump adds events and bytes once per write
(what upstream delivered together), the hub's hooks see streams start and end.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..events import Error
from ..hooks import CallContext

__all__ = ["CANCEL_CAUSES", "CONTENT_TYPE_LATEST", "Metrics", "MetricsPlugin"]

CANCEL_CAUSES = {
    "stream_detached": "detach_timeout",
    "stream_cancelled": "cancelled",
    "max_stream_duration": "max_duration",
    "server_shutting_down": "shutdown",
    "stream_too_large": "too_large",
}
"""Error codes that end a stream on purpose, and the cancellation cause each counts as."""

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_DURATION = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)


class Metrics:
    """The gateway's metrics. Labels hold names only, never keys or contents."""

    def __init__(self, active_streams: Callable[[], float]) -> None:
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.requests = Counter(
            "nexus_requests",
            "HTTP requests by endpoint, stream format and status.",
            ("endpoint", "format", "status"),
            registry=registry,
        )
        self.active = Gauge(
            "nexus_active_streams", "Streams running in this process.", registry=registry
        )
        self.active.set_function(active_streams)
        self.ttfb = Histogram(
            "nexus_time_to_first_byte_seconds",
            "From the request to the first byte of a stream's body.",
            ("endpoint", "format"),
            buckets=_LATENCY,
            registry=registry,
        )
        self.duration = Histogram(
            "nexus_stream_duration_seconds",
            "From the request to the end of a stream's body.",
            ("endpoint", "format"),
            buckets=_DURATION,
            registry=registry,
        )
        self.events = Counter(
            "nexus_events_out", "Stream events written to clients.", ("format",), registry=registry
        )
        self.bytes = Counter(
            "nexus_bytes_out", "Stream bytes written to clients.", ("format",), registry=registry
        )
        self.upstream_errors = Counter(
            "nexus_upstream_errors",
            "Streams that failed upstream, by provider and error code.",
            ("provider", "kind"),
            registry=registry,
        )
        self.cancellations = Counter(
            "nexus_cancellations",
            "Streams or responses ended early, by cause.",
            ("cause",),
            registry=registry,
        )
        self.cache = Counter(
            "nexus_cache", "Stream cache lookups by result.", ("result",), registry=registry
        )
        self.resumes = Counter(
            "nexus_resumes", "Attaches that resumed after a Last-Event-ID.", registry=registry
        )
        self.hook_errors = Counter(
            "nexus_hook_errors", "Plugin hooks that raised.", ("hook",), registry=registry
        )
        self._hook_errors_seen: dict[str, int] = {}

    def render(self, hook_errors: Mapping[str, int] | None = None) -> bytes:
        for hook, total in (hook_errors or {}).items():
            counted = self._hook_errors_seen.get(hook, 0)
            if total > counted:
                self.hook_errors.labels(hook).inc(total - counted)
                self._hook_errors_seen[hook] = total
        return generate_latest(self.registry)


class MetricsPlugin:
    """Counts each stream's end once, whoever reads it: through the lifecycle hooks."""

    def __init__(self, metrics: Metrics, provider_of: Callable[[str], str]) -> None:
        self.metrics = metrics
        self.provider_of = provider_of

    async def on_stream_failed(
        self, ctx: CallContext, request_id: str, model: str, error: Error
    ) -> None:
        code = error.code or error.error_type
        cause = CANCEL_CAUSES.get(code)
        if cause is not None:
            self.metrics.cancellations.labels(cause).inc()
        else:
            self.metrics.upstream_errors.labels(self.provider_of(model), code).inc()
