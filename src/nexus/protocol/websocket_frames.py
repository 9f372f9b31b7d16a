"""WebSocket frame headers, read without reading frames: the client-masking check.

RFC 6455 §5.1: a server must close the connection (1002, §7.4.1) on a client frame
that is not masked; aiohttp's reader takes one as it is, so the connection layer runs
the client's bytes through a :class:`MaskScanner` first. It reads frame headers only
(§5.2) and skips payloads by their length. Sans-I/O: bytes in, a verdict out.
"""

from __future__ import annotations

import struct

__all__ = ["MaskScanner", "close_frame", "text_frames"]

_MASKED = 0x80


class MaskScanner:
    """Follows the frame boundaries of a client's byte stream."""

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
    """A server's close frame (unmasked, §5.5.1); ``reason`` is 123 bytes of UTF-8 at most."""

    payload = struct.pack("!H", code) + reason.encode()
    if len(payload) > 125:
        raise ValueError("a close frame's reason is at most 123 bytes")
    return bytes((0x88, len(payload))) + payload


_SHORT_HEADS = [bytes((0x81, size)) for size in range(126)]  # final, text, unmasked (§5.2)


def text_frames(payloads: list[bytes]) -> bytes:
    """One server text frame per payload (UTF-8), final, unmasked and uncompressed
    (§5.2), back to back: what aiohttp's writer gives for each, in one piece."""
    out = []
    for payload in payloads:
        size = len(payload)
        if size < 126:
            out.append(_SHORT_HEADS[size])
        elif size < 65536:
            out.append(b"\x81\x7e" + size.to_bytes(2, "big"))
        else:
            out.append(b"\x81\x7f" + size.to_bytes(8, "big"))
        out.append(payload)
    return b"".join(out)
