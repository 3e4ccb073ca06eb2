"""DeepSeek-V4 configuration, read from either ``config.json`` dialect into one slotted dataclass.

Released checkpoints ship legacy fields (``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``,
``rope_scaling``); transformers writes ``layer_types``, ``mlp_layer_types``, ``compress_rates`` and nested
``rope_parameters``.  Both resolve to the same :class:`DeepseekV4Config`, following
``transformers.DeepseekV4Config`` (the oracle) wherever the two could differ.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)

_DEFAULT_RATES = {CSA: 4, HCA: 128}
_LEGACY_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}


class ConfigError(ValueError):
    """config.json cannot describe a DeepSeek-V4 model we can build; the message names the field."""


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


@dataclass(slots=True, frozen=True)
class QuantSpec:
    """``quantization_config`` of a released checkpoint (which tensors are quantized is read from the files)."""

    weight_block_size: tuple[int, int] = (128, 128)
    scale_fmt: str | None = "ue8m0"
    expert_dtype: str = "fp8"  # "fp8" or "fp4" (MXFP4) for the routed experts


@dataclass(slots=True, frozen=True)
class DeepseekV4Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int
    rope_head_dim: int
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    n_routed_experts: int
    n_shared_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float | None
    sliding_window: int
    layer_types: tuple[str, ...]
    compress_ratios: tuple[int, ...]  # per layer: 0 (sliding only), CSA rate or HCA rate
    mlp_layer_types: tuple[str, ...]
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_main: RopeSpec  # sliding-only layers
    rope_compress: RopeSpec  # CSA / HCA layers, their compressors and the indexer
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    num_nextn_predict_layers: int
    tie_word_embeddings: bool
    quant: QuantSpec | None
    model_type: str = "deepseek_v4"

    @classmethod
    def from_file(cls, path: str | Path) -> DeepseekV4Config:
        """Read ``config.json`` (a file, or the checkpoint directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(json.loads(path.read_text()))

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> DeepseekV4Config:
        return _parse(raw)


def _layer_types(raw: dict[str, Any], n: int, rates: dict[str, int]) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        by_ratio = {**_LEGACY_RATIO_TO_TYPE, rates[CSA]: CSA, rates[HCA]: HCA, 0: SLIDING}
        try:
            types = [by_ratio[int(r)] for r in raw["compress_ratios"]]
        except KeyError as exc:
            raise ConfigError(f"compress_ratios: unknown ratio {exc.args[0]}; known {sorted(by_ratio)}") from None
    if types is None:  # transformers' default: two HCA layers, then CSA / HCA alternating
        types = [HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))]
    types = list(types)[:n]  # released configs list the MTP layer's ratio too
    if len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ConfigError(f"layer_types must be {n} entries from {LAYER_TYPES}, got {types}")
    return tuple(types)


def _mlp_layer_types(raw: dict[str, Any], n: int) -> tuple[str, ...]:
    types = raw.get("mlp_layer_types")
    if types is None:
        n_hash = raw.get("num_hash_layers")
        n_hash = 3 if n_hash is None else int(n_hash)
        types = [HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash)
    types = list(types)[:n]
    if len(types) != n or any(t not in MLP_LAYER_TYPES for t in types):
        raise ConfigError(f"mlp_layer_types must be {n} entries from {MLP_LAYER_TYPES}, got {types}")
    return tuple(types)


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _rope_spec(params: dict[str, Any], theta: float, max_pos: int, where: str) -> RopeSpec:
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return RopeSpec("default", float(theta))
    if rope_type != "yarn":
        raise ConfigError(f"{where}: rope type {rope_type!r} is not supported (default or yarn)")
    if params.get("original_max_position_embeddings") is None:
        raise ConfigError(f"{where}: yarn needs original_max_position_embeddings")
    original = int(params["original_max_position_embeddings"])
    factor = params.get("factor")
    factor = float(max_pos / original if factor is None else factor)
    scaling = params.get("attention_factor")
    if scaling is None:  # transformers derives it; V4's own configs pin it to 1
        mscale, mscale_all_dim = params.get("mscale"), params.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            scaling = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all_dim)
        else:
            scaling = _yarn_mscale(factor)
    return RopeSpec(
        "yarn",
        float(theta),
        factor,
        original,
        float(params.get("beta_fast") or 32),
        float(params.get("beta_slow") or 1),
        float(scaling),
    )


