"""The parallel engine on 2-3 gloo ranks (forked processes) against the single-process engine: teacher-forced
prompt logprobs and generated tokens / logprobs equal (fp32, within 1e-5) for data-parallel attention alone,
with expert parallelism (divisible and non-divisible expert counts), and with EPLB's redundant experts
rebalanced while requests run; V4 and V4.1 tiny models."""

from __future__ import annotations

import os

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.parallel.comm import RankFailure
from tests.support.engine_checks import assert_same_output, mixed_params, ragged_prompts
from tests.support.ranks import results, run_alone, run_ranks
from tests.support.v4_fixtures import SMALL, build_engine_checkpoint, single_thread  # noqa: F401 (autouse)
from tests.support.v41_fixtures import FIXTURES

COMMON = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=24, state_cache_bytes=1 << 22,
              async_scheduling=True)


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory):
    return str(build_engine_checkpoint(tmp_path_factory.mktemp("tiny_v4_parallel"), SMALL)[0])


def _workload(vocab: int, count: int = 8, lengths: list[int] | None = None):
    """Mixed greedy / seeded requests with logprobs, the second one unseeded (its seed comes from the engine's)."""
    prompts = ragged_prompts(vocab, count=count, max_len=30, seed=3, lengths=lengths)
    params = mixed_params(max_tokens=5)[:count]
    params[1] = SamplingParams(max_tokens=5, temperature=1.0, logprobs=2, prompt_logprobs=1, ignore_eos=True)
    return prompts, params


def _serve(rank, world, path, kwargs, prompts, params):
    llm = LLM(path, **COMMON, **kwargs)
    outs = llm.generate(prompts, params, use_tqdm=False)
    assert llm.parallel is not None
    moe = llm.engine.model.layers[-1].ffn
    held = moe.placement.local_experts(moe.layer, llm.parallel.context.plan.ep_rank) \
        if hasattr(moe, "placement") else None
    return outs, llm.parallel.rebalances, held


def _check(path, world, kwargs, count=8, lengths=None):
    llm = LLM(path, **COMMON)
    vocab = llm.engine.model.vocab_size
    prompts, params = _workload(vocab, count, lengths)
    expected = llm.generate(prompts, params, use_tqdm=False)
    got = results(run_ranks(_serve, world, path, kwargs, prompts, params), world)
    for outs, _, _ in got:
        for a, b in zip(outs, expected, strict=True):
            assert_same_output(a, b)
    return got


def test_data_parallel_attention_alone(v4_path):
    _check(v4_path, 2, dict(data_parallel_size=2))


def _traffic(rank, world, path, prompts, params):
    llm = LLM(path, **COMMON, data_parallel_size=2, expert_parallel_size=2)
    llm.generate(prompts, params, use_tqdm=False)
    context = llm.parallel.context
    return context.sent_rows, context.sent_pairs


def test_expert_parallel_divisible(v4_path):
    got = _check(v4_path, 2, dict(data_parallel_size=2, expert_parallel_size=2))
    assert [held for _, _, held in got] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    prompts, params = _workload(SMALL["vocab_size"], 4)
    for rows, pairs in results(run_ranks(_traffic, 2, v4_path, prompts, params), 2):
        assert pairs > rows > pairs // 2  # top-2: a token whose experts share a rank sends its row there once


def test_expert_parallel_non_divisible(v4_path):
    """8 experts over 3 EP ranks: 9 slots, one expert replicated; 3 prompts leave no rank idle-free."""
    got = _check(v4_path, 3, dict(data_parallel_size=3, expert_parallel_size=3), count=5)
    assert sorted(e for _, _, held in got for e in held) == sorted([*range(8), 0])


def test_eplb_with_redundant_experts_rebalances_while_serving(v4_path):
    got = _check(v4_path, 2, dict(data_parallel_size=2, expert_parallel_size=2, num_redundant_experts=2,
                                  eplb_step_interval=3))
    assert all(rebalances >= 2 for _, rebalances, _ in got)
    assert sorted(set(got[0][2] + got[1][2])) == list(range(8)) and len(got[0][2]) == 5


def _engram_rows(rank, world, path):
    llm = LLM(path, **COMMON, data_parallel_size=2, expert_parallel_size=2)
    return [layer.engram.weights.table.shape[0] for layer in llm.engine.model.layers if layer.engram is not None]


def test_v41_expert_parallel_with_eplb():
    """V4.1 (Engram tables sharded, CSA2 roles, routing with gate_temp): 6 experts, 2 EP ranks, 2 replicas."""
    path = str(FIXTURES / "tiny_b")
    _check(path, 2, dict(data_parallel_size=2, expert_parallel_size=2, num_redundant_experts=2, eplb_step_interval=2),
           count=4)
    assert results(run_ranks(_engram_rows, 2, path), 2) == [[681], [681]]  # 1362 rows, half on each rank


