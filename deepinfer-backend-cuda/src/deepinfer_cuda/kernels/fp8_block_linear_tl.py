# mypy: disable-error-code="valid-type"
"""FP8 block-scaled GEMM in TileLang (SM90) for decode batches and prefill chunks: TMA of the e4m3 codes into
shared memory, decoded by the consumer warpgroups straight into the wgmma's A-operand registers (RS wgmma),
warp-specialized; the structure of ``moe_experts_mxfp4_tl.py`` with one weight matrix (a group of them for
``wo_a``) instead of experts.

The same op as ``fp8_block_linear.py``'s weight-only regime (core's ``fp8_block_linear`` /
``fp8_block_grouped_linear``): ``y = x @ (code * scale)^T``, the weight values exact in bf16, fp32 sums.  The GEMM
is "swapped": 128 weight rows are the MMA's M side and ``block_m`` rows of x its N side, so a decode batch wastes
tensor-core work, not weight bytes, and a prefill chunk decodes each weight tile once per 128 or 256 rows (wgmma
n256).  Per K step one producer warpgroup loads, by TMA, the tile's [128, BK / 4] 32-bit words (4 codes each) and
the [block_m, BK] activation rows; each consumer thread loads its rows' ue8m0 scale bytes for the next step into
registers, then decodes its share of the words into its wgmma fragment.  K runs in its natural order: a thread's
A-fragment pair (columns 2q, 2q + 1 of a 16-column slice) is half of one word.  ``split`` > 1 cuts K into that
many ranges, one program each (so that a narrow projection fills the SMs at batch 1), whose fp32 partial sums
``split_k_sum.py`` adds in order.

**The decode** (``_DEQUANT``, per register: bytes 2h, 2h + 1 of a word): one byte permute puts the two codes in the
high bytes of the register's halves, a shift and two masks place each code's sign, exponent and mantissa where a
bf16 keeps them (the bf16 of the e4m3 value times 2^-120: subnormal codes become bf16 subnormals), and two bf16x2
multiplies, by 2^120 and by the block's scale (2^(e8m0 - 127), a bf16 whose exponent field is e8m0), give
``dequant_fp8_block``'s bf16 values, exact.  Where every scale byte is at most ``FOLD_MAX_E8M0`` (scales up to 2^7),
the *folded* decode multiplies once, by 2^(e8m0 - 7) (the same values; off until it has run on a GPU:
``arch.FP8_FOLDED_DECODE``).

(No ``from __future__ import annotations`` here: TileLang evaluates the program's annotations.)  Built ahead of
time into the kernel set only where TileLang and nvcc are installed; :func:`plan` returns None when the active
set lacks the variant or the call is not covered (bf16 x, ue8m0 square blocks of 32 or 128, dims multiples of the
tiles), and the op then plans its Triton form.
"""

from typing import Any

import torch

import deepinfer_cuda.arch as cuda_arch
from deepinfer_cuda.arch import (
    FP8_TILELANG_CANDIDATES,
    CudaArch,
    Fp8TileLang,
    fp8_tilelang_config,
)
from deepinfer_cuda.kernel_set.dispatch import Launch
from deepinfer_cuda.kernel_set.manifest import TileLangVariant
from deepinfer_cuda.kernel_set.tilelang_kernel import TileLangKernel
from deepinfer_cuda.kernels.moe_experts_mxfp4_tl import BF16_PAIR, release_weights_after_mma, scales_at_most

