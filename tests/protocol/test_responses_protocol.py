"""The Responses request translation and the non-streaming ``response`` object (sans-I/O)."""

from __future__ import annotations

from typing import Any

import orjson
import pytest

from nexus.errors import InvalidRequest
from nexus.events import Usage
from nexus.protocol.openai_responses import (
    InputImage,
    MessageItem,
    ResponsesRequest,
    parse_responses_request,
    response_body,
    to_chat_request,
)
from nexus.protocol.openai_responses_output import response_ids
from nexus.request import ChatRequest
from nexus.types import CompletedToolCall, Completion


def parse(**body: Any) -> ChatRequest:
    return parse_responses_request(orjson.dumps({"model": "mock/echo", **body}))


def messages(**body: Any) -> list[dict[str, Any]]:
    dumped: list[dict[str, Any]] = parse(**body).model_dump(exclude_none=True)["messages"]
    return dumped


def refused(**body: Any) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse(**body)
    return info.value


# --- request translation -------------------------------------------------------


def test_instructions_then_a_string_input() -> None:
    assert messages(instructions="Be brief.", input="Hi") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]


def test_message_items_keep_roles_and_parts() -> None:
    got = messages(
        input=[
            {"role": "developer", "content": [{"type": "input_text", "text": "Rules."}]},
            {
                "type": "message",
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Look:"},
                    {"type": "input_image", "image_url": "https://x.test/a.png", "detail": "low"},
                    {"type": "input_image", "image_url": "data:image/png;base64,AAAA"},
                    {
                        "type": "input_image",
                        "image_url": "https://x.test/b.png",
                        "detail": "original",
                    },
                    {
                        "type": "input_file",
                        "file_data": "data:application/pdf;base64,AA",
                        "filename": "a.pdf",
                    },
                ],
            },
            {
                "type": "message",
                "id": "msg_1",
                "status": "completed",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": "Seen.", "annotations": [], "logprobs": []},
                    {"type": "refusal", "refusal": "But no."},
                ],
            },
            {"role": "system", "content": "Plain."},
        ]
    )
    assert got == [
        {"role": "developer", "content": [{"type": "text", "text": "Rules."}]},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look:"},
                {
                    "type": "image_url",
                    "image_url": {"url": "https://x.test/a.png", "detail": "low"},
                },
                {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                {
                    "type": "image_url",
                    "image_url": {"url": "https://x.test/b.png", "detail": "high"},
                },
                {
                    "type": "file",
                    "file": {"file_data": "data:application/pdf;base64,AA", "filename": "a.pdf"},
                },
            ],
        },
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "Seen."},
                {"type": "refusal", "refusal": "But no."},
            ],
        },
        {"role": "system", "content": "Plain."},
    ]


def call(call_id: str, name: str = "f", arguments: str = "{}") -> dict[str, Any]:
    return {"type": "function_call", "call_id": call_id, "name": name, "arguments": arguments}


def chat_call(call_id: str, name: str = "f", arguments: str = "{}") -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def test_function_calls_join_the_assistant_turn_before_them() -> None:
    got = messages(
        input=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Checking."},
            call("c1", "a"),
            {"type": "reasoning", "id": "rs_1", "summary": []},
            call("c2", "b", '{"x":1}'),
            {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "warm"}],
            },
            call("c3"),
            {"type": "function_call_output", "call_id": "c3", "output": ""},
        ]
    )
    assert got == [
        {"role": "user", "content": "Weather?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [chat_call("c1", "a"), chat_call("c2", "b", '{"x":1}')],
        },
        {"role": "tool", "content": "sunny", "tool_call_id": "c1"},
        {"role": "tool", "content": [{"type": "text", "text": "warm"}], "tool_call_id": "c2"},
        {"role": "assistant", "tool_calls": [chat_call("c3")]},
        {"role": "tool", "content": "", "tool_call_id": "c3"},
    ]


