"""The benchmark scenarios (bench/README.md): their sizes, and the figures drawn from each run.

Definitions (the README repeats them):

* **chunks/s**: content chunks received by all streams / wall time from the first
  connect to the last stream's end.
* **CPU µs/chunk**: CPU time of the gateway's process tree (every thread, from
  /proc schedstat) over the run / chunks delivered. Direct has no gateway. For
  the ``nexus-redis*`` systems, Redis's own CPU is apart: **store CPU µs/chunk**;
  the load side's (upstream and load generator) is **load CPU µs/chunk**.
* **scaling** (``scaleout``): chunks/s of a system / chunks/s of its one-process twin
  (``nexus`` for the memory store, ``nexus-redis`` for Redis) in the same round.
* **cores** (``scaleout``): CPU seconds over the run / wall seconds, of the gateway, of
  the load side with Redis (on 2 CPUs they share one: near 1.0, it is the limit), and of
  other jobs (the host's busy time from /proc/stat, less the run's own).
* **TTFB / TTFC**: from the moment the stream's connection is opened (the request
  goes out right after) to the first byte of the response / the first content chunk.
* **delay**: per chunk, its arrival at the load generator minus the send time the
  upstream stamped into it (both CLOCK_MONOTONIC). **added latency pX** = pX of the
  delays through the system minus pX through direct in the same round: chunks cannot
  be paired across systems, their distributions can.
* Every figure is taken per round, then the median over rounds is reported.
* **RSS/stream**: (peak RSS of the gateway's processes while the streams are open -
  RSS after warm-up, before the load) / the most streams open at once (all of them,
  unless the gateway could not open the last before the first ended). Sampled every
  0.25 s.
* **abort → upstream closed**: from the WebSocket ``abort`` sent to the moment the
  upstream saw its connection close (both CLOCK_MONOTONIC).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from typing import Any

from .systems import SCALEOUT_SYSTEMS, Variant

__all__ = ["FULL", "OPT_IN", "SMOKE", "Scenario", "aggregate", "percentile", "run_figures"]

_REQUEST_ID = re.compile(r',?"request_id": ?"[^"]*"')


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    streams: int
    chunks: int
    delay_ms: float
    stamp: bool = False
    batch: int = 1
    mode: str = "streams"
    stagger_s: float = 0.0
    ws_only: bool = False
    timeout_s: float = 300.0
    max_rounds: int | None = None
    """Cap on ``--rounds`` for a scenario whose runs are long and whose figure (RSS) is
    not one that timing noise moves."""
    systems: tuple[str, ...] | None = None
    """The only systems it runs, in OpenAI SSE (None: every system, every format)."""

    def applies(self, variant: Variant) -> bool:
        if self.systems is not None:
            return variant.system in self.systems and variant.format == "sse"
        return variant.format == "ws" if self.ws_only else True

    def upstream_config(self) -> dict[str, Any]:
        return {
            "chunks": self.chunks,
            "delay_ms": self.delay_ms,
            "stamp": self.stamp,
            "batch": self.batch,
        }


def _scenarios(*items: Scenario) -> dict[str, Scenario]:
    return {s.name: s for s in items}


FULL = _scenarios(
    Scenario(
        "saturation",
        "50 streams x 2,000 chunks, no delay (the upstream writes 16 frames per write)",
        streams=50,
        chunks=2000,
        delay_ms=0,
        batch=16,
    ),
    Scenario(
        "realistic",
        "200 streams x 100 tokens at 20 ms, started over 0.5 s",
        streams=200,
        chunks=100,
        delay_ms=20,
        stamp=True,
        stagger_s=0.5,
    ),
    Scenario(
        "idle",
        "5,000 concurrent streams x 60 tokens at 1 token/s (one round)",
        streams=5000,
        chunks=60,
        delay_ms=1000,
        timeout_s=240,
        max_rounds=1,
    ),
    Scenario(
        "ttfb",
        "200 sequential requests (5 chunks each) on one keep-alive connection",
        streams=200,
        chunks=5,
        delay_ms=0,
        mode="sequential",
    ),
    Scenario(
        "ws_abort",
        "50 WebSocket turns aborted after their first chunk (upstream: 10 ms per token)",
        streams=50,
        chunks=100_000,
        delay_ms=10,
        mode="ws_abort",
        ws_only=True,
        timeout_s=30,
    ),
    Scenario(
        "scaleout",
        "100 streams x 2,000 chunks, no delay, through 1, 2 and 4 workers and two processes",
        streams=100,
        chunks=2000,
        delay_ms=0,
        batch=16,
        systems=SCALEOUT_SYSTEMS,
    ),
)

SMOKE = _scenarios(
    Scenario("saturation", "smoke: 5 streams x 20 chunks", 5, 20, 0, batch=16, timeout_s=30),
    Scenario(
        "realistic",
        "smoke: 5 streams x 10 tokens at 5 ms",
        5,
        10,
        5,
        stamp=True,
        stagger_s=0.01,
        timeout_s=30,
    ),
    Scenario("idle", "smoke: 20 streams x 2 tokens at 100 ms", 20, 2, 100, timeout_s=30),
    Scenario("ttfb", "smoke: 5 sequential requests", 5, 5, 0, mode="sequential", timeout_s=30),
    Scenario(
        "ws_abort",
        "smoke: 3 aborted WebSocket turns",
        3,
        10_000,
        10,
        mode="ws_abort",
        ws_only=True,
        timeout_s=30,
    ),
    Scenario(
        "scaleout",
        "smoke: 8 streams x 20 chunks",
        8,
        20,
        0,
        batch=16,
        timeout_s=30,
        systems=SCALEOUT_SYSTEMS,
    ),
)
OPT_IN = ("scaleout",)
"""Run only when named (``--scenario``): not part of the default run."""


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0-100), linear between closest ranks; None if no values."""
    if not values:
        return None
    data = sorted(values)
    pos = (len(data) - 1) * q / 100
    low, high = math.floor(pos), math.ceil(pos)
    return data[low] + (data[high] - data[low]) * (pos - low)


