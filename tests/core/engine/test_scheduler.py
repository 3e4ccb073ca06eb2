"""The scheduler on plain data: token budget, admission, preemption order, forks.  No model, no tensors."""

from __future__ import annotations

import itertools

from deepinfer.engine.request import Request, Sequence, SequenceStatus
from deepinfer.engine.scheduler import Scheduler
from deepinfer.engine.state_cache import StateBudget
from deepinfer.sampling_params import SamplingParams

BYTES_PER_TOKEN = 10
_ids = itertools.count()


def _request(prompt_len: int, n: int = 1) -> Request:
    arrival = next(_ids)
    req = Request(str(arrival), arrival, None, list(range(prompt_len)), SamplingParams(n=n), max_total_tokens=10**6)
    req.sequences = [Sequence(next(_ids), req, i, list(range(prompt_len)), seed=0) for i in range(n)]
    return req


def _scheduler(capacity_tokens: int = 10**6, max_num_seqs: int = 256, max_tokens: int = 8) -> Scheduler:
    budget = StateBudget(capacity_tokens * BYTES_PER_TOKEN, lambda n: n * BYTES_PER_TOKEN)
    return Scheduler(budget, max_num_seqs, max_tokens)


def _sample_all(sched, out):
    """Stand in for the engine: every sampling chunk appends one token."""
    for chunk in out.chunks:
        if chunk.sample:
            for sid in (chunk.seq_id, *chunk.fork_to):
                for seq in sched.running:
                    if seq.seq_id == sid:
                        seq.token_ids.append(0)


def test_chunked_prefill_under_token_budget_mixes_with_decode():
    sched = _scheduler(max_tokens=8)
    a, b = _request(5), _request(20)
    sched.add(a)
    sched.add(b)
    out = sched.schedule()
    assert [(c.seq_id, c.start, len(c.token_ids), c.sample) for c in out.chunks] == [
        (a.sequences[0].seq_id, 0, 5, True), (b.sequences[0].seq_id, 0, 3, False)]
    _sample_all(sched, out)
    out = sched.schedule()  # a decodes one token, b continues its prompt with the rest of the budget
    assert [(c.start, len(c.token_ids)) for c in out.chunks] == [(5, 1), (3, 7)]
    assert out.num_tokens == 8


def test_admission_is_fifo_and_bounded_by_max_num_seqs():
    sched = _scheduler(max_num_seqs=2, max_tokens=100)
    reqs = [_request(3) for _ in range(3)]
    for r in reqs:
        sched.add(r)
    out = sched.schedule()
    assert [c.seq_id for c in out.chunks] == [r.sequences[0].seq_id for r in reqs[:2]]
    assert reqs[2].sequences[0].status is SequenceStatus.WAITING
    sched.finish(reqs[0].sequences[0])
    _sample_all(sched, out)
    out = sched.schedule()
    assert reqs[2].sequences[0].seq_id in [c.seq_id for c in out.chunks]


def test_memory_pressure_preempts_the_newest_and_requeues_it_first():
    sched = _scheduler(capacity_tokens=12, max_tokens=100)
    old, new = _request(6), _request(5)
    sched.add(old)
    sched.add(new)
    out = sched.schedule()
    assert len(out.chunks) == 2 and sched.budget.used == 11 * BYTES_PER_TOKEN
    _sample_all(sched, out)
    out = sched.schedule()  # old grows to 7: fits (12); new would grow to 6 -> 13 > 12: preempted
    assert out.preempted == [new.sequences[0].seq_id]
    assert [c.seq_id for c in out.chunks] == [old.sequences[0].seq_id]
    seq = new.sequences[0]
    assert seq.status is SequenceStatus.WAITING and seq.num_computed == 0 and sched.waiting[0] is seq
    assert seq.token_ids == list(range(5)) + [0]  # keeps its sampled token; recomputed later
    assert sched.num_preemptions == 1
    sched.finish(old.sequences[0])
    _sample_all(sched, out)
    out = sched.schedule()  # recompute: prompt + generated token in one chunk, then sample
    assert [(c.seq_id, c.start, len(c.token_ids), c.sample) for c in out.chunks] == [(seq.seq_id, 0, 6, True)]


def test_forks_are_made_when_the_prompt_completes():
    sched = _scheduler(max_tokens=4)
    req = _request(6, n=3)
    sched.add(req)
    out = sched.schedule()
    assert out.chunks[0].fork_to == () and not out.chunks[0].sample
    out = sched.schedule()
    parent, *children = req.sequences
    assert out.chunks[0].fork_to == tuple(c.seq_id for c in children) and out.chunks[0].sample
    assert all(c.status is SequenceStatus.RUNNING and c.num_computed == 6 for c in children)
    assert sched.budget.used == 3 * 6 * BYTES_PER_TOKEN
    _sample_all(sched, out)
    out = sched.schedule()  # three decodes
    assert sorted(c.seq_id for c in out.chunks) == sorted(s.seq_id for s in req.sequences)


def test_forks_count_against_max_num_seqs():
    sched = _scheduler(max_num_seqs=3, max_tokens=100)
    sched.add(_request(2, n=2))
    blocked = _request(2, n=2)
    sched.add(blocked)
    out = sched.schedule()
    assert len(out.chunks) == 1 and blocked.sequences[0].status is SequenceStatus.WAITING
