"""Routed MoE experts with MXFP4 weights (e2m1 packed two a byte, one e8m0 scale per 32 columns), dequantized in
the tile: ``moe_experts.py``'s routing plan, grouped GEMMs and combine, with the weight tiles read as stored.

Overrides core's ``moe_experts_mxfp4(x, ids, weights, w13, w13_scale, w2, w2_scale, swiglu_limit)``
(deepinfer/ops/quant_gemm.py).  SM90 has no FP4 tensor cores: each program loads [BLOCK_N, BLOCK_K / 2] tiles of
bytes and their [BLOCK_N, BLOCK_K / 32] e8m0 scales (one a group, never one a value) and decodes the nibbles by
bit placement: an e2m1 code's sign, exponent and mantissa bits put into an fp16's (bits 15, 10..11, 9) make its
value times 2^-14 exactly (codes 0 and 0.5 as fp16 subnormals, which the conversion to fp32 keeps), so a nibble
costs a few integer operations and one conversion.  The low nibble is the even column, the high one the odd
column: x is split into its even and odd columns instead of interleaving the weights.  Two forms
(``arch.moe_mxfp4_config``):

- decode below one slot per expert (``row_loop``): each program walks its block's slots one at a time and
  multiplies with FMAs in fp32; each 32-column group's sum is scaled once (``sum_k x_k v_k s = s sum_k x_k v_k``,
  exact for a power-of-two scale);
- otherwise ``moe_experts``' tl.dot tiles, the weights dequantized (value times scale, exact in bf16) and
  multiplied on the tensor cores, even and odd columns as two products.

Either way the weights are the reference's dequantized ones (an e2m1 value times a power of two is exact in bf16)
with fp32 accumulation, and the epilogues are ``moe_experts``' (the same roundings): the op conforms as
``moe_experts`` does.  The step reads a quarter of bf16's weight bytes (plus 1/32 for the scales).  Pointer loads,
or in the row loop (opt-in: ``arch.Mxfp4Tiles.tma``) TMA: descriptors over the packed weights viewed as [E * rows,
K / 2] bytes, read in [BLOCK_N, BLOCK_K / 2] tiles, the K loop pipelined ``num_stages`` deep (``tl.range``'s: Triton
pipelines no load of a loop without tl.dot otherwise).  The same bytes reach the same math: where the pointer loads
mask, a tile reads the next rows (never stored) or zeros past K.  The scales stay pointer loads (1/16 of the bytes).
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer import envs
from deepinfer_cuda.arch import (
    CudaArch,
    Mxfp4Tiles,
    moe_combine_config,
    moe_mxfp4_batch_invariant_config,
    moe_mxfp4_config,
)
from deepinfer_cuda.kernel_set.dispatch import Launch, LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels import fp8_e4m3_rows, moe_routing
from deepinfer_cuda.kernels import moe_experts_mxfp4_scaled as scaled
from deepinfer_cuda.kernels import moe_experts_mxfp4_tl as tilelang_form
from deepinfer_cuda.kernels import moe_experts_mxfp4_w4a8_tl as w4a8_form
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.kernels.moe_experts import (
    AOT_SHAPES,
    AOT_SLOTS_PER_EXPERT,
    COMBINE_KERNEL,
    _combine_constexprs,
    _rounded,
    _scaled_slots,
    _swiglu,
    program_block,
)
from deepinfer_cuda.kernels.moe_routing import plan
from deepinfer_cuda.override import override

#: The interpreter test turns this on (fp32 products, rounding by hand; see moe_experts.py).
INTERPRETED = False


@triton.jit
def _e2m1_halves(b):
    """fp32 values times 2^-14 of the low (even column) and high (odd column) e2m1 nibbles of bytes ``b``."""
    b = b.to(tl.int32)
    lo = ((b & 8) << 12) | ((b & 7) << 9)  # sign to bit 15, exponent and mantissa to bits 10..11 and 9
    hi = ((b & 0x80) << 8) | ((b & 0x70) << 5)
    return (lo.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32),
            hi.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32))


@triton.jit
def _group_scales(s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """[BLOCK_N, BLOCK_K / 32] fp32 scales of rows ``rows`` from column ``k0``, times 2^14 (undoing the decode's
    2^-14): e8m0 bytes [*, K / 32]."""
    ks = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    e = tl.load(s_ptr + rows[:, None] * (K // 32) + ks[None, :], mask=row_ok[:, None] & (ks < K // 32)[None, :],
                other=127).to(tl.int32)
    return (e << 23).to(tl.float32, bitcast=True) * 16384.0


@triton.jit
def _mxfp4_halves(w_ptr, s_ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                  dtype: tl.constexpr):
    """Weight rows ``rows`` [BLOCK_N] (int64), columns [k0, k0 + BLOCK_K), dequantized: the even and the odd
    columns, [BLOCK_N, BLOCK_K / 2] each in ``dtype``; ``w_ptr`` bytes [*, K / 2], ``s_ptr`` e8m0 bytes [*, K / 32]."""
    kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
    b = tl.load(w_ptr + rows[:, None] * (K // 2) + kb[None, :], mask=row_ok[:, None] & (kb < K // 2)[None, :],
                other=0)
    lo, hi = _e2m1_halves(b)
    scale = _group_scales(s_ptr, rows, row_ok, k0, K, BLOCK_K)[:, :, None]
    lo = tl.reshape(tl.reshape(lo, [BLOCK_N, BLOCK_K // 32, 16]) * scale, [BLOCK_N, BLOCK_K // 2])
    hi = tl.reshape(tl.reshape(hi, [BLOCK_N, BLOCK_K // 32, 16]) * scale, [BLOCK_N, BLOCK_K // 2])
    return lo.to(dtype), hi.to(dtype)  # exact: an e2m1 value times a power of two


@triton.jit
def _mxfp4_row_dot(w_ptr, s_ptr, rows, row_ok, k0, xe, xo, K: tl.constexpr, BLOCK_N: tl.constexpr,
                   BLOCK_K: tl.constexpr, row0, TMA_STAGES: tl.constexpr):
    """[BLOCK_N] fp32: weight rows ``rows`` over columns [k0, k0 + BLOCK_K) times one row of x, given as its even
    and odd columns ``xe``, ``xo`` [BLOCK_K / 2] fp32; each 32-column group summed, then scaled once.
    ``TMA_STAGES`` > 0: ``w_ptr`` is a descriptor of [BLOCK_N, BLOCK_K / 2] byte tiles, ``row0`` = ``rows[0]``."""
    if TMA_STAGES > 0:
        b = w_ptr.load([row0, k0 // 2])
    else:
        kb = k0 // 2 + tl.arange(0, BLOCK_K // 2)
        b = tl.load(w_ptr + rows[:, None] * (K // 2) + kb[None, :], mask=row_ok[:, None] & (kb < K // 2)[None, :],
                    other=0)
    lo, hi = _e2m1_halves(b)
    part = tl.sum(tl.reshape(lo * xe[None, :] + hi * xo[None, :], [BLOCK_N, BLOCK_K // 32, 16]), axis=2)
    return tl.sum(part * _group_scales(s_ptr, rows, row_ok, k0, K, BLOCK_K), axis=1)


@triton.jit
def _pairs(ptr, k0, K: tl.constexpr, BLOCK: tl.constexpr):
    """The even and the odd columns of ``ptr[k0 : k0 + BLOCK]`` (zeros past K), [BLOCK / 2] each."""
    ks = k0 + tl.arange(0, BLOCK)
    return tl.split(tl.reshape(tl.load(ptr + ks, mask=ks < K, other=0.0), [BLOCK // 2, 2]))


@triton.jit
def _pair_tiles(ptr, rows, row_ok, k0, K: tl.constexpr, BLOCK_K: tl.constexpr):
    """The even and the odd columns of rows ``rows`` of ``ptr`` [*, K], columns [k0, k0 + BLOCK_K)."""
    ks = k0 + tl.arange(0, BLOCK_K)
    a = tl.load(ptr + rows[:, None] * K + ks[None, :], mask=row_ok[:, None] & (ks < K)[None, :], other=0.0)
    return tl.split(tl.reshape(a, [a.shape[0], BLOCK_K // 2, 2]))


@triton.jit
def _dot(a, w, acc, FP32_DOT: tl.constexpr):
    """``acc + a @ w^T`` (w [N, K])."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
    return tl.dot(a, tl.trans(w), acc)


