"""``tools.bench.v41_slice`` on the CPU (``--tiny``): the slice builds with every V4.1 layer role, its steps run
through the shared benchmark helpers (prefill, decode through the decode graphs), and the report's roofline
arithmetic holds.  The GPU run (the real dims) is the lead's; this keeps the script from rotting in between."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tools.bench import v41_slice as bench

ROOT = Path(__file__).resolve().parents[2]


def test_bytes_of_the_v41_flash_slice_follow_the_routing():
    cfg = bench._config(bench.FULL)
    roles = {(r.mode, r.ratio) for r in cfg.layers}
    assert {("full", 2), ("reuse", 2), ("reindex", 2), ("full", 1), ("reuse", 1), ("reindex", 1)} <= roles
    assert any(r.engram for r in cfg.layers) and any(r.is_candidate_source for r in cfg.layers)
    counts = bench.count_bytes(cfg, bench.FULL)
    one, sixteen, prefill = (counts.touched(t)[0] for t in (1, 16, 1024))
    layer_experts = counts.expert * counts.layers
    assert one == pytest.approx(counts.dense + counts.head + counts.per_token + 7 * layer_experts)  # 6 + shared
    assert 7 * layer_experts < sixteen - one < 16 * 6 * layer_experts  # distinct experts grow, with overlap
    assert prefill < counts.dense + counts.head + 1024 * counts.per_token + 385 * layer_experts + 1


def test_experts_hit_counts_each_routing_layer_once_a_step_and_restores_the_layers():
    import types

    import torch

    from tools.bench.steps import experts_hit

    class Moe:
        def __init__(self, ids):
            self.ids = torch.tensor(ids)

        def route(self, x, input_ids):
            return torch.ones_like(self.ids, dtype=torch.float32), self.ids

    moes = [Moe([[0, 1], [1, 2]]), Moe([[5, 5], [5, 5]])]
    model = types.SimpleNamespace(layers=[types.SimpleNamespace(ffn=m) for m in moes] + [types.SimpleNamespace()])

    def step():
        for m in moes:
            m.route(None, None)

    assert experts_hit(model, step) == [3, 1]
    assert all("route" not in vars(m) for m in moes)  # the class's method again
    assert experts_hit(types.SimpleNamespace(), lambda: None) == []
    assert bench.count_bytes(bench._config(bench.FULL), bench.FULL).expected_hit(1) == pytest.approx(6)


@pytest.mark.slow
def test_tiny_slice_runs_on_the_cpu(tmp_path):
    out = tmp_path / "slice.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tools.bench.v41_slice", "--tiny", "--cases",
                           "prefill,decode1,decode16", "--json", str(out), "--profile", "--engram",
                           "device,host"], capture_output=True, text=True,
                          env=env, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "| case |" in proc.stdout
    assert proc.stdout.count("| kernel | us / step |") == 2  # --profile: one table per decode case
    assert proc.stdout.count("distinct routed experts a layer hits [") == 2  # and the experts its routes hit
    assert "Engram table in host memory (UVA) vs device memory, same run: decode b1 ctx 80:" in proc.stdout
    rows = json.loads(out.read_text())["rows"]
    assert [r["case"] for r in rows] == ["prefill 1x64", "decode b1 ctx 80", "decode b16 ctx 80"]
    assert all(r["s"] > 0 and 0 < r["fraction"] and r["bytes"] > 0 for r in rows)
    assert all("replay_s" in r for r in rows[1:])  # decode steps went through the decode graphs


def test_released_bytes_count_the_stored_formats():
    """Released: dense projections FP8 (1 byte + a ue8m0 byte per 128x128 block), routed experts MXFP4 (17/32
    byte a value), the shared expert FP8, Engram rows FP8 + ue8m0 per 32; FP8 GEMM FLOPs counted apart."""
    cfg = bench._config(bench.FULL)
    bf16, rel = bench.count_bytes(cfg, bench.FULL), bench.count_bytes(cfg, bench.FULL, released=True)
    assert rel.expert * 64 == bf16.expert * 17  # 2 bytes -> 1/2 + 1/32
    assert bf16.shared / rel.shared == pytest.approx(2, rel=1e-3)
    assert 1.6 < bf16.dense / rel.dense < 2  # FP8 projections; compressor, indexer, norms, routers stay
    one_bf16, one_rel = bf16.touched(1)[0], rel.touched(1)[0]
    assert 1.8 < one_bf16 / one_rel < 4  # fewer bytes a decode step (the bf16 head and compressors stay)
    _, flops, fp8 = rel.touched(1024)
    assert 0 < fp8 < flops and bf16.touched(1024)[2] == 0
    assert bf16.resident / rel.resident > 3  # 384 experts a layer dominate the weights


@pytest.mark.slow
def test_tiny_released_slice_runs_on_the_cpu(tmp_path):
    out = tmp_path / "slice.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-m", "tools.bench.v41_slice", "--tiny", "--released", "--cases",
                           "prefill,decode1", "--json", str(out)], capture_output=True, text=True, env=env, cwd=ROOT,
                          timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "released vs bf16" in proc.stdout
    slices = json.loads(out.read_text())["slices"]
    assert [s["format"] for s in slices] == ["bf16", "released"]
    bf16, rel = slices
    assert rel["weights_bytes"] < bf16["weights_bytes"] and rel["tokens_per_gib"] > 3 * bf16["tokens_per_gib"]
    assert all(r["s"] > 0 and r["bytes"] > 0 for r in rel["rows"])


def test_engram_report_compares_replayed_decode_steps():
    """``--engram device,host``: each decode case's host / device ratio of its replayed (device) time, else its
    step time; prefill and host-cost entries are not compared."""
    from tools.bench import v41_slice as bench

    device = {"decode b1 ctx 80": 3.0e-3, "decode b1 ctx 80 replay": 2.0e-3, "decode b1 ctx 80 host": {"x": 1.0},
              "decode b16 ctx 80": 8.0e-3, "prefill 1x64": 1.0}
    host = {"decode b1 ctx 80": 9.0, "decode b1 ctx 80 replay": 2.1e-3, "decode b16 ctx 80": 7.6e-3}
    line, ratios = bench.engram_report({"device": device, "host": host})
    assert ratios == pytest.approx({"decode b1 ctx 80": 1.05, "decode b16 ctx 80": 0.95})
    assert "decode b1 ctx 80: 2.000 -> 2.100 ms (+5.0%)" in line and "(-5.0%)" in line
