"""Async scheduling: step N+1 is queued before the host reads step N's tokens (they reach it on the device).

Outputs must equal strictly sequential steps (``async_scheduling=False``): same tokens, finish reasons, text
and logprobs, whatever finishes a sequence (EOS, a stop string, max_tokens) while its next step is in flight,
with ``n > 1`` forks, chunked prefill, preemption and penalties.  Overlap must really happen.
"""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from tests.support.engine_checks import assert_same_output, ragged_prompts
from tests.support.toy_model import ToyCausalLM, toy_tokenizer
from tests.support.v4_fixtures import SMALL, build_engine_checkpoint


def _params(max_tokens: int, penalties: bool = False) -> list[SamplingParams]:
    kinds = [
        dict(temperature=0.0),
        dict(temperature=1.0, seed=11, ignore_eos=False),  # may stop on EOS mid-flight
        dict(temperature=0.8, top_k=20, seed=12, stop=["e"]),  # a stop string ends it early
        dict(temperature=0.7, seed=15, n=2),
        dict(temperature=1.0, seed=16, min_tokens=4, max_tokens=max_tokens // 2),
        dict(temperature=0.0, max_tokens=1),
    ]
    if penalties:
        kinds.append(dict(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5))
    out = []
    for k in kinds:
        k = {"max_tokens": max_tokens, "logprobs": 2, "prompt_logprobs": 1, "ignore_eos": True, **k}
        out.append(SamplingParams(**k))
    return out


def _spy_feeds(llm: LLM) -> list[int]:
    """Counts, per step, the tokens the runner took from the previous step on the device."""
    runner, fed = llm.engine.runner, []
    real = runner._feed

    def feed(plan, sched, previous):
        result = real(plan, sched, previous)
        fed.append(0 if result is None else int(result[0].numel()))
        return result

    runner._feed = feed
    return fed


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    directory, _ = build_engine_checkpoint(tmp_path_factory.mktemp("tiny_v4_async"), SMALL)
    return directory


@pytest.mark.parametrize("limits", [dict(), dict(max_num_batched_tokens=16), dict(preempt=True)],
                         ids=["batched", "chunked", "preempted"])
def test_v4_async_steps_equal_sequential_steps(checkpoint, limits):
    limits = dict(limits)
    outs, fed = {}, {}
    for mode in (False, True):
        extra = dict(limits)
        if extra.pop("preempt", False):
            llm = LLM(str(checkpoint), dtype="float32")
            # two slots of 60 tokens: sequences that grow past a page preempt the other (24 tokens each)
            extra.update(max_num_seqs=2, state_cache_bytes=llm.engine.model.state_pool_bytes(2, 60))
            del llm
        llm = LLM(str(checkpoint), dtype="float32", async_scheduling=mode, **extra)
        feeds = _spy_feeds(llm)
        prompts = ragged_prompts(llm.engine.model.vocab_size, lengths=[58, 3, 62, 17, 9, 55, 21])  # some cross 64
        max_tokens = 24 if limits.get("preempt") else 12
        outs[mode] = llm.generate(prompts, _params(max_tokens, penalties=True), use_tqdm=False)
        fed[mode] = sum(feeds)
        if limits.get("preempt"):
            assert llm.engine.num_preemptions > 0
        assert not llm.engine.seqs and llm.engine._inflight is None  # nothing left behind
    assert fed[False] == 0 and fed[True] > 20  # tokens really went from step to step on the device
    for a, b in zip(outs[False], outs[True], strict=True):
        assert_same_output(a, b)


def test_toy_model_async_steps_equal_sequential_steps():
    tokenizer = toy_tokenizer()
    model = ToyCausalLM(len(tokenizer), seed=3)
    prompts = ragged_prompts(model.vocab_size, lengths=[5, 12, 30, 1, 8, 20])
    outs = {}
    for mode in (False, True):
        llm = LLM.from_model(model, tokenizer, async_scheduling=mode, max_num_batched_tokens=20)
        feeds = _spy_feeds(llm)
        outs[mode] = llm.generate(prompts, _params(10), use_tqdm=False)
        assert (sum(feeds) > 0) == mode
    for a, b in zip(outs[False], outs[True], strict=True):
        assert_same_output(a, b)


def test_penalties_count_the_token_in_flight(checkpoint):
    """Penalties need every output token counted, the one in flight too: it is added on the device, so steps
    still overlap and the tokens equal sequential steps'."""
    llm = LLM(str(checkpoint), dtype="float32")
    feeds = _spy_feeds(llm)
    prompts = ragged_prompts(llm.engine.model.vocab_size, lengths=[10, 20, 5, 33])
    # Strong penalties: a draw that missed the token in flight would often repeat it.
    params = SamplingParams(temperature=0.0, repetition_penalty=3.0, presence_penalty=2.0, frequency_penalty=2.0,
                            max_tokens=12, logprobs=1, ignore_eos=True)
    together = llm.generate(prompts, params, use_tqdm=False)
    assert sum(feeds) > 0
    sequential = LLM(str(checkpoint), dtype="float32", async_scheduling=False).generate(prompts, params,
                                                                                       use_tqdm=False)
    for a, b in zip(sequential, together, strict=True):
        assert_same_output(a, b)
