"""OpenAI Responses API wire shapes (docs/protocols.md §4). Sans-I/O.

Request bytes in, :class:`~nexus.request.ChatRequest` out, so every provider serves
``/v1/responses`` without knowing it exists; merged completion in, ``response`` object
out (:mod:`.openai_responses_output`). ``instructions`` becomes a leading system
message; ``function_call`` items join the assistant message before them as its tool
calls; ``reasoning`` items are dropped; fields with a Chat Completions twin become it
(``max_output_tokens``, ``text.format``, ``reasoning.effort``...); ``store`` stays home
(Nexus keeps no response but its stream). A field that changes the answer and that Nexus
cannot honour is refused, naming it (:func:`_refuse_unsupported`; a function tool's
fields beside the function's, too): docs/http-api.md lists them.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Discriminator, Field, Tag, ValidationError, field_validator

from ..errors import InvalidRequest
from ..request import (
    MAX_MODEL_CHARS,
    ChatRequest,
    FunctionDef,
    Items,
    MockScript,
    OpenModel,
    StreamOptions,
    StrictModel,
)
from .json_depth import MAX_JSON_DEPTH, MAX_JSON_ITEMS
from .openai_chat import field_path, parse_json_object, tool_call, validation_error
from .openai_responses_output import CHAT_NAMES, request_echo, response_body

__all__ = ["ResponsesRequest", "parse_responses_request", "response_body", "to_chat_request"]


def _shape(value: Any) -> str | None:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "list"
    if isinstance(value, dict | BaseModel):
        return "object"
    return None


def _by_shape(other: str) -> Discriminator:
    """A string-or-``other`` union chosen by the input's shape, so that an error names
    the branch the client meant."""
    message = f"Input should be a string or {other}"
    return Discriminator(_shape, custom_error_type="shape", custom_error_message=message)


_STR_OR_LIST = _by_shape("a list")
_STR_OR_OBJECT = _by_shape("an object")


# --- content parts ---------------------------------------------------------


class TextPart(OpenModel):
    type: Literal["input_text", "output_text"]
    text: str


class Refusal(OpenModel):
    type: Literal["refusal"]
    refusal: str


class InputImage(OpenModel):
    type: Literal["input_image"]
    image_url: str | None = Field(default=None, min_length=1)
    file_id: str | None = None
    detail: Literal["auto", "low", "high", "original"] | None = None


class InputFile(OpenModel):
    type: Literal["input_file"]
    file_data: str | None = None
    file_id: str | None = None
    filename: str | None = None
    file_url: str | None = None


Part = Annotated[TextPart | Refusal | InputImage | InputFile, Field(discriminator="type")]
Content = Annotated[Annotated[str, Tag("text")] | Annotated[Items[Part], Tag("list")], _STR_OR_LIST]


# --- input items -----------------------------------------------------------


class MessageItem(OpenModel):
    type: Literal["message"] | None = None
    role: Literal["user", "assistant", "system", "developer"]
    content: Content


class FunctionCallItem(OpenModel):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputItem(OpenModel):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: Content


class ReasoningInputItem(OpenModel):
    type: Literal["reasoning"]


def _item_type(value: Any) -> str | None:
    if not isinstance(value, dict):
        return None
    kind = value.get("type", "message")  # an "easy input message" has no type
    return kind if isinstance(kind, str) else None


Item = Annotated[
    Annotated[MessageItem, Tag("message")]
    | Annotated[FunctionCallItem, Tag("function_call")]
    | Annotated[FunctionCallOutputItem, Tag("function_call_output")]
    | Annotated[ReasoningInputItem, Tag("reasoning")],
    Discriminator(_item_type),
]
Input = Annotated[Annotated[str, Tag("text")] | Annotated[Items[Item], Tag("list")], _STR_OR_LIST]


# --- tools, formats, the request -------------------------------------------


class _FunctionType(OpenModel):
    type: Literal["function"]


class FunctionTool(FunctionDef, _FunctionType):
    """A function tool: Chat Completions' function definition, flat; ``type`` checked first."""


class ToolChoiceFunction(StrictModel):
    type: Literal["function"]
    name: str


