"""What every HTTP upstream shares: a pooled session, timeouts, the read loop feeding the
body to the provider's decoder, and error mapping: aiohttp errors and upstream statuses
become the most specific :mod:`nexus.errors` class here, once (``map_upstream_errors``,
:func:`~nexus.protocol.upstream.status_error`). Raised before the first event, an error
may send the engine to the next target; after, it becomes an error event.

Bodies are asked for and read as sent (``Accept-Encoding: identity``, no decompression): a
compressed body is a bomb waiting (300 MB of comments in 306 KB of gzip, inflated in one
call, held the event loop for every tenant), so one that comes compressed all the same
is :class:`~nexus.errors.UpstreamProtocolError`.

A stream holds its pooled connection (``max_connections``) for its whole length; a
request's wait for one goes to the provider's ``on_pool_wait`` callbacks (a histogram) and
to the call's :data:`POOL_WAITS` (``pool_wait_ms`` in the access line). Keys go out in
headers only, never in logs, errors or ``repr``.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
from abc import abstractmethod
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, ClassVar

import aiohttp
import orjson

from ..config import HTTPProviderConfig
from ..errors import (
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamError,
    UpstreamPoolExhausted,
    UpstreamProtocolError,
    UpstreamTimeout,
)
from ..events import StreamEvent, Usage
from ..protocol.upstream import UpstreamDecoder, error_text, keep_secret, status_error
from ..request import ChatRequest
from ..stream import Batches
from ..telemetry import upstream_headers
from ..watchdog import Watchdog
from .base import Provider

__all__ = ["POOL_WAITS", "HTTPProvider", "PoolWaits", "map_upstream_errors"]

log = logging.getLogger("nexus.providers")

_MAX_ERROR_BODY = 64 * 1024
_DRAIN_TIMEOUT_S = 0.05
_QUIET_BYTES = 256 * 1024
"""Body bytes read without an event before the read loop lets the event loop run: bytes
already buffered are read without a pause, so a flood of comments (or of a line still
arriving) would otherwise hold every other stream of the process."""


class PoolWaits:
    """What one call waited for pooled upstream connections, over all its attempts; None
    while it made no upstream HTTP request (a mock provider, a cache hit, a joined stream)."""

    __slots__ = ("seconds",)

    def __init__(self) -> None:
        self.seconds: float | None = None

    def add(self, seconds: float) -> None:
        self.seconds = (self.seconds or 0.0) + seconds


POOL_WAITS: contextvars.ContextVar[PoolWaits | None] = contextvars.ContextVar(
    "nexus_pool_waits", default=None
)
"""The tally of the call being served: set by the server per request, inherited by a
stream's run task."""


@contextlib.contextmanager
def map_upstream_errors(provider: str, phase: str) -> Iterator[None]:
    """Translate aiohttp and timeout errors into :mod:`nexus.errors` (``raise ... from``)."""
    try:
        yield
    except TimeoutError as exc:
        raise UpstreamTimeout(f"provider {provider!r} timed out {phase}") from exc
    except aiohttp.ClientConnectorError as exc:
        raise UpstreamConnectError(
            f"cannot connect to provider {provider!r}: {exc.os_error.strerror or exc}"
        ) from exc
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientPayloadError) as exc:
        raise UpstreamDisconnected(f"provider {provider!r} closed the connection {phase}") from exc
    except aiohttp.ClientError as exc:
        raise UpstreamError(f"provider {provider!r} failed {phase}: {type(exc).__name__}") from exc


class HTTPProvider(Provider):
    """A provider streaming from an HTTP endpoint: a subclass gives ``path``, ``headers()``
    and, in :meth:`upstream`, the body and the stream's decoder."""

    path: ClassVar[str]

    def __init__(self, name: str, config: HTTPProviderConfig, api_key: str | None = None) -> None:
        super().__init__(name, models=config.models)
        self.config = config
        self.base_url = config.base_url.rstrip("/")
        self._api_key = api_key
        keep_secret(api_key)  # never quoted back from an upstream's error text
        self._session: aiohttp.ClientSession | None = None
        self._watchdog = Watchdog()  # the read timeouts of every response
        self.on_pool_wait: list[Callable[[float], None]] = []
        """Called once per upstream request with its wait for a pooled connection (s)."""

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} {self.base_url}>"

    async def start(self) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                limit=self.config.max_connections,  # 0: no limit
                enable_cleanup_closed=True,
            ),
            trace_configs=[_pool_wait_trace()],
            auto_decompress=False,  # see the module docstring
            # sock_connect only: ``connect`` would also count the wait for a free
            # pooled connection, making a busy pool look like a slow upstream.
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s),
        )

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    def headers(self) -> dict[str, str]:
        return {
            "Content-Type": "application/json",
            "Accept": "text/event-stream",
            "Accept-Encoding": "identity",  # see the module docstring
        }

    @abstractmethod
    def upstream(self, request: ChatRequest, model: str) -> tuple[dict[str, Any], UpstreamDecoder]:
        """The upstream request's body for ``request``, and a decoder for its stream."""

    def batches(self, request: ChatRequest, model: str) -> Batches:
        """One list of events per upstream read, until the decoder's end; a body that
        ends before it is :class:`~nexus.errors.UpstreamDisconnected`, never a success."""
        return _Exchange(self, request, model)


