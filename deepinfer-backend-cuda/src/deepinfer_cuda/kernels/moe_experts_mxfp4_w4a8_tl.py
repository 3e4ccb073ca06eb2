# mypy: disable-error-code="valid-type"
"""MXFP4 routed experts with FP8 activations (W4A8, opt-in: ``DEEPINFER_MXFP4_ACTIVATIONS=fp8``) in TileLang
(SM90): the structure of ``moe_experts_mxfp4_tl.py`` -- swapped GEMMs, TMA of the packed words, decoded by the
consumer warpgroups into the wgmma's A registers -- with FP8 wgmma (k32) instead of bf16 (k16).

**Why.**  The bf16 form is bound by its decode instructions (docs/performance.md: the same microseconds on the H100
and the H200).  An e2m1 code's bits placed in an e4m3 byte (sign to bit 7, the three magnitude bits to bits 2..4)
are its value times 2^-6 exactly -- 0.5 lands on e4m3's subnormal 2^-7 as e2m1's own subnormal does -- so eight
codes of a word become two registers of four e4m3 values by two shifts, four masks and two ors (``_DECODE``): about
one integer operation a value against the bf16 form's three.  The group's e8m0 scale cannot ride in the codes:
each 32-column group is one k32 wgmma into a fresh accumulator, added to the running sum times ``2^(e8m0 - 121)``
(the scale and the 2^6 back) in fp32, ``block_m / 2`` FMAs a thread a group (small for decode blocks).

**The activations** are e4m3 rows with one power-of-two scale a row (``fp8_e4m3_rows.py``): x's rows gathered in
slot order and K order for the up GEMM, ``act`` (written in K order by the up GEMM, bf16) for the down GEMM; a
row's scale multiplies its column of the sums in the epilogue.  The weights stay exact: the only new rounding is the
activations' e4m3 (a relative error about 2^-5 a value; measured against the exact op in docs/performance.md).

**The K order.**  A k32 FP8 A fragment gives lane q (= lane % 4) columns 4q..4q + 3 and 16 + 4q..16 + 4q + 3 of a
32-column group, four a register.  Word q of the group (stored columns 8q..8q + 7) holds them: its even codes
(low nibbles of its bytes) are the first register, its odd codes the second, so logical column 16h + 4q + i reads
stored column 8q + 2i + h (:func:`k_order`); scale groups map onto themselves.

The pipeline's copies and the epilogues are the bf16 form's (``gemm_steps``; the projections rounded to bf16 after
the row scale, clamped SwiGLU, the routing weight).  Tiles and tiers: ``arch.MXFP4_W4A8_CANDIDATES``;
:func:`prepare` returns None where the active kernel set lacks the variant or the call is not covered (bf16 x, dims
multiples of the tiles), and the op then runs its exact forms.
"""


import functools
import logging
from typing import Any

import torch

from deepinfer_cuda.arch import (
    MXFP4_W4A8_CANDIDATES,
    CudaArch,
    Mxfp4TileLang,
    mxfp4_w4a8_config,
)
from deepinfer_cuda.kernel_set.dispatch import Launch, LaunchChain
from deepinfer_cuda.kernel_set.tilelang_kernel import TileLangKernel
from deepinfer_cuda.kernels import fp8_e4m3_rows
from deepinfer_cuda.kernels import moe_experts_mxfp4_tl as tilelang_form
from deepinfer_cuda.kernels.moe_experts_mxfp4_tl import SharedPlan, _rows, _variant, _words, gemm_steps

