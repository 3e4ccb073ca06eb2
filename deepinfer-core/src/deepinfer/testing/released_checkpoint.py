"""A synthetic checkpoint in DeepSeek-V4.1-Flash's released layout, at any dims (tiny by default): random weights
stored as the release stores them, for testing loaders, kernels and memory plans without 475 GiB of weights.

What it writes (``docs/models/deepseek_v41.md``, "Loading"; :mod:`deepinfer.models.deepseek_v41.released_layout`
for each tensor's name, dtype and block grid):

- ``model-000NN-of-000MM.safetensors`` + ``model.safetensors.index.json``: the backbone's layers over
  ``backbone_shards`` shards, then one shard per DSpark stage (``mtp.0`` .. ``mtp.{n-1}``), then one per Engram
  table (the real checkpoint: 43 + 3 + 2 = 48);
- the nested ``config.json`` (``text_config``, ``vision_config``, ``quantization_config`` at the top level);
- stubs of the vision tower (``vision.*``, ``aligner.*``, ``image_newline``) that a text engine must ignore;
- ``encoding/`` (the chat format's files; ``encoding.py`` raises if anything ever executes it), the embedded toy
  model's tokenizer (its Engram compressed vocabulary is the tiny config's), ``generation_config.json``.

``write_released_checkpoint(tmp_path / "v41")`` gives a loadable checkpoint in about a second;
``write_released_config(path)`` writes only the real model's ``config.json`` (what ``deepinfer plan`` needs to
plan the release without its shards).
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from deepinfer.engine.model_source import EMBEDDED_MODEL_DIR
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.released_layout import (
    FP8_BLOCK,
    SCALE_COLUMNS,
    LayoutOptions,
    StoredTensor,
    released_layout,
    stored_format,
)

QUANTIZATION_CONFIG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": list(FP8_BLOCK),
                       "scale_fmt": "ue8m0", "expert_dtype": "fp4"}

#: The released model's text config, as published with the checkpoint.
RELEASED_TEXT_CONFIG: dict[str, Any] = {
    "model_type": "deepseek_v41_text", "vocab_size": 129280, "hidden_size": 5120, "num_hidden_layers": 40,
    "num_attention_heads": 64, "num_key_value_heads": 1, "head_dim": 512, "qk_rope_head_dim": 64, "q_lora_rank": 1280,
    "o_lora_rank": 1024, "o_groups": 8, "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-20,
    "max_position_embeddings": 1048576, "rope_theta": 10000, "compress_rope_theta": 160000,
    "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                     "original_max_position_embeddings": 65536},
    "n_routed_experts": 384, "num_experts_per_tok": 6, "n_shared_experts": 1, "moe_intermediate_size": 2304,
    "scoring_func": "sqrtsoftplus", "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
    "sliding_window": 128, "compress_ratios": [0, 0] + [2] * 18 + [1] * 20 + [0, 0, 0],
    "kv_source_layer_ids": [2, 8, 14, 20], "index_source_layer_ids": [2, 8, 14, 20, 24, 28, 32, 36],
    "index_n_heads": 32, "index_head_dim": 128, "index_topk": 512, "candidate_source_layer_id": 20,
    "candidate_topk_blocks": 2048, "candidate_block_size": 8, "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
    "engram_layer_ids": [1, 14], "engram_num_embeddings": [384006168, 384016682], "engram_max_ngram_size": 4,
    "engram_vocab_size": 16000000, "engram_n_heads": 8, "engram_head_dim": 256, "engram_pad_token_id": 2,
    "engram_compressed_vocab_size": 99092, "num_nextn_predict_layers": 3, "dspark_block_size": 5,
    "dspark_noise_token_id": 128799, "dspark_target_layer_ids": [37, 38, 39], "dspark_markov_rank": 256,
    "dspark_n_routed_experts": 128, "dspark_num_experts_per_tok": 3, "tie_word_embeddings": False,
}

#: The embedded model's vocabulary: the synthetic release ships its tokenizer.
_EMBEDDED = json.loads((EMBEDDED_MODEL_DIR / "config.json").read_text())
_EMBEDDED_TEXT: dict[str, Any] = _EMBEDDED.get("text_config", _EMBEDDED)

#: The same structure at toy dims: the embedded model's tokenizer and Engram compressed vocabulary, every CSA2 role
#: (ratio 2 Full / Reindex / Full / Reuse, ratio 1 Full (candidate source) / Reuse / Reindex), two Engram layers,
#: three DSpark stages; dims multiples of 32 so every stored format runs (MXFP4 experts stay packed in ``native``).
TINY_TEXT_CONFIG: dict[str, Any] = {
    **RELEASED_TEXT_CONFIG, "vocab_size": _EMBEDDED_TEXT["vocab_size"], "hidden_size": 64, "num_hidden_layers": 9,
    "num_attention_heads": 4, "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 64, "o_lora_rank": 32,
    "o_groups": 2, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 64, "sliding_window": 16,
    "compress_ratios": [0, 0, 2, 2, 2, 2, 1, 1, 1, 0, 0, 0], "kv_source_layer_ids": [2, 4, 6],
    "index_source_layer_ids": [2, 3, 4, 6, 8], "index_n_heads": 4, "index_head_dim": 32, "index_topk": 8,
    "candidate_source_layer_id": 6, "candidate_topk_blocks": 4, "engram_layer_ids": [1, 4],
    "engram_num_embeddings": [462, 630], "engram_vocab_size": 64, "engram_n_heads": 2, "engram_head_dim": 32,
    "engram_compressed_vocab_size": _EMBEDDED_TEXT["engram_compressed_vocab_size"], "dspark_noise_token_id": 3,
    "dspark_target_layer_ids": [6, 7, 8], "dspark_markov_rank": 32, "dspark_n_routed_experts": 4,
    "dspark_num_experts_per_tok": 2,
}

_VISION_WIDTH = 32
_VISION_CONFIG = {"model_type": "deepseek_v41_vision", "hidden_size": _VISION_WIDTH, "num_hidden_layers": 1,
                  "patch_size": 14, "image_size": 224}


def released_config(text_config: Mapping[str, Any] = TINY_TEXT_CONFIG) -> dict[str, Any]:
    """The nested config.json of the release around ``text_config``."""
    vocab = int(text_config["vocab_size"])
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "torch_dtype": "bfloat16",
            "bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 2, "image_token_id": min(129264, vocab - 1),
            "quantization_config": dict(QUANTIZATION_CONFIG), "text_config": dict(text_config),
            "vision_config": dict(_VISION_CONFIG)}


def write_released_config(directory: str | Path, text_config: Mapping[str, Any] = RELEASED_TEXT_CONFIG) -> Path:
    """``directory/config.json`` alone (the real model's by default): enough for ``deepinfer plan``."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(released_config(text_config), indent=1))
    return directory


def write_released_checkpoint(directory: str | Path, *, text_config: Mapping[str, Any] = TINY_TEXT_CONFIG,
                              seed: int = 0, backbone_shards: int = 4, options: LayoutOptions | None = None,
                              vision: bool = True) -> Path:
    """A checkpoint of random weights in the released layout (see the module docstring); returns ``directory``.
    ``options``: the variants the sources disagree on; ``vision``: write the vision tower's stubs."""
    options = options or LayoutOptions()
    directory = write_released_config(directory, text_config)
    cfg = DeepseekV41Config.from_file(directory)
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for name, shape in _dense_weights(released_layout(cfg, options)).items():
        tensors.update(as_released(name, _random(name, shape, gen), stored_format(name, options)))
    if vision:
        tensors.update(_vision_stubs(cfg.hidden_size, gen))
    _write_shards(directory, tensors, _shard_keys(tensors, cfg, backbone_shards))
    _write_side_files(directory)
    return directory


def _dense_weights(layout: list[StoredTensor]) -> dict[str, tuple[int, ...]]:
    """Each weight of ``layout`` with its dense shape (an MXFP4 weight's columns are twice its bytes)."""
    out = {}
    for t in layout:
        if not t.name.endswith(".scale"):
            out[t.name] = (t.shape[0], t.shape[1] * 2) if t.dtype == "I8" else t.shape
    return out


def _random(name: str, shape: tuple[int, ...], gen: torch.Generator) -> torch.Tensor:
    """A value that exercises the tensor's code path with activations of order one."""
    leaf = name.rsplit(".", 1)[-1]
    noise = torch.randn(shape, generator=gen)
    if name.endswith(("norm.weight", "_scale", "q_weight", "k_weight")):
        return 1 + 0.1 * noise
    if name.endswith(("_base", "attn_sink")):
        return 0.5 * noise
    if name.endswith((".gate.bias", ".gate.bias_vl")):
        return 0.1 * noise
    if leaf.endswith("_fn"):
        return noise * (0.5 / math.sqrt(shape[1]))
    if name.endswith("embed.weight"):  # the embedding, Engram tables, the Markov code
        return noise
    return noise / math.sqrt(shape[-1])  # projections and experts: [out, in]


def as_released(name: str, value: torch.Tensor, fmt: str) -> dict[str, torch.Tensor]:
    """``value`` as the release stores it: quantized (with its ``.scale``) or in a plain dtype."""
    from deepinfer.quant import quantize_fp8_block, quantize_mxfp4

    scale_name = name.removesuffix(".weight") + ".scale"
    if fmt == "mxfp4":
        q = quantize_mxfp4(value)
        return {name: q.data.view(torch.int8), scale_name: q.scale}  # two e2m1 a byte, low nibble first
    if fmt in ("fp8", "fp8_rows"):
        q = quantize_fp8_block(value, (1, SCALE_COLUMNS) if fmt == "fp8_rows" else FP8_BLOCK)
        return {name: q.data, scale_name: q.scale}
    return {name: value.to({"F32": torch.float32, "BF16": torch.bfloat16}[fmt])}


def _vision_stubs(hidden: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    width = _VISION_WIDTH
    return {"vision.patch_embed.proj.weight": 0.02 * torch.randn(width, 3 * 14 * 14, generator=gen),
            "vision.blocks.0.attn.qkv.weight": 0.02 * torch.randn(3 * width, width, generator=gen),
            "vision.blocks.0.norm1.weight": torch.ones(width),
            "aligner.layers.0.weight": 0.02 * torch.randn(hidden, width, generator=gen),
            "image_newline": 0.02 * torch.randn(hidden, generator=gen)}


def _shard_keys(tensors: Mapping[str, torch.Tensor], cfg: DeepseekV41Config, backbone_shards: int
                ) -> dict[str, int]:
    """Shard index of every tensor: backbone layers in ``backbone_shards`` runs (the embedding first, the head,
    final norm and vision stubs last), then each DSpark stage, then each Engram table, as released."""
    layers, stages = cfg.num_hidden_layers, cfg.num_nextn_predict_layers
    per = -(-layers // backbone_shards)
    out = {}
    for name in tensors:
        parts = name.split(".")
        if ".engram.embed." in name:
            out[name] = backbone_shards + stages + cfg.engram_layer_ids.index(int(parts[1]))
        elif parts[0] == "mtp":
            out[name] = backbone_shards + int(parts[1])
        elif parts[0] == "layers":
            out[name] = int(parts[1]) // per
        else:
            out[name] = 0 if name == "embed.weight" else backbone_shards - 1
    return out


def _write_shards(directory: Path, tensors: Mapping[str, torch.Tensor], shard_of: Mapping[str, int]) -> None:
    from safetensors.torch import save_file

    count = max(shard_of.values()) + 1
    weight_map, total = {}, 0
    for index in range(count):
        file = f"model-{index + 1:05d}-of-{count:05d}.safetensors"
        part = {n: t.contiguous() for n, t in tensors.items() if shard_of[n] == index}
        save_file(part, str(directory / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
        total += sum(t.numel() * t.element_size() for t in part.values())
    index_file = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index_file, indent=1))


_ENCODING_PY = '''"""Stand-in for the release's chat encoder: DeepInfer reads this directory, never runs it."""
raise RuntimeError("encoding/encoding.py of a checkpoint must never be executed")
'''


def _write_side_files(directory: Path) -> None:
    """The tokenizer (the embedded model's), generation config and the ``encoding/`` files."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(EMBEDDED_MODEL_DIR / name, directory / name)
    (directory / "generation_config.json").write_text(json.dumps({"bos_token_id": 0, "eos_token_id": 1}))
    encoding = directory / "encoding"
    (encoding / "tests").mkdir(parents=True, exist_ok=True)
    (encoding / "encoding.py").write_text(_ENCODING_PY)
    (encoding / "README.md").write_text("# Chat encoding\n\nThe release's chat format (no Jinja template ships).\n")
    (encoding / "tests" / "test_input_1.json").write_text(json.dumps({"messages": [{"role": "user",
                                                                                    "content": "Hi"}]}))
    (encoding / "tests" / "test_output_1.txt").write_text("<｜User｜>Hi<｜Assistant｜>")
