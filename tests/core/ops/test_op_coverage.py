"""Coverage: a kernel that handles only some shapes declares which, and the table runs the reference for the rest."""

from __future__ import annotations

import logging
from collections import Counter

import pytest
import torch

from deepinfer.backends.cpu import CpuBackend
from deepinfer.ops import OpTable, op_defs
from deepinfer.ops.mhc import hc_pre as reference_hc_pre
from deepinfer.testing import check_backend, check_coverage, check_op, coverage_params

CALLS: Counter[str] = Counter()


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def tiled_hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    """A kernel like CUDA's: refuses stream counts that are no power of two (raising, as a kernel's plan does)."""
    if not _pow2(streams.shape[1]):
        raise ValueError(f"needs a power-of-two stream count (got {streams.shape[1]})")
    CALLS["hc_pre"] += 1
    return reference_hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)


def covers_hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
    return _pow2(streams.shape[1])


class _PowerOfTwoStreams(CpuBackend):
    name = "pow2"
    batch_invariant_ops = ("hc_pre",)  # the reference's tiled form behind it: the claim holds here

    def load_ops(self):
        return {"hc_pre": tiled_hc_pre}

    def op_coverage(self):
        return {"hc_pre": covers_hc_pre}


class _NoDeclaration(_PowerOfTwoStreams):
    name = "undeclared_pow2"

    def op_coverage(self):
        return {}


def _hc_pre_args(n: int, rows: int = 3, dim: int = 32):
    gen = torch.Generator().manual_seed(n)
    streams = torch.randn(rows, n, dim, generator=gen)
    fn = 0.05 * torch.randn((2 + n) * n, n * dim, generator=gen)
    return streams, fn, torch.randn((2 + n) * n, generator=gen), torch.ones(3), 1e-6, 1e-6, 20


def test_uncovered_shape_runs_the_reference_and_covered_one_the_kernel():
    table = OpTable.for_backend(_PowerOfTwoStreams())
    before = CALLS["hc_pre"]
    for n in (2, 3, 4):
        args = _hc_pre_args(n)
        got, expected = table.hc_pre(*args), reference_hc_pre(*args)
        assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True)), n
        assert table.uses_override("hc_pre", *args) == (n != 3)
    assert CALLS["hc_pre"] - before == 2  # n = 2 and 4 ran the kernel, n = 3 never entered it
    assert table.source("hc_pre") == "pow2" and table.partially_covered == {"hc_pre"}
    assert table.hc_pre.__wrapped__ is tiled_hc_pre  # the dispatcher shows the kernel's signature


def test_without_a_declaration_the_kernel_raises_for_the_shape_it_cannot_take():
    with pytest.raises(ValueError, match="power-of-two stream count"):
        OpTable.for_backend(_NoDeclaration()).hc_pre(*_hc_pre_args(3))


def test_a_real_error_inside_a_covered_kernel_is_not_hidden():
    def broken(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
        raise RuntimeError("illegal memory access")

    table = OpTable({"hc_pre": broken}, "broken", coverage={"hc_pre": covers_hc_pre})
    table.hc_pre(*_hc_pre_args(3))  # not covered: the reference
    with pytest.raises(RuntimeError, match="illegal memory access"):
        table.hc_pre(*_hc_pre_args(4))


def test_the_first_fallback_of_an_op_is_logged_once(caplog):
    table = OpTable({"hc_pre": tiled_hc_pre}, "pow2", coverage={"hc_pre": covers_hc_pre})
    with caplog.at_level(logging.INFO, logger="deepinfer.ops.table"):
        for _ in range(3):
            table.hc_pre(*_hc_pre_args(3))
    notes = [r.getMessage() for r in caplog.records if "does not cover" in r.getMessage()]
    assert notes == ["op hc_pre: backend 'pow2''s kernel does not cover these inputs (see its op_coverage); "
                     "core's reference runs such calls"]


def test_under_the_batch_invariant_flag_uncovered_calls_run_the_batch_invariant_reference(monkeypatch):
    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "1")
    table = OpTable.for_backend(_PowerOfTwoStreams())
    assert table.source("hc_pre") == "pow2"  # kept: declared batch-invariant
    args = _hc_pre_args(3, rows=40)
    expected = op_defs()["hc_pre"].batch_invariant(*args)
    assert all(torch.equal(g, e) for g, e in zip(table.hc_pre(*args), expected, strict=True))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conformance_samples_shapes_the_kernel_does_not_cover(dtype):
    backend = _PowerOfTwoStreams()
    assert coverage_params(backend) == [("hc_pre", torch.float32), ("hc_pre", torch.bfloat16)]
    covered, uncovered = check_coverage(backend, "hc_pre", dtype)
    assert covered > 0 and uncovered > 0  # the mHC samples hold 2, 3 and 4 streams
    assert check_op(backend, "hc_pre", dtype) == covered + uncovered
    assert check_backend(backend) == {"hc_pre": 2 * (covered + uncovered)}


def test_conformance_catches_a_table_that_lets_the_kernel_run_what_it_does_not_cover(monkeypatch):
    """The check compares uncovered samples with the reference bit for bit: a kernel that ran instead (here one
    that is merely close) fails it."""
    import deepinfer.ops.table as table_module

    def nudged(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters):
        collapsed, post, comb = reference_hc_pre(streams, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
        return collapsed, post, comb * (1 + 1e-6)

    class Nudged(_PowerOfTwoStreams):
        def load_ops(self):
            return {"hc_pre": nudged}

    monkeypatch.setattr(table_module, "kernel_or_reference", lambda name, kernel, *rest: kernel)
    with pytest.raises(AssertionError, match=r"pow2\.hc_pre\[5x3x64\] \(not covered: the reference must run\)"):
        check_coverage(Nudged(), "hc_pre", torch.float32)
