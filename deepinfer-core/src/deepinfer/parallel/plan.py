"""The parallel planner: a world of ranks -> data-parallel attention, expert parallelism, context parallelism.

Policy (plain data, like the scheduler; checked once at start-up):

- ``world_size = data_parallel_size * context_parallel_size``.  Rank ``r`` is DP rank ``r // cp`` and CP rank
  ``r % cp``: the ``cp`` ranks of one DP rank are consecutive (one node's fast links), and they share that DP
  rank's requests (a long prefill is split between them, :mod:`.zigzag`).
- Each DP rank owns whole requests: its own scheduler, state cache and sampler.
- MoE layers are expert-parallel over groups of ``expert_parallel_size`` consecutive ranks (``ep`` divides the
  world; ``ep < world`` replicates each EP group's experts in every group).  Physical expert slots are
  ``n_routed_experts + num_redundant_experts`` and must divide over the EP ranks; left unset, the redundant count
  is the fewest that makes them divide (a non-divisible expert count gets replicas, not an uneven split).
- Tensor and pipeline parallelism are not planned (attention is replicated per DP rank, MLA-style latents are
  small; experts are split by EP).

Every broken constraint raises ``ValueError`` naming it; nothing is adjusted silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.parallel.placement import ExpertPlacement


@dataclass(slots=True, frozen=True)
class ParallelConfig:
    """What the user asked for (``LLM(data_parallel_size=, expert_parallel_size=, context_parallel_size=)``)."""

    data_parallel_size: int = 1
    expert_parallel_size: int = 1
    context_parallel_size: int = 1
    #: Extra physical expert slots per MoE layer for EPLB's replicas; None: the fewest that divide over EP.
    num_redundant_experts: int | None = None

    def __post_init__(self) -> None:
        for name in ("data_parallel_size", "expert_parallel_size", "context_parallel_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        r = self.num_redundant_experts
        if r is not None and (isinstance(r, bool) or not isinstance(r, int) or r < 0):
            raise ValueError(f"num_redundant_experts must be None or an integer >= 0, got {r!r}")

    @property
    def world_size(self) -> int:
        return self.data_parallel_size * self.context_parallel_size

    @property
    def enabled(self) -> bool:
        """Whether this asks for more than one rank."""
        return self.world_size > 1 or self.expert_parallel_size > 1


@dataclass(slots=True, frozen=True)
class ParallelPlan:
    """One rank's view of the plan.  Frozen: layers receive it at construction (an EPLB rebalance gives the MoE
    layers a new :class:`ExpertPlacement`; the groups never change)."""

    world_size: int
    rank: int
    dp_size: int
    dp_rank: int
    cp_size: int
    cp_rank: int
    ep_size: int
    ep_rank: int
    #: World ranks of this rank's EP group and CP group (ascending).
    ep_ranks: tuple[int, ...]
    cp_ranks: tuple[int, ...]
    #: Expert placement over this EP group; None when ``ep_size == 1`` (every rank holds every expert).
    placement: ExpertPlacement | None

    @property
    def ep_groups(self) -> list[tuple[int, ...]]:
        """Every EP group of the world (creating process groups needs them all, in one order on every rank)."""
        return [tuple(range(g, g + self.ep_size)) for g in range(0, self.world_size, self.ep_size)]

    @property
    def cp_groups(self) -> list[tuple[int, ...]]:
        return [tuple(range(g, g + self.cp_size)) for g in range(0, self.world_size, self.cp_size)]


def plan_parallel(config: ParallelConfig, world_size: int, rank: int, *, n_routed_experts: int,
                  num_moe_layers: int) -> ParallelPlan:
    """Rank ``rank``'s plan in a world of ``world_size`` ranks for a model with ``num_moe_layers`` MoE layers of
    ``n_routed_experts`` experts each.  Raises ``ValueError`` naming the first constraint that breaks."""
    dp, ep, cp = config.data_parallel_size, config.expert_parallel_size, config.context_parallel_size
    if world_size != dp * cp:
        raise ValueError(f"the world has {world_size} ranks but data_parallel_size * context_parallel_size = "
                         f"{dp} * {cp} = {dp * cp}; launch exactly that many ranks")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    if world_size % ep:
        raise ValueError(f"expert_parallel_size ({ep}) must divide the world size (data_parallel_size * "
                         f"context_parallel_size = {world_size})")
    if n_routed_experts < 1 or num_moe_layers < 0:
        raise ValueError(f"a model with {n_routed_experts} routed experts and {num_moe_layers} MoE layers")
    placement = None
    if ep > 1:
        slots = _num_slots(n_routed_experts, ep, config.num_redundant_experts)
        placement = ExpertPlacement.round_robin(num_moe_layers, n_routed_experts, ep, slots)
    elif config.num_redundant_experts:
        raise ValueError(f"num_redundant_experts={config.num_redundant_experts} needs expert_parallel_size > 1 "
                         "(replicas balance load between EP ranks)")
    group = rank - rank % ep
    cp_group = rank - rank % cp
    return ParallelPlan(world_size, rank, dp, rank // cp, cp, rank % cp, ep, rank % ep,
                        tuple(range(group, group + ep)), tuple(range(cp_group, cp_group + cp)), placement)


def _num_slots(num_experts: int, ep: int, redundant: int | None) -> int:
    """Physical expert slots per layer: experts plus replicas, divisible by ``ep``."""
    if redundant is None:
        return -(-num_experts // ep) * ep
    slots = num_experts + redundant
    if slots % ep:
        fewest = -(-num_experts // ep) * ep - num_experts
        raise ValueError(f"n_routed_experts + num_redundant_experts = {num_experts} + {redundant} = {slots} expert "
                         f"slots must divide over expert_parallel_size = {ep} ranks; use num_redundant_experts = "
                         f"{fewest} + a multiple of {ep}")
    return slots
