"""The MoE experts' plan: token slots sorted by expert and cut into blocks of one expert, on the device.

``order`` [T*k] int32 maps a sorted position to its slot ``t * k + j`` (stable: ties keep slot order), and
``blocks`` [3, B] int32 holds each block's expert, first and end sorted position (``first == end``: an unused
block at the tail).  ``B = T*k // block_m + min(E, T*k)`` is a host-side bound, so neither the plan nor the
expert GEMMs that read it need a host sync, and all of it can be captured in a CUDA graph.

Two ways to the same tables (tested equal):

- decode (``T*k <= PLAN_KERNEL_MAX_SLOTS``): ``_moe_plan_kernel``, one program: a bitonic sort of the keys
  ``expert * SLOTS_PAD + slot``, per-expert counts, two prefix sums and scattered stores.  One launch
  where the torch plan is ~25 small kernels (each ~1-2 us of device time even inside a graph, and V4 has a
  MoE layer per block);
- prefill: the torch ops of :func:`expert_blocks` (their cost vanishes beside the GEMMs).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, LaunchConfig, moe_plan_config
from deepinfer_cuda.kernel_set.compile import Variant
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel

#: Largest T*k planned by the one-program kernel (decode up to 170 tokens at top-6); larger batches use torch.
PLAN_KERNEL_MAX_SLOTS = 1024
#: Expert counts compiled ahead of time: the V4 slice (64), V4-Flash (256), V4.1-Flash (384); their padded
#: widths (``experts_pad``) are what the cubins depend on.
AOT_EXPERTS = (64, 256, 384)
#: Decode tiles plan blocks of 16 slots (see arch.moe_experts_config).
AOT_BLOCK_M = 16


def slots_pad(slots: int) -> int:
    """The sort width for ``slots``: a power of two, at least 16."""
    return max(16, triton.next_power_of_2(max(slots, 1)))


def experts_pad(num_experts: int) -> int:
    """The per-expert vectors' width: a power of two above the expert ids (the sort's padding uses id E)."""
    return triton.next_power_of_2(num_experts + 1)


def num_blocks(slots: int, num_experts: int, block_m: int) -> int:
    """The host-side bound on the number of blocks (no sync): full blocks plus one partial block per hit expert."""
    return slots // block_m + min(num_experts, slots)


@triton.jit(do_not_specialize=["n_slots", "num_experts", "n_blocks"])
def _moe_plan_kernel(ids_ptr, order_ptr, blocks_ptr, n_slots, num_experts, n_blocks,
                     BLOCK_M: tl.constexpr, SLOTS_PAD: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                     CHUNK: tl.constexpr, TAIL: tl.constexpr):
    i = tl.arange(0, SLOTS_PAD)
    valid = i < n_slots
    expert = tl.load(ids_ptr + i, mask=valid, other=0).to(tl.int32)
    expert = tl.where(valid, expert, num_experts)  # padding: one bin past the experts, sorted last
    # Stable sort by expert: the keys are unique, so sorting them keeps slot order within an expert.
    keys = tl.sort(expert * SLOTS_PAD + i)
    tl.store(order_ptr + i, keys % SLOTS_PAD, mask=valid)

    # Slots per expert: chunks of the ids compared with every expert, summed.  Not tl.histogram: with a tensor
    # narrower than the program, threads hold copies of its values, and whether the lowering corrects for them
    # depends on the Triton version.
    e = tl.arange(0, EXPERTS_PAD)
    counts = tl.zeros([EXPERTS_PAD], dtype=tl.int32)
    for c in range(0, SLOTS_PAD, CHUNK):
        s = c + tl.arange(0, CHUNK)
        chunk = tl.load(ids_ptr + s, mask=s < n_slots, other=-1).to(tl.int32)
        counts += tl.sum((chunk[None, :] == e[:, None]).to(tl.int32), axis=1)
    seg_end = tl.cumsum(counts, 0)
    seg_start = seg_end - counts
    n_blk = (counts + BLOCK_M - 1) // BLOCK_M
    blk_end = tl.cumsum(n_blk, 0)
    blk_start = blk_end - n_blk
    # Expert e owns blocks blk_start[e] + j, j < n_blk[e]: the j-th holds its sorted slots from seg_start + j*BLOCK_M.
    for j in range(0, (SLOTS_PAD + BLOCK_M - 1) // BLOCK_M):
        has = j < n_blk
        b = blk_start + j
        tl.store(blocks_ptr + b, e, mask=has)
        tl.store(blocks_ptr + n_blocks + b, seg_start + j * BLOCK_M, mask=has)
        tl.store(blocks_ptr + 2 * n_blocks + b, seg_end, mask=has)
    used = tl.sum(n_blk, 0)
    for b0 in range(0, n_blocks, TAIL):  # the unused tail: first == end == 0 (the GEMMs return at once)
        b = b0 + tl.arange(0, TAIL)
        unused = (b >= used) & (b < n_blocks)
        zero = tl.zeros([TAIL], dtype=tl.int32)
        tl.store(blocks_ptr + b, zero + num_experts - 1, mask=unused)
        tl.store(blocks_ptr + n_blocks + b, zero, mask=unused)
        tl.store(blocks_ptr + 2 * n_blocks + b, zero, mask=unused)


def _constexprs(slots: int, num_experts: int, block_m: int) -> dict[str, int]:
    pad, bins = slots_pad(slots), experts_pad(num_experts)
    return {"BLOCK_M": block_m, "SLOTS_PAD": pad, "EXPERTS_PAD": bins, "CHUNK": min(pad, max(1, 8192 // bins)),
            "TAIL": 128}


def _aot_variants(arch: CudaArch) -> list[Variant]:
    sig = {"ids_ptr": "*i64:D", "order_ptr": "*i32:D", "blocks_ptr": "*i32:D", "n_slots": "i32",
           "num_experts": "i32", "n_blocks": "i32"}
    variants = []
    for pad in sorted({experts_pad(e) for e in AOT_EXPERTS}):
        slots = 16
        while slots <= PLAN_KERNEL_MAX_SLOTS:
            config = moe_plan_config(arch, slots)
            variants.append(Variant(sig, _constexprs(slots, pad - 1, AOT_BLOCK_M), config.num_warps,
                                    config.num_stages))
            slots *= 2
    return variants


PLAN_KERNEL = TritonKernel("moe_experts_plan", _moe_plan_kernel, _aot_variants)


def expert_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, blocks)`` by torch ops on the device (the prefill path, and the kernel's oracle in tests)."""
    flat = ids.reshape(-1)
    slots = flat.numel()
    order = torch.argsort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))  # not bincount, which syncs
    seg_end = counts.cumsum(0)
    n_blk = (counts + block_m - 1) // block_m
    blk_end = n_blk.cumsum(0)
    b = torch.arange(num_blocks(slots, num_experts, block_m), device=ids.device)
    expert = torch.searchsorted(blk_end, b, right=True)
    used = expert < num_experts
    e = expert.clamp(max=num_experts - 1)
    first = seg_end[e] - counts[e] + (b - (blk_end[e] - n_blk[e])) * block_m
    end = torch.where(used, seg_end[e], 0)
    first = torch.where(used, first, 0)
    return order.to(torch.int32), torch.stack([e, first, end]).to(torch.int32).contiguous()


