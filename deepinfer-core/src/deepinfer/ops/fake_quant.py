"""QAT fake-quantization: round activations onto a block-scaled low-precision grid and back (DeepSeek-V4.1).

V4.1 was trained with these in its forward pass, so the reference applies them at inference too:
FP8 to every layer's sliding-window K=V, FP4 to the compressed latents and to the indexer's queries and keys.
Common rules (the reference's): blocks of ``block`` channels along the last dim, one scale per block; a tensor
whose last dim is not a multiple of ``block`` is returned unchanged (tiny test configs run unquantized);
math in fp32; the dequantized result is cast back to ``x.dtype`` (exact for bf16: at most 6 significant bits).

Rounding is written out instead of using torch's ``float8_e4m3fn`` cast, whose out-of-range behaviour differs
between builds and devices (torch 2.13 CPU saturates to 448, inf included): :func:`round_to_grid` rounds to
nearest, ties to even, saturating, with exponents and powers of two taken from the fp32 bits, so every device
gives the same bits.  The e2m1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} is the same rule with 1 mantissa bit:
ties at 0.25, 1.25, 2.5, 5 round down and at 0.75, 1.75, 3.5 up, to the even code.
"""

from __future__ import annotations

from typing import Any, Literal

import torch

from deepinfer.ops.registry import OpSample, reference_op

FP8_MAX = 448.0  # float8_e4m3fn: 3 mantissa bits, smallest normal exponent -6, no inf
FP4_MAX = 6.0  # float4_e2m1: 1 mantissa bit, smallest normal exponent 0
#: Floors of a block's amax: FP8 (ue8m0 scale); FP4 with an e4m3 scale (scale >= 2^-9, e4m3's smallest
#: subnormal, so it never flushes to 0); FP4 with a ue8m0 scale (scale >= 2^-126, fp32's smallest normal).
FP8_AMAX_FLOOR = 1e-4
FP4_E4M3_AMAX_FLOOR = 6.0 * 2.0**-9
FP4_UE8M0_AMAX_FLOOR = 6.0 * 2.0**-126
ScaleFormat = Literal["e4m3", "ue8m0"]


def _exponent(a: torch.Tensor) -> torch.Tensor:
    """The unbiased exponent field of fp32 ``a`` as int32 (``floor(log2 a)`` for normal a > 0; -127 for 0)."""
    return ((a.contiguous().view(torch.int32) >> 23) & 0xFF) - 127


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """``2^k`` as fp32 for int32 ``k`` in [-126, 128] (128 gives inf), built from bits: exact on every device."""
    return ((k + 127) << 23).view(torch.float32)


def pow2_ceil(t: torch.Tensor) -> torch.Tensor:
    """``2^ceil(log2 t)`` for fp32 ``t >= 2^-126`` (the ue8m0 scale), exponent from the bits: the exponent field,
    plus one unless the mantissa is zero."""
    bits = t.contiguous().view(torch.int32)
    k = _exponent(t) + ((bits & 0x7FFFFF) != 0).to(torch.int32)
    return _pow2(k.clamp(max=128))


def round_to_grid(v: torch.Tensor, mantissa_bits: int, min_exponent: int, max_value: float) -> torch.Tensor:
    """fp32 ``v`` rounded to the nearest value of a small float format (ties to even), saturating at
    ``±max_value``: e4m3 is ``(3, -6, 448)``, e2m1 ``(1, 0, 6)``.  Below the smallest normal exponent the
    spacing stays that of the subnormals.  The sign (of zero too) is kept; NaN stays NaN."""
    a = v.abs()
    ulp = _pow2(_exponent(a).clamp(min=min_exponent) - mantissa_bits)
    r = (torch.round(a / ulp) * ulp).clamp(max=max_value)  # both products exact: ulp is a power of two
    return torch.where(torch.signbit(v), -r, r)


