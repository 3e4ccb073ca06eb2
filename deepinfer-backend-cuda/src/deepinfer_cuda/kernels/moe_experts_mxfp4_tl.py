# mypy: disable-error-code="valid-type"
"""MXFP4 routed experts in TileLang (SM90): TMA of the packed e2m1 bytes into shared memory, dequantized by the
consumer warpgroups into a bf16 tile, multiplied on the tensor cores (wgmma), warp-specialized.

The same op as ``moe_experts_mxfp4.py`` (core's ``moe_experts_mxfp4``) and the same routing plan, combine and
roundings; only the two expert GEMMs differ.  Each GEMM is "swapped": the weight rows are the MMA's M side (128
a program: 64 gate + 64 up rows, or 128 rows of ``w2``) and a plan block's ``block_m`` slots its N side, so a
decode block of one slot wastes tensor-core work, not weight bytes.  Per K step one producer warpgroup loads, by
TMA, the two [64, BK / 2] byte tiles and the block's [block_m, BK] activation rows (the up GEMM reads ``x``'s rows
gathered into slot order first, one ``index_select``; the down GEMM ``act`` as the up GEMM wrote it); the two
consumer warpgroups decode each 4-byte word (8 values) with ``_DEQUANT``: an e2m1 code's sign and magnitude bits
put into an fp16's give its value times 2^-14 exactly, times the 32-column group's e8m0 scale (times 2^14) in
fp32, rounded to bf16 (exact) -- the value ``dequant_mxfp4`` gives, as the Triton kernels do.  Epilogues as there:
the projections rounded to bf16, clamped SwiGLU (``limit`` = inf when the op has none), the slot's routing weight.

(No ``from __future__ import annotations`` here: TileLang evaluates the program's annotations.)  Built ahead of
time into the kernel set only where TileLang and nvcc are installed (``kernel_set/tilelang_compile``);
the GPU host needs neither.  :func:`prepare` returns None when the active set lacks the variant or the call is not
covered (bf16 only, dims multiples of the tiles), and the op then runs the Triton form.
"""


import math
from typing import Any

import torch

from deepinfer_cuda.arch import (
    MXFP4_TILELANG_CANDIDATES,
    CudaArch,
    Mxfp4TileLang,
    moe_combine_config,
    mxfp4_tilelang_config,
)
from deepinfer_cuda.kernel_set.dispatch import Launch, LaunchChain
from deepinfer_cuda.kernel_set.manifest import TileLangVariant
from deepinfer_cuda.kernel_set.tilelang_kernel import TileLangKernel
from deepinfer_cuda.kernels.moe_experts import AOT_SHAPES, COMBINE_KERNEL, _combine_constexprs
from deepinfer_cuda.kernels.moe_routing import plan

