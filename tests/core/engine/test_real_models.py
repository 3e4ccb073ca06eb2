"""The engine on each real model of the family (tiny checkpoints in their released tensor layout): continuous
batching, chunked prefill, preemption with recompute and ``n > 1`` forks give each request the tokens and
logprobs it gets alone, and the state the scheduler accounts for bounds what the model really holds."""

from __future__ import annotations

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.models import load_model
from deepinfer.ops import OpTable
from tests.support.engine_checks import assert_same_output, mixed_params, ragged_prompts
from tests.support.model_runs import run_chunked
from tests.support.v4_fixtures import SMALL, build_engine_checkpoint
from tests.support.v41_fixtures import FIXTURES

#: Lengths that cross the V4 state's 64-token page boundary (and many V4.1 ratio-1 pages) while decoding, so a
#: tight budget must preempt.
RAGGED = [62, 3, 58, 17, 60, 33, 61, 45]
RAGGED_NEW = 10


@pytest.fixture(scope="module", params=["deepseek_v4", "deepseek_v41"])
def path(request, tmp_path_factory):
    if request.param == "deepseek_v4":
        return build_engine_checkpoint(tmp_path_factory.mktemp("tiny_v4_random"), SMALL)[0]
    return FIXTURES / "tiny_b"


@pytest.fixture(scope="module")
def llm(path):
    return LLM(str(path), dtype="float32")


def _ragged(llm):
    return ragged_prompts(llm.engine.model.vocab_size, seed=3, lengths=RAGGED)


@pytest.fixture(scope="module")
def alone(llm):
    pairs = zip(_ragged(llm), mixed_params(RAGGED_NEW), strict=True)
    return [llm.generate([p], [sp], use_tqdm=False)[0] for p, sp in pairs]


@pytest.mark.parametrize("limits, preempts", [
    (dict(), False),  # one batch of 8 ragged requests
    (dict(max_num_batched_tokens=7), False),  # chunked prefill across windows, mixed with decodes
    (dict(state_cache_sequences=3, max_num_batched_tokens=16), True),  # forced preemption and recompute
], ids=["batch", "chunked", "preempted"])
def test_batching_chunking_preemption_invariance(llm, alone, limits, preempts):
    """Same tokens and logprobs (within 1e-5, fp32) as each request run alone."""
    model = llm.engine.model
    limits = dict(limits)
    room = limits.pop("state_cache_sequences", 64)
    engine = LLM.from_model(model, llm.tokenizer, state_cache_bytes=model.state_pool_bytes(room, max(RAGGED)),
                            **limits)
    outs = engine.generate(_ragged(llm), mixed_params(RAGGED_NEW), use_tqdm=False)
    assert (engine.engine.num_preemptions > 0) == preempts
    for a, b in zip(alone, outs, strict=True):
        assert_same_output(a, b)


def test_live_state_never_exceeds_the_reserved_budget(llm):
    """The scheduler's byte accounting (model.state_bytes) bounds the memory the states really hold."""
    model = llm.engine.model
    small = LLM.from_model(model, llm.tokenizer, state_cache_bytes=model.state_pool_bytes(3, max(RAGGED)),
                           max_num_batched_tokens=16)
    engine = small.engine
    for prompt, params in zip(_ragged(llm), mixed_params(RAGGED_NEW), strict=True):
        assert engine.add_request(prompt, params) is None
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        assert engine.state_cache.nbytes() <= engine.state_cache.budget.used <= engine.state_cache.budget.capacity
    assert steps > len(RAGGED) and engine.num_preemptions > 0


def test_prompt_logprobs_through_the_engine(path):
    """Teacher-forced logprobs of a batch of prompts through ``generate`` equal the model fed directly."""
    llm = LLM(str(path), dtype="float32")  # its own: the tests above reconfigured the shared one's state pool
    model = load_model(path, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
    prompts = _ragged(llm)[:4]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, prompt_logprobs=1), use_tqdm=False)
    for prompt, out in zip(prompts, outs, strict=True):
        direct = run_chunked(model, torch.tensor(prompt), len(prompt))
        got = torch.tensor([out.prompt_logprobs[i][t].logprob for i, t in enumerate(prompt) if i])
        want = direct[:-1].gather(1, torch.tensor(prompt[1:])[:, None]).squeeze(1)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
