"""The built-in deterministic provider: the default of ``config.toml``
(docs/providers.md, "The mock provider").

Unscripted, it echoes the last user message in word-sized deltas (a word keeps the
whitespace before it); an image or audio part as ``[image <mime_type> <N> bytes]`` /
``[audio <format> <N> bytes]`` (``N`` decoded bytes; ``[image <url>]`` for a link). A
``mock`` object in the request scripts ``content``, ``reasoning``, ``tool_calls``,
``delay_ms``, ``fail_after`` and ``usage``. Reasoning words, content words and tool-call
fragments (the arguments 8 characters at a time) are one chunk and one completion token
each: ``max_tokens`` stops after that many (``length``), ``fail_after: N`` fails after N
(or before the finish); ``stop`` cuts the content at the earliest stop sequence (the
finishing delta names it). Usage counts the words of all messages as the prompt, unless
``mock.usage`` says otherwise.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import re
from collections.abc import AsyncGenerator, Iterator

import orjson

from ..errors import InvalidRequest, UpstreamError
from ..events import Delta, Reasoning, StreamEvent, ToolCall, Usage, content_delta
from ..request import (
    AudioPart,
    ChatRequest,
    ImagePart,
    MockScript,
    MockUsage,
    TextPart,
    UserMessage,
    message_text,
)
from .base import Provider

__all__ = ["MockProvider", "words"]

_WORD = re.compile(r"\s*\S+(?:\s+$)?|^\s+$")
_COUNT = re.compile(r"\S+")
ARGUMENT_FRAGMENT = 8


def words(text: str) -> list[str]:
    """Split ``text`` into word-sized pieces whose concatenation is ``text``."""
    return _WORD.findall(text)


class MockProvider(Provider):
    kind = "mock"
    accepts = frozenset({"text", "image", "audio"})

    def advertised_models(self) -> list[str]:
        return list(self._models) or ["echo"]

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        script = request.mock or _NO_SCRIPT
        delay, limit, fail_after = script.delay_ms / 1000, request.token_limit, script.fail_after
        emitted = reasoning_chunks = 0
        finish = "stop"
        content = script.content if script.content is not None else echo(request)
        cuts = [(at, s) for s in request.stop_sequences if (at := content.find(s)) != -1]
        cut, matched = min(cuts, default=(len(content), None))
        content = content[:cut]

        for event in _script_events(request, script, content):
            if fail_after is not None and emitted >= fail_after:
                break
            if limit is not None and emitted >= limit:
                finish = "length"
                break
            if delay and emitted:
                await asyncio.sleep(delay)
            if type(event) is Reasoning:
                reasoning_chunks += 1
            elif type(event) is ToolCall:
                finish = "tool_calls"
            emitted += 1
            yield [event]
        if fail_after is not None and finish != "length":
            message = f"mock provider failed after {emitted} chunks, as scripted by mock.fail_after"
            raise UpstreamError(message)
        if delay and emitted:
            await asyncio.sleep(delay)
        # The sequence it stopped on, as Anthropic reports it (not when it stopped otherwise).
        yield [Delta(finish_reason=finish, stop_sequence=matched if finish == "stop" else None)]
        yield [_usage(request, script, emitted, reasoning_chunks)]


_NO_SCRIPT = MockScript()


def _script_events(request: ChatRequest, script: MockScript, content: str) -> Iterator[StreamEvent]:
    yield from map(Reasoning, words(script.reasoning or ""))
    yield from map(content_delta, words(content))
    for index, call in enumerate(script.tool_calls or ()):
        arguments = call.arguments
        if not isinstance(arguments, str):
            arguments = orjson.dumps(arguments).decode()
        seed = f"{len(request.messages)}:{index}:{call.name}:{arguments}"
        digest = hashlib.sha256(seed.encode()).hexdigest()[:24]
        yield ToolCall(index=index, id=f"call_{digest}", name=call.name)
        for start in range(0, len(arguments), ARGUMENT_FRAGMENT):
            yield ToolCall(index=index, arguments=arguments[start : start + ARGUMENT_FRAGMENT])


def echo(request: ChatRequest) -> str:
    """The text the mock answers with when not scripted."""
    for message in reversed(request.messages):
        if isinstance(message, UserMessage):
            if isinstance(message.content, str):
                return message.content
            pieces = []
            for part in message.content:
                if isinstance(part, TextPart):
                    pieces.append(part.text)
                elif isinstance(part, ImagePart):
                    pieces.append(_describe_image(part.image_url.url))
                elif isinstance(part, AudioPart):
                    size = _decoded_size(part.input_audio.data, "input_audio.data")
                    pieces.append(f"[audio {part.input_audio.format} {size} bytes]")
            return " ".join(p for p in pieces if p)
    return ""


def _describe_image(url: str) -> str:
    if url.startswith("data:"):
        header, comma, data = url.partition(",")
        mime = header[5:].split(";", 1)[0] or "application/octet-stream"
        if comma and header.endswith(";base64"):
            return f"[image {mime} {_decoded_size(data, 'image_url.url')} bytes]"
        return f"[image {mime} {len(data.encode())} bytes]"
    return f"[image {url}]"


def _decoded_size(data: str, field: str) -> int:
    try:
        return len(base64.b64decode(data, validate=True))
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{field}: not valid base64", param=field) from None


def _usage(request: ChatRequest, script: MockScript, emitted: int, reasoning: int) -> Usage:
    given = script.usage or MockUsage()
    prompt = given.prompt_tokens
    if prompt is None:
        prompt = sum(len(_COUNT.findall(message_text(m))) for m in request.messages)
    completion = emitted if given.completion_tokens is None else given.completion_tokens
    reasoning_tokens = given.reasoning_tokens
    if reasoning_tokens is None and script.reasoning:
        reasoning_tokens = reasoning
    return Usage(
        prompt_tokens=prompt,
        completion_tokens=completion,
        total_tokens=prompt + completion if given.total_tokens is None else given.total_tokens,
        cached_tokens=given.cached_tokens,
        reasoning_tokens=reasoning_tokens,
    )
