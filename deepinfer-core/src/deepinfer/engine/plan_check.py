"""``LLM``'s memory plan: built from the engine arguments and the environment once the model source is resolved,
logged, and refused before any weight is read when it cannot fit the device (:mod:`.memory_plan`)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from deepinfer import envs
from deepinfer.engine.args import EngineArgs
from deepinfer.engine.memory_plan import MemoryPlan, MemoryPlanner, PlanRequest
from deepinfer.engine.plan_fit import check_fits
from deepinfer.engine.plan_inputs import read_plan_inputs
from deepinfer.engine.plan_table import format_plan, summary
from deepinfer.engine.rank_launch import RankEnv
from deepinfer.models.deepseek_v41.config import MODEL_TYPES
from deepinfer.models.registry import model_type_of

logger = logging.getLogger(__name__)


def plan_request(args: EngineArgs, dtype: torch.dtype, **overrides: Any) -> PlanRequest:
    """The plan of these engine arguments: the sizes and the state's knobs from ``args``, the weight and KV formats
    from ``DEEPINFER_QUANTIZED_WEIGHTS`` (unset: native, the default where the packed kernels exist) /
    ``DEEPINFER_QUANTIZED_KV``; the drafter counted when drafting is not
    turned off on one rank (``DEEPINFER_USE_NEXTN_DECODE``); ``overrides``: any other field."""
    fields: dict[str, Any] = dict(
        data_parallel_size=args.data_parallel_size, expert_parallel_size=args.expert_parallel_size,
        context_parallel_size=args.context_parallel_size, num_redundant_experts=args.num_redundant_experts,
        quantized_weights=envs.quantized_weights() or "native", quantized_kv=envs.quantized_kv(), dtype=dtype,
        speculative=envs.nextn_decode() > 0 and args.data_parallel_size * args.context_parallel_size == 1,
        gpu_memory_utilization=args.gpu_memory_utilization, max_num_seqs=args.max_num_seqs,
        max_model_len=args.max_model_len, max_num_batched_tokens=args.max_num_batched_tokens,
        state_cache_bytes=args.state_cache_bytes)
    return PlanRequest(**{**fields, **overrides})


def check_memory_plan(path: Path, args: EngineArgs, dtype: torch.dtype, backend: Any, quantized_weights: str,
                      speculative: bool) -> MemoryPlan | None:
    """Log the plan of loading ``path`` with ``args`` (weights ``native`` or ``dequantize``, the drafter held when
    ``speculative``); raise :class:`~.memory_plan.MemoryPlanError` if its weights,
    the drafter's context and the smallest state pool cannot fit the memory the backend reports free (a backend
    that reports none: logged only); warn if only the workspace estimate does not fit.  None for a model the plan
    does not cover."""
    if model_type_of(path) not in MODEL_TYPES:
        logger.debug("no memory plan for %s: the plan covers DeepSeek-V4.1 checkpoints", path)
        return None
    rank = RankEnv.from_environ()  # under torchrun: this rank's own device, not the first one
    try:
        free: int | None = backend.memory_info(backend.device(rank.local_rank if rank is not None else 0))[0]
    except NotImplementedError:
        free = None
    planner = MemoryPlanner(read_plan_inputs(path))
    plan = planner.plan(plan_request(args, dtype, gpu_memory=free, quantized_weights=quantized_weights,
                                      speculative=speculative))
    logger.info("%s", summary(plan))
    logger.debug("%s", format_plan(plan))
    if args.state_cache_bytes is not None and args.state_cache_bytes < plan.state_min:
        longest = f"{args.max_model_len} tokens" if args.max_model_len is not None else "2 tokens"
        raise ValueError(f"state_cache_bytes={args.state_cache_bytes} cannot hold one sequence of {longest}: raise "
                         f"state_cache_bytes to at least {plan.state_min} (with max_num_seqs={args.max_num_seqs})")
    check_fits(plan, planner, f"the model in {path}", workspace=False)  # what certainly cannot fit: refused
    if plan.problem() is not None:  # only with the workspace estimate: the engine may still run
        logger.warning("the memory plan may not fit: %s", plan.problem())
    return plan
