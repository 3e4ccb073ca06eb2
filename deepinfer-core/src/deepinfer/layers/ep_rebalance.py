"""An EPLB rebalance between steps: global load -> new placement (:mod:`deepinfer.parallel.eplb`) -> expert
weights moved between the ranks' :class:`~deepinfer.layers.ep_moe.ExpertParallelMoE` layers.

Runs on every rank of an EP group at the same step boundary (the data-parallel loop decides it from the step
count, which every rank shares).  Only MoE weights move; no request, state or scheduler entry is touched, so
nothing in flight is lost: the next step routes by the new placement.  A new slot takes its expert from this
rank's old slots when it holds it, else from the lowest rank that held it (one all-to-all per layer).
"""

from __future__ import annotations

import logging

import torch

from deepinfer.layers.ep_moe import ExpertParallelMoE
from deepinfer.parallel import eplb
from deepinfer.parallel.context import ParallelContext
from deepinfer.parallel.placement import ExpertPlacement

logger = logging.getLogger(__name__)


def rebalance_experts(context: ParallelContext, num_groups: int = 1, num_nodes: int = 1) -> ExpertPlacement | None:
    """Place experts from the load counted since the last rebalance (summed over the EP group) and move the
    weights; returns the new placement (None without expert-parallel layers).  Resets the counts."""
    layers = [m for m in context.moe_layers if isinstance(m, ExpertParallelMoE)]
    if not layers or context.load is None:
        return None
    load = context.ep.all_reduce(context.load.clone()).tolist()
    old = layers[0].placement
    rows = eplb.rebalance(load, old.num_slots, old.ep_size, num_groups, num_nodes).slots
    # the load rows are per registered layer; the placement's rows per decoder layer
    slots = list(old.slots)
    for moe, row in zip(layers, rows, strict=True):
        slots[moe.layer] = row
    new = ExpertPlacement(old.num_experts, old.ep_size, tuple(slots))
    for moe in layers:
        move_weights(moe, new, context)
    context.load.zero_()
    def worst(placement: ExpertPlacement) -> float:  # the busiest rank's load over the mean, worst layer
        return max(eplb.max_mean_ratio(row, placement.slots[moe.layer], old.ep_size)
                   for row, moe in zip(load, layers, strict=True))

    logger.info("EPLB: experts rebalanced on EP ranks %s; busiest rank's load / mean, worst layer: %.2f -> %.2f",
                list(context.ep.ranks), worst(old), worst(new))
    return new


def move_weights(moe: ExpertParallelMoE, new: ExpertPlacement, context: ParallelContext) -> None:
    """Give ``moe`` the weights of its slots under ``new`` and route by it.  An expert travels as the bytes of its
    stacked tensors as kept (dense, or MXFP4 / FP8 data and their scales), so a packed expert arrives as stored."""
    old, layer, me, n = moe.placement, moe.layer, context.plan.ep_rank, moe.placement.ep_size
    before = [old.local_experts(layer, r) for r in range(n)]
    after = [new.local_experts(layer, r) for r in range(n)]

    def source(e: int) -> int:
        return min(r for r in range(n) if e in before[r])

    wanted = [[e for e in after[r] if e not in before[r]] for r in range(n)]  # experts each rank must fetch
    sends = [[e for e in wanted[r] if source(e) == me] for r in range(n)]
    fetch = [[e for e in wanted[me] if source(e) == r] for r in range(n)]
    stacks = [moe.w13, moe.w2, *(moe.scales or ())]  # per slot: [slots (+ the dense shared expert), ...]
    mine = {e: i for i, e in reversed(list(enumerate(before[me])))}
    rows = [torch.cat([_bytes(t[mine[e]]) for t in stacks]) for d in sends for e in d]
    width = sum(_bytes(t[0]).numel() for t in stacks)
    packed = torch.stack(rows) if rows else moe.w2.new_empty(0, width, dtype=torch.uint8)
    got, _ = context.ep.all_to_all(packed, [len(d) for d in sends], [len(f) for f in fetch])
    arrived = iter(got)
    by_source = {r: iter([next(arrived) for _ in fetch[r]]) for r in range(n)}
    slots: list[list[torch.Tensor]] = []
    for e in after[me]:
        slots.append([t[mine[e]] for t in stacks] if e in mine else _unpack(next(by_source[source(e)]), stacks))
    if moe.shared_id is not None:  # the shared expert stays after the routed slots
        slots.append([t[moe.shared_id] for t in stacks])
    moe.w13, moe.w2, *scales = (torch.stack(parts) for parts in zip(*slots, strict=True))
    if moe.scales is not None:
        moe.scales = (scales[0], scales[1])
    moe.use_placement(new)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().reshape(-1).view(torch.uint8)


def _unpack(row: torch.Tensor, stacks: list[torch.Tensor]) -> list[torch.Tensor]:
    """One expert's tensors, shaped and typed as ``stacks``' rows, from the bytes :func:`_bytes` made of them."""
    out, at = [], 0
    for t in stacks:
        size = t[0].numel() * t.element_size()
        out.append(row[at : at + size].clone().view(t.dtype).view(t.shape[1:]))
        at += size
    return out
