"""OpenAI Chat Completions wire shapes (docs/protocols.md §2 and §5). Sans-I/O.

Request bytes in, :class:`~nexus.request.ChatRequest` out; merged completion in,
``chat.completion`` dict out; plus the per-chunk pieces the SSE encoder uses.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import orjson
from pydantic import BaseModel, ValidationError

from ..errors import InvalidRequest
from ..events import Audio
from ..request import ChatRequest
from ..types import Completion, StreamMeta
from .json_depth import MAX_JSON_DEPTH, MAX_JSON_ITEMS, shape_error

__all__ = [
    "chunk_prefix",
    "completion_body",
    "joined_base64",
    "message_audio",
    "parse_chat_request",
    "tool_call",
    "unanswered",
    "validated",
    "validation_error",
]


M = TypeVar("M", bound=BaseModel)


def parse_chat_request(
    body: bytes, *, max_depth: int = MAX_JSON_DEPTH, max_items: int = MAX_JSON_ITEMS
) -> ChatRequest:
    """Validate a request body. Raises :class:`InvalidRequest` (see :func:`parse_json_object`
    and :func:`validation_error`)."""
    return validated(ChatRequest, parse_json_object(body, max_depth=max_depth, max_items=max_items))


UNANSWERED = {"moderation": "moderation results ride on a chunk of their own (moderation)"}
"""Chat fields whose answer is a response field Nexus's events have no place for."""


def unanswered(request: ChatRequest) -> InvalidRequest | None:
    """The 400 for a field whose answer would come back where Nexus keeps nothing
    (:data:`UNANSWERED`): passed on, the answer would be dropped unseen. Asked by an
    OpenAI-compatible target, on every surface (HTTP, the WebSocket, the Python API)."""
    extra = request.model_extra or {}
    asked = next((name for name in UNANSWERED if extra.get(name) is not None), None)
    if asked is None:
        return None
    message = f"{asked}: {UNANSWERED[asked]}, which Nexus does not carry back to the client"
    return InvalidRequest(message, param=asked)


def parse_json_object(
    body: bytes, *, max_depth: int = MAX_JSON_DEPTH, max_items: int = MAX_JSON_ITEMS
) -> dict[str, Any]:
    """A request body as a JSON object. Raises :class:`InvalidRequest`: ``invalid_json``
    for bytes that are not one (orjson parses 1024 levels at most), ``invalid_request``
    naming the field for one nested deeper than ``max_depth``; and 413
    ``request_too_large`` for one of more than ``max_items`` values (see
    :mod:`nexus.protocol.json_depth`)."""
    try:
        data = orjson.loads(body)
    except orjson.JSONDecodeError as exc:
        raise InvalidRequest(
            f"The request body is not valid JSON: {exc}", code="invalid_json"
        ) from None
    if not isinstance(data, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    error = shape_error(data, max_depth, max_items)
    if error is not None:
        raise error
    return data


def validated(model: type[M], data: Mapping[str, Any], context: dict[str, Any] | None = None) -> M:
    """``data`` as a ``model``; :class:`InvalidRequest` naming the first field that is not.
    ``context``: the validation's (:data:`~nexus.request.TRANSLATED`)."""
    try:
        return model.model_validate(data, context=context)
    except ValidationError as exc:
        raise validation_error(exc, data) from None


def validation_error(exc: ValidationError, data: Any) -> InvalidRequest:
    """The first validation failure as an :class:`InvalidRequest` naming its field."""
    errors = exc.errors(include_url=False)
    first = errors[0]
    if first["type"] == "string_type" and first["loc"][-1] == "str" and len(errors) > 1:
        first = errors[1]  # a content's list of parts: what is wrong in it, not "not a string"
    param = field_path(first["loc"], data)
    if first["type"] in ("union_tag_invalid", "union_tag_not_found"):
        tag = str(first.get("ctx", {}).get("discriminator", "")).strip("'")
        if tag:
            param = f"{param}.{tag}" if param else tag
    message = first["msg"]
    if first["type"] == "missing":
        message = "Field required"
    elif first["type"] == "extra_forbidden":
        message = "Unknown field"
    elif first["type"] == "value_error":
        message = message.removeprefix("Value error, ")
        name, colon, rest = message.partition(": ")  # an object's validator naming its field
        for loc in (first["loc"], first["loc"][:-1]) if colon else ():  # (last: a union's tag?)
            if name in _node(loc, data):
                base = field_path(loc, data)
                param, message = f"{base}.{name}" if base else name, rest
                break
    return InvalidRequest(f"{param}: {message}" if param else message, param=param or None)


def _node(loc: tuple[int | str, ...], data: Any) -> Any:
    """The object of ``data`` at ``loc`` (its union tags skipped), else an empty dict."""
    node = data
    for part in loc:
        in_list = isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)
        if in_list or (isinstance(node, dict) and part in node):
            node = node[part]
    return node if isinstance(node, dict) else {}


