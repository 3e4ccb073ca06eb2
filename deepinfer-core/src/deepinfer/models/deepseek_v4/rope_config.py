"""DeepSeek-V4's two RoPE families as config.json describes them, in either dialect.

Sliding layers use plain RoPE at ``rope_theta``; compressed layers (and their compressors and indexer) use
``compress_rope_theta``, YaRN-scaled.  Released configs give one flat ``rope_scaling`` dict (for the compressed
family only); transformers writes ``rope_parameters`` with ``main`` and ``compress`` sections.  Each family is
read by :func:`deepinfer.models.rope.rope_spec`.
"""

from __future__ import annotations

from deepinfer.models.config_fields import Fields
from deepinfer.models.rope import RopeSpec, rope_spec


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
        return (rope_spec(main, main.number("rope_theta", rope_theta, lo=1, lo_open=True), max_pos),
                rope_spec(compress, compress.number("rope_theta", compress_theta, lo=1, lo_open=True), max_pos))
    # Legacy / flat: the scaling dict applies to the compressed branches only (plain rope on sliding layers),
    # and a YaRN compress rope defaults to attention_factor 1 (V4 does not scale cos / sin).
    flat = f.section("rope_scaling")
    flat = flat if flat is not None and flat.raw else nested
    return RopeSpec("default", rope_theta), rope_spec(flat, compress_theta, max_pos, attention_factor=1.0)
