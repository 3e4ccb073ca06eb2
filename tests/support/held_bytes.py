"""What a built model holds: every tensor reachable from the model object (attributes, containers, DeepInfer
objects, slotted dataclasses such as ``QuantizedTensor``), each storage counted once, in all or by the memory
plan's roles.  Works on the meta device (nothing is allocated), so the real-dims V4.1 can be measured on a CPU.

Also a stand-in checkpoint that serves a list of headers as meta tensors, so the real loader
(``read_weights``) builds the real-dims model without any file."""

from __future__ import annotations

import types
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import torch

from deepinfer.engine import weight_roles as wr
from deepinfer.models.deepseek_v41.released_layout import StoredTensor

#: Tensors of the model that are not checkpoint weights (RoPE frequencies, hash constants, the token map, ...).
BUFFERS = "buffers"
#: The drafter's per-slot context rings.
DRAFTER_CONTEXT = "drafter context"
#: The configured state pool.
STATE_POOL = "state pool"
#: A tensor at a place no role, buffer or state lives: held beyond the plan (a second copy of a weight, say).
UNPLANNED = "unplanned"

_TORCH_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
                 "U8": torch.uint8, "BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
_ATTENTION_NORMS = {"kv_norm", "q_norm", "sinks", "norm", "k_norm"}
#: The attributes holding buffers: RoPE frequencies, Engram's hash constants and token map, the first collapse's
#: one-hot pre, the stacked shared expert's id and weight, an expert-parallel layer's replica table.
_BUFFER_NAMES = {"inv_freq", "hash", "token_map", "first_pre", "shared_slot", "replicas", "num_replicas"}
_SKIPPED = ("ops", "config", "parallel")  # (an expert-parallel context reaches the layers again)


class MetaCheckpoint:
    """``SafetensorsCheckpoint``'s reading surface over headers alone: ``get`` returns meta tensors."""

    def __init__(self, tensors: list[StoredTensor]):
        self.directory = Path("<meta>")
        self._tensors = {t.name: t for t in tensors}

    def names(self) -> list[str]:
        return list(self._tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._tensors[name].shape

    def dtype_name(self, name: str) -> str:
        return self._tensors[name].dtype

    def file_of(self, name: str) -> Path:
        return self.directory / "model.safetensors"

    def get(self, name: str, rows: slice | None = None) -> torch.Tensor:
        t = self._tensors[name]
        tensor = torch.empty(t.shape, dtype=_TORCH_DTYPES[t.dtype], device="meta")
        return tensor if rows is None else tensor[rows]


def storage_key(t: torch.Tensor) -> int:
    """Which storage ``t`` lives in: its data pointer; on the meta device (no data) the tensor it views."""
    if t.device.type == "meta":
        return id(t._base if t._base is not None else t)
    return t.untyped_storage().data_ptr()


def _storage_bytes(t: torch.Tensor) -> int:
    root = t._base if t.device.type == "meta" and t._base is not None else t
    return root.untyped_storage().nbytes() if root.device.type != "meta" else root.numel() * root.element_size()


def reachable(roots: dict[str, object]) -> Iterator[tuple[tuple[str, ...], torch.Tensor, int]]:
    """(the path first reaching it, a tensor, its storage's bytes) for every distinct storage reachable from
    ``roots`` (visited in order; a path starts with the root's name)."""
    objects: set[int] = set()
    storages: set[int] = set()

    def visit(obj: object, path: tuple[str, ...], depth: int) -> Iterator[tuple[tuple[str, ...], torch.Tensor, int]]:
        if isinstance(obj, torch.Tensor):
            key = storage_key(obj)
            if key not in storages:
                storages.add(key)
                yield path, obj, _storage_bytes(obj)
            return
        if depth > 16 or id(obj) in objects or isinstance(obj, (types.FunctionType, types.MethodType, type)):
            return
        objects.add(id(obj))
        if isinstance(obj, dict):
            for key, value in obj.items():
                yield from visit(value, (*path, str(key)), depth + 1)
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                yield from visit(value, (*path, str(i)), depth + 1)
        elif type(obj).__module__.startswith("deepinfer."):
            slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())]
            for name in [*getattr(obj, "__dict__", {}), *slots]:
                if name not in _SKIPPED and hasattr(obj, name):
                    yield from visit(getattr(obj, name), (*path, name), depth + 1)

    for name, root in roots.items():
        yield from visit(root, (name,), 0)


def held_storages(root: object) -> dict[int, int]:
    """``{storage key: bytes}`` of every tensor reachable from ``root`` (a view counts as its storage)."""
    return {storage_key(t): size for _, t, size in reachable({"root": root})}


def held_bytes(root: object) -> int:
    """Bytes of every distinct storage reachable from ``root``."""
    return sum(held_storages(root).values())


def role_of_path(path: tuple[str, ...]) -> str:
    """The plan's role of a tensor the model keeps at attribute ``path`` (a mapping's key is one element)."""
    head, last = path[0], path[-1]
    if _BUFFER_NAMES & set(path):
        return BUFFERS
    if head in ("embed", "head"):
        return wr.EMBED_HEAD
    if head == "norm":
        return wr.NORMS
    if head == "dspark":  # the DSpark drafter's layers and heads (the model's; the drafter adds its context)
        return wr.DRAFTER
    if head == "drafter":
        return DRAFTER_CONTEXT if path[1] == "context" else UNPLANNED
    if head == "pool":
        return STATE_POOL
    if head != "layers":
        return UNPLANNED
    part, rest = path[2], path[3:]
    if part in ("attn_hc", "ffn_hc", "attn_norm", "ffn_norm"):
        return wr.NORMS
    if part == "engram":
        if rest[:1] != ("weights",):
            return UNPLANNED
        return wr.ENGRAM_TABLES if rest[1] in ("table", "table_scale") else wr.ENGRAM_PROJ
    if part == "ffn":
        return wr.ROUTED if rest[0] in ("w13", "w2", "scales") else wr.DENSE_FFN
    return wr.NORMS if last in _ATTENTION_NORMS else wr.ATTENTION


def held_by_role(model: object, drafter: object | None = None) -> dict[str, int]:
    """Bytes of every distinct storage the model (and its DSpark drafter) hold, by :func:`role_of_path` of the
    first path reaching it; a shared expert stacked with the routed ones (``shared_id``: one more expert of the
    same grouped GEMMs) counts as a shared expert."""
    roots = {name: value for name, value in vars(model).items() if name not in _SKIPPED}
    if drafter is not None:
        roots["drafter"] = drafter
    out: dict[str, int] = defaultdict(int)
    for path, _, size in reachable(roots):
        out[role_of_path(path)] += size
    for layer in getattr(model, "layers", []):
        if getattr(layer.ffn, "shared_id", None) is not None:
            stacked = sum(w[layer.ffn.shared_id].numel() * w.element_size() for w in (layer.ffn.w13, layer.ffn.w2))
            out[wr.ROUTED] -= stacked
            out[wr.DENSE_FFN] += stacked
    return dict(out)
