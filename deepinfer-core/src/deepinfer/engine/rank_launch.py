"""Joining or starting the ranks of a parallel ``LLM``.

- **torchrun** (``torchrun --nproc-per-node N script.py``): every process runs the script; ``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR`` and ``MASTER_PORT`` (set by torchrun) say who it is.  Every
  rank calls ``LLM.generate`` with the same prompts and gets every output.
- **self-launched** (no ``WORLD_SIZE`` in the environment): the calling process becomes rank 0 and starts the
  other ranks as fresh interpreters (``python -m deepinfer.engine.rank_main``, :mod:`.rank_processes`; nothing
  re-imports the caller's script); each runs the entry point the caller gives (``LLM``'s builds the same ``LLM``)
  and then follows rank 0 (``DataParallelEngine.follow``).  Rank 0 enters the rendezvous only once every rank is
  about to join, so a rank that dies while starting is reported at once, with its error.

The plan is checked before any process starts.  Collectives fail after ``distributed_timeout`` seconds (a peer
that died closes its connections, which fails them at once), so no rank hangs on a dead one.
"""

from __future__ import annotations

import logging
import os
import socket
from dataclasses import dataclass, field
from typing import Protocol

from deepinfer.backends.backend import Backend
from deepinfer.engine.rank_processes import (
    PeerLink,
    PeerMain,
    PeerProcess,
    reporting_dead_peers,
    start_peers,
    stop_all,
    wait_for,
)
from deepinfer.host_threads import share_host_threads
from deepinfer.parallel.comm import RankFailure
from deepinfer.parallel.context import ParallelContext
from deepinfer.parallel.plan import ParallelConfig, plan_parallel

logger = logging.getLogger(__name__)


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
    peers: list[PeerProcess] = field(default_factory=list)


def join_world(config: ParallelConfig, backend: Backend, model_config: ExpertShape, timeout_s: float,
               peer_main: PeerMain, link: PeerLink | None = None) -> Joined:
    """Plan this rank, start the other ranks if nobody launched them, and initialise the collectives.
    ``peer_main``: what a self-launched rank runs (builds its engine, then follows rank 0); ``link``: this
    rank's line to the rank 0 that started it (None: torchrun's rank, or rank 0)."""
    env = RankEnv.from_environ()
    world = config.world_size
    rank = env.rank if env is not None else 0
    size = env.world_size if env is not None else world
    plan = plan_parallel(config, size, rank, n_routed_experts=model_config.n_routed_experts,
                         num_moe_layers=model_config.num_hidden_layers)
    peers: list[PeerProcess] = []
    if env is None:
        _check_not_in_a_world()
        port = _free_port()
        env = RankEnv(world, 0, 0, f"tcp://127.0.0.1:{port}")
        share_host_threads(world)
        peers = start_peers(world, port, peer_main)
        logger.info("started %d ranks for data_parallel_size=%d, expert_parallel_size=%d", world - 1,
                    config.data_parallel_size, config.expert_parallel_size)
    device = backend.device(env.local_rank)
    with reporting_dead_peers(peers):
        wait_for(peers, "joining", timeout_s)  # the rendezvous below cannot notice a rank that never comes
        if link is not None:
            link.joining()
        backend.init_communicator(env.rank, env.world_size, env.init_method, timeout_s, device)
        context = ParallelContext.create(plan, timeout_s)
    logger.info("rank %d of %d on %s (%s): DP rank %d of %d, EP rank %d of %d, CP rank %d of %d", plan.rank,
                plan.world_size, device, backend.dist_backend, plan.dp_rank, plan.dp_size, plan.ep_rank, plan.ep_size,
                plan.cp_rank, plan.cp_size)
    return Joined(context, env.local_rank, peers)


def _check_not_in_a_world() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        raise RuntimeError("this process already leads ranks of another parallel LLM: call shutdown() on that LLM "
                           "(or drop it: `del llm`) before starting a new one")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def stop_peers(context: ParallelContext, peers: list[PeerProcess], timeout_s: float = 30.0) -> None:
    """Tell the ranks following rank 0 to exit (self-launched ones, or torchrun's under ``deepinfer serve``), and
    wait for the self-launched ones (killing those that do not exit: a rank died)."""
    try:
        if all(proc.is_alive() for proc in peers):
            context.control.broadcast_object(None)
    except RankFailure:
        logger.warning("a rank had died; stopping the others")
    finally:
        for proc in peers:
            proc.join(timeout_s)
        codes = [proc.exitcode for proc in peers]
        stop_all(peers)
    if peers:
        logger.info("stopped the other ranks (exit codes %s)", codes)


def leave_world() -> None:
    """Destroy this process's default process group: a rank that is done exits without the collectives' threads
    aborting it, and rank 0 (a notebook) can start a new parallel ``LLM`` later."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


def release(peers: list[PeerProcess]) -> None:
    """Let a self-launched world go without a word to its ranks (its ``LLM`` was dropped, or they were told to stop
    already): kill what still runs and leave the process group."""
    stop_all(peers)
    leave_world()
