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
