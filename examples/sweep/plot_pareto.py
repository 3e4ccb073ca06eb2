"""Draw throughput-vs-latency Pareto fronts from ``run_sweep.sh``'s JSON rows: prefill and decode side by side.

    python examples/sweep/plot_pareto.py sweep_out/sweep.jsonl sweep_out/pareto.png

Prefill: input tokens/s per device against median TTFT (lower is better).  Decode: output tokens/s per device
against tokens/s per user (1 / TPOT; higher is better).  One series per (max_num_seqs, dspark) setting; every
point is labelled with its client concurrency and the series' Pareto front is drawn as a line.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

#: phase -> (x key, x label, whether a larger x is better, y key, y label)
AXES = {
    "prefill": ("median_ttft_ms", "median TTFT (ms)", False, "input_throughput_per_device",
                "prefill throughput (input tokens/s per device)"),
    "decode": ("per_user_output_throughput", "per-user output tokens/s (1 / TPOT)", True,
               "output_throughput_per_device", "decode throughput (output tokens/s per device)"),
}


def pareto(points: list[tuple[float, float, Any]], larger_x_better: bool) -> list[tuple[float, float, Any]]:
    """The points no other point beats on both axes (y: larger is better), sorted by x."""
    sign = 1 if larger_x_better else -1
    front = [p for p in points
             if not any(sign * q[0] >= sign * p[0] and q[1] >= p[1] and (q[0], q[1]) != (p[0], p[1]) for q in points)]
    return sorted(front, key=lambda p: p[0])


def plot(rows: list[dict[str, Any]], out: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        sys.exit("plot_pareto.py needs matplotlib: pip install 'deepinfer-core[bench]' (build.sh --dev has it)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5.2))
    for ax, (phase, (xk, xlabel, larger_x, yk, ylabel)) in zip(axes, AXES.items(), strict=True):
        series: dict[str, list[tuple[float, float, Any]]] = defaultdict(list)
        for r in rows:
            if r.get("phase") == phase and r.get("completed"):
                key = f"max_num_seqs={r.get('max_num_seqs')}, DSpark {r.get('dspark', 'off')}"
                series[key].append((r[xk], r[yk], r.get("max_concurrency")))
        for key, points in sorted(series.items()):
            (line,) = ax.plot([p[0] for p in points], [p[1] for p in points], "o", alpha=0.45)
            front = pareto(points, larger_x)
            ax.plot([p[0] for p in front], [p[1] for p in front], "-o", color=line.get_color(), label=key)
            for x, y, c in points:
                ax.annotate(f"c={c}", (x, y), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_title(f"{phase}: throughput vs {'interactivity' if larger_x else 'latency'}")
        ax.set_xlabel(xlabel)
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
        if series:
            ax.legend(fontsize=8)
    model = next((r.get("model") for r in rows if r.get("model")), None)
    fig.suptitle("deepinfer serve: Pareto fronts" + (f" ({model})" if model else ""))
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main() -> None:
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    rows = [json.loads(line) for line in Path(sys.argv[1]).read_text().splitlines() if line.strip()]
    plot(rows, Path(sys.argv[2]))


if __name__ == "__main__":
    main()