def plan(ids: torch.Tensor, num_experts: int, block_m: int, *,
         arch: CudaArch) -> tuple[torch.Tensor, torch.Tensor, tuple[TritonKernel, Launch] | None]:
    """``(order, blocks, launch)``: the plan's tables and the kernel launch that fills them, or ``None`` where
    torch already filled them (more than :data:`PLAN_KERNEL_MAX_SLOTS` slots)."""
    slots = ids.numel()
    if slots > PLAN_KERNEL_MAX_SLOTS:
        order, blocks = expert_blocks(ids, num_experts, block_m)
        return order, blocks, None
    flat = ids.reshape(-1).contiguous()
    n_blocks = num_blocks(slots, num_experts, block_m)
    order = torch.empty(slots, dtype=torch.int32, device=ids.device)
    blocks = torch.empty(3, n_blocks, dtype=torch.int32, device=ids.device)
    config: LaunchConfig = moe_plan_config(arch, slots)
    launch = Launch((1,), config, dict(ids_ptr=flat, order_ptr=order, blocks_ptr=blocks, n_slots=slots,
                                       num_experts=num_experts, n_blocks=n_blocks,
                                       **_constexprs(slots, num_experts, block_m)), (order, blocks))
    return order, blocks, (PLAN_KERNEL, launch)
