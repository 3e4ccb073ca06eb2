"""V4.1's layer schedule: which layer compresses, indexes or reuses, derived from config.json as transformers does.

A backbone layer's ``compress_ratios`` entry is 0 (sliding window only), 1 (one compressed entry per token: the
decoder half) or r > 1 (one entry per r tokens: the encoder half).  Compressed entries are produced only by
*kv sources*; every later layer with a ratio reads the entries of the nearest kv source at or before it (its
group).  Index sources score the group's entries with their own indexer and publish a top-k; the others reuse
the latest published one.  So each layer with a ratio has one of three roles:

- ``FULL``: kv source and index source (owns the compressor and the indexer keys ``indexer.wk`` / ``k_norm``);
- ``REINDEX``: index source that is not a kv source (own ``indexer.wq_b`` / ``weights_proj`` against the
  group's keys);
- ``REUSE``: neither; attends with the top-k of the latest index source before it.

The candidate source (an index source) also publishes a pool of candidate blocks; index sources after it
restrict their top-k to that pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

from deepinfer.models.config_fields import ConfigError

Mode = Literal["swa", "full", "reindex", "reuse"]
SWA: Final = "swa"
FULL: Final = "full"
REINDEX: Final = "reindex"
REUSE: Final = "reuse"

#: transformers' schedule of the released 40-layer model, used when config.json names none.
DEFAULT_COMPRESS_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20
DEFAULT_KV_SOURCES = (2, 8, 14, 20)
DEFAULT_INDEX_SOURCES = (2, 8, 14, 20, 24, 28, 32, 36)


@dataclass(slots=True, frozen=True)
class LayerRole:
    """What backbone layer ``layer_id`` does (plain data, from :func:`derive_schedule`)."""

    layer_id: int
    ratio: int  # compress ratio: 0 sliding window only, 1 an entry per token, r > 1 an entry per r tokens
    mode: Mode
    #: The kv source whose compressed entries (and indexer keys) this layer reads: the largest at or before it
    #: (itself for FULL); None for SWA.
    kv_source: int | None
    #: The index source whose top-k this layer attends with: itself (FULL, REINDEX), the latest one before it
    #: (REUSE); None for SWA.
    index_source: int | None
    is_candidate_source: bool  # publishes the candidate pool (its own top-k is unrestricted)
    uses_candidates: bool  # its top-k (for REUSE: its index source's) is restricted to the candidate pool
    engram: bool  # an Engram module writes into the streams at the start of this layer

    @property
    def rope(self) -> Literal["main", "compress"]:
        """The RoPE family of the layer's own q and sliding-window kv: ``compress`` for every layer with a ratio."""
        return "main" if self.ratio == 0 else "compress"

    @property
    def is_kv_source(self) -> bool:
        """Owns a compressor (and, being FULL, ``indexer.wk`` / ``k_norm``)."""
        return self.mode == FULL

    @property
    def is_index_source(self) -> bool:
        return self.mode in (FULL, REINDEX)


@dataclass(slots=True, frozen=True)
class Schedule:
    """The derived schedule: transformers' ``__post_init__`` values and the per-layer roles."""

    compress_ratios: tuple[int, ...]  # num_hidden_layers + num_nextn_predict_layers entries (draft layers: 0)
    kv_source_layer_ids: tuple[int, ...]
    index_source_layer_ids: tuple[int, ...]
    candidate_source_layer_id: int  # -1: no candidate pool
    dspark_target_layer_ids: tuple[int, ...]
    layers: tuple[LayerRole, ...]  # one per backbone layer


