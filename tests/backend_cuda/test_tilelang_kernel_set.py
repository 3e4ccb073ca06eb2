"""The TileLang tier of the kernel set without a GPU: manifest entries, the launcher's params, the Triton fallback
when a set has no TileLang cubins, and (slow, where TileLang and nvcc are installed) one variant compiled for
sm_90a.  The GPU side is ``test_moe_mxfp4_tilelang_gpu.py``."""

from __future__ import annotations

import ctypes

import pytest
import torch

pytest.importorskip("triton")

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


def test_the_op_plans_triton_without_tilelang_cubins_and_tilelang_with_them(tmp_path):
    layer = _layer()
    variant = tl_form._variant(CONFIG, 256, 128)
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
        assert up.args["constexprs"] == variant and up.args["wrows"] == 8 * 256 and up.grid == (up.args["nb"], 2)
        assert tl_form.prepare(*layer, arch=SM100A, config=CONFIG) is None  # Hopper only
        fp32 = (layer[0].float(), *layer[1:])
        assert tl_form.prepare(*fp32, arch=SM90A, config=CONFIG) is None  # bf16 only: fp32 runs Triton
    finally:
        use_kernel_set(None)


def test_the_arch_table_keeps_triton_until_a_sweep_picks_tilelang():
    from deepinfer_cuda.arch import MXFP4_TILELANG, mxfp4_tilelang_config

    for (hidden, inter), tiers in MXFP4_TILELANG.items():
        for tier, config in tiers.items():
            per_expert = 0 if tier == "decode" else 96
            assert mxfp4_tilelang_config(SM90A, per_expert, hidden, inter) == config
            assert tl_form.UP_KERNEL.has_aot_variant(tl_form._variant(config, hidden, inter), SM90A)
    assert mxfp4_tilelang_config(SM100A, 0, 5120, 2304) is None


@pytest.mark.slow  # ~75 s on 2 cores; the fast siblings above check entries and planning without compiling
@pytest.mark.skipif(bool(tilelang_unavailable()), reason=tilelang_unavailable() or "ok")
def test_one_variant_compiles_to_an_sm90a_cubin_with_its_launch_recipe():
    entry, cubin = compile_tilelang(tl_form.UP_KERNEL, SM90A, TileLangVariant(tl_form._variant(CONFIG, 5120, 2304)))
    assert _cubin_sm(cubin) == 90 and entry.entry.encode() in cubin
    assert entry.kind == "tilelang" and entry.num_warps == 12 and 0 < entry.shared <= 227 * 1024
    names = dict(entry.signature)
    assert names["w"] == names["xs"] == TENSORMAP and names["blocks"] == "*i32" and names["out"] == "*bf16"
    w, xs = (entry.tensormaps[[n for n, t in entry.signature if t == TENSORMAP].index(k)] for k in ("w", "xs"))
    assert w["dims"] == [2560, "wrows"] and w["box"] == [64, 64] and w["dtype"] == 0  # u8 [E * 2I, H / 2]
    assert xs["dims"] == [5120, "slots"] and xs["box"][1] == 16 and xs["dtype"] == 9  # bf16 rows of a block