def test_parameters_tools_and_formats() -> None:
    chat = parse(
        input="Hi",
        max_output_tokens=20,
        temperature=0.5,
        top_p=0.9,
        user="u1",
        stream=True,
        tools=[{"type": "function", "name": "f", "parameters": None, "strict": True}],
        tool_choice={"type": "function", "name": "f"},
        parallel_tool_calls=False,
        text={"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}}},
        reasoning={"effort": "low", "summary": "auto"},
        metadata={"k": "v"},
        store=True,
        truncation="disabled",
        include=[],
        mock={"content": "scripted"},
    )
    assert chat.token_limit == 20
    assert (chat.temperature, chat.top_p, chat.user, chat.stream) == (0.5, 0.9, "u1", True)
    assert chat.model_dump(exclude_none=True, include={"tools", "tool_choice"}) == {
        "tools": [{"type": "function", "function": {"name": "f", "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}},
    }
    assert chat.parallel_tool_calls is False
    assert chat.response_format is not None
    assert chat.response_format.model_dump(by_alias=True, exclude_none=True) == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}},
    }
    assert chat.mock is not None and chat.mock.content == "scripted"
    # Only what Chat Completions knows goes on; the rest stays behind.
    assert chat.model_extra == {"reasoning_effort": "low"}  # (metadata: the response's)
    assert chat.responses_echo is not None and chat.responses_echo["metadata"] == {"k": "v"}


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [({"type": "json_object"}, {"type": "json_object"}), ({"type": "text"}, None)],
)
def test_other_text_formats(fmt: dict[str, Any], expected: dict[str, Any] | None) -> None:
    chat = parse(input="Hi", text={"format": fmt})
    got = chat.response_format.model_dump(exclude_none=True) if chat.response_format else None
    assert got == expected


def test_parallel_tool_calls_only_with_tools_and_string_tool_choice() -> None:
    assert parse(input="Hi", parallel_tool_calls=True).parallel_tool_calls is None
    tools = [{"type": "function", "name": "f"}]
    assert parse(input="Hi", tools=tools, tool_choice="required").tool_choice == "required"
    assert parse(input="Hi", tool_choice="none").tool_choice == "none"


@pytest.mark.parametrize(
    ("body", "param", "fragment"),
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id", "input"),
        ({"input": [5]}, "input[0].type", "must be an object with a type"),
        ({"input": [{"type": 3}]}, "input[0].type", "must be an object with a type"),
        ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type", "'item_reference'"),
        ({"input": [{"role": "user", "content": 3}]}, "input[0].content", "string or a list"),
        (
            {"input": [{"role": "user", "content": [{"type": "video"}]}]},
            "input[0].content[0].type",
            "'video'",
        ),
        (
            {"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "u"}]}]},
            "input[0].content[0].type",
            "system messages cannot contain 'input_image' parts",
        ),
        (
            {"input": [{"role": "assistant", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
            "assistant messages cannot contain 'input_file' parts",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "refusal", "refusal": "no"}]}]},
            "input[0].content[0].type",
            "user messages cannot contain 'refusal' parts",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]},
            "input[0].content[0].file_id",
            "no file store",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": ""}]}]},
            "input[0].content[0].image_url",
            "at least 1 character",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_url": "u"}]}]},
            "input[0].content[0].file_url",
            "not supported",
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "filename": "a"}]}]},
            "input[0].content[0].file_data",
            "Field required",
        ),
        (
            {
                "input": [
                    {
                        "type": "function_call_output",
                        "call_id": "c",
                        "output": [{"type": "input_image", "image_url": "u"}],
                    }
                ]
            },
            "input[0].output[0].type",
            "function_call_output cannot contain 'input_image' parts",
        ),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "at least one tool"),
        ({"input": "x", "tool_choice": ["auto"]}, "tool_choice", "a string or an object"),
        (
            {"input": "x", "tool_choice": {"type": "function", "name": "f", "extra": 1}},
            "tool_choice.extra",
            "Unknown field",
        ),
        (
            {"input": "x", "tools": [{"type": "function", "name": "a b"}]},
            "tools[0].name",
            "pattern",
        ),
        (
            {"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}},
            "text.format.name",
            "Field required",
        ),
        ({"input": "x", "metadata": {"k": 1}}, "metadata.k", "valid string"),
        ({"input": "x", "top_p": 2}, "top_p", "less than or equal to 1"),
        ({"input": "x", "stream": "yes"}, "stream", "valid boolean"),
        ({}, "input", "Field required"),
    ],
)
def test_errors_name_the_responses_field(body: dict[str, Any], param: str, fragment: str) -> None:
    error = refused(**body)
    assert error.param == param
    assert error.status == 400
    assert error.message.startswith(f"{param}: ")
    assert fragment in error.message


