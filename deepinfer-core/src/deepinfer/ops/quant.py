"""Dequantization of the released checkpoint formats (FP8 block-scaled, MXFP4), and the gather of FP8 table rows."""

from __future__ import annotations

import torch

from deepinfer.ops.linear import embedding
from deepinfer.ops.registry import OpSample, reference_op
from deepinfer.quant.formats import E2M1_VALUES


def scale_values(scale: torch.Tensor) -> torch.Tensor:
    """Scales as fp32: e8m0 (``float8_e8m0fnu``, or raw exponent bytes in uint8) means ``2**(e - 127)`` (e = 255:
    NaN), built from the bits (no device needs an e8m0 conversion kernel)."""
    if scale.dtype not in (torch.uint8, torch.float8_e8m0fnu):
        return scale.float()
    e = scale.view(torch.uint8).to(torch.int32)
    value = (e << 23).view(torch.float32)  # 2^(e - 127) for e >= 1
    value = torch.where(e == 0, torch.full_like(value, 2.0**-127), value)
    return torch.where(e == 255, torch.full_like(value, float("nan")), value)


def _fp8_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, cols, block in [(64, 96, (32, 32)), (300, 200, (128, 128))]:
        data = (torch.randn(rows, cols, generator=gen) * 100).to(torch.float8_e4m3fn)
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        exps = torch.randint(-12, 3, grid, generator=gen).float()
        yield OpSample((data, torch.exp2(exps).to(torch.float8_e8m0fnu), *block, dtype), label=f"{rows}x{cols} ue8m0")
        yield OpSample((data, torch.rand(grid, generator=gen) * 1e-2, *block, dtype), label=f"{rows}x{cols} fp32")


@reference_op(sample_inputs=_fp8_samples)
def dequant_fp8_block(
    data: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, dtype: torch.dtype
) -> torch.Tensor:
    """FP8 e4m3 weights with one scale per ``block_n x block_k`` block (edge blocks may be partial).

    data: [N, K] float8_e4m3fn; scale: [ceil(N/block_n), ceil(K/block_k)] fp32, bf16, float8_e8m0fnu or uint8
    e8m0 bytes.  Returns ``data * scale`` as [N, K] in ``dtype`` (products formed in fp32).
    """
    rows, cols = data.shape
    s = scale_values(scale).repeat_interleave(block_n, dim=0)[:rows].repeat_interleave(block_k, dim=1)[:, :cols]
    return (data.float() * s).to(dtype)


#: E4M3 code bytes that are NaN (S.1111.111): no table holds them, and the samples draw none.
E4M3_NAN_CODES = (0x7F, 0xFF)


def _embedding_fp8_samples(dtype: torch.dtype, gen: torch.Generator):
    finite = torch.tensor([c for c in range(256) if c not in E4M3_NAN_CODES], dtype=torch.uint8)
    # (rows, width, block, ids): V4.1's scale block of 32 at small widths, a partial last block, a 256-wide table
    for rows, width, block, n in [(97, 64, 32, 5), (50, 80, 32, 9), (1000, 256, 32, 33)]:
        codes = finite[torch.randint(0, len(finite), (rows, width), generator=gen)].view(torch.float8_e4m3fn)
        ids = torch.randint(0, rows, (n,), generator=gen)
        ids[-1] = ids[0]  # a repeated row
        exps = torch.randint(100, 140, (rows, -(-width // block)), generator=gen, dtype=torch.uint8)
        exps[ids[1], 0] = 0  # e8m0's smallest scale, 2^-127: fp32 subnormal products
        label = f"{rows}x{width}/{block}[{n}]"
        yield OpSample((ids, codes, exps.view(torch.float8_e8m0fnu), block, dtype), label=f"{label} e8m0")
        yield OpSample((ids, codes.view(torch.uint8), exps, block, dtype), label=f"{label} e8m0 bytes")
        yield OpSample((ids, codes, torch.rand(exps.shape, generator=gen) * 1e-2, block, dtype), label=f"{label} fp32")


@reference_op(sample_inputs=_embedding_fp8_samples, tolerances={torch.float32: (0.0, 0.0),
                                                                  torch.bfloat16: (0.0, 0.0)}, rows=(0,))
def embedding_fp8(
    ids: torch.Tensor, table: torch.Tensor, scale: torch.Tensor, block: int, dtype: torch.dtype
) -> torch.Tensor:
    """Rows of an FP8 e4m3 table with one scale per ``block`` columns of each row, dequantized: an FP8 Engram
    table's lookup as one op (a backend gathers and scales in one pass, no FP8 intermediate).

    ids: [T] int64 (valid rows: out-of-range ids are an error, here an IndexError); table: [V, D] float8_e4m3fn
    or its bytes (uint8); scale: [V, ceil(D / block)] float8_e8m0fnu or uint8 e8m0 bytes, or float (fp32).
    Returns ``code * scale`` [T, D] in ``dtype``, the product formed in fp32 and rounded once: exactly
    ``dequant_fp8_block`` of the gathered rows and scales (``1 x block`` blocks), which is what this computes.
    """
    rows = embedding(ids, table.view(torch.uint8)).view(torch.float8_e4m3fn)
    scales = embedding(ids, scale.view(torch.uint8) if scale.element_size() == 1 else scale)
    return dequant_fp8_block(rows, scales, 1, block, dtype)


def _mxfp4_samples(dtype: torch.dtype, gen: torch.Generator):
    for shape in [(16, 64), (4, 48, 128)]:
        packed = torch.randint(0, 256, (*shape[:-1], shape[-1] // 2), generator=gen, dtype=torch.uint8)
        exps = torch.randint(-10, 4, (*shape[:-1], shape[-1] // 32), generator=gen).float()
        yield OpSample((packed, torch.exp2(exps).to(torch.float8_e8m0fnu), dtype), label=f"{shape}")
        yield OpSample((packed.view(torch.int8), (exps + 127).to(torch.uint8), dtype), label=f"{shape} int8/u8")


@reference_op(sample_inputs=_mxfp4_samples)
def dequant_mxfp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4: e2m1 values packed two per byte (low nibble = even column), one e8m0 scale per 32 columns.

    packed: [..., K/2] uint8 or int8; scale: [..., K/32] float8_e8m0fnu or uint8 exponent bytes.
    Returns [..., K] in ``dtype``.
    """
    bytes_ = packed.view(torch.uint8).to(torch.int64)
    codes = torch.stack((bytes_ & 0xF, bytes_ >> 4), dim=-1).flatten(-2)  # [..., K]
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=packed.device)
    values = table[codes]
    s = scale_values(scale).repeat_interleave(32, dim=-1)
    return (values * s).to(dtype)
