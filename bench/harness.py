"""``bench/run``: every scenario through every system, interleaved, in one run.

The order of a run: for each scenario, ``--rounds`` rounds; in each round every
variant (system x output format) runs once, in the same order (A B C D, A B C D, …),
so that drift of a shared machine hits them alike. Each variant gets a fresh process,
started with the others before the round, warmed up with two small streams, pinned,
then measured alone (``--smoke`` reuses the processes across scenarios to finish in
seconds; its RSS figures then mean little).

Processes: the fake upstream (one for the whole run; the harness sets N and the
delay before each scenario, and its frames for the whole run), the load generator
(one, fed jobs on stdin), the Redis of the ``nexus-redis*`` systems (one, when one runs),
and the systems under test. See :mod:`bench.systems` for the pinning.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import importlib.metadata
import json
import os
import platform
import queue
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from . import report
from .frames import FRAMES
from .loadgen import Job
from .procfs import busy_seconds, cpu_seconds, pin, raise_nofile, rss_bytes, steal_seconds
from .scenarios import FULL, OPT_IN, SMOKE, Scenario, aggregate, run_figures
from .systems import (
    REDIS_SYSTEMS,
    ROOT,
    SCALEOUT_SYSTEMS,
    SYSTEMS,
    Pinning,
    RedisServer,
    Running,
    StartError,
    Variant,
    child_env,
    litellm_module,
    pin_running,
    plan_pinning,
    start,
)
from .upstream import OBFUSCATION

__all__ = ["EXIT_FAILED", "EXIT_MISSED", "exit_status", "main"]

DEFAULT_SYSTEMS = "direct,rawproxy,nexus,nexus-w2,nexus-redis,nexus-anthropic-up,litellm"
EXIT_FAILED = 1
"""A system under test could not be started or measured (its row says why)."""
EXIT_MISSED = 3
"""With ``--check``: every system ran, and a target check failed."""
FORMATS = ("sse", "nexus", "ndjson", "anthropic", "responses", "ws")
WARMUP = {"chunks": 3, "delay_ms": 0, "stamp": False, "batch": 1}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


class Upstream:
    """The fake upstream's process (``bench.upstream``) and its control endpoint.
    ``frames``: its settings for the whole run (``frames``, ``obfuscation``)."""

    def __init__(self, cpus: set[int] | None, frames: dict[str, str] | None = None) -> None:
        self.frames = frames or {}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.upstream"],
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=child_env(),
            cwd=ROOT,
            text=True,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        if line[:1] != ["READY"]:
            raise RuntimeError("the fake upstream did not start")
        self.url = f"http://127.0.0.1:{line[1]}"
        pin([self.proc.pid], cpus)

    def configure(self, settings: dict[str, Any]) -> None:
        request = urllib.request.Request(
            self.url + "/_bench/config",
            data=json.dumps({**settings, **self.frames}).encode(),
            method="POST",
        )
        with urllib.request.urlopen(request, timeout=10) as resp:
            resp.read()

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(timeout=10)


class Loadgen:
    """The load generator's process in ``--serve`` mode: one job in, one result out."""

    def __init__(self, cpus: set[int] | None) -> None:
        self.cpus = cpus
        self._spawn()

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.loadgen", "--serve"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=child_env(),
            cwd=ROOT,
            text=True,
        )
        pin([self.proc.pid], self.cpus)
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, args=(self.proc, self.lines), daemon=True).start()

    @staticmethod
    def _read(proc: subprocess.Popen[str], lines: queue.Queue[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.put(line)
        lines.put("")

    def run(self, job: Job, tick: Callable[[], None], timeout: float) -> dict[str, Any]:
        """Run ``job``, calling ``tick`` every 0.25 s meanwhile (RSS sampling)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(asdict(job)) + "\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            try:
                line = self.lines.get(timeout=0.25)
                break
            except queue.Empty:
                tick()
                if time.monotonic() > deadline:
                    self.stop()
                    self._spawn()
                    return {"error": f"the load generator did not finish in {timeout:.0f}s"}
        if not line:
            self._spawn()
            return {"error": "the load generator died"}
        result: dict[str, Any] = json.loads(line)
        return result

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Fleet:
    """The running systems: started in parallel before a round, stopped after their run."""

    def __init__(
        self,
        upstream: Upstream,
        loadgen: Loadgen,
        workdir: Path,
        pinning: Pinning,
        reuse: bool,
        redis: RedisServer | None = None,
    ) -> None:
        self.upstream = upstream
        self.redis = redis
        self.loadgen = loadgen
        self.workdir = workdir
        self.pinning = pinning
        self.reuse = reuse
        self.live: dict[Variant, Running] = {}
        self.broken: dict[Variant, str] = {}
        self.loops: dict[str, str | None] = {}

    def prepare(self, variants: list[Variant]) -> None:
        """Start what is not running, wait for it, warm it up, pin it."""
        fresh: dict[Variant, Running] = {}
        for variant in variants:
            if variant in self.live or variant in self.broken:
                continue
            try:
                fresh[variant] = start(variant, self.upstream.url, self.workdir, self.redis)
            except StartError as exc:
                self.broken[variant] = str(exc)
        for variant, running in fresh.items():
            try:
                running.wait_ready(120 if variant.system == "litellm" else 60)
            except StartError as exc:
                running.stop(grace=2)
                self.broken[variant] = str(exc)
                log(f"  {variant.label}: failed to start\n{exc}")
                continue
            self.live[variant] = running
        if not fresh:
            return
        self.upstream.configure(WARMUP)
        for variant, running in fresh.items():
            if variant not in self.live:
                continue
            # Two streams a process at least: most workers of a multi-worker gateway get one.
            streams = 8 if variant.multi_process else 2
            job = _job(running, WARMUP["chunks"], streams=streams, timeout=60)
            result = self.loadgen.run(job, lambda: None, 90)
            bad = result.get("error") or next(
                (s["error"] or "incomplete" for s in result["streams"] if not s["ok"]), None
            )
            if bad:
                self.broken[variant] = f"warm-up failed: {bad}\n{running.log_tail()}"
                log(f"  {variant.label}: warm-up failed: {bad}")
                self.live.pop(variant).stop(grace=2)
            else:
                pin_running(running, self.pinning)
                if running.proc is not None:
                    self.loops[variant.label] = running.event_loop()

    def release(self, variant: Variant) -> None:
        if not self.reuse and variant in self.live:
            self.live.pop(variant).stop()

    def close(self) -> None:
        for running in self.live.values():
            running.stop()
        self.live.clear()


def _job(
    running: Running,
    chunks: int,
    streams: int,
    timeout: float,
    scenario: Scenario | None = None,
    upstream: str = "",
) -> Job:
    job = Job(
        url=running.url,
        urls=running.urls if running.peers else [],
        format=running.variant.format,
        model=running.model,
        api_key=running.api_key,
        streams=streams,
        expect=chunks,
        timeout_s=timeout,
        upstream=upstream,
    )
    if scenario is not None:
        job.mode = scenario.mode
        job.stamp = scenario.stamp
        job.stagger_s = scenario.stagger_s
        job.expect = 0 if scenario.mode == "ws_abort" else scenario.chunks
    return job


def measure(
    running: Running,
    scenario: Scenario,
    loadgen: Loadgen,
    upstream: Upstream,
    pinning: Pinning,
    redis: RedisServer | None = None,
) -> dict[str, Any]:
    """One run: the load generator's job, the gateway's CPU and RSS around it, the load
    side's CPU (to show when it, not the gateway, was the limit), Redis's CPU for the
    ``nexus-redis*`` systems (the store's work, not in the gateway's figure) and the CPU time
    the hypervisor stole meanwhile (to show a run the machine disturbed)."""
    job = _job(
        running, scenario.chunks, scenario.streams, scenario.timeout_s, scenario, upstream.url
    )
    gateway_cpus = pinning.multi if running.variant.multi_process else pinning.gateway
    load_pids = [upstream.proc.pid, loadgen.proc.pid]
    load_before = cpu_seconds(load_pids)
    store_pids = (
        redis.pids() if redis is not None and running.variant.system in REDIS_SYSTEMS else []
    )
    store_before = cpu_seconds(store_pids)
    steal_before = steal_seconds(gateway_cpus), steal_seconds(pinning.load)
    host_before = busy_seconds()
    pids = running.pids()
    cpu_before = cpu_seconds(pids) if pids else None
    rss_before = rss_bytes(pids) if pids else None
    peak = rss_before

    def tick() -> None:
        nonlocal peak
        now = running.pids()
        if now and peak is not None:
            peak = max(peak, rss_bytes(now))

    result = loadgen.run(job, tick, scenario.timeout_s + 60)
    tick()
    if "error" in result:
        return {"error": result["error"]}
    cpu = cpu_seconds(pids) - cpu_before if cpu_before is not None else None
    figures = run_figures(result, cpu, rss_before, peak)
    load_cpu = cpu_seconds(load_pids) - load_before
    store_cpu = cpu_seconds(store_pids) - store_before
    chunks, wall = figures["chunks"], figures["wall_s"]
    figures["load_cpu_s"] = load_cpu
    figures["load_cpu_us_per_chunk"] = load_cpu / chunks * 1e6 if chunks else None
    if store_pids:
        figures["store_cpu_s"] = store_cpu
        figures["store_cpu_us_per_chunk"] = store_cpu / chunks * 1e6 if chunks else None
    if cpu is not None and wall:
        figures["gateway_cores"] = cpu / wall
        figures["load_cores"] = (load_cpu + store_cpu) / wall
        # The host's busy time less the run's own: other jobs on a shared machine.
        others = busy_seconds() - host_before - cpu - load_cpu - store_cpu
        figures["other_cores"] = max(0.0, others) / wall
    figures["steal_s"] = {
        "gateway_cpus": steal_seconds(gateway_cpus) - steal_before[0],
        "load_cpus": steal_seconds(pinning.load) - steal_before[1],
    }
    return figures


def _variants(systems: list[str], formats: list[str]) -> list[Variant]:
    out: list[Variant] = []
    for system in systems:
        if system == "nexus":
            out.extend(Variant("nexus", f) for f in formats)
        else:
            out.append(Variant(system))
    return out


def _progress(scenario: Scenario, variant: Variant, fig: dict[str, Any]) -> str:
    if "error" in fig:
        return f"{variant.label}: error: {fig['error']}"
    parts = [f"{fig['ok']}/{fig['streams']} ok"]
    if fig.get("chunks_per_s") and scenario.name in ("saturation", "scaleout"):
        parts.append(f"{fig['chunks_per_s']:,.0f} chunks/s")
    if fig.get("cpu_us_per_chunk") is not None and scenario.name in ("saturation", "scaleout"):
        parts.append(f"{fig['cpu_us_per_chunk']:.2f} µs/chunk")
    if fig.get("load_cores") is not None and scenario.name == "scaleout":
        cores = fig["gateway_cores"], fig["load_cores"], fig["other_cores"]
        parts.append("cores: gateway {:.2f}, load + Redis {:.2f}, other jobs {:.2f}".format(*cores))
    if fig.get("rss_per_stream") is not None and scenario.name == "idle":
        parts.append(
            f"{fig['rss_per_stream'] / 1024:.1f} KB/stream, peak open {fig['peak_open']}, "
            f"last opened after {fig['ramp_s'] or 0:.1f} s, "
            f"gateway CPU {fig['gateway_cpu_s'] or 0:.1f} s"
        )
    steal = sum(fig.get("steal_s", {}).values())
    if fig.get("wall_s") and steal > 0.05 * fig["wall_s"]:
        parts.append(f"CPU stolen by the hypervisor: {steal:.2f} s")
    if fig["errors"]:
        parts.append(f"errors: {fig['errors'][:2]}")
    return f"{variant.label}: " + ", ".join(parts)


def machine() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem = ""
    with contextlib.suppress(OSError, IndexError):
        mem = Path("/proc/meminfo").read_text().splitlines()[0].split(":", 1)[1].strip()
    return {
        "nproc": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)),
        "cpu_model": model,
        "memory": mem,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "implementation": platform.python_implementation(),
    }


def versions(litellm_exe: str | None) -> dict[str, str | None]:
    out: dict[str, str | None] = {}
    for name, dist in (
        ("aiohttp", "aiohttp"),
        ("orjson", "orjson"),
        ("nexus", "nexus-gateway"),
        ("uvloop", "uvloop"),
        ("matplotlib", "matplotlib"),
    ):
        try:
            out[name] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        head = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", str(ROOT), "status", "--porcelain", "--", "src"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
        out["nexus_git"] = head + ("+dirty" if dirty else "") if head else None
    out["litellm"] = None
    if litellm_exe:
        python = Path(litellm_exe).parent / "python"
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out["litellm"] = (
                subprocess.run(
                    [
                        str(python),
                        "-c",
                        "import importlib.metadata as m; print(m.version('litellm'))",
                    ],
                    capture_output=True,
                    text=True,
                    timeout=30,
                ).stdout.strip()
                or None
            )
    return out


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="bench/run",
        description="Nexus benchmarks: every scenario through every system.",
    )
    parser.add_argument(
        "--systems",
        help=f"comma-separated, of {', '.join(SYSTEMS)} (default: {DEFAULT_SYSTEMS}; "
        f"for --scenario scaleout, {','.join(SCALEOUT_SYSTEMS)} too)",
    )
    parser.add_argument(
        "--formats",
        default=",".join(FORMATS),
        help=f"Nexus output formats, comma-separated (default: {','.join(FORMATS)})",
    )
    parser.add_argument(
        "--scenario",
        action="append",
        help=f"run only these (repeat or comma-separate): {', '.join(FULL)} (default: "
        f"all but {', '.join(OPT_IN)})",
    )
    parser.add_argument(
        "--frames",
        choices=FRAMES,
        default="realistic",
        help="the upstream's frames: today's provider wire (default), or the old identical "
        "OpenAI chunks, for comparison",
    )
    parser.add_argument(
        "--obfuscation",
        choices=OBFUSCATION,
        default="default",
        help="OpenAI's obfuscation field: as OpenAI does (default: on unless the request "
        "turns it off), or off whatever the request says",
    )
    parser.add_argument("--rounds", type=int, help="rounds per scenario (default 3; smoke 1)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, one round: seconds")
    parser.add_argument(
        "--out", type=Path, default=ROOT / "bench" / "results", help="where results go"
    )
    parser.add_argument("--no-chart", action="store_true", help="skip the PNG")
    parser.add_argument(
        "--check",
        action="store_true",
        help=f"exit {EXIT_MISSED} when a target check fails (default: report it, exit 0)",
    )
    args = parser.parse_args(argv)
    names = [n.strip() for item in (args.scenario or []) for n in item.split(",") if n.strip()]
    if args.systems is None:
        only_opt_in = bool(names) and set(names) <= set(OPT_IN)
        args.systems = [] if only_opt_in else DEFAULT_SYSTEMS.split(",")
        if "scaleout" in names:
            args.systems += [s for s in SCALEOUT_SYSTEMS if s not in args.systems]
    else:
        args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    for system in args.systems:
        if system not in SYSTEMS:
            parser.error(f"unknown system {system!r} (known: {', '.join(SYSTEMS)})")
    args.formats = [f.strip() for f in args.formats.split(",") if f.strip()]
    for fmt in args.formats:
        if fmt not in FORMATS:
            parser.error(f"unknown format {fmt!r} (known: {', '.join(FORMATS)})")
    for name in names:
        if name not in FULL:
            parser.error(f"unknown scenario {name!r} (known: {', '.join(FULL)})")
    table = SMOKE if args.smoke else FULL
    args.scenarios = [table[n] for n in (names or [n for n in table if n not in OPT_IN])]
    if args.rounds is None:
        args.rounds = 1 if args.smoke else 3
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse(argv)
    raise_nofile()  # inherited by every child: 5,000 streams need ~10,000 descriptors
    notes: list[str] = []
    systems = list(args.systems)
    litellm_exe = None
    if "litellm" in systems:
        module = litellm_module()
        litellm_exe = module.find_litellm() if module is not None else None
        if litellm_exe is None:
            systems.remove("litellm")
            message = "litellm: skipped (not installed; see bench/litellm/README.md)"
            log(message)
            notes.append(message)
    variants = _variants(systems, args.formats)
    cpus = sorted(os.sched_getaffinity(0))
    pinning = plan_pinning(cpus)
    started = dt.datetime.now(dt.UTC)
    stamp = started.strftime("%Y%m%d-%H%M%S")
    info = {"machine": machine(), "versions": versions(litellm_exe)}
    log(f"bench: {len(variants)} variants, {len(args.scenarios)} scenarios, {args.rounds} rounds")
    log(f"pinning: {pinning.note}")

    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    failures: dict[str, dict[str, list[str]]] = {}  # scenario -> variant -> "round N: why"
    upstream = Upstream(pinning.upstream, {"frames": args.frames, "obfuscation": args.obfuscation})
    loadgen = Loadgen(pinning.load)
    redis: RedisServer | None = None
    try:
        with tempfile.TemporaryDirectory(prefix="nexus-bench-") as tmp:
            if any(v.system in REDIS_SYSTEMS for v in variants):
                redis = RedisServer(Path(tmp))
                # With the load side: the store's work is measured apart from the gateway's.
                pin(redis.pids(), pinning.upstream)
            fleet = Fleet(upstream, loadgen, Path(tmp), pinning, reuse=args.smoke, redis=redis)
            loops = fleet.loops
            try:
                for scenario in args.scenarios:
                    chosen = [v for v in variants if scenario.applies(v)]
                    if scenario.systems is not None:  # in the scenario's order
                        chosen.sort(key=lambda v: scenario.systems.index(v.system))
                    runs[scenario.name] = {v.label: [] for v in chosen}
                    rounds = min(args.rounds, scenario.max_rounds or args.rounds)
                    for round_no in range(1, rounds + 1):
                        log(f"{scenario.name}, round {round_no}/{rounds}")
                        fleet.prepare(chosen)
                        upstream.configure(scenario.upstream_config())
                        for variant in chosen:
                            failed = failures.setdefault(scenario.name, {})
                            if variant in fleet.broken:
                                failed.setdefault(variant.label, []).append(
                                    f"round {round_no}: {fleet.broken[variant]}"
                                )
                                continue
                            fig = measure(
                                fleet.live[variant], scenario, loadgen, upstream, pinning, redis
                            )
                            fig["round"] = round_no
                            fleet.release(variant)
                            log("  " + _progress(scenario, variant, fig))
                            if "error" in fig:
                                failed.setdefault(variant.label, []).append(
                                    f"round {round_no}: {fig['error']}"
                                )
                            else:
                                runs[scenario.name][variant.label].append(fig)
            finally:
                fleet.close()
                if redis is not None:
                    redis.stop()
    finally:
        loadgen.stop()
        upstream.stop()

    figures: report.Figures = {}
    for scenario in args.scenarios:
        per = runs.get(scenario.name, {})
        direct = per.get("direct")
        rows: dict[str, dict[str, Any]] = {}
        for label, done in per.items():
            errors = failures.get(scenario.name, {}).get(label, [])
            if done:
                rows[label] = aggregate(scenario, done, direct)
                if errors:
                    # Figures from the rounds that ran, and every failure said, not dropped.
                    rows[label]["failed_rounds"] = errors
                    notes += [f"{scenario.name}: {label} failed in {e}" for e in errors]
            elif errors:
                rows[label] = {"error": "; ".join(errors)}
        figures[scenario.name] = rows
    report.add_ratios(figures)
    checks = report.targets(figures)
    # A system with no variant in a scenario is n/a there (ws_abort: all but Nexus).
    not_applicable = {
        s.name: [
            v.label
            for v in variants
            if not any(s.applies(w) for w in variants if w.system == v.system)
        ]
        for s in args.scenarios
        if s.ws_only
    }
    if any(not_applicable.values()):
        notes.append(
            "ws_abort runs on the WebSocket surface, which only Nexus has: n/a for the others."
        )
    if "scaleout" in runs and pinning.multi is None:
        notes.append(
            f"scaleout: on {len(cpus)} CPU(s) the multi-process gateways share the cores with "
            "the load generator, the upstream and Redis (one process is pinned to a core of "
            "its own), and every gateway with other jobs: their chunks/s and scaling measure "
            "this host; CPU per chunk is the figure that carries over."
        )
    m, v = info["machine"], info["versions"]
    caps = [
        f"{s.name}: {s.max_rounds}"
        for s in args.scenarios
        if s.max_rounds is not None and s.max_rounds < args.rounds
    ]
    capped = f" ({', '.join(caps)})" if caps else ""
    loop_note = (
        ", ".join(f"{label} {name or 'not reported'}" for label, name in loops.items()) or "-"
    )
    loop_note += "; load side: " + ("uvloop" if v.get("uvloop") else "asyncio")
    stolen = sum(
        sum(run.get("steal_s", {}).values())
        for per in runs.values()
        for done in per.values()
        for run in done
    )
    header = [
        f"## Nexus benchmarks, {started:%Y-%m-%d %H:%M} UTC" + (" (smoke)" if args.smoke else ""),
        "",
        f"- machine: {m['nproc']} CPUs ({m['cpu_model']}), {m['memory']} RAM, "
        f"Linux {m['kernel']}, {m['implementation']} {m['python']}",
        f"- versions: nexus {v['nexus']} ({v.get('nexus_git')}), aiohttp {v['aiohttp']}, "
        f"orjson {v['orjson']}, litellm {v['litellm'] or '—'}",
        f"- pinning: {pinning.note}",
        f"- event loops: {loop_note}",
        f"- {args.rounds} round(s) per scenario{capped}, systems interleaved in each round "
        "(A B C, A B C, ...); each figure (percentiles too) is the median of its per-round "
        "values",
        f"- CPU time stolen by the hypervisor during the measured runs: {stolen:.1f} s",
        f"- upstream frames: {args.frames}"
        + (", OpenAI obfuscation off" if args.obfuscation == "off" else "")
        + " (bench/frames.py)",
    ]
    text = report.markdown(header, args.scenarios, figures, not_applicable, checks, notes)
    args.out.mkdir(parents=True, exist_ok=True)
    base = args.out / stamp
    document = {
        "date": started.isoformat(),
        **info,
        "args": {
            "systems": args.systems,
            "formats": args.formats,
            "rounds": args.rounds,
            "smoke": args.smoke,
            "frames": args.frames,
            "obfuscation": args.obfuscation,
            "scenarios": {s.name: asdict(s) for s in args.scenarios},
        },
        "pinning": {
            "load": sorted(pinning.load or []),
            "upstream": sorted(pinning.upstream or []),
            "gateway": sorted(pinning.gateway or []),
            "multi_worker_gateway": sorted(pinning.multi or []),
            "note": pinning.note,
        },
        "event_loops": loops,
        "figures": figures,
        "runs": runs,
        "targets": checks,
        "notes": notes,
    }
    report.write_json(base.with_suffix(".json"), document)
    base.with_suffix(".md").write_text(text)
    charted = not args.no_chart and report.chart(
        base.with_suffix(".png"), args.scenarios, figures, header[0].lstrip("# ")
    )
    print(text)
    log(f"results: {base}.json, {base}.md" + (f", {base}.png" if charted else ""))
    status = exit_status(figures, checks, check=args.check)
    if status == EXIT_FAILED:
        unmeasured = sorted(
            {
                label
                for rows in figures.values()
                for label, fig in rows.items()
                if "error" in fig or "failed_rounds" in fig
            }
        )
        log(f"bench: not every round of {', '.join(unmeasured)} could be measured (see the notes)")
    elif status == EXIT_MISSED:
        log(f"bench: {sum(c['pass'] is False for c in checks)} target check(s) failed (--check)")
    if args.check:
        unchecked = sum(c["pass"] is None for c in checks)
        if unchecked:
            log(f"bench: {unchecked} target check(s) n/a: their reference system did not run")
    return status


def exit_status(figures: report.Figures, checks: list[dict[str, Any]], *, check: bool) -> int:
    """0; :data:`EXIT_FAILED` if a system could not be measured, in any round; with ``check``,
    :data:`EXIT_MISSED` if every system ran and a target check failed."""
    if any(
        "error" in fig or "failed_rounds" in fig
        for rows in figures.values()
        for fig in rows.values()
    ):
        return EXIT_FAILED
    if check and any(c["pass"] is False for c in checks):  # None: not checkable here (n/a)
        return EXIT_MISSED
    return 0
