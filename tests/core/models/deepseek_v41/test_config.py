"""DeepSeek-V4.1 config.json in its three forms: the fixtures (roles as their READMEs list them), a released-style
file, transformers' defaults and derivations, and errors that name the field."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import torch

from deepinfer.models.deepseek_v41 import FULL, REINDEX, REUSE, SWA, ConfigError, DeepseekV41Config, LayerRole
from deepinfer.models.rope import inv_freq

FIXTURES = Path(__file__).parents[3] / "fixtures" / "deepseek_v41"

#: The released DeepSeek-V4.1-Flash config.json (composite), with the text fields of spec §1.2 / engine note §5.
RELEASED = {
    "architectures": ["DeepseekV41ForCausalLM"],
    "model_type": "deepseek_v41",
    "bos_token_id": 0,
    "eos_token_id": 1,
    "pad_token_id": 2,
    "image_token_id": 129264,
    "quantization_config": {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32],
                            "scale_fmt": "ue8m0", "expert_dtype": "fp4"},
    "vision_config": {"model_type": "deepseek_v41_vision", "num_hidden_layers": 32, "hidden_size": 1024},
    "text_config": {
        "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "moe_intermediate_size": 2304,
        "num_hidden_layers": 40, "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512,
        "qk_rope_head_dim": 64, "q_lora_rank": 1280, "o_lora_rank": 1024, "o_groups": 8, "hidden_act": "silu",
        "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "tie_word_embeddings": False, "max_position_embeddings": 1048576,
        "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 6, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5, "sliding_window": 128,
        "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0] * 3,
        "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
        "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
        "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-6, "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682],
        "engram_max_ngram_size": 4, "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256,
        "engram_pad_token_id": 2, "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3,
        "dspark_block_size": 5, "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39],
        "dspark_markov_rank": 256, "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3,
    },
}


def _released(**text_changes) -> dict:
    raw = copy.deepcopy(RELEASED)
    raw["text_config"].update(text_changes)
    return raw


def _describe(role: LayerRole, cfg: DeepseekV41Config) -> str:
    """A layer's role in the words of the fixture READMEs' tables."""
    if role.mode == SWA:
        text = "SWA-only"
    else:
        half = "decoder" if role.ratio == 1 else "encoder"
        kind = {FULL: "Full (kv source + index source)", REINDEX: "Reindex", REUSE: "Reuse"}[role.mode]
        text = f"{half}(r={role.ratio}) {kind}"
    if role.engram:
        text += " + Engram"
    if role.is_candidate_source:
        text += " + candidate source"
    return text


def _readme_table(fixture: str) -> list[tuple[int, int, str]]:
    rows = re.findall(r"^\| (\d+) \| (\d+) \| (.+?) \|$", (FIXTURES / fixture / "README.md").read_text(), re.M)
    return [(int(layer), int(ratio), role) for layer, ratio, role in rows]


def _readme_shape(fixture: str) -> dict:
    """The README's "Model shape" list (`name`: `json value`)."""
    pairs = re.findall(r"^- `(\w+)`: `(.+)`$", (FIXTURES / fixture / "README.md").read_text(), re.M)
    return {name: json.loads(value) for name, value in pairs}


@pytest.mark.parametrize("fixture", ["tiny_a", "tiny_b"])
def test_fixture_configs_give_the_roles_their_readmes_list(fixture):
    cfg = DeepseekV41Config.from_file(FIXTURES / fixture)
    table = _readme_table(fixture)
    assert len(table) == cfg.num_hidden_layers
    assert [(r.layer_id, r.ratio, _describe(r, cfg)) for r in cfg.layers] == table
    shape = _readme_shape(fixture)
    for name in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "engram_layer_ids",
                 "engram_num_embeddings"):
        assert list(getattr(cfg, name)) == shape[name], name
    for name in ("vocab_size", "hidden_size", "head_dim", "candidate_source_layer_id", "gate_temp", "swiglu_limit",
                 "hc_mult", "engram_compressed_vocab_size", "engram_pad_id", "num_nextn_predict_layers"):
        assert getattr(cfg, name) == shape[name], name
    assert cfg.rope_dim == shape["qk_rope_head_dim"]
    yarn = shape["rope_scaling"]
    assert cfg.rope_compress.rope_type == ("yarn" if yarn else "default") and cfg.rope_main.rope_type == "default"
    assert cfg.rope_compress.theta == 160000.0 and cfg.rope_main.theta == 10000.0


