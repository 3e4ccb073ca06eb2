"""DeepSeek-V4 configuration, read from either ``config.json`` dialect into one slotted dataclass.

Released checkpoints ship legacy fields (``compress_ratios``, ``num_hash_layers``, ``qk_rope_head_dim``,
``rope_scaling``); transformers writes ``layer_types``, ``mlp_layer_types``, ``compress_rates`` and nested
``rope_parameters``.  Both resolve to the same :class:`DeepseekV4Config`, following
``transformers.DeepseekV4Config`` (the oracle) wherever the two could differ.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepinfer.models.checkpoint_files import read_json_object
from deepinfer.models.config_fields import ConfigError, Fields
from deepinfer.models.deepseek_v4.rope_config import rope_dim_of, rope_specs
from deepinfer.models.quant_config import QuantSpec, quant_spec
from deepinfer.models.rope import RopeSpec
from deepinfer.ops.moe import SCORE_FUNCS

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE = "hash_moe"
MOE = "moe"
MLP_LAYER_TYPES = (HASH_MOE, MOE)

_DEFAULT_RATES = {CSA: 4, HCA: 128}
_LEGACY_RATIO_TO_TYPE = {0: SLIDING, 4: CSA, 128: HCA}

__all__ = ["ConfigError", "DeepseekV4Config"]  # ConfigError: raised for a bad field


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
        return cls.from_dict(read_json_object(path), source=str(path))

    @classmethod
    def from_dict(cls, raw: dict[str, Any], source: str = "config") -> DeepseekV4Config:
        """``source`` names the file in errors (:class:`ConfigError`, naming the field)."""
        return _parse(Fields.of(raw, source))


def _stack_lengths(f: Fields, n: int) -> tuple[int, ...]:
    """Allowed lengths of the per-layer lists: ``n``, or ``n`` plus the MTP layers (released configs list them)."""
    return (n, n + f.integer("num_nextn_predict_layers", 1, lo=0))


def _compress_rates(f: Fields) -> dict[str, int]:
    rates = dict(_DEFAULT_RATES)
    section = f.section("compress_rates")
    if section is not None:
        for kind in section.raw:
            if kind not in _DEFAULT_RATES:
                raise section.error(kind, f"a key from {sorted(_DEFAULT_RATES)}", kind)
            rates[kind] = section.integer(kind, lo=1)
    for legacy, kind in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if f.has(legacy):
            rates[kind] = f.integer(legacy, lo=1)
    return rates


def _layer_types(f: Fields, n: int, rates: dict[str, int]) -> tuple[str, ...]:
    lengths = _stack_lengths(f, n)
    types = f.optional_strings("layer_types", lengths=lengths, choices=LAYER_TYPES)
    ratios = f.optional_integers("compress_ratios", lengths=lengths, lo=0)
    if types is None and ratios is not None:
        by_ratio = {**_LEGACY_RATIO_TO_TYPE, rates[CSA]: CSA, rates[HCA]: HCA, 0: SLIDING}
        for i, ratio in enumerate(ratios):
            if ratio not in by_ratio:
                raise f.error(f"compress_ratios[{i}]", f"one of {sorted(by_ratio)}", ratio)
        types = tuple(by_ratio[r] for r in ratios)
    if types is None:  # transformers' default: two HCA layers, then CSA / HCA alternating
        types = tuple([HCA] * min(n, 2) + [CSA if i % 2 else HCA for i in range(max(n - 2, 0))])
    return types[:n]  # released configs list the MTP layer's ratio too


def _mlp_layer_types(f: Fields, n: int) -> tuple[str, ...]:
    types = f.optional_strings("mlp_layer_types", lengths=_stack_lengths(f, n), choices=MLP_LAYER_TYPES)
    if types is None:
        n_hash = f.integer("num_hash_layers", lo=0) if f.has("num_hash_layers") else 3
        types = tuple([HASH_MOE] * min(n, n_hash) + [MOE] * max(0, n - n_hash))
    return types[:n]


def _parse(f: Fields) -> DeepseekV4Config:
    f.string("model_type", "deepseek_v4", choices=("deepseek_v4",))
    n = f.integer("num_hidden_layers", 43, lo=1)
    rates = _compress_rates(f)
    layer_types = _layer_types(f, n, rates)
    head_dim = f.integer("head_dim", 512, lo=1)
    rope_dim = rope_dim_of(f, head_dim)
    max_pos = f.integer("max_position_embeddings", 1048576, lo=2)  # a prompt token and one generated
    rope_main, rope_compress = rope_specs(f, rope_dim, head_dim, max_pos)
    heads, groups = f.integer("num_attention_heads", 64, lo=1), f.integer("o_groups", 8, lo=1)
    if heads % groups:
        raise f.error("num_attention_heads", f"a multiple of o_groups ({groups})")
    if f.integer("num_key_value_heads", 1, lo=1) != 1:
        raise f.error("num_key_value_heads", "1 (DeepSeek-V4 has one shared K=V head)")
    experts = f.integer("n_routed_experts", 256, lo=1)
    top_k = f.integer("num_experts_per_tok", 6, lo=1)
    if top_k > experts:
        raise f.error("num_experts_per_tok", f"at most n_routed_experts ({experts})")
    index_head_dim = f.integer("index_head_dim", 128, lo=1)
    if CSA in layer_types and index_head_dim < rope_dim:
        raise f.error("index_head_dim", f"at least the rope head dim ({rope_dim}): the indexer's queries are rotated")
    vocab = f.integer("vocab_size", 129280, lo=1)
    no_limit = "swiglu_limit" in f.raw and f.raw["swiglu_limit"] is None
    return DeepseekV4Config(
        vocab_size=vocab,
        hidden_size=f.integer("hidden_size", 4096, lo=1),
        num_hidden_layers=n,
        num_attention_heads=heads,
        head_dim=head_dim,
        rope_head_dim=rope_dim,
        q_lora_rank=f.integer("q_lora_rank", 1024, lo=1),
        o_groups=groups,
        o_lora_rank=f.integer("o_lora_rank", 1024, lo=1),
        n_routed_experts=experts,
        n_shared_experts=f.integer("n_shared_experts", 1, lo=1),
        num_experts_per_tok=top_k,
        moe_intermediate_size=f.integer("moe_intermediate_size", 2048, lo=1),
        scoring_func=f.string("scoring_func", "sqrtsoftplus", choices=SCORE_FUNCS),
        routed_scaling_factor=f.number("routed_scaling_factor", 1.5, lo=0, lo_open=True),
        swiglu_limit=None if no_limit else f.number("swiglu_limit", 10.0, lo=0, lo_open=True),
        sliding_window=f.integer("sliding_window", 128, lo=1),
        layer_types=layer_types,
        compress_ratios=tuple(0 if t == SLIDING else rates[t] for t in layer_types),
        mlp_layer_types=_mlp_layer_types(f, n),
        index_n_heads=f.integer("index_n_heads", 64, lo=1),
        index_head_dim=index_head_dim,
        index_topk=f.integer("index_topk", 512, lo=1),
        hc_mult=f.integer("hc_mult", 4, lo=1),
        hc_sinkhorn_iters=f.integer("hc_sinkhorn_iters", 20, lo=1),
        hc_eps=f.number("hc_eps", 1e-6, lo=0, lo_open=True),
        rms_norm_eps=f.number("rms_norm_eps", 1e-6, lo=0, lo_open=True),
        rope_main=rope_main,
        rope_compress=rope_compress,
        max_position_embeddings=max_pos,
        bos_token_id=f.optional_integer("bos_token_id", lo=0, hi=vocab - 1) if "bos_token_id" in f.raw else 0,
        eos_token_id=f.optional_ids("eos_token_id", 1, hi=vocab - 1),
        pad_token_id=f.optional_integer("pad_token_id", lo=0),
        num_nextn_predict_layers=f.integer("num_nextn_predict_layers", 1, lo=0),
        tie_word_embeddings=f.boolean("tie_word_embeddings", False),
        quant=quant_spec(f),
    )
