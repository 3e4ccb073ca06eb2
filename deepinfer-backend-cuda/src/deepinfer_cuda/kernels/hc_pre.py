"""mHC pre as two Triton kernels: a split-K projection of token tiles, then the gates, Sinkhorn and collapse.

Overrides core's ``hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)`` (deepinfer/ops/mhc.py).
The RMS normalisation is folded into the projection (``norm(x) . w = rsqrt(mean(x^2) + eps) * (x . w)``).

1. ``_hc_pre_mix_kernel``, grid (token tile, K slice): a tile of ``block_t`` tokens times one slice of the
   flattened streams against the same slice of ``fn``, so each slice of ``fn`` is read once per token tile.  bf16
   streams: ``fn`` is split in registers into three bf16 terms (hi + mid + lo == fn, all 24 bits) and dotted on
   the tensor cores; x is exactly bf16, so every product is exact and only the fp32 accumulation rounds (once per
   16 columns, not once per column as the IEEE fp32 FMAs it replaced: 805 MFLOP on CUDA cores for a 1024-token
   prefill).  fp32 streams keep ``tl.dot(..., input_precision="ieee")``.  The slice's partial mixes and sum of
   squares go to an fp32 workspace.
2. ``_hc_pre_finish_kernel``, grid (token, hidden chunk + 1): sums a token's slices in increasing slice order,
   then either collapses one chunk of the hidden dim with ``pre`` or (the extra program) runs the ``post`` gate
   and the Sinkhorn rounds (for 4 streams on 16 scalars: no cross-thread reduction in the serial rounds).

Batch invariance: the slice width, the step ``block_k``, the term count and every finishing tile come from the
model dims only.  The token tile follows the call's size (``HcPreTiles.tier``), which cannot change a token's
bits: every tier has 4+ warps and a multiple of 64 rows, so on Hopper each dot is the same ``wgmma m64nNk16``
chain over k for every row, whatever the tile's other rows (hi into one accumulator; mid then lo, per step,
into another); an fp32 ``ieee`` dot is one ``fma`` chain per output over k in order.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_cuda import coverage
from deepinfer_cuda.arch import CudaArch, HcPreTier, HcPreTiles, hc_pre_config
from deepinfer_cuda.kernel_set.dispatch import Launch, LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.override import override

#: (streams, hidden) compiled ahead of time: V4 (4 x 4096) and V4.1 (4 x 5120).
AOT_SHAPES = ((4, 4096), (4, 5120))
AOT_DTYPES = ("bf16", "fp32")
#: Set by the CPU tests under Triton's interpreter (see the mix kernel); compiled kernels always use tl.dot.
INTERPRETED = False


@triton.jit
def _bf16_terms(f, TERMS: tl.constexpr):
    """fp32 ``f`` as bf16 terms hi + mid (+ lo), each the rounded remainder of the last: 3 terms hold all 24 bits."""
    hi = f.to(tl.bfloat16)
    rest = f - hi.to(tl.float32)  # exact: the bits hi dropped
    mid = rest.to(tl.bfloat16)
    if TERMS == 3:
        lo = (rest - mid.to(tl.float32)).to(tl.bfloat16)
    else:
        lo = tl.zeros_like(mid)
    return hi, mid, lo


@triton.jit
def _column(t, kk, j, axis: tl.constexpr):
    """Column (axis 1) or row (axis 0) j of tile t as fp32, by a masked sum (exact: one nonzero term)."""
    if axis == 1:
        return tl.sum(tl.where(kk[None, :] == j, t.to(tl.float32), 0.0), axis=1)[:, None]
    else:
        return tl.sum(tl.where(kk[:, None] == j, t.to(tl.float32), 0.0), axis=0)[None, :]


@triton.jit(do_not_specialize=["tokens"])
def _hc_pre_mix_kernel(streams_ptr, fn_ptr, gate_ws_ptr, mix_ws_ptr, tokens,
                       N: tl.constexpr, K: tl.constexpr, SLICE: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_K: tl.constexpr, GATE_W: tl.constexpr, MIX_W: tl.constexpr, TERMS: tl.constexpr,
                       INTERPRETED: tl.constexpr):
    """Partial mixes of tokens [tile * BLOCK_T, +BLOCK_T) over columns [s * SLICE, +SLICE) of the flat streams.

    gate_ws [S, T, GATE_W]: pre (N), then the sum of squares; mix_ws [S, T, MIX_W]: post (N), then comb (N*N).
    TERMS 0: IEEE fp32 FMAs.  TERMS 2 / 3 (bf16 streams only): fn split into bf16 terms, dotted on the tensor
    cores; hi into one fp32 accumulator, mid then lo (per step of BLOCK_K columns, a model constant: that order
    never depends on the batch) into a second, added at the end.
    """
    wait_for_producers()
    tile = tl.program_id(0)
    s = tl.program_id(1)
    rows = tile * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < tokens
    src = streams_ptr + rows[:, None].to(tl.int64) * K
    # fn rows [0, 2N): pre then post; [2N, 2N + N*N): comb.  Loaded transposed: [BLOCK_K, rows].
    pp = tl.arange(0, 2 * N)
    cc = tl.arange(0, N * N)
    one = tl.arange(0, 8)
    kk = tl.arange(0, BLOCK_K)
    sumsq = tl.zeros([BLOCK_T, 8], dtype=tl.float32)  # 8 equal columns: the sum of squares as one more chain
    acc_pp = tl.zeros([BLOCK_T, 2 * N], dtype=tl.float32)
    acc_cc = tl.zeros([BLOCK_T, N * N], dtype=tl.float32)
    small_pp = tl.zeros([BLOCK_T, 2 * N], dtype=tl.float32)  # fn's mid and lo terms (TERMS > 0)
    small_cc = tl.zeros([BLOCK_T, N * N], dtype=tl.float32)
    for k0 in range(0, SLICE, BLOCK_K):
        ks = s * SLICE + k0 + kk
        k_ok = ks < K
        x_raw = tl.load(src + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        x = x_raw.to(tl.float32)
        f_pp = tl.load(fn_ptr + pp[None, :] * K + ks[:, None], mask=k_ok[:, None], other=0.0)
        f_cc = tl.load(fn_ptr + (2 * N + cc[None, :]) * K + ks[:, None], mask=k_ok[:, None], other=0.0)
        if TERMS == 0:
            if INTERPRETED:  # the same chains, one column at a time (numpy's matmul rounds a row by its tile)
                for j in tl.static_range(BLOCK_K):
                    xj = _column(x, kk, j, 1)
                    acc_pp = acc_pp + xj * _column(f_pp, kk, j, 0)
                    acc_cc = acc_cc + xj * _column(f_cc, kk, j, 0)
                    sumsq = sumsq + xj * xj
            else:  # FMAs: each output is one chain over k in order, whatever the tile, its steps or its other rows
                acc_pp = tl.dot(x, f_pp, acc_pp, input_precision="ieee")
                acc_cc = tl.dot(x, f_cc, acc_cc, input_precision="ieee")
                sumsq = tl.dot(x * x, tl.full([BLOCK_K, 8], 1.0, tl.float32), sumsq, input_precision="ieee")
        else:
            # x is bf16, so x * term is exact in fp32 and the terms' sum is fn: only the accumulation rounds.
            hi_pp, md_pp, lw_pp = _bf16_terms(f_pp, TERMS)
            hi_cc, md_cc, lw_cc = _bf16_terms(f_cc, TERMS)
            sq = x * x  # 16 significant bits: exactly two bf16 halves
            sq_hi = sq.to(tl.bfloat16)
            sq_lo = (sq - sq_hi.to(tl.float32)).to(tl.bfloat16)
            if INTERPRETED:  # numpy's bf16 matmul is wrong: exact products, summed per row (no other row's part)
                x3 = x[:, :, None]
                acc_pp = acc_pp + tl.sum(x3 * hi_pp.to(tl.float32)[None, :, :], axis=1)
                acc_cc = acc_cc + tl.sum(x3 * hi_cc.to(tl.float32)[None, :, :], axis=1)
                sumsq = sumsq + tl.sum(sq_hi.to(tl.float32), axis=1)[:, None]
                small_pp = small_pp + tl.sum(x3 * md_pp.to(tl.float32)[None, :, :], axis=1)
                small_cc = small_cc + tl.sum(x3 * md_cc.to(tl.float32)[None, :, :], axis=1)
                sumsq = sumsq + tl.sum(sq_lo.to(tl.float32), axis=1)[:, None]
                small_pp = small_pp + tl.sum(x3 * lw_pp.to(tl.float32)[None, :, :], axis=1)
                small_cc = small_cc + tl.sum(x3 * lw_cc.to(tl.float32)[None, :, :], axis=1)
            else:
                xb = x_raw.to(tl.bfloat16)
                ones = tl.full([BLOCK_K, 8], 1.0, tl.bfloat16)
                acc_pp = tl.dot(xb, hi_pp, acc_pp)
                acc_cc = tl.dot(xb, hi_cc, acc_cc)
                sumsq = tl.dot(sq_hi, ones, sumsq)
                small_pp = tl.dot(xb, md_pp, small_pp)
                small_cc = tl.dot(xb, md_cc, small_cc)
                sumsq = tl.dot(sq_lo, ones, sumsq)
                if TERMS == 3:
                    small_pp = tl.dot(xb, lw_pp, small_pp)
                    small_cc = tl.dot(xb, lw_cc, small_cc)
    acc_pp = acc_pp + small_pp  # zeros for TERMS 0
    acc_cc = acc_cc + small_cc
    slot = (s * tokens + rows).to(tl.int64)
    # pre -> gate_ws[..., 0:N], post -> mix_ws[..., 0:N]; comb -> mix_ws[..., N:N + N*N]; sumsq -> gate_ws[..., N].
    is_pre = pp[None, :] < N
    tl.store(gate_ws_ptr + slot[:, None] * GATE_W + pp[None, :], acc_pp, mask=row_ok[:, None] & is_pre)
    tl.store(mix_ws_ptr + slot[:, None] * MIX_W + (pp[None, :] - N), acc_pp, mask=row_ok[:, None] & ~is_pre)
    tl.store(mix_ws_ptr + slot[:, None] * MIX_W + N + cc[None, :], acc_cc, mask=row_ok[:, None])
    tl.store(gate_ws_ptr + slot[:, None] * GATE_W + N + one[None, :], sumsq, mask=row_ok[:, None] & (one[None, :] == 0))


@triton.jit
def _normalized4(a, b, c, d, eps):
    """Four entries of a Sinkhorn row or column divided by their sum + eps."""
    inv = 1.0 / (a + b + c + d + eps)  # one division, four products: the serial rounds' latency
    return a * inv, b * inv, c * inv, d * inv


@triton.jit
def _softmax4(a, b, c, d, eps):
    """Softmax of four logits, plus eps."""
    top = tl.maximum(tl.maximum(a, b), tl.maximum(c, d))
    a, b, c, d = tl.exp(a - top), tl.exp(b - top), tl.exp(c - top), tl.exp(d - top)
    inv = 1.0 / (a + b + c + d)
    return a * inv + eps, b * inv + eps, c * inv + eps, d * inv + eps


@triton.jit
def _comb_logit(mix, s_ok, inv_rms, comb_scale, base_ptr, i: tl.constexpr, j: tl.constexpr, N: tl.constexpr):
    """Logit (i, j) of comb: its slices summed (a fixed [BLOCK_S] reduction), normalised, scaled, biased."""
    w = tl.sum(tl.load(mix + N + i * N + j, mask=s_ok, other=0.0), axis=0)
    return w * inv_rms * comb_scale + tl.load(base_ptr + 2 * N + i * N + j)


@triton.jit
def _gates4(mix, s_ok, inv_rms, base_ptr, scale_ptr, post_ptr, comb_ptr, token, hc_eps, sinkhorn_iters,
            N: tl.constexpr):
    """post and comb of one token for N = 4 streams, on 16 scalars: the 40 serial Sinkhorn half-rounds are
    register arithmetic, with no reduction across threads (the tensor form spends most of its time there)."""
    ks = tl.arange(0, N)
    post_w = tl.sum(tl.load(mix[:, None] + ks[None, :], mask=s_ok[:, None], other=0.0), axis=0)
    post = 2 * tl.sigmoid(post_w * inv_rms * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + ks))
    tl.store(post_ptr + token * N + ks, post)
    cs = tl.load(scale_ptr + 2)
    c00, c01, c02, c03 = _softmax4(_comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 0, 0, N),
                                   _comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 0, 1, N),
                                   _comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 0, 2, N),
                                   _comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 0, 3, N), hc_eps)
    c10, c11, c12, c13 = _softmax4(_comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 1, 0, N),
                                   _comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 1, 1, N),
                                   _comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 1, 2, N),
                                   _comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 1, 3, N), hc_eps)
    c20, c21, c22, c23 = _softmax4(_comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 2, 0, N),
                                   _comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 2, 1, N),
                                   _comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 2, 2, N),
                                   _comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 2, 3, N), hc_eps)
    c30, c31, c32, c33 = _softmax4(_comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 3, 0, N),
                                   _comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 3, 1, N),
                                   _comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 3, 2, N),
                                   _comb_logit(mix, s_ok, inv_rms, cs, base_ptr, 3, 3, N), hc_eps)
    # Columns once, then (rows, columns) rounds, as the reference.
    c00, c10, c20, c30 = _normalized4(c00, c10, c20, c30, hc_eps)
    c01, c11, c21, c31 = _normalized4(c01, c11, c21, c31, hc_eps)
    c02, c12, c22, c32 = _normalized4(c02, c12, c22, c32, hc_eps)
    c03, c13, c23, c33 = _normalized4(c03, c13, c23, c33, hc_eps)
    for _ in range(sinkhorn_iters - 1):
        c00, c01, c02, c03 = _normalized4(c00, c01, c02, c03, hc_eps)
        c10, c11, c12, c13 = _normalized4(c10, c11, c12, c13, hc_eps)
        c20, c21, c22, c23 = _normalized4(c20, c21, c22, c23, hc_eps)
        c30, c31, c32, c33 = _normalized4(c30, c31, c32, c33, hc_eps)
        c00, c10, c20, c30 = _normalized4(c00, c10, c20, c30, hc_eps)
        c01, c11, c21, c31 = _normalized4(c01, c11, c21, c31, hc_eps)
        c02, c12, c22, c32 = _normalized4(c02, c12, c22, c32, hc_eps)
        c03, c13, c23, c33 = _normalized4(c03, c13, c23, c33, hc_eps)
    out = comb_ptr + token * N * N
    tl.store(out + 0, c00)
    tl.store(out + 1, c01)
    tl.store(out + 2, c02)
    tl.store(out + 3, c03)
    tl.store(out + 4, c10)
    tl.store(out + 5, c11)
    tl.store(out + 6, c12)
    tl.store(out + 7, c13)
    tl.store(out + 8, c20)
    tl.store(out + 9, c21)
    tl.store(out + 10, c22)
    tl.store(out + 11, c23)
    tl.store(out + 12, c30)
    tl.store(out + 13, c31)
    tl.store(out + 14, c32)
    tl.store(out + 15, c33)


@triton.jit
def _pre_gate(gate_ws_ptr, slot, s_ok, ks, inv_rms, scale_ptr, base_ptr, hc_eps, GATE_W: tl.constexpr):
    """``pre`` [N] of one token: its slices' partial mixes summed in a fixed order, normalised, gated."""
    pre_w = tl.sum(tl.load(gate_ws_ptr + slot[:, None] * GATE_W + ks[None, :], mask=s_ok[:, None], other=0.0), axis=0)
    return tl.sigmoid(pre_w * inv_rms * tl.load(scale_ptr) + tl.load(base_ptr + ks)) + hc_eps


