"""DeepSeek-V4's two RoPE families as config.json describes them, in either dialect.

Sliding layers use plain RoPE at ``rope_theta``; compressed layers (and their compressors and indexer) use
``compress_rope_theta``, YaRN-scaled.  Released configs give one flat ``rope_scaling`` dict (for the compressed
family only); transformers writes ``rope_parameters`` with ``main`` and ``compress`` sections.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


def rope_dim_of(f: Fields, head_dim: int) -> int:
    """``qk_rope_head_dim``, or ``head_dim × partial_rotary_factor``; even, within ``head_dim``."""
    factor = f.optional_number("partial_rotary_factor", lo=0, lo_open=True, hi=1)
    if f.has("qk_rope_head_dim"):
        rope_dim = f.integer("qk_rope_head_dim", lo=2, hi=head_dim)
        if factor is not None and int(head_dim * factor) != rope_dim:
            raise f.error("partial_rotary_factor", f"qk_rope_head_dim / head_dim = {rope_dim}/{head_dim}")
        field = "qk_rope_head_dim"
    else:
        rope_dim, field = int(head_dim * (64 / 512 if factor is None else factor)), "partial_rotary_factor"
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise f.error(field, f"a rope dim that is even and within head_dim {head_dim} (it gives {rope_dim})")
    return rope_dim


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_spec(p: Fields | None, theta: float, max_pos: int, attention_factor: float | None = None) -> RopeSpec:
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


def rope_specs(f: Fields, rope_dim: int, head_dim: int, max_pos: int) -> tuple[RopeSpec, RopeSpec]:
    """(sliding layers' rope, compressed layers' rope) from either dialect."""
    rope_theta = f.number("rope_theta", 10000.0, lo=1, lo_open=True)
    compress_theta = f.number("compress_rope_theta", 160000.0, lo=1, lo_open=True)
    nested = f.section("rope_parameters")
    main, compress = (nested.section("main"), nested.section("compress")) if nested is not None else (None, None)
    if nested is not None and (main is None) != (compress is None):
        raise nested.error("main" if main is None else "compress", "an object beside the other rope family")
    if main is not None and compress is not None:
        for params in (main, compress):
            factor = params.optional_number("partial_rotary_factor", lo=0, lo_open=True, hi=1)
            if factor is not None and int(head_dim * factor) != rope_dim:
                raise params.error("partial_rotary_factor", f"the rope dim over head_dim = {rope_dim}/{head_dim}")
        return (_rope_spec(main, main.number("rope_theta", rope_theta, lo=1, lo_open=True), max_pos),
                _rope_spec(compress, compress.number("rope_theta", compress_theta, lo=1, lo_open=True), max_pos))
    # Legacy / flat: the scaling dict applies to the compressed branches only (plain rope on sliding layers),
    # and a YaRN compress rope defaults to attention_factor 1 (V4 does not scale cos / sin).
    flat = f.section("rope_scaling")
    flat = flat if flat is not None and flat.raw else nested
    return RopeSpec("default", rope_theta), _rope_spec(flat, compress_theta, max_pos, attention_factor=1.0)
