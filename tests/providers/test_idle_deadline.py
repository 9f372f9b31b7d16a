"""The deadlines of an upstream read, kept at the watchdog's ticks from the body's byte
count: a read waiting past one times out; bytes that keep coming (events or not) keep it
alive."""

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


def test_bytes_that_keep_coming_keep_the_read_alive() -> None:
    exchange, content = _exchange()
    for now in range(1, 50):
        content.total_bytes += 5  # a comment, no event: the read never returns events
        exchange.check(float(now))
    assert content.raised == []