@triton.jit(do_not_specialize=["tokens", "sinkhorn_iters"])
def _hc_pre_finish_kernel(streams_ptr, gate_ws_ptr, mix_ws_ptr, base_ptr, scale_ptr, collapsed_ptr, post_ptr,
                          comb_ptr, prev_pre_ptr, pre_ptr, tokens, norm_eps, hc_eps, sinkhorn_iters,
                          N: tl.constexpr, D: tl.constexpr, S: tl.constexpr, BLOCK_S: tl.constexpr,
                          BLOCK_D: tl.constexpr, STEP_D: tl.constexpr, GATE_W: tl.constexpr, MIX_W: tl.constexpr,
                          SINGLE_PASS: tl.constexpr):
    """Program (token, c): c < cdiv(D, BLOCK_D) collapses hidden chunk c with pre (STEP_D columns at a time: fewer
    registers, more programs resident); the last c writes post, comb.  SINGLE_PASS (V4.1's
    ``hc_pre_single_pass``): chunks collapse with the previous site's pre [T, N] (``prev_pre_ptr``), and the last
    program also writes this site's pre (``pre_ptr``)."""
    wait_for_producers()
    token = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    ss = tl.arange(0, BLOCK_S)
    ks = tl.arange(0, N)
    s_ok = ss < S
    slot = ss.to(tl.int64) * tokens + token
    # Slices summed in a fixed order (a reduction over a [BLOCK_S, ...] tile whose shape depends on K only).
    sumsq = tl.sum(tl.load(gate_ws_ptr + slot * GATE_W + N, mask=s_ok, other=0.0), axis=0)
    inv_rms = tl.rsqrt(sumsq / (N * D) + norm_eps)
    if chunk * BLOCK_D < D:
        if SINGLE_PASS:
            pre = tl.load(prev_pre_ptr + token * N + ks)
        else:
            pre = _pre_gate(gate_ws_ptr, slot, s_ok, ks, inv_rms, scale_ptr, base_ptr, hc_eps, GATE_W)
        # Collapse the streams with pre (fp32 products, summed, rounded once to the stream dtype).
        for d0 in tl.static_range(0, BLOCK_D, STEP_D):
            dcols = chunk * BLOCK_D + d0 + tl.arange(0, STEP_D)
            dok = dcols < D
            x = tl.load(streams_ptr + token * (N * D) + ks[:, None] * D + dcols[None, :], mask=dok[None, :],
                        other=0.0).to(tl.float32)
            out = tl.sum(pre[:, None] * x, axis=0)
            tl.store(collapsed_ptr + token * D + dcols, out.to(collapsed_ptr.dtype.element_ty), mask=dok)
    else:
        if SINGLE_PASS:
            tl.store(pre_ptr + token * N + ks,
                     _pre_gate(gate_ws_ptr, slot, s_ok, ks, inv_rms, scale_ptr, base_ptr, hc_eps, GATE_W))
        _gates(mix_ws_ptr + slot * MIX_W, s_ok, inv_rms, base_ptr, scale_ptr, post_ptr, comb_ptr, token, hc_eps,
               sinkhorn_iters, N)


