"""Time the released-format decode kernels under candidate tiles against the copy roofline (GPU host, < 4 min).

    python -m tools.sweep.quant_decode                  # V4.1-Flash: FP8 projections at 1 and 16 rows, MXFP4 experts
    python -m tools.sweep.quant_decode --shapes all --budget 300 --json sweep.json   # every AOT shape of the FP8 GEMM
    python -m tools.sweep.quant_decode --forms tma      # the FP8 config's tiles against TMA weight tiles only
    TRITON_INTERPRET=1 python -m tools.sweep.quant_decode --tiny                     # CPU: tiny shapes (the test's)

FP8 (``fp8_block_linear`` / ``_grouped``, square ue8m0 scale blocks of ``--block``: 32 as V4.1-Flash, 128 as V4):
for each (N, K, groups) of ``fp8_block_linear.AOT_SHAPES`` (default: V4.1-Flash's) and each row tier (1 row; 16 rows
for the 63-row tier), every candidate ``arch.Fp8DecodeTile`` (row loop or 16-row tl.dot tiles, column tile,
reduction step, split-K, warps, stages, pointer or TMA weight loads; ``arch.fp8_linear_config``'s own first, then
the TMA tiles) runs the whole op (and the split-K sum) from a CUDA graph over enough copies of the weight that L2
holds none of them (each layer's weights are cold in a real step).
MXFP4 experts (top-6 of 384, hidden 5120, intermediate 2304) at 1 and 16 tokens: each candidate of the up and of
the down kernel is timed alone, over several routings.  Every row: µs per call, the bytes it must read (weights,
scales, activations) and their share of the measured copy bandwidth; ``err``: max |ours - reference| / max
|reference| (the reference op on the GPU; above 2% the candidate is marked BAD and never chosen).

All candidates are first compiled in parallel worker processes (Triton's disk cache), then timed in this process;
``--budget`` seconds of timing, spread over the cases, cut the candidates from the end (most telling first).  At
the end, per case, the fastest candidate as the entry to paste into ``arch.FP8_DECODE_TILES`` /
``arch.MXFP4_DECODE_TILES``.  ``--tiny`` runs the same code on the CPU under Triton's interpreter (tiny shapes,
a few candidates, wall-clock "times"): what ``tests/backend_cuda/test_sweep_quant_decode.py`` checks.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass

from tools.ceilings import copy_bandwidth
from tools.timing import graph_time

#: V4.1-Flash's FP8 projections (N per group, K, groups): wq_a | wkv, wq_b, wo_a (grouped), wo_b, the shared
#: expert's w1 | w3 and w2
FLASH41 = ((1792, 5120, 1), (32768, 1280, 1), (1024, 4096, 8), (5120, 8192, 1), (4608, 5120, 1), (5120, 2304, 1))
MOE = (5120, 2304, 384, 6)  #: hidden, intermediate, experts, top-k (V4.1-Flash)
TINY_FP8 = ((96, 256, 1), (32, 128, 2))
TINY_MOE = (64, 32, 16, 6)
L2_BYTES = 60 << 20  #: rotate over weight copies adding up to 3x this (H200: 50 MiB of L2)
BAD = 2e-2


@dataclass(frozen=True)
class Fp8Case:
    n: int
    k: int
    groups: int
    rows: int
    block: int = 32  #: the square scale block (V4.1-Flash: 32; V4: 128)

    @property
    def tier(self) -> int:
        from deepinfer_cuda.arch import FP8_DECODE_ROW_TIERS

        return next(t for t in FP8_DECODE_ROW_TIERS if self.rows <= t)

    def label(self) -> str:
        return f"fp8 {self.n}x{self.k}{f'x{self.groups}g' if self.groups > 1 else ''} m{self.rows} b{self.block}"


def fp8_candidates(case: Fp8Case, tiny: bool, forms: str = "all") -> list:
    """The config's tile first; then TMA weight tiles (the config's tile at 2..4 stages, then a grid at 3 stages:
    TMA needs stages to keep bytes in flight), then pointer-load row loops (1 row) or tl.dot tiles (16 rows); all
    pruned to sane program counts.  ``forms``: "tma" or "pointer" keeps the config's tile and that form's only."""
    from deepinfer_cuda.arch import SM90A, Fp8DecodeTile, fp8_linear_config

    base = fp8_linear_config(SM90A, case.rows, case.n, case.k, case.groups, case.block, 2)
    out = [Fp8DecodeTile(base.row_loop, base.block_n, base.block_k, base.split_k, base.config.num_warps,
                         base.config.num_stages, base.tma)]
    as_tma = [(base.row_loop, base.block_n, base.block_k, base.split_k, base.config.num_warps, st, True)
              for st in (2, 3, 4)]
    if tiny:
        grid = [(True, 4, 128, 2, 4, 2, True), (False, 16, 64, 3, 4, 2, True), (True, 4, 128, 2, 4, 1),
                (False, 16, 64, 3, 4, 1), (False, 32, 128, 1, 4, 2)]
    elif case.rows == 1:  # 8 warps for the widest steps only
        grid = as_tma + [(True, bn, bk, s, 8 if bk == 2048 else 4, 3, True)
                         for bk, s, bn in itertools.product((1024, 512, 2048), (1, 2), (4, 8, 16))]
        grid += [(True, bn, bk, s, 8 if bk == 2048 else 4, 1)
                 for bk, s, bn in itertools.product((1024, 512, 2048), (1, 2, 4), (4, 8, 2, 16))]
    else:
        grid = as_tma + [(False, bn, bk, s, 4, 3, True)
                         for bk, s, bn in itertools.product((256, 512), (1, 2, 4), (16, 32, 64))]
        grid += [(False, bn, bk, s, 4, 1) for bk, s, bn in itertools.product((512, 256, 1024), (1, 2, 4), (16, 32, 64))]
    cols = case.n * case.groups
    for c in grid:
        tile = Fp8DecodeTile(*c)
        steps = -(-case.k // tile.block_k)
        programs = -(-cols // tile.block_n) * min(tile.split_k, steps)
        waste = steps * tile.block_k / case.k - 1  # masked columns of the last step
        regs = tile.block_n * tile.block_k / (32 * tile.num_warps)  # weight values a thread holds
        wanted = forms == "all" or tile.tma == (forms == "tma")
        if tile not in out and wanted and (tiny or (132 <= programs <= 16384 and waste <= 0.25 and regs <= 128)):
            out.append(tile)
    return out


@dataclass(frozen=True)
class MoeCandidate:
    kernel: str  #: "up" or "down"
    n: int
    k: int
    warps: int
    stages: int
    row_loop: bool = True
    tma: bool = False  #: row loop only: weight tiles by TMA, ``stages`` deep

    def label(self) -> str:
        return f"{self.kernel:4s} n{self.n:<3d} k{self.k:<4d} w{self.warps} s{self.stages} " + (
            "row-loop" if self.row_loop else "tl.dot") + (" tma" if self.tma else "")


def moe_candidates(tiny: bool, forms: str = "all") -> list[MoeCandidate]:
    """The config's row-loop tiles and moe_experts' 16-row tl.dot tier first; then TMA row loops (the config's
    tiles at 2..4 stages, then a grid at 3 stages), then pointer-load row-loop variants (``forms``: as for FP8)."""
    from deepinfer_cuda.arch import SM90A, moe_experts_config, moe_mxfp4_config

    h, i = (TINY_MOE if tiny else MOE)[:2]
    out = []
    for tiles in (moe_mxfp4_config(SM90A, 0, h, i), None):
        t = tiles.tiles if tiles else moe_experts_config(SM90A, 0, h, i)
        loop, tma = (tiles.row_loop, tiles.tma) if tiles else (False, False)
        out += [MoeCandidate("up", t.up_block_n, t.up_block_k, t.up.num_warps, t.up.num_stages, loop, tma),
                MoeCandidate("down", t.down_block_n, t.down_block_k, t.down.num_warps, t.down.num_stages, loop, tma)]
    if tiny:
        grid = [MoeCandidate("up", 16, 32, 4, 2, tma=True), MoeCandidate("down", 16, 64, 4, 2, tma=True),
                MoeCandidate("up", 16, 32, 4, 1), MoeCandidate("down", 16, 32, 4, 1)]
    else:
        grid = [MoeCandidate(c.kernel, c.n, c.k, c.warps, st, tma=True) for c in out[:2] for st in (2, 3, 4)]
        for kernel, ns in (("up", (8, 16, 32)), ("down", (16, 32, 64))):
            grid += [MoeCandidate(kernel, n, k, w, 3, tma=True)
                     for n, k, w in itertools.product(ns, (256, 512, 1024), (4,))]
        for kernel, ns in (("up", (8, 16, 32)), ("down", (16, 32, 64))):
            grid += [MoeCandidate(kernel, n, k, w, 1) for n, k, w in itertools.product(ns, (256, 512, 1024), (4, 8))]
    for c in grid:
        wanted = forms == "all" or c.tma == (forms == "tma")
        fits = c.n * c.k // 2 * (2 if c.kernel == "up" else 1) <= 32 * 32 * c.warps * 16  # bytes a step, registers
        if c not in out and wanted and (tiny or fits):
            out.append(c)
    return out


def moe_tiles(c: MoeCandidate, tiny: bool):
    """``Mxfp4Tiles`` running ``c``'s kernel with ``c``'s tiles, the other kernel with the base of its form: the
    config's row loop, or ``moe_experts``' 16-row tl.dot tier (both kernels take one form: they share the plan)."""
    import dataclasses

    from deepinfer_cuda.arch import SM90A, LaunchConfig, Mxfp4Tiles, moe_experts_config, moe_mxfp4_config

    h, i = (TINY_MOE if tiny else MOE)[:2]
    t = moe_mxfp4_config(SM90A, 0, h, i).tiles if c.row_loop else moe_experts_config(SM90A, 0, h, i)
    cfg = LaunchConfig(num_warps=c.warps, num_stages=c.stages)
    if c.kernel == "up":
        t = dataclasses.replace(t, up=cfg, up_block_n=c.n, up_block_k=c.k)
    else:
        t = dataclasses.replace(t, down=cfg, down_block_n=c.n, down_block_k=c.k)
    return Mxfp4Tiles(t, row_loop=c.row_loop, tma=c.tma)  # (tma: both kernels; only ``c.kernel`` is timed)


# --- problems ---------------------------------------------------------------------------------------------------
def fp8_problem(case: Fp8Case, device: str, copies: int = 1, seed: int = 0):
    """(x, [(weight, scale)] * copies) in the released format (e4m3 codes, ue8m0 scales per square block)."""
    import torch

    gen = torch.Generator(device=device).manual_seed(seed)
    shape = (case.rows, case.groups, case.k) if case.groups > 1 else (case.rows, case.k)
    x = torch.randn(*shape, generator=gen, device=device).bfloat16()
    n = case.n * case.groups
    data = (torch.randn(n, case.k, generator=gen, device=device) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    exps = torch.randint(-16, -12, (-(-n // case.block), -(-case.k // case.block)), generator=gen, device=device)
    scale = (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    return x, [(data.clone(), scale.clone()) for _ in range(copies)]


def fp8_bytes(case: Fp8Case) -> int:
    n = case.n * case.groups
    return n * case.k + -(-n // case.block) * -(-case.k // case.block) + case.rows * case.groups * (case.k + case.n) * 2


def moe_problem(tokens: int, tiny: bool, device: str, routings: int, experts: int | None = None):
    """(weights, [(x, ids, routing weights)] * routings): MXFP4 experts of random bytes, scales 2^-9..2^-7."""
    import torch

    h, i, e, k = TINY_MOE if tiny else MOE
    e = experts or e
    gen = torch.Generator(device=device).manual_seed(0)
    w = []
    for rows, cols in ((2 * i, h), (h, i)):
        w.append(torch.randint(0, 256, (e, rows, cols // 2), generator=gen, device=device, dtype=torch.uint8))
        w.append(torch.randint(118, 121, (e, rows, cols // 32), generator=gen, device=device, dtype=torch.uint8))
    calls = []
    for _ in range(routings):
        ids = torch.rand(tokens, e, generator=gen, device=device).argsort(dim=1)[:, :k].contiguous()
        x = torch.randn(tokens, h, generator=gen, device=device).bfloat16()
        calls.append((x, ids, torch.rand(tokens, k, generator=gen, device=device)))
    return w, calls


def moe_bytes(kernel: str, hit: int, tiny: bool) -> int:
    h, i = (TINY_MOE if tiny else MOE)[:2]
    rows, cols = (2 * i, h) if kernel == "up" else (h, i)
    return hit * rows * (cols // 2 + cols // 32)


# --- compiling and running ---------------------------------------------------------------------------------------
def _run(plan, tiny: bool, device_index: int = 0):
    """Run a plan: launches through Triton's interpreter (``tiny``) or the CUDA path."""
    if not tiny:
        return plan.run(device_index)
    for kernel, launch in plan.steps:
        if all(g > 0 for g in launch.grid):
            kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps,
                                       num_stages=launch.config.num_stages)
    return plan.finish()


