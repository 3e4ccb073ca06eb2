"""Conformance suite: check a backend's ops against core's reference ops.

Usable from any backend's tests::

    import pytest
    from deepinfer.testing import check_op, conformance_params

    @pytest.mark.parametrize("op_name, dtype", conformance_params(my_backend))
    def test_conformance(op_name, dtype):
        check_op(my_backend, op_name, dtype)

that a kernel declaring partial coverage (``Backend.op_coverage``) hands the inputs it does not cover to the
reference, which gives the reference's exact result on the device::

    @pytest.mark.parametrize("op_name, dtype", coverage_params(my_backend))
    def test_coverage(op_name, dtype):
        check_coverage(my_backend, op_name, dtype)

and, for ``DEEPINFER_BATCH_INVARIANT=1``, that each op's rows are bitwise independent of the batch::

    @pytest.mark.parametrize("op_name, dtype", batch_invariance_params(my_backend))
    def test_batch_invariance(op_name, dtype):
        check_batch_invariance(my_backend, op_name, dtype)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import torch

from deepinfer import envs
from deepinfer.ops.catalog import op_defs
from deepinfer.ops.registry import OpDef, OpSample, assert_close
from deepinfer.ops.table import OpTable

if TYPE_CHECKING:
    from deepinfer.backends.backend import Backend


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def samples(op: OpDef, dtype: torch.dtype, seed: int = 0) -> list[OpSample]:
    """The op's registered sample inputs for ``dtype`` (CPU tensors), reproducible by ``seed``."""
    if op.sample_inputs is None:
        return []
    gen = torch.Generator().manual_seed(seed)
    return list(op.sample_inputs(dtype, gen))


def conformance_params(backend: Backend, ops: Sequence[str] | None = None) -> list[tuple[str, torch.dtype]]:
    """(op name, dtype) pairs to check for ``backend``: every op it overrides (or ``ops``) × the op's dtypes."""
    defs = op_defs()
    names = sorted(OpTable.for_backend(backend).overridden) if ops is None else list(ops)
    return [(n, dt) for n in names for dt in defs[n].dtypes]


def check_op(backend: Backend, name: str, dtype: torch.dtype, seed: int = 0) -> int:
    """Run op ``name`` of ``backend`` and the reference on the same inputs; raise AssertionError on mismatch.

    Inputs are built on the CPU, the reference runs there, the backend runs on its device.
    Returns the number of samples checked (an op without samples fails: it cannot be proven).
    """
    op = op_defs()[name]
    impl = getattr(OpTable.for_backend(backend), name)
    device = backend.device()
    cases = samples(op, dtype, seed)
    assert cases, f"op {name!r} registers no sample inputs, so no backend can prove it conforms"
    atol_rtol = op.tolerances.get(dtype, (1e-5, 1e-5))
    for i, case in enumerate(cases):
        expected = op.reference(*case.args, **case.kwargs)
        actual = impl(*_to(case.args, device), **_to(case.kwargs, device))
        where = f"{backend.name}.{name}[{case.label or i}]"
        if op.compare is not None:
            op.compare(actual, expected, case, dtype)
        else:
            assert_close(actual, expected, dtype, atol_rtol, where)
    return len(cases)


def check_backend(backend: Backend, seed: int = 0) -> dict[str, int]:
    """Check every op ``backend`` overrides at every dtype, and its declared coverage; return samples checked
    per op."""
    counts: dict[str, int] = {}
    for name, dtype in conformance_params(backend):
        counts[name] = counts.get(name, 0) + check_op(backend, name, dtype, seed)
    for name, dtype in coverage_params(backend):
        check_coverage(backend, name, dtype, seed)
    return counts


def coverage_params(backend: Backend, ops: Sequence[str] | None = None) -> list[tuple[str, torch.dtype]]:
    """(op name, dtype) pairs of the ops whose override declares what it covers (or ``ops``) × their dtypes."""
    defs = op_defs()
    names = sorted(OpTable.for_backend(backend).partially_covered) if ops is None else list(ops)
    return [(n, dt) for n in names for dt in defs[n].dtypes]


def check_coverage(backend: Backend, name: str, dtype: torch.dtype, seed: int = 0) -> tuple[int, int]:
    """Run op ``name``'s samples through ``backend``'s table on its device: each sample its kernel does not cover
    (by its ``op_coverage`` predicate) must give exactly what the reference gives there, not an error.  The
    samples the kernel covers are :func:`check_op`'s.  Returns (covered, not covered) sample counts."""
    table = OpTable.for_backend(backend)
    reference = getattr(OpTable(batch_invariant=table.batch_invariant), name)
    impl, device = getattr(table, name), backend.device()
    cases = samples(op_defs()[name], dtype, seed)
    assert cases, f"op {name!r} registers no sample inputs, so no backend can prove its coverage"
    covered = 0
    for i, case in enumerate(cases):
        args, kwargs = _to(case.args, device), _to(case.kwargs, device)
        if table.uses_override(name, *args, **kwargs):
            covered += 1
            continue
        where = f"{backend.name}.{name}[{case.label or i}] (not covered: the reference must run)"
        assert_same_bits(impl(*args, **kwargs), reference(*args, **kwargs), f"{where} ({dtype})")
    return covered, len(cases) - covered


