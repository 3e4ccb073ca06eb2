"""The contract between the engine and a model.

The engine (scheduler, state cache, runner) knows models only through these types; the model knows
nothing of requests.  One forward call processes a ragged batch: each sequence contributes a chunk of
new tokens that continue its own state exactly (feeding a prompt whole, in chunks, or token by token
gives the same result).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class SequenceState(Protocol):
    """All model state of one sequence (every layer's SWA ring, compressed entries, indexer keys,
    unfinished compressor windows).  Owned by the engine's state cache; mutated only by ``forward``."""

    @property
    def num_tokens(self) -> int:
        """Tokens consumed so far; the next chunk starts at this position."""
        ...

    def nbytes(self) -> int:
        """Bytes of tensor memory this state holds now."""
        ...

    def fork(self) -> "SequenceState":
        """An independent copy (``n > 1`` samples share one prompt prefill)."""
        ...


@dataclass(slots=True)
class ForwardBatch:
    """One step's input.  Sequence ``i`` owns rows ``sum(seq_lens[:i]) : sum(seq_lens[:i+1])``."""

    input_ids: torch.Tensor  # [T] int64, on the model's device
    positions: torch.Tensor  # [T] int64: absolute positions, contiguous per sequence from state.num_tokens
    seq_lens: list[int]  # new tokens per sequence; sum == T
    states: list[SequenceState]  # one per sequence, updated in place
    #: The backend's host-to-device copy (``Backend.to_device``: non-blocking on CUDA), set by the runner;
    #: None (tests, tools) = ``t.to(device)``.
    to_device: Callable[[torch.Tensor, torch.device], torch.Tensor] | None = None

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor the model built for this step (row indices, lengths) on the batch's device."""
        device = self.input_ids.device
        return self.to_device(t, device) if self.to_device is not None else t.to(device)


class CausalLM(Protocol):
    """What the engine calls on a loaded model."""

    vocab_size: int
    device: torch.device
    dtype: torch.dtype

    def new_state(self) -> SequenceState:
        """Empty state for a new sequence."""
        ...

    def state_bytes(self, num_tokens: int) -> int:
        """Upper bound on ``nbytes()`` of a state that has consumed ``num_tokens`` tokens (admission control)."""
        ...

    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Run the batch, advance every state, return final hidden states ``[T, hidden]``."""
        ...

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[N, vocab_size]`` in fp32 for selected rows of ``forward``'s output."""
        ...