@triton.jit
def _gates(mix, s_ok, inv_rms, base_ptr, scale_ptr, post_ptr, comb_ptr, token, hc_eps, sinkhorn_iters,
           N: tl.constexpr):
    """post and comb of one token: on 16 scalars for N = 4, as [N] / [N, N] tiles otherwise."""
    if N == 4:
        _gates4(mix, s_ok, inv_rms, base_ptr, scale_ptr, post_ptr, comb_ptr, token, hc_eps, sinkhorn_iters, N)
    else:
        ks = tl.arange(0, N)
        post_w = tl.sum(tl.load(mix[:, None] + ks[None, :], mask=s_ok[:, None], other=0.0), axis=0)
        comb_w = tl.sum(tl.load(mix[:, None, None] + N + ks[None, :, None] * N + ks[None, None, :],
                                mask=s_ok[:, None, None], other=0.0), axis=0)
        post = 2 * tl.sigmoid(post_w * inv_rms * tl.load(scale_ptr + 1) + tl.load(base_ptr + N + ks))
        logits = comb_w * inv_rms * tl.load(scale_ptr + 2) + tl.load(base_ptr + 2 * N + ks[:, None] * N + ks[None, :])
        # Softmax over each row (the reference's dim=-1), then Sinkhorn: columns once, then rows/columns rounds.
        e = tl.exp(logits - tl.max(logits, axis=1)[:, None])
        comb = e / tl.sum(e, axis=1)[:, None] + hc_eps
        comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        for _ in range(sinkhorn_iters - 1):
            comb = comb / (tl.sum(comb, axis=1)[:, None] + hc_eps)
            comb = comb / (tl.sum(comb, axis=0)[None, :] + hc_eps)
        tl.store(post_ptr + token * N + ks, post)
        tl.store(comb_ptr + token * N * N + ks[:, None] * N + ks[None, :], comb)


