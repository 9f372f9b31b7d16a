"""WebSocket frame headers, read without reading frames: the client-masking check.

RFC 6455 §5.1: "a client MUST mask all frames that it sends to the server",
and "a server MUST close the connection upon receiving a frame that is not
masked"; the status code for that is 1002, protocol error (§7.4.1). aiohttp's
reader unmasks what is masked but takes an unmasked frame as it is, so the
connection layer (:mod:`nexus.server.connection`) runs the client's bytes
through a :class:`MaskScanner` before the reader gets them.

The scanner looks at frame headers only (§5.2: two bytes, an extended length of
2 or 8 bytes, the 4-byte masking key) and skips each payload by its length, so
a chunk that lies inside a payload costs one comparison. Sans-I/O: bytes in, a
verdict out.
"""

from __future__ import annotations

import struct

__all__ = ["MaskScanner", "close_frame"]

_MASKED = 0x80


class MaskScanner:
    """Follows the frame boundaries of a client's byte stream; see the module docstring.

    :meth:`feed` takes the bytes in the order they arrived and says whether every
    frame header seen so far was masked. Once it has said no, it keeps saying no.
    """

    __slots__ = ("failed", "head", "skip")

    def __init__(self) -> None:
        self.skip = 0
        """Payload bytes of the current frame still to come."""
        self.head = b""
        """The start of a frame header split across reads."""
        self.failed = False

    def feed(self, data: bytes) -> bool:
        """True while every client frame is masked; False from the first unmasked one."""
        if self.failed:
            return False
        size = len(data)
        if self.skip >= size:  # inside a payload: the common case for large frames
            self.skip -= size
            return True
        pos = self.skip
        self.skip = 0
        if self.head:
            data = self.head + data[pos:]
            self.head = b""
            pos = 0
            size = len(data)
        while pos < size:
            if size - pos < 2:
                self.head = data[pos:]
                return True
            second = data[pos + 1]
            if not second & _MASKED:
                self.failed = True
                return False
            length = second & 0x7F
            header = 6 if length < 126 else 8 if length == 126 else 14
            if size - pos < header:
                self.head = data[pos:]
                return True
            if length == 126:
                length = int.from_bytes(data[pos + 2 : pos + 4], "big")
            elif length == 127:
                length = int.from_bytes(data[pos + 2 : pos + 10], "big")
            pos += header + length
        self.skip = pos - size
        return True


def close_frame(code: int, reason: str = "") -> bytes:
    """A server's close frame (unmasked, §5.5.1): the status code, then the reason in UTF-8.

    ``reason`` must fit a control frame with the code (123 bytes of UTF-8).
    """
    payload = struct.pack("!H", code) + reason.encode()
    if len(payload) > 125:
        raise ValueError("a close frame's reason is at most 123 bytes")
    return bytes((0x88, len(payload))) + payload
