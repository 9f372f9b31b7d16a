"""The deadlines of an upstream read, kept at the watchdog's ticks from the count of reads
that gave events: a read waiting past one times out; reads that keep giving events keep
it alive, bytes without events (comments) do not."""

from __future__ import annotations

from typing import Any

from nexus.providers.http import _Exchange


class _Content:
    total_bytes = 0

    def __init__(self) -> None:
        self.raised: list[BaseException] = []

    def set_exception(self, exc: BaseException) -> None:
        self.raised.append(exc)


class _Config:
    first_byte_timeout_s = 10.0
    idle_timeout_s = 10.0


class _Provider:
    config = _Config()


def _exchange() -> tuple[Any, _Content]:
    exchange: Any = _Exchange.__new__(_Exchange)
    exchange._provider = _Provider()
    exchange._seen = 0
    exchange._progress = 0
    exchange._waiting = True
    exchange._deadline = 10.0  # the first byte's
    content = _Content()

    class Response:
        pass

    exchange.response = Response()
    exchange.response.content = content
    return exchange, content


def test_a_read_that_waits_past_its_deadline_times_out() -> None:
    exchange, content = _exchange()
    exchange.check(5.0)
    assert content.raised == []
    exchange.check(10.0)  # no first byte within first_byte_timeout_s
    assert len(content.raised) == 1


def test_events_that_keep_coming_keep_the_read_alive() -> None:
    exchange, content = _exchange()
    for now in range(1, 50):
        exchange._progress += 1  # a read that gave events
        exchange.check(float(now))
    assert content.raised == []


def test_comments_alone_do_not_keep_the_read_alive() -> None:
    """Keepalive comments used to hold a stream (a slot, a pooled connection) open until
    max_stream_duration_s, its first-byte deadline met by bytes no event came of."""
    exchange, content = _exchange()
    for now in range(1, 10):
        content.total_bytes += 13  # b": keepalive\n\n": no read gave events
        exchange.check(float(now))
    assert content.raised == []
    exchange.check(10.0)
    assert len(content.raised) == 1
