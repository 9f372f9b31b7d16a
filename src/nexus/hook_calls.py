"""One plugin hook's call, bounded and contained (used by :mod:`nexus.hooks`).

A hook is someone else's code running inside a stream: the stream's end (its
billing, its metrics, the key's stream slot) waits for it. So each call is
bounded by its plugin's ``timeout_s`` (``[[plugins]] timeout_s``), and what it
raises stays with it: an exception, a timeout, or a ``CancelledError`` the hook
raised on its own (awaiting a future some other task cancelled) while the task
running it is not being cancelled. Each is one hook error, logged and counted;
the stream goes on. A cancellation of the task itself still goes through.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

__all__ = ["HOOK_TIMEOUT_S", "guarded"]

HOOK_TIMEOUT_S = 5.0
"""How long one hook call may take by default (``[[plugins]] timeout_s``); then it is
abandoned and counted as a hook error."""

Failed = Callable[[str, bool], None]
"""Told of a failed call: what went wrong, and whether a traceback is worth logging."""


async def guarded(
    call: Callable[[], Awaitable[object]],
    timeout_s: float | None,
    failed: Failed,
    passes: type[BaseException] | tuple[type[BaseException], ...] = (),
) -> bool:
    """Await ``call()`` for at most ``timeout_s`` (None: no bound); tell ``failed`` of a
    failure instead of raising it. ``passes``: exceptions raised as they are (a
    :class:`~nexus.hooks.StreamRejected` from ``on_stream_started``). True when the call
    was abandoned at its bound (a gate that could not decide in time: see
    :meth:`~nexus.hooks.Hooks.started`)."""
    bound = None
    try:
        if timeout_s is None:
            await call()
            return False
        async with asyncio.timeout(timeout_s) as bound:
            await call()  # called in here: a plain function's error is the hook's too
    except passes:
        raise
    except TimeoutError:
        if bound is not None and bound.expired():
            failed(f"did not return within {timeout_s:g}s (abandoned)", False)
            return True
        failed("raised", True)
    except asyncio.CancelledError:
        task = asyncio.current_task()
        if task is None or task.cancelling():
            raise  # the task itself is being cancelled: not the hook's doing
        failed("raised CancelledError (its task was not cancelled)", True)
    except Exception:
        failed("raised", True)
    return False