MAGNITUDE = 0x1C1C1C1C  #: e4m3 byte bits 2..4: the low exponent bits and the top mantissa bit
SIGN = 0x80808080
#: Element e (0..7) of a word's fragment share as an e4m3 byte: e < 4 the even code 2e, else the odd code
#: 2(e - 4) + 1, each the e2m1 value times 2^-6.  nvcc computes the two registers once a word and keeps the bytes
#: in place (no byte moves: the fragment's four bytes are the register's).
_DECODE = r"""
__device__ __forceinline__ unsigned char di_e2m1_e4m3_at(const unsigned q, const int e) {
  const unsigned even = ((q << 2) & DI_MAGNITUDEu) | ((q << 4) & DI_SIGNu);
  const unsigned odd = ((q >> 2) & DI_MAGNITUDEu) | (q & DI_SIGNu);
  return (unsigned char)(((e & 4) ? odd : even) >> (8 * (e & 3)));
}
""".replace("DI_MAGNITUDE", f"{MAGNITUDE:#x}").replace("DI_SIGN", f"{SIGN:#x}")
THREADS = 256  #: the consumer warpgroups (TileLang adds the producer's 128)
logger = logging.getLogger("deepinfer.cuda")
CODE_EXPONENT = 6  #: the decoded bytes are the e2m1 values times 2^-CODE_EXPONENT


