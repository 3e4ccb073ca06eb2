"""V4.1's entries and indexer queries / keys in one pass: ``rope``'s kernel with its ``QUANT`` epilogue in FP4.

Overrides core's ``rope_fp4_e2m1_fake_quant(x, positions, inv_freq, attention_scaling, block, scale_format)``
(deepinfer/ops/rope_quant.py).  Bits: ``fp4_e2m1_fake_quant``'s kernel applied to ``rope``'s output (the same
quantizer code on the same rounded values), one launch and one pass instead of two.  A row width that is no
multiple of ``block`` is rotated, not quantized (``rope``'s own variant).  Coverage (``deepinfer_cuda.coverage``):
a power-of-two block that divides the rope channels, when it divides the row.
"""

from __future__ import annotations

import torch

from deepinfer_cuda import coverage
from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernels import rope as base
from deepinfer_cuda.kernels.fake_quant import FP4_E4M3, FP4_UE8M0
from deepinfer_cuda.override import override

#: libdevice's rint has no interpreter implementation; the interpreter tests turn this on.
INTERPRETED = False
_FORMATS = {"e4m3": FP4_E4M3, "ue8m0": FP4_UE8M0}
#: V4.1-Flash: compressed entries (512 channels, rope 64, NVFP4-like blocks of 16), indexer queries (32 heads of
#: 128) and keys (one row of 128), MXFP4 blocks of 32.
AOT_SHAPES = ((512, 64, 1), (128, 64, 32), (128, 64, 1))
AOT_QUANTS = ((16, FP4_E4M3, False), (32, FP4_UE8M0, False), (32, FP4_UE8M0, False))


def _aot_variants(arch: CudaArch) -> list:
    return base.aot_variants(arch, AOT_SHAPES, AOT_QUANTS, inverses=(False,))


KERNEL = TritonKernel("rope_fp4_e2m1_fake_quant", base.KERNEL.jit_fn, _aot_variants)


def covers(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, block: int,
           scale_format: str) -> bool:
    return coverage.quant_block_fits(block, inv_freq, x.shape[-1])


def quantizes(x: torch.Tensor, block: int) -> bool:
    """Whether the call quantizes (the row is whole blocks) and so runs this kernel, not ``rope``'s."""
    return x.shape[-1] % block == 0


def prepare(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float, block: int,
            scale_format: str, *, arch: CudaArch) -> Launch:
    """Plan the fused op for ``arch``: output allocated, arguments built, nothing launched."""
    if scale_format not in _FORMATS:
        raise ValueError(f"scale_format must be 'e4m3' or 'ue8m0', got {scale_format!r}")
    if not covers(x, positions, inv_freq, attention_scaling, block, scale_format):
        raise ValueError(f"rope_fp4_e2m1_fake_quant: block {block} (a power of two dividing the "
                         f"{2 * inv_freq.numel()} rope channels) and rope pairs that fit {x.shape[-1]} channels "
                         "expected")
    quant = (block, _FORMATS[scale_format], INTERPRETED) if quantizes(x, block) else None
    return base.plan_rope(x, positions, inv_freq, attention_scaling, False, arch=arch, quant=quant,
                          op="rope_fp4_e2m1_fake_quant")


@override("rope_fp4_e2m1_fake_quant", coverage=covers, aot=(KERNEL,))
def rope_fp4_e2m1_fake_quant(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                             attention_scaling: float, block: int, scale_format: str) -> torch.Tensor:
    """RoPE, then FP4 e2m1 per ``block`` channels (e4m3 or ue8m0 scales), of x [T, D] or [T, H, D]."""
    index, arch = cuda_target(x)
    launch = prepare(x, positions, inv_freq, attention_scaling, block, scale_format, arch=arch)
    return launch.run(KERNEL if quantizes(x, block) else base.KERNEL, index)
