"""``grouped_linear`` (V4's block-diagonal ``wo_a``) on the streaming projection kernel of ``linear.py``: one
program per (column tile, group, row tile), each group's rows against its own block of the weight."""

from __future__ import annotations

import torch

from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import Launch, cuda_target
from deepinfer_cuda.kernels import linear as _linear

KERNEL = _linear.KERNEL


def prepare(x: torch.Tensor, weight: torch.Tensor, *, arch: CudaArch) -> Launch:
    """Plan ``grouped_linear(x [T, G, K], weight [G * N, K])`` -> [T, G, N] for ``arch``."""
    return _linear.prepare(x, weight, x.shape[1], arch=arch)


def grouped_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Block-diagonal ``[T, G, K] -> [T, G, N]``: the streaming kernel for few rows, else one batched cuBLAS GEMM."""
    index, arch = cuda_target(x)
    if not _linear.streams(x.shape[0], x, weight, arch):
        return torch.einsum("tgk,gnk->tgn", x, weight.view(x.shape[1], -1, x.shape[-1]))
    return prepare(x, weight, arch=arch).run(KERNEL, index)
