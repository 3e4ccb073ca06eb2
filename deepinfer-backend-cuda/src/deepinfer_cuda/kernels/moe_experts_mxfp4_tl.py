# mypy: disable-error-code="valid-type"
"""MXFP4 routed experts in TileLang (SM90): TMA of the packed e2m1 words into shared memory, decoded by the
consumer warpgroups straight into the wgmma's A-operand registers (RS wgmma), warp-specialized.

The same op as ``moe_experts_mxfp4.py`` (core's ``moe_experts_mxfp4``) and the same routing plan, combine and
roundings; only the two expert GEMMs differ.  Each GEMM is "swapped": the weight rows are the MMA's M side (128
a program: 64 gate + 64 up rows, or 128 rows of ``w2``) and a plan block's ``block_m`` slots its N side, so a
decode block of one slot wastes tensor-core work, not weight bytes.  Per K step one producer warpgroup loads, by
TMA, the block's [128, BK / 8] tile of 32-bit words (8 codes each) and its [block_m, BK] activation rows; each
consumer thread loads its own rows' e8m0 scale bytes for the next step into registers, then decodes its share of
the words into its wgmma fragment (no bf16 tile in shared memory: each packed byte is read once).

**The K order.**  A wgmma A fragment gives a thread, in each 16-column slice, columns 2q, 2q + 1, 2q + 8, 2q + 9
(q = lane % 4), a register holding each pair (2q + b, b = 0, 1).  So that a thread's 16 values of a 64-column
block come from two whole words (bytes 8q..8q + 7 of the block, one 32-column scale group) and each register's
pair from codes n and n + 4 of one word (bits 4n and 16 + 4n: one mask and one multiply place both), the GEMM runs
its K columns in the order :func:`k_order`: logical column 16s + 8h + 2q + b reads stored column
16q + 8h + 4b + s.  K is summed, so only the activations need the same order: the up GEMM reads ``x``'s rows
gathered in slot order *and* columns in that order (one gather), and the up GEMM writes ``act`` in it
(:func:`k_position`) for the down GEMM; the down GEMM's output is in natural order.

**The decode** (``_DEQUANT``, per register: codes n and n + 4 of a word, code n in bits 4n..4n + 3): mask the two
codes and multiply by 2^6 + 2^12 (one ``IMAD``: each code's magnitude lands in the low exponent bits and top
mantissa bit of its bf16 half, its sign in the sign bit), mask again: the bf16 pair of the e2m1 values times
2^-126 (the exponent bias; 0.5 is a subnormal).  Two bf16x2 multiplies, by 2^126 and by the group's scale
(2^(e8m0 - 127), exactly a bf16 whose exponent field is e8m0), give ``dequant_mxfp4``'s bf16 values, exact, with
no tables kept in registers (instruction counts: docs/cuda_backend.md).  Where both weights' scales are at most 2
(:func:`scales_fold`), the *folded* decode multiplies once, by 2^(e8m0 - 1) (2^126 times the scale, still a bf16):
the same values, one bf16x2 multiply a register fewer (off until it has run on a GPU: ``arch.MXFP4_FOLDED_DECODE``).
Epilogues as in the Triton kernels: the projections rounded to bf16, clamped SwiGLU (``limit`` = inf when the op
has none), the slot's routing weight.

(No ``from __future__ import annotations`` here: TileLang evaluates the program's annotations.)  Built ahead of
time into the kernel set only where TileLang and nvcc are installed (``kernel_set/tilelang_compile``);
the GPU host needs neither.  :func:`prepare` returns None when the active set lacks the variant or the call is not
covered (bf16 only, dims multiples of the tiles), and the op then runs the Triton form.
"""


import functools
import math
import re
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

import deepinfer_cuda.arch as cuda_arch
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

