"""Released quantized formats: FP8 e4m3 with 128x128 block scales (UE8M0 or fp32), MXFP4 experts (e2m1 packed
two per byte, e8m0 scale per 32).  Quantizing known weights and dequantizing gives the known values back, and
quantized checkpoints of a tiny model load and agree with the same model saved dequantized."""

from __future__ import annotations

import pytest
import torch

from deepinfer.models import load_model
from deepinfer.models.checkpoint import SafetensorsCheckpoint
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.weights import read_weights
from deepinfer.ops import OpTable
from deepinfer.quant import FP8_BLOCK, MXFP4, QuantizedTensor, quantize_fp8_block, quantize_mxfp4
from deepinfer.quant.formats import E2M1_VALUES
from tests.support.model_runs import assert_matches_hf, run_chunked
from tests.support.quantized import quantize_checkpoint, v4_layout
from tests.support.v4_fixtures import (  # noqa: F401  (single_thread is an autouse fixture)
    SMALL,
    build_checkpoint,
    hf_logprobs,
    random_tokens,
    single_thread,
)

OPS = OpTable()
E4M3_MAX = 448.0


def _representable_e4m3(shape, gen):
    values = torch.randn(shape, generator=gen).to(torch.float8_e4m3fn).float()
    return values.clamp(-E4M3_MAX, E4M3_MAX)


def test_fp8_block_exact_for_representable_weights():
    gen = torch.Generator().manual_seed(0)
    rows, cols, block = 200, 300, (128, 128)  # partial edge blocks on both axes
    values = _representable_e4m3((rows, cols), gen)
    grid = (2, 3)
    exps = torch.randint(-8, 4, grid, generator=gen).float()
    for i in range(grid[0]):
        for j in range(grid[1]):
            values[i * 128 + 3, j * 128 + 5] = E4M3_MAX  # each block's amax is exactly the e4m3 max
    weight = values * torch.exp2(exps).repeat_interleave(128, 0)[:rows].repeat_interleave(128, 1)[:, :cols]
    q = quantize_fp8_block(weight, block, "ue8m0")
    assert q.format == FP8_BLOCK and q.data.dtype == torch.float8_e4m3fn and q.scale.dtype == torch.float8_e8m0fnu
    assert q.scale.shape == grid
    torch.testing.assert_close(q.scale.float(), torch.exp2(exps), rtol=0, atol=0)
    torch.testing.assert_close(q.dequantize(OPS, torch.float32), weight, rtol=0, atol=0)
    raw_bytes = q.scale.view(torch.uint8)  # the same scales given as raw e8m0 exponent bytes
    torch.testing.assert_close(OPS.dequant_fp8_block(q.data, raw_bytes, *block, torch.float32), weight, rtol=0, atol=0)


@pytest.mark.parametrize("scale_format", ["ue8m0", "fp32"])
def test_fp8_block_error_is_within_e4m3_rounding(scale_format):
    weight = torch.randn(96, 160, generator=torch.Generator().manual_seed(1)) * 0.05
    q = quantize_fp8_block(weight, (32, 64), scale_format)
    assert q.scale.shape == (3, 3)
    scale = q.scale.float().repeat_interleave(32, 0).repeat_interleave(64, 1)[:, :160]
    err = (q.dequantize(OPS, torch.float32) - weight).abs()
    assert (err <= torch.maximum(weight.abs() * 2**-4, scale * 2**-9)).all()
    assert err.max() > 0  # random weights are not all representable: the check above did bite


def test_mxfp4_decodes_known_bytes():
    # byte 0x21: low nibble 1 (0.5) is column 0, high nibble 2 (1.0) column 1; 0xF8: -0 then -6
    packed = torch.tensor([[0x21, 0xF8] + [0x00] * 14], dtype=torch.uint8)
    scale = torch.tensor([[2.0]]).to(torch.float8_e8m0fnu)
    out = OPS.dequant_mxfp4(packed, scale, torch.float32)
    assert out.shape == (1, 32)
    assert out[0, :4].tolist() == [1.0, 2.0, -0.0, -12.0] and (out[0, 4:] == 0).all()
    torch.testing.assert_close(OPS.dequant_mxfp4(packed.view(torch.int8), scale.view(torch.uint8), torch.float32), out)


def test_mxfp4_exact_for_representable_weights():
    gen = torch.Generator().manual_seed(2)
    codes = torch.randint(0, 16, (3, 8, 64), generator=gen)
    codes[..., ::32] = 7  # each 32-block holds a 6.0, so its scale is exactly the chosen power of two
    exps = torch.randint(-6, 3, (3, 8, 2), generator=gen).float()
    weight = torch.tensor(E2M1_VALUES)[codes] * torch.exp2(exps).repeat_interleave(32, -1)
    q = quantize_mxfp4(weight)
    assert q.format == MXFP4 and q.data.shape == (3, 8, 32) and q.scale.shape == (3, 8, 2)
    torch.testing.assert_close(q.scale.float(), torch.exp2(exps), rtol=0, atol=0)
    torch.testing.assert_close(q.dequantize(OPS, torch.float32), weight, rtol=0, atol=0)


def test_mxfp4_error_is_within_e2m1_rounding():
    weight = torch.randn(16, 96, generator=torch.Generator().manual_seed(3))
    q = quantize_mxfp4(weight)
    scale = q.scale.float().repeat_interleave(32, -1)
    err = (q.dequantize(OPS, torch.float32) - weight).abs()
    assert (err <= 0.25 * torch.maximum(weight.abs(), scale) + 1e-7).all()
    assert err.max() > 0


