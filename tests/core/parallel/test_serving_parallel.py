"""The server's engine loop on several ranks (torchrun-style gloo ranks): ``AsyncLLM`` on rank 0 leads, rank 1
follows (``LLM.follow``).  Concurrent streams, ``n = 2``, seeded sampling with logprobs, an abort mid-stream and
a request its owner rejects give what one process gives; requests spread over the DP ranks; the ranks go idle
between waves and stop when rank 0 shuts down.  The dispatch policy and the output deltas alone: test_dispatch.py.
(The HTTP server on two self-launched ranks: tests/e2e/test_serve_parallel.py, slow.)"""

from __future__ import annotations

import asyncio

import pytest

from deepinfer import LLM, RequestOutputKind, SamplingParams
from deepinfer.engine.async_llm import AsyncLLM
from tests.support.engine_checks import ragged_prompts
from tests.support.ranks import results, run_ranks
from tests.support.v4_fixtures import SMALL, build_engine_checkpoint, single_thread  # noqa: F401 (autouse)

COMMON = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=24, state_cache_bytes=1 << 22)


@pytest.fixture(scope="module")
def v4_path(tmp_path_factory):
    return str(build_engine_checkpoint(tmp_path_factory.mktemp("tiny_v4_serving"), SMALL)[0])


def _params(i: int) -> SamplingParams:
    kind = RequestOutputKind.DELTA if i % 3 else RequestOutputKind.FINAL_ONLY
    if i % 2:
        return SamplingParams(max_tokens=4 + i, temperature=0.0, ignore_eos=True, output_kind=kind)
    return SamplingParams(max_tokens=4 + i, temperature=1.0, seed=i, logprobs=2, n=2 if i == 2 else 1,
                          ignore_eos=True, output_kind=kind)


def _chosen(c) -> list[float]:
    """The logprobs of a completion's sampled tokens (none without ``logprobs``)."""
    return [p[t].logprob for p, t in zip(c.logprobs, c.token_ids, strict=True)] if c.logprobs is not None else []


async def _collect(engine: AsyncLLM, prompt, params: SamplingParams, rid: str, stop_after: int | None = None):
    """Per completion index: token ids and their logprobs; an error output's message."""
    tokens: dict[int, list[int]] = {}
    logprobs: dict[int, list[float]] = {}
    seen = 0
    async for out in engine.generate(prompt, params, rid):
        if out.error is not None:
            return out.error
        for c in out.outputs:
            tokens.setdefault(c.index, []).extend(c.token_ids)
            logprobs.setdefault(c.index, []).extend(_chosen(c))
        seen += 1
        if stop_after is not None and seen >= stop_after:
            return "left"
    return tokens, logprobs


async def _clients(engine: AsyncLLM, prompts, vocab: int):
    wave = [_collect(engine, p, _params(i), f"a{i}") for i, p in enumerate(prompts)]
    wave.append(_collect(engine, [vocab], _params(1), "bad"))  # its owner rejects it
    wave.append(_collect(engine, prompts[0], SamplingParams(max_tokens=50, ignore_eos=True), "gone", stop_after=1))
    first = await asyncio.gather(*wave)
    await asyncio.sleep(0.3)  # the ranks wait, idle, for the next step
    second = await asyncio.gather(*(_collect(engine, p, _params(i), f"b{i}") for i, p in enumerate(prompts[:2])))
    return first, second


def _serve(rank, world, path, kwargs, prompts):
    llm = LLM(path, **COMMON, **kwargs)
    if rank != 0:
        llm.follow()  # returns when rank 0 shuts down
        return llm.engine.num_prompt_tokens
    engine = AsyncLLM(llm)
    try:
        first, second = asyncio.run(_clients(engine, prompts, llm.engine.model.vocab_size))
    finally:
        engine.shutdown()
        llm.shutdown()
    return first, second, engine.stats.prompt_tokens, llm.engine.num_prompt_tokens


def _expected(path, prompts):
    outs = LLM(path, **COMMON).generate(prompts, [_params(i) for i in range(len(prompts))], use_tqdm=False)
    return [({c.index: c.token_ids for c in o.outputs},
             {c.index: _chosen(c) for c in o.outputs})
            for o in outs]


@pytest.mark.parametrize("kwargs", [
    pytest.param(dict(data_parallel_size=2), marks=pytest.mark.slow, id="dp2"),  # dp2-ep2 covers it and more
    pytest.param(dict(data_parallel_size=2, expert_parallel_size=2), id="dp2-ep2")])
def test_rank_zero_serves_and_the_other_rank_follows(v4_path, kwargs):
    prompts = ragged_prompts(SMALL["vocab_size"], count=5, max_len=20, seed=4)
    expected = _expected(v4_path, prompts)
    (first, second, prompt_tokens, mine), theirs = results(
        run_ranks(_serve, 2, v4_path, kwargs, prompts), 2)
    *served, rejected, left = first
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(served + second, expected + expected[:2],
                                                                 strict=True):
        assert tokens == want_tokens
        for index, values in logprobs.items():
            assert values == pytest.approx(want_logprobs[index], abs=1e-5)
    assert "outside the vocabulary" in rejected and left == "left"
    assert mine > 0 and theirs > 0  # both DP ranks served requests
    assert prompt_tokens == mine + theirs  # the server's counters sum the ranks'


def _wait_longer_than_the_timeout(rank, world, idle_s):
    import time

    from deepinfer.parallel.context import ParallelContext
    from deepinfer.parallel.plan import ParallelConfig, plan_parallel

    plan = plan_parallel(ParallelConfig(2), world, rank, n_routed_experts=2, num_moe_layers=1)
    context = ParallelContext.create(plan, timeout_s=2.0)
    if rank == 0:
        time.sleep(idle_s)  # an idle server, a notebook between two calls
    got = context.control.broadcast_object("next call" if rank == 0 else None)
    return got, context.host.all_gather_object(rank)  # the host group keeps its 2 s limit and still works


def test_followers_wait_for_rank_zero_without_a_time_limit():
    assert results(run_ranks(_wait_longer_than_the_timeout, 2, 4.0, timeout=2.0), 2) == [("next call", [0, 1])] * 2
