"""The TileLang FP8 GEMM (``kernels/fp8_block_linear_tl.py``) without a GPU: its decode's integer steps against
the e4m3 values, the candidates' tiles against the shapes they are built for, and how ``fp8_block_linear`` plans
it (TileLang where the arch table names a form and the kernel set holds it, Triton otherwise).  The kernel itself
is checked on the GPU host by ``test_fp8_tilelang_gpu.py``."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_cuda import arch  # noqa: E402
from deepinfer_cuda.arch import SM90A, SM100A, Fp8TileLang, fp8_tilelang_tier  # noqa: E402
from deepinfer_cuda.kernel_set.dispatch import use_kernel_set  # noqa: E402
from deepinfer_cuda.kernel_set.manifest import KernelEntry, Manifest, kernel_sources_digest  # noqa: E402
from deepinfer_cuda.kernels import fp8_block_linear, fp8_block_linear_tl  # noqa: E402

FP8_CODES = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()


def _bf16_halves(bits: int) -> tuple[float, float]:
    pair = torch.tensor([bits & 0xFFFF, bits >> 16], dtype=torch.int32).to(torch.int16)
    return tuple(pair.view(torch.bfloat16).float().tolist())


def _byte_perm(word: int, selector: int) -> int:
    """CUDA's ``__byte_perm(word, 0, selector)``: selector nibble i picks byte i of the result (4..7: zero)."""
    out = 0
    for i in range(4):
        pick = (selector >> 4 * i) & 7
        out |= ((word >> 8 * pick) & 0xFF if pick < 4 else 0) << 8 * i
    return out


def test_the_decode_places_each_code_pair_as_bf16_values_times_two_to_the_minus_120():
    """``_DEQUANT``'s integer steps for both pairs of a word's bytes and every code (NaN codes aside): the placed
    bits are the bf16 pair of the e4m3 values times 2^-120 (subnormal codes as bf16 subnormals), which the first
    bf16x2 multiply (by ``TWO_POW_120``) undoes exactly; the halves keep -0."""
    tl = fp8_block_linear_tl
    assert _bf16_halves(tl.TWO_POW_120) == (2.0 ** 120, 2.0 ** 120)
    codes = [c for c in range(256) if not math.isnan(FP8_CODES[c])]
    for a in codes:
        for b in codes[a % 7::7]:  # every code in each byte, ~1/7 of the pairs
            for h in range(2):
                word = (a << 16 * h) | (b << (16 * h + 8)) | (0x5A << 16 * (1 - h))
                t = _byte_perm(word, 0x3424 if h else 0x1404)
                lo, hi = _bf16_halves((t & tl.SIGN) | ((t >> 4) & tl.MAGNITUDE))
                for half, code in ((lo, a), (hi, b)):
                    assert half * 2.0 ** 120 == FP8_CODES[code], (word, h, code)
                    assert math.copysign(1, half) == math.copysign(1, FP8_CODES[code])


def test_the_folded_decode_multiplies_once_by_two_to_the_120_times_the_scale():
    """``di_e4m3_at_folded``'s one factor, ``(e8m0 + 120) * 0x00800080``, is the bf16 pair 2^(e8m0 - 7) -- the
    placed bits' 2^120 and the block's scale in one -- for every scale byte up to ``FOLD_MAX_E8M0``, and no longer
    a power of two past it (the plan then takes the two-multiply decode)."""
    tl = fp8_block_linear_tl
    for e8m0 in range(tl.FOLD_MAX_E8M0 + 1):
        assert _bf16_halves((e8m0 + 120) * 0x00800080) == (2.0 ** (e8m0 - 7),) * 2, e8m0
    assert _bf16_halves((tl.FOLD_MAX_E8M0 + 1 + 120) * 0x00800080) != (2.0 ** (tl.FOLD_MAX_E8M0 - 6),) * 2
    assert {v.constexprs["folded"] for v in tl._aot_variants(SM90A)} == {0, 1}


def test_every_candidate_fits_its_shape_and_the_tiers_split_by_rows():
    assert [fp8_tilelang_tier(r) for r in (1, 2, 16, 17, 63, 64, 65, 255, 256, 1024)] == [
        None, "decode", "decode", "batch", "batch", "batch", "chunk", "chunk", "prefill", "prefill"]
    for (n, k, groups, block), tiers in arch.FP8_TILELANG_CANDIDATES.items():
        assert (n, k, groups) in fp8_block_linear.AOT_SHAPES and block == 32
        for name, tier in tiers.items():
            for t in tier:
                assert n % 128 == 0 and k % (t.block_k * t.split) == 0 and k // (t.block_k * t.split) >= 2
                if name != "prefill":  # decode: one row tile, so the weight tiles and splits must fill the SMs
                    assert 64 <= n * groups // 128 * t.split <= 8 * 132