#: One consumer thread's step: 4 packed bytes (8 e2m1 codes, low nibble = even column) and their group's e8m0
#: scale -> 8 bf16 values.  fp16 bits (sign << 15 | code & 7 << 9) are the code's value times 2^-14, exactly.
_DEQUANT = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>
__device__ __forceinline__ void di_mxfp4x8(const unsigned char* src, const unsigned char e8m0, void* dst) {
  const unsigned q = *reinterpret_cast<const unsigned*>(src);
  const float scale = __uint_as_float(((unsigned)e8m0) << 23) * 16384.0f;
  #pragma unroll
  for (int i = 0; i < 4; ++i) {
    const unsigned b = (q >> (8 * i)) & 0xFFu;
    unsigned h = ((b & 0x8u) << 12) | ((b & 0x7u) << 9) | ((b & 0x80u) << 24) | ((b & 0x70u) << 21);
    const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
    reinterpret_cast<__nv_bfloat162*>(dst)[i] = __floats2bfloat162_rn(f.x * scale, f.y * scale);
  }
}
"""
THREADS = 256  #: the consumer warpgroups (TileLang adds the producer's 128)


def _program(kind: str, hidden: int, inter: int, block_m: int, block_k: int, stages: int) -> Any:
    """The ``T.prim_func`` of the up (``kind="up"``) or down GEMM; every other size is a dynamic dim."""
    import tilelang.language as T

    up = kind == "up"
    K, N = (hidden, inter) if up else (inter, hidden)
    cols = 64 if up else 128  # output columns a program: gate + up rows of 64 each, or 128 rows of w2
    chunks = block_k // 8  # 8-column chunks a row
    step = THREADS // chunks  # rows one pass of the consumer threads covers
    passes = 64 // step  # passes over each half (64 rows) of the weight tile
    slots, nb, wrows = T.dynamic("slots"), T.dynamic("nb"), T.dynamic("wrows")

    @T.prim_func
    def main(xs: T.Tensor((slots, K), "bfloat16"), w: T.Tensor((wrows, K // 2), "uint8"),
             s: T.Tensor((wrows, K // 32), "uint8"), out: T.Tensor((slots, N), "bfloat16"),
             order: T.Tensor((slots,), "int32"), weights: T.Tensor((slots,), "float32"),
             blocks: T.Tensor((3, nb), "int32"), limit: T.float32):
        with T.Kernel(nb, N // cols, threads=THREADS) as (b, c):
            wa_s = T.alloc_shared((64, block_k // 2), "uint8")
            wb_s = T.alloc_shared((64, block_k // 2), "uint8")
            x_s = T.alloc_shared((block_m, block_k), "bfloat16")
            w_s = T.alloc_shared((128, block_k), "bfloat16")
            acc = T.alloc_fragment((128, block_m), "float32")
            c_s = T.alloc_shared((128, block_m), "float32")
            packed = T.alloc_local((4,), "uint8")
            deq = T.alloc_local((8,), "bfloat16")
            sc = T.alloc_local((2 * passes,), "uint8")  # this stage's scale byte of each row the thread decodes
            sc_next = T.alloc_local((2 * passes,), "uint8")  # the next stage's, loaded a stage ahead
            tx = T.get_thread_binding()
            expert, start, end = blocks[0, b], blocks[1, b], blocks[2, b]
            ra = expert * (2 * inter if up else hidden) + c * cols
            rb = ra + (inter if up else 64)
            r0 = tx // chunks  # the thread's first row; it decodes rows r0 + step * it of each half
            j = (tx % chunks) * 8  # and columns [j, j + 8) of each stage
            n_k = T.if_then_else(start < end, K // block_k, 0)
            T.import_source(_DEQUANT)
            T.clear(acc)
            for it in T.unroll(passes):
                sc_next[it] = s[ra + r0 + it * step, j // 32]
                sc_next[passes + it] = s[rb + r0 + it * step, j // 32]
            for k in T.Pipelined(n_k, num_stages=stages):
                T.copy(w[ra, k * (block_k // 2)], wa_s)
                T.copy(w[rb, k * (block_k // 2)], wb_s)
                T.copy(xs[start, k * block_k], x_s)
                for it in T.unroll(2 * passes):
                    sc[it] = sc_next[it]
                if k + 1 < n_k:  # the scale loads' latency hides behind this stage's decoding
                    for it in T.unroll(passes):
                        sc_next[it] = s[ra + r0 + it * step, (k + 1) * (block_k // 32) + j // 32]
                        sc_next[passes + it] = s[rb + r0 + it * step, (k + 1) * (block_k // 32) + j // 32]
                for it in T.unroll(passes):
                    for v in T.vectorized(4):
                        packed[v] = wa_s[r0 + it * step, j // 2 + v]
                    T.call_extern("handle", "di_mxfp4x8", T.address_of(packed[0]), sc[it], T.address_of(deq[0]))
                    for v in T.vectorized(8):
                        w_s[r0 + it * step, j + v] = deq[v]
                    for v in T.vectorized(4):
                        packed[v] = wb_s[r0 + it * step, j // 2 + v]
                    T.call_extern("handle", "di_mxfp4x8", T.address_of(packed[0]), sc[passes + it],
                                  T.address_of(deq[0]))
                    for v in T.vectorized(8):
                        w_s[64 + r0 + it * step, j + v] = deq[v]
                T.gemm(w_s, x_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            T.copy(acc, c_s)
            if up:
                for i, j in T.Parallel(64, block_m):
                    if start + j < end:
                        g = T.min(c_s[i, j].astype("bfloat16").astype("float32"), limit)
                        u = T.clamp(c_s[64 + i, j].astype("bfloat16").astype("float32"), -limit, limit)
                        silu = (g / (1.0 + T.exp(-g))).astype("bfloat16").astype("float32")
                        out[start + j, c * cols + i] = (silu * u).astype("bfloat16")
            else:
                for i, j in T.Parallel(128, block_m):
                    if start + j < end:
                        slot = order[start + j]
                        y = c_s[i, j].astype("bfloat16").astype("float32") * weights[slot]
                        out[slot, c * cols + i] = y.astype("bfloat16")

    return main


def _variant(config: Mxfp4TileLang, hidden: int, inter: int) -> dict[str, int]:
    return {"hidden": hidden, "inter": inter, "block_m": config.block_m, "block_k": config.block_k,
            "stages": config.stages}


def _aot_variants(arch: CudaArch) -> list[TileLangVariant]:
    """Every candidate of :data:`arch.MXFP4_TILELANG_CANDIDATES` at V4-Flash's and V4.1-Flash's expert shapes."""
    if arch.triton_arch != 90:  # wgmma: Hopper's; SM100 keeps its Triton forms
        return []
    shapes = sorted({(h, i) for h, i, k in AOT_SHAPES if k == 6})  # MXFP4: the routed experts (top-6) only
    configs = [c for tier in MXFP4_TILELANG_CANDIDATES.values() for c in tier]
    return [TileLangVariant(_variant(c, h, i)) for h, i in shapes for c in configs]


UP_KERNEL = TileLangKernel("moe_experts_mxfp4_tl_up", lambda **c: _program("up", **c), _aot_variants)
DOWN_KERNEL = TileLangKernel("moe_experts_mxfp4_tl_down", lambda **c: _program("down", **c), _aot_variants)


def covers(x: torch.Tensor, hidden: int, inter: int, config: Mxfp4TileLang) -> bool:
    """Whether the TileLang GEMMs take this call: bf16, and every dim a multiple of its tile."""
    return (x.dtype == torch.bfloat16 and hidden % 128 == 0 and inter % 64 == 0 and hidden % config.block_k == 0
            and inter % config.block_k == 0)


def prepare(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
            w2: torch.Tensor, w2_scale: torch.Tensor, swiglu_limit: float | None, *, arch: CudaArch,
            config: Mxfp4TileLang | None = None, require: bool = False) -> LaunchChain | None:
    """Plan the op with the TileLang GEMMs, or None when they do not take it (``config`` None: the arch table's
    choice for the call's slots per expert; ``require``: plan it even if the active kernel set lacks the cubins,
    for tests that only inspect the plan)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    slots = tokens * top_k
    if config is None:
        config = mxfp4_tilelang_config(arch, slots // max(1, num_experts), hidden, inter)
    if config is None or slots == 0 or not covers(x, hidden, inter, config):
        return None
    variant = _variant(config, hidden, inter)
    if not require and not (UP_KERNEL.available(arch, variant) and DOWN_KERNEL.available(arch, variant)):
        return None
    ids = ids.contiguous()
    order, blocks, plan_steps = plan(ids, num_experts, config.block_m, arch=arch)
    n_blocks = blocks.shape[1]
    xs = torch.empty(slots, hidden, dtype=x.dtype, device=x.device)
    gather = Launch((1,), _CONFIG, dict(x=x.contiguous(), order=order, top_k=top_k, out=xs), xs)
    act = torch.empty(slots, inter, dtype=x.dtype, device=x.device)
    slot_out = torch.empty(slots, hidden, dtype=x.dtype, device=x.device)
    out = torch.empty_like(x)
    limit = math.inf if swiglu_limit is None else float(swiglu_limit)
    common = dict(order=order, weights=weights.reshape(-1).to(torch.float32).contiguous(), blocks=blocks,
                  nb=n_blocks, slots=slots, limit=limit, constexprs=variant)
    up = Launch((n_blocks, inter // 64), _CONFIG, dict(xs=xs, w=_rows(w13), s=_rows(w13_scale), out=act,
                                                       wrows=num_experts * two_inter, **common), act)
    down = Launch((n_blocks, hidden // 128), _CONFIG, dict(xs=act, w=_rows(w2), s=_rows(w2_scale), out=slot_out,
                                                          wrows=num_experts * hidden, **common), slot_out)
    cfg, block_h = moe_combine_config(arch, hidden)
    combine = Launch((tokens, -(-hidden // block_h)), cfg,
                     dict(slot_out_ptr=slot_out, ids_ptr=ids, out_ptr=out,
                          **_combine_constexprs(hidden, top_k, block_h)), out)
    steps: list[tuple[Any, Launch]] = [*plan_steps, (GATHER, gather), (UP_KERNEL, up), (DOWN_KERNEL, down),
                                       (COMBINE_KERNEL, combine)]
    return LaunchChain(steps, lambda: out)


_CONFIG = Mxfp4TileLang.LAUNCH


class _Gather:
    """x's rows in slot order for the up GEMM's TMA (``xs[r] = x[order[r] // k]``), as a chain step: it must run
    after the plan's kernels have written ``order``."""

    name = "moe_experts_mxfp4_tl_gather"

    def launch(self, grid: tuple[int, ...], config: Any, args: dict[str, Any], device_index: int) -> None:
        torch.index_select(args["x"], 0, torch.div(args["order"], args["top_k"], rounding_mode="floor"),
                           out=args["out"])


GATHER = _Gather()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Stacked experts' bytes [E, rows, n] as one [E * rows, n] uint8 matrix (what the TMA descriptors cover)."""
    t = t.contiguous().view(torch.uint8)
    return t.view(-1, t.shape[-1])
