"""A keeper's view of its stream's mirror into a shared store (see :mod:`nexus.cache.hub`).

While the store fails, the keeper warns once per lapse, reports ``behind``, ``caught_up``
or ``abandoned`` to the hub's ``on_mirror`` (``nexus_store_mirror_total{state}``), and
waits between tries: ``RETRY_S``, doubling up to ``RETRY_MAX_S``, so that thousands of
streams do not hammer a store that is down.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any

from .run import StreamRun

__all__ = ["RETRY_MAX_S", "RETRY_S", "Mirror"]

log = logging.getLogger("nexus.streams")

RETRY_S = 1.0
"""After the store failed, a keeper's next try comes at least this much later..."""
RETRY_MAX_S = 8.0
"""...doubling after each failure up to this."""


class Mirror:
    """One run's mirror. ``tell`` gets each change of state; ``closing`` set: the hub
    shuts down, and a pause ends at once (a last try)."""

    __slots__ = ("_closing", "_delay", "_run", "_tell", "behind")

    def __init__(
        self, run: StreamRun, tell: Callable[[str], None] | None, closing: asyncio.Event
    ) -> None:
        self._run = run
        self._tell = tell
        self._closing = closing
        self._delay = RETRY_S
        self.behind = False

    def _state(self, state: str) -> None:
        if self._tell is not None:
            self._tell(state)

    def failed(self) -> None:
        """A store call failed: warned and counted once per lapse, not per try."""
        if not self.behind:
            self.behind = True
            log.warning(
                "the stream store cannot be reached: stream %s streams on to its clients "
                "here, but cannot be resumed on another replica until its log is caught up",
                self._run.id,
            )
            self._state("behind")

    def ok(self) -> None:
        """A store call succeeded: caught up, if it was behind."""
        if self.behind:
            self.behind = False
            self._delay = RETRY_S
            log.info("stream %s: its log in the store is caught up", self._run.id)
            self._state("caught_up")

    def abandon(self) -> None:
        """Given up: the store never came back in time."""
        log.warning(
            "stream %s: its log could not be kept in the store; readers elsewhere get an "
            "error, not a partial stream",
            self._run.id,
        )
        self._state("abandoned")

    async def pause(self) -> None:
        """Until the next try: the delay, or sooner when the stream ends (its end is then
        tried) or the hub closes."""
        delay = self._delay
        self._delay = min(delay * 2, RETRY_MAX_S)
        closing = asyncio.ensure_future(self._closing.wait())
        waits: list[asyncio.Future[Any]] = [closing]
        if not self._run.finished:
            waits.append(self._run.done)
        try:
            await asyncio.wait(waits, timeout=delay)
        finally:
            closing.cancel()
