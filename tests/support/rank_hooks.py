"""What a started rank may run in tests of the launcher: fail before joining, or join and then die."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from deepinfer.engine.rank_processes import PeerLink


@dataclass(frozen=True)
class TwoExperts:
    """The model shape planning needs: 2 experts, 1 MoE layer."""

    n_routed_experts: int = 2
    num_hidden_layers: int = 1


def fail_at_start(message: str, link: PeerLink) -> None:
    raise ValueError(message)


def join_then_die(code: int, timeout_s: float, link: PeerLink) -> None:
    """Join the world as a self-launched rank does, say something on stderr, and exit without a word to rank 0."""
    from deepinfer.backends import current_backend
    from deepinfer.engine.rank_launch import join_world
    from deepinfer.parallel.plan import ParallelConfig

    join_world(ParallelConfig(2), current_backend(), TwoExperts(), timeout_s, fail_at_start, link)
    print(f"rank {os.environ['RANK']} gives up loading its shard", file=sys.stderr, flush=True)
    os._exit(code)
