"""A bad request body costs one validation error, however many bad items it holds.

pydantic builds an error for every bad item of a list and every unknown field of a strict
model, about 3-4 µs each on the event loop all tenants share: an 800 KB body of them held
it for one to two seconds. Wire lists stop at their first bad item (``nexus.request.Items``)
and a strict model reports its first unknown field only; the client is told the first.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from pydantic import BaseModel, ValidationError

from nexus.errors import InvalidRequest
from nexus.protocol.anthropic_messages import MessagesRequest, parse_messages_request
from nexus.protocol.openai_chat import parse_chat_request
from nexus.protocol.openai_responses import ResponsesRequest, parse_responses_request
from nexus.request import ChatRequest

MANY = 50_000
USER = {"role": "user", "content": "hi"}
BAD = [1] * MANY
UNKNOWN = {f"k{i}": 1 for i in range(MANY)}

CHAT: dict[str, dict[str, Any]] = {
    "messages[0]": {"messages": BAD},
    "messages[0].content": {"messages": [{"role": "user", "content": BAD}]},
    "messages[0].tool_calls[0]": {"messages": [{"role": "assistant", "tool_calls": BAD}]},
    "tools[0]": {"messages": [USER], "tools": BAD},
    "stop": {"messages": [USER], "stop": BAD},
    "response_format.k0": {"messages": [USER], "response_format": {"type": "text"} | UNKNOWN},
    "mock.k0": {"messages": [USER], "mock": UNKNOWN},
}
MESSAGES: dict[str, dict[str, Any]] = {
    "messages[0]": {"messages": BAD},
    "messages[0].content": {"messages": [{"role": "user", "content": BAD}]},
    "messages[0].k0": {"messages": [{"role": "user", "content": "hi"} | UNKNOWN]},
    "system": {"messages": [USER], "system": BAD},
    "tools[0]": {"messages": [USER], "tools": BAD},
    "stop_sequences[0]": {"messages": [USER], "stop_sequences": BAD},
    "tool_choice.k0": {"messages": [USER], "tool_choice": {"type": "auto"} | UNKNOWN},
}
RESPONSES: dict[str, dict[str, Any]] = {
    "input": {"input": BAD},
    "input[0].content": {"input": [{"role": "user", "content": BAD}]},
    "tools[0]": {"input": "hi", "tools": BAD},
    "metadata": {"input": "hi", "metadata": UNKNOWN},
}
CASES = (
    [(ChatRequest, parse_chat_request, {"model": "m"}, p, body) for p, body in CHAT.items()]
    + [
        (MessagesRequest, parse_messages_request, {"model": "m", "max_tokens": 1}, p, body)
        for p, body in MESSAGES.items()
    ]
    + [
        (ResponsesRequest, parse_responses_request, {"model": "m"}, p, b)
        for p, b in RESPONSES.items()
    ]
)


@pytest.mark.parametrize(
    ("model", "parse", "base", "param", "body"),
    CASES,
    ids=[f"{case[0].__name__}-{case[3]}" for case in CASES],
)
def test_a_body_of_many_bad_items_is_one_error_naming_the_first(
    model: type[BaseModel], parse: Any, base: dict[str, Any], param: str, body: dict[str, Any]
) -> None:
    data = base | body
    with pytest.raises(ValidationError) as raised:
        model.model_validate(data)
    assert raised.value.error_count() <= 3, raised.value.error_count()  # a union's branches
    with pytest.raises(InvalidRequest) as refused:
        parse(orjson.dumps(data))
    assert refused.value.param is not None and refused.value.param.startswith(param)


@pytest.mark.parametrize(
    "parse",
    [parse_chat_request, parse_messages_request, parse_responses_request],
)
def test_a_model_name_is_at_most_256_characters(parse: Any) -> None:
    """It reaches logs, spans and error messages: a 2 MB one went whole to each."""
    body = {"model": "m" * 257, "max_tokens": 1, "messages": [{"role": "user", "content": "x"}]}
    body["input"] = "x"
    if parse is not parse_messages_request:
        del body["max_tokens"]
    if parse is parse_responses_request:
        del body["messages"]
    else:
        del body["input"]
    with pytest.raises(InvalidRequest) as refused:
        parse(orjson.dumps(body))
    assert refused.value.param == "model"
    body["model"] = "m" * 256
    assert parse(orjson.dumps(body)).model == "m" * 256
