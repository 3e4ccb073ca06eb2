"""Packed FP4 KV rows back to values: ``kv_pack.py``'s unpack kernel with an FP4 format.

Overrides core's ``fp4_e2m1_unpack(packed, block, scale_format, dtype)`` (deepinfer/ops/kv_quant.py), bit for bit.
"""

from __future__ import annotations

import functools

import torch

from deepinfer.ops.fake_quant import ScaleFormat
from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernels.kv_pack import SCALE_FORMATS, _unpack_kernel, plan_unpack, unpack_variants
from deepinfer_cuda.override import override

KERNEL = TritonKernel("fp4_e2m1_unpack", _unpack_kernel, functools.partial(unpack_variants, fmt_kind="fp4"))


def prepare(packed: torch.Tensor, block: int, scale_format: ScaleFormat, dtype: torch.dtype, *,
            arch: CudaArch) -> Launch:
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format must be 'e4m3' or 'ue8m0', got {scale_format!r}")
    return plan_unpack(packed, block, SCALE_FORMATS[scale_format], dtype, arch=arch)


# batch-invariant: per block
@override("fp4_e2m1_unpack", batch_invariant=True, aot=(KERNEL,))
def fp4_e2m1_unpack(packed: torch.Tensor, block: int, scale_format: ScaleFormat, dtype: torch.dtype
                    ) -> torch.Tensor:
    """Packed rows [..., D / 2 + D / block] uint8 -> values [..., D] in ``dtype``."""
    index, arch = cuda_target(packed)
    return prepare(packed, block, scale_format, dtype, arch=arch).run(KERNEL, index)
