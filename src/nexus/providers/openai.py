"""``kind = "openai"``: any OpenAI-compatible Chat Completions server (docs/protocols.md §2).

OpenAI, vLLM, Ollama, llama.cpp's server, ... The request goes upstream as
``POST {base_url}/chat/completions`` with ``stream: true`` and
``stream_options.include_usage: true``; parameters Nexus does not interpret are
passed through. Chunks become events: content, ``reasoning_content`` or
``reasoning`` (DeepSeek, vLLM, OpenRouter), refusal, tool-call deltas, the
finish reason, usage with cached and reasoning token details. ``data: [DONE]``
ends the stream; an end of body without it is an ``upstream_disconnect``
error, never a silent success. An error object inside the stream becomes a
typed error.
"""

from __future__ import annotations

import re
from collections.abc import AsyncGenerator
from typing import Any

import orjson

from ..config import OpenAIProviderConfig
from ..errors import GatewayError, UpstreamError
from ..events import Delta, Reasoning, StreamEvent, ToolCall, Usage
from ..protocol.sse import SSEDecoder
from ..request import ChatRequest
from .base import flatten
from .http import HTTPProvider

__all__ = [
    "ChunkReader",
    "OpenAIProvider",
    "chunk_events",
    "read_events",
    "upstream_body",
]

_loads = orjson.loads

_NOT_OPENAI = {"mock", "thinking", "top_k", "background"}
"""Fields an OpenAI-compatible server would refuse: the mock's script, Anthropic-only knobs,
and Nexus's own ``background``."""


def upstream_body(
    request: ChatRequest, model: str, token_limit_field: str | None = None
) -> dict[str, Any]:
    """The upstream request: ours, with the upstream model name, always streaming."""
    body = request.model_dump(mode="json", exclude_none=True, exclude=_NOT_OPENAI, by_alias=True)
    _strip_anthropic_parts(body)
    body["model"] = model
    body["stream"] = True
    options = dict(body.get("stream_options") or {})
    options["include_usage"] = True
    options.pop("include_cost", None)  # Nexus's own option
    body["stream_options"] = options
    if token_limit_field is not None and request.token_limit is not None:
        body.pop("max_tokens", None)
        body.pop("max_completion_tokens", None)
        body[token_limit_field] = request.token_limit
    return body


def _strip_anthropic_parts(body: dict[str, Any]) -> None:
    """Anthropic-only request parts (cache marks, signed thinking) that OpenAI would refuse."""
    for message in body.get("messages", ()):
        message.pop("thinking_blocks", None)  # Anthropic's signed thinking, carried for it alone
        content = message.get("content")
        if isinstance(content, list):
            for part in content:
                part.pop("cache_control", None)
    for tool in body.get("tools") or ():
        tool.pop("cache_control", None)


def chunk_events(chunk: dict[str, Any]) -> list[StreamEvent]:
    """The events in one ``chat.completion.chunk`` (choice 0; Nexus asks for one)."""
    events: list[StreamEvent] = []
    for choice in chunk.get("choices") or ():
        if choice.get("index", 0) != 0:
            continue
        delta = choice.get("delta") or {}
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
    return events


