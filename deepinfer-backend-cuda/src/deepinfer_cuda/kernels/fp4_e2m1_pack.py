"""Packed FP4 KV rows (V4.1's compressed latents and indexer keys): ``kv_pack.py``'s pack kernel with an FP4 format.

Overrides core's ``fp4_e2m1_pack(x, block, scale_format)`` (deepinfer/ops/kv_quant.py), bit for bit.
"""

from __future__ import annotations

import functools

import torch

from deepinfer.ops.fake_quant import ScaleFormat
from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernels.kv_pack import SCALE_FORMATS, _pack_kernel, pack_variants, plan_pack
from deepinfer_cuda.override import override

#: libdevice's rint has no interpreter implementation; the interpreter test turns this on.
INTERPRETED = False
KERNEL = TritonKernel("fp4_e2m1_pack", _pack_kernel, functools.partial(pack_variants, fmt_kind="fp4"))


def prepare(x: torch.Tensor, block: int, scale_format: ScaleFormat, *, arch: CudaArch) -> Launch:
    if scale_format not in SCALE_FORMATS:
        raise ValueError(f"scale_format must be 'e4m3' or 'ue8m0', got {scale_format!r}")
    return plan_pack(x, block, SCALE_FORMATS[scale_format], arch=arch, interpreted=INTERPRETED)


# batch-invariant: per block
@override("fp4_e2m1_pack", batch_invariant=True, aot=(KERNEL,))
def fp4_e2m1_pack(x: torch.Tensor, block: int, scale_format: ScaleFormat) -> torch.Tensor:
    """x [..., D] -> packed rows [..., D / 2 + D / block] uint8."""
    index, arch = cuda_target(x)
    return prepare(x, block, scale_format, arch=arch).run(KERNEL, index)
