"""The upstream side of Chat Completions streaming (docs/protocols.md §2), for any
OpenAI-compatible server. Sans-I/O."""

from __future__ import annotations

from typing import Any, ClassVar

import msgspec
import orjson

from ..errors import UpstreamError, UpstreamProtocolError
from ..events import Audio, Citation, Delta, Reasoning, StreamEvent, ToolCall, Usage, content_delta
from .openai_tool_calls import ToolCallPieces
from .sse import MAX_EVENT_BYTES, EventTooLarge, SSEDecoder
from .upstream import (
    Malformed,
    event_too_large,
    in_stream_error,
    malformed,
    object_of,
    optional_count,
    text_of,
    token_count,
)

__all__ = ["ChunkDecoder", "ToolCallPieces", "chunk_events"]


def chunk_events(
    chunk: dict[str, Any], events: list[StreamEvent], tools: ToolCallPieces | None = None
) -> None:
    """Append to ``events`` those of one ``chat.completion.chunk`` (choice 0: Nexus asks for
    one): reasoning (``reasoning_content`` or ``reasoning``: DeepSeek, vLLM, OpenRouter),
    content and refusal, tool-call fragments, audio, the finish reason, then the usage. A field of
    another type than the API's is :class:`~nexus.protocol.upstream.Malformed`.

    The decoder's path for what its typed read refused (a field of another type, JSON
    too deep for msgspec): rare, so every field is checked here. ``tools``: the stream's
    :class:`ToolCallPieces`, which each tool-call piece goes through."""
    for choice in _list(chunk.get("choices"), "choices"):
        if type(choice) is not dict:
            raise Malformed("a choice that is not an object")
        if choice.get("index", 0) != 0:
            continue
        delta = choice.get("delta")
        if delta:
            if type(delta) is not dict:
                raise Malformed("a delta that is not an object")
            reasoning = text_of(delta.get("reasoning_content"), "reasoning_content") or text_of(
                delta.get("reasoning"), "reasoning"
            )
            content = delta.get("content")
            if type(content) is list:
                content, thought = _parts(content)
                reasoning = (reasoning or "") + thought or None
            _delta_events(
                reasoning,
                text_of(content, "content"),
                text_of(delta.get("refusal"), "refusal"),
                delta.get("tool_calls"),
                events,
                tools,
            )
            audio = delta.get("audio")
            if audio is not None:
                audio = object_of(audio, "audio")
                _audio_event(
                    text_of(audio.get("id"), "audio id"),
                    text_of(audio.get("data"), "audio data"),
                    text_of(audio.get("transcript"), "audio transcript"),
                    _expiry(audio.get("expires_at")),
                    events,
                )
        finish = text_of(choice.get("finish_reason"), "finish_reason")
        if finish:
            events.append(Delta(finish_reason=finish))
    _usage_events(chunk.get("usage"), events)


def _parts(parts: list[Any]) -> tuple[str, str]:
    """The text and the reasoning of a content sent as parts, as Mistral's reasoning models
    send it (``text`` parts, ``thinking`` parts of text parts); other parts (references)
    carry no text and are skipped; a text that is not a string is :class:`Malformed`."""
    text, thought = [], []
    for part in parts:
        part = object_of(part, "content part")
        kind = part.get("type")
        if kind == "text":
            text.append(text_of(part.get("text"), "content part's text") or "")
        elif kind == "thinking":
            for inner in _list(part.get("thinking"), "thinking"):
                inner = object_of(inner, "thinking part")
                if inner.get("type") == "text":
                    thought.append(text_of(inner.get("text"), "thinking part's text") or "")
    return "".join(text), "".join(thought)


def _list(value: Any, field: str) -> list[Any]:
    if value is None:
        return []
    if type(value) is not list:
        raise Malformed(f"{field} that is not a list")
    return value


