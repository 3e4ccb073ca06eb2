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

from deepinfer.models.base import ForwardBatch
from deepinfer.models.deepseek_v4.attention import Attention
from deepinfer.models.deepseek_v4.config import CSA, SLIDING, DeepseekV4Config
from deepinfer.models.deepseek_v4.layout import RaggedLayout
from deepinfer.models.deepseek_v4.moe import MoE
from deepinfer.models.deepseek_v4.state import DeepseekV4State, entry_capacity
from deepinfer.models.deepseek_v4.weights import V4Weights
from deepinfer.ops import OpTable
from deepinfer.quant import QuantizedTensor


class HyperConnection:
    """One mHC site (``<prefix>_fn`` [(2+N)N, N*D], ``_base``, ``_scale`` [3], all fp32): weights and collapse."""

    def __init__(self, ops: OpTable, cfg: DeepseekV4Config, get: Callable[[str], torch.Tensor], prefix: str):
        self.ops, self.cfg = ops, cfg
        self.fn, self.base, self.scale = get(prefix + "_fn"), get(prefix + "_base"), get(prefix + "_scale")

    def pre(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        cfg = self.cfg
        return self.ops.hc_pre(
            streams, self.fn, self.base, self.scale, cfg.rms_norm_eps, cfg.hc_eps, cfg.hc_sinkhorn_iters
        )


class DecoderLayer:
    def __init__(self, ops: OpTable, cfg: DeepseekV4Config, layer: int, get: Callable[[str], torch.Tensor]):
        p = f"layers.{layer}."
        self.ops, self.eps = ops, cfg.rms_norm_eps
        self.attn_hc = HyperConnection(ops, cfg, get, p + "hc_attn")
        self.ffn_hc = HyperConnection(ops, cfg, get, p + "hc_ffn")
        self.attn_norm, self.ffn_norm = get(p + "attn_norm.weight"), get(p + "ffn_norm.weight")
        self.attn = Attention(ops, cfg, layer, get)
        self.ffn = MoE(ops, cfg, layer, get)

    def __call__(self, streams, input_ids, positions, layout, states) -> torch.Tensor:
        ops = self.ops
        x, post, comb = self.attn_hc.pre(streams)
        out = self.attn(ops.rms_norm(x, self.attn_norm, self.eps), positions, layout, states)
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
        self, cfg: DeepseekV4Config, weights: V4Weights, *, ops: OpTable, dtype: torch.dtype, device: torch.device
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

    # --- state ----------------------------------------------------------------------------------
    def new_state(self) -> DeepseekV4State:
        return DeepseekV4State([layer.attn.new_state(self.dtype, self.device) for layer in self.layers])

    def state_bytes(self, num_tokens: int) -> int:
        """Upper bound of ``nbytes()`` after ``num_tokens`` tokens (see :mod:`.state` for the layout)."""
        if num_tokens <= 0:
            return 0
        cfg, size = self.config, torch.empty(0, dtype=self.dtype).element_size()
        total = 0
        for kind, ratio in zip(cfg.layer_types, cfg.compress_ratios):
            total += cfg.sliding_window * cfg.head_dim
            if kind == SLIDING:
                continue
            dims = [cfg.head_dim] + ([cfg.index_head_dim] if kind == CSA else [])
            for dim in dims:
                width = 2 * dim if kind == CSA else dim
                total += 2 * (ratio - 1) * width  # unfinished window: kv and gate
                total += 2 * ratio * dim if kind == CSA else 0  # overlap: series a of the last window
                total += entry_capacity(num_tokens // ratio) * dim
        return total * size

    # --- compute --------------------------------------------------------------------------------
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        """Hidden states [T, hidden] after the final norm; every state advances by its sequence's tokens."""
        cfg, ops = self.config, self.ops
        states: list[DeepseekV4State] = batch.states  # type: ignore[assignment]
        layout = RaggedLayout.build(batch.seq_lens, [s.num_tokens for s in states], batch.upload)
        x = ops.embedding(batch.input_ids, self.embed)
        streams = x.unsqueeze(1).expand(-1, cfg.hc_mult, -1).contiguous()
        for i, layer in enumerate(self.layers):
            streams = layer(streams, batch.input_ids, batch.positions, layout, [s.layers[i] for s in states])
        for state, n in zip(states, batch.seq_lens):
            state.num_tokens += n
        hidden = ops.hc_head(streams, *self.hc_head, cfg.rms_norm_eps, cfg.hc_eps)
        return ops.rms_norm(hidden, self.norm, cfg.rms_norm_eps)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.ops.linear(hidden, self.head).float()
