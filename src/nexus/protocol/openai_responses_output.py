"""The Responses API ``response`` object and its output items (docs/protocols.md §4). Sans-I/O.

:func:`response_body` (non-streaming) and :mod:`nexus.encoders.responses_sse` build
items from the same functions, so the SDK's ``get_final_response()`` and
``responses.create()`` see one shape. :func:`responses_error` names the fields of an
error the way the Responses API does.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
from pydantic import BaseModel

from ..errors import GatewayError
from ..events import Usage
from ..types import Completion, ReasoningBlock, in_order

if TYPE_CHECKING:
    from .openai_responses import ResponsesRequest

__all__ = [
    "CHAT_NAMES",
    "accepted_body",
    "function_call_item",
    "incomplete_reason",
    "message_item",
    "reasoning_item",
    "refusal_part",
    "request_echo",
    "response_body",
    "response_ids",
    "response_object",
    "responses_error",
    "text_part",
    "usage_body",
]


def response_ids(stream_id: str) -> tuple[str, str]:
    """``(resp_<hex>, <hex>)`` for a stream; item ids are ``<prefix>_<hex>_<output_index>``
    (``msg_``, ``rs_``, ``fc_``) in both forms of a response."""
    stem = stream_id.rpartition("-")[2] or stream_id
    return "resp_" + stem, stem


def reasoning_item(item_id: str, text: str | None) -> dict[str, Any]:
    """A ``reasoning`` output item; ``text is None`` for the just-added form."""
    summary = [] if text is None else [{"type": "summary_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": summary}


def message_item(item_id: str, content: list[dict[str, Any]], status: str) -> dict[str, Any]:
    """An assistant ``message`` output item with its content parts."""
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def refusal_part(text: str) -> dict[str, Any]:
    return {"type": "refusal", "refusal": text}


def function_call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str
) -> dict[str, Any]:
    """A ``function_call`` output item (docs/protocols.md §4: arguments is a string)."""
    return {
        "id": item_id,
        "type": "function_call",
        "status": status,
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
    }


def usage_body(usage: Usage | None) -> dict[str, Any]:
    """The Responses ``usage`` object; zeros when the provider reported none."""
    if usage is None:
        usage = Usage()
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {
            "cached_tokens": usage.cached_tokens or 0,
            "cache_write_tokens": usage.cache_write_tokens or 0,
        },
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": usage.reasoning_tokens or 0},
        "total_tokens": usage.total_tokens,
    }


_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


def incomplete_reason(finish_reason: str | None) -> str | None:
    """The ``incomplete_details.reason`` for a finish reason, None when the turn completed."""
    return _INCOMPLETE.get(finish_reason or "")


ECHO_MAX_BYTES = 16 * 1024
"""The most of a request's ``instructions`` and ``tools`` (their JSON) its response object
echoes: they are kept with the stream for ``resume_ttl_s`` (in Redis too), outside its
log's bounds; past it, the response echoes neither (their defaults), the rest still."""


def request_echo(request: ResponsesRequest) -> dict[str, Any]:
    """What the ``response`` object echoes of the request, as it sent it (those it left
    out keep :func:`response_object`'s defaults; see :data:`ECHO_MAX_BYTES`)."""
    choice = request.tool_choice
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools or ()] or None
    instructions = request.instructions
    if len(orjson.dumps([instructions, tools])) > ECHO_MAX_BYTES:
        instructions = tools = None
    echo: dict[str, Any] = {
        "instructions": instructions,
        "metadata": request.metadata,
        "tools": tools,
        "tool_choice": choice.model_dump() if isinstance(choice, BaseModel) else choice,
        "parallel_tool_calls": request.parallel_tool_calls,
        "temperature": request.temperature,
        "top_p": request.top_p,
        "max_output_tokens": request.max_output_tokens,
    }
    return {name: value for name, value in echo.items() if value is not None}


