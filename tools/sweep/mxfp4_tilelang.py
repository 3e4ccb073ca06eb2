"""MXFP4 routed experts: the TileLang forms against the Triton form and core's reference (GPU host).

    python -m tools.sweep.mxfp4_tilelang [--kernel-set DIR] [--tokens 1,16,64,1024] [--json out.json]

One V4.1-Flash MoE layer (384 experts of 5120 -> 2 x 2304 -> 5120, top-6, random routes, random MXFP4 bytes with
e8m0 scales near 2^-7): per token count, each form's error against core's reference (bf16; past ~24 GB of
dequantized experts, against the Triton form), its device time in a CUDA graph (20 calls captured, replayed:
``tools.timing.graph_time``), and its share of the copy bandwidth measured in the same run for the bytes it must
read (the hit experts' packed weights and scales, x, out).  Each form is checked for host syncs
(``torch.cuda.set_sync_debug_mode``;
``tests/backend_cuda/test_moe_mxfp4_tilelang_gpu.py`` checks graph replay).  Prints the fastest form per token
count: where a TileLang form wins, its tiles go into ``arch.MXFP4_TILELANG`` for that tier.  The opt-in W4A8 forms
(``arch.MXFP4_W4A8_CANDIDATES``, FP8 activations) run beside them; their error against the reference is the
activations' e4m3 rounding (what ``DEEPINFER_MXFP4_ACTIVATIONS=fp8`` trades for the time).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time
from pathlib import Path

import torch

from tools.ceilings import copy_bandwidth
from tools.timing import graph_time

E, H, INTER, K = 384, 5120, 2304, 6


def layer(gen: torch.Generator):
    dev = "cuda"
    w13 = torch.randint(0, 256, (E, 2 * INTER, H // 2), dtype=torch.uint8, device=dev, generator=gen)
    w2 = torch.randint(0, 256, (E, H, INTER // 2), dtype=torch.uint8, device=dev, generator=gen)
    s13 = torch.randint(118, 122, (E, 2 * INTER, H // 32), dtype=torch.uint8, device=dev, generator=gen)
    s2 = torch.randint(118, 122, (E, H, INTER // 32), dtype=torch.uint8, device=dev, generator=gen)
    return w13, s13, w2, s2


def routed(tokens: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """x, random routes (top-K distinct experts a token) and their weights for ``tokens`` tokens."""
    x = (torch.randn(tokens, H, device="cuda", generator=gen)).to(torch.bfloat16)
    ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:K] for _ in range(tokens)])
    return x, ids, torch.rand(tokens, K, device="cuda", generator=gen)


def bytes_read(hit: int, tokens: int) -> int:
    """What the op must read: the hit experts' packed weights and scales, x, out."""
    return hit * (INTER * H + INTER * H // 16 + H * INTER // 2 + H * INTER // 32) + 2 * tokens * H * 2


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kernel-set", type=Path, default=None, help="kernel-set directory (default: the package's)")
    parser.add_argument("--tokens", default="1,16,64,1024")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--hang-s", type=float, default=10.0,
                        help="a form's first call not done after this many seconds counts as hung: the sweep writes "
                             "what it has and exits (a hung kernel cannot be stopped in-process)")
    args = parser.parse_args(argv)

    from deepinfer.ops.quant_gemm import moe_experts_mxfp4 as reference
    from deepinfer_cuda.arch import MXFP4_TILELANG_CANDIDATES, MXFP4_W4A8_CANDIDATES, SM90A, mxfp4_tilelang_tier
    from deepinfer_cuda.kernel_set.dispatch import use_kernel_set
    from deepinfer_cuda.kernels import moe_experts_mxfp4 as triton_form
    from deepinfer_cuda.kernels import moe_experts_mxfp4_tl as tilelang_form
    from deepinfer_cuda.kernels import moe_experts_mxfp4_w4a8_tl as w4a8_form

    if args.kernel_set is not None:
        print(use_kernel_set(args.kernel_set).describe())
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s; {torch.cuda.get_device_name()}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    w13, s13, w2, s2 = layer(gen)
    rows = []
    for tokens in [int(t) for t in args.tokens.split(",")]:
        x, ids, weights = routed(tokens, gen)
        op = (x, ids, weights, w13, s13, w2, s2, 10.0)
        hit = ids.unique().numel()
        # core's reference dequantizes every hit expert to bf16 (~0.15 GB each): past ~24 GB compare with Triton
        ref = reference(*op).float() if hit * 0.15 < 24 else triton_form.prepare(*op, arch=SM90A).run(0).float()
        floor_us = bytes_read(hit, tokens) / bandwidth * 1e6
        tier = mxfp4_tilelang_tier(tokens * K, E)
        forms = {"triton": (None, lambda: triton_form.prepare(*op, arch=SM90A))}
        for c in MXFP4_TILELANG_CANDIDATES[tier]:
            forms[f"tilelang m{c.block_m} k{c.block_k} s{c.stages} o{c.occupancy}"] = (
                c, lambda c=c: tilelang_form.prepare(*op, arch=SM90A, config=c))
        for c in MXFP4_W4A8_CANDIDATES.get(tier, ()):
            forms[f"w4a8 m{c.block_m} k{c.block_k} s{c.stages} o{c.occupancy}"] = (
                c, lambda c=c: w4a8_form.prepare(*op, arch=SM90A, config=c))
        for name, (config, planner) in forms.items():
            row = {"tokens": tokens, "tier": tier, "form": name, "experts_hit": hit, "floor_us": floor_us,
                   "error_against": "reference" if hit * 0.15 < 24 else "triton",
                   "tiles": None if config is None else dataclasses.astuple(config)}
            try:
                chain = planner()
                if chain is None:
                    raise RuntimeError("not available (no cubin in the kernel set)")
                out = chain.run(0).float()
                _finish_or_exit(args.hang_s, row, rows, args.json, bandwidth)
                row["rel_err"] = ((out - ref).norm() / ref.norm()).item()
                torch.cuda.set_sync_debug_mode("error")
                try:
                    planner().run(0)
                finally:
                    torch.cuda.set_sync_debug_mode(0)
                row["us"] = graph_time(lambda: planner().run(0), calls=20) * 1e6
                row["pct_copy"] = 100 * floor_us / row["us"]
            except Exception as exc:  # report and go on: one broken form must not hide the others
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'tokens':>6} {'form':>29} {'hit':>4} {'rel err':>9} {'us':>9} {'floor us':>9} {'% copy':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['tokens']:>6} {r['form']:>29} {r['experts_hit']:>4}  {r['error'][:80]}")
        else:
            print(f"{r['tokens']:>6} {r['form']:>29} {r['experts_hit']:>4} {r['rel_err']:>9.2e} {r['us']:>9.1f} "
                  f"{r['floor_us']:>9.1f} {r['pct_copy']:>6.0f}%")
    for tokens in sorted({r["tokens"] for r in rows}):
        timed = [r for r in rows if r["tokens"] == tokens and "us" in r]
        if timed:
            best = min(timed, key=lambda r: r["us"])
            print(f"fastest at {tokens} tokens: {best['form']} ({best['us']:.1f} us)")
    _write(args.json, bandwidth, rows)
    return 0


def _write(out: Path | None, bandwidth: float, rows: list[dict]) -> None:
    if out is not None:
        out.write_text(json.dumps({"copy_bandwidth": bandwidth, "rows": rows}, indent=1))


def _finish_or_exit(hang_s: float, row: dict, rows: list[dict], out: Path | None, bandwidth: float) -> None:
    """Wait for the stream, or after ``hang_s`` record ``row`` as hung, write the results so far and exit."""
    done = torch.cuda.Event()
    done.record()
    start = time.monotonic()
    while not done.query():
        if time.monotonic() - start > hang_s:
            row["error"] = f"hung: not done after {hang_s:.0f} s"
            rows.append(row)
            print(json.dumps(row), flush=True)
            _write(out, bandwidth, rows)
            os._exit(3)
        time.sleep(0.001)


if __name__ == "__main__":
    raise SystemExit(main())