def _blocks(x: torch.Tensor, block: int) -> torch.Tensor:
    return x.float().view(*x.shape[:-1], x.shape[-1] // block, block)


def _quant_samples(blocks: tuple[int, ...]):
    def samples(dtype: torch.dtype, gen: torch.Generator):
        for rows, shape in [(5, (64,)), (17, (3, 128)), (33, (512,))]:
            spread = torch.exp2(torch.randint(-20, 12, (rows, *shape[:-1], shape[-1] // 16, 1), generator=gen))
            x = (torch.randn(rows, *shape, generator=gen).view(*spread.shape[:-1], 16) * spread).view(rows, *shape)
            x[0] = 0.0
            if rows > 1:  # grid points and midpoints of both formats, at two scales
                grid = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, 0.5, 448.0, 1e-7, -0.0])
                x[1].view(-1)[: 2 * grid.numel()] = torch.cat([grid, -grid * 2.0**-5])
            x = x.to(dtype)
            for block in blocks:
                yield x, block, f"{tuple(x.shape)} block {block}"
        ragged = torch.randn(4, 40, generator=gen).to(dtype)  # 40 channels: not a multiple of 16 or 32
        for block in blocks:
            yield ragged, block, f"{tuple(ragged.shape)} block {block}: passes through"

    return samples


def _fp8_samples(dtype: torch.dtype, gen: torch.Generator):
    for x, block, label in _quant_samples((32,))(dtype, gen):
        yield OpSample((x, block), label=label)


def _fp4_samples(dtype: torch.dtype, gen: torch.Generator):
    for x, block, label in _quant_samples((16, 32))(dtype, gen):
        for fmt in ("e4m3", "ue8m0"):
            yield OpSample((x, block, fmt), label=f"{label} {fmt}")


_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def same_bits(actual: Any, expected: Any, sample: OpSample, dtype: torch.dtype) -> None:
    """Exact comparison: same shape, dtype and bits (``-0.0`` differs from ``0.0``)."""
    where = f"[{sample.label}] ({dtype})"
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, f"{where}: shape/dtype differ"
    view = _INT_VIEW[expected.dtype]
    a, e = actual.detach().cpu().contiguous().view(view), expected.contiguous().view(view)
    if not torch.equal(a, e):
        bad = tuple((a != e).nonzero()[0].tolist())
        raise AssertionError(f"{where}: bits differ first at {list(bad)}: {actual.cpu()[bad]} != {expected[bad]}")


@reference_op(sample_inputs=_fp8_samples, rows=(0,), compare=same_bits)
def fp8_e4m3_fake_quant(x: torch.Tensor, block: int) -> torch.Tensor:
    """FP8 e4m3 with a ue8m0 (power-of-two) scale per ``block`` channels, quantized and dequantized.

    quant: V4.1 applies it (block 32) to every layer's sliding-window K=V after RoPE, the whole head vector.
    Per block: ``s = pow2_ceil(max(amax, 1e-4) * fp32(1/448))`` (a multiply by the fp32 reciprocal, as the
    reference; a divide differs in the last ulp), ``x -> e4m3(clamp(x / s, ±448)) * s``.
    x: [..., D] any float dtype.  Returns x's shape and dtype; ``x`` itself if ``D % block``.
    """
    if x.shape[-1] % block:
        return x
    q, scale = fp8_e4m3_grid(x, block)
    return (q * scale).view(x.shape).to(x.dtype)


def fp8_e4m3_grid(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp8_e4m3_fake_quant`'s parts: (e4m3 values [..., D / block, block], power-of-two scales
    [..., D / block, 1]), both fp32; their product is the fake-quantized x.  ``D % block == 0``."""
    blocks = _blocks(x, block)
    scale = pow2_ceil(blocks.abs().amax(-1, keepdim=True).clamp_min(FP8_AMAX_FLOOR) * (1.0 / FP8_MAX))
    return round_to_grid((blocks / scale).clamp(-FP8_MAX, FP8_MAX), 3, -6, FP8_MAX), scale


@reference_op(sample_inputs=_fp4_samples, rows=(0,), compare=same_bits)
def fp4_e2m1_fake_quant(x: torch.Tensor, block: int, scale_format: ScaleFormat) -> torch.Tensor:
    """FP4 e2m1 with one scale per ``block`` channels, quantized and dequantized.

    quant: V4.1 applies ``(16, "e4m3")`` to the compressed KV latents of kv-source layers after RoPE (NVFP4-like),
    and ``(32, "ue8m0")`` to the indexer's keys and queries after RoPE (MXFP4).
    Per block: ``s = e4m3(max(amax, 6·2^-9) / 6)`` (a true divide, then round to e4m3) or
    ``s = pow2_ceil(max(amax, 6·2^-126) * fp32(1/6))``; ``x -> e2m1(clamp(x / s, ±6)) * s``, where a zero
    is +0 whatever its sign (the reference's code table maps -0 to +0).
    x: [..., D] any float dtype.  Returns x's shape and dtype; ``x`` itself if ``D % block``.
    """
    if x.shape[-1] % block:
        _check_scale_format(scale_format)
        return x
    q, scale = fp4_e2m1_grid(x, block, scale_format)
    return (q * scale).view(x.shape).to(x.dtype)


def _check_scale_format(scale_format: str) -> None:
    if scale_format not in ("e4m3", "ue8m0"):
        raise ValueError(f"scale_format must be 'e4m3' or 'ue8m0', got {scale_format!r}")


def fp4_e2m1_grid(x: torch.Tensor, block: int, scale_format: ScaleFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`fp4_e2m1_fake_quant`'s parts: (e2m1 values [..., D / block, block], no -0; scales
    [..., D / block, 1], e4m3 values or powers of two), both fp32.  ``D % block == 0``."""
    _check_scale_format(scale_format)
    blocks = _blocks(x, block)
    amax = blocks.abs().amax(-1, keepdim=True)
    if scale_format == "e4m3":
        scale = round_to_grid(amax.clamp_min(FP4_E4M3_AMAX_FLOOR) / FP4_MAX, 3, -6, FP8_MAX)
    else:
        scale = pow2_ceil(amax.clamp_min(FP4_UE8M0_AMAX_FLOOR) * (1.0 / FP4_MAX))
    return round_to_grid((blocks / scale).clamp(-FP4_MAX, FP4_MAX), 1, 0, FP4_MAX) + 0.0, scale  # -0 -> +0
