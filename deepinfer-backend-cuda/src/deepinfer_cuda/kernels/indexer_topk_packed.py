"""The lightning indexer over V4.1's packed FP4 keys: ``indexer_topk.py``'s scores kernel with ``PACKED`` key loads.

Overrides core's ``indexer_topk_packed(q, weights, key_pages, key_rows, key_block, key_scale_format, seq_ids,
limits, topk, softmax_scale, weights_scale)`` (deepinfer/ops/packed_indexer.py).  The reference gathers and unpacks
the keys, then scores; here the scores kernel reads each entry's page row and decodes it in registers
(``packed_rows.py``: the same values, so the same scores, bit for bit), and reads only causal entries: a decode step
reads 68 B a key (V4.1-Flash: 128 channels) instead of 256 B, with no gathered copy.  Then ``indexer_topk``'s
``torch.topk``.  ``indexer_candidates_packed.py`` shares this kernel.
"""

from __future__ import annotations

import torch

from deepinfer.ops.fake_quant import ScaleFormat
from deepinfer_cuda import coverage
from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.indexer_topk import PackedKeys, aot_variants, index_scores_kernel, plan_scores, top_entries
from deepinfer_cuda.override import override

#: (index heads, index head dim) compiled ahead of time: V4.1-Flash 32 x 128, keys FP4 + ue8m0 per 32 (68 B).
AOT_SHAPES = ((32, 128),)
AOT_KEYS: dict[str, object] = {"PACKED": True, "KEY_BLOCK": 32, "KEY_E4M3": False, "SOFT_FP8": False}
#: Triton's CPU interpreter: fp32 products and e4m3 scales decoded by arithmetic.  Off on the GPU.
INTERPRETED = False


def packed_variants(arch: CudaArch, in_blocks: bool = False) -> list[Variant]:
    return aot_variants(arch, in_blocks, AOT_KEYS, AOT_SHAPES)


KERNEL = TritonKernel("indexer_topk_packed", index_scores_kernel, packed_variants)


def prepare(q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor, key_rows: torch.Tensor, key_block: int,
            key_scale_format: ScaleFormat, seq_ids: torch.Tensor, limits: torch.Tensor, topk: int,
            softmax_scale: float, weights_scale: float, *, arch: CudaArch) -> LaunchChain:
    """Plan the op for ``arch``: the scores kernel's launch and the top-k, nothing launched."""
    keys = PackedKeys(key_pages, key_rows, key_block, key_scale_format)
    launch = plan_scores(q, weights, keys, seq_ids, limits, softmax_scale, weights_scale, arch=arch,
                         interpreted=INTERPRETED)
    return LaunchChain([(KERNEL, launch)], lambda: top_entries(launch.result, topk))


def covers(q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor, key_rows: torch.Tensor, key_block: int,
           key_scale_format: str, seq_ids: torch.Tensor, limits: torch.Tensor, topk: int, softmax_scale: float,
           weights_scale: float) -> bool:
    return coverage.packed_keys_fit(q, key_block)


@override("indexer_topk_packed", coverage=covers, aot=(KERNEL,))
def indexer_topk_packed(q: torch.Tensor, weights: torch.Tensor, key_pages: torch.Tensor, key_rows: torch.Tensor,
                        key_block: int, key_scale_format: ScaleFormat, seq_ids: torch.Tensor, limits: torch.Tensor,
                        topk: int, softmax_scale: float, weights_scale: float) -> torch.Tensor:
    """Top-``topk`` entries [T, topk] int64 (-1 = none) of q [T, H, c] against its sequence's packed keys."""
    index, arch = cuda_target(q)
    return prepare(q, weights, key_pages, key_rows, key_block, key_scale_format, seq_ids, limits, topk, softmax_scale,
                   weights_scale, arch=arch).run(index)
