"""Rows of V4.1's state in the model's own formats: pack a row into bytes, unpack it to values.

V4.1 fake-quantizes its K=V latents and indexer keys where they enter the state (:mod:`.fake_quant`), so the
state may store them quantized with no change to any logit: ``unpack(pack(x))`` is bit for bit
``fake_quant(x)``.  Pack the row the model would fake-quantize, not its fake-quantized values: with a ue8m0 scale
re-packing those gives them back, but an e4m3 scale may be subnormal (a block's amax below 6 * 2^-6), rounded far
from amax / 6, and a scale re-derived from the rounded values then differs.

A packed row is its codes, then one scale byte per block (the stored sizes of DeepSeek's formats):
- FP8 e4m3 with a ue8m0 scale per ``block``: D code bytes + D / block exponent bytes (SWA K=V: 512 + 16 = 528 B);
- FP4 e2m1 with an e4m3 or ue8m0 scale per ``block``: D / 2 bytes (two codes a byte, low nibble first) + D / block
  scale bytes (compressed latent, block 16, e4m3: 256 + 32 = 288 B; indexer key, block 32, ue8m0: 64 + 4 = 68 B).
"""

from __future__ import annotations

import torch

from deepinfer.ops.fake_quant import (
    ScaleFormat,
    _quant_samples,
    fp4_e2m1_grid,
    fp8_e4m3_grid,
    same_bits,
)
from deepinfer.ops.registry import OpSample, reference_op


def _check_width(x: torch.Tensor, block: int) -> None:
    if x.shape[-1] % block:
        raise ValueError(f"a packed row needs its last dim ({x.shape[-1]}) to be a multiple of block ({block})")


