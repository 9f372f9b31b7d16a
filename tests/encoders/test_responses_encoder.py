"""The Responses SSE encoder, byte for byte, and its output read back by the openai SDK.

docs/protocols.md §4: ``event: <type>`` plus a JSON payload with that ``type`` and a
``sequence_number`` counting from 0 by one; ``response.created`` first; items
added at ``output_index`` 0, 1, ... and each one done; exactly one of
``response.completed`` / ``response.incomplete`` / ``response.failed`` last,
carrying the response the SDK's ``get_final_response()`` returns.
"""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from openai import omit
from openai._models import construct_type
from openai._streaming import SSEDecoder
from openai.lib.streaming.responses._responses import ResponseStreamState
from openai.types.responses import ResponseStreamEvent

from nexus.encoders.responses_sse import ResponsesSSEEncoder
from nexus.events import (
    Audio,
    Citation,
    Delta,
    Done,
    Error,
    Heartbeat,
    Reasoning,
    StreamEvent,
    ToolCall,
    Usage,
)
from nexus.protocol.openai_responses import response_body
from nexus.protocol.upstream import in_stream_error
from nexus.types import CompletedToolCall, Completion, StreamMeta

META = StreamMeta(id="chatcmpl-abc123", model="mock/echo", created=1700000000)
RESP = "resp_abc123"
MSG = "msg_abc123"
ERROR = Error(error_type="upstream_error", message="boom", code="upstream_error", retryable=True)
ZERO = {
    "input_tokens": 0,
    "input_tokens_details": {"cached_tokens": 0, "cache_write_tokens": 0},
    "output_tokens": 0,
    "output_tokens_details": {"reasoning_tokens": 0},
    "total_tokens": 0,
}