def field_path(loc: tuple[int | str, ...], data: Any) -> str:
    """``('messages', 0, 'user', 'content')`` -> ``messages[0].content``: union tags in
    ``loc`` are told from real fields by walking the input along the path."""
    out = ""
    node = data
    last = len(loc) - 1
    for i, part in enumerate(loc):
        if isinstance(part, int) and isinstance(node, list) and 0 <= part < len(node):
            out += f"[{part}]"
            node = node[part]
        elif isinstance(part, str) and isinstance(node, dict) and (part in node or i == last):
            out += f".{part}" if out else part
            node = node.get(part)
        elif isinstance(part, str) and i == last and not isinstance(node, dict | list):
            continue
    return out


def tool_call(
    call_id: str, name: str, arguments: str, extra_content: dict[str, Any] | None = None
) -> dict[str, Any]:
    """A ``tool_calls`` entry of a chat message (``arguments``: JSON text; ``extra_content``
    what the upstream attached to it, when it did)."""
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    return call if extra_content is None else {**call, "extra_content": extra_content}


def chunk_prefix(meta: StreamMeta) -> bytes:
    """The bytes every chunk of a stream starts with, up to ``"choices":`` (serialised
    once per stream)."""

    head = orjson.dumps(
        {
            "id": meta.id,
            "object": "chat.completion.chunk",
            "created": meta.created,
            "model": meta.model,
        }
    )
    return head[:-1] + b',"choices":'


def completion_body(completion: Completion) -> dict[str, Any]:
    """A non-streaming ``chat.completion`` object (docs/protocols.md §5)."""
    # No text beside a refusal, tool calls or audio is null, as OpenAI sends it, not "".
    empty = completion.refusal is not None or completion.tool_calls or completion.audio
    message: dict[str, Any] = {
        "role": completion.role,
        "content": completion.content if completion.content or not empty else None,
        "refusal": completion.refusal,
        "annotations": [
            {
                "type": "url_citation",
                "url_citation": {"url": c.url, "title": c.title},
            }
            for c in completion.citations
        ],
    }
    if completion.reasoning:
        message["reasoning_content"] = completion.reasoning
    if completion.tool_calls:
        message["tool_calls"] = [
            tool_call(call.id, call.name, call.arguments, call.extra_content)
            for call in completion.tool_calls
        ]
    if completion.audio:
        message["audio"] = message_audio(completion.audio)
    usage = completion.usage
    return {
        "id": completion.id,
        "object": "chat.completion",
        "created": completion.created,
        "model": completion.model,
        "choices": [
            {
                "index": 0,
                "message": message,
                "logprobs": None,
                "finish_reason": completion.finish_reason or "stop",
            }
        ],
        "usage": usage.wire()
        if usage is not None
        else {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0},
    }


def message_audio(pieces: Sequence[Audio]) -> dict[str, Any]:
    """A non-streaming message's ``audio`` (OpenAI's ``ChatCompletionAudio``) from the
    streamed pieces: the first ``id`` and the last ``expires_at`` given, the transcript
    pieces joined, the data as :func:`joined_base64` of its pieces."""
    audio_id = next((piece.id for piece in pieces if piece.id is not None), None)
    expires = [piece.expires_at for piece in pieces if piece.expires_at is not None]
    return {
        "id": audio_id,
        "data": joined_base64([piece.data for piece in pieces if piece.data]),
        "expires_at": expires[-1] if expires else None,
        "transcript": "".join(piece.transcript for piece in pieces if piece.transcript),
    }


def joined_base64(pieces: Sequence[str]) -> str:
    """One base64 text for the bytes of ``pieces``. OpenAI encodes each streamed piece on
    its own (each a whole base64 text, padded with ``=`` where its bytes end off a
    3-byte boundary), so the texts joined would not decode past the first padding: the
    pieces are decoded, their bytes joined and encoded again. Pieces that are not each
    valid base64 are taken as one text cut anywhere, and joined as text."""
    if len(pieces) == 1:
        return pieces[0]
    try:
        raw = b"".join(base64.b64decode(piece, validate=True) for piece in pieces)
    except binascii.Error:
        return "".join(pieces)
    return base64.b64encode(raw).decode("ascii")