@triton.jit(do_not_specialize=["n_blocks", "limit"])
def _up_kernel(x_ptr, w13_ptr, s13_ptr, act_ptr, order_ptr, blocks_ptr, n_blocks, limit,
               H: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr,
               FP32_DOT: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               BLOCK_K: tl.constexpr, COLS_INNER: tl.constexpr, ROW_LOOP: tl.constexpr, TMA_STAGES: tl.constexpr):
    wait_for_producers()
    expert, start, end, col_tile = program_block(blocks_ptr, n_blocks, COLS_INNER)
    if start >= end:
        return
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    gate_rows = expert.to(tl.int64) * (2 * INTER) + cols
    gate_row0 = expert * (2 * INTER) + col_tile * BLOCK_N
    dtype = act_ptr.dtype.element_ty
    if ROW_LOOP:
        for r in range(start.to(tl.int64), end):  # one slot at a time (r: int64; a Python int interpreted)
            x_row = x_ptr + (tl.load(order_ptr + r) // TOPK).to(tl.int64) * H
            acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
            acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in tl.range(0, H, BLOCK_K, num_stages=TMA_STAGES if TMA_STAGES > 0 else None):
                xe, xo = _pairs(x_row, k0, H, BLOCK_K)
                xe, xo = xe.to(tl.float32), xo.to(tl.float32)
                acc_g += _mxfp4_row_dot(w13_ptr, s13_ptr, gate_rows, col_ok, k0, xe, xo, H, BLOCK_N, BLOCK_K,
                                        gate_row0, TMA_STAGES)
                acc_u += _mxfp4_row_dot(w13_ptr, s13_ptr, gate_rows + INTER, col_ok, k0, xe, xo, H, BLOCK_N, BLOCK_K,
                                        gate_row0 + INTER, TMA_STAGES)
            act = _swiglu(acc_g, acc_u, limit, dtype, HAS_LIMIT, INTERPRETED)
            tl.store(act_ptr + r * INTER + cols, act, mask=col_ok)
    else:
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        tokens = (tl.load(order_ptr + rows, mask=row_ok, other=0) // TOPK).to(tl.int64)
        acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            ae, ao = _pair_tiles(x_ptr, tokens, row_ok, k0, H, BLOCK_K)
            ge, go = _mxfp4_halves(w13_ptr, s13_ptr, gate_rows, col_ok, k0, H, BLOCK_N, BLOCK_K, dtype)
            ue, uo = _mxfp4_halves(w13_ptr, s13_ptr, gate_rows + INTER, col_ok, k0, H, BLOCK_N, BLOCK_K, dtype)
            acc_g = _dot(ao, go, _dot(ae, ge, acc_g, FP32_DOT), FP32_DOT)
            acc_u = _dot(ao, uo, _dot(ae, ue, acc_u, FP32_DOT), FP32_DOT)
        act = _swiglu(acc_g, acc_u, limit, dtype, HAS_LIMIT, INTERPRETED)
        tl.store(act_ptr + rows.to(tl.int64)[:, None] * INTER + cols[None, :], act,
                 mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["n_blocks"])
def _down_kernel(act_ptr, w2_ptr, s2_ptr, weights_ptr, slot_out_ptr, order_ptr, blocks_ptr, n_blocks,
                 H: tl.constexpr, INTER: tl.constexpr, FP32_DOT: tl.constexpr, INTERPRETED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COLS_INNER: tl.constexpr,
                 ROW_LOOP: tl.constexpr, TMA_STAGES: tl.constexpr):
    wait_for_producers()
    expert, start, end, col_tile = program_block(blocks_ptr, n_blocks, COLS_INNER)
    if start >= end:
        return
    cols = col_tile * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    w_rows = expert.to(tl.int64) * H + cols
    w_row0 = expert * H + col_tile * BLOCK_N
    dtype = slot_out_ptr.dtype.element_ty
    if ROW_LOOP:
        for r in range(start.to(tl.int64), end):
            slot = tl.load(order_ptr + r).to(tl.int64)
            acc = tl.zeros([BLOCK_N], dtype=tl.float32)
            for k0 in tl.range(0, INTER, BLOCK_K, num_stages=TMA_STAGES if TMA_STAGES > 0 else None):
                xe, xo = _pairs(act_ptr + r * INTER, k0, INTER, BLOCK_K)
                xe, xo = xe.to(tl.float32), xo.to(tl.float32)
                acc += _mxfp4_row_dot(w2_ptr, s2_ptr, w_rows, col_ok, k0, xe, xo, INTER, BLOCK_N, BLOCK_K, w_row0,
                                      TMA_STAGES)
            scale = tl.load(weights_ptr + slot)  # _scaled_slots' epilogue, for one slot
            y = _rounded(_rounded(acc, dtype, INTERPRETED) * scale, dtype, INTERPRETED).to(dtype)
            tl.store(slot_out_ptr + slot * H + cols, y, mask=col_ok)
    else:
        rows = start + tl.arange(0, BLOCK_M)
        row_ok = rows < end
        slots = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, INTER, BLOCK_K):
            ae, ao = _pair_tiles(act_ptr, rows.to(tl.int64), row_ok, k0, INTER, BLOCK_K)
            we, wo = _mxfp4_halves(w2_ptr, s2_ptr, w_rows, col_ok, k0, INTER, BLOCK_N, BLOCK_K, dtype)
            acc = _dot(ao, wo, _dot(ae, we, acc, FP32_DOT), FP32_DOT)
        y = _scaled_slots(acc, weights_ptr, slots, row_ok, dtype, INTERPRETED)
        tl.store(slot_out_ptr + slots[:, None] * H + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


def _constexprs(tiles: Mxfp4Tiles, hidden: int, inter: int, top_k: int, has_limit: bool, fp32: bool,
                interpreted: bool) -> tuple[dict[str, object], dict[str, object]]:
    t = tiles.tiles
    common: dict[str, object] = {"H": hidden, "INTER": inter, "FP32_DOT": fp32 or interpreted,
                                 "INTERPRETED": interpreted, "BLOCK_M": t.block_m, "COLS_INNER": t.cols_inner,
                                 "ROW_LOOP": tiles.row_loop}
    tma = tiles.tma and tiles.row_loop  # (K / 2 bytes a row: a multiple of 16, as prepare requires K % 32 == 0)
    up = {**common, "TOPK": top_k, "HAS_LIMIT": has_limit, "BLOCK_N": t.up_block_n, "BLOCK_K": t.up_block_k,
          "TMA_STAGES": t.up.num_stages if tma and t.up_block_k >= 32 else 0}
    down = {**common, "BLOCK_N": t.down_block_n, "BLOCK_K": t.down_block_k,
            "TMA_STAGES": t.down.num_stages if tma and t.down_block_k >= 32 else 0}
    return up, down


def _weight_block(const: dict[str, object]) -> list[int]:
    """The [rows, bytes] weight tile a TMA launch reads a step."""
    rows, cols = const["BLOCK_N"], const["BLOCK_K"]
    assert isinstance(rows, int) and isinstance(cols, int)
    return [rows, cols // 2]


def _weight_type(const: dict[str, object]) -> str:
    """The AOT signature of a kernel's packed weight: bytes, or a descriptor of [BLOCK_N, BLOCK_K / 2] tiles."""
    return "tensordesc<u8[{}, {}]>".format(*_weight_block(const)) if const["TMA_STAGES"] else "*u8:D"


def _weight_arg(w: torch.Tensor, const: dict[str, object]) -> torch.Tensor | TensorDescriptor:
    """A kernel's packed weight [E, rows, K / 2] as bytes, or (TMA) a descriptor over [E * rows, K / 2]."""
    b = _bytes(w)
    return TensorDescriptor.from_tensor(b.view(-1, b.shape[-1]), _weight_block(const)) if const.get("TMA_STAGES") else b


def _aot_variants(arch: CudaArch, which: int) -> list[Variant]:
    variants = []
    for hidden, inter, top_k in AOT_SHAPES:
        if top_k != 6:  # MXFP4 runs the routed experts only (the shared expert is FP8, its own MLP)
            continue
        for tiles in [moe_mxfp4_config(arch, per_expert, hidden, inter, 2) for per_expert in AOT_SLOTS_PER_EXPERT]:
            if tiles.dot_scaled:  # moe_experts_mxfp4_scaled.py's kernels
                continue
            consts = _constexprs(tiles, hidden, inter, top_k, True, False, False)
            if which == 0:
                sig = {"x_ptr": "*bf16:D", "w13_ptr": _weight_type(consts[0]), "s13_ptr": "*u8:D", "act_ptr": "*bf16:D",
                       "order_ptr": "*i32:D", "blocks_ptr": "*i32:D", "n_blocks": "i32", "limit": "fp32"}
                variants.append(Variant(sig, consts[0], tiles.tiles.up.num_warps, tiles.tiles.up.num_stages))
            else:
                sig = {"act_ptr": "*bf16:D", "w2_ptr": _weight_type(consts[1]), "s2_ptr": "*u8:D",
                       "weights_ptr": "*fp32:D", "slot_out_ptr": "*bf16:D",
                       "order_ptr": "*i32:D", "blocks_ptr": "*i32:D", "n_blocks": "i32"}
                variants.append(Variant(sig, consts[1], tiles.tiles.down.num_warps, tiles.tiles.down.num_stages))
    return variants


UP_KERNEL = TritonKernel("moe_experts_mxfp4_up", _up_kernel, lambda arch: _aot_variants(arch, 0))
DOWN_KERNEL = TritonKernel("moe_experts_mxfp4_down", _down_kernel, lambda arch: _aot_variants(arch, 1))
KERNEL = UP_KERNEL


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def prepare(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
            w2: torch.Tensor, w2_scale: torch.Tensor, swiglu_limit: float | None, *, arch: CudaArch,
            tiles: Mxfp4Tiles | None = None) -> LaunchChain:
    """Plan the op: the routing plan, the two GEMMs over packed weights, the combine (``tiles``: fixed ones, or a
    tuning run's: the kernel set holds ``arch.moe_mxfp4_config``'s)."""
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
        tiles = moe_mxfp4_config(arch, slots // max(1, num_experts), hidden, inter, x.element_size())
    x, ids = x.contiguous(), ids.contiguous()
    if tiles.tma and (_bytes(w13).data_ptr() % 16 or _bytes(w2).data_ptr() % 16):  # a descriptor's base: 16-aligned
        tiles = dataclasses.replace(tiles, tma=False)
    order, blocks, plan_steps = plan(ids, num_experts, tiles.tiles.block_m, arch=arch)
    n_blocks = blocks.shape[1]
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    slot_out = torch.empty(slots, hidden, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    scale = weights.reshape(-1).to(torch.float32).contiguous()
    if tiles.dot_scaled:
        up_c, down_c = scaled.constexprs(tiles, hidden, inter, top_k, swiglu_limit is not None, INTERPRETED)
        up_kernel, down_kernel = scaled.UP_KERNEL, scaled.DOWN_KERNEL
    else:
        up_c, down_c = _constexprs(tiles, hidden, inter, top_k, swiglu_limit is not None, x.dtype == torch.float32,
                                   INTERPRETED)
        up_kernel, down_kernel = UP_KERNEL, DOWN_KERNEL

    t = tiles.tiles

    def grid(cols: int) -> tuple[int, int]:
        return (cols, n_blocks) if t.cols_inner else (n_blocks, cols)

    up = Launch(grid(triton.cdiv(inter, t.up_block_n)), t.up,
                dict(x_ptr=x, w13_ptr=_weight_arg(w13, up_c), s13_ptr=_bytes(w13_scale), act_ptr=act, order_ptr=order,
                     blocks_ptr=blocks, n_blocks=n_blocks, limit=float(swiglu_limit or 0.0), **up_c), act)
    down = Launch(grid(triton.cdiv(hidden, t.down_block_n)), t.down,
                  dict(act_ptr=act, w2_ptr=_weight_arg(w2, down_c), s2_ptr=_bytes(w2_scale), weights_ptr=scale,
                       slot_out_ptr=slot_out, order_ptr=order, blocks_ptr=blocks, n_blocks=n_blocks, **down_c),
                  slot_out)
    config, block_h = moe_combine_config(arch, hidden)
    combine_c = {**_combine_constexprs(hidden, top_k, block_h), "INTERPRETED": INTERPRETED}
    combine = Launch((tokens, triton.cdiv(hidden, block_h)), config,
                     dict(slot_out_ptr=slot_out, ids_ptr=ids, out_ptr=out, **combine_c), out)
    steps = plan_steps + [(up_kernel, up), (down_kernel, down), (COMBINE_KERNEL, combine)]
    return LaunchChain(steps, lambda: out)


def moe_experts_mxfp4_fixed_tiles(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                                  w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                                  swiglu_limit: float | None) -> torch.Tensor:
    """:func:`moe_experts_mxfp4` with one tile configuration for every batch (as ``moe_experts_fixed_tiles``)."""
    index, arch = cuda_target(x)
    tiles = moe_mxfp4_batch_invariant_config(arch, x.shape[1], w13.shape[1] // 2, x.element_size())
    return prepare(x, ids, weights, w13, w13_scale, w2, w2_scale, swiglu_limit, arch=arch, tiles=tiles).run(index)


@override("moe_experts_mxfp4", batch_invariant=moe_experts_mxfp4_fixed_tiles,
          aot=(*moe_routing.KERNELS, UP_KERNEL, DOWN_KERNEL, scaled.UP_KERNEL, scaled.DOWN_KERNEL, COMBINE_KERNEL,
               tilelang_form.UP_KERNEL, tilelang_form.DOWN_KERNEL, fp8_e4m3_rows.KERNEL, w4a8_form.UP_KERNEL,
               w4a8_form.DOWN_KERNEL))
def moe_experts_mxfp4(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                      w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor,
                      swiglu_limit: float | None) -> torch.Tensor:
    """Routed experts [T, H]: x [T, H]; ids [T, k]; weights [T, k] fp32; w13 [E, 2I, H/2] + scales [E, 2I, H/32];
    w2 [E, H, I/2] + scales [E, H, I/32]."""
    index, arch = cuda_target(x)
    chain = None
    if envs.mxfp4_activations() == "fp8":  # opt-in W4A8; the exact forms where it has no tiles
        chain = w4a8_form.prepare(x, ids, weights, w13, w13_scale, w2, w2_scale, swiglu_limit, arch=arch)
    if chain is None:
        chain = tilelang_form.prepare(x, ids, weights, w13, w13_scale, w2, w2_scale, swiglu_limit, arch=arch)
    if chain is None:  # the arch table keeps Triton here, or the kernel set has no TileLang cubins
        chain = prepare(x, ids, weights, w13, w13_scale, w2, w2_scale, swiglu_limit, arch=arch)
    return chain.run(index)