ToolChoice = Annotated[
    Annotated[Literal["auto", "none", "required"], Tag("text")]
    | Annotated[ToolChoiceFunction, Tag("object")],
    _STR_OR_OBJECT,
]


class TextFormat(OpenModel):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = Field(default=None, min_length=1)
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    description: str | None = None
    strict: bool | None = None


class TextConfig(OpenModel):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ReasoningConfig(OpenModel):
    effort: str | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None


class ResponsesRequest(OpenModel):
    """``POST /v1/responses`` body (the fields Nexus reads)."""

    model: str = Field(min_length=1, max_length=MAX_MODEL_CHARS)
    input: Input | None = None
    instructions: str | None = None
    tools: Items[FunctionTool] | None = None
    tool_choice: ToolChoice | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stream: bool = False
    background: bool = False
    stream_options: StreamOptions | None = None
    """Only Nexus's ``resumable`` is read."""

    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = None
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = None
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    max_tool_calls: int | None = Field(default=None, ge=1)
    include: Items[str] | None = None
    prompt: dict[str, Any] | None = None
    mock: MockScript | None = None

    @field_validator("metadata", mode="before")
    @classmethod
    def _at_most_16_pairs(cls, value: Any) -> Any:
        """OpenAI's limit, checked before the values: a map of thousands of bad values
        would be an error each (see :data:`nexus.request.Items`)."""
        if isinstance(value, dict) and len(value) > 16:
            raise ValueError("at most 16 key-value pairs")
        return value


_STATEFUL = ("previous_response_id", "conversation")
_KNOWN_EXTRA = ("modalities", "audio", "thinking")  # read from the extras (refused or carried)
_TAG_ERRORS = ("union_tag_invalid", "union_tag_not_found")


def parse_responses_request(
    body: bytes, *, max_depth: int = MAX_JSON_DEPTH, max_items: int = MAX_JSON_ITEMS
) -> ChatRequest:
    """Validate a ``/v1/responses`` body and translate it. Raises :class:`InvalidRequest`
    (``invalid_json``, or ``invalid_request`` with ``param`` naming the Responses field)."""
    data = parse_json_object(body, max_depth=max_depth, max_items=max_items)
    for name in _STATEFUL:
        if data.get(name) is not None:
            raise InvalidRequest(
                f"{name}: not supported. Nexus stores no responses or conversations; "
                "send the whole conversation in input.",
                param=name,
            )
    try:
        request = ResponsesRequest.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc, data) from None
    return to_chat_request(request)


def _invalid(exc: ValidationError, data: Any) -> InvalidRequest:
    first = exc.errors(include_url=False)[0]
    loc = first["loc"]
    if first["type"] in _TAG_ERRORS and len(loc) == 3 and loc[:2] == ("input", "list"):
        # An input item whose type names no item Nexus takes.
        tag = first.get("ctx", {}).get("tag")
        what = f"type {tag!r} is not supported" if tag else "an item must be an object with a type"
        return _error(
            f"{field_path(loc, data)}.type",
            f"{what}; expected 'message', 'function_call', 'function_call_output' or 'reasoning'",
        )
    return validation_error(exc, data)


def _error(param: str, message: str) -> InvalidRequest:
    return InvalidRequest(f"{param}: {message}", param=param)


def _refuse_unsupported(request: ResponsesRequest) -> None:
    """Raise :class:`InvalidRequest` for a field that changes the answer and that Nexus
    cannot honour: dropping it would answer another question than the one asked."""
    if request.prompt is not None:
        raise _error(
            "prompt",
            "prompt templates are not supported (Nexus stores none); "
            "send the prompt's text in instructions and input",
        )
    if request.max_tool_calls is not None:
        raise _error(
            "max_tool_calls",
            "not supported: Nexus runs no tools (the client "
            "runs each call and sends its output in the next request)",
        )
    if request.truncation == "auto":
        raise _error(
            "truncation",
            "only 'disabled' is supported: Nexus does not shorten "
            "a conversation to fit the model's context window",
        )
    if request.include:
        raise _error(
            "include",
            f"{request.include[0]!r} is not supported: Nexus produces "
            "none of the extras include asks for",
        )
    if request.top_logprobs is not None:
        raise _error("top_logprobs", "not supported: Nexus's answers carry no log probabilities")
    if request.reasoning is not None and request.reasoning.summary not in (None, "auto"):
        raise _error(
            "reasoning.summary",
            "only 'auto' is supported: the summary is the "
            "reasoning the upstream streams, as long as it makes it",
        )
    # Chat Completions' ask for audio output: a response has no item for it.
    extra = request.model_extra or {}
    modalities = extra.get("modalities")
    for name, asks in (
        ("modalities", type(modalities) is list and any(m != "text" for m in modalities)),
        ("audio", extra.get("audio") is not None),
    ):
        if asks:
            raise _error(name, "audio output has no place in a response; ask chat completions")
    if unknown := next((name for name in extra if name not in _KNOWN_EXTRA), None):
        raise _error(unknown, "not a field Nexus's Responses API knows: it would go nowhere")