def response(
    status: str,
    output: list[dict[str, Any]],
    usage: dict[str, Any] | None = None,
    error: dict[str, Any] | None = None,
    incomplete: str | None = None,
) -> dict[str, Any]:
    """The ``response`` object as docs/protocols.md §4 and the SDK's type want it."""
    return {
        "id": RESP,
        "object": "response",
        "created_at": 1700000000,
        "status": status,
        "error": error,
        "incomplete_details": None if incomplete is None else {"reason": incomplete},
        "instructions": None,
        "metadata": {},
        "model": "mock/echo",
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


class Frames:
    """Expected frames, numbered in order: ``f("response.x", field=...)``."""

    def __init__(self) -> None:
        self.seq = 0

    def __call__(self, type_: str, **fields: Any) -> bytes:
        body = {"type": type_, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + type_.encode() + b"\ndata: " + orjson.dumps(body) + b"\n\n"

    def opening(self) -> bytes:
        start = response("in_progress", [])
        return self("response.created", response=start) + self(
            "response.in_progress", response=start
        )


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def message(text: str, status: str = "completed", index: int = 0) -> dict[str, Any]:
    content = [] if status == "in_progress" else [text_part(text)]
    return {
        "id": f"{MSG}_{index}",
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def call_item(index: int, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": f"fc_abc123_{index}",
        "type": "function_call",
        "status": status,
        "arguments": arguments,
        "call_id": call_id,
        "name": name,
    }


def run(*steps: StreamEvent | str, meta: StreamMeta = META) -> bytes:
    """The whole stream as the pump writes it; ``"ping"`` is an idle heartbeat."""
    enc = ResponsesSSEEncoder(meta)
    out = enc.start()
    for step in steps:
        if step == "ping":
            out += enc.heartbeat()
        elif isinstance(step, Error):
            out += enc.error(step)
        else:
            out += enc.encode(step)  # type: ignore[arg-type]
    return out + enc.end()


def payloads(body: bytes) -> list[dict[str, Any]]:
    """Each frame's JSON, read with the openai SDK's own SSE decoder."""
    return [sse.json() for sse in SSEDecoder().iter_bytes(iter([body]))]


def sdk_state(body: bytes) -> ResponseStreamState[Any]:
    """The SDK's stream helper state after reading ``body`` (its checks raise)."""
    state: ResponseStreamState[Any] = ResponseStreamState(input_tools=omit, text_format=omit)
    for data in payloads(body):
        state.handle_event(construct_type(type_=ResponseStreamEvent, value=data))  # type: ignore[arg-type]
    return state


def unparsed(value: Any) -> Any:
    """``value`` without the ``parsed*`` keys the SDK's helper adds."""
    if isinstance(value, dict):
        return {k: unparsed(v) for k, v in value.items() if not k.startswith("parsed")}
    if isinstance(value, list):
        return [unparsed(v) for v in value]
    return value


# --- frame by frame ----------------------------------------------------------


def test_start_is_created_then_in_progress_byte_for_byte() -> None:
    head = b'{"id":"resp_abc123","object":"response","created_at":1700000000,"status":"in_progress"'
    rest = (
        b',"error":null,"incomplete_details":null,"instructions":null,"metadata":{},'
        b'"model":"mock/echo","output":[],"parallel_tool_calls":true,"store":false,'
        b'"temperature":null,"tool_choice":"auto","tools":[],"top_p":null,"max_output_tokens":null,'
        b'"usage":null}'
    )
    assert ResponsesSSEEncoder(META).start() == (
        b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
        b'"response":' + head + rest + b"}\n\n"
        b'event: response.in_progress\ndata: {"type":"response.in_progress","sequence_number":1,'
        b'"response":' + head + rest + b"}\n\n"
    )


def test_text_stream() -> None:
    enc = ResponsesSSEEncoder(META)
    f = Frames()
    where = {"item_id": f"{MSG}_0", "output_index": 0, "content_index": 0}
    assert enc.start() == f.opening()
    assert enc.encode(Delta(role="assistant")) == b""
    assert enc.encode(Delta(content="Hel")) == (
        f("response.output_item.added", output_index=0, item=message("", "in_progress"))
        + f("response.content_part.added", **where, part=text_part(""))
        + f("response.output_text.delta", **where, delta="Hel", logprobs=[])
    )
    # The fast path, byte for byte.
    assert enc.encode(Delta(content='lo "wörld"\n')) == (
        b'event: response.output_text.delta\ndata: {"type":"response.output_text.delta",'
        b'"sequence_number":5,"item_id":"msg_abc123_0","output_index":0,"content_index":0,'
        b'"delta":"lo \\"w\xc3\xb6rld\\"\\n","logprobs":[]}\n\n'
    )
    f.seq += 1
    assert enc.encode(Delta(finish_reason="stop")) == b""
    assert enc.encode(Usage(5, 2, 7, cached_tokens=3, reasoning_tokens=1)) == b""
    text = 'Hello "wörld"\n'
    usage = {
        "input_tokens": 5,
        "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0},
        "output_tokens": 2,
        "output_tokens_details": {"reasoning_tokens": 1},
        "total_tokens": 7,
    }
    assert enc.end() == (
        f("response.output_text.done", **where, text=text, logprobs=[])
        + f("response.content_part.done", **where, part=text_part(text))
        + f("response.output_item.done", output_index=0, item=message(text))
        + f("response.completed", response=response("completed", [message(text)], usage))
    )
    assert enc.end() == b""


def test_reasoning_then_text() -> None:
    f = Frames()
    rs = {"item_id": "rs_abc123_0", "output_index": 0, "summary_index": 0}
    msg = {"item_id": f"{MSG}_1", "output_index": 1, "content_index": 0}
    summary = {"type": "summary_text", "text": "Let me think."}
    reasoning = {"id": "rs_abc123_0", "type": "reasoning", "summary": [summary]}
    got = run(Reasoning("Let me"), Reasoning(""), Reasoning(" think."), Delta(content="Hi"))
    assert got == (
        f.opening()
        + f(
            "response.output_item.added",
            output_index=0,
            item={"id": "rs_abc123_0", "type": "reasoning", "summary": []},
        )
        + f(
            "response.reasoning_summary_part.added", **rs, part={"type": "summary_text", "text": ""}
        )
        + f("response.reasoning_summary_text.delta", **rs, delta="Let me")
        + f("response.reasoning_summary_text.delta", **rs, delta=" think.")
        + f("response.reasoning_summary_text.done", **rs, text="Let me think.")
        + f("response.reasoning_summary_part.done", **rs, part=summary)
        + f("response.output_item.done", output_index=0, item=reasoning)
        + f("response.output_item.added", output_index=1, item=message("", "in_progress", 1))
        + f("response.content_part.added", **msg, part=text_part(""))
        + f("response.output_text.delta", **msg, delta="Hi", logprobs=[])
        + f("response.output_text.done", **msg, text="Hi", logprobs=[])
        + f("response.content_part.done", **msg, part=text_part("Hi"))
        + f("response.output_item.done", output_index=1, item=message("Hi", index=1))
        + f(
            "response.completed",
            response=response("completed", [reasoning, message("Hi", index=1)], ZERO),
        )
    )


def test_interleaved_calls_each_end_with_their_whole_arguments() -> None:
    """An upstream that interleaves parallel calls' pieces (call 0, call 1, call 0): call
    0's done events carried '{"a"' marked completed, and its last piece went out nowhere.
    A call whose arguments are not whole JSON stays open beside the next one."""
    got = run(
        ToolCall(0, id="call_a", name="f"),
        ToolCall(0, arguments='{"a"'),
        ToolCall(1, id="call_b", name="g", arguments='{"b":'),
        ToolCall(0, arguments=":1}"),
        ToolCall(1, arguments="2}"),
        Delta(finish_reason="tool_calls"),
    )
    events = [orjson.loads(frame.split(b"\ndata: ", 1)[1]) for frame in got.split(b"\n\n")[:-1]]
    done = {
        e["output_index"]: e["arguments"] for e in events if e["type"].endswith("arguments.done")
    }
    assert done == {0: '{"a":1}', 1: '{"b":2}'}
    deltas: dict[int, str] = {}
    for e in events:
        if e["type"] == "response.function_call_arguments.delta":
            deltas[e["output_index"]] = deltas.get(e["output_index"], "") + e["delta"]
    assert deltas == done  # every piece went out, under its own item
    items = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [(i["arguments"], i["status"]) for i in items] == [
        ('{"a":1}', "completed"),
        ('{"b":2}', "completed"),
    ]


def test_tool_calls_one_item_each() -> None:
    f = Frames()
    a = {"item_id": "fc_abc123_0", "output_index": 0}
    b = {"item_id": "fc_abc123_1", "output_index": 1}
    got = run(
        Delta(tool_calls=(ToolCall(0, id="call_a", name="get_weather"),)),
        ToolCall(0, arguments='{"city": '),
        Delta(tool_calls=(ToolCall(0, arguments='"Paris"}'),)),
        ToolCall(1, id="call_b", name="get_time", arguments='{"tz":'),
        ToolCall(1, arguments=' "CET"}'),
        Delta(finish_reason="tool_calls"),
    )
    done_a = call_item(0, "call_a", "get_weather", '{"city": "Paris"}', "completed")
    done_b = call_item(1, "call_b", "get_time", '{"tz": "CET"}', "completed")
    assert got == (
        f.opening()
        + f(
            "response.output_item.added",
            output_index=0,
            item=call_item(0, "call_a", "get_weather", "", "in_progress"),
        )
        + f("response.function_call_arguments.delta", **a, delta='{"city": ')
        + f("response.function_call_arguments.delta", **a, delta='"Paris"}')
        + f(
            "response.function_call_arguments.done",
            **a,
            name="get_weather",
            arguments='{"city": "Paris"}',
        )
        + f("response.output_item.done", output_index=0, item=done_a)
        + f(
            "response.output_item.added",
            output_index=1,
            item=call_item(1, "call_b", "get_time", "", "in_progress"),
        )
        + f("response.function_call_arguments.delta", **b, delta='{"tz":')
        + f("response.function_call_arguments.delta", **b, delta=' "CET"}')
        + f(
            "response.function_call_arguments.done", **b, name="get_time", arguments='{"tz": "CET"}'
        )
        + f("response.output_item.done", output_index=1, item=done_b)
        + f("response.completed", response=response("completed", [done_a, done_b], ZERO))
    )


def test_length_is_response_incomplete_and_the_last_item_incomplete() -> None:
    f = Frames()
    where = {"item_id": f"{MSG}_0", "output_index": 0, "content_index": 0}
    got = run(Delta(content="Hi"), Delta(content=" th", finish_reason="length"), Usage(1, 2, 3))
    usage = dict(ZERO, input_tokens=1, output_tokens=2, total_tokens=3)
    final = message("Hi th", "incomplete")
    assert got == (
        f.opening()
        + f("response.output_item.added", output_index=0, item=message("", "in_progress"))
        + f("response.content_part.added", **where, part=text_part(""))
        + f("response.output_text.delta", **where, delta="Hi", logprobs=[])
        + f("response.output_text.delta", **where, delta=" th", logprobs=[])
        + f("response.output_text.done", **where, text="Hi th", logprobs=[])
        + f("response.content_part.done", **where, part=text_part("Hi th"))
        + f("response.output_item.done", output_index=0, item=final)
        + f(
            "response.incomplete",
            response=response("incomplete", [final], usage, incomplete="max_output_tokens"),
        )
    )


def test_content_filter_is_incomplete_too() -> None:
    final = payloads(run(Delta(content="x"), Delta(finish_reason="content_filter")))[-1]
    assert final["type"] == "response.incomplete"
    assert final["response"]["incomplete_details"] == {"reason": "content_filter"}


def test_mid_stream_error_is_error_then_failed_and_nothing_after() -> None:
    enc = ResponsesSSEEncoder(META)
    f = Frames()
    where = {"item_id": f"{MSG}_0", "output_index": 0, "content_index": 0}
    out = enc.start() + enc.encode(Delta(content="Hi")) + enc.encode(Usage(1, 1, 2))
    assert out == (
        f.opening()
        + f("response.output_item.added", output_index=0, item=message("", "in_progress"))
        + f("response.content_part.added", **where, part=text_part(""))
        + f("response.output_text.delta", **where, delta="Hi", logprobs=[])
    )
    usage = dict(ZERO, input_tokens=1, output_tokens=1, total_tokens=2)
    failed = response(
        "failed",
        [message("Hi", "incomplete")],
        usage,
        error={"code": "server_error", "message": "boom"},
    )
    assert enc.error(ERROR) == (
        f("error", code="upstream_error", message="boom", param=None)
        + f("response.failed", response=failed)
    )
    assert enc.end() == b""
    assert enc.error(ERROR) == b""


def test_error_without_code_names_its_type_and_has_no_usage_when_none_came() -> None:
    error = Error(error_type="server_error", message="gone", param="messages")
    frames = payloads(run(error))
    assert [p["type"] for p in frames] == [
        "response.created",
        "response.in_progress",
        "error",
        "response.failed",
    ]
    assert frames[2] == {
        "type": "error",
        "sequence_number": 2,
        "code": None,
        "message": "gone",
        "param": "messages",
    }
    assert frames[3]["response"]["error"] == {"code": "server_error", "message": "gone"}
    assert frames[3]["response"]["usage"] is None
    assert frames[3]["response"]["output"] == []


def test_empty_stream_completes_with_no_output() -> None:
    f = Frames()
    assert run() == f.opening() + f("response.completed", response=response("completed", [], ZERO))


def test_refusal_is_a_second_part_of_the_message() -> None:
    frames = payloads(run(Delta(content="Sure"), Delta(refusal="I can't"), Delta(content="!")))
    types = [(p["type"], p.get("content_index")) for p in frames[2:-1]]
    assert types == [
        ("response.output_item.added", None),
        ("response.content_part.added", 0),
        ("response.output_text.delta", 0),
        ("response.output_text.done", 0),
        ("response.content_part.done", 0),
        ("response.content_part.added", 1),
        ("response.refusal.delta", 1),
        ("response.refusal.done", 1),
        ("response.content_part.done", 1),
        ("response.content_part.added", 2),
        ("response.output_text.delta", 2),
        ("response.output_text.done", 2),
        ("response.content_part.done", 2),
        ("response.output_item.done", None),
    ]
    assert frames[7]["part"] == {"type": "refusal", "refusal": ""}
    assert frames[9] == {
        "type": "response.refusal.done",
        "sequence_number": 9,
        "item_id": f"{MSG}_0",
        "output_index": 0,
        "content_index": 1,
        "refusal": "I can't",
    }
    assert frames[-1]["response"]["output"][0]["content"] == [
        text_part("Sure"),
        {"type": "refusal", "refusal": "I can't"},
        text_part("!"),
    ]


def test_heartbeat_is_a_comment_and_takes_no_number() -> None:
    enc = ResponsesSSEEncoder(META)
    assert enc.heartbeat() == b": ping\n"
    body = run("ping", Delta(content="a"), "ping", Delta(content="b"))
    assert body.count(b": ping\n") == 2
    numbers = [p["sequence_number"] for p in payloads(body)]
    assert numbers == list(range(len(numbers)))


def test_retry_line_rides_on_the_first_frame() -> None:
    meta = StreamMeta(id="chatcmpl-abc123", model="mock/echo", created=1700000000, retry_ms=3000)
    start = ResponsesSSEEncoder(meta).start()
    assert start.startswith(b"retry: 3000\nevent: response.created\ndata: ")
    assert start.count(b"retry:") == 1
    assert [p["type"] for p in payloads(start)] == ["response.created", "response.in_progress"]


def test_start_after_the_first_frame_still_numbers_in_byte_order() -> None:
    """If ``start()`` comes late, the opening goes out with the first frame and start adds none."""
    enc = ResponsesSSEEncoder(META)
    first = enc.encode(Delta(content="x"))
    assert enc.start() == b""
    expected = ResponsesSSEEncoder(META)
    assert first == expected.start() + expected.encode(Delta(content="x"))
    late_error = ResponsesSSEEncoder(META)
    body = late_error.error(ERROR) + late_error.start()
    assert [p["sequence_number"] for p in payloads(body)] == [0, 1, 2, 3]


def test_events_without_a_place_in_this_format_write_nothing() -> None:
    enc = ResponsesSSEEncoder(META)
    enc.start()
    for event in (
        Audio(data="AAAA"),
        Citation(url="https://x.test"),
        Heartbeat(),
        Done(),
        Delta(),
        Reasoning(""),
    ):
        assert enc.encode(event) == b""


def test_tool_call_without_id_gets_the_accumulate_fallback_and_a_late_name() -> None:
    frames = payloads(run(ToolCall(0, arguments="{}"), ToolCall(0, name="f")))
    call_id = "call_" + META.id[-12:] + "_0"  # what nexus.accumulate names it
    assert frames[2]["item"] == call_item(0, call_id, "", "", "in_progress")
    assert frames[-1]["response"]["output"] == [call_item(0, call_id, "f", "{}", "completed")]


def test_fragments_after_their_item_closed_reach_only_the_final_response() -> None:
    body = run(
        ToolCall(0, id="call_a", name="f", arguments='{"a":'),
        Delta(content="meanwhile"),
        ToolCall(0, arguments="1}"),
        ToolCall(5, id="call_a", arguments=""),  # a repeated id merges, as in accumulate
    )
    frames = payloads(body)
    deltas = [p["delta"] for p in frames if p["type"] == "response.function_call_arguments.delta"]
    assert deltas == ['{"a":']
    assert [p["item"]["type"] for p in frames if p["type"] == "response.output_item.added"] == [
        "function_call",
        "message",
    ]
    output = frames[-1]["response"]["output"]
    assert output[0]["arguments"] == '{"a":1}'
    assert len(output) == 2


# --- the stream as a whole ---------------------------------------------------

SCRIPTS = {
    "text": [Delta(content="Hello"), Delta(content=" world"), Delta(finish_reason="stop")],
    "reasoning-text-tools": [
        Reasoning("Think"),
        Delta(content="Let me check."),
        ToolCall(0, id="call_1", name="a", arguments='{"x":1}'),
        ToolCall(1, id="call_2", name="b"),
        ToolCall(1, arguments="{}"),
        Delta(finish_reason="tool_calls"),
        Usage(4, 5, 9, reasoning_tokens=1),
    ],
    "interleaved": [
        Reasoning("a"),
        Delta(content="b"),
        Reasoning("c"),
        Delta(refusal="d"),
        ToolCall(0, id="call_1", name="f"),
        Delta(content="e"),
    ],
    "length": [Delta(content="cut"), Delta(finish_reason="length")],
    "error": [Reasoning("hm"), Delta(content="partial"), ERROR],
    "empty": [],
}


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_numbering_and_item_bookkeeping(script: list[StreamEvent]) -> None:
    frames = payloads(run(*script, "ping"))
    assert [p["sequence_number"] for p in frames] == list(range(len(frames)))
    assert all(p["type"] for p in frames)
    assert frames[0]["type"] == "response.created"
    assert frames[1]["type"] == "response.in_progress"
    terminal = {"response.completed", "response.incomplete", "response.failed"}
    assert [p["type"] for p in frames if p["type"] in terminal] == [frames[-1]["type"]]
    ids = {p["response"]["id"] for p in frames if "response" in p}
    assert ids == {RESP}
    added = [p["output_index"] for p in frames if p["type"] == "response.output_item.added"]
    done = [p["output_index"] for p in frames if p["type"] == "response.output_item.done"]
    assert added == list(range(len(added)))
    if frames[-1]["type"] == "response.failed":
        assert done == added[:-1]  # the item the failure cut off is never done
    else:
        assert done == added
        assert [item["id"] for item in frames[-1]["response"]["output"]] == [
            p["item"]["id"] for p in frames if p["type"] == "response.output_item.done"
        ]


@pytest.mark.parametrize("script", SCRIPTS.values(), ids=SCRIPTS.keys())
def test_the_sdk_stream_helper_accepts_the_stream(script: list[StreamEvent]) -> None:
    body = run(*script)
    state = sdk_state(body)
    final = payloads(body)[-1]
    completed = state._completed_response
    if final["type"] == "response.completed":
        assert completed is not None
        assert unparsed(completed.to_dict()) == final["response"]
    else:
        assert completed is None  # get_final_response() raises "Didn't receive ..."


def test_streamed_and_non_streamed_responses_have_one_shape() -> None:
    """The ``response.completed`` object equals ``response_body`` of the same completion."""
    script = SCRIPTS["reasoning-text-tools"]
    streamed = payloads(run(*script))[-1]["response"]
    completion = Completion(
        id=META.id,
        model=META.model,
        created=META.created,
        content="Let me check.",
        reasoning="Think",
        tool_calls=[
            CompletedToolCall(0, "call_1", "a", '{"x":1}'),
            CompletedToolCall(1, "call_2", "b", "{}"),
        ],
        finish_reason="tool_calls",
        usage=Usage(4, 5, 9, reasoning_tokens=1),
    )
    assert streamed == response_body(completion)


def test_fast_path_frames_survive_a_percent_sign_in_the_stream_id() -> None:
    meta = StreamMeta(id="chatcmpl-50%d", model="m", created=1)
    enc = ResponsesSSEEncoder(meta)
    body = enc.start() + enc.encode(Delta(content="a")) + enc.encode(Delta(content="%s"))
    deltas = [p for p in payloads(body) if p["type"] == "response.output_text.delta"]
    assert [(p["item_id"], p["delta"], p["sequence_number"]) for p in deltas] == [
        ("msg_50%d_0", "a", 4),
        ("msg_50%d_0", "%s", 5),
    ]


def test_error_event_carries_the_request_id_and_an_early_usage_is_not_reported() -> None:
    """The flat ``error`` event has the spec's fields and the response's request id; a
    partial usage (input counts before any output) is neither streamed nor reported."""
    enc = ResponsesSSEEncoder(META)
    enc.request_id = "req-client-7"
    f = Frames()
    early = Usage(41, 0, 41, cached_tokens=0, cache_write_tokens=0, partial=True)
    assert enc.start() + enc.encode(early) == f.opening()
    failed = response("failed", [], None, error={"code": "server_error", "message": "boom"})
    assert enc.error(ERROR) == (
        f("error", code="upstream_error", message="boom", param=None, request_id="req-client-7")
        + f("response.failed", response=failed)
    )


def test_arguments_that_come_after_their_item_closed_replace_the_empty_object() -> None:
    """Some compatible servers interleave parallel calls: call 0 opens with no arguments,
    call 1 opens (closing call 0's item, given "{}"), then call 0's pieces come. The
    completed response held ``{}{"x":1}``, which no client can parse."""
    body = run(
        ToolCall(index=0, id="c0", name="f", arguments=""),
        ToolCall(index=1, id="c1", name="g", arguments=""),
        ToolCall(index=0, arguments='{"x":1}'),
        ToolCall(index=1, arguments='{"y":2}'),
        Delta(finish_reason="tool_calls"),
    )
    final = next(p for p in payloads(body) if p["type"] == "response.completed")["response"]
    assert [item["arguments"] for item in final["output"]] == ['{"x":1}', '{"y":2}']


@pytest.mark.parametrize(
    "error",
    [
        {"type": "rate_limit_error", "message": "slow"},  # Anthropic's
        {"type": "tokens", "code": "rate_limit_exceeded", "message": "slow"},  # OpenAI's
        {"type": "insufficient_quota", "code": "insufficient_quota", "message": "pay"},
    ],
)
def test_a_rate_limit_inside_the_stream_fails_the_response_as_one(error: dict[str, Any]) -> None:
    """An upstream's rate limit inside its stream keeps its own code now (OpenAI's
    rate_limit_exceeded), and response.failed said server_error for it."""
    event = in_stream_error("up", error).to_event()
    out = ResponsesSSEEncoder(META).error(event)
    failed = orjson.loads(out[out.rindex(b"data: ") + 6 :])
    assert failed["response"]["error"]["code"] == "rate_limit_exceeded"
