"""The contract between the engine and a speculative drafter (DSpark, issue 15).

The engine owns the target model, the verifier and the budget; a drafter owns only its own context per sequence,
keyed by the sequence's target state (a :class:`~deepinfer.models.base.SequenceState` of the model that made the
drafter, which knows where such a state lives: DSpark keeps its context in the rows of the state's pool slot).
Each step the runner asks the drafter for ``k`` tokens per decoding request (:meth:`Drafter.draft`, which must
not change the context), verifies them with the target in one forward, and then appends the captured target
features of the accepted positions to the drafter's context (:meth:`Drafter.extend`).  Rejected positions are
never extended that way, so the drafter has nothing to roll back.

A drafter whose draft pass has fixed shapes once its batch is padded may also be a :class:`GraphDrafter`; the
runner then captures that pass per (batch bucket, k, whether any request samples) through the backend's graph service
(:mod:`deepinfer.runner.draft_graphs`), as it captures a :class:`~deepinfer.models.base.GraphDecodable` model's
decode steps.  The capability is optional, so a drafter that cannot offer it (or a stand-in) stays eager.  A
:class:`VerifyExtender` also extends its context inside a captured verify step
(:mod:`deepinfer.runner.verify_graphs`), so nothing of the drafter runs between the step's read-back and the next
draft.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from deepinfer.models.base import SequenceState


@dataclass(slots=True)
class Drafts:
    """One step's drafts for ``B`` requests."""

    tokens: torch.Tensor  # [B, K] int64, drawn left to right
    confidence: torch.Tensor  # [B, K] float32: each position's conditional acceptance probability


@dataclass(slots=True)
class DraftRequest:
    """One row per request in the step."""

    state: SequenceState  # the request's target state (the drafter's context is keyed by it)
    anchor: int  # the last accepted token (the block's first input)
    position: int  # the anchor's position
    temperature: float  # 0 = greedy
    seed: int  # the request's 64-bit sampling seed (``SamplingRow.seed``): a sampled draft's noise stream
    #: The output position of the first draft (``SamplingRow.step`` of the anchor's row).  A sampled drafter
    #: draws draft ``j`` with the noise of (seed, ``step + j``), the noise the verifier's race uses there
    #: (:mod:`deepinfer.ops.speculative`), so the draft agrees with the target's token as often as it can.
    step: int


class Drafter(Protocol):
    """What the engine calls on a drafter."""

    max_draft_len: int  # the most tokens one draft() call may return (DSpark: its block size)
    capture_layer_ids: tuple[int, ...]  # target layers whose outputs the drafter reads

    def extend(self, states: list[SequenceState], positions: torch.Tensor, features: torch.Tensor) -> None:
        """Append accepted positions' captured target features [N, F] (F = len(capture_layer_ids) * hidden)
        to the drafter context of each row's sequence (``states[i]``: row ``i``'s; prefill rows and accepted
        tokens, in order)."""
        ...

    def draft(self, requests: list[DraftRequest], k: int) -> Drafts:
        """Draft k tokens per request from its context (1 <= k <= max_draft_len); must not change the context.
        The context holds the features of positions before each request's anchor."""
        ...

    def truncate(self, state: SequenceState, length: int) -> None:
        """Forget the sequence's context beyond ``length`` positions."""
        ...

    def fork(self, src: SequenceState, dst: SequenceState) -> None:
        """Copy ``src``'s context to ``dst``, forked from it (``n > 1`` completions share the prompt's prefill)."""
        ...

    def free(self, state: SequenceState) -> None:
        """Forget the sequence's context (it finished or was preempted; called before the state is released)."""
        ...


@runtime_checkable
class GraphDrafter(Protocol):
    """A drafter whose draft pass the runner can capture and replay (optional, next to :class:`Drafter`).

    ``draft_inputs`` is the host side (checks, and the requests as one int64 tensor padded to ``bucket`` rows,
    their seeds and temperatures included); ``draft_forward`` is the device side, reading only that tensor (which
    the runner keeps in a static buffer) and the drafter's context, with no host synchronisation, so sampled drafts
    draw counter-based noise (:func:`~deepinfer.ops.sampling.sample_tokens`), not a generator's.  ``draft`` must
    give what ``draft_forward`` gives on the same rows (``sampled``: whether any request samples), bit for bit
    where the backend's ops are batch invariant.
    """

    def draft_inputs(self, requests: list[DraftRequest], bucket: int) -> torch.Tensor:
        """Host int64 ``[bucket, C]``: one row per request, then padding rows that read no sequence's context
        (DSpark: the null slot 0, never handed out), draft greedily, and whose drafts nobody reads.  All-zero rows
        must be valid padding (capture runs on them)."""
        ...

    def draft_forward(self, inputs: torch.Tensor, k: int, sampled: bool) -> Drafts:
        """The drafts of ``inputs`` (from ``draft_inputs``, on the device): tokens ``[bucket, k]`` int64 and
        confidence ``[bucket, k]`` fp32; without ``sampled`` every row drafts greedily.  Must not change the
        context."""
        ...


@runtime_checkable
class VerifyExtender(Protocol):
    """A drafter that extends its context inside a captured verify step (optional, next to :class:`Drafter`).

    The step runs ``q`` rows a sequence (its anchor at position P, then drafts) before the verifier decides what
    it keeps, so every row is extended, a rejected draft's too.  The drafter must keep such rows out of any
    draft's context until they are rewritten: the rows' positions are >= the next anchor (drafts read positions
    before their anchor), and a later step extends them again before a draft reads them; what it must ensure is
    that no such row replaces a position still in a draft's window (DSpark: spare ring rows).  Padding rows use
    the null slot 0, which no request holds.
    """

    def extend_rows(self, slots: torch.Tensor, positions: torch.Tensor, features: torch.Tensor) -> None:
        """:meth:`Drafter.extend` of device tensors, with no host data or synchronisation, so it can be captured:
        ``slots`` / ``positions`` [N] int64, ``features`` [N, F]; ``slots`` are the target's state slots, as the
        model's :meth:`~deepinfer.models.base.VerifyDecodable.verify_inputs` lays them out (``"slots"``)."""
        ...


@runtime_checkable
class DraftingModel(Protocol):
    """A model whose checkpoint ships a speculative drafter (V4.1's DSpark)."""

    def make_drafter(self) -> Drafter | None:
        """The drafter of this model's sequence states (its context follows the states the model makes), or None
        when this checkpoint has none.  Called once, after ``configure_state``."""
        ...
