"""What ``LLM.generate`` returns: vLLM's ``RequestOutput`` / ``CompletionOutput`` shape."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """Log-probability of one token under the raw model distribution, and its rank (1 = most likely)."""

    logprob: float
    rank: int
    decoded_token: str | None = None


#: Per position: token id -> Logprob (the top-k alternatives plus the chosen token).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` completions of a request."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[PositionLogprobs] | None
    #: ``"stop"`` (EOS, a stop token or a stop string) or ``"length"`` (max_tokens or max_model_len).
    finish_reason: str | None = None
    #: The stop string or stop token id that ended the completion; ``None`` for EOS and ``"length"``.
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class SpecDecodingStats:
    """Speculative decoding of one request (all its completions), with vLLM's names: ``num_drafts`` steps that
    verified drafts, ``num_draft_tokens`` drafts verified, ``num_accepted_tokens`` of them accepted, and
    ``num_accepted_tokens_per_pos[i]`` how often the draft at position ``i`` of a block was accepted."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens per verify step: 1 (the target's own) + accepted drafts per step (vLLM's definition)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 1.0

    @property
    def acceptance_rate_per_pos(self) -> list[float]:
        """Per draft position, the fraction of verify steps that accepted it."""
        return [n / self.num_drafts for n in self.num_accepted_tokens_per_pos] if self.num_drafts else []

    def record(self, num_drafts: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        grow = num_accepted - len(self.num_accepted_tokens_per_pos)
        self.num_accepted_tokens_per_pos += [0] * max(0, grow)
        for i in range(num_accepted):
            self.num_accepted_tokens_per_pos[i] += 1


@dataclass(slots=True)
class RequestMetrics:
    """When a request passed each stage (vLLM's names): seconds since the epoch (``time.time()``), ``None``
    until reached.  ``first_token_time`` / ``last_token_time`` are when the host read a token of any of the
    request's completions; TTFT is ``first_token_time - arrival_time``."""

    arrival_time: float
    last_token_time: float | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    #: ``first_scheduled_time - arrival_time``: seconds spent waiting before the first chunk ran.
    time_in_queue: float | None = None
    finished_time: float | None = None


@dataclass(slots=True)
class RequestOutput:
    """The result of one prompt.

    A rejected request (bad prompt or parameters) has ``error`` set to a message naming the problem,
    ``outputs == []`` and ``finished == True``; the other requests of the same call are unaffected.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    #: ``None`` unless requested; else one entry per prompt token, the first ``None``.
    prompt_logprobs: list[PositionLogprobs | None] | None
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    error: str | None = None
    #: Timings of the request (``None`` only for outputs built outside the engine).
    metrics: RequestMetrics | None = None
    #: Speculative decoding counts; None when the request never verified drafts.
    spec_decoding_stats: SpecDecodingStats | None = None
    #: Prompt tokens served from the prefix cache (vLLM's field; 0 without ``enable_prefix_caching``).
    num_cached_tokens: int = 0
