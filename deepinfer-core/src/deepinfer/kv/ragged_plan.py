"""Where every layer of one kind finds its keys in a ragged (prefill / mixed) step, computed once per step.

A layer's attention pool for the step is ``cat([kv[gather_rows], new latents])``: first each sequence's window
history (the ring rows before its chunk), then, in compressed layers, each sequence's entries so far, then the
step's new latents in batch order.  Which rows those are, and which pool rows each query reads, depend only on
the step's layout and the layer's compression ratio — not on the layer — so all layers of a kind share one plan
and a layer runs a handful of kernels instead of a Python loop per sequence.  The plan's type lives with the
layout that carries it (:mod:`.layout`); this module builds it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from deepinfer.kv.layout import PrefillPlan, RaggedLayout, WindowAssembly


def prefill_plan(layout: RaggedLayout, slots: list[int], positions: torch.Tensor, window: int, ratio: int,
                 entry_base: int, upload: Callable[[torch.Tensor], torch.Tensor],
                 floors: list[int] | None = None, cached: list[int] | None = None, ring: int | None = None
                 ) -> PrefillPlan:
    """``slots``: each sequence's state slot; ``positions`` [T] on the device; ``entry_base``: the row of
    page 0 in every layer's kv tensor; ``floors``: each sequence's first position the plan's layers hold a
    window row for (V4.1's decoder runs only from there in a truncated prefill; None: 0), no key before it;
    ``cached``: each sequence's ``PooledState.cached_tokens`` (None: 0) -- the windows a replay closes that end
    at or before it are computed (their carry-over matters) but written to the null page, never over the
    prefix cache's shared entries; ``ring``: rows of a slot's ring (``StateSpec.ring``; None: ``window``).
    The host work is a few vectorised CPU ops and one upload."""
    starts, lens = torch.tensor(layout.starts), torch.tensor(layout.lens)
    offsets, slot = torch.tensor(layout.offsets), torch.tensor(slots)
    floor = torch.tensor(floors) if floors is not None else torch.zeros_like(starts)
    seqs = len(layout.lens)
    held = (starts - floor).clamp(0, window)  # history rows before each chunk
    ring = ring or window
    hist = slot.repeat_interleave(held) * ring + _ranges(starts - held, held) % ring
    keep = lens.clamp(max=window)  # the newest latents each ring takes
    ring_rows = slot.repeat_interleave(keep) * ring + _ranges(starts + lens - keep, keep) % ring
    ring_src = _ranges(offsets + lens - keep, keep)
    counts = (starts + lens) // ratio if ratio else torch.zeros_like(starts)  # entries so far
    # [seqs, entries] page rows of each sequence's entries (none for the sliding-only plan)
    entries = layout.entry_rows[ratio] if ratio else torch.zeros((seqs, 0), dtype=torch.int64)
    entry_idx = _ranges(torch.arange(seqs) * entries.shape[1], counts) if ratio else counts[:0]
    first = starts // ratio if ratio else counts  # the first window each chunk closes, and how many it closes
    closing = counts - first
    closed_ids = _ranges(first, closing)
    closed_idx = torch.arange(seqs).repeat_interleave(closing) * entries.shape[1] + closed_ids
    cached_ids = torch.tensor(cached) // max(ratio, 1) if cached is not None and any(cached) else None
    null = (closed_ids < cached_ids.repeat_interleave(closing)).long() if cached_ids is not None else None
    hist_off = torch.cumsum(held, 0) - held
    new_base = held.sum() + counts.sum()  # pool row of the step's first new latent
    # a history key at position kp sits at pool row hist_off + kp - (start - held); a new one at
    # new_base + offset + kp - start; a sequence's entry j at entry_off + j
    per_seq = torch.stack([starts, hist_off - (starts - held), new_base + offsets - starts,
                           held.sum() + torch.cumsum(counts, 0) - counts, floor], dim=1)
    assembly = _assembly(starts % max(ratio, 1), lens, offsets, slot, closing, ratio) if ratio else []
    publish = 1 - null if null is not None else torch.ones(0, dtype=torch.int64)
    parts = [per_seq.flatten(), hist, entry_idx, ring_rows, ring_src, closed_ids * ratio, closed_idx, publish,
             *assembly]
    per_seq, gather_rows, entry_idx, ring_rows, ring_src, closed_pos, closed_idx, publish, *assembly = \
        _aligned_upload(parts, upload)
    per_row = per_seq.view(seqs, 5)[layout.seq_ids]  # [T, 5]
    closed: dict[str, Any] = {}  # the closed windows' fields (compressed plans only)
    if ratio:
        gather_rows = torch.cat([gather_rows, entry_base + entries.flatten()[entry_idx]])
        closed_rows = entries.flatten()[closed_idx]
        if null is not None:  # a replay's windows over cached entries: to row 0 of the null page
            closed_rows = closed_rows * publish
        first_window = bool(((first == 0) & (closing > 0)).any())  # host tensors: no device sync
        closed = dict(closed_positions=closed_pos, closed_rows=closed_rows, closed_kv_rows=entry_base + closed_rows,
                      closed_has_previous=closed_pos >= ratio if first_window else None,
                      assembly=WindowAssembly(*assembly))

    key_pos = positions[:, None] + torch.arange(1 - window, 1, device=positions.device)[None, :]
    start, to_hist, to_new = per_row[:, 0:1], per_row[:, 1:2], per_row[:, 2:3]
    window_cols = torch.where(key_pos < start, to_hist + key_pos, to_new + key_pos)
    window_cols = torch.where(key_pos >= per_row[:, 4:5], window_cols, -1)
    entry_offsets = causal = None
    if ratio:
        entry_offsets = per_row[:, 3]
        ids = torch.arange(int(counts.max()), device=positions.device)[None, :]
        causal = torch.cat([window_cols, torch.where(ids < ((positions + 1) // ratio)[:, None],
                                                     entry_offsets[:, None] + ids, -1)], dim=1)
    return PrefillPlan(gather_rows, window_cols, entry_offsets, causal, ring_rows, ring_src, int(held.sum()), **closed)


def _assembly(held: torch.Tensor, lens: torch.Tensor, offsets: torch.Tensor, slot: torch.Tensor,
              closing: torch.Tensor, ratio: int) -> list[torch.Tensor]:
    """:class:`WindowAssembly`'s rows on the CPU, in field order.  Per sequence: ``held`` tokens wait in its
    carry-over, ``lens`` new ones start at proj row ``offsets``; its stream (held, then new) closes ``closing``
    windows; token ``e`` of the stream is carry-over row ``slot * ratio + e`` if ``e < held``, else proj row
    ``offset + e - held``."""
    seqs = torch.arange(len(lens))
    seq = seqs.repeat_interleave(closing * ratio)  # every window slot's sequence, and its stream index
    e = _ranges(torch.zeros_like(closing), closing * ratio)
    from_held = e < held[seq]
    slot_src = torch.where(from_held, 0, offsets[seq] + e - held[seq])
    held_dst = from_held.nonzero().flatten()
    held_src = slot[seq][held_dst] * ratio + e[held_dst]
    kept = (closing * ratio - held).clamp(min=0)  # new tokens before the leftover
    carry = seqs.repeat_interleave(lens - kept)
    t = _ranges(kept, lens - kept)
    carry_dst = slot[carry] * ratio + held[carry] + t - closing[carry] * ratio
    carry_src = offsets[carry] + t
    windows = int(closing.sum())
    ends = torch.cumsum(closing, 0)[closing > 0]
    first, last = ends - closing[closing > 0], ends - 1
    predecessor = (torch.arange(windows) - 1).clamp(min=0)
    return [slot_src, held_dst, held_src, carry_dst, carry_src, predecessor, first, last, slot[closing > 0]]


_PAD = torch.zeros(1, dtype=torch.int64)  # what an odd-length part is padded with


def _aligned_upload(parts: list[torch.Tensor], upload: Callable[[torch.Tensor], torch.Tensor]) -> list[torch.Tensor]:
    """int64 ``parts`` on the device through one upload, each view starting 16-byte aligned (odd parts padded to
    an even length): the CUDA kernel set is compiled for aligned pointers, so a misaligned view would run through
    Triton's JIT."""
    sizes = [p.numel() for p in parts]
    flat = upload(torch.cat([x for p in parts for x in ((p, _PAD) if p.numel() % 2 else (p,))]))
    return [view[:n] for view, n in zip(flat.split([n + n % 2 for n in sizes]), sizes, strict=True)]


def _ranges(first: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """``cat([arange(f, f + c) for f, c in zip(first, count)])`` on the CPU without a Python loop."""
    total = int(count.sum())
    return torch.arange(total) + (first - (torch.cumsum(count, 0) - count)).repeat_interleave(count, output_size=total)
