"""Pure-decode steps replayed from captured graphs, one per (batch bucket, length bucket).

A decode step of a :class:`~deepinfer.models.base.GraphDecodable` model has fixed shapes once its batch is padded
to a bucket of rows and its index tensors are sized for a bucket of sequence lengths.  The first step of a
bucket captures ``model.decode_forward`` through the backend's graph service (``Backend.graph_capture``: CUDA
graphs on NVIDIA, plain re-execution on the CPU) against static input buffers; every later step copies its inputs
into those buffers (one host-to-device copy) and replays.  Capturing runs on all-padding inputs, which touch only
the state pool's null slot and page, so no sequence's state is written twice.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from deepinfer.backends import Backend
from deepinfer.models.base import CausalLM, GraphDecodable, SequenceState

logger = logging.getLogger(__name__)

class DecodableModel(CausalLM, GraphDecodable, Protocol):
    """A model whose decode steps the runner captures: the engine contract plus fixed-shape decode steps."""


#: int64 elements per 16 bytes: each static input starts at a multiple of this in the packed buffer.
_ALIGN = 2


def bucket_size(n: int, smallest: int = 1) -> int:
    """The smallest power-of-two multiple of ``smallest`` that holds ``n`` (batch and length buckets)."""
    size = smallest
    while size < n:
        size *= 2
    return size


def step_buckets(states: list[SequenceState], new_tokens: int, max_seqs: int, max_tokens: int,
                 min_tokens: int) -> tuple[int, int]:
    """(rows, tokens) a captured step adding ``new_tokens`` to each of ``states`` is padded to: a batch bucket
    within ``max_seqs``; index tensors for a length bucket from ``min_tokens``, within ``max_tokens``."""
    rows = min(bucket_size(len(states)), max_seqs)
    longest = max(s.num_tokens for s in states) + new_tokens
    return rows, min(bucket_size(longest, min_tokens), max_tokens)


@dataclass(slots=True)
class _Graph:
    flat: torch.Tensor  # every static input, packed (int64), on the device
    #: Two host copies of ``flat`` (Backend.host_buffer: pinned on CUDA), used in turn: with one step in flight
    #: (async scheduling) the copy out of one may still be queued while the next step fills the other.
    staging: tuple[torch.Tensor, torch.Tensor]
    input_ids: torch.Tensor  # the view of ``flat`` holding the step's token ids
    shapes: list[tuple[str, tuple[int, ...]]]
    pads: list[torch.Tensor]  # zeros after each input in ``flat`` (host side), so every input starts aligned
    replay: Callable[[], object]
    #: What the captured body returned (a decode step: its logits; a captured graph rewrites them in place).
    outputs: list[Any]
    turn: int = 0

    def stage(self, host: dict[str, torch.Tensor]) -> None:
        """Pack ``host`` (the step's inputs, in capture order) into the next staging buffer and queue its copy
        into ``flat``."""
        staging = self.staging[self.turn]
        self.turn ^= 1
        pieces = zip(host.values(), self.pads, strict=True)
        torch.cat([piece for t, pad in pieces for piece in (t.flatten(), pad)], out=staging)
        self.flat.copy_(staging, non_blocking=True)


class CapturedSteps:
    """What the runner's captured steps share (decode steps here, draft passes in ``draft_graphs.py``): the
    backend's graph service, pinned staging buffers, and the eager fallback once a capture fails."""

    #: What a step is, for the fallback's warning.
    WHAT = "step"

    def __init__(self, backend: Backend, device: torch.device):
        self.backend, self.device = backend, device
        #: Set when a capture failed (an op of the table synchronises with the host, say): every step then runs
        #: eagerly on the same static buffers, which is exact, only slower.
        self.eager_reason: str | None = None
        self._exit = contextlib.ExitStack()
        self._capture = self._exit.enter_context(backend.graph_capture(device))

    def _staging(self, numel: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Two host int64 buffers (pinned where the backend pins), used in turn so that a copy still queued from
        the previous step is never overwritten."""
        return self.backend.host_buffer(numel, torch.int64), self.backend.host_buffer(numel, torch.int64)

    def _replayable(self, step: Callable[[], None]) -> Callable[[], object]:
        """``step`` captured, or ``step`` itself once a capture has failed (then every later one runs eagerly)."""
        if self.eager_reason is not None:
            return step
        try:
            return self._capture(step)
        except Exception as exc:  # noqa: BLE001 - any capture failure: fall back to eager steps
            self.eager_reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
            logger.warning("capturing a %s failed (%s); %ss run eagerly from now on", self.WHAT,
                           self.eager_reason, self.WHAT)
            return step

    def _capture_static(self, host: dict[str, torch.Tensor],
                        body: Callable[[dict[str, torch.Tensor]], list[Any]]) -> _Graph:
        """A graph of ``body`` over static device buffers shaped as ``host`` (one packed int64 tensor): every
        input starts at an even int64 offset, 16-byte aligned like the buffer itself (kernels are compiled ahead
        of time for 16-byte aligned pointers, so a misaligned view would run through the JIT instead)."""
        shapes = [(name, tuple(t.shape)) for name, t in host.items()]
        sizes = [int(torch.Size(shape).numel()) for _, shape in shapes]
        pads = [torch.zeros(-n % _ALIGN, dtype=torch.int64) for n in sizes]
        flat = torch.zeros(sum(sizes) + sum(p.numel() for p in pads), dtype=torch.int64, device=self.device)
        static, offset = {}, 0
        for (name, shape), n, pad in zip(shapes, sizes, pads, strict=True):
            static[name] = flat[offset : offset + n].view(shape)
            offset += n + pad.numel()
        out: list[Any] = []

        def step() -> None:
            out[:] = body(static)

        return _Graph(flat, self._staging(flat.numel()), static["input_ids"], shapes, pads, self._replayable(step),
                      out)

    def close(self) -> None:
        self._exit.close()


class DecodeGraphs(CapturedSteps):
    """Captures and replays decode steps of ``model`` on ``backend``'s device."""

    #: Length buckets start here (index tensors for at least this many tokens per sequence).
    MIN_TOKENS = 256
    WHAT = "decode step"

    def __init__(self, model: DecodableModel, backend: Backend, device: torch.device, max_seqs: int,
                 max_tokens: int):
        super().__init__(backend, device)
        self.model = model
        self.max_seqs, self.max_tokens = max_seqs, max_tokens
        self._graphs: dict[tuple[int, int], _Graph] = {}

    def buckets(self, states: list[SequenceState]) -> tuple[int, int]:
        """(rows, tokens) a step of ``states`` is padded to."""
        return step_buckets(states, 1, self.max_seqs, self.max_tokens, self.MIN_TOKENS)

    def run(self, states: list[SequenceState], input_ids: list[int],
            feed: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        """Logits ``[len(states), vocab]`` (fp32) of one decode step, which advances the states.  The graph holds
        the whole step: forward and logits.  The inputs go through two host staging buffers per graph, in turn:
        a buffer is refilled two steps after its copy was queued, by when the caller has read the step in
        between (at most one step in flight).  ``feed`` = (rows, tokens, their rows): token ids already on the device
        (sampled by the previous step) written over ``input_ids[rows]`` before the replay."""
        rows, tokens = self.buckets(states)
        host = self.model.decode_inputs(states, input_ids, rows, tokens)
        graph = self._graphs.get((rows, tokens))
        if graph is None:
            graph = self._graphs[rows, tokens] = self._capture_graph(host)
        graph.stage(host)
        if feed is not None:
            graph.input_ids[feed[0]] = feed[1][feed[2]]
        graph.replay()
        return graph.outputs[-1][: len(states)]

    def _capture_graph(self, host: dict[str, torch.Tensor]) -> _Graph:
        return self._capture_static(host, lambda static: [self.model.compute_logits(self.model.decode_forward(static))])

    def close(self) -> None:
        self._graphs.clear()
        super().close()
