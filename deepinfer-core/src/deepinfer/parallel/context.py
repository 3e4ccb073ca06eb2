"""One rank's parallel context: its frozen plan, its communicators, and the expert-parallel MoE layers built with
it (in forward order), handed to the model at construction.  No module globals: two engines in one process
(tests) each have their own."""

from __future__ import annotations

import datetime
import re
from collections.abc import Callable
from typing import Protocol

import torch
import torch.distributed as dist

from deepinfer.parallel.comm import Communicator
from deepinfer.parallel.plan import ParallelPlan

#: How long a rank waits for rank 0's next call on ``ParallelContext.control`` (no practical limit).
_IDLE_WAIT = datetime.timedelta(days=365)
#: A routed expert's checkpoint tensors: ``layers.<layer>.ffn.experts.<expert>.``
_EXPERT = re.compile(r"^layers\.(\d+)\.ffn\.experts\.(\d+)\.")


class ParallelMoE(Protocol):
    """What the context needs of an expert-parallel MoE layer."""

    def idle(self) -> None:
        """Join this layer's collectives with no tokens."""
        ...


class ParallelContext:
    def __init__(self, plan: ParallelPlan, world: Communicator, ep: Communicator, cp: Communicator,
                 host: Communicator | None = None, control: Communicator | None = None):
        self.plan, self.world, self.ep, self.cp = plan, world, ep, cp
        #: The world over gloo, for host-side coordination (who has work, the calls, the outputs): no device
        #: synchronisation between steps, so async scheduling still overlaps the host with the device.
        self.host = host if host is not None else world
        #: The world over gloo without a practical timeout: where ranks that follow rank 0 wait for its next call
        #: or serving step (an idle server, a notebook between two ``generate`` calls may wait for hours).  A
        #: rank 0 that dies still fails the wait at once (its connections close).
        self.control = control if control is not None else self.host
        #: Expert-parallel MoE layers in the order a forward calls them (they register when built).
        self.moe_layers: list[ParallelMoE] = []
        #: Every layer with a collective in the forward, as (forward order key, join with no tokens).
        self.participants: list[tuple[tuple[int, int], Callable[[], None]]] = []
        #: MoE layer calls so far (real or idle): ``calls / len(moe_layers)`` forwards.
        self.moe_calls = 0
        #: Tokens routed to each logical expert per MoE layer on this rank since the last rebalance.
        self.load: torch.Tensor | None = None
        #: Hidden rows and (token, expert) pairs this rank's MoE layers have dispatched (traffic accounting).
        self.sent_rows = 0
        self.sent_pairs = 0

    @classmethod
    def create(cls, plan: ParallelPlan, timeout_s: float) -> ParallelContext:
        """Groups for ``plan`` on the default process group (already initialised by the backend).  Every rank
        creates every group, in one order, as torch.distributed requires."""
        everyone = tuple(range(plan.world_size))
        world = Communicator(everyone, plan.rank, timeout_s)
        host = Communicator(everyone, plan.rank, timeout_s,
                            dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))
        control = Communicator(everyone, plan.rank, _IDLE_WAIT.total_seconds(),
                               dist.new_group(backend="gloo", timeout=_IDLE_WAIT))
        groups: dict[str, Communicator] = {}
        for name, all_groups, mine in (("ep", plan.ep_groups, plan.ep_ranks), ("cp", plan.cp_groups, plan.cp_ranks)):
            for ranks in all_groups:
                solo = len(ranks) == 1 and plan.world_size > 1
                group = None if solo or len(ranks) == plan.world_size else dist.new_group(list(ranks))
                if ranks == mine:
                    groups[name] = Communicator(ranks, plan.rank, timeout_s, group, solo)
        return cls(plan, world, groups["ep"], groups["cp"], host, control)

    def loads(self, name: str) -> bool:
        """Whether this rank loads checkpoint tensor ``name``: all but the routed experts other EP ranks hold."""
        placement = self.plan.placement
        match = _EXPERT.match(name)
        if placement is None or match is None:
            return True
        return int(match[2]) in placement.local_experts(int(match[1]), self.plan.ep_rank)

    def table_rows(self, name: str, num_rows: int) -> slice | None:
        """The rows of a table this rank holds when tables are sharded over the EP group (Engram); None: all."""
        if self.plan.placement is None:
            return None
        per = -(-num_rows // self.ep.size)
        return slice(min(num_rows, self.ep.rank * per), min(num_rows, (self.ep.rank + 1) * per))

    def join(self, order: tuple[int, int], idle: Callable[[], None]) -> None:
        """Add a layer with collectives; ``order``: (decoder layer, place in it) sorts them in forward order."""
        self.participants.append((order, idle))

    def register(self, moe: ParallelMoE, layer: int, num_experts: int, device: torch.device) -> int:
        """Add the MoE layer of decoder layer ``layer`` (in forward order); returns its index among them."""
        self.join((layer, 1), moe.idle)
        self.moe_layers.append(moe)
        rows = len(self.moe_layers)
        load = torch.zeros(rows, num_experts, dtype=torch.int64, device=device)
        if self.load is not None:
            load[: rows - 1] = self.load
        self.load = load
        return rows - 1

    def count(self, layer: int, ids: torch.Tensor) -> None:
        """Count one step's routed experts ``ids`` ([T, k] logical ids) of MoE layer ``layer``."""
        assert self.load is not None
        self.load[layer] += torch.bincount(ids.reshape(-1), minlength=self.load.shape[1])

    def forwards_since(self, calls: int) -> int:
        """Whole forwards run since ``moe_calls`` was ``calls``."""
        done = self.moe_calls - calls
        n = len(self.moe_layers)
        if n and done % n:
            raise RuntimeError(f"a forward called {done % n} of its {n} expert-parallel MoE layers; every rank must "
                               "call all of them, in order, in every forward")
        return done // n if n else 0

    def idle_forward(self) -> None:
        """Join one forward's collectives (MoE and sharded tables) with no tokens (a rank with no work)."""
        for _, idle in sorted(self.participants, key=lambda p: p[0]):
            idle()
