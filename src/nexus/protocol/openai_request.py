"""The upstream request of Chat Completions (docs/protocols.md §2), for any
OpenAI-compatible server: what of Nexus's request it takes, and the 400 for what it cannot.
Sans-I/O."""

from __future__ import annotations

from typing import Any

from ..errors import InvalidRequest
from ..request import ChatRequest
from .anthropic_documents import chat_file, document_refusal
from .anthropic_tools import tool_refusal
from .openai_chat import unanswered
from .output_config import openai_fields

__all__ = ["TOOL_ERROR_PREFIX", "refusal", "upstream_body"]

_NOT_OPENAI = {"mock", "thinking", "top_k", "background", "output_config", "anthropic_beta"}
_NOT_OPENAI |= {"context_management", "cache_control"}  # (a /v1/messages client's)


def refusal(request: ChatRequest) -> InvalidRequest | None:
    """The 400 for what Chat Completions has no counterpart for: a part of ``output_config``
    (:func:`~.output_config.openai_fields`), a tool's or a document's Anthropic fields."""
    try:
        openai_fields(request)
    except InvalidRequest as exc:
        return exc
    return tool_refusal(request) or document_refusal(request) or unanswered(request)


def upstream_body(
    request: ChatRequest, model: str, token_limit_field: str | None = None
) -> dict[str, Any]:
    """The upstream request: ours (fields Nexus does not interpret pass through), with the
    upstream model, streaming with usage. Anthropic's ``output_config`` goes in OpenAI's
    terms (:func:`~.output_config.openai_fields`), a ``/v1/messages`` document as a file or
    text part; its ``top_k`` (sampling only), ``thinking`` and betas stay home. Nexus's own
    stream options stay home, and so does ``include_obfuscation``: it shapes the client's
    stream; upstream, the provider's default (OpenAI pads, hiding token lengths from
    whoever watches the traffic) is kept."""
    body = request.model_dump(mode="json", exclude_none=True, exclude=_NOT_OPENAI, by_alias=True)
    body.update(openai_fields(request, model))  # output_config in OpenAI's terms
    for message in body.get("messages", ()):
        message.pop("anthropic_content", None)  # a /v1/messages turn's blocks, for Anthropic
        if message.get("role") == "tool":
            _tool_message(message)
        content = message.get("content")
        if isinstance(content, list):
            for at, part in enumerate(content):
                part.pop("cache_control", None)  # Anthropic's prompt-cache marks
                if part.pop("anthropic_document", None) is not None:
                    content[at] = chat_file(part)
    for tool in body.get("tools") or ():
        tool.pop("cache_control", None)
        tool.pop("anthropic_tool", None)
    body["model"] = model
    if body.get("service_tier") == "standard_only":  # a /v1/messages client's, in OpenAI's words
        body["service_tier"] = "default"
    body["stream"] = True
    options = dict(body.get("stream_options") or {})
    options["include_usage"] = True
    options.pop("include_cost", None)
    options.pop("include_obfuscation", None)
    body["stream_options"] = options
    if token_limit_field is not None and request.token_limit is not None:
        body.pop("max_tokens", None)
        body.pop("max_completion_tokens", None)
        body[token_limit_field] = request.token_limit
    return body


TOOL_ERROR_PREFIX = "Error: "
"""An Anthropic ``tool_result``'s ``is_error: true`` (Chat Completions has no such flag)."""


def _tool_message(message: dict[str, Any]) -> None:
    """Anthropic's fields of a tool message in Chat Completions' terms: ``is_error`` as
    :data:`TOOL_ERROR_PREFIX`, the result's text as its text (its cache mark dropped); an
    image or a document in a tool result is refused (a tool message holds only text)."""
    message.pop("cache_control", None)
    blocks = message.pop("tool_result_content", None) or ()
    held = next((block["type"] for block in blocks if block["type"] != "text"), None)
    if held is not None:
        raise InvalidRequest(
            f"messages: the tool_result for {message.get('tool_call_id')!r} holds a block "
            f"of type {held!r}, which this model's provider (Chat Completions) cannot take in "
            "a tool result; send it in the user message beside it",
            param="messages",
        )
    if message.pop("is_error", None) is True:
        content = message.get("content")
        if isinstance(content, str):
            message["content"] = TOOL_ERROR_PREFIX + content
        elif isinstance(content, list):
            message["content"] = [{"type": "text", "text": TOOL_ERROR_PREFIX}, *content]
