"""The contract between the engine and a model.

The engine (scheduler, state cache, runner) knows models only through these types; the model knows
nothing of requests.  One forward call processes a ragged batch: each sequence contributes a chunk of
new tokens that continue its own state exactly (feeding a prompt whole, in chunks, or token by token
gives the same result).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import torch

if TYPE_CHECKING:
    from deepinfer.kv.prefix_cache import PrefixCache


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

    def fork(self) -> SequenceState:
        """An independent copy (``n > 1`` samples share one prompt prefill)."""
        ...

    def release(self) -> None:
        """Give the memory back (the sequence finished or was preempted); the state is not used again."""
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
    #: Per sequence, the first position whose output the engine reads, in this step or a later one (the last
    #: prompt token's, or the first prompt position whose logprobs were asked for); None: every row's.  A model
    #: may skip work that only rows before it need (V4.1's decoder prefill truncation).
    needed_from: list[int] | None = None
    #: Rows ([R] int64, on the model's device) whose target features a model with a speculative drafter (V4.1's
    #: DSpark) returns in :attr:`captured`; None: nothing is captured, at no cost.
    capture_rows: torch.Tensor | None = None
    #: Set by ``forward`` when :attr:`capture_rows` is: ``[R, F]`` in the model dtype, rows in ``capture_rows``
    #: order (V4.1: F = len(capture_layer_ids) * hidden, the mean over the mHC streams of each layer's output).
    captured: torch.Tensor | None = None

    def upload(self, t: torch.Tensor) -> torch.Tensor:
        """A host tensor the model built for this step (row indices, lengths) on the batch's device."""
        device = self.input_ids.device
        return self.to_device(t, device) if self.to_device is not None else t.to(device)


@dataclass(slots=True, frozen=True)
class StateCapacity:
    """What a configured model's state memory holds: the scheduler keeps the live sequences' ``state_bytes``
    within ``nbytes`` and their number within ``max_seqs``."""

    nbytes: int
    max_seqs: int


class CausalLM(Protocol):
    """What the engine calls on a loaded model."""

    vocab_size: int
    device: torch.device
    dtype: torch.dtype

    def configure_state(self, max_seqs: int, capacity_bytes: int) -> StateCapacity:
        """Set aside state memory for at most ``max_seqs`` live sequences within ``capacity_bytes``, before any
        state exists; states made by ``new_state`` afterwards live there."""
        ...

    def state_pool_bytes(self, max_seqs: int, num_tokens: int, sequences: int | None = None) -> int:
        """The ``capacity_bytes`` under which, configured for ``max_seqs`` sequences, ``sequences`` (default
        ``max_seqs``) sequences of ``num_tokens`` tokens all fit; a larger budget never holds less."""
        ...

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


@runtime_checkable
class GraphDecodable(Protocol):
    """A model whose pure-decode steps have fixed shapes, so the runner can capture and replay them.

    ``decode_inputs`` does the host side (reserve memory, advance the states, build index tensors padded to
    ``bucket`` rows); ``decode_forward`` is the device side, reading only the tensors it is given, which the
    runner keeps in static buffers, and the runner captures it together with ``compute_logits``.  Eager and
    replayed steps run the same code.
    """

    def decode_inputs(self, states: list[SequenceState], input_ids: list[int], bucket: int,
                      max_tokens: int) -> dict[str, torch.Tensor]:
        """Host int64 tensors of one decode step, padded to ``bucket`` rows, shaped for ``max_tokens``-token
        sequences whatever the states hold (so one capture serves every step of that bucket); ``"input_ids"``
        ``[bucket]`` among them (the runner may overwrite rows of it on the device)."""
        ...

    def decode_forward(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states ``[bucket, hidden]`` of the step from ``decode_inputs``'s tensors on the device."""
        ...


@runtime_checkable
class VerifyDecodable(Protocol):
    """A model whose speculative verify steps of pure-decode batches (each sequence's anchor and ``q - 1``
    drafts) have fixed shapes and keep every accepted token without feeding it again, so the runner captures
    them like decode steps (``runner/verify_graphs.py``).

    ``verify_inputs`` reserves the states' memory and builds host index tensors padded to ``bucket`` sequences;
    ``verify_forward`` runs on the device from those tensors alone (the runner writes the drafts into the
    ``"input_ids"`` rows ``i * q + 1 ..`` first); ``commit_verify`` then keeps each sequence's first rows: it
    queues what they leave in the state from device counts (before the step is read back), and the function it
    returns advances the states once the host holds the counts."""

    @property
    def max_verify_rows(self) -> int:
        """The most rows a sequence (``q``) a verify step may take."""
        ...

    def verify_inputs(self, states: list[SequenceState], anchors: list[int], bucket: int, q: int,
                      max_tokens: int) -> dict[str, torch.Tensor]:
        ...

    def verify_forward(self, tensors: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor, Any]:
        """(hidden ``[bucket * q, hidden]``, the drafter's target features of every row, a record for
        ``commit_verify``: device tensors a replay rewrites in place)."""
        ...

    def commit_verify(self, record: Any, states: list[SequenceState], kept: torch.Tensor, q: int,
                      upload: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[list[int]], None]:
        """Keep the first ``kept[i]`` (1 .. q; [n] int64 on the device) rows of sequence ``i``; returns what
        advances the states given the same counts on the host."""
        ...


class StateCheckpoint(Protocol):
    """What a forward wrote into some states, saved before it ran (:meth:`Rewindable.checkpoint`)."""

    def restore(self, indices: list[int]) -> None:
        """Return states ``indices`` (positions in the checkpoint) to exactly what they were before the forward."""
        ...


@runtime_checkable
class Rewindable(Protocol):
    """A model whose states can be returned to an earlier token count: speculative decoding verifies drafts by
    feeding them, and undoes the forward of a request whose drafts the target rejected."""

    def checkpoint(self, states: list[SequenceState], advances: list[int],
                   upload: Callable[[torch.Tensor], torch.Tensor] | None = None) -> StateCheckpoint:
        """Save what the next forward overwrites when state ``i`` advances by ``advances[i]`` tokens.  ``upload``:
        the host-to-device copy for index tensors (the backend's non-blocking one; default ``.to(device)``)."""
        ...


@runtime_checkable
class PrefixCacheable(Protocol):
    """A model whose compressed state can be shared between sequences by prompt prefix (docs/prefix_caching.md)."""

    def new_prefix_cache(self) -> PrefixCache:
        """A prefix cache over the configured state pool.  Called once, after ``configure_state``."""
        ...

    def replay_start(self, hit: int, needed: int) -> int:
        """The position a sequence with ``hit`` cached tokens computes from (its rings rebuilt exactly by then);
        ``needed``: the first position whose output the engine reads."""
        ...

