"""The request-body inflater and the choice of coding (sans-I/O)."""

from __future__ import annotations

import gzip
import zlib

import pytest

from nexus.errors import InvalidRequest, RequestTooLarge, UnsupportedMediaType
from nexus.protocol.content_encoding import Inflater, content_coding


@pytest.mark.parametrize(
    ("values", "coding"),
    [
        ((), None),
        (("identity",), None),
        (("",), None),
        (("gzip",), "gzip"),
        (("GZip ",), "gzip"),
        (("x-gzip",), "gzip"),
        (("deflate",), "deflate"),
        (("identity, gzip",), "gzip"),
    ],
)
def test_codings_taken(values: tuple[str, ...], coding: str | None) -> None:
    assert content_coding(values) == coding


@pytest.mark.parametrize(
    "values",
    [("br",), ("zstd",), ("compress",), ("snappy",), ("gzip, gzip",), ("gzip", "deflate")],
)
def test_codings_refused(values: tuple[str, ...]) -> None:
    with pytest.raises(UnsupportedMediaType) as refused:
        content_coding(values)
    assert refused.value.status == 415
    assert refused.value.code == "unsupported_media_type"


def inflate(inflater: Inflater, data: bytes, step: int = 1000) -> bytes:
    out = []
    for i in range(0, len(data), step):
        out.extend(inflater.decode(data[i : i + step]))
    inflater.flush()
    return b"".join(out)


BODY = b'{"messages": "' + b"the quick brown fox " * 20_000 + b'"}'


@pytest.mark.parametrize(
    ("coding", "data"),
    [
        ("gzip", gzip.compress(BODY)),
        ("deflate", zlib.compress(BODY)),
        ("deflate", zlib.compress(BODY)[2:-4]),  # raw deflate, as some clients send it
        ("gzip", gzip.compress(BODY[:1000]) + gzip.compress(BODY[1000:])),  # two members
    ],
)
def test_round_trip_in_bounded_pieces(coding: str, data: bytes) -> None:
    inflater = Inflater(coding, limit=len(BODY), piece_bytes=4096)
    pieces = [
        piece for i in range(0, len(data), 700) for piece in inflater.decode(data[i : i + 700])
    ]
    inflater.flush()
    assert b"".join(pieces) == BODY
    assert max(map(len, pieces)) <= 4096
    assert inflater.size == len(BODY)


def test_a_bomb_stops_one_piece_past_the_limit() -> None:
    bomb = zlib.compress(bytes(64 << 20), 9)  # 64 MiB of zeros in ~64 KiB
    inflater = Inflater("deflate", limit=1 << 20, piece_bytes=65536)
    pieces = inflater.decode(bomb)  # one chunk in: nothing inflated yet
    assert inflater.size == 0
    seen = 0
    with pytest.raises(RequestTooLarge):
        for piece in pieces:
            seen += len(piece)
    assert seen == 1 << 20  # the piece that passed the limit was never handed out
    assert inflater.size == (1 << 20) + 65536


def test_compressed_input_counts_against_the_limit_too() -> None:
    # Empty stored blocks inflate to nothing: the compressed size is bounded instead.
    empty_blocks = b"\x00\x00\x00\xff\xff" * 1000
    inflater = Inflater("deflate", limit=4096)
    with pytest.raises(RequestTooLarge):
        for _ in range(10):
            list(inflater.decode(empty_blocks))


@pytest.mark.parametrize(
    ("coding", "data"),
    [
        ("gzip", b"\x1f\x8b\x08\x00" + bytes(range(256))),  # garbage after a gzip header
        ("gzip", b'{"plain": "json"}'),  # not gzip at all
        ("gzip", gzip.compress(BODY) + b"trailing"),  # a second 'member' that is not one
        ("deflate", zlib.compress(BODY) + b"trailing"),
        ("gzip", gzip.compress(BODY)[:-10]),  # truncated
        ("deflate", zlib.compress(BODY)[:-10]),
    ],
)
def test_invalid_data_is_an_invalid_request(coding: str, data: bytes) -> None:
    inflater = Inflater(coding, limit=1 << 30)
    with pytest.raises(InvalidRequest) as refused:
        inflate(inflater, data)
    assert refused.value.status == 400
    assert refused.value.code == "invalid_request"
    assert f"not valid {coding} data" in refused.value.message


def test_an_empty_body_is_empty() -> None:
    inflater = Inflater("gzip", limit=10)
    assert inflate(inflater, b"") == b""
