"""The Messages API's answer (docs/protocols.md §3): a merged completion in, a ``message``
object out (its content blocks, stop fields, usage, citations), and the error body. The
stream of it is :mod:`nexus.encoders.anthropic_sse`'s, which builds on these. Sans-I/O."""

from __future__ import annotations

from typing import Any

import orjson

from ..errors import GatewayError
from ..events import Citation
from ..types import Completion, ReasoningBlock, in_order
from .anthropic_events import NATIVE_STOP_REASONS
from .json_depth import MAX_JSON_DEPTH, deeper_than
from .upstream import ERROR_TYPES

__all__ = [
    "ANTHROPIC_ERROR_TYPES",
    "STOP_REASONS",
    "anthropic_error_body",
    "anthropic_error_type",
    "citation_body",
    "error_body",
    "message_body",
    "message_id",
    "stop_fields",
    "thinking_block",
    "tool_input",
    "tool_input_json",
    "usage_body",
]


STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}
"""Our finish reasons in Anthropic's terms."""


def stop_fields(
    finish_reason: str | None,
    stop_sequence: str | None,
    refused: bool = False,
    stop_reason: str | None = None,
    tools: bool = False,
) -> dict[str, Any]:
    """``stop_reason`` and ``stop_sequence`` of a ``message`` (or its ``message_delta``):
    ``"stop_sequence"`` and the sequence when the provider named the one it stopped on
    (an OpenAI upstream's ``stop`` cannot tell: ``end_turn``); ``"refusal"`` for a turn
    that ended on a refusal (``refused``: OpenAI sends one with ``stop``); an Anthropic
    upstream's own ``stop_reason`` where ours says less (:class:`~nexus.events.Delta`).
    A turn that holds ``tool_use`` blocks (``tools``) and stopped on its own is
    ``"tool_use"``, as Anthropic ends every such turn: OpenAI ends one forced to a named
    tool with ``stop``, and an agent loop runs tools only on ``tool_use``."""
    if stop_reason in NATIVE_STOP_REASONS:
        return {"stop_reason": stop_reason, "stop_sequence": None}
    if stop_sequence is not None and finish_reason == "stop":
        return {"stop_reason": "stop_sequence", "stop_sequence": stop_sequence}
    reason = STOP_REASONS.get(finish_reason or "stop", "end_turn")
    if refused and reason == "end_turn":
        reason = "refusal"
    elif tools and reason == "end_turn":
        reason = "tool_use"
    return {"stop_reason": reason, "stop_sequence": None}


def message_body(completion: Completion) -> dict[str, Any]:
    """A non-streaming ``message`` object (docs/protocols.md §3)."""
    content: list[dict[str, Any]] = []
    # Thinking, text and tool calls in the order they came, as the stream writes them, each
    # thinking block with its own signature (Anthropic checks each when it comes back); a
    # refusal is text, after any answer (Anthropic has no refusal block: its stop_reason
    # says so).
    runs = 0  # text runs seen: a citation goes with the text it came after
    for item in in_order(completion):
        if isinstance(item, tuple):
            text = item[0] + (item[1] or "")
            cited = [c for c, run in completion.cited() if run == runs]
            runs += 1
            if text:
                block: dict[str, Any] = {"type": "text", "text": text}
                if cited:
                    block["citations"] = [citation_body(c) for c in cited]
                content.append(block)
        elif isinstance(item, ReasoningBlock):
            content.append(thinking_block(item))
        else:
            use = {"type": "tool_use", "id": item.id, "name": item.name}
            content.append({**use, "input": tool_input(item.arguments)})
    return {
        "id": message_id(completion.id),
        "type": "message",
        "role": "assistant",
        "model": completion.model,
        "content": content,
        **stop_fields(
            completion.finish_reason,
            completion.stop_sequence,
            bool(completion.refusal),
            completion.stop_reason,
            bool(completion.tool_calls),
        ),
        "usage": usage_body(completion.usage),
    }


