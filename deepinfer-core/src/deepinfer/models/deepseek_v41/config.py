"""DeepSeek-V4.1 configuration from any of its config.json forms, into one slotted dataclass.

Three forms (reference spec §1.2), all following ``transformers``' ``DeepseekV41TextConfig`` (main branch):
- composite (``model_type: deepseek_v41``): the text model under ``text_config``, ``quantization_config`` at the
  top level (the released checkpoint; token ids may sit at either level);
- flat (``model_type: deepseek_v41_text``): what the causal LM's ``save_pretrained`` writes; its
  ``layer_types`` are recomputed, its nested ``rope_parameters`` kept;
- the released config.json: composite, with ``engram_pad_token_id`` instead of ``engram_pad_id``, a flat YaRN
  ``rope_scaling`` and 43 ``compress_ratios`` (40 layers + 3 DSpark draft layers).

Derived as transformers does: the layer schedule and roles (:mod:`.roles`) and the two RoPE families.  Fields
transformers reads but V4.1 ignores are not kept (``n_shared_experts``: always one shared expert;
``num_key_value_heads``: K=V is one latent); nor is the vision tower's config.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from deepinfer.models.checkpoint_files import read_json_object
from deepinfer.models.config_fields import ConfigError, Fields
from deepinfer.models.deepseek_v41.roles import LayerRole, derive_schedule
from deepinfer.models.quant_config import QuantSpec, quant_spec
from deepinfer.models.rope import RopeSpec, rope_spec
from deepinfer.ops.moe import SCORE_FUNCS

__all__ = ["ConfigError", "DeepseekV41Config", "LayerRole"]

MODEL_TYPES = ("deepseek_v41", "deepseek_v41_text")


@dataclass(slots=True, frozen=True)
class DeepseekV41Config:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    head_dim: int  # also the width of the compressed latent
    rope_dim: int  # rotated trailing channels of q, kv, latents and indexer q / k: int(head_dim * partial factor)
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    compress_ratios: tuple[int, ...]  # num_hidden_layers + num_nextn_predict_layers entries (draft layers: 0)
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int  # -1: no candidate pool
    candidate_topk_blocks: int
    candidate_block_size: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    layers: tuple[LayerRole, ...]  # the role of each backbone layer
    moe_intermediate_size: int  # routed and shared experts
    n_routed_experts: int
    num_experts_per_tok: int
    scoring_func: str
    gate_temp: float  # router logits are divided by it
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float  # <= 0: no clamp
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    rms_norm_eps: float
    rope_main: RopeSpec  # layers with ratio 0
    rope_compress: RopeSpec  # layers with a ratio (their q and SWA kv too), latents, indexer q / k
    max_position_embeddings: int
    engram_layer_ids: tuple[int, ...]
    engram_vocab_size: int  # the first prime candidate of the hash buckets
    engram_num_embeddings: tuple[int, ...]  # table rows per engram layer
    engram_max_ngram_size: int
    engram_n_heads: int
    engram_head_dim: int
    engram_pad_id: int  # a token id; its compressed id pads n-grams that reach before the sequence
    engram_compressed_vocab_size: int
    num_nextn_predict_layers: int
    dspark_block_size: int
    dspark_noise_token_id: int
    dspark_target_layer_ids: tuple[int, ...]
    dspark_markov_rank: int
    dspark_n_routed_experts: int
    dspark_num_experts_per_tok: int
    bos_token_id: int | None
    eos_token_id: int | list[int] | None
    pad_token_id: int | None
    tie_word_embeddings: bool
    quant: QuantSpec | None
    model_type: str = "deepseek_v41"

    @classmethod
    def from_file(cls, path: str | Path) -> DeepseekV41Config:
        """Read ``config.json`` (a file, or the checkpoint directory holding it)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        return cls.from_dict(read_json_object(path), source=str(path))

    @classmethod
    def from_dict(cls, raw: Any, source: str = "config") -> DeepseekV41Config:
        """``source`` names the file in errors."""
        return _parse(raw, source)


