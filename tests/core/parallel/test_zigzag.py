"""The zigzag split of a ragged step's rows over CP ranks (plain lists, no processes)."""

from __future__ import annotations

import pytest

from deepinfer.parallel.context_parallel import zigzag_rows


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_every_row_once_blocks_i_and_mirror(cp):
    lens = [48, 5, 1, 17]
    owned = [zigzag_rows(lens, cp, r) for r in range(cp)]
    assert sorted(r for rows in owned for r in rows) == list(range(sum(lens)))
    # the first sequence: 2 * cp equal blocks; rank i holds block i and block 2cp - 1 - i
    block = 48 // (2 * cp)
    for r, rows in enumerate(owned):
        first = [x for x in rows if x < 48]
        assert first == [*range(r * block, (r + 1) * block), *range((2 * cp - 1 - r) * block, (2 * cp - r) * block)]


def test_causal_work_is_even():
    """Attention work of a row ~ its position + 1: the zigzag gives each rank the same total."""
    cp, n = 4, 1024
    work = [sum(p + 1 for p in zigzag_rows([n], cp, r)) for r in range(cp)]
    assert max(work) == min(work)
    contiguous = [sum(p + 1 for p in range(r * n // cp, (r + 1) * n // cp)) for r in range(cp)]
    assert max(contiguous) / min(contiguous) > 5


def test_a_step_too_short_for_every_rank_runs_whole():
    import torch

    from deepinfer.parallel.comm import Communicator
    from deepinfer.parallel.context_parallel import ContextSplit

    comm = Communicator((0, 1, 2, 3), 0, 1.0)  # no collective runs while building a split
    assert ContextSplit.build(comm, [3], torch.device("cpu")) is None  # 8 blocks of 3 rows: rank 1 gets none
    split = ContextSplit.build(comm, [8, 3], torch.device("cpu"))
    assert split is not None and split.rows.tolist() == [0, 7, 10] and split.counts == [3, 2, 4, 2]