def citation_body(citation: Citation) -> dict[str, Any]:
    """A citation in Anthropic's terms: as an Anthropic upstream sent it, else (another
    upstream's source: a URL) a search result's location."""
    if citation.source is not None:
        return citation.source
    return {
        "type": "web_search_result_location",
        "url": citation.url,
        "title": citation.title,
        "cited_text": citation.quoted or "",
        "encrypted_index": "",
    }


def thinking_block(block: ReasoningBlock) -> dict[str, Any]:
    """A ``thinking`` block (``signature`` ``""`` when the provider sealed none), or the
    ``redacted_thinking`` block the provider sent."""
    if block.redacted is not None:
        return {"type": "redacted_thinking", "data": block.redacted}
    return {"type": "thinking", "thinking": block.text, "signature": block.signature or ""}


def _object(arguments: str) -> dict[str, Any] | None:
    try:
        value = orjson.loads(arguments)
    except orjson.JSONDecodeError:
        return None
    if type(value) is not dict or deeper_than(value, MAX_JSON_DEPTH):
        return None  # too deep: orjson could not write it back (254 levels)
    return value


def tool_input(arguments: str) -> dict[str, Any]:
    """A ``tool_use`` block's ``input`` for a tool call's ``arguments``: the object they
    hold; ``{}`` for none; ``{"_raw": arguments}`` when they are not a JSON object (a model
    may write broken JSON, and ``input`` must be an object)."""
    if not arguments:
        return {}
    value = _object(arguments)
    return {"_raw": arguments} if value is None else value


def tool_input_json(arguments: str) -> str:
    """:func:`tool_input` as JSON text, the streamed ``input_json_delta``: ``arguments``
    themselves when they hold an object, so the SDK's stream and the JSON body agree."""
    if _object(arguments) is not None:
        return arguments
    return orjson.dumps({"_raw": arguments}).decode()


def message_id(stream_id: str) -> str:
    return "msg_" + stream_id.rpartition("-")[2]


def usage_body(usage: Any) -> dict[str, Any]:
    """Anthropic usage from ours: ``input_tokens`` excludes cache reads and writes,
    which are reported apart (docs/protocols.md §3). Every count is there, zeros
    included, as Anthropic sends them: code that adds them up needs no ``None`` check."""
    if usage is None:
        cached = written = long = prompt = completion = 0
    else:
        cached = usage.cached_tokens or 0
        written = usage.cache_write_tokens or 0
        long = min(usage.cache_write_1h_tokens or 0, written)  # billed dearer
        prompt, completion = usage.prompt_tokens, usage.completion_tokens
    return {
        "input_tokens": max(prompt - cached - written, 0),
        "cache_creation_input_tokens": written,
        "cache_read_input_tokens": cached,
        "cache_creation": {
            "ephemeral_5m_input_tokens": written - long,
            "ephemeral_1h_input_tokens": long,
        },
        "output_tokens": completion,
    }


ANTHROPIC_ERROR_TYPES = frozenset({*ERROR_TYPES.values(), "api_error"})


def anthropic_error_type(error_type: str, status: int) -> str:
    """An Anthropic error type: the error's own when it is one (an Anthropic upstream's),
    else the one Anthropic uses for the status."""
    if error_type in ANTHROPIC_ERROR_TYPES and error_type != "invalid_request_error":
        return error_type
    return ERROR_TYPES.get(status, "api_error" if status >= 500 else "invalid_request_error")


def error_body(kind: str, message: str, code: str | None, request_id: str | None) -> dict[str, Any]:
    """Anthropic's error shape: ``{"type":"error","error":{"type","message","details":
    {"error_code"}},"request_id"}``. ``details.error_code`` is where the API puts an
    error's stable code (the SDK's ``APIStatusError.error_code``); each is left out
    when unknown."""

    error: dict[str, Any] = {"type": kind, "message": message}
    if code:
        error["details"] = {"error_code": code}
    body: dict[str, Any] = {"type": "error", "error": error}
    if request_id is not None:
        body["request_id"] = request_id
    return body


def anthropic_error_body(error: GatewayError, request_id: str | None = None) -> dict[str, Any]:
    """The error body of ``/v1/messages`` (docs/protocols.md §3): :func:`error_body`."""
    kind = anthropic_error_type(error.error_type, error.status)
    return error_body(kind, error.message, error.code, request_id)