# --------------------------------------------------------------------------------------------------
# Batch invariance: an op's rows computed in a sub-batch equal, bitwise, the same rows of the whole batch.
# --------------------------------------------------------------------------------------------------


def _sub_batches(rows: int, gen: torch.Generator) -> list[torch.Tensor]:
    """Row selections that move rows to other places among other neighbours: singles, a prefix, the batch
    reversed, and a shuffled subset."""
    picks = [[0], [rows - 1], [rows // 2], list(range((rows + 1) // 2)), list(range(rows))[::-1]]
    subset = torch.randperm(rows, generator=gen)[: max(1, 2 * rows // 3)]
    picks.append(subset.tolist())
    unique = {tuple(p): torch.tensor(p, dtype=torch.int64) for p in picks}
    return list(unique.values())


def _select_rows(value: Any, rows: torch.Tensor) -> Any:
    if isinstance(value, torch.Tensor):
        return value[rows.to(value.device)]
    return type(value)(_select_rows(v, rows) for v in value)


def assert_same_bits(actual: Any, expected: Any, where: str) -> None:
    """Outputs equal exactly: same shapes, dtypes and values (NaN equals NaN; +0 equals -0)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual).__name__}"
        assert actual.shape == expected.shape and actual.dtype == expected.dtype, f"{where}: shape/dtype differ"
        same = actual == expected
        if expected.is_floating_point():
            same |= actual.isnan() & expected.isnan()
        if not bool(same.all()):
            bad = (~same).nonzero()[0].tolist()
            diff = (actual.double() - expected.double()).abs().nan_to_num(0).max().item()
            raise AssertionError(f"{where}: not bitwise equal (first at {bad}, max |diff| {diff:.3g})")
    else:
        assert isinstance(actual, (list, tuple)) and len(actual) == len(expected), f"{where}: structure differs"
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            assert_same_bits(a, e, f"{where}[{i}]")


def check_impl_batch_invariance(
    impl: Callable[..., Any], name: str, dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0,
    where: str | None = None,
) -> int:
    """Check that ``impl`` (an implementation of op ``name``) gives every row of each sample the same bits
    in sub-batches as in the whole batch.  Returns the number of sub-batches compared."""
    op = op_defs()[name]
    assert op.rows is not None, f"op {name!r} declares no rows"
    device = torch.device(device)
    cases = samples(op, dtype, seed)
    assert cases, f"op {name!r} registers no sample inputs, so no backend can prove it batch-invariant"
    gen = torch.Generator().manual_seed(seed)
    checked = 0
    for i, case in enumerate(cases):
        whole = impl(*_to(case.args, device), **_to(case.kwargs, device))
        for rows in _sub_batches(op.rows.count(case), gen):
            sub = op.rows.select(case, rows)
            part = impl(*_to(sub.args, device), **_to(sub.kwargs, device))
            label = f"{where or name}[{case.label or i}] rows {rows.tolist()[:8]}"
            assert_same_bits(part, _select_rows(whole, rows), f"{label} ({dtype})")
            checked += 1
    return checked


def batch_invariant_table(backend: Backend) -> OpTable:
    """The op table the engine builds for ``backend`` under ``DEEPINFER_BATCH_INVARIANT=1``."""
    with envs.overridden("DEEPINFER_BATCH_INVARIANT", "1"):
        return OpTable.for_backend(backend)


def batch_invariance_params(
    backend: Backend | None = None, ops: Sequence[str] | None = None
) -> list[tuple[str, torch.dtype]]:
    """(op name, dtype) pairs to prove batch-invariant: every op with rows (or those of ``ops``) × its dtypes.

    All of them, not only a backend's overrides: the references run on the backend's device too."""
    defs = op_defs()
    names = sorted(n for n, d in defs.items() if d.rows is not None) if ops is None else list(ops)
    return [(n, dt) for n in names for dt in defs[n].dtypes]


def check_batch_invariance(backend: Backend, name: str, dtype: torch.dtype, seed: int = 0) -> int:
    """Prove op ``name`` of ``backend``'s batch-invariant table on its device: each sample's rows, run in
    several sub-batches (single rows, a prefix, reversed, shuffled subsets), equal the whole batch's bitwise.

    Raises AssertionError naming the op, sample and rows on the first difference; returns the number of
    sub-batches compared."""
    table = batch_invariant_table(backend)
    where = f"{backend.name}.{name}({table.source(name)})"
    return check_impl_batch_invariance(getattr(table, name), name, dtype, backend.device(), seed, where)
