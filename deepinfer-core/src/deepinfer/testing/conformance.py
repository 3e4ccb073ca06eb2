"""Conformance suite: check a backend's ops against core's reference ops.

Usable from any backend's tests::

    import pytest
    from deepinfer.testing import check_op, conformance_params

    @pytest.mark.parametrize("op_name, dtype", conformance_params(my_backend))
    def test_conformance(op_name, dtype):
        check_op(my_backend, op_name, dtype)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from deepinfer.ops.registry import OpDef, OpSample, OpTable, op_defs


def _to(value: Any, device: torch.device) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (list, tuple)):
        return type(value)(_to(v, device) for v in value)
    if isinstance(value, dict):
        return {k: _to(v, device) for k, v in value.items()}
    return value


def assert_close(actual: Any, expected: Any, dtype: torch.dtype, tol: tuple[float, float], where: str) -> None:
    """Recursively compare op outputs: floats within ``tol``, integers and bools exactly."""
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
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_close(a, e, dtype, tol, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def samples(op: OpDef, dtype: torch.dtype, seed: int = 0) -> list[OpSample]:
    """The op's registered sample inputs for ``dtype`` (CPU tensors), reproducible by ``seed``."""
    if op.sample_inputs is None:
        return []
    gen = torch.Generator().manual_seed(seed)
    return list(op.sample_inputs(dtype, gen))


def conformance_params(backend: Any, ops: Sequence[str] | None = None) -> list[tuple[str, torch.dtype]]:
    """(op name, dtype) pairs to check for ``backend``: every op it overrides (or ``ops``) × the op's dtypes."""
    defs = op_defs()
    names = sorted(OpTable.for_backend(backend).overridden) if ops is None else list(ops)
    return [(n, dt) for n in names for dt in defs[n].dtypes]


def check_op(backend: Any, name: str, dtype: torch.dtype, seed: int = 0) -> int:
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


def check_backend(backend: Any, seed: int = 0) -> dict[str, int]:
    """Check every op ``backend`` overrides at every dtype; return samples checked per op."""
    counts: dict[str, int] = {}
    for name, dtype in conformance_params(backend):
        counts[name] = counts.get(name, 0) + check_op(backend, name, dtype, seed)
    return counts
