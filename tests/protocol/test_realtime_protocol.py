"""The realtime session state machine, sans I/O: frames in, actions out (no sockets)."""

from __future__ import annotations

import base64
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexus.protocol.json_depth import deep_field
from nexus.protocol.realtime import (
    PENDING_ITEM_BYTES as ITEM,
)
from nexus.protocol.realtime import (
    AbortTurn,
    PendingLedger,
    RealtimeSession,
    Send,
    StartTurn,
    error_frame,
)
from nexus.request import (
    AssistantMessage,
    AudioPart,
    ChatRequest,
    ImagePart,
    SystemMessage,
    TextPart,
    UserMessage,
)

USER = [{"role": "user", "content": "hi"}]
PNG = base64.b64encode(b"\x89PNG").decode()  # 4 decoded bytes


def frame(envelope: dict[str, Any]) -> str:
    return orjson.dumps(envelope).decode()


def start(request: dict[str, Any] | None = None) -> str:
    return frame({"type": "start", "request": request or {"model": "m", "messages": USER}})


def audio(data: bytes, fmt: str = "pcm16", **extra: Any) -> str:
    return frame(
        {"type": "audio_chunk", "format": fmt, "b64": base64.b64encode(data).decode(), **extra}
    )


def image(**fields: Any) -> str:
    return frame({"type": "image", "mime_type": "image/png", **fields})


def error_of(actions: list[Any]) -> dict[str, Any]:
    """The ``error`` object of the one error frame in ``actions``."""
    assert len(actions) == 1
    assert isinstance(actions[0], Send)
    body = orjson.loads(actions[0].frame)
    assert body["type"] == "error"
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["retryable"] is False
    return body["error"]


def started(actions: list[Any]) -> ChatRequest:
    assert len(actions) == 1
    assert isinstance(actions[0], StartTurn)
    return actions[0].request


def attached(session: RealtimeSession, request: dict[str, Any] | None = None) -> list[Any]:
    """Start a turn the engine accepts; the content of its last user message."""
    req = started(session.receive_text(start(request)))
    session.start_accepted()
    users = [m for m in req.messages if isinstance(m, UserMessage)]
    return list(users[-1].content)


def audio_bytes(part: Any) -> bytes:
    assert isinstance(part, AudioPart)
    return base64.b64decode(part.input_audio.data)


@pytest.fixture
def session() -> RealtimeSession:
    return RealtimeSession(max_pending_input_bytes=1 << 20)


# --- turns -----------------------------------------------------------------


def test_start_gives_a_streaming_request(session: RealtimeSession) -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    req = started(session.receive_text(start({"model": "mock-1", "messages": messages})))
    assert req.stream is True
    assert req.model == "mock-1"
    assert req.messages == [
        SystemMessage(role="system", content="be brief"),
        UserMessage(role="user", content="hi"),
    ]
    assert session.streaming is True


def test_start_while_streaming_is_refused(session: RealtimeSession) -> None:
    session.receive_text(start())
    error = error_of(session.receive_text(start()))
    assert error["code"] == "stream_in_progress"
    assert "already running" in error["message"]
    assert "param" not in error
    assert session.streaming is True


def test_several_turns_in_sequence(session: RealtimeSession) -> None:
    for n in range(3):
        req = started(session.receive_text(start({"model": f"m{n}", "messages": USER})))
        assert req.model == f"m{n}"
        assert session.streaming is True
        session.turn_ended()
        assert session.streaming is False
        assert error_of(session.receive_text('{"type":"abort"}'))["code"] == "nothing_to_abort"


def test_abort_while_streaming(session: RealtimeSession) -> None:
    session.receive_text(start())
    assert session.receive_text('{"type":"abort"}') == [AbortTurn()]


def test_abort_while_idle(session: RealtimeSession) -> None:
    error = error_of(session.receive_text('{"type":"abort"}'))
    assert error["code"] == "nothing_to_abort"
    assert "no stream is running" in error["message"]
    assert session.streaming is False


