"""The V4.1-Flash slice (real per-layer dims) in the released formats kept as stored, under expert parallelism in
a world of one rank through NCCL: the dispatch / combine around the MXFP4 expert kernel and an EPLB rebalance
moving packed experts, the FP8 Engram table in host memory read through UVA, in bf16 against the same weights
without expert parallelism (table in device memory)
(``tests/support/v41_slice_ep.py``; its CPU sibling is ``tests/core/parallel/test_world_of_one.py``).  Skipped
where no CUDA device is visible; on the GPU host: ``pytest tests/backend_cuda/test_v41_slice_ep_nccl.py``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU (NCCL)"),
              pytest.mark.cuda]
ROOT = Path(__file__).resolve().parents[2]


def test_v41_slice_with_packed_experts_through_nccl():
    env = {**os.environ, "DEEPINFER_ACCELERATOR": "nvidia", "NCCL_NVLS_ENABLE": "0"}
    env.pop("WORLD_SIZE", None)
    done = subprocess.run([sys.executable, "-m", "tests.support.v41_slice_ep", "nvidia", "bfloat16"], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["experts_mxfp4"] == got["shared_fp8"] == 1.0 and got["sent_pairs"] > 0, got
    assert got["engram_host_bytes"] > 0, got  # the EP model read its FP8 Engram table from host memory
    # the same MXFP4 kernel on other row groupings (one expert per row, the owner's pairs): bf16-level
    # differences, as test_parallel_nccl.py allows the dense experts
    assert got["max_logprob_diff_before"] < 0.15 and got["max_logprob_diff_after_rebalance"] < 0.15, got
