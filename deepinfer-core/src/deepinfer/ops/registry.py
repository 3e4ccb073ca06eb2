"""The op table: core's reference ops by name, and a backend's overrides on top of them.

An op is a pure function on tensors.  Core registers a plain-PyTorch reference for every op with
:func:`reference_op`; a backend's ``load_ops()`` returns replacements for any subset.  Models call ops
only through an :class:`OpTable`, so hardware differences never reach model code.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

#: Default (atol, rtol) per dtype for comparing an implementation against the reference.
DEFAULT_TOLERANCES: dict[torch.dtype, tuple[float, float]] = {
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


@dataclass(slots=True)
class OpSample:
    """One set of inputs for conformance checks: ``op(*args, **kwargs)``."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any] = field(default_factory=dict)
    label: str = ""


#: ``sample_inputs(dtype, generator) -> samples`` builds CPU tensors; the checker moves them.
SampleFn = Callable[[torch.dtype, torch.Generator], Iterable[OpSample]]


@dataclass(slots=True, frozen=True)
class OpDef:
    """A registered op: its reference implementation and how to check other implementations of it."""

    name: str
    reference: Callable[..., Any]
    sample_inputs: SampleFn | None
    dtypes: tuple[torch.dtype, ...]
    tolerances: Mapping[torch.dtype, tuple[float, float]]
    #: Optional ``compare(actual, expected, sample, dtype)`` that raises AssertionError on mismatch,
    #: for outputs with implementation-defined parts (e.g. order among tied top-k entries).
    compare: Callable[..., None] | None


_REGISTRY: dict[str, OpDef] = {}


def reference_op(
    name: str | None = None,
    *,
    sample_inputs: SampleFn | None = None,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    tolerances: Mapping[torch.dtype, tuple[float, float]] | None = None,
    compare: Callable[..., None] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as the reference implementation of op ``name``."""

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        op_name = name or fn.__name__
        if op_name in _REGISTRY and _REGISTRY[op_name].reference is not fn:
            raise ValueError(f"op {op_name!r} registered twice")
        _REGISTRY[op_name] = OpDef(
            op_name, fn, sample_inputs, dtypes, {**DEFAULT_TOLERANCES, **(tolerances or {})}, compare
        )
        return fn

    return register


def _load_reference_ops() -> None:
    """Import every module of :mod:`deepinfer.ops` so all reference ops are registered."""
    import deepinfer.ops as package

    for info in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{info.name}")


def op_defs() -> dict[str, OpDef]:
    """All registered ops by name."""
    _load_reference_ops()
    return dict(_REGISTRY)


class OpTable:
    """Resolved ops for one backend: ``table.rms_norm(x, w, eps)`` calls the override or the reference."""

    __slots__ = ("_impls", "_overridden", "backend_name")

    def __init__(self, overrides: Mapping[str, Callable[..., Any]] | None = None, backend_name: str = "reference"):
        defs = op_defs()
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(defs))
        if unknown:
            raise ValueError(f"backend {backend_name!r} overrides unknown ops {unknown}; known ops: {sorted(defs)}")
        self._impls = {n: overrides.get(n, d.reference) for n, d in defs.items()}
        self._overridden = frozenset(overrides)
        self.backend_name = backend_name

    def __getattr__(self, name: str) -> Callable[..., Any]:
        try:
            return self._impls[name]
        except KeyError:
            raise AttributeError(f"no op named {name!r}") from None

    def source(self, name: str) -> str:
        """Who implements op ``name`` in this table: the backend's name or ``"reference"``."""
        if name not in self._impls:
            raise KeyError(name)
        return self.backend_name if name in self._overridden else "reference"

    @property
    def overridden(self) -> frozenset[str]:
        """Names of ops the backend replaced."""
        return self._overridden

    @classmethod
    def for_backend(cls, backend: Any) -> "OpTable":
        """The table of ``backend`` (a :class:`~deepinfer.backends.Backend`), built once per backend object."""
        table = getattr(backend, "_deepinfer_op_table", None)
        if table is None:
            table = cls(backend.load_ops(), backend.name)
            backend._deepinfer_op_table = table
        return table
