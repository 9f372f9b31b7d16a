"""``POST /v1/messages``: the Anthropic Messages API over any provider."""

from __future__ import annotations

from aiohttp import web

from ...encoders.anthropic_sse import AnthropicSSEEncoder
from ...protocol.anthropic_messages import (
    anthropic_error_body,
    message_body,
    parse_messages_request,
)
from .common import complete

DEFAULT_FORMAT = AnthropicSSEEncoder.media_type


async def handle(request: web.Request) -> web.StreamResponse:
    return await complete(
        request,
        parse=parse_messages_request,
        default_format=DEFAULT_FORMAT,
        render=message_body,
    )


handle.error_body = anthropic_error_body  # type: ignore[attr-defined]
