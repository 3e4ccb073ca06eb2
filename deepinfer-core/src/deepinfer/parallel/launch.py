"""Joining or starting the ranks of a parallel ``LLM``.

- **torchrun** (``torchrun --nproc-per-node N script.py``): every process runs the script; ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (set by torchrun) say who it is.  Every
  rank calls ``LLM.generate`` with the same prompts and gets every output.
- **self-launched** (no ``WORLD_SIZE`` in the environment): the calling process becomes rank 0 and starts the
  other ranks (torch.multiprocessing, ``spawn``); each builds the same ``LLM`` and waits for rank 0 to broadcast
  the prompts of each ``generate`` call (:func:`serve_peer`).

The plan is checked before any process starts.  Collectives fail after ``distributed_timeout`` seconds (a peer
that died closes its connections, which fails them at once), so no rank hangs on a dead one.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass
from typing import Any

from deepinfer.backends.backend import Backend
from deepinfer.host_threads import share_host_threads
from deepinfer.parallel.comm import RankFailure
from deepinfer.parallel.context import ParallelContext
from deepinfer.parallel.plan import ParallelConfig, plan_parallel

logger = logging.getLogger(__name__)


@dataclass(slots=True, frozen=True)
class RankEnv:
    """Who this process is in the world, and where the ranks meet."""

    world_size: int
    rank: int
    local_rank: int
    init_method: str

    @classmethod
    def from_environ(cls) -> RankEnv | None:
        """torchrun's variables, or None when they are absent."""
        env = os.environ
        if "WORLD_SIZE" not in env:
            return None
        missing = [v for v in ("RANK", "MASTER_ADDR", "MASTER_PORT") if v not in env]
        if missing:
            raise ValueError(f"WORLD_SIZE is set but {', '.join(missing)} are not: launch with torchrun, which sets "
                             "them all, or unset WORLD_SIZE to let LLM(...) start its own ranks")
        return cls(int(env["WORLD_SIZE"]), int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"])), "env://")


@dataclass(slots=True)
class Joined:
    """This rank's context, its local device index, and (rank 0 of a self-launched world) the other ranks."""

    context: ParallelContext
    local_rank: int
    peers: list[Any]


def join_world(config: ParallelConfig, backend: Backend, model_config: Any, timeout_s: float,
               peer_args: tuple[Any, dict[str, Any]]) -> Joined:
    """Plan this rank, start the other ranks if nobody launched them, and initialise the collectives.
    ``peer_args``: ``(model, kwargs)`` a self-launched peer builds its ``LLM`` from."""
    env = RankEnv.from_environ()
    world = config.world_size
    rank = env.rank if env is not None else 0
    size = env.world_size if env is not None else world
    plan = plan_parallel(config, size, rank, n_routed_experts=model_config.n_routed_experts,
                         num_moe_layers=model_config.num_hidden_layers)
    peers: list[Any] = []
    if env is None:
        env = RankEnv(world, 0, 0, f"tcp://127.0.0.1:{_free_port()}")
        share_host_threads(world)
        peers = _start_peers(env, peer_args)
        logger.info("started %d ranks for data_parallel_size=%d, expert_parallel_size=%d", world - 1,
                    config.data_parallel_size, config.expert_parallel_size)
    device = backend.device(env.local_rank)
    backend.init_communicator(env.rank, env.world_size, env.init_method, timeout_s, device)
    logger.info("rank %d of %d on %s (%s): DP rank %d of %d, EP rank %d of %d, CP rank %d of %d", plan.rank,
                plan.world_size, device, backend.dist_backend, plan.dp_rank, plan.dp_size, plan.ep_rank, plan.ep_size,
                plan.cp_rank, plan.cp_size)
    return Joined(ParallelContext.create(plan, timeout_s), env.local_rank, peers)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start_peers(env: RankEnv, peer_args: tuple[Any, dict[str, Any]]) -> list[Any]:
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    port = env.init_method.rsplit(":", 1)[1]
    procs = []
    for rank in range(1, env.world_size):
        proc = ctx.Process(target=_peer_main, args=(rank, env.world_size, port, peer_args), daemon=True,
                           name=f"deepinfer-rank-{rank}")
        proc.start()
        procs.append(proc)
    return procs


def _peer_main(rank: int, world: int, port: str, peer_args: tuple[Any, dict[str, Any]]) -> None:
    """A self-launched rank: torchrun's variables, the same ``LLM``, then serve rank 0's calls."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port)
    share_host_threads(world)
    from deepinfer.engine.llm import LLM

    model, kwargs = peer_args
    serve_peer(LLM(model, **kwargs))


def serve_peer(llm: Any) -> None:
    """Run each ``generate`` call rank 0 broadcasts, until it broadcasts None (shutdown)."""
    context = llm.parallel.context
    while (call := context.host.broadcast_object(None)) is not None:
        prompts, params = call
        llm.generate(prompts, params, use_tqdm=False)


def stop_peers(context: ParallelContext, peers: list[Any], timeout_s: float = 30.0) -> None:
    """Tell self-launched ranks to exit, and wait for them (killing those that do not exit: a rank died)."""
    try:
        if all(proc.is_alive() for proc in peers):
            context.host.broadcast_object(None)
    except RankFailure:
        logger.warning("a rank had died; stopping the others")
    finally:
        for proc in peers:
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
