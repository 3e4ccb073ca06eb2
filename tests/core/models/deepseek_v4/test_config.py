"""config.json in both dialects (as released, and as transformers writes it) resolves to one config,
and it agrees with transformers' own reading of it (layer schedule, RoPE frequencies)."""

from __future__ import annotations

import json

import pytest
import torch

from deepinfer.models import UnsupportedModelError, load_model, read_model_config
from deepinfer.models.deepseek_v4.config import CSA, HASH_MOE, HCA, MOE, SLIDING, ConfigError, DeepseekV4Config
from deepinfer.models.rope import inv_freq
from deepinfer.ops import OpTable

# The released V4-Flash config.json fields that matter (legacy names; compress_ratios lists the MTP layer too).
RELEASED_FLASH = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "vocab_size": 129280,
    "hidden_size": 4096,
    "num_hidden_layers": 43,
    "num_attention_heads": 64,
    "num_key_value_heads": 1,
    "head_dim": 512,
    "qk_rope_head_dim": 64,
    "q_lora_rank": 1024,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "num_experts_per_tok": 6,
    "moe_intermediate_size": 2048,
    "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5,
    "swiglu_limit": 10.0,
    "sliding_window": 128,
    "compress_ratios": [0, 0] + [4 if i % 2 == 0 else 128 for i in range(41)] + [0],
    "num_hash_layers": 3,
    "index_n_heads": 64,
    "index_head_dim": 128,
    "index_topk": 512,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "hc_eps": 1e-6,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "compress_rope_theta": 160000.0,
    "rope_scaling": {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                     "beta_fast": 32, "beta_slow": 1},
    "max_position_embeddings": 1048576,
    "num_nextn_predict_layers": 1,
    "expert_dtype": "fp4",
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "scale_fmt": "ue8m0", "weight_block_size": [128, 128]},
    "bos_token_id": 0,
    "eos_token_id": 1,
}


def _hf_round_trip(raw: dict) -> dict:
    """What transformers writes back after reading ``raw`` (the modern dialect)."""
    from transformers import DeepseekV4Config as HFConfig

    return HFConfig.from_dict(dict(raw)).to_dict()


def test_released_config_reads_as_released():
    cfg = DeepseekV4Config.from_dict(RELEASED_FLASH)
    assert cfg.layer_types[:4] == (SLIDING, SLIDING, CSA, HCA) and len(cfg.layer_types) == 43
    assert cfg.compress_ratios[:4] == (0, 0, 4, 128)
    assert cfg.mlp_layer_types[:4] == (HASH_MOE, HASH_MOE, HASH_MOE, MOE)
    assert cfg.rope_head_dim == 64
    assert cfg.rope_main.rope_type == "default" and cfg.rope_main.theta == 10000.0
    c = cfg.rope_compress
    assert (c.rope_type, c.theta, c.factor, c.original_max_position_embeddings) == ("yarn", 160000.0, 16.0, 65536)
    assert c.attention_scaling == 1.0  # V4 does not scale cos / sin
    assert cfg.quant is not None and cfg.quant.expert_dtype == "fp4" and cfg.quant.weight_block_size == (128, 128)


