"""What a request's prompt is estimated at, in tokens, before (or without) the upstream's
count. Sans-I/O.

Two uses: a budget holds a request's worst case while it runs
(:func:`~nexus.pricing.worst_cost`), and a stream its upstream answered without a usage
(cut before it) is charged its prompt's estimate (:func:`~nexus.pricing.spend_of`). Text
counts by its bytes; images by their detail; audio by its duration
(:mod:`nexus.protocol.audio_duration`), as OpenAI bills it, never by its bytes: an 8 kbit/s
MP3 is a tenth of the bytes of the same minute at 80 kbit/s, and billed the same.
"""

from __future__ import annotations

import binascii
import math
import weakref
from typing import Any

import orjson

from .protocol.audio_duration import FLOOR_BYTES_PER_S, audio_seconds
from .protocol.pdf_pages import pdf_pages
from .request import (
    AssistantMessage,
    AudioPart,
    ChatRequest,
    FilePart,
    ImagePart,
    InputAudio,
    RefusalPart,
    TextPart,
    ToolMessage,
)

__all__ = [
    "AUDIO_INPUT_TOKENS_PER_S",
    "AUDIO_OUTPUT_TOKENS_PER_S",
    "CHARS_PER_TOKEN",
    "IMAGE_DETAIL_TOKENS",
    "IMAGE_TOKENS",
    "MESSAGE_TOKENS",
    "PDF_PAGE_TOKENS",
    "SPOKEN_BYTES_PER_TOKEN",
    "UNSAID_PAGES",
    "UNSEEN_TOKENS",
    "clip_seconds",
    "prompt_audio_estimate",
    "prompt_estimate",
    "spoken_bytes",
]

CHARS_PER_TOKEN = 4
"""UTF-8 bytes per token in :func:`prompt_estimate` (English text runs at about four); a
document's bytes count as its text's."""
MESSAGE_TOKENS = 4
"""A message's role and separators, as OpenAI's chat format counts them (3 to 4)."""
IMAGE_TOKENS = 85
"""An image at ``detail: low`` (OpenAI bills 85)."""
IMAGE_DETAIL_TOKENS = 765
"""An image at ``auto`` or ``high`` detail: what OpenAI bills a 1024x1024 one (85, and
170 for each of its four tiles)."""
AUDIO_INPUT_TOKENS_PER_S = 10
"""A prompt's audio: OpenAI counts a token per 100 ms of a user's audio."""
AUDIO_OUTPUT_TOKENS_PER_S = 20
"""Audio output: OpenAI counts a token per 50 ms of the model's audio."""
SPOKEN_BYTES_PER_TOKEN = 48_000 // AUDIO_OUTPUT_TOKENS_PER_S
"""Audio output's bytes per token: OpenAI streams it as ``pcm16`` (the one format it
streams), 16-bit mono samples at 24 kHz, 48,000 bytes a second."""
UNSEEN_TOKENS = 85
"""A file sent by id: its size is the upstream's to know."""
PDF_PAGE_TOKENS = 3000
"""A PDF page as a provider bills it: its text (1,500-3,000 tokens, Anthropic says) and, for
Anthropic, an image of it."""
UNSAID_PAGES = 100
"""A PDF whose pages cannot be told (:mod:`~nexus.protocol.pdf_pages`): Anthropic's most."""


