"""Requests and their sequences: the plain data the scheduler and the output processor share.

A request with ``n`` completions owns ``n`` sequences.  Only sequence 0 runs the prompt; the others
wait in ``AWAITING_FORK`` and receive a copy of its state when the prompt is done, so the prompt is
computed once.  A sequence's ``token_ids`` is prompt + output; ``num_computed`` counts the tokens
its model state has consumed (reset to 0 when it is preempted, then recomputed).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from deepinfer.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, SpecDecodingStats
from deepinfer.sampling_params import SamplingParams

if TYPE_CHECKING:
    from deepinfer.engine.detokenizer import IncrementalDetokenizer
    from deepinfer.structured.matcher import GrammarMatcher


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    AWAITING_FORK = "awaiting_fork"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One completion being generated."""

    seq_id: int
    request: Request
    index: int
    token_ids: list[int]
    seed: int
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed: int = 0
    #: Prompt tokens whose compressed state came from the prefix cache when it last started (0: none).
    num_cached: int = 0
    #: Forks still to receive this sequence's state when its prompt completes (sequence 0 only).
    pending_forks: list[Sequence] = field(default_factory=list)
    output: CompletionOutput | None = None
    detokenizer: IncrementalDetokenizer | None = None  # set by the output processor
    #: Structured output: this completion's ``GrammarMatcher`` (``None`` for free requests).
    grammar: GrammarMatcher | None = None
    #: Tokens sampled on the device whose values the host has not read yet (async scheduling: 0 or 1).  The
    #: scheduler counts them as known tokens; the runner feeds them to the next step from the device.
    num_inflight: int = 0
    #: Speculative decoding: the drafter's confidences of this sequence's last drafts (the verify budget's
    #: one-step-old snapshot), or None before its first.
    draft_confidence: list[float] | None = None

    @property
    def prompt_len(self) -> int:
        return self.request.prompt_len

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.request.prompt_len

    @property
    def num_tokens(self) -> int:
        """Tokens so far, in-flight ones included."""
        return len(self.token_ids) + self.num_inflight

    @property
    def num_uncomputed(self) -> int:
        return self.num_tokens - self.num_computed

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.request.prompt_len :]


@dataclass(slots=True, eq=False)
class Request:
    """One prompt and its sampling parameters."""

    request_id: str
    arrival: int
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    max_total_tokens: int  # prompt + output cap: min(prompt + max_tokens, max_model_len)
    sequences: list[Sequence] = field(default_factory=list)
    #: Filled while the prompt runs when ``params.prompt_logprobs`` is set; entry 0 is ``None``.
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    #: Set when the request failed while running (e.g. its grammar rejected a sampled token).
    error: str | None = None
    #: Speculative decoding counts over its completions (None until it first verifies drafts).
    spec_stats: SpecDecodingStats | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.time()))

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return all(s.status is SequenceStatus.FINISHED for s in self.sequences)

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt positions still lack their logprobs (positions 1..prompt_len-1)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.prompt_len
