"""MaskScanner: frame headers followed across reads; close_frame bytes."""

from __future__ import annotations

import os
import struct

import pytest

from nexus.protocol.websocket_frames import MaskScanner, close_frame


def frame(payload: bytes, *, masked: bool = True, opcode: int = 1) -> bytes:
    """A client frame with the shortest length encoding (RFC 6455 §5.2)."""
    size = len(payload)
    mask_bit = 0x80 if masked else 0
    if size < 126:
        head = bytes((0x80 | opcode, mask_bit | size))
    elif size < 65536:
        head = bytes((0x80 | opcode, mask_bit | 126)) + struct.pack("!H", size)
    else:
        head = bytes((0x80 | opcode, mask_bit | 127)) + struct.pack("!Q", size)
    if not masked:
        return head + payload
    key = os.urandom(4)
    return head + key + bytes(b ^ key[i % 4] for i, b in enumerate(payload))


SIZES = [0, 1, 125, 126, 127, 65535, 65536, 70000]


@pytest.mark.parametrize("size", SIZES)
def test_masked_frames_pass_whole(size: int) -> None:
    scanner = MaskScanner()
    assert scanner.feed(frame(b"x" * size) + frame(b"y"))
    assert scanner.skip == 0 and scanner.head == b""


@pytest.mark.parametrize("size", SIZES)
def test_an_unmasked_frame_after_masked_ones_fails(size: int) -> None:
    scanner = MaskScanner()
    assert not scanner.feed(frame(b"x" * size) + frame(b"hello", masked=False))
    assert not scanner.feed(frame(b"later"))  # and stays failed


@pytest.mark.parametrize("step", [1, 2, 3, 7, 13, 1000])
def test_any_split_across_reads(step: int) -> None:
    data = b"".join(frame(b"p" * n) for n in (0, 5, 125, 126, 300, 65536, 3))
    scanner = MaskScanner()
    for pos in range(0, len(data), step):
        assert scanner.feed(data[pos : pos + step])
    assert scanner.skip == 0 and scanner.head == b""
    bad = frame(b"x" * 200) + frame(b"bad", masked=False)
    verdicts = [scanner.feed(bad[pos : pos + step]) for pos in range(0, len(bad), step)]
    assert verdicts[-1] is False
    mask_bit_at = 200 + 8 + 1  # after a 8-byte header and 200 bytes of payload, its 2nd byte
    assert verdicts.index(False) == mask_bit_at // step  # the read that holds it


def test_inside_a_payload_costs_no_parsing() -> None:
    scanner = MaskScanner()
    data = frame(b"z" * 100_000)
    assert scanner.feed(data[:10])  # a header split: kept until whole
    assert scanner.head == data[:10]
    assert scanner.feed(data[10:20])  # the 14-byte header and 6 payload bytes
    assert (scanner.head, scanner.skip) == (b"", 100_000 - 6)
    assert scanner.feed(b"\0" * 50_000)  # inside the payload: counted, not parsed
    assert scanner.skip == 100_000 - 6 - 50_000


def test_an_unmasked_header_fails_before_it_is_whole() -> None:
    scanner = MaskScanner()
    assert not scanner.feed(b"\x82\x7e")  # a 16-bit length to come, but no mask bit


@pytest.mark.parametrize(
    ("code", "reason", "expected"),
    [
        (1002, "", b"\x88\x02\x03\xea"),
        (1000, "bye", b"\x88\x05\x03\xe8bye"),
        (1002, "é", b"\x88\x04\x03\xea\xc3\xa9"),
    ],
)
def test_close_frame(code: int, reason: str, expected: bytes) -> None:
    assert close_frame(code, reason) == expected


def test_close_frame_reason_fits_a_control_frame() -> None:
    assert len(close_frame(1002, "r" * 123)) == 127
    with pytest.raises(ValueError):
        close_frame(1002, "r" * 124)
