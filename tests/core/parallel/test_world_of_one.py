"""The parallel paths with one gloo rank: the expert-parallel exchange (every expert plus two replicas on one
rank) and EPLB equal the plain model exactly in fp32; ``LLM`` under ``WORLD_SIZE=1`` equals one process; the
tiny V4.1 slice with packed (MXFP4) experts the same.  ``tests/backend_cuda/test_parallel_nccl.py`` and
``test_v41_slice_ep_nccl.py`` run the same checks through NCCL on one GPU."""

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


def test_v41_slice_with_packed_experts_on_gloo():
    from tests.support.v41_slice_ep import check as slice_check

    got = run_alone(slice_check, "cpu", torch.float32, True)
    assert got["max_logprob_diff_before"] < 1e-5 and got["max_logprob_diff_after_rebalance"] < 1e-5, got
    assert got["experts_mxfp4"] == got["shared_fp8"] == 1.0 and got["sent_pairs"] > 0, got
    assert got["engram_host_bytes"] > 0, got  # the EP model read its FP8 Engram table from host memory
