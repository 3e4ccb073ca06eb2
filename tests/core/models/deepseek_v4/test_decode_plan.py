"""The decode plan's index tensors, computed once per step for every layer, against their per-row definitions."""

import pytest
import torch

from deepinfer.kv.decode_plan import DecodePlan, DecodeStep, RatioKinds
from deepinfer.models.deepseek_v4.config import CSA, HCA, SLIDING

WINDOW, PAGE, BASE, TOPK = 8, 4, 100, 4
POSITIONS, SLOTS = [0, 3, 6, 7, 18, 23, 34], [0, 1, 2, 3, 4, 5, 6]  # row 0: a padding row


def _step(ratios: list[int]) -> DecodeStep:
    tables = {r: torch.tensor([[0, 0, 0]] + [[3 * i + 1, 3 * i + 2, 3 * i + 3] for i in range(1, 7)]) for r in ratios}
    return DecodeStep(torch.zeros(7, dtype=torch.int64), torch.tensor(POSITIONS), torch.tensor(SLOTS), tables)


def _row(table: list[int], e: int) -> int:
    return table[e // PAGE] * PAGE + e % PAGE


@pytest.mark.parametrize("kinds, ratios, topk", [
    ((CSA, HCA, SLIDING), (4, 8, 0), TOPK),  # the CSA indexer picks: 12 entries per table, top-4
    ((CSA, HCA), (4, 8), 12),  # no more entries than it picks: CSA attends to every complete one
    ((CSA, HCA), (4, 4), TOPK),  # one ratio for both kinds: the plan serves both
])
def test_plan_fields_match_their_definitions(kinds, ratios, topk):
    paged = sorted({r for r in ratios if r})
    by_ratio = {r: {k for k, q in zip(kinds, ratios, strict=True) if q == r} for r in paged}
    step = _step(paged)
    plan = DecodePlan.build(step, WINDOW, PAGE, dict.fromkeys(paged, BASE), topk,
                            {r: RatioKinds(CSA in k, CSA in k, HCA in k) for r, k in by_ratio.items()})
    for b, (p, s) in enumerate(zip(POSITIONS, SLOTS, strict=True)):
        assert plan.ring_rows[b] == s * WINDOW + p % WINDOW and plan.seq_ids[b] == b
        window = [s * WINDOW + k % WINDOW if k >= 0 else -1 for k in range(p - WINDOW + 1, p + 1)]
        assert plan.window_cols[b].tolist() == window
        for r in paged:
            ratio, table, complete = plan.ratios[r], step.page_tables[r][b].tolist(), (p + 1) // r
            closing, entries = (p + 1) % r == 0, [BASE + _row(table, e) for e in range(3 * PAGE)]
            assert ratio.pending_rows[b] == s * r + p % r and bool(ratio.closing[b]) == closing
            assert ratio.entry_rows[b].tolist() == [_row(table, e) for e in range(3 * PAGE)]
            assert ratio.entry_write[b] == (_row(table, complete - 1) if closing else 0)
            if closing:
                assert ratio.entry_positions[b] == (complete - 1) * r
            layer_kinds = {k for k, q in zip(kinds, ratios, strict=True) if q == r}
            csa, attends_all = CSA in layer_kinds, HCA in layer_kinds
            assert (ratio.has_previous is not None) == csa and (ratio.overlap_slots is not None) == csa
            if csa:
                assert bool(ratio.has_previous[b]) == (p >= r) and ratio.overlap_slots[b] == (s if closing else 0)
            assert (ratio.picks is not None) == (csa and 3 * PAGE > topk)
            if ratio.picks is not None:
                assert ratio.picks.limits[b] == complete and bool(ratio.picks.takes_all[b, 0]) == (complete <= topk)
                assert ratio.picks.ids[b].tolist() == [e if e < complete else -1 for e in range(topk)]
                assert ratio.pick_cols[b].tolist() == entries + [-1]  # a pick of -1 reads -1
            assert (ratio.causal_cols is not None) == (attends_all or ratio.picks is None)
            if ratio.causal_cols is not None:
                masked = [c if e < complete else -1 for e, c in enumerate(entries)]
                assert ratio.causal_cols[b].tolist() == window + masked
