"""Mixture of experts: routers (learned top-k and frozen hash) and the clamped-SwiGLU experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.ops.registry import OpSample, batch_invariant_reference, reference_op
from deepinfer.ops.row_tiles import in_row_tiles

SCORE_FUNCS = ("sqrtsoftplus", "sigmoid", "softmax")


def _scores(logits: torch.Tensor, score_func: str) -> torch.Tensor:
    if score_func == "sqrtsoftplus":
        return F.softplus(logits).sqrt()
    if score_func == "sigmoid":
        return torch.sigmoid(logits)
    if score_func == "softmax":
        return torch.softmax(logits, dim=-1)
    raise ValueError(f"unknown router scoring function {score_func!r}; known: {SCORE_FUNCS}")


def _normalized(scores: torch.Tensor, ids: torch.Tensor, routed_scaling_factor: float) -> torch.Tensor:
    weights = scores.gather(1, ids)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * routed_scaling_factor


def _router_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, hidden, experts, top_k in [(5, 64, 8, 2), (33, 256, 64, 6)]:
        x = torch.randn(rows, hidden, generator=gen).to(dtype)
        w = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).to(dtype)
        bias = 0.1 * torch.randn(experts, generator=gen)
        yield OpSample((x, w, bias, top_k, 1.5, "sqrtsoftplus"), label=f"{rows}x{hidden} E={experts}")
        yield OpSample((x, w, None, top_k, 1.0, "sigmoid"), label=f"{rows}x{hidden} sigmoid, no bias")


def _compare_routes(actual, expected, sample: OpSample, dtype: torch.dtype) -> None:
    """Expert order within a token's top-k is free: compare (expert, weight) pairs sorted by expert."""
    (aw, ai), (ew, ei) = actual, expected
    ai, aw = ai.cpu().sort(dim=1), aw.cpu()
    ei, ew = ei.sort(dim=1), ew
    assert torch.equal(ai.values, ei.values), "moe_router: selected experts differ"
    atol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(aw.gather(1, ai.indices), ew.gather(1, ei.indices), atol=atol, rtol=atol)


