"""A chat ``file`` part as an Anthropic ``document`` block. Sans-I/O.

OpenAI's file part carries its file inline (``file.file_data``: a ``data:`` URL of base64,
with an optional ``filename``) or by ``file_id`` (an upload to OpenAI's Files API). The
Messages API takes a PDF as a ``base64`` document and a text file as a ``text`` one (the
``filename`` its ``title``). A file by id, which Anthropic cannot fetch, or of another type,
has no place there: the request is refused naming the part (:func:`file_refusal`), never
sent without it (the model would answer about a file it never saw).

A ``/v1/messages`` client's ``document`` block goes the other way (:func:`document_part`):
a file part, its data inline when it is (any target can read a PDF so), and what only
Anthropic has (``title``, ``context``, ``citations``, the cache mark, a source by ``url``,
``file_id`` or ``content``) beside it in ``anthropic_document``, which
:func:`document_block` puts back as sent and a target without documents refuses
(:func:`document_refusal`).
"""

from __future__ import annotations

import base64
import binascii
from typing import Any

from ..errors import InvalidRequest
from ..request import ChatRequest, FilePart, UserMessage

__all__ = [
    "base64_data_url",
    "chat_file",
    "document_block",
    "document_part",
    "document_refusal",
    "file_refusal",
]

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


def document_part(block: dict[str, Any]) -> dict[str, Any]:
    """The chat ``file`` part of a Messages ``document`` block (validated as one)."""
    kept = {key: value for key, value in block.items() if key != "type"}
    source = kept.pop("source")
    file: dict[str, Any] = {}
    if source["type"] in ("base64", "text"):
        data = source["data"]
        if source["type"] == "text":
            data = base64.b64encode(data.encode()).decode()
        file["file_data"] = f"data:{source['media_type']};base64,{data}"
        extension = "pdf" if source["type"] == "base64" else "txt"
        file["filename"] = kept.get("title") or f"document.{extension}"
    else:
        kept["source"] = source  # (by url, file_id or content blocks: Anthropic's to read)
    return {"type": "file", "file": file, "anthropic_document": kept}


def document_refusal(request: ChatRequest) -> InvalidRequest | None:
    """For a target without Anthropic's documents: the 400 for the first document that
    asks for what a file part cannot carry (a source not inline, citations, a context)."""
    for at, message in enumerate(request.messages):
        if not isinstance(message, UserMessage) or isinstance(message.content, str):
            continue
        for index, part in enumerate(message.content):
            sent = (part.model_extra or {}).get("anthropic_document")
            if not isinstance(part, FilePart) or not sent:
                continue
            asked = next((key for key in ("source", "citations", "context") if key in sent), None)
            if asked is not None:
                param = f"messages[{at}].content[{index}].{asked}"
                return InvalidRequest(
                    f"{param}: a document's {asked}, which this model's provider (Chat "
                    "Completions) cannot take; send it to an Anthropic model",
                    param=param,
                )
    return None


def chat_file(part: dict[str, Any]) -> dict[str, Any]:
    """A ``/v1/messages`` document's file part as Chat Completions takes it: a PDF as it is
    (a file part), a text as a text part (files there are PDFs)."""
    inline = _inline(part["file"])
    if inline is not None and inline[0] == "text/plain":
        return {"type": "text", "text": base64.b64decode(inline[1]).decode()}
    return part


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
            sent = (part.model_extra or {}).get("anthropic_document")
            if sent and "source" in sent:
                continue  # a /v1/messages client's document, its source as sent
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
    """The ``document`` block of a file part :func:`file_refusal` let through (a
    ``/v1/messages`` client's as it sent it)."""
    sent = (part.model_extra or {}).get("anthropic_document")
    if sent is not None and "source" in sent:
        return {"type": "document", **sent}
    block = _inline_block(part)
    if sent is not None:  # its own fields, as sent (no title made of a filename it lacked)
        block.pop("title", None)
        block.update(sent)
    return block


def _inline_block(part: FilePart) -> dict[str, Any]:
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