# --- invalid requests ------------------------------------------------------


@pytest.mark.parametrize(
    ("request_body", "param"),
    [
        pytest.param({"model": "m", "messages": USER, "temperature": 5}, "temperature", id="temp"),
        pytest.param({"model": "m"}, "messages", id="no-messages"),
        pytest.param(
            {"model": "m", "messages": [{"role": "robot", "content": "x"}]},
            "messages[0].role",
            id="bad-role",
        ),
        pytest.param({"model": "m", "messages": USER, "stream": "yes"}, "stream", id="stream-yes"),
    ],
)
def test_invalid_request_names_the_field(
    session: RealtimeSession, request_body: dict[str, Any], param: str
) -> None:
    error = error_of(session.receive_text(start(request_body)))
    assert error["code"] == "invalid_request"
    assert error["param"] == f"request.{param}"
    assert param in error["message"]
    assert session.streaming is False


def test_invalid_request_keeps_pending_input(session: RealtimeSession) -> None:
    session.receive_text(audio(b"abcd"))
    session.receive_text(start({"model": "m"}))
    assert session.pending_bytes == 4 + ITEM
    assert [audio_bytes(p) for p in attached(session)[1:]] == [b"abcd"]


# --- invalid envelopes -----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "words"),
    [
        pytest.param("not json", "not valid JSON", id="non-json"),
        pytest.param("[1, 2]", "must be a JSON object", id="array"),
        pytest.param('"start"', "must be a JSON object", id="string"),
        pytest.param('{"request": {}}', "needs a 'type'", id="no-type"),
        pytest.param('{"type": "stop"}', "unknown envelope type 'stop'", id="unknown-type"),
        pytest.param('{"type":"audio_chunk","format":"pcm16"}', "b64", id="audio-no-b64"),
        pytest.param('{"type":"audio_chunk","b64":"AAAA"}', "format", id="audio-no-format"),
        pytest.param(audio(b"x", fmt="ogg"), "format", id="audio-ogg"),
        pytest.param(audio(b"abc"), "an even number of bytes", id="pcm16-half-sample"),
        pytest.param(
            '{"type":"audio_chunk","format":"pcm16","b64":"!!"}', "not valid base64", id="audio-b64"
        ),
        pytest.param(image(b64="not base64!"), "not valid base64", id="image-b64"),
        pytest.param(
            image(b64=PNG, url="https://x/a.png"), "exactly one of b64 and url", id="both"
        ),
        pytest.param(image(), "exactly one of b64 and url", id="neither"),
        pytest.param(
            frame({"type": "image", "mime_type": "text/plain", "b64": PNG}), "mime_type", id="mime"
        ),
        pytest.param(image(url="ftp://x/a.png"), "url", id="ftp-url"),
        pytest.param('{"type":"abort","now":true}', "now: Unknown field", id="extra-field"),
    ],
)
def test_invalid_envelope_says_what_is_wrong(
    session: RealtimeSession, text: str, words: str
) -> None:
    error = error_of(session.receive_text(text))
    assert error["code"] == "invalid_envelope"
    assert words in error["message"]
    assert session.streaming is False
    assert session.pending_bytes == 0
    assert started(session.receive_text(start())).messages == [
        UserMessage(role="user", content="hi")
    ]


def test_invalid_envelope_while_streaming_leaves_the_turn(session: RealtimeSession) -> None:
    session.receive_text(start())
    assert error_of(session.receive_text("{"))["code"] == "invalid_envelope"
    assert session.streaming is True
    assert session.receive_text('{"type":"abort"}') == [AbortTurn()]


def test_binary_frame_is_refused(session: RealtimeSession) -> None:
    error = error_of(session.receive_binary(b"\x00\x01\x02"))
    assert error["code"] == "invalid_envelope"
    assert "binary frames are not accepted (3 bytes" in error["message"]
    assert session.streaming is False
    assert session.pending_bytes == 0


