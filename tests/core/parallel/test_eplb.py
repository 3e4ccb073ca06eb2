"""EPLB as a pure function: replicas follow load, ranks even out, groups stay on nodes."""

from __future__ import annotations

import random

import pytest

from deepinfer.parallel.eplb import balanced_packing, max_mean_ratio, place_layer, rebalance, replicate


def test_replicas_go_to_the_heaviest_experts():
    assert replicate([100, 10, 10, 40], 6) == [3, 1, 1, 1]
    assert replicate([1, 1, 1, 1], 4) == [1, 1, 1, 1]


def test_packing_is_even_in_count_and_balanced():
    weights = [9, 8, 7, 6, 5, 4, 3, 2]
    packs = balanced_packing(weights, 2)
    assert [packs.count(p) for p in range(2)] == [4, 4]
    sums = [sum(w for w, p in zip(weights, packs, strict=True) if p == q) for q in range(2)]
    assert sums == [22, 22]


def test_packing_spreads_replicas_of_one_expert():
    packs = balanced_packing([5, 5, 1, 1], 2, avoid=[0, 0, 1, 1])
    assert packs[0] != packs[1] and packs[2] != packs[3]


def test_skewed_load_gets_balanced_with_redundant_experts():
    rng = random.Random(0)
    load = [rng.paretovariate(1.2) * 100 for _ in range(16)]
    before = max_mean_ratio(load, list(range(16)), 4)
    row = place_layer(load, 20, 4)
    after = max_mean_ratio(load, row, 4)
    assert sorted(set(row)) == list(range(16)) and len(row) == 20
    assert after < before and after < 1.3, (before, after)


def test_hierarchical_keeps_groups_on_one_node():
    load = [float(e + 1) for e in range(16)]
    row = place_layer(load, 24, ep_size=4, num_groups=4, num_nodes=2)
    node_of = {}
    for s, e in enumerate(row):
        node = s // 12
        assert node_of.setdefault(e // 4, node) == node, f"group {e // 4} split across nodes"
    # the two nodes carry the same group load: groups (1, 4) and (2, 3) by weight
    assert sorted(node_of.values()) == [0, 0, 1, 1]


def test_groups_that_do_not_divide_use_the_global_policy():
    row = place_layer([1.0] * 6, 8, ep_size=4, num_groups=3, num_nodes=2)
    assert sorted(set(row)) == list(range(6)) and len(row) == 8


def test_rebalance_every_layer_and_deterministic():
    load = [[1, 2, 3, 40], [40, 3, 2, 1]]
    a, b = rebalance(load, 6, 2), rebalance(load, 6, 2)
    assert a == b and a.num_layers == 2 and a.num_slots == 6
    assert a.slots[0].count(3) >= 2 and a.slots[1].count(0) >= 2


@pytest.mark.parametrize(("slots", "ep", "match"), [(7, 2, "divide over 2 EP ranks"), (3, 1, ">= 4 experts")])
def test_bad_sizes_are_refused(slots, ep, match):
    with pytest.raises(ValueError, match=match):
        place_layer([1.0] * 4, slots, ep)
