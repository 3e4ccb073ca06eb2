"""Block-diagonal projection with an FP8 e4m3 block-scaled weight (V4 / V4.1's ``wo_a``): ``fp8_block_linear.py``'s
kernel with a group axis in the grid (group g of x against row block g of the weight).

Overrides core's ``fp8_block_grouped_linear(x, weight, scale, block_n, block_k)`` (deepinfer/ops/quant_gemm.py).
"""

from __future__ import annotations

import torch

from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import LaunchChain, cuda_target
from deepinfer_cuda.kernels.fp8_block_linear import KERNEL, KERNELS, plan_gemm  # noqa: F401  (KERNEL: the module's kernel)
from deepinfer_cuda.override import override

#: The interpreter test turns this on (see fp8_block_linear.py).
INTERPRETED = False


def prepare(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, *,
            arch: CudaArch) -> LaunchChain:
    """Plan the op: x [T, G, K], weight [G * N, K] e4m3, scale per block."""
    return plan_gemm(x, weight, scale, block_n, block_k, x.shape[1], arch=arch, interpreted=INTERPRETED)


def fp8_block_grouped_linear_fixed_tiles(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                                         block_k: int) -> torch.Tensor:
    """:func:`fp8_block_grouped_linear` with the weight-only regime for every batch (the batch-invariant table's)."""
    index, arch = cuda_target(x)
    return plan_gemm(x, weight, scale, block_n, block_k, x.shape[1], arch=arch, interpreted=INTERPRETED,
                     fixed=True).run(index)


@override("fp8_block_grouped_linear", batch_invariant=fp8_block_grouped_linear_fixed_tiles, aot=KERNELS)
def fp8_block_grouped_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                             block_k: int) -> torch.Tensor:
    """[T, G, N] in x's dtype."""
    index, arch = cuda_target(x)
    return prepare(x, weight, scale, block_n, block_k, arch=arch).run(index)