# --- pending input ---------------------------------------------------------


def test_image_b64_becomes_a_data_url_after_string_content(session: RealtimeSession) -> None:
    assert session.receive_text(image(b64=PNG)) == []
    assert attached(session) == [
        TextPart(type="text", text="hi"),
        ImagePart.model_validate(
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG}"}}
        ),
    ]


def test_image_by_url(session: RealtimeSession) -> None:
    assert session.receive_text(image(url="https://example.com/cat.png")) == []
    parts = attached(session)
    assert isinstance(parts[1], ImagePart)
    assert parts[1].image_url.url == "https://example.com/cat.png"
    assert len(parts) == 2


def test_list_content_keeps_its_parts_first(session: RealtimeSession) -> None:
    session.receive_text(image(url="https://x/1.png"))
    content = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]
    parts = attached(session, {"model": "m", "messages": [{"role": "user", "content": content}]})
    assert parts[:2] == [TextPart(type="text", text="a"), TextPart(type="text", text="b")]
    assert [p.image_url.url for p in parts[2:]] == ["https://x/1.png"]


def test_parts_go_to_the_last_user_message_in_arrival_order(session: RealtimeSession) -> None:
    session.receive_text(audio(b"A", fmt="mp3"))
    session.receive_text(image(url="https://x/1.png"))
    session.receive_text(audio(b"B", fmt="wav"))
    messages = [
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "second"},
        {"role": "assistant", "content": "prefill"},
    ]
    req = started(session.receive_text(start({"model": "m", "messages": messages})))
    assert req.messages[0] == UserMessage(role="user", content="first")
    assert req.messages[1] == AssistantMessage(role="assistant", content="ok")
    assert req.messages[3] == AssistantMessage(role="assistant", content="prefill")
    last_user = req.messages[2]
    assert isinstance(last_user, UserMessage)
    text, mp3, img, wav = last_user.content
    assert text == TextPart(type="text", text="second")
    assert (mp3.input_audio.format, audio_bytes(mp3)) == ("mp3", b"A")
    assert img.image_url.url == "https://x/1.png"
    assert (wav.input_audio.format, audio_bytes(wav)) == ("wav", b"B")


def test_pcm16_chunks_of_one_rate_are_joined(session: RealtimeSession) -> None:
    for chunk in (b"\x01\x02", b"\x03\x04", b"\x05\x06"):
        assert session.receive_text(audio(chunk, sample_rate=16000)) == []
    parts = attached(session)
    assert len(parts) == 2
    assert audio_bytes(parts[1]) == b"\x01\x02\x03\x04\x05\x06"
    assert parts[1].input_audio.format == "pcm16"
    assert parts[1].input_audio.sample_rate == 16000


def test_sample_rate_defaults_to_24000(session: RealtimeSession) -> None:
    session.receive_text(audio(b"ab"))
    session.receive_text(audio(b"cd", sample_rate=24000))
    parts = attached(session)
    assert len(parts) == 2
    assert audio_bytes(parts[1]) == b"abcd"
    assert parts[1].input_audio.sample_rate == 24000


@pytest.mark.parametrize(
    ("second", "fmt"),
    [
        pytest.param(audio(b"cd", sample_rate=16000), "pcm16", id="other-rate"),
        pytest.param(audio(b"cd", fmt="wav"), "wav", id="wav"),
        pytest.param(audio(b"cd", fmt="mp3"), "mp3", id="mp3"),
    ],
)
def test_a_new_audio_part_starts(session: RealtimeSession, second: str, fmt: str) -> None:
    session.receive_text(audio(b"ab"))
    session.receive_text(second)
    _, first, other = attached(session)
    assert audio_bytes(first) == b"ab"
    assert first.input_audio.sample_rate == 24000
    assert audio_bytes(other) == b"cd"
    assert other.input_audio.format == fmt