def to_chat_request(request: ResponsesRequest) -> ChatRequest:
    """The engine's request for a validated Responses request (see the module docstring).
    Raises :class:`InvalidRequest` for a field Nexus cannot honour."""
    _refuse_unsupported(request)
    messages: list[dict[str, Any]] = []
    sources: list[str] = []  # the Responses field each message came from, for errors

    def add(message: dict[str, Any], source: str) -> None:
        messages.append(message)
        sources.append(source)

    if request.instructions:
        add({"role": "system", "content": request.instructions}, "instructions")
    if isinstance(request.input, str):
        add({"role": "user", "content": request.input}, "input")
    for i, item in enumerate(request.input if isinstance(request.input, list) else ()):
        where = f"input[{i}]"
        if isinstance(item, MessageItem):
            add(_message(item, where), where)
        elif isinstance(item, FunctionCallItem):
            call = tool_call(item.call_id, item.name, item.arguments)
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                add({"role": "assistant", "tool_calls": [call]}, where)
        elif isinstance(item, FunctionCallOutputItem):
            content = _text_content(item.output, f"{where}.output", "function_call_output")
            add({"role": "tool", "tool_call_id": item.call_id, "content": content}, where)
    if not messages:
        raise _error("input", "Field required")

    chat: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "stream": request.stream,
        "background": request.background,
    }
    if request.stream_options is not None and request.stream_options.resumable:
        chat["stream_options"] = {"resumable": True}
    if request.tools:
        for i, tool in enumerate(request.tools):  # (defer_loading, allowed_callers...)
            if unknown := next(iter(tool.model_extra or ()), None):
                raise _error(f"tools[{i}].{unknown}", "a function tool field Nexus does not carry")
        chat["tools"] = [
            {"type": "function", "function": tool.model_dump(exclude_none=True, exclude={"type"})}
            for tool in request.tools
        ]
        if request.parallel_tool_calls is not None:
            chat["parallel_tool_calls"] = request.parallel_tool_calls
    _tool_choice(request, chat)
    for ours, theirs in _RENAMED:
        value = getattr(request, ours)
        if value is not None:
            chat[theirs] = value
    fmt = request.text.format if request.text is not None else None
    if fmt is not None and fmt.type != "text":
        chat["response_format"] = _response_format(fmt)
    if request.text is not None and request.text.verbosity is not None:
        chat["verbosity"] = request.text.verbosity
    if request.reasoning is not None and request.reasoning.effort is not None:
        chat["reasoning_effort"] = request.reasoning.effort
    thinking = (request.model_extra or {}).get("thinking")
    if thinking is not None:  # Anthropic's knob, for anthropic upstreams (as on chat)
        chat["thinking"] = thinking
    try:
        translated = ChatRequest.model_validate(chat)
    except ValidationError as exc:  # a constraint that only ChatRequest checks
        error = validation_error(exc, chat)
        if error.param is None:
            raise error from None
        _, _, message = error.message.partition(": ")
        raise _error(_responses_param(error.param, sources), message) from None
    echo = request_echo(request)  # (set after validation: a client's own is refused there)
    return translated.model_copy(update={"responses_echo": echo}) if echo else translated


_RENAMED = (
    ("max_output_tokens", "max_tokens"),
    ("temperature", "temperature"),
    ("top_p", "top_p"),
    ("user", "user"),
    ("mock", "mock"),
    ("service_tier", "service_tier"),
    ("prompt_cache_key", "prompt_cache_key"),
    ("safety_identifier", "safety_identifier"),
)  # (not metadata: the response's, echoed; Chat Completions refuses it without store)