def _delta_events(
    reasoning: str | None,
    content: str | None,
    refusal: str | None,
    calls: Any,
    events: list[StreamEvent],
    tools: ToolCallPieces | None = None,
) -> None:
    if reasoning:
        events.append(Reasoning(reasoning))
    if refusal:
        events.append(Delta(content=content or None, refusal=refusal))
    elif content:
        events.append(Delta(content))
    for call in _list(calls, "tool_calls"):
        call = object_of(call, "tool call")
        function = object_of(call.get("function"), "tool call's function")
        index = call.get("index", 0)
        if type(index) is not int or index < 0:
            raise Malformed("a tool call index that is not a non-negative integer")
        extra = call.get("extra_content")  # Gemini's thought signature, needed back
        piece = ToolCall(
            index=index,
            id=text_of(call.get("id"), "tool call id"),
            name=text_of(function.get("name"), "tool call name"),
            arguments=text_of(function.get("arguments"), "tool call arguments") or "",
            extra_content=None if extra is None else object_of(extra, "extra_content"),
        )
        events.append(piece if tools is None else tools(piece))


def _audio_event(
    audio_id: str | None,
    data: str | None,
    transcript: str | None,
    expires_at: int | None,
    events: list[StreamEvent],
) -> None:
    """A ``delta.audio`` piece as an :class:`~nexus.events.Audio`, its ``id`` and
    ``expires_at`` kept (the client names the audio by its id in the next turn); one
    with none of the four fields carries nothing and makes no event."""
    if audio_id is None and data is None and transcript is None and expires_at is None:
        return
    events.append(Audio(data=data, transcript=transcript, id=audio_id, expires_at=expires_at))


def _expiry(value: Any) -> int | None:
    if value is None or type(value) is int:
        return value
    raise Malformed("an audio expires_at that is not an integer")


def _usage_events(usage: Any, events: list[StreamEvent]) -> None:
    """The usage, its counts checked (:func:`~nexus.protocol.upstream.token_count`): they
    are billed, and reach the access line and the key's budget; the details the upstream
    reported are kept, for clients that read them. Once a stream.

    Two compatible servers count otherwise than OpenAI, and are read in its terms:
    DeepSeek reports its cache hits as ``prompt_cache_hit_tokens`` (no
    ``prompt_tokens_details``): they are the cached tokens; xAI leaves reasoning out of
    ``completion_tokens`` (its ``total_tokens`` counts it beside them): it is added in,
    as OpenAI counts it and as it is billed."""
    if usage:
        usage = object_of(usage, "usage")
        prompt = object_of(usage.get("prompt_tokens_details"), "prompt_tokens_details")
        completion = object_of(usage.get("completion_tokens_details"), "completion_tokens_details")
        prompt_tokens = token_count(usage.get("prompt_tokens"), "prompt_tokens")
        completion_tokens = token_count(usage.get("completion_tokens"), "completion_tokens")
        total_tokens = token_count(usage.get("total_tokens"), "total_tokens")
        cached = _detail(prompt, "cached_tokens")
        if cached is None and "prompt_cache_hit_tokens" in usage:  # DeepSeek's
            cached = optional_count(usage["prompt_cache_hit_tokens"], "prompt_cache_hit_tokens")
        reasoning = _detail(completion, "reasoning_tokens")
        if reasoning and total_tokens == prompt_tokens + completion_tokens + reasoning:  # xAI's
            completion_tokens += reasoning
        events.append(
            Usage(
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                total_tokens=total_tokens,
                cached_tokens=cached,
                reasoning_tokens=reasoning,
                prompt_audio_tokens=_detail(prompt, "audio_tokens"),
                completion_audio_tokens=_detail(completion, "audio_tokens"),
                accepted_prediction_tokens=_detail(completion, "accepted_prediction_tokens"),
                rejected_prediction_tokens=_detail(completion, "rejected_prediction_tokens"),
                prompt_text_tokens=_detail(prompt, "text_tokens"),
                prompt_image_tokens=_detail(prompt, "image_tokens"),
                completion_text_tokens=_detail(completion, "text_tokens"),
            )
        )


