"""What a built V4.1 model holds, by the memory plan's roles: every tensor reachable from the model object, each
storage counted once (a view counts as its base), classified by where the model keeps it.  Works on the meta
device (nothing is allocated), so the real-dims model can be measured on a CPU.

Also a stand-in checkpoint that serves a list of headers as meta tensors, so the real loader
(``read_weights``) builds the real-dims model without any file."""

from __future__ import annotations

import types
from collections import defaultdict
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
#: Stored forms of dequantized weights that the model keeps beside their dense copies (``model.quantized``).
SECOND_COPIES = "second copies"

_TORCH_DTYPES = {"F8_E4M3": torch.float8_e4m3fn, "F8_E8M0": torch.float8_e8m0fnu, "I8": torch.int8,
                 "U8": torch.uint8, "BF16": torch.bfloat16, "F32": torch.float32, "F16": torch.float16}
_ATTENTION_NORMS = {"kv_norm", "q_norm", "sinks", "norm", "k_norm"}


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

    def get(self, name: str) -> torch.Tensor:
        t = self._tensors[name]
        return torch.empty(t.shape, dtype=_TORCH_DTYPES[t.dtype], device="meta")


def role_of_path(path: tuple[str, ...]) -> str:
    """The plan's role of a tensor the model keeps at attribute ``path`` (a mapping's key is one element)."""
    head = path[0]
    if head in ("embed", "head"):
        return wr.EMBED_HEAD
    if head == "norm":
        return wr.NORMS
    if head == "mtp_weights":
        return wr.role_of(path[1])  # keyed by the checkpoint name: the drafter's (image-only biases excepted)
    if head == "drafter":  # the DSpark drafter's own tensors (the target's embedding and head are the model's)
        if path[1] == "context":
            return DRAFTER_CONTEXT
        return BUFFERS if path[1] == "first_pre" or {"inv_freq", "shared_slot"} & set(path) else wr.DRAFTER
    if head == "quantized":
        return SECOND_COPIES
    if head == "pool":
        return STATE_POOL
    if head != "layers":
        return BUFFERS
    part, rest = path[2], path[3:]
    if part in ("attn_hc", "ffn_hc", "attn_norm", "ffn_norm"):
        return wr.NORMS
    if part == "engram":
        if rest[:1] != ("weights",):
            return BUFFERS
        return wr.ENGRAM_TABLES if rest[1] in ("table", "table_scale") else wr.ENGRAM_PROJ
    if part == "ffn":
        if rest[0] in ("w13", "w2", "scales"):
            return wr.ROUTED
        return BUFFERS if rest[0] == "shared_slot" else wr.DENSE_FFN
    if "inv_freq" in rest:
        return BUFFERS
    return wr.NORMS if rest[-1] in _ATTENTION_NORMS else wr.ATTENTION


def held_by_role(model: object, drafter: object | None = None) -> dict[str, int]:
    """Bytes of every distinct storage the model (and its DSpark drafter) hold, by :func:`role_of_path` of the
    first path reaching it."""
    seen: set[int] = set()
    out: dict[str, int] = defaultdict(int)

    def visit(obj: object, path: tuple[str, ...], depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            root = obj._base if obj._base is not None else obj
            if id(root) not in seen:
                seen.add(id(root))
                out[role_of_path(path)] += root.numel() * root.element_size()
            return
        if depth > 12 or isinstance(obj, (types.FunctionType, types.MethodType)):
            return
        if isinstance(obj, dict):
            for key, value in obj.items():
                visit(value, (*path, str(key)), depth + 1)
        elif isinstance(obj, (list, tuple)):
            for i, value in enumerate(obj):
                visit(value, (*path, str(i)), depth + 1)
        elif type(obj).__module__.startswith("deepinfer.") and id(obj) not in seen:
            seen.add(id(obj))
            slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())]
            names = list(getattr(obj, "__dict__", {})) + slots
            for name in names:
                if name not in ("ops", "config", "parallel") and hasattr(obj, name):
                    visit(getattr(obj, name), (*path, name), depth + 1)

    for name in sorted(vars(model), key=lambda n: n == "quantized"):  # last: what no layer holds is a second copy
        visit(getattr(model, name), (name,), 0)
    if drafter is not None:
        for name in vars(drafter):
            visit(getattr(drafter, name), ("drafter", name), 0)
    return dict(out)
