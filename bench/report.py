"""The run's output: markdown tables, the targets (bench/README.md), JSON, and the PNG chart.

Ratios and targets compare systems measured in the same run, never with figures
from another machine or day: on a shared, noisy machine only those are meaningful.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .scenarios import Scenario, percentile

__all__ = ["add_ratios", "chart", "markdown", "targets", "write_json"]

Figures = dict[str, dict[str, dict[str, Any]]]
"""scenario name -> variant label -> figures (see scenarios.aggregate)."""

RAW = "rawproxy"
PEER = "litellm"
MEMORY_TWIN = {
    "nexus-redis": "nexus",
    "nexus-redis-w2": "nexus-w2",
    "nexus-redis-w4": "nexus-w4",
    "nexus-redis-2p": "nexus-w2",
}
"""Each Redis system is compared with the same format of its memory-store twin (two
processes: two workers), as well as with the raw proxy."""
ONE_PROCESS = {"nexus": "nexus", "nexus-w2": "nexus", "nexus-w4": "nexus"}
"""``scaleout``: each system against the one-process system of its store."""
ONE_PROCESS |= {redis: "nexus-redis" for redis in MEMORY_TWIN}


def _is_nexus(label: str) -> bool:
    return label.startswith("nexus")


def _twin(label: str, twins: dict[str, str]) -> str | None:
    """``nexus-redis (f)`` → ``nexus (f)`` with :data:`MEMORY_TWIN`; None for a system
    that has no twin there."""
    system, _, fmt = label.partition(" ")
    return f"{twins[system]} {fmt}" if system in twins and fmt else None


def _memory_twin(label: str) -> str | None:
    return _twin(label, MEMORY_TWIN)


def _median(values: list[float]) -> float | None:
    return percentile(values, 50)


def add_ratios(figures: Figures) -> None:
    """Figures relative to the raw proxy's, the Redis systems' relative to their memory
    twin's (``*_vs_nexus``), and in ``scaleout`` each system's relative to its store's one
    process (``scaling``: chunks/s, the median of the per-round ratios; ``cpu_vs_one``),
    added to each variant's figures."""
    for scenario, key, name in (
        ("saturation", "cpu_us_per_chunk", "cpu_vs_rawproxy"),
        ("realistic", "cpu_us_per_chunk", "cpu_vs_rawproxy"),
        ("idle", "rss_per_stream_kb", "rss_vs_rawproxy"),
    ):
        rows = figures.get(scenario, {})
        base = rows.get(RAW, {}).get(key)
        for fig in rows.values():
            value = fig.get(key)
            fig[name] = value / base if value is not None and base else None
    for scenario, key, name in (
        ("saturation", "cpu_us_per_chunk", "cpu_vs_nexus"),
        ("realistic", "cpu_us_per_chunk", "cpu_vs_nexus"),
        ("idle", "cpu_us_per_chunk", "cpu_vs_nexus"),
        ("idle", "rss_per_stream_kb", "rss_vs_nexus"),
    ):
        rows = figures.get(scenario, {})
        for label, fig in rows.items():
            twin = _memory_twin(label)
            if twin is not None:
                value, base = fig.get(key), rows.get(twin, {}).get(key)
                fig[name] = value / base if value is not None and base else None
    rows = figures.get("scaleout", {})
    for label, fig in rows.items():
        one = rows.get(_twin(label, ONE_PROCESS) or "", {})
        if "error" in fig or "error" in one:
            continue
        cpu, base_cpu = fig.get("cpu_us_per_chunk"), one.get("cpu_us_per_chunk")
        fig["cpu_vs_one"] = cpu / base_cpu if cpu is not None and base_cpu else None
        pairs = fig.get("_rounds", {}), one.get("_rounds", {})
        ratios = [pairs[0][r] / pairs[1][r] for r in pairs[0] if pairs[1].get(r)]
        fig["scaling"] = _median(ratios)
    rows = figures.get("realistic", {})
    base = rows.get(RAW, {}).get("ttfc_p50_ms")
    for fig in rows.values():
        value = fig.get("ttfc_p50_ms")
        fig["ttfc_p50_vs_rawproxy_ms"] = value - base if value is not None and base else None


