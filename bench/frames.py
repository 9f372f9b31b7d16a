"""The fake upstream's frames, byte for byte as the providers send them (docs/protocols.md §2, §3).

Pure: bytes out, no I/O. :func:`frames` gives one stream's frames; the upstream
(``bench/upstream.py``) frames them in HTTP chunks and times them.

``realistic`` (the default) is today's wire:

* OpenAI: every ``chat.completion.chunk`` carries ``id``, ``object``, ``created``,
  ``model``, ``service_tier``, ``system_fingerprint``, ``choices`` (with ``logprobs``),
  ``"usage": null`` when the request set ``stream_options.include_usage``, and a random
  ``obfuscation`` string of 1-16 characters unless it set
  ``stream_options.include_obfuscation: false``. So the bytes around the text change
  from one content frame to the next.
* Anthropic: ``message_start``, ``content_block_start``, ``ping``, one
  ``content_block_delta`` (``text_delta``) per token, ``content_block_stop``,
  ``message_delta`` (stop reason, usage), ``message_stop``; each ``event: X`` then
  ``data: {...}``.

``synthetic`` is the old benchmark's OpenAI stream, kept for comparison only: the
bare fields, no ``logprobs``, ``usage`` or ``obfuscation``, so every content frame is
the same bytes but for its text. There is no synthetic Anthropic stream.

Every content text starts with a space: the load generator counts content deltas as
``"content":" `` (``"text":" ``) on the wire.
"""

from __future__ import annotations

import json
import random
import re
import string
import time
from dataclasses import dataclass

__all__ = ["FRAMES", "POOL", "TOKENS", "Frames", "Shape", "frames"]

FRAMES = ("realistic", "synthetic")
POOL = 512
"""Content frames a realistic stream cycles through (each with its own obfuscation)."""
VARIANTS = 8
"""Distinct streams (ids, fingerprints, obfuscation strings) the upstream hands out in turn."""

_TEXTS = (
    *re.findall(
        r" \S+",
        " The quick brown fox jumps over a lazy dog, while the gateway streams every token to"
        " its clients as soon as it arrives from upstream, without buffering anything.",
    ),
    " \n\n",
    ' "quoted"',
    " naïve",
    " 東京",
    " 42",
    " `code`",
    " C:\\path",
    " -",
)
TOKENS = tuple(json.dumps(t, ensure_ascii=False)[1:-1].encode() for t in _TEXTS)
"""Content texts, JSON-escaped, as they go between the quotes: words of every length,
and some with what real text has (newlines, quotes, backslashes, non-ASCII as raw
UTF-8, as OpenAI and Anthropic send it). Consecutive tokens differ: LiteLLM ends a
stream of 100 identical chunks in a row with an error."""
_SYNTHETIC_TOKENS = tuple(
    b" " + w for w in (b"alpha", b"bravo", b"delta", b"gamma", b"hotel", b"india")
)
_ALNUM = string.ascii_letters + string.digits


@dataclass(frozen=True)
class Shape:
    """Which stream a request gets: the provider's wire, and what the request asked for."""

    provider: str = "openai"
    """``openai`` (``POST …/chat/completions``) or ``anthropic`` (``POST …/v1/messages``)."""
    frames: str = "realistic"
    include_usage: bool = False
    obfuscation: bool = True


@dataclass(frozen=True)
class Frames:
    """One stream's frames. Content frame ``i`` is ``head + text + tails[i % len(tails)]``."""

    opening: tuple[bytes, ...]
    head: bytes
    tails: tuple[bytes, ...]
    texts: tuple[bytes, ...]
    shape: Shape
    prefix: bytes = b""
    """OpenAI: the chunk's fields before ``choices`` (the same in every chunk of a stream)."""
    seed: int = 0

    def content(self, i: int, text: bytes | None = None) -> bytes:
        """Content frame ``i``, with ``text`` (JSON-escaped) or the pool's."""
        if text is None:
            text = self.texts[i % len(self.texts)]
        return self.head + text + self.tails[i % len(self.tails)]

    def closing(self, chunks: int) -> tuple[bytes, ...]:
        """The frames after ``chunks`` content frames, through the end of the stream."""
        if self.shape.provider == "anthropic":
            usage = b'{"output_tokens":%d}' % chunks
            return (
                _event(b"content_block_stop", b'{"type":"content_block_stop","index":0}'),
                _event(
                    b"message_delta",
                    b'{"type":"message_delta","delta":{"stop_reason":"end_turn",'
                    b'"stop_sequence":null},"usage":' + usage + b"}",
                ),
                _event(b"message_stop", b'{"type":"message_stop"}'),
            )
        rng = random.Random(self.seed + 1)
        finish = b'[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]'
        if self.shape.frames == "synthetic":
            finish = b'[{"index":0,"delta":{},"finish_reason":"stop"}]'
        out = [self._chunk(finish, rng, usage=b"null")]
        if self.shape.include_usage:
            details = (
                b',"prompt_tokens_details":{"cached_tokens":0,"audio_tokens":0},'
                b'"completion_tokens_details":{"reasoning_tokens":0,"audio_tokens":0,'
                b'"accepted_prediction_tokens":0,"rejected_prediction_tokens":0}'
            )
            if self.shape.frames == "synthetic":
                details = b""
            usage = b'{"prompt_tokens":8,"completion_tokens":%d,"total_tokens":%d%s}' % (
                chunks,
                chunks + 8,
                details,
            )
            out.append(self._chunk(b"[]", rng, usage=usage))
        out.append(b"data: [DONE]\n\n")
        return tuple(out)

    def _chunk(self, choices: bytes, rng: random.Random, usage: bytes) -> bytes:
        return self.prefix + choices + _after_choices(self.shape, rng, usage) + b"}\n\n"


