"""Refusing a memory plan that cannot fit, with a configuration that would (:mod:`.memory_plan`)."""

from __future__ import annotations

import dataclasses

from deepinfer.engine.memory_plan import MemoryPlan, MemoryPlanError, MemoryPlanner, PlanRequest, human

#: Device counts :func:`suggest` tries beyond the requested world, with expert parallelism over all of them.
_WORLDS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def check_fits(plan: MemoryPlan, planner: MemoryPlanner, what: str = "the model", workspace: bool = True) -> None:
    """Raise :class:`MemoryPlanError` if ``plan`` does not fit its device: what does not fit, and the first
    configuration of :func:`suggest` that would.  ``workspace=False``: the workspace estimate is not held against
    it (:meth:`MemoryPlan.problem`)."""
    problem = plan.problem(workspace)
    if problem is None:
        return
    request = plan.request
    where = f"{plan.world_size} x {human(request.gpu_memory)}" if request.gpu_memory else "the devices"
    found = suggest(planner, request, workspace)
    hint = (f"a configuration that fits: {found.request.describe()} ({found.world_size} devices, "
            f"{human(found.device_total)} a device)" if found is not None else
            f"no configuration of up to {_WORLDS[-1]} such devices with expert parallelism and host Engram fits")
    raise MemoryPlanError(f"{what} does not fit {where} ({request.describe()}): {problem}; {hint}")


def suggest(planner: MemoryPlanner, request: PlanRequest, workspace: bool = True) -> MemoryPlan | None:
    """The first of these that fits: the requested sizes with host Engram; expert parallelism over the requested
    world; then more GPUs, each one a data- and expert-parallel rank; all with host Engram and native weights
    where the requested ones do not fit."""
    world = request.data_parallel_size * request.context_parallel_size
    tries = [dataclasses.replace(request, engram="host"),
             dataclasses.replace(request, engram="host", expert_parallel_size=world, num_redundant_experts=None)]
    tries += [dataclasses.replace(t, quantized_weights="native") for t in tries]
    tries += [dataclasses.replace(request, engram="host", quantized_weights="native", data_parallel_size=n,
                                  context_parallel_size=1, expert_parallel_size=n, num_redundant_experts=None)
              for n in _WORLDS if n > world]
    for candidate in tries:
        if candidate == request:
            continue
        try:
            plan = planner.plan(candidate)
        except ValueError:  # sizes the planner refuses
            continue
        if plan.problem(workspace) is None:
            return plan
    return None