def targets(figures: Figures) -> list[dict[str, Any]]:
    """Each target (bench/README.md), for each Nexus variant measured: value, limit, pass.
    A target whose reference did not run is n/a (``pass`` None), never a pass."""
    out: list[dict[str, Any]] = []

    def check(
        scenario: str, target: str, label: str, value: Any, unit: str, limit: str, ok: Any
    ) -> None:
        out.append(
            {
                "scenario": scenario,
                "target": target,
                "system": label,
                "value": value,
                "unit": unit,
                "limit": limit,
                "pass": None if ok is None else bool(ok),
            }
        )

    def at_most(scenario: str, target: str, label: str, value: Any, limit: float) -> None:
        ok = None if value is None else value <= limit
        check(scenario, target, label, value, "x", f"≤ {limit:g}x", ok)

    def nexus_rows(scenario: str) -> list[tuple[str, dict[str, Any]]]:
        rows = figures.get(scenario, {})
        return [(k, v) for k, v in rows.items() if _is_nexus(k) and "error" not in v]

    sat = figures.get("saturation", {})
    peer_rate = sat.get(PEER, {}).get("chunks_per_s")
    for label, fig in nexus_rows("saturation"):
        at_most("saturation", "CPU per chunk ≤ 2x raw proxy", label, fig.get("cpu_vs_rawproxy"), 2)
        rate = fig.get("chunks_per_s")
        vs_peer = rate / peer_rate if rate and peer_rate else None
        check(
            "saturation",
            "chunks/s ≥ 50x LiteLLM",
            label,
            vs_peer,
            "x",
            "≥ 50x",
            None if vs_peer is None else vs_peer >= 50,
        )
    for label, fig in nexus_rows("realistic"):
        check(
            "realistic",
            "every stream completes",
            label,
            fig["ok"],
            "streams",
            f"{fig['streams']:,}",
            fig["all_ok"] and not fig.get("failed_rounds"),  # a lost round lost its streams
        )
        at_most(
            "realistic", "CPU per chunk ≤ 1.3x raw proxy", label, fig.get("cpu_vs_rawproxy"), 1.3
        )
        for q, limit in ((50, 1.0), (99, 10.0)):
            added = fig.get(f"added_p{q}_ms")
            check(
                "realistic",
                f"added latency p{q} ≤ {limit:g} ms",
                label,
                added,
                "ms",
                f"≤ {limit:g} ms",
                None if added is None else added <= limit,
            )
        diff = fig.get("ttfc_p50_vs_rawproxy_ms")
        check(
            "realistic",
            "TTFC p50 within 2 ms of raw proxy",
            label,
            diff,
            "ms",
            "≤ +2 ms",
            None if diff is None else diff <= 2,
        )
    for label, fig in nexus_rows("idle"):
        per_round = fig["streams"] // max(1, fig["rounds"])
        held = fig["all_ok"] and not fig.get("failed_rounds") and fig.get("peak_open") == per_round
        check(
            "idle",
            "every stream completes, all open at once",
            label,
            fig.get("peak_open"),
            "open",
            f"{per_round:,} open, {fig['streams']:,} complete ({fig['ok']:,} did)",
            held,
        )
        at_most("idle", "RSS per stream ≤ 1.5x raw proxy", label, fig.get("rss_vs_rawproxy"), 1.5)
    for scenario in ("saturation", "realistic", "idle"):
        for label, fig in nexus_rows(scenario):
            twin = _memory_twin(label)
            if twin is None:
                continue
            target = f"CPU per chunk ≤ 1.3x {twin}"
            at_most(scenario, target, label, fig.get("cpu_vs_nexus"), 1.3)
            if scenario == "idle":
                target = f"RSS per stream ≤ 1.5x {twin}"
                at_most(scenario, target, label, fig.get("rss_vs_nexus"), 1.5)
    return out


def _num(fmt: str) -> Callable[[Any], str]:
    return lambda v: "-" if v is None else fmt.format(v)


