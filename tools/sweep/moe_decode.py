"""Time the MoE experts op at small decode batches under candidate tiles, in CUDA graphs (GPU host only).

    python -m tools.sweep.moe_decode                    # V4 slice layer: 64 experts of 4096 -> 2x2048, top-6
    python -m tools.sweep.moe_decode --experts 256 --tokens 1,8,32 --json tune.json

For each batch, every candidate ``MoeTiles`` (``arch.moe_experts_config``'s tier first) runs the whole op (plan,
up, down, combine) 10 times per graph replay; the table gives µs per call and the share of the copy ceiling that
the hit experts' bytes would take.  Also the plan alone: the one-program Triton plan against the torch plan.
Pick the fastest tiles per tier and write them into ``arch.moe_experts_config``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys

from tools.ceilings import copy_bandwidth
from tools.timing import graph_time


def candidates(base):
    from deepinfer_cuda.arch import LaunchConfig, MoeTiles

    yield base
    for up_n, k, stages, down_n in itertools.product((16, 32), (128, 256), (3, 4), (32, 64)):
        cfg = LaunchConfig(num_warps=4, num_stages=stages)
        tiles = MoeTiles(16, cfg, up_n, k, cfg, down_n, k)
        if tiles != base:
            yield tiles


def main(argv: list[str] | None = None) -> int:
    import torch

    from deepinfer_cuda.arch import moe_experts_config
    from deepinfer_cuda.kernel_set.dispatch import cuda_target
    from deepinfer_cuda.kernels import moe_experts as moe
    from deepinfer_cuda.kernels import moe_routing as routing

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--tokens", default="1,2,4,8,16")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    h, i, e, k = args.hidden, args.inter, args.experts, args.top_k
    w13 = (torch.randn(e, 2 * i, h, device="cuda") * h**-0.5).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda") * i**-0.5).bfloat16()
    bandwidth = copy_bandwidth()
    index, arch = cuda_target(w13)
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(tokens, e, device="cuda").argsort(dim=1)[:, :k].contiguous()
        w = torch.rand(tokens, k, device="cuda")
        hit = int(torch.unique(ids).numel())
        floor_us = hit * 3 * i * h * 2 / bandwidth * 1e6
        base = moe_experts_config(arch, tokens * k // e, h, i)
        plan_kernel = graph_time(lambda: routing.plan(ids, e, base.block_m, arch=arch)[2][0][1].run(
            routing.PLAN_KERNEL, index), 10) * 1e6 if tokens * k <= routing.PLAN_KERNEL_MAX_SLOTS else float("nan")
        plan_torch = graph_time(lambda: routing.expert_blocks(ids, e, base.block_m), 10) * 1e6
        print(f"T={tokens} ({hit} experts hit, floor {floor_us:.1f} us): plan kernel {plan_kernel:.1f} us, "
              f"torch plan {plan_torch:.1f} us")
        for tiles in candidates(base):
            us = graph_time(lambda: moe.prepare(x, ids, w, w13, w2, 10.0, arch=arch, tiles=tiles).run(index), 10) * 1e6
            row = {"tokens": tokens, "hit": hit, "us": us, "floor_us": floor_us, "config_tier": tiles == base,
                   "up_n": tiles.up_block_n, "down_n": tiles.down_block_n, "block_k": tiles.up_block_k,
                   "stages": tiles.up.num_stages, "plan_kernel_us": plan_kernel, "plan_torch_us": plan_torch}
            rows.append(row)
            print(f"  {'*' if row['config_tier'] else ' '} up_n {row['up_n']:3d} down_n {row['down_n']:3d} "
                  f"k {row['block_k']:3d} stages {row['stages']}: {us:7.1f} us  {100 * floor_us / us:5.1f}% of roof")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
