"""An expert-parallel MoE layer: this rank holds its slots' experts; tokens go to the ranks that hold theirs.

Per step, with ``T`` tokens routed to ``k`` experts each (every rank routes its own tokens):

1. **dispatch**: each (token, expert) pair picks a replica of its logical expert (pair index modulo the number
   of replicas, so load splits evenly between them) and is sent, with its routing weight, to the replica's rank
   (a count exchange, then all-to-alls of the token rows and of the pairs, grouped by destination);
2. the owner runs its experts on the pairs it received, in the form they are kept in (``ops.moe_experts``,
   ``moe_experts_mxfp4`` or ``moe_experts_fp8`` with one expert per row: each row's weighted output, as the
   single-process layer computes it);
3. **combine**: the outputs go back (the reverse all-to-all) and each token sums its ``k`` outputs in ascending
   expert order from zero (the reference's order, so fp32 results equal one process's), then adds the shared
   expert, which every rank runs on its own tokens (FP8 as stored, or dense, as in the single-process layer).

A rank with no tokens still joins every exchange (:meth:`idle`).  A token's hidden row goes once to each rank
that holds any of its experts (its pairs there point at it); outputs come back once per pair, so each token's sum
keeps the reference's order (a per-rank partial sum would halve that traffic but change the fp32 rounding).

:func:`build_moe` is how a model builds its MoE layers: this layer under expert parallelism, else the plain one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.layers.linear import GetWeight, swiglu_mlp
from deepinfer.layers.moe import MoE, MoESpec
from deepinfer.ops import Ops
from deepinfer.parallel.context import ParallelContext
from deepinfer.parallel.placement import ExpertPlacement


class ExpertParallelMoE(MoE):
    """:class:`~deepinfer.layers.moe.MoE` holding only this EP rank's slots (in slot order; a dense shared expert
    after them).  ``weight``: as the single-process layer's, so MXFP4 / FP8 experts stay as stored here too."""

    def __init__(self, ops: Ops, spec: MoESpec, prefix: str, get: Callable[[str], torch.Tensor],
                 context: ParallelContext, layer: int, weight: GetWeight | None = None):
        placement = context.plan.placement
        assert placement is not None, "expert parallelism without a placement"
        super().__init__(ops, spec, prefix, get, experts=placement.local_experts(layer, context.plan.ep_rank),
                         weight=weight)
        self.context, self.layer = context, layer
        # the router's: the compute dtype and hidden size whatever form the experts are kept in
        self.hidden, self.dtype, self.device = self.gate.shape[1], self.gate.dtype, self.gate.device
        self.index = context.register(self, layer, spec.n_routed_experts, self.device)
        self.use_placement(placement)

    def use_placement(self, placement: ExpertPlacement) -> None:
        """Route by ``placement`` (whose slots of this rank the stacked weights already hold)."""
        self.placement = placement
        replicas = placement.replicas(self.layer)
        width = max(len(r) for r in replicas)
        table = [r + [r[0]] * (width - len(r)) for r in replicas]
        self.replicas = torch.tensor(table, dtype=torch.int64, device=self.device)  # [E, width] slots
        self.num_replicas = torch.tensor([len(r) for r in replicas], dtype=torch.int64, device=self.device)

    def __call__(self, x: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x, input_ids)
        self.context.count(self.index, ids)
        out = self._exchange(x, ids, weights)
        if self.shared is not None:
            return out + swiglu_mlp(self.ops, x, *self.shared, self.spec.swiglu_limit)  # FP8 or dense
        shared_id, shared_weight = self.shared_slot
        n = x.shape[0]
        return out + self.ops.moe_experts(x, shared_id.expand(n, 1), shared_weight.expand(n, 1), self.w13, self.w2,
                                          self.spec.swiglu_limit)

    def idle(self) -> None:
        k = self.spec.top_k
        self._exchange(torch.empty(0, self.hidden, dtype=self.dtype, device=self.device),
                       torch.empty(0, k, dtype=torch.int64, device=self.device),
                       torch.empty(0, k, dtype=torch.float32, device=self.device))

    def _exchange(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Sum over each token's experts of ``weight * expert(x)``, run where the experts live."""
        self.context.moe_calls += 1
        comm = self.context.ep
        pairs, order, counts, got = self._dispatch(x, ids, weights)
        y = self.experts(pairs.x, pairs.slots, pairs.weights)
        back, _ = comm.all_to_all(y, got, counts)
        tokens, k = ids.shape
        per_pair = torch.empty_like(back)
        per_pair[order] = back
        per_pair = per_pair.view(tokens, k, x.shape[1])
        by_expert = torch.sort(ids, dim=1, stable=True).indices
        out = torch.zeros_like(x)
        for j in range(k):
            out += per_pair.gather(1, by_expert[:, j, None, None].expand(-1, 1, x.shape[1])).squeeze(1)
        return out

    def _dispatch(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor
                  ) -> tuple[Received, torch.Tensor, list[int], list[int]]:
        """Send each (token, expert) pair to its replica's rank: a token's hidden row once per destination rank,
        each pair's slot, weight and row.  Returns (the pairs received, the order pairs were sent in, pairs
        sent to each rank, pairs received from each)."""
        comm, per_rank, device = self.context.ep, self.placement.slots_per_rank, x.device
        tokens, k = ids.shape
        flat = ids.reshape(-1)
        pair = torch.arange(flat.shape[0], device=device)
        slot = self.replicas[flat, pair % self.num_replicas[flat]]
        dest = slot // per_rank
        order = torch.argsort(dest * tokens + pair // k, stable=True)  # by destination, then token
        key = (dest * tokens + pair // k)[order]
        first = torch.ones_like(key, dtype=torch.bool)
        first[1:] = key[1:] != key[:-1]  # a token's first pair to a rank carries its row
        row_dest = dest[order][first]
        row_counts = torch.bincount(row_dest, minlength=comm.size)
        pair_counts = torch.bincount(dest, minlength=comm.size)
        row_start = torch.cumsum(row_counts, 0) - row_counts
        row = torch.cumsum(first.long(), 0) - 1 - row_start[dest[order]]  # within its destination's rows
        meta = torch.stack([(slot % per_rank)[order].float(), weights.reshape(-1)[order], row.float()], dim=1)
        ones = [1] * comm.size
        theirs, _ = comm.all_to_all(torch.stack([row_counts, pair_counts], dim=1), ones, ones)
        rows_in, pairs_in = theirs[:, 0].tolist(), theirs[:, 1].tolist()
        counts, row_list = pair_counts.tolist(), row_counts.tolist()
        self.context.sent_rows += sum(row_list)
        self.context.sent_pairs += sum(counts)
        got_x, _ = comm.all_to_all(x[(pair // k)[order][first]], row_list, rows_in)
        got_meta, _ = comm.all_to_all(meta, counts, pairs_in)
        source = torch.repeat_interleave(torch.arange(comm.size, device=device),
                                         torch.tensor(pairs_in, device=device), output_size=sum(pairs_in))
        starts = torch.tensor(rows_in, device=device).cumsum(0) - torch.tensor(rows_in, device=device)
        at = got_meta[:, 2].long() + starts[source]
        return Received(got_x[at], got_meta[:, :1].long(), got_meta[:, 1:2]), order, counts, pairs_in


@dataclass(slots=True)
class Received:
    """The (token, expert) pairs an owner received: each pair's hidden row, local slot [P, 1], weight [P, 1]."""

    x: torch.Tensor
    slots: torch.Tensor
    weights: torch.Tensor


def build_moe(ops: Ops, spec: MoESpec, prefix: str, get: Callable[[str], torch.Tensor],
              parallel: ParallelContext | None = None, layer: int = 0, weight: GetWeight | None = None) -> MoE:
    """Decoder layer ``layer``'s MoE: every expert here, or (``parallel`` with an expert placement) this rank's
    share, exchanging tokens with the ranks that hold the others.  ``weight``: the experts as the model keeps them
    (MXFP4 / FP8 experts stay as stored, with expert parallelism or without)."""
    if parallel is None or parallel.plan.placement is None:
        return MoE(ops, spec, prefix, get, weight=weight)
    return ExpertParallelMoE(ops, spec, prefix, get, parallel, layer, weight)
