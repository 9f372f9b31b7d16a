"""What every completion endpoint does, in one place: read, negotiate, stream or answer.

An endpoint supplies its parser (body bytes to a :class:`ChatRequest`), its default
stream format and its JSON shape; :func:`complete` does the rest through the one
hub and the one pump, streaming or not. :func:`resume` serves a stream that already
exists (``GET /v1/streams/{id}``, and a POST carrying ``Last-Event-ID``).

Who may use an existing stream is :mod:`.stream_access`'s.

A stream is *resumable* when the request asks (``"background": true``,
``"stream_options": {"resumable": true}``, or ``X-Nexus-Resumable: true``): it then
outlives its client for ``[streams] detach_timeout_s``; any other stream ends when
its last client leaves (:mod:`nexus.cache.run`). ``X-Nexus-Resumable`` on the
response says which it is.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator, Callable, Coroutine
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import replace
from typing import Any, Protocol

import orjson
from aiohttp import StreamReader, web
from aiohttp.http import HttpProcessingError

from ...auth import ApiKey
from ...cache.hub import Opened
from ...cache.readers import leave, with_usage
from ...cache.run import LogReader
from ...cache.store import StreamInfo
from ...encoders.base import Encoder
from ...errors import (
    InvalidLastEventId,
    InvalidRequest,
    RequestTimeout,
    ServerShuttingDown,
    StreamError,
    StreamNotFound,
)
from ...events import Done, Error, StreamEvent
from ...hooks import CallContext
from ...pricing import NOTHING, Spend
from ...protocol.anthropic_betas import parse_betas
from ...protocol.content_encoding import Inflater, content_coding, too_large
from ...protocol.negotiation import select_format
from ...request import ChatRequest
from ...stream import Stream, accumulate
from ...telemetry import end_with, request_model
from ...types import Completion, StreamMeta
from .. import state
from ..access import (
    METRICS,
    Exchange,
    account_at_end,
    exchange,
    request_spend,
    run_ended,
    settled_spend,
)
from ..key_admission import admit, admit_stream, authenticate, budgeted
from ..rejections import describe_body_error, malformed
from ..render import Cursor, parse_cursor
from ..streaming import LOG_LOST, pump
from .key_readers import key_reader
from .stream_access import describe, find_stream, prepay_first_read, stream_not_found

__all__ = [
    "RESUMABLE_HEADER",
    "complete",
    "count_cache",
    "expect_later",
    "join_place",
    "json_response",
    "last_event_id",
    "read_body",
    "resume",
    "with_betas",
]

RESUMABLE_HEADER = "X-Nexus-Resumable"
"""Asks for a resumable stream (``true``); says on a streaming response whether it is."""
STORE_HEADER = "X-Nexus-Store"
"""``unavailable``: the store could not be reached (``[store] required = false``): the
stream runs on this replica only (see :mod:`nexus.cache.hub`)."""

ATTACH_WAIT_S = 0.05  # an attach sends its headers with the log so far, or after this long


class ParseBody(Protocol):
    """An endpoint's request parser: body bytes to a :class:`ChatRequest`, refusing JSON
    nested deeper than ``max_depth`` or of more than ``max_items`` values."""

    def __call__(self, body: bytes, /, *, max_depth: int, max_items: int) -> ChatRequest: ...


async def read_body(request: web.Request) -> bytes:
    """The request body, as sent or inflated from gzip or deflate (in pieces, with a
    turn of the loop between them: :mod:`nexus.protocol.content_encoding`).

    Raises :class:`RequestTooLarge` past ``[limits] max_body_bytes`` (sent or inflated),
    :class:`UnsupportedMediaType` for another ``Content-Encoding`` (before reading),
    :class:`InvalidRequest` for bad compressed data, and for a body the HTTP parser refused
    once it had begun (what it said is the access line's ``reason``). Call it after the
    key is checked (it sends ``100 Continue``). Read from the payload, not
    ``request.read()``, which would keep the bytes on the request for the stream's length.
    """
    limit = request.app[state.CONFIG].limits.max_body_bytes
    coding = content_coding(request.headers.getall("Content-Encoding", ()))
    if request.content_length is not None and request.content_length > limit:
        raise too_large(limit)
    content = request.content
    if not content.is_eof() and request.version >= (1, 1) and _continues(request):
        await request.writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        request.writer.output_size = 0  # (the response has not begun)
    if coding is None and content.is_eof():  # all in (a small body comes with its head)
        body = content.read_nowait()
        if len(body) > limit:
            raise too_large(limit)
        return body
    stall_s = request.app[state.CONFIG].server.body_timeout_s
    chunks: list[bytes] = []
    try:
        if coding is None:
            size = 0
            while chunk := await _read_some(content, stall_s):
                size += len(chunk)
                if size > limit:
                    raise too_large(limit)
                chunks.append(chunk)
        else:
            inflater = Inflater(coding, limit=limit)
            while chunk := await _read_some(content, stall_s):
                for piece in inflater.decode(chunk):
                    chunks.append(piece)
                    await asyncio.sleep(0)  # the loop serves others between pieces
            inflater.flush()
    except (HttpProcessingError, web.RequestPayloadError) as exc:
        # The parser refused the body's rest: a 400, as for a head it refuses (no
        # traceback, none of the client's bytes), on the request's own access line.
        exchange(request).reason = reason = describe_body_error(exc)
        raise malformed(reason) from None
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


async def _read_some(content: StreamReader, stall_s: float) -> bytes:
    """The body's next bytes (b"" at its end). Raises :class:`RequestTimeout` when
    none come for ``stall_s`` ([server] body_timeout_s)."""
    if content.is_eof():  # all of it is in (a small body came with its head): no timer
        return content.read_nowait()
    try:
        async with asyncio.timeout(stall_s):
            return await content.readany()
    except TimeoutError:
        raise RequestTimeout(
            f"The request body sent no byte for {stall_s:g}s ([server] body_timeout_s)."
        ) from None


async def expect_later(request: web.Request) -> None:
    """A route's ``Expect`` handler: ``100 Continue`` waits for :func:`read_body`, after
    the key, the rate and the headers' limits (aiohttp's went first: a client its headers
    refused was asked for its upload); another expectation is a 417, as aiohttp's."""
    if request.version >= (1, 1) and not _continues(request):
        raise web.HTTPExpectationFailed(text=f"Unknown Expect: {request.headers['Expect']}")


