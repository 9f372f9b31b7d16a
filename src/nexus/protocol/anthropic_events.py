"""The upstream side of the Anthropic Messages API (docs/protocols.md §3). Sans-I/O.

:func:`messages_body` writes the request (one role's consecutive messages merged: the API
wants them alternating; ``max_tokens``, required, defaults to ``default_max_tokens``; a
``json_schema`` response format as ``output_config.format``, Anthropic's structured
outputs; ``output_config`` as sent: :mod:`.output_config`).
:func:`refusal` (:mod:`.anthropic_fields`) names the first chat field that changes the
answer and that the Messages API has no place for. :class:`EventDecoder` reads the stream;
usage in OpenAI terms (``prompt_tokens`` = input + cache read + cache creation,
``cached_tokens`` = cache read); ``message_start``'s input counts lead the first read with
output, not before: a failure before any output stays one before the first event.
"""

from __future__ import annotations

from typing import Any, ClassVar

import orjson

from ..errors import InvalidRequest, UpstreamError, UpstreamProtocolError
from ..events import Citation, Delta, Reasoning, StreamEvent, ToolCall, Usage, content_delta
from ..request import (
    AssistantMessage,
    ChatRequest,
    FilePart,
    ImagePart,
    NamedToolChoice,
    SystemMessage,
    TextPart,
    ToolMessage,
    UserMessage,
    message_text,
)
from .anthropic_documents import base64_data_url, document_block
from .anthropic_fields import AS_SENT, refusal, schema_of
from .json_depth import MAX_JSON_DEPTH, deeper_than, too_deep
from .output_config import anthropic_config
from .sse import MAX_EVENT_BYTES, EventTooLarge, SSEDecoder
from .upstream import (
    Malformed,
    event_too_large,
    in_stream_error,
    malformed,
    object_of,
    text_of,
    token_count,
)

__all__ = ["EventDecoder", "messages_body", "refusal"]

NATIVE_STOP_REASONS = frozenset({"model_context_window_exceeded", "pause_turn"})
"""Anthropic's stop reasons that ours (``length``, ``stop``) say less than: kept beside
them (``Delta.stop_reason``) for Anthropic's clients."""
_FINISH_REASONS = {  # others (end_turn, stop_sequence, pause_turn): stop
    "max_tokens": "length",
    "model_context_window_exceeded": "length",
    "tool_use": "tool_calls",
    "refusal": "content_filter",
}


def messages_body(request: ChatRequest, model: str, default_max_tokens: int) -> dict[str, Any]:
    """The Anthropic Messages request for ``request``. Raises :func:`refusal`'s error."""
    refused = refusal(request)
    if refused is not None:
        raise refused
    system: list[dict[str, Any]] = []
    turns: list[dict[str, Any]] = []

    def add(role: str, blocks: list[dict[str, Any]]) -> None:
        if turns and turns[-1]["role"] == role:
            turns[-1]["content"].extend(blocks)
        else:
            turns.append({"role": role, "content": blocks})

    for message in request.messages:
        if isinstance(message, SystemMessage):
            if isinstance(message.content, str):
                system.append({"type": "text", "text": message.content})
            else:
                system.extend(text_block(part) for part in message.content)
        elif isinstance(message, UserMessage):
            add("user", _user_blocks(message))
        elif isinstance(message, AssistantMessage):
            blocks = _assistant_blocks(message)
            if blocks:
                add("assistant", blocks)
        elif isinstance(message, ToolMessage):
            add("user", [_tool_result(message)])
    body: dict[str, Any] = {
        "model": model,
        "messages": turns,
        "max_tokens": default_max_tokens if request.token_limit is None else request.token_limit,
        "stream": True,
    }
    if system:  # a string unless a block carries a cache mark
        marked = any("cache_control" in block for block in system)
        body["system"] = system if marked else "\n\n".join(block["text"] for block in system)
    if request.temperature is not None:
        body["temperature"] = request.temperature  # 0-1 (past it, refused: anthropic_fields)
    if request.top_p is not None:
        body["top_p"] = request.top_p
    if request.stop_sequences:
        body["stop_sequences"] = request.stop_sequences
    if request.user:
        body["metadata"] = {"user_id": request.user}
    if request.tools:
        body["tools"] = [
            {
                "name": tool.function.name,
                "description": tool.function.description or "",
                "input_schema": tool.function.parameters or {"type": "object", "properties": {}},
                **({"strict": True} if tool.function.strict else {}),  # its input held to it
                **cache_control(tool),
                **(tool.model_extra or {}).get("anthropic_tool", {}),  # a /v1/messages client's
            }
            for tool in request.tools
        ]
    choice = _tool_choice(request)
    if choice is not None:
        body["tool_choice"] = choice
    extra = request.model_extra or {}
    config = anthropic_config(request)  # a /v1/messages client's effort and format
    schema = schema_of(request)
    if schema is not None:
        config["format"] = {"type": "json_schema", "schema": schema}
    if config:
        body["output_config"] = config
    for key in AS_SENT:
        if key in extra:
            body[key] = extra[key]
    if body.get("service_tier") == "default":  # OpenAI's standard tier, in Anthropic's words
        body["service_tier"] = "standard_only"
    return body


