"""V4.1's index sources after the candidate source: the lightning indexer restricted to each query's candidate blocks.

Overrides core's ``indexer_topk_in_blocks(q, weights, keys, seq_ids, limits, topk, softmax_scale, weights_scale,
blocks, block_size)`` (deepinfer/ops/indexer.py).  The query's blocks become a byte map ``allowed`` [T, blocks + 1]
(one scatter in torch; ``-1`` pads and ids past the keys land in the spare last column), which ``indexer_topk``'s
scores kernel reads with ``CANDIDATE_BLOCK = block_size``: an entry outside the query's blocks scores ``-inf`` in
the same store that masks its future.  Then ``indexer_topk``'s ``torch.topk``.  Ties: as ``indexer_topk``.
"""

from __future__ import annotations

import torch
import triton

from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.indexer_topk import aot_variants, index_scores_kernel, plan_scores, top_entries
from deepinfer_cuda.override import override

#: As ``indexer_topk.INTERPRETED`` (fp32 products under Triton's CPU interpreter), for this op.
INTERPRETED = False


def _variants(arch: CudaArch) -> list[Variant]:
    return aot_variants(arch, in_blocks=True)


KERNEL = TritonKernel("indexer_topk_in_blocks", index_scores_kernel, _variants)


def allowed_blocks(blocks: torch.Tensor, entries: int, block_size: int) -> torch.Tensor:
    """uint8 [T, cdiv(entries, block_size) + 1]: 1 at each query's candidate blocks (the last column: dropped ids)."""
    count = triton.cdiv(entries, block_size)
    allowed = torch.zeros((blocks.shape[0], count + 1), dtype=torch.uint8, device=blocks.device)
    return allowed.scatter_(1, torch.where(blocks >= 0, blocks, count).clamp(max=count), 1)


def prepare(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, seq_ids: torch.Tensor,
            limits: torch.Tensor, topk: int, softmax_scale: float, weights_scale: float, blocks: torch.Tensor,
            block_size: int, *, arch: CudaArch) -> LaunchChain:
    """Plan ``indexer_topk_in_blocks(...)``: the byte map (torch), the masked scores kernel, then the top-k."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    allowed = allowed_blocks(blocks.to(device=q.device, dtype=torch.int64), keys.shape[1], block_size)
    launch = plan_scores(q, weights, keys, seq_ids, limits, softmax_scale, weights_scale, arch=arch,
                         interpreted=INTERPRETED, allowed=allowed, candidate_block=block_size)
    return LaunchChain([(KERNEL, launch)], lambda: top_entries(launch.result, topk))


@override("indexer_topk_in_blocks", aot=(KERNEL,))
def indexer_topk_in_blocks(q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, seq_ids: torch.Tensor,
                           limits: torch.Tensor, topk: int, softmax_scale: float, weights_scale: float,
                           blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Top-``topk`` entries [T, topk] int64 (-1 = none) inside each query's candidate ``blocks`` [T, B]."""
    index, arch = cuda_target(q)
    return prepare(q, weights, keys, seq_ids, limits, topk, softmax_scale, weights_scale, blocks, block_size,
                   arch=arch).run(index)