class ChunkReader:
    """One stream's SSE body to events: ``chat.completion.chunk`` payloads. Sans-I/O.

    Most chunks of a stream are the same bytes but for the content string: the id,
    model and created time do not change. The first content chunk is parsed in full;
    the text around its content string becomes the stream's *template*, kept once a
    probe shows that the string in that place is the delta's content and nothing else
    (parsed in full, the template with another string gives exactly that string as
    content). A read that is nothing but whole template events, ``data: <template
    around a JSON string>``, one line each, is then cut with one split and only the
    strings are parsed: the same events as the full parse, at a fraction of the cost.
    Anything else (another field, a changing field, a read that ends inside an event)
    takes the general path.
    """

    __slots__ = (
        "_decoder",
        "_head",
        "_misses",
        "_slot",
        "_tail",
        "_tail_at",
        "provider",
    )

    def __init__(self, provider: str) -> None:
        self.provider = provider
        self._decoder = SSEDecoder()
        self._head: str | None = None
        self._tail = ""
        self._tail_at = 0
        self._slot = (0, -1)
        self._misses = 0

    def feed(self, chunk: bytes) -> tuple[list[StreamEvent], bool | GatewayError]:
        """:meth:`read` for the SSE events completed by the bytes of one read."""
        decoder = self._decoder
        text = decoder.text(chunk)
        first: list[StreamEvent] = []
        if self._head is None:
            # No template yet: the first events one at a time, so that the rest of the
            # read takes the template's path once one of them taught it.
            for _ in range(_LEARN_EVENTS):
                cut = text.find("\n\n") + 2
                if cut < 2 or self._misses >= _MAX_MISSES:
                    break
                events, end = self.read(decoder.data_of(text[:cut]))
                first += events
                text = text[cut:]
                if end or self._head is not None:
                    if end:
                        return first, end
                    break
        lead = decoder.lead(text) if self._head is not None else None
        if lead is None:
            events, end = self.read(decoder.data_of(text))
            return (first + events if first else events), end
        events, used = self._template_events(lead)
        if first:
            events = first + events
        if used < len(lead):
            payloads = decoder.data_of(lead[used:] if used else lead)
            if payloads:
                more, end = self.read(payloads)
                return events + more if events else more, end
        return events, False

    def _template_events(self, text: str) -> tuple[list[StreamEvent], int]:
        """The events of the template events that ``text`` starts with, and where they end.

        ``text`` is cut at each ``LF LF data: `` (a short separator: quick to find),
        the content strings taken from their places in the pieces, and the pieces
        checked all at once by putting them back together around the template.
        """
        head = "data: " + self._head + '"'  # type: ignore[operator]
        if not text.startswith(head) or "\r" in text:
            return [], 0
        cut = text.rfind("\n\n")
        if cut < 0:
            return [], 0
        frames = text[6:cut].split("\n\ndata: ")
        start, stop = self._slot
        strings = [frame[start:stop] for frame in frames]
        used = cut + 2
        tail = '"' + self._tail + "\n\n"
        if head + (tail + head).join(strings) + tail != text[:used]:
            # Not all of them: the template events before the first other one.
            head, tail = head[6:], tail[:-2]
            count = 0
            for frame in frames:
                if len(frame) < -stop + start or not (
                    frame.startswith(head) and frame.endswith(tail)
                ):
                    break
                count += 1
            if not count:
                return [], 0
            del frames[count:], strings[count:]
            used = 8 * count + sum(map(len, frames))
        # No line break inside an event: the template has none (it was one line), a
        # string none either (a JSON string holds no raw control character).
        joined = "".join(strings)
        if _NOT_PLAIN.search(joined) is None:
            # Between the quotes, no quote, backslash or control character: the JSON
            # string is its text as it stands.
            return [Delta(s) for s in strings if s], used
        events: list[StreamEvent] = []
        append = events.append
        for string in strings:
            try:
                content = _loads('"' + string + '"')
            except orjson.JSONDecodeError:
                return [], 0
            if content:
                append(Delta(content))
        return events, used

    def read(self, payloads: list[str]) -> tuple[list[StreamEvent], bool | GatewayError]:
        """The events of one read's SSE payloads, and what ended them: False (nothing,
        read on), True (``[DONE]``) or the error to raise once the events before it
        are out: an error object in the stream, or ``upstream_protocol_error`` for a
        payload that is not JSON.
        """
        events: list[StreamEvent] = []
        append = events.append
        head = self._head
        for data in payloads:
            if head is not None and data.startswith(head) and data.endswith(self._tail):
                try:
                    content = _loads(data[len(head) : len(data) - self._tail_at])
                except orjson.JSONDecodeError:
                    content = None
                if type(content) is str:
                    if content:
                        append(Delta(content))
                    continue
            if data.startswith("[DONE]"):
                return events, True
            try:
                chunk = _loads(data)
            except orjson.JSONDecodeError:
                return events, UpstreamError(
                    f"provider {self.provider!r} sent an event that is not JSON",
                    code="upstream_protocol_error",
                )
            if type(chunk) is not dict:
                continue
            if chunk.get("error"):
                return events, in_stream_error(self.provider, chunk["error"])
            # A content chunk: one choice whose delta is only content (what
            # chunk_events() gives, with a few lookups), and the template to learn.
            choices = chunk.get("choices")
            if choices and len(choices) == 1 and not chunk.get("usage"):
                choice = choices[0]
                delta = choice.get("delta")
                if (
                    delta
                    and len(delta) == 1
                    and choice.get("finish_reason") is None
                    and choice.get("index", 0) == 0
                ):
                    content = delta.get("content")
                    if content and type(content) is str:
                        append(Delta(content))
                        if head is None and self._misses < _MAX_MISSES:
                            head = self._learn(data, content)
                        continue
            events += chunk_events(chunk)
        return events, False

    def _learn(self, data: str, content: str) -> str | None:
        """Take ``data`` (a content chunk) as the template, if the probe agrees."""
        self._misses += 1
        if "\n" in data:
            return None  # an event of several data: lines: the template must be one line
        token = orjson.dumps(content).decode()
        if data.count(token) != 1:
            return None  # escaped another way than orjson's, or found twice: no template
        at = data.index(token)
        head, tail = data[:at], data[at + len(token) :]
        try:
            probe = _loads(head + _PROBE_TOKEN + tail)
        except orjson.JSONDecodeError:
            return None
        if type(probe) is not dict or probe.get("error") or chunk_events(probe) != [_PROBE]:
            return None
        self._head, self._tail, self._tail_at = head, tail, len(tail)
        # The frame path keeps the string's quotes in the template, its text between.
        self._slot = (len(head) + 1, -len(tail) - 1)
        return head