def test_compressed_chunks_are_never_joined(session: RealtimeSession) -> None:
    session.receive_text(audio(b"a", fmt="wav"))
    session.receive_text(audio(b"b", fmt="wav"))
    session.receive_text(audio(b"cc"))
    _, one, two, three = attached(session)
    assert [audio_bytes(p) for p in (one, two, three)] == [b"a", b"b", b"cc"]
    assert [p.input_audio.format for p in (one, two, three)] == ["wav", "wav", "pcm16"]


def test_pcm16_chunks_split_by_an_image_are_not_joined(session: RealtimeSession) -> None:
    session.receive_text(audio(b"aa"))
    session.receive_text(image(b64=PNG))
    session.receive_text(audio(b"bb"))
    _, one, img, two = attached(session)
    assert (audio_bytes(one), audio_bytes(two)) == (b"aa", b"bb")
    assert isinstance(img, ImagePart)


def test_no_user_message_gets_a_new_one(session: RealtimeSession) -> None:
    session.receive_text(image(url="https://x/1.png"))
    system = {"role": "system", "content": "sys"}
    req = started(session.receive_text(start({"model": "m", "messages": [system]})))
    assert len(req.messages) == 2
    assert req.messages[0] == SystemMessage(role="system", content="sys")
    new = req.messages[1]
    assert isinstance(new, UserMessage)
    assert [p.image_url.url for p in new.content] == ["https://x/1.png"]


def test_pending_input_is_cleared_by_start(session: RealtimeSession) -> None:
    session.receive_text(audio(b"abcd"))
    assert session.pending_bytes == 4 + ITEM
    assert len(attached(session)) == 2
    assert session.pending_bytes == 0
    session.turn_ended()
    req = started(session.receive_text(start()))
    assert req.messages == [UserMessage(role="user", content="hi")]


def test_input_sent_while_streaming_waits_for_the_next_start(session: RealtimeSession) -> None:
    session.receive_text(start())
    assert session.receive_text(audio(b"wxyz")) == []
    assert session.receive_text(image(url="https://x/1.png")) == []
    error_of(session.receive_text(start()))  # refused: stream_in_progress
    assert session.pending_bytes == 4 + len("https://x/1.png") + 2 * ITEM
    session.turn_ended()
    _, sound, img = attached(session)
    assert audio_bytes(sound) == b"wxyz"
    assert img.image_url.url == "https://x/1.png"


# --- limits ----------------------------------------------------------------


PNG_URL = f"data:image/png;base64,{PNG}"


def test_pending_input_up_to_the_limit_is_accepted() -> None:
    # Audio counts as decoded, an image as the URL it is held as, each item ITEM more.
    limit = 6 + len(PNG_URL) + 2 * ITEM
    session = RealtimeSession(max_pending_input_bytes=limit)
    assert session.receive_text(audio(b"123456")) == []
    assert session.pending_bytes == 6 + ITEM
    assert session.receive_text(image(b64=PNG)) == []
    assert session.pending_bytes == limit
    _, sound, img = attached(session)
    assert audio_bytes(sound) == b"123456"
    assert img.image_url.url == f"data:image/png;base64,{PNG}"
    assert session.pending_bytes == 0


@pytest.mark.parametrize(
    "over",
    [pytest.param(audio(b"1234"), id="audio"), pytest.param(image(b64=PNG), id="image")],
)
def test_the_chunk_over_the_limit_is_dropped(over: str) -> None:
    session = RealtimeSession(max_pending_input_bytes=10 + ITEM)
    session.receive_text(audio(b"12345678"))
    error = error_of(session.receive_text(over))
    assert error["code"] == "input_too_large"
    assert f"over the limit of {10 + ITEM}" in error["message"]
    assert session.pending_bytes == 8 + ITEM
    assert session.receive_text(audio(b"90")) == []  # joined to the audio: no new item
    assert session.pending_bytes == 10 + ITEM
    parts = attached(session)
    assert len(parts) == 2
    assert audio_bytes(parts[1]) == b"1234567890"