def _assistant_blocks(message: AssistantMessage) -> list[dict[str, Any]]:
    """An assistant turn's blocks: those a ``/v1/messages`` client sent, as sent and in
    their order (Anthropic checks signed thinking in a tool loop); else its text, then its
    tool calls."""
    sent = (message.model_extra or {}).get("anthropic_content")
    if sent is not None:
        return [*sent]  # a copy: the next message of the same role extends it
    blocks: list[dict[str, Any]] = []
    text = message_text(message)
    if text:
        blocks.append({"type": "text", "text": text})
    for call in message.tool_calls or ():
        use = {"type": "tool_use", "id": call.id, "name": call.function.name}
        blocks.append({**use, "input": _arguments(call.function.arguments)})
    return blocks


def cache_control(model: Any) -> dict[str, Any]:
    """A client's ``cache_control`` on ``model``, kept: it marks a prompt-cache breakpoint."""
    value = (model.model_extra or {}).get("cache_control")
    return {"cache_control": value} if value is not None else {}


def text_block(part: Any) -> dict[str, Any]:
    """A text block (of a ``text`` part or block), its ``cache_control`` kept."""
    return {"type": "text", "text": part.text, **cache_control(part)}


def _user_blocks(message: UserMessage) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"type": "text", "text": message.content}]
    blocks: list[dict[str, Any]] = []
    for part in message.content:
        if isinstance(part, TextPart):
            blocks.append(text_block(part))
        elif isinstance(part, ImagePart):
            url = part.image_url.url
            inline = base64_data_url(url)
            source: dict[str, str] = {"type": "url", "url": url}
            if inline is not None:
                source = {"type": "base64", "media_type": inline[0], "data": inline[1]}
            blocks.append({"type": "image", "source": source, **cache_control(part)})
        elif isinstance(part, FilePart):
            blocks.append(document_block(part))
    return blocks


def _tool_result(message: ToolMessage) -> dict[str, Any]:
    """A ``tool_result`` block: the blocks a ``/v1/messages`` client sent, else its text;
    ``is_error`` and its cache mark kept."""
    extra, parts = message.model_extra or {}, message.content or ""  # parts stay apart
    blocks = parts if isinstance(parts, str) else [text_block(part) for part in parts]
    content = extra.get("tool_result_content") or blocks
    result = {"type": "tool_result", "tool_use_id": message.tool_call_id, "content": content}
    if extra.get("is_error") is True:
        result["is_error"] = True
    return {**result, **cache_control(message)}


def _arguments(arguments: str) -> Any:
    """An assistant tool call's arguments (a JSON string) as the object Anthropic wants.
    Being a string, it escaped the body's depth check: too deep is refused here, else the
    upstream body could not be written (orjson stops at 254 levels): a 500."""
    try:
        value = orjson.loads(arguments) if arguments else {}
    except orjson.JSONDecodeError:
        message = "an assistant tool call's arguments are not valid JSON"
        raise InvalidRequest(message, param="messages") from None
    if deeper_than(value, MAX_JSON_DEPTH):
        raise too_deep("messages", MAX_JSON_DEPTH)
    return value


def _tool_choice(request: ChatRequest) -> dict[str, Any] | None:
    choice = request.tool_choice
    out: dict[str, Any] | None
    if choice is None:
        out = {"type": "auto"} if request.tools and request.parallel_tool_calls is False else None
    elif isinstance(choice, NamedToolChoice):
        out = {"type": "tool", "name": choice.function.name}
    else:
        out = {"type": {"auto": "auto", "required": "any", "none": "none"}[choice]}
    if out is not None and request.parallel_tool_calls is False and out["type"] != "none":
        out["disable_parallel_tool_use"] = True
    return out


