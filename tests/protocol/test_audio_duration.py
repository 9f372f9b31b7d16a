"""nexus.protocol.audio_duration: a WAV's duration from its header, an MP3's from its
frames (constant and variable bitrates, every MPEG version), and what does not parse at
the floor rate, which no MPEG frame runs longer than: never counted short."""

from __future__ import annotations

import random
import struct

import pytest

from audio_clips import mp3, mp3_frame, wav
from nexus.protocol import audio_duration
from nexus.protocol.audio_duration import (
    FLOOR_BYTES_PER_S,
    _frames,
    audio_seconds,
    mp3_seconds,
    wav_seconds,
)


@pytest.mark.parametrize(
    ("rate", "channels", "width"),
    [(8000, 1, 1), (16000, 1, 2), (24000, 1, 2), (44100, 2, 2), (48000, 2, 3), (96000, 1, 4)],
)
def test_a_wav_runs_as_long_as_its_samples(rate: int, channels: int, width: int) -> None:
    data = wav(2.5, rate, channels, width)
    assert wav_seconds(data) == pytest.approx(2.5)
    assert audio_seconds(data, "wav") == pytest.approx(2.5)


def test_a_wav_s_other_chunks_do_not_count_and_a_streamed_size_is_read_to_the_end() -> None:
    data = wav(3.0)
    header, fmt, rest = data[:12], data[12:36], data[36:]
    listed = header + b"LIST" + struct.pack("<I", 9) + b"INFOtitle" + b"\0" + fmt + rest
    assert wav_seconds(listed) == pytest.approx(3.0)
    # A streamed WAV's data size says 0 or 4 GiB: the bytes that came are what runs.
    for size in (0, 0xFFFFFFFF):
        streamed = data[:40] + struct.pack("<I", size) + data[44:]
        assert wav_seconds(streamed) == pytest.approx(3.0)


def test_a_wav_that_does_not_time_its_samples_counts_at_the_floor() -> None:
    data = wav(1.0)  # 32,000 bytes
    floor = len(data) / FLOOR_BYTES_PER_S
    adpcm = data[:20] + struct.pack("<H", 2) + data[22:]  # a declared byte rate: not believed
    too_fast = data[:24] + struct.pack("<I", 10**9) + data[28:]  # a made-up sample rate
    for lying in (adpcm, too_fast, b"not a wav at all" * 100, data[:30], mp3(1, 32)):
        assert wav_seconds(lying) is None
        assert audio_seconds(lying, "wav") == len(lying) / FLOOR_BYTES_PER_S
    assert audio_seconds(data, "wav") < floor  # what parses counts as it runs


@pytest.mark.parametrize(
    ("version", "kbps", "rate"),
    [
        ("1", 128, 44100),
        ("1", 32, 32000),
        ("1", 320, 48000),
        ("2", 8, 24000),  # 1,000 bytes a second: ten minutes in 600 KB
        ("2", 64, 22050),
        ("2.5", 8, 8000),
    ],
)
def test_a_constant_bitrate_mp3_runs_as_long_as_its_frames(
    version: str, kbps: int, rate: int
) -> None:
    frame, duration = mp3_frame(kbps, version, rate)
    data = frame * 1000
    assert mp3_seconds(data) == pytest.approx(1000 * duration)
    assert audio_seconds(data, "mp3") == pytest.approx(1000 * duration)
    # Its length in time, whatever its bitrate: 10 minutes are 10 minutes.
    assert mp3_seconds(mp3(600, kbps, version, rate)) == pytest.approx(600, abs=duration)


def test_a_variable_bitrate_mp3_runs_as_long_as_its_frames() -> None:
    rng = random.Random(7)
    frames = [mp3_frame(rng.choice((32, 64, 128, 256, 320))) for _ in range(500)]
    padded = bytearray(mp3_frame(128)[0])
    padded[2] |= 0b10  # the padding bit: one byte more, the same duration
    data = b"".join(frame for frame, _ in frames) + bytes(padded) + b"\0" + mp3_frame(40)[0]
    expected = sum(duration for _, duration in frames) + 2 * 1152 / 44100
    assert mp3_seconds(data) == pytest.approx(expected)


