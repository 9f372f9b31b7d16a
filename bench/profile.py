"""Where a Nexus process spends its time per chunk: py-spy under a scenario's load.

Starts the fake upstream and ``nexus serve`` (the same config as ``bench/run``),
attaches ``py-spy record --format raw`` to the gateway, drives a scenario's load
through it for ``--seconds`` (``saturation``, ``realistic``, ``ttfb`` for the
per-request costs, or ``idle``: one round of 5,000 slow streams, so ``--seconds 75``),
and prints the functions with the largest share of samples, by
self time and inclusive time (the folded stacks are kept in ``--out``). Needs
``pip install py-spy`` and permission to ptrace the gateway.

Run: ``python -m bench.profile [--scenario realistic] [--format ndjson] [--seconds 20]``
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .harness import FORMATS, Loadgen, Upstream
from .loadgen import Job
from .procfs import raise_nofile
from .scenarios import FULL
from .systems import RedisServer, Variant, pin_running, plan_pinning, start

__all__ = ["main"]

_FRAME = re.compile(r"^(?P<func>.*?) \((?P<file>[^()]*?)(?::(?P<line>\d+))?\)$")


def _short(frame: str) -> str:
    """``func (path:line)`` -> ``func (file.py)``: lines differ per call site, functions do not."""
    match = _FRAME.match(frame.strip())
    if not match:
        return frame.strip()
    path = match["file"]
    for marker in ("site-packages/", "src/", "lib/python3"):
        if marker in path:
            path = path.split(marker, 1)[1]
            break
    return f"{match['func']} ({path})"


def summarize(folded: Path, top: int) -> str:
    """Self and inclusive shares of the functions in py-spy's folded (raw) output."""
    own: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    total = 0
    for line in folded.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = [_short(f) for f in stack.split(";") if f.strip()]
        frames = [f for f in frames if not f.startswith("process ") and not f.startswith("thread ")]
        if not frames:
            continue
        total += count
        own[frames[-1]] += count
        for frame in set(frames):
            inclusive[frame] += count
    lines = [f"{total} samples", "", "self time:"]
    lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in own.most_common(top)]
    lines += ["", "inclusive time:"]
    lines += [f"  {100 * n / total:5.1f}%  {f}" for f, n in inclusive.most_common(top)]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--system", default="nexus", choices=("nexus", "nexus-redis"))
    parser.add_argument("--format", default="sse", choices=FORMATS)
    parser.add_argument(
        "--scenario", default="saturation", choices=("saturation", "realistic", "ttfb", "idle")
    )
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=int, default=250, help="py-spy samples per second")
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("/tmp/nexus-profile.folded"))
    args = parser.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("py-spy is not installed (pip install py-spy)", file=sys.stderr)
        return 2
    raise_nofile()
    scenario = FULL[args.scenario]
    pinning = plan_pinning(sorted(os.sched_getaffinity(0)))
    upstream = Upstream(pinning.upstream)
    loadgen = Loadgen(pinning.load)
    with tempfile.TemporaryDirectory(prefix="nexus-profile-") as tmp:
        redis = RedisServer(Path(tmp)) if args.system == "nexus-redis" else None
        if redis is not None and redis.error:
            print(redis.error, file=sys.stderr)
            return 2
        running = start(Variant(args.system, args.format), upstream.url, Path(tmp), redis)
        try:
            running.wait_ready(60)
            pin_running(running, pinning)
            upstream.configure(scenario.upstream_config())
            assert running.proc is not None
            record = subprocess.Popen(
                [
                    spy,
                    "record",
                    "--pid",
                    str(running.proc.pid),
                    "--rate",
                    str(args.rate),
                    "--nonblocking",
                    "--format",
                    "raw",
                    "--output",
                    str(args.out),
                    "--duration",
                    str(int(args.seconds)),
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            time.sleep(1.0)
            deadline = time.monotonic() + args.seconds - 2
            chunks = 0
            while time.monotonic() < deadline:
                job = Job(
                    url=running.url,
                    format=args.format,
                    model=running.model,
                    streams=scenario.streams,
                    expect=scenario.chunks,
                    stagger_s=scenario.stagger_s,
                    mode=scenario.mode,
                )
                result = loadgen.run(job, lambda: None, 120)
                chunks += sum(s["chunks"] for s in result.get("streams", []))
            _, err = record.communicate(timeout=args.seconds + 30)
            if record.returncode != 0:
                print(f"py-spy failed: {err}", file=sys.stderr)
                return 1
        finally:
            running.stop()
            loadgen.stop()
            upstream.stop()
            if redis is not None:
                redis.stop()
    print(f"{args.system} ({args.format}), {scenario.name} load, {chunks:,} chunks while sampled")
    print(summarize(args.out, args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
