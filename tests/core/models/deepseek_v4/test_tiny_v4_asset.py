"""The shipped default model (deepinfer/assets/tiny_v4): small, complete V4 architecture, and trained.

"Trained" is checked against fresh stories from the generator in tools/train/corpus.py with a seed the
training never used: an untrained model of this vocabulary scores ~7 nats/token, the shipped one < 1.0.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from tests.support.tiny_assets import TINY_V4_DIR, corpus, known_words

ASSET = TINY_V4_DIR


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSET)


@pytest.fixture(scope="module")
def model():
    """One thread: batch-1 generation of a 3M model is all tiny ops, and two OpenMP workers spinning against
    each other on a busy 2-core CI box made these tests 30x slower."""
    from transformers import AutoModelForCausalLM

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield AutoModelForCausalLM.from_pretrained(ASSET).eval()
    torch.set_num_threads(threads)


def test_asset_is_small_and_complete():
    names = {p.name for p in ASSET.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md"} <= names
    total = sum(p.stat().st_size for p in ASSET.iterdir())
    assert total < 8.5 * 2**20, f"tiny_v4 is {total / 2**20:.1f} MiB"


def test_config_exercises_every_v4_block_kind():
    cfg = json.loads((ASSET / "config.json").read_text())
    assert cfg["model_type"] == "deepseek_v4"
    kinds = {"sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention"}
    assert kinds <= set(cfg["layer_types"])
    assert cfg["compress_rates"] == {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
    mlp = cfg["mlp_layer_types"]
    assert mlp[0] == "hash_moe" and "moe" in mlp and mlp.index("moe") > mlp.index("hash_moe")
    assert cfg["hc_mult"] == 4 and cfg["index_n_heads"] == 16
    assert cfg["num_experts_per_tok"] == 2 < cfg["n_routed_experts"] and cfg["n_shared_experts"] == 1
    assert cfg["num_nextn_predict_layers"] == 0
    # A prompt of a few hundred tokens has more CSA entries than the indexer keeps.
    assert cfg["index_topk"] < 256 // cfg["compress_rates"]["compressed_sparse_attention"]


def test_tokenizer_is_fast_and_matches_config(tokenizer):
    cfg = json.loads((ASSET / "config.json").read_text())
    gen = json.loads((ASSET / "generation_config.json").read_text())
    assert tokenizer.is_fast
    assert len(tokenizer) == cfg["vocab_size"]
    assert tokenizer.bos_token_id == cfg["bos_token_id"] and tokenizer.eos_token_id == cfg["eos_token_id"]
    assert gen["eos_token_id"] == tokenizer.eos_token_id
    text = 'Once upon a time, there was a little cat named Mia. "Look!" said Mia.'
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_hash_routes_pick_distinct_experts(model):
    cfg = model.config
    hashed = [layer.mlp.gate.tid2eid for layer in model.model.layers if layer.mlp.is_hash]
    assert hashed
    for table in hashed:
        assert table.shape == (cfg.vocab_size, cfg.num_experts_per_tok)
        assert ((table >= 0) & (table < cfg.n_routed_experts)).all()
        assert (table[:, 0] != table[:, 1]).all()
        assert len(torch.unique(table[:, 0])) == cfg.n_routed_experts  # every expert is someone's first choice


def test_model_has_learned_the_story_grammar(model, tokenizer):
    ids = corpus().pack(tokenizer, corpus().build_corpus(8, seed=12345), seq_len=320)[:1]  # > 128: HCA entries too
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    assert loss < 1.0, f"{loss:.2f} nats/token; an untrained model scores ~{math.log(len(tokenizer)):.1f}"


def test_greedy_text_reads_as_words(model, tokenizer):
    known = known_words()
    ids = tokenizer("Once upon a time, there was a", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=40, do_sample=False)
    words = tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True).split()
    assert len(words) >= 15
    assert sum(w in known for w in words) >= 0.9 * len(words), words


def test_stories_end_with_eos(model, tokenizer):
    """generation_config's eos is the token the model emits after a story, so generation stops by itself."""
    ids = tokenizer("Once upon a time, there was a little cat named Mia.", return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=200, do_sample=False)
    assert out[0, -1].item() == tokenizer.eos_token_id, "no eos within 200 tokens"
    assert tokenizer.decode(out[0], skip_special_tokens=True).endswith(".")
