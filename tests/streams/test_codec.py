"""The stored-log codec: events to compact JSON and back, exactly."""

from __future__ import annotations

from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexus.cache.codec import (
    dump_entry,
    dump_event,
    dumps_events,
    event_size,
    load_event,
    loads_events,
)
from nexus.events import (
    Audio,
    Citation,
    Delta,
    Done,
    Error,
    Heartbeat,
    Image,
    Reasoning,
    StreamEvent,
    ToolCall,
    Usage,
)

FULL_CALL = ToolCall(index=1, id="call_1", name="get_weather", arguments='{"city":"Paris"}')

# (event, its stored JSON): every type, with defaults and with every field set.
CASES: list[Any] = [
    pytest.param(Delta(), b'["delta",null,null,null,null,null]', id="delta-defaults"),
    pytest.param(Delta(content="Hi"), b'["delta","Hi",null,null,null,null]', id="delta-content"),
    pytest.param(
        Delta(
            content="Hi\n\n\u00e9\U0001f389",
            role="assistant",
            refusal="no",
            tool_calls=(FULL_CALL, ToolCall(2)),
            finish_reason="tool_calls",
        ),
        b'["delta","Hi\\n\\n\xc3\xa9\xf0\x9f\x8e\x89","assistant","no",'
        b'[[1,"call_1","get_weather","{\\"city\\":\\"Paris\\"}"],[2,null,null,""]],"tool_calls"]',
        id="delta-all-fields",
    ),
    pytest.param(
        Delta(tool_calls=()), b'["delta",null,null,null,[],null]', id="delta-empty-tool-calls"
    ),
    pytest.param(Reasoning("think"), b'["reasoning","think",null]', id="reasoning"),
    pytest.param(
        Reasoning("", signature="c2ln"), b'["reasoning","","c2ln"]', id="reasoning-signature"
    ),
    pytest.param(
        Reasoning("", redacted="QkxPQg=="),
        b'["reasoning","",null,"QkxPQg=="]',
        id="reasoning-redacted",
    ),
    pytest.param(ToolCall(0), b'["tool_call",0,null,null,""]', id="tool-call-defaults"),
    pytest.param(
        FULL_CALL,
        b'["tool_call",1,"call_1","get_weather","{\\"city\\":\\"Paris\\"}"]',
        id="tool-call-all-fields",
    ),
    pytest.param(Audio(), b'["audio",null,null,null]', id="audio-defaults"),
    pytest.param(
        Audio(data="AAAA", format="pcm16", transcript="hi"),
        b'["audio","AAAA","pcm16","hi"]',
        id="audio-before-its-id",
    ),
    pytest.param(
        Audio(transcript="hi", id="audio_1"),
        b'["audio",null,null,"hi","audio_1"]',
        id="audio-id",
    ),
    pytest.param(
        Audio(data="AAAA", format="pcm16", transcript="hi", id="audio_1", expires_at=1730768595),
        b'["audio","AAAA","pcm16","hi","audio_1",1730768595]',
        id="audio-all-fields",
    ),
    pytest.param(Image(), b'["image",null,null,null]', id="image-defaults"),
    pytest.param(
        Image(data="iVBO", url="https://x/y.png", mime_type="image/png"),
        b'["image","iVBO","https://x/y.png","image/png"]',
        id="image-all-fields",
    ),
    pytest.param(Citation(), b'["citation",null,null,null]', id="citation-defaults"),
    pytest.param(
        Citation(url="https://x", title="X", quoted="q"),
        b'["citation","https://x","X","q"]',
        id="citation-all-fields",
    ),
    pytest.param(Usage(), b'["usage",0,0,0,null,null,null]', id="usage-defaults"),
    pytest.param(
        Usage(5, 3, 8, cached_tokens=2, cache_write_tokens=0, reasoning_tokens=1, cost_usd=0.5),
        b'["usage",5,3,8,2,0,1,false,0.5]',
        id="usage-all-fields",
    ),
    # A field added later is stored only when set: a log of totals reads the same in a
    # replica that does not know it.
    pytest.param(
        Usage(41, 0, 41, cached_tokens=0, cache_write_tokens=0, partial=True),
        b'["usage",41,0,41,0,0,null,true]',
        id="usage-partial",
    ),
    pytest.param(
        Usage(17, 11, 28, 0, None, 0, prompt_audio_tokens=0, completion_audio_tokens=9),
        b'["usage",17,11,28,0,null,0,false,null,0,9]',
        id="usage-audio-tokens",
    ),
    pytest.param(
        Usage(
            9,
            12,
            21,
            accepted_prediction_tokens=4,
            rejected_prediction_tokens=2,
            prompt_text_tokens=9,
            prompt_image_tokens=0,
            completion_text_tokens=12,
        ),
        b'["usage",9,12,21,null,null,null,false,null,null,null,4,2,9,0,12]',
        id="usage-details",
    ),
    pytest.param(
        Error("upstream_error", "boom"),
        b'["error","upstream_error","boom",null,false,null]',
        id="error-defaults",
    ),
    pytest.param(
        Error("invalid_request_error", "bad", code="invalid", retryable=True, param="messages"),
        b'["error","invalid_request_error","bad","invalid",true,"messages"]',
        id="error-all-fields",
    ),
    pytest.param(Heartbeat(), b'["heartbeat"]', id="heartbeat"),
    pytest.param(Done(), b'["done",false]', id="done"),
    pytest.param(Done(aborted=True), b'["done",true]', id="done-aborted"),
]


