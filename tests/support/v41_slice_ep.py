"""The V4.1-Flash slice of ``tools/bench/v41_slice.py`` in the released formats, kept as stored (MXFP4 routed
experts, FP8 dense projections and shared experts, FP8 Engram table, packed KV), under expert parallelism in a
world of one rank: its one EP rank holds every expert plus two replicas, so the dispatch / combine all-to-alls
and an EPLB rebalance (moving packed experts and their scales) run through the backend's collectives (NCCL on one
GPU, gloo on the CPU) around the packed expert op, with the Engram table in host memory (``Backend.host_resident``:
read through UVA on CUDA); compared with the same weights without expert parallelism, table in device memory.

Run as ``python -m tests.support.v41_slice_ep nvidia bfloat16`` (the real per-layer dims, 8 routed experts a
layer) or ``python -m tests.support.v41_slice_ep cpu float32 --tiny`` in a fresh process (it initialises the
default process group); prints one JSON line.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from typing import Any

import torch

from deepinfer.backends import select_backend
from deepinfer.layers.ep_rebalance import rebalance_experts
from deepinfer.models.deepseek_v41.engram_placement import TABLE, place_tables
from deepinfer.models.deepseek_v41.model import DeepseekV41ForCausalLM
from deepinfer.models.deepseek_v41.weights import expected_shapes
from deepinfer.ops import OpTable
from deepinfer.parallel.context import ParallelContext
from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.parallel.plan import ParallelConfig, plan_parallel
from deepinfer.quant import QuantizedTensor, quantize_fp8_block, quantize_mxfp4
from tests.support.model_runs import run_chunked
from tests.support.ranks import free_port


def _bench() -> Any:
    from tools.bench import v41_slice

    return v41_slice


def released_tensors(bench: Any, shape: Any, dtype: torch.dtype) -> dict[str, Any]:
    """The slice's random weights as released: the bench's FP8 projections and Engram table, every routed expert
    MXFP4 and the shared experts FP8 (32x32 blocks, as released); the float ones (bf16) in ``dtype``."""
    rand, gen = bench.random_generator(shape.device)
    tensors = bench._random_tensors(expected_shapes(bench._config(shape)), rand, gen, torch.device(shape.device),
                                   released=True)
    bench._released(tensors)
    for name, t in tensors.items():
        if ".ffn.experts." in name:
            tensors[name] = quantize_mxfp4(t.float())
        elif ".ffn.shared_experts." in name:
            tensors[name] = quantize_fp8_block(t.float(), (32, 32))
        elif isinstance(t, torch.Tensor) and t.dtype == torch.bfloat16:
            tensors[name] = t.to(dtype)
    return tensors


def check(backend_name: str, dtype: torch.dtype, tiny: bool) -> dict[str, float]:
    os.environ.update(WORLD_SIZE="1", RANK="0", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    backend = select_backend(backend_name)
    device = backend.device(0)
    backend.init_communicator(0, 1, "env://", 120.0, device)
    bench = _bench()
    shape = dataclasses.replace(bench.SMALL if tiny else bench.FULL, device=device.type)
    cfg = bench._config(shape)
    tensors = released_tensors(bench, shape, dtype)
    token_map = torch.randint(0, cfg.engram_compressed_vocab_size, (cfg.vocab_size,),
                              generator=torch.Generator().manual_seed(0)).to(device)
    ops = OpTable.for_backend(backend)
    experts, layers = cfg.n_routed_experts, cfg.num_hidden_layers
    plan = plan_parallel(ParallelConfig(), 1, 0, n_routed_experts=experts, num_moe_layers=layers)
    plan = dataclasses.replace(plan, placement=ExpertPlacement.round_robin(layers, experts, 1, experts + 2))
    context = ParallelContext.create(plan, 120.0)

    def build(parallel: ParallelContext | None) -> DeepseekV41ForCausalLM:  # (a copy: the model consumes its dict)
        weights = dict(tensors)
        if parallel is not None:  # the EP model reads its Engram table from host memory, as released models do
            weights.update({n: t.to(torch.device("cpu")) for n, t in tensors.items() if n.endswith(TABLE)})
            engram_host_bytes.append(place_tables(weights, backend.host_resident, device))
        return DeepseekV41ForCausalLM(cfg, weights, {}, token_map, ops=ops, dtype=dtype, device=device,
                                      parallel=parallel, native_weights=True, quantized_kv=True)

    engram_host_bytes: list[int] = []
    plain, split = build(None), build(context)
    moe = split.layers[2].ffn
    tokens = torch.randint(3, cfg.vocab_size, (48,), generator=torch.Generator().manual_seed(1))
    want = run_chunked(plain, tokens, 16)
    before = (run_chunked(split, tokens, 16) - want).abs().max().item()
    held = moe.placement.local_experts(2, 0)
    rebalance_experts(context)
    after = (run_chunked(split, tokens, 16) - want).abs().max().item()
    return {"max_logprob_diff_before": before, "max_logprob_diff_after_rebalance": after,
            "experts_mxfp4": float(moe.scales is not None and moe.fp8_block is None and moe.w13.element_size() == 1),
            "shared_fp8": float(moe.shared is not None and isinstance(moe.shared[0], QuantizedTensor)),
            "slots_moved": float(moe.placement.local_experts(2, 0) != held),
            "sent_pairs": float(context.sent_pairs), "engram_host_bytes": float(sum(engram_host_bytes))}


if __name__ == "__main__":
    name, dtype_name = sys.argv[1:3]
    print(json.dumps(check(name, getattr(torch, dtype_name), "--tiny" in sys.argv[3:])))
