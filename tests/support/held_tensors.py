"""The tensors a built model holds: every storage reachable from the model object (attributes, containers,
DeepInfer objects, slotted dataclasses such as ``QuantizedTensor``), each counted once."""

from __future__ import annotations

import types

import torch


def held_storages(root: object) -> dict[int, int]:
    """``{storage data pointer: bytes}`` of every tensor reachable from ``root`` (a view counts as its storage)."""
    seen: set[int] = set()
    out: dict[int, int] = {}

    def visit(obj: object, depth: int) -> None:
        if isinstance(obj, torch.Tensor):
            storage = obj.untyped_storage()
            out[storage.data_ptr()] = storage.nbytes()
            return
        if depth > 16 or id(obj) in seen or isinstance(obj, (types.FunctionType, types.MethodType, type)):
            return
        seen.add(id(obj))
        if isinstance(obj, dict):
            for value in obj.values():
                visit(value, depth + 1)
        elif isinstance(obj, (list, tuple)):
            for value in obj:
                visit(value, depth + 1)
        elif type(obj).__module__.startswith("deepinfer."):
            slots = [s for c in type(obj).__mro__ for s in getattr(c, "__slots__", ())]
            for name in [*getattr(obj, "__dict__", {}), *slots]:
                if name != "ops" and hasattr(obj, name):
                    visit(getattr(obj, name), depth + 1)

    visit(root, 0)
    return out


def held_bytes(root: object) -> int:
    """Bytes of every distinct storage reachable from ``root``."""
    return sum(held_storages(root).values())
