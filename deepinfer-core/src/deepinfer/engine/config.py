"""Engine limits, resolved once when an ``LLM`` is built."""

from __future__ import annotations

from dataclasses import dataclass

from deepinfer.sampling_params import MAX_LOGPROBS


@dataclass(slots=True, frozen=True)
class EngineConfig:
    """Limits the scheduler and request validation enforce."""

    #: Longest sequence (prompt + output) in tokens.
    max_model_len: int
    #: Bytes of model state (all sequences together) the state cache may hold.
    state_cache_bytes: int
    #: Most sequences in one step.
    max_num_seqs: int = 256
    #: Most tokens in one step (prefill chunks + decodes).
    max_num_batched_tokens: int = 8192
    #: Seeds the per-request seeds of unseeded requests.
    seed: int = 0
    #: Most top-k alternatives per position a request may ask for.
    max_logprobs: int = MAX_LOGPROBS
    #: Tokens that end a sequence with ``finish_reason="stop"`` unless ``ignore_eos``.
    eos_token_ids: tuple[int, ...] = ()
    #: Run every step eagerly (no captured decode graphs).
    enforce_eager: bool = False
    #: Queue step N+1 before reading step N's tokens (they reach it on the device); see ``Engine.step``.
    async_scheduling: bool = True

    def __post_init__(self) -> None:
        for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "state_cache_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if not 0 <= self.max_logprobs <= MAX_LOGPROBS:
            raise ValueError(f"max_logprobs must be in [0, {MAX_LOGPROBS}], got {self.max_logprobs!r}")
