"""How long a piece of audio runs, from its bytes alone. Sans-I/O.

OpenAI bills audio by its length in time, not in bytes: the same ten minutes are 600 KB
as an 8 kbit/s MP3 and 19 MB as a 16 kHz WAV. A budget that estimated audio by its bytes
held a tenth of what a low-bitrate MP3 was billed, so the duration is read from the audio
itself: a WAV's header gives its sample rate and sample size, an MP3 is walked
frame by frame (each frame's header gives its bitrate and sample rate, so its length and
duration: exact for constant and variable bitrates alike).

What does not parse counts at :data:`FLOOR_BYTES_PER_S` (8 kbit/s, the lowest bitrate of
an MP3 frame): no MPEG audio frame lasts longer than its bytes at that rate, so bytes
that are not frames, or audio Nexus cannot time, are never counted short (the estimate
may be long: 128 kbit/s audio that does not parse counts 16 times its length).
"""

from __future__ import annotations

import re
import struct

__all__ = [
    "FLOOR_BYTES_PER_S",
    "MAX_SAMPLE_RATE",
    "MAX_STEPS",
    "MAX_UNFRAMED",
    "audio_seconds",
    "mp3_seconds",
    "wav_seconds",
]

MAX_SAMPLE_RATE = 384_000
"""The highest sample rate believed of a header: more is taken for a header that lies
(a made-up rate would shorten the audio it times)."""

_PCM_FORMATS = frozenset({1, 3, 6, 7})
"""WAV format tags timed by their samples: PCM, IEEE float, A-law, µ-law. Others (ADPCM,
MP3 in WAV, ...) declare an average byte rate a file may invent: not believed."""
_EXTENSIBLE = 0xFFFE


def audio_seconds(data: bytes, fmt: str, sample_rate: object = None) -> float:
    """How long ``data`` runs as ``fmt`` (``wav``, ``mp3``, or ``pcm16`` at ``sample_rate``,
    24 kHz by default: Nexus's realtime clips); anything that does not parse, at
    :data:`FLOOR_BYTES_PER_S`."""
    if fmt == "mp3":
        return mp3_seconds(data)
    seconds = None
    if fmt == "wav":
        seconds = wav_seconds(data)
    elif fmt == "pcm16":
        rate = 24_000 if sample_rate is None else sample_rate
        if type(rate) is int and 0 < rate <= MAX_SAMPLE_RATE:
            seconds = len(data) / (2 * rate)
    return len(data) / FLOOR_BYTES_PER_S if seconds is None else seconds


