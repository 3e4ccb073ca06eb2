"""Routed MoE experts with FP8 e4m3 weights and one scale per ``block_n x block_k`` block of each expert's matrix
(DeepSeek V3 / V4's FP8 experts: 128 x 128, ue8m0 or fp32 scales), dequantized in the tile.

Overrides core's ``moe_experts_fp8(x, ids, weights, w13, w13_scale, w2, w2_scale, block_n, block_k, swiglu_limit)``
(deepinfer/ops/quant_gemm.py) with ``moe_experts.py``'s routing plan, grouped GEMMs, epilogues and combine; only the
weight tiles differ.  Each program reads [BLOCK_N, BLOCK_K] tiles of code bytes by TMA (descriptors over ``w13`` /
``w2`` viewed as [E * rows, K] bytes: half bf16's bytes, the decode step's roofline term), decodes them to fp32,
multiplies each weight by its block's scale and rounds to the activation dtype before ``tl.dot``: exactly the
reference's dequantized weight (``code * scale`` formed in fp32, rounded once), so with fp32 accumulation the op
conforms as ``moe_experts`` does, and no activation is quantized.  The scales are pointer loads, one per (row,
scale block) the tile touches: one per row when a scale block spans the tile's columns (BLOCK_K <= block_k),
``BLOCK_K / block_k`` per row when the tile spans whole blocks, and (blocks that tile neither way, tests only)
one per weight.

Where the bf16 kernel's tile reads rows past an expert's (a column tile past I or H), the scales of those rows are
masked (their columns are never stored); past K the descriptor reads zero codes.  Under the CPU interpreter
(``INTERPRETED``) the codes are decoded with integer arithmetic (``fp8_block_linear``'s ``_code_values``) and the
products taken in fp32, as the other kernels do there.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer.ops.quant import scale_values
from deepinfer_cuda.arch import CudaArch, MoeTiles, moe_combine_config, moe_fp8_batch_invariant_config, moe_fp8_config
from deepinfer_cuda.kernel_set.dispatch import Launch, LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels import moe_routing
from deepinfer_cuda.kernels.fp8_block_linear import _code_values, _weight_scale
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.kernels.moe_experts import (
    AOT_SHAPES,
    AOT_SLOTS_PER_EXPERT,
    COMBINE_KERNEL,
    _combine_constexprs,
    _scaled_slots,
    _swiglu,
    program_block,
)
from deepinfer_cuda.kernels.moe_routing import plan
from deepinfer_cuda.kernels.split_k_sum import to_dtype
from deepinfer_cuda.override import override

#: The interpreter test turns this on (integer decoding of the codes, fp32 products, rounding by hand).
INTERPRETED = False
#: Scale blocks compiled ahead of time: the released FP8 experts' 128 x 128, with ue8m0 or fp32 scales.
AOT_BLOCKS = ((128, 128),)
AOT_SCALES = ("*u8:D", "*fp32:D")


@triton.jit
def _fp8_tile(w_desc, s_ptr, expert, row0, local_rows, row_ok, k0, N: tl.constexpr, K: tl.constexpr,
              BN_Q: tl.constexpr, BK_Q: tl.constexpr, SCALE_E8M0: tl.constexpr, dtype: tl.constexpr,
              INTERPRETED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The weight tile [BLOCK_K, BLOCK_N] (transposed for tl.dot) of descriptor rows ``row0..`` (an expert's rows
    ``local_rows`` of its N; ``row_ok``: rows of this expert whose scales are read), columns ``k0..``, dequantized
    to ``dtype``: code * scale in fp32, rounded once.  ``s_ptr``: scales [E, ceil(N / BN_Q), ceil(K / BK_Q)]."""
    v = _code_values(w_desc.load([row0, k0]), INTERPRETED)  # [BLOCK_N, BLOCK_K] fp32
    KB: tl.constexpr = (K + BK_Q - 1) // BK_Q
    s_rows = (expert.to(tl.int64) * ((N + BN_Q - 1) // BN_Q) + local_rows // BN_Q) * KB  # [BLOCK_N]
    if BK_Q % BLOCK_K == 0:  # one scale block spans the tile's columns: a scale a row
        w = v * _weight_scale(s_ptr, s_rows + k0 // BK_Q, row_ok, SCALE_E8M0)[:, None]
    elif BLOCK_K % BK_Q == 0:  # whole scale blocks: BLOCK_K / BK_Q scales a row, each over its BK_Q columns
        kg = k0 // BK_Q + tl.arange(0, BLOCK_K // BK_Q)
        s = _weight_scale(s_ptr, s_rows[:, None] + kg[None, :], row_ok[:, None] & (kg < KB)[None, :], SCALE_E8M0)
        w = tl.reshape(tl.reshape(v, [BLOCK_N, BLOCK_K // BK_Q, BK_Q]) * s[:, :, None], [BLOCK_N, BLOCK_K])
    else:  # a block that tiles neither way: each weight's scale
        ks = k0 + tl.arange(0, BLOCK_K)
        w = v * _weight_scale(s_ptr, s_rows[:, None] + (ks // BK_Q)[None, :], row_ok[:, None] & (ks < K)[None, :],
                              SCALE_E8M0)
    return to_dtype(w, dtype, INTERPRETED).T


@triton.jit
def _dot(a, w, acc, FP32_DOT: tl.constexpr):
    """``acc + a @ w`` (w [K, N]); IEEE fp32 products for fp32 inputs and under the interpreter."""
    if FP32_DOT:
        return tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit(do_not_specialize=["n_blocks", "limit"])
def _up_kernel(x_ptr, w13_desc, s13_ptr, act_ptr, order_ptr, blocks_ptr, n_blocks, limit,
               H: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr,
               BN_Q: tl.constexpr, BK_Q: tl.constexpr, SCALE_E8M0: tl.constexpr,
               FP32_DOT: tl.constexpr, INTERPRETED: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COLS_INNER: tl.constexpr):
    wait_for_producers()
    expert, start, end, col_tile = program_block(blocks_ptr, n_blocks, COLS_INNER)
    if start >= end:  # past the last block of the batch: no slots
        return
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    tokens = (tl.load(order_ptr + rows, mask=row_ok, other=0) // TOPK).to(tl.int64)
    col0 = col_tile * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    col_ok = cols < INTER
    gate_row = expert * (2 * INTER) + col0  # w13 as [E * 2I, H] bytes (as in moe_experts' up kernel)
    dtype = act_ptr.dtype.element_ty
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + tokens[:, None] * H + ks[None, :], mask=row_ok[:, None] & (ks < H)[None, :], other=0.0)
        wg = _fp8_tile(w13_desc, s13_ptr, expert, gate_row, cols, col_ok, k0, 2 * INTER, H, BN_Q, BK_Q, SCALE_E8M0,
                       dtype, INTERPRETED, BLOCK_N, BLOCK_K)
        wu = _fp8_tile(w13_desc, s13_ptr, expert, gate_row + INTER, INTER + cols, col_ok, k0, 2 * INTER, H, BN_Q,
                       BK_Q, SCALE_E8M0, dtype, INTERPRETED, BLOCK_N, BLOCK_K)
        acc_g = _dot(a, wg, acc_g, FP32_DOT)
        acc_u = _dot(a, wu, acc_u, FP32_DOT)
    act = _swiglu(acc_g, acc_u, limit, dtype, HAS_LIMIT, INTERPRETED)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * INTER + cols[None, :], act, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["n_blocks"])
def _down_kernel(act_ptr, w2_desc, s2_ptr, weights_ptr, slot_out_ptr, order_ptr, blocks_ptr, n_blocks,
                 H: tl.constexpr, INTER: tl.constexpr, BN_Q: tl.constexpr, BK_Q: tl.constexpr,
                 SCALE_E8M0: tl.constexpr, FP32_DOT: tl.constexpr, INTERPRETED: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, COLS_INNER: tl.constexpr):
    wait_for_producers()
    expert, start, end, col_tile = program_block(blocks_ptr, n_blocks, COLS_INNER)
    if start >= end:
        return
    rows = start + tl.arange(0, BLOCK_M)
    row_ok = rows < end
    slots = tl.load(order_ptr + rows, mask=row_ok, other=0).to(tl.int64)
    col0 = col_tile * BLOCK_N
    cols = col0 + tl.arange(0, BLOCK_N)
    col_ok = cols < H
    w_row = expert * H + col0  # w2 as [E * H, I] bytes
    dtype = slot_out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + rows.to(tl.int64)[:, None] * INTER + ks[None, :],
                    mask=row_ok[:, None] & (ks < INTER)[None, :], other=0.0)
        w = _fp8_tile(w2_desc, s2_ptr, expert, w_row, cols, col_ok, k0, H, INTER, BN_Q, BK_Q, SCALE_E8M0, dtype,
                      INTERPRETED, BLOCK_N, BLOCK_K)
        acc = _dot(a, w, acc, FP32_DOT)
    y = _scaled_slots(acc, weights_ptr, slots, row_ok, dtype, INTERPRETED)
    tl.store(slot_out_ptr + slots[:, None] * H + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


def _constexprs(tiles: MoeTiles, hidden: int, inter: int, top_k: int, has_limit: bool, fp32: bool,
                block: tuple[int, int], e8m0: bool) -> tuple[dict[str, object], dict[str, object]]:
    common: dict[str, object] = {"H": hidden, "INTER": inter, "BN_Q": block[0], "BK_Q": block[1],
                                 "SCALE_E8M0": e8m0, "FP32_DOT": fp32 or INTERPRETED, "INTERPRETED": INTERPRETED,
                                 "BLOCK_M": tiles.block_m, "COLS_INNER": tiles.cols_inner}
    up = {**common, "TOPK": top_k, "HAS_LIMIT": has_limit, "BLOCK_N": tiles.up_block_n,
          "BLOCK_K": tiles.up_block_k}
    down = {**common, "BLOCK_N": tiles.down_block_n, "BLOCK_K": tiles.down_block_k}
    return up, down


def _desc_type(block_n: int, block_k: int) -> str:
    """The AOT signature of a code-byte weight descriptor read in [block_n, block_k] tiles."""
    return f"tensordesc<u8[{block_n}, {block_k}]>"


def _aot_variants(arch: CudaArch, which: int) -> list[Variant]:
    variants = []
    for hidden, inter, top_k in AOT_SHAPES:
        if top_k != 6:  # FP8 experts run the routed experts only (the shared expert is its own MLP)
            continue
        for per_expert in AOT_SLOTS_PER_EXPERT:
            tiles = moe_fp8_config(arch, per_expert, hidden, inter)
            for block in AOT_BLOCKS:
                for scale in AOT_SCALES:
                    up, down = _constexprs(tiles, hidden, inter, top_k, True, False, block, scale == "*u8:D")
                    if which == 0:
                        sig = {"x_ptr": "*bf16:D", "w13_desc": _desc_type(tiles.up_block_n, tiles.up_block_k),
                               "s13_ptr": scale, "act_ptr": "*bf16:D", "order_ptr": "*i32:D",
                               "blocks_ptr": "*i32:D", "n_blocks": "i32", "limit": "fp32"}
                        variants.append(Variant(sig, up, tiles.up.num_warps, tiles.up.num_stages))
                    else:
                        sig = {"act_ptr": "*bf16:D", "w2_desc": _desc_type(tiles.down_block_n, tiles.down_block_k),
                               "s2_ptr": scale, "weights_ptr": "*fp32:D", "slot_out_ptr": "*bf16:D",
                               "order_ptr": "*i32:D", "blocks_ptr": "*i32:D", "n_blocks": "i32"}
                        variants.append(Variant(sig, down, tiles.down.num_warps, tiles.down.num_stages))
    return variants


UP_KERNEL = TritonKernel("moe_experts_fp8_up", _up_kernel, lambda arch: _aot_variants(arch, 0))
DOWN_KERNEL = TritonKernel("moe_experts_fp8_down", _down_kernel, lambda arch: _aot_variants(arch, 1))
KERNEL = UP_KERNEL  # the module's GEMM kernel (the interpreter test runs every step of the chain)


def _codes(w: torch.Tensor) -> torch.Tensor:
    """Experts' code bytes [E, rows, K], 16-byte aligned (a TMA descriptor's base)."""
    b = w.contiguous().view(torch.uint8)
    return b.clone() if b.data_ptr() % 16 else b


def _weight_desc(codes: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """A TMA descriptor of code bytes [E, N, K] as [E * N, K], read in [block_n, block_k] tiles."""
    return TensorDescriptor.from_tensor(codes.view(-1, codes.shape[-1]), [block_n, block_k])


def _scales(s13: torch.Tensor, s2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(both scales as the kernels read them, whether they are e8m0 bytes): e8m0 as its bytes when both are, else
    both as fp32 values."""
    e8m0 = (torch.uint8, torch.float8_e8m0fnu)
    if s13.dtype in e8m0 and s2.dtype in e8m0:
        return s13.contiguous().view(torch.uint8), s2.contiguous().view(torch.uint8), True
    return scale_values(s13).contiguous(), scale_values(s2).contiguous(), False


def prepare(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
            w2: torch.Tensor, w2_scale: torch.Tensor, block_n: int, block_k: int, swiglu_limit: float | None, *,
            arch: CudaArch, tiles: MoeTiles | None = None) -> LaunchChain:
    """Plan ``moe_experts_fp8(...)`` for ``arch``: the routing plan, the two GEMMs over code bytes, the combine
    (``tiles``: fixed ones, or a tuning run's: the kernel set holds ``arch.moe_fp8_config``'s)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    if hidden % 16 or inter % 16:  # a descriptor's rows: whole 16-byte units
        raise ValueError(f"moe_experts_fp8: hidden ({hidden}) and intermediate ({inter}) must be multiples of 16")
    slots = tokens * top_k
    if slots == 0:
        return LaunchChain([], lambda: torch.zeros_like(x))
    if tiles is None:
        tiles = moe_fp8_config(arch, slots // max(1, num_experts), hidden, inter, x.element_size())
    x, ids = x.contiguous(), ids.contiguous()
    codes13, codes2 = _codes(w13), _codes(w2)
    s13, s2, e8m0 = _scales(w13_scale, w2_scale)
    order, blocks, plan_steps = plan(ids, num_experts, tiles.block_m, arch=arch)
    n_blocks = blocks.shape[1]
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    slot_out = torch.empty(slots, hidden, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    scale = weights.reshape(-1).to(torch.float32).contiguous()
    up_c, down_c = _constexprs(tiles, hidden, inter, top_k, swiglu_limit is not None, x.dtype == torch.float32,
                               (block_n, block_k), e8m0)

    def grid(cols: int) -> tuple[int, int]:
        return (cols, n_blocks) if tiles.cols_inner else (n_blocks, cols)

    up = Launch(grid(triton.cdiv(inter, tiles.up_block_n)), tiles.up,
                dict(x_ptr=x, w13_desc=_weight_desc(codes13, tiles.up_block_n, tiles.up_block_k), s13_ptr=s13,
                     act_ptr=act, order_ptr=order, blocks_ptr=blocks, n_blocks=n_blocks,
                     limit=float(swiglu_limit or 0.0), **up_c), act)
    down = Launch(grid(triton.cdiv(hidden, tiles.down_block_n)), tiles.down,
                  dict(act_ptr=act, w2_desc=_weight_desc(codes2, tiles.down_block_n, tiles.down_block_k),
                       s2_ptr=s2, weights_ptr=scale, slot_out_ptr=slot_out, order_ptr=order, blocks_ptr=blocks,
                       n_blocks=n_blocks, **down_c), slot_out)
    config, block_h = moe_combine_config(arch, hidden)
    combine_c = {**_combine_constexprs(hidden, top_k, block_h), "INTERPRETED": INTERPRETED}
    combine = Launch((tokens, triton.cdiv(hidden, block_h)), config,
                     dict(slot_out_ptr=slot_out, ids_ptr=ids, out_ptr=out, **combine_c), out)
    steps = plan_steps + [(UP_KERNEL, up), (DOWN_KERNEL, down), (COMBINE_KERNEL, combine)]
    return LaunchChain(steps, lambda: out)


def moe_experts_fp8_fixed_tiles(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                                w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, block_n: int,
                                block_k: int, swiglu_limit: float | None) -> torch.Tensor:
    """:func:`moe_experts_fp8` with one tile configuration for every batch (as ``moe_experts_fixed_tiles``)."""
    index, arch = cuda_target(x)
    tiles = moe_fp8_batch_invariant_config(arch, x.shape[1], w13.shape[1] // 2, x.element_size())
    return prepare(x, ids, weights, w13, w13_scale, w2, w2_scale, block_n, block_k, swiglu_limit, arch=arch,
                   tiles=tiles).run(index)


@override("moe_experts_fp8", batch_invariant=moe_experts_fp8_fixed_tiles,
          aot=(*moe_routing.KERNELS, UP_KERNEL, DOWN_KERNEL, COMBINE_KERNEL))
def moe_experts_fp8(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                    w13_scale: torch.Tensor, w2: torch.Tensor, w2_scale: torch.Tensor, block_n: int, block_k: int,
                    swiglu_limit: float | None) -> torch.Tensor:
    """Routed experts [T, H]: x [T, H]; ids [T, k]; weights [T, k] fp32; w13 [E, 2I, H] e4m3 + scales
    [E, 2I/bn, H/bk]; w2 [E, H, I] e4m3 + scales [E, H/bn, I/bk] (ceilings)."""
    index, arch = cuda_target(x)
    return prepare(x, ids, weights, w13, w13_scale, w2, w2_scale, block_n, block_k, swiglu_limit,
                   arch=arch).run(index)