#: Element n (0..7) of a word's e2m1 codes times 2^(e8m0 - 127) as bf16 bits.  Called once per fragment element;
#: nvcc shares the work of the register's pair (n, n + 4) between the two calls.  Codes n and n + 4 sit at bits 4n
#: and 16 + 4n: for n = 1, 3 the mask takes them at bits 4..7 and 20..23 (multiplier 2^2 + 2^8), for n = 2, 3 the
#: word is first shifted down a byte.
MAGNITUDE_AND_SIGN = 0x81C081C0  #: bf16 pair bits: sign, the two low exponent bits, the top mantissa bit
TWO_POW_126 = 0x7E807E80  #: bf16 pair 2^126, undoing the exponent bias the placed bits carry
#: A bf16x2 from its bits (a decode's placed pair or one of its factors); both TileLang decodes (this one and
#: ``fp8_block_linear_tl``'s) include it.
BF16_PAIR = r"""
#include <cuda_bf16.h>
__device__ __forceinline__ __nv_bfloat162 di_bf16_pair(const unsigned bits) {
  return *reinterpret_cast<const __nv_bfloat162*>(&bits);
}
"""
_DEQUANT = BF16_PAIR + r"""
__device__ __forceinline__ __nv_bfloat162 di_e2m1_pair(const unsigned q, const int n) {
  const unsigned y = (n & 2) ? q >> 8 : q;
  const unsigned t = (n & 1) ? (y & 0x00F000F0u) * 0x104u : (y & 0x000F000Fu) * 0x1040u;
  return di_bf16_pair(t & DI_MASKu);  // (code n, code n + 4) x 2^-126 as a bf16 pair
}
__device__ __forceinline__ unsigned short di_half(const __nv_bfloat162 r, const int n) {
  return __bfloat16_as_ushort((n & 4) ? __high2bfloat16(r) : __low2bfloat16(r));
}
__device__ __forceinline__ unsigned short di_e2m1_at(const unsigned q, const int n, const unsigned char e8m0) {
  // times 2^126, then the scale 2^(e8m0 - 127) a half
  return di_half(__hmul2(__hmul2(di_e2m1_pair(q, n), di_bf16_pair(DI_BIASu)), di_bf16_pair(e8m0 * 0x00800080u)), n);
}
__device__ __forceinline__ unsigned short di_e2m1_at_folded(const unsigned q, const int n, const unsigned char e8m0) {
  // times 2^(e8m0 - 1) a half: 2^126 and the scale in one factor (e8m0 <= FOLD_MAX_E8M0)
  return di_half(__hmul2(di_e2m1_pair(q, n), di_bf16_pair((e8m0 + 126u) * 0x00800080u)), n);
}
""".replace("DI_MASK", f"{MAGNITUDE_AND_SIGN:#x}").replace("DI_BIAS", f"{TWO_POW_126:#x}")
#: The largest e8m0 scale byte the folded decode takes: its one factor 2^(e8m0 - 1) must be a bf16 (exponent field
#: e8m0 + 126 <= 254), i.e. scales up to 2 (trained weights' groups are far smaller).
FOLD_MAX_E8M0 = 128
THREADS = 256  #: the consumer warpgroups (TileLang adds the producer's 128)


