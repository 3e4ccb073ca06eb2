"""The parallel code paths in a world of one rank, on any backend (gloo on the CPU in CI; NCCL on one GPU):

- an expert-parallel model (one EP rank holding every expert plus two replicas: the dispatch / combine
  all-to-alls run through the backend's collectives) against the plain model, before and after an EPLB
  rebalance;
- ``LLM`` under torchrun's variables with ``WORLD_SIZE=1``: the lock-stepped data-parallel loop and the result
  gather, against the same engine without them.

Run as ``python -m tests.support.world_of_one <checkpoint> <backend> <dtype>`` in a fresh process (it initialises
the default process group); prints one JSON line of the largest differences.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.backends import select_backend
from deepinfer.layers.ep_rebalance import rebalance_experts
from deepinfer.models import load_model, read_model_config
from deepinfer.ops import OpTable
from deepinfer.parallel.context import ParallelContext
from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.parallel.plan import ParallelConfig, plan_parallel
from tests.support.model_runs import run_chunked
from tests.support.ranks import free_port


def check(path: str, backend_name: str, dtype: torch.dtype) -> dict[str, float]:
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    backend = select_backend(backend_name)
    device = backend.device(0)
    backend.init_communicator(0, 1, "env://", 60.0, device)
    cfg = read_model_config(path)
    experts, layers = cfg.n_routed_experts, cfg.num_hidden_layers
    plan = plan_parallel(ParallelConfig(), 1, 0, n_routed_experts=experts, num_moe_layers=layers)
    plan = dataclasses.replace(plan, placement=ExpertPlacement.round_robin(layers, experts, 1, experts + 2))
    context = ParallelContext.create(plan, 60.0)
    ops = OpTable.for_backend(backend)
    plain = load_model(path, ops=ops, dtype=dtype, device=device)
    split = load_model(path, ops=ops, dtype=dtype, device=device, parallel=context)
    tokens = torch.randint(3, cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0))
    want = run_chunked(plain, tokens, 16)
    before = (run_chunked(split, tokens, 16) - want).abs().max().item()
    rebalance_experts(context)
    after = (run_chunked(split, tokens, 16) - want).abs().max().item()
    params = SamplingParams(max_tokens=6, temperature=0.0, logprobs=2, prompt_logprobs=1)
    prompts = [tokens[:n].tolist() for n in (30, 7, 19)]
    one = LLM(path, dtype=dtype, max_num_seqs=4, state_cache_bytes=1 << 24)
    assert one.parallel is not None  # torchrun's variables: the data-parallel loop with one rank
    got = one.generate(prompts, params, use_tqdm=False)
    os.environ.pop("WORLD_SIZE")
    ref = LLM(path, dtype=dtype, max_num_seqs=4, state_cache_bytes=1 << 24).generate(prompts, params, use_tqdm=False)
    same_tokens = all(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(got, ref, strict=True))
    return {"max_logprob_diff_before": before, "max_logprob_diff_after_rebalance": after,
            "llm_tokens_equal": float(same_tokens)}


if __name__ == "__main__":
    path, backend_name, dtype_name = sys.argv[1:4]
    print(json.dumps(check(path, backend_name, getattr(torch, dtype_name))))
