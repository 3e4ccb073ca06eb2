"""The switches of speculative decoding and how LLM finds the drafter: DEEPINFER_USE_NEXTN_DECODE (0 = off, capped
by the drafter, an explicit value above it refused), a checkpoint without a drafter, batch invariance with
MTP_VARLEN=0 (bitwise equal to plain decoding), preemption and chunked prefill."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

import deepinfer
from deepinfer import LLM, SamplingParams, envs
from deepinfer.engine.llm import drafter_off
from deepinfer.models.loader import load_model
from deepinfer.ops import OpTable
from deepinfer.spec_decode.budget import SpecPolicy
from tests.support.engine_checks import assert_same_output, ragged_prompts
from tests.support.stand_in_drafter import StandInDrafter
from tests.support.structured import build_tokenizer
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)

TINY_V4 = Path(deepinfer.__file__).parent / "assets" / "tiny_v4"
GREEDY = SamplingParams(temperature=0.0, max_tokens=14, ignore_eos=True, logprobs=2)


def _model_with_drafter(max_draft_len: int = 4):
    model = load_model(TINY_V4, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
    model.make_drafter = lambda: StandInDrafter(model.vocab_size, max_draft_len)  # what V4.1 provides
    return model


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in ("DEEPINFER_USE_NEXTN_DECODE", "DEEPINFER_ENABLE_MTP_VARLEN", "DEEPINFER_BATCH_INVARIANT"):
        monkeypatch.delenv(name, raising=False)


def test_llm_takes_the_models_drafter_and_the_draft_length_from_the_environment(monkeypatch):
    llm = LLM.from_model(_model_with_drafter(), build_tokenizer())
    assert isinstance(llm.engine.drafter, StandInDrafter)
    assert llm.engine.scheduler.spec == SpecPolicy(4, False)  # default 5, capped by the drafter's 4
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    llm.engine.set_drafter(None)
    llm.engine.set_drafter(StandInDrafter(1057, 4))  # the engine keeps what it read when it started
    assert llm.engine.scheduler.spec == SpecPolicy(4, False)
    policy = LLM.from_model(_model_with_drafter(), build_tokenizer()).engine.scheduler.spec
    assert policy is not None and (policy.max_draft_len, policy.varlen) == (2, True)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    llm = LLM.from_model(_model_with_drafter(), build_tokenizer())
    assert llm.engine.drafter is None and llm.engine.scheduler.spec is None


def test_a_draft_length_above_the_drafters_is_refused(monkeypatch):
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "6")
    with pytest.raises(ValueError, match=r"DEEPINFER_USE_NEXTN_DECODE=6: .* at most 4 tokens .* 1\.\.4"):
        LLM.from_model(_model_with_drafter(4), build_tokenizer())
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "17")
    with pytest.raises(ValueError, match="DEEPINFER_USE_NEXTN_DECODE=17: must be in"):
        LLM.from_model(_model_with_drafter(4), build_tokenizer())


def test_a_checkpoint_without_a_drafter_says_so_once(monkeypatch, caplog):
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    with caplog.at_level(logging.INFO, logger="deepinfer"):
        llm = LLM(str(TINY_V4), dtype="float32")
    assert llm.engine.drafter is None
    assert sum("speculative decoding off: this checkpoint has no drafter" in r.message for r in caplog.records) == 1


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_llm_generate_with_the_models_drafter_equals_plain_decoding(async_scheduling):
    prompts = ragged_prompts(1000, lengths=[6, 19, 11])
    plain = LLM(str(TINY_V4), dtype="float32").generate(prompts, GREEDY, use_tqdm=False)
    llm = LLM.from_model(_model_with_drafter(), build_tokenizer(), async_scheduling=async_scheduling)
    spec = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert not llm.engine.seqs and llm.engine._inflight is None  # nothing left behind
    for a, b in zip(plain, spec, strict=True):
        assert_same_output(a, b, tol=1e-4)
        assert b.spec_decoding_stats is not None and b.spec_decoding_stats.num_drafts > 0


def test_batch_invariant_speculation_is_bitwise_plain_decoding(monkeypatch):
    """DEEPINFER_BATCH_INVARIANT=1 with MTP_VARLEN=0: every token and logprob of a speculative run equals plain
    decoding's bit for bit, greedy and seeded sampling (a verify chunk is just another chunking of the sequence)."""
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    prompts = ragged_prompts(1000, lengths=[6, 19])
    params = [GREEDY, SamplingParams(temperature=0.9, seed=3, max_tokens=10, ignore_eos=True, logprobs=2)]
    plain = LLM(str(TINY_V4), dtype="float32").generate(prompts, params, use_tqdm=False)
    llm = LLM.from_model(_model_with_drafter(), build_tokenizer())
    oracle = [p + o.outputs[0].token_ids for p, o in zip(prompts, plain, strict=True)]
    llm.engine.set_drafter(StandInDrafter(1057, 4, "mixed", oracle))
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec, strict=True):  # the seeded sampled request too (coupled verification)
        assert_same_output(a, b, tol=1e-12)
    assert spec[1].spec_decoding_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("limits", [dict(max_num_batched_tokens=8), dict(preempt=True)], ids=["chunked", "preempted"])