def _word(j: Any) -> Any:
    """The 32-bit word (of a row's words) holding logical K column ``j`` (ints, TIR expressions or tensors)."""
    return (j // 64) * 8 + ((j // 2) % 4) * 2 + (j // 8) % 2


def _nibble(j: Any) -> Any:
    """Which of its word's 8 codes logical column ``j`` is."""
    return (j // 16) % 4 + (j % 2) * 4


def _group(j: Any) -> Any:
    """The 32-column scale group of logical column ``j``."""
    return (j // 64) * 2 + ((j // 2) % 4) // 2


def k_position(p: Any) -> Any:
    """Where stored column ``p`` runs in the GEMMs' K order (the inverse of :func:`k_order`)."""
    return (p // 64) * 64 + (p % 4) * 16 + ((p // 8) % 2) * 8 + ((p // 16) % 4) * 2 + (p // 4) % 2


@functools.cache
def _k_order(n: int, device: str) -> torch.Tensor:
    j = torch.arange(n, device=device)
    return _word(j) * 8 + _nibble(j)


def k_order(n: int, device: torch.device) -> torch.Tensor:
    """The stored column each of the GEMMs' ``n`` K columns reads (``n`` a multiple of 64; cached per device)."""
    return _k_order(n, str(device))


def _program(kind: str, hidden: int, inter: int, block_m: int, block_k: int, stages: int, occupancy: int,
             folded: int) -> Any:
    """The ``T.prim_func`` of the up (``kind="up"``) or down GEMM; every other size is a dynamic dim.  ``folded``:
    the one-multiply decode (``di_e2m1_at_folded``: scales up to ``FOLD_MAX_E8M0``)."""
    import tilelang
    import tilelang.language as T

    up = kind == "up"
    K, N = (hidden, inter) if up else (inter, hidden)
    cols = 64 if up else 128  # output columns a program: gate + up rows of 64 each, or 128 rows of w2
    words, groups = block_k // 8, block_k // 32
    slots, nb, wrows = T.dynamic("slots"), T.dynamic("nb"), T.dynamic("wrows")
    bounds, prefetch_scales, load, store = gemm_steps(T, kind, hidden, inter, block_m, block_k, k_position)
    decode = "di_e2m1_at_folded" if folded else "di_e2m1_at"

    @T.prim_func
    def main(xs: T.Tensor((slots, K), "bfloat16"), w: T.Tensor((wrows, K // 8), "uint32"),
             s: T.Tensor((wrows, K // 32), "uint8"), out: T.Tensor((slots, N), "bfloat16"),
             order: T.Tensor((slots,), "int32"), weights: T.Tensor((slots,), "float32"),
             blocks: T.Tensor((3, nb), "int32"), limit: T.float32):
        with T.Kernel(nb, N // cols, threads=THREADS) as (b, c):
            T.annotate_min_blocks_per_sm(occupancy)
            if occupancy > 1:  # TileLang's setmaxnreg split would ask for the whole register file: two deadlock
                T.no_set_max_nreg()
            w_s = T.alloc_shared((128, words), "uint32")
            x_s = T.alloc_shared((block_m, block_k), "bfloat16")
            w_f = T.alloc_fragment((128, block_k), "bfloat16")  # the wgmma's A operand, in registers
            sc = T.alloc_fragment((128, groups), "uint8")  # this step's scales of the thread's rows
            sc_next = T.alloc_fragment((128, groups), "uint8")  # the next step's, loaded a step ahead
            acc = T.alloc_fragment((128, block_m), "float32")
            c_s = T.alloc_shared((128, block_m), "float32")
            start, end, ra, rb, n_k = bounds(blocks, b, c)
            T.import_source(_DEQUANT)
            T.annotate_layout({w_s: tilelang.layout.make_swizzled_layout(w_s)})
            T.clear(acc)
            prefetch_scales(s, sc_next, ra, rb, -1)
            for k in T.Pipelined(n_k, num_stages=stages):
                load(w, xs, s, w_s, x_s, sc, sc_next, ra, rb, start, k, n_k)
                for i, j in T.Parallel(128, block_k):
                    code = T.call_extern("uint16", decode, w_s[i, _word(j)], _nibble(j), sc[i, _group(j)])
                    w_f[i, j] = T.reinterpret(code, "bfloat16")
                T.gemm(w_f, x_s, acc, transpose_B=True, policy=T.GemmWarpPolicy.FullRow)
            T.copy(acc, c_s)
            store(c_s, out, order, weights, None, start, end, c, limit)

    return main


def gemm_steps(T: Any, kind: str, hidden: int, inter: int, block_m: int, block_k: int, k_position: Any
               ) -> tuple[Any, Any, Any, Any]:
    """The statements both TileLang forms' GEMMs (this one, ``moe_experts_mxfp4_w4a8_tl``) run alike, as TileLang
    macros: ``bounds``, a program's plan block (its slots ``start``..``end``, the weight rows ``ra`` / ``rb`` of its
    two 64-row halves, its K steps ``n_k``: none for an empty block); ``prefetch_scales``, the thread's rows' e8m0
    scales of step ``k + 1`` into registers (``k = -1``: the first step's); ``load``, one pipeline step's TMA copies
    (the 128 weight rows' words, the block's activation rows), its scales, and the next step's scales fetched a step
    ahead so that their latency hides behind this step's decoding; and ``store``, the epilogue from the fp32 sums in
    ``c_s`` -- times the activations' row scale where ``xscale`` is given --: the up GEMM's projections rounded to
    bf16, clamped SwiGLU written in the K order (``k_position``), the down GEMM's rows times the slot's routing
    weight.  Each program's generated CUDA is what the statements written out gave (checked by lowering)."""
    up = kind == "up"
    K = hidden if up else inter
    cols, words, groups = 64 if up else 128, block_k // 8, block_k // 32

    @T.macro
    def bounds(blocks, b, c):
        expert, start, end = blocks[0, b], blocks[1, b], blocks[2, b]
        ra = expert * (2 * inter if up else hidden) + c * cols
        rb = ra + (inter if up else 64)
        n_k = T.if_then_else(start < end, K // block_k, 0)
        return start, end, ra, rb, n_k

    @T.macro
    def prefetch_scales(s, sc_next, ra, rb, k):
        for i, g in T.Parallel(128, groups):
            sc_next[i, g] = s[T.if_then_else(i < 64, ra + i, rb + i - 64), (k + 1) * groups + g]

    @T.macro
    def load(w, xs, s, w_s, x_s, sc, sc_next, ra, rb, start, k, n_k):
        T.copy(w[ra:ra + 64, k * words:(k + 1) * words], w_s[0:64, :])
        T.copy(w[rb:rb + 64, k * words:(k + 1) * words], w_s[64:128, :])
        T.copy(xs[start, k * block_k], x_s)
        T.copy(sc_next, sc)
        if k + 1 < n_k:  # the scale loads' latency hides behind this step's decoding
            prefetch_scales(s, sc_next, ra, rb, k)

    def rounded(c_s: Any, xscale: Any, i: Any, j: Any, row: Any) -> Any:
        """A sum (times its activation row's scale) rounded to bf16, in fp32."""
        v = c_s[i, j] if xscale is None else c_s[i, j] * xscale[row]
        return v.astype("bfloat16").astype("float32")

    @T.macro
    def store(c_s, out, order, weights, xscale, start, end, c, limit):
        if up:
            for i, j in T.Parallel(64, block_m):
                if start + j < end:
                    g = T.min(rounded(c_s, xscale, i, j, start + j), limit)
                    u = T.clamp(rounded(c_s, xscale, 64 + i, j, start + j), -limit, limit)
                    silu = (g / (1.0 + T.exp(-g))).astype("bfloat16").astype("float32")
                    out[start + j, c * cols + k_position(i)] = (silu * u).astype("bfloat16")
        else:
            for i, j in T.Parallel(128, block_m):
                if start + j < end:
                    slot = order[start + j]
                    y = rounded(c_s, xscale, i, j, start + j) * weights[slot]
                    out[slot, c * cols + i] = y.astype("bfloat16")

    return bounds, prefetch_scales, load, store


def _variant(config: Mxfp4TileLang, hidden: int, inter: int, folded: int | None = None) -> dict[str, int]:
    """The constexprs of a variant (``folded``: the bf16 form's decode, 0 or 1; the W4A8 form has none)."""
    variant = {"hidden": hidden, "inter": inter, "block_m": config.block_m, "block_k": config.block_k,
               "stages": config.stages, "occupancy": config.occupancy}
    return variant if folded is None else {**variant, "folded": folded}


def _aot_variants(arch: CudaArch, candidates: dict[str, tuple[Mxfp4TileLang, ...]] = MXFP4_TILELANG_CANDIDATES,
                  folds: tuple[int | None, ...] = (0, 1)) -> list[TileLangVariant]:
    """Every tile of ``candidates`` (by tier; the W4A8 form passes its own, and no ``folds``) at V4-Flash's and
    V4.1-Flash's expert shapes, with each decode of ``folds``."""
    if arch.triton_arch != 90:  # wgmma: Hopper's; SM100 keeps its Triton forms
        return []
    shapes = sorted({(h, i) for h, i, k in AOT_SHAPES if k == 6})  # MXFP4: the routed experts (top-6) only
    configs = list(dict.fromkeys(c for tier in candidates.values() for c in tier))
    return [TileLangVariant(_variant(c, h, i, f)) for h, i in shapes for c in configs for f in folds]


_LARGEST = WeakIdKeyDictionary()  #: scale tensor -> (its version, its largest e8m0 byte)


def scales_at_most(scale: torch.Tensor, largest: int) -> bool:
    """Whether every e8m0 byte of ``scale`` is at most ``largest`` (a folded decode's limit).  Read once per tensor
    and version (one device sync, at the op's first eager call: the graph service warms a step up before capturing
    it); inside a capture, a tensor not read yet answers False (the two-multiply decode)."""
    known = _LARGEST.get(scale)
    if known is None or known[0] != scale._version:
        if scale.is_cuda and torch.cuda.is_current_stream_capturing():
            return False
        known = _LARGEST[scale] = (scale._version, int(scale.view(torch.uint8).max()))
    return known[1] <= largest


def scales_fold(scale: torch.Tensor) -> bool:
    """Whether this form's folded decode takes ``scale`` (every byte at most ``FOLD_MAX_E8M0``)."""
    return scales_at_most(scale, FOLD_MAX_E8M0)


_ARRIVE = re.compile(r"^\s*mbarrier\[[^\]]+\]\.arrive\(\);$")


def release_weights_after_mma(source: str) -> str:
    """Move the consumers' release of a weight stage (TileLang puts it right after their last read of ``w_s``,
    before the step's wgmma) to after the wgmma wait, beside the activation stage's release.

    TileLang releases a shared buffer after the statement that last reads it; here that read is a plain load into
    registers that the wgmma consumes, and with two programs an SM the producer's next TMA into the stage raced
    it (outputs differing run to run: docs/performance/log/2026-12-06.md).  Once the wgmma has waited, its A
    registers -- and so the loads -- are done.  The weight stage's releases are the one run of ``arrive()`` lines
    (one per weight copy: two here, one in ``fp8_block_linear_tl``) before the first wgmma wait; raises if the
    source is not that shape."""
    lines = source.split("\n")
    wait = next((j for j, line in enumerate(lines) if "warpgroup_wait<0>();" in line), None)
    if wait is None:
        raise RuntimeError("release_weights_after_mma: no wgmma wait in the source")
    starts = [i for i in range(wait) if _ARRIVE.match(lines[i]) and not _ARRIVE.match(lines[i - 1])]
    if len(starts) != 1:
        raise RuntimeError(f"release_weights_after_mma: expected one run of weight-stage releases, found {starts}")
    i = end = starts[0]
    while _ARRIVE.match(lines[end]):
        end += 1
    late = next((j for j in range(wait, len(lines)) if _ARRIVE.match(lines[j])), None)
    if late is None:
        raise RuntimeError("release_weights_after_mma: no activation-stage release after the wgmma wait")
    return "\n".join(lines[:i] + lines[end:late] + lines[i:end] + lines[late:])


UP_KERNEL = TileLangKernel("moe_experts_mxfp4_tl_up", lambda **c: _program("up", **c), _aot_variants,
                           release_weights_after_mma)
DOWN_KERNEL = TileLangKernel("moe_experts_mxfp4_tl_down", lambda **c: _program("down", **c), _aot_variants,
                             release_weights_after_mma)


def covers(x: torch.Tensor, hidden: int, inter: int, config: Mxfp4TileLang) -> bool:
    """Whether the TileLang GEMMs take this call: bf16, and every dim a multiple of its tile."""
    return (x.dtype == torch.bfloat16 and hidden % 128 == 0 and inter % 64 == 0 and hidden % config.block_k == 0
            and inter % config.block_k == 0)


def prepare(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor,
            w2: torch.Tensor, w2_scale: torch.Tensor, swiglu_limit: float | None, *, arch: CudaArch,
            config: Mxfp4TileLang | None = None, require: bool = False, folded: bool | None = None
            ) -> LaunchChain | None:
    """Plan the op with the TileLang GEMMs, or None when they do not take it (``config`` None: the arch table's
    choice for the call's slots per expert; ``require``: plan it even if the active kernel set lacks the cubins,
    for tests that only inspect the plan; ``folded`` None: the one-multiply decode where
    ``arch.MXFP4_FOLDED_DECODE`` is on and both weights' scales allow it, :func:`scales_fold`)."""
    tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    slots = tokens * top_k
    if config is None:
        config = mxfp4_tilelang_config(arch, slots, num_experts, hidden, inter)
    if config is None or slots == 0 or not covers(x, hidden, inter, config):
        return None
    if folded is None:
        folded = cuda_arch.MXFP4_FOLDED_DECODE and scales_fold(w13_scale) and scales_fold(w2_scale)
    variant = _variant(config, hidden, inter, int(folded))
    if not require and not (UP_KERNEL.available(arch, variant) and DOWN_KERNEL.available(arch, variant)):
        return None
    shared = SharedPlan.of(x, ids, weights, num_experts, inter, swiglu_limit, config.block_m, variant, arch)
    xs = torch.empty(slots, hidden, dtype=x.dtype, device=x.device)
    gather = Launch((1,), _CONFIG, dict(x=x.contiguous(), order=shared.order, top_k=top_k, out=xs), xs)
    up = Launch(shared.up_grid, _CONFIG, dict(xs=xs, w=_words(w13), s=_rows(w13_scale), out=shared.act,
                                              wrows=num_experts * two_inter, **shared.common), shared.act)
    down = Launch(shared.down_grid, _CONFIG, dict(xs=shared.act, w=_words(w2), s=_rows(w2_scale), out=shared.slot_out,
                                                  wrows=num_experts * hidden, **shared.common), shared.slot_out)
    return shared.chain([(GATHER, gather), (UP_KERNEL, up), (DOWN_KERNEL, down)])


@dataclass(slots=True)
class SharedPlan:
    """What the TileLang expert forms (this one, ``moe_experts_mxfp4_w4a8_tl``) plan alike around their GEMMs: the
    routing plan's launches and tables, the ``act`` / per-slot / output buffers, the GEMMs' common arguments and
    grids, the combine."""

    plan_steps: list[tuple[Any, Launch]]
    order: torch.Tensor
    act: torch.Tensor
    slot_out: torch.Tensor
    out: torch.Tensor
    common: dict[str, Any]
    up_grid: tuple[int, int]
    down_grid: tuple[int, int]
    combine: tuple[Any, Launch]

    @classmethod
    def of(cls, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, num_experts: int, inter: int,
           swiglu_limit: float | None, block_m: int, variant: dict[str, int], arch: CudaArch) -> "SharedPlan":
        (tokens, hidden), top_k = x.shape, ids.shape[1]
        slots = tokens * top_k
        ids = ids.contiguous()
        order, blocks, plan_steps = plan(ids, num_experts, block_m, arch=arch)
        n_blocks = blocks.shape[1]
        out = torch.empty_like(x)
        limit = math.inf if swiglu_limit is None else float(swiglu_limit)
        common = dict(order=order, weights=weights.reshape(-1).to(torch.float32).contiguous(), blocks=blocks,
                      nb=n_blocks, slots=slots, limit=limit, constexprs=variant)
        cfg, block_h = moe_combine_config(arch, hidden)
        slot_out = torch.empty(slots, hidden, dtype=x.dtype, device=x.device)
        combine = Launch((tokens, -(-hidden // block_h)), cfg,
                         dict(slot_out_ptr=slot_out, ids_ptr=ids, out_ptr=out,
                              **_combine_constexprs(hidden, top_k, block_h)), out)
        return cls(plan_steps, order, torch.empty(slots, inter, dtype=x.dtype, device=x.device), slot_out, out,
                   common, (n_blocks, inter // 64), (n_blocks, hidden // 128), (COMBINE_KERNEL, combine))

    def chain(self, gemm_steps: list[tuple[Any, Launch]]) -> LaunchChain:
        """The plan, ``gemm_steps`` (the activations' preparation and the two GEMMs), the combine."""
        out = self.out
        return LaunchChain([*self.plan_steps, *gemm_steps, self.combine], lambda: out)


_CONFIG = Mxfp4TileLang.LAUNCH


class _Gather:
    """x's rows in slot order and its columns in the GEMMs' K order for the up GEMM's TMA
    (``xs[r] = x[order[r] // k][k_order]``), as a chain step: it must run after the plan's kernels wrote ``order``.

    x's columns are put in the K order by one strided copy (per 64 columns the stored column 16q + 8h + 4b + s,
    viewed as [q, h, b, s], runs at 16s + 8h + 2q + b once permuted to [s, h, q, b]: :func:`k_order`'s rule), then
    its rows gathered by one ``index_select`` of contiguous rows (an ``index_select`` of the strided view itself
    runs torch's generic gather over every slot: docs/performance/log/2026-12-06.md)."""

    name = "moe_experts_mxfp4_tl_gather"

    def launch(self, grid: tuple[int, ...], config: Any, args: dict[str, Any], device_index: int) -> None:
        x, out = args["x"], args["out"]
        tokens, hidden = x.shape
        in_k_order = x.view(tokens, hidden // 64, 4, 2, 2, 4).permute(0, 1, 5, 3, 2, 4).reshape(tokens, hidden)
        torch.index_select(in_k_order, 0, torch.div(args["order"], args["top_k"], rounding_mode="floor"), out=out)


GATHER = _Gather()


def _rows(t: torch.Tensor) -> torch.Tensor:
    """Stacked experts' bytes [E, rows, n] as one [E * rows, n] uint8 matrix (what the TMA descriptors cover)."""
    t = t.contiguous().view(torch.uint8)
    return t.view(-1, t.shape[-1])


def _words(t: torch.Tensor) -> torch.Tensor:
    """Stacked experts' packed codes as one [E * rows, n / 4] matrix of 32-bit words (8 codes each)."""
    return _rows(t).view(torch.uint32)
