"""What one realtime socket may send: frames and bytes per second. Sans-I/O.

Every frame a client sends costs the gateway work on the event loop every tenant
shares: a parse, a validation, often an answer. aiohttp hands over all the frames of
one read without the loop turning, so a client sending tiny frames (pings, ``{}``) as
fast as its link allows would otherwise hold the loop for itself. The route yields to
the loop after each frame; this budget bounds how many frames, and how many bytes of
them, one socket may cost in all.

Two token buckets, refilled continuously: ``frames_per_s`` frames (holding one
second's worth), and ``bytes_per_s`` bytes. The byte bucket holds the most of one
second's worth, one largest message (``[realtime] max_message_bytes``) and the input a
socket may hold pending (``max_pending_input_bytes``): a quiet socket may send at once
all it may hold before a ``start`` (a few images back to back), and only a client that
keeps sending past that is held to the rate. A frame that finds a bucket short is over the
budget: the route closes the socket (1008). The caller passes the clock: nothing here
reads one.
"""

from __future__ import annotations

__all__ = ["FrameBudget", "frame_size"]


def frame_size(data: object) -> int:
    """A frame's payload in bytes, as the budget counts it: a text frame's UTF-8 length
    (aiohttp hands over decoded text, whose characters would count a 4-byte emoji once)."""
    if isinstance(data, str):
        return len(data) if data.isascii() else len(data.encode())
    return len(data) if isinstance(data, bytes) else 0


class FrameBudget:
    """One socket's frame and byte buckets (see the module docstring)."""

    __slots__ = ("_bytes", "_frames", "_last", "byte_burst", "bytes_per_s", "frames_per_s")

    def __init__(
        self,
        *,
        frames_per_s: int,
        bytes_per_s: int,
        max_message_bytes: int,
        now: float,
        max_pending_input_bytes: int = 0,
    ) -> None:
        self.frames_per_s = frames_per_s
        self.bytes_per_s = bytes_per_s
        self.byte_burst = max(bytes_per_s, max_message_bytes, max_pending_input_bytes)
        self._frames = float(frames_per_s)
        self._bytes = float(self.byte_burst)
        self._last = now

    def take(self, size: int, now: float) -> str | None:
        """Count one frame of ``size`` bytes received at ``now``: None while within the
        budget, else why it is over (the close's reason, short enough for a close frame)."""
        elapsed = now - self._last
        if elapsed > 0:
            self._last = now
            self._frames = min(self.frames_per_s, self._frames + elapsed * self.frames_per_s)
            self._bytes = min(self.byte_burst, self._bytes + elapsed * self.bytes_per_s)
        self._frames -= 1
        self._bytes -= size
        if self._frames < 0:
            return f"over {self.frames_per_s} frames per second"
        if self._bytes < 0:
            return f"over {self.bytes_per_s} bytes per second"
        return None
