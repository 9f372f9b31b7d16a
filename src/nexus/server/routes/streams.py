"""``/v1/streams/{id}``: a stream resource, outliving the connection that made it.

``GET`` attaches in any negotiated format (default: the format of the endpoint
that made the stream): the log so far, then live. ``Last-Event-ID`` (or
``?last_event_id=``) starts right after that event; past the end the answer is
``204``, which tells an ``EventSource`` to stop. ``DELETE`` cancels a stream
running in this process and answers with its status.
"""

from __future__ import annotations

from aiohttp import web

from ...cache.hub import describe, status_of
from ...errors import GatewayError, StreamNotFound
from ...events import Error
from .. import state
from .common import check_owner, json_response, last_event_id, negotiate, resume

__all__ = ["cancel", "get"]


def _not_found(stream_id: str) -> StreamNotFound:
    return StreamNotFound(
        f"No stream {stream_id!r}: unknown, or expired (finished streams are kept for "
        "[streams] resume_ttl_s).",
        param="id",
    )


async def get(request: web.Request) -> web.StreamResponse:
    stream_id = request.match_info["id"]
    cursor = last_event_id(request)
    info = await request.app[state.HUB].info(stream_id)
    if info is None:
        raise _not_found(stream_id)
    encoder = negotiate(request, info.format)
    return await resume(request, stream_id, encoder, cursor)


async def cancel(request: web.Request) -> web.StreamResponse:
    stream_id = request.match_info["id"]
    hub = request.app[state.HUB]
    run = hub.live.get(stream_id)
    if run is not None:
        check_owner(request, run.info.owner)
        # An error, not a done: whoever else reads it (a joined request) must not take
        # the cut-short stream for a finished one.
        run.cancel(
            Error(
                error_type="invalid_request_error",
                message=f"The stream was cancelled (DELETE /v1/streams/{stream_id}).",
                code="stream_cancelled",
            )
        )
        await run.wait()
        return json_response(describe(run.info) | {"status": status_of(run.events[-1])})
    info = await hub.info(stream_id)
    if info is None:
        raise _not_found(stream_id)
    check_owner(request, info.owner)
    if info.status == "in_progress":
        raise GatewayError(
            f"Stream {stream_id!r} runs on another replica; cancel it there, or detach "
            "and let [streams] detach_timeout_s end it.",
            code="stream_not_local",
            status=409,
        )
    return json_response(describe(info))
