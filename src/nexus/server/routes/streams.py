"""``/v1/streams/{id}``: a stream resource, outliving the connection that made it.

``GET`` attaches in any negotiated format (default: the format of the endpoint
that made the stream): the log so far, then live. ``Last-Event-ID`` (or
``?last_event_id=``) starts right after that event; past the end (or, at once, past what
a running stream has produced so far, on whichever replica it runs) the answer is ``204``,
which tells an ``EventSource`` to stop. The answer's
``X-Nexus-Resumable`` says whether the stream waits for a reader that leaves
(``true``) or ends with the last one (``false``). ``DELETE`` cancels a stream
running in this process and answers with its status.

With keys configured, both need the key that made the stream; a ``GET`` may
instead carry the stream's read token (``?token=``, from the ``202`` of a
background request), which a ``DELETE`` does not accept. A ``GET`` holds a place among
its key's readers while it writes (``[limits] max_readers_per_key``). See
:func:`~nexus.server.routes.stream_access.find_stream`.
"""

from __future__ import annotations

from contextlib import ExitStack

from aiohttp import web

from ...cache.keeper import status_of
from ...cache.store import Status, StreamInfo
from ...errors import GatewayError
from ...events import Error
from .. import state
from ..access import METRICS, exchange
from ..key_admission import admit
from .common import json_response, last_event_id, negotiate, resume
from .stream_access import describe, find_stream

__all__ = ["cancel", "get", "stop"]


async def get(request: web.Request) -> web.StreamResponse:
    with ExitStack() as reading:  # its place among the key's readers, while it writes
        info = await find_stream(
            request, request.match_info["id"], read_token=True, reading=reading
        )
        cursor = last_event_id(request)
        encoder = negotiate(request, info.format)
        return await resume(request, info, encoder, cursor)


async def cancel(request: web.Request) -> web.StreamResponse:
    info = await find_stream(request, request.match_info["id"], rated=False)
    status = await stop(request, info)
    return json_response(describe(info) | {"status": status})


async def stop(request: web.Request, info: StreamInfo) -> Status:
    """Cancel the stream ``info`` (found by :func:`find_stream`) if it runs here, and wait
    for its end; its status then (``cancelled``, or how it ended before: ``failed`` for one
    whose replica died). Raises 409 ``stream_not_local`` for a stream running on another
    replica. Only a cancel that stops a stream is free of the key's rate (one past its rate
    must still stop what spends its budget); asking again of one that ended takes a token."""
    stream_id = info.id
    hub = request.app[state.HUB]
    run = hub.local(stream_id)
    if run is not None:
        # An error, not a done: whoever else reads it (a joined request) must not take
        # the cut-short stream for a finished one.
        cancelled = run.cancel(
            Error(
                error_type="invalid_request_error",
                message=f"The stream was cancelled ({request.method} {request.path}).",
                code="stream_cancelled",
            )
        )
        metrics = request.app.get(METRICS)
        if cancelled and metrics is not None:  # counted here: its end reads as any abort's
            metrics.cancellations.labels("cancelled").inc()
        await run.wait()
        if not cancelled:
            await admit(request, exchange(request).key, None)
        return status_of(run.events[-1])
    if info.status == "in_progress" and await hub.store.alive(stream_id):
        await admit(request, exchange(request).key, None)  # (stops nothing: rated)
        raise GatewayError(
            f"Stream {stream_id!r} runs on another replica; cancel it there, or detach "
            "and let it end (at once when it is not resumable, else after "
            "[streams] detach_timeout_s).",
            code="stream_not_local",
            status=409,
        )
    await admit(request, exchange(request).key, None)
    # (A stream still in progress here lost its replica: it will never end, and its
    # readers get stream_lost.)
    return "failed" if info.status == "in_progress" else info.status
