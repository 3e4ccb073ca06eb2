"""Routed MoE experts with MXFP4 weights (e2m1 packed two a byte, one e8m0 scale per 32 columns), dequantized in
the tile: ``moe_experts.py``'s routing plan, grouped GEMMs and combine, with the weight tiles read as stored.

Overrides core's ``moe_experts_mxfp4(x, ids, weights, w13, w13_scale, w2, w2_scale, swiglu_limit)``
(deepinfer/ops/quant_gemm.py).  SM90 has no FP4 tensor cores: each program loads a [BLOCK_N, BLOCK_K / 2] tile of
bytes and its [BLOCK_N, BLOCK_K / 32] scales, decodes the nibbles (low nibble = even column), multiplies by the
scales and multiplies in bf16 on the tensor cores.  An e2m1 value times a power of two is exact in bf16, so the
weights are the reference's dequantized ones and the arithmetic after them is ``moe_experts``' (the same
epilogues): the op conforms as ``moe_experts`` does.  The step reads a quarter of bf16's weight bytes (plus 1/32
for the scales).  Pointer loads, not TMA (a byte tile would need its own descriptor shape; untuned).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, MoeTiles, moe_batch_invariant_config, moe_combine_config, moe_experts_config
from deepinfer_cuda.kernel_set.compile import Variant
from deepinfer_cuda.kernel_set.dispatch import Launch, LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernels.moe_experts import (
    AOT_SHAPES,
    AOT_SLOTS_PER_EXPERT,
    COMBINE_KERNEL,
    _combine_constexprs,
    _scaled_slots,
    _swiglu,
)
from deepinfer_cuda.kernels.moe_routing import plan

#: The interpreter test turns this on (fp32 products, rounding by hand; see moe_experts.py).
INTERPRETED = False


@triton.jit
def _e2m1(c):
    """fp32 value of e2m1 codes (int32 0..15): ``(2 + m) * 2^(e - 2)``, ``m / 2`` when e = 0, signed by bit 3."""
    e = (c >> 1) & 3
    m = c & 1
    mag = tl.where(e == 0, m.to(tl.float32) * 0.5, (2 + m).to(tl.float32) * (((e - 2 + 127) << 23).to(tl.float32,
                                                                                                       bitcast=True)))
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def _mxfp4_tile(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                dtype: tl.constexpr):
    """Weight rows ``rows`` [BLOCK_N] (int64), columns [k0, k0 + BLOCK_K), dequantized: [BLOCK_N, BLOCK_K] in
    ``dtype``; ``w_ptr`` bytes [*, K / 2], ``s_ptr`` e8m0 bytes [*, K / 32]."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    b = tl.load(w_ptr + rows[:, None] * (K // 2) + kb[None, :], mask=row_ok[:, None] & (kb < K // 2)[None, :],
                other=0).to(tl.int32)
    v = tl.reshape(tl.join(_e2m1(b & 15), _e2m1(b >> 4)), [BLOCK_N, BLOCK_K])
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    e = tl.load(s_ptr + rows[:, None] * (K // 32) + ks[None, :], mask=row_ok[:, None] & (ks < K // 32)[None, :],
                other=127).to(tl.int32)
    scale = (e << 23).to(tl.float32, bitcast=True)
    v = tl.reshape(tl.reshape(v, [BLOCK_N, BLOCK_K // 32, 32]) * scale[:, :, None], [BLOCK_N, BLOCK_K])
    return v.to(dtype)  # exact: an e2m1 value times a power of two


@triton.jit(do_not_specialize=["n_blocks", "limit"])
def _up_kernel(x_ptr, w13_ptr, s13_ptr, act_ptr, order_ptr, blocks_ptr, n_blocks, limit,
               H: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr,
               FP32_DOT: tl.constexpr, INTERPRETED: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COLS_INNER: tl.constexpr):
    block = tl.program_id(1 if COLS_INNER else 0)
    start = tl.load(blocks_ptr + n_blocks + block)
    end = tl.load(blocks_ptr + 2 * n_blocks + block)
    if start >= end:
        return
    expert = tl.load(blocks_ptr + block).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tokens = (tl.load(order_ptr + rows, mask=row_ok, other=0) // TOPK).to(tl.int64)
    cols = tl.program_id(0 if COLS_INNER else 1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    gate_rows = expert * (2 * INTER) + cols
    dtype = act_ptr.dtype.element_ty
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + tokens[:, None] * H + ks[None, :], mask=row_ok[:, None] & (ks < H)[None, :], other=0.0)
        wg = tl.trans(_mxfp4_tile(w13_ptr, s13_ptr, gate_rows, col_ok, k0, H, BLOCK_N, BLOCK_K, dtype))
        wu = tl.trans(_mxfp4_tile(w13_ptr, s13_ptr, gate_rows + INTER, col_ok, k0, H, BLOCK_N, BLOCK_K, dtype))
        if FP32_DOT:
            acc_g = tl.dot(a.to(tl.float32), wg.to(tl.float32), acc_g, input_precision="ieee")
            acc_u = tl.dot(a.to(tl.float32), wu.to(tl.float32), acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, wg, acc_g)
            acc_u = tl.dot(a, wu, acc_u)
    act = _swiglu(acc_g, acc_u, limit, dtype, HAS_LIMIT, INTERPRETED)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * INTER + cols[None, :], act, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["n_blocks"])
def _down_kernel(act_ptr, w2_ptr, s2_ptr, weights_ptr, slot_out_ptr, order_ptr, blocks_ptr, n_blocks,
                 H: tl.constexpr, INTER: tl.constexpr, FP32_DOT: tl.constexpr, INTERPRETED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COLS_INNER: tl.constexpr):
    block = tl.program_id(1 if COLS_INNER else 0)
    start = tl.load(blocks_ptr + n_blocks + block)
    end = tl.load(blocks_ptr + 2 * n_blocks + block)
    if start >= end:
        return
    expert = tl.load(blocks_ptr + block).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    slots = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    cols = tl.program_id(0 if COLS_INNER else 1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    dtype = slot_out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + rows.to(tl.int64)[:, None] * INTER + ks[None, :],
                    mask=row_ok[:, None] & (ks < INTER)[None, :], other=0.0)
        w = tl.trans(_mxfp4_tile(w2_ptr, s2_ptr, expert * H + cols, col_ok, k0, INTER, BLOCK_N, BLOCK_K, dtype))
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    y = _scaled_slots(acc, weights_ptr, slots, row_ok, dtype, INTERPRETED)
    tl.store(slot_out_ptr + slots[:, None] * H + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


def _tiles(arch: CudaArch, slots_per_expert: int, hidden: int, inter: int, element_bytes: int) -> MoeTiles:
    """``moe_experts``' tiles (reduction tiles of whole 32-column scale blocks: every tier's are)."""
    return moe_experts_config(arch, slots_per_expert, hidden, inter, element_bytes)


def _constexprs(tiles: MoeTiles, hidden: int, inter: int, top_k: int, has_limit: bool, fp32: bool,
                interpreted: bool):
    fp32_dot = fp32 or interpreted
    common = {"H": hidden, "INTER": inter, "FP32_DOT": fp32_dot, "INTERPRETED": interpreted,
              "BLOCK_M": tiles.block_m, "COLS_INNER": tiles.cols_inner}
    up = {**common, "TOPK": top_k, "HAS_LIMIT": has_limit, "BLOCK_N": tiles.up_block_n, "BLOCK_K": tiles.up_block_k}
    down = {**common, "BLOCK_N": tiles.down_block_n, "BLOCK_K": tiles.down_block_k}
    return up, down


def _aot_variants(arch: CudaArch, which: int) -> list[Variant]:
    variants = []
    for hidden, inter, top_k in AOT_SHAPES:
        if top_k != 6:  # MXFP4 runs the routed experts only (the shared expert is FP8, its own MLP)
            continue
        for per_expert in AOT_SLOTS_PER_EXPERT:
            tiles = _tiles(arch, per_expert, hidden, inter, 2)
            consts = _constexprs(tiles, hidden, inter, top_k, True, False, False)
            if which == 0:
                sig = {"x_ptr": "*bf16:D", "w13_ptr": "*u8:D", "s13_ptr": "*u8:D", "act_ptr": "*bf16:D",
                       "order_ptr": "*i32:D", "blocks_ptr": "*i32:D", "n_blocks": "i32", "limit": "fp32"}
                variants.append(Variant(sig, consts[0], tiles.up.num_warps, tiles.up.num_stages))
            else:
                sig = {"act_ptr": "*bf16:D", "w2_ptr": "*u8:D", "s2_ptr": "*u8:D", "weights_ptr": "*fp32:D",
                       "slot_out_ptr": "*bf16:D", "order_ptr": "*i32:D", "blocks_ptr": "*i32:D", "n_blocks": "i32"}
                variants.append(Variant(sig, consts[1], tiles.down.num_warps, tiles.down.num_stages))
    return variants


UP_KERNEL = TritonKernel("moe_experts_mxfp4_up", _up_kernel, lambda arch: _aot_variants(arch, 0))
DOWN_KERNEL = TritonKernel("moe_experts_mxfp4_down", _down_kernel, lambda arch: _aot_variants(arch, 1))
KERNEL = UP_KERNEL


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def prepare(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
            w2: torch.Tensor, w2_scale: torch.Tensor, swiglu_limit: float | None, *, arch: CudaArch,
            tiles: MoeTiles | None = None) -> LaunchChain:
    """Plan the op: the routing plan, the two GEMMs over packed weights, the combine (``tiles``: fixed ones)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if hidden % 32 or inter % 32:
        raise ValueError(f"moe_experts_mxfp4: hidden ({hidden}) and intermediate ({inter}) must be multiples of 32")
    slots = tokens * top_k
    if slots == 0:
        return LaunchChain([], lambda: torch.zeros_like(x))
    if tiles is None:
        tiles = _tiles(arch, slots // max(1, num_experts), hidden, inter, x.element_size())
    x, ids = x.contiguous(), ids.contiguous()
    order, blocks, plan_steps = plan(ids, num_experts, tiles.block_m, arch=arch)
    n_blocks = blocks.shape[1]
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    slot_out = torch.empty(slots, hidden, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    scale = weights.reshape(-1).to(torch.float32).contiguous()
    up_c, down_c = _constexprs(tiles, hidden, inter, top_k, swiglu_limit is not None, x.dtype == torch.float32,
                               INTERPRETED)

    def grid(cols: int) -> tuple[int, int]:
        return (cols, n_blocks) if tiles.cols_inner else (n_blocks, cols)

    up = Launch(grid(triton.cdiv(inter, tiles.up_block_n)), tiles.up,
                dict(x_ptr=x, w13_ptr=_bytes(w13), s13_ptr=_bytes(w13_scale), act_ptr=act, order_ptr=order,
                     blocks_ptr=blocks, n_blocks=n_blocks, limit=float(swiglu_limit or 0.0), **up_c), act)
    down = Launch(grid(triton.cdiv(hidden, tiles.down_block_n)), tiles.down,
                  dict(act_ptr=act, w2_ptr=_bytes(w2), s2_ptr=_bytes(w2_scale), weights_ptr=scale,
                       slot_out_ptr=slot_out, order_ptr=order, blocks_ptr=blocks, n_blocks=n_blocks, **down_c),
                  slot_out)
    config, block_h = moe_combine_config(arch, hidden)
    combine_c = {**_combine_constexprs(hidden, top_k, block_h), "INTERPRETED": INTERPRETED}
    combine = Launch((tokens, triton.cdiv(hidden, block_h)), config,
                     dict(slot_out_ptr=slot_out, ids_ptr=ids, out_ptr=out, **combine_c), out)
    steps = plan_steps + [(UP_KERNEL, up), (DOWN_KERNEL, down), (COMBINE_KERNEL, combine)]
    return LaunchChain(steps, lambda: out)


def moe_experts_mxfp4(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                      w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                      swiglu_limit: float | None) -> torch.Tensor:
    """Routed experts [T, H]: x [T, H]; ids [T, k]; weights [T, k] fp32; w13 [E, 2I, H/2] + scales [E, 2I, H/32];
    w2 [E, H, I/2] + scales [E, H, I/32]."""
    index, arch = cuda_target(x)
    return prepare(x, ids, weights, w13, w13_scale, w2, w2_scale, swiglu_limit, arch=arch).run(index)


def moe_experts_mxfp4_fixed_tiles(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                                  w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                                  swiglu_limit: float | None) -> torch.Tensor:
    """:func:`moe_experts_mxfp4` with one tile configuration for every batch (as ``moe_experts_fixed_tiles``)."""
    index, arch = cuda_target(x)
    tiles = moe_batch_invariant_config(arch, x.shape[1], w13.shape[1] // 2, x.element_size())
    return prepare(x, ids, weights, w13, w13_scale, w2, w2_scale, swiglu_limit, arch=arch, tiles=tiles).run(index)
