"""The op table: references, overrides, and the conformance checker itself."""

from __future__ import annotations

import pytest
import torch

from deepinfer.backends.cpu import CpuBackend
from deepinfer.ops import OpTable, op_defs
from deepinfer.testing import check_op, samples


def test_reference_table_has_every_registered_op():
    table = OpTable()
    for name in op_defs():
        assert table.source(name) == "reference"
        assert callable(getattr(table, name))
    with pytest.raises(AttributeError, match="no op named 'no_such_op'"):
        _ = table.no_such_op


def test_unknown_override_is_rejected():
    with pytest.raises(ValueError, match=r"overrides unknown ops \['typo_norm'\]"):
        OpTable({"typo_norm": lambda x: x}, backend_name="bad")


@pytest.mark.parametrize("name", sorted(op_defs()))
def test_every_op_has_samples_and_its_reference_runs_on_them(name):
    op = op_defs()[name]
    assert op.__doc__ or op.reference.__doc__, f"op {name} has no docstring"
    for dtype in op.dtypes:
        cases = samples(op, dtype)
        assert cases, f"op {name} registers no samples for {dtype}"
        for case in cases:
            op.reference(*case.args, **case.kwargs)


class _WrongNorm(CpuBackend):
    name = "wrong"

    def load_ops(self):
        return {"rms_norm": lambda x, weight, eps: x}  # forgets to normalise


class _RightNorm(CpuBackend):
    name = "right"

    def load_ops(self):
        def rms_norm(x, weight, eps):
            y = x.double() / x.double().pow(2).mean(-1, keepdim=True).add(eps).sqrt()
            return (y if weight is None else y * weight.double()).to(x.dtype)

        return {"rms_norm": rms_norm}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conformance_accepts_a_correct_override(dtype):
    backend = _RightNorm()
    assert OpTable.for_backend(backend).source("rms_norm") == "right"
    assert check_op(backend, "rms_norm", dtype) > 0


def test_conformance_rejects_a_wrong_override():
    with pytest.raises(AssertionError, match=r"wrong\.rms_norm"):
        check_op(_WrongNorm(), "rms_norm", torch.float32)
