"""Seeded sampling with speculative decoding (issue 32): a seeded request's tokens are the tokens it gets without
speculation, alone, in a batch, preempted or not, every draft verified or confidence-scheduled, with and without
DEEPINFER_BATCH_INVARIANT=1.

The embedded tiny V4.1 drafts with its trained DSpark drafter (sampled drafts race the verifier's noise) and runs
its pure-decode speculative steps as verify steps.  The needle's prompt and output cross the state's 64-token
page, so a tight state budget preempts it among its neighbours; the neighbours sample too.
"""

from __future__ import annotations

from pathlib import Path

import pytest

import deepinfer
from deepinfer import LLM, SamplingParams
from tests.support.engine_checks import assert_same_output, ragged_prompts
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)

TINY_V41 = Path(deepinfer.__file__).parent / "assets" / "tiny_v41"
NEEDLE = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_tokens=24, ignore_eos=True, logprobs=2)
#: V4.1 fake-quantizes its KV to FP8: another chunking of the same tokens moves logprobs by ~5e-3, rarely one value
#: across an FP8 rounding boundary (a few hundredths after it); the tokens must be equal all the same.
TOL, FLIPS = 2e-2, (0.15, 3)


def _prompts(vocab: int) -> tuple[list[int], list[list[int]], list[SamplingParams]]:
    needle = ragged_prompts(vocab, lengths=[52], seed=2)[0]
    others = ragged_prompts(vocab, lengths=[62, 3, 58, 17, 61], seed=3)
    params = [SamplingParams(temperature=0.8 + 0.1 * i, seed=100 + i, max_tokens=12 + 3 * i, ignore_eos=True)
              for i in range(len(others))]
    return needle, others, params


def _llm(monkeypatch, drafts: int, varlen: bool, invariant: bool, **limits) -> LLM:
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", str(drafts))
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1" if varlen else "0")
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1" if invariant else "0")
    limits.setdefault("state_cache_bytes", 8 << 20)
    llm = LLM(str(TINY_V41), dtype="float32", **limits)
    assert (llm.engine.drafter is not None) == (drafts > 0)
    return llm


def _needle(llm: LLM, batched: bool):
    needle, others, params = _prompts(llm.engine.model.vocab_size)
    if not batched:
        return llm.generate([needle], NEEDLE, use_tqdm=False)[0]
    # second of the batch: admitted with the first, the newer of the two when the first outgrows the budget
    return llm.generate(others[:1] + [needle] + others[1:], params[:1] + [NEEDLE] + params[1:], use_tqdm=False)[1]


@pytest.fixture(scope="module")
def tight_budget() -> int:
    """A state budget that holds two of the step's sequences at 64 tokens: the batch preempts."""
    with pytest.MonkeyPatch.context() as mp:
        probe = _llm(mp, 0, False, False)
    return probe.engine.model.state_pool_bytes(probe.engine.config.max_num_seqs, 64, sequences=2)


def _preemptions(llm: LLM, monkeypatch) -> list[list[int]]:
    """The prompts of the sequences the engine preempts from now on, in order."""
    scheduler, preempted = llm.engine.scheduler, []
    preempt = scheduler._preempt

    def spy(seq) -> None:
        preempted.append(seq.token_ids[: len(seq.request.prompt_token_ids)])
        preempt(seq)

    monkeypatch.setattr(scheduler, "_preempt", spy)
    return preempted


@pytest.fixture(scope="module")
def plain():
    """The needle without speculation, alone: (fp32, batch-invariant)."""
    with pytest.MonkeyPatch.context() as mp:
        return {invariant: _needle(_llm(mp, 0, False, invariant), False) for invariant in (False, True)}


#: (confidence-scheduled verification, batch invariance): envs refuses both at once.
MODES = {"every-draft": (False, False), "varlen": (True, False), "batch-invariant": (False, True)}


@pytest.mark.parametrize("where", ["alone", "batched", "preempted"])
@pytest.mark.parametrize("mode", list(MODES))
def test_seeded_sampling_with_speculation_is_the_plain_output(plain, tight_budget, monkeypatch, mode, where):
    varlen, invariant = MODES[mode]
    limits = {"state_cache_bytes": tight_budget} if where == "preempted" else {}
    llm = _llm(monkeypatch, 4, varlen, invariant, **limits)
    preempted = _preemptions(llm, monkeypatch)
    out = _needle(llm, where != "alone")
    if invariant:  # bit for bit: a verify chunk is one more chunking of the sequence
        assert_same_output(plain[True], out, tol=1e-12)
    else:
        assert_same_output(plain[False], out, tol=TOL, flips=FLIPS)
    stats = out.spec_decoding_stats
    assert stats is not None and stats.num_drafts > 0 and stats.num_accepted_tokens > 0
    if where == "preempted":
        assert _prompts(llm.engine.model.vocab_size)[0] in preempted  # the needle itself was preempted
    assert len(set(out.outputs[0].token_ids)) > 3  # it does sample


def test_the_needle_without_speculation_is_the_same_batched_and_preempted(plain, tight_budget, monkeypatch):
    """The reference itself: plain seeded sampling is batch- and preemption-invariant."""
    llm = _llm(monkeypatch, 0, False, False, state_cache_bytes=tight_budget)
    preempted = _preemptions(llm, monkeypatch)
    assert_same_output(plain[False], _needle(llm, True), tol=TOL, flips=FLIPS)
    assert _prompts(llm.engine.model.vocab_size)[0] in preempted
