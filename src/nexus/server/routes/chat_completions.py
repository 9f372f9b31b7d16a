"""``POST /v1/chat/completions``: OpenAI-compatible, streaming and not."""

from __future__ import annotations

from aiohttp import web

from ...protocol.openai_chat import completion_body, parse_chat_request
from .common import complete

DEFAULT_FORMAT = "text/event-stream"


async def handle(request: web.Request) -> web.StreamResponse:
    return await complete(
        request, parse=parse_chat_request, default_format=DEFAULT_FORMAT, render=completion_body
    )