def _pow2(v: int) -> int:
    return 1 << max(0, v - 1).bit_length()


@functools.cache
def _plan(tiles: HcPreTiles, n: int, dim: int, tier: HcPreTier,
          bf16: bool) -> tuple[dict[str, int], dict[str, int]]:
    """Constexprs of both kernels: functions of the model dims and the streams' dtype, and for the mix its tier."""
    slices = triton.cdiv(n * dim, tiles.slice)
    widths = {"GATE_W": _pow2(n + 1), "MIX_W": n + n * n}
    mix = {"N": n, "K": n * dim, "SLICE": tiles.slice, "BLOCK_T": tier.block_t,
           "BLOCK_K": min(tiles.block_k, tiles.slice), **widths, "TERMS": tiles.terms if bf16 else 0,
           "INTERPRETED": False}
    finish = {"N": n, "D": dim, "S": slices, "BLOCK_S": _pow2(slices), "BLOCK_D": tiles.block_d,
              "STEP_D": min(tiles.step_d or tiles.block_d, tiles.block_d), **widths}
    return mix, finish


def _aot_variants(arch: CudaArch, which: str, single_pass: bool = False) -> list[Variant]:
    variants = []
    for n, dim in AOT_SHAPES:
        tiles = hc_pre_config(arch, n, dim)
        for dtype in AOT_DTYPES:
            if which == "mix":
                sig = {"streams_ptr": f"*{dtype}:D", "fn_ptr": "*fp32:D", "gate_ws_ptr": "*fp32:D",
                       "mix_ws_ptr": "*fp32:D", "tokens": "i32"}
                for tier in tiles.tiers:
                    mix, _ = _plan(tiles, n, dim, tier, dtype == "bf16")
                    variants.append(Variant(sig, dict(mix), tier.config.num_warps, tier.config.num_stages))
            else:
                _, finish = _plan(tiles, n, dim, tiles.tiers[0], dtype == "bf16")
                sig = {"streams_ptr": f"*{dtype}:D", "gate_ws_ptr": "*fp32:D", "mix_ws_ptr": "*fp32:D",
                       "base_ptr": "*fp32:D", "scale_ptr": "*fp32:D", "collapsed_ptr": f"*{dtype}:D",
                       "post_ptr": "*fp32:D", "comb_ptr": "*fp32:D"}
                const: dict[str, object] = {**finish, "SINGLE_PASS": single_pass}
                if single_pass:
                    sig.update({"prev_pre_ptr": "*fp32:D", "pre_ptr": "*fp32:D"})
                else:
                    const.update({"prev_pre_ptr": None, "pre_ptr": None})
                sig.update({"tokens": "i32", "norm_eps": "fp32", "hc_eps": "fp32", "sinkhorn_iters": "i32"})
                variants.append(Variant(sig, const, tiles.finish.num_warps, tiles.finish.num_stages))
    # Two tiers of one shape may share a tile: compile each specialization once.
    unique: dict[tuple[str, str, int, int], Variant] = {}
    for v in variants:
        unique.setdefault((repr(v.signature), repr(sorted(v.constexprs.items())), v.num_warps, v.num_stages), v)
    return list(unique.values())


