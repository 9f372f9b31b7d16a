"""Asking the replica that runs a stream how far it is: how a resume on another replica
tells an event id the stream has not produced from one its copy in Redis has not caught
up with yet.

A stream's copy in Redis trails what its replica already sent by a mirror turn (10 ms and
a round trip; seconds while that replica's writes fail). A ``Last-Event-ID`` past the copy
is either one the client got from that replica a moment ago, or one the stream never
produced (forged, or from a stream of that id yet to come): the first must attach and wait
for the copy, the second is answered ``204`` at once, as on the replica that runs it. Only
that replica knows which, so it is asked (:meth:`Asks.reached`):

1. One script reads the log's last entry ID (``0-<end>``: its entries so far). At or
   past the id, nothing is asked (the usual case: one round trip). Else, if the
   stream's owner key names a replica still alive, the script publishes the question on
   that replica's channel ``{prefix}:asks:{replica id}`` in the same step.
2. Every replica subscribes to its own channel, on a connection of its own, from its
   start: it answers a question (``?<n> <asking replica> <stream id>``) with the entries
   of that stream's log here (``=<n> <entries>``, -1 when it runs no such stream) on the
   asking replica's channel, where the answer resolves the question's future.

A subscription can die without a word (a NAT or load balancer that forgets the idle
connection, a path that blackholes it): reads just time out. So every :data:`PROBE_S` a
replica probes its own: it publishes on its own channel through its command connection, as
its answers go; a probe nobody hears (Redis holds no subscription of it) or that does not
come back within :data:`PROBE_WAIT_S` gives the subscription up, to be made again. Its
traffic also keeps the connection from ever being idle long.

Nothing of it runs per event. A question nobody hears (no replica subscribed: one
reconnecting to Redis, or one from before this protocol) or that gets no answer within
:data:`ASK_WAIT_S` raises :class:`~nexus.errors.StoreUnavailable`: the resume cannot be
judged now (503, retry), rather than left waiting on an event that may never come.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Coroutine
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.client import PubSub
from redis.exceptions import RedisError

from ..errors import StoreUnavailable  # (raised through ``unavailable``)
from .redis_url import scrub

__all__ = ["ASK_WAIT_S", "Asks"]

log = logging.getLogger("nexus.store")

ASK_WAIT_S = 1.0
"""How long a question waits for the replica running the stream to answer."""
RESUBSCRIBE_S = 0.25
"""How soon a replica whose subscription failed (Redis restarted, unreachable, refusing it)
tries again; each failed try doubles it, up to :data:`RESUBSCRIBE_MAX_S`."""
RESUBSCRIBE_MAX_S = 8.0
PROBE_S = 5.0
"""How often a subscribed replica probes its subscription (the module docstring)."""
PROBE_WAIT_S = 2.0
"""How long a probe, or Redis's confirmation of a ``SUBSCRIBE``, may take to arrive."""

# KEYS: the log, its owner key. ARGV: the entries wanted, the prefix, the question.
# -2: the copy has them; -3: no live replica runs it (its read tells what became of it);
# else how many replicas heard the question (0: nobody listens).
_REACHED = """
local top = redis.call('XREVRANGE', KEYS[1], '+', '-', 'COUNT', 1)[1]
if top and tonumber(string.sub(top[1], 3)) >= tonumber(ARGV[1]) then return -2 end
local owner = redis.call('GET', KEYS[2])
if not owner or redis.call('EXISTS', ARGV[2] .. ':replica:' .. owner) == 0 then return -3 end
return redis.call('PUBLISH', ARGV[2] .. ':asks:' .. owner, ARGV[3])
"""


