"""``deepinfer bench serve|offline`` write sane rows; the sweep's Pareto front; the sweep script end to end (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.server import free_port

ROOT = Path(__file__).resolve().parents[2]
SWEEP = ROOT / "examples" / "sweep"


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "DEEPINFER_HF_MODEL_DIR"}
    env.update(DEEPINFER_ACCELERATOR="cpu", HF_HUB_OFFLINE="1")
    return env


def _bench(*args: str, tmp_path: Path) -> dict:
    out = tmp_path / "row.json"
    result = subprocess.run([sys.executable, "-m", "deepinfer", "bench", *args, "--result-json", str(out)],
                            env=_env(), capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert result.returncode == 0, result.stderr[-3000:]
    return json.loads(out.read_text())


def test_bench_serve_drives_the_server_at_a_concurrency(server_url, tmp_path):
    row = _bench("serve", "--base-url", server_url, "--num-prompts", "6", "--input-len", "16", "--output-len", "8",
                 "--max-concurrency", "3", "--label", "decode", tmp_path=tmp_path)
    assert row["completed"] == 6 and row["failed"] == 0 and row["phase"] == "decode" and row["model"] == "tiny"
    assert row["input_throughput"] * row["duration_s"] == pytest.approx(6 * 16)  # prompts of exactly 16 tokens
    assert row["output_throughput"] * row["duration_s"] == pytest.approx(6 * 8)  # outputs of exactly 8 tokens
    assert 0 < row["median_ttft_ms"] <= row["p99_ttft_ms"] and row["median_itl_ms"] > 0
    assert row["per_user_output_throughput"] > 0


def test_bench_serve_with_file_prompts_at_a_request_rate(server_url, tmp_path):
    text = tmp_path / "prompts.txt"
    text.write_text("Once upon a time, there was a little girl named Lily. She liked to play in the park.\n")
    row = _bench("serve", "--base-url", server_url, "--dataset", "file", "--dataset-path", str(text),
                 "--num-prompts", "4", "--input-len", "40", "--output-len", "4", "--request-rate", "20",
                 tmp_path=tmp_path)
    assert row["completed"] == 4 and row["request_rate"] == 20
    assert row["input_throughput"] * row["duration_s"] == pytest.approx(4 * 40)


def test_bench_offline(tmp_path):
    row = _bench("offline", "--dtype", "float32", "--num-prompts", "4", "--input-len", "12", "--output-len", "6",
                 tmp_path=tmp_path)
    assert row["completed"] == 4 and row["output_throughput"] * row["duration_s"] == pytest.approx(24)
    assert 0 < row["median_ttft_ms"] <= row["median_e2el_ms"] and row["median_tpot_ms"] > 0


def test_pareto_front():
    sys.path.insert(0, str(SWEEP))
    try:
        from plot_pareto import pareto
    finally:
        sys.path.remove(str(SWEEP))
    points = [(1.0, 10.0, "a"), (2.0, 8.0, "b"), (1.5, 7.0, "dominated by a and b"), (3.0, 2.0, "c")]
    assert [p[2] for p in pareto(points, larger_x_better=True)] == ["a", "b", "c"]
    # Latency axis (smaller is better): a has the least latency; c only trades worse on both.
    assert [p[2] for p in pareto(points, larger_x_better=False)] == ["a"]


@pytest.mark.slow
def test_sweep_script_writes_rows_and_a_png(tmp_path):
    env = {**_env(), "OUT": str(tmp_path), "CONCURRENCY": "1 4", "ROUNDS": "1", "PREFILL_INPUT_LEN": "64",
           "DECODE_OUTPUT_LEN": "8", "PYTHON": sys.executable, "PORT": str(free_port())}
    result = subprocess.run(["bash", str(SWEEP / "run_sweep.sh")], env=env, capture_output=True, text=True,
                            timeout=600, cwd=ROOT)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "sweep.jsonl").read_text().splitlines()]
    assert sorted((r["phase"], r["max_concurrency"]) for r in rows) == [("decode", 1), ("decode", 4),
                                                                        ("prefill", 1), ("prefill", 4)]
    assert all(r["completed"] == r["num_prompts"] and r["dspark"] == "off" for r in rows)
    png = (tmp_path / "pareto.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 10_000
