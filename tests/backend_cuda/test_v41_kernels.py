"""V4.1's CUDA kernels (single-pass mHC, the final collapse, the QAT fake-quantizers, the candidate indexer,
Engram's hash, gate and FP8 table lookup) at V4.1-Flash's dims.

CPU (CI): every V4.1-Flash call of these ops finds its cubin in the kernel set (``prepare`` plans without a GPU);
Triton's interpreter (a subprocess: ``TRITON_INTERPRET=1`` must precede Triton's decorators) runs the fake-quant
kernels on the reference's own vectors (bit for bit), Engram's hash at V4.1-Flash's defaults (bit for bit) and the
in-blocks indexer across several entry chunks.  ``test_kernels_interpreted.py`` runs core's conformance samples.
GPU host: each op against core's reference at V4.1-Flash's dims (fake quants, the hash and the table lookup
exactly; ``test_embedding_fp8_kernel.py`` checks the lookup's bits), AOT cubin
== JIT bitwise, no host synchronisation, and CUDA-graph capture.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from tests.support.aot_jit import assert_aot_equals_jit, assert_graph_replays_without_syncs

pytest.importorskip("triton")

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(
    not HAS_CUDA, reason="needs an NVIDIA GPU (SM90/SM100); run on the GPU host: pytest tests/backend_cuda")
BF16 = torch.bfloat16
#: V4.1-Flash: hidden 5120, 4 mHC streams, 64 heads x 512 (rope 64), index 32 heads x 128 top-512,
#: candidate blocks of 8 (top 2048), Engram n-grams up to 4 x 8 heads over 99092 compressed ids, FP8 Engram tables.
HIDDEN, STREAMS, HEAD_DIM, INDEX_HEADS, INDEX_DIM, TOPK = 5120, 4, 512, 32, 128, 512
BLOCK_SIZE, TOPK_BLOCKS, NGRAM, ENGRAM_HEADS, ENGRAM_VOCAB = 8, 2048, 4, 8, 99092
#: Engram tables: FP8 rows of 256 columns, one ue8m0 scale per 32 (a few thousand rows stand in for millions).
ENGRAM_DIM, ENGRAM_ROWS = 256, 5003
#: The kernel module of each op (the module is named after the op).
V41_OPS = ("fp8_e4m3_fake_quant", "fp4_e2m1_fake_quant", "hc_pre_single_pass", "hc_collapse", "indexer_candidates",
           "indexer_topk_in_blocks", "engram_hash", "engram_gate", "rms_norm_rope_fp8_e4m3_fake_quant",
           "rope_fp4_e2m1_fake_quant", "embedding_fp8")
#: The fused rotation + quantizer ops: (fused op, the rotation op it starts with, the quantizer it ends with).
FUSED = {"rms_norm_rope_fp8_e4m3_fake_quant": ("rms_norm_rope", "fp8_e4m3_fake_quant"),
         "rope_fp4_e2m1_fake_quant": ("rope", "fp4_e2m1_fake_quant")}
VECTORS = Path(__file__).parents[1] / "fixtures" / "deepseek_v41" / "quantizers" / "quant_vectors.json"


def _module(op: str):
    return importlib.import_module(f"deepinfer_cuda.kernels.{op}")


def v41_cases(device: str, tokens: tuple[int, ...] = (1, 16, 64)) -> Iterator[tuple[str, tuple]]:
    """(op, args) of V4.1-Flash's calls in bf16 on ``device``: decode batches ``tokens``, and a prefill chunk of
    1024 tokens for the per-token ops."""
    gen = torch.Generator().manual_seed(0)

    def randn(*shape, dtype=BF16):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)

    for t in (*tokens, 1024):
        yield "fp8_e4m3_fake_quant", (randn(t, HEAD_DIM) * 4, 32)  # the window's K=V
        yield "fp4_e2m1_fake_quant", (randn(t, HEAD_DIM), 16, "e4m3")  # compressed latents
        yield "fp4_e2m1_fake_quant", (randn(t, INDEX_HEADS, INDEX_DIM), 32, "ue8m0")  # index queries
        yield "fp4_e2m1_fake_quant", (randn(t, INDEX_DIM), 32, "ue8m0")  # index keys
        yield from _fused_cases(t, randn, device)
        streams = randn(t, STREAMS, HIDDEN)
        fn = 0.05 * randn((2 + STREAMS) * STREAMS, STREAMS * HIDDEN, dtype=torch.float32)
        base, scale = randn((2 + STREAMS) * STREAMS, dtype=torch.float32), 1 + 0.1 * randn(3, dtype=torch.float32)
        previous = torch.sigmoid(randn(t, STREAMS, dtype=torch.float32)) + 1e-6
        yield "hc_pre_single_pass", (streams, previous, fn, base, scale, 1e-20, 1e-6, 20)
        one_hot = torch.zeros(1, STREAMS, device=device)
        one_hot[0, 0] = 1.0  # the first site: the model passes an expanded (stride-0) one-hot
        yield "hc_pre_single_pass", (streams, one_hot.expand(t, -1), fn, base, scale, 1e-20, 1e-6, 20)
        yield "hc_collapse", (streams, previous)
        kv = randn(t, (STREAMS + 1) * HIDDEN)  # Engram's wkv output: S keys, then the value
        weights = (1 + 0.3 * randn(2, STREAMS, HIDDEN, dtype=torch.float32)).to(device=device, dtype=BF16)
        yield "engram_gate", (streams, kv[:, : STREAMS * HIDDEN].view(t, STREAMS, HIDDEN), kv[:, STREAMS * HIDDEN :],
                              weights[0], weights[1], 1e-20)
        yield "engram_hash", _hash_args(t, gen, device)
        yield "embedding_fp8", _engram_table_args(t, gen, device)
    for t, seqs, entries in [(1, 1, 20000), (16, 2, 6000), (64, 4, 3000)]:
        args = _indexer_args(t, seqs, entries, gen, device)
        yield "indexer_candidates", (*args, BLOCK_SIZE, TOPK_BLOCKS)
        from deepinfer.ops.indexer import candidate_blocks, index_scores

        cpu = [a.cpu() if isinstance(a, torch.Tensor) else a for a in args]
        scores = index_scores(*cpu[:5], *cpu[6:8])
        blocks = candidate_blocks(scores + torch.rand(scores.shape, generator=gen), cpu[4], BLOCK_SIZE, TOPK_BLOCKS)
        yield "indexer_topk_in_blocks", (*args, blocks.to(device), BLOCK_SIZE)


def _fused_cases(t: int, randn, device: str) -> Iterator[tuple[str, tuple]]:
    """V4.1-Flash's fused rotation + quantizer calls: the window K=V (a column slice of the layer's input
    projection, fp32 norm weight, FP8 / 32), the compressed entries (FP4 / 16 e4m3), the index queries and keys
    (FP4 / 32 ue8m0); rope 64 of the compress family (YaRN's scaling)."""
    positions = torch.randint(0, 65536, (t,), generator=torch.Generator().manual_seed(t)).to(device)
    inv_freq = (1.0 / (160000.0 ** (torch.arange(0, 64, 2, dtype=torch.float32) / 64))).to(device)
    projection = randn(t, 1024 + HEAD_DIM + INDEX_HEADS) * 3  # wq_a | wkv | index head weights
    weight = (1 + 0.1 * randn(HEAD_DIM, dtype=torch.float32)).to(device)
    latent = projection[:, 1024 : 1024 + HEAD_DIM]
    yield "rms_norm_rope_fp8_e4m3_fake_quant", (latent, weight, 1e-6, positions, inv_freq, 1.2, 32)
    yield "rope_fp4_e2m1_fake_quant", (randn(t, HEAD_DIM), positions, inv_freq, 1.2, 16, "e4m3")
    yield "rope_fp4_e2m1_fake_quant", (randn(t, INDEX_HEADS, INDEX_DIM), positions, inv_freq, 1.2, 32, "ue8m0")
    yield "rope_fp4_e2m1_fake_quant", (randn(t, INDEX_DIM), positions, inv_freq, 1.2, 32, "ue8m0")


def _indexer_args(tokens: int, seqs: int, entries: int, gen: torch.Generator, device: str) -> tuple:
    q = torch.randn(tokens, INDEX_HEADS, INDEX_DIM, generator=gen).to(device=device, dtype=BF16)
    weights = torch.randn(tokens, INDEX_HEADS, generator=gen).to(device=device, dtype=BF16)
    keys = torch.randn(seqs, entries, INDEX_DIM, generator=gen).to(device=device, dtype=BF16)
    seq_ids = torch.sort(torch.randint(0, seqs, (tokens,), generator=gen)).values.to(device)
    limits = torch.randint(entries // 2, entries + 1, (tokens,), generator=gen).to(device)
    return q, weights, keys, seq_ids, limits, TOPK, INDEX_DIM**-0.5, INDEX_HEADS**-0.5


def _hash_args(tokens: int, gen: torch.Generator, device: str) -> tuple:
    lookback = torch.randint(0, ENGRAM_VOCAB, (tokens, NGRAM), generator=gen)
    multipliers = torch.randint(0, (2**63 - 1) // ENGRAM_VOCAB // 2, (NGRAM,), generator=gen) * 2 + 1
    primes = torch.tensor([16000057 + 2 * i for i in range((NGRAM - 1) * ENGRAM_HEADS)])  # odd moduli will do
    offsets = torch.cumsum(primes, 0) - primes
    return tuple(a.to(device) for a in (lookback, multipliers, primes, offsets))


def _engram_table_args(tokens: int, gen: torch.Generator, device: str) -> tuple:
    """An FP8 Engram table's lookup: ``(N - 1) * heads`` rows a token, bf16 out (the model's dtype)."""
    codes = torch.randint(0, 256, (ENGRAM_ROWS, ENGRAM_DIM), generator=gen, dtype=torch.uint8)
    codes[codes == 0x7F] = 0  # no NaN codes (S.1111.111) in a table
    codes[codes == 0xFF] = 0x80
    scale = torch.randint(110, 135, (ENGRAM_ROWS, ENGRAM_DIM // 32), generator=gen, dtype=torch.uint8)
    ids = torch.randint(0, ENGRAM_ROWS, (tokens * (NGRAM - 1) * ENGRAM_HEADS,), generator=gen)
    return (ids.to(device), codes.view(torch.float8_e4m3fn).to(device), scale.view(torch.float8_e8m0fnu).to(device),
            32, BF16)


def _steps(op: str, plan) -> list:
    return plan.steps if hasattr(plan, "steps") else [(_module(op).KERNEL, plan)]


# --- CPU ---------------------------------------------------------------------------------------------------------
def test_every_v41_flash_call_finds_its_cubin():
    """A miss is silent at run time (the launch JIT-compiles, costing host time on every call)."""
    from deepinfer_cuda.arch import SM90A

    missing = []
    for op, args in v41_cases("cpu", tokens=(1, 16)):
        for kernel, launch in _steps(op, _module(op).prepare(*args, arch=SM90A)):
            if 0 not in launch.grid and not kernel.has_aot_variant(launch, SM90A):
                missing.append(f"{op}/{kernel.name} {[tuple(a.shape) for a in args if hasattr(a, 'shape')]}")
    assert not missing, missing


@pytest.mark.slow
def test_v41_kernel_set_builds_for_sm90a(tmp_path):
    """Every AOT variant of the V4.1 kernels compiles for sm_90a on the CPU (a compile error would otherwise show
    first on the GPU host; ~25 s on 2 cores)."""
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernel_set.build import build_kernel_set

    kernels = {k.name: k for op in V41_OPS for k in _v41_kernels(op)}
    manifest = build_kernel_set(tmp_path, [SM90A], sorted(kernels))
    built = {name: sum(e.kernel == name for e in manifest.kernels) for name in kernels}
    assert built == {name: len(k.aot_variants(SM90A)) for name, k in kernels.items()}


@pytest.mark.slow
def test_fake_quant_compiles_to_ieee_division_and_round_to_nearest_even():
    """The interpreter checks the arithmetic with numpy's IEEE operations; the compiled kernel must use the same:
    ``div.rn`` (not ``div.full`` / ``rcp.approx``) and ``cvt.rni`` (round half to even)."""
    import re

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from deepinfer_cuda.arch import SM90A

    for op in ("fp8_e4m3_fake_quant", "fp4_e2m1_fake_quant", *FUSED):
        kernel = _module(op).KERNEL
        for v in kernel.aot_variants(SM90A):
            signature = {p.name: "constexpr" if p.name in v.constexprs else v.signature[p.name].split(":")[0]
                         for p in kernel.params}
            compiled = triton.compile(ASTSource(kernel.jit_fn, signature, constexprs=dict(v.constexprs)),
                                      target=GPUTarget("cuda", SM90A.triton_arch, 32),
                                      options={"num_warps": v.num_warps})
            ops = set(re.findall(r"\b(div\.[a-z0-9.]+|rcp\.[a-z0-9.]+|cvt\.rni\.f32\.f32)", compiled.asm["ptx"]))
            if op in FUSED:  # the norm's mean may divide by a constant its own way; the quantizer's are div.rn
                assert {"div.rn.f32", "cvt.rni.f32.f32"} <= ops and not any("rcp" in o for o in ops), (op, ops)
            else:
                assert ops == {"div.rn.f32", "cvt.rni.f32.f32"}, (op, v.constexprs, ops)


INTERPRETER_SCRIPT = textwrap.dedent(
    """
    import json, sys, torch
    sys.path.insert(0, {root!r})
    from deepinfer.ops import OpSample, op_defs
    from deepinfer_cuda.arch import SM90A
    import deepinfer_cuda.kernels.fp8_e4m3_fake_quant as fp8
    import deepinfer_cuda.kernels.fp4_e2m1_fake_quant as fp4
    import deepinfer_cuda.kernels.engram_hash as engram_hash
    import deepinfer_cuda.kernels.indexer_topk_in_blocks as in_blocks
    import types, importlib, triton.language as tl
    from deepinfer.ops.fake_quant import same_bits
    from tests.backend_cuda.test_v41_kernels import FUSED, _fused_cases, _hash_args, _indexer_args

    torch.set_num_threads(1)
    fused = {{op: importlib.import_module(f"deepinfer_cuda.kernels.{{op}}") for op in FUSED}}
    for m in (fp8, fp4, in_blocks, *fused.values()):
        m.INTERPRETED = True
    for name in ("rms_norm_rope", "rope"):  # libdevice has no interpreter implementation
        importlib.import_module(f"deepinfer_cuda.kernels.{{name}}").libdevice = types.SimpleNamespace(
            cos=lambda x: tl.cos(x), sin=lambda x: tl.sin(x))

    def run(module, *args):
        plan = module.prepare(*args, arch=SM90A)
        steps = plan.steps if hasattr(plan, "steps") else [(module.KERNEL, plan)]
        for kernel, launch in steps:
            if 0 not in launch.grid:
                kernel.jit_fn[launch.grid](**launch.args, num_warps=launch.config.num_warps)
        return plan.finish() if hasattr(plan, "steps") else plan.result

    calls = {{"fp8_e4m3_ue8m0_block32": (fp8, (32,)), "fp4_e2m1_e4m3scale_block16": (fp4, (16, "e4m3")),
             "fp4_e2m1_ue8m0_block32": (fp4, (32, "ue8m0"))}}
    for name, case in json.loads(open({vectors!r}).read())["cases"].items():
        module, extra = calls[name.split(" ")[0]]
        x, expected = torch.tensor(case["input"]), torch.tensor(case["output"])
        got = run(module, x, *extra)
        assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), name
        print("OK vectors", name.split(" ")[0])
    # the fused epilogue: the reference quantizer of the rotating kernel's own rows, bit for bit
    gen = torch.Generator().manual_seed(3)
    checked = 0
    for dtype in (torch.bfloat16, torch.float32):
        def randn(*shape, dtype=dtype):
            return torch.randn(*shape, generator=gen).to(dtype)
        for op, args in _fused_cases(5, randn, "cpu"):
            rotation, quantizer = FUSED[op]
            rotated = run(importlib.import_module(f"deepinfer_cuda.kernels.{{rotation}}"), *args[:-2 if
                          rotation == "rope" else -1])
            expected = op_defs()[quantizer].reference(rotated, *args[-2 if rotation == "rope" else -1:])
            same_bits(run(fused[op], *args), expected, OpSample(args, label=op), dtype)
            checked += 1
    print("OK fused", checked)
    args = _hash_args(300, gen, "cpu")
    assert torch.equal(run(engram_hash, *args), op_defs()["engram_hash"].reference(*args))
    print("OK engram_hash")
    op = op_defs()["indexer_topk_in_blocks"]
    args = _indexer_args(5, 2, 700, gen, "cpu")  # 11 chunks of 64 entries, blocks of 8
    args = (args[0].float(), args[1].float(), args[2].float(), *args[3:5], 40, *args[6:])
    from deepinfer.ops.indexer import candidate_blocks, index_scores
    scores = index_scores(*args[:5], *args[6:8])
    blocks = candidate_blocks(scores + torch.rand(scores.shape, generator=gen), args[4], 8, 9)
    full = (*args, blocks, 8)
    op.compare(run(in_blocks, *full), op.reference(*full), OpSample(full), torch.float32)
    print("OK in_blocks")
    """
)


@pytest.mark.skipif(HAS_CUDA, reason="a GPU is present: the GPU tests below check the compiled kernels")
def test_v41_kernels_under_the_triton_interpreter():
    root = str(Path(__file__).parents[2])
    script = INTERPRETER_SCRIPT.format(root=root, vectors=str(VECTORS))
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("OK ") == 6 and "OK fused 8" in proc.stdout, proc.stdout
    assert len(json.loads(VECTORS.read_text())["cases"]) == 3


# --- GPU ---------------------------------------------------------------------------------------------------------
def _call(op: str, args: tuple):
    return getattr(_module(op), op)(*args)


def _check_against_reference(op: str, args: tuple, got) -> None:
    from deepinfer.ops import OpSample, op_defs
    from deepinfer.testing import assert_close

    definition = op_defs()[op]
    cpu_args = tuple(a.cpu() if isinstance(a, torch.Tensor) else a for a in args)
    expected = definition.reference(*cpu_args)
    dtype = args[0].dtype
    if definition.compare is not None:  # fake quants: same bits; indexer: kept scores
        definition.compare(got, expected, OpSample(cpu_args), dtype)
    else:
        assert_close(got, expected, dtype, definition.tolerances.get(dtype, (0.0, 0.0)), f"{op} {cpu_args[0].shape}")


@requires_cuda
@pytest.mark.cuda
def test_v41_kernels_match_the_reference_at_v41_flash_dims():
    for op, args in v41_cases("cuda"):
        _check_against_reference(op, args, _call(op, args))


@requires_cuda
@pytest.mark.cuda
def test_fused_quantizers_equal_the_rotation_then_the_reference_quantizer_bitwise():
    """The QUANT epilogue is the quantizer's arithmetic bit for bit: the fused op's output is the reference
    quantizer of the rotating kernel's own output, and the two kernels composed (at V4.1-Flash's dims)."""
    from deepinfer.ops import OpSample, op_defs
    from deepinfer.ops.fake_quant import same_bits

    for op, args in v41_cases("cuda"):
        if op not in FUSED:
            continue
        rotation, quantizer = FUSED[op]
        split = -2 if rotation == "rope" else -1
        rotated = _call(rotation, args[:split])
        got = _call(op, args)
        sample = OpSample(args, label=f"{op} {tuple(args[0].shape)}")
        same_bits(got, op_defs()[quantizer].reference(rotated.cpu(), *args[split:]), sample, args[0].dtype)
        same_bits(got, _call(quantizer, (rotated, *args[split:])).cpu(), sample, args[0].dtype)


@pytest.fixture(scope="module")
def v41_kernel_set(tmp_path_factory):
    """The V4.1 kernels' set for this GPU's arch, built by this process's Triton."""
    from deepinfer_cuda.kernel_set.build import build_kernel_set
    from deepinfer_cuda.kernel_set.dispatch import device_arch

    names = sorted({k.name for op in V41_OPS for k in _v41_kernels(op)})
    out = tmp_path_factory.mktemp("v41_kernel_set")
    build_kernel_set(out, [device_arch(torch.cuda.current_device())], names)
    return out


def _v41_kernels(op: str) -> list:
    from deepinfer_cuda.kernels import hc_pre

    module = _module(op)
    return [hc_pre.MIX_KERNEL, module.KERNEL] if op == "hc_pre_single_pass" else [module.KERNEL]


@requires_cuda
@pytest.mark.cuda
def test_v41_aot_cubins_equal_jit_bitwise_and_nothing_jits(v41_kernel_set):
    kernels = {k.name: k for op in V41_OPS for k in _v41_kernels(op)}
    assert_aot_equals_jit(v41_kernel_set, kernels.values(), list(v41_cases("cuda", tokens=(1, 16))), _call,
                          restore=v41_kernel_set)


@requires_cuda
@pytest.mark.cuda
def test_v41_kernels_do_not_synchronise_and_replay_from_cuda_graphs():
    """Decode steps are captured: no host sync in any of these ops, and a replay gives the eager bits."""
    assert_graph_replays_without_syncs(list(v41_cases("cuda", tokens=(1, 16))), _call)


def test_gpu_tests_skip_with_a_reason_on_cpu():
    if HAS_CUDA:
        pytest.skip("a CUDA device is present")
    assert requires_cuda.args[0] is True and "GPU" in requires_cuda.kwargs["reason"]
