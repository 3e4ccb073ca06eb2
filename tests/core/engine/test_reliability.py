"""No input, fault or interrupt breaks the LLM object or loses a request (toy model: fast and exact).

- Preemption never loses or fails a request that fits the state budget alone: async scheduling on or off,
  ``n > 1``, chunked prefill; each request gets the tokens it gets alone.
- After any exception or interrupt inside ``generate`` the engine is empty and the next call gives what a
  fresh ``LLM`` gives.
- A prompt the tokenizer cannot encode is that request's error.
- Two threads calling ``generate`` at once are served one after the other, each with its own outputs.
"""

from __future__ import annotations

import threading
import time

import pytest

from deepinfer import LLM, SamplingParams
from tests.support.engine_checks import assert_same_output, ragged_prompts
from tests.support.tiny_assets import TINY_V4_DIR
from tests.support.toy_model import ToyCausalLM, toy_tokenizer
from tests.support.v4_fixtures import single_thread  # noqa: F401 - a fixture: tiny ops on one thread


@pytest.fixture(scope="module")
def tokenizer():
    return toy_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return ToyCausalLM(len(tokenizer), seed=4)


def assert_empty(llm: LLM) -> None:
    """Nothing of an earlier call is left: no sequence, no queued or running one, no state, no budget."""
    engine = llm.engine
    assert not engine.seqs and engine._inflight is None
    assert not engine.scheduler.waiting and not engine.scheduler.running and not engine.has_unfinished()
    assert len(engine.state_cache) == 0 and engine.state_cache.budget.used == 0


# --------------------------------------------------------------------------------------------------
# Preemption loses nothing
# --------------------------------------------------------------------------------------------------

PARAMS = dict(temperature=0.8, seed=1, max_tokens=20, ignore_eos=True, logprobs=1)


def _alone(model, tokenizer, prompt, params):
    llm = LLM.from_model(model, tokenizer, state_cache_bytes=model.state_bytes(100) * 8, async_scheduling=False)
    return llm.generate([prompt], params, use_tqdm=False)[0]


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("n, batched", [(2, 8192), (3, 8192), (2, 8)], ids=["n2", "n3", "n2-chunked"])
def test_forks_that_outgrow_the_budget_complete(model, tokenizer, async_scheduling, n, batched):
    """The forks of one request cannot all grow to full length in the budget: the newest is preempted, and it
    is recomputed when its sibling finishes.  (Async scheduling used to stop with "no progress" when the
    sibling's last token was still in flight: landing it frees the budget but finishes no request.)"""
    prompt = [5 + i % 7 for i in range(20)]
    params = SamplingParams(n=n, **PARAMS)
    # Room for all n prompts and a few tokens each, not for n full sequences (prompt 20 + 20 tokens).
    llm = LLM.from_model(model, tokenizer, async_scheduling=async_scheduling, max_model_len=50,
                         state_cache_bytes=model.state_bytes(20 * n + 15), max_num_batched_tokens=batched)
    (out,) = llm.generate([prompt], params, use_tqdm=False)
    assert llm.engine.num_preemptions > 0
    assert_same_output(out, _alone(model, tokenizer, prompt, params))
    assert_empty(llm)


def test_embedded_model_n2_preempted_with_async_scheduling_completes():
    """The reported case, on the tiny V4 model (then the embedded default): ``n=2`` in a budget of two short
    sequences.  The first fork to pass 68 tokens (where its state grows by a page) preempts the other, which can
    only return once the first has finished; with async scheduling the first's last token is still in flight at
    that point."""
    prompt = [5 + i % 50 for i in range(60)]
    params = SamplingParams(n=2, temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, logprobs=1)
    ample = LLM(str(TINY_V4_DIR), dtype="float32", max_model_len=96)
    (expected,) = ample.generate([prompt], params, use_tqdm=False)
    budget = ample.engine.model.state_pool_bytes(ample.engine.config.max_num_seqs, 4, sequences=2)
    del ample
    for async_scheduling in (True, False):
        llm = LLM(str(TINY_V4_DIR), dtype="float32", max_model_len=96, state_cache_bytes=budget,
                  async_scheduling=async_scheduling)
        (out,) = llm.generate([prompt], params, use_tqdm=False)
        assert llm.engine.num_preemptions > 0
        assert_same_output(out, expected)
        assert_empty(llm)


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
def test_many_preemptions_with_forks_lose_nothing(model, tokenizer, async_scheduling):
    """A ragged batch with ``n > 1`` requests under a budget of about two full sequences."""
    prompts = ragged_prompts(model.vocab_size, lengths=[12, 3, 25, 7, 18, 30])
    params = [SamplingParams(n=1 + i % 3, **PARAMS) for i in range(len(prompts))]
    llm = LLM.from_model(model, tokenizer, async_scheduling=async_scheduling, max_model_len=60,
                         state_cache_bytes=model.state_bytes(110), max_num_batched_tokens=16)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.engine.num_preemptions > 3
    for prompt, sp, out in zip(prompts, params, outs, strict=True):
        assert_same_output(out, _alone(model, tokenizer, prompt, sp))
    assert_empty(llm)


# --------------------------------------------------------------------------------------------------
# Exceptions and interrupts leave the engine empty
# --------------------------------------------------------------------------------------------------

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, n=2)


