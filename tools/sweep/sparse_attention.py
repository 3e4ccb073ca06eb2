"""Time sparse attention at V4-Flash shapes under candidate tiles, in CUDA graphs (GPU host only).

    python -m tools.sweep.sparse_attention                  # all cases, every candidate (~60-90 s)
    python -m tools.sweep.sparse_attention --cases csa,b1   # some cases; --json PATH also writes the rows

Cases (64 heads x 512, one K=V pool, sinks): a 1024-token prefill's three layer kinds, with the index rows the
model builds (a 128-row window, -1 before the sequence start; HCA adds 8 entries, CSA 512 top-k slots of which
at most 256 entries exist, the rest -1), and decode batches of 1, 16 and 64 queries with 640 valid indices.
Every candidate ``SparseAttentionTiles`` (``arch.sparse_attention_config``'s first, marked *) runs the whole op
(attention + combine when split) 10 times per graph replay.  Per (case, candidate): µs per call, TFLOP/s over the
valid columns, % of the floor (max of valid FLOPs / --tflops and bytes moved once / copy bandwidth), the max
|difference| to the default's output and whether the bits are equal (``bits=``: a candidate with another block_n,
split_n or product form computes other bits, which is allowed if its own regimes agree), and ``inv=``: four rows
spread over the batch, run alone in the split regime, give the same bits as in the batch (what batch invariance
rests on).  The default is also checked against core's reference.  A candidate that fails to compile prints its
error; the sweep goes on.  ``--only 0,9`` times some candidates (their numbers as printed).
To adopt a winner, write its fields into ``arch.sparse_attention_config``.

``--packed`` times V4.1's packed-KV kernel (``sparse_attention_packed_inverse_rope``) instead, at decode b1 / b16 /
b64: each query's 640 columns are 128 FP8 ring rows (528 B) then 512 FP4 entry rows (288 B, e4m3 per 16).  Each
case first times the plain kernel over the same rows unpacked to bf16 (``bf16 rows``: what the packed kernel is
held against, issue 31), and ``bits=`` compares each candidate with it (the packed rows decode to the same values).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

from tools.ceilings import copy_bandwidth
from tools.timing import graph_time

HEADS, DIM, WINDOW, PREFILL = 64, 512, 128, 1024


def prefill_indices(kind: str, tokens: int, gen):
    """[T, W] pool rows as V4 attention builds them for one sequence: window latents at rows 0..T-1, entries after."""
    import torch

    pos = torch.arange(tokens)
    key_pos = pos[:, None] + torch.arange(1 - WINDOW, 1)[None, :]
    cols = [torch.where(key_pos >= 0, key_pos, -1)]
    if kind == "hca":  # ratio 128: entry e complete once the query passed its window
        ids = torch.arange(tokens // 128).expand(tokens, -1)
        cols.append(torch.where(ids < ((pos + 1) // 128)[:, None], tokens + ids, -1))
    elif kind == "csa":  # ratio 4: 512 top-k slots over the (t + 1) // 4 visible entries (<= 256), the rest -1
        picks = torch.full((tokens, 512), -1, dtype=torch.int64)
        for t in range(tokens):
            n = min((t + 1) // 4, 512)
            picks[t, :n] = tokens + torch.randperm((t + 1) // 4, generator=gen)[:n]
        cols.append(picks)
    return torch.cat(cols, dim=1), tokens + (tokens // 4 if kind == "csa" else tokens // 128 if kind == "hca" else 0)


def make_case(name: str, gen):
    import torch

    if name in ("swa", "hca", "csa"):
        tokens = PREFILL
        idx, pool = prefill_indices(name, tokens, gen)
    else:  # decode bN: 128 window rows + 512 entries, all valid, in a pool of a few sequences
        tokens = int(name[1:])
        pool = 8192
        idx = torch.randint(0, pool, (tokens, 640), generator=gen)
    q = torch.randn(tokens, HEADS, DIM, generator=gen).bfloat16()
    kv = torch.randn(pool, DIM, generator=gen).bfloat16()
    sinks = torch.randn(HEADS, generator=gen)
    return [t.cuda() for t in (q, kv, idx, sinks)]


def make_packed_case(name: str, gen):
    """Decode bN over a packed pool: (q, rings, entries, entry_base, indices, sinks, positions, inv_freq)."""
    import torch

    from deepinfer.ops.kv_quant import fp4_e2m1_pack, fp8_e4m3_pack

    tokens, pool = int(name[1:]), 8192
    spread = torch.exp2(torch.randint(-10, 1, (2 * pool, 1), generator=gen))
    values = torch.randn(2 * pool, DIM, generator=gen) * spread
    rings, entries = fp8_e4m3_pack(values[:pool], 32), fp4_e2m1_pack(values[pool:], 16, "e4m3")
    idx = torch.cat([torch.randint(0, pool, (tokens, WINDOW), generator=gen),
                     pool + torch.randint(0, pool, (tokens, 512), generator=gen)], dim=1)
    q = torch.randn(tokens, HEADS, DIM, generator=gen).bfloat16()
    sinks = torch.randn(HEADS, generator=gen)
    positions = torch.randint(0, 1 << 16, (tokens,), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    q, rings, entries, idx, sinks, positions, inv_freq = (t.cuda() for t in (q, rings, entries, idx, sinks, positions,
                                                                             inv_freq))
    return q, rings, entries, pool, idx, sinks, positions, inv_freq


def packed_main(args, bandwidth: float) -> list[dict[str, object]]:
    """The ``--packed`` sweep: the bf16-row kernel, then every candidate of the packed kernel."""
    import torch

    from deepinfer.ops.packed_attention import unpacked_rows
    from deepinfer_cuda.arch import sparse_attention_config
    from deepinfer_cuda.kernel_set.dispatch import cuda_target
    from deepinfer_cuda.kernels import sparse_attention as plain
    from deepinfer_cuda.kernels import sparse_attention_packed as module

    gen = torch.Generator().manual_seed(0)
    scale = DIM**-0.5
    rows = []
    for name in args.cases.split(","):
        q, rings, entries, base, idx, sinks, positions, inv_freq = make_packed_case(name, gen)
        index, arch = cuda_target(q)
        tiles0 = sparse_attention_config(arch, HEADS, DIM, 2)
        pool, ids = unpacked_rows(rings, entries, base, idx, 32, 16, "e4m3", q.dtype)
        flops = 4 * HEADS * DIM * idx.numel()
        moved = idx.shape[0] * (WINDOW * 528 + 512 * 288) + 2 * q.numel() * 2 + idx.numel() * 8
        floor_us = max(flops / (args.tflops * 1e12), moved / bandwidth) * 1e6

        def bf16_rows():
            return plain.prepare(q, pool, ids, sinks, scale, positions, inv_freq, 1.0, arch=arch).run(index)

        want = bf16_rows()
        bf16_us = graph_time(bf16_rows, 10) * 1e6
        print(f"{name} packed: T={q.shape[0]} W={idx.shape[1]} (floor {floor_us:.1f} us); bf16 rows {bf16_us:.1f} us",
              flush=True)
        rows.append({"case": name, "tiles": "bf16 rows (plain kernel, default tiles)", "default": False,
                     "us": bf16_us, "roof_pct": 100 * floor_us / bf16_us})
        for number, tiles in enumerate(candidates(tiles0)):
            if args.only and str(number) not in args.only.split(","):
                continue
            try:
                def call(t=tiles):
                    return module.prepare(q, rings, entries, base, idx, sinks, scale, positions, inv_freq, 1.0, 32, 16,
                                          "e4m3", arch=arch, tiles=t).run(index)

                out = call()
                us = graph_time(call, 10) * 1e6
            except Exception as exc:  # noqa: BLE001 - a candidate that does not compile is reported, not fatal
                error = str(exc).splitlines()[0][:160] if str(exc) else ""
                print(f"  {number:2d}  {describe(tiles)}: FAILED {type(exc).__name__}: {error}", flush=True)
                continue
            row = {"case": name, "tiles": describe(tiles), "default": tiles == tiles0, "us": us,
                   "roof_pct": 100 * floor_us / us, "vs_bf16_rows": bf16_us / us,
                   "bits_equal_bf16_rows": bool(torch.equal(out, want)) if tiles == tiles0 else None}
            rows.append(row)
            same = {True: " bits=", False: " bits=x", None: ""}[row["bits_equal_bf16_rows"]]
            print(f"  {number:2d}{'*' if row['default'] else ' '} {row['tiles']:<36s} {us:8.1f} us "
                  f"{row['roof_pct']:5.1f}% of floor  {row['vs_bf16_rows']:.2f}x bf16 rows{same}", flush=True)
    return rows


def candidates(base):
    """The default first, then single changes around it (each is a compiled variant of the same kernel)."""
    from deepinfer_cuda.arch import LaunchConfig

    def tiles(block_n=None, stages=None, warps=None, **kw):
        split = LaunchConfig(num_warps=warps or base.split.num_warps, num_stages=stages or base.split.num_stages)
        return dataclasses.replace(base, split=split, block_n=block_n or base.block_n, **kw)

    yield base
    options = [tiles(skip_empty=not base.skip_empty), tiles(stages=2), tiles(stages=3),
               tiles(block_n=64, stages=2), tiles(block_n=64, stages=3), tiles(block_n=16, stages=3),
               tiles(block_n=16, stages=5), tiles(block_h=16, warps=4), tiles(split_n=128),
               tiles(split_below=4 * base.split_below),  # split-K up to b132 (the regime never changes a bit)
               # gathered rows on the M side of both products: wgmma (M = 64) instead of mma.sync (M = 32 heads)
               tiles(block_n=64, stages=3, transposed=True), tiles(block_n=64, stages=2, transposed=True),
               tiles(block_h=16, block_n=64, stages=3, transposed=True),
               tiles(block_n=64, stages=3, split_n=128, transposed=True),
               # 128-row chunks: each warpgroup owns 64 rows of the first product (no shared A), one stage (172 KB)
               tiles(block_n=128, stages=1, split_n=128, transposed=True)]
    seen = {base}
    for option in options:
        if option not in seen:
            seen.add(option)
            yield option


def describe(tiles) -> str:
    return (f"h{tiles.block_h} n{tiles.block_n} split{tiles.split_n} w{tiles.split.num_warps} "
            f"s{tiles.split.num_stages} skip{int(tiles.skip_empty)}{' T' if tiles.transposed else ''}"
            f"{f' split_below{tiles.split_below}' if tiles.split_below != 66 else ''}")


def main(argv: list[str] | None = None) -> int:
    import torch

    from deepinfer.ops.attention import sparse_attention as reference
    from deepinfer_cuda.arch import sparse_attention_config
    from deepinfer_cuda.kernel_set.dispatch import cuda_target
    from deepinfer_cuda.kernels import sparse_attention as module

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default="swa,hca,csa,b1,b16,b64")
    parser.add_argument("--only", help="comma-separated candidate numbers (0 = the default) to time")
    parser.add_argument("--tflops", type=float, default=695.0, help="the matmul rate the floor assumes")
    parser.add_argument("--json", help="also write the rows here")
    parser.add_argument("--packed", action="store_true", help="the packed-KV kernel at decode (cases b1,b16,b64)")
    args = parser.parse_args(argv)
    start = time.time()
    bandwidth = copy_bandwidth()
    if args.packed:
        if args.cases == parser.get_default("cases"):
            args.cases = "b1,b16,b64"
        rows = packed_main(args, bandwidth)
        print(f"sweep took {time.time() - start:.0f} s")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"bandwidth": bandwidth, "rows": rows}, f, indent=1)
        return 0
    gen = torch.Generator().manual_seed(0)
    scale = DIM**-0.5
    rows = []
    for name in args.cases.split(","):
        q, kv, idx, sinks = make_case(name, gen)
        index, arch = cuda_target(q)
        base = sparse_attention_config(arch, HEADS, DIM, 2)
        valid = idx >= 0
        flops = 4 * HEADS * DIM * int(valid.sum())
        moved = int(torch.unique(idx[valid]).numel()) * DIM * 2 + 2 * q.numel() * 2
        floor_us = max(flops / (args.tflops * 1e12), moved / bandwidth) * 1e6
        default = module.prepare(q, kv, idx, sinks, scale, arch=arch).run(index)
        ref_err = (default.float() - reference(q, kv, idx, sinks, scale).float()).abs().max().item()
        print(f"{name}: T={q.shape[0]} W={idx.shape[1]} valid {valid.float().mean().item():.0%} "
              f"({flops / 1e9:.1f} GFLOP valid, floor {floor_us:.1f} us); default vs reference max err {ref_err:.3g}",
              flush=True)
        for number, tiles in enumerate(candidates(base)):
            if args.only and str(number) not in args.only.split(","):
                continue
            programs = q.shape[0] * HEADS // tiles.block_h
            if tiles.split_below != base.split_below and \
                    (programs <= tiles.split_below) == (programs <= base.split_below):
                continue  # the same launch as the default's at this batch
            try:
                def call(t=tiles):
                    return module.prepare(q, kv, idx, sinks, scale, arch=arch, tiles=t).run(index)

                out = call()
                pick = torch.linspace(0, q.shape[0] - 1, min(4, q.shape[0]), device=q.device).long()
                alone = module.prepare(q[pick], kv, idx[pick], sinks, scale, arch=arch, split=True,
                                       tiles=tiles).run(index)
                us = graph_time(call, 10) * 1e6
            except Exception as exc:  # noqa: BLE001 - a candidate that does not compile is reported, not fatal
                error = str(exc).splitlines()[0][:160] if str(exc) else ""
                print(f"  {number:2d}  {describe(tiles)}: FAILED {type(exc).__name__}: {error}", flush=True)
                continue
            row = {"case": name, "tiles": describe(tiles), "default": tiles == base, "us": us,
                   "tflops": flops / us / 1e6, "roof_pct": 100 * floor_us / us,
                   "max_err_vs_default": (out.float() - default.float()).abs().max().item(),
                   "bits_equal_default": bool(torch.equal(out, default)),
                   "invariant": bool(torch.equal(alone, out[pick]))}
            rows.append(row)
            mark = "*" if row["default"] else " "
            print(f"  {number:2d}{mark} {row['tiles']:<36s} {us:8.1f} us {row['tflops']:6.1f} TFLOP/s "
                  f"{row['roof_pct']:5.1f}% of floor  err {row['max_err_vs_default']:.3g} "
                  f"bits={'=' if row['bits_equal_default'] else 'x'} inv={'ok' if row['invariant'] else 'BROKEN'}",
                  flush=True)
    print(f"sweep took {time.time() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"bandwidth": bandwidth, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
