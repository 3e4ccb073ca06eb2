"""The op registry: core's reference ops by name, with their samples, tolerances and batch rows.

An op is a pure function on tensors.  Core registers a plain-PyTorch reference for every op with
:func:`reference_op`; a backend's ``load_ops()`` returns replacements for any subset.  Models call ops
only through an :class:`~deepinfer.ops.table.OpTable` (typed as :class:`~deepinfer.ops.protocol.Ops`), so
hardware differences never reach model code.

Batch invariance (``DEEPINFER_BATCH_INVARIANT=1``): an op that declares :class:`Rows` promises that row ``i``
of its output depends only on row ``i`` of its row arguments.  The plain reference keeps that promise only
up to rounding (a GEMM's reduction order may change with the number of rows); an op registers a
bitwise batch-invariant form with :func:`batch_invariant_reference`, and a table built with the flag on
uses those forms.  ``deepinfer.testing.check_batch_invariance`` proves the property per op.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
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


def registered() -> dict[str, OpDef]:
    """The ops registered so far, by name.  :func:`deepinfer.ops.catalog.op_defs` is all of them: it loads every
    op module first."""
    return dict(_REGISTRY)


def assert_close(actual: Any, expected: Any, dtype: torch.dtype, tol: tuple[float, float], where: str) -> None:
    """How an implementation's output is compared with its reference's unless the op registers a ``compare``:
    recursively, floats within ``tol`` (atol, rtol), integers and bools exactly."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual).__name__}"
        assert actual.shape == expected.shape, f"{where}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        actual = actual.detach().cpu()
        if expected.is_floating_point():
            atol, rtol = tol
            torch.testing.assert_close(actual.float(), expected.float(), atol=atol, rtol=rtol, equal_nan=True,
                                       msg=lambda m: f"{where} ({dtype}): {m}")
        else:
            assert torch.equal(actual, expected), f"{where}: integer outputs differ"
    elif isinstance(expected, (list, tuple)):
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{where}: structure differs"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_close(a, e, dtype, tol, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"
