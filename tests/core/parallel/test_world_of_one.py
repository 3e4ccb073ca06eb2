"""The parallel paths with one gloo rank: the expert-parallel exchange (every expert plus two replicas on one
rank) and EPLB equal the plain model exactly in fp32; ``LLM`` under ``WORLD_SIZE=1`` equals one process.
``tests/backend_cuda/test_parallel_nccl.py`` runs the same check through NCCL on one GPU."""

from __future__ import annotations

import torch

from tests.support.ranks import run_alone
from tests.support.v4_fixtures import SMALL, build_engine_checkpoint
from tests.support.world_of_one import check


def test_world_of_one_on_gloo(tmp_path):
    path = str(build_engine_checkpoint(tmp_path, SMALL)[0])
    diffs = run_alone(check, path, "cpu", torch.float32)
    assert diffs["max_logprob_diff_before"] < 1e-5 and diffs["max_logprob_diff_after_rebalance"] < 1e-5, diffs
    assert diffs["llm_tokens_equal"] == 1.0