def _rope_specs(raw: dict[str, Any], rope_dim: int, head_dim: int, max_pos: int) -> tuple[RopeSpec, RopeSpec]:
    rope_theta = raw.get("rope_theta", 10000.0)
    compress_theta = raw.get("compress_rope_theta", 160000.0)
    nested = raw.get("rope_parameters") or {}
    if isinstance(nested.get("main"), dict) and isinstance(nested.get("compress"), dict):
        specs = []
        for label in ("main", "compress"):
            params = nested[label]
            factor = params.get("partial_rotary_factor")
            if factor is not None and int(head_dim * factor) != rope_dim:
                raise ConfigError(f"rope_parameters.{label}.partial_rotary_factor disagrees with the rope dim")
            default_theta = rope_theta if label == "main" else compress_theta
            specs.append(_rope_spec(params, params.get("rope_theta", default_theta), max_pos, f"rope {label}"))
        return specs[0], specs[1]
    # Legacy / flat: the scaling dict applies to the compressed branches only (plain rope on sliding layers),
    # and a YaRN compress rope defaults to attention_factor 1 (V4 does not scale cos / sin).
    flat = dict(raw.get("rope_scaling") or nested or {})
    flat.pop("main", None), flat.pop("compress", None)
    if flat.get("rope_type", flat.get("type", "default")) == "yarn":
        flat.setdefault("attention_factor", 1.0)
    return RopeSpec("default", float(rope_theta)), _rope_spec(flat, compress_theta, max_pos, "rope_scaling")


def _quant_spec(raw: dict[str, Any]) -> QuantSpec | None:
    qc = raw.get("quantization_config")
    if qc is None:
        return None
    block = tuple(int(b) for b in (qc.get("weight_block_size") or (128, 128)))
    if len(block) != 2:
        raise ConfigError(f"quantization_config.weight_block_size must have 2 entries, got {block}")
    expert_dtype = qc.get("expert_dtype", raw.get("expert_dtype")) or "fp8"
    if expert_dtype not in ("fp8", "fp4"):
        raise ConfigError(f"expert_dtype must be 'fp8' or 'fp4', got {expert_dtype!r}")
    return QuantSpec(block, qc.get("scale_fmt"), expert_dtype)  # type: ignore[arg-type]


def _parse(raw: dict[str, Any]) -> DeepseekV4Config:
    model_type = raw.get("model_type", "deepseek_v4")
    if model_type != "deepseek_v4":
        raise ConfigError(f"model_type {model_type!r} is not deepseek_v4")
    n = int(raw.get("num_hidden_layers", 43))
    rates = dict(_DEFAULT_RATES)
    rates.update(raw.get("compress_rates") or {})
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if raw.get(legacy) is not None:
            rates[kind] = int(raw[legacy])
    layer_types = _layer_types(raw, n, rates)
    head_dim = int(raw.get("head_dim", 512))
    if raw.get("qk_rope_head_dim") is not None:
        rope_dim = int(raw["qk_rope_head_dim"])
    else:
        rope_dim = int(head_dim * (raw.get("partial_rotary_factor") or 64 / 512))
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise ConfigError(f"rope head dim {rope_dim} must be even and within head_dim {head_dim}")
    max_pos = int(raw.get("max_position_embeddings", 1048576))
    rope_main, rope_compress = _rope_specs(raw, rope_dim, head_dim, max_pos)
    heads, groups = int(raw.get("num_attention_heads", 64)), int(raw.get("o_groups", 8))
    if heads % groups:
        raise ConfigError(f"num_attention_heads {heads} is not a multiple of o_groups {groups}")
    if int(raw.get("num_key_value_heads", 1)) != 1:
        raise ConfigError("DeepSeek-V4 has one shared K=V head; num_key_value_heads must be 1")
    limit = raw.get("swiglu_limit", 10.0)
    return DeepseekV4Config(
        vocab_size=int(raw.get("vocab_size", 129280)),
        hidden_size=int(raw.get("hidden_size", 4096)),
        num_hidden_layers=n,
        num_attention_heads=heads,
        head_dim=head_dim,
        rope_head_dim=rope_dim,
        q_lora_rank=int(raw.get("q_lora_rank", 1024)),
        o_groups=groups,
        o_lora_rank=int(raw.get("o_lora_rank", 1024)),
        n_routed_experts=int(raw.get("n_routed_experts", 256)),
        n_shared_experts=int(raw.get("n_shared_experts", 1)),
        num_experts_per_tok=int(raw.get("num_experts_per_tok", 6)),
        moe_intermediate_size=int(raw.get("moe_intermediate_size", 2048)),
        scoring_func=str(raw.get("scoring_func", "sqrtsoftplus")),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        swiglu_limit=None if limit is None else float(limit),
        sliding_window=int(raw.get("sliding_window", 128)),
        layer_types=layer_types,
        compress_ratios=tuple(0 if t == SLIDING else int(rates[t]) for t in layer_types),
        mlp_layer_types=_mlp_layer_types(raw, n),
        index_n_heads=int(raw.get("index_n_heads", 64)),
        index_head_dim=int(raw.get("index_head_dim", 128)),
        index_topk=int(raw.get("index_topk", 512)),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_main=rope_main,
        rope_compress=rope_compress,
        max_position_embeddings=max_pos,
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_id=raw.get("eos_token_id", 1),
        pad_token_id=raw.get("pad_token_id"),
        num_nextn_predict_layers=int(raw.get("num_nextn_predict_layers", 1)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        quant=_quant_spec(raw),
    )