class _Exchange:
    """One upstream request, from its wait for a pooled connection to its body's end: the
    provider's :class:`~nexus.stream.Batches`, its ``__anext__`` a plain coroutine (one
    frame a read, no generator to resume). The request goes out at the first step.

    ``first_byte_timeout_s`` runs from the request to the first body bytes, then each gap
    between reads gets ``idle_timeout_s`` (the consumer's time does not count). Bytes, not
    events: keepalive comments (OpenRouter's while a model thinks, Anthropic's ``ping``)
    are how a live upstream says so during a long prefill, and must not be cut as silence;
    an upstream that sends nothing else is bounded by ``max_stream_duration_s``. A wait for
    a pooled connection is the gateway's: while it lasts, the deadline is ``pool_timeout_s``
    after the wait began (then :class:`~nexus.errors.UpstreamPoolExhausted`); it restarts in
    full once a connection is free. No timer nor clock per read: the provider's one
    watchdog sees the body's byte count move at its ticks (the idle deadline then starts
    afresh, at most a tick late) and ends a read waiting past its deadline with a timeout.
    """

    __slots__ = (
        "_deadline",
        "_decoder",
        "_end",
        "_now",
        "_provider",
        "_quiet",
        "_readany",
        "_request",
        "_seen",
        "_timeout",
        "_waiting",
        "accepted",
        "model",
        "queued_at",
        "response",
        "waited",
    )

    def __init__(self, provider: HTTPProvider, request: ChatRequest, model: str) -> None:
        self._provider = provider
        self._request: ChatRequest | None = request  # until the request goes out
        self.model = model
        self._timeout: asyncio.Timeout | None = None
        self._readany: Callable[[], Awaitable[bytes]] | None = None  # once responding
        self._decoder: UpstreamDecoder | None = None
        self._end = False  # the decoder ended (its error, or its end, is the next step)
        self._waiting = False
        self._seen = 0  # the body's bytes at the last tick
        self._quiet = 0  # body bytes read since the last event
        self.queued_at: float | None = None  # when the current wait for a connection began
        self.waited = 0.0
        self.accepted = False  # the upstream answered 2xx: it bills the prompt

    def __aiter__(self) -> _Exchange:
        return self

    async def __anext__(self) -> list[StreamEvent]:
        readany = self._readany
        if readany is None:
            readany = await self._open()
        decoder = self._decoder
        assert decoder is not None
        while not self._end:
            self._waiting = True
            try:
                chunk = await readany()
            except Exception as exc:
                error = exc
            else:
                self._waiting = False
                if chunk:
                    events = decoder.decode(chunk)
                    self._end = decoder.error is not None or decoder.done
                    if events:
                        self._quiet = 0
                        return events
                    self._quiet += len(chunk)
                    if self._quiet >= _QUIET_BYTES:
                        self._quiet = 0
                        await asyncio.sleep(0)
                    continue
                await self.aclose()
                raise UpstreamDisconnected(
                    f"provider {self._provider.name!r} ended the stream without "
                    f"{decoder.terminator}"
                )
            phase = self._phase()
            await self.aclose()
            with map_upstream_errors(self._provider.name, phase):
                raise error
        await self._finish(decoder.error is None)
        if decoder.error is not None:
            raise decoder.error
        raise StopAsyncIteration

    def _phase(self) -> str:
        return "between chunks" if self.response.content.total_bytes else "before the first byte"

    async def _open(self) -> Callable[[], Awaitable[bytes]]:
        if self._request is None:
            raise StopAsyncIteration  # closed before its first step
        self._now = asyncio.get_running_loop().time
        payload, self._decoder = self._provider.upstream(self._request, self.model)
        self._request = None  # held by nothing for the stream's length
        await self._send(orjson.dumps(payload))
        return self._readany  # type: ignore[return-value]

    async def _send(self, body: bytes) -> None:
        """POST ``body``; the response, once its status is 2xx. Redirects are not followed:
        they would carry the key to another host."""
        provider, config = self._provider, self._provider.config
        if provider._session is None:
            raise RuntimeError(f"provider {provider.name!r} is not started")
        url = provider.base_url + provider.path
        with map_upstream_errors(provider.name, "before responding"):
            try:
                async with asyncio.timeout(config.first_byte_timeout_s) as self._timeout:
                    response = await provider._session.post(
                        url,
                        data=body,
                        headers=upstream_headers(provider.headers(), url),
                        allow_redirects=False,
                        trace_request_ctx=self,
                    )
                    self._deadline = self._timeout.when() or self._now()
                    encoding = response.headers.get("Content-Encoding", "").lower() or "identity"
                    if (status := response.status) >= 300:
                        try:
                            text = (
                                error_text(await _read_capped(response, _MAX_ERROR_BODY))
                                if encoding == "identity"
                                else f"(a body in {encoding!r} encoding, not read)"
                            )
                        finally:
                            response.close()
                        message = f"provider {provider.name!r} answered {status}"
                        if status < 500:
                            message += f": {text}"
                        else:  # the upstream's trouble: its text is the operator's
                            log.warning("%s: %s", message, text)
                        raise status_error(provider.name, status, message, response.headers)
                    if encoding != "identity":
                        response.close()
                        raise UpstreamProtocolError(
                            f"provider {provider.name!r} sent its stream in {encoding!r} "
                            "encoding, though asked for none"
                        )
            except TimeoutError as exc:
                if self.queued_at is None:
                    raise
                raise UpstreamPoolExhausted(
                    f"provider {provider.name!r}: all {config.max_connections} connections "
                    f"stayed busy for {config.pool_timeout_s:g}s; retry shortly",
                    headers={"Retry-After": "1"},
                ) from exc
            finally:
                waited = self.waited
                if self.queued_at is not None:
                    waited += self._now() - self.queued_at
                for observe in provider.on_pool_wait:
                    observe(waited)
                tally = POOL_WAITS.get()
                if tally is not None:
                    tally.add(waited)
        self.response = response
        self.accepted = True
        self._readany = response.content.readany
        tick = min(config.first_byte_timeout_s, config.idle_timeout_s, 8.0) / 8
        provider._watchdog.add(self, tick)

    @property
    def prompt_usage(self) -> Usage | None:
        """The prompt's counts the upstream gave before any event (see :class:`Batches`)."""
        return getattr(self._decoder, "prompt_usage", None)

    @property
    def response_model(self) -> str | None:
        """The model the upstream said answered, once its stream named it."""
        return None if self._decoder is None else self._decoder.response_model

    def queued(self, now: float) -> None:
        if self.queued_at is None:
            self.queued_at = now
        if self._timeout is not None:
            self._timeout.reschedule(now - self.waited + self._provider.config.pool_timeout_s)

    def dequeued(self, now: float) -> None:
        if self.queued_at is not None:
            self.waited += now - self.queued_at
            self.queued_at = None
        if self._timeout is not None:
            self._timeout.reschedule(now + self._provider.config.first_byte_timeout_s)

    def check(self, now: float) -> None:
        """The watchdog's tick: bytes came since the last one, the idle deadline starts
        afresh; else end a read waiting past its deadline with a timeout (the body's reader
        raises it to whichever task reads)."""
        content = self.response.content
        if content.total_bytes != self._seen:
            self._seen = content.total_bytes
            self._deadline = now + self._provider.config.idle_timeout_s
        elif self._waiting and now >= self._deadline:
            self._waiting = False
            content.set_exception(TimeoutError())

    async def aclose(self) -> None:
        """Drop the connection (the upstream sees the client leave); idempotent."""
        await self._finish(False)

    async def _finish(self, clean: bool) -> None:
        """Give the connection back to the pool after a clean end (reading, briefly, the
        rest of the body keeps it alive), else drop it."""
        self._request = None
        self._end = True
        self._waiting = False
        if self._readany is None:
            return  # not responding (or finished already)
        self._readany = None
        self._provider._watchdog.discard(self)
        response = self.response
        if clean and response.content.at_eof():
            response.release()  # the body's end came with its last event: no wait
            return
        if clean:
            try:
                async with asyncio.timeout(_DRAIN_TIMEOUT_S):
                    while await response.content.readany():
                        pass
                response.release()
                return
            except (TimeoutError, aiohttp.ClientError):
                pass
            except BaseException:  # cancelled while draining: the connection goes too
                response.close()
                raise
        response.close()


def _pool_wait_trace() -> aiohttp.TraceConfig:
    """aiohttp's public signals of a request queueing for a pooled connection, to its
    :class:`_Exchange` (they fire only when a request actually queues)."""

    async def queued(session: object, context: Any, params: object) -> None:
        context.trace_request_ctx.queued(asyncio.get_running_loop().time())

    async def dequeued(session: object, context: Any, params: object) -> None:
        context.trace_request_ctx.dequeued(asyncio.get_running_loop().time())

    trace = aiohttp.TraceConfig()
    trace.on_connection_queued_start.append(queued)
    trace.on_connection_queued_end.append(dequeued)
    return trace


async def _read_capped(response: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body up to ``limit`` bytes, however many reads it takes."""
    body = b""
    while len(body) < limit and (chunk := await response.content.read(limit - len(body))):
        body += chunk
    return body
