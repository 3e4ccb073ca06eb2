"""The fused rotation + fake-quantizer ops: the compositions V4.1 made before, and a conformance check that
tells a grid-step flip from a wrong quantizer."""

from __future__ import annotations

import pytest
import torch

from deepinfer.ops import OpTable
from deepinfer.ops.registry import OpSample
from deepinfer.ops.rope_quant import quantized_close

OPS = OpTable()


def _inputs(shape: tuple[int, ...], dtype: torch.dtype, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    x = (3 * torch.randn(*shape, generator=gen)).to(dtype)
    positions = torch.randint(0, 4096, (shape[0],), generator=gen)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))
    return x, positions, inv_freq


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({torch.float32: torch.int32, torch.bfloat16: torch.int16}[t.dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_are_the_compositions_bit_for_bit(dtype):
    x, positions, inv_freq = _inputs((6, 512), dtype)
    weight = 1 + 0.1 * torch.randn(512, generator=torch.Generator().manual_seed(1))
    fused = OPS.rms_norm_rope_fp8_e4m3_fake_quant(x, weight, 1e-6, positions, inv_freq, 1.2, 32)
    composed = OPS.fp8_e4m3_fake_quant(OPS.rms_norm_rope(x, weight, 1e-6, positions, inv_freq, 1.2), 32)
    assert torch.equal(_bits(fused), _bits(composed))
    q, _, _ = _inputs((6, 4, 128), dtype, seed=2)
    fused = OPS.rope_fp4_e2m1_fake_quant(q, positions, inv_freq, 1.2, 32, "ue8m0")
    composed = OPS.fp4_e2m1_fake_quant(OPS.rope(q, positions, inv_freq, 1.2), 32, "ue8m0")
    assert torch.equal(_bits(fused), _bits(composed))
    assert not torch.equal(fused, OPS.rope(q, positions, inv_freq, 1.2))  # it did quantize


def test_rows_that_are_no_whole_blocks_are_rotated_not_quantized():
    x, positions, inv_freq = _inputs((4, 80), torch.float32)  # 80 channels: no multiple of 32
    assert torch.equal(OPS.rope_fp4_e2m1_fake_quant(x, positions, inv_freq, 1.0, 32, "ue8m0"),
                       OPS.rope(x, positions, inv_freq))
    assert torch.equal(OPS.rms_norm_rope_fp8_e4m3_fake_quant(x, None, 1e-6, positions, inv_freq, 1.0, 32),
                       OPS.rms_norm_rope(x, None, 1e-6, positions, inv_freq))


def test_quantized_close_takes_a_grid_step_flip_and_refuses_a_wrong_quantizer():
    x, positions, inv_freq = _inputs((8, 512), torch.float32)
    args = (x, None, 1e-6, positions, inv_freq, 1.0, 32)
    sample = OpSample(args, label="fp8")
    expected = OPS.rms_norm_rope_fp8_e4m3_fake_quant(*args)
    flipped = expected.clone()
    flipped[0, 0] = expected[0, 0] * (1 + 2.0**-3)  # one e4m3 grid step up (within its binade)
    quantized_close(flipped, expected, sample, torch.float32)
    far = expected.clone()
    far[0, 0] = expected[0, 0] + 3 * expected[0, :32].abs().max() * 2.0**-2
    with pytest.raises(AssertionError, match="grid steps"):
        quantized_close(far, expected, sample, torch.float32)
    unquantized = OPS.rms_norm_rope(x, None, 1e-6, positions, inv_freq)
    with pytest.raises(AssertionError, match="differ"):
        quantized_close(unquantized, expected, sample, torch.float32)
    fp4 = OPS.fp4_e2m1_fake_quant(unquantized, 32, "ue8m0")  # another format: within steps, too many flips
    with pytest.raises(AssertionError):
        quantized_close(fp4, expected, sample, torch.float32)
