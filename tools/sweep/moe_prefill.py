"""Time the MoE expert GEMMs of prefill under candidate tiles, in CUDA graphs (GPU host only, ~60-90 s).

    python -m tools.sweep.moe_prefill                       # V4 slice layer: 64 experts of 4096 -> 2x2048, top-6
    python -m tools.sweep.moe_prefill --tokens 1024 --budget 40 --json sweep.json

Each candidate is one kernel's tiles (``up`` or ``down``: block rows, column tile, reduction tile, warps, stages,
program order); the other kernel keeps a base config of the same block rows and order, since the two share the
plan's blocks.  All candidates are first compiled in parallel worker processes (Triton's disk cache), then, per
token count, every candidate's kernel is timed alone from a CUDA graph (``tools.timing.graph_time``) and the
whole op's output is checked against core's reference (``err``: max |ours - reference|, next to the default's)
and the default's output (``vs default``).  One line per (case, candidate): µs, % of the 695 TFLOP/s bf16 peak
for the kernel's useful FLOPs, % of its floor (max of those FLOPs at peak and its weights read once at the
measured copy bandwidth).  A candidate that fails to compile or run prints its error and is skipped.

At the end: the fastest up + down pair per (block rows, order) summed over the token counts, as the
``MoeTiles(...)`` to return from the prefill tier of ``arch.moe_experts_config``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

from tools.ceilings import copy_bandwidth
from tools.timing import graph_time

PEAK_FLOPS = 695e12  #: the measured bf16 matmul rate of the H200 (tools.ceilings.matmul_rate)


@dataclass(frozen=True)
class Candidate:
    """One kernel's tiles: ``kernel`` is "up" or "down"; ``n`` is the column tile (up: gate and up columns each)."""

    kernel: str
    block_m: int
    n: int
    k: int
    warps: int
    stages: int
    cols_inner: bool = False

    def label(self) -> str:
        return (f"{self.kernel:4s} m{self.block_m:<3d} n{self.n:<3d} k{self.k:<3d} w{self.warps} s{self.stages} "
                f"{'cols-inner' if self.cols_inner else 'block-inner'}")


#: the base of the other kernel per (block rows): known to compile, moderate tiles
_BASE = {("up", 64): (128, 64, 8, 3), ("down", 64): (256, 64, 8, 3),
         ("up", 128): (128, 64, 8, 3), ("down", 128): (256, 64, 8, 3)}


def candidates() -> list[Candidate]:
    """The sweep's candidates, most telling first (a time budget cuts from the end): the old 64-row tiles, the
    default's other program order, 128-row then 64-row variants, the other order for 64 rows."""
    old = [("up", 64, 64, 64, 4, 4), ("down", 64, 128, 64, 4, 4)]
    cols_inner = [("up", 128, 128, 64, 8, 3), ("down", 128, 256, 64, 8, 3)]
    rows128 = [("up", 128, 128, 64, 8, 4), ("up", 128, 64, 64, 8, 3), ("up", 128, 64, 64, 8, 4),
               ("up", 128, 128, 128, 8, 2), ("up", 128, 64, 128, 8, 2),
               ("down", 128, 256, 64, 8, 4), ("down", 128, 128, 64, 8, 4), ("down", 128, 128, 64, 8, 3),
               ("down", 128, 128, 128, 8, 2)]
    rows64 = [("up", 64, 128, 64, 8, 3), ("up", 64, 128, 64, 8, 4), ("up", 64, 128, 64, 4, 3),
              ("up", 64, 128, 64, 4, 4), ("up", 64, 128, 64, 8, 2), ("up", 64, 256, 64, 8, 2),
              ("up", 64, 64, 64, 8, 4),
              ("down", 64, 256, 64, 8, 3), ("down", 64, 256, 64, 8, 4), ("down", 64, 256, 64, 4, 3),
              ("down", 64, 256, 64, 8, 2), ("down", 64, 128, 64, 8, 4), ("down", 64, 128, 128, 4, 3)]
    cols_inner64 = [("up", 64, 128, 64, 8, 3), ("down", 64, 256, 64, 8, 3), ("up", 64, 64, 64, 4, 4),
                    ("down", 64, 128, 64, 4, 4)]
    return ([Candidate(*c) for c in old] + [Candidate(*c, cols_inner=True) for c in cols_inner]
            + [Candidate(*c) for c in rows128 + rows64] + [Candidate(*c, cols_inner=True) for c in cols_inner64])


