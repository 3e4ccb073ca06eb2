"""What rank 0 sends the ranks that follow it, what they send back, and which data-parallel rank gets a request.

Rank 0 of a parallel engine leads; the other ranks follow (``DataParallelEngine.follow``), each message on the
``control`` group:

- ``GenerateCall``: one offline ``LLM.generate`` call (a self-launched world's ``generate``);
- ``StepOrders``: one serving step: the requests that arrived since the last one, each assigned to the DP rank
  that will own it, the aborted request ids (every rank drops those it has), and whether the ranks step;
- ``None``: stop.

After a serving step every rank answers with a ``RankReport`` (its outputs, how many requests it holds, its
counters).  The dispatch policy is plain data, like the scheduler's: a new request goes to the DP rank holding
the fewest requests (reported, plus those assigned since), the lowest such rank on a tie, so concurrent arrivals
spread over the ranks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from deepinfer.engine.counters import EngineCounters
from deepinfer.engine.output_deltas import OutputUpdate
from deepinfer.sampling_params import SamplingParams


@dataclass(slots=True)
class GenerateCall:
    """One ``generate`` call: prompts and one ``SamplingParams`` (or None) per prompt."""

    prompts: list[Any]
    params: list[SamplingParams | None]


@dataclass(slots=True)
class Assignment:
    """A new request and the DP rank that owns it; ``extra``: further ``Engine.add_request`` arguments."""

    dp_rank: int
    request_id: str
    prompt: Any
    params: SamplingParams
    extra: tuple[Any, ...] = ()


@dataclass(slots=True)
class StepOrders:
    adds: list[Assignment] = field(default_factory=list)
    aborts: list[str] = field(default_factory=list)
    #: Whether every rank runs one lock-stepped iteration (a step of its own, or an idle forward).
    step: bool = False


@dataclass(slots=True)
class RankReport:
    """One rank's answer to a serving step (outputs only from the first CP rank of each DP rank)."""

    dp_rank: int
    cp_rank: int
    outputs: list[OutputUpdate]
    #: Requests this rank's engine holds (queued or running) after the step.
    num_requests: int
    counters: EngineCounters


class Dispatcher:
    """Assigns new requests to DP ranks: the least loaded, by requests held."""

    def __init__(self, dp_size: int):
        self.loads = [0] * dp_size

    def assign(self) -> int:
        rank = min(range(len(self.loads)), key=lambda r: (self.loads[r], r))
        self.loads[rank] += 1
        return rank

    def observe(self, reports: list[RankReport], pending: list[Assignment]) -> None:
        """The ranks' loads after a step, plus the requests assigned since (not yet sent)."""
        for report in reports:
            if report.cp_rank == 0:
                self.loads[report.dp_rank] = report.num_requests
        for add in pending:
            self.loads[add.dp_rank] += 1
