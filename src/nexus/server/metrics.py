"""Prometheus metrics, one registry per app (``GET /metrics``).

Counted at the edges, never per event: the access middleware counts and times
requests, the pump adds events and bytes once per write (a realtime socket its turns'
frames: :class:`~nexus.server.routes.realtime_turn.FrameMeter`), the hub's hooks see streams
start and end (spend is counted once per stream, estimated for one cut short), and
the providers, the store and the hub report pool waits, store errors and mirror
states through callbacks (:meth:`Metrics.watch`).

Labels stay few and never empty: ``model`` is an alias or advertised model as asked,
``<provider>/*`` for any other model of a provider, else ``unknown`` (:class:`ModelLabels`,
which names the spans' upstream attempts too); ``key`` is the
key's name (``anonymous`` without keys); the gateway's own error codes are labels, and
of the codes upstreams mint, the first :data:`MAX_CODES` seen, ``other`` after them.

Several workers (``nexus serve --workers N``): each calls :func:`enable_multiprocess`
after the fork, and ``/metrics`` on any worker adds up every worker's files
(prometheus_client's multiprocess mode); ``nexus_active_streams`` is a ``livesum``
gauge over the workers alive (the supervisor calls :func:`mark_worker_dead`).
"""

from __future__ import annotations

import asyncio
import os
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any, Self

import prometheus_client
from prometheus_client import (
    CollectorRegistry,
    Gauge,
    disable_created_metrics,
    generate_latest,
    multiprocess,
    values,
)
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from ..errors import GATEWAY_CODES
from ..events import Error
from ..hooks import CallContext, Hooks
from ..pricing import Spend
from ..providers.http import HTTPProvider
from ..types import Completion

if TYPE_CHECKING:
    from ..cache.hub import StreamHub

__all__ = [
    "CANCEL_CAUSES",
    "CONTENT_TYPE_LATEST",
    "Metrics",
    "MetricsPlugin",
    "ModelLabels",
    "enable_multiprocess",
    "mark_worker_dead",
]

CANCEL_CAUSES = {
    "stream_detached": "detach_timeout",
    "max_stream_duration": "max_duration",
    "server_shutting_down": "shutdown",
    "stream_too_large": "too_large",
}
"""Error codes that end a stream on purpose for a reason of the stream's own, and the
cancellation cause each counts as (once per stream, by :class:`MetricsPlugin`). What a
request or a realtime turn did is counted by it (:meth:`Metrics.observe`): its client
leaving, a timeout of its connection, a WebSocket ``abort``; and a ``DELETE`` of a stream
by that request (``cancelled``). A stream its request let go early ends ``stream_cancelled``
(:func:`~nexus.cache.readers.leave`): that request counted why."""

_CAUSE_LABELS = {"aborted": "cancelled"}
"""A realtime turn's ``abort`` counts as a ``DELETE`` does: the client cancelled it."""

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_POOL_WAIT = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
_DURATION = (0.1, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 900.0)

# No ``*_created`` series (they doubled the page; multiprocess mode has none). Process-wide.
disable_created_metrics()  # type: ignore[no-untyped-call]

MAX_CODES = 64
"""Most upstreams' own error codes that are label values of their own (per process):
without a bound ``/metrics`` could grow without end. The gateway's own codes
(:data:`~nexus.errors.GATEWAY_CODES`) are always theirs: an upstream that minted 64 codes
must not turn the alerts on ``error:budget_exceeded`` into ``error:other``."""
OTHER = "other"
_CODE = re.compile(r"[A-Za-z0-9_.-]{1,64}")

ANONYMOUS = "anonymous"
UNKNOWN = "unknown"
NO_MODEL = "none"
"""The ``model`` of a realtime ``start`` refused before it named a model the gateway serves
(on ``/v1/realtime``, ``unknown`` is the sockets')."""
REALTIME = "/v1/realtime"

_shared_dir: str | None = None
"""The multiprocess directory once :func:`enable_multiprocess` ran (None: one process)."""