_COLUMNS: dict[str, list[tuple[str, str, Callable[[Any], str]]]] = {
    "saturation": [
        ("chunks/s", "chunks_per_s", _num("{:,.0f}")),
        ("gateway CPU µs/chunk", "cpu_us_per_chunk", _num("{:.2f}")),
        ("vs raw proxy", "cpu_vs_rawproxy", _num("{:.2f}x")),
    ],
    "realistic": [
        ("TTFC p50 ms", "ttfc_p50_ms", _num("{:.2f}")),
        ("TTFC p99 ms", "ttfc_p99_ms", _num("{:.2f}")),
        ("delay p50 ms", "delay_p50_ms", _num("{:.2f}")),
        ("delay p99 ms", "delay_p99_ms", _num("{:.2f}")),
        ("added p50 ms", "added_p50_ms", _num("{:+.2f}")),
        ("added p99 ms", "added_p99_ms", _num("{:+.2f}")),
        ("gateway CPU µs/chunk", "cpu_us_per_chunk", _num("{:.0f}")),
        ("vs raw proxy", "cpu_vs_rawproxy", _num("{:.2f}x")),
    ],
    "idle": [
        ("peak open", "peak_open", _num("{:,}")),
        ("RSS before MB", "rss_before_mb", _num("{:.1f}")),
        ("RSS peak MB", "rss_peak_mb", _num("{:.1f}")),
        ("RSS KB/stream", "rss_per_stream_kb", _num("{:.1f}")),
        ("vs raw proxy", "rss_vs_rawproxy", _num("{:.2f}x")),
        ("gateway CPU µs/chunk", "cpu_us_per_chunk", _num("{:.0f}")),
    ],
    "ttfb": [
        ("TTFB p50 ms", "ttfb_p50_ms", _num("{:.2f}")),
        ("TTFB p99 ms", "ttfb_p99_ms", _num("{:.2f}")),
        ("TTFC p50 ms", "ttfc_p50_ms", _num("{:.2f}")),
        ("TTFC p99 ms", "ttfc_p99_ms", _num("{:.2f}")),
        ("gateway CPU ms/request", "cpu_ms_per_request", _num("{:.2f}")),
    ],
    "ws_abort": [
        ("abort → upstream closed p50 ms", "abort_closed_p50_ms", _num("{:.2f}")),
        ("p99 ms", "abort_closed_p99_ms", _num("{:.2f}")),
        ("abort → `done` p50 ms", "abort_ack_p50_ms", _num("{:.2f}")),
    ],
    "scaleout": [
        ("chunks/s", "chunks_per_s", _num("{:,.0f}")),
        ("scaling", "scaling", _num("{:.2f}x")),
        ("gateway CPU µs/chunk", "cpu_us_per_chunk", _num("{:.2f}")),
        ("vs one process", "cpu_vs_one", _num("{:.2f}x")),
        ("load CPU µs/chunk", "load_cpu_us_per_chunk", _num("{:.2f}")),
        ("gateway cores", "gateway_cores", _num("{:.2f}")),
        ("load + Redis cores", "load_cores", _num("{:.2f}")),
        ("other jobs' cores", "other_cores", _num("{:.2f}")),
    ],
}


_STORE = ("store CPU µs/chunk", "store_cpu_us_per_chunk", _num("{:.2f}"))
"""Redis's CPU for the Redis systems: a column of the tables it has a figure in."""


def _table(scenario: Scenario, rows: dict[str, dict[str, Any]], not_applicable: list[str]) -> str:
    columns = _COLUMNS[scenario.name]
    if any(_STORE[1] in fig for fig in rows.values()):
        columns = [*columns, _STORE]
    head = ["system", *(c[0] for c in columns), "streams ok"]
    lines = [
        "| " + " | ".join(head) + " |",
        "|---|" + "---:|" * (len(head) - 1),
    ]
    for label, fig in rows.items():
        if "error" in fig:
            first = str(fig["error"]).splitlines()[0][:120]
            cells = [label, f"failed: {first}", *([""] * (len(head) - 2))]
        else:
            cells = [label, *(fmt(fig.get(key)) for _, key, fmt in columns)]
            cells.append(f"{fig['ok']:,}/{fig['streams']:,}")
        lines.append("| " + " | ".join(cells) + " |")
    for label in not_applicable:
        lines.append("| " + " | ".join([label, "n/a", *([""] * (len(head) - 2))]) + " |")
    return "\n".join(lines)


def _value(v: Any, unit: str) -> str:
    if v is None:
        return "-"
    if unit == "x":
        return f"{v:.2f}x"
    if unit == "ms":
        return f"{v:+.2f} ms"
    return f"{v:,}"


