"""Kernel sets without a GPU: the AOT builder's manifest and cubins, and the cubin-or-JIT decision."""

from __future__ import annotations

import dataclasses
import json
import logging
import struct
import sys

import pytest
import torch

triton = pytest.importorskip("triton")

from deepinfer.ops import OpTable  # noqa: E402
from deepinfer_cuda.arch import ARCHS, SM90A, SUPPORTED_CAPABILITIES, rms_norm_config  # noqa: E402
from deepinfer_cuda.kernel_set.build import build_kernel_set  # noqa: E402
from deepinfer_cuda.kernel_set.dispatch import KernelSet, TritonKernel  # noqa: E402
from deepinfer_cuda.kernel_set.manifest import MANIFEST_NAME, Manifest, sha256_bytes, variant_key  # noqa: E402
from deepinfer_cuda.kernel_set.specialize import signature_of  # noqa: E402
from deepinfer_cuda.kernels import rms_norm as rms_mod  # noqa: E402
from deepinfer_cuda.ops import aot_kernels, batch_invariant_ops, kernels_by_op, overrides  # noqa: E402
from deepinfer_cuda.override import override  # noqa: E402
from deepinfer_cuda.plugin import CudaBackend  # noqa: E402

EM_CUDA = 190


def _cubin_sm(data: bytes) -> int:
    """SM number from a cubin's ELF header: e_flags bits 8-15 in the CUDA 13 ELF ABI (OSABI 0x41), else bits 0-7."""
    assert data[:4] == b"\x7fELF" and data[4] == 2, "not a 64-bit ELF"
    assert struct.unpack_from("<H", data, 18)[0] == EM_CUDA, "ELF machine is not CUDA"
    flags = struct.unpack_from("<I", data, 48)[0]
    return (flags >> 8) & 0xFF if data[7] == 0x41 else flags & 0xFF


@pytest.fixture(scope="module")
def sm90_set(tmp_path_factory):
    out = tmp_path_factory.mktemp("kernel_set")
    return out, build_kernel_set(out, [SM90A], ["rms_norm"])


def test_build_writes_manifest_and_cubins_for_sm90a(sm90_set):
    out, manifest = sm90_set
    expected = rms_mod._aot_variants(SM90A)
    assert manifest.triton_version == triton.__version__ and manifest.archs == ["sm_90a"]
    assert len(manifest.kernels) == len(expected) > 0
    assert Manifest.read(out) == manifest  # the JSON round-trips exactly
    param_names = [p.name for p in rms_mod.KERNEL.params]
    keys = set()
    for entry in manifest.kernels:
        data = (out / entry.cubin).read_bytes()
        assert sha256_bytes(data) == entry.sha256
        assert _cubin_sm(data) == 90, entry.cubin
        assert entry.entry.encode() in data  # the symbol cuModuleGetFunction will look up
        assert entry.arch == "sm_90a" and entry.num_ctas == 1 and entry.shared >= 0
        assert entry.launch_pdl  # a programmatic dependent (kernels/grid_dependency.py)
        # Launch ABI: explicit params in the kernel's parameter order, then Triton's hidden pointers.
        names = [n for n, _ in entry.signature]
        assert names == [n for n in param_names if n in names]
        assert set(names) | set(entry.constexprs) == set(param_names)
        assert len(entry.ptx_params) == len(names) + len(entry.hidden_params)
        assert all(t == ".u64" for t in entry.ptx_params[len(names):])
        assert entry.key == variant_key(entry.kernel, entry.arch, dict(map(tuple, entry.signature)),
                                        entry.constexprs, entry.num_warps, entry.num_stages)
        cfg = rms_norm_config(SM90A, entry.constexprs["N"])
        assert (entry.num_warps, entry.constexprs["BLOCK_ROWS"]) == (cfg.num_warps, cfg.block_rows)
        keys.add(entry.key)
    assert len(keys) == len(manifest.kernels)  # one cubin per specialization
    raw = json.loads((out / MANIFEST_NAME).read_text())
    assert raw["format"] == 1 and raw["built_with"]["triton"] == triton.__version__


