"""GEMM with an FP8 e4m3 weight and block scales, the weight read as stored (one byte a value).

Overrides core's ``fp8_block_linear(x, weight, scale, block_n, block_k)`` (deepinfer/ops/quant_gemm.py); the
grouped form (``fp8_block_grouped_linear.py``) is the same kernel with a group axis in the grid.  Two regimes
(``arch.fp8_linear_config``):

- **weight-only** (decode: fewer than 64 rows; fp32 always): each weight tile is dequantized in registers and
  multiplied with x in fp32 accumulation; the step reads the weights once at one byte a value, half bf16's bytes.
  With ue8m0 scales (powers of two, as released) the scale is taken out of the sum: ``sum_k x_k (code_k s) =
  s sum_k x_k code_k`` exactly (e4m3 codes are exact in bf16 / fp32 and a power of two rescales exactly), so each
  scale block's partial sum of ``x * code`` is scaled once per (row, block) instead of once per weight; fp32
  scales (and fp16 activations, whose range could round ``code * s``) take the reference's route per weight,
  ``code * s`` rounded to x's dtype.  Three tile forms (``arch.fp8_linear_config``, tuned by
  ``tools/sweep/quant_decode.py``): one row at a time with FMAs over [block_n, block_k] byte tiles (``row_loop``:
  decode's single row, where a 16-row ``tl.dot`` would waste 15 rows), or 16-row ``tl.dot`` tiles of one scale
  block each (``SUB``); either optionally split along K (``split_k``) into fp32 partials that
  ``split_k_sum.py`` adds in split order (deterministic), so narrow projections (1536..5120 columns) still give
  every SM several programs.  Either form can read its weight tiles by TMA (``tma``, opt-in per table entry:
  ``arch.Fp8DecodeTile.tma``): a host-side descriptor over the codes viewed as [GROUPS * N, K], read in [block_n,
  block_k] tiles by the row loop and [block_n, SUB] tiles by tl.dot, the K loop pipelined ``num_stages`` deep
  (``tl.range``'s ``num_stages``: without it Triton pipelines no load of the dot-less row loop).  The same values
  reach the same math: where the pointer loads mask, columns past a group's N read the next group's rows (never
  stored) and K's tail reads zeros, so only the load path changes.
- **FP8 tensor cores** (bf16, 64 rows and more; DeepGEMM's scheme, written anew): ``_act_quant_kernel`` first
  quantizes x per token and ``block_k`` channels (scale ``amax / 448`` in fp32, amax floored at 1e-4, codes
  rounded to nearest even), then each program multiplies FP8 tiles one weight scale block deep
  (``tl.dot`` on e4m3: wgmma) into a fresh fp32 partial that is scaled by the rows' activation scales and the
  columns' weight scales and added to the accumulator in fp32 (the promotion DeepGEMM does every 128 channels:
  FP8 wgmma accumulates with ~14 bits).  The error is the activation's FP8 rounding: the op's tolerance.

Codes travel as uint8; the kernel bit-casts them to ``float8e4nv`` for the tensor cores, and decodes them with
integer arithmetic under the CPU interpreter (``INTERPRETED``: no fp8 there; products in fp32, exact for FP8
operands), which checks the same math on the CPU.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Any

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer_cuda.arch import (
    FP8_DECODE_ROW_TIERS,
    CudaArch,
    Fp8LinearTiles,
    fp8_act_quant_config,
    fp8_linear_config,
)
from deepinfer_cuda.kernel_set.dispatch import Launch, LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels import fp8_block_linear_mx, fp8_block_linear_tl, split_k_sum
from deepinfer_cuda.kernels.fake_quant import _round_to_grid
from deepinfer_cuda.kernels.fp8_e4m3_codes import e4m3_code as _e4m3_code
from deepinfer_cuda.kernels.fp8_e4m3_codes import e4m3_value as _e4m3_value
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.kernels.split_k_sum import to_dtype
from deepinfer_cuda.override import override

#: The interpreter test turns this on (fp32 products, integer decoding of the codes, rounding by hand).
INTERPRETED = False
#: (N, K, groups) of V4-Flash's and V4.1-Flash's FP8 projections: wq_a | wkv (stacked), wq_b, wo_a (grouped),
#: wo_b, the shared expert's w1 | w3 and w2.
AOT_SHAPES = ((1536, 4096, 1), (32768, 1024, 1), (1024, 4096, 8), (4096, 8192, 1), (4096, 4096, 1), (4096, 2048, 1),
              (1792, 5120, 1), (32768, 1280, 1), (5120, 8192, 1), (4608, 5120, 1), (5120, 2304, 1))
AOT_BLOCKS = ((128, 128), (32, 32))
ACT_AMAX_FLOOR = 1e-4  # DeepGEMM's per_token_cast_to_fp8


@triton.jit
def _weight_scale(ws_ptr, idx, mask, SCALE_E8M0: tl.constexpr):
    if SCALE_E8M0:
        s = (tl.load(ws_ptr + idx, mask=mask, other=127).to(tl.int32) << 23).to(tl.float32, bitcast=True)
    else:
        s = tl.load(ws_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    return s


@triton.jit(do_not_specialize=["n_groups"])
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, n_groups, GROUP: tl.constexpr, BLOCK_R: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    """Groups [pid * BLOCK_R, +BLOCK_R) of GROUP contiguous values: e4m3 codes of ``x / s`` and ``s = max(amax,
    1e-4) / 448`` (fp32)."""
    wait_for_producers()
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, GROUP)
    ok = rows < n_groups
    offs = rows.to(tl.int64)[:, None] * GROUP + cols[None, :]
    x = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    s = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))  # IEEE, as torch divides (Triton's / is not)
    scale = tl.broadcast_to(s[:, None], x.shape)
    q = _round_to_grid(tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0), 3, -6, 448.0, INTERPRETED)
    tl.store(q_ptr + offs, _e4m3_code(q).to(tl.uint8), mask=ok[:, None])
    tl.store(s_ptr + rows, s, mask=ok)


@triton.jit
def _code_values(wc, INTERPRETED: tl.constexpr):
    """fp32 values of e4m3 code bytes (uint8): the hardware conversion, integer decoding under the interpreter."""
    if INTERPRETED:
        return _e4m3_value(wc.to(tl.int32))
    return wc.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _act_fp8_tiles(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, g, rows, cols, col_ok, w_rows, N: tl.constexpr,
                   K: tl.constexpr, GROUPS: tl.constexpr, BN_Q: tl.constexpr, BK_Q: tl.constexpr, KB: tl.constexpr,
                   SCALE_E8M0: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Prefill: FP8 tiles of x codes (scales xs) and weight codes, one scale block deep (BLOCK_K == BK_Q) a step,
    each step's product promoted to fp32 with both scales."""
    row_ok = rows < M
    x_row = rows.to(tl.int64) * (GROUPS * K) + g * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + x_row[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
        wc = tl.load(w_ptr + w_rows[:, None] * K + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
        if INTERPRETED:
            part = tl.dot(_e4m3_value(a.to(tl.int32)), tl.trans(_e4m3_value(wc.to(tl.int32))), input_precision="ieee")
        else:
            part = tl.dot(a.to(tl.float8e4nv, bitcast=True), tl.trans(wc.to(tl.float8e4nv, bitcast=True)))
        xs = tl.load(xs_ptr + rows.to(tl.int64) * (GROUPS * K // BK_Q) + (g * K + k0) // BK_Q, mask=row_ok, other=0.0)
        ws = _weight_scale(ws_ptr, (w_rows // BN_Q) * KB + k0 // BK_Q, col_ok, SCALE_E8M0)
        acc += part * xs[:, None] * ws[None, :]
    y_off = rows.to(tl.int64)[:, None] * (GROUPS * N) + g * N + cols[None, :]
    tl.store(y_ptr + y_off, to_dtype(acc, y_ptr.dtype.element_ty, INTERPRETED), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _weight_only_tiles(x_ptr, w_ptr, ws_ptr, out_ptr, M, g, rows, k_lo, k_hi, cols, col_ok, w_rows, w_row0,
                       N: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr, BN_Q: tl.constexpr,
                       BK_Q: tl.constexpr, KB: tl.constexpr, SCALE_E8M0: tl.constexpr, FACTOR: tl.constexpr,
                       FP32_DOT: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr, TMA_STAGES: tl.constexpr):
    """Decode tl.dot tiles: [BLOCK_M, BLOCK_N] of K in [k_lo, k_hi), one SUB-deep product per scale block (SUB
    divides BK_Q), factored (scaled after the product) or the reference's dequantized weight.  ``TMA_STAGES`` > 0:
    ``w_ptr`` is a descriptor of [BLOCK_N, SUB] tiles, ``w_row0`` the tile's first weight row."""
    row_ok = rows < M
    x_row = rows.to(tl.int64) * (GROUPS * K) + g * K
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=TMA_STAGES if TMA_STAGES > 0 else None):
        for j in tl.static_range(BLOCK_K // SUB):
            kj = k0 + j * SUB
            ks = kj + tl.arange(0, SUB)
            k_ok = ks < K
            a = tl.load(x_ptr + x_row[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
            if TMA_STAGES > 0:
                wc = w_ptr.load([w_row0, kj])
            else:
                wc = tl.load(w_ptr + w_rows[:, None] * K + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
            # (past K, a block's codes are masked: its scale index is clamped into the row)
            s = _weight_scale(ws_ptr, (w_rows // BN_Q) * KB + tl.minimum(kj // BK_Q, KB - 1), col_ok, SCALE_E8M0)
            if FACTOR:  # codes exactly in the dot's dtype, the block's power-of-two scale after the product
                if FP32_DOT:
                    part = tl.dot(a.to(tl.float32), tl.trans(_code_values(wc, INTERPRETED)), input_precision="ieee")
                else:
                    part = tl.dot(a, tl.trans(wc.to(tl.float8e4nv, bitcast=True).to(dtype)))
                acc += part * s[None, :]
            else:  # the reference's dequantized weight: code * scale rounded to x's dtype
                w = to_dtype(_code_values(wc, INTERPRETED) * s[:, None], dtype, INTERPRETED)
                if FP32_DOT:
                    acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
                else:
                    acc = tl.dot(a, tl.trans(w), acc)
    y_off = rows.to(tl.int64)[:, None] * (GROUPS * N) + g * N + cols[None, :]
    tl.store(out_ptr + y_off, to_dtype(acc, out_ptr.dtype.element_ty, INTERPRETED),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _row_loop(x_ptr, w_ptr, ws_ptr, out_ptr, M, g, row0, k_lo, k_hi, cols, col_ok, w_rows, w_row0,
              N: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr, BN_Q: tl.constexpr, BK_Q: tl.constexpr,
              KB: tl.constexpr, SCALE_E8M0: tl.constexpr, FACTOR: tl.constexpr, INTERPRETED: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
              TMA_STAGES: tl.constexpr):
    """Decode rows one at a time, FMAs (no tl.dot): each step a [BLOCK_N, BLOCK_K / SUB, SUB] tile of codes times
    x's [BLOCK_K / SUB, SUB], summed per scale block, scaled per (column, block).  ``TMA_STAGES`` > 0: ``w_ptr``
    is a descriptor of [BLOCK_N, BLOCK_K] tiles, ``w_row0`` the tile's first weight row."""
    kq = tl.arange(0, BLOCK_K // SUB)
    offs = kq[:, None] * SUB + tl.arange(0, SUB)[None, :]  # [KQ, SUB]
    if TMA_STAGES == 0:
        w_base = w_ptr + w_rows[:, None, None] * K
    s_rows = (w_rows // BN_Q)[:, None] * KB
    dtype = x_ptr.dtype.element_ty
    for r in range(row0, tl.minimum(row0 + BLOCK_M, M)):  # row0 int64: so is r (the interpreter's: a Python int)
        x_row = x_ptr + r * (GROUPS * K) + g * K
        acc = tl.zeros([BLOCK_N], dtype=tl.float32)
        for k0 in tl.range(k_lo, k_hi, BLOCK_K, num_stages=TMA_STAGES if TMA_STAGES > 0 else None):
            ks = k0 + offs
            k_ok = ks < K
            a = tl.load(x_row + ks, mask=k_ok, other=0.0).to(tl.float32)
            if TMA_STAGES > 0:
                wc = tl.reshape(w_ptr.load([w_row0, k0]), [BLOCK_N, BLOCK_K // SUB, SUB])
            else:
                wc = tl.load(w_base + ks[None, :, :], mask=col_ok[:, None, None] & k_ok[None, :, :], other=0)
            kb = (k0 + kq * SUB) // BK_Q
            s = _weight_scale(ws_ptr, s_rows + kb[None, :], col_ok[:, None] & (kb < KB)[None, :], SCALE_E8M0)
            if FACTOR:
                acc += tl.sum(tl.sum(_code_values(wc, INTERPRETED) * a[None, :, :], axis=2) * s, axis=1)
            else:
                w = to_dtype(_code_values(wc, INTERPRETED) * s[:, :, None], dtype, INTERPRETED).to(tl.float32)
                acc += tl.sum(tl.sum(w * a[None, :, :], axis=2), axis=1)
        tl.store(out_ptr + r * (GROUPS * N) + g * N + cols,
                 to_dtype(acc, out_ptr.dtype.element_ty, INTERPRETED), mask=col_ok)


@triton.jit(do_not_specialize=["M"])
def _fp8_linear_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M,
                       N: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr, BN_Q: tl.constexpr,
                       BK_Q: tl.constexpr, KB: tl.constexpr, SCALE_E8M0: tl.constexpr, FACTOR: tl.constexpr,
                       ACT_FP8: tl.constexpr, FP32_DOT: tl.constexpr, INTERPRETED: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
                       SPLIT_K: tl.constexpr, K_SPLIT: tl.constexpr, ROW_LOOP: tl.constexpr,
                       TMA_STAGES: tl.constexpr):
    """y[m, g, n] = sum_k x[m, g, k] * W[g * N + n, k] for a [BLOCK_M, BLOCK_N] tile of group ``program_id(2)``
    and split ``program_id(0) % SPLIT_K`` (K in [split * K_SPLIT, +K_SPLIT)); x [M, GROUPS * K] (codes uint8 when
    ACT_FP8, with scales xs [M, GROUPS * K / BK_Q]), W [GROUPS * N, K] uint8 codes with scales ws
    [cdiv(GROUPS * N, BN_Q), KB = cdiv(K, BK_Q)], y [M, GROUPS * N] (SPLIT_K > 1: fp32 partials [SPLIT_K, M,
    GROUPS * N]).  ``TMA_STAGES`` > 0 (weight-only): ``w_ptr`` is a descriptor over W instead, the K loop
    pipelined that deep (see the module docstring)."""
    wait_for_producers()
    g = tl.program_id(2)
    row0 = (tl.program_id(0) // SPLIT_K).to(tl.int64) * BLOCK_M
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_rows = (g * N + cols).to(tl.int64)
    w_row0 = g * N + tl.program_id(1) * BLOCK_N
    if ACT_FP8:
        _act_fp8_tiles(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M, g, row0 + tl.arange(0, BLOCK_M), cols, col_ok, w_rows,
                       N, K, GROUPS, BN_Q, BK_Q, KB, SCALE_E8M0, INTERPRETED, BLOCK_M, BLOCK_N, BLOCK_K)
    else:
        if SPLIT_K == 1:
            k_lo = 0
            k_hi = K
            out_ptr = y_ptr
        else:
            split = tl.program_id(0) % SPLIT_K
            k_lo = split * K_SPLIT
            k_hi = tl.minimum(k_lo + K_SPLIT, K)
            out_ptr = y_ptr + split.to(tl.int64) * M * (GROUPS * N)
        if ROW_LOOP:
            _row_loop(x_ptr, w_ptr, ws_ptr, out_ptr, M, g, row0, k_lo, k_hi, cols, col_ok, w_rows, w_row0, N, K,
                      GROUPS, BN_Q, BK_Q, KB, SCALE_E8M0, FACTOR, INTERPRETED, BLOCK_M, BLOCK_N, BLOCK_K, SUB,
                      TMA_STAGES)
        else:
            _weight_only_tiles(x_ptr, w_ptr, ws_ptr, out_ptr, M, g, row0 + tl.arange(0, BLOCK_M), k_lo, k_hi, cols,
                               col_ok, w_rows, w_row0, N, K, GROUPS, BN_Q, BK_Q, KB, SCALE_E8M0, FACTOR, FP32_DOT,
                               INTERPRETED, BLOCK_M, BLOCK_N, BLOCK_K, SUB, TMA_STAGES)


@dataclass(frozen=True, slots=True)
class _Shape:
    """What a launch's constexprs depend on besides its tiles."""

    n: int
    k: int
    groups: int
    bn: int  #: the weight's scale block along N
    bk: int  #: ... and along K
    e8m0: bool
    fp32: bool
    fp16: bool = False


def _resolve(tiles: Fp8LinearTiles, k: int, bk: int) -> tuple[Fp8LinearTiles, int]:
    """(tiles, SUB): the sub-block a scale covers whole (a power of two dividing ``bk``, at most ``block_k``); a
    scale block too narrow for a 16-deep tl.dot takes the row loop; TMA only where a descriptor can read the tiles
    (weight-only, rows of ``K`` bytes 16-byte aligned, tile rows of 16 bytes or more)."""
    sub = min(tiles.block_k, bk & -bk)
    if not tiles.act_fp8 and not tiles.row_loop and sub < 16:
        tiles = dataclasses.replace(tiles, block_m=1, row_loop=True)
    if tiles.tma and (tiles.act_fp8 or k % 16 or (tiles.block_k if tiles.row_loop else sub) < 16):
        tiles = dataclasses.replace(tiles, tma=False)
    return tiles, sub


@functools.cache
def _constexprs(shape: _Shape, tiles: Fp8LinearTiles, interpreted: bool) -> tuple[dict[str, object], int]:
    """(the kernel's constexprs, the effective split count)."""
    tiles, sub = _resolve(tiles, shape.k, shape.bk)
    steps = -(-shape.k // tiles.block_k)
    per_split = -(-steps // tiles.split_k) * tiles.block_k
    split = -(-shape.k // per_split) if tiles.split_k > 1 else 1
    const: dict[str, object] = {"N": shape.n, "K": shape.k, "GROUPS": shape.groups, "BN_Q": shape.bn, "BK_Q": shape.bk,
             "KB": -(-shape.k // shape.bk), "SCALE_E8M0": shape.e8m0, "FACTOR": shape.e8m0 and not shape.fp16,
             "ACT_FP8": tiles.act_fp8, "FP32_DOT": shape.fp32 or interpreted, "INTERPRETED": interpreted,
             "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k, "SUB": sub,
             "SPLIT_K": split, "K_SPLIT": per_split if split > 1 else shape.k, "ROW_LOOP": tiles.row_loop,
             "TMA_STAGES": tiles.config.num_stages if tiles.tma else 0}
    return const, split


def _aot_tiles(arch: CudaArch) -> list[tuple[_Shape, Fp8LinearTiles]]:
    """bf16 activations, ue8m0 scales (as released), every regime, at every AOT shape and block: decode's row tiers,
    prefill's 64- and 128-row tiles, the batch-invariant tiles."""
    out = []
    for n, k, groups in AOT_SHAPES:
        for bn, bk in AOT_BLOCKS:
            shape = _Shape(n, k, groups, bn, bk, True, False)
            for rows in (*FP8_DECODE_ROW_TIERS, 64, 128):
                out.append((shape, fp8_linear_config(arch, rows, n, k, groups, bk, 2)))
            out.append((shape, fp8_linear_config(arch, 1, n, k, groups, bk, 2, batch_invariant=True)))
    return out


def _weight_block(const: dict[str, object]) -> list[int]:
    """The [rows, columns] weight tile a TMA launch reads a step: the row loop's whole step, tl.dot's scale
    sub-block."""
    rows, cols = const["BLOCK_N"], const["BLOCK_K" if const["ROW_LOOP"] else "SUB"]
    assert isinstance(rows, int) and isinstance(cols, int)
    return [rows, cols]


def _split_sum_variants(arch: CudaArch) -> list[Variant]:
    """One split-K sum per split count of the AOT decode tiles."""
    splits = {_constexprs(shape, tiles, False)[1] for shape, tiles in _aot_tiles(arch)}
    return split_k_sum.variants(arch, splits | fp8_block_linear_tl.splits(arch))


def _gemm_variants(arch: CudaArch) -> list[Variant]:
    variants: dict[tuple, Variant] = {}
    for shape, tiles in _aot_tiles(arch):
        if tiles.mx:
            continue
        const, split = _constexprs(shape, tiles, False)
        x = "*u8:D" if tiles.act_fp8 else "*bf16:D"
        w = "tensordesc<u8[{}, {}]>".format(*_weight_block(const)) if const["TMA_STAGES"] else "*u8:D"
        sig = {"x_ptr": x, "xs_ptr": "*fp32:D" if tiles.act_fp8 else x, "w_ptr": w, "ws_ptr": "*u8:D",
               "y_ptr": "*fp32:D" if split > 1 else "*bf16:D", "M": "i32"}
        key = (tuple(sig.items()), tuple(sorted(const.items())), tiles.config.num_warps, tiles.config.num_stages)
        variants[key] = Variant(sig, dict(const), tiles.config.num_warps, tiles.config.num_stages)
    return list(variants.values())


def _act_quant_variants(arch: CudaArch) -> list[Variant]:
    variants = []
    for group in sorted({bk for _, bk in AOT_BLOCKS}):
        cfg = fp8_act_quant_config(arch, group)
        sig = {"x_ptr": "*bf16:D", "q_ptr": "*u8:D", "s_ptr": "*fp32:D", "n_groups": "i32"}
        const = {"GROUP": group, "BLOCK_R": cfg.block_rows, "INTERPRETED": False}
        variants.append(Variant(sig, const, cfg.num_warps, cfg.num_stages))
    return variants


def _mx_variants(arch: CudaArch) -> list[Variant]:
    variants: dict[str, Variant] = {}
    for shape, tiles in _aot_tiles(arch):
        if tiles.mx:
            const = fp8_block_linear_mx.constexprs(shape.n, shape.k, shape.groups, shape.bn, shape.bk, tiles.block_m,
                                                   tiles.block_n, tiles.block_k, False)
            sig = {"x_ptr": "*bf16:D", "w_ptr": "*u8:D", "ws_ptr": "*u8:D", "y_ptr": "*bf16:D", "M": "i32"}
            variants[repr(sorted(const.items()))] = Variant(sig, const, tiles.config.num_warps,
                                                            tiles.config.num_stages)
    return list(variants.values())


KERNEL = TritonKernel("fp8_block_linear", _fp8_linear_kernel, _gemm_variants)
MX_KERNEL = TritonKernel("fp8_block_linear_mx", fp8_block_linear_mx.mx_linear_kernel, _mx_variants)
ACT_QUANT_KERNEL = TritonKernel("fp8_act_quant", _act_quant_kernel, _act_quant_variants)
SPLIT_K_SUM_KERNEL = TritonKernel("split_k_sum", split_k_sum.split_k_sum_kernel, _split_sum_variants)
#: Every kernel a GEMM of this module (or the grouped one) launches.
KERNELS = (KERNEL, MX_KERNEL, ACT_QUANT_KERNEL, SPLIT_K_SUM_KERNEL, fp8_block_linear_tl.KERNEL)


def _scale_bytes(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the scales as the kernel reads them, whether they are e8m0 bytes)."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return scale.contiguous().view(torch.uint8), True
    return scale.float().contiguous(), False


def plan_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, groups: int,
              *, arch: CudaArch, interpreted: bool, fixed: bool = False,
              tiles: Fp8LinearTiles | None = None) -> LaunchChain:
    """The launches of ``y [M, groups * N] = x [M, groups * K] @ W^T`` per group (see the module docstring);
    ``fixed``: the weight-only regime at every row count (``DEEPINFER_BATCH_INVARIANT=1``: a row's result is its
    own 16-row tile's, reduced in one order, whatever the batch); ``tiles`` overrides ``arch.fp8_linear_config``
    (tuning runs only: the kernel set holds the config's tiles)."""
    if x.dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise ValueError(f"fp8_block_linear: x must be bf16, fp16 or fp32, got {x.dtype}")
    if weight.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"fp8_block_linear: weight must be float8_e4m3fn, got {weight.dtype}")
    n = weight.shape[0]
    k = x.shape[-1]  # per group: x is [..., K] or [T, G, K]
    n //= groups
    lead = x.shape[: -2 if groups > 1 else -1]
    x2 = x.reshape(-1, groups * k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, groups * n, dtype=x.dtype, device=x.device)
    result = y.view(*lead, groups, n) if groups > 1 else y.view(*lead, n)
    ws, e8m0 = _scale_bytes(scale)
    if tiles is None and not fixed and not interpreted:  # the TileLang form where the arch table names one
        planned = fp8_block_linear_tl.plan(x2, weight, scale, y, n, k, groups, block_n, block_k, arch=arch)
        if planned is not None:
            tl_gemm, part = planned
            chain: list[tuple[Any, Launch]] = [(fp8_block_linear_tl.KERNEL, tl_gemm)]
            if part is not y:
                chain.append((SPLIT_K_SUM_KERNEL, split_k_sum.plan(part, y, arch=arch, interpreted=False)))
            return LaunchChain(chain, lambda: result)
    if tiles is None:
        tiles = fp8_linear_config(arch, m, n, k, groups, block_k, x.element_size(), batch_invariant=fixed,
                                  scale_e8m0=e8m0)
    if tiles.act_fp8 and (k % block_k or block_k not in (32, 64, 128) or x.dtype != torch.bfloat16):
        # the activation path needs whole groups: the weight-only tiles of any batch
        tiles = fp8_linear_config(arch, m, n, k, groups, block_k, x.element_size(), batch_invariant=True)
    w = weight.contiguous().view(torch.uint8)
    if tiles.mx:
        const = fp8_block_linear_mx.constexprs(n, k, groups, block_n, block_k, tiles.block_m, tiles.block_n,
                                               tiles.block_k, interpreted)
        grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), groups)
        launch = Launch(grid if m else (0,), tiles.config, dict(x_ptr=x2, w_ptr=w, ws_ptr=ws, y_ptr=y, M=m, **const),
                        result)
        return LaunchChain([(MX_KERNEL, launch)], lambda: result)
    if tiles.tma and w.data_ptr() % 16:  # a descriptor's base must be 16-byte aligned
        tiles = dataclasses.replace(tiles, tma=False)
    shape = _Shape(n, k, groups, block_n, block_k, e8m0, x.dtype == torch.float32, x.dtype == torch.float16)
    const, split = _constexprs(shape, tiles, interpreted)
    w_arg: torch.Tensor | TensorDescriptor = w
    if const["TMA_STAGES"]:
        w_arg = TensorDescriptor.from_tensor(w, _weight_block(const))
    grid = (triton.cdiv(m, const["BLOCK_M"]) * split, triton.cdiv(n, tiles.block_n), groups)
    steps = []
    a, xs = x2, x2
    if tiles.act_fp8:
        a = torch.empty(m, groups * k, dtype=torch.uint8, device=x.device)
        xs = torch.empty(m, groups * k // block_k, dtype=torch.float32, device=x.device)
        cfg = fp8_act_quant_config(arch, block_k)
        n_groups = m * groups * k // block_k
        quant = Launch((triton.cdiv(n_groups, cfg.block_rows),), cfg,
                       dict(x_ptr=x2, q_ptr=a, s_ptr=xs, n_groups=n_groups, GROUP=block_k, BLOCK_R=cfg.block_rows,
                            INTERPRETED=interpreted), None)
        steps.append((ACT_QUANT_KERNEL, quant))
    out = y if split == 1 else torch.empty(split, m, groups * n, dtype=torch.float32, device=x.device)
    gemm = Launch(grid if m else (0,), tiles.config,
                  dict(x_ptr=a, xs_ptr=xs, w_ptr=w_arg, ws_ptr=ws, y_ptr=out, M=m, **const), result)
    steps.append((KERNEL, gemm))
    if split > 1:
        steps.append((SPLIT_K_SUM_KERNEL, split_k_sum.plan(out, y, arch=arch, interpreted=interpreted)))
    return LaunchChain(steps, lambda: result)


def prepare(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, *,
            arch: CudaArch) -> LaunchChain:
    """Plan ``fp8_block_linear(...)``: x [..., K], weight [N, K] e4m3, scale per block."""
    return plan_gemm(x, weight, scale, block_n, block_k, 1, arch=arch, interpreted=INTERPRETED)


def fp8_block_linear_fixed_tiles(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                                 block_k: int) -> torch.Tensor:
    """:func:`fp8_block_linear` with the weight-only regime for every batch (the batch-invariant table's)."""
    index, arch = cuda_target(x)
    return plan_gemm(x, weight, scale, block_n, block_k, 1, arch=arch, interpreted=INTERPRETED, fixed=True).run(index)


@override("fp8_block_linear", batch_invariant=fp8_block_linear_fixed_tiles, aot=KERNELS)
def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int
                     ) -> torch.Tensor:
    """``x @ (weight * scale)^T`` [..., N] in x's dtype."""
    index, arch = cuda_target(x)
    return prepare(x, weight, scale, block_n, block_k, arch=arch).run(index)
