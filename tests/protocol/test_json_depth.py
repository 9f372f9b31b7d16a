"""The JSON shape walk (depth, and how many values) and the parsers that use it (sans-I/O)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from nexus.config import parse_config
from nexus.errors import ConfigError, InvalidRequest, RequestTooLarge
from nexus.protocol.anthropic_messages import parse_messages_request
from nexus.protocol.json_depth import deep_field, deeper_than, more_items_than
from nexus.protocol.openai_chat import parse_chat_request
from nexus.protocol.openai_responses import parse_responses_request
from nexus.protocol.realtime import RealtimeSession, Send, StartTurn


def nest(depth: int) -> Any:
    value: Any = []
    for i in range(depth - 1):
        value = [value] if i % 2 else {"k": value, "s": "x"}
    return value


@pytest.mark.parametrize(
    ("value", "depth"),
    [
        (1, 0),
        ("s", 0),
        (None, 0),
        ({}, 1),
        ([], 1),
        ([1, "a", None], 1),
        ({"a": {}}, 2),
        ({"a": 1, "b": [[]], "c": {}}, 3),
        ([{}, [[[]]], {}], 4),
        (nest(64), 64),
        (nest(1000), 1000),
    ],
)
def test_depth_walk(value: Any, depth: int) -> None:
    assert not deeper_than(value, depth)
    if depth:
        assert deeper_than(value, depth - 1)


def test_the_walk_stops_at_the_limit_and_does_not_recurse() -> None:
    deep = nest(100_000)  # far past the interpreter's recursion limit
    assert deeper_than(deep, 64)
    assert not deeper_than(deep, 100_000)


def body(depth: int) -> bytes:
    """A chat request whose body nests ``depth`` deep (past what orjson can write)."""
    inner = "[" * (depth - 1) + "]" * (depth - 1)
    return (
        b'{"model":"mock/echo","messages":[{"role":"user","content":"hi"}],"metadata":'
        + inner.encode()
        + b"}"
    )


PARSERS = [parse_chat_request, parse_messages_request, parse_responses_request]


def test_deep_field_names_the_first_field_past_the_limit() -> None:
    obj = {"a": 1, "b": [[{}]], "c": [[[[]]]]}
    assert deep_field(obj, 5) is None
    assert deep_field(obj, 4) == "c"
    assert deep_field(obj, 3) == "b"


@pytest.mark.parametrize("parse", PARSERS)
@pytest.mark.parametrize("depth", [65, 254, 255, 1023, 1024])
def test_parsers_refuse_deep_bodies_naming_the_field(parse: Any, depth: int) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse(body(depth))
    assert refused.value.code == "invalid_request"
    assert refused.value.status == 400
    assert refused.value.param == "metadata"
    assert refused.value.message.startswith("metadata: nested deeper than the limit of 64")


@pytest.mark.parametrize("parse", PARSERS)
@pytest.mark.parametrize("depth", [1026, 100_000])
def test_bodies_past_the_parsers_own_limit_are_not_json(parse: Any, depth: int) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse(body(depth))
    assert refused.value.code == "invalid_json"
    assert refused.value.status == 400


def test_the_limit_is_the_callers() -> None:
    with pytest.raises(InvalidRequest, match="limit of 8 levels"):
        parse_chat_request(body(9), max_depth=8)
    request = {"model": "mock/echo", "messages": [{"role": "user", "content": "hi"}]}
    assert parse_chat_request(orjson.dumps(request), max_depth=3).model == "mock/echo"


def start(depth: int) -> str:
    return '{"type":"start","request":' + body(depth).decode() + "}"


@pytest.mark.parametrize(
    ("depth", "code"),
    [(65, "invalid_request"), (300, "invalid_request"), (2000, "invalid_envelope")],
)
def test_a_deep_start_frame_gets_an_error_and_the_session_goes_on(depth: int, code: str) -> None:
    session = RealtimeSession(max_pending_input_bytes=1000)
    [action] = session.receive_text(start(depth))
    assert isinstance(action, Send)
    error = orjson.loads(action.frame)["error"]
    assert error["code"] == code  # past 1024 levels, orjson's: not JSON it can parse
    if code == "invalid_request":
        assert error["param"] == "request.metadata"
        assert "limit of 64" in error["message"]
    assert not session.streaming
    [action] = session.receive_text(start(2))
    assert isinstance(action, StartTurn)


def test_a_start_at_the_limit_is_taken() -> None:
    session = RealtimeSession(max_pending_input_bytes=1000, max_json_depth=5)
    assert isinstance(session.receive_text(start(5))[0], StartTurn)
    session.turn_ended()
    assert isinstance(session.receive_text(start(6))[0], Send)
    # Any other frame: one level more, for its envelope.
    [refused] = session.receive_text('{"type":"abort","x":' + "[" * 6 + "]" * 6 + "}")
    assert orjson.loads(refused.frame)["error"]["param"] == "x"  # type: ignore[union-attr]


def test_the_config_key_and_its_bounds() -> None:
    assert parse_config({}).limits.max_json_depth == 64
    assert parse_config({"limits": {"max_json_depth": 12}}).limits.max_json_depth == 12
    for bad in (0, 201):  # past 200 the gateway's own encoding (254 levels) could fail
        with pytest.raises(ConfigError, match="max_json_depth"):
            parse_config({"limits": {"max_json_depth": bad}})


# --- how many values ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "items"),
    [
        (1, 0),
        ({}, 0),
        ([1, "a", None], 3),
        ({"a": [1, 2]}, 3),  # the member, and its two elements
        ({"a": {"b": {"c": []}}, "d": 1}, 4),
        ([[1, 2], [3, [4, 5]]], 8),
    ],
)
def test_values_are_the_members_and_elements_of_every_object_and_array(
    value: Any, items: int
) -> None:
    assert not more_items_than(value, items)
    if items:
        assert more_items_than(value, items - 1)


def many(messages: int, *, responses: bool = False) -> bytes:
    """A body of ``messages`` messages, in ``input`` for the Responses endpoint (which
    refuses a field it does not know), else in ``messages``."""
    user = {"role": "user", "content": "hi"}
    if responses:
        return orjson.dumps({"model": "m", "max_output_tokens": 1, "input": [user] * messages})
    return orjson.dumps({"model": "m", "max_tokens": 1, "messages": [user] * messages})


@pytest.mark.parametrize("parse", PARSERS)
def test_parsers_refuse_bodies_of_too_many_values_as_too_large(parse: Any) -> None:
    # 3 top-level members, a list of 30 messages of 2 members each: 93 values.
    responses = parse is parse_responses_request
    values = 93
    with pytest.raises(RequestTooLarge) as refused:
        parse(many(30, responses=responses), max_items=values - 1)
    assert refused.value.status == 413 and refused.value.code == "request_too_large"
    assert f"limit of {values - 1} JSON values" in refused.value.message
    assert parse(many(30, responses=responses), max_items=values).model == "m"  # taken
    with pytest.raises(RequestTooLarge):  # the default: 100,000
        parse(many(40_000, responses=responses))


def test_a_start_of_too_many_values_gets_an_error_and_the_session_goes_on() -> None:
    session = RealtimeSession(max_pending_input_bytes=1000, max_json_items=50)
    user = {"role": "user", "content": "hi"}
    big = {"type": "start", "request": {"model": "m", "messages": [user] * 30}}
    [refused] = session.receive_text(orjson.dumps(big).decode())
    assert isinstance(refused, Send)
    assert orjson.loads(refused.frame)["error"]["code"] == "request_too_large"
    assert not session.streaming
    [action] = session.receive_text(start(2))
    assert isinstance(action, StartTurn)


def test_the_items_config_key() -> None:
    assert parse_config({}).limits.max_json_items == 100_000
    assert parse_config({"limits": {"max_json_items": 50}}).limits.max_json_items == 50
    with pytest.raises(ConfigError, match="max_json_items"):
        parse_config({"limits": {"max_json_items": 0}})
