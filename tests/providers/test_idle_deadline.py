"""The deadlines of an upstream read, kept at the watchdog's ticks from the body's byte
count: a read waiting past one times out; bytes that keep coming (events or not) keep it
alive."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from nexus.providers.exchange import UpstreamExchange


def _exchange() -> UpstreamExchange:
    """An exchange waiting for its first byte (deadline at 10.0): the watchdog's view of
    it is ``received``, ``_deadline`` and a pending ``_waiter``."""
    config = SimpleNamespace(first_byte_timeout_s=10.0, idle_timeout_s=10.0)
    provider = SimpleNamespace(name="up", config=config)
    exchange = UpstreamExchange(provider, None, "m")  # type: ignore[arg-type]
    exchange._deadline = 10.0  # the first byte's
    exchange._waiter = asyncio.get_running_loop().create_future()
    return exchange


async def test_a_read_that_waits_past_its_deadline_times_out() -> None:
    exchange = _exchange()
    waiter = exchange._waiter
    assert waiter is not None
    exchange.check(5.0)
    assert exchange._failure is None and not waiter.done()
    exchange.check(10.0)  # no first byte within first_byte_timeout_s
    assert isinstance(exchange._failure, TimeoutError)
    assert waiter.done()  # the task that reads is woken to raise it


async def test_bytes_that_keep_coming_keep_the_read_alive() -> None:
    exchange = _exchange()
    waiter = exchange._waiter
    assert waiter is not None
    for now in range(1, 50):
        exchange.received += 5  # a comment, no event: the read never returns events
        exchange.check(float(now))
    assert exchange._failure is None and not waiter.done()
    exchange.check(49.0 + 10.0)  # then silence for idle_timeout_s: it times out
    assert isinstance(exchange._failure, TimeoutError) and waiter.done()
