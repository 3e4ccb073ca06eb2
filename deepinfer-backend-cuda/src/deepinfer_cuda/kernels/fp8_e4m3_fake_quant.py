"""FP8 e4m3 fake-quantization (V4.1's sliding-window K=V): the kernel of ``fake_quant.py`` with the FP8 format.

Overrides core's ``fp8_e4m3_fake_quant(x, block)`` (deepinfer/ops/fake_quant.py), bit for bit.
"""

from __future__ import annotations

import functools

import torch

from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernels.fake_quant import FP8_UE8M0, aot_variants, fake_quant_kernel, plan_fake_quant
from deepinfer_cuda.override import override

#: libdevice's rint has no interpreter implementation; the interpreter test turns this on.
INTERPRETED = False

#: V4.1 quantizes its window's K=V (512 channels) in blocks of 32.
KERNEL = TritonKernel("fp8_e4m3_fake_quant", fake_quant_kernel,
                      functools.partial(aot_variants, formats=((32, FP8_UE8M0),)))


def prepare(x: torch.Tensor, block: int, *, arch: CudaArch) -> Launch:
    """Plan ``fp8_e4m3_fake_quant(x, block)``; a ``Launch`` with an empty grid returning ``x`` when ``D % block``."""
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    return plan_fake_quant(x, block, FP8_UE8M0, arch=arch, interpreted=INTERPRETED)


# batch-invariant: per block; by construction (not yet checked on an H200)
@override("fp8_e4m3_fake_quant", batch_invariant=True, aot=(KERNEL,))
def fp8_e4m3_fake_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., D] rounded to FP8 e4m3 with a power-of-two scale per ``block`` channels and back; x's dtype."""
    index, arch = cuda_target(x)
    return prepare(x, block, arch=arch).run(KERNEL, index)
