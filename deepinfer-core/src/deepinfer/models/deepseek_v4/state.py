"""V4's sequence state: what a chunk of new tokens needs from the tokens before it, as pool buffers.

Per layer (see :mod:`deepinfer.kv.pool` for slots and pages):

- the SWA ring of the last ``sliding_window`` K=V latents (row ``slot * window + position % window``), followed
  in the same tensor by the compressed entries' pages of CSA / HCA layers (entry ``e`` at page
  ``pages[e // page_size]``, row ``e % page_size``), so sparse attention gathers from one tensor;
- for CSA / HCA layers, the compressor's carry-over in the slot (projections of the unfinished window's tokens
  at ``position % ratio``, and for CSA series a of the last closed window);
- for CSA layers, the same for the lightning indexer's compressor, whose entries (the indexer keys) get pages too.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kv.pool import PooledState, StatePool
from deepinfer.kv.spec import PAGE_SIZE, Buffer, KVBuffer, PageBuffer, SlotBuffer, StateSpec
from deepinfer.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config

#: A V4 sequence's state is a pooled state: its slot, its pages and its token count.
DeepseekV4State = PooledState


def state_spec(window: int, head_dim: int, index_head_dim: int, kinds: tuple[str, ...], ratios: tuple[int, ...],
               page_size: int = PAGE_SIZE) -> StateSpec:
    """The buffers of every layer (``ratios``: 0 for sliding layers)."""
    buffers: list[Buffer] = []
    for i, (kind, ratio) in enumerate(zip(kinds, ratios, strict=True)):
        p = f"layers.{i}."
        buffers.append(KVBuffer(p + "kv", 1, ratio, head_dim))
        if ratio:
            buffers += _compressor(p + "compressor.", ratio, head_dim, kind == CSA)
        if kind == CSA:
            buffers += _compressor(p + "indexer.", ratio, index_head_dim, True)
            buffers.append(PageBuffer(p + "index_keys", ratio, index_head_dim))
    return StateSpec(window, tuple(buffers), page_size)


def _compressor(p: str, ratio: int, dim: int, overlap: bool) -> list[Buffer]:
    width = 2 * dim if overlap else dim
    pending = SlotBuffer(p + "pending", (ratio, 2 * width))  # kv | gate of the unfinished window
    return [pending, SlotBuffer(p + "overlap", (ratio, 2 * dim))] if overlap else [pending]


def spec_for(cfg: DeepseekV4Config) -> StateSpec:
    ratios = tuple(0 if k == SLIDING else r for k, r in zip(cfg.layer_types, cfg.compress_ratios, strict=True))
    return state_spec(cfg.sliding_window, cfg.head_dim, cfg.index_head_dim, tuple(cfg.layer_types), ratios)


class CompressorCache:
    """One compressor's carry-over for every slot: ``pending`` [slots, ratio, 2 * width] holds the unfinished
    window's projections (kv, then gate, side by side: one write and one read per step); ``overlap``
    [slots, ratio, 2 * dim] series a of the last closed window's kv and gate (CSA only)."""

    __slots__ = ("pending", "overlap")

    def __init__(self, pending: torch.Tensor, overlap: torch.Tensor | None):
        self.pending, self.overlap = pending, overlap


class LayerCache:
    """One layer's buffers in the pool: ``kv`` (SWA rings, then entry pages), its compressors' carry-over and
    the CSA indexer keys' pages."""

    __slots__ = ("ratio", "kv", "compressor", "index_keys", "indexer")

    def __init__(self, pool: StatePool, layer: int):
        t, p = pool.tensors, f"layers.{layer}."
        self.kv = t[p + "kv"]
        self.ratio = next(b.ratio for b in pool.spec.buffers if b.name == p + "kv")  # type: ignore[union-attr]
        self.compressor = self._cache(t, p + "compressor.")
        self.indexer = self._cache(t, p + "indexer.")
        self.index_keys = t.get(p + "index_keys")

    @staticmethod
    def _cache(t: dict[str, torch.Tensor], p: str) -> CompressorCache | None:
        pending = t.get(p + "pending")
        return None if pending is None else CompressorCache(pending, t.get(p + "overlap"))


def layer_caches(pool: StatePool) -> list[LayerCache]:
    """Every layer's :class:`LayerCache` (the pool's ``views``)."""
    return [LayerCache(pool, i) for i in range(len(pool.spec.of(KVBuffer)))]


@dataclass(slots=True)
class LayerView:
    """One layer of one sequence's state as tensors (copies, in position order): for tests and debugging."""

    swa_ring: torch.Tensor  # [ring, head_dim] rows by position % ring (StateSpec.ring)
    entries: torch.Tensor | None  # [num_entries, head_dim]
    pending_kv: torch.Tensor | None  # [num_tokens % ratio, width]
    index_keys: torch.Tensor | None  # [num_entries, index_head_dim] (CSA)


def layer_view(state: PooledState, index: int) -> LayerView:
    pool = state.pool
    layer: LayerCache = pool.views[index]
    if state.slot is None:
        raise ValueError("this state holds no tokens yet")
    ring = layer.kv[pool.ring_rows(state.slot)].clone()
    entries = pending = keys = None
    if layer.ratio and layer.compressor is not None:
        count = state.num_tokens // layer.ratio
        rows = pool.page_rows(state, layer.ratio)[:count]
        entries = layer.kv[pool.entry_base(layer.ratio) + rows].clone()
        width = layer.compressor.pending.shape[-1] // 2
        pending = layer.compressor.pending[state.slot, : state.num_tokens % layer.ratio, :width].clone()
        if layer.index_keys is not None:
            keys = layer.index_keys[rows].clone()
    return LayerView(ring, entries, pending, keys)
