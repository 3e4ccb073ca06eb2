"""FP8 block-scaled projections: the TileLang forms against the Triton form and core's reference (GPU host).

    python -m tools.sweep.fp8_tilelang [--rows 1,16,64] [--json out.json]

V4.1-Flash's FP8 projections (``arch.FP8_TILELANG_CANDIDATES``: wq_a | wkv, wq_b, wo_a, wo_b, the shared expert's
w1 | w3 and w2; e4m3 codes, ue8m0 32x32 scales near 2^-14), at each row count: the Triton form the op plans today
(``arch.FP8_TILELANG`` cleared) and every TileLang candidate of the row tier in the active kernel set.  Each form's
error against core's reference (max |diff| / max |reference|), its device time in a CUDA graph over enough weight
copies that L2 holds none (each layer's weights are cold in a real step), and its share of the copy bandwidth
measured in the run for the bytes it must read (codes, scales, x, y).  Prints the fastest form per (shape, rows):
where a TileLang form wins, its tiles go into ``arch.FP8_TILELANG`` for that tier.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from collections.abc import Callable
from pathlib import Path

import torch

from tools.ceilings import copy_bandwidth
from tools.timing import graph_time

L2_BYTES = 60 << 20


def problem(n: int, k: int, groups: int, rows: int, block: int, gen: torch.Generator):
    """x and enough copies of one random weight (codes, ue8m0 scales) that L2 holds none; the bytes a call reads."""
    nbytes = groups * n * k * (1 + 1 / block**2) + rows * groups * (k + n) * 2
    x = torch.randn(rows, groups, k, device="cuda", generator=gen).bfloat16()
    codes = (torch.randn(groups * n, k, device="cuda", generator=gen) * 64).clamp(-448, 448).to(torch.float8_e4m3fn)
    exps = torch.randint(-16, -12, (groups * n // block, k // block), device="cuda", generator=gen)
    scale = (exps + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    copies = max(1, math.ceil(3 * L2_BYTES / nbytes))
    return (x if groups > 1 else x[:, 0]), [(codes.clone(), scale.clone()) for _ in range(copies)], nbytes


def cold_call(x: torch.Tensor, weights: list, groups: int, block: int) -> Callable[[], torch.Tensor]:
    """The op on the next weight copy at each call (as the arch table plans it then)."""
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import fp8_block_linear as op

    turn = [0]

    def call() -> torch.Tensor:
        w, s = weights[turn[0] % len(weights)]
        turn[0] += 1
        return op.plan_gemm(x, w, s, block, block, groups, arch=SM90A, interpreted=False).run(0)
    return call


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,16,64")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    from deepinfer.ops.quant_gemm import fp8_block_grouped_linear, fp8_block_linear
    from deepinfer_cuda import arch
    from deepinfer_cuda.arch import SM90A, fp8_tilelang_tier
    from deepinfer_cuda.kernels import fp8_block_linear as op

    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e12:.3f} TB/s; {torch.cuda.get_device_name()}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    table = dict(arch.FP8_TILELANG)
    rows_out = []
    try:
        for n, k, groups, block in arch.FP8_TILELANG_CANDIDATES:
            for rows in [int(r) for r in args.rows.split(",")]:
                tier = fp8_tilelang_tier(rows)
                x, weights, nbytes = problem(n, k, groups, rows, block, gen)
                ref = (fp8_block_grouped_linear if groups > 1 else fp8_block_linear)(x, *weights[0], block, block)
                forms: dict[str, object] = {"triton": None}
                forms.update({f"tilelang m{t.block_m} k{t.block_k} s{t.stages} split{t.split} o{t.occupancy}": t
                              for t in (arch.fp8_tilelang_candidates((n, k, groups, block), tier) if tier else ())})
                for name, tiles in forms.items():
                    arch.FP8_TILELANG.clear()
                    if tiles is not None:
                        arch.FP8_TILELANG[(n, k, groups, block)] = {tier: tiles}
                    row = {"shape": [n, k, groups], "rows": rows, "form": name, "floor_us": nbytes / bandwidth * 1e6,
                           "tiles": None if tiles is None else dataclasses.astuple(tiles)}
                    try:
                        chain = op.plan_gemm(x, *weights[0], block, block, groups, arch=SM90A, interpreted=False)
                        ran = chain.steps[0][0].name
                        if (tiles is None) == (ran == "fp8_block_linear_tl"):
                            raise RuntimeError(f"planned {ran}: no cubin for this form in the kernel set")
                        out = chain.run(0).float()
                        again = op.plan_gemm(x, *weights[0], block, block, groups, arch=SM90A,
                                             interpreted=False).run(0).float()
                        row["rel_err"] = ((out - ref.float()).abs().max() / ref.float().abs().max()).item()
                        row["same_bits_twice"] = bool(torch.equal(out, again))
                        row["us"] = graph_time(cold_call(x, weights, groups, block), calls=len(weights)) * 1e6
                        row["pct_copy"] = 100 * row["floor_us"] / row["us"]
                    except Exception as exc:  # report and go on: one broken form must not hide the others
                        row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                    rows_out.append(row)
                    print(json.dumps(row), flush=True)
    finally:
        arch.FP8_TILELANG.clear()
        arch.FP8_TILELANG.update(table)
    print(f"\n{'shape':>18} {'rows':>4} {'form':>36} {'rel err':>9} {'us':>8} {'% copy':>7}")
    for r in rows_out:
        shape = "x".join(map(str, r["shape"]))
        tail = r["error"][:70] if "error" in r else \
            f"{r['rel_err']:>9.2e} {r['us']:>8.2f} {r['pct_copy']:>6.0f}%{'' if r['same_bits_twice'] else ' RACE'}"
        print(f"{shape:>18} {r['rows']:>4} {r['form']:>36} {tail}")
    for key in sorted({(tuple(r["shape"]), r["rows"]) for r in rows_out}):
        timed = [r for r in rows_out if (tuple(r["shape"]), r["rows"]) == key and "us" in r]
        if timed:
            best = min(timed, key=lambda r: r["us"])
            print(f"fastest {key}: {best['form']} ({best['us']:.2f} us, {best['pct_copy']:.0f}% of copy)")
    if args.json is not None:
        args.json.write_text(json.dumps({"copy_bandwidth": bandwidth, "rows": rows_out}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