SIGN = 0x80008000  #: bf16 pair bits: the two signs, where the permute put them
MAGNITUDE = 0x07F007F0  #: bf16 pair bits: the codes' 4 exponent and 3 mantissa bits, shifted down by 4
TWO_POW_120 = 0x7B807B80  #: bf16 pair 2^120, undoing the exponent bias the placed bits carry (127 - 7)
_DEQUANT = BF16_PAIR + r"""
__device__ __forceinline__ __nv_bfloat162 di_e4m3_pair(const unsigned q, const int n) {
  const unsigned t = __byte_perm(q, 0u, (n & 2) ? 0x3424u : 0x1404u);  // bytes 2h, 2h + 1 -> bits 8.., 24..
  return di_bf16_pair((t & DI_SIGNu) | ((t >> 4) & DI_MAGNITUDEu));  // (code, code) x 2^-120 as a bf16 pair
}
__device__ __forceinline__ unsigned short di_e4m3_half(const __nv_bfloat162 r, const int n) {
  return __bfloat16_as_ushort((n & 1) ? __high2bfloat16(r) : __low2bfloat16(r));
}
__device__ __forceinline__ unsigned short di_e4m3_at(const unsigned q, const int n, const unsigned char e8m0) {
  // times 2^120, then the scale 2^(e8m0 - 127) a half
  return di_e4m3_half(__hmul2(__hmul2(di_e4m3_pair(q, n), di_bf16_pair(DI_BIASu)),
                              di_bf16_pair(e8m0 * 0x00800080u)), n);
}
__device__ __forceinline__ unsigned short di_e4m3_at_folded(const unsigned q, const int n, const unsigned char e8m0) {
  // times 2^(e8m0 - 7) a half: 2^120 and the scale in one factor (e8m0 <= FOLD_MAX_E8M0)
  return di_e4m3_half(__hmul2(di_e4m3_pair(q, n), di_bf16_pair((e8m0 + 120u) * 0x00800080u)), n);
}
""".replace("DI_SIGN", f"{SIGN:#x}").replace("DI_MAGNITUDE", f"{MAGNITUDE:#x}").replace("DI_BIAS", f"{TWO_POW_120:#x}")
ROWS = 128  #: weight rows (output columns) a program: the two consumer warpgroups' 64 each
#: The largest ue8m0 scale byte the folded decode takes: its one factor 2^(e8m0 - 7) must be a bf16 (exponent field
#: e8m0 + 120 <= 254), i.e. scales up to 2^7 (an FP8 block's scale is its largest |w| / 448).
FOLD_MAX_E8M0 = 134


