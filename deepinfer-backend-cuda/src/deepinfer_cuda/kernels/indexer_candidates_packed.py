"""V4.1's candidate source over packed FP4 keys: ``indexer_topk_packed.py``'s scores kernel, then the picks and the
candidate pool as ``indexer_candidates.py`` makes them.

Overrides core's ``indexer_candidates_packed(q, weights, key_pages, key_rows, key_block, key_scale_format, seq_ids,
limits, topk, softmax_scale, weights_scale, block_size, topk_blocks)`` (deepinfer/ops/packed_indexer.py).
"""

from __future__ import annotations

import torch

from deepinfer.ops.fake_quant import ScaleFormat
from deepinfer_cuda import coverage
from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import LaunchChain, cuda_target
from deepinfer_cuda.kernels.indexer_candidates import plan_candidates
from deepinfer_cuda.kernels.indexer_topk import PackedKeys
from deepinfer_cuda.kernels.indexer_topk_packed import KERNEL
from deepinfer_cuda.override import override

#: As ``indexer_topk_packed.INTERPRETED``, for this op.
INTERPRETED = False

__all__ = ["KERNEL", "indexer_candidates_packed", "prepare"]


def prepare(q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor, key_rows: torch.Tensor, key_block: int,
            key_scale_format: ScaleFormat, seq_ids: torch.Tensor, limits: torch.Tensor, topk: int,
            softmax_scale: float, weights_scale: float, block_size: int, topk_blocks: int, *,
            arch: CudaArch) -> LaunchChain:
    """Plan the op: the scores kernel's launch, then (``finish``) the picks and the blocks."""
    keys = PackedKeys(key_pages, key_rows, key_block, key_scale_format)
    return plan_candidates(q, weights, keys, seq_ids, limits, topk, softmax_scale, weights_scale, block_size,
                           topk_blocks, kernel=KERNEL, arch=arch, interpreted=INTERPRETED)


def covers(q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor, key_rows: torch.Tensor, key_block: int,
           key_scale_format: str, seq_ids: torch.Tensor, limits: torch.Tensor, topk: int, softmax_scale: float,
           weights_scale: float, block_size: int, topk_blocks: int) -> bool:
    return coverage.packed_keys_fit(q, key_block)


@override("indexer_candidates_packed", coverage=covers, aot=(KERNEL,))
def indexer_candidates_packed(q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor,
                              key_rows: torch.Tensor, key_block: int, key_scale_format: ScaleFormat,
                              seq_ids: torch.Tensor, limits: torch.Tensor, topk: int, softmax_scale: float,
                              weights_scale: float, block_size: int, topk_blocks: int
                              ) -> tuple[torch.Tensor, torch.Tensor]:
    """(picks [T, topk] int64, candidate blocks [T, topk_blocks] int64, ascending, -1 pads)."""
    index, arch = cuda_target(q)
    return prepare(q, weights, key_pages, key_rows, key_block, key_scale_format, seq_ids, limits, topk, softmax_scale,
                   weights_scale, block_size, topk_blocks, arch=arch).run(index)