def _text_fields(raw: Any, source: str) -> tuple[Fields, Fields]:
    """(the text model's fields, the composite's top-level fields: empty for the flat form)."""
    outer = Fields.of(raw, source)
    if outer.string("model_type", choices=MODEL_TYPES) == "deepseek_v41_text":
        return outer, Fields.of({}, source)
    text = outer.section("text_config") or Fields.of({}, source, "text_config.")
    text.string("model_type", "deepseek_v41_text", choices=("deepseek_v41_text",))
    return text, outer


def _rope(f: Fields, head_dim: int, max_pos: int) -> tuple[RopeSpec, RopeSpec, int]:
    """The ``main`` and ``compress`` families and the rotated width, as transformers derives and reads them.

    Nested ``rope_parameters`` (both ``main`` and ``compress`` dicts) are kept; a family without ``rope_type``
    reads ``type``, without ``rope_theta`` the top-level ``rope_theta`` (for ``compress`` too), without
    ``partial_rotary_factor`` 1, a YaRN one without ``original_max_position_embeddings``
    ``max_position_embeddings``.  Otherwise ``main`` is plain ``rope_theta`` and ``compress`` is
    ``compress_rope_theta`` with the flat ``rope_scaling`` dict, YaRN's attention factor pinned to 1.  There
    only ``rope_type`` counts: a legacy ``{"type": "yarn"}`` without ``rope_type`` gives *no* YaRN, as in
    transformers (which sets ``rope_type`` to "default" before it would look at ``type``); YaRN there needs
    ``original_max_position_embeddings``.
    """
    theta = f.number("rope_theta", 10000.0, lo=0, lo_open=True)
    section = f.section("rope_parameters")
    nested = dict(section.raw) if section is not None else {}
    is_nested = isinstance(nested.get("main"), dict) and isinstance(nested.get("compress"), dict)
    if is_nested:
        families = {label: dict(nested[label]) for label in ("main", "compress")}
        for params in families.values():
            params["rope_type"] = params.get("rope_type", params.get("type", "default"))
            params.setdefault("rope_theta", theta)
            params.setdefault("partial_rotary_factor", f.number("partial_rotary_factor", 1.0, lo=0, lo_open=True))
            if params["rope_type"] == "yarn":  # transformers' standardisation of nested parameters
                params.setdefault("original_max_position_embeddings", max_pos)
    else:
        partial = f.integer("qk_rope_head_dim", 64, lo=1) / head_dim
        flat = f.section("rope_scaling")
        scaling = {k: v for k, v in (flat.raw if flat is not None else {}).items() if k not in ("main", "compress")}
        compress = {**scaling, "rope_theta": f.number("compress_rope_theta", 160000.0, lo=0, lo_open=True),
                    "partial_rotary_factor": partial}
        compress.setdefault("rope_type", "default")
        if compress["rope_type"] == "yarn":
            compress.setdefault("attention_factor", 1.0)
        families = {"main": {"rope_type": "default", "rope_theta": theta, "partial_rotary_factor": partial},
                    "compress": compress}
    specs, dims = [], []
    for label, params in families.items():
        where = f"{f.prefix}rope_parameters.{label}." if is_nested else f"{f.prefix}rope_scaling."
        family = Fields.of(params, f.source, where)
        specs.append(rope_spec(family, family.number("rope_theta", lo=0, lo_open=True), max_pos))
        dims.append(int(head_dim * params["partial_rotary_factor"]))
    if dims[0] != dims[1] or dims[0] % 2 or not 0 < dims[0] <= head_dim:
        raise ConfigError(f"rope dims (head_dim * partial_rotary_factor) of main / compress are {dims}: they must "
                          f"agree and be even, in (0, head_dim {head_dim}]; check qk_rope_head_dim / rope_parameters")
    return specs[0], specs[1], dims[0]