def run_figures(
    result: dict[str, Any],
    cpu_s: float | None,
    rss_before: int | None,
    rss_peak: int | None,
) -> dict[str, Any]:
    """The figures of one run (one variant, one round), from the load generator's
    result and the gateway's CPU and RSS."""
    streams = result["streams"]
    chunks = sum(s["chunks"] for s in streams)
    wall = result.get("wall_s")
    # The same error of many streams once, with its count; request ids told apart nothing.
    kinds = Counter(_REQUEST_ID.sub("", s["error"]) for s in streams if s["error"])
    errors = [f"{n} x {error}" for error, n in kinds.most_common()]
    run: dict[str, Any] = {
        "streams": len(streams),
        "ok": sum(1 for s in streams if s["ok"]),
        "errors": errors[:5],
        "chunks": chunks,
        "bytes": sum(s["bytes"] for s in streams),
        "wall_s": wall,
        "chunks_per_s": chunks / wall if wall else None,
        "peak_open": result.get("peak_open"),
        "ramp_s": result.get("ramp_s"),
        "gaps": result.get("gaps"),
        "gateway_cpu_s": cpu_s,
        "cpu_us_per_chunk": cpu_s / chunks * 1e6 if cpu_s is not None and chunks else None,
        "rss_before": rss_before,
        "rss_peak": rss_peak,
        # Per stream open at the peak: a gateway too slow to open them all before the
        # first ones end holds fewer at once, and its RSS peak is theirs.
        "rss_per_stream": (rss_peak - rss_before) / (result.get("peak_open") or len(streams))
        if rss_peak is not None and rss_before is not None and streams
        else None,
        # Samples, pooled over the rounds by aggregate(); not written to the JSON.
        "_ttfb": [s["ttfb"] for s in streams if s["ttfb"] is not None],
        "_ttfc": [s["ttfc"] for s in streams if s["ttfc"] is not None],
        "_delays": result.get("delays", []),
        "_abort_upstream": [
            s["abort_upstream"] for s in streams if s.get("abort_upstream") is not None
        ],
        "_abort_ack": [s["abort_ack"] for s in streams if s.get("abort_ack") is not None],
    }
    return run


def _median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return percentile(present, 50) if present else None


