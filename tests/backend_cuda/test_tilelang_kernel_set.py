"""The TileLang tier of the kernel set without a GPU: manifest entries, the launcher's params, the Triton fallback
when a set has no TileLang cubins, and (slow, where TileLang and nvcc are installed) one variant compiled for
sm_90a.  The GPU side is ``test_moe_mxfp4_tilelang_gpu.py``."""

from __future__ import annotations

import ctypes
import math

import pytest
import torch

pytest.importorskip("triton")

from deepinfer.quant.formats import E2M1_VALUES  # noqa: E402
from deepinfer_cuda.arch import SM90A, SM100A, Mxfp4TileLang  # noqa: E402
from deepinfer_cuda.kernel_set.cubin import TENSORMAP, param_storage  # noqa: E402
from deepinfer_cuda.kernel_set.dispatch import use_kernel_set  # noqa: E402
from deepinfer_cuda.kernel_set.manifest import (  # noqa: E402
    KernelEntry,
    Manifest,
    TileLangVariant,  # noqa: E402
    kernel_sources_digest,
)
from deepinfer_cuda.kernel_set.tilelang_compile import compile_tilelang, tilelang_unavailable  # noqa: E402
from deepinfer_cuda.kernels import moe_experts_mxfp4_tl as tl_form  # noqa: E402
from deepinfer_cuda.ops import tilelang_kernels  # noqa: E402
from tests.backend_cuda.test_kernel_set import _cubin_sm  # noqa: E402

CONFIG = Mxfp4TileLang(16, 128, 4)
RECIPE = {"dtype": 0, "dims": [2560, "wrows"], "strides": [2560], "box": [64, 64], "elem_strides": [1, 1],
          "interleave": 0, "swizzle": 0, "l2": 2, "oob": 0}


def _entry(kernel: str, constexprs: dict) -> KernelEntry:
    key = next(k for k in tilelang_kernels() if k.name == kernel).key("sm_90a", constexprs)
    return KernelEntry(kernel=kernel, arch="sm_90a", key=key, entry="main_kernel", cubin="sm_90a/x.cubin",
                       sha256="0", signature=[["blocks", "*i32"], ["w", TENSORMAP], ["limit", "fp32"], ["nb", "i32"]],
                       constexprs=constexprs, num_warps=12, num_stages=0, num_ctas=1, shared=180224, ptx_params=[],
                       hidden_params=[], kind="tilelang", tensormaps=[RECIPE])


