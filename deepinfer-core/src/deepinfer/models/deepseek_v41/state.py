"""V4.1's sequence state as pool buffers: private SWA rings, group-owned compressed KV and indexer keys.

- Every layer keeps its own SWA ring of K=V latents (FP8 fake-quantized values, as the model attends them).
- A **group** is a kv source and the layers after it that read its entries (CSA2: Full, Reindex, Reuse).
  The group owns one KV buffer: the rings of all its members (member ``m`` at ring ``m``), then the pages of
  its compressed entries, so every member's sparse attention reads its own window and the group's entries
  through one tensor, and the entries exist once, not once per layer.  Groups of one ratio have the same
  number of rings (the largest group's), so their entries start at one row (the plans are per ratio).
- The group also owns its indexer keys' pages and, at ratio > 1, the compressor's unfinished window (fp32
  ``kv | gate`` projections, as the reference pools them).
- Engram keeps the compressed ids of each sequence's last ``max_ngram - 1`` tokens.
Sliding-only layers (ratio 0) have a one-ring KV buffer of their own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kv.pool import StatePool
from deepinfer.kv.spec import PAGE_SIZE, Buffer, KVBuffer, PageBuffer, SlotBuffer, StateSpec
from deepinfer.models.deepseek_v41.config import DeepseekV41Config

HISTORY = "engram.history"


def groups(cfg: DeepseekV41Config) -> dict[int, list[int]]:
    """Each kv source's members (itself first), in layer order."""
    out: dict[int, list[int]] = {}
    for role in cfg.layers:
        if role.kv_source is not None:
            out.setdefault(role.kv_source, []).append(role.layer_id)
    return out


def state_spec(cfg: DeepseekV41Config, page_size: int = PAGE_SIZE) -> StateSpec:
    members = groups(cfg)
    rings: dict[int, int] = {}
    for source, layers in members.items():
        ratio = cfg.layers[source].ratio
        rings[ratio] = max(rings.get(ratio, 0), len(layers))
    buffers: list[Buffer] = [KVBuffer(f"layers.{r.layer_id}.kv", 1, 0, cfg.head_dim) for r in cfg.layers if not r.ratio]
    for source in members:
        ratio, p = cfg.layers[source].ratio, f"groups.{source}."
        buffers.append(KVBuffer(p + "kv", rings[ratio], ratio, cfg.head_dim))
        buffers.append(PageBuffer(p + "index_keys", ratio, cfg.index_head_dim))
        if ratio > 1:
            buffers.append(SlotBuffer(p + "pending", (ratio, 2 * cfg.head_dim), torch.float32))
    if cfg.engram_layer_ids:
        buffers.append(SlotBuffer(HISTORY, (cfg.engram_max_ngram_size - 1,), torch.int64))
    return StateSpec(cfg.sliding_window, tuple(buffers), page_size)


@dataclass(slots=True)
class LayerCache:
    """Where one layer's attention reads and writes: ``kv`` (its ring at ``ring_base``; the group's entries
    after the rings), the group's indexer keys and compressor carry-over (None where the layer has none)."""

    kv: torch.Tensor
    ring_base: int
    index_keys: torch.Tensor | None
    pending: torch.Tensor | None


@dataclass(slots=True)
class Views:
    layers: list[LayerCache]
    history: torch.Tensor | None  # [slots, max_ngram - 1] int64


def views_for(cfg: DeepseekV41Config):
    members = groups(cfg)

    def views(pool: StatePool) -> Views:
        t, caches = pool.tensors, []
        for role in cfg.layers:
            if role.kv_source is None:
                caches.append(LayerCache(t[f"layers.{role.layer_id}.kv"], 0, None, None))
                continue
            p = f"groups.{role.kv_source}."
            member = members[role.kv_source].index(role.layer_id)
            caches.append(LayerCache(t[p + "kv"], pool.ring_base(member), t[p + "index_keys"], t.get(p + "pending")))
        return Views(caches, t.get(HISTORY))

    return views