def _detail(details: dict[str, Any], field: str) -> int | None:
    return optional_count(details.get(field), field)


# The fields chunk_events() reads, typed as it needs them: msgspec skips the others
# (id, model, logprobs, obfuscation...) in C and builds no dict. A chunk whose fields
# have other types (or that is not an object, or not JSON) fails to decode and is read
# by chunk_events() after orjson, as before: the same events, or the same error.
class _Audio(msgspec.Struct, gc=False):
    id: str | None = None
    data: str | None = None
    transcript: str | None = None
    expires_at: int | None = None


class _Delta(msgspec.Struct, gc=False):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    refusal: str | None = None
    tool_calls: Any = None  # rare: read as chunk_events() reads it
    audio: _Audio | None = None


class _Choice(msgspec.Struct, gc=False):
    index: int = 0
    delta: _Delta | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct, gc=False):
    choices: list[_Choice] | None = None
    usage: dict[str, Any] | None = None
    error: Any = None
    citations: Any = None  # Perplexity's sources, every chunk: URLs
    search_results: Any = None  # and in its newer form: {title, url, date}


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_NOT_TYPED = (msgspec.DecodeError, RecursionError)  # RecursionError: too deep for msgspec


class _Named(msgspec.Struct, gc=False):
    model: Any = None


_decode_named = msgspec.json.Decoder(_Named).decode


def _model_of(data: bytes) -> str | None:
    """A chunk's ``model`` (the upstream's name for what answered), if it is a string."""
    try:
        model = _decode_named(data).model
    except _NOT_TYPED:
        return None
    return model if type(model) is str and model else None


def _typed_events(chunk: _Chunk, events: list[StreamEvent], tools: ToolCallPieces) -> bool:
    """:func:`chunk_events` of a typed chunk; whether it finished the choice."""
    finished = False
    for choice in chunk.choices or ():
        if choice.index:
            continue
        delta = choice.delta
        if delta is not None:
            content = delta.content
            reasoning = delta.reasoning_content or delta.reasoning
            audio = delta.audio
            if not reasoning and not delta.refusal and delta.tool_calls is None and audio is None:
                if content:
                    events.append(content_delta(content))  # the commonest: one token of text
            else:
                _delta_events(reasoning, content, delta.refusal, delta.tool_calls, events, tools)
                if audio is not None:
                    _audio_event(audio.id, audio.data, audio.transcript, audio.expires_at, events)
        if choice.finish_reason:
            events.append(Delta(finish_reason=choice.finish_reason))
            finished = True
    return finished


