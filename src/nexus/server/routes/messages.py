"""``POST /v1/messages``: the Anthropic Messages API over any provider; and
``POST /v1/messages/count_tokens``, which Claude Code asks before each request."""

from __future__ import annotations

import logging

from aiohttp import web

from ...encoders.anthropic_sse import AnthropicSSEEncoder
from ...errors import GatewayError
from ...estimates import prompt_estimate
from ...events import Usage
from ...protocol.anthropic_messages import parse_messages_request
from ...protocol.anthropic_output import anthropic_error_body, message_body
from ...providers.anthropic import AnthropicProvider
from .. import state
from ..key_admission import admit, authenticate, check_model
from ..state import exchange
from .common import check_open, complete, json_response, read_body, with_betas

DEFAULT_FORMAT = AnthropicSSEEncoder.media_type
log = logging.getLogger("nexus.server")


async def handle(request: web.Request) -> web.StreamResponse:
    return await complete(
        request,
        parse=parse_messages_request,
        default_format=DEFAULT_FORMAT,
        render=message_body,
    )


handle.error_body = anthropic_error_body  # type: ignore[attr-defined]


async def count_tokens(request: web.Request) -> web.StreamResponse:
    """The prompt's tokens, ``{"input_tokens": N}``: exact from the model's first Anthropic
    target that answers (which counts them for free; a retryable failure tries the next),
    else Nexus's estimate (what a budget holds), as ``X-Nexus-Token-Count`` says
    (``counted``, ``estimated``). A request of a key's rate, for a model the key may use;
    it spends nothing."""
    check_open(request)
    key = authenticate(request)
    await admit(request, key, None)  # its rate's token before its body
    limits = request.app[state.CONFIG].limits
    body = await read_body(request)
    chat = parse_messages_request(
        body, max_depth=limits.max_json_depth, max_items=limits.max_json_items, counting=True
    )
    chat = with_betas(request, chat)
    exchange(request).model = chat.model  # the access line's and the metrics' model
    if key is not None:
        check_model(key, chat.model)
    engine = request.app[state.ENGINE]
    for provider, model in engine.route(chat.model):
        if isinstance(provider, AnthropicProvider):
            counted = 0
            try:
                async for batch in provider.counter().batches(chat, model):
                    usage = (e.prompt_tokens for e in batch if isinstance(e, Usage))
                    counted = next(usage, counted)
            except GatewayError as exc:
                if engine.on_upstream_error is not None:  # a failed attempt, counted as any
                    engine.on_upstream_error(provider.name, exc.code)
                if not exc.retryable:
                    raise  # the request's own fault, or the key's: as Anthropic said
                log.warning("count_tokens: provider %s failed (%s)", provider.name, exc.code)
                continue
            return json_response({"input_tokens": counted}, headers={_COUNT: "counted"})
    return json_response({"input_tokens": prompt_estimate(chat)}, headers={_COUNT: "estimated"})


_COUNT = "X-Nexus-Token-Count"


count_tokens.error_body = anthropic_error_body  # type: ignore[attr-defined]
