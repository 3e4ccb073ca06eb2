"""Packed FP8 KV rows (V4.1's sliding-window K=V): ``kv_pack.py``'s pack kernel with the FP8 format.

Overrides core's ``fp8_e4m3_pack(x, block)`` (deepinfer/ops/kv_quant.py), bit for bit.
"""

from __future__ import annotations

import functools

import torch

from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernels.fake_quant import FP8_UE8M0
from deepinfer_cuda.kernels.kv_pack import _pack_kernel, pack_variants, plan_pack
from deepinfer_cuda.override import override

#: libdevice's rint has no interpreter implementation; the interpreter test turns this on.
INTERPRETED = False
KERNEL = TritonKernel("fp8_e4m3_pack", _pack_kernel, functools.partial(pack_variants, fmt_kind="fp8"))


def prepare(x: torch.Tensor, block: int, *, arch: CudaArch) -> Launch:
    return plan_pack(x, block, FP8_UE8M0, arch=arch, interpreted=INTERPRETED)


# batch-invariant: per block
@override("fp8_e4m3_pack", batch_invariant=True, aot=(KERNEL,))
def fp8_e4m3_pack(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., D] -> packed rows [..., D + D / block] uint8."""
    index, arch = cuda_target(x)
    return prepare(x, block, arch=arch).run(KERNEL, index)
