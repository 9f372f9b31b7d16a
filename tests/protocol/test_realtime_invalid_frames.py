"""Invalid frames in a row: the session closes (1008) after ``max_invalid_frames``."""

from __future__ import annotations

import base64

import orjson

from nexus.protocol.realtime import AbortTurn, Close, RealtimeSession, Send, StartTurn

AUDIO = orjson.dumps(
    {"type": "audio_chunk", "format": "pcm16", "b64": base64.b64encode(b"ab").decode()}
).decode()
START = orjson.dumps(
    {"type": "start", "request": {"model": "m", "messages": [{"role": "user", "content": "x"}]}}
).decode()


def codes(actions: list[object]) -> list[str | None]:
    return [a.code if isinstance(a, Send) else type(a).__name__ for a in actions]


def test_the_nth_invalid_frame_in_a_row_is_answered_then_closed() -> None:
    s = RealtimeSession(max_pending_input_bytes=1 << 20, max_invalid_frames=3)
    assert codes(s.receive_text("x")) == ["invalid_envelope"]
    assert codes(s.receive_binary(b"\0")) == ["invalid_envelope"]
    last = s.receive_text('{"type":"abort"}')  # nothing_to_abort: a strike too
    assert codes(last) == ["nothing_to_abort", "Close"]
    assert last[-1] == Close(1008, "3 invalid frames in a row")


def test_a_frame_that_is_taken_starts_the_count_again() -> None:
    s = RealtimeSession(max_pending_input_bytes=1 << 20, max_invalid_frames=2)
    assert codes(s.receive_text("{}")) == ["invalid_envelope"]
    assert s.receive_text(AUDIO) == []
    assert codes(s.receive_text("{}")) == ["invalid_envelope"]
    assert isinstance(s.receive_text(START)[0], StartTurn)
    s.start_accepted()  # the engine took it (a refused one would be a strike: refused())
    assert codes(s.receive_text(START)) == ["stream_in_progress"]
    assert s.receive_text('{"type":"abort"}') == [AbortTurn()]
    s.turn_ended()
    assert codes(s.receive_text("[]")) == ["invalid_envelope"]
    assert codes(s.receive_text("[]")) == ["invalid_envelope", "Close"]


def test_input_over_the_limit_is_no_strike() -> None:
    # Well formed, refused for its size: the client can start and carry on.
    s = RealtimeSession(max_pending_input_bytes=1, max_invalid_frames=2)
    for _ in range(5):
        assert codes(s.receive_text(AUDIO)) == ["input_too_large"]


def test_starts_the_route_refuses_are_strikes_until_one_is_accepted() -> None:
    s = RealtimeSession(max_pending_input_bytes=1 << 20, max_invalid_frames=3)
    frame = Send("{}", "rate_limited")
    assert s.refused(frame) == [frame]
    assert isinstance(s.receive_text(START)[0], StartTurn)  # not yet judged
    s.start_refused()
    assert s.refused(frame) == [frame]  # the admission refused it: the second strike
    assert s.refused(frame) == [frame, Close(1008, "3 invalid frames in a row")]
    s = RealtimeSession(max_pending_input_bytes=1 << 20, max_invalid_frames=2)
    assert s.refused(frame) == [frame]
    s.receive_text(START)
    s.start_accepted()
    assert s.refused(frame) == [frame]  # the count began again


def test_a_frame_other_than_a_start_is_refused_unwalked(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Only a start's request may nest: any other envelope that does fails validation at
    its first field not its own. Walked first (twice: values, then depth), a 400 KB frame of
    small objects held the shared loop ~70 ms, and such frames take no rate token."""
    import nexus.protocol.realtime as realtime

    def walked(*_: object) -> None:
        raise AssertionError("a frame other than a start was walked")

    monkeypatch.setattr(realtime, "more_items_than", walked)
    monkeypatch.setattr(realtime, "deep_field", walked)
    s = RealtimeSession(max_pending_input_bytes=1 << 20, max_json_items=100, max_invalid_frames=9)
    junk = [{"a": 0}] * 1000  # ten times the limit on values
    for frame in (
        {"type": "image", "mime_type": "image/png", "x": junk},
        {"type": "audio_chunk", "format": "pcm16", "b64": junk},
        {"type": "abort", "x": [[[[[0]]]]]},
    ):
        (answer,) = s.receive_text(orjson.dumps(frame).decode())
        assert isinstance(answer, Send) and answer.code == "invalid_envelope"
