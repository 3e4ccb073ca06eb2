"""The parallel planner: plain data, no processes."""

from __future__ import annotations

import dataclasses

import pytest

from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.parallel.plan import ParallelConfig, plan_parallel


def _plan(dp=1, ep=1, cp=1, redundant=None, world=None, rank=0, experts=8, layers=2):
    config = ParallelConfig(dp, ep, cp, redundant)
    return plan_parallel(config, world if world is not None else dp * cp, rank, n_routed_experts=experts,
                         num_moe_layers=layers)


def test_dp_and_cp_ranks_are_consecutive_blocks():
    plans = [_plan(dp=2, cp=2, ep=4, rank=r) for r in range(4)]
    assert [(p.dp_rank, p.cp_rank) for p in plans] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert [p.cp_ranks for p in plans] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert all(p.ep_ranks == (0, 1, 2, 3) and p.ep_rank == r for r, p in enumerate(plans))


def test_ep_smaller_than_the_world_makes_groups():
    plan = _plan(dp=4, ep=2, rank=3)
    assert plan.ep_ranks == (2, 3) and plan.ep_rank == 1 and plan.ep_groups == [(0, 1), (2, 3)]


def test_divisible_experts_get_no_replicas():
    placement = _plan(dp=4, ep=4).placement
    assert placement is not None and placement.num_slots == 8 and placement.slots_per_rank == 2
    assert placement.local_experts(0, 3) == (6, 7)


def test_non_divisible_experts_get_the_fewest_replicas():
    placement = _plan(dp=4, ep=4, experts=6).placement
    assert placement is not None and placement.num_slots == 8
    assert sorted(set(placement.slots[1])) == list(range(6))  # every expert placed, two replicated
    assert sum(len(r) for r in placement.replicas(0)) == 8 and max(len(r) for r in placement.replicas(0)) == 2


def test_explicit_redundant_experts():
    placement = _plan(dp=2, ep=2, redundant=4).placement
    assert placement is not None and placement.num_slots == 12


def test_frozen_plain_data():
    plan = _plan(dp=2, ep=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.rank = 1  # type: ignore[misc]


def test_no_placement_without_ep():
    assert _plan(dp=2).placement is None


@pytest.mark.parametrize(("kwargs", "match"), [
    (dict(dp=2, world=3), r"data_parallel_size \* context_parallel_size = 2 \* 1 = 2"),
    (dict(dp=2, ep=4), r"expert_parallel_size \(4\) must divide the world size"),
    (dict(dp=3, ep=3, cp=1, redundant=2), r"8 \+ 2 = 10 expert slots must divide over expert_parallel_size = 3"),
    (dict(dp=2, redundant=2), "num_redundant_experts=2 needs expert_parallel_size > 1"),
    (dict(dp=2, rank=2), r"rank must be in \[0, 2\)"),
])
def test_bad_combinations_name_the_constraint(kwargs, match):
    with pytest.raises(ValueError, match=match):
        _plan(**kwargs)


@pytest.mark.parametrize(("field", "value"), [("data_parallel_size", 0), ("expert_parallel_size", True),
                                              ("context_parallel_size", 1.5), ("num_redundant_experts", -1)])
def test_bad_sizes_name_the_parameter(field, value):
    with pytest.raises(ValueError, match=field):
        ParallelConfig(**{field: value})


def test_placement_refuses_a_missing_expert():
    with pytest.raises(ValueError, match=r"missing \[3\]"):
        ExpertPlacement(4, 2, ((0, 1, 2, 2),))


def test_a_rank_loads_only_its_own_experts():
    from deepinfer.parallel.comm import Communicator
    from deepinfer.parallel.context import ParallelContext

    solo = Communicator.alone()
    context = ParallelContext(_plan(dp=2, ep=2, rank=1), solo, solo, solo)
    assert context.loads("layers.0.ffn.experts.5.w1.weight") and context.loads("layers.1.ffn.experts.4.w2.scale")
    assert not context.loads("layers.0.ffn.experts.3.w1.weight")
    assert context.loads("layers.0.ffn.shared_experts.w1.weight") and context.loads("layers.0.ffn.gate.weight")
    assert context.loads("mtp.0.ffn.experts.0.w1.weight")  # the drafter's experts are not split
