"""MoE routing after the router GEMM as one Triton pass: scores, top-k, renormalised weights.

Overrides core's ``moe_router(x, weight, correction_bias, top_k, routed_scaling_factor, score_func)``
(deepinfer/ops/moe.py).  The logits stay cuBLAS (``F.linear(x, weight)`` in x's dtype, as the reference computes
them); the reference's ~10 small torch kernels after it (``.float()``, softplus, sqrt, bias add, topk, gather, sum,
div, mul) become one launch, which is what a decode step pays for in a CUDA graph (~2 us a node, 43 MoE layers in
V4-Flash) and a prefill in host time.

One program holds ``BLOCK_T`` token rows x all ``E`` logits in registers:

- scores in fp32 by ``SCORE`` (sqrt(softplus) with torch's threshold 20, sigmoid, or softmax over the experts),
  with libdevice's ``expf`` / ``log1pf`` and IEEE sqrt and division: the functions torch's CUDA kernels call;
- top-k of ``score + bias`` as k rounds of one max over a packed int64 key (order-preserving bits of the biased
  score, then the inverted expert id), so a round finds the largest score and, among equals, the lowest expert
  id with one reduction; each round also reads the chosen expert's unbiased score (an exact one-hot sum);
- weights = score / (sum of the k scores, added in pick order, + 1e-20) * routed_scaling_factor.

The hash router (``moe_hash_router.py``) runs the same kernel with ``HASH``: the k experts are read, not chosen
(its own ``TritonKernel`` and AOT variants, named after its op, on the same ``@triton.jit`` function).
Every reduction runs along one token's row (max and one-hot sums are exact, so only softmax's sum has an order),
and the tile depends only on E, so a row's bits never depend on the rest of the batch.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from triton.language.extra import libdevice

from deepinfer_cuda.arch import CudaArch, LaunchConfig, moe_router_config
from deepinfer_cuda.kernel_set.dispatch import Launch, TritonKernel, cuda_target
from deepinfer_cuda.kernel_set.manifest import Variant
from deepinfer_cuda.kernels.grid_dependency import wait_for_producers
from deepinfer_cuda.override import override

#: core's SCORE_FUNCS as the kernel's SCORE constexpr.
SCORE_CODES = {"sqrtsoftplus": 0, "sigmoid": 1, "softmax": 2}
#: Routed experts compiled ahead of time: 64 (the V4 slice, tests), 256 (V4-Flash, V4.1-Flash), 384 (V4.1), and
#: V4.1-Flash's DSpark drafter: 128 experts, top-3.
AOT_EXPERTS = (64, 128, 256, 384)
AOT_TOP_K = (3, 6, 8)
AOT_DTYPES = ("bf16", "fp32")
#: libdevice has no implementation in Triton's CPU interpreter; the interpreter test turns this on to use
#: ``tl.exp`` and Kahan's log1p instead (the same function to a few ulps).  Off on the GPU.
INTERPRETED = False


@triton.jit
def _exp(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        return tl.exp(x)
    return libdevice.exp(x)


@triton.jit
def _log1p(x, INTERPRETED: tl.constexpr):
    if INTERPRETED:
        u = 1.0 + x
        return tl.where(u == 1.0, x, tl.log(u) * x / (u - 1.0))
    return libdevice.log1p(x)


@triton.jit
def _scores(logits, valid, SCORE: tl.constexpr, INTERPRETED: tl.constexpr):
    """fp32 scores of a [rows, BLOCK_E] tile of fp32 logits (``valid``: real experts; others score 0)."""
    if SCORE == 0:  # sqrt(softplus(l)), torch's softplus: l itself above the threshold 20
        s = tl.sqrt_rn(tl.where(logits > 20.0, logits, _log1p(_exp(logits, INTERPRETED), INTERPRETED)))
    elif SCORE == 1:
        s = tl.div_rn(tl.full(logits.shape, 1.0, tl.float32), 1.0 + _exp(-logits, INTERPRETED))
    else:
        shifted = tl.where(valid, logits, float("-inf"))
        e = _exp(shifted - tl.max(shifted, axis=1)[:, None], INTERPRETED)
        s = tl.div_rn(e, tl.broadcast_to(tl.sum(e, axis=1)[:, None], e.shape))
    return tl.where(valid, s, 0.0)


@triton.jit(do_not_specialize=["n_rows"])
def moe_router_kernel(logits_ptr, bias_ptr, ids_ptr, weights_ptr, n_rows, scale,
                       E: tl.constexpr, BLOCK_E: tl.constexpr, K: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_T: tl.constexpr, SCORE: tl.constexpr, HAS_BIAS: tl.constexpr, HASH: tl.constexpr,
                       INTERPRETED: tl.constexpr):
    wait_for_producers()
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    row_ok = rows < n_rows
    rows64 = rows.to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = row_ok[:, None] & (cols < E)[None, :]
    logits = tl.load(logits_ptr + rows64[:, None] * E + cols[None, :], mask=valid, other=0.0).to(tl.float32)
    scores = _scores(logits, valid, SCORE, INTERPRETED)
    if not HASH:
        biased = scores
        if HAS_BIAS:
            biased = scores + tl.load(bias_ptr + cols, mask=cols < E, other=0.0)[None, :]
        biased = tl.where(biased == 0.0, 0.0, biased)  # -0.0 ties +0.0, as in torch.topk
        bits = biased.to(tl.int32, bitcast=True)
        ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # signed int order == float order
        key = (ordered.to(tl.int64) << 32) | (BLOCK_E - 1 - cols).to(tl.int64)[None, :]
        key = tl.where(valid, key, -0x7FFFFFFFFFFFFFFF)  # below every real key (-inf is ~ -2**63 + 2**55)
    ks = tl.arange(0, BLOCK_K)
    picked = tl.zeros((BLOCK_T, BLOCK_K), tl.int64)
    chosen = tl.zeros((BLOCK_T, BLOCK_K), tl.float32)
    total = tl.zeros((BLOCK_T,), tl.float32)
    for j in tl.static_range(K):
        if HASH:
            expert = tl.load(ids_ptr + rows64 * K + j, mask=row_ok, other=0)
        else:
            best = tl.max(key, axis=1)
            expert = (BLOCK_E - 1) - (best & (BLOCK_E - 1))  # the key's low bits
            key = tl.where(cols.to(tl.int64)[None, :] == expert[:, None], -0x7FFFFFFFFFFFFFFF, key)
        w = tl.sum(tl.where(cols.to(tl.int64)[None, :] == expert[:, None], scores, 0.0), axis=1)
        total = total + w  # the reference's sum over k, in pick order
        picked = tl.where(ks[None, :] == j, expert[:, None], picked)
        chosen = tl.where(ks[None, :] == j, w[:, None], chosen)
    weights = tl.div_rn(chosen, tl.broadcast_to((total + 1e-20)[:, None], chosen.shape)) * scale
    out = rows64[:, None] * K + ks[None, :]
    out_ok = row_ok[:, None] & (ks < K)[None, :]
    tl.store(weights_ptr + out, weights, mask=out_ok)
    if not HASH:
        tl.store(ids_ptr + out, picked, mask=out_ok)


def _constexprs(experts: int, top_k: int, cfg: LaunchConfig, score_func: str, has_bias: bool, hash_ids: bool,
                interpreted: bool = False) -> dict[str, object]:
    if score_func not in SCORE_CODES:
        raise ValueError(f"unknown router scoring function {score_func!r}; known: {tuple(SCORE_CODES)}")
    return {"E": experts, "BLOCK_E": max(16, triton.next_power_of_2(experts)), "K": top_k,
            "BLOCK_K": max(2, triton.next_power_of_2(top_k)), "BLOCK_T": cfg.block_rows,
            "SCORE": SCORE_CODES[score_func], "HAS_BIAS": has_bias, "HASH": hash_ids, "INTERPRETED": interpreted}


def aot_variants(arch: CudaArch, hash_ids: bool) -> list[Variant]:
    """Contiguous logits (bf16 from the bf16 model, fp32 in tests), int64 ids, fp32 weights at V4's expert counts and
    top-k, every score function; learned routing with an fp32 correction bias or none, hash routing without."""
    variants = []
    for experts in AOT_EXPERTS:
        cfg = moe_router_config(arch, experts)
        for top_k in AOT_TOP_K:
            for dtype in AOT_DTYPES:
                for score_func in SCORE_CODES:
                    for has_bias in ((False,) if hash_ids else (True, False)):
                        sig = {"logits_ptr": f"*{dtype}:D"}
                        if has_bias:
                            sig["bias_ptr"] = "*fp32:D"
                        sig.update({"ids_ptr": "*i64:D", "weights_ptr": "*fp32:D", "n_rows": "i32", "scale": "fp32"})
                        const = _constexprs(experts, top_k, cfg, score_func, has_bias, hash_ids)
                        if not has_bias:
                            const["bias_ptr"] = None
                        variants.append(Variant(sig, const, cfg.num_warps, cfg.num_stages))
    return variants


KERNEL = TritonKernel("moe_router", moe_router_kernel, functools.partial(aot_variants, hash_ids=False))


@functools.cache
def _plan(arch: CudaArch, experts: int, top_k: int, score_func: str, has_bias: bool, hash_ids: bool,
          interpreted: bool) -> tuple[LaunchConfig, dict[str, object]]:
    cfg = moe_router_config(arch, experts)
    return cfg, _constexprs(experts, top_k, cfg, score_func, has_bias, hash_ids, interpreted)


def plan_routes(logits: torch.Tensor, bias: torch.Tensor | None, ids: torch.Tensor | None, top_k: int,
                routed_scaling_factor: float, score_func: str, *, arch: CudaArch, interpreted: bool) -> Launch:
    """The kernel's launch on router logits [T, E]: chosen (``ids`` None) or given ``ids`` [T, k] int64.

    ``Launch.result`` is ``(weights, ids)``; both [T, k], fp32 and int64.  ``interpreted``: the calling module's
    ``INTERPRETED`` switch (each op's module has its own, which the interpreter tests turn on).
    """
    experts = logits.shape[-1]
    logits = logits.reshape(-1, experts).contiguous()
    n_rows = logits.shape[0]
    hash_ids = ids is not None
    if ids is not None:
        ids = ids.reshape(n_rows, top_k).to(torch.int64).contiguous()
    else:
        ids = torch.empty((n_rows, top_k), dtype=torch.int64, device=logits.device)
    if bias is not None:
        bias = bias.to(torch.float32).contiguous()
    weights = torch.empty((n_rows, top_k), dtype=torch.float32, device=logits.device)
    cfg, constexprs = _plan(arch, experts, top_k, score_func, bias is not None, hash_ids, interpreted)
    args = dict(logits_ptr=logits, bias_ptr=bias, ids_ptr=ids, weights_ptr=weights, n_rows=n_rows,
                scale=float(routed_scaling_factor), **constexprs)
    return Launch((triton.cdiv(n_rows, cfg.block_rows),), cfg, args, (weights, ids))


def prepare(x: torch.Tensor, weight: torch.Tensor, correction_bias: torch.Tensor | None, top_k: int,
            routed_scaling_factor: float, score_func: str, *, arch: CudaArch) -> Launch:
    """Plan ``moe_router(...)`` for ``arch``: the logits GEMM runs (cuBLAS, as the reference's), the routing kernel
    is planned, not launched."""
    return plan_routes(F.linear(x, weight), correction_bias, None, top_k, routed_scaling_factor, score_func,
                       arch=arch, interpreted=INTERPRETED)


@override("moe_router", aot=(KERNEL,))
def moe_router(
    x: torch.Tensor,
    weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    routed_scaling_factor: float,
    score_func: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Learned routing: ``(weights [T, k] fp32, ids [T, k] int64)``, experts in descending biased score."""
    index, arch = cuda_target(x)
    return prepare(x, weight, correction_bias, top_k, routed_scaling_factor, score_func, arch=arch).run(KERNEL, index)