_MAX_MISSES = 3
_NOT_PLAIN = re.compile(r'["\\\x00-\x1f]')
_LEARN_EVENTS = 8
"""Most events of one read taken one at a time while no template is known."""
"""Content chunks looked at for a template before a stream is read in full throughout."""
_PROBE = Delta('\u2603 probe "\u00e9"')
_PROBE_TOKEN = orjson.dumps(_PROBE.content).decode()


def read_events(
    payloads: list[str], provider: str
) -> tuple[list[StreamEvent], bool | GatewayError]:
    """:meth:`ChunkReader.read` for payloads on their own (no template carried over)."""
    return ChunkReader(provider).read(payloads)


_IN_STREAM_STATUS = {
    "invalid_request_error": (400, False),
    "not_found_error": (404, False),
    "rate_limit_error": (429, True),
    "authentication_error": (502, False),
    "permission_error": (502, False),
}


def in_stream_error(provider: str, error: Any) -> GatewayError:
    """An error object met inside the stream (OpenAI ``{"error": {...}}``, Anthropic ``error``).

    Its ``type`` decides the status it maps to if no output went out yet:
    a request the upstream refused stays a 4xx, anything else is a 502.
    """
    if isinstance(error, dict):
        message = str(error.get("message") or "error inside the stream")
        code = error.get("code")
        kind = error.get("type")
    else:
        message, code, kind = str(error), None, None
    status, retryable = _IN_STREAM_STATUS.get(kind if isinstance(kind, str) else "", (502, True))
    if kind in ("authentication_error", "permission_error"):
        # As for a 401/403: the gateway's credentials, and the text may quote the key.
        message = "the upstream refused the gateway's credentials"
    exc = UpstreamError(f"provider {provider!r}: {message}", code="upstream_error", status=status)
    if isinstance(code, str) and code:
        exc.code = code
    if isinstance(kind, str) and kind:
        exc.error_type = kind
    exc.retryable = retryable
    return exc


class OpenAIProvider(HTTPProvider):
    kind = "openai"
    accepts = frozenset({"text", "image", "audio"})
    config: OpenAIProviderConfig

    def headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        return headers

    def stream(self, request: ChatRequest, model: str) -> AsyncGenerator[StreamEvent, None]:
        return flatten(self.batches(request, model))

    async def batches(
        self, request: ChatRequest, model: str
    ) -> AsyncGenerator[list[StreamEvent], None]:
        payload = upstream_body(request, model, self.config.token_limit_field)
        del request  # held by nothing for the stream's length
        upstream = await self.post_stream("/chat/completions", payload, self.headers())
        del payload
        clean = False
        body = self.body(upstream)
        feed = ChunkReader(self.name).feed
        try:
            while chunk := await body.read():
                events, end = feed(chunk)
                if events:
                    yield events
                if end is True:
                    clean = True
                    return
                if end:
                    raise end
            raise UpstreamError(
                f"provider {self.name!r} ended the stream without [DONE]",
                code="upstream_disconnect",
            )
        finally:
            body.close()
            await upstream.finish(clean)
