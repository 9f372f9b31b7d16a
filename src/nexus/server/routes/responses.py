"""``POST /v1/responses``: the OpenAI Responses API, streaming and not.

Its own stream format by default (``response.*`` events, docs/protocols.md §4);
``stream_format`` negotiation picks any other registered one. ``background: true`` answers
with a ``response`` object (what the OpenAI SDK reads), which carries the stream's ``url``;
with ``stream: true`` too it streams at once, as OpenAI does, the run detached (it goes on
if the client leaves) and resumable.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from ...encoders.responses_sse import ResponsesSSEEncoder
from ...errors import InvalidRequest
from ...protocol.openai_responses import parse_responses_request, response_body
from ...protocol.openai_responses_output import accepted_body, responses_error
from ...types import StreamMeta
from .common import complete

DEFAULT_FORMAT = ResponsesSSEEncoder.media_type


def _accepted(described: dict[str, Any], meta: StreamMeta) -> dict[str, Any]:
    return accepted_body(described, meta.id, meta.model, meta.created)


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
    except InvalidRequest as exc:  # the engine's names a chat field (no target honours it)
        raise responses_error(exc) from None
