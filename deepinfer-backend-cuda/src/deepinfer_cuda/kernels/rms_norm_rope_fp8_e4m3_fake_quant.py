"""V4.1's window K=V in one pass: ``rms_norm_rope``'s kernel with its ``QUANT`` epilogue in the FP8 format.

Overrides core's ``rms_norm_rope_fp8_e4m3_fake_quant(x, weight, eps, positions, inv_freq, attention_scaling,
block)`` (deepinfer/ops/rope_quant.py).  Bits: ``fp8_e4m3_fake_quant``'s kernel applied to ``rms_norm_rope``'s
output (the same quantizer code on the same rounded values), one launch and one pass over the rows instead of
two.  A row width that is no multiple of ``block`` is rotated, not quantized (``rms_norm_rope``'s own variant).
Batch-invariant as ``rms_norm_rope``.  Coverage (``deepinfer_cuda.coverage``): a power-of-two block that divides
the rope channels, when it divides the row.
"""

from __future__ import annotations

import torch

from deepinfer_cuda import coverage
from deepinfer_cuda.arch import CudaArch
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernels import rms_norm_rope as base
from deepinfer_cuda.kernels.fake_quant import FP8_UE8M0
from deepinfer_cuda.override import override

#: libdevice's rint has no interpreter implementation; the interpreter tests turn this on.
INTERPRETED = False
#: V4.1-Flash's window K=V: 512 channels, rope 64, one latent a token, FP8 blocks of 32.
AOT_SHAPES = ((512, 64, 1),)


def _aot_variants(arch: CudaArch) -> list:
    return base.aot_variants(arch, AOT_SHAPES, (32, FP8_UE8M0, False), weights=("fp32",))


KERNEL = TritonKernel("rms_norm_rope_fp8_e4m3_fake_quant", base.KERNEL.jit_fn, _aot_variants)


def covers(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor, inv_freq: torch.Tensor,
           attention_scaling: float, block: int) -> bool:
    return coverage.quant_block_fits(block, inv_freq, x.shape[-1])


def quantizes(x: torch.Tensor, block: int) -> bool:
    """Whether the call quantizes (the row is whole blocks) and so runs this kernel, not ``rms_norm_rope``'s."""
    return x.shape[-1] % block == 0


def prepare(x: torch.Tensor, weight: torch.Tensor | None, eps: float, positions: torch.Tensor,
            inv_freq: torch.Tensor, attention_scaling: float, block: int, *, arch: CudaArch) -> Launch:
    """Plan the fused op for ``arch``: output allocated, arguments built, nothing launched."""
    if not covers(x, weight, eps, positions, inv_freq, attention_scaling, block):
        raise ValueError(f"rms_norm_rope_fp8_e4m3_fake_quant: block {block} (a power of two dividing the "
                         f"{2 * inv_freq.numel()} rope channels) and rope pairs that fit {x.shape[-1]} channels "
                         "expected")
    quant = (block, FP8_UE8M0, INTERPRETED) if quantizes(x, block) else None
    return base.plan_rms_norm_rope(x, weight, eps, positions, inv_freq, attention_scaling, arch=arch, quant=quant,
                                   op="rms_norm_rope_fp8_e4m3_fake_quant")


# batch-invariant: rms_norm_rope's kernel, quantized per block; by construction (not yet checked on an H200)
@override("rms_norm_rope_fp8_e4m3_fake_quant", coverage=covers, batch_invariant=True, aot=(KERNEL,))
def rms_norm_rope_fp8_e4m3_fake_quant(x: torch.Tensor, weight: torch.Tensor | None, eps: float,
                                      positions: torch.Tensor, inv_freq: torch.Tensor, attention_scaling: float,
                                      block: int) -> torch.Tensor:
    """RMSNorm, RoPE, then FP8 e4m3 per ``block`` channels, of x [T, D] or [T, H, D]; x's shape and dtype."""
    index, arch = cuda_target(x)
    launch = prepare(x, weight, eps, positions, inv_freq, attention_scaling, block, arch=arch)
    return launch.run(KERNEL if quantizes(x, block) else base.KERNEL, index)