def test_hidden_params_match_this_triton(sm90_set):
    # Triton 3.9's launcher passes two trailing scratch pointers; the manifest must say the same.
    _, manifest = sm90_set
    major_minor = tuple(int(p) for p in triton.__version__.split(".")[:2])
    if major_minor >= (3, 5):
        assert {tuple(e.hidden_params) for e in manifest.kernels} == {("global_scratch", "profile_scratch")}


def _key_for(x, weight):
    launch = rms_mod.prepare(x, weight, 1e-6, arch=SM90A)
    sig, const = signature_of(rms_mod.KERNEL.params, launch.args)
    return variant_key("rms_norm", "sm_90a", sig, const, launch.config.num_warps, launch.config.num_stages)


def test_runtime_key_of_contiguous_inputs_finds_its_cubin(sm90_set):
    out, _ = sm90_set
    ks = KernelSet(out)
    assert ks.refusal is None and ks.entries
    for dim in rms_mod.AOT_DIMS:
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(3, dim, dtype=dtype)
            for w in (torch.ones(dim, dtype=dtype), None):
                assert _key_for(x, w) in ks.entries, (dim, dtype, w is None)
    # A single row keys the same as many (the row count is never specialized).
    x = torch.randn(1, 4096, dtype=torch.bfloat16)
    assert _key_for(x, None) in ks.entries


def test_jit_fallback_when_no_cubin_matches(sm90_set, caplog):
    out, _ = sm90_set
    ks = KernelSet(out)
    base = torch.randn(4 * 4096 + 1, dtype=torch.bfloat16)
    unaligned = base[1:].view(4, 4096)  # 2-byte offset: Triton would compile an unaligned variant
    fp16 = torch.randn(4, 4096, dtype=torch.float16)
    odd = torch.randn(4, 3000, dtype=torch.bfloat16)  # a width nobody compiled ahead of time
    for x in (unaligned, fp16, odd):
        assert _key_for(x, None) not in ks.entries
    # The dispatcher's decision (no GPU needed to refuse): None means Triton JIT, and it says why.
    from deepinfer_cuda.kernel_set import dispatch

    previous = dispatch._active
    dispatch._active = ks
    try:
        with caplog.at_level(logging.INFO, logger="deepinfer.cuda.kernel_set"):
            assert rms_mod.KERNEL._resolve(_key_for(odd, None), SM90A, 0) is None
    finally:
        dispatch._active = previous
    assert "no cubin was built for this specialization" in caplog.text and "using Triton JIT" in caplog.text


def test_kernel_set_refused_on_triton_mismatch_or_missing_manifest(sm90_set, tmp_path):
    out, manifest = sm90_set
    other = dataclasses.replace(manifest, triton_version="0.0.1")
    other.write(tmp_path)
    ks = KernelSet(tmp_path)
    assert ks.entries == {} and "built by triton 0.0.1" in ks.refusal and triton.__version__ in ks.refusal
    assert "no manifest.json" in KernelSet(tmp_path / "absent").refusal
    dataclasses.replace(manifest, kernel_sources="0" * 64).write(tmp_path)  # a kernel changed since the build
    assert "other kernel sources" in KernelSet(tmp_path).refusal
    assert KernelSet(out).refusal is None
    (tmp_path / MANIFEST_NAME).write_text(json.dumps({"format": 99}))
    assert "format 99" in KernelSet(tmp_path).refusal
    assert KernelSet.disabled().refusal == "kernel sets are disabled"


#: Forms that ``arch.py`` picks for one architecture only: SM100's ``tl.dot_scaled`` GEMMs.
ONE_ARCH_KERNELS = {"fp8_block_linear_mx": "sm_100a", "moe_experts_mxfp4_scaled_up": "sm_100a",
                    "moe_experts_mxfp4_scaled_down": "sm_100a"}


def test_every_kernel_is_compiled_ahead_of_time_for_every_arch():
    """Each Triton kernel a kernel module defines is named in some ``@override(..., aot=...)`` (the builder's list),
    under a name of its own."""
    every = aot_kernels()
    assert len({k.name for k in every}) == len(every) and all(isinstance(k, TritonKernel) for k in every)
    modules = [m for n, m in list(sys.modules.items()) if n.startswith("deepinfer_cuda.kernels.")]  # all: overrides()
    defined = {f"{m.__name__}.{name}": k for m in modules for name, k in vars(m).items() if isinstance(k, TritonKernel)}
    assert defined and not {w for w, k in defined.items() if k not in every}, "kernels no override compiles"
    for kernel in every:
        for arch in ARCHS:
            if ONE_ARCH_KERNELS.get(kernel.name, arch.name) == arch.name:
                assert kernel.aot_variants(arch), f"{kernel.name} has no AOT variants for {arch.name}"
            else:
                assert not kernel.aot_variants(arch), f"{kernel.name} has AOT variants for {arch.name}"


