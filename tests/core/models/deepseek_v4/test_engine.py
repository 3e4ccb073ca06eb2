"""The engine on a real (tiny, random) DeepSeek-V4 checkpoint, against transformers as the oracle.

The checkpoint is saved by ``transformers.DeepseekV4ForCausalLM.save_pretrained`` (the released tensor
names) with a small byte-level tokenizer, and loaded through ``LLM(model=<dir>)`` like a user would.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.support.v4_fixtures import SMALL, build_engine_checkpoint, hf_logprobs

PROMPTS = [
    "Once upon a time", "The quick brown fox jumps over the lazy dog.", "Le café", "日本語",
    "She liked to read books", "Numbers: 0 1 2 3", "def generate(prompt):", "x",
    "Once upon a time there was a little girl who lived in a small house near the woods, and she",
    "crème brûlée", "The", "sing songs and play in the park with her friends", "{ } [ ] ( )",
    "a b c d e f g h i j k l m n o p q r s t u v w x y z", "Tokyo", "10 100 1000",
]
NEW_TOKENS = 8
NEAR_TIE = 1e-3


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_engine_checkpoint(tmp_path_factory.mktemp("tiny_v4_random"), SMALL)


@pytest.fixture(scope="module")
def llm(checkpoint):
    return LLM(str(checkpoint[0]), dtype="float32")


def test_loads_through_the_public_api(llm, checkpoint):
    assert llm.engine.model.vocab_size == len(llm.tokenizer)
    assert llm.engine.config.eos_token_ids == (1,)


def test_greedy_matches_hf_generate(llm, checkpoint):
    """16 prompts, greedy: equal to HF ``generate`` unless HF itself faced a near-tie on the way."""
    hf = checkpoint[1]
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                        use_tqdm=False)
    compared = 0
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                              do_sample=False)[0, ids.shape[1]:].tolist()
        logp = hf_logprobs(hf, torch.tensor(out.prompt_token_ids + ref))[len(out.prompt_token_ids) - 1 : -1]
        top2 = logp.topk(2, dim=-1).values
        margins = (top2[:, 0] - top2[:, 1]).tolist()
        mine = out.outputs[0].token_ids
        for i, (a, b) in enumerate(zip(mine, ref, strict=False)):  # HF stops at its EOS
            if a != b:
                assert margins[i] < NEAR_TIE, f"diverged at {i} with HF margin {margins[i]}"
                break
        else:
            compared += 1
    assert compared >= 12


STORY_PROMPTS = [
    "Once upon a time, there was a little girl named Lily.", "Tom had a big red ball. One day,",
    "One day, a small dog found a shiny key", "The sun was warm. Mia and her mom went to the park.",
    "Ben was a brave bear who lived", "It was a rainy day.", "Zoe picked up the", "They ate cookies and",
    "Once upon a time, there was a small cat named Emma. She", "Max and Sam went to the beach",
    "Lucy saw a kite stuck in a tree.", "The clouds were gray.", '"Can you help me?" asked', "That night,",
    "Nora liked to read books", "Jack found a shell",
]


def test_embedded_model_greedy_matches_hf():
    """The trained tiny_v4 checkpoint (real tokenizer): greedy stories equal HF's where margins allow."""
    from transformers import DeepseekV4ForCausalLM

    from tests.support.tiny_assets import TINY_V4_DIR

    if not (TINY_V4_DIR / "model.safetensors").is_file():
        pytest.skip("the tiny_v4 checkpoint is not in this checkout yet")
    hf = DeepseekV4ForCausalLM.from_pretrained(TINY_V4_DIR, dtype=torch.float32).eval()
    llm = LLM(str(TINY_V4_DIR), dtype="float32")
    outs = llm.generate(STORY_PROMPTS, SamplingParams(temperature=0, max_tokens=12, prompt_logprobs=0),
                        use_tqdm=False)
    exact = 0
    for out in outs:
        ids = torch.tensor([out.prompt_token_ids])
        with torch.no_grad():
            ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False,
                              eos_token_id=list(llm.engine.config.eos_token_ids),
                              pad_token_id=llm.tokenizer.pad_token_id)[0, ids.shape[1]:].tolist()
        logp = hf_logprobs(hf, torch.tensor(out.prompt_token_ids + ref))
        for pos in range(1, len(out.prompt_token_ids)):  # prompt logprobs against the same oracle
            tok = out.prompt_token_ids[pos]
            assert abs(out.prompt_logprobs[pos][tok].logprob - logp[pos - 1, tok].item()) < 1e-4
        top2 = logp[len(out.prompt_token_ids) - 1 :].topk(2, dim=-1).values
        mine = out.outputs[0].token_ids
        for i, (a, b) in enumerate(zip(mine, ref, strict=True)):
            if a != b:
                assert (top2[i, 0] - top2[i, 1]).item() < NEAR_TIE, f"diverged at {i}"
                break
        else:
            assert len(mine) == len(ref)
            exact += 1
    assert exact >= 14


def test_prompt_logprobs_match_hf(llm, checkpoint):
    hf = checkpoint[1]
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=1, prompt_logprobs=3), use_tqdm=False)
    for out in outs:
        ids = out.prompt_token_ids
        ref = hf_logprobs(hf, torch.tensor(ids))
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(ids)
        for pos in range(1, len(ids)):
            entry, expected = out.prompt_logprobs[pos], ref[pos - 1]
            assert abs(entry[ids[pos]].logprob - expected[ids[pos]].item()) < 1e-4
            for t in expected.topk(3).indices.tolist():
                if t in entry:
                    assert abs(entry[t].logprob - expected[t].item()) < 1e-4
