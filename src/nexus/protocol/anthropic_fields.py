"""What of a chat request an Anthropic target carries, drops or refuses. Sans-I/O.

:func:`refusal` names the first field that changes the answer and that the Messages API has
no place for: sent without it, the request would answer another question than the one
asked. Fields that only tune sampling (``seed``) or serve OpenAI alone (``store``,
``prompt_cache_key``...) are dropped; :data:`AS_SENT` go in the body as the client sent them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..errors import InvalidRequest
from ..request import ChatRequest
from .anthropic_documents import file_refusal
from .output_config import anthropic_config

__all__ = ["AS_SENT", "refusal", "schema_of"]


def refusal(request: ChatRequest) -> InvalidRequest | None:
    """The 400 for the first field of ``request`` that changes the answer and that the
    Messages API has no place for (None: all of it can be carried or dropped). A
    ``json_schema`` response format is carried (:func:`schema_of`); ``json_object`` is not:
    a schema for "any object" would hold the answer to ``{}`` (the API closes every object
    to properties it does not list). Nor is an ``output_config`` asking one thing twice."""
    refused = file_refusal(request)
    if refused is not None:
        return refused
    fmt = request.response_format
    if fmt is not None and fmt.type != "text" and schema_of(request) is None:
        what = (
            "type 'json_object' (a JSON object of any shape)"
            if fmt.type == "json_object"
            else "type 'json_schema' without a schema"
        )
        return _cannot("response_format", what, "send type 'json_schema' with a schema")
    refused = _tool_refusal(request)
    if refused is not None:
        return refused
    if request.temperature is not None and request.temperature > 1:  # (it was cut to 1)
        what = f"{request.temperature:g}, past the Messages API's range of 0 to 1"
        return _cannot("temperature", what, "send 0 to 1")
    extra = request.model_extra
    if extra:
        for name, (asks, what) in _UNCARRIED.items():
            if name in extra and asks(extra[name]):
                return _cannot(name, what, "send it to a model of an OpenAI-compatible provider")
        unknown = next((name for name in extra if name not in _KNOWN), None)
        if unknown is not None:  # passed on to OpenAI-compatible upstreams, which may know it
            what = "a field Nexus does not know, and so cannot carry"
            return _cannot(unknown, what, "send it to a model of an OpenAI-compatible provider")
        try:
            anthropic_config(request)
        except InvalidRequest as exc:
            return exc
    return None


_TOOL_CARRIED = frozenset(("cache_control", "anthropic_tool"))
"""A chat tool's fields beside ``type`` and ``function`` that an Anthropic tool carries."""


def _tool_refusal(request: ChatRequest) -> InvalidRequest | None:
    """The 400 for a tool's field (or its function's) the Messages API has no place for:
    dropped, the model would see a tool other than the one the client described."""
    for index, tool in enumerate(request.tools or ()):
        for where, fields in (("", tool.model_extra), (".function", tool.function.model_extra)):
            known = _TOOL_CARRIED if not where else ()
            unknown = next((name for name in fields or () if name not in known), None)
            if unknown is not None:
                what = "a tool field Nexus does not know, and so cannot carry"
                instead = "send it to a model of an OpenAI-compatible provider"
                return _cannot(f"tools[{index}]{where}.{unknown}", what, instead)
    return None


def _cannot(param: str, what: str, instead: str) -> InvalidRequest:
    message = (
        f"{param}: {what}, which this model's provider (Anthropic Messages) cannot honour; "
        f"{instead}"
    )
    return InvalidRequest(message, param=param)


AS_SENT = (
    "thinking",
    "top_k",
    "service_tier",
    "context_management",
    "cache_control",
    "inference_geo",
)
_CARRIED = (*AS_SENT, "output_config", "reasoning_effort", "anthropic_beta")  # (beta: a header)
_DROPPED: tuple[str, ...] = ("verbosity", "prediction", "store", "metadata", "prompt_cache_key")
_DROPPED += ("safety_identifier", "function_call")  # (the legacy tool choice: none alone)

_UNCARRIED: dict[str, tuple[Callable[[Any], bool], str]] = {
    # name: (whether the value asks for something, what it asks for)
    "logit_bias": (bool, "token biases (a bias of -100 bans a token)"),
    "functions": (bool, "functions (the tools of the legacy API)"),
    "modalities": (
        lambda value: type(value) is list and any(m != "text" for m in value),
        "output other than text",
    ),
    "audio": (lambda value: value is not None, "audio output"),
    "web_search_options": (lambda value: value is not None, "a web search"),
    "service_tier": (  # OpenAI's flex, scale and priority have no Anthropic tier
        lambda value: value not in (None, "auto", "default", "standard_only"),
        "a service tier Anthropic does not offer (it has auto and standard_only)",
    ),
}
_KNOWN = frozenset((*_CARRIED, *_DROPPED, *_UNCARRIED))
"""The request fields beside the declared ones an Anthropic target carries, drops (they
tune sampling or serve OpenAI alone) or refuses by name (:data:`_UNCARRIED`, when they ask
for something); any other is refused: dropped, it would change the answer unseen."""


def schema_of(request: ChatRequest) -> dict[str, Any] | None:
    """A ``json_schema`` response format's schema (Anthropic's format is always strict)."""
    fmt = request.response_format
    if fmt is None or fmt.json_schema is None or fmt.type != "json_schema":
        return None
    return fmt.json_schema.schema_