def prompt_estimate(request: ChatRequest) -> int:
    """The tokens ``request``'s prompt is estimated at, for a stream without a usage from
    its upstream: a token per :data:`CHARS_PER_TOKEN` UTF-8 bytes of every text the model
    reads (contents, refusals, names, tool calls, fields Nexus passes on unread, tool
    definitions, the response schema) and of inline documents, :data:`MESSAGE_TOKENS` per
    message, images by their detail, audio by its duration (:func:`clip_seconds`;
    :data:`AUDIO_INPUT_TOKENS_PER_S` a second, rounded up, and one a clip).

    A tokenizer would be closer, but there is none for every provider, and one would
    cost more per request than the estimate is worth: it is charged only to streams
    whose upstream reported no usage (cut before it, mostly), marked ``estimated``.
    """
    size = 0
    tokens = MESSAGE_TOKENS * len(request.messages)
    for message in request.messages:
        content = message.content
        if isinstance(content, str):
            size += len(content.encode())
        elif content is not None:
            for part in content:
                if isinstance(part, TextPart):
                    size += len(part.text.encode())
                elif isinstance(part, RefusalPart):
                    size += len(part.refusal.encode())
                else:
                    tokens += _media_tokens(part)
        if not isinstance(message, ToolMessage):  # (a missing attribute costs pydantic µs)
            size += len((message.name or "").encode())
        if isinstance(message, AssistantMessage):
            size += len((message.refusal or "").encode())
            for call in message.tool_calls or ():
                called = call.function
                size += len(called.name.encode()) + len(called.arguments.encode())
        extra = message.model_extra  # passed on upstream as they came
        if extra:
            if "anthropic_content" in extra or "tool_result_content" in extra:
                extra = dict(extra)
                for block in extra.pop("anthropic_content", None) or ():
                    size += _block_size(block, ("text", "tool_use"))  # (in content, tool_calls)
                for block in extra.pop("tool_result_content", None) or ():
                    size, tokens = _result_block(block, size, tokens)
            size += _json_size(extra) if extra else 0
    for tool in request.tools or ():
        function = tool.function  # its parts, not a model_dump: per request, dozens of tools
        size += len(function.name) + len((function.description or "").encode())
        if function.parameters is not None:
            size += len(orjson.dumps(function.parameters))
        if tool.model_extra:  # what rides beside it (a /v1/messages tool's input_examples)
            size += _json_size(tool.model_extra)
    response_format = request.response_format
    schema = response_format.json_schema if response_format is not None else None
    if schema is not None:
        size += len(schema.name.encode()) + len((schema.description or "").encode())
        if schema.schema_ is not None:
            size += len(orjson.dumps(schema.schema_))
    config = (request.model_extra or {}).get("output_config")  # Anthropic's format
    fmt = config.get("format") if type(config) is dict else None
    if type(fmt) is dict:
        size += len(orjson.dumps(fmt.get("schema")))
    return tokens + -(-size // CHARS_PER_TOKEN)  # rounded up


def prompt_audio_estimate(request: ChatRequest) -> int:
    """Of :func:`prompt_estimate`, the tokens of its audio parts (by their duration): what
    a budget holds, and a stream cut before its usage is charged, at the audio input
    price."""
    tokens = 0
    for message in request.messages:
        content = message.content
        if isinstance(content, list):
            for part in content:
                if isinstance(part, AudioPart):
                    tokens += _media_tokens(part)
    return tokens


def _json_size(value: Any) -> int:
    try:
        return len(orjson.dumps(value))
    except TypeError:  # (an integer past 64 bits, from Python callers)
        return len(repr(value))


def _block_size(block: Any, counted: tuple[str, ...]) -> int:
    """The bytes of an Anthropic block a message carries beside its chat form, but for the
    blocks of a type that form has already counted (``counted``): a thinking block by its
    text, any other by its JSON."""
    kind = block.get("type") if type(block) is dict else None
    if kind in counted:
        return 0
    if kind == "thinking":
        return len(str(block.get("thinking") or "").encode())
    return _json_size(block)


def _result_block(block: Any, size: int, tokens: int) -> tuple[int, int]:
    """A ``tool_result``'s block (its text is the tool message's content, already
    counted): an image by its detail, a PDF by its pages, anything else by its JSON."""
    kind = block.get("type") if type(block) is dict else None
    source = block.get("source") if kind in ("image", "document") else None
    if kind == "image":
        return size, tokens + IMAGE_DETAIL_TOKENS
    if type(source) is dict and source.get("media_type") == "application/pdf":
        data = source.get("data")
        by_size = 1 + len(data) * 3 // 4 // CHARS_PER_TOKEN if type(data) is str else 0
        return size, tokens + max(by_size, _pdf_tokens(data))  # as a file part is
    return size + _block_size(block, ("text",)), tokens


def _media_tokens(part: ImagePart | AudioPart | FilePart) -> int:
    """An image by its detail, audio by its duration, a document by its size."""
    if isinstance(part, ImagePart):
        return IMAGE_TOKENS if part.image_url.detail == "low" else IMAGE_DETAIL_TOKENS
    if isinstance(part, AudioPart):
        return 1 + _tokens(clip_seconds(part.input_audio), AUDIO_INPUT_TOKENS_PER_S)
    extra = part.model_extra  # a /v1/messages document's context, title, content blocks
    said = -(-len(orjson.dumps(extra)) // CHARS_PER_TOKEN) if extra else 0
    data = part.file.get("file_data")
    if not isinstance(data, str):
        return said + UNSEEN_TOKENS
    encoded = len(data) - (data.find(",") + 1 if data.startswith("data:") else 0)
    by_size = 1 + encoded * 3 // 4 // CHARS_PER_TOKEN
    if not data[:21].lower().startswith("data:application/pdf"):
        return said + by_size
    return said + max(by_size, _pdf_tokens(data, data.find(",") + 1))


def _pdf_tokens(text: object, at: int = 0) -> int:
    """A PDF (its base64, from ``at`` in ``text``) by its pages, :data:`PDF_PAGE_TOKENS`
    each, once a request (its hold and its stream both ask: reading a 32 MB one takes 0.1
    s); one that does not say, :data:`UNSAID_PAGES`."""
    if type(text) is not str:
        return UNSAID_PAGES * PDF_PAGE_TOKENS
    # By the text's identity, the text held beside its count: an id is another string's
    # once its own is freed (a PDF of one page read as another's thousand, or the other
    # way), never while the text is alive. Bounded in bytes held, not in entries.
    held = _PDFS.get(id(text))
    if held is not None and held[0] is text:
        return held[1]
    try:
        pages = pdf_pages(binascii.a2b_base64(text[at:]))
    except (binascii.Error, ValueError):
        pages = None
    tokens = (UNSAID_PAGES if pages is None else pages) * PDF_PAGE_TOKENS
    global _pdf_chars
    while _PDFS and _pdf_chars + len(text) > PDF_CACHE_CHARS:
        _pdf_chars -= len(_PDFS.pop(next(iter(_PDFS)))[0])
    if len(text) <= PDF_CACHE_CHARS:
        _PDFS[id(text)] = (text, tokens)
        _pdf_chars += len(text)
    return tokens


PDF_CACHE_CHARS = 64 * 1024 * 1024
"""The PDFs' text :func:`_pdf_tokens` keeps alive for their counts, at most (the last ones)."""
_PDFS: dict[int, tuple[str, int]] = {}
_pdf_chars = 0


_SECONDS: weakref.WeakKeyDictionary[InputAudio, float] = weakref.WeakKeyDictionary()
"""Each audio's duration, once: a request's estimate is taken for its hold and again for
its stream (and a 32 MB clip takes a tenth of a second to decode and walk)."""


def clip_seconds(audio: InputAudio) -> float:
    """How long ``audio`` (base64, maybe in a ``data:`` URL) runs
    (:func:`~nexus.protocol.audio_duration.audio_seconds`; ``pcm16`` at its
    ``sample_rate``); what does not decode, its bytes at the floor rate."""
    seconds = _SECONDS.get(audio)
    if seconds is None:
        data = audio.data
        if data.startswith("data:"):
            data = data[data.find(",") + 1 :]
        try:
            decoded = binascii.a2b_base64(data)
        except (binascii.Error, ValueError):  # (ValueError: not ASCII)
            seconds = len(data) * 3 / 4 / FLOOR_BYTES_PER_S
        else:
            rate = (audio.model_extra or {}).get("sample_rate")
            seconds = audio_seconds(decoded, audio.format, rate)
        _SECONDS[audio] = seconds
    return seconds


def _tokens(seconds: float, per_second: int) -> int:
    """``seconds`` of audio in tokens, rounded up (after rounding off a float sum's last
    bits: 25,000 frames of 24 ms are 600 s, 6,000 tokens, not 6,001)."""
    return math.ceil(round(seconds * per_second, 6))


def spoken_bytes(data: str) -> int:
    """The bytes a piece of audio output holds, from its base64 text's length (each piece
    is padded on its own)."""
    return len(data) * 3 // 4 - (2 if data.endswith("==") else 1 if data.endswith("=") else 0)
