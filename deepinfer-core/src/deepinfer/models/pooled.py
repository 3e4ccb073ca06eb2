"""The engine-facing half of a model whose state lives in a :class:`~deepinfer.kv.pool.StatePool` (V4, V4.1).

State management (:meth:`configure_state`, :meth:`new_state`, :meth:`state_bytes`), the split of a step into a
ragged forward and a fixed-shape decode forward, and the host side of decode steps are the same for every such
model; a model supplies its :class:`~deepinfer.kv.spec.StateSpec`, the views it reads the pool through, and
the two forwards :meth:`_ragged` and :meth:`_decode`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from deepinfer.kv.decode_plan import DecodeStep
from deepinfer.kv.layout import BuiltOnUse, RaggedLayout
from deepinfer.kv.pool import PooledState, StatePool, entry_rows, padded_pages
from deepinfer.kv.prefix_cache import PrefixCache, block_size_for
from deepinfer.kv.ragged_plan import prefill_plan
from deepinfer.kv.rewind import PoolCheckpoint, checkpoint
from deepinfer.kv.sizing import describe_density, pool_bytes_for
from deepinfer.kv.spec import StateSpec
from deepinfer.models.base import ForwardBatch, StateCapacity

logger = logging.getLogger(__name__)


class PooledCausalLM:
    """Implements the state and step parts of :class:`~deepinfer.models.base.CausalLM` and
    :class:`~deepinfer.models.base.GraphDecodable` over a state pool.  Subclasses set :attr:`state_spec`,
    :attr:`views` (``pool -> what the layers read``), :attr:`head`, ``ops``, ``dtype`` and ``device``."""

    state_spec: StateSpec
    views: Callable[[StatePool], Any] | None = None
    pool: StatePool | None = None  # set by configure_state, or grown on demand by new_state
    dtype: torch.dtype
    device: torch.device
    head: torch.Tensor
    ops: Any
    config: Any  # num_hidden_layers, sliding_window

    @property
    def _element_size(self) -> int:
        return torch.empty(0, dtype=self.dtype).element_size()

    # --- state ----------------------------------------------------------------------------------
    def configure_state(self, max_seqs: int, capacity_bytes: int) -> StateCapacity:
        """Allocate a fixed state pool for at most ``max_seqs`` sequences within ``capacity_bytes``.  A model
        serves one engine at a time: this replaces the pool, so it is refused while sequences still hold state."""
        if self.pool is not None and self.pool.live:
            raise RuntimeError(f"this model's state pool still holds {self.pool.live} sequences (an engine is "
                               "using it); a model serves one engine at a time")
        self.pool, plan = StatePool.for_budget(self.state_spec, self.dtype, self.device, max_seqs, capacity_bytes,
                                               views=self.views)
        logger.info("state pool: %d bytes, %s", self.pool.nbytes(), describe_density(self.state_spec,
                                                                                      self._element_size))
        return StateCapacity(plan.admissible, plan.slots - 1)

    def state_pool_bytes(self, max_seqs: int, num_tokens: int, sequences: int | None = None) -> int:
        """The ``configure_state`` budget under which ``sequences`` (default ``max_seqs``) sequences of
        ``num_tokens`` tokens all fit."""
        return pool_bytes_for(self.state_spec, self._element_size, max_seqs, num_tokens, sequences)

    def new_state(self) -> PooledState:
        if self.pool is None:  # not configured (tests, tools): a pool that grows on demand
            self.pool = StatePool.growable_pool(self.state_spec, self.dtype, self.device, views=self.views)
        return self.pool.new_state()

    # --- prefix caching (deepinfer.kv.prefix_cache) ----------------------------------------------
    def new_prefix_cache(self) -> PrefixCache:
        """A prefix cache over the configured pool's pages (blocks a multiple of every compression ratio)."""
        assert self.pool is not None, "new_prefix_cache: the model has no configured state pool"
        return PrefixCache(self.pool, block_size_for(self.pool.ratios))

    @property
    def replay_lookback(self) -> int:
        """Tokens before a prefix hit to replay so that every layer's ring is exact: a layer's output at a
        position depends on ``sliding_window - 1`` positions before it in the layer below (the cached entries
        cover the rest), so ``layers`` windows cover the stack; plus the n-gram history of an Engram layer."""
        cfg = self.config
        return cfg.num_hidden_layers * (cfg.sliding_window - 1) + self._history_lookback

    _history_lookback = 0

    def replay_start(self, hit: int, needed: int) -> int:
        """Where a sequence that hit ``hit`` cached tokens starts computing (``needed``: the first position whose
        output the engine reads); 0 means the hit saves nothing."""
        return max(0, hit - self.replay_lookback)

    def state_bytes(self, num_tokens: int) -> int:
        """``nbytes()`` of a state after ``num_tokens`` tokens: its slot and its pages."""
        return self.state_spec.state_bytes(num_tokens, self._element_size)

    # --- steps ----------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; every state advances by its sequence's tokens.  A step
        of single tokens runs the decode forward (what graphs replay); any other the ragged one."""
        states: list[PooledState] = batch.states  # type: ignore[assignment]
        pool = states[0].pool
        if any(s.pool is not pool for s in states):
            raise ValueError("every state of a batch must come from the same state pool")
        starts = [s.num_tokens for s in states]
        for state, n in zip(states, batch.seq_lens, strict=True):
            pool.reserve(state, state.num_tokens + n)
        if all(n == 1 for n in batch.seq_lens):
            host = decode_step(states, pool, None, len(states))
            step = DecodeStep(batch.input_ids, batch.positions, batch.upload(host.slots),
                              {r: batch.upload(t) for r, t in host.page_tables.items()})
            hidden = self._decode(step, pool)
        else:
            hidden = self._ragged(batch, ragged_layout(batch, states, starts, pool), states, pool)
        for state, n in zip(states, batch.seq_lens, strict=True):
            state.num_tokens += n
        return hidden

    def decode_inputs(self, states: list[PooledState], input_ids: list[int], bucket: int,
                      max_tokens: int) -> dict[str, torch.Tensor]:
        """Host tensors of a decode step padded to ``bucket`` rows (page tables wide enough for ``max_tokens``
        tokens), for :meth:`decode_forward` on static buffers.  Reserves the states' pages and advances them."""
        pool = self.pool
        assert pool is not None, "decode_inputs: the model has no configured state pool"
        for state in states:
            if state.pool is not pool:
                raise ValueError("decode_inputs: a state is not from the model's configured pool")
            pool.reserve(state, state.num_tokens + 1)
        step = decode_step(states, pool, max_tokens, bucket, input_ids)
        for state in states:
            state.num_tokens += 1
        return step.tensors()

    def decode_forward(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode step from :meth:`decode_inputs`'s tensors on the device:
        fixed shapes and no host data, so it can be captured and replayed."""
        assert self.pool is not None, "decode_forward: the model has no configured state pool"
        return self._decode(DecodeStep.from_tensors(tensors), self.pool)

    def checkpoint(self, states: list[PooledState], advances: list[int],
                   upload: Callable[[torch.Tensor], torch.Tensor] | None = None) -> PoolCheckpoint:
        """Save what advancing each state by ``advances[i]`` tokens overwrites (:mod:`deepinfer.kv.rewind`)."""
        for state, n in zip(states, advances, strict=True):
            state.pool.reserve(state, state.num_tokens + n)
        return checkpoint(states, advances, upload)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(hidden, self.head).float()

    def _ragged(self, batch: ForwardBatch, layout: RaggedLayout, states: list[PooledState], pool: StatePool
                ) -> torch.Tensor:
        raise NotImplementedError

    def _decode(self, step: DecodeStep, pool: StatePool) -> torch.Tensor:
        raise NotImplementedError


def ragged_layout(batch: ForwardBatch, states: list[PooledState], starts: list[int], pool: StatePool
                  ) -> RaggedLayout:
    """The step's layout, its per-ratio entry rows and plans built on first use (one upload each)."""
    layout = RaggedLayout.build(batch.seq_lens, starts, batch.upload)
    page = pool.spec.page_size

    def entries(ratio: int) -> torch.Tensor:
        width = max(1, max(len(s.pages.get(ratio, ())) for s in states))
        return entry_rows(batch.upload(pool.page_table(states, ratio, width)), page)

    slots = [s.slot for s in states]
    cached = [s.cached_tokens for s in states]
    layout.entry_rows = BuiltOnUse(entries)
    layout.plans = BuiltOnUse(lambda r: prefill_plan(layout, slots, batch.positions, pool.spec.window, r,  # type: ignore[arg-type]
                                                     pool.entry_base(r) if r else 0, batch.upload,
                                                     cached=cached, ring=pool.spec.ring))
    return layout


def verify_step(states: list[PooledState], pool: StatePool, anchors: list[int], rows: int, q: int,
                max_tokens: int) -> DecodeStep:
    """Host-side verify step (:class:`DecodeStep` with ``starts``): ``q`` rows a sequence (its anchor, then
    ``q - 1`` rows whose ids the runner writes on the device), padded to ``rows`` sequences; page tables wide
    enough for ``max_tokens`` tokens.  Reserves each state's pages for ``q`` more tokens; advancing the states is
    the commit's (only the verifier knows how many rows a sequence keeps)."""
    if any(s.pool is not pool for s in states):
        raise ValueError("verify_step: a state is not from the model's configured pool")
    for state in states:
        pool.reserve(state, state.num_tokens + q)
    one = decode_step(states, pool, max_tokens, rows, anchors)  # a decode step of the anchors, then q rows each
    ids = torch.zeros(rows, q, dtype=torch.int64)
    ids[:, 0] = one.input_ids
    return DecodeStep(ids.flatten(), (one.positions[:, None] + torch.arange(q)).flatten(),
                      one.slots.repeat_interleave(q), {r: t.repeat_interleave(q, dim=0) for r, t in
                                                       one.page_tables.items()},
                      one.positions.repeat_interleave(q))


def decode_step(states: list[PooledState], pool: StatePool, max_tokens: int | None, rows: int,
                input_ids: list[int] | None = None) -> DecodeStep:
    """Host-side :class:`DecodeStep` for ``states`` padded to ``rows`` (page tables wide enough for
    ``max_tokens`` tokens; None: for the states' own pages), built from one Python list (one tensor
    construction: this runs on the host before every replayed step)."""
    n, pad = len(states), rows - len(states)
    values = (list(input_ids) if input_ids is not None else [0] * n) + [0] * pad
    values += [s.num_tokens for s in states] + [0] * pad
    values += [s.slot or 0 for s in states] + [0] * pad
    widths = {}
    for r in pool.ratios:
        width = pool.spec.pages_for(max_tokens, r) if max_tokens is not None else \
            max(len(s.pages.get(r, ())) for s in states)
        widths[r] = width = max(1, width)
        values += padded_pages(states, r, width) + [0] * (width * pad)
    flat = torch.tensor(values, dtype=torch.int64)
    ids, positions, slots = flat[:rows], flat[rows : 2 * rows], flat[2 * rows : 3 * rows]
    tables, offset = {}, 3 * rows
    for r, width in widths.items():
        tables[r] = flat[offset : offset + rows * width].view(rows, width)
        offset += rows * width
    return DecodeStep(ids, positions, slots, tables)
