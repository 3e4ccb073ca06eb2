"""Released-format checkpoints (written by ``tools.fixtures.quantize``) and a CPU emulation of the CUDA FP8 GEMMs'
rounding."""

from __future__ import annotations

import torch

from tools.fixtures.quantize import V41_RELEASED, quantize_checkpoint, v4_layout, v41_released_layout

__all__ = ["V41_RELEASED", "fp8_prefill_emulation", "quantize_checkpoint", "v41_released_layout", "v4_layout"]


def fp8_prefill_emulation(ops):
    """``ops`` (an OpTable) with ``fp8_block_linear`` / ``fp8_block_grouped_linear`` replaced by a torch emulation of
    the CUDA kernels' prefill regime (bf16, >= 64 rows, K a multiple of block_k): x rounded to FP8 e4m3 per token
    and ``block_k`` channels (scale ``max(amax, 1e-4) / 448``) before the product; other calls as the reference.
    What the GPU's FP8 GEMMs should deviate by, measured on the CPU."""
    import torch.nn.functional as F

    from deepinfer.ops.quant import dequant_fp8_block

    def rounded(x: torch.Tensor, bk: int) -> torch.Tensor:
        m = x.reshape(x.shape[0], -1)
        if m.shape[0] < 64 or x.shape[-1] % bk or x.dtype != torch.bfloat16:
            return x.float()
        g = m.float().view(m.shape[0], -1, bk)
        s = g.abs().amax(-1, keepdim=True).clamp_min(1e-4) / 448
        return ((g / s).clamp(-448, 448).to(torch.float8_e4m3fn).float() * s).view(x.shape)

    def linear(x, weight, scale, block_n, block_k):
        w = dequant_fp8_block(weight, scale, block_n, block_k, torch.float32)
        flat = x.reshape(-1, x.shape[-1])
        return F.linear(rounded(flat, block_k), w).to(x.dtype).view(*x.shape[:-1], -1)

    def grouped(x, weight, scale, block_n, block_k):
        w = dequant_fp8_block(weight, scale, block_n, block_k, torch.float32)
        out = torch.einsum("tgk,gnk->tgn", rounded(x, block_k), w.view(x.shape[1], -1, x.shape[-1]))
        return out.to(x.dtype)

    ops.fp8_block_linear, ops.fp8_block_grouped_linear = linear, grouped
    return ops
