"""The MXFP4 expert GEMMs' ``tl.dot_scaled`` form (``arch.Mxfp4Tiles.dot_scaled``): the packed e2m1 weight bytes and
their e8m0 scales go to ``tl.dot_scaled`` as stored, no decoding in the kernel.

``moe_experts_mxfp4.py`` plans the op (routing plan, combine) and picks these two kernels where the arch's tiles ask
for them.  The activation operand is ``Mxfp4Tiles.dot_scaled``:

- ``"e4m3"``: each [BLOCK_M, BLOCK_K] activation tile quantized in registers to MXFP8 (``mxfp8_tile.py``: e4m3
  codes, an e8m0 scale per 32 columns), so both operands are microscaled and SM100 runs ``tcgen05.mma ...
  kind::mxf8f6f4.block_scale`` (Blackwell's native FP4 x FP8 rate, twice bf16's).  The activation's FP8 rounding
  (2^-4 relative, as the FP8 GEMMs' prefill) is the error against the reference;
- ``"bf16"``: the activation as it is; Triton upcasts the weights to bf16 in the tile and multiplies in bf16
  (``kind::f16`` on SM100): the reference's arithmetic, within ``moe_experts``' tolerance.

Elsewhere (SM90, the CPU interpreter) Triton decomposes ``dot_scaled`` into an upcast and a plain dot, so the same
code runs and is checked there.  The epilogues (SwiGLU with its limit, the routing weight) are ``moe_experts``'.
Row tiles only (prefill's many slots per expert); decode keeps ``moe_experts_mxfp4``'s row loop.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, Mxfp4Tiles, moe_mxfp4_config
from deepinfer_cuda.kernel_set.dispatch import TritonKernel
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.kernels.moe_experts import (
    AOT_SHAPES,
    AOT_SLOTS_PER_EXPERT,
    _scaled_slots,
    _swiglu,
    program_block,
)
from deepinfer_cuda.kernels.mxfp8_tile import mxfp8_tile


@triton.jit
def _weight_tile(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """Packed e2m1 bytes [BLOCK_N, BLOCK_K / 2] and e8m0 scale bytes [BLOCK_N, BLOCK_K / 32] of weight rows
    ``rows`` from column ``k0`` (masked rows: zeros, scale 1)."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    b = tl.load(w_ptr + rows[:, None] * (K // 2) + kb[None, :], mask=row_ok[:, None] & (kb < K // 2)[None, :],
                other=0)
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    s = tl.load(s_ptr + rows[:, None] * (K // 32) + ks[None, :], mask=row_ok[:, None] & (ks < K // 32)[None, :],
                other=127)
    return b, s


@triton.jit
def _scaled_dot(a, w_ptr, s_ptr, rows, row_ok, k0, acc, K: tl.constexpr, LHS: tl.constexpr,
                INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """``acc + a @ W[rows, k0 : k0 + BLOCK_K]^T``, ``a`` [BLOCK_M, BLOCK_K] in the activation's dtype."""
    b, s = _weight_tile(w_ptr, s_ptr, rows, row_ok, k0, K, BLOCK_K)
    if LHS == "e4m3":
        codes, a_scale = mxfp8_tile(a, BLOCK_M, BLOCK_K, INTERPRETED)
        return tl.dot_scaled(codes, a_scale, "e4m3", tl.trans(b), s, "e2m1", acc)
    return tl.dot_scaled(a, None, "bf16", tl.trans(b), s, "e2m1", acc)


@triton.jit
def _rows_tile(ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    ks = k0 + tl.arange(0, BLOCK_K)
    return tl.load(ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)


@triton.jit(do_not_specialize=["n_blocks", "limit"])
def _up_kernel(x_ptr, w13_ptr, s13_ptr, act_ptr, order_ptr, blocks_ptr, n_blocks, limit,
               H: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr, LHS: tl.constexpr,
               INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               COLS_INNER: tl.constexpr):
    """act[slot] = swiglu(x[token] @ gate^T, x[token] @ up^T) for BLOCK_M slots of one expert, BLOCK_N columns: the
    gate and up rows as one [2 * BLOCK_N] weight tile, so one product a step (one scale operand: Triton 3.6 fails on
    an activation scale shared by two block-scaled MMAs)."""
    wait_for_producers()
    expert, start, end, col_tile = program_block(blocks_ptr, n_blocks, COLS_INNER)
    if start >= end:
        return
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    both = tl.arange(0, 2 * BLOCK_N)
    both_cols = col_tile * BLOCK_N + both % BLOCK_N
    w_rows = expert.to(tl.int64) * (2 * INTER) + (both // BLOCK_N) * INTER + both_cols  # gate rows, then up rows
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tokens = (tl.load(order_ptr + rows, mask=row_ok, other=0) // TOPK).to(tl.int64)
    acc = tl.zeros([BLOCK_M, 2 * BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        a = _rows_tile(x_ptr, tokens, row_ok, k0, H, BLOCK_K)
        acc = _scaled_dot(a, w13_ptr, s13_ptr, w_rows, both_cols < INTER, k0, acc, H, LHS, INTERPRETED, BLOCK_M,
                          BLOCK_K)
    acc_g, acc_u = tl.split(tl.permute(tl.reshape(acc, [BLOCK_M, 2, BLOCK_N]), (0, 2, 1)))
    col_ok = cols < INTER
    act = _swiglu(acc_g, acc_u, limit, act_ptr.dtype.element_ty, HAS_LIMIT, INTERPRETED)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * INTER + cols[None, :], act, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["n_blocks"])
def _down_kernel(act_ptr, w2_ptr, s2_ptr, weights_ptr, slot_out_ptr, order_ptr, blocks_ptr, n_blocks,
                 H: tl.constexpr, INTER: tl.constexpr, LHS: tl.constexpr, INTERPRETED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COLS_INNER: tl.constexpr):
    """slot_out[slot] = weight[slot] * act[slot] @ W2^T for BLOCK_M slots of one expert, BLOCK_N columns."""
    wait_for_producers()
    expert, start, end, col_tile = program_block(blocks_ptr, n_blocks, COLS_INNER)
    if start >= end:
        return
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    w_rows = expert.to(tl.int64) * H + cols
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    slots = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        a = _rows_tile(act_ptr, rows.to(tl.int64), row_ok, k0, INTER, BLOCK_K)
        acc = _scaled_dot(a, w2_ptr, s2_ptr, w_rows, col_ok, k0, acc, INTER, LHS, INTERPRETED, BLOCK_M, BLOCK_K)
    y = _scaled_slots(acc, weights_ptr, slots, row_ok, slot_out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(slot_out_ptr + slots[:, None] * H + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


def constexprs(tiles: Mxfp4Tiles, hidden: int, inter: int, top_k: int, has_limit: bool, interpreted: bool
               ) -> tuple[dict[str, object], dict[str, object]]:
    """The up and down kernels' constexprs for ``tiles`` (``tiles.dot_scaled`` set)."""
    t = tiles.tiles
    common: dict[str, object] = {"H": hidden, "INTER": inter, "LHS": tiles.dot_scaled, "INTERPRETED": interpreted,
                                 "BLOCK_M": t.block_m, "COLS_INNER": t.cols_inner}
    up = {**common, "TOPK": top_k, "HAS_LIMIT": has_limit, "BLOCK_N": t.up_block_n, "BLOCK_K": t.up_block_k}
    down = {**common, "BLOCK_N": t.down_block_n, "BLOCK_K": t.down_block_k}
    return up, down


def _aot_variants(arch: CudaArch, which: int) -> list[Variant]:
    """V4-Flash's and V4.1-Flash's routed experts (top-6, bf16) at the tiers whose tiles take this form."""
    variants: dict[str, Variant] = {}
    for hidden, inter, top_k in AOT_SHAPES:
        if top_k != 6:
            continue
        for per_expert in AOT_SLOTS_PER_EXPERT:
            tiles = moe_mxfp4_config(arch, per_expert, hidden, inter, 2)
            if not tiles.dot_scaled:
                continue
            up, down = constexprs(tiles, hidden, inter, top_k, True, False)
            if which == 0:
                sig = {"x_ptr": "*bf16:D", "w13_ptr": "*u8:D", "s13_ptr": "*u8:D", "act_ptr": "*bf16:D",
                       "order_ptr": "*i32:D", "blocks_ptr": "*i32:D", "n_blocks": "i32", "limit": "fp32"}
                v = Variant(sig, up, tiles.tiles.up.num_warps, tiles.tiles.up.num_stages)
            else:
                sig = {"act_ptr": "*bf16:D", "w2_ptr": "*u8:D", "s2_ptr": "*u8:D", "weights_ptr": "*fp32:D",
                       "slot_out_ptr": "*bf16:D", "order_ptr": "*i32:D", "blocks_ptr": "*i32:D", "n_blocks": "i32"}
                v = Variant(sig, down, tiles.tiles.down.num_warps, tiles.tiles.down.num_stages)
            variants[repr((v.constexprs, v.num_warps, v.num_stages))] = v
    return list(variants.values())


UP_KERNEL = TritonKernel("moe_experts_mxfp4_scaled_up", _up_kernel, lambda arch: _aot_variants(arch, 0))
DOWN_KERNEL = TritonKernel("moe_experts_mxfp4_scaled_down", _down_kernel, lambda arch: _aot_variants(arch, 1))
