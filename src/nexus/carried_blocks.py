"""What a chat request carries for an Anthropic target beyond Chat Completions' fields,
and the checks that keep it to what ``/v1/messages`` validated: an assistant turn's blocks
(``anthropic_content``), a tool result's (``tool_result_content``), and the fields only a
translator may set (:data:`TRANSLATED`). Nothing here imports the request models."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import ValidationInfo

__all__ = ["TRANSLATED", "assistant_block", "result_block", "tool_input", "translated_only"]


TRANSLATED = {"translated": True}
"""The validation context of a request a surface's translator built (``/v1/messages``):
only such a request may carry what that surface checked for an Anthropic target
(``anthropic_tool``, ``anthropic_document``, ``anthropic_beta``). A client's own would
reach Anthropic unchecked (a server tool, an unknown field, a cache mark the budget's hold
does not see): refused on every other surface, the Python API's included."""


def translated_only(data: Any, info: ValidationInfo, name: str, instead: str) -> Any:
    if type(data) is dict and name in data and not (info.context or {}).get("translated"):
        raise ValueError(f"{name}: a field Nexus sets itself, not taken from a client; {instead}")
    return data


def tool_input(arguments: str) -> Any:
    """A tool call's arguments as a ``tool_use`` block's ``input`` holds them."""
    try:
        return orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return None  # (never equal to a block's input, which is an object)


_BLOCK_FIELDS: dict[str, dict[str, type]] = {
    "thinking": {"thinking": str},
    "redacted_thinking": {},
    "text": {"text": str},
    "tool_use": {"id": str, "name": str, "input": dict},
}
_OPTIONAL_FIELDS = {"signature": str, "data": str}
"""Checked when present: a thinking block without one (some Anthropic-compatible servers
send it so) goes back as the client has it."""


def assistant_block(block: Any) -> bool:
    if type(block) is not dict:
        return False
    fields = _BLOCK_FIELDS.get(str(block.get("type")))
    return (
        fields is not None
        and all(type(block.get(k)) is t for k, t in fields.items())
        and all(type(block[k]) is t for k, t in _OPTIONAL_FIELDS.items() if k in block)
    )


_INLINE_DOCUMENTS = {("base64", "application/pdf"), ("text", "text/plain")}
_DOCUMENT_KEYS = {"type", "source", "title", "context", "citations", "cache_control"}


def result_block(block: Any) -> bool:
    if type(block) is not dict:
        return False
    if block.get("type") == "text":
        return (
            type(block.get("text")) is str
            and block.keys() <= {"type", "text", "cache_control", "citations"}
            and type(block.get("citations", [])) is list
        )
    source = block.get("source")
    if block.get("type") == "document" and type(source) is dict:  # inline: its size is known
        inline = (source.get("type"), source.get("media_type")) in _INLINE_DOCUMENTS
        data = type(source.get("data")) is str and len(source) == 3
        return inline and data and block.keys() <= _DOCUMENT_KEYS
    if block.get("type") != "image" or type(source) is not dict:
        return False
    if source.get("type") == "base64":
        fields = (source.get("media_type"), source.get("data"))
        return all(type(f) is str for f in fields) and source.keys() == {
            "type",
            "media_type",
            "data",
        }
    return source.get("type") == "url" and type(source.get("url")) is str and len(source) == 2
