"""GEMM with an FP8 e4m3 weight and block scales, the weight read as stored (one byte a value).

Overrides core's ``fp8_block_linear(x, weight, scale, block_n, block_k)`` (deepinfer/ops/quant_gemm.py); the
grouped form (``fp8_block_grouped_linear.py``) is the same kernel with a group axis in the grid.  Two regimes
(``arch.fp8_linear_config``):

- **weight-only** (decode: fewer than 64 rows; fp32 always): each weight tile is dequantized in registers, code
  times its block's scale rounded to x's dtype (exactly the reference's dequantized weight), and multiplied in
  x's dtype with fp32 accumulation.  The step reads the weights once at one byte a value: half bf16's bytes.
- **FP8 tensor cores** (bf16, 64 rows and more; DeepGEMM's scheme, written anew): ``_act_quant_kernel`` first
  quantizes x per token and ``block_k`` channels (scale ``amax / 448`` in fp32, amax floored at 1e-4, codes
  rounded to nearest even), then each program multiplies FP8 tiles one weight scale block deep
  (``tl.dot`` on e4m3: wgmma) into a fresh fp32 partial that is scaled by the rows' activation scales and the
  columns' weight scales and added to the accumulator in fp32 (the promotion DeepGEMM does every 128 channels:
  FP8 wgmma accumulates with ~14 bits).  The error is the activation's FP8 rounding: the op's tolerance.

Codes travel as uint8; the kernel bit-casts them to ``float8e4nv`` for the tensor cores, and decodes them with
integer arithmetic under the CPU interpreter (``INTERPRETED``: no fp8 there; products in fp32, exact for FP8
operands), which checks the same math on the CPU.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from deepinfer_cuda.arch import CudaArch, Fp8LinearTiles, fp8_act_quant_config, fp8_linear_config
from deepinfer_cuda.kernel_set.compile import Variant
from deepinfer_cuda.kernel_set.dispatch import Launch, LaunchChain, TritonKernel, cuda_target
from deepinfer_cuda.kernels.fake_quant import _exponent, _pow2, _round_to_grid

#: The interpreter test turns this on (fp32 products, integer decoding of the codes, rounding by hand).
INTERPRETED = False
#: (N, K, groups) of V4-Flash's and V4.1-Flash's FP8 projections: wq_a | wkv (stacked), wq_b, wo_a (grouped),
#: wo_b, the shared expert's w1 | w3 and w2.
AOT_SHAPES = ((1536, 4096, 1), (32768, 1024, 1), (1024, 4096, 8), (4096, 8192, 1), (4096, 4096, 1), (4096, 2048, 1),
              (1792, 5120, 1), (32768, 1280, 1), (5120, 8192, 1), (4608, 5120, 1), (5120, 2304, 1))
AOT_BLOCKS = ((128, 128), (32, 32))
ACT_AMAX_FLOOR = 1e-4  # DeepGEMM's per_token_cast_to_fp8


@triton.jit
def _e4m3_value(c):
    """fp32 value of e4m3 codes (int32 0..255; no NaN code in a weight): ``(8 + m) * 2^(e - 10)``, or ``m * 2^-9``
    when e = 0, signed by bit 7."""
    e = (c >> 3) & 15
    m = c & 7
    mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, (8 + m).to(tl.float32) * _pow2(e - 10))
    # the sign bit set directly: compiled, ``-mag`` is ``0 - mag``, which turns code 0x80 (-0) into +0
    sign = tl.where((c & 128) != 0, -2147483648, 0)
    return (mag.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def _e4m3_code(q):
    """e4m3 codes (int32) of fp32 values on the e4m3 grid (|q| <= 448), -0 kept."""
    a = tl.abs(q)
    ex = _exponent(a)
    normal = ((ex + 7) << 3) | ((a * _pow2(-tl.maximum(ex, -126)) - 1.0) * 8.0).to(tl.int32)
    code = tl.where(ex >= -6, normal, (a * 512.0).to(tl.int32))
    return tl.where(q.to(tl.int32, bitcast=True) < 0, code | 128, code)


@triton.jit
def _to_dtype(v, dtype: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 ``v`` in ``dtype``, rounded to nearest even (the interpreter's cast truncates)."""
    if INTERPRETED and dtype == tl.bfloat16:
        bits = v.to(tl.uint32, bitcast=True)
        v = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    return v.to(dtype)


