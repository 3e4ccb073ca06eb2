"""An expert-parallel MoE layer: this rank holds its slots' experts; tokens go to the ranks that hold theirs.

Per step, with ``T`` tokens routed to ``k`` experts each (every rank routes its own tokens):

1. **dispatch**: each (token, expert) pair picks a replica of its logical expert (pair index modulo the number
   of replicas, so load splits evenly between them) and is sent, with its routing weight, to the replica's rank
   (all-to-all of the pair rows, grouped by destination);
2. the owner runs its experts on the pairs it received (``ops.moe_experts`` with one expert per row: each row's
   weighted output, as the single-process layer computes it);
3. **combine**: the outputs go back (the reverse all-to-all) and each token sums its ``k`` outputs in ascending
   expert order from zero (the reference's order, so fp32 results equal one process's), then adds the shared
   expert, which every rank runs on its own tokens.

A rank with no tokens still joins every exchange (:meth:`idle`).  Tokens are sent once per pair (a token whose
two experts live on one rank travels twice): simple and exact; deduplication is an optimisation left for later.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.layers.moe import MoE, MoESpec
from deepinfer.ops import Ops
from deepinfer.parallel.context import ParallelContext
from deepinfer.parallel.placement import ExpertPlacement


class ExpertParallelMoE(MoE):
    """:class:`~deepinfer.layers.moe.MoE` holding only this EP rank's slots (in slot order; the shared expert
    after them)."""

    def __init__(self, ops: Ops, spec: MoESpec, prefix: str, get: Callable[[str], torch.Tensor],
                 context: ParallelContext, layer: int):
        placement = context.plan.placement
        assert placement is not None, "expert parallelism without a placement"
        super().__init__(ops, spec, prefix, get, experts=placement.local_experts(layer, context.plan.ep_rank))
        self.context, self.layer = context, layer
        self.hidden, self.dtype, self.device = self.w2.shape[1], self.w2.dtype, self.w2.device
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
            return out + self.ops.swiglu_mlp(x, *self.shared, self.spec.swiglu_limit)
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
        comm, per_rank = self.context.ep, self.placement.slots_per_rank
        tokens, k = ids.shape
        flat = ids.reshape(-1)
        pairs = torch.arange(flat.shape[0], device=x.device)
        slot = self.replicas[flat, pairs % self.num_replicas[flat]]
        dest = slot // per_rank
        order = torch.argsort(dest, stable=True)
        counts = torch.bincount(dest, minlength=comm.size).tolist()
        meta = torch.stack([(slot % per_rank)[order].to(torch.float32), weights.reshape(-1)[order]], dim=1)
        got_x, got = comm.all_to_all(x[order // k], counts)
        got_meta, _ = comm.all_to_all(meta, counts, got)
        y = self.ops.moe_experts(got_x, got_meta[:, :1].long(), got_meta[:, 1:], self.w13, self.w2,
                                 self.spec.swiglu_limit)
        back, _ = comm.all_to_all(y, got, counts)
        per_pair = torch.empty_like(back)
        per_pair[order] = back
        per_pair = per_pair.view(tokens, k, x.shape[1])
        by_expert = torch.sort(ids, dim=1, stable=True).indices
        out = torch.zeros_like(x)
        for j in range(k):
            out += per_pair.gather(1, by_expert[:, j, None, None].expand(-1, 1, x.shape[1])).squeeze(1)
        return out