def markdown(
    header: list[str],
    scenarios: list[Scenario],
    figures: Figures,
    not_applicable: dict[str, list[str]],
    checks: list[dict[str, Any]],
    notes: list[str],
) -> str:
    parts = ["\n".join(header)]
    for scenario in scenarios:
        rows = figures.get(scenario.name, {})
        parts.append(f"### {scenario.name}: {scenario.title}")
        parts.append(_table(scenario, rows, not_applicable.get(scenario.name, [])))
    if checks:
        lines = [
            "### targets, against figures of this run",
            "",
            "| scenario | target | system | measured | limit | result |",
            "|---|---|---|---:|---|---|",
        ]
        for c in checks:
            result = "n/a" if c["pass"] is None else ("pass" if c["pass"] else "**FAIL**")
            lines.append(
                f"| {c['scenario']} | {c['target']} | {c['system']} | "
                f"{_value(c['value'], c['unit'])} | {c['limit']} | {result} |"
            )
        parts.append("\n".join(lines))
    if notes:
        parts.append("\n".join(f"- {n}" for n in notes))
    return "\n\n".join(parts) + "\n"


def _clean(value: Any) -> Any:
    """The figures without the raw samples (keys starting with ``_``)."""
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items() if not str(k).startswith("_")}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def write_json(path: Path, document: dict[str, Any]) -> None:
    path.write_text(json.dumps(_clean(document), indent=2, ensure_ascii=False) + "\n")


_CHART: dict[str, tuple[str, list[tuple[str, str]], str]] = {
    "saturation": ("chunks/s (label: gateway CPU µs/chunk)", [("chunks/s", "chunks_per_s")], "log"),
    "realistic": (
        "added latency vs direct, ms",
        [("p50", "added_p50_ms"), ("p99", "added_p99_ms")],
        "symlog",
    ),
    "idle": ("RSS per stream, KB", [("KB/stream", "rss_per_stream_kb")], "linear"),
    "ttfb": ("time to first chunk, ms", [("p50", "ttfc_p50_ms"), ("p99", "ttfc_p99_ms")], "linear"),
    "ws_abort": (
        "abort → upstream closed, ms",
        [("p50", "abort_closed_p50_ms"), ("p99", "abort_closed_p99_ms")],
        "linear",
    ),
    "scaleout": (
        "chunks/s (label: gateway CPU µs/chunk)",
        [("chunks/s", "chunks_per_s")],
        "linear",
    ),
}


def chart(path: Path, scenarios: list[Scenario], figures: Figures, title: str) -> bool:
    """One subplot per scenario; False (and nothing written) without matplotlib."""
    try:
        import matplotlib  # type: ignore[import-not-found, unused-ignore]

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]
    except ImportError:
        return False
    shown = [s for s in scenarios if figures.get(s.name)]
    if not shown:
        return False
    fig, axes = plt.subplots(len(shown), 1, figsize=(10, 3.2 * len(shown)), squeeze=False)
    for ax, scenario in zip(axes[:, 0], shown, strict=True):
        ylabel, series, scale = _CHART[scenario.name]
        rows = {k: v for k, v in figures[scenario.name].items() if "error" not in v}
        labels = list(rows)
        width = 0.8 / len(series)
        for i, (name, key) in enumerate(series):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(labels))]
            values = [rows[label].get(key) or 0 for label in labels]
            bars = ax.bar(xs, values, width, label=name)
            if scenario.name in ("saturation", "scaleout"):
                for bar, label in zip(bars, labels, strict=True):
                    cpu = rows[label].get("cpu_us_per_chunk")
                    if cpu is not None:
                        ax.annotate(
                            f"{cpu:.1f} µs",
                            (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                            ha="center",
                            va="bottom",
                            fontsize=8,
                        )
        ax.set_title(f"{scenario.name}: {scenario.title}", fontsize=9)
        ax.set_ylabel(ylabel, fontsize=8)
        ax.set_xlim(-0.75, max(len(labels), 3) - 0.25)  # a lone bar does not fill the plot
        ax.set_xticks(range(len(labels)))
        ax.set_xticklabels(labels, fontsize=8, rotation=15)
        if scale == "symlog":
            ax.set_yscale("symlog", linthresh=1)
        elif scale == "log":
            ax.set_yscale("log")
        if len(series) > 1:
            ax.legend(fontsize=8)
        ax.grid(axis="y", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True