def test_a_walk_stops_at_its_steps_and_counts_the_rest_at_the_floor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A body with a candidate header at every byte cost one Python step a byte (32 MB
    stalled the event loop for half a second): a walk looks at ``MAX_STEPS`` at most, and
    what it did not reach counts at the floor, never short."""
    frame, duration = mp3_frame(128)
    monkeypatch.setattr(audio_duration, "MAX_STEPS", 100)
    data = frame * 300
    rest = len(frame) * 200
    assert mp3_seconds(data) == pytest.approx(100 * duration + rest / FLOOR_BYTES_PER_S)
    assert mp3_seconds(data) > 300 * duration
    crafted = b"\xff" * 5000  # a header candidate at every byte, no frame
    monkeypatch.setattr(audio_duration, "MAX_UNFRAMED", 1000)
    assert mp3_seconds(crafted) == pytest.approx(len(crafted) / FLOOR_BYTES_PER_S)
    assert mp3_seconds(crafted + data) == pytest.approx(len(crafted + data) / FLOOR_BYTES_PER_S)


def test_every_layer_s_frame_lasts_no_longer_than_its_bytes_at_the_floor() -> None:
    table = _frames()
    # Versions, layers, bitrates, sample rates; and the CRC, padding and private bits.
    assert len(table) == 3 * 3 * 14 * 3 * 2 * 2 * 2
    for length, seconds in table.values():
        assert seconds <= length / FLOOR_BYTES_PER_S
    # The floor is 8 kbit/s, a frame's own (one whose length is rounded down the most).
    assert 8000 / 8 * 0.99 < FLOOR_BYTES_PER_S <= 8000 / 8
    frame, seconds = mp3_frame(8, "2.5", 11025)
    assert seconds == pytest.approx(len(frame) / FLOOR_BYTES_PER_S)


def test_id3_tags_are_not_audio_unless_their_size_lies() -> None:
    audio = mp3(2, 128)
    art = bytes(200_000)  # a cover image: 200 s at the floor, were it counted
    size = len(art)
    syncsafe = bytes([size >> 21 & 0x7F, size >> 14 & 0x7F, size >> 7 & 0x7F, size & 0x7F])
    tag = b"ID3\x04\x00\x00" + syncsafe + art
    v1 = b"TAG" + bytes(125)
    assert mp3_seconds(tag + audio + v1) == pytest.approx(mp3_seconds(audio))
    # A size past the end would hide the audio behind it: walked as any bytes are.
    lying = b"ID3\x04\x00\x00\x7f\x7f\x7f\x7f" + audio
    assert mp3_seconds(lying) >= mp3_seconds(audio)


def test_bytes_that_are_not_frames_count_at_the_floor() -> None:
    noise = bytes(b for b in range(256) if b != 0xFF) * 400  # no sync byte at all
    assert mp3_seconds(noise) == len(noise) / FLOOR_BYTES_PER_S
    rng = random.Random(3)
    garbage = rng.randbytes(300_000)  # sync bytes, headers by chance: no stream of frames
    assert mp3_seconds(garbage) == pytest.approx(len(garbage) / FLOOR_BYTES_PER_S, rel=1e-3)
    # Frames among garbage: the frames as they run, the garbage at the floor.
    audio = mp3(5, 64)
    mixed = noise + audio + noise
    floor = 2 * len(noise) / FLOOR_BYTES_PER_S
    assert mp3_seconds(mixed) == pytest.approx(mp3_seconds(audio) + floor)


def test_a_lone_header_is_not_a_stream_nor_a_free_format_frame() -> None:
    """A header must be followed by the next frame's (as decoders find a stream), or end
    the data; a free-format frame (bitrate index 0) gives no length: both at the floor."""
    frame, _ = mp3_frame(320)  # 1,044 bytes, 26 ms
    noise = bytes(range(0x100 - 1)) * 10
    lone = noise + frame + noise
    assert mp3_seconds(lone) == len(lone) / FLOOR_BYTES_PER_S
    free = bytearray(frame)
    free[2] &= 0x0F
    assert mp3_seconds(bytes(free) * 100) == 100 * len(free) / FLOOR_BYTES_PER_S


def test_pcm16_runs_at_its_sample_rate_and_other_formats_at_the_floor() -> None:
    pcm = bytes(48_000)
    assert audio_seconds(pcm, "pcm16") == 1.0  # 24 kHz by default
    assert audio_seconds(pcm, "pcm16", 16000) == 1.5
    floor = len(pcm) / FLOOR_BYTES_PER_S
    for lying in (10**9, "16000", 0, True):
        assert audio_seconds(pcm, "pcm16", lying) == floor
    assert audio_seconds(pcm, "flac") == floor
    assert audio_seconds(b"", "mp3") == audio_seconds(b"", "wav") == 0.0
