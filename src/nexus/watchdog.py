"""One task for the timers of every response in flight.

A task per response for its heartbeat and write timeout cost each idle stream a task,
a future and a timer handle (about 2 KB of its ~45). Here one task ticks for all, at a
quarter of the shortest interval registered, and asks each to :meth:`Watched.check`
itself; a response starts a task only to write a heartbeat that is due.
"""

from __future__ import annotations

import asyncio
import logging
import math
from typing import Protocol

__all__ = ["Watchdog", "Watched"]

log = logging.getLogger("nexus.server")


class Watched(Protocol):
    def check(self, now: float) -> None:
        """Act on the timers as of ``now`` (the loop's time): never awaits."""


class Watchdog:
    """Ticks while anything is watched; see the module docstring."""

    def __init__(self) -> None:
        self._watched: set[Watched] = set()
        self._tick = math.inf
        self._task: asyncio.Task[None] | None = None

    def __len__(self) -> int:
        return len(self._watched)

    def add(self, watched: Watched, tick: float) -> None:
        """Watch ``watched``, checking it at least every ``tick`` seconds."""
        self._watched.add(watched)
        self._tick = min(self._tick, tick)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    def discard(self, watched: Watched) -> None:
        self._watched.discard(watched)

    async def stop(self) -> None:
        """Stop watching (its owner closes): the task ends now, not after its next sleep."""
        self._watched.clear()
        if (task := self._task) is not None and task is not asyncio.current_task():
            task.cancel()
            await asyncio.wait((task,))
            self._task = None  # (a task cancelled before it ran never ran its finally)

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while self._watched:
                await asyncio.sleep(self._tick)
                now = loop.time()
                for watched in list(self._watched):
                    try:
                        watched.check(now)
                    except Exception:
                        log.exception("checking the timers of a response failed")
        finally:
            self._task = None