def round_trip(event: StreamEvent) -> StreamEvent:
    return load_event(orjson.loads(orjson.dumps(dump_event(event))))


def assert_same(loaded: StreamEvent, event: StreamEvent) -> None:
    assert type(loaded) is type(event)
    assert loaded == event
    if type(event) is Delta:
        assert type(loaded) is Delta
        assert type(loaded.tool_calls) is type(event.tool_calls)
        for call in loaded.tool_calls or ():
            assert type(call) is ToolCall


@pytest.mark.parametrize(("event", "stored"), CASES)
def test_dump_event_bytes(event: StreamEvent, stored: bytes) -> None:
    assert orjson.dumps(dump_event(event)) == stored


@pytest.mark.parametrize(("event", "stored"), CASES)
def test_round_trip(event: StreamEvent, stored: bytes) -> None:
    assert_same(round_trip(event), event)
    assert_same(load_event(orjson.loads(stored)), event)


def test_dumps_events_round_trips_a_log() -> None:
    log = [case.values[0] for case in CASES]
    data = dumps_events(log)
    assert data == b"[" + b",".join(case.values[1] for case in CASES) + b"]"
    for source in (data, data.decode()):
        loaded = loads_events(source)
        assert len(loaded) == len(log)
        for got, event in zip(loaded, log, strict=True):
            assert_same(got, event)
    assert loads_events(dumps_events([])) == []


def test_dump_event_does_not_share_the_tool_calls() -> None:
    event = Delta(tool_calls=(FULL_CALL,))
    dumped = dump_event(event)
    dumped[4][0][0] = 99
    assert event.tool_calls == (FULL_CALL,)


# --- hypothesis -------------------------------------------------------------------------

