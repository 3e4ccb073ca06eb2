"""V4.1's candidate source: the lightning indexer's scores kernel, then its top-k and the candidate pool in torch.

Overrides core's ``indexer_candidates(q, weights, keys, seq_ids, limits, topk, softmax_scale, weights_scale,
block_size, topk_blocks)`` (deepinfer/ops/indexer.py).  The scores are ``indexer_topk``'s kernel (tensor cores,
fp32 accumulate, ``-inf`` past each query's limit); the picks are ``indexer_topk``'s ``torch.topk``; the blocks
are core's :func:`candidate_blocks` of the same scores (block maxima, the newest block pinned, a stable sort: a few
device kernels, no host sync).  One layer of V4.1-Flash (the candidate source) runs it.  Ties: as ``indexer_topk``.
"""

from __future__ import annotations

import torch

from deepinfer.ops.indexer import candidate_blocks
from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernels.indexer_topk import KERNEL, PackedKeys, plan_scores, top_entries
from deepinfer_cuda.override import override

#: As ``indexer_topk.INTERPRETED`` (fp32 products under Triton's CPU interpreter), for this op.
INTERPRETED = False

__all__ = ["KERNEL", "indexer_candidates", "prepare"]


def plan_candidates(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor | PackedKeys, seq_ids: torch.Tensor,
                    limits: torch.Tensor, topk: int, softmax_scale: float, weights_scale: float, block_size: int,
                    topk_blocks: int, *, kernel: TritonKernel, arch: CudaArch, interpreted: bool) -> LaunchChain:
    """The scores kernel's launch (``kernel``: the plain or the packed keys' variants), then (``finish``) the picks
    and the blocks; shared with ``indexer_candidates_packed``."""
    if block_size < 1 or topk_blocks < 1:
        raise ValueError(f"block_size and topk_blocks must be >= 1, got {block_size} and {topk_blocks}")
    launch = plan_scores(q, weights, keys, seq_ids, limits, softmax_scale, weights_scale, arch=arch,
                         interpreted=interpreted)

    def finish() -> tuple[torch.Tensor, torch.Tensor]:
        scores = launch.result
        causal = limits.to(device=scores.device, dtype=torch.int64)
        return top_entries(scores, topk), candidate_blocks(scores, causal, block_size, topk_blocks)

    return LaunchChain([(kernel, launch)], finish)


def prepare(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, seq_ids: torch.Tensor,
            limits: torch.Tensor, topk: int, softmax_scale: float, weights_scale: float, block_size: int,
            topk_blocks: int, *, arch: CudaArch) -> LaunchChain:
    """Plan ``indexer_candidates(...)``: the scores kernel's launch, then (``finish``) the picks and the blocks."""
    return plan_candidates(q, weights, keys, seq_ids, limits, topk, softmax_scale, weights_scale, block_size,
                           topk_blocks, kernel=KERNEL, arch=arch, interpreted=INTERPRETED)


@override("indexer_candidates", aot=(KERNEL,))
def indexer_candidates(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, seq_ids: torch.Tensor,
                       limits: torch.Tensor, topk: int, softmax_scale: float, weights_scale: float, block_size: int,
                       topk_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(picks [T, topk] int64, candidate blocks [T, topk_blocks] int64, ascending, -1 pads)."""
    index, arch = cuda_target(q)
    return prepare(q, weights, keys, seq_ids, limits, topk, softmax_scale, weights_scale, block_size, topk_blocks,
                   arch=arch).run(index)
