"""SSE framing and the WHATWG decoder (docs/protocols.md §1), rule by rule."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexus.protocol.sse import (
    HOLD_BYTES,
    EventTooLarge,
    ServerSentEvent,
    SSEDecoder,
    comment,
    frame,
)

Ev = ServerSentEvent


def decode_all(*chunks: bytes) -> list[ServerSentEvent]:
    decoder = SSEDecoder()
    events = [event for chunk in chunks for event in decoder.decode(chunk)]
    return events + decoder.flush()


# --- frame() and comment() -----------------------------------------------------------------


@pytest.mark.parametrize(
    ("data", "kwargs", "expected"),
    [
        ("hello", {}, b"data: hello\n\n"),
        (b"bytes \xc3\xa9", {}, "data: bytes \u00e9\n\n".encode()),
        ("", {}, b"data: \n\n"),
        (" lead", {}, b"data:  lead\n\n"),
        ("a\nb", {}, b"data: a\ndata: b\n\n"),
        ("a\rb", {}, b"data: a\ndata: b\n\n"),
        ("a\r\nb", {}, b"data: a\ndata: b\n\n"),
        ("a\r\n\r\nb\n", {}, b"data: a\ndata: \ndata: b\ndata: \n\n"),
        ("x", {"event": "update"}, b"event: update\ndata: x\n\n"),
        ("x", {"id": "42"}, b"id: 42\ndata: x\n\n"),
        ("x", {"id": ""}, b"id: \ndata: x\n\n"),
        ("x", {"retry": 3000}, b"retry: 3000\ndata: x\n\n"),
        ("x", {"retry": 0}, b"retry: 0\ndata: x\n\n"),
        (
            "x\ny",
            {"event": "e", "id": "7", "retry": 10},
            b"event: e\nid: 7\nretry: 10\ndata: x\ndata: y\n\n",
        ),
    ],
)
def test_frame(data: str | bytes, kwargs: dict[str, object], expected: bytes) -> None:
    assert frame(data, **kwargs) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"event": "a\nb"}, "an SSE event must not contain CR or LF"),
        ({"event": "a\r"}, "an SSE event must not contain CR or LF"),
        ({"id": "a\rb"}, "an SSE id must not contain CR or LF"),
        ({"id": "a\nb"}, "an SSE id must not contain CR or LF"),
        ({"id": "a\0b"}, "an SSE id must not contain NUL"),
        ({"retry": -1}, "an SSE retry must be a non-negative integer"),
    ],
)
def test_frame_rejects_invalid_fields(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError) as info:
        frame("x", **kwargs)  # type: ignore[arg-type]
    assert str(info.value) == message


@pytest.mark.parametrize(
    "data", ["plain", "", "a\nb", "a\r\nb\rc", "\n", "\r\n\r\n", " spaced ", "\u00e9\U0001f600"]
)
def test_frame_decodes_back_with_line_breaks_as_lf(data: str) -> None:
    events = decode_all(frame(data, event="e", id="i"))
    normalized = data.replace("\r\n", "\n").replace("\r", "\n")
    assert events == [Ev(data=normalized, event="e", id="i")]


def test_comment() -> None:
    assert comment() == b":\n\n"
    assert comment("ping") == b": ping\n\n"
    with pytest.raises(ValueError, match="an SSE comment must not contain CR or LF"):
        comment("a\nb")
    assert decode_all(comment("ping") + comment() + frame("x")) == [Ev(data="x")]


# --- decoder, rule by rule (docs/protocols.md §1) -------------------------------------------------


@pytest.mark.parametrize(
    "stream",
    [
        b"data: a\ndata: b\n\ndata: c\n\n",
        b"data: a\rdata: b\r\rdata: c\r\r",
        b"data: a\r\ndata: b\r\n\r\ndata: c\r\n\r\n",
        b"data: a\ndata: b\r\n\rdata: c\r\n\n",
    ],
    ids=["lf", "cr", "crlf", "mixed"],
)
def test_line_endings(stream: bytes) -> None:
    assert decode_all(stream) == [Ev(data="a\nb"), Ev(data="c")]


@pytest.mark.parametrize(
    "chunks",
    [
        [b"data: a\r", b"\ndata: b\r\n\r\n"],
        [b"data: a\r", b"\n", b"data: b\r", b"\n\r", b"\n"],
        [b"data: a\r", b"", b"\ndata: b\r\n\r\n"],
    ],
)
def test_crlf_split_across_chunks_is_one_terminator(chunks: list[bytes]) -> None:
    # Had the LF after a chunk-final CR counted as a line of its own, it would dispatch "a".
    assert decode_all(*chunks) == [Ev(data="a\nb")]


def test_cr_at_chunk_end_followed_by_text_is_a_line_end() -> None:
    assert decode_all(b"data: a\r", b"\rdata: b\r", b"\r") == [Ev(data="a"), Ev(data="b")]


@pytest.mark.parametrize(
    "chunks",
    [
        [b"\xef\xbb\xbfdata: x\n\n"],
        [b"\xef", b"\xbb", b"\xbfdata: x\n\n"],
        [b"", b"\xef\xbb\xbf", b"data: x\n\n"],
    ],
)
def test_leading_bom_is_stripped(chunks: list[bytes]) -> None:
    assert decode_all(*chunks) == [Ev(data="x")]


def test_bom_is_stripped_only_once_and_only_at_start() -> None:
    # A second BOM makes the field name "\ufeffdata": an unknown field, so nothing fires.
    assert decode_all(b"\xef\xbb\xbf\xef\xbb\xbfdata: x\n\n") == []
    assert decode_all(b"data: a\n\n\xef\xbb\xbfdata: b\n\ndata: c\n\n") == [
        Ev(data="a"),
        Ev(data="c"),
    ]
    assert decode_all(b"data: \xef\xbb\xbfx\n\n") == [Ev(data="\ufeffx")]


def test_comments_are_ignored() -> None:
    assert decode_all(b": hello\n:\ndata: x\n: between\n\n") == [Ev(data="x")]
    assert decode_all(b": only a comment\n\n") == []


def test_field_without_colon_has_empty_value() -> None:
    assert decode_all(b"data\n\n") == [Ev(data="")]
    assert decode_all(b"data\ndata\n\n") == [Ev(data="\n")]
    assert decode_all(b"event\ndata: x\n\n") == [Ev(data="x", event="message")]


@pytest.mark.parametrize(
    ("line", "value"),
    [
        (b"data:x", "x"),
        (b"data: x", "x"),
        (b"data:  x", " x"),
        (b"data:\tx", "\tx"),
        (b"data: x ", "x "),
        (b"data: a:b: c", "a:b: c"),
        (b"data:", ""),
        (b"data: ", ""),
    ],
)
def test_one_leading_space_removed_and_split_at_first_colon(line: bytes, value: str) -> None:
    assert decode_all(line + b"\n\n") == [Ev(data=value)]


def test_data_lines_joined_with_lf_and_one_trailing_lf_removed() -> None:
    assert decode_all(b"data: a\ndata: b\ndata: c\n\n") == [Ev(data="a\nb\nc")]
    assert decode_all(b"data: a\ndata:\n\n") == [Ev(data="a\n")]


def test_event_field_sets_type_and_resets_after_dispatch() -> None:
    assert decode_all(b"event: a\nevent: b\ndata: x\n\ndata: y\n\n") == [
        Ev(data="x", event="b"),
        Ev(data="y", event="message"),
    ]
    assert decode_all(b"event:\ndata: x\n\n") == [Ev(data="x", event="message")]


def test_event_without_data_dispatches_nothing_and_is_forgotten() -> None:
    assert decode_all(b"event: ping\n\n") == []
    assert decode_all(b"event: ping\n\ndata: x\n\n") == [Ev(data="x", event="message")]
    assert decode_all(b"\n\n\n") == []


def test_id_persists_across_events_and_can_be_cleared() -> None:
    decoder = SSEDecoder()
    assert decoder.last_event_id == ""
    events = decoder.decode(b"id: 1\ndata: a\n\ndata: b\n\nid\ndata: c\n\nid: 9\n\n")
    assert events == [Ev(data="a", id="1"), Ev(data="b", id="1"), Ev(data="c", id="")]
    # An id on an event without data still sets the last event id (dispatch step a).
    assert decoder.last_event_id == "9"
    assert decoder.decode(b"data: d\n\n") == [Ev(data="d", id="9")]


def test_id_containing_nul_is_ignored() -> None:
    events = decode_all(b"id: 1\ndata: a\n\nid: 2\x003\ndata: b\n\n")
    assert events == [Ev(data="a", id="1"), Ev(data="b", id="1")]


@pytest.mark.parametrize(
    ("value", "retry"),
    [
        (b"3000", 3000),
        (b"0", 0),
        (b"007", 7),
        (b"", None),
        (b"-1", None),
        (b"+5", None),
        (b" 5", None),  # after the one stripped space: " 5"
        (b"5 ", None),
        (b"1.5", None),
        (b"1e3", None),
        ("\uff11".encode(), None),  # fullwidth digit one: isdigit() but not ASCII
        ("\u00b2".encode(), None),
    ],
)
def test_retry_only_ascii_digits(value: bytes, retry: int | None) -> None:
    assert decode_all(b"retry: " + value + b"\ndata: x\n\n") == [Ev(data="x", retry=retry)]


def test_retry_is_reported_once() -> None:
    assert decode_all(b"retry: 10\ndata: a\n\ndata: b\n\n") == [
        Ev(data="a", retry=10),
        Ev(data="b", retry=None),
    ]


def test_unknown_and_case_variant_fields_are_ignored() -> None:
    stream = b"foo: bar\nData: up\ndata : spaced\nDATA: x\nEvent: e\ndata: kept\n\n"
    assert decode_all(stream) == [Ev(data="kept")]


@pytest.mark.parametrize(
    "tail",
    [b"data: tail", b"data: tail\n", b"data: tail\r", b"data: tail\r\n", b"event: x\ndata: y\n"],
)
def test_unterminated_final_event_is_dropped_at_flush(tail: bytes) -> None:
    decoder = SSEDecoder()
    assert decoder.decode(b"data: a\n\n" + tail) == [Ev(data="a")]
    assert decoder.flush() == []


def test_invalid_utf8_becomes_replacement_characters() -> None:
    assert decode_all(b"data: a\xffb\xc3(\n\n") == [Ev(data="a\ufffdb\ufffd(")]
    # A truncated sequence at end of input does not raise at flush.
    assert decode_all(b"data: x\n\n\xe2\x82") == [Ev(data="x")]


@pytest.mark.parametrize("cut", [1, 2, 3])
def test_utf8_character_split_across_chunks(cut: int) -> None:
    stream = "data: \U0001f600\n\n".encode()
    at = len(b"data: ") + cut
    decoder = SSEDecoder()
    assert decoder.decode(stream[:at]) == []
    assert decoder.decode(stream[at:]) == [Ev(data="\U0001f600")]


def test_decode_returns_events_as_soon_as_their_blank_line_arrives() -> None:
    decoder = SSEDecoder()
    assert decoder.decode(b"data: a\n") == []
    assert decoder.decode(b"\ndata: b\n") == [Ev(data="a")]
    assert decoder.decode(b"\n") == [Ev(data="b")]


# --- chunking does not change the result ---------------------------------------------------

RECORDED = (
    "\ufeff: keepalive\r\n"
    "retry: 2500\n"
    "event: delta\r"
    "id: r1\r\n"
    'data: {"content":"h\u00e9llo \u20ac"}\r\n'
    "\r\n"
    "data: line one\r"
    "data: \U0001f600 two\n"
    "\r"
    "id\n"
    "event: bare\r\n"
    "\n"
    "data\r\n"
    "data:  \u00fcber\r\n"
    "\n"
    "data: [DONE]\r"
    "\r"
    "data: never dispatched"
).encode()

RECORDED_EVENTS = [
    Ev(data='{"content":"h\u00e9llo \u20ac"}', event="delta", id="r1", retry=2500),
    Ev(data="line one\n\U0001f600 two", id="r1"),
    Ev(data="\n \u00fcber", id=""),
    Ev(data="[DONE]", id=""),
]


def test_recorded_stream_whole() -> None:
    assert decode_all(RECORDED) == RECORDED_EVENTS


@pytest.mark.parametrize("at", range(len(RECORDED) + 1))
def test_recorded_stream_split_in_two_anywhere(at: int) -> None:
    assert decode_all(RECORDED[:at], RECORDED[at:]) == RECORDED_EVENTS


@settings(max_examples=300, database=None, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(RECORDED)), max_size=40))
def test_recorded_stream_chunked_anywhere(cuts: list[int]) -> None:
    bounds = [0, *sorted(cuts), len(RECORDED)]
    chunks = [RECORDED[a:b] for a, b in itertools.pairwise(bounds)]
    assert decode_all(*chunks) == RECORDED_EVENTS


_TEXT = st.text(alphabet=st.sampled_from("ab: \u00e9\u20ac\U0001f600\ufeff\x00"), max_size=6)
_LINE = st.tuples(st.sampled_from(["data", "event", "id", "retry", ":", "other", ""]), _TEXT)


@st.composite
def streams(draw: st.DrawFn) -> bytes:
    lines = draw(st.lists(_LINE, max_size=25))
    ends = draw(st.lists(st.sampled_from(["\n", "\r", "\r\n"]), min_size=len(lines)))
    text = "".join(
        (name + ": " + value if name else "") + end
        for (name, value), end in zip(lines, ends, strict=False)
    )
    return text.encode()


@settings(max_examples=300, database=None, deadline=None)
@given(data=st.data(), stream=streams())
def test_any_stream_chunked_anywhere_decodes_as_whole(data: st.DataObject, stream: bytes) -> None:
    # Cuts anywhere, with a bias towards the awkward places: after a CR, inside a UTF-8 sequence.
    awkward = [i for i in range(1, len(stream)) if stream[i - 1] == 13 or stream[i] >= 0x80]
    anywhere = st.integers(min_value=0, max_value=len(stream))
    cut = st.one_of(anywhere, st.sampled_from(awkward)) if awkward else anywhere
    cuts = data.draw(st.lists(cut, max_size=20))
    bounds = [0, *sorted(cuts), len(stream)]
    whole = SSEDecoder()
    expected = whole.decode(stream) + whole.flush()
    chunked = SSEDecoder()
    events = [e for a, b in itertools.pairwise(bounds) for e in chunked.decode(stream[a:b])]
    assert events + chunked.flush() == expected
    assert chunked.last_event_id == whole.last_event_id


class _GeneralOnly(SSEDecoder):
    """The decoder without its fast path for whole ``data:`` events: the reference."""

    def _plain(self) -> bool:
        return False


_DATA_HEAVY = st.lists(
    st.one_of(
        st.tuples(st.just("data"), _TEXT),
        st.tuples(st.sampled_from(["data", "event", "id", "retry", ":", ""]), _TEXT),
    ),
    max_size=30,
)


@st.composite
def data_heavy_streams(draw: st.DrawFn) -> bytes:
    """Mostly ``data: x`` lines and blank lines, LF-ended, as servers send: the fast path's
    ground, with the odd field, comment, CR and missing space to knock it off."""
    lines = draw(_DATA_HEAVY)
    out = []
    for name, value in lines:
        out.append((name + draw(st.sampled_from([": ", ":"])) + value) if name else "")
        out.append(draw(st.sampled_from(["\n", "\n", "\n", "\n\n", "\r\n"])))
    return "".join(out).encode()


@settings(max_examples=400, database=None, deadline=None)
@given(data=st.data(), stream=data_heavy_streams())
def test_fast_path_decodes_as_the_general_rules(data: st.DataObject, stream: bytes) -> None:
    # A leading BOM, or a byte that is not UTF-8, must read the same either way.
    stream = data.draw(st.sampled_from([b"", b"\xef\xbb\xbf", b"\xef\xbb"])) + stream
    if stream and data.draw(st.booleans()):
        at = data.draw(st.integers(min_value=0, max_value=len(stream)))
        stream = stream[:at] + b"\xff" + stream[at:]
    cuts = data.draw(st.lists(st.integers(min_value=0, max_value=len(stream)), max_size=8))
    bounds = [0, *sorted(cuts), len(stream)]
    chunks = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    fast, reference, payloads = SSEDecoder(), _GeneralOnly(), SSEDecoder()
    expected = [e for chunk in chunks for e in reference.decode(chunk)]
    assert [e for chunk in chunks for e in fast.decode(chunk)] == expected
    data = [d for chunk in chunks for d in payloads.decode_data(chunk)]
    assert [d.decode("utf-8", "replace") for d in data] == [e.data for e in expected]
    assert fast.last_event_id == reference.last_event_id


def test_decode_data_gives_payloads_of_whole_and_split_events() -> None:
    decoder = SSEDecoder()
    assert decoder.decode_data(b'data: {"a":1}\n\ndata: {"b"') == [b'{"a":1}']
    assert decoder.decode_data(b":2}\n\ndata: [DONE]\n\n") == [b'{"b":2}', b"[DONE]"]
    assert decoder.decode_data(b"event: x\ndata: y\n\n: ping\n\n") == [b"y"]
    assert decoder.decode_data("data: é\n\n".encode()) == ["é".encode()]


def test_whole_events_keep_the_id_in_force_before_a_partial_event_after_them() -> None:
    decoder = SSEDecoder()
    decoder.decode(b": start\n\n")
    assert decoder.decode(b"data: a\n\nid: 7\n") == [Ev(data="a")]  # id 7 is the next event's
    assert decoder.decode(b"data: b\n\n") == [Ev(data="b", id="7")]
    assert decoder.decode(b"data: c\n\n") == [Ev(data="c", id="7")]


_NAMED = st.lists(
    st.tuples(
        st.sampled_from(["event: ", "event:", "event:  ", "data: ", "id: ", ": "]),
        _TEXT,
        st.sampled_from(["data: ", "data:", "event: "]),
        _TEXT,
        st.sampled_from(["\n\n", "\n\n", "\n\n", "\n", "\r\n\r\n", "\n\n\n"]),
    ),
    max_size=12,
)


@settings(max_examples=400, database=None, deadline=None)
@given(data=st.data(), events=_NAMED)
def test_named_events_read_whole_decode_as_the_general_rules(
    data: st.DataObject, events: list[tuple[str, str, str, str, str]]
) -> None:
    # Anthropic's reads: one "event: NAME" line and one "data: DATA" line each, cut
    # whole (the fast path), among reads that are not quite that.
    chunks = [f"{a}{name}\n{b}{value}{end}".encode() for a, name, b, value, end in events]
    if chunks and data.draw(st.booleans()):
        at = data.draw(st.integers(min_value=0, max_value=len(chunks) - 1))
        chunks[at] = chunks[at].replace(b"e", b"\xff", 1)
    fast, reference = SSEDecoder(), _GeneralOnly()
    expected = [e for chunk in chunks for e in reference.decode(chunk)]
    assert [e for chunk in chunks for e in fast.decode(chunk)] == expected
    assert fast.last_event_id == reference.last_event_id


@settings(max_examples=400, database=None, deadline=None)
@given(data=st.data(), events=_NAMED)
def test_named_events_many_to_a_read_cut_anywhere_decode_as_the_general_rules(
    data: st.DataObject, events: list[tuple[str, str, str, str, str]]
) -> None:
    # Anthropic at full speed: several "event:"/"data:" pairs to a read, the last one cut
    # by the read and held as bytes until the next.
    stream = b"".join(f"{a}{name}\n{b}{value}{end}".encode() for a, name, b, value, end in events)
    cuts = data.draw(st.lists(st.integers(min_value=0, max_value=len(stream)), max_size=8))
    bounds = [0, *sorted(cuts), len(stream)]
    chunks = [stream[a:b] for a, b in itertools.pairwise(bounds)]
    fast, reference = SSEDecoder(), _GeneralOnly()
    expected = [e for chunk in chunks for e in reference.decode(chunk)]
    assert [e for chunk in chunks for e in fast.decode(chunk)] == expected
    assert fast.last_event_id == reference.last_event_id
    assert fast.flush() == reference.flush() == []


def test_the_start_of_an_event_held_between_reads() -> None:
    decoder = SSEDecoder()
    decoder.decode(b": start\n\n")
    # Whole events, then the start of the next: held, and completed by the next read.
    assert decoder.decode_data(b'data: a\n\ndata: b\n\ndata: {"c') == [b"a", b"b"]
    assert decoder.decode_data(b'":1}\n\ndata: d') == [b'{"c":1}']
    assert decoder.decode_data(b"\n\n") == [b"d"]
    # An id line among the held bytes is in force as soon as it was read.
    assert decoder.decode(b"data: e\n\nid: 7\ndata: f") == [Ev(data="e")]
    assert decoder.last_event_id == "7"
    assert decoder.decode(b"\n\n") == [Ev(data="f", id="7")]
    # At the end of input, a held event without its blank line is dropped.
    assert decoder.decode(b"data: g") == []
    assert decoder.flush() == []
    assert decoder.decode(b"data: h\n\n") == [Ev(data="h", id="7")]


def test_a_held_event_is_bounded() -> None:
    decoder = SSEDecoder(max_event_bytes=HOLD_BYTES * 2)
    decoder.decode(b": start\n\n")
    assert decoder.decode(b"data: " + b"x" * (HOLD_BYTES - 10)) == []
    with pytest.raises(EventTooLarge):
        for _ in range(4):
            decoder.decode(b"x" * (HOLD_BYTES // 2))


@pytest.mark.parametrize("bom", [b"", b"\xef\xbb\xbf"])
def test_a_big_first_read_is_cut_on_bytes(bom: bytes, monkeypatch: pytest.MonkeyPatch) -> None:
    # A fast upstream's first read holds hundreds of events: it must not go to the line
    # rules (the text decoder and a loop per line) for want of the BOM check.
    decoder = SSEDecoder()
    ruled: list[bytes] = []
    general = decoder._general
    monkeypatch.setattr(decoder, "_general", lambda chunk: ruled.append(chunk) or general(chunk))
    body = bom + b"".join(b'data: {"n":%d}\n\n' % i for i in range(300)) + b"data: {"
    assert decoder.decode_data(body) == [b'{"n":%d}' % i for i in range(300)]
    assert ruled == []
    # A BOM later is text (a field named "\ufeffdata", ignored), read by the rules.
    assert decoder.decode_data(b"}\n\n\xef\xbb\xbfdata: x\n\n") == [b"{}"]
    assert ruled == [b"data: {}\n\n\xef\xbb\xbfdata: x\n\n"]