def test_greedy_identity_under_chunked_prefill_and_preemption(limits):
    limits = dict(limits)
    prompts = ragged_prompts(1000, lengths=[58, 62, 55, 60, 9])  # they cross a page of entries (64 tokens)
    params = [SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, logprobs=1),
              SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True, n=2)] * 2 + [GREEDY]
    if limits.pop("preempt", False):
        probe = LLM(str(TINY_V4), dtype="float32")
        seqs = probe.engine.config.max_num_seqs
        limits["state_cache_bytes"] = probe.engine.model.state_pool_bytes(seqs, 60, sequences=2)
        del probe
    plain = LLM(str(TINY_V4), dtype="float32", **limits).generate(prompts, params, use_tqdm=False)
    llm = LLM.from_model(_model_with_drafter(), build_tokenizer(), **limits)
    oracle = [p + c.token_ids for p, o in zip(prompts, plain, strict=True) for c in o.outputs]
    llm.engine.set_drafter(StandInDrafter(1057, 4, "mixed", oracle))
    spec = llm.generate(prompts, params, use_tqdm=False)
    for a, b in zip(plain, spec, strict=True):
        assert_same_output(a, b, tol=1e-4)
    if "state_cache_bytes" in limits:
        assert llm.engine.num_preemptions > 0
    assert not llm.engine.seqs and not llm.engine.drafter.context  # every slot's context was freed


def test_mtp_varlen_profiles_the_step_costs_at_start_up(monkeypatch):
    from deepinfer.runner.cost_profile import buckets

    assert buckets(5, 64) == [5, 8, 16, 32, 64] and buckets(3, 20) == [3, 4, 8, 16, 20]
    monkeypatch.setenv("DEEPINFER_ENABLE_MTP_VARLEN", "1")
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    llm = LLM.from_model(_model_with_drafter(), build_tokenizer(), max_num_seqs=8, max_num_batched_tokens=64)
    policy = llm.engine.scheduler.spec
    assert policy is not None and policy.varlen and policy.cost_table is not None
    table = policy.cost_table
    assert table.buckets == (4, 8, 16, 32) and all(c > 0 for c in table.costs)
    assert list(table.costs) == sorted(table.costs)
    assert llm.engine.model.pool.live == 0  # the scratch states were released
    prompts = ragged_prompts(1000, lengths=[6, 19, 11])
    plain = LLM(str(TINY_V4), dtype="float32").generate(prompts, GREEDY, use_tqdm=False)
    for a, b in zip(plain, llm.generate(prompts, GREEDY, use_tqdm=False), strict=True):
        assert_same_output(a, b, tol=1e-4)


TINY_V41 = Path(deepinfer.__file__).parent / "assets" / "tiny_v41"


def test_the_embedded_v41_decodes_with_its_drafter_by_default(monkeypatch):
    """LLM() on the embedded V4.1 turns DSpark on (the CPU backend captures no graphs) and its greedy output is
    the plain output; DEEPINFER_USE_NEXTN_DECODE=0 turns it off."""
    llm = LLM(str(TINY_V41), dtype="float32")
    assert llm.engine.drafter is not None and llm.engine.scheduler.spec == SpecPolicy(4, False)
    prompts = ["Once upon a time", "Tom and his dog"]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    spec = llm.generate(prompts, params, use_tqdm=False)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "0")
    plain_llm = LLM(str(TINY_V41), dtype="float32")
    assert plain_llm.engine.drafter is None
    for a, b in zip(plain_llm.generate(prompts, params, use_tqdm=False), spec, strict=True):
        assert_same_output(a, b, tol=2e-2)
        assert b.spec_decoding_stats.mean_acceptance_length > 2.0 and a.spec_decoding_stats is None


def test_a_capturing_backend_keeps_it_off_unless_asked(monkeypatch, caplog):
    from contextlib import contextmanager

    from deepinfer.backends import Backend

    class Capturing(Backend):
        name = "capturing"

        @contextmanager
        def graph_capture(self, device):
            yield lambda fn: fn

    with caplog.at_level(logging.INFO, logger="deepinfer"):
        llm = LLM.from_model(_model_with_drafter(), build_tokenizer(), backend=Capturing())
    assert llm.engine.drafter is None
    assert any("off by default on backend 'capturing'" in r.message for r in caplog.records)
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "3")
    llm = LLM.from_model(_model_with_drafter(), build_tokenizer(), backend=Capturing())
    assert llm.engine.drafter is not None and llm.engine.scheduler.spec.max_draft_len == 3


def test_several_ranks_leave_speculation_off_or_refuse_it(monkeypatch):
    """The lock-stepped data-parallel loop runs one forward a step (docs/parallel.md)."""
    backend = LLM.from_model(_model_with_drafter(), build_tokenizer()).engine.runner.backend
    assert "not supported on several ranks" in drafter_off(backend, False, True, envs.spec_decode())
    monkeypatch.setenv("DEEPINFER_USE_NEXTN_DECODE", "2")
    with pytest.raises(ValueError, match="DEEPINFER_USE_NEXTN_DECODE on several ranks"):
        drafter_off(backend, False, True, envs.spec_decode())