def test_input_may_be_left_out_when_instructions_are_given() -> None:
    assert messages(instructions="Say hi.") == [{"role": "system", "content": "Say hi."}]


def test_a_constraint_only_chat_request_checks_still_names_the_responses_field() -> None:
    """The last line of defence: ChatRequest's own failures map back to Responses names."""
    image = InputImage.model_construct(type="input_image", image_url="", detail=None)
    item = MessageItem.model_construct(type=None, role="user", content=[image])
    request = ResponsesRequest.model_construct(
        model="m", input=[item], instructions="x", stream=False
    )
    with pytest.raises(InvalidRequest) as info:
        to_chat_request(request)
    assert info.value.param == "input[0]"  # messages[1]: the instructions are messages[0]
    assert info.value.message.startswith("input[0]: ")
    for name, value, param in (
        ("max_output_tokens", -1, "max_output_tokens"),
        ("temperature", 9.0, "temperature"),
    ):
        bad = ResponsesRequest.model_construct(model="m", input="x", stream=False, **{name: value})
        with pytest.raises(InvalidRequest) as info:
            to_chat_request(bad)
        assert info.value.param == param
        assert info.value.message.startswith(f"{param}: ")


# --- the response object -----------------------------------------------------------


def completion(**fields: Any) -> Completion:
    return Completion(id="chatcmpl-abc", model="mock/echo", created=1700000000, **fields)


def test_response_ids() -> None:
    assert response_ids("chatcmpl-0123abcd") == ("resp_0123abcd", "0123abcd")
    assert response_ids("plain") == ("resp_plain", "plain")


def test_response_body_text() -> None:
    body = response_body(
        completion(content="Hi", finish_reason="stop", usage=Usage(3, 1, 4, cached_tokens=2))
    )
    assert body == {
        "id": "resp_abc",
        "object": "response",
        "created_at": 1700000000,
        "status": "completed",
        "error": None,
        "incomplete_details": None,
        "instructions": None,
        "metadata": {},
        "model": "mock/echo",
        "output": [
            {
                "id": "msg_abc_0",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [
                    {"type": "output_text", "text": "Hi", "annotations": [], "logprobs": []}
                ],
            }
        ],
        "parallel_tool_calls": True,
        "store": False,
        "temperature": None,
        "tool_choice": "auto",
        "tools": [],
        "top_p": None,
        "max_output_tokens": None,
        "usage": {
            "input_tokens": 3,
            "input_tokens_details": {"cached_tokens": 2, "cache_write_tokens": 0},
            "output_tokens": 1,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 4,
        },
    }


def test_response_body_reasoning_refusal_tools_and_length() -> None:
    body = response_body(
        completion(
            reasoning="Think.",
            refusal="No.",
            tool_calls=[CompletedToolCall(0, "call_1", "f", '{"x":1}')],
            finish_reason="length",
        )
    )
    assert body["status"] == "incomplete"
    assert body["incomplete_details"] == {"reason": "max_output_tokens"}
    assert body["output"] == [
        {
            "id": "rs_abc_0",
            "type": "reasoning",
            "summary": [{"type": "summary_text", "text": "Think."}],
        },
        {
            "id": "msg_abc_1",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "refusal", "refusal": "No."}],
        },
        {
            "id": "fc_abc_2",
            "type": "function_call",
            "status": "incomplete",
            "arguments": '{"x":1}',
            "call_id": "call_1",
            "name": "f",
        },
    ]
    assert body["usage"]["total_tokens"] == 0


def test_response_body_empty_and_content_filter() -> None:
    body = response_body(completion(finish_reason="content_filter"))
    assert (body["status"], body["incomplete_details"], body["output"]) == (
        "incomplete",
        {"reason": "content_filter"},
        [],
    )
    assert response_body(completion())["status"] == "completed"


def test_thinking_is_forwarded_for_anthropic_upstreams() -> None:
    from nexus.protocol.anthropic_events import messages_body

    thinking = {"type": "enabled", "budget_tokens": 1024}
    body = {"model": "claude/x", "input": "Hi", "max_output_tokens": 2048, "thinking": thinking}
    chat = parse_responses_request(orjson.dumps(body))
    assert messages_body(chat, "x", 4096)["thinking"] == thinking
