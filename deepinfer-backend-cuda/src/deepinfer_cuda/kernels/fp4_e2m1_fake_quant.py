"""FP4 e2m1 fake-quantization (V4.1's compressed latents, indexer keys and queries): the kernel of
``fake_quant.py`` with an e4m3 or ue8m0 scale.

Overrides core's ``fp4_e2m1_fake_quant(x, block, scale_format)`` (deepinfer/ops/fake_quant.py), bit for bit.
"""

from __future__ import annotations

import functools

import torch

from deepinfer.ops.fake_quant import ScaleFormat
from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernels.fake_quant import FP4_E4M3, FP4_UE8M0, aot_variants, fake_quant_kernel, plan_fake_quant
from deepinfer_cuda.override import override

#: libdevice's rint has no interpreter implementation; the interpreter test turns this on.
INTERPRETED = False
FORMATS = {"e4m3": FP4_E4M3, "ue8m0": FP4_UE8M0}

#: V4.1: latents (512 channels) in blocks of 16 with e4m3 scales (NVFP4-like); indexer keys and queries (128)
#: in blocks of 32 with ue8m0 scales (MXFP4); the other two pairs for other checkpoints.
KERNEL = TritonKernel("fp4_e2m1_fake_quant", fake_quant_kernel,
                      functools.partial(aot_variants, formats=tuple((b, f) for b in (16, 32) for f in (1, 2))))


def prepare(x: torch.Tensor, block: int, scale_format: ScaleFormat, *, arch: CudaArch) -> Launch:
    """Plan ``fp4_e2m1_fake_quant(x, block, scale_format)``; an empty grid returning ``x`` when ``D % block``."""
    if scale_format not in FORMATS:
        raise ValueError(f"scale_format must be 'e4m3' or 'ue8m0', got {scale_format!r}")
    if block < 1:
        raise ValueError(f"block must be >= 1, got {block}")
    return plan_fake_quant(x, block, FORMATS[scale_format], arch=arch, interpreted=INTERPRETED)


# batch-invariant: per block; by construction (not yet checked on an H200)
@override("fp4_e2m1_fake_quant", batch_invariant=True, aot=(KERNEL,))
def fp4_e2m1_fake_quant(x: torch.Tensor, block: int, scale_format: ScaleFormat) -> torch.Tensor:
    """x [..., D] rounded to FP4 e2m1 with one ``scale_format`` scale per ``block`` channels and back; x's dtype."""
    index, arch = cuda_target(x)
    return prepare(x, block, scale_format, arch=arch).run(KERNEL, index)
