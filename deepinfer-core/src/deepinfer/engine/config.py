"""Engine limits, resolved once when an ``LLM`` is built.

The user's settings, their defaults and checks live in :class:`~deepinfer.engine.args.EngineArgs`; this is what
they become against the model and its state budget (``max_model_len`` fitted, ``max_num_seqs`` lowered to the
slots the budget holds, the budget the pool actually admits), so it has no defaults of its own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True, frozen=True, kw_only=True)
class EngineConfig:
    """Limits the scheduler and request validation enforce."""

    #: Longest sequence (prompt + output) in tokens.
    max_model_len: int
    #: Bytes of model state (all sequences together) the state cache may hold.
    state_cache_bytes: int
    #: Most sequences in one step.
    max_num_seqs: int
    #: Most tokens in one step (prefill chunks + decodes).
    max_num_batched_tokens: int
    #: Seeds the per-request seeds of unseeded requests.
    seed: int
    #: Most top-k alternatives per position a request may ask for.
    max_logprobs: int
    #: Tokens that end a sequence with ``finish_reason="stop"`` unless ``ignore_eos``.
    eos_token_ids: tuple[int, ...]
    #: Run every step eagerly (no captured decode graphs).
    enforce_eager: bool
    #: Queue step N+1 before reading step N's tokens (they reach it on the device); see ``Engine.step``.
    async_scheduling: bool
    #: Reuse cached prompt prefixes (``deepinfer.kv.prefix_cache``).
    enable_prefix_caching: bool = False