def _continues(request: web.Request) -> bool:  # (Expect: 100-continue)
    return request.headers.get("Expect", "").lower() == "100-continue"


def json_response(
    body: dict[str, Any], *, status: int = 200, headers: dict[str, str] | None = None
) -> web.Response:
    return web.Response(
        body=orjson.dumps(body), status=status, content_type="application/json", headers=headers
    )


def negotiate(request: web.Request, default_format: str) -> type[Encoder]:
    formats = request.app[state.REGISTRY]
    media_type = select_format(
        request.query.get("stream_format"),
        request.headers.get("X-Nexus-Stream-Format"),
        request.headers.get("Accept"),
        default_format,
        formats,
    )
    return formats.get(media_type)


def last_event_id(request: web.Request) -> Cursor | None:
    """The resume point: the ``Last-Event-ID`` header, else ``?last_event_id=``."""
    value = request.headers.get("Last-Event-ID", request.query.get("last_event_id"))
    if value is None or not value.strip():
        return None
    return parse_cursor(value)


def resumable_header(value: str | None) -> bool:
    """What ``X-Nexus-Resumable`` asks: ``true`` or ``false`` in any case (absent:
    false). Raises :class:`InvalidRequest` for anything else."""
    answer = "false" if value is None else value.strip().lower()
    if answer not in ("true", "false"):
        message = f"{RESUMABLE_HEADER}: must be 'true' or 'false'."
        raise InvalidRequest(message, param=RESUMABLE_HEADER)
    return answer == "true"


def check_open(request: web.Request) -> None:
    """Raises :class:`ServerShuttingDown` once the server is stopping."""
    if request.app[state.RUNTIME].shutting_down:
        raise ServerShuttingDown("The server is shutting down; retry the request.")