def enable_multiprocess(directory: str) -> None:
    """Make this process one of several workers whose metrics ``/metrics`` adds up.

    Call it in each worker after the fork, before ``create_app``: metrics made from then
    on keep their values in ``directory`` (the supervisor's). Raises :class:`ValueError`
    when ``directory`` is not a directory.
    """
    global _shared_dir
    if not os.path.isdir(directory):
        raise ValueError(f"metrics directory {directory!r} is not a directory")
    # prometheus_client picks its value class when it is first imported, from this
    # variable; the supervisor imported it already, so the class is swapped here too.
    # MultiProcessValue() takes this process's pid for its file names: after the fork.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = directory
    values.ValueClass = values.MultiProcessValue()  # type: ignore[no-untyped-call]
    _shared_dir = directory


def mark_worker_dead(directory: str, pid: int) -> None:
    """Forget the live gauges of the ended worker ``pid`` (its counters still count)."""
    multiprocess.mark_process_dead(pid, directory)  # type: ignore[no-untyped-call]


class _CachedLabels:
    """:meth:`labels` finding a label set's child in one dict lookup, once prometheus_client
    made it (its own ``labels()`` checks, stringifies and locks every call: several
    microseconds, several times per request). Children are never removed here, so the
    cache stays true."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._children: dict[tuple[object, ...], Self] = {}

    def labels(self, *values: object, **named: object) -> Self:
        if named:
            return super().labels(*values, **named)  # type: ignore[misc, no-any-return]
        child = self._children.get(values)
        if child is None:
            made: Self = super().labels(*values)  # type: ignore[misc]
            child = self._children[values] = made
        return child


class Counter(_CachedLabels, prometheus_client.Counter):
    """A counter with cached label children (:class:`_CachedLabels`)."""


class Histogram(_CachedLabels, prometheus_client.Histogram):
    """A histogram with cached label children (:class:`_CachedLabels`)."""


class ModelLabels:
    """A model's bounded name: itself when it is an alias or an advertised model, else
    ``<provider>/*`` when it names a provider, else ``unknown``. What a client asks for
    is unbounded; this is the one map from it to a name that is not, for the metrics'
    ``model`` label and the spans' names (:mod:`nexus.telemetry`)."""

    __slots__ = ("models", "providers")

    def __init__(self, models: Iterable[str] = (), providers: Iterable[str] = ()) -> None:
        self.models = frozenset(models)
        """Model ids that are names as they are (aliases, advertised models)."""
        self.providers = frozenset(providers)
        """Provider names (``<provider>/*``)."""

    def __call__(self, model: str | None) -> str:
        if model is None:
            return UNKNOWN
        if model in self.models:
            return model
        provider, slash, _ = model.partition("/")
        return f"{provider}/*" if slash and provider in self.providers else UNKNOWN


class Metrics:
    """The gateway's metrics. Labels hold names only, never keys or contents."""

    def __init__(self) -> None:
        self.shared_dir = _shared_dir
        """The multiprocess directory, or None (this process alone)."""
        self.registry = registry = CollectorRegistry(auto_describe=True)
        self.model_label = ModelLabels()
        """The ``model`` label of a model (the app gives it the engine's models)."""
        self._codes: set[str] = set()  # the error codes that are labels of their own
        self._rendering: asyncio.Future[bytes] | None = None  # the render scrapes share

        def counter(name: str, doc: str, labels: tuple[str, ...] = ()) -> Counter:
            return Counter(name, doc, labels, registry=registry)

        def histogram(
            name: str, doc: str, labels: tuple[str, ...], buckets: tuple[float, ...]
        ) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=registry)

        self.requests = counter(
            "nexus_requests",
            "HTTP requests by endpoint, model asked for and outcome (ok, error:<code>, "
            "cancelled:<reason>, mid_stream_error:<code>, rejected:<kind>).",
            ("endpoint", "model", "outcome"),
        )
        self.tokens = counter(
            "nexus_tokens",
            "Tokens spent upstream by model asked for, key name and kind (prompt, completion, "
            "cached, cache_write, reasoning); estimated for streams cut before their final "
            "usage.",
            ("model", "key", "kind"),
        )
        self.cost = counter(
            "nexus_cost_usd",
            "What streams cost upstream, in USD, by model asked for and key name (models "
            "with a price only).",
            ("model", "key"),
        )
        self.failed_tokens = counter(
            "nexus_failed_attempt_prompt_tokens",
            "Prompt tokens of upstream attempts that failed after the upstream took the "
            "request (a fallback followed, or the error): they may be billed upstream, and "
            "are charged to no budget. By model asked for and key name; estimated unless the "
            "upstream counted them.",
            ("model", "key"),
        )
        self.failed_cost = counter(
            "nexus_failed_attempt_cost_usd",
            "What those failed attempts may have cost upstream, in USD, by model asked for "
            "and key name (targets with a price only); not in nexus_cost_usd.",
            ("model", "key"),
        )
        self.ttft = histogram(
            "nexus_time_to_first_token_seconds",
            "From the request to the first event of its stream, by model asked for (streams "
            "that produced output, replays excepted).",
            ("model",),
            _LATENCY,
        )
        self.active = Gauge(
            "nexus_active_streams",
            "Streams running in this process."
            if _shared_dir is None
            else "Streams running, in all the workers alive.",
            registry=registry,
            multiprocess_mode="livesum",  # several workers: the sum over those alive
        )
        self.ttfb = histogram(
            "nexus_time_to_first_byte_seconds",
            "From the request to the first byte of a stream's body.",
            ("endpoint", "format"),
            _LATENCY,
        )
        self.duration = histogram(
            "nexus_stream_duration_seconds",
            "From the request to the end of a stream's body, by model asked for (streams that "
            "produced output and ended ok, replays excepted).",
            ("model",),
            _DURATION,
        )
        self.events = counter(
            "nexus_events_out",
            "Stream events written to clients, by format (websocket: realtime turns' frames).",
            ("format",),
        )
        self.bytes = counter(
            "nexus_bytes_out",
            "Stream bytes written to clients, by format (websocket: realtime turns' frames).",
            ("format",),
        )
        self.upstream_errors = counter(
            "nexus_upstream_errors",
            "Failed upstream attempts, by the provider tried and the error code (those a "
            "fallback recovered from included).",
            ("provider", "code"),
        )
        self.cancellations = counter(
            "nexus_cancellations", "Streams or responses ended early, by cause.", ("cause",)
        )
        self.cache = counter("nexus_cache", "Stream cache lookups by result.", ("result",))
        self.resumes = counter("nexus_resumes", "Attaches that resumed after a Last-Event-ID.")
        self.hook_errors = counter("nexus_hook_errors", "Plugin hooks that raised.", ("hook",))
        self.pool_wait = histogram(
            "nexus_upstream_pool_wait_seconds",
            "Each upstream request's wait for a free connection of its provider's pool "
            "(max_connections); 0 when one was free.",
            ("provider",),
            _POOL_WAIT,
        )
        self.store_errors = counter(
            "nexus_store_errors",
            "Store operations that failed, by operation and cause: busy (no turn of the "
            "pipeline, or no connection, within [store] pool_timeout_s), unreachable "
            "(Redis failed or did not answer) or refused (an error reply: OOM, NOPERM, ...).",
            ("op", "cause"),
        )
        self.store_evictions = counter(
            "nexus_store_evictions",
            "Logs and recordings a store pushed out before their TTL: key_limit (a key past "
            "[store] max_bytes_per_key, its own oldest), store_full (past max_bytes).",
            ("reason",),
        )
        self.store_mirror = counter(
            "nexus_store_mirror",
            "Streams whose log mirror into the shared store fell behind (behind: it cannot "
            "be resumed elsewhere meanwhile), caught up, or was given up (abandoned).",
            ("state",),
        )
        self.metrics_refused = counter(
            "nexus_metrics_refused",
            "Requests for /metrics refused: token (401, a missing or wrong bearer token), "
            "token_not_set (403, a gateway with keys and no [metrics] token_env), not_local "
            "(403, a keyless gateway asked from another machine or by a name not loopback), "
            "origin (403, asked by a page of a site not in [cors] allow_origins).",
            ("reason",),
        )
        self.connections_refused = counter(
            "nexus_connections_refused",
            "Connections refused at [server] max_connections (a 503 without the app, or "
            "closed at once when too many refused ones were still being answered).",
        )

    def observe(
        self,
        endpoint: str,
        model: str | None,
        outcome: str,
        elapsed: float,
        ttft: float | None,
        *,
        cache: str | None = None,
        cancelled: str | None = None,
    ) -> None:
        """Count one request, or one realtime turn, by its model and outcome, and what ended
        it early (``cancelled``: its client leaving, a timeout, a WebSocket ``abort``).

        The histograms time what upstreams serve: a stream that produced output (``ttft``,
        None for one that failed or ended before its first event), not a replay (``cache``
        ``hit``: its pace is the cache's), has its time to first token observed, and, if
        it ended ``ok``, its duration (one cut short says when it was cut, not how long an
        answer takes; the outcome counts it)."""
        label = self.model_label(model)
        self.requests.labels(endpoint, label, self.outcome_label(outcome)).inc()
        if cancelled is not None:
            self.cancellations.labels(_CAUSE_LABELS.get(cancelled, cancelled)).inc()
        if ttft is not None and cache != "hit":
            self.ttft.labels(label).observe(ttft)
            if outcome == "ok":
                self.duration.labels(label).observe(elapsed)

    def refused_start(self, model: str | None, code: str) -> None:
        """A realtime ``start`` refused (``error:<code>``), counted under the model it named
        when the gateway serves it, else :data:`NO_MODEL`: on ``/v1/realtime``, ``unknown``
        counts the sockets alone."""
        label = self.model_label(model)
        label = NO_MODEL if label == UNKNOWN else label
        self.requests.labels(REALTIME, label, self.outcome_label(f"error:{code}")).inc()

    def code_label(self, code: str) -> str:
        """An error code's label: itself for the gateway's own, and for the first
        :data:`MAX_CODES` sane codes seen of the others."""
        codes = self._codes
        if code in codes or code in GATEWAY_CODES:
            return code
        if len(codes) < MAX_CODES and _CODE.fullmatch(code):
            codes.add(code)
            return code
        return OTHER

    def outcome_label(self, outcome: str) -> str:
        """The label of an outcome: ``error:<code>`` and ``mid_stream_error:<code>`` with
        the code's label (:meth:`code_label`); ``cancelled:`` and ``rejected:`` ones name
        the gateway's own causes and kinds, a few fixed names."""
        kind, colon, code = outcome.partition(":")
        if not colon or kind in ("cancelled", "rejected"):  # ok; the gateway's own names
            return outcome
        return f"{kind}:{self.code_label(code)}"

    def spent(self, model: str, key: str | None, spend: Spend) -> None:
        """Count a stream's spend (once per stream, at its end), and apart, what its
        failed attempts may have cost."""
        label = self.model_label(model)
        owner = key if key is not None else ANONYMOUS
        for kind, count in (
            ("prompt", spend.prompt_tokens),
            ("completion", spend.completion_tokens),
            ("cached", spend.cached_tokens),
            ("cache_write", spend.cache_write_tokens),
            ("reasoning", spend.reasoning_tokens),
            ("prompt_audio", spend.prompt_audio_tokens),
            ("completion_audio", spend.completion_audio_tokens),
        ):
            if count > 0:
                self.tokens.labels(label, owner, kind).inc(count)
        if spend.cost_usd:
            self.cost.labels(label, owner).inc(spend.cost_usd)
        failed = spend.failed_attempts
        if failed is not None:
            if failed.prompt_tokens > 0:
                self.failed_tokens.labels(label, owner).inc(failed.prompt_tokens)
            if failed.cost_usd:
                self.failed_cost.labels(label, owner).inc(failed.cost_usd)

    def watch(self, hub: StreamHub, hooks: Hooks) -> None:
        """Follow the hub's running streams, the hooks' errors, the HTTP providers' pool
        waits and the store's errors (once, before the app starts).

        One process: ``nexus_active_streams`` reads ``len(hub.live)`` at scrape time;
        several: the hub sets it on every change, for scrapes on other workers.
        """
        if self.shared_dir is None:
            self.active.set_function(lambda: len(hub.live))
        else:
            hub.on_live = self.active.set
            self.active.set(len(hub.live))
        counter = self.hook_errors
        for hook, count in hooks.errors.items():
            if count > 0:
                counter.labels(hook).inc(count)
        hooks.on_error.append(lambda hook: counter.labels(hook).inc())
        for provider in hub.engine.providers.values():
            if isinstance(provider, HTTPProvider):
                provider.on_pool_wait.append(self.pool_wait.labels(provider.name).observe)
        store_errors = self.store_errors
        hub.store.on_error.append(lambda op, cause: store_errors.labels(op, cause).inc())
        evictions = self.store_evictions
        hub.store.on_evict.append(lambda why, count: evictions.labels(why).inc(count))
        store_mirror = self.store_mirror
        hub.on_mirror = lambda state: store_mirror.labels(state).inc()
        upstream_errors, code_label = self.upstream_errors, self.code_label
        hub.engine.on_upstream_error = lambda provider, code: upstream_errors.labels(
            provider, code_label(code)
        ).inc()

    async def scrape(self) -> bytes:
        """:meth:`render`, in a thread, one render at a time: a scrape arriving while one
        renders gets that render's page.

        On the event loop a render (a third of a second for 25,000 series) stalled every
        stream of the process for its length; in a thread the loop takes the GIL back
        within the interpreter's switch interval. prometheus_client collects under its own
        locks (it serves scrapes from a thread itself), the multiprocess files are read as
        other workers write them, and ``nexus_active_streams`` reads ``len()`` of a dict.
        A client that leaves cancels its wait, not the render the others wait for.
        """
        rendering = self._rendering
        if rendering is None:
            rendering = self._rendering = asyncio.ensure_future(asyncio.to_thread(self.render))
            rendering.add_done_callback(self._rendered)
        return await asyncio.shield(rendering)

    def _rendered(self, rendering: asyncio.Future[bytes]) -> None:
        """The next scrape renders anew (a failure is its waiters' to raise, and retrieved
        here so that none left unwaited is logged as never retrieved)."""
        self._rendering = None
        if not rendering.cancelled():
            rendering.exception()

    def render(self) -> bytes:
        """The Prometheus text format: this app's registry, or every worker's files."""
        if self.shared_dir is None:
            return generate_latest(self.registry)
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, self.shared_dir)  # type: ignore[no-untyped-call]
        return generate_latest(registry)


class MetricsPlugin:
    """Counts each stream's end once, whoever reads it: through the lifecycle hooks."""

    wants_final = False  # the spend is all it reads of a completed stream

    def __init__(self, metrics: Metrics) -> None:
        self.metrics = metrics

    async def on_stream_completed(
        self,
        ctx: CallContext,
        request_id: str,
        model: str,
        provider: str,
        elapsed: float,
        final: Completion,
        *,
        spend: Spend,
    ) -> None:
        self.metrics.spent(model, ctx.key, spend)

    async def on_stream_failed(
        self, ctx: CallContext, request_id: str, model: str, error: Error, *, spend: Spend
    ) -> None:
        self.metrics.spent(model, ctx.key, spend)
        # Upstream errors are counted per attempt, as they happen (Engine.on_upstream_error);
        # what a request or a turn did to its stream, by that request (CANCEL_CAUSES).
        cause = CANCEL_CAUSES.get(error.code or error.error_type)
        if cause is not None:
            self.metrics.cancellations.labels(cause).inc()