class Asks:
    """One replica's side of the questions (see the module docstring): it asks through
    ``call`` (the store's pipeline; ``unavailable(op)``, the failure it counts and
    raises) and hears questions and answers on a connection of its own (``connect``);
    :attr:`entries` answers."""

    def __init__(
        self,
        connect: Callable[[], aioredis.Redis],
        call: Callable[..., Coroutine[Any, Any, list[Any]]],
        unavailable: Callable[[str], StoreUnavailable],
        prefix: str,
        replica_id: str,
        url: str,
    ) -> None:
        self._connect = connect
        self._url = url  # (cut out of the errors it logs)
        self._call = call
        self._unavailable = unavailable
        self.prefix = prefix
        self.replica_id = replica_id
        self.entries: Callable[[str], int | None] = lambda stream_id: None
        """This replica's answer (its store sets it): the entries of a stream's log
        running here, None when none runs here."""
        self._ids = itertools.count()
        self._waiting: dict[str, asyncio.Future[int]] = {}
        self._client: aioredis.Redis | None = None
        self._pubsub: PubSub | None = None
        self._task: asyncio.Task[None] | None = None
        self._answers: set[asyncio.Task[Any]] = set()

    def _channel(self, replica_id: str) -> str:
        return f"{self.prefix}:asks:{replica_id}"

    async def start(self) -> None:
        """Listen on this replica's channel. A subscription refused (a Redis user without
        ``SUBSCRIBE`` on the channel, say) does not stop the replica: it is warned about
        and tried again, and meanwhile a question for this replica goes unheard (503)."""
        self._client = self._connect()
        failure: Exception | None = None
        try:
            self._pubsub = await self._subscribe(self._client)
        except (RedisError, OSError) as exc:
            failure = exc  # (the listener warns, tries again)
        self._task = asyncio.get_running_loop().create_task(self._listen(self._client, failure))

    async def _subscribe(self, client: aioredis.Redis) -> PubSub:
        """A subscription to this replica's channel, once Redis confirms it: a refusal
        raises here (redis-py only sends the command; its reply comes with the next read)."""
        pubsub = client.pubsub(ignore_subscribe_messages=True)
        try:
            await pubsub.subscribe(self._channel(self.replica_id))
            if await pubsub.parse_response(block=False, timeout=PROBE_WAIT_S) is None:
                raise TimeoutError(f"Redis did not confirm the subscription in {PROBE_WAIT_S:g} s")
        except BaseException:
            await pubsub.aclose()  # type: ignore[no-untyped-call]
            raise
        return pubsub

    async def close(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.wait((task,), timeout=2.0)
        for answer in list(self._answers):
            answer.cancel()
        pubsub, self._pubsub = self._pubsub, None
        client, self._client = self._client, None
        with contextlib.suppress(RedisError, OSError):
            if pubsub is not None:
                await pubsub.aclose()  # type: ignore[no-untyped-call]
            if client is not None:
                await client.aclose()

    async def reached(self, log: str, owner: str, stream_id: str, entries: int) -> bool:
        """Whether the live log at ``log`` (``owner``: its owner key) has ``entries``
        entries on the replica running it: in its copy here, else as that replica says.
        True too when no live replica runs it (a read of it tells what became of it).
        Raises :class:`StoreUnavailable` when that replica cannot be asked."""
        number = str(next(self._ids))
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting[number] = future
        try:
            question = f"?{number} {self.replica_id} {stream_id}"
            (heard,) = await self._call(
                "ask", ("EVAL", _REACHED, 2, log, owner, entries, self.prefix, question)
            )
            heard = int(heard)
            if heard < 0:
                return True
            if heard > 0:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(ASK_WAIT_S):
                        live = await future
                    return live < 0 or entries <= live
            raise self._unavailable("ask")  # nobody heard, or answered in time
        finally:
            self._waiting.pop(number, None)

    async def _listen(self, client: aioredis.Redis, failure: Exception | None) -> None:
        """Questions and answers, as they come (:meth:`_hear`). The subscription failing
        (Redis restarted, unreachable, refusing it; or dead without a word, as its probe
        tells), it is made again: after :data:`RESUBSCRIBE_S`, twice as long after each
        failed try, up to :data:`RESUBSCRIBE_MAX_S`; one warning an outage. What was said
        meanwhile is not heard (its question fails, to be retried)."""
        pause, warned = RESUBSCRIBE_S, False
        while True:
            if failure is not None:
                why = scrub(str(failure), self._url)
                if warned:
                    log.debug("questions between replicas: %s", why)
                else:  # once an outage: a resume elsewhere past its copy gets 503 meanwhile
                    log.warning("other replicas cannot ask this one about its streams: %s", why)
                    warned = True
                pubsub, self._pubsub = self._pubsub, None
                if pubsub is not None:
                    with contextlib.suppress(RedisError, OSError):
                        await pubsub.aclose()  # type: ignore[no-untyped-call]
                await asyncio.sleep(pause)
                pause = min(2 * pause, RESUBSCRIBE_MAX_S)
            try:
                if self._pubsub is None:
                    self._pubsub = await self._subscribe(client)
                    if warned:
                        log.info("other replicas can ask this one about its streams again")
                    pause, warned = RESUBSCRIBE_S, False
                await self._hear(self._pubsub)  # (returns only by raising)
            except (RedisError, OSError) as exc:
                failure = exc

    async def _hear(self, pubsub: PubSub) -> None:
        """Questions and answers on ``pubsub``, until it fails or its probe (every
        :data:`PROBE_S`, in a task of its own: questions are heard meanwhile) tells it dead."""
        loop = asyncio.get_running_loop()
        probe: asyncio.Task[str | None] | None = None
        probe_at = loop.time() + PROBE_S
        try:
            while True:
                message = await pubsub.get_message(timeout=min(1.0, PROBE_S))
                if message is not None and message.get("type") == "message":
                    self._heard(message["data"])
                if probe is None:
                    if loop.time() >= probe_at:
                        probe = loop.create_task(self._probe())
                elif probe.done():
                    if dead := probe.result():
                        raise ConnectionError(dead)
                    probe, probe_at = None, loop.time() + PROBE_S
        finally:
            if probe is not None:
                probe.cancel()

    async def _probe(self) -> str | None:
        """Why this replica's subscription is dead, else None: a probe (an answer to
        itself) published on its channel that Redis has no subscriber for, or that is not
        heard back within :data:`PROBE_WAIT_S`. A probe Redis fails to take tells nothing
        (the store counts it; a subscription to a Redis that is down fails of itself)."""
        number = str(next(self._ids))
        future: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        self._waiting[number] = future
        try:
            try:
                (heard,) = await self._call(
                    "ask", ("PUBLISH", self._channel(self.replica_id), f"={number} 0")
                )
            except StoreUnavailable:
                return None
            if int(heard) == 0:
                return "Redis holds no subscription of it any more (its connection dropped)"
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(PROBE_WAIT_S):
                    await future
                return None
            return f"its own probe was not heard back within {PROBE_WAIT_S:g} s (a dead connection)"
        finally:
            self._waiting.pop(number, None)

    def _heard(self, data: bytes) -> None:
        kind, rest = data[:1], data[1:].decode(errors="replace")
        if kind == b"=":
            number, _, entries = rest.partition(" ")
            future = self._waiting.get(number)
            if future is not None and not future.done() and entries.lstrip("-").isdigit():
                future.set_result(int(entries))
        elif kind == b"?":
            number, asker, stream_id = [*rest.split(" ", 2), "", ""][:3]
            if number and asker and stream_id:
                found = self.entries(stream_id)
                answer = f"={number} {-1 if found is None else found}"
                task = asyncio.ensure_future(
                    self._call("ask", ("PUBLISH", self._channel(asker), answer))
                )
                self._answers.add(task)
                task.add_done_callback(self._answered)

    def _answered(self, task: asyncio.Task[Any]) -> None:
        self._answers.discard(task)
        if not task.cancelled():
            task.exception()  # (counted by the store's call: retrieved, not raised)
