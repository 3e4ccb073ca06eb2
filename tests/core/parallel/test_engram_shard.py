"""Engram tables sharded over 2 EP ranks: every rank's lookups return exactly the rows (and FP8 scales) of the
whole table, for ids owned by either rank, and a rank with no ids joins the exchange."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from deepinfer.models.deepseek_v41.engram import EngramWeights, local_rows
from deepinfer.models.deepseek_v41.engram_shard import EngramShard
from deepinfer.ops import OpTable
from deepinfer.parallel.context import ParallelContext
from deepinfer.parallel.plan import ParallelConfig, plan_parallel
from tests.support.ranks import results, run_ranks

ROWS, WIDTH = 11, 64  # 11 rows over 2 ranks: 6 and 5


def _tables():
    gen = torch.Generator().manual_seed(0)
    table = torch.randn(ROWS, WIDTH, generator=gen).to(torch.float8_e4m3fn)
    scale = torch.randint(100, 140, (ROWS, WIDTH // 32), generator=gen, dtype=torch.uint8)
    return table, scale


def _lookup(rank, world):
    plan = plan_parallel(ParallelConfig(2, 2), world, rank, n_routed_experts=4, num_moe_layers=1)
    context = ParallelContext.create(plan, 30)
    table, scale = _tables()
    mine = context.table_rows("layers.1.engram.embed.weight", ROWS)
    weights = EngramWeights(table[mine], scale[mine], torch.zeros(1, 1), torch.zeros(1), torch.zeros(1))
    shard = EngramShard(context, SimpleNamespace(weights=weights, ops=OpTable()), ROWS)
    ids = torch.tensor([10, 0, 5, 6, 6, 3]) if rank == 0 else torch.empty(0, dtype=torch.int64)
    rows, scales = shard.gather(OpTable(), weights, ids)
    shard.idle()  # the other rank idles at the same time
    # as lists: a tensor would travel as a shared-memory handle that a rank which already exited cannot hand over
    return mine, rows.view(torch.uint8).tolist(), scales.tolist()


def test_sharded_lookup_equals_the_whole_table():
    (first, rows, scales), (second, empty, _) = results(run_ranks(_lookup, 2), 2)
    assert (first, second) == (slice(0, 6), slice(6, 11))
    table, scale = _tables()
    ids = torch.tensor([10, 0, 5, 6, 6, 3])
    want_rows, want_scales = local_rows(OpTable(), EngramWeights(table, scale, *[torch.zeros(1)] * 3), ids)
    assert rows == want_rows.view(torch.uint8).tolist() and scales == want_scales.tolist()
    assert empty == []