def tiles_of(c: Candidate):
    """The ``MoeTiles`` that run ``c``'s kernel with ``c``'s tiles and the other with the base of its block rows."""
    from deepinfer_cuda.arch import LaunchConfig, MoeTiles

    other = "down" if c.kernel == "up" else "up"
    on, ok, ow, os_ = _BASE[(other, c.block_m)]
    mine = (LaunchConfig(num_warps=c.warps, num_stages=c.stages), c.n, c.k)
    base = (LaunchConfig(num_warps=ow, num_stages=os_), on, ok)
    up, down = (mine, base) if c.kernel == "up" else (base, mine)
    return MoeTiles(c.block_m, *up, *down, cols_inner=c.cols_inner)


def from_tiles(kernel: str, tiles) -> Candidate:
    cfg, n, k = ((tiles.up, tiles.up_block_n, tiles.up_block_k) if kernel == "up"
                 else (tiles.down, tiles.down_block_n, tiles.down_block_k))
    return Candidate(kernel, tiles.block_m, n, k, cfg.num_warps, cfg.num_stages, tiles.cols_inner)


def _compile(tiles, hidden: int, inter: int, top_k: int) -> str | None:
    """Worker: run the op once on a small batch with ``tiles`` (fills Triton's disk cache); the error, if any."""
    try:
        import torch

        from deepinfer_cuda.kernel_set.dispatch import cuda_target
        from deepinfer_cuda.kernels import moe_experts as moe

        experts, tokens = 4, 64
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        w13 = torch.randn(experts, 2 * inter, hidden, device="cuda", dtype=torch.bfloat16)
        w2 = torch.randn(experts, hidden, inter, device="cuda", dtype=torch.bfloat16)
        ids = torch.randint(0, experts, (tokens, top_k), device="cuda")
        w = torch.rand(tokens, top_k, device="cuda")
        index, arch = cuda_target(x)
        moe.prepare(x, ids, w, w13, w2, 10.0, arch=arch, tiles=tiles).run(index)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001  (any compile or launch failure is reported, not fatal)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--inter", type=int, default=2048)
    parser.add_argument("--experts", type=int, default=64)
    parser.add_argument("--top-k", type=int, default=6)
    parser.add_argument("--tokens", default="1024,2048,4096")
    parser.add_argument("--workers", type=int, default=12, help="parallel compile processes")
    parser.add_argument("--budget", type=float, default=80.0, help="seconds; later candidates are skipped after")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    t0 = time.time()

    import multiprocessing

    import torch

    from deepinfer.ops.moe import moe_experts as reference
    from deepinfer_cuda.arch import SM90A, moe_experts_config
    from deepinfer_cuda.kernels import moe_experts as moe

    h, i, e, k = args.hidden, args.inter, args.experts, args.top_k
    default = moe_experts_config(SM90A, 96, h, i)  # the prefill tier (any slots per expert >= 32)
    cands = [from_tiles("up", default), from_tiles("down", default)]
    cands += [c for c in candidates() if c not in cands]
    tiles = {c: (default if idx < 2 else tiles_of(c)) for idx, c in enumerate(cands)}

    # 1. compile every distinct tiles in parallel (workers fill Triton's disk cache; this process then loads)
    distinct = list(dict.fromkeys(tiles.values()))
    ctx = multiprocessing.get_context("spawn")
    errors: dict = {}
    with ProcessPoolExecutor(max_workers=args.workers, mp_context=ctx) as pool:
        futures = {t: pool.submit(_compile, t, h, i, k) for t in distinct}
        for t, future in futures.items():
            try:
                errors[t] = future.result()
            except Exception as ex:  # noqa: BLE001  (a worker that died: this process compiles it when timing)
                errors[t] = None
                print(f"  compile worker lost ({type(ex).__name__}); compiling in the timing loop instead")
    failed = {c: errors[tiles[c]] for c in cands if errors[tiles[c]]}
    for c, err in failed.items():
        print(f"  compile/run failed: {c.label()}: {err}")
    print(f"compiled {len(distinct)} tile sets in {time.time() - t0:.0f} s ({len(failed)} failed)", flush=True)

    torch.manual_seed(0)
    w13 = (torch.randn(e, 2 * i, h, device="cuda") * h**-0.5 * 4).bfloat16()
    w2 = (torch.randn(e, h, i, device="cuda") * i**-0.5).bfloat16()
    bandwidth = copy_bandwidth()
    index = torch.cuda.current_device()
    print(f"copy bandwidth {bandwidth / 1e12:.2f} TB/s, peak {PEAK_FLOPS / 1e12:.0f} TFLOP/s (fixed)")
    rows = []
    token_counts = [int(t) for t in args.tokens.split(",")]
    start = time.time()
    for case, tokens in enumerate(token_counts):
        deadline = start + (args.budget - (start - t0)) * (case + 1) / len(token_counts)
        x = torch.randn(tokens, h, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(tokens, e, device="cuda").argsort(dim=1)[:, :k].contiguous()
        w = torch.rand(tokens, k, device="cuda")
        want = reference(x, ids, w, w13, w2, 10.0).float()
        flops = {"up": tokens * k * 2 * i * h * 2, "down": tokens * k * h * i * 2}
        weight_bytes = {"up": e * 2 * i * h * 2, "down": e * h * i * 2}
        floor = {n: max(flops[n] / PEAK_FLOPS, weight_bytes[n] / bandwidth) * 1e6 for n in flops}
        print(f"T={tokens}: up {flops['up'] / 1e9:.0f} GFLOP, floor {floor['up']:.0f} us; "
              f"down {flops['down'] / 1e9:.0f} GFLOP, floor {floor['down']:.0f} us", flush=True)
        default_out = None
        default_err = float("nan")
        op_us = graph_time(lambda: moe.prepare(x, ids, w, w13, w2, 10.0, arch=SM90A).run(index), 3) * 1e6
        print(f"  whole op (plan, up, down, combine) with the default tiles: {op_us:.1f} us, "
              f"{100 * (flops['up'] + flops['down']) / PEAK_FLOPS / (op_us * 1e-6):.1f}% of peak", flush=True)
        for idx, c in enumerate(cands):
            if c in failed:
                continue
            if idx >= 2 and time.time() > deadline:
                print(f"  this case's share of the {args.budget:.0f} s budget is spent: {len(cands) - idx} "
                      "candidates skipped")
                break
            try:
                plan = moe.prepare(x, ids, w, w13, w2, 10.0, arch=SM90A, tiles=tiles[c])
                out = plan.run(index).float()
                err = (out - want).abs().max().item()
                if default_out is None:
                    default_out, default_err = out, err
                vs_default = (out - default_out).abs().max().item()
                kernel = moe.UP_KERNEL if c.kernel == "up" else moe.DOWN_KERNEL
                launch = next(step for kk, step in plan.steps if kk is kernel)
                us = graph_time(lambda: launch.run(kernel, index), 3) * 1e6
            except Exception as ex:  # noqa: BLE001 - a candidate that fails is reported, not fatal
                print(f"  {c.label()}: FAILED {type(ex).__name__}: {str(ex).splitlines()[0] if str(ex) else ''}")
                continue
            row = {"tokens": tokens, **asdict(c), "default": idx < 2, "us": us,
                   "pct_peak": 100 * flops[c.kernel] / PEAK_FLOPS / (us * 1e-6),
                   "pct_floor": 100 * floor[c.kernel] / us,
                   "err": err, "default_err": default_err, "vs_default": vs_default}
            rows.append(row)
            print(f"  {'*' if row['default'] else ' '} {c.label()}: {us:7.1f} us  {row['pct_peak']:5.1f}% of peak  "
                  f"{row['pct_floor']:5.1f}% of floor  err {err:.4f} (default {default_err:.4f})  "
                  f"vs default {vs_default:.4f}", flush=True)
    _summary(rows)
    print(f"total {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "peak": PEAK_FLOPS, "rows": rows}, f, indent=1)
    return 0


def _summary(rows: list[dict]) -> None:
    """Fastest up and down per (block rows, order), summed over the token counts every candidate ran at."""
    cases = sorted({r["tokens"] for r in rows})
    best: dict[tuple, dict[str, tuple[float, dict]]] = {}
    by_cand: dict[tuple, dict[int, float]] = {}
    for r in rows:
        key = (r["kernel"], r["block_m"], r["n"], r["k"], r["warps"], r["stages"], r["cols_inner"])
        by_cand.setdefault(key, {})[r["tokens"]] = r["us"]
    for key, times in by_cand.items():
        if len(times) != len(cases):
            continue
        kernel, block_m, *_, cols_inner = key
        total = sum(times.values())
        group = best.setdefault((block_m, cols_inner), {})
        if kernel not in group or total < group[kernel][0]:
            fields = ("kernel", "block_m", "n", "k", "warps", "stages", "cols_inner")
            group[kernel] = (total, dict(zip(fields, key, strict=True)))
    print(f"best pairs (µs summed over T={cases}):")
    for (block_m, cols_inner), group in sorted(best.items(), key=lambda kv: sum(t for t, _ in kv[1].values())):
        if len(group) != 2:
            continue
        (tu, u), (td, d) = group["up"], group["down"]
        print(f"  {tu + td:8.1f} us: MoeTiles({block_m}, "
              f"LaunchConfig(num_warps={u['warps']}, num_stages={u['stages']}), {u['n']}, {u['k']}, "
              f"LaunchConfig(num_warps={d['warps']}, num_stages={d['stages']}), {d['n']}, {d['k']}, "
              f"cols_inner={cols_inner})  (up {tu:.1f} + down {td:.1f})")


if __name__ == "__main__":
    sys.exit(main())