async def complete(
    request: web.Request,
    *,
    parse: ParseBody,
    default_format: str,
    render: Callable[[Completion], dict[str, Any]],
    accepted: Callable[[dict[str, Any], StreamMeta], dict[str, Any]] | None = None,
    streams_background: bool = False,
) -> web.StreamResponse:
    """Serve one completion request in the endpoint's shapes. A ``background`` request is
    answered 202 with where to read it; with ``streams_background`` (OpenAI's Responses),
    one that also asks to ``stream`` is streamed at once, its run detached and resumable.

    The stream format is negotiated before the body is read, so an unknown
    format is refused whatever the body holds, and a token of the key's rate is taken
    before it too: a key past its rate is refused without the gateway reading, parsing
    or validating what it sent. Its budget and its place among the streams are taken
    once the body is in. With ``Last-Event-ID`` the request resumes the stream it names
    (the body is not used).
    """
    check_open(request)
    app = request.app
    key = authenticate(request)
    encoder = negotiate(request, default_format)
    asked = resumable_header(request.headers.get(RESUMABLE_HEADER))
    cursor = last_event_id(request)
    if cursor is not None:
        if cursor.stream_id is None:
            raise InvalidLastEventId(
                "A POST resumes the stream its Last-Event-ID names: send the id of an "
                "event ('<stream id>.<step>'), not a count.",
                param="last_event_id",
            )
        with ExitStack() as reading:  # a reader's place, and the key's rate token
            info = await find_stream(request, cursor.stream_id, reading=reading)
            await read_body(request)  # unused, but read within its limits
            return await resume(request, info, encoder, cursor)
    await admit(request, key, None)  # its rate's token before its body: a refusal reads none
    body = await read_body(request)
    limits = app[state.CONFIG].limits
    chat = parse(body, max_depth=limits.max_json_depth, max_items=limits.max_json_items)
    chat = with_betas(request, chat)
    request_model(chat.model)  # on the request's span, when tracing
    owner = key.name if key is not None else None
    hub = app[state.HUB]
    ex = exchange(request)
    ex.model = chat.model
    streaming = chat.stream or chat.background
    ctx = CallContext(
        request_id=ex.request_id,
        key=owner,
        endpoint=ex.endpoint,
        format=encoder.media_type if streaming else "application/json",
    )
    if not streaming:
        ex.format = "application/json"
    # A JSON answer is counted among the streams running like a streaming one: as its run.
    # Taken once the body is in: an upload, however slow, holds no place among them.
    chat, hold = budgeted(request, key, chat)
    async with admit_stream(request, key, chat.model, rate_taken=True, hold=hold):
        opened = await hub.open(
            chat,
            format=default_format,
            background=chat.background,
            resumable=streaming and (chat.resumable or asked),
            owner=owner,
            ctx=ctx,
            private=not streaming,
        )
    later = chat.background and not (chat.stream and streams_background)  # a 202, read later
    if opened.run is not None and chat.background:
        opened.run.info.named = True  # its id is in the 202 (or its first headers: the pump)
    # A join reads a run another request holds the slot of: it is one of the key's readers.
    with await join_place(request, key, opened, later):
        count_cache(request, ex, opened)
        headers = {STORE_HEADER: "unavailable"} if not opened.stored else {}
        if not streaming:
            if hub.cache.enabled:
                headers["X-Nexus-Cache"] = opened.cache or "miss"
            completion = await _answer(app, ex, opened)
            answer = _body(render, completion, chat.include_cost, opened.joined)
            return json_response(answer, headers=headers)
        if opened.cache:
            headers["X-Nexus-Cache"] = opened.cache
        headers[RESUMABLE_HEADER] = str(opened.info.resumable).lower()
        if later:
            if opened.reader is not None:  # a background request reads nothing: it resumes
                await opened.reader.close()
            if opened.run is not None:
                run = opened.run  # the request's span covers its run, not just the 202
                end_with(run.done, lambda: run_ended(run))
                if not opened.joined and opened.cache != "hit":
                    account_at_end(app, ex, run)  # its spend, when it ends
            # Location is the bare resource (a key reads it); the body's url carries a read token.
            headers.update({"Location": f"/v1/streams/{opened.id}", "X-Nexus-Stream-Id": opened.id})
            config = app[state.CONFIG]
            # Good for as long as the stream can be read: while it may run, then resume_ttl_s
            # (a browser's EventSource reconnecting late in a long stream still gets in).
            lifetime = config.limits.max_stream_duration_s + config.streams.resume_ttl_s
            # Its reads are this key's, also on another key's stream it joined (shared cache).
            token = app[state.TOKENS].issue(opened.id, time.time(), lifetime, key=owner)
            await prepay_first_read(request, opened.id, key)  # one action, one rate token
            described = describe(opened.info, token)
            if accepted is not None:  # the endpoint's own shape (a Responses ``response``)
                described = accepted(described, opened.info.meta)
            return json_response(described, status=202, headers=headers)
        # include_cost asks for the usage chunk too: the cost rides on it.
        usage = chat.include_usage or chat.include_cost
        meta = with_usage(opened.info.meta, usage, chat.include_cost)
        if chat.include_obfuscation or (opened.joined and chat.include_cost):
            meta = replace(meta, include_obfuscation=chat.include_obfuscation, joined=opened.joined)
        reader = await hub.reader_of(opened, meta=meta)
        del chat, body, ctx, opened  # not held for the stream's length: the run has what it needs
        return await _pump(request, reader, encoder, None, headers)


