"""DeepSeek-V4.1 as a causal LM over the op table.

    streams = [embed(tokens)] * hc_mult;  pre = one-hot(stream 0)        # single-pass mHC
    for each layer:
        streams = engram(streams, n-grams)                   # Engram layers only
        x, pre', post, comb = hc_pre(streams, pre)           # collapse with the previous site's pre
        streams = hc_post(attention(RMSNorm(x)), streams, post, comb)
        x, pre, post, comb = hc_pre(streams, pre')
        streams = hc_post(moe(RMSNorm(x)), streams, post, comb)
    hidden = RMSNorm(collapse(streams, pre));  logits = head(hidden)

Attention is the causal encoder-decoder of CSA2 groups (see :mod:`.attention`, :mod:`.state`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.kv.decode_plan import DecodePlan, DecodeStep, RatioKinds
from deepinfer.kv.layout import BuiltOnUse, RaggedLayout
from deepinfer.kv.pool import StatePool, entry_rows, padded_pages
from deepinfer.kv.ragged_plan import PrefillPlan
from deepinfer.kv.sizing import pool_bytes_for
from deepinfer.kv.state import PooledState
from deepinfer.layers.mhc import HcSpec, HyperConnection
from deepinfer.layers.moe import MoE, MoESpec
from deepinfer.models.base import ForwardBatch, StateCapacity
from deepinfer.models.deepseek_v41.attention import Attention, GraphStep, RaggedStep
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.engram import Engram
from deepinfer.models.deepseek_v41.engram_hash import EngramLayout, engram_lookback, history_after
from deepinfer.models.deepseek_v41.indexer import Published
from deepinfer.models.deepseek_v41.state import Views, state_spec, views_for
from deepinfer.ops import OpTable
from deepinfer.quant import QuantizedTensor

Stored = torch.Tensor | QuantizedTensor
#: attend(attention, x, layer index) -> the attention sublayer's output
Attend = Callable[[Attention, torch.Tensor, int], torch.Tensor]


class DecoderLayer:
    def __init__(self, ops: OpTable, cfg: DeepseekV41Config, layer: int, get: Callable[[str], torch.Tensor],
                 engram: Engram | None):
        p = f"layers.{layer}."
        self.ops, self.eps, self.engram = ops, cfg.rms_norm_eps, engram
        hc = HcSpec(cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters)
        self.attn_hc = HyperConnection(ops, hc, get, p + "hc_attn")
        self.ffn_hc = HyperConnection(ops, hc, get, p + "hc_ffn")
        self.attn_norm, self.ffn_norm = get(p + "attn_norm.weight"), get(p + "ffn_norm.weight")
        self.attn = Attention(ops, cfg, cfg.layers[layer], get)
        limit = cfg.swiglu_limit if cfg.swiglu_limit > 0 else None
        moe = MoESpec(cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.routed_scaling_factor, cfg.scoring_func,
                      limit, gate_temp=cfg.gate_temp)
        self.ffn = MoE(ops, moe, p + "ffn.", get)

    def __call__(self, streams: torch.Tensor, pre: torch.Tensor, input_ids: torch.Tensor,
                 lookback: torch.Tensor | None, attend: Attend, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(streams, the FFN site's pre) after this layer; ``pre``: the previous site's."""
        ops = self.ops
        if self.engram is not None:
            assert lookback is not None
            streams = self.engram(streams, lookback)
        x, pre, post, comb = self.attn_hc.pre_single_pass(streams, pre)
        out = attend(self.attn, ops.rms_norm(x, self.attn_norm, self.eps), index)
        streams = ops.hc_post(out, streams, post, comb)
        x, pre, post, comb = self.ffn_hc.pre_single_pass(streams, pre)
        out = self.ffn(ops.rms_norm(x, self.ffn_norm, self.eps), input_ids)
        return ops.hc_post(out, streams, post, comb), pre


