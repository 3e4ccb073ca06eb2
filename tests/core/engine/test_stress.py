"""Stress: 64 mixed requests under a state budget that forces many preemptions, async scheduling on and off.

Some requests are bad (empty prompt, a token id outside the vocabulary, invalid ``so_args``, a prompt too long,
text the tokenizer cannot encode, a prompt dict of the wrong shape): each fails alone.  The good ones (``n`` up
to 3, varied prompt lengths and ``max_tokens``, greedy and seeded sampling, a few stop strings, chunked
prefill) each complete with exactly the tokens they get alone.  The tiny V4 model (its state pages set the
prompt lengths below) runs in fp32 with
``DEEPINFER_BATCH_INVARIANT=1``, so a request's logits do not depend on its batch and near-ties cannot flip.
"""

from __future__ import annotations

import random

import pytest

from deepinfer import LLM, SamplingParams
from tests.support.engine_checks import assert_same_output
from tests.support.tiny_assets import TINY_V4_DIR
from tests.support.v4_fixtures import single_thread  # noqa: F401 - a fixture: tiny ops on one thread

MAX_MODEL_LEN = 96
NUM_REQUESTS = 64
#: Prompt lengths and max_tokens: the long prompts end just below 68 tokens, where tiny_v4's state
#: grows by a page (as at 4), so most of them grow while they decode.
PROMPT_LENS = (1, 3, 9, 30, 64, 66, 67, 67)
MAX_TOKENS = (2, 4, 8, 10)


def _llm(**limits) -> LLM:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DEEPINFER_BATCH_INVARIANT", "1")  # read when the op table is built
        return LLM(str(TINY_V4_DIR), dtype="float32", max_model_len=MAX_MODEL_LEN, **limits)


def _workload(vocab: int) -> tuple[list[object], list[SamplingParams], dict[int, str]]:
    """64 (prompt, params) pairs; ``bad`` maps the index of each bad request to a piece of its error."""
    rng = random.Random(21)
    prompts: list[object] = []
    params: list[SamplingParams] = []
    for i in range(NUM_REQUESTS):
        prompts.append([rng.randrange(3, vocab) for _ in range(rng.choice(PROMPT_LENS))])
        kind = dict(max_tokens=rng.choice(MAX_TOKENS), n=rng.choice([1, 2, 3]), ignore_eos=True, logprobs=1)
        if i % 3:
            kind.update(temperature=rng.choice([0.7, 1.0]), seed=1000 + i)
        else:
            kind.update(temperature=0.0)
        if i % 11 == 5:
            kind.update(stop=["e", " the"])
        params.append(SamplingParams(**kind))
    bad = {
        3: ([], None, "prompt is empty"),
        14: ([5, vocab + 7, 6], None, "outside the vocabulary"),
        25: ([5, 6, 7], SamplingParams(so_args={"regex": "a("}), "so_args['regex']: invalid regular"),
        36: ([5] * MAX_MODEL_LEN, None, f"max_model_len={MAX_MODEL_LEN}"),
        47: ("lone \ud800 surrogate", None, "could not be encoded"),
        58: ({"prompt": [5, 6]}, None, "'prompt' must be a string"),
    }
    for i, (prompt, sp, _) in bad.items():
        prompts[i] = prompt
        params[i] = sp if sp is not None else params[i]
    return prompts, params, {i: message for i, (_, _, message) in bad.items()}


@pytest.fixture(scope="module")
def workload_and_alone():
    """The workload and each good request's output alone.  Under DEEPINFER_BATCH_INVARIANT=1 a request's tokens
    and logprobs are bitwise those it gets alone in any batch, so one call with an ample budget (no preemption)
    gives them all; a sample of requests, one call each, checks that here too."""
    llm = _llm(async_scheduling=False)
    prompts, params, bad = _workload(llm.engine.model.vocab_size)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.num_preemptions == 0
    alone = {i: out for i, out in enumerate(outs) if i not in bad}
    longest = max(alone, key=lambda i: len(prompts[i]) * params[i].n)  # type: ignore[arg-type]
    for i in sorted({longest, *(i for i in alone if params[i].n == 3 or params[i].stop)})[:8]:
        assert_same_output(llm.generate([prompts[i]], [params[i]], use_tqdm=False)[0], alone[i])
    # State for five sequences of under 68 tokens: a sequence that grows past 68 while five run preempts the newest.
    budget = llm.engine.model.state_pool_bytes(5, 4)
    return prompts, params, bad, alone, budget


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_64_mixed_requests_under_preemption_get_what_they_get_alone(workload_and_alone, async_scheduling):
    prompts, params, bad, alone, budget = workload_and_alone
    llm = _llm(async_scheduling=async_scheduling, state_cache_bytes=budget, max_num_batched_tokens=48)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.num_preemptions >= 10
    assert len(outs) == NUM_REQUESTS
    for i, out in enumerate(outs):
        if i in bad:
            assert out.error is not None and bad[i] in out.error and out.outputs == [], (i, out.error)
        else:
            assert out.error is None, (i, out.error)
            assert_same_output(out, alone[i])
    engine = llm.engine
    assert not engine.seqs and not engine.has_unfinished() and engine._inflight is None
    assert len(engine.state_cache) == 0 and engine.state_cache.budget.used == 0
