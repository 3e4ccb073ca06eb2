"""V4.1 in its released weight format: dense FP8 e4m3 with ue8m0 block scales (32x32 for some tensors, 128x128
for others: the block is read off each tensor's shapes), routed experts MXFP4 (32-element blocks, e8m0), Engram
tables FP8 with one ue8m0 scale per 32 columns.  Built from the tiny_b fixture's weights, it must give the same
logprobs as its dequantized twin, and layouts that fit no format are refused naming the tensor."""

from __future__ import annotations

import pytest
import torch

from deepinfer.models import load_model
from deepinfer.models.checkpoint import CheckpointError, SafetensorsCheckpoint
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.weights import read_weights
from deepinfer.ops import OpTable
from deepinfer.quant import MXFP4, QuantizedTensor
from tests.support.model_runs import run_chunked
from tests.support.quantized import V41_RELEASED as RELEASED
from tests.support.quantized import quantize_checkpoint, rewrite_checkpoint
from tests.support.quantized import v41_released_layout as released_layout
from tests.support.v4_fixtures import single_thread  # noqa: F401  (autouse)
from tests.support.v41_fixtures import FIXTURES, references


def _load(path):
    return load_model(path, ops=OpTable(), dtype=torch.float32, device=torch.device("cpu"))


def _stored(path):
    """The checkpoint's tensors as the reader gives them, quantized ones as stored."""
    cfg = DeepseekV41Config.from_file(path)
    return read_weights(SafetensorsCheckpoint(path), cfg, torch.float32, torch.device("cpu"))[0]


@pytest.fixture(scope="module")
def released(tmp_path_factory):
    target = tmp_path_factory.mktemp("released")
    return quantize_checkpoint(FIXTURES / "tiny_b", target, released_layout, quantization_config=RELEASED)


def test_released_format_matches_its_dequantized_twin(released):
    quantized_dir, twin_dir = released
    model = _load(quantized_dir)
    stored = _stored(quantized_dir)
    assert stored["layers.4.ffn.experts.1.w1.weight"].format == MXFP4
    assert stored["layers.4.attn.wq_b.weight"].block == (32, 32)
    assert stored["layers.5.attn.wq_b.weight"].block == (128, 128)
    table = model.layers[2].engram.weights.table  # gathered by row, never dequantized whole
    assert table.dtype == torch.float8_e4m3fn
    tokens = references("tiny_b")[0].tokens
    got = run_chunked(model, tokens, 37)
    torch.testing.assert_close(got, run_chunked(_load(twin_dir), tokens, len(tokens)), atol=1e-5, rtol=0)
    original = run_chunked(_load(FIXTURES / "tiny_b"), tokens, len(tokens))
    assert float((got - original).abs().max()) > 1e-3  # the quantization really happened


def test_fp8_engram_lookup_in_one_op_gives_the_three_op_logits_bit_for_bit(released, monkeypatch):
    """``ops.embedding_fp8`` (the default local lookup) against the gather-codes, gather-scales, dequantize
    composition it replaced (still the path of a shard exchange): the same logits, every bit."""
    from deepinfer.models.deepseek_v41.engram import local_rows

    ops, calls = OpTable(), []
    one_op = ops.embedding_fp8

    def counted(*args):
        calls.append(args[1].shape)
        return one_op(*args)

    monkeypatch.setattr(ops, "embedding_fp8", counted)
    model = load_model(released[0], ops=ops, dtype=torch.float32, device=torch.device("cpu"))
    tokens = references("tiny_b")[0].tokens[:24]
    fused = run_chunked(model, tokens, 11)
    assert calls, "the FP8 table's lookups went through ops.embedding_fp8"
    for layer in model.layers:
        if layer.engram is not None:
            layer.engram.gather = local_rows
    assert torch.equal(run_chunked(model, tokens, 11), fused)


def test_a_scale_grid_that_fits_no_block_is_refused(released, tmp_path):
    name = "layers.4.attn.wq_b.scale"

    def change(t):
        t[name] = t[name][:3].contiguous()  # 160x32 takes 5x1 scales in 32x32 blocks, 2x1 in 128x128: not 3x1

    path = rewrite_checkpoint(released[0], tmp_path / "bad", change)
    with pytest.raises(CheckpointError, match=r"layers.4.attn.wq_b.weight: FP8 dense projection of dense shape "
                                              r"\(160, 32\) stored as data \(160, 32\) with scales \(3, 1\); the "
                                              r"role needs data \(160, 32\) and scales \(5, 1\) \(32x32 blocks\) or "
                                              r"\(2, 1\) \(128x128 blocks\)"):
        _load(path)


def test_mxfp4_scales_read_as_16_element_blocks_are_refused(released, tmp_path):
    """A scale per 16 elements (NVFP4's block) must not be read as MXFP4: the shapes check names both."""
    name = "layers.4.ffn.experts.1.w1.scale"

    def change(t):
        t[name] = t[name].repeat_interleave(2, dim=1).contiguous()

    path = rewrite_checkpoint(released[0], tmp_path / "bad", change)
    with pytest.raises(CheckpointError, match=r"layers.4.ffn.experts.1.w1.weight: MXFP4 routed expert of dense shape "
                                              r"\(16, 64\) stored as data \(16, 32\) with scales \(16, 4\); the role "
                                              r"needs data \(16, 32\) \(two e2m1 a byte\) and scales \(16, 2\)"):
        _load(path)


def test_native_weights_stay_fp8_and_match_the_dequantized_load(released, monkeypatch):
    """``DEEPINFER_QUANTIZED_WEIGHTS=native``: the FP8 projections (both block sizes) stay as stored and run through
    ``fp8_block_linear``; on the reference ops the logprobs equal those of the same checkpoint dequantized at load
    (documented tolerance 1e-5 in fp32).  tiny_b's experts mix MXFP4 (w1, w3) and FP8 (w2: K = 16), so they are
    dequantized (the MXFP4 expert path runs in V4's test, whose dims fit it)."""
    quantized_dir, _ = released
    tokens = references("tiny_b")[0].tokens
    dequantized = run_chunked(_load(quantized_dir), tokens, len(tokens))
    monkeypatch.setenv("DEEPINFER_QUANTIZED_WEIGHTS", "native")
    model = _load(quantized_dir)
    assert isinstance(model.layers[4].attn.wq_b, QuantizedTensor) and model.layers[4].attn.wq_b.block == (32, 32)
    assert model.layers[5].attn.wo_a.block == (128, 128)
    assert isinstance(model.layers[4].attn.indexer.wq_b, QuantizedTensor)
    assert model.layers[4].ffn.scales is None  # mixed expert formats: dequantized
    got = run_chunked(model, tokens, 37)
    torch.testing.assert_close(got, dequantized, atol=1e-5, rtol=0)