def response_object(
    *,
    response_id: str,
    created_at: int,
    model: str,
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete: str | None = None,
    echo: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """A ``response`` object with the fields the SDK's type requires; the request's fields
    it echoes (``instructions``, ``metadata``, ``tools``...) as the request sent them
    (``echo``: :attr:`~nexus.types.StreamMeta.echo`), else their defaults."""
    body = {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "error": error,
        "incomplete_details": None if incomplete is None else {"reason": incomplete},
        "instructions": None,
        "metadata": {},
        "model": model,
        "output": output,
        "parallel_tool_calls": True,
        "store": False,
        "temperature": None,
        "tool_choice": "auto",
        "tools": [],
        "top_p": None,
        "max_output_tokens": None,
        "usage": usage,
    }
    if echo:
        body.update(echo)
    return body


def accepted_body(
    described: dict[str, Any],
    stream_id: str,
    model: str,
    created: int,
    echo: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The answer to ``background: true``: the ``response`` object the SDK reads (its
    ``resp_`` id, status ``in_progress``, no output yet: ``output_text`` is ``""``), with
    Nexus's ``url``, ``read_token``, ``resumable`` and ``stream_id`` (``described``, the 202
    of the other endpoints) to read it from, as on every endpoint."""
    response_id, _ = response_ids(stream_id)
    body = response_object(
        response_id=response_id,
        created_at=created,
        model=model,
        status=described["status"],
        output=[],
        echo=echo,
    )
    body["background"] = True
    body["stream_id"] = described["id"]  # the resource's, in url and Last-Event-IDs
    for key in ("url", "read_token", "resumable"):
        if key in described:
            body[key] = described[key]
    return body


def response_body(completion: Completion) -> dict[str, Any]:
    """The non-streaming ``response`` object for a merged completion: reasoning, messages
    (text, refusal) and function calls in the order they came, as the stream writes them;
    an incomplete response's last item is incomplete too."""

    response_id, stem = response_ids(completion.id)
    reason = incomplete_reason(completion.finish_reason)
    output: list[dict[str, Any]] = []
    # A refusal goes in the last message. Reasoning blocks that follow one another are one
    # item, as streamed; a block without text (redacted, or a bare signature) has no place.
    for item in in_order(completion):
        if isinstance(item, ReasoningBlock):
            if not item.text:
                continue
            if output and output[-1]["type"] == "reasoning":
                output[-1]["summary"][0]["text"] += item.text
            else:
                output.append(reasoning_item(f"rs_{stem}_{len(output)}", item.text))
        elif isinstance(item, tuple):
            text, refusal = item
            content = [text_part(text)] if text else []
            if refusal:
                content.append(refusal_part(refusal))
            if content:
                output.append(message_item(f"msg_{stem}_{len(output)}", content, "completed"))
        else:
            item_id = f"fc_{stem}_{len(output)}"
            output.append(
                function_call_item(item_id, item.id, item.name, item.arguments, "completed")
            )
    if reason is not None and output and "status" in output[-1]:
        output[-1]["status"] = "incomplete"
    return response_object(
        response_id=response_id,
        created_at=completion.created,
        model=completion.model,
        status="completed" if reason is None else "incomplete",
        output=output,
        usage=usage_body(completion.usage),
        incomplete=reason,
        echo=completion.echo,
    )


CHAT_NAMES = {
    "max_tokens": "max_output_tokens",
    "response_format": "text.format",
    "messages": "input",
}
"""The chat fields whose Responses twins have another name."""


def responses_error(error: GatewayError) -> GatewayError:
    """``error`` naming its chat field (``response_format: ...``, an upstream's
    ``messages``) as the Responses API does (``text.format: ...``, ``input``); as it is when
    it names no field with another name there."""
    param = error.param
    name = CHAT_NAMES.get(param) if param is not None else None
    if param is None or name is None:
        return error
    message = error.message
    if message.startswith(param):
        message = name + message.removeprefix(param)
    return type(error)(
        message,
        param=name,
        code=error.code,
        status=error.status,
        retryable=error.retryable,
        headers=error.headers,
        error_type=error.error_type,
    )