MIX_KERNEL = TritonKernel("hc_pre_mix", _hc_pre_mix_kernel, functools.partial(_aot_variants, which="mix"))
#: The finishing kernel carries the op's name (tests look the op up by ``KERNEL.name``); both are in ``ALL``.
KERNEL = TritonKernel("hc_pre", _hc_pre_finish_kernel, functools.partial(_aot_variants, which="finish"))
#: The same finishing kernel with ``SINGLE_PASS`` (``hc_pre_single_pass.py`` uses it with :data:`MIX_KERNEL`).
SINGLE_PASS_KERNEL = TritonKernel("hc_pre_single_pass", _hc_pre_finish_kernel,
                                  functools.partial(_aot_variants, which="finish", single_pass=True))


def covers(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           hc_eps: float, sinkhorn_iters: int) -> bool:
    """The streams are one tile (a power-of-two count; 1, 2, 4 and 8 ran on an H200); one Sinkhorn round or more."""
    return coverage.is_pow2(streams.shape[1]) and sinkhorn_iters >= 1


def plan_hc_pre(streams: torch.Tensor, previous_pre: torch.Tensor | None, fn: torch.Tensor, base: torch.Tensor,
                scale: torch.Tensor, norm_eps: float, hc_eps: float, sinkhorn_iters: int, *, arch: CudaArch,
                tiles: HcPreTiles | None, interpreted: bool) -> LaunchChain:
    """Both kernels' launches; ``previous_pre`` [T, N] given: the single-pass form (the finish collapses with it and
    also writes this site's pre).  The chain's result: (collapsed, post, comb), or (collapsed, pre, post, comb)."""
    tokens, n, dim = streams.shape
    if not covers(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
        raise ValueError(f"hc_pre: needs a power-of-two stream count (got {n}) and sinkhorn_iters >= 1 (got "
                         f"{sinkhorn_iters}); the op table runs core's reference for other inputs")
    streams = streams.contiguous()
    fn, base, scale = (t.to(torch.float32).contiguous() for t in (fn, base, scale))
    device = streams.device
    tiles = tiles or hc_pre_config(arch, n, dim)
    tier = tiles.tier(tokens)
    mix, finish = _plan(tiles, n, dim, tier, streams.dtype == torch.bfloat16)
    slices = finish["S"]
    gate_ws = torch.empty((slices, tokens, mix["GATE_W"]), dtype=torch.float32, device=device)
    mix_ws = torch.empty((slices, tokens, mix["MIX_W"]), dtype=torch.float32, device=device)
    collapsed = torch.empty((tokens, dim), dtype=streams.dtype, device=device)
    post = torch.empty((tokens, n), dtype=torch.float32, device=device)
    comb = torch.empty((tokens, n, n), dtype=torch.float32, device=device)
    pre = prev = None
    if previous_pre is not None:
        prev = previous_pre.to(device=device, dtype=torch.float32).contiguous()
        pre = torch.empty((tokens, n), dtype=torch.float32, device=device)
    mix_launch = Launch((triton.cdiv(tokens, tier.block_t), slices), tier.config,
                        dict(streams_ptr=streams, fn_ptr=fn, gate_ws_ptr=gate_ws, mix_ws_ptr=mix_ws, tokens=tokens,
                             **{**mix, "INTERPRETED": interpreted}), None)
    finish_launch = Launch((tokens, triton.cdiv(dim, tiles.block_d) + 1), tiles.finish,
                           dict(streams_ptr=streams, gate_ws_ptr=gate_ws, mix_ws_ptr=mix_ws, base_ptr=base,
                                scale_ptr=scale, collapsed_ptr=collapsed, post_ptr=post, comb_ptr=comb,
                                prev_pre_ptr=prev, pre_ptr=pre, tokens=tokens, norm_eps=float(norm_eps),
                                hc_eps=float(hc_eps), sinkhorn_iters=int(sinkhorn_iters), **finish,
                                SINGLE_PASS=previous_pre is not None), None)
    result = (collapsed, post, comb) if pre is None else (collapsed, pre, post, comb)
    finish_kernel = KERNEL if pre is None else SINGLE_PASS_KERNEL
    return LaunchChain([(MIX_KERNEL, mix_launch), (finish_kernel, finish_launch)], lambda: result)


def prepare(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
            hc_eps: float, sinkhorn_iters: int, *, arch: CudaArch, tiles: HcPreTiles | None = None) -> LaunchChain:
    """Plan ``hc_pre(...)`` for ``arch``: outputs and workspaces allocated, arguments built, nothing launched.
    ``tiles`` overrides ``arch.hc_pre_config`` (tools/sweep/hc_pre.py times candidates this way)."""
    return plan_hc_pre(streams, None, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, arch=arch, tiles=tiles,
                       interpreted=INTERPRETED)


# batch-invariant: a token's programs read only its streams, tiles from the model dims
@override("hc_pre", coverage=covers, batch_invariant=True, aot=(MIX_KERNEL, KERNEL))
def hc_pre(streams: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float,
           hc_eps: float, sinkhorn_iters: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(collapsed [T, D] in streams.dtype, post [T, N] fp32, comb [T, N, N] fp32) of one mHC site."""
    index, arch = cuda_target(streams)
    return prepare(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, arch=arch).run(index)
