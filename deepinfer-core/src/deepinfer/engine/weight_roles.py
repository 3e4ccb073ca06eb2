"""Checkpoint tensors by role, how the engine holds each, and what one rank holds of each role.

Roles are read off the released names (``layers.N.attn.wq_a.weight``, ``layers.N.ffn.experts.E.w1.scale``,
``mtp.I.*``, ...); a ``.scale`` belongs to its weight's role.  How a tensor is held is how the loader holds it:
with ``native`` weights every quantized tensor stays as stored (FP8 / MXFP4 and its scales: under expert
parallelism too, and the DSpark drafter too); with ``dequantize`` each becomes one dense tensor in the compute
dtype (no stored copy kept beside it); Engram tables stay FP8 either way; float tensors take the compute dtype
unless the model keeps them in fp32.  Names a text engine never reads (the vision tower, image-only biases)
are held by nobody.

One function per kind of placement gives a rank's (device, host) bytes of a role's tensors: whole on every
rank, routed experts by the rank's expert slots, Engram tables by the rows the rank keeps (in host or device
memory), the drafter only when speculative decoding is on.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from deepinfer.models.deepseek_v41.released_layout import DTYPE_BYTES, StoredTensor

EMBED_HEAD = "embedding, head"
ATTENTION = "attention"
DENSE_FFN = "shared experts, routers"
ROUTED = "routed experts"
NORMS = "norms, mHC, sinks"
ENGRAM_PROJ = "Engram projections"
ENGRAM_TABLES = "Engram tables"
DRAFTER = "DSpark drafter"
IGNORED = "not read (vision, image-only)"
#: Every role, in the plan's order.
ROLES = (EMBED_HEAD, ATTENTION, DENSE_FFN, ROUTED, NORMS, ENGRAM_PROJ, ENGRAM_TABLES, DRAFTER, IGNORED)

_IGNORED_PREFIXES = ("vision.", "aligner.", "image_")
_QUANTIZED_DTYPES = ("F8_E4M3", "I8", "U8")
_NORM_SUFFIXES = ("norm.weight", "attn_sink", ".ape")


def role_of(name: str) -> str:
    """The role of checkpoint tensor ``name`` (a ``.scale``: its weight's)."""
    if name.startswith(_IGNORED_PREFIXES) or name.endswith(".gate.bias_vl"):
        return IGNORED  # (a draft layer's image-token bias too)
    if name.startswith("mtp."):
        return DRAFTER
    if name in ("embed.weight", "head.weight", "embed_tokens.weight", "lm_head.weight"):
        return EMBED_HEAD
    if ".engram.embed." in name:
        return ENGRAM_TABLES
    if ".engram." in name:
        return ENGRAM_PROJ
    if ".ffn.experts." in name:
        return ROUTED
    if ".ffn." in name:
        return DENSE_FFN
    if "hc_" in name or name.endswith(_NORM_SUFFIXES):
        return NORMS
    return ATTENTION


@dataclass(slots=True, frozen=True)
class Holding:
    """How the engine holds weights: ``native`` (quantized ones as stored) or dequantized, in ``element_size``
    bytes, except the floats ``fp32(name)`` names."""

    native: bool
    element_size: int
    fp32: Callable[[str], bool]


@dataclass(slots=True, frozen=True)
class HeldTensor:
    """A checkpoint tensor, its role, whether it is a block scale, and the bytes one whole copy takes as held."""

    stored: StoredTensor
    role: str
    scale: bool
    held: int


def held_tensors(tensors: Sequence[StoredTensor], holding: Holding) -> list[HeldTensor]:
    """Every tensor of a checkpoint (from its headers) as the engine holds it."""
    by_name = {t.name: t for t in tensors}
    quantized = {t.name for t in tensors if t.dtype in _QUANTIZED_DTYPES
                 and t.name.removesuffix(".weight") + ".scale" in by_name}
    out = []
    for t in tensors:
        role = role_of(t.name)
        scale = t.name.endswith(".scale") and t.name.removesuffix(".scale") + ".weight" in quantized
        held = 0 if role == IGNORED else _held(t, role, scale, t.name in quantized, holding)
        out.append(HeldTensor(t, role, scale, held))
    return out


def _held(t: StoredTensor, role: str, scale: bool, quantized: bool, holding: Holding) -> int:
    as_stored = holding.native or role == ENGRAM_TABLES
    if scale or quantized:
        if as_stored:
            return t.nbytes
        return 0 if scale else _numel(t) * (2 if t.dtype in ("I8", "U8") else 1) * holding.element_size
    if t.name.endswith(".scale"):  # the unused scale of a float weight (a float Engram table)
        return 0
    if t.dtype not in ("F64", "F32", "BF16", "F16"):
        return _numel(t) * 8  # id tables (hash routing) are held as int64
    return _numel(t) * (4 if holding.fp32(t.name) else holding.element_size)


def _numel(t: StoredTensor) -> int:
    return t.nbytes // DTYPE_BYTES[t.dtype]


@dataclass(slots=True, frozen=True)
class RoleWeights:
    """A role's tensors summed as the placements need them: in all, by routed expert, by Engram table."""

    tensors: int
    stored: int
    held: int
    experts: dict[tuple[int, int], int]  # routed experts: held bytes by (layer, expert)
    tables: tuple[tuple[int, int], ...]  # Engram tables and their scales: (rows, held bytes)

    @classmethod
    def of(cls, tensors: Sequence[HeldTensor]) -> RoleWeights:
        experts: dict[tuple[int, int], int] = {}
        tables = []
        for t in tensors:
            parts = t.stored.name.split(".")
            if parts[0] == "layers" and parts[2:4] == ["ffn", "experts"]:
                key = (int(parts[1]), int(parts[4]))
                experts[key] = experts.get(key, 0) + t.held
            elif t.role == ENGRAM_TABLES:
                tables.append((t.stored.shape[0], t.held))
        return cls(len(tensors), sum(t.stored.nbytes for t in tensors), sum(t.held for t in tensors), experts,
                   tuple(tables))


# --- what one rank holds of a role: (device bytes, host bytes) ---------------------------------------------------
Split = tuple[int, int]


def whole(weights: RoleWeights) -> Split:
    """Every rank holds every tensor on its device."""
    return weights.held, 0


def routed_experts(weights: RoleWeights, local: Callable[[int], Sequence[int]]) -> Split:
    """``local(layer)``: the experts of this rank's slots in that layer (a replicated expert once per slot)."""
    layers = sorted({layer for layer, _ in weights.experts})
    return sum(weights.experts.get((layer, e), 0) for layer in layers for e in local(layer)), 0


def engram_tables(weights: RoleWeights, shards: int, shard: int, on_host: bool) -> Split:
    """Rows ``[shard * ceil(n / shards), (shard + 1) * ceil(n / shards))`` of each table and its scales (an
    expert-parallel rank's share; ``shards`` 1: the whole table), in host or device memory."""
    total = 0
    for rows, held in weights.tables:
        per = -(-rows // shards)
        total += held // rows * max(0, min(rows, (shard + 1) * per) - shard * per)
    return (0, total) if on_host else (total, 0)


def drafter(weights: RoleWeights, speculative: bool) -> Split:
    """The DSpark drafter, whole on every rank (its experts are not split), only when it drafts."""
    return whole(weights) if speculative else (0, 0)
