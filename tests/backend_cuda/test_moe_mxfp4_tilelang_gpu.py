"""The TileLang MXFP4 expert GEMMs on a GPU (H100 / H200): against core's reference, with no host sync, and replayed
from a CUDA graph.  Skipped without a GPU or without the TileLang cubins in the active kernel set (built where
TileLang and nvcc are installed: ``python -m deepinfer_cuda.kernel_set.build --arch sm_90a``)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

E, H, INTER, K = 16, 5120, 2304, 6  # V4.1-Flash's expert dims (the cubins'); 16 experts keep the test small


def _layer(tokens: int, seed: int, E: int = E, scales: tuple[int, int] = (118, 122)):
    """A layer whose e8m0 scale bytes are drawn from ``scales`` (lo, hi): trained weights' range by default."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    lo, hi = scales

    def u8(*shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, dtype=torch.uint8, device="cuda", generator=gen)

    x = torch.randn(tokens, H, device="cuda", generator=gen).bfloat16()
    ids = torch.stack([torch.randperm(E, device="cuda", generator=gen)[:K] for _ in range(tokens)])
    weights = torch.rand(tokens, K, device="cuda", generator=gen)
    return (x, ids, weights, u8(E, 2 * INTER, H // 2), u8(E, 2 * INTER, H // 32, lo=lo, hi=hi), u8(E, H, INTER // 2),
            u8(E, H, INTER // 32, lo=lo, hi=hi), 10.0)


def _chain(op, config):
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import moe_experts_mxfp4_tl as tl_form

    chain = tl_form.prepare(*op, arch=SM90A, config=config)
    if chain is None:
        pytest.skip("the active kernel set has no TileLang cubins for this variant")
    return chain


@pytest.mark.parametrize("tokens", [1, 16, 100])
def test_tilelang_forms_match_the_reference_without_syncs_and_replay(tokens):
    from deepinfer.ops.quant_gemm import moe_experts_mxfp4 as reference
    from deepinfer_cuda.arch import MXFP4_TILELANG_CANDIDATES

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TileLang forms are SM90's")
    op = _layer(tokens, tokens)
    ref = reference(*op).float()
    triton_err = None
    for config in {c for tier in MXFP4_TILELANG_CANDIDATES.values() for c in tier}:
        out = _chain(op, config).run(0).float()
        err = ((out - ref).norm() / ref.norm()).item()
        if triton_err is None:
            from deepinfer_cuda.arch import SM90A
            from deepinfer_cuda.kernels import moe_experts_mxfp4 as triton_form

            tri = triton_form.prepare(*op, arch=SM90A).run(0).float()
            triton_err = ((tri - ref).norm() / ref.norm()).item()
        assert err < max(2 * triton_err, 2e-3), (config, err, triton_err)  # bf16 rounding of the same values
        torch.cuda.set_sync_debug_mode("error")
        try:
            _chain(op, config).run(0)
        finally:
            torch.cuda.set_sync_debug_mode(0)
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            _chain(op, config).run(0)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            replayed = _chain(op, config).run(0)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(replayed.float(), out), config
        from deepinfer_cuda.arch import SM90A
        from deepinfer_cuda.kernels import moe_experts_mxfp4_tl as tl_form

        for folded in (False, True):  # the two-multiply and the folded decode: the same exact values
            chain = tl_form.prepare(*op, arch=SM90A, config=config, folded=folded)
            assert chain is not None and torch.equal(chain.run(0).float(), out), (config, folded)


def test_scales_past_two_take_the_two_multiply_decode(monkeypatch):
    """A layer with e8m0 scales above ``FOLD_MAX_E8M0`` (scales 2^-3 .. 2^5): the op reads the scales once, plans
    the two-multiply decode, and matches the reference as closely as Triton's form does."""
    from deepinfer.ops.quant_gemm import moe_experts_mxfp4 as reference
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import moe_experts_mxfp4 as triton_form
    from deepinfer_cuda.kernels import moe_experts_mxfp4_tl as tl_form

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TileLang forms are SM90's")
    op = _layer(16, 3, scales=(124, 133))
    assert not tl_form.scales_fold(op[4])
    monkeypatch.setattr("deepinfer_cuda.arch.MXFP4_FOLDED_DECODE", True)  # on: the scales still refuse it
    chain = _chain(op, None)
    assert chain.steps[-3][1].args["constexprs"]["folded"] == 0
    ref = reference(*op).float()
    err = ((chain.run(0).float() - ref).norm() / ref.norm()).item()
    tri = triton_form.prepare(*op, arch=SM90A).run(0).float()
    assert err < max(2 * ((tri - ref).norm() / ref.norm()).item(), 2e-3), err


def test_two_programs_an_sm_give_the_same_bits_run_after_run():
    """An ``occupancy`` 2 form must give the bits of its first run every run, and those of its one-program sibling
    where the set has it (the same code); a weight stage released before the wgmma read it raced here (44 of 100
    runs differed at 64 tokens of a 384-expert layer)."""
    from deepinfer_cuda.arch import MXFP4_TILELANG_CANDIDATES, SM90A
    from deepinfer_cuda.kernels import moe_experts_mxfp4_tl as tl_form

    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the TileLang forms are SM90's")
    shared = {c for tier in MXFP4_TILELANG_CANDIDATES.values() for c in tier if c.occupancy > 1}
    assert shared, "no occupancy-2 candidate to check"
    op = _layer(256, 7, E=128)  # 12 slots an expert: programs of one expert share SMs
    for config in shared:
        expected = _chain(op, config).run(0)
        sibling = tl_form.prepare(*op, arch=SM90A, config=dataclasses.replace(config, occupancy=1))
        if sibling is not None:
            assert torch.equal(sibling.run(0), expected), config
        for _ in range(20):
            assert torch.equal(_chain(op, config).run(0), expected), config