def test_composite_and_flat_forms_read_alike():
    composite = json.loads((FIXTURES / "tiny_a" / "config.json").read_text())
    flat = {**composite["text_config"], "model_type": "deepseek_v41_text"}
    assert DeepseekV41Config.from_dict(flat) == DeepseekV41Config.from_dict(composite)


def test_released_config_json():
    cfg = DeepseekV41Config.from_dict(RELEASED)
    assert len(cfg.compress_ratios) == 43 and cfg.compress_ratios[40:] == (0, 0, 0)
    assert (cfg.num_hidden_layers, cfg.rope_dim, cfg.engram_pad_id) == (40, 64, 2)
    assert (cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id) == (0, 1, 2)  # from the top level
    assert cfg.quant is not None and cfg.quant.weight_block_size == (32, 32) and cfg.quant.expert_dtype == "fp4"
    assert cfg.dspark_target_layer_ids == (37, 38, 39) and cfg.dspark_n_routed_experts == 128
    modes = {i: r.mode for i, r in enumerate(cfg.layers)}
    assert [i for i, m in modes.items() if m == SWA] == [0, 1]
    assert [i for i, m in modes.items() if m == FULL] == [2, 8, 14, 20]
    assert [i for i, m in modes.items() if m == REINDEX] == [24, 28, 32, 36]
    reuse_of = {i: (r.kv_source, r.index_source) for i, r in enumerate(cfg.layers) if r.mode == REUSE}
    assert reuse_of[3] == reuse_of[7] == (2, 2) and reuse_of[19] == (14, 14)
    assert reuse_of[21] == (20, 20) and reuse_of[25] == (20, 24) and reuse_of[39] == (20, 36)
    assert [i for i, r in enumerate(cfg.layers) if r.uses_candidates] == list(range(24, 40))
    assert [r.rope for r in cfg.layers] == ["main"] * 2 + ["compress"] * 38
    assert [i for i, r in enumerate(cfg.layers) if r.engram] == [1, 14]
    assert cfg.layers[20].is_candidate_source and cfg.layers[20].is_kv_source and not cfg.layers[24].is_kv_source


def test_released_yarn_rope():
    cfg = DeepseekV41Config.from_dict(RELEASED)
    c = cfg.rope_compress
    assert (c.rope_type, c.theta, c.factor, c.original_max_position_embeddings) == ("yarn", 160000.0, 16.0, 65536)
    assert c.attention_scaling == 1.0  # pinned by the config: cos / sin are not scaled
    freq = inv_freq(c, cfg.rope_dim)
    pos_freqs = 160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64)
    extrapolated, interpolated = 1.0 / pos_freqs, 1.0 / (16.0 * pos_freqs)
    # the ramp runs from dim floor(15.45) = 15 to ceil(24.71) = 25: pure extrapolation below, interpolation above
    assert torch.equal(freq[:16], extrapolated[:16]) and torch.equal(freq[25:], interpolated[25:])
    assert ((freq[16:25] < extrapolated[16:25]) & (freq[16:25] > interpolated[16:25])).all()
    assert torch.equal(inv_freq(cfg.rope_main, 64), 1.0 / (10000.0 ** (torch.arange(0, 64, 2).float() / 64)))


def test_hf_saved_nested_rope_reads_like_the_flat_scaling():
    """What transformers' save_pretrained writes (nested rope_parameters next to rope_scaling, as tiny_a has)."""
    nested = {"main": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.125},
              "compress": {"rope_type": "yarn", "factor": 16.0, "beta_fast": 32.0, "beta_slow": 1.0,
                           "original_max_position_embeddings": 65536, "rope_theta": 160000.0,
                           "partial_rotary_factor": 0.125, "attention_factor": 1.0}}
    assert DeepseekV41Config.from_dict(_released(rope_parameters=nested)) == DeepseekV41Config.from_dict(RELEASED)


