"""The serving side of the parallel engine without processes: which DP rank gets a request, the outputs sent
as deltas and rebuilt whole, and what rank 0's driver sends with each step."""

from __future__ import annotations

import pickle
import random

from deepinfer.engine.counters import EngineCounters
from deepinfer.engine.dp_dispatch import Dispatcher, RankReport, StepOrders
from deepinfer.engine.engine_driver import LockstepDriver
from deepinfer.engine.output_deltas import DeltaReceiver, DeltaSender
from deepinfer.outputs import CompletionOutput, Logprob, RequestOutput
from deepinfer.sampling_params import SamplingParams


def test_requests_go_to_the_least_loaded_rank():
    d = Dispatcher(3)
    assert [d.assign() for _ in range(4)] == [0, 1, 2, 0]
    report = lambda dp, n, cp=0: RankReport(dp, cp, [], n, EngineCounters())  # noqa: E731
    d.observe([report(0, 0), report(0, 9, cp=1), report(1, 2), report(2, 1)], pending=[])
    assert d.loads == [0, 2, 1]  # a DP rank's load is its first CP rank's
    assert [d.assign() for _ in range(3)] == [0, 0, 2]


def _grow(out: RequestOutput, rng: random.Random, steps: int) -> None:
    """What an engine step does to a live output: tokens, logprobs and text appended to its completions."""
    for c in out.outputs:
        for _ in range(rng.randrange(steps + 1)):
            c.token_ids.append(rng.randrange(100))
            assert c.logprobs is not None
            c.logprobs.append({c.token_ids[-1]: Logprob(-rng.random(), 1)})
            c.text += rng.choice(["a", " b", "é", ""])
            c.cumulative_logprob = -rng.random()


def _sent(update):
    """Through a pipe: a copy (ranks pickle what they report)."""
    return pickle.loads(pickle.dumps(update))


def _same(a: RequestOutput, b: RequestOutput) -> None:
    assert [(c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason) for c in a.outputs] \
        == [(c.index, c.text, c.token_ids, c.logprobs, c.cumulative_logprob, c.finish_reason) for c in b.outputs]
    assert (a.request_id, a.prompt, a.prompt_token_ids, a.finished) == (b.request_id, b.prompt, b.prompt_token_ids,
                                                                         b.finished)


def test_outputs_travel_as_deltas_and_arrive_whole():
    rng = random.Random(3)
    sender, receiver = DeltaSender(), DeltaReceiver()
    live = RequestOutput("r", "p", [1, 2, 3], None, [CompletionOutput(i, "", [], None, []) for i in range(2)])
    _grow(live, rng, 2)
    first = sender.encode(live)
    assert first.starts is None
    _same(receiver.decode(_sent(first)), live)
    for _ in range(6):
        before = [len(c.token_ids) for c in live.outputs]
        _grow(live, rng, 3)
        update = sender.encode(live)
        assert update.starts is not None and update.output.prompt_token_ids == []
        assert [len(c.token_ids) for c in update.output.outputs] == [
            len(c.token_ids) - n for c, n in zip(live.outputs, before, strict=True)]  # only the news travels
        _same(receiver.decode(_sent(update)), live)
    for c in live.outputs:
        c.finish_reason = "length"
    live.finished = True
    last = sender.encode(live)
    assert last.starts is None  # a finished request goes whole, once
    _same(receiver.decode(_sent(last)), live)
    assert receiver._have == {} and sender._sent == {}


def test_a_completion_that_shrank_is_sent_from_the_start():
    sender, receiver = DeltaSender(), DeltaReceiver()
    live = RequestOutput("r", "p", [1], None, [CompletionOutput(0, "abcd", [1, 2, 3, 4], None, None)])
    receiver.decode(_sent(sender.encode(live)))
    live.outputs[0].token_ids[2:] = []
    live.outputs[0].text = "ab"
    update = sender.encode(live)
    assert update.starts == {0: (0, 0)}
    _same(receiver.decode(_sent(update)), live)


class _Engine:
    """What the driver reads of rank 0's engine: counters, and the seed generator unseeded requests draw from."""

    def __init__(self):
        self._seed_rng = random.Random(0)


class _Parallel:
    """A data-parallel engine that records what rank 0 sends and answers with canned reports."""

    class context:  # noqa: N801 - stands for ParallelContext
        class plan:  # noqa: N801
            dp_size = 2

    def __init__(self):
        self.sent: list[StepOrders] = []
        self.failed = None
        self.engine = _Engine()

    def seeded(self, params):
        from deepinfer.engine.data_parallel import DataParallelEngine

        return DataParallelEngine.seeded(self, params)  # type: ignore[arg-type]

    def lead_step(self, orders):
        self.sent.append(orders)
        held = {0: 0, 1: 0}
        for add in orders.adds:
            held[add.dp_rank] += 1
        return [RankReport(dp, 0, [], n, EngineCounters(prompt_tokens=10 * n)) for dp, n in held.items()]


def test_rank_zero_sends_new_requests_and_aborts_with_the_next_step(monkeypatch):
    monkeypatch.setattr(EngineCounters, "of", classmethod(lambda cls, engine: cls()))
    parallel = _Parallel()
    driver = LockstepDriver(parallel)  # type: ignore[arg-type]
    assert not driver.has_unfinished()
    for rid in "abc":
        assert driver.add_request([5, 6], SamplingParams(max_tokens=2), rid) is None
    driver.abort("b")  # not sent yet: it never reaches a rank
    assert driver.has_unfinished()
    assert driver.step() == []
    orders = parallel.sent[-1]
    assert [(a.request_id, a.dp_rank) for a in orders.adds] == [("a", 0), ("c", 0)] and orders.step
    assert len({a.params.seed for a in orders.adds}) == 2  # unseeded requests drew their seeds in arrival order
    assert driver.counters().prompt_tokens == 20 and driver.has_unfinished()
    driver.abort("a")
    driver.step()
    assert parallel.sent[-1].aborts == ["a"] and parallel.sent[-1].step  # ranks still held requests
    assert not driver.has_unfinished()  # the canned reports now say nothing is held
    parallel.failed = "RankFailure: gone"
    rejected = driver.add_request([5], SamplingParams(), "d")
    assert rejected is not None and "failed (RankFailure: gone)" in rejected.error
