"""Quantizers for the released formats: how tests and tools build FP8 / MXFP4 checkpoints of known weights."""

from __future__ import annotations

import torch

from deepinfer.quant.formats import E2M1_VALUES, FP8_BLOCK, MXFP4, QuantizedTensor

FP8_MAX = 448.0  # largest finite e4m3fn value
E2M1_MAX = 6.0


def _ceil_pow2(x: torch.Tensor) -> torch.Tensor:
    """Smallest power of two >= x (x > 0): what a UE8M0 scale can hold without overflowing the data."""
    return torch.exp2(torch.ceil(torch.log2(x)))


def _e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Power-of-two fp32 scales (>= 2^-126) as ``float8_e8m0fnu``, from their exponent bits (no conversion kernel
    needed on any device)."""
    return ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8).view(torch.float8_e8m0fnu)


def quantize_fp8_block(
    weight: torch.Tensor, block: tuple[int, int] = (128, 128), scale_format: str = "ue8m0"
) -> QuantizedTensor:
    """Block-scaled FP8 e4m3: each block is divided by ``amax / 448`` (rounded up to a power of two for
    ``scale_format="ue8m0"``, kept as fp32 for ``"fp32"``) and cast.  Scales are stored as float8_e8m0fnu / fp32.
    """
    if scale_format not in ("ue8m0", "fp32"):
        raise ValueError(f"scale_format must be 'ue8m0' or 'fp32', not {scale_format!r}")
    rows, cols = weight.shape
    bn, bk = block
    gr, gc = -(-rows // bn), -(-cols // bk)
    padded = torch.zeros(gr * bn, gc * bk, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight.float()
    blocks = padded.view(gr, bn, gc, bk)
    amax = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-30)
    scale = amax / FP8_MAX
    if scale_format == "ue8m0":
        scale = _ceil_pow2(scale)
    data = (blocks / scale[:, None, :, None]).view(gr * bn, gc * bk)[:rows, :cols].to(torch.float8_e4m3fn)
    stored = _e8m0(scale) if scale_format == "ue8m0" else scale
    return QuantizedTensor(FP8_BLOCK, data.contiguous(), stored, (rows, cols), (bn, bk))


def quantize_mxfp4(weight: torch.Tensor) -> QuantizedTensor:
    """MXFP4: per 32 columns a power-of-two scale ``>= amax / 6``, values rounded to the nearest e2m1 (ties to
    the even code), packed low nibble first.  weight: [..., K] with K a multiple of 32."""
    *lead, cols = weight.shape
    if cols % 32:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of 32, got {cols}")
    blocks = weight.float().reshape(*lead, cols // 32, 32)
    scale = _ceil_pow2((blocks.abs().amax(dim=-1) / E2M1_MAX).clamp(min=2.0**-126))
    scaled = blocks / scale.unsqueeze(-1)
    grid = torch.tensor(E2M1_VALUES[:8], device=weight.device)  # non-negative magnitudes, code = index
    dist = (scaled.abs().unsqueeze(-1) - grid).abs()
    # argmin keeps the first minimum, i.e. the lower (even-mantissa-first) code on exact ties
    codes = dist.argmin(dim=-1) | ((scaled < 0).to(torch.int64) << 3)
    codes = codes.reshape(*lead, cols)
    packed = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return QuantizedTensor(MXFP4, packed, _e8m0(scale), (*lead, cols), (1, 32))