_TEXT = st.text(max_size=20)
_OPT_TEXT = st.none() | _TEXT
_COUNT = st.integers(0, 2**53)
_OPT_COUNT = st.none() | _COUNT
_CALLS = st.builds(
    ToolCall, index=st.integers(0, 64), id=_OPT_TEXT, name=_OPT_TEXT, arguments=_TEXT
)
EVENTS = st.one_of(
    st.builds(
        Delta,
        content=_OPT_TEXT,
        role=st.none() | st.just("assistant"),
        refusal=_OPT_TEXT,
        tool_calls=st.none() | st.lists(_CALLS, max_size=3).map(tuple),
        finish_reason=st.none() | st.sampled_from(["stop", "length", "tool_calls"]),
    ),
    st.builds(Reasoning, _TEXT, signature=_OPT_TEXT, redacted=_OPT_TEXT),
    _CALLS,
    st.builds(Audio, data=_OPT_TEXT, format=_OPT_TEXT, transcript=_OPT_TEXT),
    st.builds(Image, data=_OPT_TEXT, url=_OPT_TEXT, mime_type=_OPT_TEXT),
    st.builds(Citation, url=_OPT_TEXT, title=_OPT_TEXT, quoted=_OPT_TEXT),
    st.builds(
        Usage,
        prompt_tokens=_COUNT,
        completion_tokens=_COUNT,
        total_tokens=_COUNT,
        cached_tokens=_OPT_COUNT,
        cache_write_tokens=_OPT_COUNT,
        reasoning_tokens=_OPT_COUNT,
        partial=st.booleans(),
    ),
    st.builds(
        Error,
        _TEXT,
        _TEXT,
        code=_OPT_TEXT,
        retryable=st.booleans(),
        param=_OPT_TEXT,
    ),
    st.just(Heartbeat()),
    st.builds(Done, aborted=st.booleans()),
)


@settings(max_examples=200, deadline=None, database=None)
@given(event=EVENTS)
def test_round_trip_any_event(event: StreamEvent) -> None:
    assert_same(round_trip(event), event)
    assert event_size(event) > 0


@settings(max_examples=50, deadline=None, database=None)
@given(log=st.lists(EVENTS, max_size=10))
def test_round_trip_any_log(log: list[StreamEvent]) -> None:
    loaded = loads_events(dumps_events(log))
    assert len(loaded) == len(log)
    for got, event in zip(loaded, log, strict=True):
        assert_same(got, event)


@settings(max_examples=50, deadline=None, database=None)
@given(log=st.lists(EVENTS, max_size=10))
def test_an_entry_is_its_events_stored_and_their_size_but_the_terminals(
    log: list[StreamEvent],
) -> None:
    # The mirror's one pass: the bytes dumps_events makes, and the size the run bounds its
    # log by (a Done or an Error, a log's last event, does not count toward it).
    payload, size = dump_entry(log)
    assert payload == dumps_events(log)
    assert size == sum(event_size(e) for e in log if not isinstance(e, (Done, Error)))


# --- bad input --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [
        pytest.param([], id="empty"),
        pytest.param((), id="empty-tuple"),
        pytest.param(None, id="none"),
        pytest.param("", id="empty-string"),
        pytest.param(["nope"], id="unknown-type"),
        pytest.param(["Delta", None, None, None, None, None], id="type-case"),
        pytest.param(["tool_calls", 0, None, None, ""], id="near-type"),
        pytest.param([1, 2], id="number-type"),
        pytest.param([None], id="null-type"),
        pytest.param([["delta"]], id="nested-type"),
        pytest.param(["delta"], id="no-fields"),
        pytest.param(["delta", "Hi"], id="too-few-fields"),
        pytest.param(["delta", "Hi", *[None] * 7], id="too-many-fields"),
        pytest.param(["done"], id="done-no-field"),
        pytest.param(["done", False, True], id="done-extra-field"),
        pytest.param(["heartbeat", 1], id="heartbeat-extra-field"),
        pytest.param(["error", "t"], id="error-short"),
        pytest.param(["usage", 1, 2, 3, None, None], id="usage-short"),
        pytest.param(
            ["usage", 1, 2, 3, None, None, None, True, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10],
            id="usage-long",
        ),
        pytest.param("delta", id="bare-string"),
    ],
)
def test_load_event_rejects_junk(data: Any) -> None:
    with pytest.raises(ValueError):
        load_event(data)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"not json", id="not-json"),
        pytest.param(b"[[]]", id="empty-event"),
        pytest.param(b'[["nope"]]', id="unknown-type"),
        pytest.param(b'[["delta","Hi"]]', id="short-event"),
        pytest.param(b'[["done",false],["done"]]', id="second-bad"),
    ],
)
def test_loads_events_rejects_junk(data: bytes) -> None:
    with pytest.raises(ValueError):
        loads_events(data)


