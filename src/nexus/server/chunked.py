"""HTTP/1.1 chunked bodies as the pump (:mod:`nexus.server.streaming`) writes them: the
framing of one chunk (a batch pushed straight to the transport), and a response whose
headers go out with its first bytes and whose end goes out with its last.
"""

from __future__ import annotations

from aiohttp import web

__all__ = ["ChunkedResponse", "chunk"]


def chunk(data: bytes) -> bytes:
    """``data`` as one HTTP/1.1 chunk (RFC 9112 §7.1; ``data`` not empty)."""
    return b"%x\r\n%b\r\n" % (len(data), data)


class ChunkedResponse(web.Response):
    """A chunked response whose headers go out with its first bytes, and its last
    bytes with the end of the body: one write each.

    aiohttp's ``StreamResponse`` sends its headers alone on ``prepare()``; its
    ``Response`` keeps them for the first write, but writes only a body given up
    front at ``write_eof()``.
    """

    async def write_eof(self, data: bytes = b"") -> None:
        await web.StreamResponse.write_eof(self, data)
