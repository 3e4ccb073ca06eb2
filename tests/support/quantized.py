"""Released-format checkpoints (written by ``tools.fixtures.quantize``) and a CPU emulation of the CUDA FP8 GEMMs'
rounding."""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import torch

from tools.fixtures.quantize import V41_RELEASED, quantize_checkpoint, v4_layout, v41_released_layout

__all__ = ["V41_RELEASED", "fp8_prefill_emulation", "quantize_checkpoint", "released_tiny_v41", "rewrite_checkpoint",
           "v41_released_layout", "v4_layout"]


def released_tiny_v41(target: str | Path, fp8_engram: bool = True) -> tuple[Path, Path]:
    """The embedded tiny V4.1 (``deepinfer/assets/tiny_v41``, with its DSpark drafter) in the released layout:
    its dims fit every format, so every routed and draft expert is MXFP4, the dense projections (shared experts
    and ``main_proj`` included) FP8, the Engram tables FP8 (float if not ``fp8_engram``).  (quantized,
    dequantized twin) directories."""
    import deepinfer

    def layout(name: str, w: torch.Tensor):
        return None if not fp8_engram and name.endswith("engram.embed.weight") else v41_released_layout(name, w)

    source = Path(deepinfer.__file__).parent / "assets" / "tiny_v41"
    return quantize_checkpoint(source, target, layout, quantization_config=V41_RELEASED)


def rewrite_checkpoint(source: str | Path, target: str | Path, change: Callable[[dict[str, torch.Tensor]], None]
                       ) -> Path:
    """A copy of the single-file checkpoint ``source`` at ``target`` whose tensors ``change`` edited in place."""
    from safetensors.torch import load_file, save_file

    target = Path(target)
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(target / "model.safetensors"))
    return target


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
