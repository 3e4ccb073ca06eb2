"""GEMMs on stored weight formats: the references are the dense ops on the dequantized weights (bit for bit), the
FP8 tolerance admits DeepGEMM-style activation quantization and refuses a wrong scale, projections stack only
where one GEMM computes the same thing, and the MoE layer keeps FP8 routed experts FP8 where they stack."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from deepinfer.layers.linear import Projection, stack_rows
from deepinfer.layers.moe import MoE, MoESpec, kept_format
from deepinfer.ops import OpSample, OpTable
from deepinfer.ops.quant_gemm import within_fp8_activation_rounding
from deepinfer.quant import FP8_BLOCK, MXFP4, QuantizedTensor, quantize_fp8_block, quantize_mxfp4

OPS = OpTable()


def _act_quant(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x rounded as an FP8 GEMM reads it: e4m3 with an fp32 scale amax / 448 per ``group`` channels."""
    g = x.float().view(*x.shape[:-1], -1, group)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
    return ((g / scale).to(torch.float8_e4m3fn).float() * scale).view(x.shape)


@pytest.mark.parametrize("block", [(32, 32), (128, 128)])
@pytest.mark.parametrize("scale_format", ["ue8m0", "fp32"])
def test_fp8_block_linear_is_the_dense_gemm_on_the_dequantized_weight(block, scale_format):
    gen = torch.Generator().manual_seed(0)
    q = quantize_fp8_block(torch.randn(200, 256, generator=gen) * 0.06, block, scale_format)  # partial row block
    x = torch.randn(5, 256, generator=gen)
    got = OPS.fp8_block_linear(x, q.data, q.scale, *block)
    assert torch.equal(got, F.linear(x, q.dequantize(OPS, torch.float32)))


def test_fp8_tolerance_admits_activation_rounding_and_refuses_a_wrong_scale():
    gen = torch.Generator().manual_seed(1)
    q = quantize_fp8_block(torch.randn(256, 512, generator=gen) * 512**-0.5, (128, 128), "ue8m0")
    x = torch.randn(64, 512, generator=gen).to(torch.bfloat16)
    sample = OpSample((x, q.data, q.scale, 128, 128))
    expected = OPS.fp8_block_linear(x, q.data, q.scale, 128, 128)
    w = q.dequantize(OPS, torch.float32)
    emulated = F.linear(_act_quant(x), w).to(torch.bfloat16)
    assert not torch.equal(emulated, expected)
    within_fp8_activation_rounding(emulated, expected, sample, torch.bfloat16)
    wrong = q.scale.float().clone()
    wrong[1, 2] *= 2  # one block's scale read wrongly
    bad = OPS.fp8_block_linear(x, q.data, wrong, 128, 128)
    with pytest.raises(AssertionError):
        within_fp8_activation_rounding(bad, expected, sample, torch.bfloat16)


def test_fp8_grouped_linear_is_the_grouped_gemm_on_the_dequantized_weight():
    gen = torch.Generator().manual_seed(2)
    q = quantize_fp8_block(torch.randn(4 * 64, 96, generator=gen), (32, 32), "ue8m0")
    x = torch.randn(3, 4, 96, generator=gen)
    got = OPS.fp8_block_grouped_linear(x, q.data, q.scale, 32, 32)
    assert torch.equal(got, OPS.grouped_linear(x, q.dequantize(OPS, torch.float32)))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_experts_are_the_experts_on_the_dequantized_weights(dtype):
    gen = torch.Generator().manual_seed(3)
    w13, w2 = quantize_mxfp4(torch.randn(8, 64, 64, generator=gen) * 0.5), quantize_mxfp4(torch.randn(8, 64, 32,
                                                                                                      generator=gen))
    x = torch.randn(9, 64, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(9)])
    ids[0] = torch.tensor([5, 5, 1])  # a repeated expert counts twice
    weights = torch.rand(9, 3, generator=gen)
    got = OPS.moe_experts_mxfp4(x, ids, weights, w13.data, w13.scale, w2.data, w2.scale, 10.0)
    dense = OPS.moe_experts(x, ids, weights, w13.dequantize(OPS, dtype), w2.dequantize(OPS, dtype), 10.0)
    assert torch.equal(got, dense)