def _fp8_plan(case: Fp8Case, x, w, s, tile, tiny: bool):
    from deepinfer_cuda.arch import SM90A, fp8_decode_tiles
    from deepinfer_cuda.kernels import fp8_block_linear as m

    return m.plan_gemm(x, w, s, case.block, case.block, case.groups, arch=SM90A, interpreted=tiny,
                       tiles=fp8_decode_tiles(tile, 2))


def _moe_plan(x, ids, rw, w, tiles):
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import moe_experts_mxfp4 as m

    return m.prepare(x, ids, rw, *w, 10.0, arch=SM90A, tiles=tiles)


def _compile(job: tuple) -> str | None:
    """Worker: run one candidate once on the GPU (fills Triton's disk cache); the error, if any."""
    try:
        import torch

        kind, case, cand = job
        if kind == "fp8":
            x, [(w, s)] = fp8_problem(case, "cuda")
            _run(_fp8_plan(case, x, w, s, cand, False), False)
        else:
            w, [(x, ids, rw)] = moe_problem(1, False, "cuda", 1, experts=8)
            _run(_moe_plan(x, ids, rw, w, moe_tiles(cand, False)), False)
        torch.cuda.synchronize()
        return None
    except Exception as e:  # noqa: BLE001  (any compile or launch failure is reported, not fatal)
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]