def _event(name: bytes, data: bytes) -> bytes:
    return b"event: " + name + b"\ndata: " + data + b"\n\n"


def _random(rng: random.Random, n: int, alphabet: str = _ALNUM) -> bytes:
    return "".join(rng.choices(alphabet, k=n)).encode()


def _after_choices(shape: Shape, rng: random.Random, usage: bytes) -> bytes:
    """What follows ``choices`` in an OpenAI chunk: ``usage`` and ``obfuscation``, as asked."""
    if shape.frames == "synthetic":
        return b',"usage":' + usage if usage != b"null" else b""
    out = b',"usage":' + usage if shape.include_usage else b""
    if shape.obfuscation:
        out += b',"obfuscation":"' + _random(rng, rng.randint(1, 16)) + b'"'
    return out


def frames(shape: Shape, variant: int) -> Frames:
    """The frames of stream ``variant`` (``0 <= variant < VARIANTS``) of ``shape``;
    the same bytes for the same arguments (seeded), but ``created``."""
    seed = variant * 7919
    rng = random.Random(seed)
    if shape.provider == "anthropic":
        return _anthropic(shape, rng, seed)
    if shape.frames == "synthetic":
        prefix = (
            b'data: {"id":"chatcmpl-bench","object":"chat.completion.chunk",'
            b'"created":1700000000,"model":"bench","choices":'
        )
        role = b'[{"index":0,"delta":{"role":"assistant","content":""},"finish_reason":null}]'
        return Frames(
            opening=(prefix + role + b"}\n\n",),
            head=prefix + b'[{"index":0,"delta":{"content":"',
            tails=(b'"},"finish_reason":null}]}\n\n',),
            texts=_SYNTHETIC_TOKENS,
            shape=shape,
            prefix=prefix,
            seed=seed,
        )
    prefix = (
        b'data: {"id":"chatcmpl-%s","object":"chat.completion.chunk","created":%d,'
        b'"model":"gpt-4o-mini-2024-07-18","service_tier":"default",'
        b'"system_fingerprint":"fp_%s","choices":'
        % (_random(rng, 29), int(time.time()), _random(rng, 10, "0123456789abcdef"))
    )
    role = (
        b'[{"index":0,"delta":{"role":"assistant","content":"","refusal":null},'
        b'"logprobs":null,"finish_reason":null}]'
    )
    tails = tuple(
        b'"},"logprobs":null,"finish_reason":null}]'
        + _after_choices(shape, rng, b"null")
        + b"}\n\n"
        for _ in range(POOL if shape.obfuscation else 1)
    )
    return Frames(
        opening=(prefix + role + _after_choices(shape, rng, b"null") + b"}\n\n",),
        head=prefix + b'[{"index":0,"delta":{"content":"',
        tails=tails,
        texts=TOKENS,
        shape=shape,
        prefix=prefix,
        seed=seed,
    )


def _anthropic(shape: Shape, rng: random.Random, seed: int) -> Frames:
    message = (
        b'{"type":"message_start","message":{"id":"msg_01%s","type":"message",'
        b'"role":"assistant","model":"claude-sonnet-4-5-20250929","content":[],'
        b'"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":8,'
        b'"cache_creation_input_tokens":0,"cache_read_input_tokens":0,'
        b'"cache_creation":{"ephemeral_5m_input_tokens":0,"ephemeral_1h_input_tokens":0},'
        b'"output_tokens":1,"service_tier":"standard"}}}' % _random(rng, 22)
    )
    block = b'{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}'
    return Frames(
        opening=(
            _event(b"message_start", message),
            _event(b"content_block_start", block),
            _event(b"ping", b'{"type": "ping"}'),
        ),
        head=b'event: content_block_delta\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"',
        tails=(b'"}}\n\n',),
        texts=TOKENS,
        shape=shape,
        seed=seed,
    )
