"""Joining or starting the ranks of a parallel ``LLM``.

- **torchrun** (``torchrun --nproc-per-node N script.py``): every process runs the script; ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (set by torchrun) say who it is.  Every
  rank calls ``LLM.generate`` with the same prompts and gets every output.
- **self-launched** (no ``WORLD_SIZE`` in the environment): the calling process becomes rank 0 and starts the
  other ranks (torch.multiprocessing, ``spawn``); each runs the entry point the caller gives (``LLM``'s builds
  the same ``LLM``) and waits for rank 0 to broadcast the prompts of each ``generate`` call (:func:`serve_peer`).

The plan is checked before any process starts.  Collectives fail after ``distributed_timeout`` seconds (a peer
that died closes its connections, which fails them at once), so no rank hangs on a dead one.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.process import BaseProcess
from typing import Any, Protocol

import torch.multiprocessing as mp

from deepinfer.backends.backend import Backend
from deepinfer.host_threads import share_host_threads
from deepinfer.parallel.comm import RankFailure
from deepinfer.parallel.context import ParallelContext
from deepinfer.parallel.plan import ParallelConfig, plan_parallel
from deepinfer.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

#: A self-launched rank's work once it has joined the world (picklable: ``spawn`` sends it to the new process).
PeerMain = Callable[[], None]
#: One ``generate`` call a peer runs: (prompts, one ``SamplingParams`` or None per prompt).
GenerateCall = Callable[[list[Any], list[SamplingParams | None]], object]


class ExpertShape(Protocol):
    """What planning the ranks needs of the model's config."""

    @property
    def n_routed_experts(self) -> int: ...

    @property
    def num_hidden_layers(self) -> int: ...


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
    peers: list[BaseProcess]


def join_world(config: ParallelConfig, backend: Backend, model_config: ExpertShape, timeout_s: float,
               peer_main: PeerMain) -> Joined:
    """Plan this rank, start the other ranks if nobody launched them, and initialise the collectives.
    ``peer_main``: what a self-launched peer runs once it has joined (builds its engine, then :func:`serve_peer`)."""
    env = RankEnv.from_environ()
    world = config.world_size
    rank = env.rank if env is not None else 0
    size = env.world_size if env is not None else world
    plan = plan_parallel(config, size, rank, n_routed_experts=model_config.n_routed_experts,
                         num_moe_layers=model_config.num_hidden_layers)
    peers: list[BaseProcess] = []
    if env is None:
        env = RankEnv(world, 0, 0, f"tcp://127.0.0.1:{_free_port()}")
        share_host_threads(world)
        peers = _start_peers(env, peer_main)
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


def _start_peers(env: RankEnv, peer_main: PeerMain) -> list[BaseProcess]:
    ctx = mp.get_context("spawn")
    port = env.init_method.rsplit(":", 1)[1]
    procs: list[BaseProcess] = []
    for rank in range(1, env.world_size):
        proc = ctx.Process(target=_peer_main, args=(rank, env.world_size, port, peer_main), daemon=True,
                           name=f"deepinfer-rank-{rank}")
        proc.start()
        procs.append(proc)
    return procs


def _peer_main(rank: int, world: int, port: str, peer_main: PeerMain) -> None:
    """A self-launched rank: torchrun's variables, then the caller's work (which joins through them)."""
    os.environ.update(WORLD_SIZE=str(world), RANK=str(rank), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=port)
    share_host_threads(world)
    peer_main()


def serve_peer(context: ParallelContext, generate: GenerateCall) -> None:
    """Run each ``generate`` call rank 0 broadcasts, until it broadcasts None (shutdown)."""
    while (call := context.host.broadcast_object(None)) is not None:
        prompts, params = call
        generate(prompts, params)


def stop_peers(context: ParallelContext, peers: list[BaseProcess], timeout_s: float = 30.0) -> None:
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