@reference_op(sample_inputs=_router_samples, compare=_compare_routes, rows=(0,))
def moe_router(
    x: torch.Tensor,
    weight: torch.Tensor,
    correction_bias: torch.Tensor | None,
    top_k: int,
    routed_scaling_factor: float,
    score_func: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Learned routing: experts chosen by ``score + correction_bias``, weighted by the unbiased scores.

    x: [T, H]; weight: [E, H]; correction_bias: [E] fp32 or None.  ``score = score_func(x @ weight.T)``
    (``sqrtsoftplus`` = sqrt(softplus(.)), V4's).  Weights are renormalised over the top-k, then scaled.
    Returns ``(weights [T, k] fp32, ids [T, k] int64)``; the order of experts within a row is free.
    """
    scores = _scores(F.linear(x, weight).float(), score_func)
    biased = scores if correction_bias is None else scores + correction_bias.float()
    ids = torch.topk(biased, top_k, dim=-1).indices
    return _normalized(scores, ids, routed_scaling_factor), ids


@batch_invariant_reference(moe_router)
def moe_router_in_tiles(x, weight, correction_bias, top_k, routed_scaling_factor, score_func):
    """The router GEMM on fixed tiles of 16 tokens (see :mod:`deepinfer.ops.row_tiles`)."""
    return in_row_tiles(moe_router, (x, weight, correction_bias, top_k, routed_scaling_factor, score_func), (0,))


def _hash_router_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, hidden, experts, top_k in [(5, 64, 8, 2), (33, 256, 64, 6)]:
        x = torch.randn(rows, hidden, generator=gen).to(dtype)
        w = (torch.randn(experts, hidden, generator=gen) * hidden**-0.5).to(dtype)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)])
        yield OpSample((x, w, ids, 1.5, "sqrtsoftplus"), label=f"{rows}x{hidden} E={experts}")


@reference_op(sample_inputs=_hash_router_samples, rows=(0, 2))
def moe_hash_router(
    x: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, routed_scaling_factor: float, score_func: str
) -> torch.Tensor:
    """Hash routing: experts are fixed per token id (``tid2eid``); only their weights are learned.

    x: [T, H]; weight: [E, H]; ids: [T, k] int64 (looked up by the caller).  Returns weights [T, k] fp32,
    renormalised over the k experts and scaled, as :func:`moe_router` does.
    """
    scores = _scores(F.linear(x, weight).float(), score_func)
    return _normalized(scores, ids, routed_scaling_factor)


@batch_invariant_reference(moe_hash_router)
def moe_hash_router_in_tiles(x, weight, ids, routed_scaling_factor, score_func):
    """The router GEMM on fixed tiles of 16 tokens (see :mod:`deepinfer.ops.row_tiles`)."""
    return in_row_tiles(moe_hash_router, (x, weight, ids, routed_scaling_factor, score_func), (0, 2))


def _mlp_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, hidden, inter in [(5, 64, 32), (17, 256, 128)]:
        x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)  # large enough for the clamp to bite
        w13 = (torch.randn(2 * inter, hidden, generator=gen) * hidden**-0.5 * 4).to(dtype)
        w2 = (torch.randn(hidden, inter, generator=gen) * inter**-0.5).to(dtype)
        yield OpSample((x, w13, w2, 10.0), label=f"{rows}x{hidden} I={inter}")


@reference_op(sample_inputs=_mlp_samples, rows=(0,))
def swiglu_mlp(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, swiglu_limit: float | None) -> torch.Tensor:
    """Clamped SwiGLU MLP: ``w2 @ (silu(min(g, L)) * clamp(u, -L, L))`` with ``[g; u] = w13 @ x``.

    x: [T, H]; w13: [2I, H] (gate rows then up rows: the checkpoint's w1 and w3 stacked); w2: [H, I].
    ``swiglu_limit`` None disables the clamp.  Returns [T, H] in x.dtype.
    """
    gate, up = F.linear(x, w13).chunk(2, dim=-1)
    if swiglu_limit is not None:
        gate = gate.clamp(max=swiglu_limit)
        up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return F.linear(F.silu(gate) * up, w2)


@batch_invariant_reference(swiglu_mlp)
def swiglu_mlp_in_tiles(x, w13, w2, swiglu_limit):
    """Both GEMMs on fixed tiles of 16 tokens (see :mod:`deepinfer.ops.row_tiles`)."""
    return in_row_tiles(swiglu_mlp, (x, w13, w2, swiglu_limit), (0,))


def _experts_samples(dtype: torch.dtype, gen: torch.Generator):
    for rows, hidden, inter, experts, top_k in [(5, 64, 32, 4, 2), (33, 128, 64, 16, 6)]:
        x = (3 * torch.randn(rows, hidden, generator=gen)).to(dtype)
        ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(rows)])
        weights = torch.rand(rows, top_k, generator=gen)
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5 * 4).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
        yield OpSample((x, ids, weights, w13, w2, 10.0), label=f"{rows}x{hidden} E={experts} k={top_k}")


#: fp32: a few ulps of the largest activation.  The samples drive activations to ~100 and outputs to ~250 (the
#: clamp must bite), where this reference itself is 8.6e-5 from an fp64 evaluation (2026-11-29), so a GEMM with
#: any other summation order (cuBLAS, a Triton kernel) differs from it by more than the default 1e-5.
@reference_op(sample_inputs=_experts_samples, rows=(0, 1, 2), tolerances={torch.float32: (3e-4, 1e-4)})
def moe_experts(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    swiglu_limit: float | None,
) -> torch.Tensor:
    """Routed experts: ``sum_j weights[t, j] * swiglu_mlp(x[t], expert ids[t, j])``.

    x: [T, H]; ids: [T, k] int64 (a repeated id counts twice); weights: [T, k] fp32; w13: [E, 2I, H];
    w2: [E, H, I].  Returns [T, H] in x.dtype.
    """
    out = torch.zeros_like(x)
    for expert in torch.unique(ids).tolist():
        rows, slots = torch.where(ids == expert)
        y = swiglu_mlp(x[rows], w13[expert], w2[expert], swiglu_limit) * weights[rows, slots, None]
        out.index_add_(0, rows, y.to(out.dtype))
    return out


@batch_invariant_reference(moe_experts)
def moe_experts_fixed_order(x, ids, weights, w13, w2, swiglu_limit):
    """How many tokens an expert gets depends on the batch, so each expert runs its tokens in fixed tiles of
    16.  A token's k weighted outputs are then added one at a time in ascending expert order (the reference's
    order and rounding, in x.dtype), an order no other token can change."""
    per_slot = x.new_zeros(*ids.shape, x.shape[-1])  # [T, k, H]
    for expert in torch.unique(ids).tolist():
        rows, slots = torch.where(ids == expert)
        y = in_row_tiles(swiglu_mlp, (x[rows], w13[expert], w2[expert], swiglu_limit), (0,))
        per_slot[rows, slots] = (y * weights[rows, slots, None]).to(x.dtype)
    by_expert = torch.sort(ids, dim=1, stable=True).indices  # [T, k]
    out = torch.zeros_like(x)
    for j in range(ids.shape[1]):
        out += per_slot.gather(1, by_expert[:, j, None, None].expand(-1, 1, x.shape[-1])).squeeze(1)
    return out
