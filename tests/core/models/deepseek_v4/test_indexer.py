"""The indexer picks every causal entry of a query with at most ``index_topk`` of them, without scoring."""

from types import SimpleNamespace

import torch

from deepinfer.kv.decode_plan import CausalPicks
from deepinfer.models.deepseek_v4.indexer import Indexer
from deepinfer.ops import OpTable

HEADS, DIM, TOPK, RATIO = 4, 16, 6, 4


def _indexer(gen: torch.Generator) -> Indexer:
    wq_b = torch.randn(HEADS * DIM, 32, generator=gen)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2, dtype=torch.float32) / 8))
    return Indexer(OpTable(), wq_b, SimpleNamespace(ratio=RATIO), n_heads=HEADS, head_dim=DIM, topk=TOPK,
                   inv_freq=inv_freq, rope_scaling=1.0)


def test_causal_picks_stop_at_the_limit():
    picks = CausalPicks.build(torch.tensor([0, 2, 5]), torch.arange(4))
    assert picks.ids.tolist() == [[-1, -1, -1, -1], [0, 1, -1, -1], [0, 1, 2, 3]]
    assert picks.takes_all.flatten().tolist() == [True, True, False]


def test_short_rows_take_every_causal_entry_and_long_rows_the_ops_top_k():
    gen = torch.Generator().manual_seed(0)
    indexer = _indexer(gen)
    positions = torch.tensor([3, 10, 23, 24, 27, 40, 47])  # limits 1, 2, 6, 6, 7, 10, 12 against topk 6
    rows, entries = positions.shape[0], 12
    q_residual = torch.randn(rows, 32, generator=gen)
    weights = torch.randn(rows, HEADS, generator=gen)
    keys = torch.randn(1, entries, DIM, generator=gen)
    seq_ids = torch.zeros(rows, dtype=torch.int64)
    picks = indexer._topk(weights, q_residual, positions, keys, seq_ids)

    limits = (positions + 1) // RATIO
    q = indexer.ops.rope(indexer.ops.linear(q_residual, indexer.wq_b).view(rows, HEADS, DIM), positions,
                         indexer.inv_freq, 1.0)
    scored = indexer.ops.indexer_topk(q, weights, keys, seq_ids, limits, TOPK, DIM**-0.5, HEADS**-0.5)
    short = limits <= TOPK
    assert short.any() and (~short).any()
    assert torch.equal(picks[~short], scored[~short])
    causal = torch.tensor([[e if e < limit else -1 for e in range(TOPK)] for limit in limits.tolist()])
    assert torch.equal(picks[short], causal[short])
    for row in torch.nonzero(short).flatten().tolist():  # the same entries as the scores would pick
        assert sorted(scored[row][scored[row] >= 0].tolist()) == list(range(int(limits[row])))