def test_the_limit_applies_again_after_start() -> None:
    session = RealtimeSession(max_pending_input_bytes=10 + ITEM)
    session.receive_text(audio(b"0123456789"))
    session.receive_text(start())
    session.start_accepted()
    session.turn_ended()
    assert session.receive_text(audio(b"0123456789")) == []
    assert session.pending_bytes == 10 + ITEM


def test_every_item_counts_however_small_and_however_long_its_url() -> None:
    # Empty images cost nothing by their data, and a long https URL has none: each counts
    # what it is held as, plus ITEM, so neither piles up past the limit.
    session = RealtimeSession(max_pending_input_bytes=100 * ITEM)
    empty = frame({"type": "image", "mime_type": "image/png", "b64": ""})
    refusals = [a for _ in range(150) for a in session.receive_text(empty)]
    each = len("data:image/png;base64,") + ITEM
    assert len(refusals) == 150 - 100 * ITEM // each
    assert session.pending_bytes == 100 * ITEM // each * each
    assert {orjson.loads(a.frame)["error"]["code"] for a in refusals} == {"input_too_large"}
    session = RealtimeSession(max_pending_input_bytes=1 << 20)
    long_url = image(url="https://x/" + "a" * (1 << 20))
    assert error_of(session.receive_text(long_url))["code"] == "input_too_large"
    assert session.pending_bytes == 0


def test_pending_items_are_at_most_a_quarter_of_max_json_items() -> None:
    session = RealtimeSession(max_pending_input_bytes=1 << 30, max_json_items=40)
    url = image(url="https://x/1.png")
    sent = [a for _ in range(12) for a in session.receive_text(url)]
    assert len(sent) == 2  # 10 held
    assert "items" in error_of(sent[:1])["message"]
    assert len(attached(session)) == 11  # the text, then the 10 images


# --- the error frame -------------------------------------------------------


def test_error_frame_shape() -> None:
    error = {
        "type": "invalid_request_error",
        "message": "too hot",
        "code": "invalid_request",
        "retryable": False,
    }
    plain = error_frame("invalid_request", "too hot")
    assert orjson.loads(plain.frame) == {"type": "error", "error": error, "refused": "frame"}
    named = error_frame("invalid_request", "too hot", param="request.temperature", refused="start")
    assert orjson.loads(named.frame) == {
        "type": "error",
        "error": {**error, "param": "request.temperature"},
        "refused": "start",
    }


def test_session_error_frame_is_exact(session: RealtimeSession) -> None:
    (sent,) = session.receive_text(start({"model": "m", "messages": USER, "temperature": 5}))
    assert isinstance(sent, Send)
    assert orjson.loads(sent.frame) == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "temperature: Input should be less than or equal to 2",
            "code": "invalid_request",
            "retryable": False,
            "param": "request.temperature",
        },
        "refused": "start",
    }


def test_every_session_error_frame_carries_the_request_id() -> None:
    session = RealtimeSession(max_pending_input_bytes=10, request_id="req-ws-1")
    frames = [
        *session.receive_text("not json"),
        *session.receive_text('{"type":"abort"}'),
        *session.receive_text('{"type":"nope"}'),
        *session.receive_text('{"kind":"start"}'),
        *session.receive_text('{"type":"image","mime_type":"image/png"}'),
        *session.receive_binary(b"x"),
    ]
    assert [orjson.loads(f.frame)["error"]["request_id"] for f in frames] == ["req-ws-1"] * 6
    # Each names the envelope type of the frame it refused ("frame": none it could read).
    refused = [orjson.loads(f.frame)["refused"] for f in frames]
    assert refused == ["frame", "abort", "frame", "frame", "image", "frame"]
    busy = error_frame("stream_in_progress", "busy", request_id="req-ws-1", refused="start")
    assert busy.frame == (
        '{"type":"error","error":{"type":"invalid_request_error","message":"busy",'
        '"code":"stream_in_progress","retryable":false,"request_id":"req-ws-1"},'
        '"refused":"start"}'
    )


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"background": True}, "request.background"),
        ({"stream_options": {"resumable": True}}, "request.stream_options.resumable"),
    ],
)
def test_http_ways_to_read_later_are_refused_on_a_start(extra: dict[str, Any], param: str) -> None:
    """Accepted, they did nothing: a turn is read on its socket or not at all."""
    session = RealtimeSession(max_pending_input_bytes=1000)
    (sent,) = session.receive_text(start({"model": "m", "messages": USER, **extra}))
    error = orjson.loads(sent.frame)["error"]  # type: ignore[union-attr]
    assert (error["code"], error["param"]) == ("invalid_request", param)
    assert not session.streaming