class DeepseekV41ForCausalLM:
    """Implements :class:`deepinfer.models.base.CausalLM` and :class:`~deepinfer.models.base.GraphDecodable`.

    ``token_map``: the Engram compressed id of every token id ([vocab] int64), derived from the tokenizer.
    Quantized checkpoint tensors are dequantized into the compute dtype, except Engram tables (gathered by
    row); the DSpark drafter's tensors (``mtp.*``) are kept in :attr:`mtp_weights`.
    """

    def __init__(self, cfg: DeepseekV41Config, tensors: dict[str, Stored], mtp: dict[str, Stored],
                 token_map: torch.Tensor | None, *, ops: OpTable, dtype: torch.dtype, device: torch.device):
        self.config, self.ops, self.dtype, self.device = cfg, ops, dtype, torch.device(device)
        self.vocab_size = cfg.vocab_size
        self.quantized = {n: t for n, t in tensors.items() if isinstance(t, QuantizedTensor)}
        self.mtp_weights = mtp

        def get(name: str) -> torch.Tensor:
            t = tensors[name]
            return t.dequantize(ops, dtype) if isinstance(t, QuantizedTensor) else t

        self.embed = get("embed.weight")
        self.head = self.embed if cfg.tie_word_embeddings else get("head.weight")
        self.norm = get("norm.weight")
        engrams: dict[int, Engram] = {}
        if cfg.engram_layer_ids:
            if token_map is None:
                raise ValueError("DeepSeek-V4.1 with Engram layers needs the tokenizer's compressed token map")
            layout = EngramLayout.from_config(cfg)
            self.token_map = token_map.to(self.device)
            self.pad_id = int(self.token_map[cfg.engram_pad_id])
            engrams = {layer: Engram(ops, layout, i, get, tensors.__getitem__, cfg.rms_norm_eps)
                       for i, layer in enumerate(cfg.engram_layer_ids)}
        self.layers = [DecoderLayer(ops, cfg, i, get, engrams.get(i)) for i in range(cfg.num_hidden_layers)]
        self.first_pre = torch.zeros(1, cfg.hc_mult, dtype=torch.float32, device=self.device)
        self.first_pre[0, 0] = 1.0  # layer 0 collapses with a one-hot pre: its input is the embedding itself
        self.state_spec = state_spec(cfg)
        self._views = views_for(cfg)
        self.pool: StatePool | None = None  # set by configure_state, or grown on demand by new_state
        self.ratio_kinds = {r: RatioKinds(indexed=True) for r in self.state_spec.paged_ratios}
        self._element_size = torch.empty(0, dtype=dtype).element_size()

    # --- state ----------------------------------------------------------------------------------
    def configure_state(self, max_seqs: int, capacity_bytes: int) -> StateCapacity:
        """Allocate a fixed state pool for at most ``max_seqs`` sequences within ``capacity_bytes``; refused
        while sequences still hold state (a model serves one engine at a time)."""
        if self.pool is not None and self.pool.live:
            raise RuntimeError(f"this model's state pool still holds {self.pool.live} sequences (an engine is "
                               "using it); a model serves one engine at a time")
        self.pool, plan = StatePool.for_budget(self.state_spec, self.dtype, self.device, max_seqs, capacity_bytes,
                                               views=self._views)
        return StateCapacity(plan.admissible, plan.slots - 1)

    def state_pool_bytes(self, max_seqs: int, num_tokens: int) -> int:
        return pool_bytes_for(self.state_spec, self._element_size, max_seqs, num_tokens)

    def new_state(self) -> PooledState:
        if self.pool is None:  # not configured (tests, tools): a pool that grows on demand
            self.pool = StatePool.growable_pool(self.state_spec, self.dtype, self.device, views=self._views)
        return self.pool.new_state()

    def state_bytes(self, num_tokens: int) -> int:
        return self.state_spec.state_bytes(num_tokens, self._element_size)

    # --- compute --------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; every state advances by its sequence's tokens."""
        states: list[PooledState] = batch.states  # type: ignore[assignment]
        pool = states[0].pool
        if any(s.pool is not pool for s in states):
            raise ValueError("every state of a batch must come from the same state pool")
        starts = [s.num_tokens for s in states]
        for state, n in zip(states, batch.seq_lens, strict=True):
            pool.reserve(state, state.num_tokens + n)
        if all(n == 1 for n in batch.seq_lens):
            host = self._decode_step(states, pool, None, len(states))
            step = DecodeStep(batch.input_ids, batch.positions, batch.upload(host.slots),
                              {r: batch.upload(t) for r, t in host.page_tables.items()})
            hidden = self._decode(step, pool)
        else:
            hidden = self._ragged(batch, states, starts, pool)
        for state, n in zip(states, batch.seq_lens, strict=True):
            state.num_tokens += n
        return hidden

    def _ragged(self, batch: ForwardBatch, states: list[PooledState], starts: list[int], pool: StatePool
                ) -> torch.Tensor:
        layout = RaggedLayout.build(batch.seq_lens, starts, batch.upload)
        slots = [s.slot for s in states]
        assert all(s is not None for s in slots)
        page = pool.spec.page_size

        def entries(r: int) -> torch.Tensor:
            width = max(1, max(len(s.pages.get(r, ())) for s in states))
            return entry_rows(batch.upload(pool.page_table(states, r, width)), page)

        layout.entry_rows = BuiltOnUse(entries)
        positions = batch.positions
        layout.plans = BuiltOnUse(lambda r: PrefillPlan.build(layout, slots, positions, pool.spec.window, r,  # type: ignore[arg-type]
                                                              pool.entry_base(r) if r else 0, batch.upload))
        step = RaggedStep(positions, layout, states, Published())
        views: Views = pool.views
        lookback = None
        if views.history is not None:
            seq_info = batch.upload(torch.tensor([slots, starts], dtype=torch.int64))[:, layout.seq_ids]
            lookback = engram_lookback(self.token_map[batch.input_ids], positions, seq_info[1],
                                       views.history[seq_info[0]], self.pad_id)
            last = torch.tensor([o + n - 1 for o, n in zip(layout.offsets, layout.lens, strict=True)])
            views.history.index_copy_(0, batch.upload(torch.tensor(slots, dtype=torch.int64)),
                                      history_after(lookback, batch.upload(last)))
        return self._run(batch.input_ids, lookback, lambda attn, x, i: attn(x, step, views.layers[i]))

    def decode_inputs(self, states: list[PooledState], input_ids: list[int], bucket: int,
                      max_tokens: int) -> dict[str, torch.Tensor]:
        """Host tensors of a decode step padded to ``bucket`` rows (page tables wide enough for ``max_tokens``
        tokens), for :meth:`decode_forward` on static buffers.  Reserves the states' pages and advances them."""
        pool = self.pool
        assert pool is not None
        for state in states:
            if state.pool is not pool:
                raise ValueError("decode_inputs: a state is not from the model's configured pool")
            pool.reserve(state, state.num_tokens + 1)
        step = self._decode_step(states, pool, max_tokens, bucket, input_ids)
        for state in states:
            state.num_tokens += 1
        return step.tensors()

    def decode_forward(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode step from :meth:`decode_inputs`'s tensors on the device."""
        assert self.pool is not None
        return self._decode(DecodeStep.from_tensors(tensors), self.pool)

    @staticmethod
    def _decode_step(states: list[PooledState], pool: StatePool, max_tokens: int | None, rows: int,
                     input_ids: list[int] | None = None) -> DecodeStep:
        """Host-side :class:`DecodeStep` for ``states`` padded to ``rows``, from one Python list."""
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

    def _decode(self, step: DecodeStep, pool: StatePool) -> torch.Tensor:
        spec, views = pool.spec, pool.views
        bases = {r: pool.entry_base(r) for r in pool.ratios}
        plan = DecodePlan.build(step, spec.window, spec.page_size, bases, self.config.index_topk, self.ratio_kinds)
        window_cols = BuiltOnUse(lambda base: torch.where(plan.window_cols >= 0, plan.window_cols + base, -1))
        window_cols[0] = plan.window_cols
        graph = GraphStep(step, plan, window_cols, Published())
        lookback = None
        if views.history is not None:
            lookback = engram_lookback(self.token_map[step.input_ids], step.positions, step.positions,
                                       views.history[step.slots], self.pad_id)
            views.history.index_copy_(0, step.slots, history_after(lookback, plan.seq_ids))

        def attend(attn: Attention, x: torch.Tensor, i: int) -> torch.Tensor:
            return attn.decode(x, graph, views.layers[i], bases.get(attn.ratio, 0))

        return self._run(step.input_ids, lookback, attend)

    def _run(self, input_ids: torch.Tensor, lookback: torch.Tensor | None, attend: Attend) -> torch.Tensor:
        cfg, ops = self.config, self.ops
        x = ops.embedding(input_ids, self.embed)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        pre = self.first_pre.expand(x.shape[0], -1)
        for i, layer in enumerate(self.layers):
            streams, pre = layer(streams, pre, input_ids, lookback, attend, i)
        return ops.rms_norm(ops.hc_collapse(streams, pre), self.norm, cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(hidden, self.head).float()
