"""Collectives of one group of ranks, through torch.distributed (the backend's NCCL / HCCL / gloo).

Every call names what failed when a peer is gone: a rank that died (its connections close) or never joins
(the group's timeout) makes the others raise :class:`RankFailure` instead of hanging.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist


class RankFailure(RuntimeError):
    """A collective failed: another rank died or did not join in time."""


class Communicator:
    """A group of world ranks (ascending); ``rank`` is this process's index in it.  ``group``: its torch.distributed
    group (None: the default group, the whole world); ``solo``: a one-rank group inside a larger world, whose
    collectives are the identity (no process group is made for it).  A world of one rank is not solo: its
    collectives run (NCCL / HCCL / gloo with one rank), so that path is exercised on one device."""

    def __init__(self, ranks: tuple[int, ...], world_rank: int, timeout_s: float, group: Any = None,
                 solo: bool = False):
        self.ranks, self.size, self.rank = ranks, len(ranks), ranks.index(world_rank)
        self.group, self.timeout_s, self.solo = group, timeout_s, solo
        if solo and self.size != 1:
            raise ValueError(f"a solo communicator has one rank, not {self.size}")

    @classmethod
    def alone(cls) -> Communicator:
        """A one-rank group with no process group at all (tests, tools)."""
        return cls((0,), 0, 0.0, solo=True)

    @contextlib.contextmanager
    def _failing_as(self, what: str) -> Iterator[None]:
        try:
            yield
        except (RuntimeError, dist.DistError) as exc:
            late = f" or did not join within {self.timeout_s:g} s" if self.timeout_s < 86400 else ""
            raise RankFailure(f"{what} across ranks {list(self.ranks)} failed on rank {self.ranks[self.rank]}: "
                              f"another rank died{late} ({exc})") from exc

    def all_to_all(self, send: torch.Tensor, counts: list[int], recv_counts: list[int] | None = None
                   ) -> tuple[torch.Tensor, list[int]]:
        """Rows of ``send`` grouped by destination (``counts[d]`` rows to rank ``d``) -> the rows received,
        grouped by source, and how many came from each.  ``recv_counts``: when the caller knows them (skips
        one exchange)."""
        if self.solo:
            return send, list(counts)
        with self._failing_as("an all-to-all"):
            if recv_counts is None:
                theirs = torch.empty(self.size, dtype=torch.int64, device=send.device)
                dist.all_to_all_single(theirs, torch.tensor(counts, dtype=torch.int64, device=send.device),
                                       group=self.group)
                recv_counts = theirs.tolist()
            out = send.new_empty((sum(recv_counts), *send.shape[1:]))
            dist.all_to_all_single(out, send.contiguous(), recv_counts, list(counts), group=self.group)
        return out, recv_counts

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``t`` reduced over the group in place (``"sum"`` or ``"max"``)."""
        if not self.solo:
            with self._failing_as(f"an all-reduce ({op})"):
                dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX, group=self.group)
        return t

    def any(self, flag: bool, device: torch.device) -> bool:
        """Whether ``flag`` is true on any rank of the group."""
        return bool(self.all_reduce(torch.tensor([int(flag)], device=device), "max").item())

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable ``obj``, in rank order."""
        if self.solo:
            return [obj]
        out: list[Any] = [None] * self.size
        with self._failing_as("gathering results"):
            dist.all_gather_object(out, obj, group=self.group)
        return out

    def gather_object(self, obj: Any, dst: int = 0) -> list[Any] | None:
        """Every rank's picklable ``obj``, in rank order, on rank ``dst`` (None on the others)."""
        if self.solo:
            return [obj]
        out: list[Any] | None = [None] * self.size if self.rank == dst else None
        with self._failing_as("gathering results"):
            dist.gather_object(obj, out, dst=self.ranks[dst], group=self.group)
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank of the group."""
        if self.solo:
            return obj
        box = [obj]
        with self._failing_as("a broadcast"):
            dist.broadcast_object_list(box, src=self.ranks[src], group=self.group)
        return box[0]
