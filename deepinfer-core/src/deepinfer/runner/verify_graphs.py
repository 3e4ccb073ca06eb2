"""Speculative verify steps replayed from captured graphs, one per (batch bucket, rows a sequence, length bucket).

A pure-decode step with drafts (every chunk its anchor alone) on a
:class:`~deepinfer.models.base.VerifyDecodable` model has fixed shapes: ``q`` rows a sequence (anchor, then
``q - 1`` drafts), sequences padded to a bucket, index tensors sized for a bucket of lengths.  As with
:class:`~deepinfer.runner.decode_graphs.DecodeGraphs`, the first step of a bucket captures the forward (hidden states
of every row) and the drafter's target features through the backend's graph service; later steps copy their host
inputs into the static buffers, write the drafts (already on the device) over the draft rows, and replay.  The
verifier then decides what each sequence keeps and the model's ``commit_verify`` writes what that leaves in the
state: nothing is undone and nothing is fed again.  With a :class:`~deepinfer.spec_decode.drafter.VerifyExtender`
drafter, the graph also extends the drafter's context with every row's target features (the drafter keeps rejected
rows out of its windows), so the runner does no drafter work between the read-back and the next draft.  The graph
ends at the hidden states: the caller computes the logits of the rows it reads (one GEMM), so a graph holds no
``[rows * q, vocab]`` buffer (graphs of every bucket and ``q`` stay alive together).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deepinfer.backends import Backend
from deepinfer.models.base import CausalLM, SequenceState, VerifyDecodable
from deepinfer.runner.decode_graphs import CapturedSteps, DecodeGraphs, step_buckets
from deepinfer.spec_decode.drafter import VerifyExtender


class VerifiableModel(CausalLM, VerifyDecodable, Protocol):
    """A model whose verify steps the runner captures."""


@dataclass(slots=True)
class VerifyStep:
    """One replayed verify step's results, views of the graph's outputs (valid until its bucket runs again)."""

    hidden: torch.Tensor  # [rows * q, hidden], sequence i's rows at i * q ..
    features: torch.Tensor  # [rows * q, F] the drafter's target features of every row (extended already when
    #                         the graphs have an ``extender``)
    record: Any  # what the model's commit_verify reads
    q: int


class VerifyGraphs(CapturedSteps):
    """Captures and replays verify steps of ``model`` on ``backend``'s device."""

    WHAT = "verify step"

    def __init__(self, model: VerifiableModel, backend: Backend, device: torch.device, max_seqs: int,
                 max_tokens: int, extender: VerifyExtender | None = None):
        super().__init__(backend, device)
        self.model, self.max_seqs, self.max_tokens, self.extender = model, max_seqs, max_tokens, extender
        self._graphs: dict[tuple[int, int, int], Any] = {}

    def run(self, states: list[SequenceState], anchors: list[int], q: int, drafts: torch.Tensor,
            dst: torch.Tensor) -> VerifyStep:
        """Run a verify step of ``q`` rows a sequence: row ``i * q`` is ``anchors[i]``; ``drafts`` (device, flat)
        go to rows ``dst`` of the step (on the device, before the replay)."""
        rows, tokens = step_buckets(states, q, self.max_seqs, self.max_tokens + q, DecodeGraphs.MIN_TOKENS)
        host = self.model.verify_inputs(states, anchors, rows, q, tokens)
        graph = self._graphs.get((rows, q, tokens))
        if graph is None:
            graph = self._graphs[rows, q, tokens] = self._capture_static(host, self._body)
        graph.stage(host)
        if dst.numel():
            graph.input_ids[dst] = drafts
        graph.replay()
        hidden, features, record = graph.outputs
        return VerifyStep(hidden, features, record, q)

    def _body(self, static: dict[str, torch.Tensor]) -> list[Any]:
        hidden, features, record = self.model.verify_forward(static)
        if self.extender is not None:
            self.extender.extend_rows(static["slots"], static["positions"], features)
        return [hidden, features, record]

    def close(self) -> None:
        self._graphs.clear()
        super().close()
