"""The scale-out benchmark (bench/README.md, "Scale-out with Redis"): which systems it runs,
the load split over the processes of a system of several ports, the scaling factor against
the one process of the same store, and a tiny run through one, two workers and two
processes on Redis."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def bench_importable() -> Iterator[None]:
    sys.path.insert(0, str(ROOT))
    try:
        yield
    finally:
        sys.path.remove(str(ROOT))


def test_scaleout_is_opt_in_and_brings_its_systems() -> None:
    from bench.harness import DEFAULT_SYSTEMS, _parse
    from bench.systems import SCALEOUT_SYSTEMS

    default = _parse([])
    assert "scaleout" not in [s.name for s in default.scenarios]
    assert default.systems == DEFAULT_SYSTEMS.split(",")

    named = _parse(["--scenario", "scaleout"])
    assert [s.name for s in named.scenarios] == ["scaleout"]
    assert named.systems == list(SCALEOUT_SYSTEMS)

    both = _parse(["--scenario", "saturation,scaleout"])
    extra = ["nexus-w4", "nexus-redis-w2", "nexus-redis-w4", "nexus-redis-2p"]
    assert both.systems == [*DEFAULT_SYSTEMS.split(","), *extra]

    chosen = _parse(["--scenario", "scaleout", "--systems", "nexus,nexus-redis-2p"])
    assert chosen.systems == ["nexus", "nexus-redis-2p"]


def test_scaleout_runs_its_systems_in_openai_sse_only() -> None:
    from bench.scenarios import FULL
    from bench.systems import Variant

    scaleout = FULL["scaleout"]
    assert scaleout.applies(Variant("nexus-redis-2p"))
    assert scaleout.applies(Variant("nexus"))
    assert not scaleout.applies(Variant("nexus", "ndjson"))
    assert not scaleout.applies(Variant("rawproxy"))
    assert not scaleout.applies(Variant("nexus-anthropic-up"))
    assert FULL["saturation"].applies(Variant("nexus-redis-w4"))
    multi = {s: Variant(s).multi_process for s in ("nexus", "nexus-redis", "nexus-w4")}
    assert multi == {"nexus": False, "nexus-redis": False, "nexus-w4": True}
    assert Variant("nexus-redis-2p").multi_process


def test_two_processes_share_one_key_prefix_of_their_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from bench import systems

    launched: list[list[str]] = []

    def launch(running: Any, argv: list[str], *rest: Any) -> Any:
        launched.append(argv)
        return running

    monkeypatch.setattr(systems, "_launch", launch)
    redis = cast(systems.RedisServer, SimpleNamespace(url="redis://127.0.0.1:1/0", error=""))
    pair = systems.start(systems.Variant("nexus-redis-2p"), "http://up", tmp_path, redis)
    other = systems.start(systems.Variant("nexus-redis-w2"), "http://up", tmp_path, redis)

    assert len(pair.peers) == 1 and len(set(pair.urls)) == 2
    configs = [Path(argv[argv.index("--config") + 1]).read_text() for argv in launched]
    prefixes = [re.findall(r'prefix = "(\w+)"', text) for text in configs]
    assert prefixes[0] == prefixes[1] != prefixes[2]  # the pair's, then the other system's
    assert all('url = "redis://127.0.0.1:1/0"' in text for text in configs)
    assert launched[2][-2:] == ["--workers", "2"] and "--workers" not in launched[0]
    assert other.urls == [other.url]
    assert pair.pids() == []  # nothing started: nothing measured, nothing to stop
    pair.stop()


async def _sse_server(served: Counter[int]) -> asyncio.Server:
    body = b'data: {"choices":[{"delta":{"content":" hi"}}]}\n\ndata: [DONE]\n\n'

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        await reader.readexactly(length)
        served[writer.get_extra_info("sockname")[1]] += 1
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body))
        await writer.drain()
        writer.close()

    return await asyncio.start_server(answer, "127.0.0.1", 0)


async def test_the_load_generator_sends_every_other_stream_to_the_second_process() -> None:
    from bench.loadgen import Job, run_job

    served: Counter[int] = Counter()
    servers = [await _sse_server(served) for _ in range(2)]
    ports = [server.sockets[0].getsockname()[1] for server in servers]
    urls = [f"http://127.0.0.1:{port}/v1/chat/completions" for port in ports]
    try:
        result = await run_job(Job(url=urls[0], urls=urls, streams=10, expect=1, timeout_s=10))
        alone = await run_job(Job(url=urls[1], streams=3, expect=1, timeout_s=10))
    finally:
        for server in servers:
            server.close()
            await server.wait_closed()
    assert all(s["ok"] for s in result["streams"] + alone["streams"])
    assert served == {ports[0]: 5, ports[1]: 5 + 3}


def test_scaling_is_the_median_of_the_per_round_ratios_to_the_same_store() -> None:
    from bench.report import add_ratios, markdown
    from bench.scenarios import FULL

    def row(cpu: float, *rates: float) -> dict[str, Any]:
        rounds = dict(enumerate(rates, 1))
        return {"ok": 1, "streams": 1, "cpu_us_per_chunk": cpu, "_rounds": rounds}

    rows = {
        "nexus (openai-sse)": row(2.0, 100, 200, 100),
        "nexus-w2 (openai-sse)": row(3.0, 150, 400, 300),
        "nexus-redis (openai-sse)": row(4.0, 50, 50, 100),
        "nexus-redis-2p (openai-sse)": row(5.0, 60, 90, 200),
        "nexus-redis-w4 (openai-sse)": {"error": "round 1: exited with 1 at start"},
    }
    figures = {"scaleout": rows}
    add_ratios(figures)
    got = {label: (fig.get("scaling"), fig.get("cpu_vs_one")) for label, fig in rows.items()}
    assert got == {
        "nexus (openai-sse)": (1.0, 1.0),
        # Rounds 1-3: 1.5, 2.0, 3.0 (never the ratio of the medians, 300 / 100).
        "nexus-w2 (openai-sse)": (2.0, 1.5),
        "nexus-redis (openai-sse)": (1.0, 1.0),
        "nexus-redis-2p (openai-sse)": (1.8, 1.25),
        "nexus-redis-w4 (openai-sse)": (None, None),
    }
    text = markdown([], [FULL["scaleout"]], figures, {}, [], [])
    assert "| scaling |" in text and "| nexus-w2 (openai-sse) | - | 2.00x | 3.00 | 1.50x |" in text


def test_a_tiny_scaleout_through_workers_and_two_processes_on_redis(tmp_path: Path) -> None:
    systems = ("nexus", "nexus-redis", "nexus-redis-w2", "nexus-redis-2p")
    options = ["--scenario", "scaleout", "--systems", ",".join(systems), "--no-chart"]
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "run"), "--smoke", *options, "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "### scaleout:" in proc.stdout
    (path,) = tmp_path.glob("*.json")
    rows = json.loads(path.read_text())["figures"]["scaleout"]
    assert list(rows) == [f"{s} (openai-sse)" for s in systems]
    for label, fig in rows.items():
        assert fig["all_ok"], (label, fig)
        for key in ("chunks_per_s", "scaling", "cpu_us_per_chunk", "cpu_vs_one", "load_cores"):
            assert fig[key] > 0, (label, key)
        assert ("store_cpu_us_per_chunk" in fig) == ("redis" in label), label
    assert rows["nexus (openai-sse)"]["scaling"] == rows["nexus-redis (openai-sse)"]["scaling"] == 1


def test_a_gateway_of_several_processes_gets_every_core_the_load_side_leaves() -> None:
    from bench.systems import plan_pinning

    assert plan_pinning([0, 1]).multi is None  # both CPUs, shared with the load side
    assert plan_pinning([0, 1, 2, 3]).multi == {2, 3}
    eight = plan_pinning(list(range(8)))
    assert (eight.load, eight.upstream, eight.gateway) == ({0}, {1}, {2})
    assert eight.multi == {2, 3, 4, 5, 6, 7}


def test_the_redis_workers_and_the_pair_are_held_to_their_memory_twins() -> None:
    from bench.report import add_ratios, targets

    def row(cpu: float) -> dict[str, Any]:
        return {"ok": 1, "streams": 1, "all_ok": True, "rounds": 1, "cpu_us_per_chunk": cpu}

    figures = {
        "saturation": {
            "nexus-w2 (openai-sse)": row(4.0),
            "nexus-redis-w2 (openai-sse)": row(5.0),
            "nexus-redis-2p (openai-sse)": row(6.0),
            "nexus-redis-w4 (openai-sse)": row(5.0),
        }
    }
    add_ratios(figures)
    got = {
        (c["system"], c["target"]): c["pass"]
        for c in targets(figures)
        if "≤ 1.3x nexus" in c["target"]
    }
    assert got == {
        ("nexus-redis-w2 (openai-sse)", "CPU per chunk ≤ 1.3x nexus-w2 (openai-sse)"): True,
        ("nexus-redis-2p (openai-sse)", "CPU per chunk ≤ 1.3x nexus-w2 (openai-sse)"): False,
        ("nexus-redis-w4 (openai-sse)", "CPU per chunk ≤ 1.3x nexus-w4 (openai-sse)"): None,
    }
