"""Train the tiny DeepSeek-V4.1 checkpoint that DeepInfer ships as its offline default model.

What it is: a ~3M-parameter DeepSeek-V4.1 text model with every V4.1 block kind (single-pass mHC with 4
streams; two sliding-window-only layers; ratio-2 encoder groups and a ratio-1 decoder whose global KV its kv
source computes once; the CSA2 roles Full / Reindex / Reuse in both halves; the candidate indexer; private SWA
with sinks, partial + inverse RoPE (YaRN on the compressed family) and grouped O-proj; the QAT fake-quantizers
(FP8 SWA, FP4 latents, FP4 indexer q / k: the head dims are multiples of their blocks); two Engram layers with
the tokenizer-derived compressed token map; sqrt-softplus MoE with ``gate_temp`` and a shared expert; V4.1 has
no hash layers), with a byte-level BPE tokenizer that has the DeepSeek-V4.1 chat format's tokens under their
released names (``<｜System｜>``, also the DSpark noise token as in the release, ``<｜User｜>``, ``<｜Assistant｜>``,
``<think>``, ``</think>``, ``｜DSML｜``: whole tokens, not special).  Trained on the simple English stories of
``tools.train.corpus``, half of them as they are and half asked for in V4.1 chats (a user asks for a story, often
naming its hero; the assistant tells it with thinking off; rendered by DeepInfer's own V4.1 renderer), so the
example and the end-to-end tests run offline in seconds and print words, and chat replies are stories.

How: transformers has no V4.1 in a release, so the training forward is the repository's dense PyTorch
reference of V4.1 (``tools.train.v41_dense``, differentiable; the fake-quantizers straight-through, the
integer selections without gradient, so the indexers keep their random initialisation).  Its parameters carry
the checkpoint's own tensor names, so the state dict is the checkpoint.  After saving, the tool loads the files
with DeepInfer's own V4.1 loader and checks its logits against the trained model's (the saved bf16 weights).

Run (2 CPU threads; half an hour to an hour on a shared 2-core machine):

    nice .venv/bin/python -m tools.train.tiny_v41 --out deepinfer-core/src/deepinfer/assets/tiny_v41

The DSpark fields (block size, noise token, target layers, drafter experts) are in config.json with
``num_nextn_predict_layers`` 0: the drafter (``mtp.*``) is trained and added separately.  Everything derives
from --seed; a rerun with the same flags and torch version reproduces the checkpoint up to kernel order.
The asset's README.md is written by hand (numbers from the log).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path
from typing import Any

# On a shared 2-core machine, spinning OpenMP workers starve each other (3x slower); must precede torch.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402 - after OMP_WAIT_POLICY is set (see above)
import torch.nn.functional as F  # noqa: E402 - as torch
from safetensors.torch import save_file  # noqa: E402 - as torch
from transformers import PreTrainedTokenizerFast  # noqa: E402 - as torch

from deepinfer.chat.deepseek_v41 import ASSISTANT, END_THINK, SYSTEM, THINK, USER  # noqa: E402 - as torch
from deepinfer.chat.dsml import DSML  # noqa: E402 - as torch
from deepinfer.testing.model_runs import run_chunked  # noqa: E402 - as torch
from tools.train import v41_dense  # noqa: E402 - as torch
from tools.train.corpus import (  # noqa: E402 - as torch
    PROMPTS,
    add_training_args,
    build_chats,
    build_corpus,
    eval_loss,
    pack,
    render_chats,
    train,
    train_tokenizer,
)

#: The V4.1 format's tokens, with the released tokenizer's names (ids 3.. here): whole, not special.
CHAT_TOKENS = (SYSTEM, USER, ASSISTANT, THINK, END_THINK, DSML)
NOISE = SYSTEM  # the DSpark drafter's mask token is <｜System｜>, as in the released checkpoint (id 128799 there)
CHAT_PROMPTS = ["Tell me a story.", "Tell me a story about a cat named Mia.", "Write a short story about Max the dog."]

# --------------------------------------------------------------------------------------------------
# Model: the released V4.1 schedule, cut to 9 layers.
# --------------------------------------------------------------------------------------------------

#: layer: 0 SWA | 1 SWA + Engram | 2 enc Full | 3 enc Reindex | 4 enc Full + Engram | 5 enc Reuse |
#: 6 dec Full (the decoder's kv source, candidate source) | 7 dec Reuse | 8 dec Reindex (in the candidate pool)
COMPRESS_RATIOS = [0, 0, 2, 2, 2, 2, 1, 1, 1]
KV_SOURCES, INDEX_SOURCES, ENGRAM_LAYERS = [2, 4, 6], [2, 3, 4, 6, 8], [1, 4]  # released Engram: layers 1 and 14
ENGRAM_PRIME_START, ENGRAM_NGRAM, ENGRAM_HEADS = 1000, 3, 2


def engram_rows(n_layers: int) -> list[int]:
    """Table rows per Engram layer: the sum of its hash buckets, consecutive primes from ENGRAM_PRIME_START
    (the reference's rule, spec §9.3: (n-gram sizes x heads) primes per layer, none reused)."""
    seen: set[int] = set()
    cols = (ENGRAM_NGRAM - 1) * ENGRAM_HEADS
    return [sum(v41_dense._next_prime(ENGRAM_PRIME_START, seen) for _ in range(cols)) for _ in range(n_layers)]


def tiny_config(tokenizer: PreTrainedTokenizerFast, compressed_vocab: int) -> dict[str, Any]:
    """config.json in the released checkpoint's own form: composite ``deepseek_v41`` with the text model under
    ``text_config``, ``engram_pad_token_id``, a flat YaRN ``rope_scaling``.  The sliding window is 32 (released:
    128) so ordinary prompts wrap it; index_topk 16 is below the entry count of any prompt over 32 tokens."""
    ids = {"bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
           "pad_token_id": tokenizer.pad_token_id}
    text = {
        "model_type": "deepseek_v41_text", "vocab_size": len(tokenizer), "hidden_size": 128,
        "num_hidden_layers": len(COMPRESS_RATIOS), "num_attention_heads": 4, "num_key_value_heads": 1,
        "head_dim": 64, "qk_rope_head_dim": 16, "q_lora_rank": 64, "o_groups": 2, "o_lora_rank": 64,
        "hidden_act": "silu", "swiglu_limit": 10.0, "rms_norm_eps": 1e-20, "tie_word_embeddings": False,
        "max_position_embeddings": 1 << 20, "rope_theta": 10000, "compress_rope_theta": 160000,
        "rope_scaling": {"rope_type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                         "original_max_position_embeddings": 65536},
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "moe_intermediate_size": 96,
        "scoring_func": "sqrtsoftplus", "gate_temp": 0.8, "topk_method": "noaux_tc", "norm_topk_prob": True,
        "routed_scaling_factor": 1.5, "sliding_window": 32,
        "compress_ratios": COMPRESS_RATIOS, "kv_source_layer_ids": KV_SOURCES,
        "index_source_layer_ids": INDEX_SOURCES, "index_n_heads": 8, "index_head_dim": 32, "index_topk": 16,
        "candidate_source_layer_id": KV_SOURCES[-1], "candidate_topk_blocks": 4, "candidate_block_size": 8,
        "hc_mult": 4, "hc_sinkhorn_iters": 20, "hc_eps": 1e-6,
        "engram_layer_ids": ENGRAM_LAYERS, "engram_num_embeddings": engram_rows(len(ENGRAM_LAYERS)),
        "engram_max_ngram_size": ENGRAM_NGRAM, "engram_vocab_size": ENGRAM_PRIME_START,
        "engram_n_heads": ENGRAM_HEADS, "engram_head_dim": 32, "engram_pad_token_id": tokenizer.pad_token_id,
        "engram_compressed_vocab_size": compressed_vocab,
        "num_nextn_predict_layers": 0,  # the DSpark drafter is added (and this flipped) by its own tool
        "dspark_block_size": 4, "dspark_noise_token_id": tokenizer.convert_tokens_to_ids(NOISE),
        "dspark_target_layer_ids": [6, 7, 8], "dspark_markov_rank": 32, "dspark_n_routed_experts": 4,
        "dspark_num_experts_per_tok": 2, **ids,
    }
    return {"architectures": ["DeepseekV41ForCausalLM"], "model_type": "deepseek_v41", "dtype": "bfloat16",
            **ids, "text_config": text}


def initialise(model: v41_dense.V41Model, seed: int) -> None:
    """The reference zero-fills the router and mHC projections (checkpoints overwrite them); training needs them
    random: symmetric streams and routers never separate."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("hc_attn_fn", "hc_ffn_fn")):
                p.normal_(0.0, 0.02, generator=gen)
            elif name.endswith("ffn.gate.weight"):
                p.normal_(0.0, p.shape[1] ** -0.5, generator=gen)
            elif name.endswith("engram.wkv.weight"):
                p.normal_(0.0, 0.02, generator=gen)


def lm_loss(model: v41_dense.V41Model, batch: torch.Tensor) -> torch.Tensor:
    logits = model(batch)
    return F.cross_entropy(logits[:, :-1].flatten(0, 1), batch[:, 1:].flatten())


# --------------------------------------------------------------------------------------------------
# Saving and checking.
# --------------------------------------------------------------------------------------------------

#: Tensors the released checkpoint (and the reference) keep in fp32: mHC, sinks, router biases.
KEEP_FP32 = v41_dense._KEEP_FP32


def round_for_shipping(model: v41_dense.V41Model) -> dict[str, torch.Tensor]:
    """The checkpoint's tensors: bf16 except :data:`KEEP_FP32`; the model's weights are rounded alike, so the
    model IS what is shipped."""
    state = {}
    with torch.no_grad():
        for name, tensor in model.state_dict(keep_vars=True).items():
            if tensor.is_floating_point() and not name.endswith(KEEP_FP32):
                tensor.copy_(tensor.to(torch.bfloat16))  # rounded in place: the model keeps computing in fp32
                state[name] = tensor.detach().to(torch.bfloat16).contiguous()
            else:
                state[name] = tensor.detach().contiguous()
    return state


def save(model: v41_dense.V41Model, tokenizer: PreTrainedTokenizerFast, config: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    save_file(round_for_shipping(model), out / "model.safetensors", metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    generation = {k: config[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    (out / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")


def check_deepinfer_matches(model: v41_dense.V41Model, out: Path, rows: torch.Tensor) -> tuple[float, float]:
    """(max, median) |teacher-forced logprob difference| between the trained model and DeepInfer's own loader
    on ``rows`` (fp32); raises if DeepInfer's greedy choice differs where the model's top-2 margin is clear.

    Close, not bit-equal: the fake-quantizers round (an input 1e-7 from a grid boundary flips a code) and FP4
    indexer keys give exactly tied index scores, which two implementations may break differently."""
    from deepinfer.models import load_model
    from deepinfer.ops import OpTable

    loaded = load_model(out, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
    model.eval()
    gaps = []
    with torch.no_grad():
        for row in rows:
            ours = torch.log_softmax(model(row[None])[0], -1)
            theirs = run_chunked(loaded, row, len(row))
            gaps.append((ours - theirs)[:-1].gather(1, row[1:, None]).abs().flatten())
            top2 = ours.topk(2, -1).values
            clear = top2[:, 0] - top2[:, 1] > 0.1
            if not bool((ours.argmax(-1) == theirs.argmax(-1))[clear].all()):
                raise SystemExit("DeepInfer's greedy choice differs from the trained model's on a clear position")
    gap = torch.cat(gaps)
    return gap.max().item(), gap.median().item()


def sample(out: Path, prompts: list[str], max_new_tokens: int) -> list[str]:
    """Greedy continuations from the saved files through DeepInfer's engine, as any user would run them."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(str(out), dtype="float32")
    params = SamplingParams(temperature=0, max_tokens=max_new_tokens)
    return [p + o.outputs[0].text for p, o in zip(prompts, llm.generate(prompts, params, use_tqdm=False), strict=True)]


def chat_samples(out: Path, max_new_tokens: int) -> list[str]:
    """Greedy replies of the saved model to :data:`CHAT_PROMPTS` through ``LLM.chat`` (the V4.1 format)."""
    from deepinfer import LLM, SamplingParams

    llm = LLM(str(out), dtype="float32")
    outs = llm.chat([[{"role": "user", "content": p}] for p in CHAT_PROMPTS],
                    SamplingParams(temperature=0, max_tokens=max_new_tokens), use_tqdm=False)
    return [f"[user] {p} [assistant] {o.outputs[0].text}" for p, o in zip(CHAT_PROMPTS, outs, strict=True)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_training_args(parser, out="deepinfer-core/src/deepinfer/assets/tiny_v41", steps=500, batch=4)
    parser.add_argument("--chats", type=int, default=20000, help="story requests rendered as V4.1 chats")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t0 = time.time()
    stories = build_corpus(args.stories, args.seed)
    chats = render_chats(build_chats(args.chats, args.seed + 2))
    texts = [t for pair in zip(stories, chats, strict=False) for t in pair] + stories[len(chats):]
    held_out_stories, held_out_chats = build_corpus(200, args.seed + 1), render_chats(build_chats(100, args.seed + 3))
    tokenizer = train_tokenizer(texts, args.vocab, chat_tokens=CHAT_TOKENS)
    args.out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(args.out)  # Engram's compressed token map is derived from tokenizer.json
    token_map = v41_dense.compressed_token_map(args.out / "tokenizer.json")
    config = tiny_config(tokenizer, len(set(token_map)))
    rows, held_out = pack(tokenizer, texts, args.seq_len), pack(tokenizer, held_out_stories, args.seq_len)
    held_out_chat_rows = pack(tokenizer, held_out_chats, args.seq_len)
    print(f"vocab {len(tokenizer)} ({len(set(token_map))} compressed), {rows.numel()} training tokens "
          f"({len(stories)} stories, {len(chats)} chats)")

    model = v41_dense.V41Model(v41_dense.V41Config.from_dict(config), token_map)
    initialise(model, args.seed)
    print(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    final_loss = train(model, lambda batch: lm_loss(model, batch), rows, held_out, args)
    chat_loss = eval_loss(model, lambda batch: lm_loss(model, batch), held_out_chat_rows, args.batch)
    print(f"held-out chat loss {chat_loss:.3f}")

    save(model, tokenizer, config, args.out)
    print(f"final train loss (last 50 steps) {final_loss:.3f}; wall {time.time() - t0:.0f}s; saved to {args.out}")
    worst, median = check_deepinfer_matches(model, args.out, held_out[:4])
    print(f"DeepInfer vs the trained model, teacher-forced logprobs of 4 x {args.seq_len} held-out tokens (fp32): "
          f"|diff| max {worst:.3g}, median {median:.3g}; greedy choices equal where the margin is > 0.1")
    for text in sample(args.out, PROMPTS, max_new_tokens=60) + chat_samples(args.out, max_new_tokens=60):
        print("---", text)


if __name__ == "__main__":
    main()
