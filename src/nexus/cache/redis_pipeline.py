"""The store's commands to Redis: one pipeline for every task, and RESP written by hand.

**One pipeline** (:class:`Pipeliner`): every task's commands join one pipeline; while it
is in flight the next ones gather for the next. A thousand streams mirroring their logs
cost a round trip per turn, on one connection the pipeline keeps.

**Failing fast** (:data:`DOWN_S`): a round trip Redis failed (no answer within its deadline,
no connection to be made; not a kept connection found closed, which the next one makes
again) fails the commands after it at once for a moment, rather than each waiting out a
deadline of its own: a request makes several round trips, and behind a Redis that hangs it
waited 15-30 s before its 503 (or, with ``required = false``, before running on its replica
alone). The first commands after the moment are the probe; while a round trip goes
unanswered past :data:`SLOW_S` (the probe of a Redis that hangs), new commands fail at once
too, rather than queue behind it for the rest of its deadline.

**RESP** (:func:`_pack`): the commands of a pipeline are packed at less than half of
redis-py's cost; a command may come packed already (the mirror's appends,
:class:`~nexus.cache.redis_log.Appends`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError, RedisError, ResponseError

__all__ = [
    "DOWN_S",
    "Command",
    "Pipeliner",
    "StoreBusy",
    "StoreDown",
    "bulk",
    "busy",
    "exchange",
    "send",
]

DOWN_S = 1.0
"""How long after a round trip Redis failed the commands fail at once (see above)."""
SLOW_S = 2.5
"""A round trip unanswered this long: Redis hangs (it answers in milliseconds, a large
pipeline in tens of them; a fork for a snapshot or a slow script may hold it a second or
two, which requests wait out); commands that come meanwhile fail at once."""


class StoreBusy(RedisError):
    """The pipeline's queue was not sent within its wait: Redis is slow or the load high."""


class StoreDown(ConnectionError):
    """Redis failed the last round trip, less than :data:`DOWN_S` ago: not tried again yet."""


def busy(exc: BaseException) -> bool:
    """Whether ``exc`` says the store's connections were all busy past their wait (the
    pipeline's queue, or a pool: redis-py's ``No connection available``, raised from the
    wait's timeout), rather than that Redis failed."""
    return isinstance(exc, StoreBusy) or (
        isinstance(exc, ConnectionError) and isinstance(exc.__cause__, TimeoutError)
    )


Command = tuple[Any, ...] | bytes
"""A command's arguments, or the whole command already in RESP
(:meth:`~nexus.cache.redis_log.Appends.command`)."""


