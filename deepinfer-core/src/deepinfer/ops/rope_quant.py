"""V4.1's rotations with their QAT fake-quantizer, as one op each, so a backend can quantize in the epilogue of
the kernel that rotates (one pass over the rows instead of two, one launch instead of two).

The references are exactly the compositions the model made before (``fp8_e4m3_fake_quant(rms_norm_rope(...))``,
``fp4_e2m1_fake_quant(rope(...))``): the CPU path, and so every logit, keeps its bits.  The quantizer sees the
rotated rows rounded to ``x.dtype``, as the two ops compose; a row width that is no multiple of ``block`` stays
unquantized, as the standalone quantizers leave it.

Conformance (:func:`quantized_close`): an implementation may differ from the reference in the rounding of the
norm or the rotation (rsqrt, sin/cos); a value next to a grid midpoint then rounds to the neighbouring grid point,
and a block maximum next to a scale boundary rescales its block.  So most values must agree bit for bit and the
rest by at most two grid steps of their block; the quantizer's own arithmetic is held bit for bit by the backend's
tests (the fused kernel against the reference quantizer of its own unquantized rows).
"""

from __future__ import annotations

from typing import Any

import torch

from deepinfer.ops.fake_quant import ScaleFormat, fp4_e2m1_fake_quant, fp8_e4m3_fake_quant
from deepinfer.ops.registry import DEFAULT_TOLERANCES, OpSample, assert_close, reference_op
from deepinfer.ops.rope import rms_norm_rope, rope

#: The share of values that may round to a neighbouring grid point (or sit in a rescaled block).
FLIP_SHARE = 0.125


def _inv_freq(rope_dim: int) -> torch.Tensor:
    return 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))


def _rms_norm_rope_fp8_samples(dtype: torch.dtype, gen: torch.Generator):
    # V4.1-Flash's window K=V (512, rope 64, fp32 or bf16 norm weight), a head-split case, tiny dims; 48 channels
    # are no multiple of the block: rotated, not quantized.
    for rows, heads, dim, rope_dim, w_dtype in [(9, 1, 512, 64, torch.float32), (5, 1, 512, 64, dtype),
                                                 (3, 4, 128, 64, None), (6, 1, 64, 16, torch.float32),
                                                 (4, 1, 48, 16, torch.float32)]:
        shape = (rows, heads, dim) if heads > 1 else (rows, dim)
        x = (3 * torch.randn(*shape, generator=gen)).to(dtype)
        w = None if w_dtype is None else (1 + 0.1 * torch.randn(dim, generator=gen)).to(w_dtype)
        positions = torch.randint(0, 4096, (rows,), generator=gen)
        label = f"{shape} rope {rope_dim} weight {w_dtype}"
        yield OpSample((x, w, 1e-6, positions, _inv_freq(rope_dim), 1.0, 32), label=label)
        yield OpSample((x, w, 1e-6, positions, _inv_freq(rope_dim), 1.25, 32), label=f"{label} scaled")
    wide = (3 * torch.randn(7, 512 + 96, generator=gen)).to(dtype)  # the model's column slice of its projection
    w = (1 + 0.1 * torch.randn(512, generator=gen)).float()
    yield OpSample((wide[:, :512], w, 1e-6, torch.randint(0, 4096, (7,), generator=gen), _inv_freq(64), 1.0, 32),
                   label="(7, 512) column slice")


def _rope_fp4_samples(dtype: torch.dtype, gen: torch.Generator):
    # V4.1-Flash: compressed entries (512, rope 64, NVFP4-like), index queries (32 x 128) and keys (128, MXFP4);
    # tiny dims; 48 channels: rotated, not quantized.
    for rows, heads, dim, rope_dim, block, fmt in [(9, 1, 512, 64, 16, "e4m3"), (5, 32, 128, 64, 32, "ue8m0"),
                                                    (7, 1, 128, 64, 32, "ue8m0"), (6, 4, 64, 16, 16, "e4m3"),
                                                    (3, 1, 64, 16, 32, "ue8m0"), (4, 1, 48, 16, 32, "ue8m0")]:
        shape = (rows, heads, dim) if heads > 1 else (rows, dim)
        x = torch.randn(*shape, generator=gen).to(dtype)
        positions = torch.randint(0, 4096, (rows,), generator=gen)
        label = f"{shape} rope {rope_dim} block {block} {fmt}"
        yield OpSample((x, positions, _inv_freq(rope_dim), 1.0, block, fmt), label=label)
        yield OpSample((x, positions, _inv_freq(rope_dim), 1.25, block, fmt), label=f"{label} scaled")


