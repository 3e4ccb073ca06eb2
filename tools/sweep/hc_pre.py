"""Time mHC pre (``hc_pre``: split-K projection + finish) under candidate tiles, in CUDA graphs (GPU host only).

    python -m tools.sweep.hc_pre                       # V4 site: streams [T, 4, 4096] bf16, T = 1, 16, 64, 1024
    python -m tools.sweep.hc_pre --tokens 1,1024 --json sweep.json

One line per (tokens, candidate): µs per call of the whole op (mix + finish) and of the mix kernel alone, the
share of the memory roofline (x read once, collapsed written, fn read once, at the measured copy bandwidth), the
max error of post / comb / collapsed against a float64 evaluation of the op, and whether all outputs are bitwise
equal to the default's (``bits=``).  Candidates that change only a token tier's tile (``tier...``) must print
``bits=same``: that is the batch-invariance claim (every tier's dots lower to the same instruction).
Apply a winner in ``deepinfer_cuda.arch.hc_pre_config`` (see the report printed at the end).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import traceback

from tools.ceilings import copy_bandwidth
from tools.timing import graph_time

N, DIM = 4, 4096
#: The tiles before the bf16-term split (IEEE fp32 FMAs): tokens -> (block_t, block_k, warps, stages).
OLD_TIERS = {1: (1, 256, 1, 1), 2: (2, 256, 1, 1), 4: (4, 256, 1, 1), 8: (8, 256, 1, 1), 16: (16, 256, 4, 1),
             64: (32, 128, 4, 2), 1 << 30: (128, 32, 4, 3)}


def reference64(streams, fn, base, scale, norm_eps: float, hc_eps: float, iters: int):
    """core's hc_pre in float64 (core's reference casts to fp32): the yardstick for every candidate's error."""
    import torch

    t, n, _ = streams.shape
    x = streams.reshape(t, -1).double()
    mixes = (x @ fn.double().T) * torch.rsqrt(x.square().mean(-1, keepdim=True) + norm_eps)
    pre_w, post_w, comb_w = mixes.split([n, n, n * n], dim=-1)
    pre_b, post_b, comb_b = base.double().split([n, n, n * n])
    s = scale.double()
    pre = torch.sigmoid(pre_w * s[0] + pre_b) + hc_eps
    post = 2 * torch.sigmoid(post_w * s[1] + post_b)
    comb = torch.softmax(comb_w.view(t, n, n) * s[2] + comb_b.view(n, n), dim=-1) + hc_eps
    comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    for _ in range(iters - 1):
        comb = comb / (comb.sum(-1, keepdim=True) + hc_eps)
        comb = comb / (comb.sum(-2, keepdim=True) + hc_eps)
    collapsed = (pre.unsqueeze(-1) * streams.double()).sum(1)
    return collapsed, post, comb


def candidates(default):
    """(name, tiles or a function tokens -> tiles, token counts it applies to or None for all)."""
    from deepinfer_cuda.arch import HcPreTier, HcPreTiles, LaunchConfig

    small, big = default.tiers[0], default.tiers[-1]

    def old(tokens: int) -> HcPreTiles:
        max_t = next(m for m in sorted(OLD_TIERS) if tokens <= m)
        bt, bk, w, st = OLD_TIERS[max_t]
        return HcPreTiles(slice=256, block_k=bk, tiers=(HcPreTier(1 << 30, bt, LaunchConfig(w, st)),),
                          finish=LaunchConfig(num_warps=1), block_d=1024, terms=0)

    def with_small(tier):
        return dataclasses.replace(default, tiers=(dataclasses.replace(tier, max_tokens=small.max_tokens), big))

    def with_big(tier):
        return dataclasses.replace(default, tiers=(small, dataclasses.replace(tier, max_tokens=big.max_tokens)))

    decode = (1, 16, 64)
    yield "default", default, None
    yield "old ieee fp32 (before)", old, None
    yield "ieee fp32, new tiles", dataclasses.replace(default, terms=0), None
    yield "terms=2 (hi+mid only)", dataclasses.replace(default, terms=2), None
    yield "block_k=32", dataclasses.replace(default, block_k=32), None
    yield "slice=128", dataclasses.replace(default, slice=128), None
    yield "tier<=64: 64 tok 4w 1st", with_small(HcPreTier(0, 64, LaunchConfig(4, 1))), decode
    yield "tier<=64: 16 tok 1w mma.sync (bits?)", with_small(HcPreTier(0, 16, LaunchConfig(1, 1))), decode
    for bt, w, st in ((128, 8, 2), (128, 4, 2), (64, 4, 3)):
        yield f"tier big: {bt} tok {w}w {st}st", with_big(HcPreTier(0, bt, LaunchConfig(w, st))), (1024,)
    # Finishing kernel: warps, chunk, and columns collapsed per unrolled step (0: the whole chunk, as before: 1 warp
    # then holds a 4 x 1024 chunk in 168 registers a thread, 12 warps resident per SM).
    for w, bd, step in ((1, 1024, 0), (1, 1024, 512), (2, 1024, 256), (4, 1024, 0), (4, 2048, 0), (8, 4096, 0)):
        yield f"finish {w}w block_d={bd} step_d={step}", dataclasses.replace(
            default, finish=LaunchConfig(num_warps=w), block_d=bd, step_d=step), (1, 1024)
    # Fewer slices: half the workspace the finishing programs re-read per token, with fewer, wider of them.
    for w, bd, step in ((1, 1024, 256), (4, 2048, 0), (8, 4096, 0)):
        yield f"slice=512 + finish {w}w block_d={bd} step_d={step}", dataclasses.replace(
            default, slice=512, finish=LaunchConfig(num_warps=w), block_d=bd, step_d=step), None