@triton.jit
def _weight_scale(ws_ptr, idx, mask, SCALE_E8M0: tl.constexpr):
    if SCALE_E8M0:
        s = (tl.load(ws_ptr + idx, mask=mask, other=127).to(tl.int32) << 23).to(tl.float32, bitcast=True)
    else:
        s = tl.load(ws_ptr + idx, mask=mask, other=0.0).to(tl.float32)
    return s


@triton.jit(do_not_specialize=["n_groups"])
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, n_groups, GROUP: tl.constexpr, BLOCK_R: tl.constexpr,
                      INTERPRETED: tl.constexpr):
    """Groups [pid * BLOCK_R, +BLOCK_R) of GROUP contiguous values: e4m3 codes of ``x / s`` and ``s = max(amax,
    1e-4) / 448`` (fp32)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, GROUP)
    ok = rows < n_groups
    offs = rows.to(tl.int64)[:, None] * GROUP + cols[None, :]
    x = tl.load(x_ptr + offs, mask=ok[:, None], other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-4)
    s = tl.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32))  # IEEE, as torch divides (Triton's / is not)
    scale = tl.broadcast_to(s[:, None], x.shape)
    q = _round_to_grid(tl.minimum(tl.maximum(tl.div_rn(x, scale), -448.0), 448.0), 3, -6, 448.0, INTERPRETED)
    tl.store(q_ptr + offs, _e4m3_code(q).to(tl.uint8), mask=ok[:, None])
    tl.store(s_ptr + rows, s, mask=ok)


@triton.jit(do_not_specialize=["M"])
def _fp8_linear_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr, M,
                       N: tl.constexpr, K: tl.constexpr, GROUPS: tl.constexpr, BN_Q: tl.constexpr,
                       BK_Q: tl.constexpr, KB: tl.constexpr, SCALE_E8M0: tl.constexpr, ACT_FP8: tl.constexpr,
                       FP32_DOT: tl.constexpr, INTERPRETED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_K: tl.constexpr):
    """y[m, g, n] = sum_k x[m, g, k] * W[g * N + n, k] for a [BLOCK_M, BLOCK_N] tile of group ``program_id(2)``;
    x [M, GROUPS * K] (codes uint8 when ACT_FP8, with scales xs [M, GROUPS * K / BK_Q]), W [GROUPS * N, K] uint8
    codes with scales ws [cdiv(GROUPS * N, BN_Q), KB = cdiv(K, BK_Q)], y [M, GROUPS * N]."""
    g = tl.program_id(2)
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok, col_ok = rows < M, cols < N
    w_rows = (g * N + cols).to(tl.int64)
    x_row = rows.to(tl.int64) * (GROUPS * K) + g * K
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(x_ptr + x_row[:, None] + ks[None, :], mask=row_ok[:, None] & k_ok[None, :], other=0)
        wc = tl.load(w_ptr + w_rows[:, None] * K + ks[None, :], mask=col_ok[:, None] & k_ok[None, :], other=0)
        if ACT_FP8:  # BLOCK_K == BK_Q: one scale block of the weight, one group of the activation
            if INTERPRETED:
                part = tl.dot(_e4m3_value(a.to(tl.int32)), tl.trans(_e4m3_value(wc.to(tl.int32))),
                              input_precision="ieee")
            else:
                part = tl.dot(a.to(tl.float8e4nv, bitcast=True), tl.trans(wc.to(tl.float8e4nv, bitcast=True)))
            xs = tl.load(xs_ptr + rows.to(tl.int64) * (GROUPS * K // BK_Q) + (g * K + k0) // BK_Q, mask=row_ok,
                         other=0.0)
            ws = _weight_scale(ws_ptr, (w_rows // BN_Q) * KB + k0 // BK_Q, col_ok, SCALE_E8M0)
            acc += part * xs[:, None] * ws[None, :]
        else:  # the reference's dequantized weight: code * scale rounded to x's dtype
            if INTERPRETED:
                wv = _e4m3_value(wc.to(tl.int32))
            else:
                wv = wc.to(tl.float8e4nv, bitcast=True).to(tl.float32)
            s_idx = (w_rows // BN_Q)[:, None] * KB + (ks // BK_Q)[None, :]
            ws = _weight_scale(ws_ptr, s_idx, col_ok[:, None] & k_ok[None, :], SCALE_E8M0)
            w = _to_dtype(wv * ws, x_ptr.dtype.element_ty, INTERPRETED)
            if FP32_DOT:
                acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, tl.trans(w), acc)
    out = _to_dtype(acc, y_ptr.dtype.element_ty, INTERPRETED)
    y_off = rows.to(tl.int64)[:, None] * (GROUPS * N) + g * N + cols[None, :]
    tl.store(y_ptr + y_off, out, mask=row_ok[:, None] & col_ok[None, :])


@functools.cache
def _constexprs(n: int, k: int, groups: int, bn: int, bk: int, e8m0: bool, tiles: Fp8LinearTiles, fp32: bool,
                interpreted: bool) -> dict[str, object]:
    return {"N": n, "K": k, "GROUPS": groups, "BN_Q": bn, "BK_Q": bk, "KB": -(-k // bk), "SCALE_E8M0": e8m0,
            "ACT_FP8": tiles.act_fp8,
            "FP32_DOT": fp32 or interpreted, "INTERPRETED": interpreted, "BLOCK_M": tiles.block_m,
            "BLOCK_N": tiles.block_n, "BLOCK_K": tiles.block_k}


def _gemm_variants(arch: CudaArch) -> list[Variant]:
    """bf16 activations, ue8m0 scales (as released), every regime, at every AOT shape and block."""
    variants = []
    for n, k, groups in AOT_SHAPES:
        for bn, bk in AOT_BLOCKS:
            for rows in (1, 64, 128):  # decode; prefill's 64- and 128-row tiles
                tiles = fp8_linear_config(arch, rows, n * groups, bk, 2)
                x = "*u8:D" if tiles.act_fp8 else "*bf16:D"
                sig = {"x_ptr": x, "xs_ptr": "*fp32:D" if tiles.act_fp8 else x, "w_ptr": "*u8:D", "ws_ptr": "*u8:D",
                       "y_ptr": "*bf16:D", "M": "i32"}
                const = _constexprs(n, k, groups, bn, bk, True, tiles, False, False)
                variants.append(Variant(sig, dict(const), tiles.config.num_warps, tiles.config.num_stages))
    return variants


def _act_quant_variants(arch: CudaArch) -> list[Variant]:
    variants = []
    for group in sorted({bk for _, bk in AOT_BLOCKS}):
        cfg = fp8_act_quant_config(arch, group)
        sig = {"x_ptr": "*bf16:D", "q_ptr": "*u8:D", "s_ptr": "*fp32:D", "n_groups": "i32"}
        const = {"GROUP": group, "BLOCK_R": cfg.block_rows, "INTERPRETED": False}
        variants.append(Variant(sig, const, cfg.num_warps, cfg.num_stages))
    return variants


KERNEL = TritonKernel("fp8_block_linear", _fp8_linear_kernel, _gemm_variants)
ACT_QUANT_KERNEL = TritonKernel("fp8_act_quant", _act_quant_kernel, _act_quant_variants)


def _scale_bytes(scale: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """(the scales as the kernel reads them, whether they are e8m0 bytes)."""
    if scale.dtype in (torch.float8_e8m0fnu, torch.uint8):
        return scale.contiguous().view(torch.uint8), True
    return scale.float().contiguous(), False


def plan_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, groups: int,
              *, arch: CudaArch, interpreted: bool, fixed: bool = False) -> LaunchChain:
    """The launches of ``y [M, groups * N] = x [M, groups * K] @ W^T`` per group (see the module docstring);
    ``fixed``: the weight-only regime at every row count (``DEEPINFER_BATCH_INVARIANT=1``: a row's result is its
    own 16-row tile's, reduced in one order, whatever the batch)."""
    if x.dtype not in (torch.bfloat16, torch.float32, torch.float16):
        raise ValueError(f"fp8_block_linear: x must be bf16, fp16 or fp32, got {x.dtype}")
    if weight.dtype not in (torch.float8_e4m3fn, torch.uint8):
        raise ValueError(f"fp8_block_linear: weight must be float8_e4m3fn, got {weight.dtype}")
    n = weight.shape[0]
    k = x.shape[-1]  # per group: x is [..., K] or [T, G, K]
    n //= groups
    lead = x.shape[: -2 if groups > 1 else -1]
    x2 = x.reshape(-1, groups * k).contiguous()
    m = x2.shape[0]
    y = torch.empty(m, groups * n, dtype=x.dtype, device=x.device)
    result = y.view(*lead, groups, n) if groups > 1 else y.view(*lead, n)
    tiles = fp8_linear_config(arch, 0 if fixed else m, n * groups, block_k, x.element_size())
    if tiles.act_fp8 and (k % block_k or block_k not in (32, 64, 128) or x.dtype != torch.bfloat16):
        tiles = fp8_linear_config(arch, 0, n * groups, block_k, x.element_size())  # the activation path: whole groups
    w = weight.contiguous().view(torch.uint8)
    ws, e8m0 = _scale_bytes(scale)
    const = _constexprs(n, k, groups, block_n, block_k, e8m0, tiles, x.dtype == torch.float32, interpreted)
    grid = (triton.cdiv(m, tiles.block_m), triton.cdiv(n, tiles.block_n), groups)
    steps = []
    a, xs = x2, x2
    if tiles.act_fp8:
        a = torch.empty(m, groups * k, dtype=torch.uint8, device=x.device)
        xs = torch.empty(m, groups * k // block_k, dtype=torch.float32, device=x.device)
        cfg = fp8_act_quant_config(arch, block_k)
        n_groups = m * groups * k // block_k
        quant = Launch((triton.cdiv(n_groups, cfg.block_rows),), cfg,
                       dict(x_ptr=x2, q_ptr=a, s_ptr=xs, n_groups=n_groups, GROUP=block_k, BLOCK_R=cfg.block_rows,
                            INTERPRETED=interpreted), None)
        steps.append((ACT_QUANT_KERNEL, quant))
    gemm = Launch(grid if m else (0,), tiles.config, dict(x_ptr=a, xs_ptr=xs, w_ptr=w, ws_ptr=ws, y_ptr=y, M=m,
                                                           **const), result)
    steps.append((KERNEL, gemm))
    return LaunchChain(steps, lambda: result)


def prepare(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int, *,
            arch: CudaArch) -> LaunchChain:
    """Plan ``fp8_block_linear(...)``: x [..., K], weight [N, K] e4m3, scale per block."""
    return plan_gemm(x, weight, scale, block_n, block_k, 1, arch=arch, interpreted=INTERPRETED)


def fp8_block_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int, block_k: int
                     ) -> torch.Tensor:
    """``x @ (weight * scale)^T`` [..., N] in x's dtype."""
    index, arch = cuda_target(x)
    return prepare(x, weight, scale, block_n, block_k, arch=arch).run(index)


def fp8_block_linear_fixed_tiles(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, block_n: int,
                                 block_k: int) -> torch.Tensor:
    """:func:`fp8_block_linear` with the weight-only regime for every batch (the batch-invariant table's)."""
    index, arch = cuda_target(x)
    return plan_gemm(x, weight, scale, block_n, block_k, 1, arch=arch, interpreted=INTERPRETED, fixed=True).run(index)
