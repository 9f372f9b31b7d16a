"""The benchmark harness (bench/run, see bench/README.md) at tiny sizes: it runs every system but
LiteLLM (skipped with its message: it is not installed here, or is made to look so), prints
its tables, and writes a JSON with every figure, every stream having ended well, and the
PNG chart."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
SCENARIOS = ("saturation", "realistic", "idle", "ttfb", "ws_abort")
NEXUS = (
    "nexus (openai-sse)",
    "nexus (native-sse)",
    "nexus (ndjson)",
    "nexus (anthropic-sse)",
    "nexus (responses-sse)",
    "nexus (websocket)",
    "nexus-w2 (openai-sse)",
    "nexus-redis (openai-sse)",
    "nexus-anthropic-up (openai-sse)",
)
WS = ("nexus (websocket)",)
FIGURES = {
    "saturation": ("chunks_per_s", "cpu_us_per_chunk", "cpu_vs_rawproxy"),
    "realistic": (
        "ttfc_p50_ms",
        "ttfc_p99_ms",
        "delay_p50_ms",
        "added_p50_ms",
        "added_p99_ms",
        "cpu_vs_rawproxy",
    ),
    "idle": ("peak_open", "rss_per_stream_kb", "rss_vs_rawproxy"),
    "ttfb": ("ttfb_p50_ms", "ttfb_p99_ms", "ttfc_p50_ms", "ttfc_p99_ms"),
    "ws_abort": ("abort_closed_p50_ms", "abort_closed_p99_ms", "abort_ack_p50_ms"),
}
GATEWAY_ONLY = {"cpu_us_per_chunk", "cpu_vs_rawproxy", "rss_per_stream_kb", "rss_vs_rawproxy"}


def _bench_run(
    *args: str, env: dict[str, str], python: list[str] | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*(python or [sys.executable]), str(ROOT / "bench" / "run"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


def test_bench_smoke(tmp_path: Path) -> None:
    env = dict(os.environ, NEXUS_BENCH_LITELLM=str(tmp_path / "no-litellm"))
    proc = _bench_run(
        "--smoke",
        "--systems",
        "direct,rawproxy,nexus,nexus-w2,nexus-redis,nexus-anthropic-up,litellm",
        "--out",
        str(tmp_path),
        env=env,
        timeout=180,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "litellm: skipped (not installed; see bench/litellm/README.md)" in proc.stderr
    for scenario in SCENARIOS:
        assert f"### {scenario}:" in proc.stdout
    assert "| system |" in proc.stdout
    assert "### targets, against figures of this run" in proc.stdout

    (path,) = tmp_path.glob("*.json")
    run = json.loads(path.read_text())
    assert run["machine"]["nproc"] >= 1
    assert run["versions"]["aiohttp"] and run["versions"]["nexus"]
    assert (tmp_path / path.name.replace(".json", ".md")).read_text().strip()
    png = tmp_path / path.name.replace(".json", ".png")
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n") and png.stat().st_size > 10_000
    figures = run["figures"]
    for scenario, keys in FIGURES.items():
        rows = figures[scenario]
        expected = WS if scenario == "ws_abort" else ("direct", "rawproxy", *NEXUS)
        assert set(rows) == set(expected), (scenario, rows)
        for label, fig in rows.items():
            assert "error" not in fig, (scenario, label, fig)
            assert fig["all_ok"] and fig["ok"] == fig["streams"] > 0, (scenario, label, fig)
            for key in keys:
                if label == "direct" and key in GATEWAY_ONLY:
                    continue
                assert fig[key] is not None, (scenario, label, key)
    for target in run["targets"]:
        assert {"scenario", "target", "system", "value", "limit", "pass"} <= set(target)
    assert run["args"]["frames"] == "realistic"  # the default, --check included
    # Redis's own CPU is measured apart, and the Redis store is held to the memory store.
    for scenario in ("saturation", "realistic", "idle"):
        assert figures[scenario]["nexus-redis (openai-sse)"]["store_cpu_us_per_chunk"] > 0
    twin = {
        (t["scenario"], t["target"])
        for t in run["targets"]
        if t["system"] == "nexus-redis (openai-sse)" and t["pass"] is not None
    }
    assert {
        ("saturation", "CPU per chunk ≤ 1.3x nexus (openai-sse)"),
        ("realistic", "CPU per chunk ≤ 1.3x nexus (openai-sse)"),
        ("idle", "RSS per stream ≤ 1.5x nexus (openai-sse)"),
    } <= twin


def test_bench_run_finds_its_interpreter_or_says_what_to_do(tmp_path: Path) -> None:
    # python -S: this very interpreter without its site-packages, as a python3 outside the venv.
    bare = [sys.executable, "-S"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("NEXUS_BENCH")}
    found = _bench_run("--help", env={**env, "NEXUS_BENCH_PYTHON": sys.executable}, python=bare)
    assert found.returncode == 0, found.stderr
    assert "--check" in found.stdout

    absent = tmp_path / "no-venv" / "python"
    lost = _bench_run("--smoke", env={**env, "NEXUS_BENCH_PYTHON": str(absent)}, python=bare)
    assert lost.returncode == 2
    assert (
        "cannot import aiohttp" in lost.stderr and f"{absent} is not an executable" in lost.stderr
    )
    assert "pip install -e '.[bench]'" in lost.stderr

    # A python that cannot import the project either: run once more, then told, never a loop.
    wrapper = tmp_path / "bare-python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    wrapper.chmod(0o755)
    again = _bench_run("--smoke", env={**env, "NEXUS_BENCH_PYTHON": str(wrapper)}, python=bare)
    assert again.returncode == 2
    assert f"{wrapper} cannot either" in again.stderr


def test_a_system_that_cannot_start_fails_the_run(tmp_path: Path) -> None:
    broken = tmp_path / "litellm"
    broken.write_text("#!/bin/sh\necho 'no config' >&2\nexit 1\n")
    broken.chmod(0o755)
    env = dict(os.environ, NEXUS_BENCH_LITELLM=str(broken))
    proc = _bench_run(
        "--smoke",
        "--systems",
        "direct,litellm",
        "--scenario",
        "saturation",
        "--no-chart",
        "--out",
        str(tmp_path),
        env=env,
        timeout=120,
    )
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert "bench: not every round of litellm could be measured" in proc.stderr
    (path,) = tmp_path.glob("*.json")
    row = json.loads(path.read_text())["figures"]["saturation"]["litellm"]
    assert row["error"].startswith("round 1: ")


def test_the_exit_status_tells_a_failed_system_and_with_check_a_missed_target() -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from bench.harness import EXIT_FAILED, EXIT_MISSED, exit_status
    finally:
        sys.path.remove(str(ROOT))
    ran = {"realistic": {"rawproxy": {"ok": 1}, "nexus (openai-sse)": {"ok": 1}}}
    passed = [{"pass": True}, {"pass": None}]  # None: n/a (LiteLLM's ratio without LiteLLM)
    missed = [{"pass": True}, {"pass": False}]
    assert exit_status(ran, passed, check=True) == 0
    assert exit_status(ran, missed, check=False) == 0
    assert exit_status(ran, missed, check=True) == EXIT_MISSED
    broken = {"realistic": {**ran["realistic"], "litellm": {"error": "exited with 1 at start"}}}
    assert exit_status(broken, passed, check=False) == EXIT_FAILED
    assert exit_status(broken, missed, check=True) == EXIT_FAILED
    one_round = {"idle": {"nexus (ndjson)": {"ok": 1, "failed_rounds": ["round 2: timed out"]}}}
    assert exit_status(one_round, passed, check=False) == EXIT_FAILED


def test_a_lost_round_fails_every_stream_completes() -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from bench.report import targets
    finally:
        sys.path.remove(str(ROOT))
    row = {"ok": 400, "streams": 400, "all_ok": True, "rounds": 2, "peak_open": 200}
    lost = {**row, "failed_rounds": ["round 3: timed out"]}
    for scenario in ("realistic", "idle"):
        for fig, expected in ((row, True), (lost, False)):
            (check,) = [
                c
                for c in targets({scenario: {"nexus (ndjson)": fig}})
                if c["target"].startswith("every stream completes")
            ]
            assert check["pass"] is expected, (scenario, fig)


def test_the_frames_for_comparison_are_asked_for_by_name(tmp_path: Path) -> None:
    proc = _bench_run(
        "--smoke",
        "--systems",
        "direct,rawproxy",
        "--scenario",
        "saturation",
        "--frames",
        "synthetic",
        "--obfuscation",
        "off",
        "--no-chart",
        "--out",
        str(tmp_path),
        env=dict(os.environ),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "- upstream frames: synthetic, OpenAI obfuscation off" in proc.stdout
    (path,) = tmp_path.glob("*.json")
    run = json.loads(path.read_text())
    assert (run["args"]["frames"], run["args"]["obfuscation"]) == ("synthetic", "off")
    assert all(fig["all_ok"] for fig in run["figures"]["saturation"].values())
    wrong = _bench_run("--frames", "identical", env=dict(os.environ))
    assert wrong.returncode == 2 and "invalid choice: 'identical'" in wrong.stderr


def test_the_redis_store_is_held_to_the_memory_store_of_the_same_run() -> None:
    sys.path.insert(0, str(ROOT))
    try:
        from bench.report import add_ratios, targets
    finally:
        sys.path.remove(str(ROOT))

    def row(cpu: float, rss: float | None = None) -> dict[str, Any]:
        fig = {"ok": 10, "streams": 10, "all_ok": True, "rounds": 1, "peak_open": 10}
        return {**fig, "cpu_us_per_chunk": cpu, "rss_per_stream_kb": rss}

    def verdicts(figures: dict[str, dict[str, dict[str, Any]]]) -> dict[tuple[str, str], Any]:
        add_ratios(figures)
        return {
            (c["scenario"], c["target"]): c["pass"]
            for c in targets(figures)
            if c["system"] == "nexus-redis (openai-sse)" and "nexus (openai-sse)" in c["target"]
        }

    got = verdicts(
        {
            "saturation": {"nexus (openai-sse)": row(2.0), "nexus-redis (openai-sse)": row(2.5)},
            "realistic": {"nexus (openai-sse)": row(40), "nexus-redis (openai-sse)": row(60)},
            "idle": {
                "nexus (openai-sse)": row(60, 30.0),
                "nexus-redis (openai-sse)": row(70, 46.0),
            },
        }
    )
    assert got == {
        ("saturation", "CPU per chunk ≤ 1.3x nexus (openai-sse)"): True,
        ("realistic", "CPU per chunk ≤ 1.3x nexus (openai-sse)"): False,
        ("idle", "CPU per chunk ≤ 1.3x nexus (openai-sse)"): True,
        ("idle", "RSS per stream ≤ 1.5x nexus (openai-sse)"): False,
    }
    alone = verdicts({"saturation": {"nexus-redis (openai-sse)": row(2.5)}})
    assert alone == {("saturation", "CPU per chunk ≤ 1.3x nexus (openai-sse)"): None}
