"""The FP8 table lookup (``embedding_fp8``: V4.1's FP8 Engram tables gathered and scaled in one pass): V4.1-Flash's
calls find their cubins (CPU); under Triton's interpreter (CPU) and on the GPU it equals core's reference bit for
bit, every finite e4m3 code and the e8m0 specials (2^-127: subnormal products; 255: NaN) included, and on the GPU
a table past 2^31 bytes is addressed right.  ``test_kernels_interpreted.py`` also runs core's conformance samples
and ``test_v41_kernels.py`` the AOT == JIT and CUDA-graph checks at V4.1-Flash's dims."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

pytest.importorskip("triton")

from deepinfer_cuda.arch import SM90A  # noqa: E402
from deepinfer_cuda.kernels import embedding_fp8  # noqa: E402

HAS_CUDA = torch.cuda.is_available()
requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs an NVIDIA GPU (SM90/SM100)")
#: V4.1-Flash's Engram: 256 columns a row, a ue8m0 scale per 32; 3 n-gram sizes x 8 heads = 24 rows a token.
DIM, BLOCK, PER_TOKEN = 256, 32, 24


def _table(rows: int, gen: torch.Generator, device: str = "cpu", specials: bool = False):
    """FP8 codes (the finite ones: no table holds the NaN codes) and e8m0 scale bytes; ``specials``: scale bytes 0
    and 255 in some blocks."""
    codes = torch.randint(0, 256, (rows, DIM), generator=gen, dtype=torch.uint8)
    codes[codes == 0x7F] = 0x00
    codes[codes == 0xFF] = 0x80
    scale = torch.randint(100, 150, (rows, DIM // BLOCK), generator=gen, dtype=torch.uint8)
    if specials:
        scale[::3, 0], scale[1::3, -1] = 0, 255
    return codes.view(torch.float8_e4m3fn).to(device), scale.to(device)


def same_bits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Equal bit for bit, except that NaNs need only be NaN (a GPU multiply returns the canonical NaN)."""
    nan, bits = want.isnan(), torch.uint8
    return bool(torch.equal(got.isnan(), nan) and torch.equal(got[~nan].view(bits), want[~nan].view(bits)))


@pytest.mark.parametrize("tokens", [1, 16, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.uint8])
def test_v41_flash_lookups_find_their_cubin(tokens, dtype, scale_dtype):
    codes, scale = _table(64, torch.Generator().manual_seed(0))
    ids = torch.randint(0, 64, (tokens * PER_TOKEN,))
    launch = embedding_fp8.prepare(ids, codes, scale.view(scale_dtype), BLOCK, dtype, arch=SM90A)
    assert embedding_fp8.KERNEL.has_aot_variant(launch, SM90A)


SCRIPT = textwrap.dedent(
    """
    import torch
    from deepinfer.ops.quant import embedding_fp8 as reference
    from deepinfer_cuda.arch import SM90A
    from deepinfer_cuda.kernels import embedding_fp8 as module
    from tests.backend_cuda.test_embedding_fp8_kernel import _table, same_bits

    module.INTERPRETED = True
    gen = torch.Generator().manual_seed(1)
    codes, scale = _table(300, gen, specials=True)
    ids = torch.cat([torch.arange(300), torch.randint(0, 300, (37,), generator=gen)])  # every row, then repeats
    fp32_scale = torch.rand(scale.shape, generator=gen) * 1e-3
    for dtype in (torch.bfloat16, torch.float32):
        for s in (scale, scale.view(torch.float8_e8m0fnu), fp32_scale):
            plan = module.prepare(ids, codes, s, 32, dtype, arch=SM90A)
            module.KERNEL.jit_fn[plan.grid](**plan.args, num_warps=plan.config.num_warps)
            assert same_bits(plan.result, reference(ids, codes, s, 32, dtype)), (dtype, s.dtype)
            print("OK", dtype, s.dtype)
    """
)


@pytest.mark.skipif(HAS_CUDA, reason="a GPU is present: the GPU test below checks the compiled kernel")
def test_equals_the_reference_bit_for_bit_under_the_interpreter():
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1",
           "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-4000:]
    assert proc.stdout.count("OK ") == 6, proc.stdout


@requires_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_equals_the_reference_bit_for_bit_on_the_gpu(dtype):
    """The reference's ops run on the GPU too (a gather and an fp32 multiply: exact), so both read the same
    table: 8.5 M rows of 256 bytes (2.2 GB, past int32 byte offsets), ids near its end among them."""
    from deepinfer.ops.quant import embedding_fp8 as reference

    gen = torch.Generator().manual_seed(2)
    codes, scale = _table(4099, gen, specials=True)
    ids = torch.randint(0, 4099, (1024 * PER_TOKEN,), generator=gen).cuda()
    codes, scale = codes.cuda(), scale.cuda()
    for s in (scale, scale.view(torch.float8_e8m0fnu), torch.rand(scale.shape, device="cuda") * 1e-3):
        assert same_bits(embedding_fp8.embedding_fp8(ids, codes, s, BLOCK, dtype), reference(ids, codes, s, BLOCK,
                                                                                                dtype)), s.dtype
    rows = 8_500_000
    big = torch.empty(rows, DIM, dtype=torch.uint8, device="cuda")
    big[-4099:] = codes.view(torch.uint8)
    big_scale = torch.full((rows, DIM // BLOCK), 127, dtype=torch.uint8, device="cuda")
    big_scale[-4099:] = scale
    far = ids[:4096] + (rows - 4099)
    got = embedding_fp8.embedding_fp8(far, big.view(torch.float8_e4m3fn), big_scale, BLOCK, dtype)
    assert same_bits(got, reference(ids[:4096], codes, scale, BLOCK, dtype))


def test_gpu_tests_skip_with_a_reason_on_cpu():
    if HAS_CUDA:
        pytest.skip("a CUDA device is present")
    assert requires_cuda.args[0] is True and "GPU" in requires_cuda.kwargs["reason"]