class Pipeliner:
    """Sends commands in pipelines, one at a time (see the module docstring). A group
    not sent within ``wait_s`` (its pipeline waited for the pool) fails, and so does a
    pipeline Redis has not answered within ``timeout_s``: one deadline per round trip,
    where a connection's ``socket_timeout`` set a timer per reply (half the CPU of a
    begin's round trip, ~15 µs per further reply)."""

    def __init__(self, client: aioredis.Redis, wait_s: float, timeout_s: float = 5.0) -> None:
        self._client = client
        self._wait_s = wait_s
        self._timeout_s = timeout_s
        self._connection: AbstractConnection | None = None
        """Taken from the pool once and kept (pipelines go one at a time), checked before
        each pipeline as the pool checks what it hands out: taking one per pipeline cost a
        lock, a timeout and the pool's metrics each, a third of the store's CPU in a
        request."""
        self._queue: list[tuple[Sequence[Command], asyncio.Future[list[Any]], float]] = []
        self._task: asyncio.Task[None] | None = None
        self._down_until = 0.0  # (loop time) until when commands fail at once
        self._sent_at = 0.0  # (loop time) when the round trip in flight went; 0: none

    async def run(self, commands: Sequence[Command]) -> list[Any]:
        """Each command's reply, in order (a refusal as its error). Raises
        :class:`RedisError` or ``OSError`` when Redis cannot be reached."""
        loop = asyncio.get_running_loop()
        if self._down_until and loop.time() < self._down_until:
            raise StoreDown(f"Redis failed a round trip less than {DOWN_S:g} s ago")
        if self._sent_at and loop.time() - self._sent_at > SLOW_S:
            raise StoreDown(f"Redis has not answered a round trip for {SLOW_S:g} s")
        future: asyncio.Future[list[Any]] = loop.create_future()
        self._queue.append((commands, future, loop.time()))
        if self._task is None:
            self._task = loop.create_task(self._flush())
        return await future

    async def _flush(self) -> None:
        loop = asyncio.get_running_loop()
        sent: list[tuple[asyncio.Future[list[Any]], int]] = []
        failed: BaseException | None = None
        try:
            while self._queue:
                groups, self._queue = self._queue, []
                if failed is not None and loop.time() < self._down_until:
                    # Queued behind the round trip that failed: failed with it, not sent
                    # to wait out a deadline of their own.
                    for _, future, _ in groups:
                        if not future.done():
                            future.set_exception(failed)
                    continue
                late = loop.time() - self._wait_s
                commands: list[Command] = []
                sent = []
                for group, future, queued in groups:
                    if queued < late and not future.done():
                        # Late behind a round trip that failed (Redis not answering): that
                        # failure; behind one that went through, the pipeline was busy.
                        future.set_exception(failed or StoreBusy("no pipeline free in time"))
                    if not future.done():  # (else: its caller left)
                        commands += group
                        sent.append((future, len(group)))
                failed = None
                try:
                    replies = []
                    if commands:
                        pool = self._client.connection_pool
                        connection = self._connection
                        pooled = connection is None  # (a wait for the pool is not Redis's)
                        async with asyncio.timeout(self._timeout_s):
                            try:
                                if connection is None:
                                    connection = await pool.get_connection()  # type: ignore[no-untyped-call]
                                    self._connection = connection
                                else:  # closed by Redis while kept (a restart): connected again
                                    await pool.ensure_connection(connection)
                            except (RedisError, OSError) as exc:
                                if not busy(exc):  # cannot connect (not: the pool is full)
                                    self._down_until = loop.time() + DOWN_S
                                raise
                            pooled = False
                            self._sent_at = loop.time()
                            try:
                                replies = await exchange(connection, commands)
                            finally:
                                self._sent_at = 0.0
                            self._down_until = 0.0
                except TimeoutError as exc:  # (no answer in time)
                    failed = exc
                    if not pooled:  # Redis's answer or its connect, not a wait for the pool
                        self._down_until = loop.time() + DOWN_S
                except (RedisError, OSError) as exc:
                    # A connection Redis (or a proxy) closed, found broken mid-exchange: the
                    # next round trip connects again; Redis itself may be well.
                    failed = exc
                at = 0
                for future, count in sent:
                    if future.done():
                        pass
                    elif failed is not None:
                        future.set_exception(failed)
                    else:
                        future.set_result(replies[at : at + count])
                    at += count
            sent = []
        finally:
            self._task = None
            # Closed (or broken) with groups sent or queued: each caller gets an error it
            # handles (StoreUnavailable), never a wait without end or a CancelledError
            # that is not its own.
            for future in [f for f, _ in sent] + [f for _, f, _ in self._queue]:
                if not future.done():
                    future.set_exception(RedisError("the store's pipeline stopped"))
            self._queue = []

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.wait((self._task,), timeout=2.0)
            if self._task is not None:
                return  # still on its connection (Redis not answering): closed with the pool
        connection, self._connection = self._connection, None
        if connection is not None:
            await self._client.connection_pool.release(connection)


async def send(client: aioredis.Redis, commands: Sequence[Command]) -> list[Any]:
    """``commands`` in one go on one connection of ``client``'s pool (:func:`exchange`)."""
    pool = client.connection_pool
    connection = await pool.get_connection()  # type: ignore[no-untyped-call]
    try:
        return await exchange(connection, commands)
    finally:
        await pool.release(connection)


async def exchange(connection: AbstractConnection, commands: Sequence[Command]) -> list[Any]:
    """``commands`` in one go on ``connection``, each reply in order (a refusal as its
    error); a connection that broke since its last use (Redis restarted) is connected
    again once; one that fails midway is left disconnected (a reply may be unread)."""
    try:
        for retry in (True, False):
            try:
                await connection.send_packed_command(_pack(commands))
                break
            except (ConnectionError, OSError):
                await connection.disconnect()
                if not retry:
                    raise
        replies: list[Any] = []
        for _ in commands:
            try:
                replies.append(await connection.read_response())
            except ResponseError as exc:
                replies.append(exc)
        return replies
    except BaseException:
        await connection.disconnect()  # a reply may be left unread
        raise


def bulk(arg: bytes) -> bytes:
    """One argument in RESP (a bulk string)."""
    return b"$%d\r\n%b\r\n" % (len(arg), arg)


def _pack(commands: Sequence[Command]) -> bytes:
    """``commands`` in RESP: what redis-py's packing makes, at less than half its cost."""
    out = []
    for command in commands:
        if type(command) is bytes:  # packed already
            out.append(command)
            continue
        out.append(b"*%d\r\n" % len(command))
        for arg in command:
            if type(arg) is not bytes:
                arg = b"%d" % arg if type(arg) is int else str(arg).encode()
            out.append(bulk(arg))
    return b"".join(out)
