"""Rotary position embedding, DeepSeek-V4 flavour: interleaved pairs on the trailing channels."""

from __future__ import annotations

import torch

from deepinfer.ops.norm import rms_norm
from deepinfer.ops.registry import OpSample, reference_op


def _rope_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, heads, dim, rope_dim in [(5, 4, 64, 16), (17, 1, 512, 64), (9, 8, 128, 64), (4, 2, 64, 12)]:
        shape = (rows, heads, dim) if heads > 1 else (rows, dim)
        x = torch.randn(*shape, generator=gen).to(dtype)
        positions = torch.randint(0, 4096, (rows,), generator=gen)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
        yield OpSample((x, positions, inv_freq), label=f"{tuple(shape)} rope {rope_dim}")
        yield OpSample((x, positions, inv_freq), {"inverse": True}, label=f"{tuple(shape)} inverse")
        yield OpSample((x, positions, inv_freq), {"attention_scaling": 1.25}, label=f"{tuple(shape)} scaled")


@reference_op(sample_inputs=_rope_samples, rows=(0, 1))
def rope(
    x: torch.Tensor,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
    inverse: bool = False,
) -> torch.Tensor:
    """Rotate the last ``2 * len(inv_freq)`` channels of every row by its position; the rest pass through.

    Channel pairs are interleaved: ``(x[2i], x[2i+1])`` rotates by ``positions * inv_freq[i]``.
    ``inverse=True`` rotates by the negative angle (V4 applies it to the attention output, whose values carry
    the keys' rotation).  cos/sin are scaled by ``attention_scaling`` (YaRN's mscale; 1 for V4).

    x: [T, D] or [T, H, D], any float dtype; positions: [T] int64; inv_freq: [R/2] fp32.
    The rotation is computed in fp32; returns x's shape and dtype.
    """
    half = inv_freq.numel()
    freqs = positions.to(torch.float32)[:, None] * inv_freq.to(torch.float32)[None, :]  # [T, R/2]
    cos = freqs.cos() * attention_scaling
    sin = freqs.sin() * attention_scaling
    if inverse:
        sin = -sin
    bshape = (freqs.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cos.view(bshape), sin.view(bshape)
    rot = x[..., -2 * half :].float()
    even, odd = rot[..., 0::2], rot[..., 1::2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2)
    return torch.cat((x[..., : -2 * half], rotated.to(x.dtype)), dim=-1)


def _rms_norm_rope_samples(dtype: torch.dtype, gen: torch.Generator):
    cases = [(5, 4, 64, 16, None), (17, 1, 512, 64, torch.float32), (9, 8, 128, 64, None),
             (6, 1, 128, 64, torch.float32), (3, 64, 512, 64, None), (4, 1, 64, 16, dtype), (4, 2, 64, 12, None)]
    for rows, heads, dim, rope_dim, w_dtype in cases:
        shape = (rows, heads, dim) if heads > 1 else (rows, dim)
        x = (3 * torch.randn(*shape, generator=gen)).to(dtype)
        w = None if w_dtype is None else (1 + 0.1 * torch.randn(dim, generator=gen)).to(w_dtype)
        positions = torch.randint(0, 4096, (rows,), generator=gen)
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim))
        label = f"{tuple(shape)} rope {rope_dim} weight {w_dtype}"
        yield OpSample((x, w, 1e-6, positions, inv_freq), label=label)
        yield OpSample((x, w, 1e-6, positions, inv_freq, 1.25), label=f"{label} scaled")
    # The K=V latent as the model has it: a column slice of the fused input projection (rows strided).
    wide = torch.randn(7, 512 + 96, generator=gen).to(dtype)
    w = (1 + 0.1 * torch.randn(512, generator=gen)).float()
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    yield OpSample((wide[:, :512], w, 1e-6, torch.randint(0, 4096, (7,), generator=gen), inv_freq),
                   label="(7, 512) column slice")


@reference_op(sample_inputs=_rms_norm_rope_samples, rows=(0, 3))
def rms_norm_rope(
    x: torch.Tensor,
    weight: torch.Tensor | None,
    eps: float,
    positions: torch.Tensor,
    inv_freq: torch.Tensor,
    attention_scaling: float = 1.0,
) -> torch.Tensor:
    """``rope(rms_norm(x, weight, eps), positions, inv_freq, attention_scaling)``, as one op so a backend can
    fuse the two (V4 normalises then rotates its queries per head and its K=V latent: one pass instead of two).

    The norm's output is rounded to ``x.dtype`` before the rotation, exactly as the two ops compose.
    x: [T, D] or [T, H, D], any float dtype (the norm runs over D, per head); weight: [D] or None;
    positions: [T] int64; inv_freq: [R/2] fp32.  Returns x's shape and dtype.
    """
    return rope(rms_norm(x, weight, eps), positions, inv_freq, attention_scaling)
