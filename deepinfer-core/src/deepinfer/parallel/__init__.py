"""Scaling past one device, the plans and collectives only: the planner (plain data), the expert placement,
EPLB (a pure function), communicators, a rank's context and context-parallel row splits.  The layers that
exchange through them live in ``deepinfer.layers`` (``ep_moe``, ``ep_rebalance``) and the V4.1 model
(``engram_shard``); the rank launcher and the data-parallel loop in ``deepinfer.engine`` (``rank_launch``,
``data_parallel``).  See ``docs/parallel.md``."""

from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.parallel.plan import ParallelConfig, ParallelPlan, plan_parallel

__all__ = ["ExpertPlacement", "ParallelConfig", "ParallelPlan", "plan_parallel"]
