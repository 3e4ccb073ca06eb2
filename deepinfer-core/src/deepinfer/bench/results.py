"""Summaries of per-request timings: percentiles, one JSON row per benchmark point."""

from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Any

PERCENTILES = (50, 90, 99)


def percentile(values: list[float], p: float) -> float:
    """Linear-interpolated percentile (numpy's default); 0 for no values."""
    if not values:
        return 0.0
    xs = sorted(values)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(name: str, values_s: list[float]) -> dict[str, float]:
    """``mean_<name>_ms``, ``median_...``, ``p90_...``, ``p99_...`` (milliseconds)."""
    ms = [v * 1000 for v in values_s]
    row = {f"mean_{name}_ms": statistics.fmean(ms) if ms else 0.0}
    for p in PERCENTILES:
        row[f"{'median' if p == 50 else f'p{p}'}_{name}_ms"] = percentile(ms, p)
    return row


def write_row(row: dict[str, Any], path: str | None, append: bool) -> None:
    """Print the row; also write it to ``path`` (one JSON object per line when appending)."""
    text = json.dumps(row, sort_keys=True)
    print(text)
    if path is not None:
        with Path(path).open("a" if append else "w") as f:
            f.write(text + "\n")
