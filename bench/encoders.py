"""Frames per second for each registered encoder on a typical content delta.

A micro-benchmark of the per-token hot path (event -> bytes), not a timed
test. Run: ``python bench/encoders.py [--frames N] [--repeat R]``. Each figure
is the best of R runs of N frames; the ratio column compares encoders measured
in the same run, which is what to trust on a shared, noisy machine.
"""

from __future__ import annotations

import argparse
import platform
import sys
import time

from nexus.encoders.registry import default_registry
from nexus.events import Delta, ToolCall
from nexus.types import StreamMeta

SAMPLES = {
    "content delta": Delta(content=" world"),
    "tool-call fragment": ToolCall(index=0, arguments='{"city": '),
}


def measure(encoder_cls: type, event: object, frames: int, repeat: int) -> float:
    meta = StreamMeta.new("openai/gpt-5.1", include_usage=True)
    best = float("inf")
    for _ in range(repeat):
        encoder = encoder_cls(meta)
        encode = encoder.encode
        start = time.perf_counter()
        for _ in range(frames):
            encode(event)
        best = min(best, time.perf_counter() - start)
    return frames / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--frames", type=int, default=200_000)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    print(f"python {sys.version.split()[0]} on {platform.machine()}, {platform.processor() or ''}")
    print(f"best of {args.repeat} x {args.frames} frames\n")
    print("| encoder | event | frames/s | µs/frame | bytes/frame |")
    print("|---|---|---:|---:|---:|")
    meta = StreamMeta.new("openai/gpt-5.1")
    for media_type in default_registry.media_types():
        encoder_cls = default_registry.get(media_type)
        for label, event in SAMPLES.items():
            rate = measure(encoder_cls, event, args.frames, args.repeat)
            size = len(encoder_cls(meta).encode(event))
            print(f"| {media_type} | {label} | {rate:,.0f} | {1e6 / rate:.2f} | {size} |")


if __name__ == "__main__":
    main()