def test_context_parallel_prefill(v4_path):
    """2 CP ranks split every ragged step (zigzag) on V4: windows of 16, CSA / HCA entries, indexer top-8
    across the split."""
    _check(v4_path, 2, dict(context_parallel_size=2), count=4, lengths=[70, 9, 33, 2])


def test_context_parallel_three_ranks_with_steps_too_short_to_split(v4_path):
    _check(v4_path, 3, dict(context_parallel_size=3), count=2, lengths=[3, 40])


def test_v41_context_parallel_prefill():
    _check(str(FIXTURES / "tiny_b"), 2, dict(context_parallel_size=2), count=4, lengths=[70, 9, 33, 2])


def test_combination_dp_cp_ep_with_eplb(v4_path):
    """4 ranks: 2 DP ranks of 2 CP ranks each, experts over all 4 with 2 replicas, rebalanced while serving."""
    got = _check(v4_path, 4, dict(data_parallel_size=2, context_parallel_size=2, expert_parallel_size=4,
                                  num_redundant_experts=4, eplb_step_interval=3), count=6)
    assert all(rebalances >= 1 for _, rebalances, _ in got)


def _die_midway(rank, world, path, prompts, params):
    llm = LLM(path, **COMMON, data_parallel_size=2, expert_parallel_size=2, distributed_timeout=20)
    if rank == 1:
        step = llm.engine.step
        calls = iter(range(100))

        def dying_step():
            if next(calls) == 2:
                os._exit(3)  # a rank that dies mid-run, without a word
            return step()

        llm.engine.step = dying_step
    try:
        llm.generate(prompts, params, use_tqdm=False)
    except RankFailure as exc:
        return str(exc)
    return "finished"


def test_a_rank_that_dies_fails_the_others_with_a_clear_error(v4_path):
    prompts, params = _workload(SMALL["vocab_size"], 4)
    outcome = run_ranks(_die_midway, 2, v4_path, prompts, params, timeout=20, join_s=60)
    assert 1 not in outcome  # it died
    status, message = outcome[0]
    assert status == "ok" and "another rank died or did not join" in message, outcome


def _self_launched(path, prompts, params):
    llm = LLM(path, **COMMON, data_parallel_size=2, expert_parallel_size=2)
    try:
        return [llm.generate(prompts, params, use_tqdm=False), llm.generate(prompts[:1], params[:1], use_tqdm=False)]
    finally:
        llm.shutdown()


def _peer_dies(path, prompts, params):
    llm = LLM(path, **COMMON, data_parallel_size=2, expert_parallel_size=2, distributed_timeout=20)
    llm.generate(prompts, params, use_tqdm=False)
    llm._peers[0].kill()
    errors = []
    for _ in range(2):
        try:
            llm.generate(prompts, params, use_tqdm=False)
        except (RankFailure, RuntimeError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    llm.shutdown()
    return errors


@pytest.mark.slow  # spawns a fresh interpreter (~10 s); test_a_rank_that_dies_... is the fast sibling
def test_a_self_launched_rank_that_dies(v4_path):
    prompts, params = _workload(SMALL["vocab_size"], 2)
    first, second = run_alone(_peer_dies, v4_path, prompts, params, join_s=240)
    assert first.startswith("RankFailure") and "another rank died" in first
    assert "failed earlier" in second


@pytest.mark.slow  # starts a rank by spawning a fresh interpreter (~10 s); the torchrun-style tests above are fast
def test_llm_starts_its_own_ranks(v4_path):
    llm = LLM(v4_path, **COMMON)
    prompts, params = _workload(llm.engine.model.vocab_size, 4)
    expected = llm.generate(prompts, params, use_tqdm=False)
    first, second = run_alone(_self_launched, v4_path, prompts, params, join_s=240)
    for a, b in zip(first, expected, strict=True):
        assert_same_output(a, b)
    assert second[0].outputs[0].token_ids == expected[0].outputs[0].token_ids


def _different_prompts(rank, world, path):
    llm = LLM(path, **COMMON, data_parallel_size=2)
    try:
        llm.generate([[5, 6, 7]] * (rank + 1), SamplingParams(max_tokens=2), use_tqdm=False)
    except ValueError as exc:
        first = str(exc)
    try:
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), use_tqdm=False)
    except RuntimeError as exc:
        return first, str(exc)
    return first, "no error"


def test_ranks_must_agree_and_a_failed_engine_stays_failed(v4_path):
    for first, second in results(run_ranks(_different_prompts, 2, v4_path), 2):
        assert "every rank must call generate with the same prompts; the ranks got [1, 2]" in first
        assert "failed earlier" in second and "start a new LLM" in second
