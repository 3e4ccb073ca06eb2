"""The plain data of one step, shared by the engine (which builds it) and the runner (which runs it).

    Scheduler   -> SchedulerOutput   which sequences run which tokens (chunks), which were preempted
    Engine      -> StepInput         the chunks, plus what the runner needs of their sequences: states, the
                                     rows to sample with their sampling info, the prompt tokens to score
    ModelRunner -> RunnerOutput      sampled tokens and logprobs, as plain Python values

No requests, sequences or scheduler here: the runner imports this module and no engine module.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from deepinfer.models.base import SequenceState
    from deepinfer.sampling_params import SamplingParams

#: A token the device sampled and the host has not read yet; the runner takes it from the previous step.
PLACEHOLDER = -1


@dataclass(slots=True)
class ScheduledChunk:
    """Run ``token_ids`` at positions ``start..`` of sequence ``seq_id``."""

    seq_id: int
    start: int
    token_ids: list[int]
    #: The chunk reaches the sequence's last known token: sample the next one from its last row.
    sample: bool
    #: Sequences that get a copy of this sequence's state after the chunk and sample from the same row.
    fork_to: tuple[int, ...] = ()
    #: Speculative decoding: draft tokens the runner gets from the drafter and verifies after the chunk's last
    #: token (the anchor); the chunk samples, forks nothing, and may advance its state by up to this many more.
    num_drafts: int = 0


@dataclass(slots=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    #: Sequences whose state must be dropped before this step runs.
    preempted: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)

    @property
    def empty(self) -> bool:
        return not self.chunks


@dataclass(slots=True)
class SamplingRow:
    """What the sampler needs to know about one row: plain data, no tensors."""

    params: SamplingParams
    seed: int
    step: int  # output position being sampled (0 for the first generated token)
    prompt_ids: list[int]
    output_ids: list[int]
    #: The request's ``GrammarMatcher`` (structured output), read by the ``TokenMaskProvider``.
    grammar: Any = None


@dataclass(slots=True)
class ScheduledSample:
    """One row to sample this step: the sequence that receives the token, and its sampling info."""

    seq_id: int
    row: SamplingRow
    #: The sequence's newest token is still on the device (sampled by the step in flight, async scheduling):
    #: ``row.output_ids`` lacks it, and the penalties take it from the previous step's tokens.
    inflight: bool = False


@dataclass(slots=True)
class PromptScoring:
    """Prompt tokens one chunk scores for ``prompt_logprobs``: the chunk's row at position ``first + i`` scores
    ``token_ids[i]``, the prompt token at position ``first + 1 + i``."""

    seq_id: int
    first: int
    token_ids: list[int]
    num_logprobs: int


@dataclass(slots=True)
class StepInput:
    """One step as the runner sees it."""

    chunks: list[ScheduledChunk]
    #: The state of each chunk's sequence (same order as ``chunks``); the chunk continues it at ``chunk.start``.
    states: list[SequenceState]
    #: One per sampled row, in chunk order (a forking chunk: its sequence, then each fork, all from one row).
    samples: list[ScheduledSample] = field(default_factory=list)
    #: Per chunk: the prompt tokens it scores, or ``None``.
    prompt_scoring: list[PromptScoring | None] = field(default_factory=list)
    #: Per chunk: the first position whose output the engine reads, now or later (ForwardBatch.needed_from)
    needed_from: list[int] = field(default_factory=list)


@dataclass(slots=True)
class TokenLogprobs:
    """A chosen token with its raw logprob and rank, and the top alternatives ``(token_id, logprob)``."""

    token_id: int
    logprob: float
    rank: int
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class SpecResult:
    """What verifying one sequence's drafts did (speculative decoding)."""

    seq_id: int
    num_drafts: int  # drafts verified
    num_accepted: int  # of them accepted: the sequence got ``num_accepted + 1`` tokens
    #: Tokens the sequence's state holds after the step: all it was fed when every draft passed, else its count
    #: before the step (the forward was undone; the accepted tokens are fed again with the next step's).
    num_computed: int
    #: The drafter's per-position confidences of this step's drafts (the next step's verify budget reads them).
    confidence: list[float] = field(default_factory=list)


@dataclass(slots=True)
class RunnerOutput:
    #: One per sampled row, in chunk order: (sequence id, its token).  A speculative sequence has one entry per
    #: token it got (its accepted drafts, then the target's token), consecutively.
    sampled: list[tuple[int, TokenLogprobs]] = field(default_factory=list)
    #: One per sequence that verified drafts this step.
    spec: list[SpecResult] = field(default_factory=list)
    #: Prompt logprobs computed this step: (``PromptScoring.seq_id``, position of the scored token, its logprobs).
    prompt_logprobs: list[tuple[int, int, TokenLogprobs]] = field(default_factory=list)
