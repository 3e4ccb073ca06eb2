"""The W4A8 MXFP4 experts on a GPU (H100 / H200): tight against a torch emulation of their scheme (the weights exact,
the activations' e4m3 rows), within the activations' rounding of core's exact reference, the quantizer bit for bit
against its torch oracle, the same bits run after run, no host sync, and CUDA-graph replay.  Skipped without a GPU
or without the cubins."""

from __future__ import annotations

import pytest
import torch

from tests.backend_cuda.test_moe_mxfp4_tilelang_gpu import INTER, _layer
from tests.support.aot_jit import assert_graph_replays_without_syncs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _emulation(x, ids, weights, w13, w13_scale, w2, w2_scale, limit):
    """The W4A8 op by torch ops: x's rows and each slot's ``act`` as e4m3 with a power-of-two scale, the weights
    exact, fp32 sums, the kernels' bf16 roundings."""
    from deepinfer.ops.quant import dequant_mxfp4
    from deepinfer_cuda.kernels.fp8_e4m3_rows import reference as quantize

    def rows(t):
        codes, scales = quantize(t)
        return codes.float() * scales[:, None]

    bf16 = torch.bfloat16
    xq = rows(x)
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for j in range(ids.shape[1]):
        for e in ids[:, j].unique().tolist():
            t = (ids[:, j] == e).nonzero().flatten()
            h = (xq[t] @ dequant_mxfp4(w13[e], w13_scale[e], torch.float32).T).to(bf16).float()
            g, u = h[:, :INTER].clamp(max=limit), h[:, INTER:].clamp(-limit, limit)
            act = ((g / (1 + torch.exp(-g))).to(bf16).float() * u).to(bf16)
            y = (rows(act) @ dequant_mxfp4(w2[e], w2_scale[e], torch.float32).T).to(bf16).float()
            out[t] += (y * weights[t, j, None]).to(bf16).float()
    return out.to(bf16)


def _chain(op, config=None):
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import moe_experts_mxfp4_w4a8_tl as w4a8

    chain = w4a8.prepare(*op, arch=SM90A, config=config)
    if chain is None:
        pytest.skip("the active kernel set has no W4A8 cubins for this variant")
    return chain


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


@pytest.mark.parametrize("tokens", [1, 16, 100])
def test_w4a8_tracks_its_emulation_and_the_exact_op_within_the_activation_rounding(tokens):
    from deepinfer.ops.quant_gemm import moe_experts_mxfp4 as reference
    from deepinfer_cuda.arch import MXFP4_W4A8_CANDIDATES

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the W4A8 forms are SM90's")
    op = _layer(tokens, tokens)
    exact, emulated = reference(*op), _emulation(*op)
    budget = _rel(emulated, exact)
    assert 1e-3 < budget < 6e-2, budget  # the activations' e4m3 rounding, not more
    for config in {c for tier in MXFP4_W4A8_CANDIDATES.values() for c in tier}:
        out = _chain(op, config).run(0)
        assert _rel(out, emulated) < 0.15 * budget, (config, _rel(out, emulated), budget)
        for _ in range(5):  # two or three programs an SM: the same bits every run
            assert torch.equal(_chain(op, config).run(0), out), config
        assert_graph_replays_without_syncs([(str(config), op)], lambda _, args, c=config: _chain(args, c).run(0),
                                           max_rows=128)


def test_the_quantizer_matches_its_torch_oracle_bit_for_bit():
    from deepinfer_cuda.kernels import fp8_e4m3_rows as q
    from deepinfer_cuda.kernels import moe_experts_mxfp4_w4a8_tl as w4a8

    x = (torch.randn(9, 5120, device="cuda") * torch.logspace(-30, 30, 9, device="cuda")[:, None]).bfloat16()
    x[2] = 0
    order = torch.randperm(54, device="cuda").to(torch.int32)
    cols = w4a8.k_order(5120, x.device)
    launch, codes, scales = q.plan(x, 54, order, cols, 6)
    launch.run(q.KERNEL, 0)
    want_codes, want_scales = q.reference(x[order.long() // 6][:, cols.long()])
    assert torch.equal(codes.view(torch.uint8), want_codes.view(torch.uint8)) and torch.equal(scales, want_scales)