def _layer(tokens: int = 3, experts: int = 8, hidden: int = 256, inter: int = 128):
    x = torch.randn(tokens, hidden).bfloat16()
    ids = torch.randint(0, experts, (tokens, 2))
    return (x, ids, torch.rand(tokens, 2), torch.zeros(experts, 2 * inter, hidden // 2, dtype=torch.uint8),
            torch.zeros(experts, 2 * inter, hidden // 32, dtype=torch.uint8),
            torch.zeros(experts, hidden, inter // 2, dtype=torch.uint8),
            torch.zeros(experts, hidden, inter // 32, dtype=torch.uint8), None)


def test_tilelang_entries_round_trip_and_pack_a_tensormap_param():
    entry = _entry("moe_experts_mxfp4_tl_up", {"a": 1})
    manifest = Manifest(triton_version="x", archs=["sm_90a"], kernels=[entry])
    assert Manifest.from_json(manifest.to_json()) == manifest
    storage, plain, maps = param_storage(entry)
    # blocks (u64 address), the 128-byte CUtensorMap alone (no shape / strides, unlike Triton's descriptors),
    # limit (f32), nb (i32); no hidden params
    assert [ctypes.sizeof(s) for s in storage] == [8, 128, 4, 4]
    assert [name for _, name in plain] == ["blocks", "limit", "nb"] and [name for _, name in maps] == ["w"]


def test_the_op_plans_triton_without_tilelang_cubins_and_tilelang_with_them(tmp_path, monkeypatch):
    layer = _layer()
    variant = tl_form._variant(CONFIG, 256, 128, 0)  # the two-multiply decode (the folded one is opt-in)
    try:
        use_kernel_set(None)
        assert tl_form.prepare(*layer, arch=SM90A, config=CONFIG) is None  # no set: the Triton form runs
        entries = [_entry(k.name, variant) for k in tilelang_kernels()]
        Manifest(triton_version=__import__("triton").__version__, archs=["sm_90a"], kernels=entries,
                 kernel_sources=kernel_sources_digest()).write(tmp_path)
        use_kernel_set(tmp_path)
        chain = tl_form.prepare(*layer, arch=SM90A, config=CONFIG)
        assert chain is not None
        names = [k.name for k, _ in chain.steps]
        assert names[-4:] == ["moe_experts_mxfp4_tl_gather",
                              "moe_experts_mxfp4_tl_up", "moe_experts_mxfp4_tl_down", "moe_experts_combine"]
        up = chain.steps[-3][1]
        assert chain.steps[-4][1].args["order"] is up.args["order"]  # gathered after the plan wrote it
        assert chain.steps[-4][1].args["x"] is layer[0]  # x itself: the K order is a view the gather reads
        assert up.args["w"].dtype == torch.uint32 and up.args["w"].shape == (8 * 256, 256 // 8)
        assert up.args["constexprs"] == variant and up.args["wrows"] == 8 * 256 and up.grid == (up.args["nb"], 2)
        assert tl_form.prepare(*layer, arch=SM90A, config=CONFIG, folded=True) is None  # no such cubin in this set
        monkeypatch.setattr("deepinfer_cuda.arch.MXFP4_FOLDED_DECODE", True)  # zero scales fold: asks for it
        assert tl_form.prepare(*layer, arch=SM90A, config=CONFIG) is None
        assert tl_form.prepare(*layer, arch=SM90A, config=CONFIG, require=True).steps[-3][1].args["constexprs"][
            "folded"] == 1
        assert tl_form.prepare(*layer, arch=SM100A, config=CONFIG) is None  # Hopper only
        fp32 = (layer[0].float(), *layer[1:])
        assert tl_form.prepare(*fp32, arch=SM90A, config=CONFIG) is None  # bf16 only: fp32 runs Triton
    finally:
        use_kernel_set(None)


def test_the_k_order_gives_each_fragment_thread_two_whole_words_of_one_scale_group():
    """The RS decode's contract: in a 64-column block, lane q of a wgmma A fragment holds columns 2q, 2q + 1,
    2q + 8, 2q + 9 of each 16-column slice (a register a pair 2q + b, b = 0, 1); the K order maps those 16 to
    stored columns 16q..16q + 15 (bytes 8q..8q + 7: two words, one scale group), each register's pair to codes n
    and n + 4 of one word; the up GEMM's output positions invert it."""
    n = 256
    order = tl_form.k_order(n, torch.device("cpu"))
    columns = torch.arange(n)
    assert torch.equal(order.sort().values, columns)
    assert torch.equal(tl_form.k_position(order), columns)
    assert torch.equal(order, tl_form._word(columns) * 8 + tl_form._nibble(columns))
    assert torch.equal(tl_form._group(columns), order // 32)
    for block in range(n // 64):
        for q in range(4):
            fragment = [64 * block + 16 * s + 8 * h + 2 * q for s in range(4) for h in range(2)]
            stored = order[fragment]
            assert sorted(stored.tolist() + order[[c + 1 for c in fragment]].tolist()) == list(
                range(64 * block + 16 * q, 64 * block + 16 * q + 16))
            assert torch.equal(order[[c + 1 for c in fragment]], stored + 4) and (stored % 8 < 4).all()
    x, w = torch.randn(3, n, dtype=torch.float64), torch.randn(5, n, dtype=torch.float64)
    assert torch.allclose(x[:, order] @ w[:, order].T, x @ w.T)  # K is summed: only its order changed


def _bf16_halves(bits: int) -> tuple[float, float]:
    pair = torch.tensor([bits & 0xFFFF, bits >> 16], dtype=torch.int32).to(torch.int16)
    return tuple(pair.view(torch.bfloat16).float().tolist())


def test_the_decode_places_each_code_pair_as_bf16_values_times_two_to_the_minus_126():
    """``_DEQUANT``'s integer steps for every code pair (n, n + 4) of a word, emulated with its constants: the
    masked, multiplied bits are the bf16 pair of the e2m1 values times 2^-126, which its first bf16x2 multiply
    (by ``TWO_POW_126``) undoes exactly."""
    assert _bf16_halves(tl_form.TWO_POW_126) == (2.0 ** 126, 2.0 ** 126)
    gen = torch.Generator().manual_seed(0)
    for word in [0x76543210, 0xFEDCBA98, *torch.randint(0, 2 ** 32, (64,), generator=gen).tolist()]:
        for n in range(4):
            y = word >> 8 if n & 2 else word
            t = ((y & 0x00F000F0) * 0x104 if n & 1 else (y & 0x000F000F) * 0x1040) & 0xFFFFFFFF
            lo, hi = _bf16_halves(t & tl_form.MAGNITUDE_AND_SIGN)
            for half, code in ((lo, (word >> 4 * n) & 15), (hi, (word >> 4 * (n + 4)) & 15)):
                expected = E2M1_VALUES[code]
                assert half * 2.0 ** 126 == expected, (word, n)
                assert math.copysign(1, half) == math.copysign(1, expected), (word, n)  # -0.0 included


def test_the_folded_decode_multiplies_once_by_two_to_the_126_times_the_scale():
    """``di_e2m1_at_folded``'s one factor, ``(e8m0 + 126) * 0x00800080``, is the bf16 pair 2^(e8m0 - 1) -- the
    placed bits' 2^126 and the scale 2^(e8m0 - 127) in one -- for every scale up to ``FOLD_MAX_E8M0``, and no
    longer a power of two past it (the op then takes the two-multiply decode)."""
    for e8m0 in range(tl_form.FOLD_MAX_E8M0 + 1):
        assert _bf16_halves((e8m0 + 126) * 0x00800080) == (2.0 ** (e8m0 - 1),) * 2, e8m0
    assert _bf16_halves((tl_form.FOLD_MAX_E8M0 + 1 + 126) * 0x00800080) != (2.0 ** tl_form.FOLD_MAX_E8M0,) * 2


def test_the_op_reads_each_scale_tensor_once_to_choose_the_decode():
    small, large = torch.full((4, 8), 120, dtype=torch.uint8), torch.full((4, 8), 120, dtype=torch.uint8)
    large[3, 7] = tl_form.FOLD_MAX_E8M0 + 1
    assert tl_form.scales_fold(small) and not tl_form.scales_fold(large)
    small[0, 0] = 200  # an in-place change (a new version) is read again
    assert not tl_form.scales_fold(small)
    variant = tl_form._variant(Mxfp4TileLang(16, 128, 4, 2), 5120, 2304, 1)
    assert variant["folded"] == 1 and "folded" not in tl_form._variant(Mxfp4TileLang(16, 128, 4, 2), 5120, 2304)
    assert {v.constexprs["folded"] for v in tl_form._aot_variants(SM90A)} == {0, 1}


def test_the_tiers_split_calls_by_slots_an_expert():
    from deepinfer_cuda.arch import MXFP4_TILELANG_CANDIDATES, mxfp4_tilelang_tier

    tiers = [mxfp4_tilelang_tier(tokens * 6, 384) for tokens in (1, 3, 4, 63, 64, 767, 768, 2047, 2048)]
    assert tiers == ["few", "few", "decode", "decode", "batch", "batch", "chunk", "chunk", "prefill"]
    assert set(MXFP4_TILELANG_CANDIDATES) == {"few", "decode", "batch", "chunk", "prefill"}


def test_the_arch_table_keeps_triton_until_a_sweep_picks_tilelang():
    from deepinfer_cuda.arch import MXFP4_TILELANG, mxfp4_tilelang_config

    for (hidden, inter), tiers in MXFP4_TILELANG.items():
        for tier, config in tiers.items():
            slots = {"few": 6, "decode": 96, "batch": 384, "chunk": 6144, "prefill": 96 * 384}[tier]  # 384 experts
            assert mxfp4_tilelang_config(SM90A, slots, 384, hidden, inter) == config
            for folded in (0, 1):
                assert tl_form.UP_KERNEL.has_aot_variant(tl_form._variant(config, hidden, inter, folded), SM90A)
    assert mxfp4_tilelang_config(SM100A, 6, 384, 5120, 2304) is None


_LOOP = """    for (int k_1 = 0; k_1 < n; ++k_1) {
      mbarrier[(k_1 & 3)].wait(((k_1 & 7) >> 2));
      w_f[0] = ((uint*)w_s)[k_1];
      mbarrier[((k_1 & 3) + 12)].arrive();
      mbarrier[((k_1 & 3) + 16)].arrive();
      mbarrier[((k_1 & 3) + 8)].wait(((k_1 & 7) >> 2));
      {
        tl::warpgroup_arrive();
        tl::warpgroup_commit_batch();
        tl::warpgroup_wait<0>();
      }
      mbarrier[((k_1 & 3) + 20)].arrive();
    }"""


def test_the_weight_stage_is_released_after_the_wgmma_wait_not_after_its_loads():
    fixed = tl_form.release_weights_after_mma(_LOOP).split("\n")
    releases = [i for i, line in enumerate(fixed) if ".arrive();" in line]
    assert [fixed[i].strip() for i in releases] == ["mbarrier[((k_1 & 3) + 12)].arrive();",
                                                    "mbarrier[((k_1 & 3) + 16)].arrive();",
                                                    "mbarrier[((k_1 & 3) + 20)].arrive();"]
    assert releases[0] > next(i for i, line in enumerate(fixed) if "warpgroup_wait<0>" in line)
    assert sorted(fixed) == sorted(_LOOP.split("\n"))  # moved, nothing else changed
    one_copy = _LOOP.replace("      mbarrier[((k_1 & 3) + 16)].arrive();\n", "")  # fp8_block_linear_tl's shape
    fixed = tl_form.release_weights_after_mma(one_copy).split("\n")
    assert [line.strip() for line in fixed if ".arrive();" in line] == ["mbarrier[((k_1 & 3) + 12)].arrive();",
                                                                        "mbarrier[((k_1 & 3) + 20)].arrive();"]
    assert fixed.index("      mbarrier[((k_1 & 3) + 12)].arrive();") > fixed.index("        tl::warpgroup_wait<0>();")
    with pytest.raises(RuntimeError, match="one run"):  # a release the fix does not know
        tl_form.release_weights_after_mma(_LOOP.replace("      w_f[0]", "      mbarrier[4].arrive();\n      w_f[0]"))
    with pytest.raises(RuntimeError, match="no wgmma wait"):
        tl_form.release_weights_after_mma(_LOOP.replace("tl::warpgroup_wait<0>();", ""))


@pytest.mark.slow  # ~75 s on 2 cores; the fast siblings above check entries and planning without compiling
@pytest.mark.skipif(bool(tilelang_unavailable()), reason=tilelang_unavailable() or "ok")
def test_one_variant_compiles_to_an_sm90a_cubin_with_its_launch_recipe():
    entry, cubin = compile_tilelang(tl_form.UP_KERNEL, SM90A, TileLangVariant(tl_form._variant(CONFIG, 5120, 2304, 1)))
    assert _cubin_sm(cubin) == 90 and entry.entry.encode() in cubin
    assert entry.kind == "tilelang" and entry.num_warps == 12 and 0 < entry.shared <= 227 * 1024
    names = dict(entry.signature)
    assert names["w"] == names["xs"] == TENSORMAP and names["blocks"] == "*i32" and names["out"] == "*bf16"
    w, xs = (entry.tensormaps[[n for n, t in entry.signature if t == TENSORMAP].index(k)] for k in ("w", "xs"))
    # u32 words [E * 2I, H / 8], 64 rows of 16 words a box, 64-byte swizzle (no bank conflicts for the decoders)
    assert w["dims"] == [640, "wrows"] and w["box"] == [16, 64] and w["dtype"] == 2 and w["swizzle"] == 2
    assert xs["dims"] == [5120, "slots"] and xs["box"][1] == 16 and xs["dtype"] == 9  # bf16 rows of a block


def test_the_gather_puts_x_rows_in_slot_order_and_columns_in_k_order():
    x = torch.randn(5, 256).bfloat16()
    order = torch.tensor([7, 0, 13, 4, 9, 2], dtype=torch.int32)  # slots of top-3 routes: token = slot // 3
    out = torch.empty(6, 256, dtype=torch.bfloat16)
    tl_form.GATHER.launch((1,), None, dict(x=x, order=order, top_k=3, out=out), 0)
    assert torch.equal(out, x[order.long() // 3][:, tl_form.k_order(256, x.device)])