def _program(n: int, k: int, groups: int, block: int, block_m: int, block_k: int, stages: int, split: int,
             occupancy: int, folded: int) -> Any:
    """The ``T.prim_func`` of one (N, K, groups, scale block) and tiles; M is a dynamic dim.  ``folded``: the
    one-multiply decode (``di_e4m3_at_folded``: scales up to ``FOLD_MAX_E8M0``)."""
    import tilelang
    import tilelang.language as T

    words = block_k // 4
    sg = max(1, block_k // block)  # scale columns a K step
    steps = k // block_k // split  # K steps a program
    m = T.dynamic("m")
    out_dtype = "float32" if split > 1 else "bfloat16"
    decode = "di_e4m3_at_folded" if folded else "di_e4m3_at"

    @T.prim_func
    def main(x: T.Tensor((m, groups * k), "bfloat16"), w: T.Tensor((groups * n, k // 4), "uint32"),
             s: T.Tensor((groups * n // block, k // block), "uint8"), y: T.Tensor((split, m, groups * n), out_dtype)):
        with T.Kernel(n // ROWS * split, groups, T.ceildiv(m, block_m), threads=256) as (c, g, mb):
            T.annotate_min_blocks_per_sm(occupancy)
            if occupancy > 1:  # as in moe_experts_mxfp4_tl: TileLang's setmaxnreg split would deadlock two
                T.no_set_max_nreg()
            w_s = T.alloc_shared((ROWS, words), "uint32")
            x_s = T.alloc_shared((block_m, block_k), "bfloat16")
            w_f = T.alloc_fragment((ROWS, block_k), "bfloat16")  # the wgmma's A operand, in registers
            sc = T.alloc_fragment((ROWS, sg), "uint8")
            sc_next = T.alloc_fragment((ROWS, sg), "uint8")
            acc = T.alloc_fragment((ROWS, block_m), "float32")
            c_s = T.alloc_shared((ROWS, block_m), out_dtype)  # rounded once, as the store would
            r0 = g * n + (c // split) * ROWS
            k0 = (c % split) * steps  # the program's first K step
            T.import_source(_DEQUANT)
            T.annotate_layout({w_s: tilelang.layout.make_swizzled_layout(w_s)})
            T.clear(acc)
            for i, j in T.Parallel(ROWS, sg):
                sc_next[i, j] = s[(r0 + i) // block, (k0 * block_k) // block + j]
            for kk in T.Pipelined(steps, num_stages=stages):
                T.copy(w[r0:r0 + ROWS, (k0 + kk) * words:(k0 + kk + 1) * words], w_s)
                T.copy(x[mb * block_m, g * k + (k0 + kk) * block_k], x_s)
                T.copy(sc_next, sc)
                if kk + 1 < steps:  # the scale loads' latency hides behind this step's decoding
                    for i, j in T.Parallel(ROWS, sg):
                        sc_next[i, j] = s[(r0 + i) // block, ((k0 + kk + 1) * block_k) // block + j]
                for i, j in T.Parallel(ROWS, block_k):
                    code = T.call_extern("uint16", decode, w_s[i, j // 4], j % 4, sc[i, j * sg // block_k])
                    w_f[i, j] = T.reinterpret(code, "bfloat16")
                T.gemm(w_f, x_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            T.copy(acc, c_s)
            for j, i in T.Parallel(block_m, ROWS):
                if mb * block_m + j < m:
                    y[c % split, mb * block_m + j, r0 + i] = c_s[i, j]

    return main


def _variant(tiles: Fp8TileLang, n: int, k: int, groups: int, block: int, folded: int = 0) -> dict[str, int]:
    return {"n": n, "k": k, "groups": groups, "block": block, "block_m": tiles.block_m, "block_k": tiles.block_k,
            "stages": tiles.stages, "split": tiles.split, "occupancy": tiles.occupancy, "folded": folded}


def _aot_variants(arch: CudaArch) -> list[TileLangVariant]:
    """Every candidate of :data:`arch.FP8_TILELANG_CANDIDATES` (V4.1-Flash's projections, 32x32 blocks), with
    both decodes."""
    if arch.triton_arch != 90:
        return []
    return [TileLangVariant(_variant(t, n, k, g, block, f)) for (n, k, g, block), tiers in
            FP8_TILELANG_CANDIDATES.items() for tier in tiers.values() for t in tier for f in (0, 1)]


KERNEL = TileLangKernel("fp8_block_linear_tl", _program, _aot_variants, release_weights_after_mma)


def covers(x: torch.Tensor, scale: torch.Tensor, n: int, k: int, block_n: int, block_k: int,
           tiles: Fp8TileLang) -> bool:
    """bf16 x, ue8m0 square blocks of 32 or 128, N a multiple of 128 rows and K of the split steps."""
    return (x.dtype == torch.bfloat16 and scale.dtype in (torch.float8_e8m0fnu, torch.uint8) and block_n == block_k
            and block_k in (32, 128) and n % 128 == 0 and k % (tiles.block_k * tiles.split) == 0
            and tiles.block_k % min(block_k, tiles.block_k) == 0)


def splits(arch: CudaArch) -> set[int]:
    """The split counts of ``arch``'s built variants (``fp8_block_linear``'s split-K sum compiles one variant each)."""
    return {v.constexprs["split"] for v in _aot_variants(arch)}


def plan(x2: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, y: torch.Tensor, n: int, k: int,
         groups: int, block_n: int, block_k: int, *, arch: CudaArch, tiles: Fp8TileLang | None = None,
         require: bool = False, folded: bool | None = None) -> tuple[Launch, torch.Tensor] | None:
    """The launch of ``x2 [M, groups * K] @ W^T`` into ``y [M, groups * N]`` (bf16), or into fp32 partials [split,
    M, groups * N] to be summed into y (returned as the second item: y itself when ``split`` is 1); None when the
    TileLang form does not take the call (``tiles`` None: the arch table's; ``require``: plan it even if the active
    kernel set lacks the cubin, for tests that only inspect the plan; ``folded`` None: the one-multiply decode
    where ``arch.FP8_FOLDED_DECODE`` is on and the scales allow it)."""
    m = x2.shape[0]
    if tiles is None:
        tiles = fp8_tilelang_config(arch, m, n, k, groups, block_k)
    if tiles is None or m == 0 or not covers(x2, scale, n, k, block_n, block_k, tiles):
        return None
    if folded is None:
        folded = cuda_arch.FP8_FOLDED_DECODE and scales_at_most(scale, FOLD_MAX_E8M0)
    variant = _variant(tiles, n, k, groups, block_k, int(folded))
    if not require and not KERNEL.available(arch, variant):
        return None
    part = y.view(1, m, groups * n) if tiles.split == 1 else \
        torch.empty(tiles.split, m, groups * n, dtype=torch.float32, device=x2.device)
    words = weight.contiguous().view(torch.uint8).view(torch.uint32)
    grid = (n // 128 * tiles.split, groups, -(-m // tiles.block_m))
    args = dict(x=x2, w=words, s=scale.contiguous().view(torch.uint8), y=part, m=m, constexprs=variant)
    return Launch(grid, Fp8TileLang.LAUNCH, args, y), (y if tiles.split == 1 else part)
