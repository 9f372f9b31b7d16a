"""``/v1/responses``: the OpenAI Responses API, streaming and not.

Its own stream format by default (``response.*`` events, docs/protocols.md §4);
``stream_format`` negotiation picks any other registered one. ``background: true`` answers
with a ``response`` object (what the OpenAI SDK reads), which carries the stream's ``url``;
with ``stream: true`` too it streams at once, as OpenAI does, the run detached (it goes on
if the client leaves) and resumable.

A response is its stream: ``GET /v1/responses/{id}`` (the SDK's ``responses.retrieve``)
answers the ``response`` object of a stream Nexus still keeps, or streams it again from
after a ``starting_after``; ``POST /v1/responses/{id}/cancel`` stops it. Whose stream it
is, and for how long it is kept, are the stream routes' rules (:mod:`.stream_access`).
"""

from __future__ import annotations

from contextlib import ExitStack
from typing import Any

from aiohttp import web
from multidict import MultiMapping

from ...cache.keeper import status_of
from ...cache.store import StreamInfo
from ...encoders.responses_sse import ResponsesSSEEncoder, final_response
from ...errors import (
    InvalidRequest,
    StreamError,
    StreamLost,
    StreamNotFound,
    UpstreamInvalidRequest,
)
from ...events import Done, Error, StreamEvent
from ...protocol.openai_responses import parse_responses_request, response_body
from ...protocol.openai_responses_output import (
    accepted_body,
    response_ids,
    response_object,
    responses_error,
)
from ...types import StreamMeta
from .. import state
from ..render import ABORTED, Cursor
from ..streaming import LOG_LOST
from .common import complete, json_response, last_event_id, negotiate, resume
from .stream_access import find_stream, stream_not_found
from .streams import stop

__all__ = ["DEFAULT_FORMAT", "cancel", "handle", "retrieve"]

DEFAULT_FORMAT = ResponsesSSEEncoder.media_type


def _accepted(described: dict[str, Any], meta: StreamMeta) -> dict[str, Any]:
    return accepted_body(described, meta.id, meta.model, meta.created, meta.echo)


async def handle(request: web.Request) -> web.StreamResponse:
    try:
        return await complete(
            request,
            parse=parse_responses_request,
            default_format=DEFAULT_FORMAT,
            render=response_body,
            accepted=_accepted,
            streams_background=True,
        )
    except (InvalidRequest, UpstreamInvalidRequest) as exc:  # naming a chat field
        raise responses_error(exc) from None


async def retrieve(request: web.Request) -> web.StreamResponse:
    """``GET /v1/responses/{id}``: the ``response`` object of a stream Nexus still keeps
    (``in_progress`` while it runs; then as its stream ended), or with ``stream=true`` its
    events, from after ``starting_after`` (a ``sequence_number``) or ``Last-Event-ID``."""
    query = request.query
    streamed = _flag(query, "stream")
    _flag(query, "include_obfuscation")  # checked; a replay is never padded (see resume)
    # (the SDK sends a list as include[]=...; none of its values is produced here)
    if any(query.getall("include", ())) or any(query.getall("include[]", ())):
        raise InvalidRequest("include: Nexus produces none of those extras.", param="include")
    with ExitStack() as reading:  # its place among the key's readers, while it reads
        info = await find_stream(
            request, request.match_info["id"], read_token=True, reading=reading
        )
        if not streamed:
            return json_response(await _response_of(request, info))
        encoder = negotiate(request, DEFAULT_FORMAT)
        cursor = last_event_id(request)
        after = query.get("starting_after")
        if after is not None:
            if cursor is not None or encoder is not ResponsesSSEEncoder:
                raise InvalidRequest(
                    "starting_after: counts the events of the Responses stream format, and "
                    "goes without Last-Event-ID.",
                    param="starting_after",
                )
            cursor = Cursor(None, 0, frames=_sequence_number(after) + 1)
        return await resume(request, info, encoder, cursor)


async def cancel(request: web.Request) -> web.StreamResponse:
    """``POST /v1/responses/{id}/cancel``: stop the stream (if it runs on this replica; as
    ``DELETE /v1/streams/{id}``) and answer its ``response`` object, ``cancelled`` or as
    it had ended (cancelling twice answers the same)."""
    info = await find_stream(request, request.match_info["id"], rated=False)
    await stop(request, info)
    info = await request.app[state.HUB].info(info.id) or info
    return json_response(await _response_of(request, info))  # (failed: its replica died)


async def _response_of(request: web.Request, info: StreamInfo) -> dict[str, Any]:
    """The ``response`` object of ``info``'s stream: ``in_progress`` (no output yet) while
    it runs, else what its stream's last event carried, ``cancelled`` when it was cut
    short. Nexus's ``stream_id`` goes with it, as in a background request's ``202``."""
    meta, hub = info.meta, request.app[state.HUB]
    running = info.status == "in_progress"
    if running and not hub.local(info.id) and not await hub.store.alive(info.id):
        # Ended elsewhere since it was read (its end lets its keep-alive go), or its
        # replica died: then it will never end (a GET of its stream gets stream_lost).
        info = await hub.info(info.id) or info
        if info.status == "in_progress":
            lost = StreamLost("The replica running this response stopped before it ended.")
            return final_response(meta, (), lost.to_event()) | {"stream_id": info.id}
    if info.status == "in_progress":
        response_id, _ = response_ids(info.id)
        body = response_object(
            response_id=response_id,
            created_at=meta.created,
            model=meta.model,
            status="in_progress",
            output=[],
            echo=meta.echo,
        )
    else:
        events, terminal = await _log_of(request, info.id)
        failure = terminal if type(terminal) is Error else None
        if type(terminal) is Done and terminal.aborted:
            failure = ABORTED
        body = final_response(meta, events, failure)
        if status_of(terminal) == "cancelled":
            body["status"], body["error"] = "cancelled", None
    body["stream_id"] = info.id
    return body


async def _log_of(request: web.Request, stream_id: str) -> tuple[list[StreamEvent], StreamEvent]:
    """A finished stream's events, and its terminal entry (``Done`` or ``Error``)."""
    try:
        reader = await request.app[state.HUB].attach(stream_id)
    except StreamNotFound:  # expired since it was found
        raise stream_not_found(stream_id) from None
    events: list[StreamEvent] = []
    try:
        async for batch in reader:
            for event in batch:
                if type(event) is Done or type(event) is Error:
                    return events, event
                events.append(event)
    finally:
        await reader.close()
    raise StreamError(LOG_LOST)


def _flag(query: MultiMapping[str], name: str) -> bool:
    value = query.get(name)
    if value is None:
        return False
    if value.lower() not in ("true", "false"):
        raise InvalidRequest(f"{name}: must be true or false.", param=name)
    return value.lower() == "true"


def _sequence_number(text: str) -> int:
    if not (text.isascii() and text.isdigit()) or len(text) > 12:  # (int() refuses '²')
        raise InvalidRequest(
            "starting_after: must be the sequence_number of an event (an integer, 0 or more).",
            param="starting_after",
        )
    return int(text)