def _grid(sample: OpSample) -> tuple[int, int]:
    """(block, mantissa bits) of the sample's quantizer; block 0 when the row stays unquantized."""
    x, args = sample.args[0], sample.args
    block, mantissa = (args[6], 3) if len(args) == 7 else (args[4], 1)
    return (0 if x.shape[-1] % block else block), mantissa


def quantized_close(actual: Any, expected: Any, sample: OpSample, dtype: torch.dtype) -> None:
    """Bits equal but for at most :data:`FLIP_SHARE` of the values, each within two grid steps of its block
    (``2 * amax * 2^-mantissa``: covers a neighbouring grid point and a block rescaled by a power of two).
    An unquantized row (width no multiple of the block) is held to the rotation's own tolerance."""
    where = f"[{sample.label}] ({dtype})"
    assert actual.shape == expected.shape and actual.dtype == expected.dtype, f"{where}: shape/dtype differ"
    block, mantissa = _grid(sample)
    a, e = actual.detach().cpu().float(), expected.float()
    if not block:
        assert_close(actual, expected, dtype, DEFAULT_TOLERANCES[dtype], where)
        return
    step = e.reshape(*e.shape[:-1], -1, block).abs().amax(-1, keepdim=True) * 2.0 ** (1 - mantissa)
    diff = (a - e).reshape(*e.shape[:-1], -1, block).abs()
    assert bool((diff <= step).all()), f"{where}: a value is more than two grid steps off"
    flips = (actual.detach().cpu() != expected).float().mean().item()
    assert flips <= FLIP_SHARE, f"{where}: {flips:.1%} of the values differ (at most {FLIP_SHARE:.1%} may)"


@reference_op(sample_inputs=_rms_norm_rope_fp8_samples, rows=(0, 3), compare=quantized_close)
def rms_norm_rope_fp8_e4m3_fake_quant(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    block: int,
) -> torch.Tensor:
    """``fp8_e4m3_fake_quant(rms_norm_rope(x, weight, eps, positions, inv_freq, attention_scaling), block)``.

    quant: V4.1's sliding-window K=V latent (block 32): normalised, rotated, rounded to ``x.dtype``, then FP8 with
    a ue8m0 scale per ``block`` channels.  x: [T, D] or [T, H, D]; the rest as :func:`~deepinfer.ops.rope.
    rms_norm_rope`.  Returns x's shape and dtype (rotated but unquantized if ``D % block``).
    """
    return fp8_e4m3_fake_quant(rms_norm_rope(x, weight, eps, positions, inv_freq, attention_scaling), block)


@reference_op(sample_inputs=_rope_fp4_samples, rows=(0, 1), compare=quantized_close)
def rope_fp4_e2m1_fake_quant(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float,
    block: int,
    scale_format: ScaleFormat,
) -> torch.Tensor:
    """``fp4_e2m1_fake_quant(rope(x, positions, inv_freq, attention_scaling), block, scale_format)``.

    quant: V4.1's compressed entries (``16, "e4m3"``) and indexer queries and keys (``32, "ue8m0"``): rotated,
    rounded to ``x.dtype``, then FP4 with one scale per ``block`` channels.  x: [T, D] or [T, H, D]; the rest as
    :func:`~deepinfer.ops.rope.rope`.  Returns x's shape and dtype (rotated but unquantized if ``D % block``).
    """
    return fp4_e2m1_fake_quant(rope(x, positions, inv_freq, attention_scaling), block, scale_format)