@pytest.mark.parametrize(
    "data",
    [
        pytest.param(b'[["delta",null,null,null,5,null]]', id="tool-calls-not-a-list"),
        pytest.param(b'[["delta",null,null,null,[5],null]]', id="tool-call-not-a-list"),
        pytest.param(b'[["delta",null,null,null,[[0,1,2,3,4,5]],null]]', id="tool-call-long"),
        pytest.param(b'[{"type":"delta"}]', id="object-event"),
    ],
)
def test_loads_events_rejects_malformed_nesting(data: bytes) -> None:
    with pytest.raises(ValueError):
        loads_events(data)


# --- event_size -------------------------------------------------------------------------


@pytest.mark.parametrize(("event", "stored"), CASES)
def test_event_size_is_positive(event: StreamEvent, stored: bytes) -> None:
    assert event_size(event) > 0


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda text: Delta(content=text), id="delta-content"),
        pytest.param(lambda text: Delta(content=text, finish_reason="stop"), id="delta-finish"),
        pytest.param(lambda text: Delta(refusal=text), id="delta-refusal"),
        pytest.param(
            lambda text: Delta(tool_calls=(ToolCall(0, arguments=text),)), id="delta-tool-calls"
        ),
        pytest.param(lambda text: Reasoning(text), id="reasoning"),
        pytest.param(lambda text: Reasoning("", signature=text), id="reasoning-signature"),
        pytest.param(lambda text: ToolCall(0, arguments=text), id="tool-call"),
        pytest.param(lambda text: Audio(data=text), id="audio"),
        pytest.param(lambda text: Image(url=text), id="image"),
        pytest.param(lambda text: Citation(quoted=text), id="citation"),
        pytest.param(lambda text: Error("upstream_error", text), id="error"),
    ],
)
def test_event_size_grows_with_content(make: Any) -> None:
    sizes = [event_size(make("x" * n)) for n in (0, 1, 10, 100, 1000)]
    assert sizes[0] > 0
    assert sizes == sorted(set(sizes)), sizes
    # About one byte per character of content, within a constant.
    assert sizes[-1] - sizes[1] >= 999


def test_event_size_counts_more_for_more_tool_calls() -> None:
    one = event_size(Delta(tool_calls=(FULL_CALL,)))
    two = event_size(Delta(tool_calls=(FULL_CALL, FULL_CALL)))
    assert 0 < one < two


def test_a_usage_stored_without_the_partial_flag_loads_as_totals() -> None:
    assert load_event(["usage", 5, 3, 8, None, None, None]) == Usage(5, 3, 8)
    assert load_event(["usage", 5, 3, 8, None, None, None, False]) == Usage(5, 3, 8)


def test_an_audio_piece_stored_before_its_id_loads_without_one() -> None:
    assert load_event(["audio", "AAAA", None, "hi"]) == Audio(data="AAAA", transcript="hi")


def test_a_usage_stored_before_its_cost_still_loads() -> None:
    assert load_event(["usage", 5, 3, 8, 2, 0, 1]) == Usage(5, 3, 8, 2, 0, 1)


@given(st.text(max_size=30))
def test_a_token_is_stored_as_any_delta_is(text: str) -> None:
    # Tokens skip the field-by-field dump: the same list, and a delta that is not a token
    # (a stop sequence, a role) still goes field by field.
    from nexus.cache.codec import _dump_fields

    for event in (
        Delta(content=text),
        Delta(content=text, stop_sequence="x"),
        Delta(content=text, stop_reason="pause_turn"),
        Delta(content=text, role="assistant"),
    ):
        assert dump_event(event) == _dump_fields(event)
        assert load_event(orjson.loads(orjson.dumps(dump_event(event)))) == event