def with_betas(request: web.Request, chat: ChatRequest) -> ChatRequest:
    """``chat`` with the ``anthropic-beta`` values the request names: part of the request
    (two that differ in them are not one), sent on by an Anthropic target as it allows
    (:mod:`nexus.protocol.anthropic_betas`). Raises :class:`InvalidRequest` for a bad one."""
    if betas := request.headers.getall("anthropic-beta", ()):
        return chat.model_copy(update={"anthropic_beta": parse_betas(betas)})
    return chat


def count_cache(request: web.Request, ex: Exchange, opened: Opened) -> None:
    """The cache's answer to a request or a realtime turn (``hit``, ``miss``; None with the
    cache off): on its line, and in ``nexus_cache_total``."""
    ex.cache = opened.cache
    metrics = request.app.get(METRICS)
    if metrics is not None and opened.cache is not None:
        metrics.cache.labels(opened.cache).inc()


async def join_place(
    request: web.Request, key: ApiKey | None, opened: Opened, background: bool
) -> AbstractContextManager[None]:
    """The place among ``key``'s readers of a request (or a realtime turn) that joined a
    stream in flight (its admission gave its slot back: the run is another's), held while
    it reads; or 429 ``too_many_readers``, its joined reader closed. A background join
    reads nothing."""
    if not opened.joined or background or key is None:
        return _NOT_JOINED  # (shared: an ExitStack a stream cost 0.76 KB while it ran)
    try:
        return await key_reader(request, key.name)
    except BaseException:
        if opened.reader is not None:
            await opened.reader.close()
        raise


_NOT_JOINED: AbstractContextManager[None] = nullcontext()


async def _answer(app: web.Application, ex: Exchange, opened: Opened) -> Completion:
    """The merged completion of a stream nobody else learnt the id of, and its spend on
    the access line. Raises the stream's failure, or :class:`StreamError`."""
    reader = await app[state.HUB].reader_of(opened, meta=with_usage(opened.info.meta, False))
    hit = opened.cache == "hit"  # a replay or a join: the tokens were another's
    run = None if opened.joined else opened.run
    try:
        completion = await accumulate(Stream(_events(reader, ex), reader.meta))
    except BaseException:
        # The run ends with the request (the client gone, a failure) unless shared: the
        # line has what it spent until then, or, still running, a spend line at its end.
        await leave(reader, run, aborted=False)
        if reader.failure is None:
            _settle(ex, reader.served, NOTHING if hit else None)
            if not hit:
                ex.spend = await settled_spend(app, ex, reader, run)
        else:  # no target answered: what its failed attempts may have cost
            ex.spend = request_spend(reader, hit=hit)
        raise
    await leave(reader, run)
    _settle(ex, reader.served, request_spend(reader, hit=hit))
    return completion