def test_a_refusal_during_a_turn_names_what_it_refused_and_a_turns_end_does_not() -> None:
    """An image refused while a turn runs (bad base64), or a second start, is answered with
    an error frame between the turn's events; the turn goes on. A client reading until
    `done` or `error` took it for the turn's end: `refused` names the frame it answers
    (a turn's own end has none)."""
    session = RealtimeSession(max_pending_input_bytes=1000)
    assert isinstance(session.receive_text(start({"model": "m", "messages": USER}))[0], StartTurn)
    session.start_accepted()
    bad_image = '{"type":"image","mime_type":"image/png","b64":"not base64!"}'
    for frame, kind in ((bad_image, "image"), (start({"model": "m", "messages": USER}), "start")):
        (sent,) = session.receive_text(frame)
        assert orjson.loads(sent.frame)["refused"] == kind  # type: ignore[union-attr]
    from nexus.errors import ServerShuttingDown
    from nexus.protocol.realtime_envelopes import gateway_error_frame

    turn_end = orjson.loads(gateway_error_frame(ServerShuttingDown("bye")).frame)
    assert "refused" not in turn_end


def test_stream_false_is_refused_and_stream_true_accepted() -> None:
    session = RealtimeSession(max_pending_input_bytes=1000)
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    [refused] = session.receive_text(
        orjson.dumps({"type": "start", "request": {**body, "stream": False}}).decode()
    )
    assert isinstance(refused, Send)
    error = orjson.loads(refused.frame)["error"]
    assert (error["code"], error["param"]) == ("invalid_request", "request.stream")
    assert not session.streaming
    [started] = session.receive_text(
        orjson.dumps({"type": "start", "request": {**body, "stream": True}}).decode()
    )
    assert isinstance(started, StartTurn)
    assert started.request.stream is True


def test_data_url_images_count_against_the_pending_limit() -> None:
    small = base64.b64encode(b"12345678").decode()
    envelope = {"type": "image", "mime_type": "image/png", "url": f"data:image/png;base64,{small}"}
    held = len(envelope["url"]) + ITEM
    session = RealtimeSession(max_pending_input_bytes=held)
    assert session.receive_text(orjson.dumps(envelope).decode()) == []
    assert session.pending_bytes == held
    [refused] = session.receive_text(orjson.dumps(envelope).decode())
    assert isinstance(refused, Send)
    assert orjson.loads(refused.frame)["error"]["code"] == "input_too_large"
    assert session.pending_bytes == held
    bad = {**envelope, "url": "data:image/png;base64,%%%"}
    [invalid] = session.receive_text(orjson.dumps(bad).decode())
    assert isinstance(invalid, Send)
    assert orjson.loads(invalid.frame)["error"]["code"] == "invalid_envelope"


def test_a_refused_start_keeps_pending_input(session: RealtimeSession) -> None:
    session.receive_text(image(b64=base64.b64encode(b"png!").decode()))
    first = started(session.receive_text(start()))
    assert session.streaming
    session.start_refused()  # e.g. the model does not exist
    assert not session.streaming
    assert session.pending_bytes == len("data:image/png;base64,cG5nIQ==") + ITEM
    retry = attached(session)
    assert isinstance(retry[-1], ImagePart)
    assert retry == list(first.messages[-1].content)  # type: ignore[arg-type]
    assert session.pending_bytes == 0


