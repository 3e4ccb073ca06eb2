"""The op table: core's reference ops by name, and a backend's overrides on top of them.

An op is a pure function on tensors.  Core registers a plain-PyTorch reference for every op with
:func:`reference_op`; a backend's ``load_ops()`` returns replacements for any subset.  Models call ops
only through an :class:`OpTable`, so hardware differences never reach model code.

Batch invariance (``DEEPINFER_BATCH_INVARIANT=1``): an op that declares :class:`Rows` promises that row ``i``
of its output depends only on row ``i`` of its row arguments.  The plain reference keeps that promise only
up to rounding (a GEMM's reduction order may change with the number of rows); an op registers a
bitwise batch-invariant form with :func:`batch_invariant_reference`, and a table built with the flag on
uses those forms.  ``deepinfer.testing.check_batch_invariance`` proves the property per op.
"""

from __future__ import annotations

import importlib
import logging
import pkgutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from deepinfer import envs

logger = logging.getLogger(__name__)

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
class Rows:
    """Where an op's batch lives: positional arguments ``args`` carry one row per token or request on dim 0,
    every other argument is shared by all rows, and every tensor of the output has the same rows on dim 0.

    ``narrow(sample, rows)``, if given, builds the sub-batch itself, for ops whose shared arguments are
    padded to the batch (e.g. a key pool or an index width): it may trim what the kept rows do not use.
    """

    args: tuple[int, ...]
    narrow: Callable[[OpSample, torch.Tensor], OpSample] | None = None

    def count(self, sample: OpSample) -> int:
        return sample.args[self.args[0]].shape[0]

    def select(self, sample: OpSample, rows: torch.Tensor) -> OpSample:
        """The sample holding only ``rows`` (an int64 index, any order) of the batch."""
        if self.narrow is not None:
            return self.narrow(sample, rows)
        args = tuple(a[rows] if i in self.args else a for i, a in enumerate(sample.args))
        return OpSample(args, dict(sample.kwargs), sample.label)


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
    #: The op's batch rows; ``None`` for ops that never see a batch (weight dequantization).
    rows: Rows | None = None
    #: Reference used when ``DEEPINFER_BATCH_INVARIANT=1``; ``None``: the plain reference already is.
    batch_invariant: Callable[..., Any] | None = None


_REGISTRY: dict[str, OpDef] = {}


def reference_op(
    name: str | None = None,
    *,
    sample_inputs: SampleFn | None = None,
    dtypes: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16),
    tolerances: Mapping[torch.dtype, tuple[float, float]] | None = None,
    compare: Callable[..., None] | None = None,
    rows: Rows | tuple[int, ...] | None = None,
) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as the reference implementation of op ``name``.

    ``rows``: the positional arguments holding the batch's rows (or a :class:`Rows`); see :class:`Rows`.
    """
    row_spec = Rows(tuple(rows)) if isinstance(rows, tuple) else rows

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        op_name = name or fn.__name__
        if op_name in _REGISTRY and _REGISTRY[op_name].reference is not fn:
            raise ValueError(f"op {op_name!r} registered twice")
        previous = _REGISTRY.get(op_name)
        _REGISTRY[op_name] = OpDef(
            op_name, fn, sample_inputs, dtypes, {**DEFAULT_TOLERANCES, **(tolerances or {})}, compare, row_spec,
            previous.batch_invariant if previous is not None else None,
        )
        return fn

    return register


def batch_invariant_reference(op: str | Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Register the decorated function as op ``op``'s (a name or its reference) batch-invariant reference:
    the same math, reduced in an order that no other row of the batch can change."""
    op_name = op if isinstance(op, str) else op.__name__

    def register(fn: Callable[..., Any]) -> Callable[..., Any]:
        if op_name not in _REGISTRY:
            raise ValueError(f"register op {op_name!r} with @reference_op before its batch-invariant form")
        if _REGISTRY[op_name].rows is None:
            raise ValueError(f"op {op_name!r} declares no rows, so it has no batch to be invariant to")
        _REGISTRY[op_name] = replace(_REGISTRY[op_name], batch_invariant=fn)
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
    """Resolved ops for one backend: ``table.rms_norm(x, w, eps)`` calls the override or the reference.

    ``batch_invariant`` (default: ``DEEPINFER_BATCH_INVARIANT``, read once here) selects each op's
    batch-invariant reference where the backend does not override it.
    """

    __slots__ = ("_impls", "_overridden", "backend_name", "batch_invariant")

    def __init__(
        self,
        overrides: Mapping[str, Callable[..., Any]] | None = None,
        backend_name: str = "reference",
        batch_invariant: bool | None = None,
    ):
        defs = op_defs()
        overrides = dict(overrides or {})
        unknown = sorted(set(overrides) - set(defs))
        if unknown:
            raise ValueError(f"backend {backend_name!r} overrides unknown ops {unknown}; known ops: {sorted(defs)}")
        self.batch_invariant = envs.batch_invariant() if batch_invariant is None else batch_invariant

        def fallback(d: OpDef) -> Callable[..., Any]:
            return (d.batch_invariant or d.reference) if self.batch_invariant else d.reference

        self._impls = {n: overrides.get(n, fallback(d)) for n, d in defs.items()}
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
    def for_backend(cls, backend: Any) -> OpTable:
        """The table of ``backend`` (a :class:`~deepinfer.backends.Backend`), built once per backend object
        and value of ``DEEPINFER_BATCH_INVARIANT``.

        With the flag on, a backend's override of an op that has rows is kept only if the backend lists the
        op in ``batch_invariant_ops`` (proven by ``check_batch_invariance``); the others fall back to the
        batch-invariant reference, so the flag's promise never rests on an unproven kernel.
        """
        flag = envs.batch_invariant()
        tables = getattr(backend, "_deepinfer_op_tables", None)
        if tables is None:
            tables = backend._deepinfer_op_tables = {}
        table = tables.get(flag)
        if table is None:
            overrides = dict(backend.load_ops())
            if flag:
                defs = op_defs()
                claimed = set(backend.batch_invariant_ops)
                dropped = sorted(n for n in overrides if n in defs and defs[n].rows is not None and n not in claimed)
                if dropped:
                    logger.info("DEEPINFER_BATCH_INVARIANT=1: backend %r does not declare %s batch-invariant; "
                                "using core's batch-invariant reference for them", backend.name, dropped)
                overrides = {n: f for n, f in overrides.items() if n not in dropped}
            table = tables[flag] = cls(overrides, backend.name, flag)
        return table
