"""A realtime socket's frame budget, on a clock the test moves."""

from __future__ import annotations

from nexus.protocol.realtime_budget import FrameBudget


def budget(frames: int = 3, size: int = 100, message: int = 50) -> FrameBudget:
    return FrameBudget(frames_per_s=frames, bytes_per_s=size, max_message_bytes=message, now=0.0)


def test_a_seconds_worth_of_frames_at_once_then_at_the_rate() -> None:
    b = budget(frames=3)
    assert [b.take(0, 0.0) for _ in range(3)] == [None, None, None]
    assert b.take(0, 0.0) == "over 3 frames per second"
    b = budget(frames=3)
    for _ in range(3):
        b.take(0, 0.0)
    assert b.take(0, 1 / 3) is None  # a third of a second: one frame back
    assert b.take(0, 1 / 3) == "over 3 frames per second"


def test_the_byte_bucket_holds_one_largest_message_or_a_second() -> None:
    b = budget(size=10, message=50, frames=100)
    assert b.take(50, 0.0) is None  # a largest message fits an idle socket
    assert b.take(1, 0.0) == "over 10 bytes per second"
    b = budget(size=100, message=50, frames=100)
    assert b.take(60, 0.0) is None and b.take(40, 0.0) is None
    assert b.take(1, 0.0) == "over 100 bytes per second"


def test_an_idle_socket_refills_no_further_than_its_burst() -> None:
    b = budget(frames=2)
    assert b.take(0, 1000.0) is None and b.take(0, 1000.0) is None
    assert b.take(0, 1000.0) is not None


def test_the_byte_bucket_holds_all_the_input_a_socket_may_hold_pending() -> None:
    b = FrameBudget(
        frames_per_s=100, bytes_per_s=10, max_message_bytes=50, max_pending_input_bytes=200, now=0.0
    )
    assert [b.take(50, 0.0) for _ in range(4)] == [None] * 4  # four largest messages at once
    assert b.take(1, 0.0) == "over 10 bytes per second"