def test_legacy_type_yarn_is_ignored_as_transformers_does():
    legacy = {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536}
    cfg = DeepseekV41Config.from_dict(_released(rope_scaling=legacy))
    assert cfg.rope_compress.rope_type == "default" and cfg.rope_compress.theta == 160000.0


def test_nested_rope_defaults():
    """Nested families: ``type`` counts, theta falls back to the top-level rope_theta (for compress too), a YaRN
    family without attention_factor gets transformers' mscale, without original length max_position_embeddings."""
    nested = {"main": {"rope_type": "default", "partial_rotary_factor": 0.125},
              "compress": {"type": "yarn", "factor": 4.0, "partial_rotary_factor": 0.125}}
    cfg = DeepseekV41Config.from_dict(_released(rope_parameters=nested, rope_theta=5000.0))
    c = cfg.rope_compress
    assert (c.rope_type, c.theta, c.factor, c.original_max_position_embeddings) == ("yarn", 5000.0, 4.0, 1048576)
    assert c.attention_scaling == pytest.approx(0.1 * torch.log(torch.tensor(4.0)).item() + 1)
    assert cfg.rope_main.theta == 5000.0


def test_engram_pad_id_aliases():
    assert DeepseekV41Config.from_dict(_released(engram_pad_token_id=7)).engram_pad_id == 7
    assert DeepseekV41Config.from_dict(_released(engram_pad_token_id=7, engram_pad_id=5)).engram_pad_id == 5
    text = {k: v for k, v in RELEASED["text_config"].items() if k != "engram_pad_token_id"}
    assert DeepseekV41Config.from_dict({"model_type": "deepseek_v41", "text_config": text}).engram_pad_id == 2


def test_defaults_follow_transformers():
    cfg = DeepseekV41Config.from_dict({"model_type": "deepseek_v41_text"})
    released = DeepseekV41Config.from_dict(RELEASED)
    assert cfg.layers == tuple(LayerRole(r.layer_id, r.ratio, r.mode, r.kv_source, r.index_source,
                                         r.is_candidate_source, r.uses_candidates, False) for r in released.layers)
    assert cfg.dspark_target_layer_ids == (37, 38, 39) and cfg.engram_layer_ids == ()
    assert cfg.rope_compress.rope_type == "default" and cfg.rope_dim == 64
    # transformers' schedule scaled to 9 layers (values from its DeepseekV41TextConfig)
    small = DeepseekV41Config.from_dict({"model_type": "deepseek_v41_text", "num_hidden_layers": 9})
    assert small.compress_ratios == (0, 0, 2, 2, 2, 2, 1, 1, 1, 0, 0, 0)
    assert small.kv_source_layer_ids == small.index_source_layer_ids == (2, 6)
    assert small.candidate_source_layer_id == 6 and small.dspark_target_layer_ids == (5, 7, 8)
    # a custom schedule without sources: the first layer of each same-ratio run
    custom = DeepseekV41Config.from_dict({"model_type": "deepseek_v41_text", "num_hidden_layers": 6,
                                          "num_nextn_predict_layers": 0, "compress_ratios": [0, 4, 4, 1, 1, 1]})
    assert custom.kv_source_layer_ids == (1, 3) and [r.mode for r in custom.layers] == [SWA, FULL, REUSE, FULL,
                                                                                         REUSE, REUSE]