class ChunkDecoder:
    """One stream's body to events: SSE, then :func:`chunk_events` of each payload
    (:class:`~nexus.protocol.upstream.UpstreamDecoder`: ``[DONE]`` sets ``done``).
    ``response_model`` is the first payload's ``model``: every chunk repeats it, so it
    is read once a stream (the typed decoder skips it, as it does ``id``)."""

    __slots__ = (
        "_cited",
        "_finished",
        "_held",
        "_named",
        "_output",
        "_payloads",
        "_tools",
        "done",
        "error",
        "provider",
        "response_model",
    )
    terminator: ClassVar[str] = "[DONE]"

    def __init__(self, provider: str, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.provider = provider
        self._payloads = SSEDecoder(max_event_bytes).decode_data
        self.done = False
        self.error: UpstreamError | None = None
        self.response_model: str | None = None
        self._named = False  # the first payload was read for its model
        self._tools = ToolCallPieces()
        self._held: Usage | None = None  # the last usage of a chunk with choices
        self._finished = False  # a finish_reason came
        self._cited = 0  # sources passed on as citations
        self._output = False  # an event went out: the held usage is the stream's to charge

    def decode(self, chunk: bytes) -> list[StreamEvent]:
        events = self._decode(chunk)
        self._output = self._output or bool(events)
        if self.error is not None and self._held is not None:
            events += self.cut()  # an error ends it: the counts it gave are charged
        return events

    @property
    def prompt_usage(self) -> Usage | None:
        """A running count that came before any output (vLLM's, on the role chunk): the
        attempt's prompt, should it fail so (its fallback is tried; it is not charged)."""
        return None if self._output else self._held

    def _decode(self, chunk: bytes) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        try:
            payloads = self._payloads(chunk)
        except EventTooLarge as exc:
            self.error = event_too_large(self.provider, exc)
            return events
        if not self._named and payloads:
            self._named = True
            self.response_model = _model_of(payloads[0])
        try:
            for data in payloads:
                try:
                    typed = _decode_chunk(data)
                except _NOT_TYPED:
                    if not self._general(data, events):
                        return events
                    continue
                if typed.error:
                    self.error = in_stream_error(self.provider, typed.error)
                    return events
                if _typed_events(typed, events, self._tools):
                    self._finished = True
                if typed.citations or typed.search_results:
                    self._cite(typed.search_results or typed.citations, events)
                if typed.usage:
                    self._usage(typed.usage, bool(typed.choices), events)
        except Malformed as exc:
            self.error = malformed(self.provider, exc)
        return events

    def _cite(self, sources: Any, events: list[StreamEvent]) -> None:
        """Perplexity's sources (on every chunk, the list so far; the answer's ``[1]``
        refers to its first): each new one a :class:`~nexus.events.Citation`."""
        for source in _list(sources, "search_results")[self._cited :]:
            if type(source) is str:
                events.append(Citation(source))
            else:
                source = object_of(source, "search result")
                url = text_of(source.get("url"), "search result url")
                events.append(Citation(url, text_of(source.get("title"), "search result title")))
            self._cited += 1

    def closed(self) -> list[StreamEvent]:
        """The body ended cleanly without ``[DONE]``: after a ``finish_reason`` the stream
        is whole (Perplexity sends none), ``done``; before one, it was cut. The usage held
        goes out either way."""
        if self._finished and self.error is None:
            self.done = True
        return self.cut()

    def cut(self) -> list[StreamEvent]:
        """The body was cut: the usage held (a running count, a finish chunk's) is charged,
        once output went out (before, it is the failed attempt's :attr:`prompt_usage`)."""
        if not self._output:
            return []
        held, self._held = self._held, None
        return [] if held is None else [held]

    def _usage(self, usage: Any, choices: bool, events: list[StreamEvent]) -> None:
        """A chunk's usage: on a chunk of its own (OpenAI's), out at once; beside choices (a
        finish chunk's, vLLM's running counts), held to the end: one usage, the last."""
        counted: list[StreamEvent] = []
        _usage_events(usage, counted)
        if choices:
            self._held = counted[0]  # type: ignore[assignment]
        else:
            self._held = None
            events += counted

    def _general(self, data: bytes, events: list[StreamEvent]) -> bool:
        """One payload by :func:`chunk_events`; False if the stream ends there."""
        try:
            value = orjson.loads(data.decode("utf-8", "replace"))
        except orjson.JSONDecodeError:
            if data.startswith(b"[DONE]"):
                self.done = True
                if self._held is not None:
                    events.append(self._held)
            else:
                self.error = UpstreamProtocolError(
                    f"provider {self.provider!r} sent an event that is not JSON"
                )
            return False
        if type(value) is dict:
            if value.get("error"):
                self.error = in_stream_error(self.provider, value["error"])
                return False
            usage = value.get("usage")
            if usage:
                value = {**value, "usage": None}
            count = len(events)
            chunk_events(value, events, self._tools)
            if any(type(e) is Delta and e.finish_reason for e in events[count:]):
                self._finished = True
            if sources := value.get("search_results") or value.get("citations"):
                self._cite(sources, events)
            if usage:
                self._usage(usage, bool(value.get("choices")), events)
        return True
