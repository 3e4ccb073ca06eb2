"""``AsyncLLM``: requests from asyncio callers join a running engine, stream, abort, fail alone."""

from __future__ import annotations

import asyncio
import time

import pytest

from deepinfer import LLM, RequestOutputKind, SamplingParams
from deepinfer.engine.async_llm import AsyncLLM
from tests.support.toy_model import ToyCausalLM, toy_tokenizer

PROMPTS = ["The quick brown fox jumps", "Once upon a time", "Le café", "She liked to read"]


class _FailingModel(ToyCausalLM):
    fail_next = False

    def forward(self, batch):
        if self.fail_next:
            self.fail_next = False
            raise RuntimeError("device fell over")
        return super().forward(batch)


@pytest.fixture
def served():
    tok = toy_tokenizer()
    llm = LLM.from_model(_FailingModel(len(tok), seed=5), tok, max_num_seqs=8)
    engine = AsyncLLM(llm)
    yield llm, engine
    engine.shutdown()


def _params(i: int, kind=RequestOutputKind.DELTA) -> SamplingParams:
    return SamplingParams(temperature=0.0 if i % 2 else 1.0, seed=i, max_tokens=8 + 2 * i, ignore_eos=True,
                          output_kind=kind)


async def _collect(engine: AsyncLLM, prompt, params, rid: str, delay: float = 0.0) -> tuple[list[int], int]:
    await asyncio.sleep(delay)
    tokens, chunks = [], 0
    async for out in engine.generate(prompt, params, rid):
        chunks += 1
        for c in out.outputs:
            tokens += c.token_ids
    return tokens, chunks


def _wait_until(cond, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_concurrent_callers_get_their_offline_outputs(served):
    llm, engine = served
    ref = llm.generate(PROMPTS, [_params(i) for i in range(4)], use_tqdm=False)

    async def main():
        # Staggered arrivals: later requests join while earlier ones run.
        return await asyncio.gather(*(_collect(engine, p, _params(i), f"r{i}", 0.01 * i)
                                      for i, p in enumerate(PROMPTS)))

    results = asyncio.run(main())
    for (tokens, chunks), want in zip(results, ref, strict=True):
        assert tokens == want.outputs[0].token_ids
        assert chunks > 1  # streamed step by step
    stats = engine.stats
    assert stats.requests["length"] == 4 and stats.time_to_first_token.count == 4
    assert stats.inter_token_latency.count > 0 and stats.e2e_request_latency.count == 4


def test_a_late_request_joins_the_running_batch(served):
    llm, engine = served
    batch_sizes: list[int] = []
    step = llm.engine.step

    def counting_step():
        batch_sizes.append(len(llm.engine.scheduler.running))
        return step()

    llm.engine.step = counting_step
    long = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    short = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)

    async def main():
        first = engine.generate("Once upon a time", long, "first")
        out = asyncio.create_task(anext(first))
        while not batch_sizes:  # the first request is running
            await asyncio.sleep(0.001)
        late = [o async for o in engine.generate("Le café", short, "late")]
        return await out, late[-1]

    first, late = asyncio.run(main())
    del llm.engine.step
    m1, m2 = first.metrics, late.metrics
    # joined mid-run (with async scheduling the first token's time is taken after the next step is scheduled,
    # so the late request may be scheduled before it)
    assert m1.first_scheduled_time < m2.first_scheduled_time < m2.finished_time < m1.finished_time
    assert max(batch_sizes) == 2  # and shared its steps


def test_offline_generate_waits_for_the_async_requests(served):
    llm, engine = served
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    ref = llm.generate(PROMPTS, params, use_tqdm=False)

    async def main():
        async_outs = asyncio.gather(*(_collect(engine, p, params, f"a{i}") for i, p in enumerate(PROMPTS)))
        offline = asyncio.to_thread(llm.generate, PROMPTS, params, use_tqdm=False)
        return await asyncio.gather(async_outs, offline)

    async_outs, offline = asyncio.run(main())
    assert [t for t, _ in async_outs] == [o.outputs[0].token_ids for o in ref]
    assert [o.outputs[0].token_ids for o in offline] == [o.outputs[0].token_ids for o in ref]


def test_leaving_early_aborts_and_frees_state(served):
    llm, engine = served

    async def main():
        stream = engine.generate("Once upon a time", SamplingParams(max_tokens=10_000, ignore_eos=True,
                                                                    output_kind=RequestOutputKind.DELTA), "long")
        async for _ in stream:
            break
        await stream.aclose()
        ok = await _collect(engine, "Le café", _params(1), "short")
        return ok

    tokens, _ = asyncio.run(main())
    assert len(tokens) == _params(1).max_tokens
    _wait_until(lambda: not llm.engine.seqs and not llm.engine.requests)
    assert llm.engine.state_cache.budget.used == 0 and engine.stats.requests["abort"] == 1


def test_bad_request_fails_alone_and_a_failed_step_fails_only_its_requests(served):
    llm, engine = served

    async def main():
        good = asyncio.create_task(_collect(engine, "Le café", _params(1), "good"))
        bad = [out async for out in engine.generate([10**6], _params(0), "bad")]
        return bad, await good

    bad, (tokens, _) = asyncio.run(main())
    assert len(bad) == 1 and bad[0].error is not None and "vocabulary" in bad[0].error
    assert len(tokens) == _params(1).max_tokens

    llm.engine.model.fail_next = True

    async def failing():
        with pytest.raises(RuntimeError, match="device fell over"):
            await _collect(engine, "Le café", _params(1), "doomed")
        return await _collect(engine, "Le café", _params(1), "after")

    assert asyncio.run(failing())[0] == tokens  # the loop survived, the engine is clean
    assert engine.is_running
