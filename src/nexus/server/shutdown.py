"""How the server stops: the order of the steps, and one deadline over all of them.

``nexus serve``, on SIGTERM, SIGINT or SIGHUP (:func:`stop`):

1. ``[server] drain_delay_s`` (0 by default): it goes on serving, but ``/healthz``
   answers 503, so that a load balancer that probes it stops sending connections
   before the listener goes (they would be refused);
2. the listener closes, and so do the idle keep-alive connections; a request that
   arrives on a connection still open gets 503 ``server_shutting_down`` with
   ``Connection: close``;
3. the grace (:func:`drain`): running streams and realtime turns get
   ``[server] shutdown_grace_s`` to finish. Every open connection is still read
   meanwhile, so a WebSocket's pongs and aborts, a client that leaves and an upload
   under way are all handled as at any other time. Realtime sockets without a turn
   close 1001 at once, and so does each one as its turn ends;
4. at the grace's end, what still runs is ended with a retryable
   ``server_shutting_down`` error and its format's terminator (a turn: its error frame,
   then close 1001);
5. then the closing (aiohttp's cleanup, the streams' logs, spend not yet charged, the
   store), which has at most :data:`CLOSE_BOUND_S`.

The grace is the streams': they end when it ends, whatever the store does. Every wait
on the store after the signal is bounded by the one deadline, ``grace's end +
CLOSE_BOUND_S`` (a lease check that does not answer counts as "nobody follows"), so
with Redis unreachable the process still exits within ``drain_delay_s +
shutdown_grace_s + CLOSE_BOUND_S`` of the signal (and a second or so of exit). A second
signal (Ctrl-C again) cuts the drain delay and the grace short: what runs is ended at once.

aiohttp's own ``runner.cleanup()`` stops reading every connection before it runs the
app's shutdown hooks, so :func:`stop` runs the grace before it. An app run another way
(``aiohttp_client``, ``web.run_app``) still has :func:`drain` as its ``on_shutdown``
hook: the same grace and deadline, in aiohttp's order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable

from aiohttp import web

from ..errors import ServerShuttingDown
from ..events import Error
from .state import CONFIG, HUB, RUNTIME, Runtime, Socket

__all__ = ["CLOSE_BOUND_S", "closing_deadline", "drain", "shutdown_event", "stop"]

log = logging.getLogger("nexus.server")

CLOSE_BOUND_S = 5.0
"""How long past the grace the process may take to close (see the module docstring)."""
_ENDING_S = 2.5
"""Of :data:`CLOSE_BOUND_S`: for the streams ended at the grace's end to write their
errors and hand their logs to the store; the rest is for aiohttp's cleanup, spend not yet
charged and the store."""
_NET_S = 1.0
"""Past the deadline, how long :func:`stop` waits before it gives up on the closing."""


def shutdown_event() -> Error:
    """What ends a stream still running at the grace's end."""
    return ServerShuttingDown("The server is shutting down; retry the request.").to_event()


def closing_deadline(app: web.Application) -> float:
    """When the closing must be over (event loop time): the drain's deadline, or
    :data:`CLOSE_BOUND_S` from now for an app that closes without one."""
    stop_by = app[RUNTIME].stop_by
    return stop_by if stop_by is not None else asyncio.get_running_loop().time() + CLOSE_BOUND_S


async def stop(runner: web.AppRunner, close_listener: Awaitable[None]) -> None:
    """Stop ``runner``'s app in the order the module docstring gives; ``close_listener``
    stops accepting connections (and closes the idle ones)."""
    app = runner.app
    runtime = app[RUNTIME]
    server = app[CONFIG].server
    loop = asyncio.get_running_loop()
    if server.drain_delay_s > 0:
        runtime.draining = True
        log.info("draining: /healthz answers 503; serving on for %.1fs", server.drain_delay_s)
        with contextlib.suppress(TimeoutError):  # a second signal cuts it short
            await asyncio.wait_for(runtime.hurry.wait(), server.drain_delay_s)
    runtime.shutting_down = True  # before the listener goes: a request from now on is refused
    await close_listener
    log.info("stopping: no new connections; streams get %.1fs", server.shutdown_grace_s)
    await drain(app)
    try:
        async with asyncio.timeout(closing_deadline(app) - loop.time() + _NET_S):
            await runner.cleanup()
    except TimeoutError:
        log.error("shutdown: closing took past its bound (%.0fs after the grace)", CLOSE_BOUND_S)


