"""``POST /v1/responses``: the OpenAI Responses API, streaming and not.

Its own stream format by default (``response.*`` events, docs/protocols.md §4);
``stream_format`` negotiation picks any other registered one.
"""

from __future__ import annotations

from aiohttp import web

from ...encoders.responses_sse import ResponsesSSEEncoder
from ...protocol.openai_responses import parse_responses_request, response_body
from .common import complete

DEFAULT_FORMAT = ResponsesSSEEncoder.media_type


async def handle(request: web.Request) -> web.StreamResponse:
    return await complete(
        request, parse=parse_responses_request, default_format=DEFAULT_FORMAT, render=response_body
    )
