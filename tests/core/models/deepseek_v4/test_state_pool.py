"""The V4 state pool's sizing: whatever the scheduler admits (state_bytes within the plan's bytes, at most
its slots) fits in the fixed pool's slots and pages, and a budget from pool_bytes_for admits what it promises."""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer.kv.pool import StatePool
from deepinfer.kv.sizing import min_pool_bytes, plan_pool, pool_bytes_for
from deepinfer.models.deepseek_v4.config import CSA, HCA, SLIDING
from deepinfer.models.deepseek_v4.state import layer_caches, state_spec

SPEC = state_spec(window=16, head_dim=32, index_head_dim=16, kinds=(SLIDING, CSA, HCA, CSA), ratios=(0, 4, 16, 4),
                  page_size=4)
SIZE = 4  # fp32


def _state_bytes(n: int) -> int:
    return SPEC.state_bytes(n, SIZE)


@pytest.mark.parametrize("capacity", [100_000, 250_000, 1_000_000, 5_000_000])
def test_whatever_the_budget_admits_fits_in_the_pool(capacity):
    rng = random.Random(capacity)
    pool, plan = StatePool.for_budget(SPEC, torch.float32, torch.device("cpu"), 64, capacity)
    assert plan.nbytes <= capacity and pool.nbytes() == plan.nbytes
    live = plan.slots - 1
    for _ in range(30):  # random admissible sets: grow sequences one by one until the budget says stop
        states, used = [], 0
        while len(states) < live:
            n = rng.choice([1, 3, 4, 15, 16, 17, 63, 64, 65, 200, 1000])
            if used + _state_bytes(n) > plan.admissible:
                break
            state = pool.new_state()
            pool.reserve(state, n)  # raises if slots or pages run out
            states.append(state)
            used += _state_bytes(n)
            assert state.nbytes() <= _state_bytes(n)
        for state in states:
            pool.release(state)
    assert sorted(pool._free_slots) == list(range(1, pool.slots))


def test_small_budgets_limit_slots_and_tiny_ones_are_refused():
    assert plan_pool(SPEC, SIZE, 256, 200_000).slots - 1 < 256
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        plan_pool(SPEC, SIZE, 256, 1_000)


@pytest.mark.parametrize("max_seqs", [1, 3, 256])
def test_the_least_budget_the_error_names_is_accepted(max_seqs):
    with pytest.raises(ValueError, match=r"raise state_cache_bytes to at least (\d+)") as info:
        plan_pool(SPEC, SIZE, max_seqs, 1_000)
    least = int(str(info.value).rsplit(" ", 1)[1])
    assert least == min_pool_bytes(SPEC, SIZE)
    plan = plan_pool(SPEC, SIZE, max_seqs, least)
    assert plan.nbytes <= least and plan.admissible >= _state_bytes(2)  # a 2-token sequence, the shortest limit
    with pytest.raises(ValueError, match="cannot hold one sequence"):
        plan_pool(SPEC, SIZE, max_seqs, least - 1)


@pytest.mark.parametrize("seqs, tokens", [(1, 10), (4, 100), (16, 1000)])
def test_pool_bytes_for_admits_what_it_promises(seqs, tokens):
    capacity = pool_bytes_for(SPEC, SIZE, seqs, tokens)
    plan = plan_pool(SPEC, SIZE, seqs, capacity)
    assert plan.slots - 1 == seqs and plan.admissible >= seqs * _state_bytes(tokens)
    assert plan_pool(SPEC, SIZE, seqs, int(capacity * 0.98)).admissible < seqs * _state_bytes(tokens) or \
        plan_pool(SPEC, SIZE, seqs, int(capacity * 0.98)).slots - 1 < seqs  # and not much less would do


def test_a_fixed_pool_says_which_resource_ran_out():
    pool, plan = StatePool.for_budget(SPEC, torch.float32, torch.device("cpu"), 2, 200_000)
    states = [pool.new_state() for _ in range(plan.slots - 1)]
    for s in states:
        pool.reserve(s, 1)
    with pytest.raises(RuntimeError, match="no free slot"):
        pool.reserve(pool.new_state(), 1)
    with pytest.raises(RuntimeError, match="no free page for compression ratio 4"):
        pool.reserve(states[0], 10**6)


def test_growable_pool_keeps_contents_when_it_grows():
    pool = StatePool.growable_pool(SPEC, torch.float32, torch.device("cpu"), views=layer_caches)
    first = pool.new_state()
    pool.reserve(first, 40)
    for layer in pool.views:
        layer.kv[pool.ring_rows(first.slot)] = 1.0
        if layer.ratio:
            layer.kv[pool.entry_base(layer.ratio) + pool.page_rows(first, layer.ratio)] = 2.0
    others = [pool.new_state() for _ in range(9)]
    for s in others:
        pool.reserve(s, 300)  # forces more slots and pages
    assert pool.slots > 4
    for layer in pool.views:
        assert bool((layer.kv[pool.ring_rows(first.slot)] == 1.0).all())
        if layer.ratio:
            assert bool((layer.kv[pool.entry_base(layer.ratio) + pool.page_rows(first, layer.ratio)] == 2.0).all())


def test_a_model_in_use_is_not_reconfigured(tmp_path):
    from deepinfer.models import load_model
    from deepinfer.ops import OpTable
    from tests.support.v4_fixtures import SMALL, build_checkpoint

    path, _ = build_checkpoint(tmp_path, SMALL, seed=3)
    model = load_model(path, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))
    model.configure_state(4, model.state_pool_bytes(4, 64))
    state = model.new_state()
    model.pool.reserve(state, 10)
    with pytest.raises(RuntimeError, match="still holds 1 sequences"):
        model.configure_state(4, model.state_pool_bytes(4, 64))
    state.release()
    assert model.configure_state(2, model.state_pool_bytes(2, 64)).max_seqs == 2