def test_no_candidate_source():
    cfg = DeepseekV41Config.from_dict(_released(candidate_source_layer_id=-1))
    assert cfg.candidate_source_layer_id == -1
    assert not any(r.uses_candidates or r.is_candidate_source for r in cfg.layers)


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"compress_ratios": [0, 0, 2]}, r"compress_ratios has 3 entries; it needs num_hidden_layers \(40\) to .*43"),
        ({"kv_source_layer_ids": [1, 8, 14, 20]}, r"kv_source_layer_ids \[1, 8, 14, 20\] must all have"),
        ({"kv_source_layer_ids": [2, 8, 14, 40]}, r"kv_source_layer_ids must be distinct layer ids in \[0, 40\)"),
        ({"candidate_source_layer_id": 21}, "candidate_source_layer_id 21 must be one of index_source_layer_ids"),
        ({"index_source_layer_ids": [2, 14, 20]}, r"kv_source_layer_ids \[8\] are not in index_source_layer_ids"),
        ({"kv_source_layer_ids": [2, 8, 14, 18], "index_source_layer_ids": [2, 8, 14, 18],
          "candidate_source_layer_id": 18},
         r"compress_ratios\[20\] = 1 differs from its kv source layer 18's 2"),
        ({"num_experts_per_tok": 385},
         r"text_config.num_experts_per_tok must be an integer >= 1 and <= 384, found 385"),
        ({"hidden_size": "5120"}, 'text_config.hidden_size must be an integer >= 1, found "5120"'),
        ({"o_groups": 3}, "num_attention_heads 64 must be a multiple of o_groups 3"),
        ({"hidden_act": "gelu"}, r"text_config.hidden_act must be one of \['silu'\]"),
        ({"scoring_func": "relu"}, "text_config.scoring_func must be one of"),
        ({"gate_temp": 0}, "text_config.gate_temp must be a finite number > 0"),
        ({"engram_num_embeddings": [5]}, "engram_num_embeddings has 1 entries but engram_layer_ids has 2"),
        ({"engram_layer_ids": [1, 40]}, r"engram_layer_ids must be distinct layer ids in \[0, 40\)"),
        ({"engram_max_ngram_size": 1}, "text_config.engram_max_ngram_size must be an integer >= 2"),
        ({"dspark_target_layer_ids": [38, 39, 40]}, r"dspark_target_layer_ids must be distinct layer ids"),
        ({"compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 1, 0]},
         r"compress_ratios of the 3 DSpark draft layers \(entries 40..\) must be 0 .*\[0, 1, 0\]"),
        ({"dspark_target_layer_ids": []}, "dspark_target_layer_ids must name at least one layer"),
        ({"dspark_noise_token_id": 129280}, r"dspark_noise_token_id must be an integer >= 0 and <= 129279"),
        ({"dspark_num_experts_per_tok": 129}, r"dspark_num_experts_per_tok must be an integer >= 1 and <= 128"),
        ({"dspark_block_size": 0}, "dspark_block_size must be an integer >= 1"),
        ({"dspark_markov_rank": 0}, "dspark_markov_rank must be an integer >= 1"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 16}},
         "rope_scaling.original_max_position_embeddings is missing"),
        ({"rope_scaling": {"rope_type": "longrope"}}, "longrope"),
        ({"qk_rope_head_dim": 63}, r"rope dims .* are \[63, 63\]"),
        ({"rope_parameters": {"main": {"partial_rotary_factor": 0.25}, "compress": {"partial_rotary_factor": 0.125}}},
         r"rope dims .* are \[128, 64\]: they must agree"),
    ],
)
def test_bad_configs_name_the_field(changes, message):
    with pytest.raises(ConfigError, match=message):
        DeepseekV41Config.from_dict(_released(**changes))


@pytest.mark.parametrize(
    "raw, message",
    [
        ({"model_type": "deepseek_v4"}, r"model_type must be one of \['deepseek_v41', 'deepseek_v41_text'\]"),
        ({"model_type": "deepseek_v41", "text_config": {"model_type": "llama"}}, "text_config.model_type"),
        ({"model_type": "deepseek_v41", "text_config": [1]}, "text_config must be a JSON object"),
    ],
)
def test_bad_forms(raw, message):
    with pytest.raises(ConfigError, match=message):
        DeepseekV41Config.from_dict(raw)


def test_from_file_reads_a_directory_or_the_file(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED))
    assert DeepseekV41Config.from_file(tmp_path) == DeepseekV41Config.from_file(tmp_path / "config.json")