def k_order_of(j: Any) -> Any:
    """The stored column logical K column ``j`` reads (ints, TIR expressions or tensors)."""
    r = j % 32
    return j - r + ((r % 16) // 4) * 8 + (r % 4) * 2 + r // 16


def k_position(p: Any) -> Any:
    """Where stored column ``p`` runs in the GEMMs' K order (the inverse of :func:`k_order_of`)."""
    r = p % 32
    return p - r + (r % 2) * 16 + (r // 8) * 4 + (r % 8) // 2


@functools.cache
def _k_order(n: int, device: str) -> torch.Tensor:
    return k_order_of(torch.arange(n, device=device)).to(torch.int32)


def k_order(n: int, device: torch.device) -> torch.Tensor:
    """int32 [n]: the stored column of each of the GEMMs' ``n`` K columns (a multiple of 32; cached per device)."""
    return _k_order(n, str(device))


def _program(kind: str, hidden: int, inter: int, block_m: int, block_k: int, stages: int, occupancy: int
             ) -> Any:
    """The ``T.prim_func`` of the up (``kind="up"``) or down GEMM; every other size is a dynamic dim."""
    import tilelang
    import tilelang.language as T

    up = kind == "up"
    K, N = (hidden, inter) if up else (inter, hidden)
    cols = 64 if up else 128  # output columns a program: gate + up rows of 64 each, or 128 rows of w2
    words, groups = block_k // 8, block_k // 32
    slots, nb, wrows = T.dynamic("slots"), T.dynamic("nb"), T.dynamic("wrows")
    bounds, prefetch_scales, load, store = gemm_steps(T, kind, hidden, inter, block_m, block_k, k_position)

    @T.prim_func
    def main(xs: T.Tensor((slots, K), "float8_e4m3"), xscale: T.Tensor((slots,), "float32"),
             w: T.Tensor((wrows, K // 8), "uint32"), s: T.Tensor((wrows, K // 32), "uint8"),
             out: T.Tensor((slots, N), "bfloat16"), order: T.Tensor((slots,), "int32"),
             weights: T.Tensor((slots,), "float32"), blocks: T.Tensor((3, nb), "int32"), limit: T.float32):
        with T.Kernel(nb, N // cols, threads=THREADS) as (b, c):
            T.annotate_min_blocks_per_sm(occupancy)
            if occupancy > 1:  # TileLang's setmaxnreg split would ask for the whole register file: two deadlock
                T.no_set_max_nreg()
            w_s = T.alloc_shared((128, words), "uint32")
            x_s = T.alloc_shared((block_m, block_k), "float8_e4m3")
            w_f = T.alloc_fragment((128, 32), "float8_e4m3")  # one group's wgmma A operand, in registers
            sc = T.alloc_fragment((128, groups), "uint8")  # this step's scales of the thread's rows
            sc_next = T.alloc_fragment((128, groups), "uint8")  # the next step's, loaded a step ahead
            part = T.alloc_fragment((128, block_m), "float32")  # one group's product
            acc = T.alloc_fragment((128, block_m), "float32")
            c_s = T.alloc_shared((128, block_m), "float32")
            start, end, ra, rb, n_k = bounds(blocks, b, c)
            T.import_source(_DECODE)
            T.annotate_layout({w_s: tilelang.layout.make_swizzled_layout(w_s)})
            T.clear(acc)
            prefetch_scales(s, sc_next, ra, rb, -1)
            for k in T.Pipelined(n_k, num_stages=stages):
                load(w, xs, s, w_s, x_s, sc, sc_next, ra, rb, start, k, n_k)
                for g in T.unroll(groups):
                    for i, j in T.Parallel(128, 32):
                        code = T.call_extern("uint8", "di_e2m1_e4m3_at", w_s[i, g * 4 + (j % 16) // 4],
                                             (j // 16) * 4 + j % 4)
                        w_f[i, j] = T.reinterpret(code, "float8_e4m3")
                    T.gemm(w_f, x_s[:, g * 32:(g + 1) * 32], part, transpose_B=True, clear_accum=True,
                           policy=T.GemmWarpPolicy.FullRow)
                    for i, j in T.Parallel(128, block_m):  # 2^(e8m0 - 127 + 6) as fp32 bits
                        scale = T.reinterpret((sc[i, g].astype("uint32") + CODE_EXPONENT) << 23, "float32")
                        acc[i, j] += part[i, j] * scale
            T.copy(acc, c_s)
            store(c_s, out, order, weights, xscale, start, end, c, limit)

    return main


_aot_variants = functools.partial(tilelang_form._aot_variants, candidates=MXFP4_W4A8_CANDIDATES, folds=(None,))


#: No source fix: the weight tile is read inside each group's step, so TileLang releases both stages after the
#: step's last wgmma wait (the race ``release_weights_after_mma`` fixes in the bf16 form cannot happen).
UP_KERNEL = TileLangKernel("moe_experts_mxfp4_w4a8_up", lambda **c: _program("up", **c), _aot_variants)
DOWN_KERNEL = TileLangKernel("moe_experts_mxfp4_w4a8_down", lambda **c: _program("down", **c), _aot_variants)


def prepare(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
            w2: torch.Tensor, w2_scale: torch.Tensor, swiglu_limit: float | None, *, arch: CudaArch,
            config: Mxfp4TileLang | None = None, require: bool = False) -> LaunchChain | None:
    """Plan the op in W4A8, or None where this form does not take it (``config`` None: the arch table's tiles for
    the call's tier; ``require``: plan it even if the active kernel set lacks the cubins, for tests that only
    inspect the plan)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    slots = tokens * top_k
    if config is None:
        config = mxfp4_w4a8_config(arch, slots, num_experts)
    if (config is None or slots == 0 or x.dtype != torch.bfloat16 or hidden % 128 or inter % 64
            or hidden % config.block_k or inter % config.block_k):
        return None
    variant = _variant(config, hidden, inter)
    if not require and not (UP_KERNEL.available(arch, variant) and DOWN_KERNEL.available(arch, variant)):
        return None
    _warn_experimental()
    shared = SharedPlan.of(x, ids, weights, num_experts, inter, swiglu_limit, config.block_m, variant, arch)
    quant_x, xs, xs_scale = fp8_e4m3_rows.plan(x.contiguous(), slots, shared.order, k_order(hidden, x.device), top_k)
    quant_act, acts, acts_scale = fp8_e4m3_rows.plan(shared.act, slots, None, None, top_k)
    up = Launch(shared.up_grid, _CONFIG, dict(xs=xs, xscale=xs_scale, w=_words(w13), s=_rows(w13_scale),
                                              out=shared.act, wrows=num_experts * two_inter, **shared.common),
                shared.act)
    down = Launch(shared.down_grid, _CONFIG, dict(xs=acts, xscale=acts_scale, w=_words(w2), s=_rows(w2_scale),
                                                  out=shared.slot_out, wrows=num_experts * hidden, **shared.common),
                  shared.slot_out)
    return shared.chain([(fp8_e4m3_rows.KERNEL, quant_x), (UP_KERNEL, up), (fp8_e4m3_rows.KERNEL, quant_act),
                         (DOWN_KERNEL, down)])


_CONFIG = Mxfp4TileLang.LAUNCH


@functools.cache
def _warn_experimental() -> None:
    logger.warning("DEEPINFER_MXFP4_ACTIVATIONS=fp8: the W4A8 MXFP4 experts round their activations to e4m3 (~5% "
                   "relative error of the expert output against the exact form: docs/performance.md)")
