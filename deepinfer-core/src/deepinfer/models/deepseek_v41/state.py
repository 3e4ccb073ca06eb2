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

With ``quantized`` (``DEEPINFER_QUANTIZED_KV``) the rows are stored in the formats the model fake-quantizes them
to (:data:`WINDOW`, :data:`LATENT`, :data:`INDEX_KEY`; a group's rings and entries then live in two tensors),
where the width fits the format; the logits do not change (:mod:`deepinfer.kv.store`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.kv.pool import StatePool
from deepinfer.kv.spec import PAGE_SIZE, Buffer, KVBuffer, PageBuffer, RowFormat, SlotBuffer, StateSpec, entries_name
from deepinfer.kv.store import KVStore, RowStore
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.indexer import KEY_FORMAT
from deepinfer.ops import Ops

HISTORY = "engram.history"
#: The model's formats (its QAT fake-quantization): every layer's SWA K=V, the compressed latents (entries),
#: the indexer keys.
WINDOW = RowFormat("fp8_e4m3", 32, "ue8m0")
LATENT = RowFormat("fp4_e2m1", 16, "e4m3")
INDEX_KEY = RowFormat("fp4_e2m1", *KEY_FORMAT)  # the queries use it too


def _stored(fmt: RowFormat, width: int, quantized: bool) -> RowFormat | None:
    return fmt if quantized and fmt.fits(width) else None


def groups(cfg: DeepseekV41Config) -> dict[int, list[int]]:
    """Each kv source's members (itself first), in layer order."""
    out: dict[int, list[int]] = {}
    for role in cfg.layers:
        if role.kv_source is not None:
            out.setdefault(role.kv_source, []).append(role.layer_id)
    return out


def state_spec(cfg: DeepseekV41Config, page_size: int = PAGE_SIZE, quantized: bool = False) -> StateSpec:
    members = groups(cfg)
    ring, entry = _stored(WINDOW, cfg.head_dim, quantized), _stored(LATENT, cfg.head_dim, quantized)
    key = _stored(INDEX_KEY, cfg.index_head_dim, quantized)
    rings: dict[int, int] = {}
    for source, layers in members.items():
        ratio = cfg.layers[source].ratio
        rings[ratio] = max(rings.get(ratio, 0), len(layers))
    buffers: list[Buffer] = [KVBuffer(f"layers.{r.layer_id}.kv", 1, 0, cfg.head_dim, ring_format=ring)
                             for r in cfg.layers if not r.ratio]
    for source in members:
        ratio, p = cfg.layers[source].ratio, f"groups.{source}."
        buffers.append(KVBuffer(p + "kv", rings[ratio], ratio, cfg.head_dim, ring_format=ring, entry_format=entry))
        buffers.append(PageBuffer(p + "index_keys", ratio, cfg.index_head_dim, format=key))
        if ratio > 1:
            buffers.append(SlotBuffer(p + "pending", (ratio, 2 * cfg.head_dim), torch.float32))
    if cfg.engram_layer_ids:
        buffers.append(SlotBuffer(HISTORY, (cfg.engram_max_ngram_size - 1,), torch.int64))
    # a DSpark verify step feeds the anchor and up to a block of drafts per sequence at once (verify_step.py)
    spare = cfg.dspark_block_size if cfg.num_nextn_predict_layers else 0
    return StateSpec(cfg.sliding_window, tuple(buffers), page_size, spare)


@dataclass(slots=True)
class LayerCache:
    """Where one layer's attention reads and writes: ``kv`` (its ring at ``ring_base``; the group's entries
    after the rings), the group's indexer keys and compressor carry-over (None where the layer has none)."""

    kv: torch.Tensor
    ring_base: int
    index_keys: torch.Tensor | None
    pending: torch.Tensor | None
    #: ``kv`` (and its entries' tensor when stored apart) as values, and the indexer keys likewise
    kv_rows: KVStore
    key_rows: RowStore | None


@dataclass(slots=True)
class Views:
    layers: list[LayerCache]
    history: torch.Tensor | None  # [slots, max_ngram - 1] int64


def views_for(cfg: DeepseekV41Config, ops: Ops):
    members = groups(cfg)

    def views(pool: StatePool) -> Views:
        t, caches = pool.tensors, []
        specs = {b.name: b for b in pool.spec.buffers}
        stores = {name: _kv_store(ops, pool, b) for name, b in specs.items() if isinstance(b, KVBuffer)}
        for role in cfg.layers:
            if role.kv_source is None:
                name = f"layers.{role.layer_id}.kv"
                caches.append(LayerCache(t[name], 0, None, None, stores[name], None))
                continue
            p = f"groups.{role.kv_source}."
            member = members[role.kv_source].index(role.layer_id)
            keys = specs[p + "index_keys"]
            assert isinstance(keys, PageBuffer)
            key_rows = RowStore(ops, t[p + "index_keys"], INDEX_KEY, keys.format is not None, pool.dtype)
            caches.append(LayerCache(t[p + "kv"], pool.ring_base(member), t[p + "index_keys"], t.get(p + "pending"),
                                     stores[p + "kv"], key_rows))
        return Views(caches, t.get(HISTORY))

    return views


def _kv_store(ops: Ops, pool: StatePool, b: KVBuffer) -> KVStore:
    t = pool.tensors[b.name]
    rings = RowStore(ops, t, WINDOW, b.ring_format is not None, pool.dtype)
    base = pool.entry_base(b.ratio) if b.ratio else t.shape[0]
    entry_tensor = pool.tensors[entries_name(b.name)] if b.split else t[base:]
    entries = RowStore(ops, entry_tensor, LATENT, b.entry_format is not None, pool.dtype)
    return KVStore(rings, entries, base, joint=not b.split)
