"""Time the CUDA backend's kernels against core's reference ops and the memory roofline (GPU host only).

    python -m tools.bench.kernels            # prints a table; --json PATH also writes the numbers
    python -m tools.bench.kernels --ops moe  # only some groups (rms_norm, rope_hc, moe, attention, compress_sample,
                                             # fused, packed_kv, released)

The roofline is the measured device-to-device copy bandwidth (bytes read + written per second); each
kernel's time is compared with the bytes it must move once.  Medians of CUDA-event timings (do_bench).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
from collections.abc import Callable
from typing import Any

from tools.ceilings import copy_bandwidth, matmul_rate
from tools.timing import device_time, graph_time


def rms_norm_rows() -> list[dict[str, object]]:
    import torch

    from deepinfer.ops.norm import rms_norm as reference
    from deepinfer_cuda.kernels.rms_norm import KERNEL, rms_norm

    out = []
    shapes = [("prefill hidden", 1024, 4096), ("decode b64 hidden", 64, 4096), ("prefill per-head q", 1024 * 64, 512),
              ("prefill mHC flat", 1024, 16384), ("decode b1 hidden", 1, 4096)]
    for label, rows, dim in shapes:
        x = torch.randn(rows, dim, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(dim, device="cuda", dtype=torch.bfloat16)
        weight = None if "per-head" in label or "mHC" in label else w
        nbytes = 2 * x.numel() * x.element_size() + (dim * 2 if weight is not None else 0)
        ours = device_time(lambda: rms_norm(x, weight, 1e-6))
        ours_graph = graph_time(lambda: rms_norm(x, weight, 1e-6), 20)
        ref = device_time(lambda: reference(x, weight, 1e-6))
        ref_graph = graph_time(lambda: reference(x, weight, 1e-6), 20)
        out.append({"op": "rms_norm", "case": f"{label} {rows}x{dim} bf16", "bytes": nbytes, "ours_s": ours,
                    "ours_graph_s": ours_graph, "reference_s": ref, "reference_graph_s": ref_graph,
                    "path": "cubin" if KERNEL.launch_counts["cubin"] else "jit"})
    return out


def rope_and_hc_rows() -> list[dict[str, object]]:
    import torch

    from deepinfer.ops.mhc import hc_post as hc_reference
    from deepinfer.ops.mhc import hc_pre as hc_pre_reference
    from deepinfer.ops.rope import rope as rope_reference
    from deepinfer_cuda.kernels.hc_post import KERNEL as HC
    from deepinfer_cuda.kernels.hc_post import hc_post
    from deepinfer_cuda.kernels.hc_pre import KERNEL as HC_PRE
    from deepinfer_cuda.kernels.hc_pre import hc_pre
    from deepinfer_cuda.kernels.rope import KERNEL as ROPE
    from deepinfer_cuda.kernels.rope import rope

    out = []
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32, device="cuda") / 64))
    for label, tokens in [("prefill", 1024), ("decode b64", 64), ("decode b16", 16), ("decode b1", 1)]:
        q = torch.randn(tokens, 64, 512, device="cuda", dtype=torch.bfloat16)
        pos = torch.arange(tokens, device="cuda")
        nbytes = 2 * q.numel() * 2
        cases = [("rope", f"{label} q {tokens}x64x512 bf16", nbytes, lambda: rope(q, pos, inv_freq),
                  lambda: rope_reference(q, pos, inv_freq), ROPE)]
        o = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
        st = torch.randn(tokens, 4, 4096, device="cuda", dtype=torch.bfloat16)
        post = torch.rand(tokens, 4, device="cuda")
        comb = torch.softmax(torch.randn(tokens, 4, 4, device="cuda"), -1)
        cases.append(("hc_post", f"{label} {tokens}x4x4096 bf16", (o.numel() + 2 * st.numel()) * 2,
                      lambda: hc_post(o, st, post, comb), lambda: hc_reference(o, st, post, comb), HC))
        fn = 0.05 * torch.randn(24, 16384, device="cuda")
        base, scale = torch.randn(24, device="cuda"), 1 + 0.1 * torch.randn(3, device="cuda")
        cases.append(("hc_pre", f"{label} {tokens}x4x4096 bf16", (st.numel() + o.numel()) * 2 + fn.numel() * 4,
                      lambda: hc_pre(st, fn, base, scale, 1e-6, 1e-6, 20),
                      lambda: hc_pre_reference(st, fn, base, scale, 1e-6, 1e-6, 20), HC_PRE))
        for op, case, nb, ours_fn, ref_fn, kernel in cases:
            out.append({"op": op, "case": case, "bytes": nb, "ours_s": device_time(ours_fn),
                        "ours_graph_s": graph_time(ours_fn, 20), "reference_s": device_time(ref_fn),
                        "reference_graph_s": graph_time(ref_fn, 20),
                        "path": "cubin" if kernel.launch_counts["cubin"] else "jit"})
    return out


def moe_rows(peak: float) -> list[dict[str, object]]:
    """Routed experts of one V4-Flash-slice layer (64 experts of 4096 -> 2048, top-6).  The reference loops over
    the hit experts with a host sync each, so it cannot be captured: its graph column is left empty."""
    import torch

    from deepinfer.ops.moe import moe_experts as reference
    from deepinfer_cuda.kernels.moe_experts import DOWN_KERNEL, UP_KERNEL, moe_experts

    hidden, inter, experts, top_k = 4096, 2048, 64, 6
    w13 = (torch.randn(experts, 2 * inter, hidden, device="cuda") * hidden**-0.5).bfloat16()
    w2 = (torch.randn(experts, hidden, inter, device="cuda") * inter**-0.5).bfloat16()
    out = []
    for label, tokens in [("decode b1", 1), ("decode b16", 16), ("decode b64", 64), ("prefill", 1024)]:
        x = torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16)
        ids = torch.rand(tokens, experts, device="cuda").argsort(dim=1)[:, :top_k]
        w = torch.rand(tokens, top_k, device="cuda")
        hit = int(torch.unique(ids).numel())
        nbytes = hit * 3 * inter * hidden * 2 + 2 * x.numel() * 2
        flops = 2 * 3 * inter * hidden * tokens * top_k

        def ours_fn():
            return moe_experts(x, ids, w, w13, w2, 10.0)

        row = {"op": "moe_experts", "case": f"{label} T={tokens} E={experts} k={top_k} bf16", "bytes": nbytes,
               "flops": flops, "floor_s": max(nbytes / _BW[0], flops / peak), "ours_s": device_time(ours_fn),
               "ours_graph_s": graph_time(ours_fn, 5),
               "reference_s": device_time(lambda: reference(x, ids, w, w13, w2, 10.0)),
               "reference_graph_s": float("nan"),
               "path": "cubin" if UP_KERNEL.launch_counts["cubin"] and DOWN_KERNEL.launch_counts["cubin"] else "jit"}
        out.append(row)
    return out


def attention_rows(peak: float) -> list[dict[str, object]]:
    """Sparse attention of one V4-Flash CSA layer: 64 heads x 512, each query sees 128 window rows + its top-512
    compressed entries of a shared K=V pool.  *floor* = max(q + out + indices + the distinct pool rows read once
    over the copy ceiling, q.k and p.v FLOPs over the matmul rate)."""
    import torch

    from deepinfer.ops.attention import sparse_attention as reference
    from deepinfer_cuda.kernels.sparse_attention import KERNEL, sparse_attention

    heads, dim, width = 64, 512, 128 + 512
    out = []
    for label, tokens, pool in [("decode b1", 1, 1 * 1024), ("decode b16", 16, 16 * 1024),
                                ("decode b64", 64, 64 * 1024), ("prefill", 1024, 1024 + 256)]:
        q = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
        kv = torch.randn(pool, dim, device="cuda", dtype=torch.bfloat16)
        sinks = torch.randn(heads, device="cuda")
        if label == "prefill":  # one sequence: every query reads from the same pool
            indices = torch.randint(0, pool, (tokens, width), device="cuda")
        else:  # a sequence per query, each with its own part of the pool
            own = pool // tokens
            first = own * torch.arange(tokens, device="cuda")[:, None]
            indices = torch.randint(0, own, (tokens, width), device="cuda") + first
        indices[torch.rand(tokens, width, device="cuda") < 0.05] = -1
        distinct = int(torch.unique(indices[indices >= 0]).numel())
        nbytes = 2 * q.numel() * 2 + indices.numel() * 8 + distinct * dim * 2
        flops = 4 * tokens * heads * width * dim

        def ours_fn():
            return sparse_attention(q, kv, indices, sinks, dim**-0.5)

        row = {"op": "sparse_attention", "case": f"{label} T={tokens} H={heads} D={dim} K={width} bf16",
               "bytes": nbytes, "flops": flops, "floor_s": max(nbytes / _BW[0], flops / peak),
               "ours_s": device_time(ours_fn), "ours_graph_s": graph_time(ours_fn, 5),
               "reference_s": device_time(lambda: reference(q, kv, indices, sinks, dim**-0.5)),
               "reference_graph_s": graph_time(lambda: reference(q, kv, indices, sinks, dim**-0.5), 2),
               "path": "cubin" if KERNEL.launch_counts["cubin"] else "jit"}
        out.append(row)
    return out


def indexer_rows(peak: float) -> list[dict[str, object]]:
    """Lightning indexer of one V4-Flash CSA layer (ratio 4): 64 index heads x 128, top-512; prefill of 1024 tokens
    (256 entries), decode at 512 tokens of context (128 entries) and at 32K (8192).  *floor* = max(q, weights, keys
    and picks moved once over the copy ceiling, q.k FLOPs over the matmul rate)."""
    import torch

    from deepinfer.ops.indexer import indexer_topk as reference
    from deepinfer_cuda.kernels.indexer_topk import KERNEL, indexer_topk

    heads, dim, topk = 64, 128, 512
    out = []
    cases = [("prefill", 1024, 256, True), ("decode b1 ctx512", 1, 128, False), ("decode b16 ctx512", 16, 128, False),
             ("decode b64 ctx512", 64, 128, False), ("decode b64 ctx32K", 64, 8192, False)]
    for label, tokens, entries, prefill in cases:
        seqs = 1 if prefill else tokens
        q = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(tokens, heads, device="cuda", dtype=torch.bfloat16)
        keys = torch.randn(seqs, entries, dim, device="cuda", dtype=torch.bfloat16)
        positions = torch.arange(tokens, device="cuda")
        seq_ids = torch.zeros_like(positions) if prefill else positions
        limits = (positions + 1) // 4 if prefill else torch.full_like(positions, entries)
        args = (q, w, keys, seq_ids, limits, topk, dim**-0.5, heads**-0.5)
        nbytes = (q.numel() + w.numel() + keys.numel()) * 2 + tokens * topk * 8
        flops = 2 * tokens * heads * entries * dim

        row = {"op": "indexer_topk", "case": f"{label} T={tokens} N={entries} bf16", "bytes": nbytes, "flops": flops,
               "floor_s": max(nbytes / _BW[0], flops / peak), "ours_s": device_time(lambda: indexer_topk(*args)),
               "ours_graph_s": graph_time(lambda: indexer_topk(*args), 5),
               "reference_s": device_time(lambda: reference(*args)),
               "reference_graph_s": graph_time(lambda: reference(*args), 2),
               "path": "cubin" if KERNEL.launch_counts["cubin"] else "jit"}
        out.append(row)
    return out


def packed_kv_rows(peak: float) -> list[dict[str, object]]:
    """V4.1-Flash decode over its packed state (``DEEPINFER_QUANTIZED_KV=1``), a sequence per query at 8K / 32K
    tokens: attention of a CSA layer (64 heads x 512; window 128 FP8 ring rows of 528 B + top-512 FP4 entries of
    288 B) and the indexer (32 heads x 128 over FP4 keys of 68 B), reading the packed rows in place.  *ref* is what
    ran before on the GPU: the rows gathered, unpacked by the unpack kernels, then the plain kernel.  *floor* =
    max(q, out, indices and the distinct packed rows moved once over the copy ceiling, the products over the matmul
    rate)."""
    import torch

    from deepinfer.ops.kv_quant import fp4_e2m1_pack, fp8_e4m3_pack
    from deepinfer_cuda.kernels.fp4_e2m1_unpack import fp4_e2m1_unpack
    from deepinfer_cuda.kernels.fp8_e4m3_unpack import fp8_e4m3_unpack
    from deepinfer_cuda.kernels.indexer_topk import indexer_topk
    from deepinfer_cuda.kernels.indexer_topk_packed import KERNEL as INDEXER_KERNEL
    from deepinfer_cuda.kernels.indexer_topk_packed import indexer_topk_packed
    from deepinfer_cuda.kernels.sparse_attention import sparse_attention_inverse_rope
    from deepinfer_cuda.kernels.sparse_attention_packed import KERNEL, sparse_attention_packed_inverse_rope

    heads, dim, window, topk = 64, 512, 128, 512
    inv_freq = torch.rand(32, device="cuda")
    out = []
    for label, tokens, ctx in [("b1 ctx8K", 1, 8192), ("b16 ctx8K", 16, 8192), ("b64 ctx8K", 64, 8192),
                               ("b16 ctx32K", 16, 32768)]:
        n = ctx // 4  # CSA entries per sequence
        rings = fp8_e4m3_pack(torch.randn(tokens * window, dim, device="cuda"), 32)
        entries = fp4_e2m1_pack(torch.randn(tokens * n, dim, device="cuda"), 16, "e4m3")
        base, seqs = rings.shape[0], torch.arange(tokens, device="cuda")[:, None]
        indices = torch.cat([seqs * window + torch.arange(window, device="cuda"),
                             base + seqs * n + torch.randint(0, n, (tokens, topk), device="cuda")], dim=1)
        q = torch.randn(tokens, heads, dim, device="cuda", dtype=torch.bfloat16)
        sinks, positions = torch.randn(heads, device="cuda"), torch.full((tokens,), ctx - 1, device="cuda")
        rope = (positions, inv_freq, 1.0)

        def packed(q=q, rings=rings, entries=entries, base=base, indices=indices, sinks=sinks, rope=rope):
            return sparse_attention_packed_inverse_rope(q, rings, entries, base, indices, sinks, dim**-0.5, *rope,
                                                        32, 16, "e4m3")

        def unpacking(q=q, rings=rings, entries=entries, base=base, indices=indices, sinks=sinks, rope=rope):
            rows = indices.clamp(min=0).flatten()
            ring = fp8_e4m3_unpack(rings[rows.clamp(max=base - 1)], 32, q.dtype)
            entry = fp4_e2m1_unpack(entries[(rows - base).clamp(min=0)], 16, "e4m3", q.dtype)
            pool = torch.where((rows < base).unsqueeze(-1), ring, entry)
            cols = torch.where(indices >= 0, torch.arange(indices.numel(), device="cuda").view_as(indices), -1)
            return sparse_attention_inverse_rope(q, pool, cols, sinks, dim**-0.5, *rope)

        width = window + topk
        nbytes = 2 * q.numel() * 2 + indices.numel() * 8 + tokens * (window * 528 + topk * 288)
        flops = 4 * tokens * heads * width * dim
        out.append(_packed_row("sparse_attention_packed", f"decode {label} T={tokens} K={width}", nbytes, flops, peak,
                               packed, unpacking, KERNEL))

        iheads, idim = 32, 128
        pages = fp4_e2m1_pack(torch.randn(tokens * n, idim, device="cuda"), 32, "ue8m0")
        key_rows = torch.randperm(tokens * n, device="cuda").view(tokens, n)
        iq = torch.randn(tokens, iheads, idim, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(tokens, iheads, device="cuda", dtype=torch.bfloat16)
        tail = (seqs.flatten(), torch.full((tokens,), n, device="cuda"), topk, idim**-0.5, iheads**-0.5)

        def packed_index(iq=iq, w=w, pages=pages, key_rows=key_rows, tail=tail):
            return indexer_topk_packed(iq, w, pages, key_rows, 32, "ue8m0", *tail)

        def unpacking_index(iq=iq, w=w, pages=pages, key_rows=key_rows, tail=tail):
            return indexer_topk(iq, w, fp4_e2m1_unpack(pages[key_rows], 32, "ue8m0", iq.dtype), *tail)

        nbytes = (iq.numel() + w.numel()) * 2 + tokens * n * (68 + 8) + tokens * topk * 8
        flops = 2 * tokens * iheads * n * idim
        out.append(_packed_row("indexer_topk_packed", f"decode {label} T={tokens} N={n}", nbytes, flops, peak,
                               packed_index, unpacking_index, INDEXER_KERNEL))
    return out


def _packed_row(op: str, case: str, nbytes: int, flops: int, peak: float, packed: Callable[[], object],
                unpacking: Callable[[], object], kernel: Any) -> dict[str, object]:
    """One row of a packed-KV kernel against the unpack-then-plain-op path it replaces (eager and graph times)."""
    return {"op": op, "case": case, "bytes": nbytes, "flops": flops, "floor_s": max(nbytes / _BW[0], flops / peak),
            "ours_s": device_time(packed), "ours_graph_s": graph_time(packed, 5), "reference_s": device_time(unpacking),
            "reference_graph_s": graph_time(unpacking, 5),
            "path": "cubin" if kernel.launch_counts["cubin"] else "jit"}


def released_rows() -> list[dict[str, object]]:
    """The released formats' GEMMs at V4.1-Flash shapes, each adopted TileLang form beside the Triton form it
    replaces (``path``): the FP8 32x32 block projections ``arch.FP8_TILELANG`` names, at 16 and 64 rows, over
    weight copies that L2 cannot hold (``tools/sweep/fp8_tilelang.py``'s problem), and one MXFP4 expert layer
    (``tools/sweep/mxfp4_tilelang.py``'s) at 1 / 16 / 64 tokens, with the opt-in W4A8 form as a third path.
    *ref*: core's reference op, eager (none for the experts: it dequantizes all 384 to bf16, more than a GPU
    holds).  The Triton form is timed with the arch table cleared; the sweeps time every candidate."""
    import torch

    from deepinfer import envs
    from deepinfer.ops.quant_gemm import fp8_block_grouped_linear, fp8_block_linear
    from deepinfer_cuda import arch
    from deepinfer_cuda.kernels import fp8_block_linear_tl, moe_experts_mxfp4_tl, moe_experts_mxfp4_w4a8_tl
    from deepinfer_cuda.kernels import moe_experts_mxfp4 as mxfp4_op
    from tools.sweep import fp8_tilelang, mxfp4_tilelang

    gen = torch.Generator(device="cuda").manual_seed(0)
    out: list[dict[str, object]] = []

    def both(op: str, case: str, nbytes: float, table: dict, call: Callable[[], object], calls: int,
             reference: Callable[[], object] | None, kernel: Any) -> None:
        saved = dict(table)
        ref_s = float("nan") if reference is None else device_time(reference)
        for path in ("triton", "tilelang"):
            if path == "triton":
                table.clear()
            try:
                before = kernel.launch_counts["cubin"]
                out.append({"op": op, "case": case, "bytes": nbytes, "ours_s": device_time(call),
                            "ours_graph_s": graph_time(call, calls), "reference_s": ref_s,
                            "reference_graph_s": float("nan"),
                            "path": path if path == "triton" or kernel.launch_counts["cubin"] > before
                            else "triton (by the table)"})
            finally:
                table.clear()
                table.update(saved)

    for (n, k, groups, block) in arch.FP8_TILELANG:
        for rows in (16, 64):
            x, weights, nbytes = fp8_tilelang.problem(n, k, groups, rows, block, gen)
            ref = fp8_block_grouped_linear if groups > 1 else fp8_block_linear
            both("fp8_block_linear", f"{n}x{k}x{groups} rows={rows} block {block}", nbytes, arch.FP8_TILELANG,
                 fp8_tilelang.cold_call(x, weights, groups, block), len(weights),
                 lambda x=x, w=weights[0], ref=ref, block=block: ref(x, *w, block, block), fp8_block_linear_tl.KERNEL)
    w13, s13, w2, s2 = mxfp4_tilelang.layer(gen)
    for tokens in (1, 16, 64):
        x, ids, weights = mxfp4_tilelang.routed(tokens, gen)
        op = (x, ids, weights, w13, s13, w2, s2, 10.0)
        hit = ids.unique().numel()
        case, nbytes = f"V4.1 layer T={tokens} ({hit} experts hit)", mxfp4_tilelang.bytes_read(hit, tokens)
        call = functools.partial(mxfp4_op.moe_experts_mxfp4, *op)
        both("moe_experts_mxfp4", case, nbytes, arch.MXFP4_TILELANG, call, 20, None, moe_experts_mxfp4_tl.UP_KERNEL)
        before = moe_experts_mxfp4_w4a8_tl.UP_KERNEL.launch_counts["cubin"]
        with envs.overridden("DEEPINFER_MXFP4_ACTIVATIONS", "fp8"):  # the opt-in W4A8 form (FP8 activations)
            out.append({"op": "moe_experts_mxfp4", "case": case, "bytes": nbytes, "ours_s": device_time(call),
                        "ours_graph_s": graph_time(call, 20), "reference_s": float("nan"),
                        "reference_graph_s": float("nan"),
                        "path": "w4a8" if moe_experts_mxfp4_w4a8_tl.UP_KERNEL.launch_counts["cubin"] > before
                        else "exact (no W4A8 cubins)"})
    return out


def compress_and_sample_rows() -> list[dict[str, object]]:
    """Gated pooling at V4-Flash shapes (CSA: 2 x 4 slots, HCA: 128 slots, head_dim 512, bf16) and token sampling
    over V4's 129280-token vocabulary (fp32 logits, seeded rows).  Memory floor: inputs read once, output written."""
    import torch

    from deepinfer.ops.compress import compress_pool as pool_reference
    from deepinfer.ops.sampling import sample_tokens as sample_reference
    from deepinfer_cuda.kernels import compress_pool, sample_tokens

    out = []
    for label, windows, slots in [("CSA prefill 1024 tok", 256, 8), ("HCA prefill 1024 tok", 8, 128),
                                  ("CSA decode b64", 64, 8)]:
        kv = torch.randn(windows, slots, 512, device="cuda", dtype=torch.bfloat16)
        score = torch.randn(windows, slots, 512, device="cuda")
        args = (kv, score)
        out.append({"op": "compress_pool", "case": f"{label} {windows}x{slots}x512 bf16",
                    "bytes": kv.numel() * 6 + windows * 512 * 2,
                    "ours_s": device_time(lambda: compress_pool.compress_pool(*args)),
                    "ours_graph_s": graph_time(lambda: compress_pool.compress_pool(*args), 20),
                    "reference_s": device_time(lambda: pool_reference(*args)),
                    "reference_graph_s": graph_time(lambda: pool_reference(*args), 20),
                    "path": "cubin" if compress_pool.KERNEL.launch_counts["cubin"] else "jit"})
    for rows in (1, 16, 64):
        logits = torch.randn(rows, 129280, device="cuda") * 3
        args = (logits, torch.zeros(rows, dtype=torch.bool, device="cuda"),
                torch.arange(rows, device="cuda") * 7919, torch.full((rows,), 100, device="cuda"))
        out.append({"op": "sample", "case": f"seeded b{rows} V=129280 fp32", "bytes": logits.numel() * 4,
                    "ours_s": device_time(lambda: sample_tokens.sample_tokens(*args)),
                    "ours_graph_s": graph_time(lambda: sample_tokens.sample_tokens(*args), 20),
                    "reference_s": device_time(lambda: sample_reference(*args)),
                    "reference_graph_s": graph_time(lambda: sample_reference(*args), 2),
                    "path": "cubin" if sample_tokens.KERNEL.launch_counts["cubin"] else "jit"})
    out.extend(verify_rows())
    return out


def verify_rows() -> list[dict[str, object]]:
    """Speculative verification of 4 drafts a request over V4's vocabulary (fp32 target rows, drafts from a blurred
    target), half the requests seeded.  Memory floor: the target rows read once."""
    import torch

    from deepinfer.ops.speculative import verify_drafts as verify_reference
    from deepinfer_cuda.kernels import sample_tokens, verify_drafts

    out = []
    k, vocab = 4, 129280
    for rows in (1, 16, 64):
        target = torch.randn(rows, k + 1, vocab, device="cuda") * 3
        q = torch.softmax(target[:, :k] + torch.randn(rows, k, vocab, device="cuda"), dim=-1)
        drafts = torch.multinomial(q.view(-1, vocab), 1).view(rows, k)
        args = (target, torch.arange(rows, device="cuda") % 2 == 0, drafts, torch.full((rows,), k, device="cuda"),
                torch.arange(rows, device="cuda") * 7919, torch.full((rows,), 100, device="cuda"))
        out.append({"op": "verify_drafts", "case": f"b{rows} K={k} V={vocab}", "bytes": target.numel() * 4,
                    "ours_s": device_time(lambda: verify_drafts.verify_drafts(*args)),
                    "ours_graph_s": graph_time(lambda: verify_drafts.verify_drafts(*args), 20),
                    "reference_s": device_time(lambda: verify_reference(*args)),
                    "reference_graph_s": graph_time(lambda: verify_reference(*args), 2),
                    "path": "cubin" if sample_tokens.KERNEL.launch_counts["cubin"] else "jit"})
    return out


def fused_rows() -> list[dict[str, object]]:
    """The fused ops at V4-Flash shapes (bf16, rope dim 64): the compressor's entry (CSA: 4-token windows with their
    predecessors, dim 512; HCA: 128, 512; decode rows with a quarter of the windows closing), norm + RoPE of the
    queries (64 x 512) and of the K=V latent, the MoE router's kernel (256 experts, top-6, after the GEMM).  Memory
    floor: inputs read once, output written once."""
    import torch

    from deepinfer.ops.compress import compress_entries as entries_reference
    from deepinfer.ops.moe import moe_router as router_reference
    from deepinfer.ops.rope import rms_norm_rope as norm_rope_reference
    from deepinfer_cuda.kernels import compress_entries, moe_router, rms_norm_rope

    def randn(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda").to(dtype)

    inv_freq = 1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32, device="cuda") / 64))
    cases = []
    for label, n, ratio, overlap, decode in [("CSA prefill 1024 tok", 256, 4, True, False),
                                             ("HCA prefill 1024 tok", 8, 128, False, False),
                                             ("CSA decode b64", 64, 4, True, True),
                                             ("HCA decode b64", 64, 128, False, True)]:
        width = 1024 if overlap else 512
        args = (randn(n, ratio, 2 * width), randn(n, ratio, 1024) if overlap else None,
                torch.arange(n, device="cuda") > 0 if overlap else None, randn(ratio, width, dtype=torch.float32),
                1 + 0.1 * randn(512, dtype=torch.float32), 1e-6, ratio * torch.arange(n, device="cuda"), inv_freq, 1.0)
        needed = torch.arange(n, device="cuda") % 4 == 3 if decode else None
        nbytes = args[0].numel() * 2 + (args[1].numel() * 2 if overlap else 0) + n * 512 * 2
        cases.append(("entries", f"{label} {n}x{ratio}x512", nbytes, compress_entries,
                      lambda args=args, needed=needed: compress_entries.compress_entries(*args, needed),
                      lambda args=args, needed=needed: entries_reference(*args, needed)))
    for label, tokens in [("prefill", 1024), ("decode b64", 64), ("decode b1", 1)]:
        pos = torch.arange(tokens, device="cuda")
        q, latent, w = randn(tokens, 64, 512), randn(tokens, 512), randn(512, dtype=torch.float32)
        cases.append(("norm+rope", f"{label} q {tokens}x64x512", q.numel() * 4, rms_norm_rope,
                      lambda q=q, pos=pos: rms_norm_rope.rms_norm_rope(q, None, 1e-6, pos, inv_freq),
                      lambda q=q, pos=pos: norm_rope_reference(q, None, 1e-6, pos, inv_freq)))
        cases.append(("norm+rope", f"{label} latent {tokens}x512", latent.numel() * 4, rms_norm_rope,
                      lambda x=latent, w=w, pos=pos: rms_norm_rope.rms_norm_rope(x, w, 1e-6, pos, inv_freq),
                      lambda x=latent, w=w, pos=pos: norm_rope_reference(x, w, 1e-6, pos, inv_freq)))
        x, gate, bias = randn(tokens, 4096), randn(256, 4096) * 4096**-0.5, 0.1 * randn(256, dtype=torch.float32)
        cases.append(("router", f"{label} {tokens}x4096 E=256 top-6", gate.numel() * 2 + x.numel() * 2, moe_router,
                      lambda x=x, g=gate, b=bias: moe_router.moe_router(x, g, b, 6, 2.5, "sqrtsoftplus"),
                      lambda x=x, g=gate, b=bias: router_reference(x, g, b, 6, 2.5, "sqrtsoftplus")))
    return [{"op": op, "case": case, "bytes": nbytes, "ours_s": device_time(ours), "ours_graph_s": graph_time(ours, 20),
             "reference_s": device_time(ref), "reference_graph_s": graph_time(ref, 20),
             "path": "cubin" if module.KERNEL.launch_counts["cubin"] else "jit"}
            for op, case, nbytes, module, ours, ref in cases]