@pytest.mark.parametrize(
    "raw",
    [
        RELEASED_FLASH,
        {**RELEASED_FLASH, "num_hidden_layers": 6, "compress_ratios": [0, 4, 128, 4, 0, 128, 4],
         "num_hash_layers": 2, "rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 32}},
    ],
    ids=["flash", "small"],
)
def test_both_dialects_give_the_same_config(raw):
    modern = _hf_round_trip(raw)
    assert "layer_types" in modern and "compress_ratios" not in modern and "rope_scaling" not in modern
    assert DeepseekV4Config.from_dict(modern) == DeepseekV4Config.from_dict(raw)


@pytest.mark.parametrize("variant", ["legacy", "modern"])
def test_rope_tables_match_transformers(variant):
    from transformers import DeepseekV4Config as HFConfig
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    raw = {**RELEASED_FLASH, "head_dim": 128, "qk_rope_head_dim": 32,
           "rope_scaling": {"type": "yarn", "factor": 8, "original_max_position_embeddings": 4096, "beta_fast": 16}}
    if variant == "modern":
        raw = _hf_round_trip(raw)
    cfg = DeepseekV4Config.from_dict(raw)
    hf = DeepseekV4RotaryEmbedding(HFConfig.from_dict(dict(raw)))
    for label, spec in (("main", cfg.rope_main), ("compress", cfg.rope_compress)):
        torch.testing.assert_close(inv_freq(spec, cfg.rope_head_dim), getattr(hf, f"{label}_inv_freq"), rtol=0, atol=0)
        assert spec.attention_scaling == getattr(hf, f"{label}_attention_scaling")


def test_nested_yarn_without_attention_factor_uses_the_derived_mscale():
    from transformers import DeepseekV4Config as HFConfig
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    raw = _hf_round_trip(RELEASED_FLASH)
    del raw["rope_parameters"]["compress"]["attention_factor"]
    cfg = DeepseekV4Config.from_dict(raw)
    hf = DeepseekV4RotaryEmbedding(HFConfig.from_dict(dict(raw)))
    assert cfg.rope_compress.attention_scaling == pytest.approx(hf.compress_attention_scaling)
    assert cfg.rope_compress.attention_scaling > 1.2


def test_defaults_follow_transformers():
    cfg = DeepseekV4Config.from_dict({"model_type": "deepseek_v4", "num_hidden_layers": 5})
    assert cfg.layer_types == (HCA, HCA, HCA, CSA, HCA)
    assert cfg.mlp_layer_types == (HASH_MOE,) * 3 + (MOE,) * 2
    assert cfg.compress_ratios == (128, 128, 128, 4, 128)
    assert cfg.rope_head_dim == 64 and cfg.rope_compress.rope_type == "default"


@pytest.mark.parametrize(
    "change, message",
    [
        ({"compress_ratios": [0, 5, 4]}, r"compress_ratios\[1\] must be one of \[0, 4, 128\], found 5"),
        ({"layer_types": [SLIDING, "full_attention", CSA]}, "layer_types"),
        ({"mlp_layer_types": ["moe"]}, "mlp_layer_types"),
        ({"num_key_value_heads": 2}, "num_key_value_heads"),
        ({"o_groups": 3}, "o_groups"),
        ({"rope_scaling": {"type": "longrope"}}, "longrope"),
    ],
)
def test_bad_configs_name_the_field(change, message):
    raw = {"model_type": "deepseek_v4", "num_hidden_layers": 3, "num_attention_heads": 4, "o_groups": 2, **change}
    with pytest.raises(ConfigError, match=message):
        DeepseekV4Config.from_dict(raw)



BASE = {"model_type": "deepseek_v4", "num_hidden_layers": 3, "num_attention_heads": 4, "o_groups": 2,
        "n_routed_experts": 8, "num_experts_per_tok": 2, "num_nextn_predict_layers": 1, "head_dim": 128,
        "qk_rope_head_dim": 64, "vocab_size": 1000}
_CSA_RATE_4 = {"compressed_sparse_attention": 4}


@pytest.mark.parametrize(
    "change, message",
    [
        ({"hidden_size": "4096"}, 'hidden_size must be an integer >= 1, found "4096"'),
        ({"hidden_size": None}, "hidden_size must be an integer >= 1, found null"),
        ({"vocab_size": 1.5}, "vocab_size must be an integer >= 1, found 1.5"),
        ({"num_hidden_layers": -2}, "num_hidden_layers must be an integer >= 1, found -2"),
        ({"num_hidden_layers": 2.5}, "num_hidden_layers must be an integer >= 1, found 2.5"),
        ({"num_hidden_layers": True}, "num_hidden_layers must be an integer >= 1, found true"),
        ({"sliding_window": 0}, "sliding_window must be an integer >= 1, found 0"),
        ({"sliding_window": -128}, "sliding_window must be an integer >= 1, found -128"),
        ({"max_position_embeddings": 0}, "max_position_embeddings must be an integer >= 2, found 0"),
        ({"num_experts_per_tok": 9}, "num_experts_per_tok must be at most n_routed_experts (8), found 9"),
        ({"n_routed_experts": 0}, "n_routed_experts must be an integer >= 1, found 0"),
        ({"compress_ratios": [0, 4]},
         "compress_ratios must be a list of 3 or 4 entries of integers >= 0, found [0, 4]"),
        ({"compress_ratios": [0, 4, 128, 0, 4]}, "compress_ratios must be a list of 3 or 4 entries of integers >= 0"),
        ({"compress_ratios": "0,4,128"},
         'compress_ratios must be a list of 3 or 4 entries of integers >= 0, found "0,4'),
        ({"compress_ratios": [0, "4", 128]}, 'compress_ratios[1] must be an integer >= 0, found "4"'),
        ({"compress_ratios": [0, 4.5, 128]}, "compress_ratios[1] must be an integer >= 0, found 4.5"),
        ({"compress_ratios": [0, -4, 128]}, "compress_ratios[1] must be an integer >= 0, found -4"),
        ({"compress_ratios": [0, 4, 8]}, "compress_ratios[2] must be one of [0, 4, 128], found 8"),
        ({"layer_types": [SLIDING] * 5}, "layer_types must be a list of 3 or 4 entries of strings from"),
        ({"mlp_layer_types": [MOE, MOE, "dense"]}, "mlp_layer_types[2] must be one of ['hash_moe', 'moe'], found"),
        ({"num_hash_layers": -1}, "num_hash_layers must be an integer >= 0, found -1"),
        ({"compress_rates": {"full_attention": 4}}, "compress_rates.full_attention must be a key from"),
        ({"compress_rates": {CSA: 0}}, f"compress_rates.{CSA} must be an integer >= 1, found 0"),
        ({"compress_rate_hca": "128"}, 'compress_rate_hca must be an integer >= 1, found "128"'),
        ({"rms_norm_eps": 0}, "rms_norm_eps must be a finite number > 0, found 0"),
        ({"rms_norm_eps": float("nan")}, "rms_norm_eps must be a finite number > 0, found NaN"),
        ({"hc_mult": 0}, "hc_mult must be an integer >= 1, found 0"),
        ({"scoring_func": "relu"},
         "scoring_func must be one of ['sigmoid', 'softmax', 'sqrtsoftplus'], found \"relu\""),
        ({"routed_scaling_factor": "1.5"}, 'routed_scaling_factor must be a finite number > 0, found "1.5"'),
        ({"swiglu_limit": -1}, "swiglu_limit must be a finite number > 0, found -1"),
        ({"tie_word_embeddings": "yes"}, 'tie_word_embeddings must be true or false, found "yes"'),
        ({"eos_token_id": "1"}, 'eos_token_id must be an integer >= 0 and <= 999, found "1"'),
        ({"eos_token_id": [1, 1000]}, "eos_token_id[1] must be an integer >= 0 and <= 999, found 1000"),
        ({"bos_token_id": -1}, "bos_token_id must be an integer >= 0 and <= 999, found -1"),
        ({"qk_rope_head_dim": 63}, "qk_rope_head_dim must be a rope dim that is even and within head_dim 128"),
        ({"qk_rope_head_dim": None, "partial_rotary_factor": 0},
         "partial_rotary_factor must be a finite number > 0 and <= 1, found 0"),
        ({"partial_rotary_factor": 0.25}, "partial_rotary_factor must be qk_rope_head_dim / head_dim = 64/128, found"),
        ({"index_head_dim": 32, "layer_types": [CSA, SLIDING, HCA]},
         "index_head_dim must be at least the rope head dim (64): the indexer's queries are rotated, found 32"),
        ({"rope_scaling": "yarn"}, 'rope_scaling must be a JSON object, found "yarn"'),
        ({"rope_scaling": {"type": "yarn", "factor": 4}},
         "rope_scaling.original_max_position_embeddings is missing; it must be an integer >= 1"),
        ({"rope_scaling": {"type": "yarn", "factor": 4, "original_max_position_embeddings": 32, "beta_fast": 0}},
         "rope_scaling.beta_fast must be a finite number > 0, found 0"),
        ({"rope_scaling": {"type": "yarn", "factor": -4, "original_max_position_embeddings": 32}},
         "rope_scaling.factor must be a finite number > 0, found -4"),
        ({"rope_parameters": {"main": {"rope_type": "default"}}}, "rope_parameters.compress must be an object beside"),
        ({"rope_parameters": {"main": {"rope_type": "default", "rope_theta": 1}, "compress": {"rope_type": "default"}}},
         "rope_parameters.main.rope_theta must be a finite number > 1, found 1"),
        ({"quantization_config": {"weight_block_size": [128]}},
         "quantization_config.weight_block_size must be a list of 2 entries of integers >= 1, found [128]"),
        ({"quantization_config": {"expert_dtype": "int4"}},
         "quantization_config.expert_dtype must be one of ['fp4', 'fp8'], found \"int4\""),
        ({"quantization_config": [128, 128]}, "quantization_config must be a JSON object, found [128, 128]"),
    ],
)
def test_bad_field_values_are_named_with_what_they_take(change, message):
    """Each bad field fails at load with one line: the field, what it takes, what was found (before: raw int() /
    TypeError / an IndexError in the first step, or a silent default)."""
    with pytest.raises(ConfigError) as err:
        DeepseekV4Config.from_dict({**BASE, **change})
    assert str(err.value).startswith("config: ") and message in str(err.value), str(err.value)
    assert "\n" not in str(err.value)


def test_valid_edge_values_still_read():
    cfg = DeepseekV4Config.from_dict({**BASE, "hidden_size": 4096.0, "swiglu_limit": None, "eos_token_id": [1, 2],
                                      "pad_token_id": None, "compress_ratios": [0, 4, 128, 0]})
    assert cfg.hidden_size == 4096 and isinstance(cfg.hidden_size, int)
    assert cfg.swiglu_limit is None and cfg.eos_token_id == [1, 2] and cfg.pad_token_id is None
    assert cfg.layer_types == (SLIDING, CSA, HCA)  # the MTP layer's ratio, listed last, is dropped
    assert DeepseekV4Config.from_dict(BASE).swiglu_limit == 10.0


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"model_type": "deepseek_v4",}', "invalid JSON: Expecting property name enclosed in double quotes at line 1"),
        ("[1, 2]", "expected a JSON object at the top level, found an array"),
        ('"deepseek_v4"', "expected a JSON object at the top level, found a string"),
        ('{"model_type": 4}', "model_type must be a string, found 4"),
        (json.dumps({**BASE, "sliding_window": 0}), "sliding_window must be an integer >= 1, found 0"),
    ],
    ids=["invalid-json", "array", "string", "model-type-number", "bad-field"],
)
def test_config_file_errors_name_the_file(tmp_path, text, message):
    from deepinfer.models import CheckpointError

    (tmp_path / "config.json").write_text(text)
    for call in (lambda: read_model_config(tmp_path),
                 lambda: load_model(tmp_path, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))):
        with pytest.raises(CheckpointError) as err:
            call()
        assert str(err.value).startswith(f"{tmp_path / 'config.json'}: ") and message in str(err.value), str(err.value)

def test_registry_dispatch(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_FLASH))
    assert read_model_config(tmp_path) == DeepseekV4Config.from_dict(RELEASED_FLASH)

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "deepseek_v41", "text_config": {}}))
    assert type(read_model_config(tmp_path)).__name__ == "DeepseekV41Config"

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    supported = r"\['deepseek_v4', 'deepseek_v41', 'deepseek_v41_text'\]"
    for call in (lambda: read_model_config(tmp_path),
                 lambda: load_model(tmp_path, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))):
        with pytest.raises(UnsupportedModelError, match=r"'llama' is not supported; supported: " + supported):
            call()
