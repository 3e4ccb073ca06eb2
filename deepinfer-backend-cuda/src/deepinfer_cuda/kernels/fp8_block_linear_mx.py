"""The FP8 block-scaled GEMM's prefill regime as one ``tl.dot_scaled`` a step (``arch.Fp8LinearTiles.mx``: SM100, ue8m0
weight scales): both operands microscaled e4m3 with an e8m0 scale per 32 along K, which SM100 multiplies with
``tcgen05.mma ... kind::mxf8f6f4.block_scale`` (the scales applied by the tensor cores, no fp32 promotion step).

``fp8_block_linear.py`` plans it and holds its ``TritonKernel`` (``MX_KERNEL``) and AOT variants.  The
activation tile is quantized in registers (``mxfp8_tile.py``: no separate quantization launch or workspace; each
column tile's program quantizes its rows again).  The weight's
``block_n x block_k`` ue8m0 scales (128x128, or V4.1's 32x32) are its per-32 scales, each repeated over its
block: the weight row's block scale byte for every 32 columns.  The error against the reference is the activation's
FP8 rounding (2^-4 relative at most), the FP8 GEMMs' tolerance.  Elsewhere (SM90, the CPU interpreter) Triton
decomposes ``dot_scaled`` into an upcast to bf16 and a plain dot, so the same code runs and is checked there.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.kernels.mxfp8_tile import mxfp8_tile
from deepinfer_cuda.kernels.split_k_sum import to_dtype


@triton.jit(do_not_specialize=["M"])
def mx_linear_kernel(x_ptr, w_ptr, ws_ptr, y_ptr, M, N: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr,
                      BN_Q: tl.constexpr, BK_Q: tl.constexpr, KB: tl.constexpr, INTERPRETED: tl.constexpr,
                      BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """y[m, g, n] = sum_k x[m, g, k] * W[g * N + n, k] for a [BLOCK_M, BLOCK_N] tile of group ``program_id(2)``;
    x [M, GROUPS * K] (bf16), W [GROUPS * N, K] e4m3 code bytes with e8m0 scale bytes ws [cdiv(GROUPS * N, BN_Q),
    KB = cdiv(K, BK_Q)], y [M, GROUPS * N]; K a multiple of 32."""
    wait_for_producers()
    g = tl.program_id(2)
    rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_ok = cols < N
    w_rows = (g * N + cols).to(tl.int64)
    x_row = rows * (GROUPS * K) + g * K
    s_row = (w_rows // BN_Q) * KB
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + x_row[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        codes, a_scale = mxfp8_tile(a, BLOCK_M, BLOCK_K, INTERPRETED)
        wc = tl.load(w_ptr + w_rows[:, None] * K + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
        if not INTERPRETED:
            wc = wc.to(tl.float8e4nv, bitcast=True)
        kb = (k0 + 32 * tl.arange(0, BLOCK_K // 32)) // BK_Q  # each 32 columns' weight scale block
        w_scale = tl.load(ws_ptr + s_row[:, None] + kb[None, :], mask=col_ok[:, None] & (kb < KB)[None, :], other=127)
        acc = tl.dot_scaled(codes, a_scale, "e4m3", tl.trans(wc), w_scale, "e4m3", acc)
    y_off = rows[:, None] * (GROUPS * N) + g * N + cols[None, :]
    tl.store(y_ptr + y_off, to_dtype(acc, y_ptr.dtype.element_ty, INTERPRETED), mask=row_ok[:, None] & col_ok[None, :])


def constexprs(n: int, k: int, groups: int, bn: int, bk: int, block_m: int, block_n: int, block_k: int,
               interpreted: bool) -> dict[str, object]:
    return {"N": n, "K": k, "GROUPS": groups, "BN_Q": bn, "BK_Q": bk, "KB": -(-k // bk), "INTERPRETED": interpreted,
            "BLOCK_M": block_m, "BLOCK_N": block_n, "BLOCK_K": block_k}