def _fp8_stack(w: torch.Tensor, block: tuple[int, int], scale_format: str) -> tuple[torch.Tensor, torch.Tensor]:
    q = [quantize_fp8_block(e, block, scale_format) for e in w]
    return torch.stack([e.data for e in q]), torch.stack([e.scale for e in q])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block, scale_format", [((32, 32), "ue8m0"), ((128, 128), "fp32")])
def test_fp8_experts_are_the_experts_on_the_dequantized_weights(dtype, block, scale_format):
    gen = torch.Generator().manual_seed(5)
    w13 = _fp8_stack(torch.randn(8, 64, 96, generator=gen) * 0.5, block, scale_format)  # partial blocks at 128
    w2 = _fp8_stack(torch.randn(8, 96, 32, generator=gen) * 0.2, block, scale_format)
    x = torch.randn(9, 96, generator=gen).to(dtype)
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(9)])
    ids[0] = torch.tensor([5, 5, 1])  # a repeated expert counts twice
    weights = torch.rand(9, 3, generator=gen)
    got = OPS.moe_experts_fp8(x, ids, weights, *w13, *w2, *block, 10.0)
    dense = [torch.stack([OPS.dequant_fp8_block(d, s, *block, dtype) for d, s in zip(*w, strict=True)])
             for w in (w13, w2)]
    assert torch.equal(got, OPS.moe_experts(x, ids, weights, *dense, 10.0))


def _moe_weights(inter: int, block: tuple[int, int], gen: torch.Generator, experts: int = 8, hidden: int = 64
                 ) -> tuple[dict[str, QuantizedTensor], dict[str, torch.Tensor]]:
    """(FP8 weights as stored, every weight dense) of a small MoE layer: routed and shared experts FP8."""
    stored = {}
    for p in [f"experts.{e}." for e in range(experts)] + ["shared_experts."]:
        for w, shape in (("w1", (inter, hidden)), ("w3", (inter, hidden)), ("w2", (hidden, inter))):
            stored[p + w + ".weight"] = quantize_fp8_block(torch.randn(shape, generator=gen) * 0.3, block, "ue8m0")
    dense = {n: q.dequantize(OPS, torch.float32) for n, q in stored.items()}
    dense["gate.weight"] = torch.randn(experts, hidden, generator=gen)
    dense["gate.bias"] = torch.randn(experts, generator=gen) * 0.1
    return stored, dense


def test_moe_keeps_fp8_experts_fp8_and_matches_the_dequantized_layer():
    """Routed experts FP8 with w1's rows in whole blocks stay FP8 ([E, 2I, H] codes, stacked scales) and run through
    ``moe_experts_fp8``; the layer computes what the same weights dequantized at load compute."""
    gen = torch.Generator().manual_seed(6)
    stored, dense = _moe_weights(32, (32, 32), gen)
    spec = MoESpec(n_routed_experts=8, top_k=3, routed_scaling_factor=1.5, score_func="sqrtsoftplus",
                   swiglu_limit=10.0)
    called = []

    class Spy(OpTable):
        def __getattribute__(self, name):
            if name.startswith("moe_experts"):
                called.append(name)
            return super().__getattribute__(name)

    kept = MoE(Spy(), spec, "", dense.__getitem__, weight=lambda n: stored.get(n, dense[n]))
    assert kept.w13.dtype == torch.float8_e4m3fn and kept.w13.shape == (8, 64, 64) and kept.fp8_block == (32, 32)
    assert kept.scales is not None and kept.scales[0].shape == (8, 2, 2) and kept.scales[1].shape == (8, 2, 1)
    assert kept.shared_id is None and isinstance(kept.shared[0], QuantizedTensor)  # its own FP8 MLP
    dequantized = MoE(OPS, spec, "", dense.__getitem__)
    assert dequantized.w13.dtype == torch.float32
    x, input_ids = torch.randn(11, 64, generator=gen), torch.arange(11)
    got = kept(x, input_ids)
    assert called == ["moe_experts_fp8"]
    torch.testing.assert_close(got, dequantized(x, input_ids), atol=1e-5, rtol=1e-5)