def _nested(depth: int) -> Any:
    value: Any = "x"
    for level in range(depth):
        value = [value] if level % 2 else {"k": value}
    return value


@settings(max_examples=200, deadline=None, database=None)
@given(
    kind=st.sampled_from(["start", "abort", "image"]),
    request_depth=st.integers(0, 6),
    other_depth=st.integers(0, 7),
    other_first=st.booleans(),
    limit=st.integers(1, 5),
)
def test_the_depth_check_walks_once_and_answers_as_the_two_walks(
    kind: str, request_depth: int, other_depth: int, other_first: bool, limit: int
) -> None:
    """One walk of the whole frame decides a frame within the limits; a frame past them
    gets what checking a start's request first, then the envelope, gives."""
    request = {"model": "m", "messages": USER, "metadata": _nested(request_depth)}
    other = ("extra", _nested(other_depth))
    items = [other, ("type", kind), ("request", request)]
    data = dict(items if other_first else items[1:] + items[:1])
    session = RealtimeSession(max_pending_input_bytes=100, max_json_depth=limit)

    expected: tuple[str, str] | None = None
    inner = deep_field(request, limit)
    if kind == "start" and inner is not None:
        expected = ("invalid_request", f"request.{inner}")
    elif (field := deep_field(data, limit + 1)) is not None:
        expected = ("invalid_envelope", field)
    refused = session._too_deep(data)
    if expected is None:
        assert refused is None
    else:
        assert refused is not None
        error = orjson.loads(refused.frame)["error"]
        assert (error["code"], error["param"]) == expected


def test_a_start_without_stream_is_the_request_with_stream_true() -> None:
    body = {"model": "m", "messages": USER, "temperature": 0.5, "stream_options": {}}
    session = RealtimeSession(max_pending_input_bytes=100)
    request = started(session.receive_text(start(body)))
    expected = ChatRequest.model_validate(body).model_copy(update={"stream": True})
    assert request == expected
    assert request.model_fields_set == expected.model_fields_set


def test_a_keys_connections_share_one_pending_allowance() -> None:
    # Each socket alone is within its own limit; together they may hold the key's only.
    ledger = PendingLedger(3 * (100 + ITEM))
    sessions = [
        RealtimeSession(max_pending_input_bytes=1 << 20, ledger=ledger, owner="alpha")
        for _ in range(4)
    ]
    other = RealtimeSession(max_pending_input_bytes=1 << 20, ledger=ledger, owner="beta")
    chunk = audio(b"x" * 100)
    assert [session.receive_text(chunk) for session in sessions[:3]] == [[], [], []]
    refused = error_of(sessions[3].receive_text(chunk))
    assert refused["code"] == "input_too_large"
    assert "max_pending_bytes_per_key" in refused["message"]
    assert other.receive_text(chunk) == []  # another key has its own
    sessions[0].close()  # a socket that closes lets its input go
    assert sessions[3].receive_text(chunk) == []
    attached(sessions[1])  # so does a start the engine took
    assert sessions[0].receive_text(chunk) == []
    assert ledger.held("alpha") == 3 * (100 + ITEM)
    for session in [*sessions, other]:
        session.close()
    assert ledger.held("alpha") == ledger.held("beta") == 0


def test_an_image_url_is_printable_ascii_as_urls_are() -> None:
    # It counts as its length: other characters would hold several times that in memory.
    session = RealtimeSession(max_pending_input_bytes=1 << 20)
    for url in ("https://x/\u4e2d", "https://x/\U0001f600", "https://x/a b"):
        assert error_of(session.receive_text(image(url=url)))["code"] == "invalid_envelope"
    assert session.receive_text(image(url="https://x/%E4%B8%AD")) == []