def _timer(tiny: bool):
    """µs per call of ``fn`` making ``calls`` calls: a CUDA graph's replays (GPU), or wall clock (``tiny``)."""
    def measure(fn, calls: int) -> float:
        if tiny:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) / calls * 1e6

        return graph_time(fn, per_call=calls, warmup=5, rep=40) * 1e6

    return measure


def _rel_err(got, want) -> float:
    return float((got.float() - want.float()).abs().max() / want.float().abs().max().clamp_min(1e-30))


# --- the sweep ---------------------------------------------------------------------------------------------------
def sweep_fp8(cases: list[Fp8Case], cands: dict, failed: set, tiny: bool, deadline, rows_out: list) -> None:
    from deepinfer.ops.quant_gemm import fp8_block_grouped_linear, fp8_block_linear

    device = "cpu" if tiny else "cuda"
    measure = _timer(tiny)
    for idx, case in enumerate(cases):
        nbytes = fp8_bytes(case)
        copies = 1 if tiny else max(1, math.ceil(3 * L2_BYTES / nbytes))
        x, weights = fp8_problem(case, device, copies)
        ref = fp8_block_grouped_linear if case.groups > 1 else fp8_block_linear
        want = ref(x, *weights[0], case.block, case.block)
        print(f"{case.label()}: {nbytes / 1e6:.1f} MB a call, {copies} weight copies", flush=True)
        for c_idx, cand in enumerate(cands[case]):
            if (case, cand) in failed:
                continue
            if c_idx and time.time() > deadline(idx):
                print(f"  budget spent: {len(cands[case]) - c_idx} candidates skipped")
                break
            plans = [_fp8_plan(case, x, w, s, cand, tiny) for w, s in weights]
            err = _rel_err(_run(plans[0], tiny), want)
            us = measure(lambda plans=plans: [_run(p, tiny) for p in plans], copies)
            row = {"op": "fp8", **asdict(case), "tier": case.tier, **asdict(cand), "us": us, "bytes": nbytes,
                   "err": err, "default": c_idx == 0}
            rows_out.append(row)
            _print_row(row, cand_label(cand))