def _exponent_bytes(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0: the biased exponent of a power-of-two fp32 scale (>= 2^-126)."""
    return ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def _from_exponent_bytes(e: torch.Tensor) -> torch.Tensor:
    return (e.to(torch.int32) << 23).view(torch.float32)


def _scale_bytes(scale: torch.Tensor, scale_format: ScaleFormat) -> torch.Tensor:
    if scale_format == "ue8m0":
        return _exponent_bytes(scale)
    return scale.to(torch.float8_e4m3fn).view(torch.uint8)  # exact: the scale is an e4m3 value


def _scale_values(b: torch.Tensor, scale_format: ScaleFormat) -> torch.Tensor:
    if scale_format == "ue8m0":
        return _from_exponent_bytes(b)
    return b.contiguous().view(torch.float8_e4m3fn).float()


def _packed_samples(with_format: bool):
    def samples(dtype: torch.dtype, gen: torch.Generator):
        blocks = (16, 32) if with_format else (32,)
        for x, block, label in _quant_samples(blocks)(dtype, gen):
            if x.shape[-1] % block:
                continue
            for fmt in ("e4m3", "ue8m0") if with_format else ("ue8m0",):
                yield x, block, fmt, f"{label} {fmt}"

    return samples


def _fp8_pack_samples(dtype: torch.dtype, gen: torch.Generator):
    for x, block, _, label in _packed_samples(False)(dtype, gen):
        yield OpSample((x, block), label=label)


@reference_op(sample_inputs=_fp8_pack_samples, rows=(0,))
def fp8_e4m3_pack(x: torch.Tensor, block: int) -> torch.Tensor:
    """x [..., D] (D a multiple of ``block``) as packed FP8 rows [..., D + D / block] uint8: the e4m3 codes of
    :func:`~.fake_quant.fp8_e4m3_fake_quant`, then each block's ue8m0 scale byte."""
    _check_width(x, block)
    q, scale = fp8_e4m3_grid(x, block)
    codes = q.to(torch.float8_e4m3fn).view(torch.uint8).flatten(-2)  # exact: q is an e4m3 value
    return torch.cat([codes, _exponent_bytes(scale).squeeze(-1)], dim=-1)


def _fp8_unpack_samples(dtype: torch.dtype, gen: torch.Generator):
    for x, block, _, label in _packed_samples(False)(dtype, gen):
        yield OpSample((fp8_e4m3_pack(x, block), block, dtype), label=label)


@reference_op(sample_inputs=_fp8_unpack_samples, rows=(0,), compare=same_bits)
def fp8_e4m3_unpack(packed: torch.Tensor, block: int, dtype: torch.dtype) -> torch.Tensor:
    """Packed FP8 rows [..., D + D / block] uint8 -> values [..., D] in ``dtype`` (``code * scale`` in fp32)."""
    width = packed.shape[-1] * block // (block + 1)
    codes = packed[..., :width].contiguous().view(torch.float8_e4m3fn).float()
    scale = _from_exponent_bytes(packed[..., width:])
    q = codes.view(*packed.shape[:-1], width // block, block)
    return (q * scale.unsqueeze(-1)).view(*packed.shape[:-1], width).to(dtype)


def _fp4_pack_samples(dtype: torch.dtype, gen: torch.Generator):
    for x, block, fmt, label in _packed_samples(True)(dtype, gen):
        yield OpSample((x, block, fmt), label=label)


@reference_op(sample_inputs=_fp4_pack_samples, rows=(0,))
def fp4_e2m1_pack(x: torch.Tensor, block: int, scale_format: ScaleFormat) -> torch.Tensor:
    """x [..., D] as packed FP4 rows [..., D / 2 + D / block] uint8: the e2m1 codes of
    :func:`~.fake_quant.fp4_e2m1_fake_quant` two a byte (low nibble = even channel), then each block's scale byte
    (e4m3 code, or ue8m0 exponent)."""
    _check_width(x, block)
    q, scale = fp4_e2m1_grid(x, block, scale_format)
    m = q.abs()  # e2m1 magnitudes 0, .5, 1, 1.5, 2 -> codes 0..4; 3, 4, 6 -> 5, 6, 7
    code = torch.where(m <= 2, m * 2, torch.where(m == 3, 5.0, torch.where(m == 4, 6.0, 7.0))).to(torch.uint8)
    code = (code | ((q < 0).to(torch.uint8) << 3)).flatten(-2)
    nibbles = code[..., 0::2] | (code[..., 1::2] << 4)
    return torch.cat([nibbles, _scale_bytes(scale, scale_format).squeeze(-1)], dim=-1)


def _e2m1_values(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of e2m1 codes (int32 0..15), by arithmetic: ``(2 + m) * 2^(e - 2)``, ``m / 2`` when e = 0, signed
    by bit 3 (no lookup table to copy to the device: a CUDA graph can capture it)."""
    e, m = (codes >> 1) & 3, (codes & 1).float()
    mag = torch.where(e == 0, m * 0.5, (2.0 + m) * torch.exp2((e - 2).float()))
    return torch.where((codes & 8) != 0, -mag, mag)


def _fp4_unpack_samples(dtype: torch.dtype, gen: torch.Generator):
    for x, block, fmt, label in _packed_samples(True)(dtype, gen):
        yield OpSample((fp4_e2m1_pack(x, block, fmt), block, fmt, dtype), label=label)


@reference_op(sample_inputs=_fp4_unpack_samples, rows=(0,), compare=same_bits)
def fp4_e2m1_unpack(packed: torch.Tensor, block: int, scale_format: ScaleFormat, dtype: torch.dtype
                    ) -> torch.Tensor:
    """Packed FP4 rows [..., D / 2 + D / block] uint8 -> values [..., D] in ``dtype`` (``value * scale`` in
    fp32)."""
    width = packed.shape[-1] * 2 * block // (block + 2)
    bytes_ = packed[..., : width // 2].to(torch.int32)
    q = _e2m1_values(torch.stack((bytes_ & 0xF, bytes_ >> 4), dim=-1).flatten(-2))
    scale = _scale_values(packed[..., width // 2 :], scale_format)
    q = q.view(*packed.shape[:-1], width // block, block)
    return (q * scale.unsqueeze(-1)).view(*packed.shape[:-1], width).to(dtype)
