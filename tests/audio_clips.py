"""Real audio bytes for the tests: WAV files written by Python's ``wave`` module, and MPEG
audio streams of frames whose headers are built bit by bit from the MPEG-1/2/2.5 layer
I-III header layout (their payloads are silence: a frame's length and duration are in its
header alone)."""

from __future__ import annotations

import base64
import io
import math
import wave

__all__ = ["b64", "mp3", "mp3_frame", "wav"]

KBPS_MPEG1_LAYER3 = (32, 40, 48, 56, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320)
KBPS_MPEG2_LAYER3 = (8, 16, 24, 32, 40, 48, 56, 64, 80, 96, 112, 128, 144, 160)
RATES = {"1": (44100, 48000, 32000), "2": (22050, 24000, 16000), "2.5": (11025, 12000, 8000)}
VERSION_BITS = {"1": 0b11, "2": 0b10, "2.5": 0b00}


def wav(seconds: float, rate: int = 16000, channels: int = 1, width: int = 2) -> bytes:
    """A PCM WAV file of ``seconds`` of silence."""
    out = io.BytesIO()
    with wave.open(out, "wb") as file:
        file.setnchannels(channels)
        file.setsampwidth(width)
        file.setframerate(rate)
        file.writeframes(bytes(round(seconds * rate) * channels * width))
    return out.getvalue()


def mp3_frame(kbps: int, version: str = "1", rate: int | None = None) -> tuple[bytes, float]:
    """One layer III frame at ``kbps`` (MPEG ``version`` 1, 2 or 2.5; ``rate`` its sample
    rate, the version's first by default), and its duration in seconds."""
    rates = RATES[version]
    rate = rates[0] if rate is None else rate
    table = KBPS_MPEG1_LAYER3 if version == "1" else KBPS_MPEG2_LAYER3
    second = 0xE0 | VERSION_BITS[version] << 3 | 0b01 << 1 | 1  # layer III, no CRC
    third = (table.index(kbps) + 1) << 4 | rates.index(rate) << 2
    samples, slots = (1152, 144) if version == "1" else (576, 72)
    length = slots * kbps * 1000 // rate  # no padding bit
    return bytes([0xFF, second, third, 0xC4]) + bytes(length - 4), samples / rate


def mp3(seconds: float, kbps: int, version: str = "1", rate: int | None = None) -> bytes:
    """A constant-bitrate stream of frames lasting at least ``seconds``."""
    frame, duration = mp3_frame(kbps, version, rate)
    return frame * math.ceil(round(seconds / duration, 6))


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()
