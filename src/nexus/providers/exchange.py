"""One upstream request and its streamed response (:class:`UpstreamExchange`): the POST over
a pooled connection (:mod:`.connections`), the response's head and body from the
connection's callbacks (:class:`~.http1.Listener`), each read's bytes decoded into events
where they arrive (and pushed to a caught-up reader), the first-byte and idle deadlines on
the provider's watchdog, and what a failure before the first event is: a status refused, a
JSON answer to a request for a stream, a connection lost. A reused connection closed at
once, unanswered, is tried once more on a new one (:data:`~.connections.STALE_CLOSE_S`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import orjson
from multidict import CIMultiDict

from ..errors import (
    UpstreamDisconnected,
    UpstreamError,
    UpstreamPoolExhausted,
    UpstreamProtocolError,
)
from ..events import StreamEvent, Usage
from ..protocol.upstream import UpstreamDecoder, error_text, in_stream_error, status_error
from ..request import ChatRequest
from .connections import POOL_WAITS, STALE_CLOSE_S, ConnectionPool, map_upstream_errors
from .http1 import Connection, UpstreamClosed

if TYPE_CHECKING:
    from .http import HTTPProvider

__all__ = ["UpstreamExchange"]

log = logging.getLogger("nexus.providers")

_MAX_ERROR_BODY = 64 * 1024
_DRAIN_TIMEOUT_S = 0.05
_MAX_READY = 4096  # events decoded and not yet read past which the socket is not read


class UpstreamExchange:
    """One upstream request, from its wait for a pooled connection to its body's end: the
    provider's :class:`~nexus.stream.Batches`, and the :class:`~.connections.Listener` of
    its response. The request goes out at the first step.

    Each socket read's body is decoded in the socket's callback. While its stream is under
    way, a reader may have the events pushed to it there (:meth:`push_to`), no task woken
    per read; else they wait for ``__anext__`` (reading pauses past :data:`_MAX_READY`).

    ``first_byte_timeout_s`` runs from the connection to the first body bytes, then each
    gap between reads gets ``idle_timeout_s`` (the consumer's time does not count). Bytes,
    not events: keepalive comments (OpenRouter's while a model thinks, Anthropic's ``ping``)
    are how a live upstream says so during a long prefill, and must not be cut as silence;
    an upstream that sends nothing else is bounded by ``max_stream_duration_s``. A wait for
    a pooled connection is the gateway's: it is bounded by ``pool_timeout_s`` (then
    :class:`~nexus.errors.UpstreamPoolExhausted`), and the first byte's deadline starts once
    a connection is free. No timer nor clock per read: the provider's one watchdog sees the
    body's byte count move at its ticks (the idle deadline then starts afresh, at most a
    tick late) and ends a wait past its deadline with a timeout.
    """

    __slots__ = (
        "_collect",
        "_connection",
        "_deadline",
        "_decoder",
        "_end",
        "_failure",
        "_head",
        "_paused",
        "_provider",
        "_ready",
        "_request",
        "_seen",
        "_sink",
        "_sniffing",
        "_timeout",
        "_waiter",
        "_whole",
        "accepted",
        "model",
        "queued_at",
        "received",
        "waited",
    )

    def __init__(self, provider: HTTPProvider, request: ChatRequest, model: str) -> None:
        self._provider = provider
        self._request: ChatRequest | None = request  # until the request goes out
        self.model = model
        self._connection: Connection | None = None  # while responding
        self._decoder: UpstreamDecoder | None = None
        self._head: tuple[int, CIMultiDict[str]] | None = None
        self._collect: bytearray | None = None  # an error body, while it is read
        self._sniffing = False  # a 2xx labelled JSON: its first byte tells an answer from a stream
        self._ready: list[StreamEvent] = []  # events decoded, not yet read
        self._sink: Callable[[list[StreamEvent]], bool] | None = None  # while pushing
        self._waiter: asyncio.Future[None] | None = None
        self._end = False  # the decoder ended (its error, or its end, is the next step)
        self._whole = False  # the response's end came (the connection may be reused)
        self._failure: BaseException | None = None  # why the response will not end
        self._paused = False
        self._timeout: asyncio.Timeout | None = None  # the wait for a connection's deadline
        self._deadline = 0.0
        self._seen = 0  # the body's bytes at the last tick
        self.received = 0  # the body's bytes
        self.queued_at: float | None = None  # when the current wait for a connection began
        self.waited = 0.0
        self.accepted = False  # the upstream answered 2xx: it bills the prompt

    def __aiter__(self) -> UpstreamExchange:
        return self

    async def __anext__(self) -> list[StreamEvent]:
        if not self.accepted:
            await self._open()
        while True:
            ready = self._ready
            if ready:
                self._ready = []
                if self._paused:
                    self._paused = False
                    self._connection.resume_reading()  # type: ignore[union-attr]
                return ready
            if self._failure is not None:
                error, phase = self._failure, self._phase()
                await self.aclose()
                # Raised once, and let go: held (here or on self), its traceback, which
                # holds this frame, would make a cycle only the collector frees.
                self._failure = None
                try:
                    with map_upstream_errors(self._provider.name, phase):
                        raise error
                finally:
                    del error
            if self._end:
                decoder = self._decoder
                assert decoder is not None
                await self._finish(decoder.error is None)
                if decoder.error is not None:
                    raise decoder.error
                raise StopAsyncIteration
            if self._connection is None:
                raise StopAsyncIteration  # closed
            await self._wait()

    async def _wait(self) -> None:
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        try:
            await waiter
        finally:
            self._waiter = None

    def _wake(self) -> None:
        self._sink = None  # a pushing reader woken has stopped being pushed to
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def push_to(self, sink: Callable[[list[StreamEvent]], bool]) -> asyncio.Future[None] | None:
        """Hand each read's events to ``sink`` in the socket's callback from now on, while
        it returns true; the future is done when the pushing stops (the stream's end, a
        failure, a timeout, the sink's no): ``__anext__`` then says which. None: there is
        something to read now (or nothing ever again), read it."""
        if self._ready or self._end or self._failure is not None or self._connection is None:
            return None
        self._sink = sink
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        waiter.add_done_callback(self._pushed)
        return waiter

    def _pushed(self, waiter: asyncio.Future[None]) -> None:
        self._sink = None
        if self._waiter is waiter:
            self._waiter = None

    # the response, from the connection's callbacks (see Listener)

    def head(self, status: int, headers: CIMultiDict[str]) -> None:
        self._head = (status, headers)
        coded = headers.get("Content-Encoding", "identity").lower() not in ("", "identity")
        if status >= 300 or coded or self._json(headers):
            self._collect = bytearray()  # an error's text, or a body refused: not decoded
            self._sniffing = status < 300 and not coded
        self._wake()

    def _json(self, headers: CIMultiDict[str]) -> bool:
        """Labelled a JSON answer to a request for a stream: an error (a 200 with an error
        body, as some servers and proxies send), or a stream a relay mislabelled (its
        first byte tells: :meth:`_sniff`)."""
        kind = headers.get("Content-Type", "").partition(";")[0].strip().lower()
        return kind == "application/json" and not getattr(self._decoder, "answers_json", False)

    def _sniff(self, collect: bytearray, data: bytes) -> bytes | None:
        """A body labelled JSON, held until its first byte that is not a space: an object
        (the answer: read as an error) stays held; anything else is a stream after all, and
        what came so far is decoded as one."""
        collect += data
        first = bytes(collect.lstrip()[:1])
        if not first and len(collect) <= _MAX_ERROR_BODY:  # (spaces past it: a stream's)
            return None
        self._sniffing = False
        self._wake()
        if first in (b"{", b"["):
            return None
        self._collect = None
        return bytes(collect)

    def body(self, data: bytes) -> None:
        self.received += len(data)
        if self._end:
            return  # past the decoder's end: drained
        collect = self._collect
        if collect is not None and self._sniffing:
            sniffed = self._sniff(collect, data)
            if sniffed is None:
                return
            data, collect = sniffed, None
        if collect is not None:
            if len(collect) < _MAX_ERROR_BODY:
                collect += data[: _MAX_ERROR_BODY - len(collect)]
                if len(collect) >= _MAX_ERROR_BODY:
                    self._wake()
            return
        decoder = self._decoder
        assert decoder is not None
        events = decoder.decode(data)
        if decoder.error is not None or decoder.done:
            self._end = True
        elif events:
            sink = self._sink
            if sink is not None:
                if not sink(events):
                    self._wake()  # the reader stops here
                return
        else:
            return
        self._ready += events
        if len(self._ready) > _MAX_READY and not self._paused:
            self._paused = True
            self._connection.pause_reading()  # type: ignore[union-attr]
        self._wake()

    def ended(self, error: BaseException | None) -> None:
        decoder = self._decoder
        if error is None:
            self._whole = True
            if decoder is not None and not self._end and self._collect is None:
                events = decoder.decode(b"\n\n")  # its end lacks the blank line: [DONE]\n
                cut = decoder.error is not None  # its last event, ended by the close: cut
                self._ready += events + ([] if decoder.done else decoder.closed())
                if not cut and (decoder.done or decoder.error is not None):
                    self._end = True  # (the error its whole body read as: raised as read)
                else:
                    self._failure = UpstreamDisconnected(
                        f"provider {self._provider.name!r} ended the stream without "
                        f"{decoder.terminator}"
                    )
        elif not self._end:  # cut: what it said of its usage is charged
            self._failure, self._ready = error, self._ready + (decoder.cut() if decoder else [])
        self._wake()

    async def _open(self) -> None:
        if self._request is None:
            raise StopAsyncIteration  # closed before its first step
        payload, self._decoder = self._provider.upstream(self._request, self.model)
        extra = self._provider.request_headers(self._request)
        self._request = None  # held by nothing for the stream's length
        await self._send(orjson.dumps(payload), extra)

    async def _send(self, body: bytes, extra: dict[str, str] | None = None) -> None:
        """POST ``body``; the response, once its status is 2xx. Redirects are not followed:
        they would carry the key to another host."""
        provider, config = self._provider, self._provider.config
        pool = provider._pool
        if pool is None:
            raise RuntimeError(f"provider {provider.name!r} is not started")
        loop = asyncio.get_running_loop()
        head = provider.request_head(pool, len(body), extra)
        with map_upstream_errors(provider.name, "before responding"):
            connection = self._connection = await self._acquire(pool, loop)
            for fresh in (False, True):
                try:
                    async with asyncio.timeout(config.first_byte_timeout_s) as timeout:
                        sent_at = loop.time()
                        connection.send(head + body, self)
                        while self._head is None and self._failure is None:
                            await self._wait()
                        while self._sniffing and not self._whole and self._failure is None:
                            await self._wait()
                        if self._head is None:
                            raise self._failure  # type: ignore[misc]
                        status, headers = self._head
                        encoding = headers.get("Content-Encoding", "").lower() or "identity"
                        if status >= 300 or (self._collect is not None and encoding == "identity"):
                            raise await self._refusal(status, headers, encoding)
                        if encoding != "identity":
                            raise UpstreamProtocolError(
                                f"provider {provider.name!r} sent its stream in {encoding!r} "
                                "encoding, though asked for none"
                            )
                    self._deadline = timeout.when() or loop.time()
                    break
                except BaseException as exc:
                    self._connection = None
                    # A kept-alive connection the upstream closed as it was reused, at once
                    # and unanswered (its keep-alive ran out first): once more, on a new one
                    # in its place (not behind the requests waiting for one).
                    stale = not fresh and isinstance(exc, UpstreamClosed) and connection.reused
                    if not stale or connection.heard or loop.time() - sent_at > STALE_CLOSE_S:
                        pool.release(connection, self._whole)
                        raise
                    self._failure = None
                    connection = self._connection = await pool.renew(connection)
        self._head = None
        self.accepted = True
        tick = min(config.first_byte_timeout_s, config.idle_timeout_s, 8.0) / 8
        provider._watchdog.add(self, tick)

    async def _acquire(self, pool: ConnectionPool, loop: asyncio.AbstractEventLoop) -> Connection:
        """A connection of ``pool``, waited for at most ``pool_timeout_s``; the wait told."""
        provider, config = self._provider, self._provider.config
        try:
            try:
                async with asyncio.timeout(None) as self._timeout:
                    return await pool.acquire(self)
            except TimeoutError as exc:
                if self._timeout is None or not self._timeout.expired():
                    raise  # the connect's own deadline, not the wait's
                raise UpstreamPoolExhausted(
                    f"provider {provider.name!r}: all {config.max_connections} "
                    f"connections stayed busy for {config.pool_timeout_s:g}s; retry shortly",
                    headers={"Retry-After": "1"},
                ) from exc
        finally:
            self._timeout = None
            waited = self.waited
            if self.queued_at is not None:
                waited += loop.time() - self.queued_at
            for observe in provider.on_pool_wait:
                observe(waited)
            tally = POOL_WAITS.get()
            if tally is not None:
                tally.add(waited)

    async def _refusal(
        self, status: int, headers: CIMultiDict[str], encoding: str
    ) -> UpstreamError:
        """The error for a status of 300 or more, or a 2xx answered in JSON (:meth:`_json`),
        its body read (up to its first 64 KB)."""
        provider = self._provider
        collect = self._collect
        assert collect is not None  # (see head())
        if encoding == "identity":
            while not self._whole and self._failure is None and len(collect) < _MAX_ERROR_BODY:
                await self._wait()
            text = error_text(body := bytes(collect))
        else:
            text, body = f"(a body in {encoding!r} encoding, not read)", b""
        if status < 300:
            try:
                answer = orjson.loads(body)
            except orjson.JSONDecodeError:
                answer = None
            error = answer.get("error") if isinstance(answer, dict) else None
            if isinstance(error, dict):
                return in_stream_error(provider.name, error)
            return UpstreamProtocolError(f"provider {provider.name!r} answered JSON: {text}")
        message = f"provider {provider.name!r} answered {status}"
        if status in (400, 404, 413, 422) and text:  # the request's: the upstream's words
            message = text  # (clients read them: "prompt is too long: 210118 tokens > ...")
        elif status < 500:
            message += f": {text}"
        else:  # the upstream's trouble: its message is the operator's
            log.warning("%s: %s", message, error_text(body, whole=False) if body else text)
        return status_error(provider.name, status, message, headers, body=body)

    @property
    def prompt_usage(self) -> Usage | None:
        """The prompt's counts the upstream gave before any event (see :class:`Batches`)."""
        return getattr(self._decoder, "prompt_usage", None)

    @property
    def response_model(self) -> str | None:
        """The model the upstream said answered, once its stream named it."""
        return None if self._decoder is None else self._decoder.response_model

    def queued(self, now: float) -> None:
        self.queued_at = now
        if self._timeout is not None:
            self._timeout.reschedule(now + self._provider.config.pool_timeout_s)

    def dequeued(self, now: float) -> None:
        if self.queued_at is not None:
            self.waited += now - self.queued_at
            self.queued_at = None
        if self._timeout is not None and not self._timeout.expired():
            self._timeout.reschedule(None)  # a place is free: the wait's deadline is over

    def _phase(self) -> str:
        return "between chunks" if self.received else "before the first byte"

    def check(self, now: float) -> None:
        """The watchdog's tick: bytes came since the last one, the idle deadline starts
        afresh; else end a wait past its deadline with a timeout (whichever task reads
        gets it, or the pushing stops with it)."""
        if self.received != self._seen:
            self._seen = self.received
            self._deadline = now + self._provider.config.idle_timeout_s
        elif (
            self._waiter is not None
            and now >= self._deadline
            and not self._end
            and self._failure is None
        ):
            self._failure = TimeoutError()
            self._wake()

    async def aclose(self) -> None:
        """Drop the connection (the upstream sees the client leave); idempotent."""
        await self._finish(False)

    async def _finish(self, clean: bool) -> None:
        """Give the connection back to the pool after a clean end (waiting, briefly, for
        the rest of the body keeps it alive), else drop it."""
        self._request = None
        self._end = True
        self._wake()  # a pushing reader: the stream ends under it
        connection = self._connection
        if connection is None:
            return  # not responding (or finished already)
        self._connection = None
        provider = self._provider
        provider._watchdog.discard(self)
        pool = provider._pool
        if pool is None:  # the provider closed under the stream
            connection.close()
            return
        if clean and not self._whole and self._failure is None:
            if self._paused:
                connection.resume_reading()
            try:
                async with asyncio.timeout(_DRAIN_TIMEOUT_S):
                    while not self._whole and self._failure is None:
                        await self._wait()
            except TimeoutError:
                pass
            except BaseException:  # cancelled while draining: the connection goes too
                pool.release(connection, False)
                raise
        pool.release(connection, clean and self._whole and self._failure is None)
