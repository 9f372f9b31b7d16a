"""The upstream side of OpenAI Chat Completions streaming (docs/protocols.md §2), for any
OpenAI-compatible server (OpenAI, vLLM, Ollama, llama.cpp, ...). Sans-I/O."""

from __future__ import annotations

from typing import Any, ClassVar

import orjson

from ..errors import UpstreamError, UpstreamProtocolError
from ..events import Delta, Reasoning, StreamEvent, ToolCall, Usage
from ..request import ChatRequest
from .sse import SSEDecoder
from .upstream import in_stream_error

__all__ = ["ChunkDecoder", "chunk_events", "upstream_body"]

_NOT_OPENAI = {"mock", "thinking", "top_k", "background"}  # Nexus's or Anthropic's alone


def upstream_body(
    request: ChatRequest, model: str, token_limit_field: str | None = None
) -> dict[str, Any]:
    """The upstream request: ours (fields Nexus does not interpret pass through), with the
    upstream model, streaming with usage. Nexus's own stream options stay home, and so does
    ``include_obfuscation``: it shapes the client's stream; upstream, the provider's default
    (OpenAI pads, hiding token lengths from whoever watches the traffic) is kept, and a
    compatible server that refuses the field never sees it."""
    body = request.model_dump(mode="json", exclude_none=True, exclude=_NOT_OPENAI, by_alias=True)
    for message in body.get("messages", ()):
        message.pop("thinking_blocks", None)  # Anthropic's signed thinking, carried for it alone
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                part.pop("cache_control", None)  # Anthropic's prompt-cache marks
    for tool in body.get("tools") or ():
        tool.pop("cache_control", None)
    body["model"] = model
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


def chunk_events(chunk: dict[str, Any], events: list[StreamEvent]) -> None:
    """Append to ``events`` those of one ``chat.completion.chunk`` (choice 0: Nexus asks for
    one): reasoning (``reasoning_content`` or ``reasoning``: DeepSeek, vLLM, OpenRouter),
    content and refusal, tool-call fragments, the finish reason, then the usage."""
    for choice in chunk.get("choices") or ():
        if choice.get("index", 0) != 0:
            continue
        delta = choice.get("delta")
        if delta and len(delta) == 1 and (content := delta.get("content")):
            events.append(Delta(content))  # the commonest chunk: one token of text
        elif delta:
            reasoning = delta.get("reasoning_content") or delta.get("reasoning")
            if reasoning:
                events.append(Reasoning(reasoning))
            content = delta.get("content")
            refusal = delta.get("refusal")
            if refusal:
                events.append(Delta(content=content or None, refusal=refusal))
            elif content:
                events.append(Delta(content))
            for call in delta.get("tool_calls") or ():
                function = call.get("function") or {}
                events.append(
                    ToolCall(
                        index=call.get("index", 0),
                        id=call.get("id"),
                        name=function.get("name"),
                        arguments=function.get("arguments") or "",
                    )
                )
        finish = choice.get("finish_reason")
        if finish:
            events.append(Delta(finish_reason=finish))
    usage = chunk.get("usage")
    if usage:
        prompt_details = usage.get("prompt_tokens_details") or {}
        completion_details = usage.get("completion_tokens_details") or {}
        events.append(
            Usage(
                prompt_tokens=usage.get("prompt_tokens") or 0,
                completion_tokens=usage.get("completion_tokens") or 0,
                total_tokens=usage.get("total_tokens") or 0,
                cached_tokens=prompt_details.get("cached_tokens"),
                reasoning_tokens=completion_details.get("reasoning_tokens"),
            )
        )


class ChunkDecoder:
    """One stream's body to events: SSE, then :func:`chunk_events` of each payload
    (:class:`~nexus.protocol.upstream.UpstreamDecoder`: ``[DONE]`` sets ``done``)."""

    __slots__ = ("_payloads", "done", "error", "provider")
    terminator: ClassVar[str] = "[DONE]"

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self._payloads = SSEDecoder().decode_data
        self.done = False
        self.error: UpstreamError | None = None

    def decode(self, chunk: bytes) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for data in self._payloads(chunk):
            try:
                value = orjson.loads(data)
            except orjson.JSONDecodeError:
                if data.startswith("[DONE]"):
                    self.done = True
                else:
                    self.error = UpstreamProtocolError(
                        f"provider {self.provider!r} sent an event that is not JSON"
                    )
                return events
            if type(value) is dict:
                if value.get("error"):
                    self.error = in_stream_error(self.provider, value["error"])
                    return events
                chunk_events(value, events)
        return events
