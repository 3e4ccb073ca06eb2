"""The MoE experts' plan: token slots sorted by expert and cut into blocks of one expert, on the device.

``order`` [T*k] int32 maps a sorted position to its slot ``t * k + j`` (stable: ties keep slot order), and
``blocks`` [3, B] int32 holds each block's expert, first and end sorted position (``first == end``: an unused
block at the tail).  ``B = T*k // block_m + min(E, T*k)`` is a host-side bound, so neither the plan nor the
expert GEMMs that read it need a host sync, and all of it can be captured in a CUDA graph.

Two ways to the same tables (tested equal to each other and to the torch oracle :func:`expert_blocks`):

- decode (``T*k <= PLAN_KERNEL_MAX_SLOTS``): ``_moe_plan_kernel``, one program: a bitonic sort of the keys
  ``expert * SLOTS_PAD + slot``, per-expert counts, two prefix sums and scattered stores.  One launch
  where the torch plan is ~25 small kernels (each ~1-2 us of device time even inside a graph, and V4 has a
  MoE layer per block);
- any larger call (prefill): three launches, whatever the slot count (``arch.moe_plan_chunks_config``):
  ``_moe_count_kernel`` (one program per chunk of 512 slots: its per-expert counts), ``_moe_scan_kernel``
  (one program: each expert's slots in the chunks before each chunk, the expert segments and block ranges) and
  ``_moe_scatter_kernel`` (one program per 128 slots: a slot's rank among its expert's slots in its chunk is a
  count of equal ids over the chunk's earlier slots; plus its expert's segment start and the slots of earlier
  chunks, read back from the scan, it is the slot's place in ``order``; each program also writes a share of
  the block table).  No sort, no atomics: every value is a count, so the tables do not depend on the order in
  which programs run.  Before, this path was the ~25 torch ops of :func:`expert_blocks` per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, LaunchConfig, MoePlanChunks, moe_plan_chunks_config, moe_plan_config
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers

#: Largest T*k planned by the one-program kernel (decode up to 170 tokens at top-6); larger calls use the
#: three chunked kernels.
PLAN_KERNEL_MAX_SLOTS = 1024
#: Expert counts compiled ahead of time: the V4 slice (64), V4-Flash (256), V4.1-Flash (384), each also with the
#: shared expert run as one more (the V4 model does), and V4.1-Flash's DSpark drafter (128); their padded widths
#: (``experts_pad``) are what the cubins depend on.
AOT_EXPERTS = (64, 65, 128, 256, 257, 384, 385)
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
    wait_for_producers()
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


# The chunked plan.  ``scratch`` [n_chunks + 4, EXPERTS_PAD] int32: row c < n_chunks holds chunk c's counts
# (count kernel), then each expert's slots in the chunks before c (scan kernel); the last four rows hold the
# experts' first and end sorted slot and first and end block, in that order.


@triton.jit(do_not_specialize=["n_slots"])
def _moe_count_kernel(ids_ptr, scratch_ptr, n_slots, CHUNK: tl.constexpr, EXPERTS_PAD: tl.constexpr,
                      SUB: tl.constexpr):
    """Chunk c's slots per expert: sub-chunks of ids compared with every expert and summed (not tl.histogram,
    see the one-program kernel)."""
    wait_for_producers()
    c = tl.program_id(0)
    e = tl.arange(0, EXPERTS_PAD)
    counts = tl.zeros([EXPERTS_PAD], dtype=tl.int32)
    for s0 in range(0, CHUNK, SUB):
        s = c * CHUNK + s0 + tl.arange(0, SUB)
        sub = tl.load(ids_ptr + s, mask=s < n_slots, other=-1).to(tl.int32)
        counts += tl.sum((sub[None, :] == e[:, None]).to(tl.int32), axis=1)
    tl.store(scratch_ptr + c * EXPERTS_PAD + e, counts)


@triton.jit(do_not_specialize=["n_chunks", "block_m"])
def _moe_scan_kernel(scratch_ptr, n_chunks, block_m, EXPERTS_PAD: tl.constexpr, CHUNK_TILE: tl.constexpr):
    """One program: over the counts, each expert's slots in the chunks before (an exclusive sum down the
    chunks, in tiles of CHUNK_TILE chunks whose loads are all in flight at once); then the totals' segments and
    block ranges (prefix sums over the experts)."""
    wait_for_producers()
    e = tl.arange(0, EXPERTS_PAD)
    before = tl.zeros([EXPERTS_PAD], dtype=tl.int32)  # each expert's slots in the chunks done so far
    for c0 in range(0, n_chunks, CHUNK_TILE):
        c = c0 + tl.arange(0, CHUNK_TILE)
        at = scratch_ptr + c[:, None] * EXPERTS_PAD + e[None, :]
        rows = c[:, None] < n_chunks
        counts = tl.load(at, mask=rows, other=0)
        tl.store(at, tl.cumsum(counts, axis=0) - counts + before[None, :], mask=rows)
        before += tl.sum(counts, axis=0)
    seg_end = tl.cumsum(before, 0)
    n_blk = (before + block_m - 1) // block_m
    blk_end = tl.cumsum(n_blk, 0)
    rows = scratch_ptr + n_chunks * EXPERTS_PAD + e
    tl.store(rows, seg_end - before)
    tl.store(rows + EXPERTS_PAD, seg_end)
    tl.store(rows + 2 * EXPERTS_PAD, blk_end - n_blk)
    tl.store(rows + 3 * EXPERTS_PAD, blk_end)


@triton.jit(do_not_specialize=["n_slots", "num_experts", "n_chunks", "n_blocks", "blocks_per_program", "block_m"])
def _moe_scatter_kernel(ids_ptr, order_ptr, blocks_ptr, scratch_ptr, n_slots, num_experts, n_chunks, n_blocks,
                        blocks_per_program, block_m, CHUNK: tl.constexpr, BLOCK_I: tl.constexpr,
                        BLOCK_J: tl.constexpr, EXPERTS_PAD: tl.constexpr, TAIL: tl.constexpr):
    """Program (c, q) places slots i of chunk c's q-th BLOCK_I: ``order[seg_start[e] + (e's slots in chunks
    before c) + (e's slots before i in chunk c)] = i``, e = ids[i].  The last term is a count of equal ids over
    the chunk's earlier slots (at most CHUNK compares per slot; no sort, no atomics)."""
    wait_for_producers()
    c = tl.program_id(0)
    q = tl.program_id(1)
    i = c * CHUNK + q * BLOCK_I + tl.arange(0, BLOCK_I)
    valid = i < n_slots
    expert = tl.load(ids_ptr + i, mask=valid, other=0).to(tl.int32)
    rank = tl.zeros([BLOCK_I], dtype=tl.int32)
    for j0 in range(c * CHUNK, c * CHUNK + (q + 1) * BLOCK_I, BLOCK_J):
        j = j0 + tl.arange(0, BLOCK_J)
        other = tl.load(ids_ptr + j, mask=j < n_slots, other=-1).to(tl.int32)
        earlier = (other[None, :] == expert[:, None]) & (j[None, :] < i[:, None])
        rank += tl.sum(earlier.to(tl.int32), axis=1)
    rows = scratch_ptr + n_chunks * EXPERTS_PAD
    dest = (tl.load(rows + expert, mask=valid, other=0)
            + tl.load(scratch_ptr + c * EXPERTS_PAD + expert, mask=valid, other=0) + rank)
    tl.store(order_ptr + dest, i, mask=valid)

    # This program's share of the block table: block b belongs to the expert whose block range holds it (the
    # number of experts whose ranges end at or before b); past the last used block, first == end == 0.
    p = c * tl.num_programs(1) + q
    x = tl.arange(0, EXPERTS_PAD)
    blk_end = tl.load(rows + 3 * EXPERTS_PAD + x, mask=x < num_experts, other=2147483647)
    for b0 in range(0, blocks_per_program, TAIL):
        b = p * blocks_per_program + b0 + tl.arange(0, TAIL)
        mine = (b0 + tl.arange(0, TAIL) < blocks_per_program) & (b < n_blocks)
        owner = tl.sum((blk_end[None, :] <= b[:, None]).to(tl.int32), axis=1)
        used = owner < num_experts
        owner = tl.minimum(owner, num_experts - 1)
        first = (tl.load(rows + owner, mask=mine, other=0)
                 + (b - tl.load(rows + 2 * EXPERTS_PAD + owner, mask=mine, other=0)) * block_m)
        end = tl.load(rows + EXPERTS_PAD + owner, mask=mine, other=0)
        tl.store(blocks_ptr + b, owner, mask=mine)
        tl.store(blocks_ptr + n_blocks + b, tl.where(used, first, 0), mask=mine)
        tl.store(blocks_ptr + 2 * n_blocks + b, tl.where(used, end, 0), mask=mine)


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


def chunk_experts_pad(num_experts: int) -> int:
    """The chunked kernels' per-expert width (their padding needs no bin of its own)."""
    return triton.next_power_of_2(max(num_experts, 1))


def _chunk_constexprs(chunk: MoePlanChunks, num_experts: int) -> tuple[dict[str, int], dict[str, int], dict[str, int]]:
    """(count, scan, scatter) constexprs: each a function of the chunk and the expert width only, so a few AOT
    variants serve every slot count; compare tiles of 8K elements (4K in the scatter kernel: no spills)."""
    pad = chunk_experts_pad(num_experts)
    tile = max(1, 8192 // pad)
    return ({"CHUNK": chunk.chunk, "EXPERTS_PAD": pad, "SUB": min(chunk.chunk, tile)},
            {"EXPERTS_PAD": pad, "CHUNK_TILE": min(64, tile)},
            {"CHUNK": chunk.chunk, "BLOCK_I": chunk.block_i, "BLOCK_J": 4096 // chunk.block_i, "EXPERTS_PAD": pad,
             "TAIL": max(8, min(128, tile // 2))})


_COUNT_SIG = {"ids_ptr": "*i64:D", "scratch_ptr": "*i32:D", "n_slots": "i32"}
_SCAN_SIG = {"scratch_ptr": "*i32:D", "n_chunks": "i32", "block_m": "i32"}
_SCATTER_SIG = {"ids_ptr": "*i64:D", "order_ptr": "*i32:D", "blocks_ptr": "*i32:D", "scratch_ptr": "*i32:D",
                "n_slots": "i32", "num_experts": "i32", "n_chunks": "i32", "n_blocks": "i32",
                "blocks_per_program": "i32", "block_m": "i32"}


def _aot_chunk_variants(arch: CudaArch, step: int, signature: dict[str, str]) -> list[Variant]:
    chunks = moe_plan_chunks_config(arch)
    config = (chunks.count, chunks.scan, chunks.scatter)[step]
    return [Variant(signature, _chunk_constexprs(chunks, pad)[step], config.num_warps, config.num_stages)
            for pad in sorted({chunk_experts_pad(e) for e in AOT_EXPERTS})]


PLAN_KERNEL = TritonKernel("moe_experts_plan", _moe_plan_kernel, _aot_variants)
COUNT_KERNEL = TritonKernel("moe_experts_plan_count", _moe_count_kernel,
                            lambda arch: _aot_chunk_variants(arch, 0, _COUNT_SIG))
SCAN_KERNEL = TritonKernel("moe_experts_plan_scan", _moe_scan_kernel,
                           lambda arch: _aot_chunk_variants(arch, 1, _SCAN_SIG))
SCATTER_KERNEL = TritonKernel("moe_experts_plan_scatter", _moe_scatter_kernel,
                              lambda arch: _aot_chunk_variants(arch, 2, _SCATTER_SIG))


#: Every kernel of the routing plan (an MoE op launches one or the other path).
KERNELS = (PLAN_KERNEL, COUNT_KERNEL, SCAN_KERNEL, SCATTER_KERNEL)


def expert_blocks(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(order, blocks)`` by torch ops: the kernels' oracle in tests (and a readable statement of the plan)."""
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
         arch: CudaArch) -> tuple[torch.Tensor, torch.Tensor, list[tuple[TritonKernel, Launch]]]:
    """``(order, blocks, steps)``: the plan's tables and the launches that fill them, in order: one program up to
    :data:`PLAN_KERNEL_MAX_SLOTS` slots, else the three chunked kernels."""
    slots = ids.numel()
    flat = ids.reshape(-1).contiguous()
    n_blocks = num_blocks(slots, num_experts, block_m)
    order = torch.empty(slots, dtype=torch.int32, device=ids.device)
    blocks = torch.empty(3, n_blocks, dtype=torch.int32, device=ids.device)
    if slots <= PLAN_KERNEL_MAX_SLOTS:
        config: LaunchConfig = moe_plan_config(arch, slots)
        launch = Launch((1,), config, dict(ids_ptr=flat, order_ptr=order, blocks_ptr=blocks, n_slots=slots,
                                           num_experts=num_experts, n_blocks=n_blocks,
                                           **_constexprs(slots, num_experts, block_m)), (order, blocks))
        return order, blocks, [(PLAN_KERNEL, launch)]
    chunks: MoePlanChunks = moe_plan_chunks_config(arch)
    n_chunks = triton.cdiv(slots, chunks.chunk)
    count_c, scan_c, scatter_c = _chunk_constexprs(chunks, num_experts)
    scratch = torch.empty(n_chunks + 4, scan_c["EXPERTS_PAD"], dtype=torch.int32, device=ids.device)
    count = Launch((n_chunks,), chunks.count, dict(ids_ptr=flat, scratch_ptr=scratch, n_slots=slots, **count_c),
                   scratch)
    scan = Launch((1,), chunks.scan, dict(scratch_ptr=scratch, n_chunks=n_chunks, block_m=block_m, **scan_c),
                  scratch)
    grid = (n_chunks, chunks.chunk // chunks.block_i)
    scatter = Launch(grid, chunks.scatter,
                     dict(ids_ptr=flat, order_ptr=order, blocks_ptr=blocks, scratch_ptr=scratch, n_slots=slots,
                          num_experts=num_experts, n_chunks=n_chunks, n_blocks=n_blocks,
                          blocks_per_program=triton.cdiv(n_blocks, grid[0] * grid[1]), block_m=block_m, **scatter_c),
                     (order, blocks))
    return order, blocks, [(COUNT_KERNEL, count), (SCAN_KERNEL, scan), (SCATTER_KERNEL, scatter)]
