"""The runtime's mirror of Triton's argument specialization agrees with Triton itself (CPU only)."""

from __future__ import annotations

import pytest
import torch

from deepinfer_cuda.kernel_set.specialize import TRITON_DTYPES, ParamInfo, signature_of, specialize_arg

triton_c = pytest.importorskip("triton._C.libtriton")
from triton.backends.compiler import BaseBackend  # noqa: E402


def _triton(value, specialize=True, align=True):
    ty, hint = triton_c.native_specialize_impl(BaseBackend, value, False, specialize, align)
    return ty, hint


def _values():
    base = torch.empty(64, dtype=torch.float32)
    yield base  # aligned
    yield base[1:]  # 4-byte offset: not 16-divisible
    yield base[4:]  # 16-byte offset
    for dtype in TRITON_DTYPES:
        yield torch.empty(8, dtype=dtype)
    yield torch.empty(9, dtype=torch.bfloat16)[1:]
    yield from [0, 1, 2, 15, 16, 17, 32, -16, -17, 2**31 - 1, 2**31, -(2**31), -(2**31) - 1, 2**40, 2**63, 2**64 - 1]
    yield from [0.0, 1.0, 1e-6, True, False, None]
    from triton.tools.tensor_descriptor import TensorDescriptor

    yield TensorDescriptor.from_tensor(torch.empty(64, 256, dtype=torch.bfloat16), [32, 256])  # a host TMA descriptor
    yield TensorDescriptor.from_tensor(torch.empty(8, 64, dtype=torch.float32), [8, 16])


@pytest.mark.parametrize("specialize, align", [(True, True), (False, True), (True, False), (False, False)])
def test_specialize_arg_matches_triton(specialize, align):
    for value in _values():
        ours = specialize_arg(value, specialize, align)
        theirs = _triton(value, specialize, align)
        if ours[0] == "constexpr" or theirs[0] == "constexpr":
            assert ours == theirs, f"{value!r}: {ours} != {theirs}"
        else:
            # Triton reports no hint as None or "" depending on the type; both mean "not divisible".
            assert ours[0] == theirs[0] and (ours[1] or "") == (theirs[1] or ""), f"{value!r}: {ours} != {theirs}"


def test_signature_of_splits_constexprs_and_folds_like_triton():
    params = [ParamInfo("x", False), ParamInfo("w", False), ParamInfo("n", False, specialize=False),
              ParamInfo("stride", False), ParamInfo("one", False), ParamInfo("BLOCK", True)]
    x = torch.empty(32, dtype=torch.bfloat16)
    sig, const = signature_of(params, {"x": x, "w": None, "n": 1, "stride": 48, "one": 1, "BLOCK": 64})
    assert list(sig.items()) == [("x", "*bf16:D"), ("n", "i32"), ("stride", "i32:D")]
    assert const == {"w": None, "one": 1, "BLOCK": 64}
    sig, _ = signature_of(params, {"x": x[1:], "w": x, "n": 5, "stride": 50, "one": 2, "BLOCK": 64})
    assert sig == {"x": "*bf16", "w": "*bf16:D", "n": "i32", "stride": "i32", "one": "i32"}


def test_launch_spec_separates_every_specialization():
    """The per-launch cache key (``TritonKernel._fast_spec``) must split argument sets wherever Triton's
    specialization (the cubin's signature and constexprs) differs, or a launch would reuse another variant's cubin."""
    from deepinfer_cuda.kernels.rms_norm import KERNEL

    base = torch.zeros(64, dtype=torch.bfloat16)
    values = {
        "ptr": [base, base[1:], base.float(), torch.nn.Parameter(base.float(), requires_grad=False)],
        "int": [1, 16, 17, 2**31, -(2**31) - 1, 2**63, True, None],
        "eps": [1e-6, 0.5],
    }
    seen: dict[tuple, tuple] = {}
    for x in values["ptr"]:
        for w in values["ptr"] + [None]:
            for n_rows in values["int"]:
                for stride in (16, 8):
                    args = dict(x_ptr=x, w_ptr=w, y_ptr=base, x_row_stride=stride, y_row_stride=16, n_rows=n_rows,
                                eps=values["eps"][stride == 8], N=16, BLOCK_N=16, BLOCK_ROWS=4,
                                HAS_WEIGHT=w is not None)
                    sig, const = signature_of(KERNEL.params, args)
                    full = (tuple(sorted(sig.items())), tuple(sorted((k, repr(v)) for k, v in const.items())))
                    assert seen.setdefault(KERNEL._fast_spec(args), full) == full, args
    assert len(seen) > 20
