"""Packed FP8 KV rows back to values: ``kv_pack.py``'s unpack kernel with the FP8 format.

Overrides core's ``fp8_e4m3_unpack(packed, block, dtype)`` (deepinfer/ops/kv_quant.py), bit for bit.
"""

from __future__ import annotations

import functools

import torch

from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernels.fake_quant import FP8_UE8M0
from deepinfer_cuda.kernels.kv_pack import _unpack_kernel, plan_unpack, unpack_variants
from deepinfer_cuda.override import override

KERNEL = TritonKernel("fp8_e4m3_unpack", _unpack_kernel, functools.partial(unpack_variants, fmt_kind="fp8"))


def prepare(packed: torch.Tensor, block: int, dtype: torch.dtype, *, arch: CudaArch) -> Launch:
    return plan_unpack(packed, block, FP8_UE8M0, dtype, arch=arch)


# batch-invariant: per block
@override("fp8_e4m3_unpack", batch_invariant=True, aot=(KERNEL,))
def fp8_e4m3_unpack(packed: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed rows [..., D + D / block] uint8 -> values [..., D] in ``dtype``."""
    index, arch = cuda_target(packed)
    return prepare(packed, block, dtype, arch=arch).run(KERNEL, index)
