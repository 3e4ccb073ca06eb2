"""The shipped default model (deepinfer/assets/tiny_v41): small, every V4.1 block kind, trained, and DeepInfer's;
it speaks the DeepSeek-V4.1 chat format (its tokenizer has the format's tokens, it was trained on stories asked for
in V4.1 chats).

"Trained" is checked against fresh stories from the generator in tools/train/corpus.py with a seed the training
never used: an untrained model of this vocabulary scores ~7 nats/token, the shipped one well under 1.5.  The
fake-quantizers are active in this model (its head dims are multiples of the blocks), so DeepInfer and the dense
reference agree closely, not bit for bit: a rounding decision flips under a 1e-7 change of its input, and FP4
indexer keys give exactly tied index scores that the two may break differently.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.engine.model_source import EMBEDDED_MODEL_DIR
from deepinfer.models import load_model
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.token_map import CompressedTokenMap
from deepinfer.ops import OpTable
from tests.support.model_runs import run_chunked
from tests.support.tiny_assets import TINY_V41_DIR, corpus, known_words
from tests.support.v4_fixtures import single_thread  # noqa: F401 - a fixture: tiny ops on one thread

ASSET = TINY_V41_DIR
NOISE = "<｜System｜>"  # the DSpark mask token is the system token, as in the released checkpoint
#: The V4.1 format's tokens (deepinfer/chat/deepseek_v41.py, dsml.py): whole tokens, not special.
CHAT_TOKENS = ("<｜System｜>", "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>", "｜DSML｜")

pytestmark = pytest.mark.skipif(not (ASSET / "model.safetensors").is_file(), reason="tiny_v41 asset not built")


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ASSET)


@pytest.fixture(scope="module")
def model():
    return load_model(ASSET, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))


@pytest.fixture(scope="module")
def story(tokenizer) -> torch.Tensor:
    """Fresh stories (a seed the training never used), 200 tokens: past the window, the groups and the pool."""
    return corpus().pack(tokenizer, corpus().build_corpus(8, seed=12345), seq_len=200)[0]


def test_it_is_the_embedded_default():
    assert EMBEDDED_MODEL_DIR == ASSET


def test_asset_is_small_and_complete():
    names = {p.name for p in ASSET.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "README.md"} <= names
    total = sum(p.stat().st_size for p in ASSET.iterdir())
    assert total < 8.5 * 2**20, f"tiny_v41 is {total / 2**20:.1f} MiB"


def test_config_is_the_checkpoints_own_form_with_every_block_kind():
    raw = json.loads((ASSET / "config.json").read_text())
    assert raw["model_type"] == "deepseek_v41" and "engram_pad_token_id" in raw["text_config"]
    cfg = DeepseekV41Config.from_file(ASSET)
    roles = cfg.layers
    for half in (2, 1):  # every CSA2 role in the ratio-2 encoder and in the ratio-1 decoder
        assert {r.mode for r in roles if r.ratio == half} == {"full", "reindex", "reuse"}
    assert any(r.mode == "swa" for r in roles) and cfg.layers[cfg.kv_source_layer_ids[-1]].ratio == 1
    assert sum(r.is_candidate_source for r in roles) == 1 and any(r.uses_candidates for r in roles)
    assert len(cfg.engram_layer_ids) >= 1 and cfg.gate_temp != 1.0 and cfg.hc_mult == 4
    assert cfg.num_experts_per_tok < cfg.n_routed_experts
    # the QAT fake-quantizers apply: SWA FP8 and indexer FP4 per 32, latents FP4 per 16
    assert cfg.head_dim % 32 == 0 and cfg.index_head_dim % 32 == 0
    assert cfg.index_topk < 200 // 2  # a 200-token prompt has more encoder entries than the indexer keeps


def test_dspark_fields_name_the_reserved_noise_token(tokenizer):
    cfg = DeepseekV41Config.from_file(ASSET)
    assert cfg.num_nextn_predict_layers == 2  # the trained drafter (tools/train/tiny_dspark.py): test_tiny_v41_dspark
    assert cfg.dspark_noise_token_id == tokenizer.convert_tokens_to_ids(NOISE)
    assert tokenizer.encode(NOISE, add_special_tokens=False) == [cfg.dspark_noise_token_id]
    assert 4 <= cfg.dspark_block_size <= 5 and set(cfg.dspark_target_layer_ids) <= set(range(cfg.num_hidden_layers))
    assert NOISE not in tokenizer.decode(tokenizer(" ".join(corpus().build_corpus(20, seed=3))).input_ids)


def test_tokenizer_matches_config(tokenizer):
    cfg = DeepseekV41Config.from_file(ASSET)
    assert tokenizer.is_fast and len(tokenizer) == cfg.vocab_size
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id) == (cfg.bos_token_id, cfg.eos_token_id)
    token_map = CompressedTokenMap.from_file(ASSET / "tokenizer.json", cfg.engram_compressed_vocab_size)
    assert token_map.size < len(tokenizer)  # " The" and "the" share an Engram id
    text = 'Once upon a time, there was a little cat named Mia. "Look!" said Mia.'
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id and tokenizer.decode(ids, skip_special_tokens=True) == text


def test_model_has_learned_the_story_grammar(model, tokenizer, story):
    logprobs = run_chunked(model, story, len(story))
    loss = -logprobs[:-1].gather(1, story[1:, None]).mean().item()
    assert loss < 1.5, f"{loss:.2f} nats/token; an untrained model scores ~{math.log(len(tokenizer)):.1f}"


def test_deepinfer_agrees_with_the_dense_reference(model, story):
    from tools.train import v41_dense

    with torch.no_grad():
        ref = torch.log_softmax(v41_dense.load(ASSET)(story[None])[0], -1)
    ours = run_chunked(model, story, len(story))
    gap = (ours - ref)[:-1].gather(1, story[1:, None]).abs()  # teacher-forced: the tokens the text has
    assert gap.max().item() < 0.05 and gap.median().item() < 1e-4, (gap.max().item(), gap.median().item())
    top2 = ref.topk(2, -1).values
    clear = top2[:, 0] - top2[:, 1] > 0.1
    assert bool((ours.argmax(-1) == ref.argmax(-1))[clear].all())


def test_greedy_text_reads_as_words():
    llm = LLM(str(ASSET), dtype="float32", max_model_len=128, max_num_seqs=2)
    (out,) = llm.generate(["Once upon a time, there was a"], SamplingParams(temperature=0, max_tokens=40),
                          use_tqdm=False)
    words = out.outputs[0].text.split()
    assert len(words) >= 15
    known = known_words()
    assert sum(w in known for w in words) >= 0.9 * len(words), words


def test_tokenizer_has_the_chat_formats_tokens(tokenizer):
    ids = [tokenizer.convert_tokens_to_ids(t) for t in CHAT_TOKENS]
    assert ids == list(range(3, 3 + len(CHAT_TOKENS)))  # right after bos, eos, pad
    assert not set(CHAT_TOKENS) & set(tokenizer.all_special_tokens)  # kept by decoding: the reply parsers read them
    for token in CHAT_TOKENS:  # whole
        assert tokenizer.encode(token, add_special_tokens=False) == [tokenizer.convert_tokens_to_ids(token)]
    text = "<｜User｜>Hi<｜Assistant｜></think>Once upon a time."
    assert tokenizer.decode(tokenizer.encode(text, add_special_tokens=False), skip_special_tokens=True) == text


def test_model_has_learned_the_chat_format(model, tokenizer):
    chats = corpus().render_chats(corpus().build_chats(6, seed=54321))
    rows = corpus().pack(tokenizer, chats, seq_len=200)
    logprobs = run_chunked(model, rows[0], len(rows[0]))
    loss = -logprobs[:-1].gather(1, rows[0][1:, None]).mean().item()
    assert loss < 1.5, f"{loss:.2f} nats/token on held-out V4.1 chats"


def test_chat_replies_with_a_story():
    llm = LLM(str(ASSET), dtype="float32", max_model_len=160, max_num_seqs=2)
    (out,) = llm.chat([{"role": "user", "content": "Tell me a story about a dog named Max."}],
                      SamplingParams(temperature=0, max_tokens=48), use_tqdm=False)
    assert out.prompt == ("<｜begin▁of▁sentence｜><｜User｜>Tell me a story about a dog named Max."
                          "<｜Assistant｜></think>")
    words = out.outputs[0].text.split()
    known = known_words()
    assert len(words) >= 20 and sum(w in known for w in words) >= 0.9 * len(words), words