async def drain(app: web.Application) -> None:
    """The grace, then the end of what still runs (steps 3 and 4 of the module
    docstring). Only the first call does anything: :func:`stop` calls it, then aiohttp
    calls it again as the ``on_shutdown`` hook."""
    runtime = app[RUNTIME]
    if runtime.stop_by is not None:
        return
    runtime.shutting_down = True
    grace = app[CONFIG].server.shutdown_grace_s
    loop = asyncio.get_running_loop()
    grace_end = loop.time() + grace
    runtime.stop_by = grace_end + CLOSE_BOUND_S
    closing: dict[Socket, asyncio.Task[None]] = {}

    def close_idle_sockets() -> None:
        for socket in list(runtime.sockets):
            if not socket.busy and socket not in closing:
                closing[socket] = loop.create_task(socket.shutdown())

    close_idle_sockets()
    count = await _busy(app, runtime, grace_end)
    if count:
        log.info("waiting up to %.1fs for %d streams and requests to finish", grace, count)
    while count and loop.time() < grace_end and not runtime.hurry.is_set():
        await asyncio.sleep(min(0.05, max(grace_end - loop.time(), 0)))
        close_idle_sockets()
        count = await _busy(app, runtime, grace_end)
    if runtime.hurry.is_set():  # a second signal: the grace ends now, and so do its bounds
        grace_end = min(grace_end, loop.time())
        runtime.stop_by = grace_end + CLOSE_BOUND_S
    if count:
        log.warning("ending %d streams still running after the grace period", count)
    ending_by = grace_end + _ENDING_S
    # Sockets first: their turns end with close 1001, not with the streams' errors.
    for socket in list(runtime.sockets):
        if socket not in closing:
            closing[socket] = loop.create_task(socket.shutdown())
    if closing:
        await asyncio.wait(closing.values(), timeout=max(ending_by - loop.time(), 0))
    # The streams end with a retryable error in their logs, which their pumps write.
    hub_closed = loop.create_task(
        app[HUB].shutdown(shutdown_event(), timeout_s=max(ending_by - loop.time(), 0))
    )
    await _pumps_gone(runtime, min(loop.time() + 0.2, ending_by))
    # Pumps still running: following another replica's stream, or a stream whose end
    # waits on its end hooks (a store that does not answer): they write the error now.
    for pump in list(runtime.active):
        pump.shutdown()
    await _pumps_gone(runtime, ending_by)
    await hub_closed


async def _busy(app: web.Application, runtime: Runtime, deadline: float) -> int:
    """Streams someone reads here, or (leased) on another replica, busy sockets, and
    requests not streaming yet (an upload, an admission, a stream being opened).
    Streams nobody reads are not waited for: they end after the grace period. A stream
    is counted once, however many read it (its pumps, a run they are attached to)."""
    hub = app[HUB]
    followed = {run.id for run in hub.live.values() if run.attached}
    unread = [run.id for run in hub.live.values() if not run.attached]
    if unread and hub.store.shared:
        # A store that does not answer costs each check a second at most.
        followed |= await _leased(
            app, unread, min(deadline, asyncio.get_running_loop().time() + 1.0)
        )
    followed |= {pump.reader.meta.id for pump in runtime.active}
    opening = max(runtime.requests - len(runtime.active), 0)  # (each pump is a request's)
    return len(followed) + opening + sum(1 for socket in runtime.sockets if socket.busy)


async def _leased(app: web.Application, stream_ids: list[str], deadline: float) -> set[str]:
    """Those of ``stream_ids`` followed on another replica: one round trip, given up
    (nobody follows them) when the store fails or does not answer by ``deadline``."""
    try:
        async with asyncio.timeout_at(deadline):
            return await app[HUB].store.leased_among(stream_ids)
    except Exception:  # the store's failure, or the deadline: TimeoutError
        return set()


async def _pumps_gone(runtime: Runtime, deadline: float) -> None:
    loop = asyncio.get_running_loop()
    while runtime.active and loop.time() < deadline:
        await asyncio.sleep(0.01)
