"""Which request a log line was written for: the task that serves it.

A request's handler task, and the task of the stream run it starts, are registered with
the request's id (:func:`serve`, :func:`inherit`); :class:`RequestIds` gives a record logged
in one of them that id (the JSON format writes it), so the ``req_...`` of a ``502`` finds the
upstream's own words and the fallback that followed. Those tasks only: a task one of them
starts for everyone (the watchdog, a DNS lookup, a Redis flush) serves no one request, and
a context variable, which every task started inherits, would have named one for it.
"""

from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

__all__ = ["RequestIds", "inherit", "serve"]

_SERVING: weakref.WeakKeyDictionary[asyncio.Task[Any], str] = weakref.WeakKeyDictionary()


def serve(request_id: str) -> None:
    """The current task serves the request ``request_id``."""
    task = asyncio.current_task()
    if task is not None:
        _SERVING[task] = request_id


def inherit(task: asyncio.Task[Any]) -> None:
    """``task`` (a stream's run) serves the request the current task serves, if any."""
    current = asyncio.current_task()
    request_id = _SERVING.get(current) if current is not None else None
    if request_id is not None:
        _SERVING[task] = request_id


class RequestIds(logging.Filter):
    """Gives a record logged in a task that serves a request that request's id."""

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "request_id", None) is None:
            try:
                task = asyncio.current_task()
            except RuntimeError:  # no loop running in this thread
                task = None
            request_id = _SERVING.get(task) if task is not None else None
            if request_id is not None:
                record.request_id = request_id
        return True
