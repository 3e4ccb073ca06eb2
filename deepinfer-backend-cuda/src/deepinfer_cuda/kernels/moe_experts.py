"""Routed MoE experts as two grouped GEMMs over token slots sorted by expert, clamped SwiGLU fused into the first.

Overrides core's ``moe_experts(x, ids, weights, w13, w2, swiglu_limit)`` (deepinfer/ops/moe.py).  The reference
loops over the experts a batch hits in Python (a host sync per expert to find its rows, ~10 kernels each);
here the routing is sorted on the device and every expert's tokens run in two launches, with no host sync:

    plan (moe_routing.py)         the T*k slots sorted by expert, cut into blocks of BLOCK_M slots of one expert
    _moe_up_kernel                per (block, column tile): [g; u] = x[tokens] @ w13[e]^T, act = silu(min(g, L)) *
                                  clamp(u)
    _moe_down_kernel              per (block, column tile): y = act @ w2[e]^T, scaled by the slot's routing weight
    _moe_combine_kernel           per (token, column tile): out[t] = its k slot outputs added in increasing expert id

Decode is four launches (the plan is one Triton program up to 1024 slots; above, three chunked programs'
launches, so prefill is six), so neither a CUDA graph of a step nor a prefill pays tiny torch kernels for the
routing or the k-way sum.

Each program streams one column tile of one expert's weights once for up to BLOCK_M tokens, so decode reads
each hit expert's weights once (memory-bound, the roofline's term) and prefill runs tensor-core tiles.  The
weight tiles come by TMA (host-side descriptors over ``w13`` / ``w2`` viewed as [E * N, K]): at decode that
took the up GEMM from ~76% to ~94% of the copy ceiling; the gathered token rows stay pointer loads.
Rounding follows the reference: the projections, the activation and the weighted output are rounded to the
model dtype where the reference's tensors are, and each token's k outputs are added in the reference's order
(increasing expert id, in the model dtype), so a row depends only on its own token and experts.  fp32 inputs
(tests, fp32 oracle runs) multiply with IEEE fp32 products, not TF32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

from deepinfer_cuda.arch import CudaArch, MoeTiles, moe_batch_invariant_config, moe_combine_config, moe_experts_config
from deepinfer_cuda.kernel_set.dispatch import Launch, LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels import moe_routing
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.kernels.moe_routing import expert_blocks, plan  # noqa: F401  (expert_blocks: re-exported)
from deepinfer_cuda.override import override

#: (hidden, intermediate, top-k) compiled ahead of time: V4-Flash (4096, 2048) and V4.1-Flash (5120, 2304) at top-6,
#: and at top-7: the V4 model runs its shared expert as one more slot per token; V4.1-Flash's DSpark drafter at top-3.
AOT_SHAPES = ((4096, 2048, 6), (5120, 2304, 6), (4096, 2048, 7), (5120, 2304, 7), (5120, 2304, 3))
#: Work around Triton's CPU interpreter, which computes bf16 ``tl.dot`` wrongly and truncates fp32 -> bf16: multiply
#: in fp32 (bf16 products are exact in fp32) and round to bf16 to nearest-even explicitly.  The same function as
#: the GPU path; off on the GPU, turned on by the interpreter test.
INTERPRETED = False
#: Mean slots per expert compiled ahead of time: the three tiers of arch.moe_experts_config (decode below one slot
#: per expert, decode, prefill).
AOT_SLOTS_PER_EXPERT = (0, 1, 96)


@triton.jit
def _rounded(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """``v`` (fp32) rounded to ``dtype`` and back: where the reference holds a tensor in the model dtype."""
    if INTERPRETED and dtype == tl.bfloat16:  # round to nearest even by hand: the interpreter's cast truncates
        bits = v.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return bits.to(tl.float32, bitcast=True)
    return v.to(dtype).to(tl.float32)


@triton.jit
def _swiglu(acc_g, acc_u, limit, dtype: tl.constexpr, HAS_LIMIT: tl.constexpr, INTERPRETED: tl.constexpr):
    """The up GEMM's epilogue: ``silu(min(g, L)) * clamp(u, -L, L)`` in ``dtype``, rounded where the reference
    rounds (its projection output, SiLU and product are in the model dtype)."""
    g = _rounded(acc_g, dtype, INTERPRETED)
    u = _rounded(acc_u, dtype, INTERPRETED)
    if HAS_LIMIT:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
    silu = _rounded(g / (1.0 + tl.exp(-g)), dtype, INTERPRETED)
    return _rounded(silu * u, dtype, INTERPRETED).to(dtype)


@triton.jit
def _scaled_slots(acc, weights_ptr, slots, row_ok, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """The down GEMM's epilogue: the slot's output in ``dtype`` times its fp32 routing weight, in ``dtype``."""
    scale = tl.load(weights_ptr + slots, mask=row_ok, other=0.0)
    return _rounded(_rounded(acc, dtype, INTERPRETED) * scale[:, None], dtype, INTERPRETED).to(dtype)


@triton.jit
def program_block(blocks_ptr, n_blocks, COLS_INNER: tl.constexpr):
    """(expert, first sorted slot, end, column tile) of this program's plan block (``first == end``: an unused block
    past the batch's last, whose program returns at once).  The expert GEMMs' grids are (blocks, column tiles), or
    (column tiles, blocks) when ``COLS_INNER``."""
    block = tl.program_id(1 if COLS_INNER else 0)
    start = tl.load(blocks_ptr + n_blocks + block)
    end = tl.load(blocks_ptr + 2 * n_blocks + block)
    expert = tl.load(blocks_ptr + block)
    return expert, start, end, tl.program_id(0 if COLS_INNER else 1)


@triton.jit(do_not_specialize=["n_blocks", "limit"])
def _moe_up_kernel(x_ptr, w13_desc, act_ptr, order_ptr, blocks_ptr, n_blocks, limit,
                   H: tl.constexpr, INTER: tl.constexpr, TOPK: tl.constexpr, HAS_LIMIT: tl.constexpr,
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
    gate_row = expert * (2 * INTER) + col0  # w13 as [E * 2I, H]: a tile past INTER reads the next rows, whose columns
    up_row = gate_row + INTER  # are never stored; past H (and the tensor's end) the TMA box reads zeros
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(x_ptr + tokens[:, None] * H + ks[None, :], mask=row_ok[:, None] & (ks < H)[None, :], other=0.0)
        wg = w13_desc.load([gate_row, k0]).T  # [BLOCK_K, BLOCK_N]
        wu = w13_desc.load([up_row, k0]).T
        if FP32_DOT:
            acc_g = tl.dot(a.to(tl.float32), wg.to(tl.float32), acc_g, input_precision="ieee")
            acc_u = tl.dot(a.to(tl.float32), wu.to(tl.float32), acc_u, input_precision="ieee")
        else:
            acc_g = tl.dot(a, wg, acc_g)
            acc_u = tl.dot(a, wu, acc_u)
    act = _swiglu(acc_g, acc_u, limit, act_ptr.dtype.element_ty, HAS_LIMIT, INTERPRETED)
    tl.store(act_ptr + rows.to(tl.int64)[:, None] * INTER + cols[None, :], act, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["n_blocks"])
def _moe_down_kernel(act_ptr, w2_desc, weights_ptr, slot_out_ptr, order_ptr, blocks_ptr, n_blocks,
                     H: tl.constexpr, INTER: tl.constexpr, FP32_DOT: tl.constexpr, INTERPRETED: tl.constexpr,
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
    w_row = expert * H + col0  # w2 as [E * H, I] (as in the up kernel: rows past H are never stored)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, INTER, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        a = tl.load(act_ptr + rows.to(tl.int64)[:, None] * INTER + ks[None, :],
                    mask=row_ok[:, None] & (ks < INTER)[None, :],
                    other=0.0)
        w = w2_desc.load([w_row, k0]).T  # [BLOCK_K, BLOCK_N]
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), w.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, w, acc)
    y = _scaled_slots(acc, weights_ptr, slots, row_ok, slot_out_ptr.dtype.element_ty, INTERPRETED)
    tl.store(slot_out_ptr + slots[:, None] * H + cols[None, :], y, mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _moe_combine_kernel(slot_out_ptr, ids_ptr, out_ptr, H: tl.constexpr, TOPK: tl.constexpr,
                        TOPK_PAD: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_H: tl.constexpr):
    wait_for_producers()
    token = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    col_ok = cols < H
    j = tl.arange(0, TOPK_PAD)
    j_ok = j < TOPK
    expert = tl.load(ids_ptr + token * TOPK + j, mask=j_ok, other=0)
    # rank of slot j by (expert, j): the reference adds a token's outputs in increasing expert id, a repeated
    # expert's slots in slot order
    before = (expert[:, None] < expert[None, :]) | ((expert[:, None] == expert[None, :]) & (j[:, None] < j[None, :]))
    rank = tl.sum((before & j_ok[:, None]).to(tl.int32), axis=0)
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)  # the reference adds into zeros, in the model dtype
    for r in tl.static_range(TOPK):
        slot = tl.sum(tl.where((rank == r) & j_ok, j, 0), axis=0)
        y = tl.load(slot_out_ptr + (token * TOPK + slot) * H + cols, mask=col_ok, other=0.0)
        acc = _rounded(acc + y.to(tl.float32), dtype, INTERPRETED)
    tl.store(out_ptr + token * H + cols, acc.to(dtype), mask=col_ok)


def _constexprs(tiles: MoeTiles, hidden: int, inter: int, top_k: int, has_limit: bool, fp32: bool):
    fp32_dot = fp32 or INTERPRETED  # fp32: IEEE products (no TF32), as the reference computes them
    up = {"H": hidden, "INTER": inter, "TOPK": top_k, "HAS_LIMIT": has_limit, "FP32_DOT": fp32_dot,
          "INTERPRETED": INTERPRETED,
          "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.up_block_n, "BLOCK_K": tiles.up_block_k,
          "COLS_INNER": tiles.cols_inner}
    down = {"H": hidden, "INTER": inter, "FP32_DOT": fp32_dot, "INTERPRETED": INTERPRETED,
            "BLOCK_M": tiles.block_m, "BLOCK_N": tiles.down_block_n, "BLOCK_K": tiles.down_block_k,
            "COLS_INNER": tiles.cols_inner}
    return up, down


def _desc_type(block_n: int, block_k: int) -> str:
    """The AOT signature of a bf16 weight descriptor read in [block_n, block_k] tiles."""
    return f"tensordesc<bf16[{block_n}, {block_k}]>"


def _weight_desc(w: torch.Tensor, block_n: int, block_k: int) -> TensorDescriptor:
    """A TMA descriptor of expert weights [E, N, K] as [E * N, K], read in [block_n, block_k] tiles."""
    return TensorDescriptor.from_tensor(w.view(-1, w.shape[-1]), [block_n, block_k])


def _aot_up_variants(arch: CudaArch) -> list[Variant]:
    variants = []
    for hidden, inter, top_k in AOT_SHAPES:
        for per_expert in AOT_SLOTS_PER_EXPERT:
            tiles = moe_experts_config(arch, per_expert, hidden, inter)
            up, _ = _constexprs(tiles, hidden, inter, top_k, True, False)
            sig = {"x_ptr": "*bf16:D", "w13_desc": _desc_type(tiles.up_block_n, tiles.up_block_k),
                   "act_ptr": "*bf16:D", "order_ptr": "*i32:D",
                   "blocks_ptr": "*i32:D", "n_blocks": "i32", "limit": "fp32"}
            variants.append(Variant(sig, up, tiles.up.num_warps, tiles.up.num_stages))
    return variants


def _aot_down_variants(arch: CudaArch) -> list[Variant]:
    variants = []
    for hidden, inter, top_k in AOT_SHAPES:
        for per_expert in AOT_SLOTS_PER_EXPERT:
            tiles = moe_experts_config(arch, per_expert, hidden, inter)
            _, down = _constexprs(tiles, hidden, inter, top_k, True, False)
            sig = {"act_ptr": "*bf16:D", "w2_desc": _desc_type(tiles.down_block_n, tiles.down_block_k),
                   "weights_ptr": "*fp32:D", "slot_out_ptr": "*bf16:D",
                   "order_ptr": "*i32:D", "blocks_ptr": "*i32:D", "n_blocks": "i32"}
            variants.append(Variant(sig, down, tiles.down.num_warps, tiles.down.num_stages))
    return variants


def _combine_constexprs(hidden: int, top_k: int, block_h: int) -> dict[str, object]:
    return {"H": hidden, "TOPK": top_k, "TOPK_PAD": max(2, triton.next_power_of_2(top_k)),
            "INTERPRETED": INTERPRETED, "BLOCK_H": block_h}


def _aot_combine_variants(arch: CudaArch) -> list[Variant]:
    variants = []
    for hidden, _, top_k in AOT_SHAPES:
        config, block_h = moe_combine_config(arch, hidden)
        sig = {"slot_out_ptr": "*bf16:D", "ids_ptr": "*i64:D", "out_ptr": "*bf16:D"}
        variants.append(Variant(sig, _combine_constexprs(hidden, top_k, block_h), config.num_warps, config.num_stages))
    return variants


UP_KERNEL = TritonKernel("moe_experts_up", _moe_up_kernel, _aot_up_variants)
DOWN_KERNEL = TritonKernel("moe_experts_down", _moe_down_kernel, _aot_down_variants)
COMBINE_KERNEL = TritonKernel("moe_experts_combine", _moe_combine_kernel, _aot_combine_variants)
KERNEL = UP_KERNEL  # the module's GEMM kernel (the interpreter test runs every step of the chain)


def prepare(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
            swiglu_limit: float | None, *, arch: CudaArch, tiles: MoeTiles | None = None) -> LaunchChain:
    """Plan ``moe_experts(...)`` for ``arch``: buffers allocated, the plan and three kernels' launches built.

    ``tiles`` overrides ``arch.moe_experts_config`` (tuning runs only: the kernel set holds the config's tiles).
    """
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    slots = tokens * top_k
    if slots == 0:
        return LaunchChain([], lambda: torch.zeros_like(x))
    if tiles is None:
        tiles = moe_experts_config(arch, slots // max(1, num_experts), hidden, inter, x.element_size())
    x, w13, w2, ids = x.contiguous(), w13.contiguous(), w2.contiguous(), ids.contiguous()
    order, blocks, plan_steps = plan(ids, num_experts, tiles.block_m, arch=arch)
    n_blocks = blocks.shape[1]
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    slot_out = torch.empty(slots, hidden, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    scale = weights.reshape(-1).to(torch.float32).contiguous()
    up_c, down_c = _constexprs(tiles, hidden, inter, top_k, swiglu_limit is not None, x.dtype == torch.float32)
    def grid(cols: int) -> tuple[int, int]:
        return (cols, n_blocks) if tiles.cols_inner else (n_blocks, cols)

    up = Launch(grid(triton.cdiv(inter, tiles.up_block_n)), tiles.up,
                dict(x_ptr=x, w13_desc=_weight_desc(w13, tiles.up_block_n, tiles.up_block_k), act_ptr=act,
                     order_ptr=order, blocks_ptr=blocks, n_blocks=n_blocks, limit=float(swiglu_limit or 0.0), **up_c),
                act)
    down = Launch(grid(triton.cdiv(hidden, tiles.down_block_n)), tiles.down,
                  dict(act_ptr=act, w2_desc=_weight_desc(w2, tiles.down_block_n, tiles.down_block_k),
                       weights_ptr=scale, slot_out_ptr=slot_out, order_ptr=order,
                       blocks_ptr=blocks, n_blocks=n_blocks, **down_c), slot_out)
    config, block_h = moe_combine_config(arch, hidden)
    combine = Launch((tokens, triton.cdiv(hidden, block_h)), config,
                     dict(slot_out_ptr=slot_out, ids_ptr=ids, out_ptr=out,
                          **_combine_constexprs(hidden, top_k, block_h)), out)
    steps = plan_steps + [(UP_KERNEL, up), (DOWN_KERNEL, down), (COMBINE_KERNEL, combine)]
    return LaunchChain(steps, lambda: out)


def moe_experts_fixed_tiles(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor,
                            w2: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """:func:`moe_experts` with one tile configuration for every batch (the batch-invariant table's: the combine
    already adds a token's slots in a fixed order).  Core's batch-invariant reference loops over the experts a
    batch hits (a host sync), which CUDA graph capture refuses; this keeps decode steps capturable."""
    index, arch = cuda_target(x)
    tiles = moe_batch_invariant_config(arch, x.shape[1], w13.shape[1] // 2, x.element_size())
    return prepare(x, ids, weights, w13, w2, swiglu_limit, arch=arch, tiles=tiles).run(index)


@override("moe_experts", batch_invariant=moe_experts_fixed_tiles,
          aot=(*moe_routing.KERNELS, UP_KERNEL, DOWN_KERNEL, COMBINE_KERNEL))
def moe_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                swiglu_limit: float | None) -> torch.Tensor:
    """Routed experts [T, H]: x [T, H]; ids [T, k] int64; weights [T, k] fp32; w13 [E, 2I, H]; w2 [E, H, I]."""
    index, arch = cuda_target(x)
    return prepare(x, ids, weights, w13, w2, swiglu_limit, arch=arch).run(index)