def _settle(ex: Exchange, served: StreamMeta, spend: Spend | None) -> None:
    """A JSON answer's access line: who answered, what it spent."""
    ex.provider = served.provider
    ex.served = f"{served.provider}/{served.upstream_model}"
    ex.spend = spend


def _body(
    render: Callable[[Completion], dict[str, Any]],
    completion: Completion,
    include_cost: bool,
    joined: bool,
) -> dict[str, Any]:
    """The response body, with ``usage.cost`` (USD) when asked for and known: what the
    request was charged (a request that ``joined`` a stream another runs: nothing)."""
    body = render(completion)
    usage = completion.usage
    if include_cost and usage is not None and usage.cost_usd is not None:
        wire = body.get("usage")
        if isinstance(wire, dict):
            wire["cost"] = 0.0 if joined else usage.cost_usd
    return body


async def resume(
    request: web.Request, info: StreamInfo, encoder: type[Encoder], cursor: Cursor | None
) -> web.StreamResponse:
    """Attach to a stream :func:`find_stream` found and write it from after ``cursor``
    (from the start if None)."""
    stream_id = info.id
    if cursor is not None and cursor.stream_id not in (None, stream_id):
        raise InvalidLastEventId(
            f"Last-Event-ID {str(cursor)!r} belongs to another stream than {stream_id!r}.",
            param="last_event_id",
        )
    if cursor is not None and not await request.app[state.HUB].reached(info, cursor.step):
        # Past every step the stream has rendered so far (step *i* is log entry *i - 1*),
        # wherever it runs: no client was sent it, and what comes next does not follow it.
        # Answered at once, as an id past a finished stream's end is, not attached (a
        # reader's place held, a plain stream kept running, the steps up to it skipped).
        exchange(request).stream_id = stream_id
        return web.Response(status=204, headers={"Cache-Control": "no-cache"})
    try:
        reader = await request.app[state.HUB].attach(stream_id)
    except StreamNotFound:  # expired since it was found
        raise stream_not_found(stream_id) from None
    if (reading := exchange(request).key) is not None and reading.name != info.owner:
        reader.meta = replace(reader.meta, joined=True)  # another key's (shared): paid nothing
    if cursor is not None:
        metrics = request.app.get(METRICS)
        if metrics is not None:
            metrics.resumes.inc()
    return await _pump(
        request,
        reader,
        encoder,
        cursor,
        {RESUMABLE_HEADER: str(info.resumable).lower()},
        first_wait_s=ATTACH_WAIT_S,
        origin=False,
    )


def _pump(
    request: web.Request,
    reader: LogReader,
    encoder: type[Encoder],
    cursor: Cursor | None,
    headers: dict[str, str],
    first_wait_s: float | None = None,
    origin: bool = True,
) -> Coroutine[Any, Any, web.StreamResponse]:
    config = request.app[state.CONFIG]
    return pump(
        request,
        reader,
        encoder,
        heartbeat_s=config.server.heartbeat_interval_s,
        write_timeout_s=config.server.write_timeout_s,
        after=cursor,
        headers=headers,
        active=request.app[state.RUNTIME].active,
        first_wait_s=first_wait_s,
        origin=origin,
        watchdog=request.app[state.RUNTIME].watchdog,
    )


async def _events(reader: LogReader, ex: Exchange) -> AsyncGenerator[StreamEvent, None]:
    """A log as a plain event stream (for :func:`accumulate`): no terminal ``Done``. Its
    first output is the answer's time to first token (``ex.ttft``, for the histograms)."""
    try:
        async for batch in reader:
            if ex.ttft is None and type(batch[0]) is not Done and type(batch[0]) is not Error:
                ex.ttft = time.monotonic() - ex.started
            for event in batch:
                if type(event) is Done:
                    return
                if type(event) is Error and reader.failure is not None:
                    raise reader.failure
                yield event
        raise StreamError(LOG_LOST)
    finally:
        await reader.close()
