"""The V4.1 QAT fake-quantizers: bit for bit against the reference's vectors, and the properties behind them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from deepinfer.backends.cpu import CpuBackend
from deepinfer.ops import OpTable
from deepinfer.ops.fake_quant import round_to_grid
from deepinfer.testing import check_op

VECTORS = Path(__file__).parents[2] / "fixtures" / "deepseek_v41" / "quantizers" / "quant_vectors.json"
OPS = OpTable()
#: case-name prefix in quant_vectors.json -> the op call it checks
QUANTIZERS = {
    "fp8_e4m3_ue8m0_block32": lambda x: OPS.fp8_e4m3_fake_quant(x, 32),
    "fp4_e2m1_e4m3scale_block16": lambda x: OPS.fp4_e2m1_fake_quant(x, 16, "e4m3"),
    "fp4_e2m1_ue8m0_block32": lambda x: OPS.fp4_e2m1_fake_quant(x, 32, "ue8m0"),
}


def _cases():
    cases = json.loads(VECTORS.read_text())["cases"]
    return [(name.split(" ")[0], case) for name, case in cases.items()]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


@pytest.mark.parametrize("name, case", _cases(), ids=[n for n, _ in _cases()])
def test_every_reference_vector_bit_for_bit(name, case):
    x = torch.tensor(case["input"], dtype=torch.float32)
    expected = torch.tensor(case["output"], dtype=torch.float32)
    out = QUANTIZERS[name](x)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    mismatch = (_bits(out) != _bits(expected)).nonzero()
    assert mismatch.numel() == 0, f"{name}: {len(mismatch)} values differ, first at {mismatch[0].tolist()}"
    # the same rows as a [rows, heads, D] batch: blocks never cross a row
    assert torch.equal(_bits(QUANTIZERS[name](x.view(-1, 1, x.shape[-1]))).view_as(_bits(out)), _bits(out))


@pytest.mark.parametrize("name", QUANTIZERS)
def test_bf16_input_is_quantized_in_fp32_and_returns_exact_bf16(name):
    gen = torch.Generator().manual_seed(5)
    x = (torch.randn(64, 128, generator=gen) * torch.exp2(torch.randint(-12, 8, (64, 1), generator=gen))).bfloat16()
    out = QUANTIZERS[name](x)
    wide = QUANTIZERS[name](x.float())
    assert out.dtype == torch.bfloat16
    assert torch.equal(wide.bfloat16().float(), wide), "dequantized values must be exactly representable in bf16"
    assert torch.equal(_bits(out), _bits(wide.bfloat16()))


@pytest.mark.parametrize("name", QUANTIZERS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_last_dim_not_a_multiple_of_the_block_passes_through(name, dtype):
    x = torch.randn(3, 2, 40).to(dtype)  # 40 = tiny_b's head_dim: neither 16 nor 32 divides it
    assert QUANTIZERS[name](x) is x


def test_e2m1_ties_go_to_the_even_code():
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert round_to_grid(ties, 1, 0, 6.0).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    above = torch.nextafter(ties, torch.tensor(float("inf")))
    assert round_to_grid(above, 1, 0, 6.0).tolist() == [0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    below = torch.nextafter(ties, torch.tensor(0.0))
    assert round_to_grid(-below, 1, 0, 6.0).tolist() == [-0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0]


def test_e4m3_rounding_equals_torch_cast_on_every_in_range_bf16_value():
    """Every finite bf16 value within ±448 (subnormals of both formats included): the explicit rounding gives
    torch's float8_e4m3fn cast, which is round-to-nearest-even there on every build."""
    values = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    values = values[values.isfinite() & (values.abs() <= 448)]
    ours = round_to_grid(values, 3, -6, 448.0)
    assert torch.equal(_bits(ours), _bits(values.to(torch.float8_e4m3fn).float()))


def test_e4m3_rounding_saturates():
    big = torch.tensor([448.0, 449.0, 464.0, 1e30, float("inf"), -float("inf")])
    assert round_to_grid(big, 3, -6, 448.0).tolist() == [448.0, 448.0, 448.0, 448.0, 448.0, -448.0]


def test_fp4_e4m3_scale_saturates_for_huge_blocks():
    """amax/6 above 448 gives the largest e4m3 scale (torch 2.13's CPU cast, which the reference ran on)."""
    x = torch.zeros(1, 16)
    x[0, 0], x[0, 1] = 6 * 448 * 4, 448.0 * 3
    out = OPS.fp4_e2m1_fake_quant(x, 16, "e4m3")
    assert out[0, :2].tolist() == [6 * 448.0, 3 * 448.0]


def test_bad_scale_format_is_rejected():
    with pytest.raises(ValueError, match="scale_format must be 'e4m3' or 'ue8m0', got 'e8m0'"):
        OPS.fp4_e2m1_fake_quant(torch.zeros(2, 32), 32, "e8m0")


@pytest.mark.parametrize("name", ["fp8_e4m3_fake_quant", "fp4_e2m1_fake_quant"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conformance_suite_runs_bitwise(name, dtype):
    assert check_op(CpuBackend(), name, dtype) > 0