def _ms(value: float | None) -> float | None:
    return None if value is None else value * 1e3


def aggregate(
    scenario: Scenario, runs: list[dict[str, Any]], direct: list[dict[str, Any]] | None
) -> dict[str, Any]:
    """A variant's figures over its rounds: each figure (percentiles included) is taken
    per round, then the median over the rounds, so that one round a shared machine
    disturbed does not decide a p99. ``direct``: the direct runs of the same scenario,
    for the added latency (each round against the direct run of the same round)."""

    def per_round(key: str, q: float) -> float | None:
        return _ms(_median([percentile(run[key], q) for run in runs]))

    fig: dict[str, Any] = {
        "rounds": len(runs),
        "streams": sum(r["streams"] for r in runs),
        "ok": sum(r["ok"] for r in runs),
    }
    fig["all_ok"] = fig["streams"] > 0 and fig["ok"] == fig["streams"]
    fig["steal_s"] = sum(sum(r.get("steal_s", {}).values()) for r in runs)
    fig["cpu_us_per_chunk"] = _median([r["cpu_us_per_chunk"] for r in runs])
    if any("store_cpu_us_per_chunk" in r for r in runs):
        fig["store_cpu_us_per_chunk"] = _median([r.get("store_cpu_us_per_chunk") for r in runs])
    if scenario.name in ("saturation", "scaleout"):
        fig["chunks_per_s"] = _median([r["chunks_per_s"] for r in runs])
    if scenario.name == "scaleout":
        fig["load_cpu_us_per_chunk"] = _median([r.get("load_cpu_us_per_chunk") for r in runs])
        fig["gateway_cores"] = _median([r.get("gateway_cores") for r in runs])
        fig["load_cores"] = _median([r.get("load_cores") for r in runs])
        fig["other_cores"] = _median([r.get("other_cores") for r in runs])
        fig["_rounds"] = {r["round"]: r["chunks_per_s"] for r in runs if "round" in r}
    elif scenario.name == "realistic":
        fig["ttfc_p50_ms"] = per_round("_ttfc", 50)
        fig["ttfc_p99_ms"] = per_round("_ttfc", 99)
        fig["delay_p50_ms"] = per_round("_delays", 50)
        fig["delay_p99_ms"] = per_round("_delays", 99)
        base = {r.get("round"): r for r in direct or []}
        for q in (50, 99):
            added: list[float | None] = []
            for run in runs:
                other = base.get(run.get("round"))
                mine = percentile(run["_delays"], q)
                theirs = percentile(other["_delays"], q) if other is not None else None
                added.append(None if mine is None or theirs is None else mine - theirs)
            fig[f"added_p{q}_ms"] = _ms(_median(added))
    elif scenario.name == "idle":
        fig["peak_open"] = min((r["peak_open"] or 0) for r in runs)
        fig["rss_per_stream_kb"] = _median(
            [None if r["rss_per_stream"] is None else r["rss_per_stream"] / 1024 for r in runs]
        )
        fig["rss_before_mb"] = _median(
            [None if r["rss_before"] is None else r["rss_before"] / 2**20 for r in runs]
        )
        fig["rss_peak_mb"] = _median(
            [None if r["rss_peak"] is None else r["rss_peak"] / 2**20 for r in runs]
        )
    elif scenario.name == "ttfb":
        fig["cpu_ms_per_request"] = _median(
            [
                None if r["gateway_cpu_s"] is None else r["gateway_cpu_s"] / r["streams"] * 1e3
                for r in runs
            ]
        )
        fig["ttfb_p50_ms"] = per_round("_ttfb", 50)
        fig["ttfb_p99_ms"] = per_round("_ttfb", 99)
        fig["ttfc_p50_ms"] = per_round("_ttfc", 50)
        fig["ttfc_p99_ms"] = per_round("_ttfc", 99)
    elif scenario.name == "ws_abort":
        fig["abort_closed_p50_ms"] = per_round("_abort_upstream", 50)
        fig["abort_closed_p99_ms"] = per_round("_abort_upstream", 99)
        fig["abort_ack_p50_ms"] = per_round("_abort_ack", 50)
    return fig
