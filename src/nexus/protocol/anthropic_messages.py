"""Anthropic Messages wire shapes for ``POST /v1/messages`` (docs/protocols.md §3). Sans-I/O.

Request bytes in, the engine's :class:`~nexus.request.ChatRequest` out (so any provider
can serve it); the answer's shapes are :mod:`.anthropic_output`'s.
``thinking``, ``top_k`` and ``cache_control`` pass through for Anthropic upstreams.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import orjson
from pydantic import Field, model_validator

from ..carried_blocks import TRANSLATED
from ..errors import InvalidRequest
from ..request import (
    MAX_MODEL_CHARS,
    ChatRequest,
    Items,
    MockScript,
    OpenModel,
    StreamOptions,
    StrictModel,
)
from .anthropic_documents import document_part
from .anthropic_events import cache_control, text_block
from .anthropic_tools import chat_tool
from .json_depth import MAX_JSON_DEPTH, MAX_JSON_ITEMS
from .openai_chat import parse_json_object, tool_call, validated

__all__ = ["MessagesRequest", "parse_messages_request", "to_chat_request"]


class TextBlock(OpenModel):
    type: Literal["text"]
    text: str


class Base64Source(StrictModel):
    type: Literal["base64"]
    media_type: str = Field(pattern=r"^image/[A-Za-z0-9.+\-]+$")
    data: str


class URLSource(StrictModel):
    type: Literal["url"]
    url: str = Field(pattern=r"^https?://\S+$")


class DocumentData(StrictModel):
    type: Literal["base64"]
    media_type: Literal["application/pdf"]
    data: str = Field(min_length=1)


class DocumentText(StrictModel):
    type: Literal["text"]
    media_type: Literal["text/plain"]
    data: str


class DocumentElsewhere(OpenModel):
    type: Literal["url", "file", "content"]


class ImageBlock(OpenModel):
    type: Literal["image"]
    source: Annotated[Base64Source | URLSource, Field(discriminator="type")]


class DocumentBlock(StrictModel):
    """A document (a PDF, a text), as Claude Code sends one it read. Inline (``base64``
    PDF, ``text``) it reaches any target as a file (:mod:`.anthropic_documents`); by
    ``url``, ``file_id`` or as ``content`` blocks, an Anthropic target only."""

    type: Literal["document"]
    source: Annotated[DocumentData | DocumentText | DocumentElsewhere, Field(discriminator="type")]
    title: str | None = None
    context: str | None = None
    citations: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None


class ToolUseBlock(OpenModel):
    type: Literal["tool_use"]
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(OpenModel):
    type: Literal["tool_result"]
    tool_use_id: str
    content: str | Items[TextBlock | ImageBlock | DocumentBlock] = ""
    is_error: bool | None = None


class ThinkingBlock(OpenModel):
    type: Literal["thinking", "redacted_thinking"]


Block = Annotated[
    TextBlock | ImageBlock | DocumentBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock,
    Field(discriminator="type"),
]


class InputMessage(StrictModel):
    role: Literal["user", "assistant"]
    content: str | Items[Block]


class ToolDef(OpenModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    input_schema: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _custom(cls, data: Any) -> Any:
        """A server tool (``web_search_20250305``...: no ``input_schema``) is refused by
        its type, not as a custom tool without a schema."""
        kind = data.get("type", "custom") if isinstance(data, dict) else "custom"
        if kind != "custom":
            raise ValueError(
                f"type: {str(kind)[:64]!r} is a server tool, which Nexus does not carry (its "
                "results are blocks of their own); only custom tools are"
            )
        return data


class ToolChoice(StrictModel):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Metadata(OpenModel):
    user_id: str | None = None


class OutputFormat(StrictModel):
    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema")


class OutputConfig(StrictModel):
    format: OutputFormat | None = None
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None


class MessagesRequest(StrictModel):
    """Fields Nexus does not carry out (``mcp_servers``, ``container``, a newer API's) are
    refused by name: dropped, they would change the answer without a word."""

    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS)
    max_tokens: int = Field(ge=0)  # 0: the prompt cache warmed, nothing generated
    messages: Items[InputMessage] = Field(min_length=1)
    system: str | Items[TextBlock] | None = None
    tools: Items[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    stop_sequences: Items[Annotated[str, Field(min_length=1)]] | None = Field(
        default=None, max_length=4
    )
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    thinking: dict[str, Any] | None = None
    context_management: dict[str, Any] | None = None
    cache_control: dict[str, Any] | None = None  # on the last block: dropped off Anthropic
    inference_geo: str | None = Field(default=None, min_length=1, max_length=64)
    """What Anthropic may clear from the context (old tool results, thinking), which
    Claude Code sends: carried to Anthropic targets; another has no such thing."""
    metadata: Metadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = None
    output_config: OutputConfig | None = None
    stream: bool = False
    background: bool = False
    stream_options: StreamOptions | None = None
    """Nexus: only ``resumable`` is read."""

    mock: MockScript | None = None


_CARRIED: tuple[str, ...] = ("temperature", "top_p", "top_k", "thinking", "service_tier")
_CARRIED += ("context_management", "cache_control", "inference_geo")


def parse_messages_request(
    body: bytes,
    *,
    max_depth: int = MAX_JSON_DEPTH,
    max_items: int = MAX_JSON_ITEMS,
    counting: bool = False,
) -> ChatRequest:
    """Validate a Messages request and translate it. Raises :class:`InvalidRequest`
    (also for JSON nested deeper than ``max_depth``), and 413 past ``max_items``.
    ``counting``: a ``count_tokens`` request, which has no ``max_tokens``."""
    data = parse_json_object(body, max_depth=max_depth, max_items=max_items)
    if counting:
        data.setdefault("max_tokens", 1)
    return to_chat_request(validated(MessagesRequest, data))


def to_chat_request(request: MessagesRequest) -> ChatRequest:
    messages: list[dict[str, Any]] = []
    if request.system:
        system = request.system
        if isinstance(system, str):
            messages.append({"role": "system", "content": system})
        else:  # text blocks keep their cache_control
            messages.append({"role": "system", "content": [text_block(b) for b in system]})
    for index, message in enumerate(request.messages):
        messages.extend(_translate(message, index))
    chat: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "max_tokens": request.max_tokens,
        "stream": request.stream,
        "background": request.background,
    }
    options: dict[str, bool] = {}
    if request.stream:
        options["include_usage"] = True
    if request.stream_options is not None and request.stream_options.resumable:
        options["resumable"] = True
    if options:
        chat["stream_options"] = options
    for key in _CARRIED:
        value = getattr(request, key)
        if value is not None:
            chat[key] = value
    if request.stop_sequences:
        chat["stop"] = request.stop_sequences
    if request.output_config is not None:
        _output_config(request.output_config, chat)
    if request.metadata is not None and request.metadata.user_id:
        chat["user"] = request.metadata.user_id
    if request.tools:
        chat["tools"] = [chat_tool(tool, index) for index, tool in enumerate(request.tools)]
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise InvalidRequest(
                    "tool_choice.name: required when type is 'tool'", param="tool_choice.name"
                )
            chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            chat["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            chat["parallel_tool_calls"] = False
    if request.mock is not None:
        chat["mock"] = request.mock.model_dump(exclude_none=True)
    return validated(ChatRequest, chat, TRANSLATED)


def _output_config(config: OutputConfig, chat: dict[str, Any]) -> None:
    """Structured outputs and effort ride as Anthropic's ``output_config``: an Anthropic
    upstream gets it as sent; an OpenAI one its format as a ``json_schema`` response
    format, strict when OpenAI's strict mode can hold the answer to it as Anthropic
    does, and its effort as ``reasoning_effort`` (:mod:`.output_config`)."""
    sent = config.model_dump(exclude_none=True, by_alias=True)
    if sent:
        chat["output_config"] = sent


def _translate(message: InputMessage, index: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (tool results become ``tool`` messages). An
    assistant turn keeps its blocks as sent, in order, in ``anthropic_content``: an
    Anthropic upstream gets them back unmodified (it checks signed thinking in a tool loop;
    cache marks stay where they were); its text and tool calls are the chat message."""
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    if message.role == "assistant":
        return _assistant(message.content, index)
    out: list[dict[str, Any]] = []
    parts: list[dict[str, Any]] = []
    for block in message.content:
        if isinstance(block, TextBlock):
            parts.append(text_block(block))
        elif isinstance(block, ImageBlock):
            source = block.source
            url = (
                f"data:{source.media_type};base64,{source.data}"
                if isinstance(source, Base64Source)
                else source.url
            )
            parts.append({"type": "image_url", "image_url": {"url": url}, **cache_control(block)})
        elif isinstance(block, DocumentBlock):
            parts.append(document_part(block.model_dump(exclude_none=True)))
        elif isinstance(block, ToolResultBlock):
            out.append(_tool_result(block))
    if parts:
        out.append({"role": "user", "content": parts})
    return out


def _assistant(content: list[Any], index: int) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    for block in content:
        if isinstance(block, ImageBlock | DocumentBlock | ToolResultBlock):
            raise InvalidRequest(
                f"messages[{index}]: {block.type} blocks belong in user messages",
                param=f"messages[{index}].content",
            )
        if isinstance(block, ToolUseBlock):
            calls.append(tool_call(block.id, block.name, orjson.dumps(block.input).decode()))
        blocks.append(block.model_dump(exclude_none=True))
    if not blocks:
        return []
    text = "".join(b["text"] for b in blocks if b["type"] == "text")
    entry: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        entry["tool_calls"] = calls
    entry["anthropic_content"] = blocks
    return [entry]


def _tool_result(block: ToolResultBlock) -> dict[str, Any]:
    """A ``tool`` message; ``is_error``, the result's cache mark and its blocks ride beside
    its text for an Anthropic upstream (:mod:`.anthropic_events`; an OpenAI one takes
    ``is_error`` as a text prefix, drops the mark and refuses an image: :mod:`.openai_request`)."""
    content = block.content
    if isinstance(content, str):
        text = content
    else:
        # One line between blocks (an MCP tool's results: files, rows), not glued together.
        text = "\n".join(b.text for b in content if isinstance(b, TextBlock))
    message: dict[str, Any] = {"role": "tool", "tool_call_id": block.tool_use_id, "content": text}
    if block.is_error:
        message["is_error"] = True
    if not isinstance(content, str) and content:
        message["tool_result_content"] = [b.model_dump(exclude_none=True) for b in content]
    message.update(cache_control(block))
    return message
