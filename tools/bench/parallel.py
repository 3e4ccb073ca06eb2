"""Measure the parallel engine (docs/parallel.md; issue 18's numbers): one engine rank per device under torchrun.

    python -m tools.bench.parallel --model PATH --batch 256                     # one device: the baseline
    torchrun --nproc-per-node 4 -m tools.bench.parallel --model PATH --dp 4 --ep 4 --batch 256
    torchrun --nproc-per-node 4 -m tools.bench.parallel --model PATH --dp 4 --ep 4 --batch 256 --redundant 4

Rank 0 prints one JSON line: the world; prefill and decode tokens/s in all and per device (``--batch`` prompts of
``--prompt-len`` tokens over all DP ranks, greedy, ``--output-len`` tokens each); the MoE dispatch traffic per
decode step and the time one such all-to-all takes, against the all-to-all bandwidth of a large exchange measured
in the same run; and EPLB's effect on the busiest EP rank's expert load (max / mean, worst layer) for the load
counted while decoding: the start-up placement against the one EPLB computes from it.  Keep NVLink multicast off
(``NCCL_NVLS_ENABLE=0``) on hosts where the device notes say so.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch


def _timed(llm: Any, prompts: list[list[int]], tokens: int) -> float:
    from deepinfer import SamplingParams

    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False)  # ends with a gather: every rank has finished
    return time.perf_counter() - start


def _all_to_all_seconds(llm: Any, rows_per_peer: int, width: int, dtype: torch.dtype, repeat: int = 10) -> float:
    """Seconds of one all-to-all sending ``rows_per_peer`` rows of ``width`` to every EP rank."""
    context, device = llm.parallel.context, llm.engine.model.device
    backend = llm.engine.runner.backend
    send = torch.ones(rows_per_peer * context.ep.size, width, dtype=dtype, device=device)
    counts = [rows_per_peer] * context.ep.size
    context.ep.all_to_all(send, counts, counts)
    backend.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeat):
        context.ep.all_to_all(send, counts, counts)
    backend.synchronize(device)
    return (time.perf_counter() - start) / repeat


def _eplb_effect(llm: Any) -> dict[str, float] | None:
    from deepinfer.layers.ep_moe import ExpertParallelMoE
    from deepinfer.parallel import eplb

    context = llm.parallel.context
    layers = [m for m in context.moe_layers if isinstance(m, ExpertParallelMoE)]
    if not layers or context.load is None:
        return None
    load = context.ep.all_reduce(context.load.clone()).tolist()
    start = layers[0].placement
    placed = eplb.rebalance(load, start.num_slots, start.ep_size)

    def worst(rows: Any) -> float:
        return max(eplb.max_mean_ratio(row, slots, start.ep_size) for row, slots in zip(load, rows, strict=True))

    return {"start": worst([start.slots[m.layer] for m in layers]), "eplb": worst(placed.slots)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--ep", type=int, default=1)
    parser.add_argument("--cp", type=int, default=1)
    parser.add_argument("--redundant", type=int, default=None, help="num_redundant_experts")
    parser.add_argument("--batch", type=int, default=64, help="prompts over all DP ranks")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    args = parser.parse_args()

    from deepinfer import LLM

    per_rank = -(-args.batch // args.dp)
    llm = LLM(args.model, dtype=args.dtype, data_parallel_size=args.dp, expert_parallel_size=args.ep,
              context_parallel_size=args.cp, num_redundant_experts=args.redundant, max_num_seqs=per_rank,
              max_num_batched_tokens=max(8192, per_rank * args.prompt_len),
              max_model_len=args.prompt_len + args.output_len + 8)
    vocab = llm.engine.model.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (args.prompt_len,), generator=gen).tolist() for _ in range(args.batch)]
    _timed(llm, prompts[: max(1, args.dp)], 4)  # warm-up: kernels, graphs, the first collectives
    context = llm.parallel.context if llm.parallel is not None else None
    if context is not None and context.load is not None:
        context.load.zero_()
    prefill = _timed(llm, prompts, 1)
    rows0, pairs0 = (context.sent_rows, context.sent_pairs) if context is not None else (0, 0)
    steps0 = llm.parallel.steps if llm.parallel is not None else 0
    total = _timed(llm, prompts, args.output_len + 1)
    decode = max(total - prefill, 1e-9)
    world = context.plan.world_size if context is not None else 1
    out: dict[str, Any] = {
        "world": world, "dp": args.dp, "ep": args.ep, "cp": args.cp, "batch": args.batch,
        "prompt_len": args.prompt_len, "output_len": args.output_len,
        "prefill_tok_s": args.batch * args.prompt_len / prefill,
        "decode_tok_s": args.batch * args.output_len / decode,
        "decode_tok_s_per_device": args.batch * args.output_len / decode / world,
    }
    if context is not None and context.moe_layers and llm.parallel is not None:
        steps = max(1, llm.parallel.steps - steps0) * len(context.moe_layers)
        mine = torch.tensor([(context.sent_rows - rows0) / steps], dtype=torch.float64, device=llm.engine.model.device)
        rows = context.ep.all_reduce(mine).item() / context.ep.size  # an EP rank's rows per MoE layer per step
        hidden = llm.engine.model.config.hidden_size
        dtype = llm.engine.model.dtype
        per_peer = max(1, int(rows) // context.ep.size)
        small = _all_to_all_seconds(llm, per_peer, hidden, dtype)
        big_rows = max(1, (64 << 20) // (hidden * dtype.itemsize * context.ep.size))
        big = _all_to_all_seconds(llm, big_rows, hidden, dtype, repeat=5)
        out.update({
            "dispatch_rows_per_layer_step": rows,
            "dispatch_seconds_per_layer_step": small,
            "dispatch_bandwidth_gb_s": per_peer * context.ep.size * hidden * dtype.itemsize / small / 1e9,
            "link_all_to_all_gb_s": big_rows * context.ep.size * hidden * dtype.itemsize / big / 1e9,
            "eplb_max_over_mean": _eplb_effect(llm),
        })
    if context is None or context.plan.rank == 0:
        print(json.dumps(out))
    llm.shutdown()


if __name__ == "__main__":
    main()