class EventDecoder:
    """One stream's body to events (:class:`~nexus.protocol.upstream.UpstreamDecoder`:
    ``message_stop`` sets ``done``)."""

    terminator: ClassVar[str] = "message_stop"

    def __init__(self, provider: str, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.provider = provider
        self.done = False
        self.error: UpstreamError | None = None
        self.response_model: str | None = None  # message_start's message.model
        self._sse = SSEDecoder(max_event_bytes).decode
        self._tool_index: dict[int, int] = {}
        self._no_input: set[int] = set()  # tool_use blocks no input_json_delta filled yet
        self._counts = dict.fromkeys(_COUNTS, 0)
        self._finish: str | None = None
        self._early: Usage | None = None  # message_start's counts, until output goes out
        self._started = False  # output went out
        self._counted: Usage | None = None  # the usage that went out with the stop
        self._thinking: int | None = None  # output_tokens_details.thinking_tokens
        self._long: int | None = None  # cache_creation.ephemeral_1h_input_tokens

    @property
    def prompt_usage(self) -> Usage | None:
        """``message_start``'s counts while no output went out (then they go with it)."""
        return None if self._started else self._early

    def decode(self, chunk: bytes) -> list[StreamEvent]:
        out: list[StreamEvent] = []
        try:
            events = self._sse(chunk)
        except EventTooLarge as exc:
            self.error = event_too_large(self.provider, exc)
            return out
        for sse in events:
            try:
                data = orjson.loads(sse.data)
            except orjson.JSONDecodeError:
                self.error = UpstreamProtocolError(
                    f"provider {self.provider!r} sent an event that is not JSON"
                )
                break
            if type(data) is dict:
                kind = sse.event if sse.event != "message" else data.get("type")
                try:
                    out += self._event(kind, data)
                except Malformed as exc:
                    self.error = malformed(self.provider, exc)
                if self.done or self.error:
                    break
        if out and not self._started:
            self._started = True
            if self._early is not None:
                out.insert(0, self._early)
        return out

    def _event(self, kind: object, data: dict[str, Any]) -> list[StreamEvent]:
        match kind:
            case "content_block_delta":
                delta = object_of(data.get("delta"), "delta")
                match delta.get("type"):
                    case "text_delta":
                        text = text_of(delta.get("text"), "text")
                        return [content_delta(text)] if text else []
                    case "input_json_delta":
                        block_index = _block_index(data)
                        index = self._tool_index.get(block_index)
                        partial = text_of(delta.get("partial_json"), "partial_json")
                        if index is None or not partial:
                            return []
                        self._no_input.discard(block_index)
                        return [ToolCall(index, arguments=partial)]
                    case "thinking_delta":
                        thinking = text_of(delta.get("thinking"), "thinking")
                        return [Reasoning(thinking)] if thinking else []
                    case "signature_delta":
                        signature = text_of(delta.get("signature"), "signature")
                        return [Reasoning("", signature=signature)] if signature else []
                    case "citations_delta":
                        citation = object_of(delta.get("citation"), "citation")
                        title = text_of(citation.get("title"), "citation title") or text_of(
                            citation.get("document_title"), "citation document_title"
                        )
                        url = text_of(citation.get("url"), "citation url")
                        quoted = text_of(citation.get("cited_text"), "cited_text")
                        return [Citation(url, title, quoted, source=citation)]
                return []  # future delta types
            case "content_block_start":
                block = object_of(data.get("content_block"), "content_block")
                block_type = block.get("type")
                if block_type == "tool_use":
                    block_index = _block_index(data)
                    index = self._tool_index[block_index] = len(self._tool_index)
                    self._no_input.add(block_index)
                    call_id = text_of(block.get("id"), "tool_use id")
                    call = ToolCall(index, call_id, text_of(block.get("name"), "tool_use name"))
                    given = block.get("input")  # whole here: some compatible servers
                    if type(given) is not dict or not given:
                        return [call]
                    self._no_input.discard(block_index)
                    return [call, ToolCall(index, arguments=orjson.dumps(given).decode())]
                if block_type == "thinking":  # (its text and signature whole, from some)
                    thought = text_of(block.get("thinking"), "thinking")
                    signed = text_of(block.get("signature"), "signature")
                    out: list[StreamEvent] = [Reasoning(thought)] if thought else []
                    return [*out, Reasoning("", signature=signed)] if signed else out
                if block_type == "text" and (text := text_of(block.get("text"), "text")):
                    return [Delta(content=text)]
                if block_type == "redacted_thinking":
                    return [Reasoning("", redacted=text_of(block.get("data"), "data") or "")]
            case "content_block_stop":
                return self._input_of_none(_block_index(data))
            case "message_start":
                message = object_of(data.get("message"), "message")
                model = message.get("model")
                if type(model) is str and model:
                    self.response_model = model
                usage = object_of(message.get("usage"), "usage")
                self._count(usage)
                if usage.get("input_tokens") is not None and not self._started:
                    self._early = self._usage(partial=True)
            case "message_delta":
                self._count(object_of(data.get("usage"), "usage"))
                delta = object_of(data.get("delta"), "delta")
                reason = text_of(delta.get("stop_reason"), "stop_reason")
                if reason and self._finish is None:
                    # The turn's last counts (cumulative: §3): the usage goes out with its
                    # stop, so a stream cut before message_stop is charged what it billed.
                    self._finish = _FINISH_REASONS.get(reason, "stop")
                    self._counted = self._usage()
                    matched = delta.get("stop_sequence") if reason == "stop_sequence" else None
                    native = reason if reason in NATIVE_STOP_REASONS else None
                    stop = Delta(
                        finish_reason=self._finish,
                        stop_sequence=matched if type(matched) is str else None,
                        stop_reason=native,
                    )
                    return [stop, self._counted]
            case "message_stop":
                self.done = True
                if self._finish is None:
                    self._finish = "stop"
                    return [Delta(finish_reason="stop"), self._usage()]
                final = self._usage()  # a later message_delta's counts, if they moved
                return [] if final == self._counted else [final]
            case "error":
                self.error = in_stream_error(self.provider, data.get("error"))
        return []  # ping, unknown events

    def closed(self) -> list[StreamEvent]:  # without message_stop: cut (Anthropic sends it)
        return []

    def cut(self) -> list[StreamEvent]:  # (its usage went out with its stop: none held)
        return []

    def _input_of_none(self, block_index: int) -> list[StreamEvent]:
        """A tool call whose block closed without input (a tool that takes no arguments:
        ``input: {}`` at its start, then nothing or an empty ``partial_json``) has the
        arguments ``{}``, as OpenAI sends them: an empty string is not JSON."""
        if block_index not in self._no_input:
            return []
        self._no_input.discard(block_index)
        return [ToolCall(self._tool_index[block_index], arguments="{}")]

    def _count(self, usage: dict[str, Any]) -> None:
        # Counts are cumulative totals: later values overwrite (§3, message_delta). Each is
        # checked (token_count): they are billed.
        for key, value in usage.items():
            if key in self._counts and value is not None:
                self._counts[key] = token_count(value, key)
        details = usage.get("output_tokens_details")
        if details is not None:  # of output_tokens, those of reasoning (may be summarised)
            thinking = object_of(details, "output_tokens_details").get("thinking_tokens")
            if thinking is not None:
                self._thinking = token_count(thinking, "thinking_tokens")
        written = usage.get("cache_creation")  # of the writes, those for an hour (dearer)
        if written is not None:  # (a count it leaves out stays as it was)
            long = object_of(written, "cache_creation").get("ephemeral_1h_input_tokens")
            if long is not None:
                self._long = token_count(long, "ephemeral_1h_input_tokens") or None

    def _usage(self, partial: bool = False) -> Usage:
        counts = self._counts
        cached, written = counts["cache_read_input_tokens"], counts["cache_creation_input_tokens"]
        prompt = counts["input_tokens"] + cached + written
        long = self._long
        if partial:
            return Usage(
                prompt, 0, prompt, cached, written, partial=True, cache_write_1h_tokens=long
            )
        output = counts["output_tokens"]
        total = prompt + output
        return Usage(
            prompt, output, total, cached, written, self._thinking, cache_write_1h_tokens=long
        )


def _block_index(data: dict[str, Any]) -> int:
    """A content block event's ``index`` (-1 when absent: no block of ours)."""
    index = data.get("index", -1)
    if type(index) is not int:
        raise Malformed("a content block index that is not an integer")
    return index


_COUNTS = (
    "input_tokens",
    "cache_read_input_tokens",
    "cache_creation_input_tokens",
    "output_tokens",
)
