"""The verify budget on plain data: survival ranking, prefixes, the cost trade-off, the switches.  No tensors."""

from __future__ import annotations

import itertools

import pytest

from deepinfer.spec_decode.budget import CostTable, survival, verify_lengths

FLAT = CostTable((1 << 20,), (1.0,))  # every step costs the same: verifying more never hurts


def test_survival_is_the_running_product_and_clamped():
    assert survival([0.5, 0.5, 1.0]) == [0.5, 0.25, 0.25]
    assert survival([1.5, -0.2]) == [1.0, 0.0]


def test_without_varlen_or_table_every_request_verifies_its_whole_draft():
    caps, conf = [5, 3, 0], [[0.1] * 5, None, None]
    assert verify_lengths(caps, conf, 3, FLAT, varlen=False) == caps
    assert verify_lengths(caps, conf, 3, None, varlen=True) == caps  # unprofiled: verify everything


def test_flat_cost_admits_everything_and_steep_cost_only_the_floor():
    caps, conf = [4, 4], [[0.9] * 4, [0.2] * 4]
    assert verify_lengths(caps, conf, 2, FLAT, varlen=True) == [4, 4]
    steep = CostTable(tuple(range(1, 64)), tuple(float(n) ** 3 for n in range(1, 64)))
    assert verify_lengths(caps, conf, 2, steep, varlen=True) == [1, 1]  # each request still verifies one


def test_global_ranking_gives_the_budget_to_the_confident_request():
    # Cost jumps after 6 tokens: 2 anchors + 2 floor drafts + 2 more.  The best two extra slots are request 0's.
    table = CostTable((6, 64), (1.0, 100.0))
    out = verify_lengths([5, 5], [[0.95] * 5, [0.3] * 5], 2, table, varlen=True)
    assert out == [3, 1]


def test_admitted_sets_are_prefixes_and_respect_caps():
    table = CostTable((4, 8, 12, 16, 32), (1.0, 1.3, 1.9, 2.6, 6.0))
    confs = [[0.9, 0.1, 0.99, 0.99], [0.5, 0.9, 0.9, 0.9], [0.99] * 4, None]
    caps = [4, 2, 4, 3]
    out = verify_lengths(caps, confs, 4, table, varlen=True)
    assert all(1 <= k <= cap for k, cap in zip(out, caps, strict=True))
    # A request's k-th draft is admitted only if every slot with higher survival is.
    slots = {(r, j): s for r, c in enumerate(confs) for j, s in enumerate(survival((c or [1.0] * 4)[: caps[r]]))}
    admitted = {(r, j) for r, k in enumerate(out) for j in range(k)}
    competed = [a for a in admitted if a[1] >= 1]  # beyond each request's floor draft
    for slot, s in slots.items():
        if slot not in admitted:
            assert all(slots[a] >= s for a in competed)


def _brute_force(caps, confs, base, table):
    best = -1.0
    for ks in itertools.product(*[range(min(c, 1), c + 1) for c in caps]):
        value = len(caps) + sum(sum(survival(c[:k])) for c, k in zip(confs, ks, strict=True))
        ratio = value / table.cost(base + sum(ks))
        if ratio > best + 1e-12:
            best = ratio
    return best


@pytest.mark.parametrize("seed", range(6))
def test_the_chosen_budget_is_optimal_over_every_prefix_allocation(seed):
    import random

    rng = random.Random(seed)
    caps = [rng.randint(0, 4) for _ in range(4)]
    confs = [[rng.random() for _ in range(4)] for _ in caps]
    costs, c = [], 1.0
    for _ in range(30):
        c += rng.random()
        costs.append(c)
    table = CostTable(tuple(range(1, 31)), tuple(costs))
    out = verify_lengths(caps, confs, 4, table, varlen=True)
    value = len(caps) + sum(sum(survival(c[:k])) for c, k in zip(confs, out, strict=True))
    assert value / table.cost(4 + sum(out)) == pytest.approx(_brute_force(caps, confs, 4, table))


def test_unknown_confidence_counts_as_certain():
    table = CostTable((5, 64), (1.0, 50.0))  # room for 2 anchors, the 2 floor drafts and one more
    assert verify_lengths([3, 3], [None, [0.5, 0.5, 0.5]], 2, table, varlen=True) == [2, 1]


def test_bad_inputs_raise():
    with pytest.raises(ValueError, match="increasing"):
        CostTable((4, 2), (1.0, 2.0))
    with pytest.raises(ValueError, match="> 0"):
        CostTable((4,), (0.0,))
    with pytest.raises(ValueError, match="confidence rows"):
        verify_lengths([1, 2], [None], 0, FLAT, varlen=True)
    assert CostTable((4, 8), (1.0, 2.0)).cost(16) == 4.0  # linear past the last bucket
