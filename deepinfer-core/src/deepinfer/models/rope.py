"""RoPE as both DeepSeek-V4 models configure it: one family's parameters (plain or YaRN) read from config.json,
and its frequency table.  Each model reads its own dialect of which families there are (V4's
``deepseek_v4/rope_config.py``, V4.1's ``deepseek_v41/config.py``)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer.models.config_fields import Fields


@dataclass(slots=True, frozen=True)
class RopeSpec:
    """One RoPE family: plain (``default``) or YaRN-scaled; ``attention_scaling`` multiplies cos and sin."""

    rope_type: str
    theta: float
    factor: float = 1.0
    original_max_position_embeddings: int = 0
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    attention_scaling: float = 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_spec(p: Fields | None, theta: float, max_pos: int, attention_factor: float | None = None) -> RopeSpec:
    """One rope family from its parameters (None: plain rope at ``theta``); ``attention_factor`` is the
    default when the parameters name none."""
    if p is None:
        return RopeSpec("default", theta)
    kinds = ("default", "yarn")
    key = "rope_type" if p.has("rope_type") else "type"  # transformers' name, or the legacy one
    rope_type = p.string(key, "default", choices=kinds)
    if rope_type == "default":
        return RopeSpec("default", theta)
    original = p.integer("original_max_position_embeddings", lo=1)
    factor = p.optional_number("factor", lo=0, lo_open=True)
    factor = max_pos / original if factor is None else factor
    scaling = p.optional_number("attention_factor", attention_factor, lo=0, lo_open=True)
    if scaling is None:  # transformers derives it; V4's own configs pin it to 1
        mscale = p.optional_number("mscale", lo=0)
        mscale_all_dim = p.optional_number("mscale_all_dim", lo=0)
        if mscale and mscale_all_dim:
            scaling = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            scaling = _yarn_mscale(factor)
    beta_fast = p.number("beta_fast", 32.0, lo=0, lo_open=True) if p.has("beta_fast") else 32.0
    beta_slow = p.number("beta_slow", 1.0, lo=0, lo_open=True) if p.has("beta_slow") else 1.0
    return RopeSpec("yarn", theta, factor, original, beta_fast, beta_slow, scaling)


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
