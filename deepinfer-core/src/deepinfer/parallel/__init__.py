"""Scaling past one device: the planner (plain data), EPLB (a pure function), expert-parallel MoE layers,
data-parallel attention and launching ranks.  See ``docs/parallel.md``."""

from deepinfer.parallel.placement import ExpertPlacement
from deepinfer.parallel.plan import ParallelConfig, ParallelPlan, plan_parallel

__all__ = ["ExpertPlacement", "ParallelConfig", "ParallelPlan", "plan_parallel"]
