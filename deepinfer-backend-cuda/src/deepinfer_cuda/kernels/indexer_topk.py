"""The lightning indexer: scores on tensor cores in one Triton kernel, then the top-k in torch on the device.

Overrides core's ``indexer_topk(q, weights, keys, seq_ids, limits, topk, softmax_scale, weights_scale)``
(deepinfer/ops/indexer.py).  The reference gathers every query's sequence keys ([T, N, c] fp32) and runs an
fp32 bmm; here:

    index_scores_kernel   per (query, chunk of BLOCK_N entries): s = q [H, c] @ k^T [c, BLOCK_N] (tensor cores,
                           fp32 accumulate), score_n = sum_h ReLU(s_hn) * softmax_scale * (w_h * weights_scale);
                           entries at or past the query's limit get -inf, chunks wholly past it skip the product
    finish (torch)         torch.topk of the [T, N] fp32 scores, -inf picks -> -1, padded with -1 to ``topk``

No host synchronisation.  Which of two tied entries is kept may differ from the reference's stable sort; the op's
conformance comparison compares the kept scores (see its ``compare``).  fp32 inputs use IEEE fp32 products.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, indexer_config
from deepinfer_cuda.kernel_set.dispatch import Launch, LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.kernels.packed_rows import fp4_row_values
from deepinfer_cuda.override import override

#: (index heads, index head dim) compiled ahead of time: V4-Flash 64 x 128, V4.1-Flash 32 x 128.
AOT_SHAPES = ((64, 128), (32, 128))
#: V4.1-Flash's candidate blocks (entries a block), for ``indexer_topk_in_blocks``'s variants.
AOT_CANDIDATE_BLOCKS = (8,)
#: Work around Triton's CPU interpreter, which computes bf16 ``tl.dot`` wrongly: multiply in fp32 (bf16 products
#: are exact in fp32).  Off on the GPU, turned on by the interpreter test.
INTERPRETED = False


@triton.jit(do_not_specialize=["entries", "softmax_scale", "weights_scale", "allowed_stride"])
def index_scores_kernel(q_ptr, w_ptr, keys_ptr, rows_ptr, seq_ptr, limit_ptr, scores_ptr, allowed_ptr, entries,
                         softmax_scale, weights_scale, allowed_stride, H: tl.constexpr, C: tl.constexpr,
                         FP32_DOT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr, BLOCK_N: tl.constexpr,
                         CANDIDATE_BLOCK: tl.constexpr, PACKED: tl.constexpr, KEY_BLOCK: tl.constexpr,
                         KEY_E4M3: tl.constexpr, SOFT_FP8: tl.constexpr):
    """Scores of query t against entries [pid1 * BLOCK_N, +BLOCK_N).  CANDIDATE_BLOCK > 0 (``indexer_topk_in_blocks``):
    entries whose block (``e // CANDIDATE_BLOCK``) is not set in the query's row of ``allowed`` [T, blocks] (uint8)
    score -inf too.  ``PACKED`` (the ``_packed`` ops): keys_ptr holds packed FP4 rows (a ``KEY_BLOCK`` scale byte,
    e4m3 or ue8m0) and the sequence's entry e is row ``rows[seq, e]``, decoded in registers (``packed_rows.py``);
    only causal entries are read (the others score -inf whatever their key)."""
    wait_for_producers()
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    limit = tl.load(limit_ptr + t)
    out_ptrs = scores_ptr + t * entries + cols
    col_ok = cols < entries
    if tl.program_id(1) * BLOCK_N >= limit:  # every entry of the chunk is in the query's future
        tl.store(out_ptrs, tl.full([BLOCK_N], float("-inf"), tl.float32), mask=col_ok)
        return
    heads = tl.arange(0, BLOCK_H)
    head_ok = heads < H
    dims = tl.arange(0, BLOCK_C)
    dim_ok = dims < C
    q = tl.load(q_ptr + t * (H * C) + heads[:, None] * C + dims[None, :], mask=head_ok[:, None] & dim_ok[None, :],
                other=0.0)
    seq = tl.load(seq_ptr + t).to(tl.int64)
    if PACKED:  # C = BLOCK_C
        causal = col_ok & (cols < limit)
        rows = tl.load(rows_ptr + seq * entries + cols, mask=causal, other=0)
        k = fp4_row_values(keys_ptr, rows, causal & (rows >= 0), C, KEY_BLOCK, KEY_E4M3, SOFT_FP8,
                           q_ptr.dtype.element_ty)
    else:
        k = tl.load(keys_ptr + (seq * entries + cols.to(tl.int64))[:, None] * C + dims[None, :],
                    mask=col_ok[:, None] & dim_ok[None, :], other=0.0)  # [BLOCK_N, BLOCK_C]
    if FP32_DOT:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    w = tl.load(w_ptr + t * H + heads, mask=head_ok, other=0.0).to(tl.float32) * weights_scale
    score = tl.sum(tl.maximum(s, 0.0) * softmax_scale * w[:, None], axis=0)  # [BLOCK_N]
    keep = cols < limit
    if CANDIDATE_BLOCK > 0:
        block_ok = tl.load(allowed_ptr + t * allowed_stride + cols // CANDIDATE_BLOCK, mask=col_ok, other=0)
        keep = keep & (block_ok != 0)
    tl.store(out_ptrs, tl.where(keep, score, float("-inf")), mask=col_ok)


#: The plain (values) kernel's packed-key constexprs: off.
PLAIN_KEYS: dict[str, object] = {"PACKED": False, "KEY_BLOCK": 32, "KEY_E4M3": False, "SOFT_FP8": False}


def _constexprs(heads: int, dim: int, block_n: int, fp32: bool, candidate_block: int,
                keys: dict[str, object] | None = None) -> dict[str, object]:
    return {"H": heads, "C": dim, "FP32_DOT": fp32, "BLOCK_H": max(16, triton.next_power_of_2(heads)),
            "BLOCK_C": max(16, triton.next_power_of_2(dim)), "BLOCK_N": block_n, "CANDIDATE_BLOCK": candidate_block,
            **(keys or PLAIN_KEYS)}


def aot_variants(arch: CudaArch, in_blocks: bool = False, packed: dict[str, object] | None = None,
                 shapes: tuple[tuple[int, int], ...] = AOT_SHAPES) -> list[Variant]:
    """Contiguous bf16 queries, weights and keys, int64 sequence ids and limits, at the model shapes; with the
    candidate-block mask (``in_blocks``) at V4.1's block sizes; ``packed``: uint8 key pages and int64 rows, with
    these packed-key constexprs.  The sequence ids either 16-byte aligned or not (a decode step's are a view
    8 bytes into its plan's buffer)."""
    variants = []
    for (heads, dim), seq in itertools.product(shapes, ("*i64:D", "*i64")):
        cfg, block_n = indexer_config(arch, heads, dim, 2)
        for block in AOT_CANDIDATE_BLOCKS if in_blocks else (0,):
            keys = {"keys_ptr": "*u8:D", "rows_ptr": "*i64:D"} if packed else {"keys_ptr": "*bf16:D"}
            sig = {"q_ptr": "*bf16:D", "w_ptr": "*bf16:D", **keys, "seq_ptr": seq, "limit_ptr": "*i64:D",
                   "scores_ptr": "*fp32:D"}
            const = _constexprs(heads, dim, block_n, False, block, packed)
            if not packed:
                const["rows_ptr"] = None
            if block:
                sig["allowed_ptr"] = "*u8:D"
            else:
                const["allowed_ptr"] = None
            sig.update({"entries": "i32", "softmax_scale": "fp32", "weights_scale": "fp32", "allowed_stride": "i32"})
            variants.append(Variant(sig, const, cfg.num_warps, cfg.num_stages))
    return variants


KERNEL = TritonKernel("indexer_topk", index_scores_kernel, aot_variants)


@dataclass(slots=True, frozen=True)
class PackedKeys:
    """The ``_packed`` ops' keys: ``pages`` [P, c / 2 + c / block] uint8 FP4 rows, ``rows`` [B, N] of each sequence's
    entries."""

    pages: torch.Tensor
    rows: torch.Tensor
    block: int
    scale_format: str

    def check(self, dim: int) -> None:
        if dim & (dim - 1) or dim < 16 or self.block not in (16, 32) or dim % self.block:
            raise ValueError(f"packed indexer keys: the head dim must be a power of two >= 16 in blocks of 16 or 32, "
                             f"got {dim}, {self.block}")
        if self.pages.shape[-1] != dim // 2 + dim // self.block:
            raise ValueError(f"packed key rows of {self.pages.shape[-1]} bytes are not rows of {dim} values")


def plan_scores(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor | PackedKeys, seq_ids: torch.Tensor,
                limits: torch.Tensor, softmax_scale: float, weights_scale: float, *, arch: CudaArch,
                interpreted: bool, allowed: torch.Tensor | None = None, candidate_block: int = 0) -> Launch:
    """The scores kernel's launch; ``result``: the fp32 scores [T, N] (``-inf`` at and past each query's limit,
    and outside its ``allowed`` [T, >= cdiv(N, candidate_block)] uint8 blocks when given).  ``keys``: values
    [B, N, c], or packed rows."""
    tokens, heads, dim = q.shape
    q = q.contiguous()
    weights = weights.to(q.dtype).contiguous()
    packed: dict[str, object] | None = None
    key_args: dict[str, object]
    if isinstance(keys, PackedKeys):
        keys.check(dim)
        entries = keys.rows.shape[1]
        key_args = dict(keys_ptr=keys.pages.contiguous(), rows_ptr=keys.rows.to(torch.int64).contiguous())
        packed = {"PACKED": True, "KEY_BLOCK": keys.block, "KEY_E4M3": keys.scale_format == "e4m3",
                  "SOFT_FP8": interpreted}
    else:
        entries = keys.shape[1]
        key_args = dict(keys_ptr=keys.to(q.dtype).contiguous(), rows_ptr=None)
    seq_ids = seq_ids.to(device=q.device, dtype=torch.int64).contiguous()
    limits = limits.to(device=q.device, dtype=torch.int64).contiguous()
    scores = torch.empty((tokens, entries), dtype=torch.float32, device=q.device)
    cfg, block_n = indexer_config(arch, heads, dim, q.element_size())
    const = _constexprs(heads, dim, block_n, q.dtype == torch.float32 or interpreted,
                        candidate_block if allowed is not None else 0, packed)
    args = dict(q_ptr=q, w_ptr=weights, **key_args, seq_ptr=seq_ids, limit_ptr=limits, scores_ptr=scores,
                allowed_ptr=allowed, entries=entries, softmax_scale=float(softmax_scale),
                weights_scale=float(weights_scale), allowed_stride=allowed.stride(0) if allowed is not None else 0,
                **const)
    return Launch((tokens, triton.cdiv(entries, block_n)), cfg, args, scores)


def top_entries(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """Ids of the ``topk`` best finite scores per row, best first; ``-1`` pads."""
    kept = min(topk, scores.shape[1])
    values, ids = torch.topk(scores, kept, dim=1, sorted=True)
    ids = torch.where(values > float("-inf"), ids, -1)
    if kept < topk:
        ids = torch.cat([ids, ids.new_full((ids.shape[0], topk - kept), -1)], dim=1)
    return ids


def prepare(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, seq_ids: torch.Tensor,
            limits: torch.Tensor, topk: int, softmax_scale: float, weights_scale: float, *,
            arch: CudaArch) -> LaunchChain:
    """Plan ``indexer_topk(...)`` for ``arch``: the scores kernel's launch and the top-k, nothing launched."""
    launch = plan_scores(q, weights, keys, seq_ids, limits, softmax_scale, weights_scale, arch=arch,
                         interpreted=INTERPRETED)
    return LaunchChain([(KERNEL, launch)], lambda: top_entries(launch.result, topk))


@override("indexer_topk", aot=(KERNEL,))
def indexer_topk(
    q: torch.Tensor,
    weights: torch.Tensor,
    keys: torch.Tensor,
    seq_ids: torch.Tensor,
    limits: torch.Tensor,
    topk: int,
    softmax_scale: float,
    weights_scale: float,
) -> torch.Tensor:
    """Top-``topk`` entries [T, topk] int64 (-1 = none) of q [T, H, c] against its sequence's keys [B, N, c]."""
    index, arch = cuda_target(q)
    return prepare(q, weights, keys, seq_ids, limits, topk, softmax_scale, weights_scale, arch=arch).run(index)
