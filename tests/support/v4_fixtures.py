"""Tiny random DeepSeek-V4 checkpoints saved by transformers, and running them in DeepInfer and in HF.

``build_checkpoint`` makes a ``transformers.DeepseekV4ForCausalLM`` from a small config, gives every
parameter and buffer a meaningful random value (transformers' init leaves sinks, position biases, router
bias and ``tid2eid`` at zero, which would hide whole code paths), and ``save_pretrained``s it: the files carry
the released checkpoint's tensor names.  Also used by ``tools/make_tiny_v4.py``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def single_thread():
    """Tiny ops run faster on one thread, and a shared 2-core CI machine then does not thrash.
    Import this fixture into a test module to apply it there."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


#: Small enough for a 2-core CI machine, large enough that every component matters: windows of 16 tokens,
#: CSA rate 4 / HCA rate 16, top-8 of the compressed entries, 16 indexer heads (exact top-k ties are rare).
SMALL: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    moe_intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    head_dim=32,
    q_lora_rank=32,
    o_groups=2,
    o_lora_rank=16,
    n_routed_experts=8,
    num_experts_per_tok=2,
    index_n_heads=16,
    index_head_dim=16,
    index_topk=8,
    sliding_window=16,
    layer_types=[
        "compressed_sparse_attention",
        "sliding_attention",
        "heavily_compressed_attention",
        "compressed_sparse_attention",
    ],
    mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
    compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
    partial_rotary_factor=0.5,
    swiglu_limit=2.0,  # low enough that the clamp bites on random weights
    rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32},
    max_position_embeddings=128,
)

#: The released geometry that matters for state: 128-token window, CSA rate 4, HCA rate 128.
RELEASED_RATES: dict[str, Any] = {
    **SMALL,
    "num_hidden_layers": 3,
    "sliding_window": 128,
    "layer_types": ["heavily_compressed_attention", "compressed_sparse_attention", "sliding_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128},
    "index_topk": 16,
    "swiglu_limit": 10.0,
    "rope_parameters": {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 64},
    "max_position_embeddings": 1024,
}


def hf_model(config: dict[str, Any], seed: int = 0):
    """A randomly initialised HF model of ``config`` in fp32, eval mode."""
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(DeepseekV4Config(**config)).eval()
    randomize(model, seed)
    return model


@torch.no_grad()
def randomize(model, seed: int) -> None:
    """Give every tensor a value that exercises its code path; scales keep activations O(1)."""
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        leaf = name.rsplit(".", 1)[-1]
        if leaf.endswith("inv_freq"):
            continue
        if leaf == "tid2eid":
            rows = [torch.randperm(cfg.n_routed_experts, generator=gen)[: t.shape[1]] for _ in range(t.shape[0])]
            t.copy_(torch.stack(rows))
        elif leaf in ("sinks", "position_bias", "hc_base", "base"):
            t.normal_(0.0, 0.5, generator=gen)
        elif leaf == "e_score_correction_bias":
            t.normal_(0.0, 0.1, generator=gen)
        elif leaf in ("scale", "hc_scale") or name.endswith("norm.weight") or leaf == "weight" and t.dim() == 1:
            t.copy_(1 + 0.1 * torch.randn(t.shape, generator=gen))
        elif leaf in ("fn", "hc_fn"):
            t.normal_(0.0, 0.5 / math.sqrt(t.shape[1]), generator=gen)
        elif "embed" in name:
            t.normal_(0.0, 1.0, generator=gen)
        else:  # projections and stacked experts: [.., out, in]
            t.normal_(0.0, 1.0 / math.sqrt(t.shape[-1]), generator=gen)


def build_checkpoint(directory: str | Path, config: dict[str, Any], seed: int = 0):
    """Save a random tiny model with ``save_pretrained``; returns ``(directory, hf_model)``."""
    model = hf_model(config, seed)
    model.save_pretrained(directory)
    return Path(directory), model


def build_engine_checkpoint(directory: str | Path, config: dict[str, Any], seed: int = 0,
                            vocab_size: int | None = None):
    """``build_checkpoint`` with the toy tokenizer saved beside it, so ``LLM(directory)`` loads both.

    The model's vocab is ``vocab_size`` (default: the tokenizer's length).  Returns ``(directory, hf_model)``.
    """
    from tests.support.toy_model import toy_tokenizer

    tok = toy_tokenizer() if vocab_size is None else toy_tokenizer(vocab_size)
    built = build_checkpoint(directory, {**config, "vocab_size": vocab_size or len(tok)}, seed)
    tok.save_pretrained(directory)
    return built


@torch.no_grad()
def hf_logprobs(model, tokens: torch.Tensor) -> torch.Tensor:
    """Teacher-forced log-probabilities [S, V] of one sequence, the whole sequence in one call."""
    logits = model(tokens[None], use_cache=False).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def random_tokens(length: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randint(0, vocab, (length,), generator=torch.Generator().manual_seed(seed))


def read_tensors(directory: str | Path) -> dict[str, torch.Tensor]:
    """All tensors of a single-file checkpoint, by stored name."""
    from safetensors.torch import load_file

    return load_file(str(Path(directory) / "model.safetensors"))


def write_checkpoint(directory: str | Path, tensors: dict[str, torch.Tensor], config: dict[str, Any]) -> Path:
    """A single-file safetensors checkpoint with ``config`` as config.json."""
    import json

    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