def cand_label(t) -> str:
    return (f"{'row-loop' if t.row_loop else 'tl.dot  '} n{t.block_n:<3d} k{t.block_k:<5d} split{t.split_k} "
            f"w{t.num_warps} s{t.num_stages}{' tma' if t.tma else ''}")


def sweep_moe(tokens_list: list[int], cands: list[MoeCandidate], failed: set, tiny: bool, deadline, rows_out: list,
              first_case: int) -> None:
    import torch

    from deepinfer.ops.quant_gemm import moe_experts_mxfp4 as reference
    from deepinfer_cuda.kernels import moe_experts_mxfp4 as m

    device = "cpu" if tiny else "cuda"
    measure = _timer(tiny)
    for idx, tokens in enumerate(tokens_list):
        routings = 1 if tiny else 8
        w, calls = moe_problem(tokens, tiny, device, routings)
        hit = sum(int(torch.unique(ids).numel()) for _, ids, _ in calls) / routings
        want = reference(*calls[0], *w, 10.0)
        print(f"mxfp4 T={tokens}: {hit:.1f} experts hit a call (mean of {routings} routings)", flush=True)
        for c_idx, cand in enumerate(cands):
            if cand in failed:
                continue
            if c_idx > 3 and time.time() > deadline(first_case + idx):
                print(f"  budget spent: {len(cands) - c_idx} candidates skipped")
                break
            tiles = moe_tiles(cand, tiny)
            plans = [_moe_plan(*call, w, tiles) for call in calls]
            err = _rel_err(_run(plans[0], tiny), want)
            for p in plans[1:]:
                _run(p, tiny)  # the plans' tables and activations, for the kernel timed alone
            kernel = m.UP_KERNEL if cand.kernel == "up" else m.DOWN_KERNEL
            launches = [next(launch for k, launch in p.steps if k is kernel) for p in plans]
            if tiny:
                def fn(launches=launches, kernel=kernel):
                    for launch in launches:
                        kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps,
                                                   num_stages=launch.config.num_stages)
            else:
                def fn(launches=launches, kernel=kernel):
                    for launch in launches:
                        launch.run(kernel, 0)
            us = measure(fn, len(launches))
            row = {"op": "mxfp4", "tokens": tokens, **asdict(cand), "us": us,
                   "bytes": moe_bytes(cand.kernel, round(hit), tiny), "err": err, "default": c_idx < 2}
            rows_out.append(row)
            _print_row(row, cand.label())


