"""EPLB: place redundant expert replicas from measured load (a pure function of plain numbers).

Hierarchical, as DeepSeek's expert-parallel load balancer (github.com/deepseek-ai/EPLB) describes it:

1. **groups -> nodes**: the layer's experts form ``num_groups`` contiguous groups (the router's expert groups);
   whole groups are packed onto nodes so each node gets the same number of groups and loads are even (experts of
   one group stay on one node, so group-limited routing stays inside a node).
2. **replicas**: within each node, the node's slots are handed out one at a time to the expert whose per-replica
   load (load / replicas) is highest.
3. **ranks**: each node's replicas (load split evenly between an expert's replicas) are packed onto the node's
   ranks, ``slots_per_rank`` each, heaviest first onto the lightest rank with room (a rank that does not hold the
   expert yet is preferred, so replicas spread out).

When the groups do not divide over the nodes, one global level is used (``num_groups = num_nodes = 1``).  Ties
break by index, so every rank computes the same placement from the same load.
"""

from __future__ import annotations

from collections.abc import Sequence

from deepinfer.parallel.placement import ExpertPlacement


def balanced_packing(weights: Sequence[float], num_packs: int, avoid: Sequence[int] | None = None) -> list[int]:
    """Pack ``len(weights)`` items into ``num_packs`` packs of equal count, heaviest first onto the lightest pack
    with room.  ``avoid[i]``: a key; a pack already holding an item of the same key is taken only when no other
    has room.  Returns each item's pack."""
    n = len(weights)
    if n % num_packs:
        raise ValueError(f"{n} items do not pack evenly into {num_packs} packs")
    room = n // num_packs
    load = [0.0] * num_packs
    count = [0] * num_packs
    keys: list[set[int]] = [set() for _ in range(num_packs)]
    pack = [-1] * n
    for i in sorted(range(n), key=lambda i: (-weights[i], i)):
        open_packs = [p for p in range(num_packs) if count[p] < room]
        if avoid is not None:
            fresh = [p for p in open_packs if avoid[i] not in keys[p]]
            open_packs = fresh or open_packs
        p = min(open_packs, key=lambda p: (load[p], p))
        pack[i] = p
        load[p] += weights[i]
        count[p] += 1
        if avoid is not None:
            keys[p].add(avoid[i])
    return pack


def replicate(load: Sequence[float], num_slots: int) -> list[int]:
    """Replicas per expert (each at least 1, ``num_slots`` in all), minimising the largest per-replica load."""
    if num_slots < len(load):
        raise ValueError(f"{num_slots} slots cannot hold {len(load)} experts")
    count = [1] * len(load)
    for _ in range(num_slots - len(load)):
        e = max(range(len(load)), key=lambda e: (load[e] / count[e], -e))
        count[e] += 1
    return count


def place_layer(load: Sequence[float], num_slots: int, ep_size: int, num_groups: int = 1,
                num_nodes: int = 1) -> tuple[int, ...]:
    """One layer's slots (logical expert per physical slot) for ``ep_size`` ranks over ``num_nodes`` nodes."""
    num_experts = len(load)
    if num_slots % ep_size or num_slots < num_experts:
        raise ValueError(f"{num_slots} slots must be >= {num_experts} experts and divide over {ep_size} EP ranks")
    if ep_size % num_nodes:
        raise ValueError(f"{ep_size} EP ranks do not divide over {num_nodes} nodes")
    if num_experts % num_groups:
        raise ValueError(f"{num_experts} experts do not form {num_groups} equal groups")
    if num_groups % num_nodes:
        num_groups = num_nodes = 1  # global policy
    size = num_experts // num_groups
    group_load = [sum(load[g * size : (g + 1) * size]) for g in range(num_groups)]
    node_of_group = balanced_packing(group_load, num_nodes)
    ranks_per_node, slots_per_rank = ep_size // num_nodes, num_slots // ep_size
    slots: list[int] = []
    for node in range(num_nodes):
        experts = [e for g in range(num_groups) if node_of_group[g] == node for e in range(g * size, (g + 1) * size)]
        count = replicate([load[e] for e in experts], num_slots // num_nodes)
        replicas = [e for e, c in zip(experts, count, strict=True) for _ in range(c)]
        share = [load[e] / c for e, c in zip(experts, count, strict=True) for _ in range(c)]
        rank_of = balanced_packing(share, ranks_per_node, avoid=replicas)
        for r in range(ranks_per_node):
            held = sorted(e for e, p in zip(replicas, rank_of, strict=True) if p == r)
            assert len(held) == slots_per_rank
            slots += held
    return tuple(slots)


def rebalance(load: Sequence[Sequence[float]], num_slots: int, ep_size: int, num_groups: int = 1,
              num_nodes: int = 1) -> ExpertPlacement:
    """A placement for every layer from ``load[layer][expert]`` (tokens routed there while serving)."""
    if not load:
        raise ValueError("no MoE layers to place")
    num_experts = len(load[0])
    rows = tuple(place_layer([float(x) for x in row], num_slots, ep_size, num_groups, num_nodes) for row in load)
    return ExpertPlacement(num_experts, ep_size, rows)


def max_mean_ratio(load: Sequence[float], placement_row: Sequence[int], ep_size: int) -> float:
    """The busiest rank's expected load over the mean, with each expert's load split evenly between its
    replicas (what EPLB minimises)."""
    count: dict[int, int] = {}
    for e in placement_row:
        count[e] = count.get(e, 0) + 1
    per = len(placement_row) // ep_size
    ranks = [sum(load[e] / count[e] for e in placement_row[r * per : (r + 1) * per]) for r in range(ep_size)]
    mean = sum(ranks) / ep_size
    return max(ranks) / mean if mean > 0 else 1.0