def _normalised_ratios(ratios: list[int] | None, n: int, n_nextn: int) -> list[int]:
    if ratios is None:
        if n == len(DEFAULT_COMPRESS_RATIOS):
            ratios = list(DEFAULT_COMPRESS_RATIOS)
        else:  # the released shape scaled to n layers: 2 sliding-only, an r=2 half, an r=1 half
            n_slide = min(2, n)
            n_enc = max(0, (n - n_slide + 1) // 2)
            ratios = [0] * n_slide + [2] * n_enc + [1] * max(0, n - n_slide - n_enc)
    ratios = list(ratios)
    if len(ratios) < n or len(ratios) > n + n_nextn:
        raise ConfigError(f"compress_ratios has {len(ratios)} entries; it needs num_hidden_layers ({n}) to "
                            f"num_hidden_layers + num_nextn_predict_layers ({n + n_nextn})")
    if any(r < 0 for r in ratios):
        raise ConfigError(f"compress_ratios must be >= 0, got {ratios}")
    return ratios[:n] + ratios[n : n + n_nextn] + [0] * (n_nextn - max(0, len(ratios) - n))


def derive_schedule(
    num_hidden_layers: int,
    num_nextn_predict_layers: int,
    compress_ratios: list[int] | None,
    kv_source_layer_ids: list[int] | None,
    index_source_layer_ids: list[int] | None,
    candidate_source_layer_id: int | None,
    dspark_target_layer_ids: list[int] | None,
    engram_layer_ids: tuple[int, ...] = (),
) -> Schedule:
    """transformers' derivations (None fields get its defaults, in its order), its checks, and two more that
    it lacks but that every real config meets and the per-group semantics need: every kv source is an index
    source (its group's indexer keys exist), and a layer's ratio equals its kv source's."""
    n = num_hidden_layers
    ratios = _normalised_ratios(compress_ratios, n, num_nextn_predict_layers)
    backbone = ratios[:n]
    kv = kv_source_layer_ids
    if kv is None:
        kv = list(DEFAULT_KV_SOURCES) if backbone == list(DEFAULT_COMPRESS_RATIOS[:n]) else [
            i for i in range(n) if backbone[i] > 0 and (i == 0 or backbone[i - 1] != backbone[i])]
    index = index_source_layer_ids
    if index is None:
        index = list(DEFAULT_INDEX_SOURCES) if kv == list(DEFAULT_KV_SOURCES) else list(kv)
    targets = dspark_target_layer_ids
    if targets is None:
        targets = sorted([i for i in range(n) if i not in kv][-3:])
    candidate = kv[-1] if candidate_source_layer_id is None and kv else candidate_source_layer_id
    candidate = -1 if candidate is None else candidate
    _check(n, backbone, kv, index, candidate, targets)
    layers = tuple(_role(i, backbone, kv, index, candidate, set(engram_layer_ids)) for i in range(n))
    return Schedule(tuple(ratios), tuple(kv), tuple(index), candidate, tuple(targets), layers)


def _check(n: int, ratios: list[int], kv: list[int], index: list[int], candidate: int, targets: list[int]) -> None:
    for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index),
                      ("dspark_target_layer_ids", targets)):
        if any(i < 0 or i >= n for i in ids) or len(set(ids)) != len(ids):
            raise ConfigError(f"{name} must be distinct layer ids in [0, {n}), got {ids}")
    for name, ids in (("kv_source_layer_ids", kv), ("index_source_layer_ids", index)):
        if any(ratios[i] == 0 for i in ids):
            raise ConfigError(f"{name} {ids} must all have compress_ratios > 0 (ratios {ratios})")
    if any(i not in kv and not any(s < i for s in kv) for i in index):
        raise ConfigError(f"index_source_layer_ids {index}: each needs a kv_source_layer_ids entry {kv} at or "
                            "before it to publish the indexer keys")
    if candidate >= 0 and candidate not in index:
        raise ConfigError(f"candidate_source_layer_id {candidate} must be one of index_source_layer_ids {index}")
    if any(ratios[i] > 0 and not any(s <= i for s in kv) for i in range(n)):
        raise ConfigError(f"every layer with compress_ratios > 0 needs a kv_source_layer_ids entry {kv} at or "
                            f"before it (ratios {ratios})")
    missing = [s for s in kv if s not in index]
    if missing:
        raise ConfigError(f"kv_source_layer_ids {missing} are not in index_source_layer_ids {index}: a kv "
                            "source publishes its group's indexer keys, so it must index too")
    for i in range(n):
        source = max((s for s in kv if s <= i), default=None)
        if ratios[i] > 0 and source is not None and ratios[i] != ratios[source]:
            raise ConfigError(f"compress_ratios[{i}] = {ratios[i]} differs from its kv source layer {source}'s "
                                f"{ratios[source]}: a group shares one compressed list")


def _role(i: int, ratios: list[int], kv: list[int], index: list[int], candidate: int, engram: set[int]) -> LayerRole:
    if ratios[i] == 0:
        return LayerRole(i, 0, SWA, None, None, False, False, i in engram)
    source = max(s for s in kv if s <= i)
    if i in index:
        mode: Mode = FULL if i in kv else REINDEX
        indexer = i
    else:  # the latest index source before it, in its own group (its kv source is one)
        mode, indexer = REUSE, max(s for s in index if s < i)
    uses = 0 <= candidate < indexer
    return LayerRole(i, ratios[i], mode, source, indexer, i == candidate, uses, i in engram)
