"""A ``/v1/messages`` tool in chat's terms, and what only Anthropic has of it. Sans-I/O.

Claude Code's tools carry fields beside name, description and schema (``defer_loading``,
``input_examples``, ``eager_input_streaming``, ``allowed_callers``): they ride beside the
chat tool as ``anthropic_tool``, reach an Anthropic target as sent, and are refused by a
target without them when they change the answer (:func:`tool_refusal`). A field Nexus
does not know, and a server tool (its results are blocks of their own), are refused.
"""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequest
from ..request import ChatRequest
from .anthropic_events import cache_control

__all__ = ["TOOL_FIELDS", "chat_tool", "tool_refusal"]

TOOL_FIELDS = ("defer_loading", "input_examples", "eager_input_streaming", "allowed_callers")
"""A tool's fields beside its function that ride to an Anthropic target as sent
(``anthropic_tool``): what Claude Code sends. Any other is refused by name."""
_TOOL_KEYS = frozenset(("type", "strict", "cache_control", *TOOL_FIELDS))


def chat_tool(tool: Any, index: int) -> dict[str, Any]:
    """A tool in chat's terms; its Anthropic fields ride beside it. (A server tool,
    ``web_search_20250305``..., was refused as the request was read: ``ToolDef``.)"""
    extra = tool.model_extra or {}
    unknown = next((key for key in extra if key not in _TOOL_KEYS), None)
    if unknown is not None:
        raise InvalidRequest(
            f"tools[{index}].{unknown}: a tool field Nexus does not carry.",
            param=f"tools[{index}].{unknown}",
        )
    function: dict[str, Any] = {"name": tool.name, "description": tool.description}
    function["parameters"] = tool.input_schema
    if extra.get("strict") is True:  # the input held to its schema (OpenAI's strict mode)
        function["strict"] = True
    chat: dict[str, Any] = {"type": "function", "function": function, **cache_control(tool)}
    fields = {key: extra[key] for key in TOOL_FIELDS if key in extra}
    if fields:
        chat["anthropic_tool"] = fields
    return chat


def tool_refusal(request: ChatRequest) -> InvalidRequest | None:
    """For a target without Anthropic's tools: the 400 for the first of a tool's Anthropic
    fields that changes the answer (all but ``eager_input_streaming``, how it streams);
    and for ``inference_geo``, where the answer may be made: a residency, not a hint."""
    if (request.model_extra or {}).get("inference_geo") is not None:
        message = "inference_geo: where Anthropic infers, which this model's provider (Chat "
        message += "Completions) cannot honour; send it to an Anthropic model"
        return InvalidRequest(message, param="inference_geo")
    for index, tool in enumerate(request.tools or ()):
        asked = next(iter((tool.model_extra or {}).get("anthropic_tool", {})), None)
        if asked is not None and asked != "eager_input_streaming":
            message = f"tools[{index}].{asked}: an Anthropic tool field, which this model's "
            message += "provider (Chat Completions) cannot honour; send it to an Anthropic model"
            return InvalidRequest(message, param=f"tools[{index}].{asked}")
    return None
