"""Expert parallelism over experts kept as stored: the embedded tiny V4.1 in the released layout (MXFP4 routed
experts, FP8 dense and shared experts, FP8 Engram tables sharded over the ranks) on 2 and 4 gloo ranks, in both
weight modes, against one process: teacher-forced logprobs, before and after an EPLB rebalance that moves packed
experts (data and scales) between ranks."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer.layers.ep_rebalance import rebalance_experts
from deepinfer.models import load_model, read_model_config
from deepinfer.ops import OpTable
from deepinfer.parallel.context import ParallelContext
from deepinfer.parallel.plan import ParallelConfig, plan_parallel
from tests.support.model_runs import run_chunked
from tests.support.quantized import released_tiny_v41
from tests.support.ranks import results, run_ranks
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)

MODES = ("native", "dequantize")
TOKENS = torch.randint(3, 1058, (40,), generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    return released_tiny_v41(tmp_path_factory.mktemp("tiny_v41_released"))[0]


def _load(path, mode: str, parallel: ParallelContext | None = None):
    os.environ["DEEPINFER_QUANTIZED_WEIGHTS"] = mode
    try:
        return load_model(path, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"), parallel=parallel)
    finally:
        del os.environ["DEEPINFER_QUANTIZED_WEIGHTS"]


def _expert_parallel(rank: int, world: int, path, redundant: int, alone: dict[str, torch.Tensor]):
    """Per mode: (largest difference from one process, the same after a rebalance, the routed experts kept MXFP4,
    whether the rebalance brought this rank an expert another rank held); and whether both modes gave the same
    logprobs, bit for bit."""
    cfg = read_model_config(path)
    out, logprobs = {}, {}
    for mode in MODES:
        config = ParallelConfig(world, world, num_redundant_experts=redundant)
        plan = plan_parallel(config, world, rank, n_routed_experts=cfg.n_routed_experts,
                             num_moe_layers=cfg.num_hidden_layers)
        context = ParallelContext.create(plan, 60.0)
        model = _load(path, mode, context)
        moe = model.layers[3].ffn
        first, held = run_chunked(model, TOKENS, 16), moe.placement.local_experts(3, rank)
        rebalance_experts(context)
        after = run_chunked(model, TOKENS, 16)
        logprobs[mode] = (first, after)
        out[mode] = (float((first - alone[mode]).abs().max()), float((after - alone[mode]).abs().max()),
                     moe.fp8_block is None and moe.scales is not None,
                     bool(set(moe.placement.local_experts(3, rank)) - set(held)))  # fetched from another rank
    same = all(torch.equal(a, b) for a, b in zip(logprobs["native"], logprobs["dequantize"], strict=True))
    return out, same


@pytest.mark.parametrize("world, redundant", [(2, 2), (4, 4)], ids=["ep2", "ep4"])  # ~3 s and ~7 s
def test_packed_experts_under_expert_parallelism_equal_one_process(released, world, redundant):
    """Within 1e-5 of one process, as the dense path (an expert's GEMM over more or fewer rows rounds otherwise in
    fp32); the packed experts give the dense experts' logprobs bit for bit, on one process and on every rank."""
    alone = {mode: run_chunked(_load(released, mode), TOKENS, 16) for mode in MODES}
    assert torch.equal(alone["native"], alone["dequantize"])
    ranks = results(run_ranks(_expert_parallel, world, released, redundant, alone, timeout=120.0, join_s=300.0),
                    world)
    for got, same in ranks:
        for mode in MODES:
            first, after, packed, _ = got[mode]
            assert packed == (mode == "native"), f"{mode}: routed experts kept as MXFP4: {packed}"
            assert first < 1e-5 and after < 1e-5, (mode, first, after)
        assert same, "packed and dense experts differ under expert parallelism"
    assert any(got["native"][3] for got, _ in ranks), "no expert crossed ranks: the weight moves went untested"