def _token_id(text: Fields, outer: Fields, name: str, default: int | None) -> int | list[int] | None:
    """A token id (or a list: ``eos_token_id``) of the text config, else of the composite's top level."""
    return text.optional_ids(name, outer.optional_ids(name, default))


def _ints(f: Fields, name: str) -> list[int] | None:
    """A list of integers, or None when absent or null (transformers then derives it)."""
    value = f.optional_integers(name)
    return None if value is None else list(value)


def _parse(raw: Any, source: str) -> DeepseekV41Config:
    f, outer = _text_fields(raw, source)
    n = f.integer("num_hidden_layers", 40, lo=1)
    n_nextn = f.integer("num_nextn_predict_layers", 3, lo=0)
    vocab = f.integer("vocab_size", 129280, lo=1)
    head_dim = f.integer("head_dim", 512, lo=1)
    heads, groups = f.integer("num_attention_heads", 64, lo=1), f.integer("o_groups", 8, lo=1)
    if heads % groups:
        raise ConfigError(f"num_attention_heads {heads} must be a multiple of o_groups {groups}")
    max_pos = f.integer("max_position_embeddings", 1048576, lo=1)
    rope_main, rope_compress, rope_dim = _rope(f, head_dim, max_pos)
    index_head_dim = f.integer("index_head_dim", 128, lo=1)
    if rope_dim > index_head_dim:
        raise ConfigError(f"the rope dim {rope_dim} must fit index_head_dim {index_head_dim} (the indexer rotates it)")
    engram_ids = list(f.optional_integers("engram_layer_ids", (), lo=0) or ())
    schedule = derive_schedule(
        n, n_nextn, _ints(f, "compress_ratios"), _ints(f, "kv_source_layer_ids"), _ints(f, "index_source_layer_ids"),
        f.optional_integer("candidate_source_layer_id"), _ints(f, "dspark_target_layer_ids"), tuple(engram_ids))
    _check_drafter(n, n_nextn, schedule.compress_ratios, schedule.dspark_target_layer_ids)
    experts = f.integer("n_routed_experts", 384, lo=1)
    draft_experts = f.integer("dspark_n_routed_experts", 128, lo=1)
    f.string("hidden_act", "silu", choices=("silu",))
    return DeepseekV41Config(
        vocab_size=vocab,
        hidden_size=f.integer("hidden_size", 5120, lo=1),
        num_hidden_layers=n,
        num_attention_heads=heads,
        head_dim=head_dim,
        rope_dim=rope_dim,
        q_lora_rank=f.integer("q_lora_rank", 1280, lo=1),
        o_groups=groups,
        o_lora_rank=f.integer("o_lora_rank", 1024, lo=1),
        sliding_window=f.integer("sliding_window", 128, lo=1),
        compress_ratios=schedule.compress_ratios,
        kv_source_layer_ids=schedule.kv_source_layer_ids,
        index_source_layer_ids=schedule.index_source_layer_ids,
        candidate_source_layer_id=schedule.candidate_source_layer_id,
        candidate_topk_blocks=f.integer("candidate_topk_blocks", 2048, lo=1),
        candidate_block_size=f.integer("candidate_block_size", 8, lo=1),
        index_n_heads=f.integer("index_n_heads", 32, lo=1),
        index_head_dim=index_head_dim,
        index_topk=f.integer("index_topk", 512, lo=1),
        layers=schedule.layers,
        moe_intermediate_size=f.integer("moe_intermediate_size", 2304, lo=1),
        n_routed_experts=experts,
        num_experts_per_tok=f.integer("num_experts_per_tok", 6, lo=1, hi=experts),
        scoring_func=f.string("scoring_func", "sqrtsoftplus", choices=SCORE_FUNCS),
        gate_temp=f.number("gate_temp", 1.0, lo=0, lo_open=True),
        norm_topk_prob=f.boolean("norm_topk_prob", True),
        routed_scaling_factor=f.number("routed_scaling_factor", 1.5),
        swiglu_limit=f.number("swiglu_limit", 10.0),
        hc_mult=f.integer("hc_mult", 4, lo=1),
        hc_sinkhorn_iters=f.integer("hc_sinkhorn_iters", 20, lo=1),
        hc_eps=f.number("hc_eps", 1e-6, lo=0.0),
        rms_norm_eps=f.number("rms_norm_eps", 1e-20, lo=0.0),
        rope_main=rope_main,
        rope_compress=rope_compress,
        max_position_embeddings=max_pos,
        **_engram_fields(f, n, vocab, engram_ids),
        num_nextn_predict_layers=n_nextn,
        dspark_block_size=f.integer("dspark_block_size", 5, lo=1),
        dspark_noise_token_id=f.integer("dspark_noise_token_id", 128799, lo=0, hi=vocab - 1),
        dspark_target_layer_ids=schedule.dspark_target_layer_ids,
        dspark_markov_rank=f.integer("dspark_markov_rank", 256, lo=1),
        dspark_n_routed_experts=draft_experts,
        dspark_num_experts_per_tok=f.integer("dspark_num_experts_per_tok", 3, lo=1, hi=draft_experts),
        bos_token_id=_token_id(f, outer, "bos_token_id", None),  # type: ignore[arg-type]  # one id, not a list
        eos_token_id=_token_id(f, outer, "eos_token_id", 1),
        pad_token_id=_token_id(f, outer, "pad_token_id", None),  # type: ignore[arg-type]  # one id, not a list
        tie_word_embeddings=f.boolean("tie_word_embeddings", False),
        # top level in the released composite config (transformers' text config alone would miss it)
        quant=quant_spec(outer if outer.has("quantization_config") else f),
    )