_BANDWIDTH: list[float] = [0.0]


def _print_row(row: dict, label: str) -> None:
    bw = _BANDWIDTH[0]
    roof = f"{100 * row['bytes'] / bw / (row['us'] * 1e-6):5.1f}% of copy" if bw else "  n/a"
    bad = "  BAD" if row["err"] > BAD else ""
    print(f"  {'*' if row['default'] else ' '} {label}: {row['us']:9.2f} us  {roof}  err {row['err']:.2e}{bad}",
          flush=True)


def summary(rows: list[dict], moe_shape: tuple[int, ...]) -> None:
    """The fastest good candidate per FP8 case; the fastest MXFP4 up + down pair per form (µs summed over the token
    counts), the faster form first (the entry for ``arch.MXFP4_DECODE_TILES``)."""
    bw = _BANDWIDTH[0]
    print("\nbest FP8 decode tiles (paste into arch.FP8_DECODE_TILES):")
    cases = sorted({(r["n"], r["k"], r["groups"], r["rows"], r["tier"]) for r in rows if r["op"] == "fp8"})
    for n, k, g, m, tier in cases:
        mine = [r for r in rows if r["op"] == "fp8" and (r["n"], r["k"], r["groups"], r["rows"]) == (n, k, g, m)]
        good = [r for r in mine if r["err"] <= BAD]
        if not good:
            print(f"    # {n}x{k}x{g} m{m}: no candidate within {BAD}")
            continue
        best = min(good, key=lambda r: r["us"])
        default = next((r for r in mine if r["default"]), best)
        roof = f", {100 * best['bytes'] / bw / (best['us'] * 1e-6):.0f}% of copy" if bw else ""
        tma = ", tma=True" if best.get("tma") else ""
        print(f"    ({n}, {k}, {g}, {tier}): Fp8DecodeTile({best['row_loop']}, {best['block_n']}, {best['block_k']}, "
              f"{best['split_k']}, {best['num_warps']}, {best['num_stages']}{tma}),  # m{m}: {best['us']:.2f} us{roof} "
              f"(default {default['us']:.2f})")
    moe = [r for r in rows if r["op"] == "mxfp4" and r["err"] <= BAD]
    tokens = sorted({r["tokens"] for r in moe})
    totals: dict[tuple, dict[int, float]] = {}
    for r in moe:
        key = (r["row_loop"], r.get("tma", False), r["kernel"], r["n"], r["k"], r["warps"], r["stages"])
        totals.setdefault(key, {})[r["tokens"]] = r["us"]
    full = {key: sum(t.values()) for key, t in totals.items() if len(t) == len(tokens)}
    pairs = []
    # both kernels take one form (they share the plan's blocks; Mxfp4Tiles.tma is both kernels' too)
    for form in ((True, False), (True, True), (False, False)):
        up = [key for key in full if key[:3] == (*form, "up")]
        down = [key for key in full if key[:3] == (*form, "down")]
        if up and down:
            u, d = min(up, key=full.__getitem__), min(down, key=full.__getitem__)
            pairs.append((full[u] + full[d], u, d))
    h, i = moe_shape[:2]
    for total, u, d in sorted(pairs):
        name = ("row-loop, TMA" if u[1] else "row-loop") if u[0] else "tl.dot (moe_experts_config's 16-row tier)"
        tma = ", tma=True" if u[1] else ""
        print(f"best MXFP4 {name}: {total:.1f} us over T={tokens} (up {full[u]:.1f} + down {full[d]:.1f}):\n"
              f"    ({h}, {i}): Mxfp4Tiles(MoeTiles(16, LaunchConfig(num_warps={u[5]}, num_stages={u[6]}), {u[3]}, "
              f"{u[4]}, LaunchConfig(num_warps={d[5]}, num_stages={d[6]}), {d[3]}, {d[4]}), row_loop={u[0]}{tma}),")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="CPU, Triton's interpreter, tiny shapes")
    parser.add_argument("--shapes", choices=("flash41", "all"), default="flash41")
    parser.add_argument("--rows", default="1,16", help="FP8 row counts")
    parser.add_argument("--tokens", default="1,16", help="MXFP4 token counts")
    parser.add_argument("--block", type=int, default=32, help="FP8 scale block (V4.1-Flash 32, V4 128)")
    parser.add_argument("--skip", choices=("fp8", "mxfp4"), help="leave one op out")
    parser.add_argument("--forms", choices=("all", "tma", "pointer"), default="all",
                        help="weight loads of the candidates besides the config's own: TMA tiles, pointer loads, both")
    parser.add_argument("--workers", type=int, default=14, help="parallel compile processes")
    parser.add_argument("--budget", type=float, default=120.0, help="seconds of timing; later candidates skipped")
    parser.add_argument("--json", help="also write the rows here")
    args = parser.parse_args(argv)
    t0 = time.time()
    if args.tiny and os.environ.get("TRITON_INTERPRET") != "1":
        parser.error("--tiny runs under Triton's interpreter: set TRITON_INTERPRET=1")
    import torch

    from deepinfer_cuda.kernels import fp8_block_linear, moe_experts_mxfp4

    if args.tiny:
        torch.set_num_threads(1)
        moe_experts_mxfp4.INTERPRETED = True  # (the FP8 plans take ``interpreted`` as an argument)
    shapes = TINY_FP8 if args.tiny else FLASH41 if args.shapes == "flash41" else fp8_block_linear.AOT_SHAPES
    rows_list = [1, 3] if args.tiny else [int(r) for r in args.rows.split(",")]
    fp8_cases = [] if args.skip == "fp8" else [Fp8Case(n, k, g, r, args.block) for n, k, g in shapes
                                                  for r in rows_list]
    fp8_cands = {case: fp8_candidates(case, args.tiny, args.forms) for case in fp8_cases}
    tokens = [] if args.skip == "mxfp4" else ([1, 4] if args.tiny else [int(t) for t in args.tokens.split(",")])
    moe_cands = moe_candidates(args.tiny, args.forms) if tokens else []

    failed: set = set()
    if not args.tiny:  # 1. compile every candidate in parallel (workers fill Triton's disk cache)
        import multiprocessing

        jobs = [("fp8", case, c) for case in fp8_cases for c in fp8_cands[case]] + [("moe", None, c) for c in moe_cands]
        with ProcessPoolExecutor(max_workers=args.workers, mp_context=multiprocessing.get_context("spawn")) as pool:
            for job, err in zip(jobs, pool.map(_compile, jobs), strict=True):
                if err:
                    failed.add((job[1], job[2]) if job[0] == "fp8" else job[2])
                    print(f"  compile/run failed: {job[0]} {job[1] or ''} {job[2]}: {err}")
        print(f"compiled {len(jobs)} candidates in {time.time() - t0:.0f} s ({len(failed)} failed)", flush=True)

        _BANDWIDTH[0] = copy_bandwidth()
        print(f"copy bandwidth {_BANDWIDTH[0] / 1e12:.2f} TB/s", flush=True)

    start = time.time()
    n_cases = len(fp8_cases) + len(tokens)

    def deadline(case_idx: int) -> float:
        return start + args.budget * (case_idx + 1) / max(1, n_cases)

    rows: list[dict] = []
    sweep_fp8(fp8_cases, fp8_cands, failed, args.tiny, deadline, rows)
    sweep_moe(tokens, moe_cands, failed, args.tiny, deadline, rows, len(fp8_cases))
    summary(rows, TINY_MOE if args.tiny else MOE)
    print(f"total {time.time() - t0:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": _BANDWIDTH[0], "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
