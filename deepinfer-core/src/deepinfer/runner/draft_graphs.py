"""Draft passes replayed from captured graphs, one per (batch bucket, k, sampled).

A :class:`~deepinfer.spec_decode.drafter.GraphDrafter`'s draft pass has fixed shapes once its requests are padded to a
bucket of rows: the drafter reads one int64 tensor (``draft_inputs``: a row per request, its seed and temperature
included) and its own context.  The first draft of a (bucket, k, sampled) captures ``draft_forward`` through the
backend's graph service (``Backend.graph_capture``: CUDA graphs on NVIDIA, plain re-execution on the CPU) against a
static input buffer; every later one copies its rows into that buffer (one host-to-device copy) and replays.
Capture runs on all-zero rows, padding that reads only the null slot, and drafting writes nothing, so capturing
changes no context.  A step whose requests are all greedy replays the greedy pass (argmax only); one with a
sampled request replays the sampled pass, whose draws are counter-based noise of each row's (seed, output
position) (no generator), so they are captured like the rest.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from deepinfer.backends import Backend
from deepinfer.runner.decode_graphs import CapturedSteps, bucket_size
from deepinfer.spec_decode.drafter import DraftRequest, Drafts, GraphDrafter


@dataclass(slots=True)
class _DraftGraph:
    inputs: torch.Tensor  # [bucket, C] int64 on the device: the static input
    #: Two host copies of ``inputs`` (Backend.host_buffer: pinned on CUDA), used in turn, so a copy still queued
    #: from the previous draft is never overwritten (as :class:`~deepinfer.runner.decode_graphs.DecodeGraphs`).
    staging: tuple[torch.Tensor, torch.Tensor]
    replay: Callable[[], object]
    outputs: list[Drafts]  # the pass's drafts [bucket, k(, V)]; a captured graph rewrites them in place
    turn: int = 0

    def stage(self, host: torch.Tensor) -> None:
        staging = self.staging[self.turn]
        self.turn ^= 1
        staging.copy_(host.flatten())
        self.inputs.copy_(staging.view(self.inputs.shape), non_blocking=True)


class DraftGraphs(CapturedSteps):
    """Captures and replays ``drafter``'s draft passes on ``backend``'s ``device``."""

    WHAT = "draft pass"

    def __init__(self, drafter: GraphDrafter, backend: Backend, device: torch.device, max_seqs: int):
        super().__init__(backend, device)
        self.drafter, self.max_seqs = drafter, max_seqs
        self._graphs: dict[tuple[int, int, bool], _DraftGraph] = {}

    def bucket(self, n: int) -> int:
        """Rows a draft of ``n`` requests is padded to (``n`` itself beyond ``max_seqs``)."""
        return max(n, min(bucket_size(n), self.max_seqs))

    def run(self, requests: list[DraftRequest], k: int) -> Drafts:
        """The drafts of ``requests`` (tokens and confidence ``[len(requests), k]``): views of the graph's outputs,
        valid until the next draft of the same (bucket, k, sampled)."""
        rows = self.bucket(len(requests))
        sampled = any(r.temperature > 0 for r in requests)
        host = self.drafter.draft_inputs(requests, rows)
        graph = self._graphs.get((rows, k, sampled))
        if graph is None:
            graph = self._graphs[rows, k, sampled] = self._capture_graph(host, k, sampled)
        graph.stage(host)
        graph.replay()
        out, n = graph.outputs[0], len(requests)
        return Drafts(out.tokens[:n], out.confidence[:n])

    def _capture_graph(self, host: torch.Tensor, k: int, sampled: bool) -> _DraftGraph:
        inputs = torch.zeros(host.shape, dtype=torch.int64, device=self.device)
        out: list[Drafts] = []

        def step() -> None:
            out[:] = [self.drafter.draft_forward(inputs, k, sampled)]

        return _DraftGraph(inputs, self._staging(host.numel()), self._replayable(step), out)

    def close(self) -> None:
        self._graphs.clear()
        super().close()
