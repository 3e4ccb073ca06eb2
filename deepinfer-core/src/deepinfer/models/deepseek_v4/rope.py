"""RoPE frequency tables for V4's two families: plain (sliding layers) and YaRN (compressed layers)."""

from __future__ import annotations

import math

import torch

from deepinfer.models.deepseek_v4.config import RopeSpec


def inv_freq(spec: RopeSpec, rope_dim: int) -> torch.Tensor:
    """[rope_dim / 2] fp32 angular frequencies; YaRN blends interpolated and extrapolated frequencies
    with a linear ramp between the correction dims of ``beta_fast`` and ``beta_slow`` rotations."""
    exponents = torch.arange(0, rope_dim, 2, dtype=torch.float32) / rope_dim
    if spec.rope_type == "default":
        return 1.0 / (spec.theta**exponents)
    pos_freqs = spec.theta**exponents
    extrapolated = 1.0 / pos_freqs
    interpolated = 1.0 / (spec.factor * pos_freqs)

    def correction_dim(rotations: float) -> float:
        wavelength = spec.original_max_position_embeddings / (rotations * 2 * math.pi)
        return (rope_dim * math.log(wavelength)) / (2 * math.log(spec.theta))

    # transformers always truncates the correction range for V4 (it reads `truncate` from the outer dict)
    low = max(math.floor(correction_dim(spec.beta_fast)), 0)
    high: float = min(math.ceil(correction_dim(spec.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_weight = 1 - ramp
    return interpolated * (1 - extrapolation_weight) + extrapolated * extrapolation_weight
