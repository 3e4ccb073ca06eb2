"""Train the tiny DeepSeek-V4 checkpoint that DeepInfer ships as its offline default model.

What it is: a ~3M-parameter `transformers.DeepseekV4ForCausalLM` (every V4 block kind: sliding-window,
CSA ratio 4 with the lightning indexer, HCA ratio 128, mHC with 4 streams, hash-MoE then routed MoE with
a shared expert, attention sinks, grouped output projection; no MTP layer) with a byte-level BPE
tokenizer, trained for a quarter of an hour on simple English stories that this script generates from a small
grammar.  It exists so `examples/offline_inference.py` and the end-to-end tests run offline in seconds
and print words rather than noise.

What it is not: a language model.  It knows only the story grammar below; its text is locally
coherent (grammatical sentences, names carried through a story) and nothing more.  The lightning
indexer gets no gradient through its top-k (as in HF's model) and keeps its random initialisation.

Run (1000 steps of 8 x 256 tokens: about 16 minutes on 2 CPU cores shared with other jobs, ~1 s/step):

    .venv/bin/python -m tools.train.tiny_v4 --out deepinfer-core/src/deepinfer/assets/tiny_v4 --steps 1000 --seed 0

Everything (corpus, tokenizer, hash routes, initialisation, batches) derives from --seed, so a rerun
with the same flags and torch version reproduces the checkpoint up to floating-point kernel order.
The output dir gets config.json, model.safetensors (bf16 matrices; mHC, norms, sinks, router bias
and compressor position biases in fp32), tokenizer.json + tokenizer_config.json and
generation_config.json; the script then reloads it with `AutoModelForCausalLM` and prints greedy
continuations of a few prompts.  The asset's README.md is written by hand (numbers from the log).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

# On a shared 2-core machine, spinning OpenMP workers starve each other (3x slower); must precede torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402 - after OMP_WAIT_POLICY is set (see above)
from transformers import (  # noqa: E402 - as torch
    DeepseekV4Config,
    DeepseekV4ForCausalLM,
    GenerationConfig,
    PreTrainedTokenizerFast,
)

from tools.train.corpus import PROMPTS, add_training_args, build_corpus, pack, train, train_tokenizer  # noqa: E402

# --------------------------------------------------------------------------------------------------
# Model: the smallest config that still has every V4 block kind.
# --------------------------------------------------------------------------------------------------


def tiny_config(tokenizer: PreTrainedTokenizerFast) -> DeepseekV4Config:
    """5 layers: SWA, SWA, CSA, HCA, CSA (the released schedule, cut short); hash-MoE in layer 0 only.

    The sliding window is 32 (released: 128) so that ordinary prompts already wrap the SWA ring and
    lean on compressed entries; index_topk 8 < the 32 CSA entries of a 128-token prompt.
    """
    return DeepseekV4Config(
        vocab_size=len(tokenizer),
        hidden_size=192,
        num_hidden_layers=5,
        layer_types=[
            "sliding_attention",
            "sliding_attention",
            "compressed_sparse_attention",
            "heavily_compressed_attention",
            "compressed_sparse_attention",
        ],
        mlp_layer_types=["hash_moe", "moe", "moe", "moe", "moe"],
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=64,
        partial_rotary_factor=0.25,  # 16 rope channels (released: 64 of 512)
        q_lora_rank=96,
        o_groups=2,
        o_lora_rank=64,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        moe_intermediate_size=128,
        index_n_heads=16,
        index_head_dim=32,
        index_topk=8,
        sliding_window=32,
        num_nextn_predict_layers=0,
        max_position_embeddings=1 << 20,
        rope_parameters={
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 65536,
            "beta_fast": 32.0,
            "beta_slow": 1.0,
        },
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )


def set_hash_routes(model: DeepseekV4ForCausalLM, seed: int) -> None:
    """Fill each hash-MoE layer's frozen `tid2eid` with distinct random experts per token.

    HF initialises the table to zeros (real values come from the checkpoint), which would send every
    token to expert 0 twice."""
    gen = torch.Generator().manual_seed(seed)
    cfg = model.config
    for layer in model.model.layers:
        if layer.mlp.is_hash:
            table = torch.stack([torch.randperm(cfg.n_routed_experts, generator=gen)[: cfg.num_experts_per_tok]
                                 for _ in range(cfg.vocab_size)])
            layer.mlp.gate.tid2eid.copy_(table)



# --------------------------------------------------------------------------------------------------
# Saving and checking.
# --------------------------------------------------------------------------------------------------


def _kept_in_fp32(model: DeepseekV4ForCausalLM, name: str) -> bool:
    """Whether HF's V4 keeps this tensor in fp32 (mHC, sinks, norms, router bias, position biases)."""
    return not set(model._keep_in_fp32_modules_strict).isdisjoint(name.split("."))


def cast_for_shipping(model: DeepseekV4ForCausalLM) -> None:
    """bf16 everywhere except what V4 keeps in fp32."""
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and not _kept_in_fp32(model, name):
            tensor.data = tensor.data.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16


def sample(model_dir: Path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy continuations from the saved checkpoint, loaded the way any user would load it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    outs = []
    for prompt in prompts:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False)
        outs.append(tokenizer.decode(gen[0], skip_special_tokens=True))
    return outs



def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_args(parser, out="deepinfer-core/src/deepinfer/assets/tiny_v4")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    stories = build_corpus(args.stories, args.seed)
    held_out_stories = build_corpus(200, args.seed + 1)
    print("sample story:", stories[0])
    tokenizer = train_tokenizer(stories, args.vocab)
    rows, held_out = pack(tokenizer, stories, args.seq_len), pack(tokenizer, held_out_stories, args.seq_len)
    print(f"vocab {len(tokenizer)}, {rows.numel()} training tokens in {len(rows)} rows of {args.seq_len}")

    model = DeepseekV4ForCausalLM(tiny_config(tokenizer))
    set_hash_routes(model, args.seed)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")

    def loss(batch: torch.Tensor) -> torch.Tensor:  # LM loss + the load-balancing aux loss
        return model(input_ids=batch, labels=batch, output_router_logits=True).loss

    def lm_loss(batch: torch.Tensor) -> torch.Tensor:
        return model(input_ids=batch, labels=batch).loss

    final_loss = train(model, loss, rows, held_out, args, eval_fn=lm_loss)

    cast_for_shipping(model)
    model.generation_config = GenerationConfig(
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out)
    tokenizer.save_pretrained(args.out)
    print(f"final train loss (last 50 steps) {final_loss:.3f}; wall {time.time() - t0:.0f}s; saved to {args.out}")
    for text in sample(args.out, PROMPTS, max_new_tokens=60):
        print("---", text)


if __name__ == "__main__":
    main()
