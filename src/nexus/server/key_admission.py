"""The caller's key and what it may run: :func:`authenticate` (401 ``invalid_api_key``),
:func:`admit` (the model's allow-list, a token of the key's rate), :func:`admit_stream`
(the block that opens a stream, under the key's stream limits and budget hold) and
:func:`budgeted` (what a key's budget holds for a request). Routes call them once they have
read what a request asks for; the access middleware (:mod:`.access`) knows only the key
they found, for its line."""

from __future__ import annotations

import contextlib

from aiohttp import web

from ..auth import ApiKey, Forbidden, credential
from ..engine import Engine
from ..errors import ModelNotFound
from ..providers.base import Provider
from ..request import ChatRequest
from .access import KEYS
from .state import CONFIG as _CONFIG
from .state import HUB as _HUB
from .state import exchange

__all__ = ["admit", "admit_stream", "authenticate", "budgeted", "check_model", "check_stream_model"]


def authenticate(request: web.Request, subprotocols: tuple[str, ...] = ()) -> ApiKey | None:
    """The caller's key (None with auth off). Raises 401 ``invalid_api_key``."""
    keys = request.app[KEYS]
    key = keys.authenticate(credential(request.headers, subprotocols)) if keys.enabled else None
    exchange(request).key = key
    return key


async def admit(
    request: web.Request, key: ApiKey | None, model: str | None, *, param: str = "model"
) -> None:
    """Per-key checks before a request may run: its model (when it names one), and a
    token of its rate (here or in :func:`admit_stream`; :mod:`nexus.cache.limits`).
    Raises 403 ``model_not_allowed`` (naming ``param``) and 429 ``rate_limited``."""
    if key is None:
        return
    check_model(key, model, param)
    await request.app[_HUB].limits.admit(key, stream=False)


def check_model(key: ApiKey, model: str | None, param: str = "model") -> None:
    """Raises 403 ``model_not_allowed`` for a model ``key`` may not use."""
    if model is not None and not key.allows(model):
        raise Forbidden(f"The API key {key.name!r} may not use the model {model!r}.", param=param)


def admit_stream(
    request: web.Request,
    key: ApiKey | None,
    model: str,
    *,
    param: str = "model",
    rate_taken: bool = False,
    hold: float = 0.0,
) -> contextlib.AbstractAsyncContextManager[None]:
    """For the block that opens the stream (``async with admit_stream(...)``): the model
    checks (:func:`check_stream_model`), then a token of the key's rate (unless
    ``rate_taken``: :func:`admit` took it), its budget with ``hold`` held (see
    :func:`budgeted`), a place among the streams running here and the key's
    (:mod:`nexus.cache.admission`).

    Raises what :func:`check_stream_model` raises when it is called; 429
    ``rate_limited``, ``too_many_streams`` and ``budget_exceeded``, and 503
    ``store_unavailable`` (Redis down, a budget to check) when the block is entered.
    """
    check_stream_model(request, key, model, param=param)
    limit = request.app[_CONFIG].limits.max_concurrent_streams
    return request.app[_HUB].admit(key, limit, rate_taken=rate_taken, hold=hold)


def budgeted(
    request: web.Request, key: ApiKey | None, chat: ChatRequest
) -> tuple[ChatRequest, float]:
    """``chat`` as it runs for ``key``, and what the key's budget holds for it while it
    runs (0.0: no budget): its worst case, :meth:`~nexus.engine.Engine.hold_usd`. One
    without an output cap is given ``[limits] budget_max_output_tokens``, sent upstream,
    so that its worst case is known (a cap nobody set would hold the whole budget).
    Raises 403 ``model_not_priced`` for what the prices of the model's targets do not
    cover (:func:`~nexus.pricing.unpriced`)."""
    if key is None or key.budget_usd is None:
        return chat, 0.0
    engine = request.app[_HUB].engine
    billed = engine.unpriced(chat)
    if billed is not None:
        param, why = billed
        raise Forbidden(
            f"The API key {key.name!r} has a budget, and {why}: [models] prices do not "
            "cover it, so it could not be held or charged.",
            code="model_not_priced",
            param=param,
        )
    if chat.token_limit is None:
        # Less where a target sends less by default (Anthropic's default_max_tokens).
        caps = [provider.default_output_cap for provider, _ in _targets(engine, chat.model)]
        cap = min([request.app[_CONFIG].limits.budget_max_output_tokens, *filter(None, caps)])
        chat = chat.model_copy(update={"max_completion_tokens": cap})
    elif chat.max_tokens is not None and chat.max_completion_tokens is not None:
        # Both sent: an upstream may obey either, so both get the smaller (the one held).
        cap = min(chat.max_tokens, chat.max_completion_tokens)
        chat = chat.model_copy(update={"max_tokens": cap, "max_completion_tokens": cap})
    return chat, engine.hold_usd(chat)


def _targets(engine: Engine, model: str) -> list[tuple[Provider, str]]:
    try:
        return engine.route(model)
    except ModelNotFound:
        return []  # refused when it opens, with its own error


def check_stream_model(
    request: web.Request, key: ApiKey | None, model: str, *, param: str = "model"
) -> None:
    """Whether ``key`` may run ``model``: 403 ``model_not_allowed``, or ``model_not_priced``
    (a key with a budget, a model a target of which has no price)."""
    if key is None:
        return
    check_model(key, model, param)
    if key.budget_usd is not None and not request.app[_HUB].engine.priced(model):
        # Without a price a stream costs nothing and is never charged: the budget would
        # not hold. Refused, as a budget that cannot be checked is.
        raise Forbidden(
            f"The API key {key.name!r} has a budget and the model {model!r} has no "
            'price ([models."<name>"] input_usd_per_mtok, output_usd_per_mtok).',
            code="model_not_priced",
            param=param,
        )