@pytest.mark.parametrize(
    "expert_dtype, block, scale_format",
    [("fp4", (128, 128), "ue8m0"), ("fp8", (32, 32), "fp32")],
    ids=["fp8-ue8m0+mxfp4-experts", "fp8-fp32-scales-32x32"],
)
def test_quantized_checkpoint_matches_its_dequantized_model(tmp_path, expert_dtype, block, scale_format):
    from transformers import DeepseekV4ForCausalLM

    source, _ = build_checkpoint(tmp_path / "source", SMALL, seed=7)
    config = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": list(block),
              "scale_fmt": scale_format, "expert_dtype": expert_dtype}
    quantized_dir, dequantized_dir = quantize_checkpoint(source, tmp_path, v4_layout(expert_dtype, block),
                                                         scale_format, config)
    tokens = random_tokens(60, SMALL["vocab_size"], seed=8)
    load = lambda path: load_model(path, ops=OPS, dtype=torch.float32, device=torch.device("cpu"))  # noqa: E731
    model = load(quantized_dir)

    cfg = DeepseekV4Config.from_file(quantized_dir)
    stored = read_weights(SafetensorsCheckpoint(quantized_dir), cfg, torch.float32, torch.device("cpu")).tensors
    expert = stored["layers.2.ffn.experts.3.w1.weight"]
    assert expert.format == (MXFP4 if expert_dtype == "fp4" else FP8_BLOCK)
    assert expert.data.dtype == (torch.int8 if expert_dtype == "fp4" else torch.float8_e4m3fn)
    assert stored["layers.0.attn.wo_a.weight"].format == FP8_BLOCK
    assert stored["layers.0.attn.wo_a.weight"].block == block
    assert isinstance(stored["layers.0.attn.compressor.wkv.weight"], torch.Tensor)  # unquantized, as released

    got = run_chunked(model, tokens, 7)
    dequantized = run_chunked(load(dequantized_dir), tokens, 60)
    torch.testing.assert_close(got, dequantized, atol=1e-5, rtol=0)
    assert (got - run_chunked(load(source), tokens, 60)).abs().max() > 1e-3  # quantization really happened
    hf = DeepseekV4ForCausalLM.from_pretrained(dequantized_dir, dtype=torch.float32).eval()
    assert_matches_hf(got, hf_logprobs(hf, tokens))


@pytest.mark.parametrize("expert_dtype, block", [("fp4", (32, 32)), ("fp4", (128, 128)), ("fp8", (32, 32)),
                                                 ("fp8", (128, 128))],
                         ids=["mxfp4-experts-32x32", "mxfp4-experts-128x128", "fp8-experts-32x32",
                              "fp8-experts-128x128"])
def test_native_weights_stay_quantized_and_match_the_dequantized_load(tmp_path, monkeypatch, expert_dtype, block):
    """``DEEPINFER_QUANTIZED_WEIGHTS=native``: FP8 projections and MXFP4 experts stay as stored, FP8 experts too
    where each expert's w1 and w3 stack (I = 32: 32-row blocks; 128-row blocks are dequantized); the shared expert
    keeps FP8 when w1 and w3 stack.  The reference ops compute what the model dequantized at load computes
    (documented tolerance: 1e-5 in fp32, measured 0)."""
    source, _ = build_checkpoint(tmp_path / "source", SMALL, seed=7)
    config = {"quant_method": "fp8", "weight_block_size": list(block), "scale_fmt": "ue8m0",
              "expert_dtype": expert_dtype}
    quantized_dir, _ = quantize_checkpoint(source, tmp_path, v4_layout(expert_dtype, block), "ue8m0", config)
    tokens = random_tokens(40, SMALL["vocab_size"], seed=9)
    load = lambda: load_model(quantized_dir, ops=OPS, dtype=torch.float32, device=torch.device("cpu"))  # noqa: E731
    dequantized = run_chunked(load(), tokens, 40)
    monkeypatch.setenv("DEEPINFER_QUANTIZED_WEIGHTS", "native")
    model = load()
    attn, ffn = model.layers[2].attn, model.layers[2].ffn
    assert attn.wo_a.format == FP8_BLOCK and attn.wo_a.block == block and attn.wq_b.format == FP8_BLOCK
    small_blocks = block == (32, 32)  # wq_a (32 rows) fills whole row blocks: it stacks with wkv into one GEMM
    assert attn.w_in.weights[0].format == FP8_BLOCK and attn.w_in.weights[0].shape[0] == (64 if small_blocks else 32)
    if expert_dtype == "fp4":
        assert ffn.w13.dtype == torch.int8 and ffn.scales is not None and ffn.w13.shape == (8, 64, 32)
        assert ffn.fp8_block is None
    elif small_blocks:
        assert ffn.w13.dtype == torch.float8_e4m3fn and ffn.w13.shape == (8, 64, 64) and ffn.fp8_block == block
        assert ffn.scales is not None and ffn.scales[0].shape == (8, 2, 2)
    else:
        assert ffn.scales is None and ffn.w13.dtype == torch.float32  # I = 32 fills no 128-row block
    shared_fp8 = small_blocks
    assert isinstance(ffn.shared[0] if ffn.shared else None, QuantizedTensor) == shared_fp8
    got = run_chunked(model, tokens, 7)
    torch.testing.assert_close(got, dequantized, atol=1e-5, rtol=0)
