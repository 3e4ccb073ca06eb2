"""DeepSeek-V4 as a causal LM over the op table.

    streams = [embed(tokens)] * hc_mult                        # mHC residual: hc_mult streams per token
    for each layer:
        x, post, comb = hc_pre(streams)                        # collapse the streams into one input
        streams = hc_post(attention(RMSNorm(x)), streams, post, comb)
        x, post, comb = hc_pre(streams)
        streams = hc_post(moe(RMSNorm(x)), streams, post, comb)
    hidden = RMSNorm(hc_head(streams));  logits = head(hidden)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer.models.base import ForwardBatch, StateCapacity
from deepinfer.models.deepseek_v4.attention import Attention
from deepinfer.models.deepseek_v4.config import DeepseekV4Config
from deepinfer.models.deepseek_v4.layout import BuiltOnUse, RaggedLayout
from deepinfer.models.deepseek_v4.moe import MoE
from deepinfer.models.deepseek_v4.prefill_plan import PrefillPlan
from deepinfer.models.deepseek_v4.state import DeepseekV4State
from deepinfer.models.deepseek_v4.state_pool import StatePool, StateSpec, entry_rows, padded_pages, pool_bytes_for
from deepinfer.models.deepseek_v4.step import DecodePlan, DecodeStep
from deepinfer.models.deepseek_v4.weights import V4Weights
from deepinfer.ops import Ops
from deepinfer.quant import QuantizedTensor


class HyperConnection:
    """One mHC site (``<prefix>_fn`` [(2+N)N, N*D], ``_base``, ``_scale`` [3], all fp32): weights and collapse."""

    def __init__(self, ops: Ops, cfg: DeepseekV4Config, get: Callable[[str], torch.Tensor], prefix: str):
        self.ops, self.cfg = ops, cfg
        self.fn, self.base, self.scale = get(prefix + "_fn"), get(prefix + "_base"), get(prefix + "_scale")

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        return self.ops.hc_pre(
            streams, self.fn, self.base, self.scale, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
        )


class DecoderLayer:
    def __init__(self, ops: Ops, cfg: DeepseekV4Config, layer: int, get: Callable[[str], torch.Tensor]):
        p = f"layers.{layer}."
        self.ops, self.eps = ops, cfg.rms_norm_eps
        self.attn_hc = HyperConnection(ops, cfg, get, p + "hc_attn")
        self.ffn_hc = HyperConnection(ops, cfg, get, p + "hc_ffn")
        self.attn_norm, self.ffn_norm = get(p + "attn_norm.weight"), get(p + "ffn_norm.weight")
        self.attn = Attention(ops, cfg, layer, get)
        self.ffn = MoE(ops, cfg, layer, get)

    def __call__(self, streams: torch.Tensor, input_ids: torch.Tensor,
                 attend: Callable[[Attention, torch.Tensor], torch.Tensor]) -> torch.Tensor:
        """``attend(attention, x)`` runs this layer's attention on ``x`` against the step's state."""
        ops = self.ops
        x, post, comb = self.attn_hc.pre(streams)
        out = attend(self.attn, ops.rms_norm(x, self.attn_norm, self.eps))
        streams = ops.hc_post(out, streams, post, comb)
        x, post, comb = self.ffn_hc.pre(streams)
        out = self.ffn(ops.rms_norm(x, self.ffn_norm, self.eps), input_ids)
        return ops.hc_post(out, streams, post, comb)


class DeepseekV4ForCausalLM:
    """Implements :class:`deepinfer.models.base.CausalLM`.

    Quantized checkpoint tensors are dequantized (through the op table) into the compute dtype; the stored
    forms stay available in :attr:`quantized` (and the MTP layer's tensors in :attr:`mtp_weights`).
    """

    def __init__(
        self, cfg: DeepseekV4Config, weights: V4Weights, *, ops: Ops, dtype: torch.dtype, device: torch.device
    ):
        self.config, self.ops, self.dtype, self.device = cfg, ops, dtype, torch.device(device)
        self.vocab_size = cfg.vocab_size
        self.quantized = {n: t for n, t in weights.tensors.items() if isinstance(t, QuantizedTensor)}
        self.mtp_weights = weights.mtp

        def get(name: str) -> torch.Tensor:
            t = weights.tensors[name]
            return t.dequantize(ops, dtype) if isinstance(t, QuantizedTensor) else t

        self.embed = get("embed.weight")
        self.head = self.embed if cfg.tie_word_embeddings else get("head.weight")
        self.norm = get("norm.weight")
        self.hc_head = (get("hc_head_fn"), get("hc_head_base"), get("hc_head_scale"))
        self.layers = [DecoderLayer(ops, cfg, i, get) for i in range(cfg.num_hidden_layers)]
        self.pool: StatePool | None = None  # set by configure_state, or grown on demand by new_state
        self.state_spec = StateSpec.from_config(cfg)
        self._element_size = torch.empty(0, dtype=dtype).element_size()

    # --- state ----------------------------------------------------------------------------------
    def configure_state(self, max_seqs: int, capacity_bytes: int) -> StateCapacity:
        """Allocate a fixed state pool for at most ``max_seqs`` sequences within ``capacity_bytes``.  A model
        serves one engine at a time: this replaces the pool, so it is refused while sequences still hold state."""
        if self.pool is not None and self.pool.live:
            raise RuntimeError(f"this model's state pool still holds {self.pool.live} sequences (an engine is "
                               "using it); a model serves one engine at a time")
        self.pool, plan = StatePool.for_budget(self.state_spec, self.dtype, self.device, max_seqs, capacity_bytes)
        return StateCapacity(plan.admissible, plan.slots - 1)

    def state_pool_bytes(self, max_seqs: int, num_tokens: int) -> int:
        """The ``configure_state`` budget under which ``max_seqs`` sequences of ``num_tokens`` tokens all fit."""
        return pool_bytes_for(self.state_spec, self._element_size, max_seqs, num_tokens)

    def new_state(self) -> DeepseekV4State:
        if self.pool is None:  # not configured (tests, tools): a pool that grows on demand
            self.pool = StatePool.growable_pool(self.state_spec, self.dtype, self.device)
        return self.pool.new_state()

    def state_bytes(self, num_tokens: int) -> int:
        """``nbytes()`` of a state after ``num_tokens`` tokens: its slot and its pages (see :mod:`.state`)."""
        return self.state_spec.state_elems(num_tokens) * self._element_size

    # --- compute --------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; every state advances by its sequence's tokens."""
        # The engine passes back the states this model's new_state made (the contract types them as SequenceState).
        states: list[DeepseekV4State] = batch.states  # type: ignore[assignment]
        pool = states[0].pool
        if any(s.pool is not pool for s in states):
            raise ValueError("every state of a batch must come from the same state pool")
        starts = [s.num_tokens for s in states]
        for state, n in zip(states, batch.seq_lens, strict=True):
            pool.reserve(state, state.num_tokens + n)
        if all(n == 1 for n in batch.seq_lens):
            step = self._decode_step(states, pool, None, len(states))
            step = DecodeStep(batch.input_ids, batch.positions, batch.upload(step.slots),
                              {r: batch.upload(t) for r, t in step.page_tables.items()})
            hidden = self._decode(step, pool)
        else:
            layout = RaggedLayout.build(batch.seq_lens, starts, batch.upload)
            layout.entry_rows = BuiltOnUse(lambda r: self._entry_rows(states, pool, r, batch.upload))
            positions = batch.positions
            slots = [s.held_slot for s in states]
            layout.plans = BuiltOnUse(lambda r: PrefillPlan.build(layout, slots, positions, pool.spec.window, r,
                                                                  pool.entry_base, batch.upload))

            def attend(attn, x):
                return attn(x, positions, layout, states, pool, pool.layers[attn.layer])

            hidden = self._run(batch.input_ids, attend)
        for state, n in zip(states, batch.seq_lens, strict=True):
            state.num_tokens += n
        return hidden

    @staticmethod
    def _entry_rows(states: list[DeepseekV4State], pool: StatePool, ratio: int, upload) -> torch.Tensor:
        """Every sequence's page rows of its ratio-``ratio`` entries in order ([seqs, entries] on the device): one
        upload per ratio and step, not one per sequence and layer."""
        width = max(1, max(len(s.pages.get(ratio, ())) for s in states))
        return entry_rows(upload(pool.page_table(states, ratio, width)), pool.spec.page_size)

    def decode_inputs(self, states: list[DeepseekV4State], input_ids: list[int], bucket: int,
                      max_tokens: int) -> dict[str, torch.Tensor]:
        """Host tensors of a decode step padded to ``bucket`` rows (page tables wide enough for ``max_tokens``
        tokens), for :meth:`decode_forward` on static buffers.  Reserves the states' pages and advances them."""
        pool = self._configured_pool()
        for state in states:
            if state.pool is not pool:
                raise ValueError("decode_inputs: a state is not from the model's configured pool")
            pool.reserve(state, state.num_tokens + 1)
        step = self._decode_step(states, pool, max_tokens, bucket, input_ids)
        for state in states:
            state.num_tokens += 1
        return step.tensors()

    def decode_forward(self, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        """Hidden states [B, hidden] of a decode step from :meth:`decode_inputs`'s tensors on the device:
        fixed shapes and no host data, so it can be captured and replayed."""
        return self._decode(DecodeStep.from_tensors(tensors), self._configured_pool())

    def _configured_pool(self) -> StatePool:
        """The pool :meth:`configure_state` allocated: decode graphs run on its fixed tensors."""
        if self.pool is None:
            raise RuntimeError("decode_inputs / decode_forward need a state pool: call configure_state first")
        return self.pool

    def _decode_step(self, states: list[DeepseekV4State], pool: StatePool, max_tokens: int | None, rows: int,
                     input_ids: list[int] | None = None) -> DecodeStep:
        """Host-side :class:`DecodeStep` for ``states`` padded to ``rows``, built from one Python list (one
        tensor construction: this runs on the host before every replayed step)."""
        n, pad = len(states), rows - len(states)
        values = (list(input_ids) if input_ids is not None else [0] * n) + [0] * pad
        values += [s.num_tokens for s in states] + [0] * pad
        values += [s.held_slot for s in states] + [0] * pad
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
        plan = DecodePlan.build(step, pool.spec, pool.entry_base, self.config.index_topk)
        return self._run(step.input_ids, lambda attn, x: attn.decode(x, step, plan, pool, pool.layers[attn.layer]))

    def _run(self, input_ids: torch.Tensor, attend: Callable[[Attention, torch.Tensor], torch.Tensor]):
        cfg, ops = self.config, self.ops
        x = ops.embedding(input_ids, self.embed)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams, input_ids, attend)
        hidden = ops.hc_head(streams, *self.hc_head, cfg.rms_norm_eps, cfg.hc_eps)
        return ops.rms_norm(hidden, self.norm, cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(hidden, self.head).float()