_BW = [0.0]


def main(argv: list[str] | None = None) -> int:
    import torch
    import triton

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--ops", default="rms_norm,rope_hc,moe",
                        help="groups: rms_norm, rope_hc, moe, attention, compress_sample, fused, packed_kv, released")
    args = parser.parse_args(argv)
    groups = args.ops.split(",")
    bw = _BW[0] = copy_bandwidth()
    rows = (rms_norm_rows() if "rms_norm" in groups else []) + (rope_and_hc_rows() if "rope_hc" in groups else [])
    peak = matmul_rate() if {"moe", "attention", "packed_kv"} & set(groups) else 0.0
    if "moe" in groups:
        rows += moe_rows(peak)
    if "attention" in groups:
        rows += attention_rows(peak) + indexer_rows(peak)
    if "packed_kv" in groups:
        rows += packed_kv_rows(peak)
    if "compress_sample" in groups:
        rows += compress_and_sample_rows()
    if "fused" in groups:
        rows += fused_rows()
    if "released" in groups:
        rows += released_rows()
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  triton {triton.__version__}")
    print(f"roofline: device copy {bw / 1e12:.2f} TB/s (read + write)")
    print("eager = one call timed end to end (host launch cost included); graph = device time per call")
    print(f"{'op':9} {'case':38} {'eager us':>8} {'ref us':>7} {'graph us':>8} {'ref gr':>7} {'floor':>6} "
          f"{'%roof':>5} path")
    for r in rows:
        floor = r.get("floor_s", r["bytes"] / bw)  # memory floor; MoE rows: max(memory, matmul) floor
        print(f"{r['op']:9} {r['case']:38} {r['ours_s'] * 1e6:8.1f} {r['reference_s'] * 1e6:7.1f} "
              f"{r['ours_graph_s'] * 1e6:8.1f} {r['reference_graph_s'] * 1e6:7.1f} {floor * 1e6:6.1f} "
              f"{100 * floor / r['ours_graph_s']:4.0f}% {r['path']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"copy_bandwidth_Bps": bw, "device": torch.cuda.get_device_name(),
                       "triton": triton.__version__, "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
