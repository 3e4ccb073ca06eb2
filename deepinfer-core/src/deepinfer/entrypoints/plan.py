"""``deepinfer plan [MODEL]``: print what each rank would hold, as a table, without a GPU and without reading any
weight (config.json and the safetensors headers only; a hub repo's headers are read from the hub)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from deepinfer.engine.memory_plan import GiB, MemoryPlanError, MemoryPlanner
from deepinfer.engine.plan_fit import check_fits
from deepinfer.engine.plan_inputs import PlanInputs, hub_plan_inputs, read_plan_inputs

#: ``EngineArgs`` fields the plan reads, as flags (the same names and checks as ``LLM(...)`` / ``deepinfer serve``).
_ENGINE_FLAGS = {"data_parallel_size": int, "expert_parallel_size": int, "context_parallel_size": int,
                 "num_redundant_experts": int, "gpu_memory_utilization": float, "max_num_seqs": int,
                 "max_model_len": int, "max_num_batched_tokens": int, "state_cache_bytes": int, "dtype": str,
                 "revision": str}


def add_plan_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("plan", help="the memory plan of a checkpoint: bytes per GPU by role (no GPU needed)",
                       description=__doc__)
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint directory (config.json alone will do), or Hugging Face repo id (its weights are "
                        "not downloaded); default: as LLM() finds it")
    p.add_argument("--gpus", type=int, default=None,
                   help="GPUs (ranks); alone, each is a data- and expert-parallel rank (default: the parallel sizes' "
                        "world, 1)")
    p.add_argument("--gpu-memory", type=float, default=None, metavar="GiB",
                   help="memory of one GPU in GiB (an H200: about 139); without it the fit is not checked")
    p.add_argument("--engram", choices=["host", "device"], default="host",
                   help="where the Engram tables live (default: host memory)")
    p.add_argument("--engram-sharded", action=argparse.BooleanOptionalAction, default=None,
                   help="row-shard the Engram tables over the expert-parallel group (default: when EP > 1)")
    p.add_argument("--quantized-weights", choices=["native", "dequantize"], default=None,
                   help="weights as stored or dequantized (default: DEEPINFER_QUANTIZED_WEIGHTS, else native: "
                        "the default of a backend with the packed kernels, CUDA)")
    p.add_argument("--quantized-kv", action=argparse.BooleanOptionalAction, default=None,
                   help="state rows in the model's formats (default: DEEPINFER_QUANTIZED_KV)")
    p.add_argument("--speculative", action=argparse.BooleanOptionalAction, default=False,
                   help="hold the DSpark drafter (default: off)")
    group = p.add_argument_group("engine arguments (EngineArgs; docs/engine.md)")
    for name, kind in _ENGINE_FLAGS.items():
        group.add_argument("--" + name.replace("_", "-"), type=kind, default=argparse.SUPPRESS)
    p.set_defaults(run=run_plan)


def _engine_kwargs(ns: argparse.Namespace) -> dict[str, Any]:
    kwargs = {k: v for k, v in vars(ns).items() if k in _ENGINE_FLAGS}
    if ns.gpus is not None:
        if ns.gpus < 1:
            raise ValueError(f"--gpus must be an integer >= 1, got {ns.gpus}")
        if "data_parallel_size" not in kwargs and "context_parallel_size" not in kwargs:
            kwargs["data_parallel_size"] = ns.gpus
            kwargs.setdefault("expert_parallel_size", ns.gpus)
        world = kwargs.get("data_parallel_size", 1) * kwargs.get("context_parallel_size", 1)
        if world != ns.gpus:
            raise ValueError(f"--gpus {ns.gpus}, but data_parallel_size x context_parallel_size = {world} ranks; "
                             "give the GPUs or the sizes, or make them agree")
    return kwargs


def plan_inputs(model: str | None, revision: str | None) -> PlanInputs:
    """A directory's config.json and headers; a repo id's without its weights; None: where ``LLM()`` looks."""
    if model is None:
        from deepinfer.engine.model_source import resolve_model

        return read_plan_inputs(resolve_model(None).path)
    path = Path(model).expanduser()
    if path.exists():
        return read_plan_inputs(path)
    return hub_plan_inputs(model, revision)


def run_plan(ns: argparse.Namespace) -> None:
    from deepinfer import envs
    from deepinfer.engine.args import EngineArgs, resolve_dtype
    from deepinfer.engine.model_source import ModelSourceError
    from deepinfer.engine.plan_check import plan_request
    from deepinfer.engine.plan_table import format_plan

    try:
        args = EngineArgs.from_kwargs(_engine_kwargs(ns), caller="deepinfer plan")
        inputs = plan_inputs(ns.model, args.revision)
        extra: dict[str, Any] = {"engram": ns.engram, "engram_sharded": ns.engram_sharded,
                                 "speculative": ns.speculative,
                                 "gpu_memory": int(ns.gpu_memory * GiB) if ns.gpu_memory is not None else None}
        if ns.quantized_weights is not None:
            extra["quantized_weights"] = ns.quantized_weights
        if ns.quantized_kv is not None:
            extra["quantized_kv"] = ns.quantized_kv
        envs.validate()
        planner = MemoryPlanner(inputs)
        plan = planner.plan(plan_request(args, resolve_dtype(args.dtype, inputs.path), **extra))
    except (TypeError, ValueError, ModelSourceError) as exc:
        sys.exit(f"deepinfer plan: {exc}")
    print(format_plan(plan))
    try:
        check_fits(plan, planner, f"the model in {inputs.path}")
    except MemoryPlanError as exc:
        print(f"\nrefused: {exc}", file=sys.stderr)
        sys.exit(1)