def _responses_param(param: str, sources: list[str]) -> str:
    """``messages[3].content`` -> the item it came from; ``max_tokens`` -> ``max_output_tokens``."""
    head, _, _ = param.partition(".")
    name, _, index = head.partition("[")
    if name == "messages" and index[:-1].isdigit() and int(index[:-1]) < len(sources):
        return sources[int(index[:-1])]
    return CHAT_NAMES.get(name, name)


def _message(item: MessageItem, where: str) -> dict[str, Any]:
    role = item.role
    if isinstance(item.content, str):
        return {"role": role, "content": item.content}
    if role in ("system", "developer"):
        content = _text_content(item.content, f"{where}.content", f"{role} messages")
        return {"role": role, "content": content}
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(item.content):
        at = f"{where}.content[{j}]"
        if isinstance(part, TextPart):
            parts.append(_text_part(part))
        elif role == "assistant" and isinstance(part, Refusal):
            parts.append({"type": "refusal", "refusal": part.refusal})
        elif role == "user" and isinstance(part, InputImage):
            parts.append(_image(part, at))
        elif role == "user" and isinstance(part, InputFile):
            parts.append(_file(part, at))
        else:
            raise _wrong_part(at, part.type, f"{role} messages")
    return {"role": role, "content": parts}


def _text_content(content: str | list[Any], where: str, what: str) -> str | list[dict[str, Any]]:
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if not isinstance(part, TextPart):
            raise _wrong_part(f"{where}[{j}]", part.type, what)
        parts.append(_text_part(part))
    return parts


def _text_part(part: TextPart) -> dict[str, Any]:
    """A chat text part, with its ``prompt_cache_breakpoint`` (chat's has one too)."""
    mark = (part.model_extra or {}).get("prompt_cache_breakpoint")
    text = {"type": "text", "text": part.text}
    return text if mark is None else text | {"prompt_cache_breakpoint": mark}


def _wrong_part(at: str, kind: str, what: str) -> InvalidRequest:
    return _error(f"{at}.type", f"{what} cannot contain {kind!r} parts")


def _image(part: InputImage, at: str) -> dict[str, Any]:
    if part.image_url is None:
        if part.file_id is not None:
            raise _error(
                f"{at}.file_id",
                "file ids are not supported (Nexus has no file store); "
                "send image_url as a URL or a data: URL",
            )
        raise _error(f"{at}.image_url", "Field required")
    image: dict[str, Any] = {"url": part.image_url}
    if part.detail is not None:
        # Chat Completions has no "original"; "high" is the nearest detail level.
        image["detail"] = "high" if part.detail == "original" else part.detail
    return {"type": "image_url", "image_url": image}


def _file(part: InputFile, at: str) -> dict[str, Any]:
    if part.file_url is not None:
        raise _error(f"{at}.file_url", "file URLs are not supported; send file_data")
    file = part.model_dump(include={"file_data", "file_id", "filename"}, exclude_none=True)
    if "file_data" not in file and "file_id" not in file:
        raise _error(f"{at}.file_data", "Field required")
    return {"type": "file", "file": file}


def _tool_choice(request: ResponsesRequest, chat: dict[str, Any]) -> None:
    choice = request.tool_choice
    if choice is None:
        return
    names = {tool.name for tool in request.tools or ()}
    if isinstance(choice, ToolChoiceFunction):
        if choice.name not in names:
            raise _error("tool_choice.name", f"{choice.name!r} is not among the request's tools")
        chat["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        return
    if choice == "required" and not names:
        raise _error("tool_choice", "'required' needs at least one tool")
    chat["tool_choice"] = choice


def _response_format(fmt: TextFormat) -> dict[str, Any]:
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.name is None:
        raise _error("text.format.name", "Field required")
    schema = fmt.model_dump(exclude_none=True, by_alias=True, include=_SCHEMA_FIELDS)
    return {"type": "json_schema", "json_schema": schema}


_SCHEMA_FIELDS = {"name", "schema_", "description", "strict"}
