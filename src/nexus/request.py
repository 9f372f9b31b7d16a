"""The engine's one request model: an OpenAI chat-completions request.

Every endpoint's body is validated into (or translated to) :class:`ChatRequest`;
providers read only this. Parameters Nexus does not interpret (``logit_bias``,
``metadata``, ...) are kept as extras so that upstream providers can pass them on.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationInfo,
    field_validator,
    model_validator,
)

from .carried_blocks import assistant_block, result_block, tool_input, translated_only

__all__ = [
    "AssistantMessage",
    "AudioPart",
    "ChatRequest",
    "ContentPart",
    "FilePart",
    "ImagePart",
    "Items",
    "Message",
    "MockScript",
    "OpenModel",
    "StreamOptions",
    "StrictModel",
    "SystemMessage",
    "TextPart",
    "ToolMessage",
    "UserMessage",
    "audio_reference",
    "input_kinds",
]


_T = TypeVar("_T")

Items = Annotated[list[_T], Field(fail_fast=True)]
"""A wire list, validated up to its first bad item only (an error for each bad item, 4 µs
apiece: an 800 KB body of them held every tenant's streams for 1-2 s). Every list is one."""


MAX_MODEL_CHARS = 256
"""A model name's longest: it reaches logs, spans, metrics and errors (real ones: tens)."""


class StrictModel(BaseModel):
    """Wire models: strict types, frozen, unknown fields refused (the first one named)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    @model_validator(mode="before")
    @classmethod
    def _first_unknown_field_only(cls, data: Any) -> Any:
        """Keep one unknown field of many (pydantic builds an error for each, 3 µs apiece:
        a body of 400,000 held the event loop a second)."""
        if isinstance(data, dict) and len(data) > 1:
            names = _field_names(cls)
            unknown = [key for key in data if key not in names][:2]
            if len(unknown) > 1:
                return {k: v for k, v in data.items() if k in names or k == unknown[0]}
        return data


@functools.cache
def _field_names(model: type[BaseModel]) -> frozenset[str]:
    return frozenset(
        name
        for field, info in model.model_fields.items()
        for name in (field, info.alias)
        if name is not None
    )


class OpenModel(BaseModel):
    """Known fields are validated; unknown ones are kept (newer API fields)."""

    model_config = ConfigDict(extra="allow", frozen=True, strict=True)


# --- content parts ---------------------------------------------------------


class TextPart(OpenModel):
    type: Literal["text"]
    text: str


class ImageURL(OpenModel):
    url: str = Field(min_length=1)
    detail: Literal["auto", "low", "high"] | None = None


class ImagePart(OpenModel):
    type: Literal["image_url"]
    image_url: ImageURL


class InputAudio(OpenModel):
    data: str
    format: str


class AudioPart(OpenModel):
    type: Literal["input_audio"]
    input_audio: InputAudio


class RefusalPart(OpenModel):
    type: Literal["refusal"]
    refusal: str


class FilePart(OpenModel):
    type: Literal["file"]
    file: dict[str, Any]

    @model_validator(mode="before")
    @classmethod
    def _document(cls, data: Any, info: ValidationInfo) -> Any:
        instead = "send a document block to /v1/messages"
        return translated_only(data, info, "anthropic_document", instead)


ContentPart = Annotated[TextPart | ImagePart | AudioPart | FilePart, Field(discriminator="type")]
AssistantPart = Annotated[TextPart | RefusalPart, Field(discriminator="type")]


# --- messages --------------------------------------------------------------


class FunctionCall(OpenModel):
    name: str
    arguments: str


class ToolCallSpec(OpenModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class SystemMessage(OpenModel):
    role: Literal["system", "developer"]
    content: str | Items[TextPart]
    name: str | None = None


class UserMessage(OpenModel):
    role: Literal["user"]
    content: str | Items[ContentPart]
    name: str | None = None


class AssistantMessage(OpenModel):
    role: Literal["assistant"]
    content: str | Items[AssistantPart] | None = None
    tool_calls: Items[ToolCallSpec] | None = None
    refusal: str | None = None
    name: str | None = None

    @model_validator(mode="after")
    def _anthropic_content(self) -> AssistantMessage:
        """``anthropic_content`` (the turn's blocks as a ``/v1/messages`` client sent them,
        which an Anthropic upstream gets as they are, in their order: signed thinking, cache
        marks) holds thinking, redacted thinking, text and tool_use blocks only, and the
        message's own text and tool calls: any target gets the same turn."""
        blocks = (self.model_extra or {}).get("anthropic_content")
        if blocks is None:
            return self
        if not (type(blocks) is list and all(map(assistant_block, blocks))):
            raise ValueError("anthropic_content holds thinking, redacted_thinking, text, tool_use")
        text = "".join(block["text"] for block in blocks if block["type"] == "text")
        uses = [(b["id"], b["name"], b["input"]) for b in blocks if b["type"] == "tool_use"]
        content = self.content
        own = (
            content
            if isinstance(content, str)
            else "".join(part.text for part in content or () if isinstance(part, TextPart))
        )
        calls = [
            (c.id, c.function.name, tool_input(c.function.arguments)) for c in self.tool_calls or ()
        ]
        if text != own or uses != calls:  # (an id alone would let the blocks name another call)
            raise ValueError(
                "anthropic_content: the message's own text and tool calls (ids, names and "
                "arguments), in order"
            )
        return self


class ToolMessage(OpenModel):
    role: Literal["tool"]
    content: str | Items[TextPart]
    tool_call_id: str

    @model_validator(mode="after")
    def _anthropic_result(self) -> ToolMessage:
        """``is_error`` and ``tool_result_content`` (what ``/v1/messages`` carries for an
        Anthropic upstream) go to it as they are: only a boolean and text, image and inline
        document blocks, no block a client makes up (a document by URL: its cost unknown),
        and the message's own text, a line between blocks: any target gets the same result
        (and the estimate, which counts the text once, holds what an Anthropic one gets)."""
        extra = self.model_extra or {}
        if "is_error" in extra and type(extra["is_error"]) is not bool:
            raise ValueError("is_error must be a boolean")
        blocks = extra.get("tool_result_content")
        if blocks is None:
            return self
        if not (type(blocks) is list and blocks and all(map(result_block, blocks))):
            raise ValueError("tool_result_content holds text, images and inline documents")
        content = self.content
        own = content if isinstance(content, str) else "\n".join(part.text for part in content)
        if "\n".join(b["text"] for b in blocks if b["type"] == "text") != own:
            raise ValueError("tool_result_content: its text blocks, a line apart, are the content")
        return self


Message = Annotated[
    SystemMessage | UserMessage | AssistantMessage | ToolMessage, Field(discriminator="role")
]


def message_text(message: SystemMessage | UserMessage | AssistantMessage | ToolMessage) -> str:
    """The text of a message's content: the string, or its text parts joined by spaces."""
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return " ".join(part.text for part in content if isinstance(part, TextPart))


def input_kinds(request: ChatRequest) -> set[str]:
    """The non-text inputs a request carries: ``image``, ``audio`` (a target whose provider
    cannot take one is skipped); an earlier audio answer named by id is audio too."""
    kinds: set[str] = set()
    for message in request.messages:
        if isinstance(message, AssistantMessage) and audio_reference(message):
            kinds.add("audio")
        elif isinstance(message, UserMessage) and not isinstance(message.content, str):
            for part in message.content:
                if isinstance(part, ImagePart):
                    kinds.add("image")
                elif isinstance(part, AudioPart):
                    kinds.add("audio")
    return kinds


def audio_reference(message: AssistantMessage) -> bool:
    """Whether an assistant turn names an upstream's audio answer (``audio: {"id": ...}``)."""
    extra = message.model_extra
    return extra is not None and extra.get("audio") is not None


# --- tools and formats -----------------------------------------------------


class FunctionDef(OpenModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(OpenModel):
    type: Literal["function"]
    function: FunctionDef

    @model_validator(mode="before")
    @classmethod
    def _anthropic_fields(cls, data: Any, info: ValidationInfo) -> Any:
        instead = "send the tool to /v1/messages"
        return translated_only(data, info, "anthropic_tool", instead)


class NamedFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: NamedFunction


class JSONSchemaFormat(OpenModel):
    name: str
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_present(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("json_schema is required when type is 'json_schema'")
        return self


class StreamOptions(OpenModel):
    include_usage: bool = False
    include_cost: bool = False
    """Nexus's: ``usage.cost`` (USD) in the usage chunk (even without ``include_usage``)."""
    include_obfuscation: bool | None = None
    """OpenAI's: an ``obfuscation`` string of random length in each chunk (padding
    against length side channels). Nexus pads its own chunks only when it is true."""
    resumable: bool = Field(default=False, exclude=True)
    """Nexus: the stream outlives its client for ``[streams] detach_timeout_s``, to be
    resumed with ``Last-Event-ID`` (without it, a client that leaves cancels the upstream
    at once). Never sent upstream, not in the cache key."""


# --- the mock provider's script --------------------------------------------


class MockToolCall(StrictModel):
    name: str = Field(min_length=1)
    arguments: str | dict[str, Any] = "{}"


class MockUsage(StrictModel):
    prompt_tokens: int | None = Field(default=None, ge=0)
    completion_tokens: int | None = Field(default=None, ge=0)
    total_tokens: int | None = Field(default=None, ge=0)
    cached_tokens: int | None = Field(default=None, ge=0)
    reasoning_tokens: int | None = Field(default=None, ge=0)


class MockScript(StrictModel):
    """What the mock provider produces instead of its echo (docs/providers.md, "The mock")."""

    content: str | None = None
    reasoning: str | None = None
    tool_calls: Items[MockToolCall] | None = None
    delay_ms: int = Field(default=0, ge=0, le=600_000)
    fail_after: int | None = Field(default=None, ge=0)
    usage: MockUsage | None = None


# --- the request -----------------------------------------------------------


class ChatRequest(OpenModel):
    """``POST /v1/chat/completions`` body, and the engine's request."""

    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS)
    messages: Items[Message] = Field(min_length=1)
    max_tokens: int | None = Field(default=None, ge=0)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stop: str | Items[str] | None = None
    tools: Items[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    background: bool = False
    """Nexus: answer 202 at once and stream via ``GET /v1/streams/{id}``."""
    user: str | None = None
    seed: int | None = None
    n: int = Field(default=1, ge=1)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    logprobs: bool | None = None
    top_logprobs: int | None = None
    mock: MockScript | None = None
    responses_echo: dict[str, Any] | None = Field(default=None, exclude=True)
    """Nexus's, set by the ``/v1/responses`` translator: the request's fields as sent that
    its ``response`` object echoes (``instructions``, ``metadata``, ``tools``...). Never sent
    upstream; derived from what is, so not in the cache key either."""

    @model_validator(mode="before")
    @classmethod
    def _betas(cls, data: Any, info: ValidationInfo) -> Any:
        instead = "name betas in the anthropic-beta header"
        data = translated_only(data, info, "anthropic_beta", instead)
        return translated_only(data, info, "responses_echo", "send the request to /v1/responses")

    @field_validator("stop")
    @classmethod
    def _stop_limits(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list):
            if len(value) > 4:
                raise ValueError("at most 4 stop sequences are allowed")
            if any(not s for s in value):
                raise ValueError("stop sequences must not be empty")
        elif value == "":
            raise ValueError("stop sequences must not be empty")
        return value

    @field_validator("n")
    @classmethod
    def _single_choice(cls, value: int) -> int:
        if value != 1:
            raise ValueError("only n=1 is supported: Nexus streams one choice per request")
        return value

    @field_validator("logprobs", "top_logprobs")
    @classmethod
    def _no_logprobs(cls, value: Any, info: ValidationInfo) -> Any:
        """Nexus's events carry no log probabilities: forwarded, the ask had the upstream
        compute them for nothing and the client got ``logprobs: null`` without a word."""
        if value is True or (info.field_name == "top_logprobs" and value is not None):
            raise ValueError(
                "not supported: Nexus's answers carry no log probabilities "
                "(choices[].logprobs is always null)"
            )
        return value

    @field_validator("tool_choice")
    @classmethod
    def _tool_choice_names_a_tool(cls, choice: Any, info: ValidationInfo) -> Any:
        tools = info.data.get("tools")
        if isinstance(choice, NamedToolChoice):
            names = {tool.function.name for tool in tools or ()}
            if choice.function.name not in names:
                raise ValueError(
                    f"names function {choice.function.name!r}, "
                    "which is not among the request's tools"
                )
        elif choice == "required" and not tools:
            raise ValueError("'required' needs at least one tool")
        return choice

    @property
    def token_limit(self) -> int | None:
        """``max_completion_tokens``, else ``max_tokens``, else no limit."""
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens

    @property
    def stop_sequences(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def resumable(self) -> bool:
        """Whether the body asked for a resumable stream (``stream_options.resumable``)."""
        return self.stream_options is not None and self.stream_options.resumable

    @property
    def include_cost(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_cost

    @property
    def include_obfuscation(self) -> bool:
        options = self.stream_options
        return options is not None and options.include_obfuscation is True