def _fresh(model, tokenizer, prompts, **limits):
    return LLM.from_model(model, tokenizer, **limits).generate(prompts, [GREEDY, SEEDED] * (len(prompts) // 2),
                                                                use_tqdm=False)


def _interrupt_at(monkeypatch, target, name: str, call: int, error: BaseException) -> list[int]:
    """Make ``target.name`` raise ``error`` on its ``call``-th call (0-based); returns the call counter."""
    real = getattr(target, name)
    calls = [0]

    def wrapped(*args, **kwargs):
        calls[0] += 1
        if calls[0] - 1 == call:
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(target, name, wrapped)
    return calls


@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("where", ["launch", "collect", "process", "schedule"])
def test_interrupt_inside_a_step_then_reuse(model, tokenizer, monkeypatch, async_scheduling, where):
    """A KeyboardInterrupt at step 3 of a large call (many sequences waiting) leaves the engine empty, and the
    next call gives the outputs of a fresh LLM."""
    limits = dict(async_scheduling=async_scheduling, max_num_seqs=4, max_num_batched_tokens=16)
    prompts = ragged_prompts(model.vocab_size, count=40, max_len=20, seed=3)
    small = prompts[:4]
    expected = _fresh(model, tokenizer, small, **limits)
    llm = LLM.from_model(model, tokenizer, **limits)
    engine = llm.engine
    target = {"launch": engine.runner, "collect": engine, "process": engine, "schedule": engine.scheduler}[where]
    name = {"launch": "launch", "collect": "_process_landed", "process": "process", "schedule": "schedule"}[where]
    calls = _interrupt_at(monkeypatch, target, name, 3, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, [GREEDY, SEEDED] * 20, use_tqdm=False)
    assert calls[0] == 4
    monkeypatch.undo()
    assert_empty(llm)
    again = llm.generate(small, [GREEDY, SEEDED] * 2, use_tqdm=False)
    for a, b in zip(again, expected, strict=True):
        assert_same_output(a, b)
    assert_empty(llm)


def test_error_while_queueing_requests_leaves_the_engine_empty(model, tokenizer, monkeypatch):
    """A failure after some prompts of a call were queued (here: an interrupt while adding the 5th) drops them."""
    llm = LLM.from_model(model, tokenizer)
    prompts = ragged_prompts(model.vocab_size, count=8, max_len=10, seed=5)
    _interrupt_at(monkeypatch, llm.engine, "add_request", 4, KeyboardInterrupt())
    with pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, GREEDY, use_tqdm=False)
    monkeypatch.undo()
    assert_empty(llm)
    again = llm.generate(prompts[:2], [GREEDY, SEEDED], use_tqdm=False)
    for a, b in zip(again, _fresh(model, tokenizer, prompts[:2]), strict=True):
        assert_same_output(a, b)


def test_unencodable_prompt_is_that_requests_error(model, tokenizer):
    """A lone surrogate cannot be encoded (the tokenizer raises TypeError): that request fails alone, and the
    engine stays usable."""
    llm = LLM.from_model(model, tokenizer)
    outs = llm.generate(["Once upon a time", "bad \ud800 text", "The quick"], GREEDY, use_tqdm=False)
    assert outs[1].error is not None and "could not be encoded" in outs[1].error and outs[1].outputs == []
    assert outs[0].error is None and outs[2].error is None
    assert_empty(llm)
    again = llm.generate(["Once upon a time", "The quick"], GREEDY, use_tqdm=False)
    for a, b in zip(again, [outs[0], outs[2]], strict=True):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_unexpected_failure_while_checking_a_request_fails_it_alone(model, tokenizer, monkeypatch):
    """Whatever raises while one request is checked (here: a grammar service that breaks) fails that request."""
    llm = LLM.from_model(model, tokenizer)

    def broken(params):
        raise RuntimeError("grammar service down")

    monkeypatch.setattr(llm.engine, "_grammars", broken)
    outs = llm.generate(["Once upon a time", "The quick"], GREEDY, use_tqdm=False)
    assert all(o.outputs == [] and o.error == "could not prepare the request (RuntimeError: grammar service down)"
               for o in outs)
    monkeypatch.undo()
    assert_empty(llm)
    assert all(o.error is None for o in llm.generate(["Once upon a time"], GREEDY, use_tqdm=False))


# --------------------------------------------------------------------------------------------------
# Two threads
# --------------------------------------------------------------------------------------------------


class _SlowToy(ToyCausalLM):
    """Sleeps in every forward, so two threads' calls would interleave if nothing kept them apart."""

    def forward(self, batch):
        time.sleep(0.002)
        return super().forward(batch)


def test_two_threads_are_served_one_after_the_other(tokenizer):
    model = _SlowToy(len(tokenizer), seed=4)
    llm = LLM.from_model(model, tokenizer, max_num_seqs=8)
    work = {
        "a": (ragged_prompts(model.vocab_size, count=6, max_len=15, seed=1), GREEDY),
        "b": (ragged_prompts(model.vocab_size, count=5, max_len=15, seed=2), SEEDED),
    }
    expected = {k: llm.generate(p, sp, use_tqdm=False) for k, (p, sp) in work.items()}
    results: dict[str, object] = {}
    start = threading.Barrier(2)

    def call(key: str) -> None:
        start.wait()
        try:
            results[key] = llm.generate(*work[key], use_tqdm=False)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            results[key] = exc

    threads = [threading.Thread(target=call, args=(k,), daemon=True) for k in work]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for key in work:
        assert isinstance(results[key], list), results[key]
        for a, b in zip(results[key], expected[key], strict=True):
            assert_same_output(a, b)
    assert_empty(llm)
