"""Gated pooling: the compressor's reduction of a window of token projections to one KV entry."""

from __future__ import annotations

import torch

from deepinfer.ops.registry import OpSample, batch_invariant_reference, reference_op
from deepinfer.ops.row_tiles import in_row_tiles


def _compress_pool_samples(dtype: torch.dtype, gen: torch.Generator):
    for windows, slots, dim in [(1, 8, 32), (13, 8, 512), (3, 128, 64)]:
        kv = torch.randn(windows, slots, dim, generator=gen).to(dtype)
        score = torch.randn(windows, slots, dim, generator=gen)
        yield OpSample((kv, score), label=f"{windows}x{slots}x{dim}")
        # CSA's first window has no predecessor: its first half is empty (zero kv, -inf score).
        kv0, score0 = kv.clone(), score.clone()
        kv0[0, : slots // 2], score0[0, : slots // 2] = 0, float("-inf")
        yield OpSample((kv0, score0), label=f"{windows}x{slots}x{dim} empty half")


@reference_op(sample_inputs=_compress_pool_samples, rows=(0, 1))
def compress_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Per channel, a softmax over a window's slots of ``score`` weighs the slots of ``kv``.

    kv: [W, S, C] (model dtype); score: [W, S, C] fp32 (gate projection + learned position bias; ``-inf``
    marks an empty slot, which gets weight 0).  The softmax runs in fp32; the weighted sum in kv.dtype.
    Returns [W, C] in kv.dtype.  (CSA lays out 2m slots: the previous window's series a, then this window's
    series b; HCA m slots.)
    """
    weights = torch.softmax(score.float(), dim=1).to(kv.dtype)
    return (kv * weights).sum(dim=1)


@batch_invariant_reference(compress_pool)
def compress_pool_in_tiles(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """Fixed tiles of 16 windows: CUDA's softmax and sum over the slots pick their kernel by the whole shape
    (measured on an H200: fp32 results change with the number of windows)."""
    return in_row_tiles(compress_pool, (kv, score), rows=(0, 1))
