"""The prefill plan's index tensors point every query at the right keys: window history from the rings, new
latents of the step, and each sequence's compressed entries, for fresh, continued and short chunks."""

import dataclasses

import torch

from deepinfer.kv.layout import RaggedLayout
from deepinfer.kv.ragged_plan import prefill_plan

WINDOW, RATIO, PAGE = 8, 4, 4
STARTS, LENS, SLOTS = [0, 5, 30, 13], [7, 11, 2, 1], [1, 2, 3, 4]
BASE = 5 * WINDOW  # entry page 0's row in the kv tensor: after the rings of 5 slots


def _tag(seq: int, pos: int) -> float:
    return seq * 1000.0 + pos


def _setup():
    layout = RaggedLayout.build(LENS, STARTS, lambda t: t)
    positions = torch.cat([torch.arange(s, s + n) for s, n in zip(STARTS, LENS, strict=True)])
    pages = [[2 * i + 1, 2 * i + 2, 9 + i] for i in range(len(LENS))]  # 3 pages of 4 entries per sequence
    table = torch.tensor(pages)
    layout.entry_rows = {RATIO: (table[:, :, None] * PAGE + torch.arange(PAGE)).flatten(1)}
    kv = torch.full((BASE + 16 * PAGE, 1), -7.0)
    # the rings hold each sequence's last WINDOW latents
    for i, (start, slot) in enumerate(zip(STARTS, SLOTS, strict=True)):
        for p in range(max(0, start - WINDOW), start):
            kv[slot * WINDOW + p % WINDOW] = _tag(i, p)
        for e in range((start + LENS[i]) // RATIO):  # entries tagged by id (as the compressor wrote them)
            kv[BASE + layout.entry_rows[RATIO][i, e]] = _tag(i, 500 + e)
    chunks = enumerate(zip(STARTS, LENS, strict=True))
    new = torch.tensor([_tag(i, p) for i, (s, n) in chunks for p in range(s, s + n)])[:, None]
    return layout, positions, kv, new


def test_window_columns_read_each_querys_window():
    layout, positions, kv, new = _setup()
    plan = prefill_plan(layout, SLOTS, positions, WINDOW, 0, BASE, lambda t: t)
    keys = torch.cat([kv[plan.gather_rows], new])[:, 0]
    seq = layout.seq_ids
    for t in range(positions.shape[0]):
        for j, col in enumerate(plan.window_cols[t].tolist()):
            key = int(positions[t]) - WINDOW + 1 + j
            assert (col == -1) == (key < 0)
            if key >= 0:
                assert keys[col] == _tag(int(seq[t]), key), (t, j)
    assert plan.entry_offsets is None and plan.causal_cols is None


def test_entry_columns_and_ring_update():
    layout, positions, kv, new = _setup()
    plan = prefill_plan(layout, SLOTS, positions, WINDOW, RATIO, BASE, lambda t: t)
    keys = torch.cat([kv[plan.gather_rows], new])[:, 0]
    seq = layout.seq_ids
    for t in range(positions.shape[0]):
        complete = (int(positions[t]) + 1) // RATIO
        assert torch.equal(plan.causal_cols[t, :WINDOW], plan.window_cols[t])
        cols = plan.causal_cols[t, WINDOW:].tolist()
        assert [c for c in cols if c >= 0] == cols[:complete] and all(c == -1 for c in cols[complete:])
        assert [keys[c].item() for c in cols[:complete]] == [_tag(int(seq[t]), 500 + e) for e in range(complete)]
        assert keys[int(plan.entry_offsets[t]) + 0].item() == _tag(int(seq[t]), 500) or complete == 0
    kv.index_copy_(0, plan.ring_rows, new[plan.ring_src])
    for i, (start, n, slot) in enumerate(zip(STARTS, LENS, SLOTS, strict=True)):
        end = start + n
        for p in range(max(0, end - WINDOW), end):
            assert kv[slot * WINDOW + p % WINDOW, 0] == _tag(i, p)


def test_step_tables_are_built_once_when_first_asked():
    from deepinfer.kv.layout import BuiltOnUse

    built = []
    tables = BuiltOnUse(lambda r: built.append(r) or torch.full((2,), r))
    assert built == []  # nothing up front: the first layers' kernels are queued before later ratios' tables
    assert torch.equal(tables[4], torch.full((2,), 4)) and tables[4] is tables[4]
    tables[128]
    assert built == [4, 128]


def test_closed_windows_are_where_each_compressor_writes():
    """The windows a step closes, per sequence in batch order: first positions, page rows (also as kv rows), and
    whether a predecessor exists (a sequence's first window has none)."""
    layout, positions, _, _ = _setup()
    plan = prefill_plan(layout, SLOTS, positions, WINDOW, RATIO, BASE, lambda t: t)
    want_pos, want_rows = [], []
    for i, (start, n) in enumerate(zip(STARTS, LENS, strict=True)):
        for w in range(start // RATIO, (start + n) // RATIO):  # the windows this chunk completes
            want_pos.append(w * RATIO)
            want_rows.append(int(layout.entry_rows[RATIO][i, w]))
    assert plan.closed_positions.tolist() == want_pos and len(want_pos) > 3
    assert plan.closed_rows.tolist() == want_rows
    assert plan.closed_kv_rows.tolist() == [BASE + r for r in want_rows]
    assert plan.closed_has_previous.tolist() == [p >= RATIO for p in want_pos]  # sequence 0 closes its window 0
    none_first = RaggedLayout.build([3], [5], lambda t: t)
    none_first.entry_rows = layout.entry_rows
    continued = prefill_plan(none_first, [1], torch.arange(5, 8), WINDOW, RATIO, BASE, lambda t: t)
    assert continued.closed_positions.tolist() == [4] and continued.closed_has_previous is None
    sliding = prefill_plan(layout, SLOTS, positions, WINDOW, 0, BASE, lambda t: t)
    assert sliding.closed_positions is None and sliding.closed_rows is None


def test_uploaded_tables_start_16_byte_aligned():
    """Every table the plan uploads starts on a 16-byte boundary (the CUDA kernel set is compiled for aligned
    pointers; a misaligned view would fall back to Triton's JIT): odd part lengths are padded in the upload."""
    layout, positions, _, _ = _setup()
    uploads = []
    plan = prefill_plan(layout, SLOTS, positions, WINDOW, RATIO, BASE, lambda t: uploads.append(t) or t)
    assert len(uploads) == 1  # still one host-to-device copy
    tables = [plan.closed_positions, plan.closed_rows, plan.ring_rows, plan.ring_src,
              *(getattr(plan.assembly, f.name) for f in dataclasses.fields(plan.assembly))]
    assert any(t.numel() % 2 for t in tables)  # the case has odd lengths to pad
    base = uploads[0].data_ptr()
    for t in tables:
        if t.numel() and t.untyped_storage().data_ptr() == base:
            assert (t.data_ptr() - base) % 16 == 0