def wav_seconds(data: bytes) -> float | None:
    """How long a RIFF WAVE file of PCM, float, A-law or µ-law samples runs: the bytes
    after its ``data`` chunk's header (to the end: a streamed WAV's size field says 0 or
    4 GiB) over its sample rate times its sample frame. None: not such a file."""
    n = len(data)
    if n < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return None
    pos, frame_rate = 12, 0
    while pos + 8 <= n:
        chunk, size = data[pos : pos + 4], int.from_bytes(data[pos + 4 : pos + 8], "little")
        body = pos + 8
        if chunk == b"fmt ":
            if size < 16 or body + 16 > n:
                return None
            tag, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", data, body)
            if tag == _EXTENSIBLE and size >= 26 and body + 26 <= n:
                tag = int.from_bytes(data[body + 24 : body + 26], "little")  # its subformat
            sample = -(-bits // 8)
            if (
                tag not in _PCM_FORMATS
                or not 1 <= channels <= 8
                or not 1 <= sample <= 8
                or not 0 < rate <= MAX_SAMPLE_RATE
            ):
                return None
            frame_rate = rate * channels * sample
        elif chunk == b"data":
            return (n - body) / frame_rate if frame_rate else None
        pos = body + size + (size & 1)
    return None


# MPEG audio frame headers: 11 sync bits, version (2), layer (2), CRC (1); bitrate index
# (4), sample rate index (2), padding (1), private (1); channel bits (8).
_KBPS = {
    (1, 1): (32, 64, 96, 128, 160, 192, 224, 256, 288, 320, 352, 384, 416, 448),
    (1, 2): (32, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384),
    (1, 3): (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320),
    (2, 1): (32, 48, 56, 64, 80, 96, 112, 128, 144, 160, 176, 192, 224, 256),
    (2, 2): (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
    (2, 3): (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160),
}
"""Kbit/s by (MPEG version: 1, or 2 for 2 and 2.5; layer), bitrate indexes 1 to 14."""
_RATES = {3: (44100, 48000, 32000), 2: (22050, 24000, 16000), 0: (11025, 12000, 8000)}
"""Sample rates by the version bits (3: MPEG-1, 2: MPEG-2, 0: MPEG-2.5)."""


def _frames() -> dict[int, tuple[int, float]]:
    """(frame length in bytes, seconds) of every valid header by its 2nd and 3rd bytes."""
    table: dict[int, tuple[int, float]] = {}
    for second in range(0xE0, 0x100):
        version_bits, layer_bits = (second >> 3) & 3, (second >> 1) & 3
        if version_bits == 1 or layer_bits == 0:
            continue  # reserved
        version, layer = (1 if version_bits == 3 else 2), 4 - layer_bits
        for third in range(0x100):
            bitrate_index, rate_index, padding = third >> 4, (third >> 2) & 3, (third >> 1) & 1
            if bitrate_index in (0, 15) or rate_index == 3:
                continue  # free format, or reserved
            bitrate = _KBPS[version, layer][bitrate_index - 1] * 1000
            rate = _RATES[version_bits][rate_index]
            if layer == 1:
                length, samples = (12 * bitrate // rate + padding) * 4, 384
            elif layer == 2 or version == 1:
                length, samples = 144 * bitrate // rate + padding, 1152
            else:  # layer III of MPEG-2 and 2.5: half the samples
                length, samples = 72 * bitrate // rate + padding, 576
            table[second << 8 | third] = (length, samples / rate)
    return table


_FRAMES = _frames()
FLOOR_BYTES_PER_S = min(length / seconds for length, seconds in _FRAMES.values())
"""About 995: the fewest bytes a second of MPEG audio holds (8 kbit/s, the lowest bitrate,
of MPEG-2 and 2.5 layers II and III, in a frame whose length is rounded down and not
padded), so the longest any byte of audio can run. (Free-format frames, of a bitrate no
header gives, are not counted as frames: their bytes count at this rate.)"""
_SAME_STREAM = 0xFE0C
"""Of the 2nd and 3rd bytes, what the frames of one stream share: version, layer and
sample rate (as decoders check when they look for a stream's first frame)."""
_SYNC = re.compile(
    b"\xff["
    + re.escape(bytes(sorted({key >> 8 for key in _FRAMES})))
    + b"]["
    + re.escape(bytes(sorted({key & 0xFF for key in _FRAMES})))
    + b"]"
)
"""Where a frame header may start: found in C, so that bytes that are not frames cost no
Python loop."""
MAX_STEPS = 100_000
"""The most frames and candidate headers one walk looks at: 43 minutes of 44.1 kHz MP3,
~0.1 s of the event loop at most (as long as decoding the 32 MB of base64 it came in)."""
MAX_UNFRAMED = 1 << 20
"""The most bytes that are not frames one walk searches for a header: the search is in C,
but 32 MB of ``0xFF`` (a candidate at every byte) took it half a second. Past either
bound the rest counts at :data:`FLOOR_BYTES_PER_S`, never short: a body crafted to be slow
to walk cannot stall the gateway's other streams for long."""


def mp3_seconds(data: bytes) -> float:
    """How long an MPEG audio stream runs: the sum of its frames' durations, between its
    ID3 tags (v2 at the start, v1 at the end). A frame found after bytes that are not
    frames (at the start, or after garbage) counts once the next frame's header follows it
    where its length says (or it ends the data), as decoders find a stream; bytes between
    frames, and those past :data:`MAX_STEPS` or :data:`MAX_UNFRAMED`, count at
    :data:`FLOOR_BYTES_PER_S`."""
    n, frames, sync = len(data), _FRAMES, _SYNC
    if n >= 128 and data[-128:-125] == b"TAG":
        n -= 128  # an ID3v1 tag ends the file: metadata
    pos = _after_id3(data)
    seconds, unframed, synced = 0.0, 0, False
    for _ in range(MAX_STEPS):
        if pos + 4 > n or unframed >= MAX_UNFRAMED:
            break
        frame = frames.get(data[pos + 1] << 8 | data[pos + 2]) if data[pos] == 0xFF else None
        if frame is not None:
            length, duration = frame
            end = pos + length
            if synced or end == n or _follows(data, end, n, data[pos + 1] << 8 | data[pos + 2]):
                seconds += duration
                pos, synced = end, True
                continue
        synced = False
        bound = min(n, pos + 1 + MAX_UNFRAMED - unframed)
        found = sync.search(data, pos + 1, bound)
        resume = bound if found is None else found.start()
        unframed += resume - pos
        pos = resume
    return seconds + (unframed + max(n - pos, 0)) / FLOOR_BYTES_PER_S


def _follows(data: bytes, pos: int, n: int, header: int) -> bool:
    """Whether a frame of the same stream as ``header`` starts at ``pos`` (before ``n``)."""
    if pos + 3 > n or data[pos] != 0xFF:
        return False
    other = data[pos + 1] << 8 | data[pos + 2]
    return other in _FRAMES and (other ^ header) & _SAME_STREAM == 0


def _after_id3(data: bytes) -> int:
    """Where the audio starts after the ID3v2 tags at the start of ``data`` (metadata,
    cover art: not audio, skipped by decoders), each of a size within the data."""
    pos = 0
    while data[pos : pos + 3] == b"ID3" and pos + 10 <= len(data):
        size = data[pos + 6 : pos + 10]
        if any(byte & 0x80 for byte in size):
            break  # not a tag's syncsafe size
        footer = 10 if data[pos + 5] & 0x10 else 0
        end = pos + 10 + footer + (size[0] << 21 | size[1] << 14 | size[2] << 7 | size[3])
        if end > len(data):
            break  # a size past the end would hide the audio after it: walked instead
        pos = end
    return pos
