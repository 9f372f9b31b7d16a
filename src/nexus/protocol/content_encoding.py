"""Request bodies sent with a ``Content-Encoding``: which codings are taken, and how
gzip and deflate are inflated without letting a small body become a large one. Sans-I/O.

aiohttp's own decompression is off (``auto_decompress=False``): a route checks the key,
then feeds the compressed bytes to an :class:`Inflater`, which yields the body in pieces
and raises :class:`~nexus.errors.RequestTooLarge` as soon as the total passes the limit,
so a gzip bomb costs the limit's worth of inflating and never one large allocation.

Taken: ``gzip`` (``x-gzip``) and ``deflate`` (RFC 9110 §8.4.1: zlib format, raw deflate
taken too, as browsers do); ``identity`` is no coding. Anything else, or two codings
stacked, is 415 ``unsupported_media_type`` before a byte of the body is read.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Iterator

from ..errors import InvalidRequest, RequestTooLarge, UnsupportedMediaType

__all__ = ["PIECE_BYTES", "Inflater", "content_coding", "too_large"]

PIECE_BYTES = 64 * 1024
"""The most one step inflates: some tens of microseconds of work."""

_WBITS = {"gzip": 16 + zlib.MAX_WBITS, "x-gzip": 16 + zlib.MAX_WBITS, "deflate": zlib.MAX_WBITS}


def content_coding(values: Iterable[str]) -> str | None:
    """The coding to undo (``"gzip"`` or ``"deflate"``) from the ``Content-Encoding``
    values, or None. Raises :class:`UnsupportedMediaType` for another, or for two."""
    codings = [
        token.strip().lower() for value in values for token in value.split(",") if token.strip()
    ]
    codings = [coding for coding in codings if coding != "identity"]
    if not codings:
        return None
    if len(codings) == 1 and codings[0] in _WBITS:
        return "gzip" if codings[0] == "x-gzip" else codings[0]
    shown = ", ".join(codings)
    raise UnsupportedMediaType(
        f"Content-Encoding {shown!r} is not supported: send the body as it is, or "
        "compressed once with gzip or deflate.",
        param="Content-Encoding",
    )


def too_large(limit: int) -> RequestTooLarge:
    return RequestTooLarge(f"The request body is larger than the limit of {limit} bytes.")


class Inflater:
    """One body's gzip or deflate data, inflated in bounded pieces under a limit.

    :meth:`decode` returns a lazy iterator of pieces of at most ``piece_bytes``;
    :meth:`flush` ends the body. Both raise :class:`RequestTooLarge` once the inflated
    (or compressed) size passes ``limit``, and :class:`InvalidRequest` for bad,
    truncated or trailing data. Several gzip members may follow each other (RFC 1952).
    """

    def __init__(self, coding: str, *, limit: int, piece_bytes: int = PIECE_BYTES) -> None:
        if coding not in _WBITS:
            raise ValueError(f"not a coding the inflater takes: {coding!r}")
        self.coding = coding
        self.limit = limit
        self.piece_bytes = piece_bytes
        self.size = 0  # inflated bytes so far
        self.compressed = 0

        self._inflate: zlib._Decompress | None = None
        self._ended = False

    def decode(self, data: bytes) -> Iterator[bytes]:
        self.compressed += len(data)
        if self.compressed > self.limit:
            # Input that inflates to nothing (empty deflate blocks) is bounded too.
            raise too_large(self.limit)
        return self._pieces(data)

    def _pieces(self, data: bytes) -> Iterator[bytes]:
        piece_bytes = self.piece_bytes
        while data:
            if self._ended:
                raise self._invalid("there are bytes after the end of the compressed data")
            inflate = self._inflate
            if inflate is None:
                inflate = self._inflate = self._start(data)
            try:
                piece = inflate.decompress(data, piece_bytes)
                # A full piece may leave output pending inside zlib: ask again, with
                # no new input, until a piece comes back short.
                while len(piece) == piece_bytes:
                    yield self._count(piece)
                    piece = inflate.decompress(inflate.unconsumed_tail, piece_bytes)
            except zlib.error as exc:
                raise self._invalid(str(exc)) from None
            if piece:
                yield self._count(piece)
            data = inflate.unconsumed_tail
            if inflate.eof:
                data = inflate.unused_data
                self._inflate = None
                self._ended = self.coding == "deflate"  # gzip: a next member may follow

    def flush(self) -> None:
        """The body has ended: raises :class:`InvalidRequest` if its data stopped short."""
        if self._inflate is not None:
            raise self._invalid("the compressed data is truncated")

    def _start(self, data: bytes) -> zlib._Decompress:
        wbits = _WBITS[self.coding]
        if self.coding == "deflate" and data[0] & 0x0F != 8:
            wbits = -zlib.MAX_WBITS  # no zlib header: raw deflate data
        return zlib.decompressobj(wbits)

    def _count(self, piece: bytes) -> bytes:
        self.size += len(piece)
        if self.size > self.limit:
            raise too_large(self.limit)
        return piece

    def _invalid(self, why: str) -> InvalidRequest:
        return InvalidRequest(
            f"The request body is not valid {self.coding} data ({why}).",
            param="Content-Encoding",
        )
