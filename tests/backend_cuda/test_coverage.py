"""What the CUDA kernels cover, without a GPU: the declarations, their agreement with the kernels' own checks, and
the op table running core's reference for the rest (on an H200, ``hc_pre`` raised for a model with 3 streams)."""

from __future__ import annotations

import importlib

import pytest
import torch

from deepinfer.ops import OpTable, op_defs
from deepinfer.testing import check_coverage, coverage_params, samples

triton = pytest.importorskip("triton")

from deepinfer_cuda.ops import coverage, kernels_by_op  # noqa: E402 - the kernel modules import Triton
from deepinfer_cuda.plugin import CudaBackend  # noqa: E402


def _streams(n: int, rows: int = 3, dim: int = 64):
    gen = torch.Generator().manual_seed(n)
    streams = torch.randn(rows, n, dim, generator=gen).to(torch.bfloat16)
    fn = 0.05 * torch.randn((2 + n) * n, n * dim, generator=gen)
    return streams, fn, torch.randn((2 + n) * n, generator=gen), torch.ones(3)


@pytest.mark.parametrize("n, covered", [(1, True), (2, True), (3, False), (4, True), (5, False), (6, False),
                                        (8, True)])
def test_hc_kernels_cover_power_of_two_stream_counts(n, covered):
    streams, fn, base, scale = _streams(n)
    assert coverage()["hc_pre"](streams, fn, base, scale, 1e-6, 1e-6, 20) is covered
    out, post, comb = streams[:, 0], torch.rand(3, n), torch.rand(3, n, n)
    assert coverage()["hc_post"](out, streams, post, comb) is covered


def test_hc_pre_needs_a_sinkhorn_round():
    assert not coverage()["hc_pre"](*_streams(4), 1e-6, 1e-6, 0)


@pytest.mark.parametrize("pairs, dim, covered", [(8, 64, True), (32, 64, True), (6, 64, False), (64, 64, False)])
def test_rotating_kernels_cover_a_power_of_two_pair_count_within_the_row(pairs, dim, covered):
    x, positions, inv_freq = torch.randn(2, 4, dim), torch.arange(2), torch.rand(pairs)
    assert coverage()["rope"](x, positions, inv_freq) is covered
    assert coverage()["rms_norm_rope"](x, None, 1e-6, positions, inv_freq) is covered


@pytest.mark.parametrize("block, dim, covered", [(32, 512, True), (16, 512, True), (64, 512, True),
                                                  (128, 512, False), (24, 96, False), (24, 80, True),
                                                  (32, 80, True)])
def test_fused_quantizers_cover_power_of_two_blocks_within_the_rope_channels(block, dim, covered):
    """The epilogue quantizes the rope channels' tile by itself: its blocks are powers of two that divide it (64
    channels here).  A row that is no whole number of blocks is rotated only: covered whatever the block."""
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import rms_norm_rope_fp8_e4m3_fake_quant as fp8
    from deepinfer_cuda.kernels import rope_fp4_e2m1_fake_quant as fp4

    x, positions, inv_freq = torch.randn(2, dim), torch.arange(2), torch.rand(32)
    assert coverage()["rms_norm_rope_fp8_e4m3_fake_quant"](x, None, 1e-6, positions, inv_freq, 1.0, block) is covered
    assert coverage()["rope_fp4_e2m1_fake_quant"](x, positions, inv_freq, 1.0, block, "ue8m0") is covered
    if not covered:  # the kernels' own check agrees
        with pytest.raises(ValueError, match="block"):
            fp8.prepare(x, None, 1e-6, positions, inv_freq, 1.0, block, arch=SM90A)
        with pytest.raises(ValueError, match="block"):
            fp4.prepare(x, positions, inv_freq, 1.0, block, "ue8m0", arch=SM90A)


class _CudaKernelsOnTheCpu(CudaBackend):
    """The CUDA backend's real table (overrides and coverage) with inputs left on the CPU: whatever reaches a
    kernel fails (no GPU), so every call that succeeds went to the reference."""

    def device(self, index: int = 0) -> torch.device:
        return torch.device("cpu")


def test_a_three_stream_model_runs_the_reference_instead_of_failing():
    table = OpTable.for_backend(_CudaKernelsOnTheCpu())
    assert table.source("hc_pre") == "nvidia"
    streams, fn, base, scale = _streams(3)
    got = table.hc_pre(streams, fn, base, scale, 1e-6, 1e-6, 20)
    expected = op_defs()["hc_pre"].reference(streams, fn, base, scale, 1e-6, 1e-6, 20)
    assert all(torch.equal(g, e) for g, e in zip(got, expected, strict=True))
    y = table.hc_post(got[0], streams, got[1], got[2])
    assert torch.equal(y, op_defs()["hc_post"].reference(got[0], streams, got[1], got[2]))


@pytest.mark.parametrize("op_name, dtype", coverage_params(_CudaKernelsOnTheCpu()))
def test_conformance_samples_outside_the_kernels_run_the_reference(op_name, dtype):
    """Every op with a declaration has conformance samples it does not cover (V4.1's 2 and 3 streams, a rope of
    12 pairs); those are checked here, the covered ones on the GPU (test_gpu_kernels.py)."""
    covered, uncovered = check_coverage(_CudaKernelsOnTheCpu(), op_name, dtype)
    assert covered > 0 and uncovered > 0


@pytest.mark.parametrize("op_name", sorted(coverage()))
def test_declarations_agree_with_each_kernels_own_check(op_name):
    """``prepare`` (plans a launch, runs nothing: fine on the CPU) raises exactly for the samples declared
    uncovered, so the table never sends a kernel what it refuses, nor falls back where the kernel would run."""
    from deepinfer_cuda.arch import SM90A

    module = importlib.import_module(kernels_by_op()[op_name].__module__)
    op = op_defs()[op_name]
    for dtype in op.dtypes:
        for case in samples(op, dtype):
            declared = coverage()[op_name](*case.args, **case.kwargs)
            try:
                module.prepare(*case.args, **case.kwargs, arch=SM90A)
                planned = True
            except ValueError:
                planned = False
            assert planned == declared, f"{op_name}[{case.label}] {dtype}: declared {declared}, planned {planned}"
