"""Engine invariants on the toy model: batching, chunked prefill and preemption change nothing.

A request run alone, inside a batch of ragged requests, with its prompt split into chunks, and while
the state budget forces preemption and recompute must give the same tokens and logprobs.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from tests.support.engine_checks import assert_same_output, mixed_params, ragged_prompts
from tests.support.toy_model import ToyCausalLM, toy_tokenizer

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return ToyCausalLM(len(tokenizer), seed=1)


def _prompts(vocab: int) -> list[list[int]]:
    return ragged_prompts(vocab)


def _params() -> list[SamplingParams]:
    return mixed_params(MAX_TOKENS)


def _run(model, tokenizer, prompts, params, **limits):
    llm = LLM.from_model(model, tokenizer, **limits)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, llm.engine


@pytest.fixture(scope="module")
def alone(model, tokenizer):
    """Each request in its own engine, prompt in one piece."""
    pairs = zip(_prompts(model.vocab_size), _params(), strict=True)
    return [_run(model, tokenizer, [p], [sp])[0][0] for p, sp in pairs]


def test_batch_of_ragged_requests_matches_alone(model, tokenizer, alone):
    outs, engine = _run(model, tokenizer, _prompts(model.vocab_size), _params())
    assert max(len(c) for c in model.forward_calls[-MAX_TOKENS:]) > 1  # really batched
    for a, b in zip(alone, outs, strict=True):
        assert_same_output(a, b)


def test_chunked_prefill_matches_alone(model, tokenizer, alone):
    calls = len(model.forward_calls)
    outs, _ = _run(model, tokenizer, _prompts(model.vocab_size), _params(), max_num_batched_tokens=7)
    steps = model.forward_calls[calls:]
    assert all(sum(s) <= 7 for s in steps)
    assert any(len(s) > 1 and max(s) > 1 for s in steps)  # prefill chunks mixed with decodes
    for a, b in zip(alone, outs, strict=True):
        assert_same_output(a, b)


def test_forced_preemption_matches_alone(model, tokenizer, alone):
    # Room for about three sequences of full length: the batch must preempt and recompute.
    budget = 3 * model.state_bytes(40 + MAX_TOKENS)
    outs, engine = _run(model, tokenizer, _prompts(model.vocab_size), _params(), state_cache_bytes=budget,
                        max_num_batched_tokens=16)
    assert engine.num_preemptions > 0
    assert engine.state_cache.budget.used == 0 and len(engine.state_cache) == 0  # everything released
    for a, b in zip(alone, outs, strict=True):
        assert_same_output(a, b)


def test_prompt_logprobs_match_full_forward(model, tokenizer, alone):
    """prompt_logprobs equal log_softmax of a single whole-sequence forward (the oracle)."""
    for prompt, out in zip(_prompts(model.vocab_size), alone, strict=True):
        logp = torch.log_softmax(model.full_logits(prompt), dim=-1)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for pos in range(1, len(prompt)):
            entry = out.prompt_logprobs[pos]
            expected = logp[pos - 1]
            assert abs(entry[prompt[pos]].logprob - expected[prompt[pos]].item()) < 1e-5
            assert entry[prompt[pos]].rank == int((expected > expected[prompt[pos]]).sum()) + 1
            top = torch.topk(expected, 2).indices.tolist()
            assert set(top) <= set(entry)


def test_generated_logprobs_match_full_forward(model, alone):
    """The logprob reported for each generated token is the raw model distribution at that point."""
    for prompt, out in zip(_prompts(model.vocab_size), alone, strict=True):
        for comp in out.outputs:
            seq = prompt + comp.token_ids
            logp = torch.log_softmax(model.full_logits(seq), dim=-1)
            for i, tok in enumerate(comp.token_ids):
                assert abs(comp.logprobs[i][tok].logprob - logp[len(prompt) - 1 + i, tok].item()) < 1e-5
            assert abs(comp.cumulative_logprob - sum(comp.logprobs[i][t].logprob
                                                     for i, t in enumerate(comp.token_ids))) < 1e-6


def test_greedy_equals_argmax_of_full_forward(model, tokenizer):
    prompt = _prompts(model.vocab_size)[2]
    (out,), _ = _run(model, tokenizer, [prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    seq = list(prompt)
    for _ in range(8):
        seq.append(int(model.full_logits(seq)[-1].argmax()))
    assert out.outputs[0].token_ids == seq[len(prompt):]