def test_fp8_experts_whose_w1_and_w3_scales_do_not_stack_are_dequantized():
    gen = torch.Generator().manual_seed(7)
    stored, dense = _moe_weights(48, (32, 32), gen)  # I = 48: w1's last row block is partial
    assert kept_format(list(stored.values())) is None
    spec = MoESpec(8, 2, 1.0, "softmax", None)
    moe = MoE(OPS, spec, "", dense.__getitem__, weight=lambda n: stored.get(n, dense[n]))
    assert moe.scales is None and moe.w13.dtype == torch.float32
    mixed = list(stored.values())[:3] + [quantize_mxfp4(torch.randn(64, 64, generator=gen))]
    assert kept_format(mixed) is None and kept_format(mixed[3:]) == MXFP4
    whole = [quantize_fp8_block(torch.randn(32, 64, generator=gen), (32, 32), fmt) for fmt in ("ue8m0", "fp32")]
    assert kept_format(whole) is None and kept_format(whole[:1]) == kept_format(whole[1:]) == FP8_BLOCK


def test_projections_stack_only_into_a_gemm_that_computes_the_same():
    gen = torch.Generator().manual_seed(4)
    fp8 = [quantize_fp8_block(torch.randn(n, 64, generator=gen), (32, 32), "ue8m0") for n in (64, 40, 32)]
    dense = torch.randn(8, 64, generator=gen)
    # 64 rows fill whole blocks, so the 40-row one follows; the 40-row one does not, so the 32-row one cannot
    stacked = stack_rows([*fp8, dense])
    assert [w.shape[0] for w in stacked] == [104, 32, 8] and stacked[0].format == FP8_BLOCK
    wide = quantize_fp8_block(torch.randn(32, 64, generator=gen), (128, 128), "ue8m0")
    assert len(stack_rows([fp8[0], wide])) == 2  # other block size
    proj = Projection([*fp8, dense])
    x = torch.randn(3, 64, generator=gen)
    expected = torch.cat([F.linear(x, w.dequantize(OPS, torch.float32)) for w in fp8] + [F.linear(x, dense)], -1)
    torch.testing.assert_close(proj(OPS, x), expected, atol=1e-5, rtol=1e-5)
    assert proj.sizes == [64, 40, 32, 8]


def test_a_stacked_projection_is_read_alone_through_a_view():
    """``Projection.part``: each part's weight as it was given (FP8 data and scale rows alike), viewing the
    stacked tensors, never a copy (the DSpark drafter reads ``wkv`` of ``wq_a | wkv`` so)."""
    gen = torch.Generator().manual_seed(5)
    parts = [quantize_fp8_block(torch.randn(n, 64, generator=gen), (32, 32), "ue8m0") for n in (64, 40)]
    proj = Projection([*parts, torch.randn(8, 64, generator=gen)])
    stack = proj.weights[0]
    for i, given in enumerate(parts):
        part = proj.part(i)
        assert isinstance(part, QuantizedTensor) and (part.shape, part.block) == (given.shape, given.block)
        assert torch.equal(part.data.view(torch.uint8), given.data.view(torch.uint8))
        assert torch.equal(part.scale.view(torch.uint8), given.scale.view(torch.uint8))
        for view, stacked in ((part.data, stack.data), (part.scale, stack.scale)):
            assert view.untyped_storage().data_ptr() == stacked.untyped_storage().data_ptr()
    dense = proj.part(2)
    assert torch.equal(dense, proj.weights[1]) and dense._base is proj.weights[1]
