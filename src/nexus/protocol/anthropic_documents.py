"""A chat ``file`` part as an Anthropic ``document`` block. Sans-I/O.

OpenAI's file part carries its file inline (``file.file_data``: a ``data:`` URL of base64,
with an optional ``filename``) or by ``file_id`` (an upload to OpenAI's Files API). The
Messages API takes a PDF as a ``base64`` document and a text file as a ``text`` one (the
``filename`` its ``title``). A file by id, which Anthropic cannot fetch, or of another type,
has no place there: the request is refused naming the part (:func:`file_refusal`), never
sent without it (the model would answer about a file it never saw).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from ..errors import InvalidRequest
from ..request import ChatRequest, FilePart, UserMessage

__all__ = ["base64_data_url", "document_block", "file_refusal"]

_TYPES = ("application/pdf", "text/plain")


def base64_data_url(value: object) -> tuple[str, str] | None:
    """The media type and base64 of a ``data:<type>;base64,<data>`` URL, else None: what
    an Anthropic ``base64`` source is made of (an image's as a file's)."""
    if type(value) is not str or not value.startswith("data:"):
        return None
    header, comma, payload = value.partition(",")
    media_type, _, encoding = header[5:].partition(";")
    if not comma or encoding != "base64":
        return None
    return media_type.strip().lower(), payload


def _inline(file: dict[str, Any]) -> tuple[str, str] | None:
    """The media type and base64 of a file sent inline, else None."""
    return base64_data_url(file.get("file_data"))


def _problem(file: dict[str, Any]) -> str | None:
    """Why a file part cannot be an Anthropic document, or None."""
    if "file_id" in file and "file_data" not in file:
        return "a file sent by file_id (an upload to OpenAI, which Anthropic cannot fetch)"
    inline = _inline(file)
    if inline is None:
        return "a file not sent as a base64 data: URL"
    media_type, payload = inline
    if media_type not in _TYPES:
        return f"a file of type {media_type[:60]!r} (a document is a PDF or plain text)"
    try:
        raw = base64.b64decode(payload, validate=True)
        if media_type == "text/plain":
            raw.decode("utf-8")
    except (binascii.Error, ValueError):
        return f"a {media_type} file whose data is not valid base64 of it"
    return None


def file_refusal(request: ChatRequest) -> InvalidRequest | None:
    """The 400 for the first file part the Messages API cannot take, or None."""
    for at, message in enumerate(request.messages):
        if not isinstance(message, UserMessage) or isinstance(message.content, str):
            continue
        for index, part in enumerate(message.content):
            if isinstance(part, FilePart) and (problem := _problem(part.file)) is not None:
                param = f"messages[{at}].content[{index}].file"
                message_text = (
                    f"{param}: {problem}, which this model's provider (Anthropic Messages) "
                    "cannot take; send a PDF or a text file inline as file_data, or send it "
                    "to a model of an OpenAI-compatible provider"
                )
                return InvalidRequest(message_text, param=param)
    return None


def document_block(part: FilePart) -> dict[str, Any]:
    """The ``document`` block of a file part :func:`file_refusal` let through."""
    inline = _inline(part.file)
    assert inline is not None  # (file_refusal)
    media_type, payload = inline
    if media_type == "text/plain":
        text = base64.b64decode(payload).decode("utf-8")
        source = {"type": "text", "media_type": "text/plain", "data": text}
    else:
        source = {"type": "base64", "media_type": media_type, "data": payload}
    block: dict[str, Any] = {"type": "document", "source": source}
    title = part.file.get("filename")
    if type(title) is str and title:
        block["title"] = title
    cache = (part.model_extra or {}).get("cache_control")
    if cache is not None:
        block["cache_control"] = cache
    return block