def _check_drafter(n: int, n_nextn: int, ratios: tuple[int, ...], targets: tuple[int, ...]) -> None:
    """The DSpark draft layers (the last ``num_nextn_predict_layers`` entries of ``compress_ratios``) attend to
    a sliding window only, and read at least one target layer."""
    if any(ratios[n:]):
        raise ConfigError(f"compress_ratios of the {n_nextn} DSpark draft layers (entries {n}..) must be 0 "
                          f"(sliding window only), got {list(ratios[n:])}")
    if n_nextn and not targets:
        raise ConfigError("dspark_target_layer_ids must name at least one layer when num_nextn_predict_layers > 0")


def _engram_fields(f: Fields, n: int, vocab: int, layer_ids: list[int]) -> dict[str, Any]:
    if len(set(layer_ids)) != len(layer_ids) or any(i >= n for i in layer_ids):
        raise ConfigError(f"engram_layer_ids must be distinct layer ids in [0, {n}), got {layer_ids}")
    rows = list(f.optional_integers("engram_num_embeddings", (0,) * len(layer_ids), lo=0) or ())
    if len(rows) != len(layer_ids):
        raise ConfigError(f"engram_num_embeddings has {len(rows)} entries but engram_layer_ids has "
                          f"{len(layer_ids)}: one table size per engram layer")
    # the released config.json spells the pad id engram_pad_token_id (transformers keeps it as a stray attribute)
    pad_name = "engram_pad_id" if f.has("engram_pad_id") or not f.has("engram_pad_token_id") else "engram_pad_token_id"
    return dict(
        engram_layer_ids=tuple(layer_ids),
        engram_vocab_size=f.integer("engram_vocab_size", 16000000, lo=2),
        engram_num_embeddings=tuple(rows),
        engram_max_ngram_size=f.integer("engram_max_ngram_size", 4, lo=2),
        engram_n_heads=f.integer("engram_n_heads", 8, lo=1),
        engram_head_dim=f.integer("engram_head_dim", 256, lo=1),
        engram_pad_id=f.integer(pad_name, 2, lo=0, hi=vocab - 1),
        engram_compressed_vocab_size=f.integer("engram_compressed_vocab_size", 99092, lo=1),
    )