def main(argv: list[str] | None = None) -> int:
    import torch

    from deepinfer_cuda.arch import hc_pre_config
    from deepinfer_cuda.kernel_set.dispatch import cuda_target
    from deepinfer_cuda.kernels import hc_pre as module

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", default="1,16,64,1024")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    gen = torch.Generator(device="cuda").manual_seed(0)
    fn = 0.05 * torch.randn((2 + N) * N, N * DIM, device="cuda", generator=gen)
    base = 0.5 * torch.randn((2 + N) * N, device="cuda", generator=gen)
    scale = 1 + 0.1 * torch.randn(3, device="cuda", generator=gen)
    bandwidth = copy_bandwidth()
    index, arch = cuda_target(fn)
    default = hc_pre_config(arch, N, DIM)
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s; default {default}")
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        streams = torch.randn(tokens, N, DIM, device="cuda", generator=gen).bfloat16()
        call = (streams, fn, base, scale, 1e-6, 1e-6, 20)
        want = reference64(*call)
        floor_us = (streams.numel() * 2 + tokens * DIM * 2 + fn.numel() * 4) / bandwidth * 1e6
        print(f"\nT={tokens} x ({N}, {DIM}) bf16: roofline {floor_us:.1f} us")
        default_out = None
        for name, tiles, only in candidates(default):
            if only is not None and tokens not in only:
                continue
            try:
                tiles = tiles(tokens) if callable(tiles) else tiles
                plan = module.prepare(*call, arch=arch, tiles=tiles)
                out = [t.clone() for t in plan.run(index)]
                torch.cuda.synchronize()
                (mix_kernel, mix_launch), _ = plan.steps
                us = graph_time(lambda: plan.run(index), 10) * 1e6
                finish_only = name.startswith("finish")  # same mix as the default's: not timed again
                mix_us = float("nan") if finish_only else \
                    graph_time(lambda: mix_launch.run(mix_kernel, index), 10) * 1e6
            except Exception as exc:  # a candidate that does not compile or launch: report it, go on
                first = str(exc).splitlines()[0][:200] if str(exc) else ''
                print(f"  {name:46s} FAILED: {type(exc).__name__}: {first}")
                traceback.print_exc(limit=1, file=sys.stdout)
                continue
            errs = [float((o.double() - w).abs().max()) for o, w in zip(out, want, strict=True)]
            if default_out is None and name == "default":
                default_out = out
                if tokens > 1:  # batch invariance at a glance (pytest's GPU tests check it properly)
                    alone = module.prepare(streams[-1:], *call[1:], arch=arch).run(index)
                    ok = all(torch.equal(a, b[-1:]) for a, b in zip(alone, out, strict=True))
                    print(f"  default: last token alone (1-token tier) == in the batch: {ok}")
            same = default_out is not None and all(torch.equal(a, b) for a, b in zip(out, default_out, strict=True))
            print(f"  {name:46s} {us:7.1f} us (mix {mix_us:6.1f}, finish ~{us - mix_us:5.1f})  "
                  f"{100 * floor_us / us:5.1f}% of roofline  err post {errs[1]:.1e} comb {errs[2]:.1e} "
                  f"collapsed {errs[0]:.1e}  bits={'same' if same else 'diff'}")
            rows.append({"tokens": tokens, "candidate": name, "us": us, "mix_us": mix_us, "floor_us": floor_us,
                         "err_collapsed": errs[0], "err_post": errs[1], "err_comb": errs[2], "bits_same": same,
                         "tiles": repr(tiles)})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print("\nApply a winner in deepinfer_cuda/arch.py hc_pre_config: terms/block_k/slice/finish/block_d are fields of"
          " HcPreTiles; a 'tier...' winner replaces that HcPreTier (keep every tier at 4+ warps and a multiple of 64"
          " tokens unless its line printed bits=same).")
    return 0


if __name__ == "__main__":
    sys.exit(main())