def test_every_triton_kernel_first_waits_for_the_kernel_before_it():
    """The cubin launcher launches every Triton kernel of the set as a programmatic dependent: one that touched
    memory before ``griddepcontrol.wait`` would race the kernel before it (the builder also checks the PTX)."""
    import ast
    import inspect
    import textwrap

    for kernel in aot_kernels():
        body = ast.parse(textwrap.dedent(inspect.getsource(kernel.jit_fn.fn))).body[0].body
        if isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        first = body[0]
        assert (isinstance(first, ast.Expr) and isinstance(first.value, ast.Call)
                and ast.unparse(first.value.func) == "wait_for_producers"), kernel.name


def test_overrides_use_core_op_names_and_signatures():
    """The table refuses unknown op names and any override or coverage predicate whose parameters (names, kinds,
    defaults) differ from the reference's: building it is the check."""
    backend = CudaBackend()
    table = OpTable(backend.load_ops(), "nvidia", coverage=backend.op_coverage())
    assert table.overridden == frozenset(kernels_by_op()) == frozenset(overrides())
    assert table.partially_covered <= table.overridden and "hc_pre" in table.partially_covered
    fixed = OpTable(kernels_by_op(batch_invariant=True), "nvidia", coverage=backend.op_coverage())
    assert fixed.overridden == table.overridden and set(backend.batch_invariant_ops) <= table.overridden
    assert kernels_by_op(batch_invariant=True)["moe_experts"] is not kernels_by_op()["moe_experts"]  # fixed tiles
    assert set(batch_invariant_ops()) >= {"sparse_attention", "moe_experts"} and "rms_norm" not in batch_invariant_ops()
    assert set(SUPPORTED_CAPABILITIES) == {a.capability for a in ARCHS}


def test_an_op_has_one_kernel():
    with pytest.raises(ValueError, match="op 'rms_norm' has two kernels"):
        override("rms_norm")(lambda x, weight, eps: x)
    assert overrides()["rms_norm"].kernel is rms_mod.rms_norm


def test_tma_descriptor_variant_lowers_to_a_tensor_map_the_launcher_packs():
    """The MoE GEMMs read weights through host TMA descriptors: the builder records how Triton lowered each one
    (``tensordesc_meta``) and the PTX params it expands to (a 128-byte ``CUtensorMap``, its shape, its strides), and
    the cubin launcher's storage has one slot of the right size per PTX param."""
    import ctypes

    from deepinfer_cuda.kernel_set.compile import compile_variant
    from deepinfer_cuda.kernel_set.cubin import param_storage
    from deepinfer_cuda.kernels import moe_experts

    variant = moe_experts._aot_down_variants(SM90A)[0]
    assert variant.signature["w2_desc"].startswith("tensordesc<bf16[")
    entry, _ = compile_variant(moe_experts.DOWN_KERNEL, SM90A, variant)
    (meta,) = entry.tensordesc_meta
    assert meta["elem_size"] == 2 and len(meta["block_size"]) == 2 and meta["swizzle"] in (0, 1, 2, 3)
    names = [n for n, _ in entry.signature]
    at = names.index("w2_desc")  # the params before it are one each
    assert entry.ptx_params[at : at + 5] == [".b8", ".u32", ".u32", ".u64", ".u64"]
    storage, plain, maps = param_storage(entry)
    assert len(storage) == len(entry.ptx_params) and [n for _, n in maps] == ["w2_desc"]
    assert len(plain) == len(names) - 1
    sizes = {".b8": 128, ".u32": 4, ".u64": 8, ".f32": 4, ".u8": 1, ".u16": 2}
    assert [ctypes.sizeof(s) for s in storage] == [sizes[t] for t in entry.ptx_params]
