"""The indexers' top-k: the ids of a row's ``topk`` best finite scores, best first, ``-1`` padding, in one kernel.

The indexer ops (``indexer_topk.py`` and its packed / in-blocks / candidates siblings) score entries in a Triton
kernel, then pick.  torch's ``topk`` + ``where`` (+ ``cat`` where the row is shorter than ``topk``) is several
launches a layer, which a decode step's small batch does not hide; here one program sorts a row: each score becomes
an unsigned key whose order is the float order, packed above the entry's reversed index, and ``tl.sort`` (bitonic,
in registers) orders them, best first and, among equal scores, the lower entry first.  Rows longer than
:data:`MAX_BLOCK` entries keep torch's ``topk`` (a register sort of more would spill), and so does every row until
``arch.TOP_ENTRIES_MAX_BLOCK`` adopts the kernel (after a GPU run; so far it has run under the interpreter only).
Ties: torch's order among equal scores is unspecified, the reference's is a stable sort; the indexer ops'
conformance compares the kept scores (their ``compare``), and this order is the stable one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import triton
import triton.language as tl

from deepinfer_cuda import arch
from deepinfer_cuda.arch import CudaArch, LaunchConfig
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel
from deepinfer_cuda.kernel_set.manifest import Variant

MAX_BLOCK = 4096  #: the longest row (entries, padded to a power of two) sorted in one program
#: ``index_topk`` of V4-Flash and V4.1-Flash, compiled ahead of time for rows of up to MAX_BLOCK entries
AOT_TOPK = (512,)
NEG_INF_KEY = tl.constexpr(0x007FFFFF)  #: the sort key of -inf (its bits 0xFF800000, inverted)


@triton.jit(do_not_specialize=["entries"])
def top_entries_kernel(scores_ptr, ids_ptr, entries, TOPK: tl.constexpr, BLOCK: tl.constexpr):
    """Row t of ``scores`` [T, entries] fp32 -> ``ids`` [T, TOPK] int64 (BLOCK >= max(entries, TOPK))."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    s = tl.load(scores_ptr + t * entries + cols, mask=cols < entries, other=float("-inf"))
    bits = s.to(tl.uint32, bitcast=True)
    key = tl.where((bits >> 31) != 0, ~bits, bits | 0x80000000)  # unsigned order == float order
    packed = (key.to(tl.uint64) << 32) | (BLOCK - 1 - cols).to(tl.uint64)
    ordered = tl.sort(packed, descending=True)
    ids = BLOCK - 1 - (ordered & 0xFFFFFFFF).to(tl.int64)
    tl.store(ids_ptr + t * TOPK + cols, tl.where((ordered >> 32) > NEG_INF_KEY, ids, -1), mask=cols < TOPK)


def _config(block: int) -> LaunchConfig:
    return LaunchConfig(num_warps=4 if block <= 1024 else 8)


def _variants(arch: CudaArch) -> list[Variant]:
    sig = {"scores_ptr": "*fp32:D", "ids_ptr": "*i64:D", "entries": "i32"}
    out = []
    for topk in AOT_TOPK:
        block = topk
        while block <= MAX_BLOCK:
            out.append(Variant(sig, {"TOPK": topk, "BLOCK": block}, _config(block).num_warps, 1))
            block *= 2
    return out


KERNEL = TritonKernel("top_entries", top_entries_kernel, _variants)


def torch_top_entries(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """The same ids by torch ops (rows too long for one program; the kernel's oracle in tests)."""
    kept = min(topk, scores.shape[1])
    values, ids = torch.topk(scores, kept, dim=1, sorted=True)
    ids = torch.where(values > float("-inf"), ids, -1)
    if kept < topk:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], topk - kept), -1)], dim=1)
    return ids


def plan(scores: torch.Tensor, topk: int, max_block: int | None = None
         ) -> tuple[list[tuple[TritonKernel, Launch]], Callable[[], torch.Tensor]]:
    """(steps, finish) picking from ``scores`` [T, N] once the steps before them wrote it: one launch, or none and
    torch's ``topk`` in ``finish`` for rows longer than ``max_block`` (None: ``arch.TOP_ENTRIES_MAX_BLOCK``, the
    kernel's adoption; at most :data:`MAX_BLOCK`)."""
    tokens, entries = scores.shape
    block = triton.next_power_of_2(max(entries, topk, 16))
    if block > min(MAX_BLOCK, arch.TOP_ENTRIES_MAX_BLOCK if max_block is None else max_block):
        return [], lambda: torch_top_entries(scores, topk)
    ids = torch.empty(tokens, topk, dtype=torch.int64, device=scores.device)
    launch = Launch((tokens,), _config(block), dict(scores_ptr=scores, ids_ptr=ids, entries=entries, TOPK=topk,
                                                     BLOCK=block), ids)
    return [(KERNEL, launch)], lambda: ids
