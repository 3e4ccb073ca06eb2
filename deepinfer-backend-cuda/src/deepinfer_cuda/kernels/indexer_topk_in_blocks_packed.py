"""V4.1's index sources after the candidate source, over packed FP4 keys: ``indexer_topk_in_blocks.py``'s byte map
of allowed blocks and ``indexer_topk_packed.py``'s packed scores kernel, in one launch.

Overrides core's ``indexer_topk_in_blocks_packed(q, weights, key_pages, key_rows, key_block, key_scale_format,
seq_ids, limits, topk, softmax_scale, weights_scale, blocks, block_size)`` (deepinfer/ops/packed_indexer.py).
"""

from __future__ import annotations

import torch

from deepinfer.ops.fake_quant import ScaleFormat
from deepinfer_cuda import coverage
from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.indexer_topk import PackedKeys, index_scores_kernel, plan_scores, top_entries
from deepinfer_cuda.kernels.indexer_topk_in_blocks import allowed_blocks
from deepinfer_cuda.kernels.indexer_topk_packed import packed_variants
from deepinfer_cuda.override import override

#: As ``indexer_topk_packed.INTERPRETED``, for this op.
INTERPRETED = False


def _variants(arch: CudaArch) -> list[Variant]:
    return packed_variants(arch, in_blocks=True)


KERNEL = TritonKernel("indexer_topk_in_blocks_packed", index_scores_kernel, _variants)


def prepare(q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor, key_rows: torch.Tensor, key_block: int,
            key_scale_format: ScaleFormat, seq_ids: torch.Tensor, limits: torch.Tensor, topk: int,
            softmax_scale: float, weights_scale: float, blocks: torch.Tensor, block_size: int, *,
            arch: CudaArch) -> LaunchChain:
    """Plan the op: the byte map (torch), the masked packed scores kernel, then the top-k."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    allowed = allowed_blocks(blocks.to(device=q.device, dtype=torch.int64), key_rows.shape[1], block_size)
    keys = PackedKeys(key_pages, key_rows, key_block, key_scale_format)
    launch = plan_scores(q, weights, keys, seq_ids, limits, softmax_scale, weights_scale, arch=arch,
                         interpreted=INTERPRETED, allowed=allowed, candidate_block=block_size)
    return LaunchChain([(KERNEL, launch)], lambda: top_entries(launch.result, topk))


def covers(q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor, key_rows: torch.Tensor, key_block: int,
           key_scale_format: str, seq_ids: torch.Tensor, limits: torch.Tensor, topk: int, softmax_scale: float,
           weights_scale: float, blocks: torch.Tensor, block_size: int) -> bool:
    return coverage.packed_keys_fit(q, key_block)


@override("indexer_topk_in_blocks_packed", coverage=covers, aot=(KERNEL,))
def indexer_topk_in_blocks_packed(q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor,
                                  key_rows: torch.Tensor, key_block: int, key_scale_format: ScaleFormat,
                                  seq_ids: torch.Tensor, limits: torch.Tensor, topk: int, softmax_scale: float,
                                  weights_scale: float, blocks: torch.Tensor, block_size: int) -> torch.Tensor:
    """Top-``topk`` entries [T, topk] int64 (-1 = none) inside each query's candidate ``blocks`` [T, B]."""
    index, arch = cuda_target(q)
    return prepare(q, weights, key_pages, key_rows, key_block, key_scale_format, seq_ids, limits, topk, softmax_scale,
                   weights_scale, blocks, block_size, arch=arch).run(index)