def test_every_adopted_tile_is_a_built_candidate_of_its_tier():
    for shape, tiers in arch.FP8_TILELANG.items():
        for tier, tiles in tiers.items():
            assert tiles in arch.fp8_tilelang_candidates(shape, tier), (shape, tier)
    assert arch.fp8_tilelang_candidates((1792, 5120, 1, 32), "chunk") == \
        arch.FP8_TILELANG_CANDIDATES[(1792, 5120, 1, 32)]["prefill"]  # one set of cubins for both


def _entry(constexprs: dict) -> KernelEntry:
    key = fp8_block_linear_tl.KERNEL.key("sm_90a", constexprs)
    return KernelEntry(kernel="fp8_block_linear_tl", arch="sm_90a", key=key, entry="main_kernel",
                       cubin="sm_90a/x.cubin", sha256="0", signature=[["x", "*bf16"]], constexprs=constexprs,
                       num_warps=12, num_stages=0, num_ctas=1, shared=0, ptx_params=[], hidden_params=[],
                       kind="tilelang", tensormaps=[])


def test_the_op_plans_tilelang_where_the_table_and_the_kernel_set_have_it(tmp_path, monkeypatch):
    n, k, block = 256, 512, 32
    tiles = Fp8TileLang(16, 128, 4, 2, 2)
    monkeypatch.setitem(arch.FP8_TILELANG, (n, k, 1, block), {"decode": tiles})
    x = torch.randn(3, k).bfloat16()
    weight = torch.zeros(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.full((n // block, k // block), 120, dtype=torch.uint8).view(torch.float8_e8m0fnu)

    def kernels(**kw):
        return [kernel.name for kernel, _ in fp8_block_linear.plan_gemm(x, weight, scale, block, block, 1, arch=SM90A,
                                                                        interpreted=False, **kw).steps]
    try:
        use_kernel_set(None)
        assert kernels()[0] == "fp8_block_linear"  # a set without the cubin: Triton
        Manifest(triton_version=__import__("triton").__version__, archs=["sm_90a"],
                 kernels=[_entry(fp8_block_linear_tl._variant(tiles, n, k, 1, block))],
                 kernel_sources=kernel_sources_digest()).write(tmp_path)
        use_kernel_set(tmp_path)
        assert kernels() == ["fp8_block_linear_tl", "split_k_sum"]
        chain = fp8_block_linear.plan_gemm(x, weight, scale, block, block, 1, arch=SM90A, interpreted=False)
        gemm = chain.steps[0][1]
        assert gemm.grid == (n // 128 * 2, 1, 1) and gemm.args["m"] == 3
        assert gemm.args["w"].dtype == torch.uint32 and gemm.args["w"].shape == (n, k // 4)
        assert gemm.args["y"].shape == (2, 3, n) and gemm.args["y"].dtype == torch.float32
        assert kernels(fixed=True)[0] == "fp8_block_linear"  # batch invariant: the fixed Triton tiles
        monkeypatch.setattr(arch, "FP8_FOLDED_DECODE", True)  # scales of 2^-7 fold: it asks for the folded cubin
        assert kernels()[0] == "fp8_block_linear"
        assert fp8_block_linear_tl.plan(x, weight, scale, torch.empty(3, n), n, k, 1, block, block, arch=SM90A,
                                        require=True)[0].args["constexprs"]["folded"] == 1
        monkeypatch.setattr(arch, "FP8_FOLDED_DECODE", False)
        assert fp8_block_linear.plan_gemm(x, weight, scale, block, block, 1, arch=SM100A,
                                          interpreted=False).steps[0][0].name != "fp8_block_linear_tl"
        x32 = x.float()
        assert fp8_block_linear.plan_gemm(x32, weight, scale, block, block, 1, arch=SM90A,
                                          interpreted=False).steps[0][0].name == "fp8_block_linear"
        rows = torch.randn(70, k).bfloat16()  # the chunk tier, which the table does not name here: Triton
        assert fp8_block_linear.plan_gemm(rows, weight, scale, block, block, 1, arch=SM90A,
                                          interpreted=False).steps[0][0].name != "fp8_block_linear_tl"
    finally:
        use_kernel_set(None)
